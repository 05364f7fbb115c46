"""A folder of evaluation results for ONE model: `<task>.json` (+ `<task>.png`), and when one may be reused.

    results = ResultsDir("runs/demo/diff/eval")
    cached = results.cached("needle", weights_sha256, settings)   # a dict, or None: run the task
    results.save(result, png_writer)                                # atomic; the PNG when the task has a figure
    record, reused = evaluate_cached(task, model, tokenizer, cfg, results)   # both in one call

A stored result is reused only when it belongs to the same weights (sha256 of every tensor), the same
task version (Task.version), the same settings (the task's options and the EvalConfig fields that change
numbers), the same prepared data (eval.task.data_identity: not just the same folder name) and its figure is
the one saved with it (the JSON records the PNG's sha256), and the task does not refuse reuse
(Task.reusable: an external judge's code may have changed behind its name). Options that only skip work
(Task.skip_options: ood's `min_accuracy`) are the one exception: a stored result that holds every part the
asked-for values would compute serves them (`settings_served`), whatever values it was computed with.
A file that cannot be read or does not have a result's shape (a hand edit, a foreign JSON), or one of other
weights, means the task runs again; nothing is ever merged or guessed. A result of these weights with other
settings is the user's work: it is never replaced without `force` (StoredResultError names the settings
that differ); one of an older task version measured with code that is gone, and is replaced (one of a newer
version than this package's is refused: an older checkout must not overwrite it).
One writer at a time per folder: evaluate_cached holds the folder's lock (_io.folder_lock).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from difftransformer._io import atomic_path, atomic_write_text, folder_lock, writing
from difftransformer.eval.task import (
    TASKS,
    EvalConfig,
    Task,
    TaskResult,
    get_task,
    run_task,
    task_settings,
    weights_hash,
)

# EvalConfig fields that cannot change a task's numbers (where it ran, how it was batched)
UNSCORED = ("device", "batch_size")
FIGURE_HASH = "figure_sha256"  # provenance key: the sha256 of the PNG saved with a result (None: no figure)


def comparable_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The part of a result's settings that decides its numbers (the run's own bookkeeping left out); a result
    stored before task versions were recorded is version 1."""
    cfg = {k: v for k, v in settings.get("eval_config", {}).items() if k not in UNSCORED}
    return {"task_version": settings.get("task_version", 1), "eval_config": cfg,
            "options": settings.get("options", {}), "data": settings.get("data")}


def is_result_record(data: Any, task: str) -> bool:
    """Whether `data` has the shape of `task`'s stored result (what reusing and printing it read): a
    dict whose metrics map names to numbers and whose settings and provenance are dicts."""
    return record_problem(data, task) is None


def record_problem(data: Any, task: str) -> str | None:
    """Why `data` is not `task`'s stored result, in words for the user (None when it is one)."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("task") != task:
        return f"its task is {data.get('task')!r}, not {task!r}"
    metrics, settings = data.get("metrics"), data.get("settings", {})
    if not isinstance(metrics, dict):
        return "its metrics are not an object"
    bad = next(((k, v) for k, v in metrics.items() if not (isinstance(k, str) and _number(v))), None)
    if bad is not None:
        return f"metric {bad[0]!r} is {bad[1]!r}, not a number"
    if not (isinstance(settings, dict) and isinstance(data.get("provenance", {}), dict)
            and all(isinstance(settings.get(k, {}), dict) for k in ("eval_config", "options"))):
        return "its settings or provenance are not objects"
    return None


def _number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                 and (isinstance(value, float) or abs(value) < 2**63))


class ResultsDir:
    """Where evaluation results live; the folder is made on the first save.

    `own`: the folder is one model's (its run's eval/), so a result of other weights there measured a model that
    is gone (training went on) and is replaced; a folder the user chose (eval --out-dir) may hold another model's
    results, which are never replaced silently (`conflict`)."""

    def __init__(self, path: str | Path, *, own: bool = True):
        self.path = Path(path)
        self.own = own

    def json_path(self, task: str) -> Path:
        return self.path / f"{task}.json"

    def png_path(self, task: str) -> Path:
        return self.path / f"{task}.png"

    def load(self, task: str) -> dict[str, Any] | None:
        """The stored result of `task` as a dict; None when there is none, it cannot be read, or it does
        not have a result's shape (`record_problem`)."""
        return self._read(task)[0]

    def problem(self, task: str) -> str | None:
        """Why the stored `<task>.json` is not a readable result (a hand edit, broken JSON), for
        a caller that must name the file rather than treat it as absent; None when it is one or is absent."""
        return self._read(task)[1]

    def _read(self, task: str) -> tuple[dict[str, Any] | None, str | None]:
        """(the stored result, None), (None, why the file is not one), or (None, None) without a file."""
        try:
            data = json.loads(self.json_path(task).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None, None
        except UnicodeDecodeError as e:
            return None, f"not UTF-8 text: {e.reason} at byte {e.start}"
        except ValueError as e:
            return None, f"not JSON: {e}"
        except OSError as e:
            return None, e.strerror or str(e)
        problem = record_problem(data, task)
        return (None, problem) if problem else (data, None)

    def all(self) -> dict[str, dict[str, Any]]:
        """Every readable result in the folder, by task name."""
        if not self.path.is_dir():
            return {}
        found = {p.stem: self.load(p.stem) for p in sorted(self.path.glob("*.json"))}
        return {k: v for k, v in found.items() if v is not None}

    def cached(self, task: str, weights_sha256: str, settings: dict[str, Any]) -> dict[str, Any] | None:
        """The stored result if it was computed from these weights under this model configuration with these
        settings and its figure is the one it was saved with (`figure_matches`), else None. A result stored
        without its model's configuration is not reused: it may have measured these tensors under another."""
        stored = self.load(task)
        if stored is None or stored.get("provenance", {}).get("weights_sha256") != weights_sha256:
            return None
        if stored.get("settings", {}).get("model") != settings.get("model"):
            return None
        settings = settings_served(task, settings, stored)
        if comparable_settings(stored.get("settings", {})) != comparable_settings(settings):
            return None
        return stored if self.figure_matches(stored) else None

    def figure_matches(self, stored: dict[str, Any]) -> bool:
        """Whether `<task>.png` is the figure saved with the stored result: the sha256 the JSON records, or no
        figure where it records none (a result saved before figures were hashed counts only without one)."""
        png = self.png_path(stored["task"])
        want = stored.get("provenance", {}).get(FIGURE_HASH)
        if want is None:
            return not png.exists()
        return png.is_file() and _sha256(png) == want

    def conflict(self, task: str, weights_sha256: str, settings: dict[str, Any]) -> str | None:
        """Why running `task` here would replace a stored result that is the user's work, in words naming the
        file and the settings that differ: a result for these very weights with other settings (the task's
        options and the EvalConfig, the user's choices), or, in a folder that is not one model's own (`own`),
        a result of other weights or of these weights under another model configuration (another model's). None
        when there is none: no result, a broken one, one with these settings or of an older task version (it
        measured with code that is gone), or, in a model's own folder, one of other weights, of another
        configuration or of a data folder prepared again since (it measured a model or text that is gone). A
        result of a newer task version than this package's is refused too."""
        stored = self.load(task)
        if stored is None:
            return None
        theirs = stored.get("provenance", {}).get("weights_sha256")
        if theirs != weights_sha256:
            if self.own:
                return None
            return f"{self.json_path(task)} holds {task}'s result for other weights ({str(theirs)[:12]}), " \
                   f"perhaps another model's"
        theirs_model = stored.get("settings", {}).get("model")
        if not self.own and theirs_model is not None and theirs_model != settings.get("model"):
            return f"{self.json_path(task)} holds {task}'s result for these weights under another model configuration"
        version, ours = comparable_settings(stored.get("settings", {}))["task_version"], settings.get("task_version", 1)
        if version < ours:
            return None
        if version > ours:
            return f"{self.json_path(task)} holds {task}'s result of version {version} of the task, newer than this " \
                   f"package's ({ours})"
        chosen = lambda d: {k: v for k, v in comparable_settings(d).items()  # noqa: E731
                            if k not in ("data", "task_version")}
        old, new = chosen(stored.get("settings", {})), chosen(settings_served(task, settings, stored))
        if old == new:
            return None
        return f"{self.json_path(task)} holds {task}'s result for these weights with other settings " \
               f"({'; '.join(differing_keys(old, new)[:3])})"

    def save(self, result: TaskResult, plot: Callable[[TaskResult, Path], bool] | None = None) -> list[Path]:
        """Write `<task>.png` (when `plot` draws one) and then `<task>.json`, each atomically: the JSON, which
        the reuse check reads, comes last and records the figure's sha256 (provenance["figure_sha256"]), so
        a figure and a JSON of two different runs (a kill between the two, two writers) are never taken
        for one result. Returns the paths written."""
        self.path.mkdir(parents=True, exist_ok=True)
        png = self.png_path(result.task)
        figure = None
        if plot is not None:
            try:
                with atomic_path(png, suffix=".png") as tmp:  # plotting libraries pick the format from the suffix
                    with writing(png):  # a full disk names the figure, not the temporary file
                        if not (plot(result, tmp) and tmp.is_file() and tmp.stat().st_size):
                            raise _NoFigure
                    figure = _sha256(tmp)
            except _NoFigure:
                pass
        if figure is None:
            png.unlink(missing_ok=True)  # a stale figure of an earlier result must not stay beside this one
        result.provenance = {**result.provenance, FIGURE_HASH: figure}
        path = self.json_path(result.task)
        atomic_write_text(path, json.dumps(result.to_dict(), indent=2, allow_nan=True) + "\n", fsync=True)
        return [path, *([png] if figure else [])]


class _NoFigure(Exception):
    """The task drew no figure for this result."""


class StoredResultError(ValueError):
    """Running a task would replace a stored result computed with other settings (see ResultsDir.conflict)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def differing_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The dotted keys at which two nested records differ, with both values, for messages:
    ["options.lengths: [128] before, [256] now"] (long values cut)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for k in sorted(set(old) | set(new), key=str)
                for line in differing_keys(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))]
    cut = lambda v: (text if len(text := repr(v)) <= 40 else text[:37] + "...")  # noqa: E731
    return [] if old == new else [f"{prefix or 'value'}: {cut(old)} before, {cut(new)} now"]


def settings_served(task: str, settings: dict[str, Any], stored: dict[str, Any] | None) -> dict[str, Any]:
    """`settings` (task_settings of the task called `task`) with the task's `skip_options` read as the stored
    result has them, where that result covers what these settings ask for (Task.covers), so that it is reused
    and not refused: an `ood` result that scored every condition serves any `min_accuracy`. Otherwise
    `settings` unchanged (also for a task without skip_options, or options it cannot take)."""
    skip = getattr(TASKS.get(task), "skip_options", ())
    theirs = ((stored or {}).get("settings") or {}).get("options") if isinstance(stored, dict) else None
    if not skip or not isinstance(theirs, dict):
        return settings
    try:
        asked = get_task(task, **settings.get("options", {}))
    except (TypeError, ValueError):
        return settings
    if not asked.covers(stored):
        return settings
    options = {k: v for k, v in settings.get("options", {}).items() if k not in skip}
    options.update({k: theirs[k] for k in skip if k in theirs})
    return {**settings, "options": options}


def evaluate_cached(task: Task, model: torch.nn.Module, tokenizer, cfg: EvalConfig, results: ResultsDir,
                    *, force: bool = False, log: Callable[[str], None] | None = None,
                    weights_sha256: str | None = None) -> tuple[dict[str, Any], bool]:
    """(result record, reused?): the stored result of `task` for these weights and settings, else the
    task run now and saved (JSON, and the PNG where it has a figure) into `results`.

    weights_sha256: the model's `weights_hash`, so that a caller running several tasks hashes once."""
    digest = weights_sha256 or weights_hash(model)  # keys the reuse and stamps a new result
    with folder_lock(results.path, purpose="keep these results in another folder "
                                           "(eval --out-dir DIR)"):
        settings = task_settings(task, cfg, model)
        refused = task.reusable()
        cached = None if force or refused else results.cached(task.name, digest, settings)
        if refused and log and results.load(task.name) is not None:
            log(f"{task.name}: not reusing {results.json_path(task.name)}: {refused}")
        if cached is not None:
            if log:
                log(f"{task.name}: reusing {results.json_path(task.name)} (same weights and settings)")
            return cached, True
        conflict = None if force else results.conflict(task.name, digest, settings)
        if conflict:
            raise StoredResultError(f"{conflict}; it is not replaced: keep the new result in another folder "
                                    f"(eval --out-dir DIR), or replace it on purpose (eval --force)")
        result = run_task(task, model, tokenizer, cfg, weights_sha256=digest)
        for path in results.save(result, task.plot):
            if log:
                log(f"  wrote {path}")
    return result.to_dict(), False
