"""Studies over many training runs: paired DIFF/baseline comparisons, their statistics and report.

    from difftransformer.experiments import CompareConfig, Study, run_compare
    run_compare(Study(model_cfg, train_cfg, data_cfg, CompareConfig(seeds=[0, 1, 2])), "runs/study")

One model at a time is evaluated by `difftransformer.eval`; this package trains and compares many.
"""

from difftransformer.experiments.compare import Study, StudyMismatchError, run_compare
from difftransformer.experiments.config import CompareConfig, parse_int_list
from difftransformer.experiments.pairing import PairedInit, paired_init
from difftransformer.experiments.provenance import hardware, invocation
from difftransformer.experiments.report import write_report
from difftransformer.experiments.stats import NOISE_FACTOR, mean_std, paired_differences, verdict
from difftransformer.experiments.study_dir import StudyDir

__all__ = [
    "NOISE_FACTOR", "CompareConfig", "PairedInit", "Study", "StudyDir", "StudyMismatchError", "hardware",
    "invocation", "mean_std", "paired_differences", "paired_init", "parse_int_list", "run_compare", "verdict",
    "write_report",
]
