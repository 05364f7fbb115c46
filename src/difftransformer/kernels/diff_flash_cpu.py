"""Fused differential flash attention for CPU: a C++ extension compiled on first use.

Same contract as the Triton kernel (`diff_flash.py`): per DIFF head i (kv group i // n_rep),

    out_i = (A1 - lam * A2) V,   A_c = softmax(Q_c K_c^T * scale + mask)

with q (B, 2h, T, d) striped, k (B, 2h_kv, S, d), v (B, h_kv, S, 2d), bottom-right causal masks,
an optional (B, S) key-padding mask, and zeros for a query that sees no key. It exists because
PyTorch's CPU flash kernel needs equal q/k/v head dims, which costs the `sdpa` backend 2x the
baseline's attention FLOPs; this kernel does 1.5x in the forward and 1.0x in the backward
(see `csrc/diff_flash_cpu.cpp`). It computes in fp32; other dtypes are upcast and the result cast
back.

The extension is built with `torch.utils.cpp_extension.load` (needs a C++ compiler and ninja,
both installed by `make venv`) into TORCH_EXTENSIONS_DIR and reused from there. If the build
fails, `is_available()` is False, the reason is in `build_error()`, and backend 'auto' uses SDPA.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "diff_flash_cpu.cpp"
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
    cpp_extension.load(name="difftransformer_diff_flash_cpu", sources=[str(_SOURCE)], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], is_python_module=False,
                       verbose=os.environ.get("DIFFTRANSFORMER_VERBOSE_BUILD", "0") == "1")


def is_available() -> bool:
    """True once the extension is built and loaded (the first call builds it, ~10-60 s; cached on disk)."""
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
    if not is_available():
        raise RuntimeError(f"the fused CPU kernel could not be built ({build_error()}); use backend='sdpa', "
                           "or install a C++ compiler and ninja (`make venv` does) and retry")


def _register_fakes() -> None:
    """Shape-only versions so torch.compile can trace through the ops."""

    @torch.library.register_fake("difftransformer_cpu::diff_flash_fwd")
    def _(q, k, v, lam, causal, scale, key_mask):
        B, two_h, T, d = q.shape
        out = q.new_empty(B, T, two_h // 2, 2 * d).transpose(1, 2)
        lse = q.new_empty(B, two_h // 2, T)
        return out, torch.empty_like(out), lse, torch.empty_like(lse)

    @torch.library.register_fake("difftransformer_cpu::diff_flash_bwd")
    def _(dout, q, k, v, lam, lse1, lse2, d1, d2, causal, scale, key_mask):
        B, two_h, T, d = q.shape
        h, S = two_h // 2, k.shape[2]
        dq = q.new_empty(B, T, two_h, d).transpose(1, 2)
        return dq, q.new_empty(B, h, 2, S, d), q.new_empty(B, h, S, 2 * d)


class DiffFlashAttentionCPU(torch.autograd.Function):
    """Autograd glue: saves out's factor A2 V and the two log-sum-exps; the backward reduces the
    per-head dk, dv over each kv group and returns dlam = -sum(dO * A2 V)."""

    @staticmethod
    def forward(ctx, q, k, v, lam, key_mask, causal: bool, scale: float):
        out, o2, lse1, lse2 = torch.ops.difftransformer_cpu.diff_flash_fwd(q, k, v, lam, causal, scale, key_mask)
        ctx.save_for_backward(q, k, v, lam, out, o2, lse1, lse2, key_mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lam, out, o2, lse1, lse2, key_mask = ctx.saved_tensors
        dout = _dense_rows(dout)
        r2 = (dout * o2).sum(-1)  # rowsum(dO * A2 V)
        d1 = (dout * out).sum(-1) + lam * r2  # rowsum(dO * A1 V), as A1 V = out + lam A2 V
        dq, dk_h, dv_h = torch.ops.difftransformer_cpu.diff_flash_bwd(
            dout, q, k, v, lam, lse1, lse2, d1, r2, ctx.causal, ctx.scale, key_mask)
        B, h_kv, S, d = k.shape[0], k.shape[1] // 2, k.shape[2], k.shape[3]
        n_rep = q.shape[1] // 2 // h_kv
        dk = dk_h.view(B, h_kv, n_rep, 2, S, d).sum(2).view(B, 2 * h_kv, S, d)
        dv = dv_h.view(B, h_kv, n_rep, S, 2 * d).sum(2)
        return dq, dk, dv, -r2.sum(), None, None, None


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads any (batch, head, length) strides; only the last dim must be dense."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def diff_flash_attention_cpu(q, k, v, lam, *, causal: bool = True, key_padding_mask=None,
                             scale: float | None = None):
    """(softmax(Q1 K1^T s) - lam * softmax(Q2 K2^T s)) V for every DIFF head on CPU, fused.

    Shapes as in `difftransformer.attention.functional`; lam is a 0-d fp32 tensor (it gets a
    gradient). Returns (B, h, T, 2d) in q's dtype.
    """
    _require()
    d = q.shape[-1]
    scale = float(d ** -0.5 if scale is None else scale)
    dtype = q.dtype
    f = torch.float32
    lam = torch.as_tensor(lam, dtype=f, device=q.device)
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool).contiguous()
    q, k, v = (_dense_rows(t.to(f)) for t in (q, k, v))
    out = DiffFlashAttentionCPU.apply(q, k, v, lam, mask, bool(causal), scale)
    return out.to(dtype)
