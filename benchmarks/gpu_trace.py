"""Where one attention forward + backward spends its time on a CUDA GPU, kernel by kernel.

For each shape B,h,h_kv,T,d (causal, bf16) it runs three workloads under torch.profiler:
the fused DIFF kernel with the deterministic backward, with the one-pass backward
(`deterministic=False`), and the matched baseline (SDPA over 2h heads of dim d, its default
dispatch). Per workload it prints, per iteration:

    wall ms      CUDA events around --iters back-to-back calls, divided by --iters (the queue is not
                 drained between calls, so host work overlaps the GPU's as in training)
    host ms      what it costs the CPU to enqueue one call (queue drained first, not awaited after)
    kernels ms   the sum of the GPU kernels' own times, from the profiler
    idle         1 - kernels / wall: the share of the call the GPU waits on the host or on launches

and then each kernel's GPU time per iteration. When `idle` is large, tiles cannot help: the host
is the limit. When it is small, the kernel rows say which pass to work on.

    python benchmarks/gpu_trace.py                                   # gpu-small's shape, the 4K/d=128
                                                                     # target and the T = 1K anomaly
    python benchmarks/gpu_trace.py --shapes 16,8,8,1024,64 --iters 50
    TRITON_INTERPRET=1 python benchmarks/gpu_trace.py --cpu-smoke-test   # the code paths, on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from attention_gpu import baseline  # noqa: E402
from common import host_ms, kernel_times, machine, wall_ms  # noqa: E402
from gpu_tile_check import inputs, parse_shape  # noqa: E402

SHAPES = "16,8,8,2048,64 4,8,8,4096,128 16,8,8,1024,64"


def workloads(shape, device, dtype):
    """{name: fwd+bwd callable} at this shape: fused (both backwards) and the SDPA baseline."""
    from difftransformer.kernels.diff_flash import diff_flash_attention

    B, h, h_kv, T, d = shape
    q, k, v, do = inputs(B, h, h_kv, T, d, device, dtype, seed=400)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    lam = torch.tensor(0.7, device=device, requires_grad=True)
    # The baseline: 2h heads of d (2 h_kv kv heads), the same tokens; its dO is (B, 2h, T, d).
    qb, kb, vb, dob = (torch.randn(B, n, T, d, device=device, dtype=dtype) for n in (2 * h, 2 * h_kv, 2 * h_kv, 2 * h))
    qb, kb, vb = (x.requires_grad_() for x in (qb, kb, vb))

    def fused(det):
        def call():
            out = diff_flash_attention(q, k, v, lam, causal=True, deterministic=det)
            torch.autograd.grad(out, (q, k, v, lam), do)
        return call

    def sdpa():
        torch.autograd.grad(baseline(qb, kb, vb, causal=True), (qb, kb, vb), dob)

    return {"fused, two-pass backward": fused(True), "fused, one-pass backward": fused(False),
            "baseline (SDPA)": sdpa}


def trace(shape, device, dtype, iters) -> None:
    B, h, h_kv, T, d = shape
    print(f"\n## B {B}, h {h}, h_kv {h_kv}, T {T}, d {d}, causal, {str(dtype)[6:]}: forward + backward\n")
    print("| workload | wall ms | host ms | kernels ms | idle |")
    print("|---|---|---|---|---|")
    per_kernel = {}
    for name, fn in workloads(shape, device, dtype).items():
        wall = wall_ms(fn, iters)  # autotunes on its first call
        host = host_ms(fn)
        kernels = kernel_times(fn, iters)
        busy = sum(ms for ms, _ in kernels.values())
        per_kernel[name] = kernels
        print(f"| {name} | {wall:.3f} | {host:.3f} | {busy:.3f} | {max(0.0, 1 - busy / wall):.0%} |", flush=True)
    for name, kernels in per_kernel.items():
        print(f"\n{name}, per iteration:\n")
        print("| kernel | ms | launches |")
        print("|---|---|---|")
        for key, (ms, count) in list(kernels.items())[:12]:
            print(f"| {key[:90]} | {ms:.3f} | {count:g} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", metavar="B,h,h_kv,T,d",
                   default=[parse_shape(s) for s in SHAPES.split()],
                   help=f"shapes to trace (default: {SHAPES})")
    p.add_argument("--iters", type=int, default=20, help="calls per measurement (default 20)")
    p.add_argument("--cpu-smoke-test", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the script, measures nothing (CI)")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke_test
    if args.iters < 1:
        p.error(f"--iters must be at least 1, got {args.iters}")
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--cpu-smoke-test needs TRITON_INTERPRET=1 in the environment")
    if not smoke and not torch.cuda.is_available():
        p.error("no CUDA GPU here; use --cpu-smoke-test with TRITON_INTERPRET=1 to check the script on CPU")
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    shapes = [(1, 2, 1, 24, 16)] if smoke else args.shapes
    name = f"CPU interpreter (torch {torch.__version__})" if smoke else machine(torch.device("cuda"))
    print(f"# Fused kernel and baseline, kernel by kernel, on {name}")
    t0 = time.perf_counter()
    for shape in shapes:
        trace(shape, device, dtype, 1 if smoke else args.iters)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
