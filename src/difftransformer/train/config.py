"""The training run's typed configuration: every knob of the loop in one JSON-serialisable dataclass.

Validation happens in __post_init__ so a bad value fails before any data is read or any model built,
with a message that names the field, the value and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difftransformer._config import check_field_types
from difftransformer._io import atomic_write_text
from difftransformer.dist import is_device_name

LR_SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("fp32", "bf16")
TRAINABLE = ("all", "attention")
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: rates above it overflow in the optimizer

# Fields that change which tokens a step sees or how a step is computed: a checkpoint can only be
# resumed with the same values (the rest, e.g. lr after a divergence, may change with a warning).
RESUME_MUST_MATCH = ("seq_len", "batch_size", "seed", "trainable")
# Fields that decide the optimizer's parameter groups: a checkpoint's optimizer state only fits the same groups.
OPTIMIZER_GROUPS_MUST_MATCH = ("decay_norms_and_lambdas", "decay_embeddings")
# Fields that only affect speed, I/O or how far to train: a resumed run (or a continued study) may change them.
FREELY_CHANGEABLE = frozenset({"out_dir", "data_dir", "max_steps", "eval_interval", "eval_batches", "log_interval",
                               "ckpt_interval", "keep_last", "compile", "activation_checkpointing", "device", "fsdp",
                               "dist_timeout_min",
                               "tensorboard", "progress", "max_weight_growth"})


@dataclass
class TrainConfig:
    """Hyperparameters and I/O of one training run (see the field comments for units)."""

    data_dir: str = "cache/data/sotu"  # a prepared-data folder (PreparedData.load)
    out_dir: str = "runs/default"
    seq_len: int = 256
    batch_size: int = 16  # GLOBAL sequences per optimizer step (across ranks and accumulation)
    grad_accum_steps: int = 1
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_schedule: str = "cosine"  # cosine | linear | constant (warmup is linear from 0 in every case)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    # Divergence guard: before every checkpoint the weights must be finite and their global norm within
    # this factor of its value at the run's start (kept in checkpoints); otherwise nothing is saved (0: no check).
    max_weight_growth: float = 10.0
    decay_norms_and_lambdas: bool = False  # by default no weight decay on norms, λ vectors, embeddings
    decay_embeddings: bool = False
    eval_interval: int = 100
    eval_batches: int = 20
    log_interval: int = 10
    ckpt_interval: int = 200
    keep_last: int = 2
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    fsdp: bool = False  # FSDP2 (fully_shard) instead of DDP when distributed
    # Under torchrun: minutes a rank waits for the others at a collective (rank 0 writing a checkpoint, or
    # evaluating a study's finished units while the others wait to train the next) before the run fails.
    dist_timeout_min: float = 240.0
    tensorboard: bool = True
    progress: bool = True  # tqdm bar with loss, tokens/s, ETA
    # Which parameters the optimizer moves: "all", or "attention" (every layers.N.self_attn.* tensor:
    # projections, λ vectors, head norm; embeddings, MLPs and the other norms frozen), e.g. to
    # continue training a retrofitted model (docs/interop.md, "Retrofit").
    trainable: str = "all"
    # A model folder (config.json + model.safetensors in our format: a run's final/, the output of
    # `retrofit` or `convert --to difftransformer`) whose weights start the run instead of a random init; the
    # run's model config must be the folder's (run configs take it from there). Ignored when resuming.
    init_from: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "TrainConfig")
        positive = ("seq_len", "batch_size", "grad_accum_steps", "max_steps", "eval_interval", "eval_batches",
                    "log_interval", "ckpt_interval", "keep_last")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("warmup_steps", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.lr <= FLOAT32_MAX:  # the optimizer holds it in float32 tensors: inf/1e300 overflow
            raise ValueError(f"TrainConfig.lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 < self.dist_timeout_min <= 7 * 24 * 60:
            raise ValueError(f"TrainConfig.dist_timeout_min must be in (0, {7 * 24 * 60}] minutes, got "
                             f"{self.dist_timeout_min}")
        for name in ("weight_decay", "grad_clip", "max_weight_growth"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if 0 < self.max_weight_growth <= 1:  # the norm of healthy weights grows: every run would stop as diverged
            raise ValueError(f"TrainConfig.max_weight_growth must be 0 (no check) or a factor > 1, got "
                             f"{self.max_weight_growth}")
        if not self.weight_decay <= FLOAT32_MAX:
            raise ValueError(f"TrainConfig.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 < self.adam_eps <= FLOAT32_MAX:
            raise ValueError(f"TrainConfig.adam_eps must be a positive number, got {self.adam_eps}")
        if not self.out_dir.strip():
            raise ValueError("TrainConfig.out_dir is empty; name the folder to train into (--out-dir DIR)")
        if self.seed >= 2**32:
            raise ValueError(f"TrainConfig.seed must be below 2**32, got {self.seed}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"TrainConfig.trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("TrainConfig.init_from is empty; name a model folder (config.json + model.safetensors) "
                             "or leave it out to start from a random init")
        if not is_device_name(self.device, auto=True):
            raise ValueError(f"TrainConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"TrainConfig.batch_size ({self.batch_size}) must be divisible by grad_accum_steps "
                             f"({self.grad_accum_steps}): every micro-batch has the same number of sequences")

    def check_model(self, model_config: Any) -> None:
        """The one check of this recipe against a model config: seq_len must fit its max_position_embeddings
        (a ValueError naming both and the fix). train() and the run-config loader both call it."""
        if self.seq_len > model_config.max_position_embeddings:
            raise ValueError(f"train.seq_len {self.seq_len} exceeds the model's max_position_embeddings "
                             f"{model_config.max_position_embeddings}; lower train.seq_len or raise "
                             f"model.max_position_embeddings")

    # -- derived ------------------------------------------------------------------------------
    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown TrainConfig key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")  # never torn

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def differences(self, other: TrainConfig) -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's value)} for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}
