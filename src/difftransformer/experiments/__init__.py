"""Studies over many training runs: arms x seeds x sizes x token budgets, paired, evaluated, with
statistics over seeds, scaling fits and one report (Markdown + self-contained HTML).

    from difftransformer.experiments import Study, StudyConfig, run_study
    run_study(Study(model_cfg, train_cfg, data_cfg, StudyConfig(seeds=[0, 1, 2])), "runs/study")

A study is what `difftransformer compare` runs (its settings are the `[compare]` section). One model at a
time is evaluated by `difftransformer.eval`, and two models' results side by side are
`eval.comparison`; this package trains and evaluates many.

`CompareConfig` and `run_compare` are the names `StudyConfig` and `run_study` had before; they still
work and will be removed in the next release.
"""

from difftransformer.experiments.ablations import ABLATIONS, Arm, parse_arm
from difftransformer.experiments.config import Size, StudyConfig, parse_int_list
from difftransformer.experiments.pairing import PairedInit, paired_init
from difftransformer.experiments.provenance import hardware, invocation
from difftransformer.experiments.report import write_report
from difftransformer.experiments.stats import compare_paired, mean_std, paired_differences, t_interval, verdict
from difftransformer.experiments.study import Study, StudyMismatchError, run_study
from difftransformer.experiments.study_dir import StudyDir
from difftransformer.experiments.units import Unit

CompareConfig = StudyConfig  # deprecated name, removed in the next release
run_compare = run_study  # deprecated name, removed in the next release

__all__ = [
    "ABLATIONS", "Arm", "PairedInit", "Size", "Study", "StudyConfig", "StudyDir", "StudyMismatchError", "Unit",
    "compare_paired", "hardware", "invocation", "mean_std", "paired_differences", "paired_init", "parse_arm",
    "parse_int_list", "run_study", "t_interval", "verdict", "write_report",
]
