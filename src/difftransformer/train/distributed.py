"""Process groups, devices and parallel wrappers (DDP / FSDP2), kept apart from the training loop.

torchrun (or a test's mp.spawn) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, which
`difftransformer.dist` reads (the one rank helper). With WORLD_SIZE > 1 we join a process group
(gloo on CPU, nccl on CUDA); otherwise everything here degrades to single-process no-ops, so the
loop has a single code path. `DistEnv` is what the loop holds: rank, world size and its device.

The group we create lives until the process exits (destroyed by an atexit hook), not until train()
returns: a script that trains several arms in one torchrun launch would otherwise re-rendezvous on
the same MASTER_PORT while a slower rank still serves the old group's store, and hang.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from difftransformer import dist as ranks

log = logging.getLogger("difftransformer.train")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t



def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (also run at interpreter exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """'auto' -> cuda (this process's local GPU) if available, else cpu."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={spec!r} was requested but CUDA is not available here; use device 'cpu' or "
                             f"'auto' (--set train.device=auto)")
        index = int(spec.split(":", 1)[1]) if ":" in spec else local_rank % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device(spec)


def init_distributed(device_spec: str, timeout_min: float) -> DistEnv:
    """Read the torchrun environment and join (or reuse) the process group. timeout_min: how long a collective
    waits for every rank (the backends' defaults, 10 min for NCCL and 30 for gloo, fail a run whose rank 0 writes a
    large checkpoint or evaluates a study's units for longer while the others wait)."""
    world_size, rank, local_rank = ranks.world_size(), ranks.rank(), ranks.local_rank()
    device = resolve_device(device_spec, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_min))
        atexit.register(shutdown_distributed)
        log.info("joined process group: rank %d of %d, backend %s, device %s", rank, world_size, backend, device)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return DistEnv(rank=ranks.rank(), world_size=ranks.world_size(), local_rank=local_rank, device=device)


def apply_activation_checkpointing(blocks: nn.ModuleList) -> None:
    """Recompute each block's activations in backward instead of storing them.

    The block's forward is replaced on the instance, so parameter names (and checkpoints) stay the
    same as without it; remove_activation_checkpointing undoes it.
    """
    for block in blocks:
        original = type(block).forward.__get__(block)

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def remove_activation_checkpointing(blocks: nn.ModuleList) -> None:
    for block in blocks:
        block.__dict__.pop("forward", None)


def wrap_model(model: nn.Module, env: DistEnv, fsdp: bool) -> nn.Module:
    """DDP, or FSDP2 (fully_shard each decoder block, then the root), when distributed."""
    if not env.distributed:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def no_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on accumulation micro-steps that are not the last one."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_model_state(model: nn.Module, fsdp: bool, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model state dict (a collective under FSDP: call it on every rank). rank0_only: under FSDP
    only rank 0 gets it, in host memory, the others an empty dict (a checkpoint, which rank 0 alone writes: no
    rank holds the whole model on its device beside its shards)."""
    if not fsdp or not dist.is_initialized():
        return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def full_optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Optimizer state keyed by parameter name, unsharded (collective under FSDP), for a checkpoint: under FSDP on
    rank 0 only, in host memory (the other ranks get empty state)."""
    from difftransformer.train.checkpoint import optimizer_state_by_name

    if not fsdp or not dist.is_initialized():
        return optimizer_state_by_name(optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
    if not osd:  # a rank other than 0
        return {}
    # DCP keys state and param groups by fully qualified name already; keep our "names" key in step.
    groups = [{**g, "names": list(g["params"])} for g in osd["param_groups"]]
    return {"state": osd["state"], "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, named, fsdp: bool) -> None:
    from difftransformer.train.checkpoint import load_optimizer_state_by_name

    if not fsdp or not dist.is_initialized():
        load_optimizer_state_by_name(optimizer, named)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))
