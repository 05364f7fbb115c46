"""Units of a study and their result files: what one training of the grid produced, in one small JSON.

A study is arms x seeds x sizes x token budgets; one point of that grid is a `Unit`, trained into one
run folder (checkpoints, weights: large, never committed) and summarised in one result file (a few
tens of KB: its config, learning curves, final losses, λ, throughput, evaluation results and sample
generations). Result files are what make a study portable:

    <results_dir>/[<size>/][<tokens>tok/][seed<s>/]<arm>.json    (mirrors the run folders' layout)

- a unit whose result file exists, for the same model, recipe and data (`identity`), is done: the
  runner skips it on any machine, with or without its run folder, so a study continues where the
  committed results stop;
- the report is built from result files alone (run folders are only read for units without one).

The format is `UNIT_FORMAT`; a result file for another identity is never overwritten silently: the
runner refuses, naming the file and what differs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from difftransformer._io import atomic_write_text
from difftransformer.eval.results import differing_keys

UNIT_FORMAT = "difftransformer-unit-v1"
MANIFEST_FILE = "compare.json"  # the study's manifest, in the study folder and copied beside its result files
_SEED_PREFIX = "seed"
_TOKENS_SUFFIX = "tok"


@dataclass(frozen=True, order=True)
class Unit:
    """One point of a study's grid: an arm trained with one seed, at one size and token budget.

    `size` is None when the study has no size grid (the [model] section is the size), `tokens` None
    when it has no token grid (train.max_steps is the budget)."""

    size: str | None
    tokens: int | None
    seed: int
    arm: str

    @property
    def cell(self) -> tuple[str | None, int | None]:
        """The (size, tokens) point of the grid: the arms and seeds inside one cell are compared."""
        return self.size, self.tokens

    def rel(self, multi_seed: bool) -> PurePosixPath:
        """Where this unit lives below the study folder (and below results_dir, with '.json')."""
        parts = [p for p in (self.size, f"{self.tokens}{_TOKENS_SUFFIX}" if self.tokens else None) if p]
        if multi_seed:
            parts.append(f"{_SEED_PREFIX}{self.seed}")
        return PurePosixPath(*parts, self.arm)

    def label(self) -> str:
        parts = [f"size {self.size}" if self.size else "", f"{self.tokens:,} tokens" if self.tokens else "",
                 f"seed {self.seed}", f"arm {self.arm}"]
        return ", ".join(p for p in parts if p)

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "tokens": self.tokens, "seed": self.seed, "arm": self.arm}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Unit":
        return cls(d.get("size"), d.get("tokens"), int(d["seed"]), str(d["arm"]))


def cell_label(cell: tuple[str | None, int | None]) -> str:
    size, tokens = cell
    parts = [f"size {size}" if size else "", f"{tokens:,} tokens" if tokens else ""]
    return ", ".join(p for p in parts if p) or "the study's size and budget"


class ResultFileError(ValueError):
    """A result file that cannot be read, or that belongs to another model, recipe or data."""


def result_path(results_dir: str | Path, unit: Unit, multi_seed: bool) -> Path:
    return Path(results_dir) / f"{unit.rel(multi_seed)}.json"


def read_result(path: Path) -> dict[str, Any] | None:
    """A unit's result record (None when there is none); an unreadable one is an error naming the file."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultFileError(f"{path} is not a readable result file ({e}); restore it from git, or delete it to "
                              f"have the unit trained and evaluated again") from None
    if not isinstance(record, dict) or record.get("format") != UNIT_FORMAT or not _is_unit(record.get("unit")):
        raise ResultFileError(f"{path} is not a {UNIT_FORMAT} result file; move it away, or delete it to have the "
                              f"unit trained and evaluated again")
    problem = _shape_problem(record)
    if problem:
        raise ResultFileError(f"{path} is not a valid result file ({problem}: edited by hand?); restore it from git, "
                              f"or delete it to have the unit trained and evaluated again")
    return record


def _number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
             and (isinstance(v, float) or abs(v) < 2**63))


def _rows(rows: Any, numeric: tuple[str, ...]) -> bool:
    return isinstance(rows, list) and all(isinstance(r, dict) and all(_number(r.get(k)) for k in numeric)
                                          for r in rows)


def _shape_problem(record: dict[str, Any]) -> str | None:
    """What in a result record has the wrong type for the report and the runner that read it (None: all
    fine). A field the report reads is never reinterpreted: "no" is not read as finished, "x" not as a loss."""
    checks = [
        ("identity", isinstance(record.get("identity", {}), dict), "a table"),
        ("model", isinstance(record.get("model", {}), dict), "a table of model settings"),
        ("finished", isinstance(record.get("finished", False), bool), "true or false"),
        ("last_step", _number(record.get("last_step")) and not isinstance(record.get("last_step"), float),
         "an integer"),
        ("max_steps", _number(record.get("max_steps")) and not isinstance(record.get("max_steps"), float),
         "an integer or null"),
        ("parameters", _number(record.get("parameters")), "a number or null"),
        ("final_val_loss", _number(record.get("final_val_loss")), "a number or null"),
        ("val", _rows(record.get("val", []), ("step", "loss", "tokens")), "a list of {step, loss, tokens} rows"),
        ("train", _rows(record.get("train", []), ("step", "loss", "tokens", "lr", "grad_norm", "tokens_per_s")),
         "a list of {step, loss, tokens, ...} rows"),
        ("evals", isinstance(record.get("evals", {}), dict) and all(
            isinstance(v, dict) and isinstance(v.get("metrics"), dict) for v in (record.get("evals") or {}).values()),
         "a table of task results with their metrics"),
        ("train", all(_layer_values(r.get(k)) for r in record.get("train") or [] if isinstance(r, dict)
                      for k in ("lambdas", "lambda_inits")), "a list of rows whose λ are lists of numbers"),
        ("samples", record.get("samples") is None or (isinstance(record["samples"], list) and all(
            isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("prompt", "greedy", "sampled"))
            for r in record["samples"])), "a list of {prompt, greedy, sampled} texts or null"),
    ]
    bad = [f"{name} is not {what}" for name, ok, what in checks if not ok]
    evals = record.get("evals") if isinstance(record.get("evals"), dict) else {}
    bad += [f"evals.{task}.metrics.{k} is {str(v)[:40]}, not a number" for task, e in evals.items()
            if isinstance(e, dict) and isinstance(e.get("metrics"), dict)
            for k, v in e["metrics"].items() if not _number(v)][:1]
    return "; ".join(bad) or None


def _layer_values(v: Any) -> bool:
    """A row's λ per layer: absent, or a list of numbers (None for layers without λ)."""
    return v is None or (isinstance(v, list) and all(map(_number, v)))


def _is_unit(d: Any) -> bool:
    """Whether `d` is a unit's record: {size, tokens, seed, arm} with an integer seed and a named arm."""
    return (isinstance(d, dict) and isinstance(d.get("seed"), int) and not isinstance(d.get("seed"), bool)
            and isinstance(d.get("arm"), str) and d["arm"] != "" and isinstance(d.get("size"), (str, type(None)))
            and (d.get("tokens") is None or (isinstance(d["tokens"], int) and not isinstance(d["tokens"], bool))))


def identity_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The parts (model, train, data) in which a recorded identity differs from `new`. A recipe recorded
    before a training setting or model field existed is read with it at its default (a new field's default
    is what the code did before it: adding `init_from` or `position_encoding` must not make every committed result
    "another experiment", retrained or refused). The training seed is left out (`_seedless`)."""
    old, new = _seedless(old), _seedless(new)
    old = _with_defaults(old, new)
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _seedless(identity: dict[str, Any]) -> dict[str, Any]:
    """`identity` without its training seed, which the unit itself names (`Unit.seed`): records written by older
    versions hold the study's `train.seed` for every seed, and they are results of the same unit all the same."""
    train = identity.get("train")
    if not isinstance(train, dict) or "seed" not in train:
        return identity
    return {**identity, "train": {k: v for k, v in train.items() if k != "seed"}}


def train_defaults() -> dict[str, Any]:
    """Every training setting at its default: what a record written before a setting existed trained with."""
    from difftransformer.train import TrainConfig

    return TrainConfig().to_dict()


def model_defaults() -> dict[str, Any]:
    """Every model field with a default, at it: what a record written before the field existed built (a model
    without `position_encoding` used RoPE)."""
    from difftransformer.model import DiffTransformerConfig

    return {f.name: f.default for f in dataclasses.fields(DiffTransformerConfig)
            if f.default is not dataclasses.MISSING}


def predating(mine: dict[str, Any], theirs: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`mine` (a recorded config) with the fields of `theirs` that it predates at their `defaults`."""
    return {**{k: defaults[k] for k in theirs if k not in mine and k in defaults}, **mine}


def _with_defaults(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` with the training settings and model fields it predates at their defaults (see identity_differences)."""
    out = dict(old)
    for part, defaults in (("train", train_defaults), ("model", model_defaults)):
        mine, theirs = old.get(part), new.get(part)
        if isinstance(mine, dict) and isinstance(theirs, dict) and set(theirs) - set(mine):
            out[part] = predating(mine, theirs, defaults())
    return out


def check_identity(path: Path, record: dict[str, Any], identity: dict[str, Any], *, replace: bool = False) -> bool:
    """Whether `record` was produced for `identity` (then the unit is done). A stored result is never
    replaced silently: one of the same unit trained for another number of steps is a ResultFileError
    naming the steps, unless `replace` (then False: the unit is trained again and the file replaced);
    one for another model, recipe or data is a ResultFileError naming the keys that differ, whatever
    `replace` says (reusing it would report another experiment's numbers)."""
    old, identity = _seedless(record.get("identity") or {}), _seedless(identity)
    differ = identity_differences(old, identity)
    if not differ:
        return True
    keys = "; ".join(differing_keys(_with_defaults(old, identity), identity))
    if differ == ["train"]:
        if not identity_differences(_without_steps(old), _without_steps(identity)):
            if replace:
                return False
            raise ResultFileError(f"{path} holds a finished result of another training length ({keys}); a stored "
                                  f"result is not replaced silently: give the new recipe its own compare.results_dir "
                                  f"and --out-dir, or pass --replace-results to train it again and replace the file")
    raise ResultFileError(f"{path} holds the result of another experiment ({', '.join(differ)} differ: {keys}); use "
                          f"another compare.results_dir, or delete the file to train this unit again")


def _without_steps(identity: dict[str, Any]) -> dict[str, Any]:
    return {**identity, "train": {k: v for k, v in (identity.get("train") or {}).items() if k != "max_steps"}}


def write_result(path: Path, record: dict[str, Any]) -> None:
    """The unit's result file, whole or not at all, flushed to disk (hours of training stand behind it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=False) + "\n", fsync=True)


def find_results(results_dir: str | Path) -> dict[Unit, dict[str, Any]]:
    """Every readable result record under `results_dir`, by unit. A unit has one result file: one kept in
    both layouts (<arm>.json and seed<s>/<arm>.json) is a ResultFileError naming both, never one of them
    chosen silently."""
    root = Path(results_dir)
    out: dict[Unit, dict[str, Any]] = {}
    found: dict[Unit, Path] = {}
    if not root.is_dir():
        return out
    for path in sorted(root.rglob("*.json")):
        if path.name == MANIFEST_FILE:
            continue
        record = read_result(path)
        if record is not None:
            unit = Unit.from_dict(record["unit"])
            _check_place(root, path, unit)
            if unit in found:
                raise ResultFileError(f"{found[unit]} and {path} both hold the result of {unit.label()} (the "
                                      f"one-seed and the several-seed layout); a unit has one result file: delete "
                                      f"the one not to be reported, or move it out of {root}")
            out[unit], found[unit] = record, path
    return out


def _check_place(root: Path, path: Path, unit: Unit) -> None:
    """A result file lies where its unit's result goes: one moved, copied or edited into another unit's
    place would report one arm's numbers under another's name (or hide one of two arms)."""
    if path not in (result_path(root, unit, True), result_path(root, unit, False)):
        raise ResultFileError(f"{path} holds the result of {unit.label()}, which belongs at "
                              f"{result_path(root, unit, False)} (one seed) or {result_path(root, unit, True)} "
                              f"(several); move it there, or delete it to have the unit trained and evaluated again")
