#!/usr/bin/env bash
# Decoding from CUDA graphs on one GPU, in one call that fits a 10-minute limit (about 5 minutes on an H100):
#   1. the static-cache decoding tests, CPU and CUDA ones (greedy tokens of the graph path equal the eager
#      path's in fp32; in bf16 up to a late near tie), generate's and the transformers wrapper's loop tests, and
#      the Triton decoding kernel's CUDA tests (the step's DIFF attention in bf16);
#   2. benchmarks/decode.py at gpu-small in bf16, prompts 512 and 2048, batch 1 and 8, 128 new tokens: both
#      kinds decoding from a CUDA graph and on the growing cache, interleaved round by round (tokens/s, the
#      graph/dynamic speed-up per kind, DIFF/T per decoder, the warm-up round's capture cost and token check),
#      then the kernels of 20 static-cache steps of each kind at 2048 x 8 (what the graph replays);
#   3. the same check in fp32 at one row, where rounding cannot flip a greedy token;
#   4. benchmarks/decode_attention_gpu.py: one masked decoding step's attention, T on SDPA, DIFF on its SDPA route
#      and on the Triton decoding kernel, each replayed from CUDA graphs.
# Logs go to $OUT (the device tool's folder) or runs/gpu.
#
#     bash benchmarks/gpu_decode.sh
set -u -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1
PY=${PYTHON:-python3}
$PY -c "import datetime, torch, triton; print(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes'),
torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt"
echo "commit ${COMMIT:-unknown}" | tee -a "$OUT/env.txt"
T="$PY -m pytest -q -p no:cacheprovider -rfE --tb=short"
timeout 150 $T tests/model/test_static_decode.py tests/model/test_generation.py tests/hf/test_generation.py 2>&1 \
    | tee "$OUT/decode_tests.log"
timeout 60 $T -m gpu tests/kernels/test_diff_decode.py 2>&1 | tee -a "$OUT/decode_tests.log"
timeout 270 $PY benchmarks/decode.py --device cuda --preset gpu-small --precision bf16 --prompts 512 2048 \
    --batch 1 8 --new-tokens 128 --repeats 6 --trace 20 2>&1 | tee "$OUT/decode_graph.md"
timeout 80 $PY benchmarks/decode.py --device cuda --preset gpu-small --precision fp32 --prompts 512 --batch 8 \
    --new-tokens 64 --repeats 2 2>&1 | tee "$OUT/decode_graph_fp32.md"
timeout 60 $PY benchmarks/decode_attention_gpu.py --repeats 9 2>&1 | tee "$OUT/decode_attention_gpu.md"
