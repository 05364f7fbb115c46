"""Paired initialisation: DIFF and baseline arms that start from the same weights wherever they can.

A comparison of two architectures trained from different random draws mixes the architecture's
effect with init noise. Building each model with the same seed is not enough (DIFF draws its λ
vectors mid-construction, shifting every later draw), so every parameter whose name and shape match
the first config's model is copied from it: embeddings, FFN, norms, LM head and q/k/v/out projections.
"""

from __future__ import annotations

import logging

import torch

from difftransformer.model import DiffTransformerConfig, DiffTransformerLM

log = logging.getLogger("difftransformer.experiments")


class PairedInit(list):
    """A list of state dicts (one per config) that also records what was shared.

    `shared[i]`: names copied from config 0's model into model i (all names for i = 0);
    `own[i]`: names left at model i's own seeded init (missing from model 0 or another shape).
    """

    shared: list[list[str]]
    own: list[list[str]]


def paired_init(configs: list[DiffTransformerConfig], seed: int) -> PairedInit:
    """State dicts for `configs`, each built with torch.manual_seed(seed), shared params copied from the first."""
    if not configs:
        raise ValueError("paired_init needs at least one config")
    states: list[dict[str, torch.Tensor]] = []
    for cfg in configs:
        torch.manual_seed(seed)
        states.append({k: v.detach().clone() for k, v in DiffTransformerLM(cfg).state_dict().items()})
    reference = states[0]
    result = PairedInit()
    result.shared, result.own = [], []
    for i, state in enumerate(states):
        shared, own = [], []
        for name, tensor in state.items():
            ref = reference.get(name)
            if ref is not None and ref.shape == tensor.shape and ref.dtype == tensor.dtype:
                state[name] = ref.clone()
                shared.append(name)
            else:
                own.append(name)
        result.append(state)
        result.shared.append(shared)
        result.own.append(own)
        if i:
            log.info("paired_init: %s shares %d/%d tensors with %s; own init: %s", configs[i].attention,
                     len(shared), len(state), configs[0].attention, own or "none")
    return result
