"""Who this process is in a (possibly) distributed run: the one place that answers "am I rank 0?".

torchrun (or a test's mp.spawn) sets RANK, WORLD_SIZE and LOCAL_RANK before the process group
exists; once `torch.distributed` is initialised it is the authority. Code that only needs to know
whether to write files or print (the CLI, data preparation, the comparison runner) asks here, before
or after the group is joined, and gets the same answer the training loop gets.

This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as torch_dist


def _initialised() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's global rank: the process group's if joined, else $RANK, else 0."""
    return torch_dist.get_rank() if _initialised() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of processes: the process group's if joined, else $WORLD_SIZE, else 1."""
    return torch_dist.get_world_size() if _initialised() else int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its machine ($LOCAL_RANK, else the global rank): its GPU index."""
    return int(os.environ.get("LOCAL_RANK", str(rank())))


def is_device_name(device: object, *, auto: bool = False) -> bool:
    """Whether `device` names a device this package runs on: 'cpu', 'cuda' or 'cuda:N' (and 'auto' where
    `auto`). The one check behind every --device and config device: torch's own error for a name like
    'tpu' is a traceback listing twenty device types."""
    names = r"cpu|cuda(:\d+)?" + (r"|auto" if auto else "")
    return isinstance(device, str) and re.fullmatch(names, device) is not None


def is_main() -> bool:
    """True on the one process that writes files, logs at INFO and prints results (rank 0)."""
    return rank() == 0


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) gathered into a plain tensor; a plain tensor passes through.

    Gathering is a collective: under FSDP every rank must call this for the same tensors.
    """
    return t.full_tensor() if hasattr(t, "full_tensor") else t
