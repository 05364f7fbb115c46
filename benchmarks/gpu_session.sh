#!/usr/bin/env bash
# The fused kernel's speed on a CUDA machine, in one call that fits a 10-minute limit:
#   1. benchmarks/attention_gpu.py: fused vs two-call vs four-call vs matched SDPA baseline (it
#      first checks the fused kernel against an fp32 reference and marks its rows if that fails;
#      rows print as measured, and no new shape starts after 260 s);
#   2. the kernel's GPU tests (bf16 at training-like lengths, both backwards, d 64 and 128).
# Its correctness tile by tile and the whole test suite on the GPU: benchmarks/gpu_tests.sh; the
# end-to-end 160 M pair: benchmarks/gpu_e2e.sh. Logs and the table go to $OUT (the device tool's
# folder) or runs/gpu. Uses the machine's own python3 with PyTorch and Triton; the package is read
# from src/.
#
#     bash benchmarks/gpu_session.sh                 # about 7 minutes on an H100 (2026-11-24)
#     bash benchmarks/gpu_session.sh --non-causal    # arguments go to attention_gpu.py
set -u -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

$PY - <<'PY' 2>&1 | tee "$OUT/env.txt"
import datetime, torch, triton
print(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
      torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
PY
timeout 320 $PY benchmarks/attention_gpu.py --time-limit 260 "$@" 2>&1 | tee "$OUT/attention_gpu.md"
# Each test autotunes its pass's tiles (the d = 128 one-pass test alone took over 40 s on an H100).
timeout 200 $PY -m pytest -q -p no:cacheprovider -rfE --tb=short tests/kernels/test_diff_flash.py -m gpu 2>&1 \
    | tee "$OUT/triton_tests.log"
