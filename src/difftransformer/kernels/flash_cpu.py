"""Fused flash attention for CPU, differential and ordinary: a C++ extension compiled on first use.

`diff_flash_attention_cpu` has the Triton kernel's contract (`diff_flash.py`): per DIFF head i
(kv group i // n_rep),

    out_i = (A1 - lam * A2) V,   A_c = softmax(Q_c K_c^T * scale + mask)

with q (B, 2h, T, d) striped, k (B, 2h_kv, S, d), v (B, h_kv, S, 2d). `flash_attention_cpu` is
ordinary GQA attention (q (B, H, T, d), k/v (B, H_kv, S, d)) from the same C++ template, so the
matched baseline runs through code of the same quality and DIFF/baseline ratios compare like
with like. Both: bottom-right causal masks, an optional (B, S) key-padding mask, zeros for a query
that sees no key, fp32 compute (other dtypes are upcast and the result cast back), deterministic.

Why it exists: PyTorch's CPU flash kernel needs equal q/k/v head dims, which costs the `sdpa`
backend 2x the baseline's attention FLOPs for DIFF; this kernel does 1.5x in the forward and 1.0x
in the backward (see `csrc/flash_cpu.cpp`).

The extension is built with `torch.utils.cpp_extension.load` (needs a C++ compiler and ninja,
both installed by `make venv`) into TORCH_EXTENSIONS_DIR and reused from there. If the build
fails, `is_available()` is False, `build_error()` says why, and backend 'auto' uses SDPA.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from difftransformer.kernels import token_major_empty

_SOURCE = Path(__file__).parent / "csrc" / "flash_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _capability_flags() -> list[str]:
    """Compile for the SIMD level PyTorch itself uses on this CPU (ATen's Vectorized<float>)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []  # portable build: Vectorized<float> falls back to plain loops


def _build() -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja lives next to this interpreter, maybe not on PATH
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    flags = ["-O3", "-fopenmp", "-DNDEBUG", *_capability_flags()]
    cpp_extension.load(name="difftransformer_flash_cpu", sources=[str(_SOURCE)], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], is_python_module=False,
                       verbose=os.environ.get("DIFFTRANSFORMER_VERBOSE_BUILD", "0") == "1")


def is_available() -> bool:
    """True once the extension is built and loaded (the first call builds it: about 10 s on a 2-core
    machine; then it is cached on disk)."""
    if "ok" in _state:
        return bool(_state["ok"])
    if torch.compiler.is_compiling():  # never build inside a trace; the first eager call does
        return False
    with _lock:
        if "ok" not in _state:
            if os.environ.get("DIFFTRANSFORMER_DISABLE_CPU_KERNEL", "0") == "1":
                _state["ok"], _state["error"] = False, "disabled by DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1"
            else:
                try:
                    _build()
                    _register_fakes()
                    _state["ok"], _state["error"] = True, None
                except Exception as exc:  # no compiler, no ninja, a failed build: fall back
                    _state["ok"], _state["error"] = False, f"{type(exc).__name__}: {exc}"
        return bool(_state["ok"])


def build_error() -> str | None:
    """Why the extension is unavailable (None when it loaded or was never tried)."""
    return _state.get("error")  # type: ignore[return-value]


def _require() -> None:
    if is_available():
        return
    if "ok" not in _state:  # only possible while torch.compile traces
        raise RuntimeError("the fused CPU kernel is not built yet and cannot be built while torch.compile "
                           "traces; call difftransformer.kernels.flash_cpu.is_available() once before compiling")
    raise RuntimeError(f"the fused CPU kernel could not be built ({build_error()}); use backend='sdpa', "
                       "or install a C++ compiler and ninja (`make venv` does) and retry")


def _register_fakes() -> None:
    """Shape-only versions so torch.compile can trace through the ops."""

    @torch.library.register_fake("difftransformer_cpu::diff_flash_fwd")
    def _(q, k, v, lam, causal, scale, key_mask):
        B, two_h, T, d = q.shape
        h = two_h // 2
        return token_major_empty(q, h, 2 * d), token_major_empty(q, h, 2 * d), q.new_empty(2, B, h, T)

    @torch.library.register_fake("difftransformer_cpu::diff_flash_bwd")
    def _(dout, q, k, v, lam, lse, drow, causal, scale, key_mask):
        B, two_h, T, d = q.shape
        h, S = two_h // 2, k.shape[2]
        return token_major_empty(q, two_h, d), q.new_empty(B, h, 2, S, d), q.new_empty(B, h, S, 2 * d)

    @torch.library.register_fake("difftransformer_cpu::flash_fwd")
    def _(q, k, v, causal, scale, key_mask):
        B, H, T, d = q.shape
        return token_major_empty(q, H, d), q.new_empty(B, H, T)

    @torch.library.register_fake("difftransformer_cpu::flash_bwd")
    def _(dout, q, k, v, lse, drow, causal, scale, key_mask):
        B, H, T, d = q.shape
        S = k.shape[2]
        return token_major_empty(q, H, d), q.new_empty(B, H, 1, S, d), q.new_empty(B, H, S, d)


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads any (batch, head) strides; each (length, dim) slice goes to BLAS as a matrix,
    so its rows must be dense, must not overlap (no broadcast length axis) and their stride must
    fit in 32 bits. Otherwise copy. (`.contiguous()` would keep odd strides of size-1 dims.)"""
    if t.numel() == 0 or (t.stride(-1) == 1 and max(t.shape[-1], 1) <= t.stride(-2) < 2**31):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _sum_over_group(dk_h, dv_h, k):
    """Per-query-head dk (B, h, C, S, d) and dv (B, h, S, C d) summed over each kv group's heads."""
    B, h, C, S, d = dk_h.shape
    h_kv = k.shape[1] // C
    n_rep = h // h_kv
    dk = dk_h.view(B, h_kv, n_rep, C, S, d).sum(2).view(B, C * h_kv, S, d)
    dv = dv_h.view(B, h_kv, n_rep, S, C * d).sum(2)
    return dk, dv


class DiffFlashAttentionCPU(torch.autograd.Function):
    """Saves A2 V and both maps' log-sum-exps (2, B, h, T); the backward returns dq, dk, dv and
    dlam = -sum(dO * A2 V)."""

    @staticmethod
    def forward(ctx, q, k, v, lam, key_mask, causal: bool, scale: float):
        out, o2, lse = torch.ops.difftransformer_cpu.diff_flash_fwd(q, k, v, lam, causal, scale, key_mask)
        ctx.save_for_backward(q, k, v, lam, out, o2, lse, key_mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: say so instead of a wrong answer
    def backward(ctx, dout):
        q, k, v, lam, out, o2, lse, key_mask = ctx.saved_tensors
        dout = _dense_rows(dout)
        r2 = (dout * o2).sum(-1)  # rowsum(dO * A2 V)
        d1 = (dout * out).sum(-1) + lam * r2  # rowsum(dO * A1 V), as A1 V = out + lam A2 V
        dq, dk_h, dv_h = torch.ops.difftransformer_cpu.diff_flash_bwd(
            dout, q, k, v, lam, lse, torch.stack((d1, r2)), ctx.causal, ctx.scale, key_mask)
        dk, dv = _sum_over_group(dk_h, dv_h, k)
        return dq, dk, dv, -r2.sum(), None, None, None


class FlashAttentionCPU(torch.autograd.Function):
    """Ordinary attention: saves out and the log-sum-exp, like any flash attention."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, causal: bool, scale: float):
        out, lse = torch.ops.difftransformer_cpu.flash_fwd(q, k, v, causal, scale, key_mask)
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        dout = _dense_rows(dout)
        drow = (dout * out).sum(-1)  # rowsum(dO * A V)
        dq, dk_h, dv_h = torch.ops.difftransformer_cpu.flash_bwd(
            dout, q, k, v, lse, drow, ctx.causal, ctx.scale, key_mask)
        dk, dv = _sum_over_group(dk_h, dv_h, k)
        return dq, dk, dv, None, None, None


def _prepare(q, k, v, key_padding_mask, scale):
    _require()
    f = torch.float32
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool).contiguous()
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return (*(_dense_rows(t.to(f)) for t in (q, k, v)), mask, scale)


def diff_flash_attention_cpu(q, k, v, lam, *, causal: bool = True, key_padding_mask=None,
                             scale: float | None = None):
    """(softmax(Q1 K1^T s) - lam * softmax(Q2 K2^T s)) V for every DIFF head on CPU, fused.

    Shapes as in `difftransformer.attention.functional`; lam is a 0-d fp32 tensor (it gets a
    gradient). Returns (B, h, T, 2d) in q's dtype.
    """
    dtype = q.dtype
    q, k, v, mask, scale = _prepare(q, k, v, key_padding_mask, scale)
    lam = torch.as_tensor(lam, dtype=torch.float32, device=q.device)
    return DiffFlashAttentionCPU.apply(q, k, v, lam, mask, bool(causal), scale).to(dtype)


def flash_attention_cpu(q, k, v, *, causal: bool = True, key_padding_mask=None, scale: float | None = None):
    """softmax(Q K^T s) V for every head on CPU, GQA included: q (B, H, T, d), k/v (B, H_kv, S, d)."""
    dtype = q.dtype
    q, k, v, mask, scale = _prepare(q, k, v, key_padding_mask, scale)
    return FlashAttentionCPU.apply(q, k, v, mask, bool(causal), scale).to(dtype)
