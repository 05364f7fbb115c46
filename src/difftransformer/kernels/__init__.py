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
# mode, a torch dispatch mode (fake tensors, FLOP counters), and a torch.compile trace. torch has no
# public test for the two modes, so `ops_observed` reads private hooks of torch._C, on the releases
# they were checked with only (up to OBSERVER_HOOKS_CHECKED_UP_TO; the package's floor is torch 2.4).
# On a newer torch, or one that lacks a hook, every call counts as observed: the ops then run through
# the dispatcher, which is correct, only slower. tests/kernels/test_flash_cpu_decode.py fails on such a
# torch (`OBSERVER_HOOKS_USED`) and checks under each observer that the hooks see it.
OBSERVER_HOOKS_CHECKED_UP_TO = (2, 13)
_HOOK_NAMES = ("_is_tracing", "_is_torch_function_mode_enabled", "_len_torch_dispatch_stack")


def _observer_hooks() -> tuple | None:
    """torch's private observer hooks (`_HOOK_NAMES`), or None where one is missing or this torch is newer
    than the last release they were checked with."""
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    hooks = tuple(getattr(torch._C, name, None) for name in _HOOK_NAMES)
    return None if release > OBSERVER_HOOKS_CHECKED_UP_TO or None in hooks else hooks


_HOOKS = _observer_hooks()
OBSERVER_HOOKS_USED = _HOOKS is not None
_is_tracing, _function_mode, _dispatch_depth = _HOOKS or (None, None, None)


def ops_observed() -> bool:
    """True when something must see the kernels' custom-op calls rather than their Python bodies (see
    above), and always where the hooks are not used. A no-gradient call may skip the op's dispatch only
    when this is False."""
    if _is_tracing is None:
        return True
    return bool(torch.compiler.is_compiling() or _is_tracing() or _function_mode() or _dispatch_depth())


__all__ = ["OBSERVER_HOOKS_USED", "ops_observed", "token_major_empty", "triton_runs"]
