"""GPU benchmark: the fused differential kernel against SDPA layouts and the matched baseline.

Layouts timed (DIFF: h heads, q/k components of dim d, V of dim 2d; baseline: 2h heads of dim d):
  (a) fused     difftransformer.kernels.diff_flash.diff_flash_attention (deterministic backward)
  (a1) fused, one-pass backward: deterministic=False (dQ added with atomics, no dQ pass)
  (b) two-call  SDPA(Q1, K1, V) - lam * SDPA(Q2, K2, V), V of dim 2d
  (c) four-call V split in its two d-halves, each half through both softmaxes, outputs concatenated
  (d) baseline  one SDPA call over 2h heads of dim d
The SDPA layouts (b)-(d) are timed with each of SDPA's fused kernels pinned in turn (flash,
memory-efficient, cuDNN; one that cannot take the shapes is skipped), and each column keeps the fastest:
the "kernel" column names it for fwd / fwd+bwd. Flash needs q, k and v of one head dim, so
the two-call layout (V of dim 2d) cannot use it; the four-call layout can.

FLOPs (2 per multiply-add), causal counted as half of T * S:
  baseline fwd     F = 4 * B * (2h) * T * S * d * (1/2 if causal)     (Q K^T and P V)
  baseline fwd+bwd 3.5 F                                              (bwd: S, dP, dV, dK, dQ = 2.5 F)
  DIFF fwd         1.5 F   (S1, S2 of width d; A1 V, A2 V of width 2d)
  DIFF fwd+bwd     4.0 F   (bwd as the baseline's: dP2 = -lam dP1, dV = (A1 - lam A2)^T dO)
All DIFF layouts are credited with the same DIFF FLOPs, so their TFLOP/s is useful work per second:
the deterministic backward of (a) recomputes the scores and dP for its dQ pass (1.4x the one-pass
backward's work), and the four-call layout computes every score twice. Ratios are time / time of (d).

    python benchmarks/attention_gpu.py                       # T 1K..16K, d 128 and 64, bf16
    python benchmarks/attention_gpu.py --seq-lens 4096 --head-dims 128 --rep-ms 500
"""

import argparse
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
from common import host_ms, machine  # noqa: E402

# cuDNN last: a fault there is the likeliest to spoil the CUDA context for what follows.
SDPA_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1024,2048,4096,8192,16384", help="comma-separated T (= S) values")
    p.add_argument("--head-dims", default="128,64",
                   help="comma-separated DIFF component dims d (128 first: the targets are judged there)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="input dtype")
    p.add_argument("--tokens", type=int, default=16384, help="batch * T per measurement (B = tokens // T)")
    p.add_argument("--heads", type=int, default=8, help="DIFF heads h (the baseline gets 2h)")
    p.add_argument("--kv-heads", type=int, default=None, help="DIFF kv groups h_kv (default: h, no GQA)")
    p.add_argument("--non-causal", action="store_true", help="time full (non-causal) attention instead")
    p.add_argument("--rep-ms", type=int, default=100, help="time spent on timed calls per measurement "
                   "(triton.testing.do_bench's rep); the median call is reported")
    p.add_argument("--warmup-ms", type=int, default=25, help="untimed calls first, in ms (autotuning comes before)")
    p.add_argument("--time-limit", type=float, default=0, metavar="SECONDS",
                   help="start no new shape after this many seconds (0: no limit), so that a run under an "
                        "outer timeout still ends with the autotuner's choices")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check of the fused kernel")
    p.add_argument("--cpu-smoke-test", action="store_true",
                   help="run every code path on CPU with the Triton interpreter (TRITON_INTERPRET=1) at tiny "
                        "shapes: checks the script, measures nothing (CI runs this)")
    return p.parse_args(argv)


# ---- the layouts ------------------------------------------------------------------------------


def split_components(q, k):
    """Striped (B, 2h, T, d) -> the two (B, h, T, d) component views, without copies."""
    B, two_h, T, d = q.shape
    q1, q2 = q.unflatten(1, (two_h // 2, 2)).unbind(2)
    k1, k2 = k.unflatten(1, (k.shape[1] // 2, 2)).unbind(2)
    return q1, q2, k1, k2


def two_call_maps(q, k, v, causal):
    """(A1 V, A2 V), one SDPA call each."""
    q1, q2, k1, k2 = split_components(q, k)
    gqa = q1.shape[1] != k1.shape[1]
    return tuple(F.scaled_dot_product_attention(qc, kc, v, is_causal=causal, enable_gqa=gqa)
                 for qc, kc in ((q1, k1), (q2, k2)))


def two_call(q, k, v, lam, causal):
    o1, o2 = two_call_maps(q, k, v, causal)
    return o1 - lam * o2


def four_call(q, k, v, lam, causal):
    q1, q2, k1, k2 = split_components(q, k)
    gqa = q1.shape[1] != k1.shape[1]
    halves = []
    for vh in v.chunk(2, dim=-1):
        o1 = F.scaled_dot_product_attention(q1, k1, vh, is_causal=causal, enable_gqa=gqa)
        o2 = F.scaled_dot_product_attention(q2, k2, vh, is_causal=causal, enable_gqa=gqa)
        halves.append(o1 - lam * o2)
    return torch.cat(halves, dim=-1)


def baseline(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


# ---- timing -----------------------------------------------------------------------------------


def median_ms(fn, warmup_ms, rep_ms):
    """Median time of fn in ms. On CUDA, Triton's do_bench: CUDA events around each call, L2 flushed
    between calls and no host sync inside the timed loop, so launch overhead is not counted as
    kernel time. In the CPU smoke test, one wall-clock call."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def measure(fn, inputs, grad_out, warmup_ms, rep_ms):
    """(forward ms, forward+backward ms, forward+backward host ms); None for a layout that runs out of memory."""
    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        torch.autograd.grad(fn(), inputs, grad_out)

    try:
        return median_ms(fwd, warmup_ms, rep_ms), median_ms(fwd_bwd, warmup_ms, rep_ms), host_ms(fwd_bwd)
    except torch.OutOfMemoryError:
        free_cached_memory()
        return None


def first_line(e: BaseException, width: int = 80) -> str:
    text = str(e).strip() or repr(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:width]}"


def free_cached_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_sdpa(fn, inputs, grad_out, warmup_ms, rep_ms):
    """The best (fwd ms, fwd+bwd ms) over SDPA's fused kernels, each pinned in turn (with the host
    ms of the best fwd+bwd's kernel), and the kernels that gave them ("fwd / fwd+bwd"); (None,
    reason) when none could run."""
    best, skipped = [None, None], []
    for name, kernel in SDPA_KERNELS.items():
        try:
            with sdpa_kernel([kernel]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "<kernel> not used because ..." for unsupported shapes
                times = measure(fn, inputs, grad_out, warmup_ms, rep_ms)
        except Exception as e:  # mostly "No available kernel": this kernel cannot take these shapes
            skipped.append(f"{name}: {first_line(e, 60)}")
            continue
        if times is None:
            skipped.append(f"{name}: OOM")
            continue
        if best[0] is None or times[0] < best[0][0]:
            best[0] = (times[0], name)
        if best[1] is None or times[1] < best[1][0]:
            best[1] = (times[1], name, times[2])  # with that kernel's fwd+bwd host time
    if best[0] is None:
        return None, "; ".join(skipped) or "no kernel"
    return (best[0][0], best[1][0], best[1][2]), f"{best[0][1]} / {best[1][1]}"


def check_fused(diff_flash_attention, dtype, device, B, h, h_kv, T, d, causal):
    """The fused kernel, both backwards, against SDPA in fp32 on the same rounded inputs: out, dq,
    dk, dv relative to their largest magnitude, dlam = -sum(dO * A2 V) relative to the sum of its
    terms' magnitudes (dlam itself may cancel to near 0). The shapes are the benchmark's own, so
    the kernels compiled here are the ones it times. Returns (ok, message)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, 2 * h, T, d, device=device, generator=g).to(dtype)
    k = torch.randn(B, 2 * h_kv, T, d, device=device, generator=g).to(dtype)
    v = torch.randn(B, h_kv, T, 2 * d, device=device, generator=g).to(dtype)
    do = torch.randn(B, h, T, 2 * d, device=device, generator=g).to(dtype)
    lam = torch.tensor(0.7, device=device)
    ref_ins = [x.float().requires_grad_() for x in (q, k, v)] + [lam.clone().requires_grad_()]
    o1, o2 = two_call_maps(*ref_ins[:3], causal)
    ref = o1 - ref_ins[3] * o2
    want = [ref, *torch.autograd.grad(ref, ref_ins, do.float())]
    dlam_scale = (do.float().abs() * o2.detach().abs()).sum().item()
    worst = {}
    for deterministic in (True, False):
        ins = [x.clone().requires_grad_() for x in (q, k, v)] + [lam.clone().requires_grad_()]
        out = diff_flash_attention(*ins, causal=causal, deterministic=deterministic)
        got = [out, *torch.autograd.grad(out, ins, do)]
        for name, a, b in zip(("out", "dq", "dk", "dv", "dlam"), got, want):
            scale = dlam_scale if name == "dlam" else b.abs().max().clamp_min(1.0).item()
            err = (a.float() - b).abs().max().item() / scale
            worst[name] = max(worst.get(name, 0.0), err)
    ok = max(worst.values()) < 3e-2
    detail = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    return ok, f"max rel err {detail}: {'ok' if ok else 'FAILED'}"


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_smoke_test:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--cpu-smoke-test needs TRITON_INTERPRET=1 in the environment (set before Triton loads)")
        args.seq_lens, args.head_dims, args.tokens, args.heads, args.kv_heads = "40", "32", 80, 2, None
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        sys.exit("attention_gpu.py needs a CUDA device, and torch.cuda.is_available() is False here "
                 "(--cpu-smoke-test runs the script's code paths on CPU without measuring anything).")
    from difftransformer import kernels

    if not kernels.triton_runs():
        sys.exit("attention_gpu.py needs Triton (pip install triton) for the fused kernel.")
    from difftransformer.kernels.diff_flash import diff_flash_attention

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    causal = not args.non_causal
    h = args.heads
    h_kv = args.kv_heads or h
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    began = time.monotonic()
    cpu_name = f"CPU (smoke test: timings mean nothing), torch {torch.__version__}"
    name = machine(torch.device("cuda")) if device == "cuda" else cpu_name
    print(f"device {name}, triton {triton.__version__}, {args.dtype}, "
          f"{'causal' if causal else 'non-causal'}, {args.tokens} tokens, DIFF {h} heads / {h_kv} kv groups, "
          f"baseline {2 * h} / {2 * h_kv}, median call of {args.rep_ms} ms of calls")

    fused_note = "(triton)"
    if not args.no_check:
        # In the interpreter the check runs in fp32 (no bf16 matmul there) at a tiny length.
        check_dtype, check_T = (dtype, 512) if device == "cuda" else (torch.float32, seq_lens[0])
        try:
            ok, message = check_fused(diff_flash_attention, check_dtype, device, 2, h, h_kv, check_T,
                                      head_dims[0], causal)
        except Exception as e:
            ok, message = False, f"raised {first_line(e)}"
        print(f"correctness check (fused, both backwards, vs SDPA in fp32; T {check_T}, d {head_dims[0]}): "
              f"{message}\n", flush=True)
        if not ok:
            fused_note = "(triton) CHECK FAILED"

    print("| T | d | B | layout | kernel | fwd ms | fwd TFLOP/s | fwd / (d) | fwd+bwd ms | fwd+bwd TFLOP/s "
          "| fwd+bwd / (d) | fwd+bwd host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for d in head_dims:
        for T in seq_lens:
            if args.time_limit and time.monotonic() - began > args.time_limit:
                print(f"(time limit of {args.time_limit:g} s reached: T {T}, d {d} and later shapes not measured)")
                break
            B = max(1, args.tokens // T)
            g = torch.Generator(device=device).manual_seed(T + d)

            def rnd(*shape):
                return torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_()

            q, k, v = rnd(B, 2 * h, T, d), rnd(B, 2 * h_kv, T, d), rnd(B, h_kv, T, 2 * d)
            lam = torch.tensor(0.5, device=device, requires_grad=True)
            do = torch.randn(B, h, T, 2 * d, device=device, dtype=dtype, generator=g)
            qb, kb, vb = rnd(B, 2 * h, T, d), rnd(B, 2 * h_kv, T, d), rnd(B, 2 * h_kv, T, d)
            dob = torch.randn(B, 2 * h, T, d, device=device, dtype=dtype, generator=g)

            flops = 4 * B * (2 * h) * T * T * d * (0.5 if causal else 1.0)
            diff_inputs = (q, k, v, lam)
            # The baseline first: every other row is printed as soon as it is measured, with its ratio.
            runs = [
                ("(d) baseline", True, lambda: baseline(qb, kb, vb, causal), (qb, kb, vb), dob, 1.0, 3.5),
                ("(a) fused", False, lambda: diff_flash_attention(q, k, v, lam, causal=causal),
                 diff_inputs, do, 1.5, 4.0),
                ("(a1) fused, one-pass bwd", False,
                 lambda: diff_flash_attention(q, k, v, lam, causal=causal, deterministic=False),
                 diff_inputs, do, 1.5, 4.0),
                ("(b) two-call", True, lambda: two_call(q, k, v, lam, causal), diff_inputs, do, 1.5, 4.0),
                ("(c) four-call", True, lambda: four_call(q, k, v, lam, causal), diff_inputs, do, 1.5, 4.0),
            ]
            base = None
            for name, on_sdpa, fn, inputs, grad_out, fw, fb in runs:
                try:
                    if on_sdpa:
                        times, kernel = measure_sdpa(fn, inputs, grad_out, args.warmup_ms, args.rep_ms)
                    else:
                        times, kernel = measure(fn, inputs, grad_out, args.warmup_ms, args.rep_ms), fused_note
                except Exception as e:  # keep the rest of the table: one broken layout is a row, not a crash
                    times, kernel = None, f"error: {first_line(e)}"
                if name.startswith("(d)"):
                    base = times
                print(table_row(T, d, B, name, kernel, times, fw * flops, fb * flops, base), flush=True)
            free_cached_memory()
        else:
            continue
        break  # the time limit was reached
    print(f"\n{HOST_BOUND}: the call's host time (queue drained first) is at least {HOST_SHARE:.0%} of its "
          "median time, so that time is the host's, not the kernels' (benchmarks/gpu_trace.py gives the "
          "kernels' own time)")
    print_tuning_choices()


HOST_BOUND, HOST_SHARE = "(host)", 0.9


def table_row(T, d, B, name, kernel, times, f_fwd, f_all, base):
    """One markdown row; times in ms, FLOPs per call, ratios to the baseline's times `base`. A
    fwd+bwd time that the host's enqueueing reaches (HOST_SHARE of it) is marked HOST_BOUND."""
    if times is None:
        return f"| {T} | {d} | {B} | {name} | {kernel} | OOM / n.a. | | | | | | |"
    t_f, t_fb, host = times
    r_f = f"{t_f / base[0]:.2f}x" if base else "-"
    r_fb = f"{t_fb / base[1]:.2f}x" if base else "-"
    mark = f" {HOST_BOUND}" if host >= HOST_SHARE * t_fb else ""
    return (f"| {T} | {d} | {B} | {name} | {kernel} | {t_f:.3f} | {f_fwd / t_f / 1e9:.1f} | {r_f} | "
            f"{t_fb:.3f}{mark} | {f_all / t_fb / 1e9:.1f} | {r_fb} | {host:.3f} |")


def print_tuning_choices():
    """The config the autotuner picked per kernel and key: what to keep when the tile lists in
    diff_flash.py are next revised (benchmarks/kernel_resources.py shows what each one costs)."""
    from difftransformer.kernels import diff_flash as df

    print("\nautotuner choices (key: HEAD_D, CAUSAL, IEEE, LEN_BUCKET, dtypes...):")
    for name in ("_diff_fwd_kernel", "_diff_bwd_dkdv_kernel", "_diff_bwd_dq_kernel", "_diff_bwd_dkdvq_kernel"):
        for key, config in getattr(getattr(df, name), "cache", {}).items():
            print(f"  {name} {key[:4]}: BLOCK_M, BLOCK_N, warps, stages[, split] = {df._tile(config)}")


if __name__ == "__main__":
    main()
