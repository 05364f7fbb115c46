"""The evaluation-task interface: one trained model in, one JSON-able result out.

A task evaluates ONE model. It knows nothing of training runs, arms or seeds over runs (studies
that evaluate many models live in `difftransformer.experiments`). Black-box tasks (eval/tasks/)
see logits only, through `eval/lm.py`; white-box probes that look inside attention go in eval/probes/.

    result = run_task("heldout-loss", model, tokenizer, EvalConfig(data_dir="cache/data/sotu-8192"))
    result.metrics["loss"], result.to_dict()           # JSON: settings, weights hash, version, time

Adding a task: subclass `Task`, set `name` and `description`, implement `run`, decorate with
`@register_task`. `run` must be deterministic given `EvalConfig.eval_seed`.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as dt
import difflib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from difftransformer._config import check_field_types
from difftransformer._version import __version__


@dataclass
class EvalConfig:
    """Settings every task shares; a task reads what it needs and records it in its result."""

    data_dir: str | None = None  # a prepared-data folder, for tasks that read held-out text
    split: str = "test"  # which split of it: held-out text is never the training split
    seq_len: int | None = None  # window length; None: the model's max_position_embeddings
    batch_size: int = 8
    max_windows: int | None = None  # cap on the windows read, for quick runs; None: the whole split
    eval_seed: int = 0  # seeds a task's own randomness (synthetic prompts, subsets); not training or sampling
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_field_types(self, "EvalConfig")
        for name in ("batch_size", "seq_len", "max_windows"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"EvalConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.split == "train":
            raise ValueError("EvalConfig.split='train' would evaluate on the text the model was trained on; "
                             "use 'val' or 'test'")
        if self.split not in ("val", "test"):
            raise ValueError(f"EvalConfig.split must be 'val' or 'test' (the held-out splits of a prepared corpus), "
                             f"got {self.split!r}")


@dataclass
class TaskResult:
    task: str
    metrics: dict[str, float]  # the task's headline numbers
    settings: dict[str, Any]  # everything that decided them (the EvalConfig and the task's own choices)
    details: dict[str, Any] = field(default_factory=dict)  # per-cell / per-example numbers, for plots
    provenance: dict[str, Any] = field(default_factory=dict)  # weights hash, package version, time taken

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Task(abc.ABC):
    """One measurement of one model. Subclasses set `name`, `description` and implement `run`."""

    name: ClassVar[str]
    description: ClassVar[str]

    @abc.abstractmethod
    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        """Evaluate `model` (in eval mode, on cfg.device) and return its result."""


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task available by name to `get_task` and `run_task`."""
    if cls.name in TASKS and TASKS[cls.name] is not cls:
        raise ValueError(f"two evaluation tasks are called {cls.name!r}: {TASKS[cls.name].__name__} and {cls.__name__}")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str) -> Task:
    """A new instance of the task called `name`; an unknown name is a ValueError listing the tasks.

    The built-in tasks register themselves when `difftransformer.eval` is imported (eval/tasks/)."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown evaluation task {name!r}{hint}; available: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 of the model's tensors (names, dtypes, shapes, bytes): which weights a result belongs to."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_task(task: str | Task, model: torch.nn.Module, tokenizer, cfg: EvalConfig | None = None) -> TaskResult:
    """Run one task on `model` (put in eval mode, restored after) and stamp the result with provenance."""
    task = get_task(task) if isinstance(task, str) else task
    cfg = cfg or EvalConfig()
    was_training = model.training
    model.eval()
    started, t0 = dt.datetime.now().astimezone(), time.perf_counter()
    try:
        result = task.run(model, tokenizer, cfg)
    finally:
        model.train(was_training)
    result.provenance = {"weights_sha256": weights_hash(model), "package_version": __version__,
                         "started": started.isoformat(timespec="seconds"),
                         "seconds": round(time.perf_counter() - t0, 3)}
    return result
