"""Side-by-side runs: every arm (attention kind) x every training seed, paired, resumable, then the report.

Per seed, all arms start from `paired_init` (identical weights wherever names and shapes match) and
see the same batches (the same TrainConfig.seed), so the only difference between arms is the
attention. The study folder (study_dir.py) holds one run folder per arm and seed and a manifest of
what was run. Re-running continues unfinished arms and skips finished ones.

    study = Study(get_preset("cpu-small").config(), TrainConfig(max_steps=240), DataConfig(corpus="sotu"),
                  CompareConfig(arms=["diff", "transformer"]))
    run_compare(study, "runs/demo")      # train.data_dir is set to data's prepared folder
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
from difftransformer.experiments.config import CompareConfig, baseline_arm
from difftransformer.experiments.pairing import paired_init
from difftransformer.experiments.provenance import hardware, invocation
from difftransformer.experiments.study_dir import StudyDir
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.model.config import model_identity
from difftransformer.train import TrainConfig, train
from difftransformer.train.config import FREELY_CHANGEABLE
from difftransformer.train.distributed import resolve_device

log = logging.getLogger("difftransformer.experiments")


class StudyMismatchError(ValueError):
    """A study folder holds another comparison than the one asked to continue in it."""


@dataclass
class Study:
    """Everything one comparison needs: the size spec, the recipe, the data and the study settings."""

    model: DiffTransformerConfig  # the size spec (any kind; arms are derived with `matched`); its
    # vocab_size must hold the tokenizer's (the CLI sizes it from the prepared data)
    train: TrainConfig  # its data_dir is replaced by the folder `data` is prepared in
    data: DataConfig
    compare: CompareConfig
    config_file: str | None = None  # the run config it came from, for the record

    def arm_configs(self, arms: list[str]) -> list[DiffTransformerConfig]:
        """Each arm is the size spec with another attention kind (heads converted by `matched`)."""
        return [self.model.matched(a) for a in arms]


def run_compare(study: Study, out_dir: str | Path, *, arms: list[str] | None = None, seeds: list[int] | None = None,
                resume: bool = True, command: str | None = None, report: bool = True) -> Path:
    """Train every arm for every seed (paired), then write <out_dir>/report.md; returns out_dir.

    One comparison at a time per folder: a second one refuses at once (FolderInUseError)."""
    folder = StudyDir(out_dir)
    if not dist.is_main():
        return _run_compare(study, folder, arms, seeds, resume, command, report)
    with folder_lock(folder.path, purpose="compare into another --out-dir"):
        return _run_compare(study, folder, arms, seeds, resume, command, report)


def _run_compare(study: Study, folder: StudyDir, arms: list[str] | None, seeds: list[int] | None, resume: bool,
                 command: str | None, report: bool) -> Path:
    arms = list(arms or study.compare.arms)
    seeds = list(seeds if seeds is not None else (study.compare.seeds or [study.train.seed]))
    data = ensure_data(study.data)
    study = dataclasses.replace(study, train=dataclasses.replace(study.train, data_dir=str(data.out_dir)))
    configs = study.arm_configs(arms)
    manifest = _merge_manifest(folder, _manifest(study, arms, seeds, configs, data, command))
    if dist.is_main():
        folder.path.mkdir(parents=True, exist_ok=True)
        _write_json(folder.manifest, manifest)
    for seed in seeds:
        _run_seed(study, folder, manifest, arms, configs, seed, multi=len(seeds) > 1, resume=resume)
    if dist.is_main() and study.compare.eval_tasks:
        from difftransformer.experiments.evaluate import evaluate_run

        for seed in seeds:
            for arm in arms:
                evaluate_run(folder.run_dir(arm, seed, len(seeds) > 1), study.compare.eval_tasks, data.out_dir,
                             device=str(resolve_device(study.train.device)))
    if dist.is_main():
        manifest["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        _write_json(folder.manifest, manifest)
        if report:
            from difftransformer.experiments.report import write_report

            write_report(folder.path)
    return folder.path


def _run_seed(study: Study, folder: StudyDir, manifest: dict[str, Any], arms: list[str],
              configs: list[DiffTransformerConfig], seed: int, *, multi: bool, resume: bool) -> None:
    """Train the arms of one seed that are not finished yet, from one paired initialisation."""
    dirs = [folder.run_dir(a, seed, multi) for a in arms]
    pending = [i for i, d in enumerate(dirs) if not (resume and d.is_finished(study.train.max_steps))]
    for i in sorted(set(range(len(arms))) - set(pending)):
        log.info("seed %d, arm %s: already finished in %s; skipping", seed, arms[i], dirs[i].path)
    if not pending:
        return
    states = paired_init(configs, seed)  # ignored by train() for arms that resume from a checkpoint
    for n, i in enumerate(pending):
        tcfg = dataclasses.replace(study.train, out_dir=str(dirs[i].path), seed=seed)
        log.info("seed %d, arm %s (%d/%d): training into %s", seed, arms[i], n + 1, len(pending), dirs[i].path)
        t0 = time.perf_counter()
        result = train(configs[i], tcfg, init_state=states[i], resume=resume)
        wall = time.perf_counter() - t0
        if dist.is_main():
            key = f"seed{seed}/{arms[i]}"
            manifest["wall_s"][key] = manifest["wall_s"].get(key, 0.0) + wall if resume else wall
            _write_json(folder.manifest, manifest)
        states[i] = None  # free memory early: big models
        del result


def _manifest(study: Study, arms: list[str], seeds: list[int], configs: list[DiffTransformerConfig],
              data: PreparedData, command: str | None) -> dict[str, Any]:
    counts = {a: DiffTransformerLM(c, device="meta").num_parameters() for a, c in zip(arms, configs)}
    train_record = study.train.to_dict()
    train_record.pop("out_dir")
    return {
        "format": "difftransformer-compare-v1",
        "arms": arms,
        "seeds": seeds,
        "baseline": baseline_arm(arms),
        "models": {a: c.to_dict() for a, c in zip(arms, configs)},
        "parameters": counts,
        "train": train_record,
        "data": {**study.data.to_dict(), "data_dir": str(data.out_dir), "corpus": data.corpus or study.data.corpus,
                 "num_tokens": data.num_tokens, "num_documents": data.num_documents,
                 "vocab_size": data.vocab_size, "corpus_hash": data.corpus_hash},
        "report": study.compare.samples(),
        "eval_tasks": list(study.compare.eval_tasks),
        "config_file": study.config_file,
        "command": command or invocation(),
        "hardware": hardware(),
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": {},
    }


def _merge_manifest(folder: StudyDir, new: dict[str, Any]) -> dict[str, Any]:
    """Continue the manifest of an earlier invocation in the same folder (refusing another study):
    arms and seeds from before stay, so the report covers everything in the folder."""
    old = folder.read_manifest()
    if old is None:
        return new
    _check_same_study(old, new, folder.manifest)
    new["started"] = old.get("started", new["started"])
    new["wall_s"] = old.get("wall_s", {})
    new["arms"] = new["arms"] + [a for a in old.get("arms", []) if a not in new["arms"]]
    new["baseline"] = baseline_arm(new["arms"])
    new["seeds"] = sorted(set(new["seeds"]) | set(old.get("seeds", [])))
    new["models"] = {**old.get("models", {}), **new["models"]}
    new["parameters"] = {**old.get("parameters", {}), **new["parameters"]}
    return new


def _check_same_study(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Resuming into a folder that holds another comparison would mix two studies in one report."""
    recipe = {k: v for k, v in new["train"].items() if k not in FREELY_CHANGEABLE}
    changed = {k: (old.get("train", {}).get(k), v) for k, v in recipe.items()
               if "train" in old and old["train"].get(k, v) != v}
    if changed:
        detail = ", ".join(f"{k}: {a!r} before, {b!r} now" for k, (a, b) in changed.items())
        raise StudyMismatchError(f"{path} was trained with another recipe ({detail}); every arm of a study trains "
                                 f"with one recipe. Use another --out-dir for the new one")
    for key in ("models", "data"):
        o, n = dict(old.get(key, {})), dict(new[key])
        if key == "data":  # what the tokens are matters; where they are cached does not
            o = {k: o.get(k) for k in ("corpus_hash", "vocab_size")}
            n = {k: n.get(k) for k in ("corpus_hash", "vocab_size")}
        else:  # arms may be added to a comparison; the ones it already has must be the same models
            o = {a: model_identity(c) for a, c in o.items() if a in n}
            n = {a: model_identity(c) for a, c in n.items() if a in o}
        if o != n:
            raise StudyMismatchError(f"{path} was written for a different comparison ({key} differ); use another "
                                     f"--out-dir, or delete {path.parent} to start over")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2) + "\n")
