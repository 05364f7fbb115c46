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
backend 2x the baseline's attention FLOPs for DIFF; this kernel does 1.5x in the training forward
and 1.0x in the backward (see `csrc/flash_cpu.cpp`). Without a gradient, forward-only paths merge a
DIFF head's two maps before P V, so DIFF costs what the baseline costs: decoding (few queries) splits
the keys across threads, and a prefill or evaluation forward keeps each query block's scores
(`decode_path_applies` and `infer_path_applies` state when).

The extension is built with `torch.utils.cpp_extension.load` (needs a C++ compiler and ninja,
both installed by `make venv`) into TORCH_EXTENSIONS_DIR and reused from there, once per process:
`build()` builds and loads it or raises; `is_available()` answers whether it runs here (building it
on its first call, never raising); `build_error()` says why not; `loaded_module()` is the loaded
module or None and never builds. Where it does not build, backend 'auto' uses SDPA.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from difftransformer.kernels import ops_observed, token_major_empty

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
    """Compile (or load the cached build of) the extension into `_state["module"]`; raises what the build raises."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja lives next to this interpreter, maybe not on PATH
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    flags = ["-O3", "-fopenmp", "-DNDEBUG", *_capability_flags()]
    # A Python module as well as a library of torch ops: the decode ops are also plain functions of it
    # (`_decode_op`); loading it registers the ops (TORCH_LIBRARY) as a library would.
    # A load that outlasts BUILD_NOTICE_AFTER_S is a compilation: say so, once.
    notice = threading.Timer(BUILD_NOTICE_AFTER_S, _build_notice)
    notice.daemon = True
    notice.start()
    try:
        _state["module"] = cpp_extension.load(
                           name="difftransformer_flash_cpu", sources=[str(_SOURCE)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], is_python_module=True,
                           verbose=os.environ.get("DIFFTRANSFORMER_VERBOSE_BUILD", "0") == "1")
    finally:
        notice.cancel()


BUILD_NOTICE_AFTER_S = 1.0  # a load slower than this is a compilation: one line on stderr says what is happening


def _build_notice() -> None:
    print("difftransformer: compiling the fused CPU attention kernel (C++, once per machine, 10-40 s; cached in "
          "TORCH_EXTENSIONS_DIR; DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1 skips it)", file=sys.stderr, flush=True)


def build() -> None:
    """Build and load the extension, once per process (then it is cached on disk and loaded from there).

    Raises RuntimeError, one line naming the cause and the fix, where it cannot be built here: no compiler
    or ninja, a failed compilation, DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1, or a call while torch.compile
    traces (no build can happen inside a trace). A failure is remembered: later calls raise it again
    without retrying."""
    if "ok" not in _state:
        if torch.compiler.is_compiling():
            raise RuntimeError("the fused CPU kernel is not built yet and cannot be built while torch.compile "
                               "traces; call difftransformer.kernels.flash_cpu.build() once before compiling")
        with _lock:
            if "ok" not in _state:
                _state["ok"], _state["error"] = _try_build()
    if not _state["ok"]:
        why = str(build_error())
        if "\n" in why:
            why = why.split("\n", 1)[0] + " ... (all of it: flash_cpu.build_error())"
        raise RuntimeError(f"the fused CPU kernel could not be built ({why}); use backend='sdpa', "
                           "or install a C++ compiler and ninja (`make venv` does) and retry")


def _try_build() -> tuple[bool, str | None]:
    """(built, why not): the outcome of one attempt to build and load the extension."""
    if os.environ.get("DIFFTRANSFORMER_DISABLE_CPU_KERNEL", "0") == "1":
        return False, "disabled by DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1"
    try:
        _build()
        _register_fakes()
    except Exception as exc:  # no compiler, no ninja, a failed build: the caller falls back or says why
        return False, f"{type(exc).__name__}: {exc}"
    return True, None


def is_available() -> bool:
    """Whether the extension runs here. The first call in a process builds it (`build()`) and the answer
    is kept for the process; it never raises. Inside a torch.compile trace, before any build was tried,
    it answers False without building (the first eager call builds)."""
    if "ok" not in _state:
        if torch.compiler.is_compiling():
            return False
        try:
            build()
        except RuntimeError:
            pass
    return bool(_state["ok"])


def build_error() -> str | None:
    """Why the extension is unavailable (None when it loaded or was never tried)."""
    return _state.get("error")  # type: ignore[return-value]


def loaded_module():
    """The extension module once `build()` has loaded it in this process, else None; never builds. Its
    functions are the ops' C++ functions without the dispatcher (see `_decode_op`)."""
    return _state["module"] if _state.get("ok") is True else None


def _require() -> None:
    if _state.get("ok") is not True:
        build()


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

    @torch.library.register_fake("difftransformer_cpu::diff_flash_decode")
    def _(q, k, v, lam, causal, scale, key_mask, norm_weight, norm_eps):
        return token_major_empty(q, q.shape[1] // 2, 2 * q.shape[3])

    @torch.library.register_fake("difftransformer_cpu::diff_flash_infer")
    def _(q, k, v, lam, causal, scale, key_mask, norm_weight, norm_eps):
        return token_major_empty(q, q.shape[1] // 2, 2 * q.shape[3])

    @torch.library.register_fake("difftransformer_cpu::flash_decode")
    def _(q, k, v, causal, scale, key_mask):
        return token_major_empty(q, q.shape[1], q.shape[3])


# The forward paths' rule, stated once. `csrc/flash_cpu.cpp` has three forward paths:
#   training  one task per (batch, head, 64-query block), each walking all keys with an online
#             softmax per map; saves what the backward needs (log-sum-exps, A2 V), and multiplies
#             both DIFF maps with V (1.5x the baseline's attention FLOPs);
#   decode    one task per (batch, kv group, 128-key split), all the group's query rows scored in
#             one matrix, partial softmaxes combined afterwards (flash-decoding); forward only;
#   infer     (DIFF only) the training path's tasks, but each keeps its rows' scores over all the
#             keys they see, so both maps' softmaxes are exact before P V and merge into one row
#             A1 - lam A2: one P V product, the baseline's attention FLOPs; forward only.
# Only the training path keeps anything for a backward, so under grad (a training step, or any input
# that requires grad) it always runs. Otherwise: decode when the group's query rows fit one query
# block, n_rep * T <= DECODE_MAX_ROWS (64, the training path's block: then the training path has at
# most B * h tasks, each reading the whole cache, while the decode path reads each key once and has
# more tasks the longer the cache is); else, for DIFF, infer while S <= INFER_MAX_KEYS (its kept
# scores, 2 x 64 x S floats per thread, stay within 32 MB); else training. Every path computes the
# same function within fp32 rounding (tests/kernels/test_flash_cpu_decode.py).
DECODE_MAX_ROWS = 64
INFER_MAX_KEYS = 65536


def _no_grad_wanted(inputs) -> bool:
    return not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))


def decode_path_applies(q: torch.Tensor, k: torch.Tensor, *inputs) -> bool:
    """True when `csrc/flash_cpu.cpp`'s decode path computes this call (the rule above): q (B, C h,
    T, d) and k (B, C h_kv, S, d); `inputs`: every tensor a gradient could flow to (q, k, v, lam)."""
    return q.shape[2] * (q.shape[1] // max(k.shape[1], 1)) <= DECODE_MAX_ROWS and _no_grad_wanted(inputs)


def infer_path_applies(q: torch.Tensor, k: torch.Tensor, *inputs) -> bool:
    """True when a DIFF call that the decode path does not take runs the inference path (the rule
    above); arguments as for `decode_path_applies`."""
    return (not decode_path_applies(q, k, *inputs) and k.shape[2] <= INFER_MAX_KEYS
            and _no_grad_wanted(inputs))


def _decode_op(name: str):
    """The decode op `name` ('flash_decode' or 'diff_flash_decode') as this call should reach it: the
    extension module's plain function (pybind11), the same C++ function as torch.ops' without the
    dispatcher, which boxes every argument into an IValue and the result back; torch.ops' op when
    something must see the call (`kernels.ops_observed`). For callers past `_prepare`, which built the extension."""
    return getattr(torch.ops.difftransformer_cpu if ops_observed() else _state["module"], name)


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads any (batch, head) strides; each (length, dim) slice goes to BLAS as a matrix,
    so its rows must be dense, must not overlap (no broadcast length axis) and their stride must
    fit in 32 bits. Otherwise copy. (`.contiguous()` would keep odd strides of size-1 dims.)"""
    stride = t.stride()  # one call: this runs for every input of every general-route call
    if (stride[-1] == 1 and max(t.shape[-1], 1) <= stride[-2] < 2**31) or t.numel() == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)  # skips `.to`'s argument parsing


def _cast_back(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out if dtype == torch.float32 else out.to(dtype)


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
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool).contiguous()
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return _dense_rows(_fp32(q)), _dense_rows(_fp32(k)), _dense_rows(_fp32(v)), mask, scale


def _rms_norm(out: torch.Tensor, out_norm) -> torch.Tensor:
    """RMSNorm of each output row with weight out_norm[0] and eps out_norm[1], in fp32, cast back."""
    weight, eps = out_norm
    return F.rms_norm(out.float(), (out.shape[-1],), weight.float(), float(eps)).to(out.dtype)


def diff_flash_attention_cpu(q, k, v, lam, *, causal: bool = True, key_padding_mask=None,
                             scale: float | None = None, out_norm=None):
    """(softmax(Q1 K1^T s) - lam * softmax(Q2 K2^T s)) V for every DIFF head on CPU, fused.

    Shapes as in `difftransformer.attention.functional`; lam is a 0-d fp32 tensor (it gets a
    gradient). Returns (B, h, T, 2d) in q's dtype. out_norm: None, or (weight (2d,), eps) for an
    RMSNorm of each head's output row (DIFF's head norm), applied inside the decode path's combine
    pass for fp32 inputs (the layer then runs no separate norm op), else after the kernel.
    """
    dtype = q.dtype
    q, k, v, mask, scale = _prepare(q, k, v, key_padding_mask, scale)
    if not (isinstance(lam, torch.Tensor) and lam.dtype == torch.float32):
        lam = torch.as_tensor(lam, dtype=torch.float32, device=q.device)
    weight = None if out_norm is None else out_norm[0]
    inputs = (q, k, v, lam, weight)
    forward_only = (_decode_op("diff_flash_decode") if decode_path_applies(q, k, *inputs) else
                    torch.ops.difftransformer_cpu.diff_flash_infer if infer_path_applies(q, k, *inputs) else None)
    if forward_only is not None:
        fused = weight is not None and dtype == torch.float32  # fp16/bf16: round, then norm, as unfused
        out = _cast_back(forward_only(q, k, v, lam, bool(causal), scale, mask,
                                      _fp32(weight).contiguous() if fused else None,
                                      float(out_norm[1]) if fused else 0.0), dtype)
        return out if fused or out_norm is None else _rms_norm(out, out_norm)
    out = _cast_back(DiffFlashAttentionCPU.apply(q, k, v, lam, mask, bool(causal), scale), dtype)
    return out if out_norm is None else _rms_norm(out, out_norm)


def flash_attention_cpu(q, k, v, *, causal: bool = True, key_padding_mask=None, scale: float | None = None):
    """softmax(Q K^T s) V for every head on CPU, GQA included: q (B, H, T, d), k/v (B, H_kv, S, d)."""
    dtype = q.dtype
    q, k, v, mask, scale = _prepare(q, k, v, key_padding_mask, scale)
    if decode_path_applies(q, k, q, k, v):
        return _cast_back(_decode_op("flash_decode")(q, k, v, bool(causal), scale, mask), dtype)
    return _cast_back(FlashAttentionCPU.apply(q, k, v, mask, bool(causal), scale), dtype)
