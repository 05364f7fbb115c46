"""Evaluate the finished runs of a study with the evaluation tasks, reusing stored results.

    evaluate_run(run_dir, ["needle", "outliers"], data_dir="cache/data/sotu-8192")

Each run's results live in its own eval/ folder (train/run_dir.py), one `<task>.json` per task,
and are reused while the final weights and the task's settings are unchanged (eval/results.py), so
re-running a study evaluates only what is new. A task that does not apply to a model (TaskNotApplicable: `ood` on
a model trained on text) is logged and left out; any other failure of a task stops the run's evaluation, naming
the task (TaskFailedError), so that no result is written without it and running again evaluates it again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from difftransformer.data import Tokenizer
from difftransformer.eval import TASKS, EvalConfig, Task, get_task
from difftransformer.eval.results import ResultsDir, StoredResultError, differing_keys, evaluate_cached
from difftransformer.eval.task import TaskNotApplicable, weights_hash
from difftransformer.train import RunDir, load_model

log = logging.getLogger("difftransformer.experiments")


class TaskFailedError(ValueError):
    """A task that applies to a run's model failed with a ValueError while it ran (the cause is chained): its
    run gets no result without it; running again evaluates it again, reusing the tasks that finished."""


def task_for_run(name: str, run: RunDir | None, options: dict[str, Any] | None = None) -> Task:
    """The task `name` with `options`, plus what the run folder knows that the task asks for (its
    training length, for long-context), so the CLI and studies build the same task and share results."""
    options = dict(options or {})
    fields = {f.name for f in dataclasses.fields(get_task(name).Options)}
    if "train_length" in fields and "train_length" not in options and run is not None and run.seq_len():
        options["train_length"] = run.seq_len()
    return get_task(name, **options)


# Options a study derives from the run folder (task_for_run), not chosen in its config: compared only when set.
_FROM_RUN = ("train_length",)


def stale_evaluations(evals: dict[str, Any], tasks: list[str],
                      options: dict[str, dict[str, Any]] | None) -> dict[str, str]:
    """{task: what differs} for each of `tasks` whose stored result in `evals` (a unit's result record) was
    computed with other options than `options[task]` and the task's defaults give now ("densities: [1, 2]
    before, [1, 2, 8] now"). An option the stored result lacks (added to the task since) counts as its default;
    the task's `skip_options` are not compared where the stored result covers the work they ask for."""
    out = {}
    for name in tasks:
        stored = ((evals.get(name) or {}).get("settings") or {}).get("options")
        if not isinstance(stored, dict):
            continue
        chosen = (options or {}).get(name) or {}
        task = get_task(name, **chosen)
        now = json.loads(json.dumps(task.options_dict()))
        defaults = json.loads(json.dumps(get_task(name).options_dict()))
        lenient = task.skip_options if task.skip_options and task.covers(evals[name]) else ()
        keys = [k for k in now if (k not in _FROM_RUN or k in chosen) and k not in lenient]
        differ = differing_keys({k: stored.get(k, defaults.get(k)) for k in keys}, {k: now[k] for k in keys})
        if differ:
            out[name] = "; ".join(differ[:3])
    return out


def evaluate_run(run: RunDir, tasks: list[str], data_dir: str | Path, *, eval_seed: int = 0,
                 device: str = "cpu", options: dict[str, dict[str, Any]] | None = None,
                 replace: frozenset[str] = frozenset(), label: str | None = None) -> dict[str, dict[str, Any]]:
    """Every task on the run's final model, with options[task] (default: its defaults); {task: result record}.
    A stored result of these weights with other settings is refused (StoredResultError), except for the tasks
    in `replace`, which run again and replace it (a study evaluating its units with new options).

    A task that does not apply to the model (TaskNotApplicable) is logged and left out of the answer. Any other
    failure stops here, naming the task and the run (`label`, e.g. a study's unit, else its folder): a ValueError
    as a one-line TaskFailedError, anything else (a bug, the machine out of memory) as it is, after a logged
    line. Each finished task's result is already stored in the run's eval/ folder, so running again redoes only
    the rest."""
    if not tasks or not run.has_final():
        return {}
    loaded = load_model(run.final, device)
    tokenizer = Tokenizer.from_file(loaded.tokenizer_path) if loaded.tokenizer_path else None
    cfg = EvalConfig(data_dir=str(data_dir), eval_seed=eval_seed, device=device)
    results = ResultsDir(run.evals)
    digest = weights_hash(loaded.model)
    who = f"{label} ({run.path})" if label else str(run.path)
    out = {}
    for name in tasks:
        log.info("%s: %s ...", run.path, name)
        try:
            task = task_for_run(name, run, (options or {}).get(name))
            out[name], reused = evaluate_cached(task, loaded.model, tokenizer, cfg, results, force=name in replace,
                                                weights_sha256=digest)
        except StoredResultError:
            raise  # a result of these weights run with other settings (by hand) is the user's: never replaced
        except TaskNotApplicable as e:
            log.warning("%s: %s does not apply to this model: %s", run.path, name, e)
            continue
        except Exception as e:
            cause = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            kept = f" ({', '.join(out)}: done, kept in {run.evals})" if out else ""
            message = (f"{who}: task {name} failed: {cause}; no result is written without it: fix the cause and run "
                       f"again, which evaluates {name} again{kept}")
            if isinstance(e, ValueError):
                raise TaskFailedError(message) from e
            log.error("%s", message)
            raise
        log.info("%s: %s %s", run.path, name, "reused" if reused else "evaluated")
    return out


def stored_results(run: RunDir) -> dict[str, dict[str, Any]]:
    """The evaluation results stored for the run's final model, by task (for reports: nothing is computed; the
    final weights are read to hash them). A result of other weights in its eval/ folder (of an earlier final
    model, or copied in) is logged and left out, never reported as this run's; without a final model that loads,
    none can be told to be its: {} (logged)."""
    found = ResultsDir(run.evals).all()
    if not found or not run.has_final():
        return {}
    try:
        digest = weights_hash(load_model(run.final, "cpu").model)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # CheckpointError is a RuntimeError
        log.warning("%s: its evaluation results are left out: the final model %s does not load, so they cannot be "
                    "told to be its (%s)", run.path, run.final, e)
        return {}
    own = {}
    for name, record in found.items():
        if record.get("provenance", {}).get("weights_sha256") == digest:
            own[name] = record
        else:
            log.warning("%s: %s was computed from other weights than %s; left out", run.path,
                        ResultsDir(run.evals).json_path(name), run.final)
    return own


def outdated_evaluations(evals: dict[str, Any], tasks: list[str], *, newer: bool = False) -> dict[str, str]:
    """{task: "version 1, now 2"} for each of `tasks` whose stored result in `evals` was computed by an older
    version of the task (Task.version): code that has changed since measured it. Results stored before
    versions were recorded are version 1; a task this package no longer has is left out. newer=True: those
    computed by a newer version than this package's instead (a result from a newer checkout, which this code
    neither reproduces nor replaces)."""
    out = {}
    for name in tasks:
        settings = (evals.get(name) or {}).get("settings")
        if not isinstance(settings, dict) or name not in TASKS:
            continue
        stored, now = settings.get("task_version", 1), TASKS[name].version
        if (stored > now) if newer else (stored < now):
            out[name] = f"version {stored}, here {now}" if newer else f"version {stored}, now {now}"
    return out
