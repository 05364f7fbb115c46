"""AdamW with decay / no-decay parameter groups, and the learning-rate schedule as a pure function.

Weight decay pulls weights towards 0. That is wanted for the projection matrices, but for a gain
(RMSNorm weight, DIFF's head norm), a λ re-parameterisation vector or an embedding row it biases the
model towards "off" instead of regularising it, so by default they are excluded (as in GPT-3/LLaMA
recipes). The schedule depends only on the step, so resuming needs nothing but the step number.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from difftransformer.norm import RMSNorm
from difftransformer.train.config import TrainConfig


def apply_trainable(model: nn.Module, cfg: TrainConfig) -> None:
    """Freeze what `cfg.trainable` leaves out ("attention": all but the layers' self_attn tensors), before
    the model is wrapped (DDP reads requires_grad) and the optimizer built (it takes trainable ones only)."""
    if cfg.trainable == "all":
        return
    for name, p in model.named_parameters():
        p.requires_grad_(".self_attn." in f".{name}")


def classify_parameters(model: nn.Module, cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(names that get weight decay, names that do not), in model.named_parameters() order.

    Tied weights appear once (named_parameters deduplicates), under the embedding's name.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm) and m.weight is not None}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            wd = False
        elif id(p) in embedding_params:
            wd = cfg.decay_embeddings
        elif id(p) in norm_params or (leaf.startswith("lambda_") and p.dim() == 1) or p.dim() < 2:
            wd = cfg.decay_norms_and_lambdas  # gains, λ vectors and any other vector
        else:
            wd = True
        (decay if wd else no_decay).append(name)
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over two groups; each group also records its parameter names under "names".

    The names let checkpoints store optimizer state by parameter name instead of by position.
    """
    params = dict(model.named_parameters())
    decay, no_decay = classify_parameters(model, cfg)
    groups = [
        {"params": [params[n] for n in decay], "names": decay, "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "names": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup: a line from 0 reaching cfg.lr at step warmup_steps - 1, i.e. lr * (step + 1) / warmup_steps
    (step 0 is not wasted at lr 0). Then decay over the remaining steps to min_lr: cosine, linear,
    or none (constant). The decay reaches min_lr at step max_steps, which is not run: the last step,
    max_steps - 1, runs a little above it (by 1 / (max_steps - warmup_steps) of the decay or less).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        coeff = 1.0 - progress
    else:
        raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}")
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
