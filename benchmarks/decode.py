"""Decoding speed: DIFF LM vs its matched Transformer LM on each attention backend, and transformers' Llama.

For each prompt length and batch size, every arm generates greedily from a random prompt with its
KV cache (`generate(..., temperature=0)`; for Llama, transformers' `generate(do_sample=False,
use_cache=True)`), once for 1 new token and once for new_tokens. The arms run alternately in one
process, so machine load hits all alike; figures are medians over repeats. Prefill ms is the
1-token call (the prompt's forward into a fresh cache: time to first token); decode tokens/s is
batch * (new_tokens - 1) / (new_tokens call - 1-token call), the rate of the single-token steps.
Timing whole generate calls of every arm, transformers' included, measures what a user gets, with
each library's own prefill (both compute only the last position's logits there).

Arms: the Transformer and DIFF on the fused C++ kernel (`cpp`, what 'auto' picks on CPU) and on
PyTorch's SDPA (`sdpa`); "best" is an arm's faster backend. `Llama (HF)` is transformers'
LlamaForCausalLM with the Transformer arm's sizes (hidden, layers, heads, kv heads, FFN, vocab,
RoPE theta, tied embeddings), random weights, fp32, its default attention; "-" when transformers
is not installed. The models are built with a context of the longest prompt plus the new tokens
(the presets' own max_position_embeddings is shorter than the long prompts).

Ratios: DIFF/T decode is DIFF's tokens/s over the Transformer's (higher is better for DIFF), at each
arm's best backend and on the same backend; prefill DIFF/T is a time ratio (lower is better for
DIFF); T cpp/sdpa compares our kernel's Transformer decode with SDPA's; ours/Llama is the best of
our two models' decode over Llama's.

    python benchmarks/decode.py                                          # the full table
    python benchmarks/decode.py --prompts 64 512 --batch 1 --new-tokens 16 --repeats 1   # quick
    python benchmarks/decode.py --threads 1        # one thread: steadier on a shared machine
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_medians, machine  # noqa: E402

BACKENDS = ("cpp", "sdpa")
KINDS = (("transformer", "T"), ("diff", "DIFF"))


@dataclass
class Arm:
    name: str
    generate: Callable[[torch.Tensor, int], object]  # (prompt, n) -> greedy generation of n new tokens


def _ours(preset: str, kind: str, backend: str, context: int) -> Arm:
    from difftransformer import DiffTransformerLM, get_preset

    torch.manual_seed(0)
    model = DiffTransformerLM(get_preset(preset).config(kind, attn_backend=backend,
                                                        max_position_embeddings=context)).eval()

    def generate(prompt, n):
        return model.generate(prompt, n, temperature=0)

    return Arm(f"{dict(KINDS)[kind]} {backend}", generate)


def _llama(preset: str, context: int) -> Arm | None:
    """transformers' LlamaForCausalLM with the Transformer arm's sizes; None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    from difftransformer import get_preset

    transformers.logging.set_verbosity_error()
    c = get_preset(preset).config("transformer", max_position_embeddings=context)
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads or c.num_attention_heads, max_position_embeddings=context,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=False, mlp_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    @torch.no_grad()
    def generate(prompt, n):
        # min_new_tokens: never stop early at a random eos, so every arm makes the same number of tokens
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)

    return Arm("Llama (HF)", generate)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def _row(T: int, B: int, arms: list[Arm], repeats: int, new_tokens: int) -> str:
    prompt = torch.randint(3, 512, (B, T), generator=torch.Generator().manual_seed(T * 131 + B))
    pre = dict(zip((a.name for a in arms), interleaved_medians([lambda a=a: a.generate(prompt, 1) for a in arms],
                                                              repeats)))
    gen = dict(zip((a.name for a in arms),
                   interleaved_medians([lambda a=a: a.generate(prompt, new_tokens) for a in arms], repeats)))
    # None when noise made the median generate no slower than the median prefill (nothing to divide)
    rate = {n: B * (new_tokens - 1) / (gen[n] - pre[n]) if gen[n] > pre[n] else None for n in pre}
    names = [f"{k} {b}" for _, k in KINDS for b in BACKENDS]
    best_rate = {k: max((rate[f"{k} {b}"] for b in BACKENDS if rate.get(f"{k} {b}") is not None), default=None)
                 for _, k in KINDS}
    best_pre = {k: min((pre[f"{k} {b}"] for b in BACKENDS if f"{k} {b}" in pre), default=None) for _, k in KINDS}
    llama = "Llama (HF)"
    ours_best = max((r for r in best_rate.values() if r is not None), default=None)
    cells = [str(T), str(B)]
    cells += [_fmt(None if pre.get(n) is None else pre[n] * 1e3, ".1f") for n in names + [llama]]
    cells += [_ratio(best_pre["DIFF"], best_pre["T"])]
    cells += [_fmt(rate.get(n), ",.0f") for n in names + [llama]]
    cells += [_ratio(best_rate["DIFF"], best_rate["T"])]
    cells += [_ratio(rate.get(f"DIFF {b}"), rate.get(f"T {b}")) for b in BACKENDS]
    cells += [_ratio(rate.get("T cpp"), rate.get("T sdpa")), _ratio(ours_best, rate.get(llama))]
    return "| " + " | ".join(cells) + " |"


def _header() -> str:
    names = [f"{k} {b}" for _, k in KINDS for b in BACKENDS] + ["Llama (HF)"]
    cols = ["prompt", "batch", *(f"prefill ms {n}" for n in names), "prefill DIFF/T (best)",
            *(f"decode tok/s {n}" for n in names), "decode DIFF/T (best)",
            *(f"decode DIFF/T {b}" for b in BACKENDS), "decode T cpp/sdpa", "decode ours/Llama"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2048, 4096], help="prompt lengths")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (at least 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per arm (medians); one warm-up run first")
    p.add_argument("--no-llama", action="store_true", help="leave out transformers' Llama")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for every arm (default: PyTorch's own choice)")
    args = p.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be positive; got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be at least 2 (one prefill, then decoding steps); got {args.new_tokens}")
    if min(args.prompts) < 1 or min(args.batch) < 1 or args.repeats < 1:
        p.error("--prompts, --batch and --repeats must be positive")
    from difftransformer.kernels import flash_cpu

    context = max(args.prompts) + args.new_tokens + 1
    backends = [b for b in BACKENDS if b != "cpp" or flash_cpu.is_available()]
    arms = [_ours(args.preset, kind, b, context) for kind, _ in KINDS for b in backends]
    llama = None if args.no_llama else _llama(args.preset, context)
    arms += [llama] if llama is not None else []
    print(f"# Greedy decoding, {args.preset}, {args.new_tokens} new tokens, medians of {args.repeats} "
          f"({machine()}){'' if 'cpp' in backends else '; cpp kernel unavailable: ' + str(flash_cpu.build_error())}"
          f"\n")
    print(_header(), flush=True)
    for T in args.prompts:
        for B in args.batch:
            print(_row(T, B, arms, args.repeats, args.new_tokens), flush=True)


if __name__ == "__main__":
    main()
