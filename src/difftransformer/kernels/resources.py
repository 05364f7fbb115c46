"""Compile the fused Triton kernel for an NVIDIA GPU this machine does not have, and report what
each autotune config costs in registers, spills and shared memory.

Triton compiles ahead of time without a driver (TTIR -> TTGIR -> LLVM -> PTX), and its wheel ships
NVIDIA's `ptxas`, whose `-v` report is the same one a GPU build gets: registers per thread, bytes
spilled to local memory, and whether Hopper's asynchronous tensor-core instructions (wgmma) had to
be serialised (for lack of registers, or because other instructions write their accumulators). A
config that spills or serialises wgmma is slow on the GPU whatever the autotuner measures for it;
this tells us before any GPU time is spent.

The launch arguments are the real ones: `diff_flash.fwd_launch` / `bwd_dkdv_launch` /
`bwd_dq_launch` are called with meta-device tensors in the attention layer's layouts, and every
integer is specialised the way the JIT specialises it at launch (1 -> constant, multiples of 16 ->
divisibility hints).

    python -m difftransformer.kernels.resources                 # sm_90, d 64 and 128, bf16
    python -m difftransformer.kernels.resources --arch 80 --head-dims 32,64,96,128 --jobs 2
    python -m difftransformer.kernels.resources --kernels bwd_dkdv --head-dims 128 --tiles "64,64,8,2,split"

(`python benchmarks/kernel_resources.py` runs the same.) The tests hold the tile lists to these
reports (tests/kernels/test_resources.py), which is why this lives in the package.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import subprocess
import tempfile

import torch

from difftransformer.kernels import diff_flash as df
from difftransformer.kernels import token_major_empty

KERNELS = tuple(df.TILES)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x10: 90 (H100/H200), 80 (A100)")
    p.add_argument("--head-dims", default="64,128", help="comma-separated DIFF component dims d")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="input dtype")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {KERNELS}")
    p.add_argument("--non-causal", action="store_true", help="compile the non-causal variants")
    p.add_argument("--tiles", type=parse_tiles, default=None,
                   help="explore other configs: 'M,N,warps,stages[,split];...' (',split': the key-block pass as a "
                        "dK and a dV program; default: each kernel's autotune list)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    return p.parse_args(argv)


def launch(kernel_name, d, dtype, causal, h=8, h_kv=8, B=2, T=4096):
    """The kernel, its launch arguments and constexprs, from the real launch helpers."""
    meta_dev = dict(device="meta")
    # The layer's layouts: q/k are transposed views of (B, T, 2h, d) projections, v of (B, S, h_kv, 2d).
    q = torch.empty(B, T, 2 * h, d, dtype=dtype, **meta_dev).transpose(1, 2)
    k = torch.empty(B, T, 2 * h_kv, d, dtype=dtype, **meta_dev).transpose(1, 2)
    v = torch.empty(B, T, h_kv, 2 * d, dtype=dtype, **meta_dev).transpose(1, 2)
    lam = torch.empty((), dtype=torch.float32, **meta_dev)
    out = token_major_empty(q, h, 2 * d)
    rows = torch.empty(B, h, T, dtype=torch.float32, **meta_dev)
    scale = d ** -0.5
    if kernel_name == "fwd":  # with the head norm fused, as the layer runs it (its epilogue needs registers too)
        weight = torch.empty(2 * d, dtype=torch.float32, **meta_dev)
        return df.fwd_launch(q, k, v, lam, out, out, rows, rows, causal, scale, (weight, out, rows, 1e-5))
    if kernel_name in ("bwd_dkdv", "bwd_dkdvq"):  # the second adds dQ with atomics (deterministic=False)
        dq_sum = torch.empty(q.shape, dtype=torch.float32, **meta_dev) if kernel_name == "bwd_dkdvq" else None
        return df.bwd_dkdv_launch(out, q, k, v, lam, rows, rows, rows, rows, torch.empty_like(k),
                                  torch.empty_like(v), causal, scale, dq_sum)
    return df.bwd_dq_launch(out, q, k, v, lam, rows, rows, rows, rows, torch.empty_like(q), causal, scale)


def _signature(fn, args, constexprs):
    """Triton signature, constants and divisibility attributes, as the JIT would derive them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    names = [n for n in fn.arg_names if n not in constexprs]
    assert len(names) == len(args), (names, len(args))
    signature, constants, attrs = {}, dict(constexprs), {}
    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for name, value in zip(names, args):
        index = (fn.arg_names.index(name),)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + type_names[value.dtype]
            attrs[index] = [["tt.divisibility", 16]]  # the caching allocator aligns to >= 16 bytes
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            signature[name], constants[name] = "constexpr", value
        else:
            signature[name] = kind
            if spec == "D":
                attrs[index] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constants, attrs


def compile_one(job):
    """Compile one (kernel, d, config) for the target and parse ptxas -v. Runs in a worker process."""
    kernel_name, d, dtype_name, causal, arch, tile = job
    block_m, block_n, warps, stages = tile[:4]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    kernel, _, args, meta = launch(kernel_name, d, dtype, causal)
    fn = kernel.fn  # the JITFunction under the autotuner
    meta = dict(meta, **df.tile_config(tile, fn).kwargs, INTERPRET=False)
    args = args + (meta.pop("LEN_BUCKET"),)  # a plain int argument (it only keys the autotuner)
    signature, constants, attrs = _signature(fn, args, meta)
    row = dict(kernel=kernel_name, d=d, block_m=block_m, block_n=block_n, warps=warps, stages=stages,
               split=df.SPLIT_FLAG in tile[4:])
    try:
        compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
    except Exception as exc:  # report, do not stop the sweep
        return dict(row, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
    gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu_name}", ptx_path, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0  # noqa: E731
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return dict(row, mma=mma, smem_kib=compiled.metadata.shared / 1024, regs=number(r"Used (\d+) registers"),
                spill_bytes=number(r"(\d+) bytes spill stores"), wgmma_serialized="wgmma.mma_async" in log
                and "serialized" in log)


def parse_tiles(text):
    """'M,N,warps,stages[,split];...' as a list of tiles (argparse type)."""
    try:
        return [df.parse_tile(t) for t in text.split(";")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def jobs_for(args):
    jobs = []
    for name in args.kernels.split(","):
        for d in map(int, args.head_dims.split(",")):
            for tile in args.tiles or df.tiles_for(df.TILES[name], d, ieee=args.dtype == "fp32"):
                jobs.append((name, d, args.dtype, not args.non_causal, args.arch, tile))
    return jobs


def compile_all(jobs, workers):
    """Compile in fresh processes that import Triton in compile mode, never the interpreter."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # inherited by the workers; restored for this process
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            return list(pool.map(compile_one, jobs))
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def format_table(rows):
    lines = ["| kernel | d | BLOCK_M | BLOCK_N | warps | stages | split | MMA | regs/thread | spill stores (B) "
             "| smem (KiB) | wgmma serialised |", "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        head = (f"| {r['kernel']} | {r['d']} | {r['block_m']} | {r['block_n']} | {r['warps']} | {r['stages']} | "
                f"{'yes' if r['split'] else 'no'} |")
        if "error" in r:
            lines.append(f"{head} compile error: {r['error']} | | | | |")
        else:
            lines.append(f"{head} {r['mma']} | {r['regs']} | {r['spill_bytes']} | {r['smem_kib']:.0f} | "
                         f"{'yes' if r['wgmma_serialized'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import triton

    jobs = jobs_for(args)
    print(f"Triton {triton.__version__}, target sm_{args.arch}, {args.dtype}, "
          f"{'non-causal' if args.non_causal else 'causal'}, {len(jobs)} compilations", flush=True)
    rows = compile_all(jobs, args.jobs)
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
