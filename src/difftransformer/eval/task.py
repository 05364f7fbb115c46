"""The evaluation-task interface: one trained model in, one JSON-able result out.

A task evaluates ONE model. It knows nothing of training runs, arms or seeds over runs (studies
that evaluate many models live in `difftransformer.experiments`). Black-box tasks (eval/tasks/)
see logits only, through `eval/lm.py`; white-box probes that look inside attention go in eval/probes/.

    result = run_task("heldout-loss", model, tokenizer, EvalConfig(data_dir="cache/data/sotu-8192"))
    result.metrics["loss"], result.to_dict()           # JSON: settings, weights hash, version, time

Adding a task: subclass `Task`, set `name` and `description`, implement `run`, decorate with
`@register_task`. `run` must be deterministic given `EvalConfig.eval_seed`. A task's own settings
are a dataclass named by its `Options` (int, float, bool, str fields, or tuples of them, each with a
default and `metadata={"help": ...}`): `get_task("needle", lengths=(256, 512))` sets them, the
CLI turns every field into a flag, and the result records them under settings["options"]. A task
whose paper measurement has a figure implements `plot(result, path)` (a PNG).
"""

from __future__ import annotations

import abc
import contextvars
import dataclasses
import datetime as dt
import difflib
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from difftransformer._config import check_field_types
from difftransformer._version import __version__
from difftransformer.dist import is_device_name
from difftransformer.model.config import model_identity

OPTION_LIMIT = 10**9  # the magnitude every numeric setting of a task (a count, a length, a ratio) stays within


def shown(value: Any) -> str:
    """A number for a message: an integer of more than 15 digits is cut (a 400-digit one is not printed whole)."""
    text = str(value)
    return text if len(text) <= 15 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"


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
            value = getattr(self, name)
            if value is not None and not 0 < value <= OPTION_LIMIT:
                raise ValueError(f"EvalConfig.{name} must be a positive integer up to {OPTION_LIMIT:,}, got "
                                 f"{shown(value)}")
        if self.split == "train":
            raise ValueError("EvalConfig.split='train' would evaluate on the text the model was trained on; "
                             "use 'val' or 'test'")
        if self.split not in ("val", "test"):
            raise ValueError(f"EvalConfig.split must be 'val' or 'test' (the held-out splits of a prepared corpus), "
                             f"got {self.split!r}")
        if not 0 <= self.eval_seed < 2**63:  # what the command line's --eval-seed allows
            raise ValueError(f"EvalConfig.eval_seed must be in [0, 2**63), got {self.eval_seed}")
        if not is_device_name(self.device):
            raise ValueError(f"EvalConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


@dataclass
class TaskResult:
    task: str
    metrics: dict[str, float]  # the task's headline numbers
    settings: dict[str, Any]  # everything that decided them (the EvalConfig and the task's own choices)
    details: dict[str, Any] = field(default_factory=dict)  # per-cell / per-example numbers, for plots
    provenance: dict[str, Any] = field(default_factory=dict)  # weights hash, package version, time taken

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TaskNotApplicable(ValueError):
    """The task does not apply to this model (a white-box probe on another library's model, `ood` on a model
    trained on text): nothing failed, there is nothing to measure. `eval all` names it and goes on."""


@dataclass
class NoOptions:
    """The options of a task that has none of its own."""


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def option_kind(f: dataclasses.Field) -> tuple[type, bool]:
    """(element type, is_tuple) of an option field: `int`, `float`, `bool`, `str` or `tuple[X, ...]`."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    text = text.replace(" ", "")
    if text.startswith("tuple[") and text.endswith(",...]") and text[6:-5] in _SCALARS:
        return _SCALARS[text[6:-5]], True
    if text in _SCALARS:
        return _SCALARS[text], False
    raise TypeError(f"option {f.name} has type {text}; task options are int, float, bool, str or tuple[X, ...]")


def _check_option(owner: str, f: dataclasses.Field, value: Any) -> Any:
    """The value, converted where lossless (int -> float, list -> tuple), or a ValueError naming the field."""
    kind, is_tuple = option_kind(f)

    def one(v: Any) -> Any:
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if number and kind in (int, float) and not abs(v) <= OPTION_LIMIT:  # nan and inf too
            raise ValueError(f"{owner}.{f.name} is {shown(v)}, beyond what an evaluation can run; numeric task "
                             f"options are finite and within ±{OPTION_LIMIT:,}")
        if kind is float and number:
            return float(v)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{owner}.{f.name} takes {kind.__name__} values, got {v!r} ({type(v).__name__})")
        return v

    if is_tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError(f"{owner}.{f.name} takes a list of {kind.__name__} values, got {value!r}")
        return tuple(one(v) for v in value)
    return one(value)


class Task(abc.ABC):
    """One measurement of one model. Subclasses set `name`, `description` and implement `run`.

    white_box: the task looks inside attention (eval/probes/) and runs only on this package's models;
    black-box tasks see logits only and run on any causal LM with the `eval/lm.py` interface.
    reads_seq_len: the task's window or prompt length follows EvalConfig.seq_len (`eval --seq-len`); tasks
    that size their prompts themselves say False, so a --seq-len given to them is refused or noted, not
    silently ignored.
    version: the version of what the task measures, recorded in every result (settings["task_version"]). Raise
    it whenever a change can alter a metric's value on the same weights and settings (a fixed metric, another
    rule), so that results stored before it are computed again rather than reused; results stored before
    versions were recorded read as version 1.
    skip_options: options that only choose which parts of the work are skipped, never how a part is computed
    (ood's `min_accuracy`). A stored result computed with other values of them (or before they existed) still
    serves where `covers` says it holds every part that these options would compute.
    derived_metrics: {metric: the metric it is a monotone function of} (heldout-loss's perplexity = exp(loss)):
    one measurement under two names, so a report tests the source alone and counts it once among its tests."""

    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    white_box: ClassVar[bool] = False
    reads_seq_len: ClassVar[bool] = True
    version: ClassVar[int] = 1
    skip_options: ClassVar[tuple[str, ...]] = ()
    derived_metrics: ClassVar[dict[str, str]] = {}

    def __init__(self, options: Any = None, **overrides: Any):
        """`options`: an instance of `Options` (default: its defaults); `overrides`: fields to change."""
        options = self.Options() if options is None else options
        if not isinstance(options, self.Options):
            raise TypeError(f"task {self.name!r} takes {self.Options.__name__} options, got {type(options).__name__}")
        fields = {f.name: f for f in dataclasses.fields(options)}
        for key in overrides:
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"task {self.name!r} has no option {key!r}{hint}; its options: "
                                 f"{', '.join(fields) or 'none'}")
        checked = {k: _check_option(f"{self.name}", fields[k], v) for k, v in overrides.items()}
        self.options = dataclasses.replace(options, **checked)
        for f in fields.values():  # the defaults and the dataclass's own checks too
            _check_option(self.name, f, getattr(self.options, f.name))
        self.check_options()

    def check_options(self) -> None:
        """Refuse option values that cannot work (a ValueError naming the option and the fix)."""

    @abc.abstractmethod
    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        """Evaluate `model` (in eval mode, on cfg.device) and return its result."""

    def reusable(self) -> str | None:
        """Why a stored result of this task may not be reused although its weights and settings match (None: it
        may). A task whose result depends on code its settings only name (an external judge) says so here."""
        return None

    def covers(self, stored: dict[str, Any]) -> bool:
        """Whether `stored`, a result record of this task whose settings differ from this task's at most in
        `skip_options`, holds every part that this task's options would compute (then it serves as this task's
        result). Callers ask only tasks that have skip_options."""
        return False

    def plot(self, result: TaskResult, path: Path) -> bool:
        """Draw the result as the paper's figure into the PNG `path`; False when the task has none."""
        return False

    def options_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.options).items()}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task available by name to `get_task` and `run_task`."""
    if cls.name in TASKS and TASKS[cls.name] is not cls:
        raise ValueError(f"two evaluation tasks are called {cls.name!r}: {TASKS[cls.name].__name__} and {cls.__name__}")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str, **options: Any) -> Task:
    """A new instance of the task called `name` with these options changed from their defaults; an
    unknown name or option is a ValueError listing what exists.

    The built-in tasks register themselves when `difftransformer.eval` is imported (eval/tasks/)."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown evaluation task {name!r}{hint}; available: {', '.join(sorted(TASKS))}")
    return TASKS[name](**options)


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 of the model's tensors (names, dtypes, shapes, bytes): which weights a result belongs to."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def task_settings(task: Task, cfg: EvalConfig, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The settings every result records besides the task's own: the task's version, the EvalConfig, the
    task's options, which prepared data cfg.data_dir held (`data_identity`: a folder prepared again with
    other text under the same name gives other numbers, so a stored result is not reused for it) and, given
    the model, its configuration (`model_settings`)."""
    settings: dict[str, Any] = {"task_version": task.version, "eval_config": dataclasses.asdict(cfg)}
    if task.Options is not NoOptions:
        settings["options"] = task.options_dict()
    if cfg.data_dir is not None:
        settings["data"] = data_identity(cfg.data_dir)
    if model is not None:
        settings["model"] = model_settings(model)
    return settings


SAVED_BY = ("_name_or_path", "transformers_version")  # a transformers config's record of where and by what it was saved


def model_settings(model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's configuration as JSON holds it: the same tensors under another configuration (a longer context,
    another RoPE base, no position encoding, another λ_init) give other numbers, so a result stored for one is not
    reused for the other. Left out: how attention is computed (`model_identity`: a backend changes a number only in
    its last bits, as the device does) and where a transformers config was saved from. None for a model without a
    `config.to_dict()`."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if not callable(to_dict):
        return None
    config = {k: v for k, v in model_identity(to_dict()).items() if k not in SAVED_BY}
    return json.loads(json.dumps(config, sort_keys=True, default=str))  # as a stored result reads it back


def data_identity(data_dir: str | Path) -> dict[str, Any] | None:
    """What decides the held-out tokens of a prepared-data folder (its manifest's corpus and tokenizer
    hashes, split settings and token counts, not its path); None when it has no readable manifest (the
    task that reads it then fails, naming the folder)."""
    from difftransformer.data.prepare import PREPARED_FILE

    try:
        manifest = json.loads((Path(data_dir) / PREPARED_FILE).read_text(encoding="utf-8"))
        return {k: manifest[k] for k in ("corpus_hash", "tokenizer_hash", "split_config", "num_tokens")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


_RUNNING: contextvars.ContextVar[Task | None] = contextvars.ContextVar("running_task", default=None)


def running_task() -> Task | None:
    """The task whose `run` is under way in `run_task` (None outside one): for a helper that a task calls to word
    its errors for that task (eval/probes/hooks.py: whether --seq-len sets the windows)."""
    return _RUNNING.get()


def run_task(task: str | Task, model: torch.nn.Module, tokenizer, cfg: EvalConfig | None = None, *,
             weights_sha256: str | None = None) -> TaskResult:
    """Run one task on `model` (put in eval mode, restored after) and stamp the result with provenance.

    weights_sha256: the model's `weights_hash`, when the caller has it already (hashing a large
    model's tensors takes seconds)."""
    task = get_task(task) if isinstance(task, str) else task
    if not isinstance(task, Task):
        raise TypeError(f"run_task takes a task name or a Task, got {task!r} ({type(task).__name__})")
    cfg = cfg or EvalConfig()
    was_training = model.training
    model.eval()
    started, t0 = dt.datetime.now().astimezone(), time.perf_counter()
    running = _RUNNING.set(task)
    try:
        result = task.run(model, tokenizer, cfg)
    finally:
        _RUNNING.reset(running)
        model.train(was_training)
    result.settings = {**result.settings, **task_settings(task, cfg, model)}
    result.provenance = {"weights_sha256": weights_sha256 or weights_hash(model), "package_version": __version__,
                         "started": started.isoformat(timespec="seconds"),
                         "seconds": round(time.perf_counter() - t0, 3)}
    return result
