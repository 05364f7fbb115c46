#!/usr/bin/env bash
# The fused Triton kernel's correctness on a CUDA machine, in one call that fits a 10-minute limit:
#   1. benchmarks/gpu_tile_check.py: every tile of every pass alone against fp32 explicit maps
#      (the layer's autotuner may pick any of them on another GPU or length);
#   2. the kernel's GPU tests, the layer tests of the 'triton' backend, and the kernel's whole
#      interpreter suite compiled for the GPU, 8 processes at a time (pytest-xdist is in the GPU
#      image; it compiles many small specialisations).
# Logs go to $OUT (the device tool's folder) or runs/gpu.
#
#     bash benchmarks/gpu_tests.sh                   # about 8 minutes on an H100 (2026-11-24 timings)
set -u -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T="$PY -m pytest -q -p no:cacheprovider -rfE --tb=short"
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 210 $PY benchmarks/gpu_tile_check.py --time-limit 180 2>&1 | tee "$OUT/tiles.md"
timeout 140 $T $XDIST tests/kernels/test_diff_flash.py tests/attention/test_layers.py -k "gpu or triton" 2>&1 \
    | tee "$OUT/gpu_tests.log"
timeout 230 $T $XDIST tests/kernels/test_diff_flash.py -m "not gpu" 2>&1 | tee "$OUT/kernel_tests.log"
