"""Fused attention kernels: `diff_flash` (Triton, differential attention) and `flash_cpu` (C++, CPU).

Triton is optional: check `triton_runs()` before importing `diff_flash`.

    from difftransformer import kernels
    if kernels.triton_runs():
        from difftransformer.kernels.diff_flash import diff_flash_attention

This package imports nothing else of difftransformer.
"""

import importlib.util
import os

import torch


def triton_runs() -> bool:
    """True when Triton is importable and can run here: a CUDA device, or TRITON_INTERPRET=1 (CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install is as good as none
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    return torch.cuda.is_available()


def token_major_empty(q, heads: int, width: int):
    """An uninitialised (B, heads, T, width) output stored as (B, T, heads, width), as the fused
    kernels write it: the caller's transpose(1, 2).reshape(B, T, heads * width) before the output
    projection is then free."""
    B, _, T, _ = q.shape
    return q.new_empty(B, T, heads, width).transpose(1, 2)


# What must see a kernel's op call rather than its Python body: a torch.jit trace, a torch function
# mode, a torch dispatch mode (fake tensors, FLOP counters), and a torch.compile trace. Bound once;
# flash_cpu's decoding route tests them inline (one Python frame less per layer and token).
_is_tracing = torch._C._is_tracing
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_depth = torch._C._len_torch_dispatch_stack


def ops_observed() -> bool:
    """True when something must see the kernels' custom-op calls rather than their Python bodies (see
    above). A no-gradient call may skip the op's dispatch only when this is False."""
    return bool(torch.compiler.is_compiling() or _is_tracing() or _function_mode() or _dispatch_depth())


__all__ = ["ops_observed", "token_major_empty", "triton_runs"]
