#!/usr/bin/env bash
# fp8 linear layers beside PARO on one GPU (sm_89 or newer): the GPU tests, the demo model's quality rows and
# the compiled step table with a profiled split of each row. One part per call (each fits in 10 minutes):
#
#   bash benchmarks/fp8_linear_gpu.sh tests                 # tests/test_linear.py, GPU tests and torchao on the CPU
#   bash benchmarks/fp8_linear_gpu.sh quality               # QUALITY.md rows: fp8 linear alone, with PARO d=0.5, 0.2
#   bash benchmarks/fp8_linear_gpu.sh step MODEL WHICH      # e2e.py --compile fullgraph --profile, one model:
#        WHICH: bf16 (dense, PARO d=0.2 int8+fp8), fp8 (the same two with fp8 linear layers), or one mode:
#        dense, dense-fp8, paro, paro-fp8 (HunyuanVideo 720p's four modes: about 8 minutes regional on an H200)
#        MODEL: wan (Wan2.1-1.3B), wan-14b-720p, cogvideox, hunyuan, flux
#        HOW=regional compiles each block on its own (a fraction of fullgraph's compile time), HOW=reduce-overhead
#        the whole transformer under CUDA graphs; default fullgraph
#   HOW=regional bash benchmarks/fp8_linear_gpu.sh table  # every model's four modes, the models spread over the
#        host's GPUs (one process per GPU at a time, longest first), each model's log and JSON in $OUT
#
# Wheels (diffusers, torchao, ...) are installed from $WHEELS (default .whl) into /tmp/site when missing there.
# Results go to $OUT (default ./fp8-linear-results); the last lines printed are a short table of this call's
# results. Tables over several calls, anywhere (no GPU): python3 benchmarks/e2e.py --table FILES --merge
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-fp8-linear-results}"
HOW="${HOW:-fullgraph}"  # the step's compile setting (benchmarks/e2e.py --compile): fullgraph, regional or reduce-overhead
WHEELS="${WHEELS:-.whl}"
mkdir -p "$OUT"
if [ ! -d /tmp/site/torchao ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, torchao, diffusers; print('torch', torch.__version__, 'torchao', torchao.__version__, \
'diffusers', diffusers.__version__, 'capability', torch.cuda.get_device_capability())" 2>&1 | tail -1

part="${1:?pass tests, quality or step MODEL WHICH}"
case "$part" in
tests)
    # the GPU tests and, with torchao installed, the CPU tests that run its real quantization
    python3 -m pytest -q -s -m "gpu or not gpu" tests/test_linear.py > "$OUT/tests.log" 2>&1
    status=$?
    grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | tail -20
    grep -E "^(fullgraph|reduce-overhead) plan=" "$OUT/tests.log"
    tail -1 "$OUT/tests.log"
    exit $status
    ;;
quality)
    python3 scripts/demo_model_quality.py --out "$OUT/quality-fp8-linear" \
        --grid "1:bf16:fp8 linear" --grid "0.5,0.2:int8fp8:calibrated,fp8 linear" > "$OUT/quality.log" 2>&1
    status=$?
    tail -12 "$OUT/quality.log"
    cat "$OUT/quality-fp8-linear/quality_table.md"
    exit $status
    ;;
step)
    model="${2:?pass a model: wan, wan-14b-720p, cogvideox, hunyuan, flux}"
    case "${3:?pass all, bf16, fp8, dense, dense-fp8, paro or paro-fp8}" in
        all) modes="dense,dense + fp8 linear,paro d=0.2 int8+fp8,paro d=0.2 int8+fp8 + fp8 linear" ;;
        bf16) modes="dense,paro d=0.2 int8+fp8" ;;
        fp8) modes="dense + fp8 linear,paro d=0.2 int8+fp8 + fp8 linear" ;;
        dense) modes="dense" ;;
        dense-fp8) modes="dense + fp8 linear" ;;
        paro) modes="paro d=0.2 int8+fp8" ;;
        paro-fp8) modes="paro d=0.2 int8+fp8 + fp8 linear" ;;
        *) echo "pass all, bf16, fp8, dense, dense-fp8, paro or paro-fp8, not $3" >&2; exit 2 ;;
    esac
    json="$OUT/e2e-fp8-linear-$model-$3-$HOW.json"
    # 128-query blocks: the kernels' fast tiles at head dim 128 (CogVideoX's 64: its own 64 x 64 is used below)
    query_block=128
    [ "$model" = cogvideox ] && query_block=64
    python3 benchmarks/e2e.py --models "$model" --compile "$HOW" --linear fp8 --modes "$modes" --profile \
        --no-eager --iters 2 --query-block "$query_block" --json "$json" > "$OUT/e2e-$model-$3.log" 2>&1
    status=$?
    grep -E "^\[|^  |Error" "$OUT/e2e-$model-$3.log" | tail -20
    python3 benchmarks/e2e.py --table "$json"
    exit $status
    ;;
table)
    export OUT HOW WHEELS
    models=(hunyuan wan-14b-720p cogvideox wan flux)  # longest first
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
    for lane in $(seq 0 $((gpus - 1))); do
        (
            for i in "${!models[@]}"; do
                # back and forth over the GPUs: the second round's longest joins the first round's shortest
                round=$((i / gpus)) slot=$((i % gpus))
                [ $((round % 2)) -eq 1 ] && slot=$((gpus - 1 - slot))
                if [ "$slot" -eq "$lane" ]; then
                    CUDA_VISIBLE_DEVICES=$lane bash "$PWD/benchmarks/fp8_linear_gpu.sh" step "${models[$i]}" all > "$OUT/lane-$lane-${models[$i]}.log" 2>&1
                fi
            done
        ) &
    done
    wait
    python3 benchmarks/e2e.py --table "$OUT"/e2e-fp8-linear-*-all-"$HOW".json --merge
    ;;
*)
    echo "unknown part $part: pass tests, quality, step MODEL WHICH or table" >&2
    exit 2
    ;;
esac
