#!/usr/bin/env bash
# Where the fused kernel's time goes on a CUDA machine, in one call that fits a 10-minute limit
# (issue 16, item 2: the 4K/d=128 targets and the d=64 backward that costs the 159 M model 8%):
#   1. every tile of every pass timed alone at three shapes (benchmarks/gpu_tile_check.py --time):
#      one training step of gpu-small's attention (d 64, T 2048), the target shape (d 128,
#      T 4096), and d 64 at T 1024, where the backward was slower than at 2048 (2026-11-24);
#   2. Nsight Compute on the autotuner's picks of 2026-11-24 (benchmarks/gpu_ncu_driver.py): speed of
#      light, occupancy, launch statistics and the memory workload of each pass.
# Logs go to $OUT (the device tool's folder) or runs/gpu.
#
#     bash benchmarks/gpu_profile.sh
set -u -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
for shape in 16,8,8,2048,64 4,8,8,4096,128 16,8,8,1024,64; do
    timeout 110 $PY benchmarks/gpu_tile_check.py --no-check --time "$shape" 2>&1 \
        | tee -a "$OUT/tile_times.md"
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
if [ -n "$NCU" ]; then
    timeout 120 "$NCU" -k regex:_diff_ --launch-skip 3 --launch-count 3 $SECTIONS \
        $PY benchmarks/gpu_ncu_driver.py --shape 16,8,8,2048,64 --fwd 128,64,8,3 --dkdv 32,64,4,2 --dq 64,64,4,2 \
        2>&1 | tee "$OUT/ncu_d64_T2048.txt"
    timeout 120 "$NCU" -k regex:_diff_ --launch-skip 3 --launch-count 3 $SECTIONS \
        $PY benchmarks/gpu_ncu_driver.py --shape 4,8,8,4096,128 --fwd 64,64,8,2 --dkdv 128,32,8,2 --dq 128,32,8,2 \
        2>&1 | tee "$OUT/ncu_d128_T4096.txt"
else
    echo "ncu not found: no Nsight Compute step" | tee "$OUT/ncu_d64_T2048.txt"
fi
