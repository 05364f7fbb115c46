"""The transformers wrapper's cost over the native model: forward and greedy generation, interleaved.

Both share the same parameters (`DiffTransformerForCausalLM.from_native`), so only the plumbing
differs: transformers' generate loop and its DynamicCache against our generate and in-place cache.
The two run alternately (`common.interleaved_times`); times are medians over the rounds, and each ratio is
the median of the per-round wrapper / native time ratios with a distribution-free 95% interval (order
statistics, from 6 rounds on). The target is within 5% (ratio <= 1.05); below the table each
row's generate and forward get 'met' where the whole interval lies at or below 1.05, 'not met' where it
lies above, 'open' otherwise.

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
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import MedianInterval, interleaved_times, machine  # noqa: E402


def main() -> None:
    from difftransformer import DiffTransformerLM, get_preset
    from difftransformer.hf import DiffTransformerForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small", help="preset name(s), comma-separated (default cpu-small)")
    p.add_argument("--kinds", default="diff,transformer")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated (default 64)")
    p.add_argument("--repeats", type=int, default=9, help="rounds, both models once per round (default 9)")
    args = p.parse_args()
    if min(args.prompt, args.new_tokens, args.repeats) < 1:
        p.error("--prompt, --new-tokens and --repeats must be positive")
    print(f"# transformers wrapper vs native, {machine()}, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"batch 1, {args.repeats} rounds (ratios: median per-round wrapper / native time [95% interval])\n")
    print("| preset | kind | forward native ms | forward wrapper ms | ratio | generate native ms/token | "
          "generate wrapper ms/token | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    verdicts = []
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

        f = interleaved_times([fwd_native, fwd_wrapped], args.repeats)
        g = interleaved_times([gen_native, gen_wrapped], args.repeats)
        fr, gr = (MedianInterval.ratio(wrapped, native) for native, wrapped in (f, g))  # per-round wrapper / native
        verdicts.append((f"{preset} {kind}", gr.verdict("<=", 1.05), fr.verdict("<=", 1.05)))
        fn, fw, gn, gw = (statistics.median(t) for t in (*f, *g))
        print(f"| {preset} | {kind} | {fn * 1e3:.1f} | {fw * 1e3:.1f} | {fr.cell(3)} | {gn / n * 1e3:.2f} | "
              f"{gw / n * 1e3:.2f} | {gr.cell(3)} |", flush=True)
    print("\nWithin 5% of native (ratio <= 1.05), by the 95% interval of each ratio:")
    for label, gen, fwd in verdicts:
        print(f"- {label}: generate {gen}, forward {fwd}")


if __name__ == "__main__":
    main()
