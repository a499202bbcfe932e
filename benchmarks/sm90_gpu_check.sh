#!/usr/bin/env bash
# One device call for the sm_90a CUDA kernel: its GPU tests, compute-sanitizer, and the kernel-alone timings beside
# cuDNN, FA3 FP8 and SageAttention2 (and, with COMPARE, an earlier version of the family on the same buffers).
# Usage (on the device machine, repo root):
#   SAGE=path/to/SageAttention COMPARE=paroattn.kernels.sm90_before bash benchmarks/sm90_gpu_check.sh
# STAGES (default "tests bench sanitizer") picks stages; logs and the JSON land in $OUT (or ./out).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STAGES=${STAGES:-"tests bench sanitizer"}
SHAPES=${SHAPES:-cogvideox-5b,wan2.1-1.3b,wan2.1-14b-720p,flux.1-dev}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [[ -n ${SAGE:-} && $STAGES == *bench* ]]; then  # SageAttention2's two extensions (about 95 s) beside the tests
  for extension in _qattn_sm90 _fused; do
    python3 benchmarks/sage2_anchor.py "$SAGE" $extension > "$OUT/sage_build$extension.log" 2>&1 &
  done
fi
if [[ $STAGES == *tests* ]]; then
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
    tests/test_sm90_kernel.py -k "not sanitizer" 2>&1 | tee "$OUT/tests.log" | grep -E "rel err|passed|failed|Error|error|assert|Timeout" | tail -40
fi
wait
if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_LIMIT:-300} python3 benchmarks/sm90_kernel.py --shapes "$SHAPES" --densities 1.0,0.2 \
    ${SAGE:+--sageattention "$SAGE"} ${COMPARE:+--compare "$COMPARE"} --out "$OUT/sm90_kernel.json" 2>&1 \
    | tee "$OUT/bench.log" | tail -60
fi
if [[ $STAGES == *sanitizer* ]]; then
  timeout ${SANITIZER_LIMIT:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_sm90_kernel.py \
    -k sanitizer 2>&1 | tee "$OUT/sanitizer.log" | grep -E "ERROR SUMMARY|RACECHECK|passed|failed" | tail -10
fi
