"""A fixed workload for Nsight Compute: the fused kernel's passes, each pinned to one tile, run twice.

ncu replays every kernel it profiles many times, so the workload must not autotune (a tuning run
would launch every tile, and ncu would profile those). Pinning each pass to one tile (as
benchmarks/gpu_tile_check.py does) gives exactly one launch per pass per iteration: forward, then the
backward's dK/dV and dQ passes (or the one-pass kernel with --one-pass). The first iteration compiles;
profile the second: `ncu -k regex:_diff_ --launch-skip 3 --launch-count 3 ...` (2 with --one-pass).

    python benchmarks/gpu_ncu_driver.py --shape 16,8,8,2048,64 --fwd 128,64,8,3 --dkdv 32,64,4,2 --dq 64,64,4,2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_tile_check import inputs, kernels, parse_shape  # noqa: E402


def parse_tile(text: str) -> tuple:
    """A tile 'M,N,warps,stages[,split]' (argparse type; --dkdv)."""
    from difftransformer.kernels.diff_flash import parse_tile as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_unsplit_tile(text: str) -> tuple:
    """A tile 'M,N,warps,stages' (argparse type; --fwd, --dq: only the key-block pass splits)."""
    tile = parse_tile(text)
    if len(tile) > 4:
        raise argparse.ArgumentTypeError(f"{text!r}: only the key-block pass (--dkdv) splits; give M,N,warps,stages")
    return tile


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=parse_shape, default=(16, 8, 8, 2048, 64), metavar="B,h,h_kv,T,d")
    p.add_argument("--fwd", type=parse_unsplit_tile, required=True, metavar="M,N,WARPS,STAGES")
    p.add_argument("--dkdv", type=parse_tile, required=True, metavar="M,N,WARPS,STAGES[,split]",
                   help="the dK/dV pass (',split': as a dK and a dV program), or the one-pass kernel with --one-pass")
    p.add_argument("--dq", type=parse_unsplit_tile, metavar="M,N,WARPS,STAGES", help="the dQ pass (two-pass backward)")
    p.add_argument("--one-pass", action="store_true", help="the one-pass backward (deterministic=False)")
    p.add_argument("--iterations", type=int, default=2)
    args = p.parse_args(argv)
    if not args.one_pass and args.dq is None:
        p.error("--dq is needed for the two-pass backward (or pass --one-pass)")
    if args.one_pass and len(args.dkdv) > 4:
        p.error("--one-pass: the one-pass kernel has no split tiles (the autotuner never runs one); "
                "give --dkdv M,N,warps,stages")
    if not torch.cuda.is_available():
        p.error("no CUDA GPU here: this is a workload for Nsight Compute on a GPU")
    return args


def workload(args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
    """args.iterations forward + backward calls with each pass pinned to its tile."""
    from difftransformer.kernels import diff_flash

    ks = kernels()
    pins = [diff_flash.pinned(ks["fwd"], args.fwd)]
    pins += ([diff_flash.pinned(ks["bwd_dkdvq"], args.dkdv)] if args.one_pass
             else [diff_flash.pinned(ks["bwd_dkdv"], args.dkdv), diff_flash.pinned(ks["bwd_dq"], args.dq)])
    B, h, h_kv, T, d = args.shape
    q, k, v, do = inputs(B, h, h_kv, T, d, device, dtype, seed=400)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    lam = torch.tensor(0.7, device=device, requires_grad=True)
    with contextlib.ExitStack() as stack:
        for pinned_pass in pins:
            stack.enter_context(pinned_pass)
        for _ in range(args.iterations):
            out = diff_flash.diff_flash_attention(q, k, v, lam, causal=True, deterministic=not args.one_pass)
            torch.autograd.grad(out, (q, k, v, lam), do)


def main(argv=None) -> None:
    args = parse_args(argv)
    workload(args, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    B, h, _, T, d = args.shape
    print(f"ran {args.iterations} iterations of {B}x{h}x{T}, d {d}: fwd {args.fwd}, "
          + (f"one-pass {args.dkdv}" if args.one_pass else f"dkdv {args.dkdv}, dq {args.dq}"))


if __name__ == "__main__":
    main()
