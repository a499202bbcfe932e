#!/usr/bin/env bash
# The multi-GPU table on one host of 4 GPUs, in three phases that keep every GPU busy:
#   1. one-GPU rows, one model per GPU at a time (their outputs saved for the checks);
#   2. Ulysses 2: the models split between GPUs 0,1 and GPUs 2,3, both pairs at once;
#   3. Ulysses 4 on all four.
# Each phase compares every mode's output with the one-GPU output saved in phase 1 (--outputs).
#
#   bash benchmarks/multi_gpu_table.sh                     # every family
#   MODELS="wan-14b-720p cogvideox-5b" bash benchmarks/multi_gpu_table.sh
#   SMOKE=1 bash benchmarks/multi_gpu_table.sh             # the shrunk Wan on the CPU, 2 gloo processes (a check)
#
# Results: $OUT (default ./multi-gpu-results): one-*.json, two-*.json, four.json and a log; the table of each:
# python3 benchmarks/multi_gpu.py --table FILE. Other models' steps run beside a phase's on the other GPUs: the
# one-GPU rows of a phase share the host, not a GPU. ITERS (default 1) timed steps per mode.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-multi-gpu-results}"
MODES="paro d=0.2 int8+fp8,paro d=0.2 int8+fp8 balanced,paro d=0.2 int8+fp8 pipelined"
ITERS="${ITERS:-1}"
LOG="$OUT/multi_gpu_table.log"
mkdir -p "$OUT/outputs"
export PYTHONUNBUFFERED=1
if [ -n "${SMOKE:-}" ]; then
    read -r -a models <<< "${MODELS:-wan-1.3b}"
    extra=(--smoke)
    gpus=2
else
    # longest first, so the phases end together
    read -r -a models <<< "${MODELS:-hunyuanvideo-720p hunyuanvideo-1.5-720p skyreels-v2-720p wan-14b-720p wan-vace-14b cogvideox-5b wan-1.3b}"
    extra=()
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
    if [ "$gpus" -lt 4 ]; then
        echo "this table needs 4 GPUs of one host; this one has $gpus" >&2
        exit 2
    fi
fi

FAILED="$OUT/failed.txt"  # one line per run that failed (runs in the background cannot hand back a status)
rm -f "$FAILED"
failed() { echo "$1 failed: see $LOG" | tee -a "$FAILED" >&2; }

one_gpu() {  # GPU, models (comma-separated), results file
    CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/multi_gpu.py "${extra[@]}" --models "$2" --iters "$ITERS" \
        --modes "$MODES" --outputs "$OUT/outputs" --out "$OUT/$3" 2>&1 | sed -u "s/^/[$3] /" >> "$LOG" || failed "$3"
}

ulysses() {  # GPUs, port, N, models, results file
    CUDA_VISIBLE_DEVICES=$1 torchrun --nproc-per-node "$3" --master-port "$2" benchmarks/multi_gpu.py "${extra[@]}" \
        --models "$4" --iters "$ITERS" --modes "$MODES" --outputs "$OUT/outputs" --baseline "$OUT"/one-*.json \
        --out "$OUT/$5" 2>&1 | sed -u "s/^/[$5] /" >> "$LOG" || failed "$5"
}

# phase 1: model i on GPU i mod 4 (on the CPU: one after the other)
lanes=4
[ -n "${SMOKE:-}" ] && lanes=1
for lane in $(seq 0 $((lanes - 1))); do
    mine=()
    for i in "${!models[@]}"; do
        [ $((i % lanes)) -eq "$lane" ] && mine+=("${models[$i]}")
    done
    [ ${#mine[@]} -gt 0 ] && one_gpu "$lane" "$(IFS=,; echo "${mine[*]}")" "one-$lane.json" &
done
wait
echo "one GPU: done" | tee -a "$LOG"

# phase 2: alternate models between the two pairs of GPUs
if [ -n "${SMOKE:-}" ]; then
    ulysses "" 29511 2 "$(IFS=,; echo "${models[*]}")" two-a.json
else
    pair_a=() pair_b=()
    for i in "${!models[@]}"; do
        if [ $((i % 2)) -eq 0 ]; then pair_a+=("${models[$i]}"); else pair_b+=("${models[$i]}"); fi
    done
    ulysses 0,1 29511 2 "$(IFS=,; echo "${pair_a[*]}")" two-a.json &
    [ ${#pair_b[@]} -gt 0 ] && ulysses 2,3 29512 2 "$(IFS=,; echo "${pair_b[*]}")" two-b.json &
    wait
fi
echo "Ulysses 2: done" | tee -a "$LOG"

# phase 3
if [ -z "${SMOKE:-}" ]; then
    ulysses 0,1,2,3 29513 4 "$(IFS=,; echo "${models[*]}")" four.json
    echo "Ulysses 4: done" | tee -a "$LOG"
fi
for file in "$OUT"/two-*.json "$OUT"/four.json; do
    if [ -f "$file" ]; then
        python3 benchmarks/multi_gpu.py --table "$file"
    fi
done
if [ -f "$FAILED" ]; then
    exit 1
fi
