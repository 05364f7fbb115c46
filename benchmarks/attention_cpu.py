"""DIFF attention layer vs its matched Transformer layer: forward+backward time and peak memory.

For each backend and sequence length, both layers (same width; DIFF with h heads, the baseline
with 2h heads of the same head_dim) run forward+backward on the same input. Time: the layers
alternate in one process after a warm-up and the ratio is of the medians, so load on a shared
machine hits both alike. Peak memory: the peak of tensor memory allocated during one
forward+backward (PyTorch profiler), in a fresh process per (layer, backend, T). Prints a
Markdown table of DIFF/baseline ratios.

Both layers of a row use the same backend: under 'cpp' the baseline runs the C++ kernel's
ordinary-attention path, under 'sdpa' PyTorch's CPU flash kernel.

    python benchmarks/attention_cpu.py                 # T = 512, 2048, 4096; cpp, sdpa and eager
    python benchmarks/attention_cpu.py --seq-lens 1024 --backends sdpa --embed-dim 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_medians, machine, peak_memory_mib  # noqa: E402


def build_step(args, kind: str, backend: str, T: int):
    """A closure running one forward+backward of the `kind` layer."""
    from difftransformer import MultiheadAttention, MultiheadDiffAttention

    torch.manual_seed(0)
    if kind == "diff":
        layer = MultiheadDiffAttention(args.embed_dim, 4, args.diff_heads, backend=backend)
    else:
        layer = MultiheadAttention(args.embed_dim, 4, 2 * args.diff_heads, backend=backend)
    x = torch.randn(args.batch, T, args.embed_dim, requires_grad=True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).float().square().mean().backward()

    return step


def _make(args):  # module-level so the memory probe can pickle it
    return build_step(args, args.kind, args.backend, args.T)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--backends", nargs="+", default=["cpp", "sdpa", "eager"],
                   choices=["cpp", "sdpa", "eager"])
    p.add_argument("--embed-dim", type=int, default=1024)
    p.add_argument("--diff-heads", type=int, default=4,
                   help="DIFF heads h; the baseline gets 2h (default: E=1024, h=4 -> head_dim 128 as in the paper)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", help="also write the raw results to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    d = args.embed_dim // args.diff_heads // 2
    print(f"# DIFF vs matched Transformer attention layer, fwd+bwd, fp32 (E={args.embed_dim}, "
          f"DIFF {args.diff_heads} heads x 2 x {d} vs baseline {2 * args.diff_heads} x {d}, batch {args.batch}; "
          f"{machine()})\n")
    print("| backend | T | baseline ms | DIFF ms | time ratio | baseline peak MiB | DIFF peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for backend in args.backends:
        for T in args.seq_lens:
            t_base, t_diff = interleaved_medians(
                [build_step(args, "transformer", backend, T), build_step(args, "diff", backend, T)], args.repeats)
            mem = [peak_memory_mib(_make, argparse.Namespace(**vars(args), kind=k, backend=backend, T=T), args.threads)
                   for k in ("transformer", "diff")]
            rows.append(dict(backend=backend, T=T, time_s=[t_base, t_diff], peak_mib=mem))
            print(f"| {backend} | {T} | {t_base * 1e3:.1f} | {t_diff * 1e3:.1f} | {t_diff / t_base:.2f} | "
                  f"{mem[0]:.0f} | {mem[1]:.0f} | {mem[1] / max(mem[0], 1e-9):.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
