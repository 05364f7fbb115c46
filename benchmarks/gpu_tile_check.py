"""Which tile of which fused-kernel pass is wrong on this GPU? Each tile checked alone, on hardware.

The CPU suite runs the fused Triton kernel in the interpreter with one small tile, and ptxas checks
that every tile compiles; neither runs a tuned tile on a GPU. This script does: for each pass
(forward, dK/dV, dQ, one-pass dK/dV/dQ) and each tile of the launch's class, it pins that pass to
the one tile (the other passes autotune as usual), runs forward + backward on fresh random bf16
inputs and compares the pass's own outputs with an fp32 explicit-map reference:

    forward      out             dK/dV   dk, dv          dQ   dq          one-pass   dq, dk, dv

Error = max |got - ref| / max(max |ref|, 1), the measure of tests/kernels/test_diff_flash.py's GPU
test (limit 3e-2 there). Each tile runs twice on the same inputs; a deterministic pass whose two
results differ has a race. First, all passes autotuned together (what the layer runs), per output.

With --time B,h,h_kv,T,d it then times each pass on each of its tiles at that shape (bf16, causal):
the forward alone, or the backward alone (after one forward) with the pass pinned, medians of
triton.testing.do_bench (attention_gpu.median_ms). The autotuner picks from a few timed calls; this
table shows what each tile costs and whether its pick was the best. The default shape 16,8,8,2048,64 is one
training step of one layer of preset gpu-small (configs/gpu-small.toml).

    python benchmarks/gpu_tile_check.py                     # d = 128 then 64, three shapes
    python benchmarks/gpu_tile_check.py --head-dims 128 --time-limit 200
    python benchmarks/gpu_tile_check.py --head-dims 64 --time 16,8,8,2048,64    # + each tile's time
    TRITON_INTERPRET=1 python benchmarks/gpu_tile_check.py --cpu-smoke-test   # the code paths, on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from attention_gpu import median_ms  # noqa: E402  (do_bench's median on CUDA; one wall-clock call on CPU)
from common import host_ms, machine  # noqa: E402

LIMIT = 3e-2  # the GPU test's limit
# (B, h, h_kv, T, causal): the failing GPU test's shape (GQA, T not a multiple of any tile), the same
# without GQA at a whole number of tiles, and non-causal.
SHAPES = [(1, 4, 2, 1000, True), (2, 4, 4, 1024, True), (1, 4, 2, 1000, False)]
OUTPUTS = {"fwd": ("out",), "bwd_dkdv": ("dk", "dv"), "bwd_dq": ("dq",), "bwd_dkdvq": ("dq", "dk", "dv")}


def kernels():
    from difftransformer.kernels import diff_flash as df

    return {"fwd": df._diff_fwd_kernel, "bwd_dkdv": df._diff_bwd_dkdv_kernel, "bwd_dq": df._diff_bwd_dq_kernel,
            "bwd_dkdvq": df._diff_bwd_dkdvq_kernel}


def inputs(B, h, h_kv, T, d, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return rnd(B, 2 * h, T, d), rnd(B, 2 * h_kv, T, d), rnd(B, h_kv, T, 2 * d), rnd(B, h, T, 2 * d)


def reference(q, k, v, do, lam, causal):
    """fp32 explicit maps: out and the gradients of (q, k, v, lam) for the cotangent do."""
    B, two_h, T, d = q.shape
    h, h_kv = two_h // 2, k.shape[1] // 2
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    lf = torch.tensor(lam, device=q.device, requires_grad=True)
    qc = qf.view(B, h, 2, T, d)
    kc = kf.view(B, h_kv, 2, T, d).repeat_interleave(h // h_kv, 1)
    s = qc @ kc.transpose(-1, -2) * d ** -0.5
    if causal:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    a = torch.softmax(s, -1)
    out = (a[:, :, 0] - lf * a[:, :, 1]) @ vf.repeat_interleave(h // h_kv, 1)
    grads = torch.autograd.grad(out, (qf, kf, vf, lf), do.float())
    return dict(out=out.detach(), dq=grads[0], dk=grads[1], dv=grads[2], dlam=grads[3])


def fused(q, k, v, do, lam, causal, deterministic):
    from difftransformer.kernels.diff_flash import diff_flash_attention

    lam_t = torch.tensor(lam, device=q.device, requires_grad=True)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = diff_flash_attention(q, k, v, lam_t, causal=causal, deterministic=deterministic)
    dq, dk, dv, dlam = torch.autograd.grad(out, (q, k, v, lam_t), do)
    return dict(out=out.detach(), dq=dq, dk=dk, dv=dv, dlam=dlam)


def error(got, want):
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def tile_cells(tile) -> str:
    """A tile as the tables' BLOCK_M | BLOCK_N | warps | stages | split cells."""
    from difftransformer.kernels.diff_flash import SPLIT_FLAG

    return " | ".join(map(str, tile[:4])) + f" | {'yes' if SPLIT_FLAG in tile[4:] else 'no'}"


def smoke_tiles(pname):
    """The interpreter's tile; the key-block pass also split in two (its other code path)."""
    from difftransformer.kernels.diff_flash import SPLIT_FLAG

    return [(16, 16, 1, 1), (16, 16, 1, 1, SPLIT_FLAG)] if pname == "bwd_dkdv" else [(16, 16, 1, 1)]


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """'B,h,h_kv,T,d' as five positive ints (argparse type)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1 or shape[1] % shape[2]:
        raise argparse.ArgumentTypeError(f"{text!r}: give B,h,h_kv,T,d as five positive integers with h a "
                                         "multiple of h_kv, e.g. 16,8,8,2048,64")
    return shape


def parse_dims(text: str) -> list[int]:
    """'128,64' as positive head dims (argparse type)."""
    try:
        dims = [int(x) for x in text.split(",")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give head dims as positive integers separated by commas, "
                                         "e.g. 128,64")
    return dims


def time_tiles(shape, device, dtype, tiles_of, ks) -> None:
    """Each pass on each of its tiles at `shape`: the forward alone, or the backward alone."""
    from difftransformer.kernels.diff_flash import diff_flash_attention, pinned

    B, h, h_kv, T, d = shape
    q, k, v, do = inputs(B, h, h_kv, T, d, device, dtype, seed=300)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    lam = torch.tensor(0.7, device=device, requires_grad=True)
    print(f"\n## Time of each tile, B {B}, h {h}, h_kv {h_kv}, T {T}, d {d}, causal, {str(dtype)[6:]}\n")
    print("| pass | BLOCK_M | BLOCK_N | warps | stages | split | ms | / best | host ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pname, kernel in ks.items():
        det = pname != "bwd_dkdvq"
        times, hosts = {}, {}
        for tile in tiles_of(pname):
            try:
                with pinned(kernel, tile):
                    if pname == "fwd":
                        def call():
                            with torch.no_grad():
                                diff_flash_attention(q, k, v, lam, causal=True)
                    else:
                        out = diff_flash_attention(q, k, v, lam, causal=True, deterministic=det)

                        def call(out=out):
                            torch.autograd.grad(out, (q, k, v, lam), do, retain_graph=True)
                    times[tile], hosts[tile] = median_ms(call, 25, 100), host_ms(call)
            except Exception as e:  # a tile that cannot run here is a row, not the end
                times[tile] = f"error: {type(e).__name__}"
        best = min((t for t in times.values() if isinstance(t, float)), default=float("nan"))
        for tile, t in times.items():
            cells = f"{t:.3f} | {t / best:.2f}x | {hosts[tile]:.3f}" if isinstance(t, float) else f"{t} | - | -"
            print(f"| {pname} | {tile_cells(tile)} | {cells} |", flush=True)


def fmt(x):
    return "nan" if x != x else f"{x:.1e}"


def check_autotuned(dims, shapes, device, dtype, lam) -> None:
    """Every pass autotuned together (what the layer runs), each output against the reference."""
    print("## All passes autotuned (what the layer runs)\n")
    print("| d | B | h | h_kv | T | causal | backward | out | dq | dk | dv | dλ | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in dims:
        for i, (B, h, h_kv, T, causal) in enumerate(shapes):
            q, k, v, do = inputs(B, h, h_kv, T, d, device, dtype, seed=100 + i)
            ref = reference(q, k, v, do, lam, causal)
            for det in (True, False):
                got = fused(q, k, v, do, lam, causal, det)
                errs = {n: error(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
                errs["dlam"] = abs(got["dlam"].item() - ref["dlam"].item()) / max(abs(ref["dlam"].item()), 1.0)
                ok = all(e <= LIMIT for e in errs.values())
                print(f"| {d} | {B} | {h} | {h_kv} | {T} | {causal} | {'two-pass' if det else 'one-pass'} | "
                      + " | ".join(fmt(errs[n]) for n in ("out", "dq", "dk", "dv", "dlam"))
                      + f" | {'yes' if ok else 'NO'} |",
                      flush=True)


def check_pinned(dims, shapes, device, dtype, lam, smoke, t0, time_limit) -> None:
    """One pass pinned to each tile of its class in turn (the others autotuned)."""
    from difftransformer.kernels.diff_flash import TILES, pinned, tiles_for

    print("\n## One pass pinned to one tile (the others autotuned)\n")
    print("| d | pass | BLOCK_M | BLOCK_N | warps | stages | split | "
          + " | ".join(f"shape {i + 1}" for i in range(len(shapes)))
          + " | repeat equal | ok |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(shapes) + "---|---|")
    ks = kernels()
    for d in dims:
        cases = []
        for i, (B, h, h_kv, T, causal) in enumerate(shapes):
            q, k, v, do = inputs(B, h, h_kv, T, d, device, dtype, seed=200 + i)
            cases.append(((q, k, v, do, causal), reference(q, k, v, do, lam, causal)))
        for pname, kernel in ks.items():
            if time.perf_counter() - t0 > time_limit:
                print(f"| {d} | {pname} | time limit reached: not checked |" + " |" * (len(shapes) + 6))
                continue
            tiles = smoke_tiles(pname) if smoke else tiles_for(TILES[pname], d)
            det = pname != "bwd_dkdvq"
            for tile in tiles:
                cells, same, ok = [], True, True
                try:
                    with pinned(kernel, tile):
                        for (q, k, v, do, causal), ref in cases:
                            a = fused(q, k, v, do, lam, causal, det)
                            b = fused(q, k, v, do, lam, causal, det)
                            worst = max(error(a[n], ref[n]) for n in OUTPUTS[pname])
                            if det:
                                same &= all(torch.equal(a[n], b[n]) for n in OUTPUTS[pname])
                            ok &= worst <= LIMIT
                            cells.append(fmt(worst))
                except Exception as e:  # a tile that fails to compile or launch is a row, not the end
                    cells = [f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"] + [""] * (len(shapes) - 1)
                    ok = False
                print(f"| {d} | {pname} | {tile_cells(tile)} | " + " | ".join(cells)
                      + f" | {('yes' if same else 'NO') if det else '-'} | {'yes' if ok else 'NO'} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=parse_dims, default=[128, 64],
                   help="head dims to check, in order (default 128,64; the smoke test checks 16 only)")
    p.add_argument("--time-limit", type=float, default=300.0, help="no new (d, pass) group starts after this many s")
    p.add_argument("--time", type=parse_shape, metavar="B,h,h_kv,T,d",
                   help="then time every tile of every pass at this shape (e.g. 16,8,8,2048,64)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness tables (with --time: timing only)")
    p.add_argument("--cpu-smoke-test", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1 (the interpreter's one tile), for CI")
    args = p.parse_args()
    from difftransformer.kernels.diff_flash import TILES, tiles_for

    smoke = args.cpu_smoke_test
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--cpu-smoke-test needs TRITON_INTERPRET=1 in the environment")
    if not smoke and not torch.cuda.is_available():
        p.error("no CUDA GPU here; use --cpu-smoke-test with TRITON_INTERPRET=1 to check the script on CPU")
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = [(1, 2, 1, 19, True), (1, 2, 2, 16, False)] if smoke else SHAPES
    dims = [16] if smoke else args.head_dims
    lam = 0.7
    t0 = time.perf_counter()
    name = f"CPU interpreter (torch {torch.__version__})" if smoke else machine(torch.device("cuda"))
    print(f"# Fused kernel, tile by tile, on {name}; error = max|got-ref| / "
          f"max(max|ref|, 1) against fp32 explicit maps; limit {LIMIT:.0e}; λ = {lam}\n")

    if not args.no_check:
        check_autotuned(dims, shapes, device, dtype, lam)
        check_pinned(dims, shapes, device, dtype, lam, smoke, t0, args.time_limit)
    if args.time:
        tiles_of = smoke_tiles if smoke else (lambda pname: tiles_for(TILES[pname], args.time[4]))
        time_tiles(args.time, device, dtype, tiles_of, kernels())
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
