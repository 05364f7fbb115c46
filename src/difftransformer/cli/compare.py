"""`difftransformer compare`: DIFF and its matched Transformer (or any arms) side by side, then the report."""

from __future__ import annotations

import argparse
import sys
import time

from difftransformer import dist
from difftransformer.cli.common import add_config_args, out_dir, print_section
from difftransformer.data import ensure_data
from difftransformer.experiments import Study, StudyConfig, StudyDir, parse_int_list, run_study
from difftransformer.experiments.evaluate import TaskFailedError
from difftransformer.run_config import ConfigError, load_run_config

HELP = "train DIFF and its matched Transformer side by side, then report"
DESCRIPTION = ("Train every arm (an attention kind at the same size: DIFF and its matched Transformer by "
               "default) on the same data with paired initialisation and the same batches, for each training "
               "seed, then write <out>/report.md. One seed: <out>/<arm>/; several: <out>/seed<s>/<arm>/ (a one-seed "
               "study continued with more seeds keeps its first seed's units in <out>/<arm>/). "
               "Re-running continues unfinished arms and skips finished ones.")
EXAMPLES = """
    examples:
      difftransformer compare --config configs/demo.toml --out-dir runs/demo
      difftransformer compare --config configs/demo.toml --out-dir runs/demo3 --seeds 0,1,2
      difftransformer compare --preset cpu-small --arms diff,transformer,diff_v2 --set train.max_steps=400
      torchrun --nproc_per_node 8 -m difftransformer compare --config configs/gpu-350m.toml

      difftransformer compare --config configs/studies/ablations-cpu.toml
      difftransformer report results/ablations-cpu     # the report again, from committed result files alone

    A study is arms x seeds x sizes x token budgets ([compare] arms, seeds, sizes, tokens). Each finished
    unit is evaluated (compare.eval_tasks) and summarised in a result file under compare.results_dir;
    units whose result file exists are skipped, so a study continues on another machine from committed
    results. The report says plainly when the arms cannot be separated: with one seed always, with
    several when the 95% interval of the paired difference contains 0. A task that applies to a unit's
    model but fails while it runs stops the study with one line naming unit, task and cause, and exit
    status 3 (2: bad input); running the same command again evaluates it again."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, "the size spec's own attention kind (default diff); the arms are derived from it",
                    "[model], [train], [data], [compare]")
    p.add_argument("--arms", metavar="ARMS", help="comma-separated arms: attention kinds or named ablations "
                   "(diff_lambda_0.8, transformer_diff_heads, transformer_gated, ...; see docs/studies.md) "
                   "(default: [compare].arms, else diff,transformer); the first is the paired-init reference")
    p.add_argument("--seeds", metavar="LIST", help="comma-separated training seeds, e.g. 0,1,2 (default: "
                   "[compare].seeds, else [train].seed)")
    p.add_argument("--replace-results", action="store_true",
                   help="replace stored result files of another training length (train.max_steps): their units "
                        "train again (from their checkpoints where there are some); or evaluated with other "
                        "options ([compare.eval_options]): their units are evaluated again; without it such a "
                        "file is refused, naming what differs")


def _arm_names(text: str, compare: StudyConfig) -> list[str]:
    """--arms as names: the config's own arms (tables included) by name, else named ablations or attention
    kinds; an unknown name is an error that lists the config's arms."""
    own = {arm.name: arm for arm in compare.arms}
    names = [name.strip() for name in text.split(",") if name.strip()]
    try:
        return StudyConfig(arms=[own.get(name, name) for name in names]).arm_names  # did-you-mean, no arm twice
    except ValueError as e:
        if own and str(e).startswith("unknown arm"):
            raise ValueError(f"{e}; this config's arms: {', '.join(own)}") from None
        raise


TASK_FAILED = 3  # a task that applies to a unit's model could not run: not a crash (1), not bad input (2)


def run(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, preset=args.preset, attention=args.attention, overrides=args.overrides)
    if cfg.train.init_from is not None:
        raise ConfigError(f"train.init_from ({cfg.train.init_from}) starts one model from a folder; a study starts "
                          f"every arm of a seed from one paired random init, so remove it (use `train --init-from`)")
    arms = seeds = None
    try:
        if args.arms is not None:
            arms = _arm_names(args.arms, cfg.compare)
        if args.seeds is not None:
            seeds = parse_int_list(args.seeds, "--seeds")
            if not seeds:
                raise ValueError(f"--seeds {args.seeds!r} names no seed; give training seeds like 0,1,2")
            StudyConfig(seeds=seeds)  # >= 0, below 2**32, no seed twice
    except ValueError as e:
        raise ConfigError(str(e).replace("compare.seeds", "--seeds")) from None
    study_dir = StudyDir(out_dir(args) or cfg.compare.out_dir)
    data = ensure_data(cfg.data)
    cfg.resolve_vocab(data.vocab_size)
    t0 = time.perf_counter()
    try:
        run_study(Study(cfg.model, cfg.train, cfg.data, cfg.compare, cfg.source), study_dir.path, arms=arms,
                  seeds=seeds, resume=not args.no_resume, replace_results=args.replace_results)
    except TaskFailedError as e:  # a task that applies could not run: as `eval all` says it, exit status 3
        print(f"difftransformer compare: error: {e}", file=sys.stderr)
        return TASK_FAILED
    if dist.is_main():
        print(f"\ncompare finished in {(time.perf_counter() - t0) / 60:.1f} min; report: {study_dir.report}")
        print_section(study_dir.report, "## Verdict")
    return 0
