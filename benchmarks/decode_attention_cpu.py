"""One decoding step of attention on CPU: DIFF and the matched Transformer, our fused kernel against SDPA.

What a layer computes per generated token: one query row per head against S cached keys, read from
views of a KV cache preallocated longer than S (as `KVCache` holds them). Both kinds have the same
width: DIFF h heads of 2 x d (q/k (B, 2h, 1, d), v (B, h, S, 2d), the head norm fused as the layer
runs it), the Transformer 2h heads of d. Calls go through the public functions
(`differential_attention`, `multihead_attention`) under `torch.no_grad`, so the Python route a
model takes is timed with the kernel. Every call of a row runs once per round, alternately
(`common.interleaved_times`); figures are medians over rounds of the mean time of `--calls`
back-to-back calls, ratios are medians of per-round ratios with a 95% interval from 6 rounds on.

Columns: µs per call of T on `cpp` and on `sdpa`, DIFF on `cpp` (DIFF on SDPA pads q/k to v's dim
and runs two calls: see benchmarks/decode.py for whole models); `T cpp/sdpa` (time; < 1 means our
kernel is faster than SDPA for the Transformer) and `DIFF/T best` (time over the faster T path).

    python benchmarks/decode_attention_cpu.py                      # cpu-small's layer: 4 DIFF heads, d 32
    python benchmarks/decode_attention_cpu.py --heads 8 --head-dim 64 --keys 512 4096 --batch 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import MedianInterval, interleaved_times, machine  # noqa: E402


def _cached(B: int, heads: int, S: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """(B, heads, S, dim): the filled part of a cache buffer with room for 64 more positions."""
    return torch.randn(B, heads, S + 64, dim, generator=g)[:, :, :S]


def _calls(B: int, S: int, h: int, d: int, n: int):
    """Closures running n decode calls each: T on cpp, T on sdpa, DIFF on cpp."""
    from difftransformer import differential_attention
    from difftransformer.attention import multihead_attention

    g = torch.Generator().manual_seed(S * 31 + B)
    qt, kt, vt = torch.randn(B, 2 * h, 1, d, generator=g), _cached(B, 2 * h, S, d, g), _cached(B, 2 * h, S, d, g)
    qd, kd, vd = torch.randn(B, 2 * h, 1, d, generator=g), _cached(B, 2 * h, S, d, g), _cached(B, h, S, 2 * d, g)
    lam, norm = torch.tensor(0.3), (torch.rand(2 * d, generator=g) + 0.5, 1e-5)

    def run(fn):
        def calls():
            with torch.no_grad():
                for _ in range(n):
                    fn()
        return calls

    return [run(lambda: multihead_attention(qt, kt, vt, backend="cpp")),
            run(lambda: multihead_attention(qt, kt, vt, backend="sdpa")),
            run(lambda: differential_attention(qd, kd, vd, lam, backend="cpp", out_norm=norm))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, nargs="+", default=[64, 512, 2048, 4096], help="cached keys S")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--heads", type=int, default=4, help="DIFF heads h; the Transformer gets 2h (default 4)")
    p.add_argument("--head-dim", type=int, default=32, help="d of each DIFF component and T head (default 32)")
    p.add_argument("--calls", type=int, default=50, help="back-to-back calls per timing (default 50)")
    p.add_argument("--repeats", type=int, default=9, help="rounds (default 9)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    args = p.parse_args()
    if min(args.keys + args.batch) < 1 or min(args.heads, args.head_dim, args.calls, args.repeats) < 1:
        p.error("--keys, --batch, --heads, --head-dim, --calls and --repeats must be positive")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from difftransformer.kernels import flash_cpu

    if not flash_cpu.is_available():
        p.error(f"the fused CPU kernel is unavailable here: {flash_cpu.build_error()}")
    h, d = args.heads, args.head_dim
    print(f"# One decoding step of attention, DIFF {h} heads x 2 x {d} vs T {2 * h} heads x {d}, fp32, no grad; "
          f"median of {args.repeats} rounds of {args.calls} calls ({machine()})\n")
    print("| batch | keys | T cpp µs | T sdpa µs | DIFF cpp µs | T cpp/sdpa (time) | DIFF/T best (time) |")
    print("|---|---|---|---|---|---|---|")
    for B in args.batch:
        for S in args.keys:
            t_cpp, t_sdpa, diff = (
                [x / args.calls for x in xs]
                for xs in interleaved_times(_calls(B, S, h, d, args.calls), args.repeats))
            best = min((t_cpp, t_sdpa), key=statistics.median)
            print(f"| {B} | {S} | {statistics.median(t_cpp) * 1e6:.1f} | {statistics.median(t_sdpa) * 1e6:.1f} | "
                  f"{statistics.median(diff) * 1e6:.1f} | {MedianInterval.ratio(t_cpp, t_sdpa)} | "
                  f"{MedianInterval.ratio(diff, best)} |", flush=True)


if __name__ == "__main__":
    main()
