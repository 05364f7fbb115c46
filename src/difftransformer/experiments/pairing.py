"""Paired initialisation: DIFF and baseline arms that start from the same weights wherever they can.

A study of two architectures trained from different random draws mixes the architecture's
effect with init noise. Building each model with the same seed is not enough (DIFF draws its λ
vectors mid-construction, shifting every later draw), so every parameter whose name and shape match
the first config's model is copied from it: embeddings, FFN, norms, LM head and q/k/v/out projections.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from difftransformer.model import DiffTransformerConfig, DiffTransformerLM

log = logging.getLogger("difftransformer.experiments")


@dataclass
class PairedInit:
    """One state dict per config, and what was shared.

    `states[i]`: model i's initial weights; a caller may drop one (set it to None) once used.
    `shared[i]`: names copied from config 0's model into model i (all names for i = 0);
    `own[i]`: names left at model i's own seeded init (missing from model 0 or another shape).
    Indexing, assignment, iteration, unpacking and len() act on `states`."""

    states: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    shared: list[list[str]] = field(default_factory=list)
    own: list[list[str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor] | None:
        return self.states[i]

    def __setitem__(self, i: int, state: dict[str, torch.Tensor] | None) -> None:
        self.states[i] = state

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | None]:
        return iter(self.states)


def paired_init(configs: list[DiffTransformerConfig], seed: int) -> PairedInit:
    """State dicts for `configs`, each built with torch.manual_seed(seed), shared params copied from the first."""
    if not configs:
        raise ValueError("paired_init needs at least one config")
    states: list[dict[str, torch.Tensor]] = []
    for cfg in configs:
        torch.manual_seed(seed)
        states.append({k: v.detach().clone() for k, v in DiffTransformerLM(cfg).state_dict().items()})
    result = PairedInit()
    for i, state in enumerate(states):
        shared, own = _share(states[0], state)
        result.states.append(state)
        result.shared.append(shared)
        result.own.append(own)
        if i:
            log.info("paired_init: %s shares %d/%d tensors with %s; own init: %s", configs[i].attention,
                     len(shared), len(state), configs[0].attention, own or "none")
    return result


def _share(reference: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy into `state` every tensor of `reference` with its name, shape and dtype; (shared names, own names)."""
    shared, own = [], []
    for name, tensor in state.items():
        ref = reference.get(name)
        if ref is not None and ref.shape == tensor.shape and ref.dtype == tensor.dtype:
            state[name] = ref.clone()
            shared.append(name)
        else:
            own.append(name)
    return shared, own
