#!/usr/bin/env bash
# One device call: kernel tests on the GPU, GPU tests at real shapes, then the benchmark.
# Usage (on the device machine, repo root): bash benchmarks/gpu_check.sh [benchmark options...]
# Logs and the JSON land in $OUT (or ./out). Each stage has its own time limit.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
STAGES=${STAGES:-"unit gpu bench"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $STAGES == *unit* ]]; then
  timeout ${UNIT_LIMIT:-150} python3 -m pytest -q -x -p no:cacheprovider -m "gpu or not gpu" tests/test_kernels.py tests/test_index_math.py 2>&1 | tee "$OUT/unit.log" | tail -15
fi
if [[ $STAGES == *gpu* ]]; then
  timeout ${GPU_LIMIT:-200} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_kernels_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "rel err|passed|failed|Error|error|assert" | tail -40
fi
if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_LIMIT:-300} python3 benchmarks/attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -140
fi
