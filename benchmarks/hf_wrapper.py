"""The transformers wrapper's cost over the native model: forward and greedy generation, interleaved.

Both share the same parameters (`DiffTransformerForCausalLM.from_native`), so only the plumbing
differs: transformers' generate loop and its DynamicCache against our generate and in-place cache.
Medians of interleaved repeats; prints a Markdown table with wrapper / native time ratios.
The issue's target: within 5% (ratio <= 1.05).

    python benchmarks/hf_wrapper.py                       # cpu-small, diff and transformer
    python benchmarks/hf_wrapper.py --preset cpu-small,cpu-medium,gpu-small   # how the ratio falls with size
    python benchmarks/hf_wrapper.py --preset tiny --new-tokens 32

transformers' generate loop costs ~0.07-0.1 ms per token more than ours at 5 M parameters on a 2-core Xeon
(its logits copy, processors, stopping criteria and stop check, measured with a forward stub and in the
model): a larger share of a small model's step than of a large one's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_medians, machine  # noqa: E402


def main() -> None:
    from difftransformer import DiffTransformerLM, get_preset
    from difftransformer.hf import DiffTransformerForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small", help="preset name(s), comma-separated (default cpu-small)")
    p.add_argument("--kinds", default="diff,transformer")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated (default 64)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"# transformers wrapper vs native, {machine()}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, batch 1, median of {args.repeats}\n")
    print("| preset | kind | forward native ms | forward wrapper ms | ratio | generate native ms/token | "
          "generate wrapper ms/token | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, kind in [(p_, k) for p_ in args.preset.split(",") for k in args.kinds.split(",")]:
        torch.manual_seed(0)
        native = DiffTransformerLM(get_preset(preset).config(kind)).eval()
        wrapped = DiffTransformerForCausalLM.from_native(native).eval()
        ids = torch.randint(0, native.config.vocab_size, (1, args.prompt))
        n = args.new_tokens

        @torch.no_grad()
        def fwd_native():
            native(ids)

        @torch.no_grad()
        def fwd_wrapped():
            wrapped(input_ids=ids, use_cache=False)

        # Neither model has an EOS id (from_native sets none), so both generate exactly n tokens; checked
        # below. (min_new_tokens would add a logits processor to transformers' loop that ours lacks.)
        @torch.no_grad()
        def gen_native():
            return native.generate(ids, n, temperature=0.0)

        @torch.no_grad()
        def gen_wrapped():
            return wrapped.generate(ids, max_new_tokens=n, do_sample=False)

        if not torch.equal(gen_native(), gen_wrapped()) or gen_native().shape[1] != args.prompt + n:
            raise SystemExit(f"{kind}: the wrapper's greedy tokens differ from the native model's")

        f = interleaved_medians([fwd_native, fwd_wrapped], args.repeats)
        g = interleaved_medians([gen_native, gen_wrapped], args.repeats)
        print(f"| {preset} | {kind} | {f[0] * 1e3:.1f} | {f[1] * 1e3:.1f} | {f[1] / f[0]:.3f} | {g[0] / n * 1e3:.2f} | "
              f"{g[1] / n * 1e3:.2f} | {g[1] / g[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
