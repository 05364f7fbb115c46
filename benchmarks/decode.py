"""Decoding speed: DIFF LM vs its matched Transformer LM, prefill and greedy decode timed apart.

For each prompt length and batch size, both models (same size spec, same backend) prefill a random
prompt into a KV cache, then decode new tokens one at a time (greedy, cached), alternating in one
process so machine load hits both alike; medians over repeats. Decode time is the median of a
prefill-and-decode run less the median prefill. Prints a Markdown table with the DIFF/Transformer
ratios (decode: tokens/s ratio, higher is better for DIFF; prefill: time ratio).

    python benchmarks/decode.py                                   # cpu-small, prompts 64 512 2048, batch 1
    python benchmarks/decode.py --prompts 64 2048 --batch 8 --backend sdpa --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_medians, machine  # noqa: E402


def _model(preset: str, attention: str, backend: str, context: int):
    from difftransformer import DiffTransformerLM, get_preset

    torch.manual_seed(0)
    return DiffTransformerLM(get_preset(preset).config(attention, attn_backend=backend,
                                                       max_position_embeddings=context)).eval()


def _runs(model, prompt: torch.Tensor, new_tokens: int):
    """(prefill, decode) callables: the prompt into a fresh cache; then new_tokens single-token steps."""
    from difftransformer import KVCache

    @torch.no_grad()
    def prefill():
        cache = KVCache(capacity=prompt.shape[1] + new_tokens)
        return model(prompt, kv_cache=cache).logits[:, -1].argmax(-1, keepdim=True), cache

    @torch.no_grad()
    def decode():
        nxt, cache = prefill()
        for _ in range(new_tokens):
            nxt = model(nxt, kv_cache=cache).logits[:, -1].argmax(-1, keepdim=True)

    return (lambda: prefill()), decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2048], help="prompt lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--backend", default="auto", choices=["auto", "cpp", "sdpa", "eager"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    context = max(args.prompts) + args.new_tokens + 1
    models = [_model(args.preset, kind, args.backend, context) for kind in ("transformer", "diff")]
    print(f"# Greedy decoding, {args.preset}, batch {args.batch}, {args.new_tokens} new tokens, backend "
          f"{args.backend} ({machine()})\n")
    print("| prompt | Transformer prefill ms | DIFF prefill ms | prefill time ratio | Transformer decode tok/s | "
          "DIFF decode tok/s | decode tok/s ratio |")
    print("|---|---|---|---|---|---|---|")
    for T in args.prompts:
        prompt = torch.randint(0, models[0].config.vocab_size, (args.batch, T),
                               generator=torch.Generator().manual_seed(T))
        (pre_t, dec_t), (pre_d, dec_d) = (_runs(m, prompt, args.new_tokens) for m in models)
        tp, dp = interleaved_medians([pre_t, pre_d], args.repeats)
        td, dd = interleaved_medians([dec_t, dec_d], args.repeats)
        rate_t, rate_d = (args.batch * args.new_tokens / max(total - pre, 1e-9)
                          for total, pre in ((td, tp), (dd, dp)))
        print(f"| {T} | {tp * 1e3:.1f} | {dp * 1e3:.1f} | {dp / tp:.2f} | {rate_t:,.0f} | {rate_d:,.0f} | "
              f"{rate_d / rate_t:.2f} |", flush=True)


if __name__ == "__main__":
    main()
