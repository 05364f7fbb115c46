"""Subnormal floats on CPU: flushed to zero by the CLI and during `train()`, unless asked to keep them.

A model that has learned a task sharply puts softmax weights of e^-88 and less on what it ignores; in
float32 those are subnormal numbers (below 2^-126 = 1.2e-38), and x86 cores compute with them through a slow
microcode assist. The Transformer of the max-retrieval study, converged, took 10.7x as long per training step
with them as without (docs/benchmarks.md, "Subnormal floats"). Flushing them (the FTZ and DAZ bits of MXCSR:
results and inputs below 2^-126 read as 0) removes the assist. Added to a number above 2^-102 (2e-31) such a
number changes nothing in float32, so only a computation made of such tiny numbers reads differently.

The bits are per thread, and a thread inherits them from the thread that creates it: set before torch
starts its intra-op threads they hold in all of them, set later in the calling thread only. So the CLI runs
every command inside `denormals_flushed()`, entered before anything else, and `train()` runs inside it for
library callers (where torch's threads may exist already, it reaches the calling thread alone); each restores
the mode it found. CUDA is untouched: GPU kernels choose per instruction.

DIFFTRANSFORMER_KEEP_DENORMALS=1 keeps them (IEEE arithmetic, as results before 2026-11-29 were computed).
Studies record the mode with the machine (`experiments.provenance.hardware`, key "denormals").

This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

KEEP_ENV = "DIFFTRANSFORMER_KEEP_DENORMALS"  # set to 1 to compute with subnormal floats on CPU (slow, IEEE)
_OFF = ("", "0", "false", "no", "off")

_flushed = False


def keep_requested() -> bool:
    """Whether DIFFTRANSFORMER_KEEP_DENORMALS asks to keep subnormal floats (1, true, yes...)."""
    return os.environ.get(KEEP_ENV, "").strip().lower() not in _OFF


def flush_denormals() -> bool:
    """Flush subnormal floats to zero on CPU in this thread and the threads it starts from now on, unless
    DIFFTRANSFORMER_KEEP_DENORMALS asks to keep them; True when they are flushed. Idempotent. On a CPU
    without the flags (torch.set_flush_denormal returns False there) nothing changes and this returns False."""
    global _flushed
    _flushed = False if keep_requested() else bool(torch.set_flush_denormal(True))
    return _flushed


@contextlib.contextmanager
def denormals_flushed() -> Iterator[bool]:
    """Subnormal floats flushed (as `flush_denormals`) for the body; the mode found is restored after it when this
    set it. Yields whether they are flushed."""
    if _flushed:
        yield True
        return
    try:
        yield flush_denormals()
    finally:
        if _flushed:
            _unflush()


def _unflush() -> None:
    global _flushed
    torch.set_flush_denormal(False)
    _flushed = False


def denormals_mode() -> str:
    """'flushed' or 'kept': how this process computes on CPU, for the record of a measurement."""
    return "flushed" if _flushed else "kept"


__all__ = ["KEEP_ENV", "denormals_flushed", "denormals_mode", "flush_denormals", "keep_requested"]
