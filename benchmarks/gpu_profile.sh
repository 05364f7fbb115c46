#!/usr/bin/env bash
# Where the fused kernel's time goes on a CUDA machine, in one call that fits a 10-minute limit
# (the 4K/d=128 targets and the d=64 backward of the 160 M model's step, docs/benchmarks.md):
#   1. benchmarks/gpu_trace.py: one forward + backward, kernel by kernel (torch.profiler), with the
#      call's wall and host time, fused (both backwards) and the SDPA baseline: is the GPU waiting
#      on the host, and which pass takes the time;
#   2. every tile of every pass timed alone at three shapes (benchmarks/gpu_tile_check.py --time):
#      one training step of gpu-small's attention (d 64, T 2048), the target shape (d 128,
#      T 4096), and d 64 at T 1024, where the backward was slower than at 2048 (2026-11-24);
#   3. if time is left, Nsight Compute on gpu-small's shape (benchmarks/gpu_ncu_driver.py, each pass
#      pinned to the autotuner's pick of 2026-11-24): speed of light, occupancy, memory workload.
# Logs go to $OUT (the device tool's folder) or runs/gpu.
#
#     bash benchmarks/gpu_profile.sh      # each shape of the trace autotunes every pass (over 60 s on an
#                                         # H100); the steps' timeouts add up to 8 minutes before ncu
set -u -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -c "import datetime, torch, triton; print(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes'),
torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt"
timeout 200 $PY benchmarks/gpu_trace.py 2>&1 | tee "$OUT/trace.md"
for shape_limit in 16,8,8,2048,64:100 4,8,8,4096,128:100 16,8,8,1024,64:80; do
    timeout "${shape_limit#*:}" $PY benchmarks/gpu_tile_check.py --no-check --time "${shape_limit%:*}" 2>&1 \
        | tee -a "$OUT/tile_times.md"
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
if [ -z "$NCU" ]; then
    echo "ncu not found: no Nsight Compute step" | tee "$OUT/ncu_d64_T2048.txt"
elif [ "$SECONDS" -gt 480 ]; then
    echo "no time left for Nsight Compute ($SECONDS s used)" | tee "$OUT/ncu_d64_T2048.txt"
else
    timeout $((570 - SECONDS)) "$NCU" -k regex:_diff_ --launch-skip 3 --launch-count 3 $SECTIONS \
        $PY benchmarks/gpu_ncu_driver.py --shape 16,8,8,2048,64 --fwd 128,64,8,3 --dkdv 32,64,4,2 --dq 64,64,4,2 \
        2>&1 | tee "$OUT/ncu_d64_T2048.txt"
fi
