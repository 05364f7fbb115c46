"""One decoding step of attention on CUDA, as a static KV cache's step runs it: replayed from CUDA graphs.

Per row of the table, every call reads one query row per head against a cache buffer of `--keys` slots whose last
`--unwritten` are masked out (the (B, S) key mask of a static cache's step), under `torch.no_grad`, through the
public functions (`multihead_attention`, `differential_attention`), in the dtype asked. Arms: the Transformer's
2h heads of d on SDPA (PyTorch's fastest masked kernel; cuDNN on an H100/H200); DIFF's h heads of 2 x d with its
head norm on 'sdpa' (one SDPA call per map on strided views, then λ and the norm in small kernels) and on
'triton' (`kernels/diff_decode.py`: one kernel pair, both maps, λ and the norm fused). Each arm's `--calls`
back-to-back calls are captured in one graph; the graphs replay alternately (`common.interleaved_times`):
figures are medians over rounds of µs per call, ratios medians of per-round ratios with a 95% interval from
6 rounds on.

    python benchmarks/decode_attention_gpu.py                      # gpu-small's layer: 6 DIFF heads, d 64, bf16
    python benchmarks/decode_attention_gpu.py --heads 8 --head-dim 128 --keys 4096 16384 --batch 1 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import MedianInterval, interleaved_times, machine  # noqa: E402

ARMS = ("T sdpa", "DIFF sdpa", "DIFF triton")


def _graphed(fn, calls: int):
    """A closure replaying one CUDA graph of `calls` calls of fn (captured after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        for _ in range(calls):
            fn()

    return graph.replay


def _arms(B: int, S: int, unwritten: int, h: int, d: int, dtype: torch.dtype, calls: int):
    from difftransformer import differential_attention
    from difftransformer.attention import multihead_attention

    g = torch.Generator(device="cuda").manual_seed(S * 31 + B)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    keep = torch.ones(B, S, dtype=torch.bool, device="cuda")
    keep[:, S - unwritten:] = False
    qt, kt, vt = randn(B, 2 * h, 1, d), randn(B, 2 * h, S, d), randn(B, 2 * h, S, d)
    qd, kd, vd = randn(B, 2 * h, 1, d), randn(B, 2 * h, S, d), randn(B, h, S, 2 * d)
    lam = torch.tensor(0.3, device="cuda")
    norm = (torch.rand(2 * d, generator=g, device="cuda") + 0.5, 1e-5)
    fns = [lambda: multihead_attention(qt, kt, vt, key_padding_mask=keep, backend="sdpa"),
           lambda: differential_attention(qd, kd, vd, lam, key_padding_mask=keep, backend="sdpa", out_norm=norm),
           lambda: differential_attention(qd, kd, vd, lam, key_padding_mask=keep, backend="triton", out_norm=norm)]
    return [_graphed(fn, calls) for fn in fns]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, nargs="+", default=[768, 2304, 8448], help="cache slots S (default: the "
                   "static caches of 512 + 128, 2048 + 128 and 8192 + 128 positions)")
    p.add_argument("--unwritten", type=int, default=100, help="masked slots at the end of each buffer (default 100)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--heads", type=int, default=6, help="DIFF heads h; the Transformer gets 2h (default 6)")
    p.add_argument("--head-dim", type=int, default=64, help="d of each DIFF component and T head (default 64)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16"], help="dtype (default bf16)")
    p.add_argument("--calls", type=int, default=50, help="calls per graph (default 50)")
    p.add_argument("--repeats", type=int, default=9, help="rounds (default 9)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark replays CUDA graphs and needs a CUDA device; on CPU use decode_attention_cpu.py")
    if min(args.keys + args.batch) < 1 or min(args.heads, args.head_dim, args.calls, args.repeats) < 1:
        p.error("--keys, --batch, --heads, --head-dim, --calls and --repeats must be positive")
    if not 0 <= args.unwritten < min(args.keys):
        p.error(f"--unwritten must be in [0, the smallest --keys); got {args.unwritten}")
    from difftransformer.kernels import triton_runs

    if not triton_runs():
        p.error("Triton does not run here; the 'triton' arm needs it")
    h, d = args.heads, args.head_dim
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float16
    print(f"# One masked decoding step of attention, DIFF {h} heads x 2 x {d} (head norm) vs T {2 * h} x {d}, "
          f"{args.precision}, CUDA graphs of {args.calls} calls, median of {args.repeats} rounds "
          f"({machine(torch.device('cuda'))})\n")
    print("| batch | keys | " + " | ".join(f"{a} µs" for a in ARMS) + " | DIFF triton / T (time) | "
          "DIFF triton / DIFF sdpa (time) |")
    print("|---|---|" + "---|" * (len(ARMS) + 2))
    for B in args.batch:
        for S in args.keys:
            t, ds, dt = ([x / args.calls for x in xs] for xs in interleaved_times(
                _arms(B, S, args.unwritten, h, d, dtype, args.calls), args.repeats, device=torch.device("cuda")))
            cells = [f"{statistics.median(x) * 1e6:.1f}" for x in (t, ds, dt)]
            print(f"| {B} | {S} | {' | '.join(cells)} | {MedianInterval.ratio(dt, t)} | "
                  f"{MedianInterval.ratio(dt, ds)} |", flush=True)


if __name__ == "__main__":
    main()
