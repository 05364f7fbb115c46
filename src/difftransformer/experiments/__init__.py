"""Studies over many training runs: arms x seeds x sizes x token budgets, paired, evaluated, with
statistics over seeds, scaling fits and one report (Markdown + self-contained HTML).

    from difftransformer.experiments import CompareConfig, Study, run_compare
    run_compare(Study(model_cfg, train_cfg, data_cfg, CompareConfig(seeds=[0, 1, 2])), "runs/study")

One model at a time is evaluated by `difftransformer.eval`; this package trains and compares many.
"""

from difftransformer.experiments.ablations import ABLATIONS, Arm, parse_arm
from difftransformer.experiments.compare import Study, StudyMismatchError, run_compare
from difftransformer.experiments.config import CompareConfig, Size, parse_int_list
from difftransformer.experiments.pairing import PairedInit, paired_init
from difftransformer.experiments.provenance import hardware, invocation
from difftransformer.experiments.report import write_report
from difftransformer.experiments.stats import compare_paired, mean_std, paired_differences, t_interval, verdict
from difftransformer.experiments.study_dir import StudyDir
from difftransformer.experiments.units import Unit

__all__ = [
    "ABLATIONS", "Arm", "CompareConfig", "PairedInit", "Size", "Study", "StudyDir", "StudyMismatchError", "Unit",
    "compare_paired", "hardware", "invocation", "mean_std", "paired_differences", "paired_init", "parse_arm",
    "parse_int_list", "run_compare", "t_interval", "verdict", "write_report",
]
