"""DIFF attention layer vs its matched Transformer layer: forward+backward time and peak memory.

For each backend and sequence length, both layers (same width, DIFF with h heads, baseline with
2h heads of the same head_dim) run forward+backward on the same input. Time: the two layers
alternate in one process (baseline, DIFF, baseline, DIFF, ...) after a warm-up, and the ratio is
of the medians, so load on a shared machine hits both alike. Peak memory: the growth of the
process's peak RSS over one forward+backward, in a fresh subprocess per (layer, backend, T) so
peaks never mix. Prints a Markdown table of DIFF/baseline ratios.

    python benchmarks/attention_cpu.py                # T = 512, 2048, 4096; sdpa and eager
    python benchmarks/attention_cpu.py --seq-lens 1024 --backends sdpa --threads 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import statistics
import time

import torch


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def _build(kind: str, args, backend: str):
    from difftransformer import MultiheadAttention, MultiheadDiffAttention

    if kind == "diff":
        return MultiheadDiffAttention(args.embed_dim, 4, args.diff_heads, backend=backend)
    return MultiheadAttention(args.embed_dim, 4, 2 * args.diff_heads, backend=backend)


def _fwd_bwd(layer, x) -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    layer(x).float().square().mean().backward()


def _peak_memory(kind: str, backend: str, T: int, args, queue) -> None:
    """Runs in a child process: peak-RSS growth (MiB) of one forward+backward."""
    torch.set_num_threads(args.threads)
    layer = _build(kind, args, backend)
    x = torch.randn(args.batch, T, args.embed_dim, requires_grad=True)
    before = _rss_kib()
    _fwd_bwd(layer, x)
    queue.put(max((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, 0.0))


def peak_memory(kind: str, backend: str, T: int, args) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_memory, args=(kind, backend, T, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def interleaved_times(backend: str, T: int, args) -> tuple[float, float]:
    """Median fwd+bwd seconds of (baseline, DIFF), measured alternately."""
    torch.manual_seed(0)
    layers = [_build("transformer", args, backend), _build("diff", args, backend)]
    x = torch.randn(args.batch, T, args.embed_dim, requires_grad=True)
    times = [[], []]
    for layer in layers:
        _fwd_bwd(layer, x)  # warm-up
    for _ in range(args.repeats):
        for i, layer in enumerate(layers):
            t0 = time.perf_counter()
            _fwd_bwd(layer, x)
            times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--backends", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager"])
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--diff-heads", type=int, default=4, help="DIFF heads h; the baseline gets 2h (default 4 -> d=64)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", help="also write the raw results to this file")
    args = p.parse_args()

    d = args.embed_dim // args.diff_heads // 2
    print(f"# DIFF vs matched Transformer attention layer, CPU fwd+bwd "
          f"(E={args.embed_dim}, DIFF {args.diff_heads}x(2x{d}) vs baseline {2 * args.diff_heads}x{d}, "
          f"batch {args.batch}, fp32, {args.threads} threads, torch {torch.__version__}, {platform.processor() or platform.machine()})\n")
    print("| backend | T | baseline ms | DIFF ms | time ratio | baseline peak MiB | DIFF peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for backend in args.backends:
        for T in args.seq_lens:
            torch.set_num_threads(args.threads)
            t_base, t_diff = interleaved_times(backend, T, args)
            m_base, m_diff = peak_memory("transformer", backend, T, args), peak_memory("diff", backend, T, args)
            rows.append(dict(backend=backend, T=T, time_s=[t_base, t_diff], peak_mib=[m_base, m_diff]))
            print(f"| {backend} | {T} | {t_base * 1e3:.1f} | {t_diff * 1e3:.1f} | {t_diff / t_base:.2f} | "
                  f"{m_base:.0f} | {m_diff:.0f} | {m_diff / max(m_base, 1e-9):.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
