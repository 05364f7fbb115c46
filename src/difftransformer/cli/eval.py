"""`difftransformer eval`: the paper's measurements on one trained model, and two models side by side.

    difftransformer eval needle runs/demo/diff --lengths 192,229
    difftransformer eval all runs/demo/diff
    difftransformer eval compare runs/demo/transformer runs/demo/diff

Each task is a subcommand whose flags are the task's own options (eval/task.py turns the fields of
its Options dataclass into flags), plus the settings every task shares. Results go to the run's
eval/ folder (`<task>.json`, and `<task>.png` where the paper has a figure) and are reused while the
weights and settings are unchanged (eval/results.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import sys
from pathlib import Path
from typing import Any

from difftransformer._io import atomic_write_text
from difftransformer.cli.common import (
    Formatter,
    check_device,
    epilog,
    is_transformers_folder,
    load_trained,
    model_tokenizer,
)
from difftransformer.eval import TASKS, EvalConfig, Task, get_task
from difftransformer.eval.comparison import compare_table
from difftransformer.eval.results import (
    ResultsDir,
    StoredResultError,
    comparable_settings,
    differing_keys,
    evaluate_cached,
    settings_served,
)
from difftransformer.eval.task import OPTION_LIMIT, TaskNotApplicable, option_kind, shown, task_settings, weights_hash
from difftransformer.experiments.evaluate import task_for_run
from difftransformer.run_config import ConfigError
from difftransformer.train import RunDir
from difftransformer.train.run_dir import EVAL_DIR

HELP = "evaluate a model with the paper's measurements (retrieval, attention noise, outliers, ...)"
DESCRIPTION = ("Run one of the paper's evaluations on a trained model (a run folder, its final/ folder or a "
               "checkpoint; the black-box tasks also on a local transformers causal-LM folder, with --data-dir), "
               "`all` of them, or `compare` two models in one Markdown table beside the paper's "
               "numbers. Results are written as JSON (settings, weights hash, package version, time taken) and, "
               "where the paper has a figure, a PNG, into the run's eval/ folder; a result for the same weights "
               "and settings is reused.")
EXAMPLES = """
    examples:
      difftransformer eval needle runs/demo/diff
      difftransformer eval needle runs/demo/diff --lengths 192,229 --samples 20 --haystack needles
      difftransformer eval outliers runs/demo/transformer --tokens 20000
      difftransformer eval all runs/demo/diff
      difftransformer eval compare runs/demo/transformer runs/demo/diff --out runs/demo/eval.md
      difftransformer eval needle --help        # the task's own options"""
ALL, COMPARE = "all", "compare"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="task", metavar="TASK", required=True,
                           help=f"one of: {', '.join(sorted(TASKS))}, {ALL}, {COMPARE}")
    for name in sorted(TASKS):
        cls = TASKS[name]
        tp = sub.add_parser(name, formatter_class=Formatter, help=cls.description,
                            description=f"{name}: {cls.description}." + (" White box: needs one of this package's "
                                                                          "models." if cls.white_box else ""),
                            epilog=epilog(f"""
                                example:
                                  difftransformer eval {name} runs/demo{"-ood" if name == "ood" else ""}/diff"""))
        tp.add_argument("model", metavar="MODEL", help="run folder, final/ folder or checkpoint folder")
        _add_shared(tp)
        _add_options(tp, cls)
    ap = sub.add_parser(ALL, formatter_class=Formatter, help="run every task with its defaults",
                        description="Run every evaluation task on MODEL with its default options; results "
                                    "already there for these weights and settings are reused. A task that does "
                                    "not apply to MODEL (ood on a model trained on text) is named and left out; "
                                    "one that applies but could not run is named, the others still run, and the "
                                    "exit status is 3.")
    ap.add_argument("model", metavar="MODEL", help="run folder, final/ folder or checkpoint folder")
    ap.add_argument("--tasks", metavar="LIST", help="comma-separated subset of the tasks (default: all)")
    _add_shared(ap)
    cp = sub.add_parser(COMPARE, formatter_class=Formatter, help="two models side by side, beside the paper",
                        description="Evaluate MODEL_A and MODEL_B with every task (reusing stored results) and "
                                    "print one Markdown table: each metric for both, B - A, and the paper's "
                                    "Transformer and DIFF numbers where it has them. Put the baseline first. "
                                    "Tasks that do not apply or could not run are noted under the table; exit "
                                    "status 3 when one that applies could not run.")
    cp.add_argument("model", metavar="MODEL_A", help="the baseline, e.g. runs/demo/transformer")
    cp.add_argument("model_b", metavar="MODEL_B", help="e.g. runs/demo/diff")
    cp.add_argument("--tasks", metavar="LIST", help="comma-separated subset of the tasks (default: all)")
    cp.add_argument("--out", metavar="FILE", help="also write the table to this Markdown file")
    cp.add_argument("--no-run", action="store_true",
                    help="only read stored results; run nothing. A stored result is shown only when it was computed "
                         "from these weights with the settings the other flags ask for (--split, --seq-len, "
                         "--data-dir, --eval-seed, the tasks' default options) by this package's version of the "
                         "task; any other is named and left out")
    _add_shared(cp)


def _add_shared(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shared settings")
    g.add_argument("--data-dir", metavar="DIR", help="prepared-data folder for held-out text (default: the run's own)")
    g.add_argument("--split", default="test", choices=("test", "val"), help="held-out split (default test)")
    g.add_argument("--eval-seed", type=int, default=0, metavar="N",
                   help="seeds the task's own randomness: prompts, subsets, orders (default 0)")
    g.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per forward (default 8)")
    g.add_argument("--seq-len", type=int, metavar="N",
                   help="window / prompt length in tokens for the tasks that read held-out text in windows "
                        "(default: the model's context, max_position_embeddings; a task's own length option wins)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json, if not the one saved with the model")
    g.add_argument("--out-dir", metavar="DIR", help="where results go (default: the run's eval/ folder)")
    g.add_argument("--force", action="store_true", help="run again even if a stored result matches")


def _add_options(p: argparse.ArgumentParser, cls: type[Task]) -> None:
    """One flag per field of the task's Options: --name-with-dashes; lists are comma-separated."""
    fields = dataclasses.fields(cls.Options)
    if not fields:
        return
    g = p.add_argument_group(f"{cls.name} options")
    for f in fields:
        kind, is_tuple = option_kind(f)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(cls.Options(), f.name)
        shown = ",".join(map(str, default)) if is_tuple else default
        text = f"{f.metadata.get('help', '')} (default: {shown if shown not in ('', ()) else 'automatic'})"
        if kind is bool and not is_tuple:
            g.add_argument(flag, dest=f"opt_{f.name}", action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            g.add_argument(flag, dest=f"opt_{f.name}", type=_parser(kind, is_tuple, flag), default=None,
                           metavar=("LIST" if is_tuple else kind.__name__.upper()), help=text)


def _parser(kind: type, is_tuple: bool, flag: str):
    def one(text: str) -> Any:
        try:
            return kind(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {kind.__name__} values; {text!r} is not one") from None

    def parse(text: str) -> Any:
        if not is_tuple:
            return one(text)
        return tuple(one(t) for t in text.split(",") if t.strip())
    return parse


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def _task_names(args: argparse.Namespace) -> list[str]:
    if getattr(args, "tasks", None) is None:  # '' is a list that names nothing: refused below, not "all"
        return sorted(TASKS)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"--tasks {args.tasks!r} names no task; list some, e.g. --tasks needle,outliers")
    for name in names:
        get_task(name)  # an unknown name is a one-line error with the list
    return names


class _Model:
    """A loaded model with what evaluating it needs: tokenizer, default data, results folder."""

    def __init__(self, path: str, args: argparse.Namespace):
        self.path = path
        if not Path(path).exists():
            raise ConfigError(f"{path} does not exist; give a run folder, final/ folder or checkpoint folder")
        self.step = None
        self.foreign = is_transformers_folder(path)
        if self.foreign:  # black-box tasks on any transformers causal LM
            if args.tokenizer:
                raise ConfigError(
                    f"{path} is a transformers folder and brings its own tokenizer; leave --tokenizer out"
                )
            from difftransformer.hf.causal_lm import load_causal_lm

            self.model, self.tokenizer = load_causal_lm(path, args.device)
            self.run = None
        else:
            loaded = load_trained(path, args.device)
            self.model, self.step = loaded.model, loaded.checkpoint_step
            self.tokenizer = model_tokenizer(path, args.tokenizer, loaded)
            self.run = _run_of(Path(path))
        context = getattr(self.model.config, "max_position_embeddings", None)
        if args.seq_len is not None and isinstance(context, int) and args.seq_len > context:
            raise ConfigError(f"--seq-len {args.seq_len} is beyond the context of {path} ({context} tokens, "
                              f"max_position_embeddings); use --seq-len <= {context}")
        data_dir = args.data_dir or (self.run.data_dir() if self.run else None)
        self.cfg = EvalConfig(data_dir=str(data_dir) if data_dir else None, split=args.split, seq_len=args.seq_len,
                              eval_seed=args.eval_seed, batch_size=args.batch_size, device=args.device)
        own = args.out_dir is None  # the model's own eval/ folder; a chosen one may hold other models' results
        self.results = ResultsDir(self._default_results() if own else args.out_dir, own=own)
        self.out_dir_given = args.out_dir is not None
        self.hash = weights_hash(self.model)  # once per model, whatever number of tasks

    def _default_results(self) -> Path:
        step = self.step
        if self.run is not None:
            return self.run.evals if step is None else self.run.evals / f"step_{step:08d}"
        return Path(self.path) / EVAL_DIR

    def stored(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The stored results of `names` that belong to these weights (--no-run); a result left by other
        weights (an earlier final/, another model sharing the folder) is named and left out, never shown
        as this model's."""
        out = {}
        for name in names:  # a broken file is named, not taken for a missing one
            problem = self.results.problem(name)
            if problem is not None:
                print(f"{name}: {self.results.json_path(name)} is not a readable result ({problem}); delete it or "
                      f"run without --no-run to evaluate {self.path} again", file=sys.stderr)
        for name, record in self.results.all().items():
            if name not in names:
                continue
            if record.get("provenance", {}).get("weights_sha256") != self.hash:
                print(f"{name}: {self.results.json_path(name)} was computed from other weights than {self.path}'s; "
                      f"left out (run without --no-run to evaluate this model)", file=sys.stderr)
                continue
            theirs, ours = record.get("settings", {}).get("task_version", 1), TASKS[name].version
            if theirs != ours:
                print(f"{name}: {self.results.json_path(name)} was computed by version {theirs} of the task, this "
                      f"package's is {ours} (docs/evaluation.md, task versions); left out (run without --no-run to "
                      f"compute it again)", file=sys.stderr)
                continue
            differ = self._other_settings(name, record)
            if differ:
                print(f"{name}: {self.results.json_path(name)} was computed with other settings than these flags "
                      f"ask for ({'; '.join(differ[:3])}); left out (run without --no-run, or pass the flags it was "
                      f"run with)", file=sys.stderr)
                continue
            out[name] = record
        return out

    def _other_settings(self, name: str, record: dict[str, Any]) -> list[str]:
        """Where a stored result's settings differ from what the flags ask (split, seq_len, data, eval seed, the
        task's default options); [] when they match or the task cannot say (it cannot run on this model)."""
        try:
            settings = task_settings(self.task(name, {}), self.cfg, self.model)
            wanted = comparable_settings(settings_served(name, settings, record))
        except ValueError:
            return []
        stored = comparable_settings(record.get("settings", {}))
        differ = [] if stored == wanted else differing_keys(stored, wanted)
        if record.get("settings", {}).get("model") != settings.get("model"):
            differ.append("the model's configuration")
        return differ

    def task(self, name: str, options: dict[str, Any]) -> Task:
        return task_for_run(name, self.run, options)

    def conflicts(self, names: list[str]) -> list[str]:
        """The stored results (these weights, other settings) that running `names` with their defaults would
        replace (ResultsDir.conflict), before anything runs."""
        out = []
        for name in names:
            try:
                task = self.task(name, {})
            except ValueError:  # a task that cannot run on this model is named when it is skipped
                continue
            conflict = self.results.conflict(name, self.hash, task_settings(task, self.cfg, self.model))
            if conflict:
                out.append(conflict)
        return out

    def evaluate(self, task: Task, force: bool) -> dict[str, Any]:
        """The task's result for this model: stored if it matches, else run now and saved."""
        if task.white_box and self.foreign:
            raise TaskNotApplicable(f"{task.name} looks inside attention and runs on this package's models only; "
                              f"{self.path} is a transformers folder. Black-box tasks run on it: "
                              f"{', '.join(sorted(n for n, t in TASKS.items() if not t.white_box))}")
        print(f"{task.name}: {self.path} ...", file=sys.stderr)
        try:
            record, _ = evaluate_cached(task, self.model, self.tokenizer, self.cfg, self.results, force=force,
                                        log=lambda line: print(line, file=sys.stderr), weights_sha256=self.hash)
        except OSError as e:  # the model's own eval/ folder, read-only: the flag that moves the results is the fix
            if self.out_dir_given or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise ConfigError(f"{self.results.path} cannot be written ({e.strerror}), so {task.name}'s result cannot "
                              f"be kept beside the model; pass --out-dir DIR to keep the results in a folder you can "
                              f"write") from None
        return record


def _run_of(path: Path) -> RunDir | None:
    """The run folder a model path belongs to (the folder itself, the parent of final/, or the run
    that holds a checkpoint), if any."""
    for candidate in (path, path.parent, path.parent.parent):
        if RunDir(candidate).train_config.is_file():
            return RunDir(candidate)
    return None


def _check_shared(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len must be a positive integer, got {args.seq_len}")
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value > OPTION_LIMIT:
            raise ConfigError(f"{flag} {shown(value)} is beyond what an evaluation can run; use at most "
                              f"{OPTION_LIMIT:,}")
    for flag, value in (("--out-dir", args.out_dir), ("--out", getattr(args, "out", None)),
                        ("--data-dir", args.data_dir), ("--tokenizer", args.tokenizer)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty; name a path (`.` for the current folder), or leave {flag} out")
    check_device(args.device)
    if not 0 <= args.eval_seed < 2**63:
        raise ConfigError(f"--eval-seed must be in [0, 2**63), got {args.eval_seed}")


def _reads_seq_len(name: str, seq_len: int | None, alone: bool) -> bool:
    """Whether a --seq-len given to task `name` is read by it. Run alone, a task that sizes its own
    prompts (needle, icl, hallucination) refuses the flag, naming its own options, rather than ignore it;
    in `all` / `compare` the caller notes it and runs the task."""
    if seq_len is None or TASKS[name].reads_seq_len:
        return True
    if alone:
        raise ConfigError(f"{name} does not read --seq-len ({seq_len}): it sizes its own prompts from its options "
                          f"and the model's context (see `difftransformer eval {name} --help`); drop --seq-len")
    return False


def _check_own_results_folders(a: _Model, b: _Model) -> None:
    """Two models with different weights cannot keep their results in one folder: each `<task>.json`
    would replace the other model's, and a later --no-run would show one model's numbers in both columns."""
    if a.results.path.resolve() == b.results.path.resolve() and a.hash != b.hash:
        raise ConfigError(f"--out-dir {a.results.path} would hold the results of both models, each replacing the "
                          f"other's; leave --out-dir out (each model keeps its results in its own eval/ folder)")


def _refuse_replacing(conflicts: list[str], way: str) -> None:
    """Refuse, before anything runs, to replace stored results of other settings (the user's work): one line
    naming the first, how many there are, and the ways out."""
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise ConfigError(f"{conflicts[0]}{more}, which running the tasks with their defaults would replace; use "
                          f"{way}, --out-dir DIR to keep new results elsewhere, or --force to replace them")


def _print_metrics(name: str, record: dict[str, Any]) -> None:
    print(f"## {name}")
    for key, value in record.get("metrics", {}).items():
        print(f"  {key:<32} {value:.4g}" if isinstance(value, float) else f"  {key:<32} {value}")


def _evaluate_all(model: _Model, names: list[str], force: bool, skipped: dict[str, str],
                  inapplicable: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every named task on one model. A task that does not apply to it (TaskNotApplicable: `ood` on a model
    trained on text) is named and recorded in `inapplicable`; one that could not run (no held-out data, a
    context too short for its prompts) in `skipped` ({task: why}); either way the others still run."""
    out = {}
    for name in names:
        if not _reads_seq_len(name, model.cfg.seq_len, alone=False):
            print(f"{name}: --seq-len is not read by this task (it sizes its own prompts)", file=sys.stderr)
        try:
            out[name] = model.evaluate(model.task(name, {}), force)
        except StoredResultError:
            raise
        except ValueError as e:
            applies = not isinstance(e, TaskNotApplicable)
            print(f"{name}: {'skipped' if applies else 'does not apply to this model'}: {e}", file=sys.stderr)
            into = skipped if applies else inapplicable
            into[name] = "; ".join(filter(None, [into.get(name), f"{model.path}: {e}"]))
    return out


PARTIAL = 3  # `all` / `compare` when a task that applies could not run: not a crash (1), not bad input (2)


def _skipped_status(skipped: dict[str, str]) -> int:
    """PARTIAL when a task that applies to a model could not run on it (the command did not measure what it was
    asked to), with one line naming them; 0 otherwise (tasks that do not apply to a model are no failure)."""
    if not skipped:
        return 0
    print(f"could not run {len(skipped)} task(s): {', '.join(sorted(skipped))} (reasons above); exit status "
          f"{PARTIAL}", file=sys.stderr)
    return PARTIAL


def run(args: argparse.Namespace) -> int:
    _check_shared(args)
    if args.task in TASKS:
        _reads_seq_len(args.task, args.seq_len, alone=True)  # before the model is loaded
    if args.task == COMPARE:
        a, b = _Model(args.model, args), _Model(args.model_b, args)
        _check_own_results_folders(a, b)
        names = _task_names(args)
        if not (args.no_run or args.force):
            _refuse_replacing(a.conflicts(names) + b.conflicts(names), "--no-run to compare the stored results")
        skipped: dict[str, str] = {}
        inapplicable: dict[str, str] = {}
        if args.no_run:
            ra, rb = a.stored(names), b.stored(names)
        else:
            ra = _evaluate_all(a, names, args.force, skipped, inapplicable)
            rb = _evaluate_all(b, names, args.force, skipped, inapplicable)
        table = compare_table(ra, rb, (args.model, args.model_b), (a.model.config.attention, b.model.config.attention),
                              skipped=skipped, inapplicable=inapplicable)
        print(table)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(args.out, table + "\n")
            print(f"wrote {args.out}", file=sys.stderr)
        return _skipped_status(skipped)
    model = _Model(args.model, args)
    if args.task == ALL:
        names = _task_names(args)
        if not args.force:
            _refuse_replacing(model.conflicts(names), "--tasks to leave those tasks out")
        skipped: dict[str, str] = {}
        for name, record in _evaluate_all(model, names, args.force, skipped, {}).items():
            _print_metrics(name, record)
        return _skipped_status(skipped)
    record = model.evaluate(model.task(args.task, _options(args)), args.force)
    _print_metrics(args.task, record)
    return 0
