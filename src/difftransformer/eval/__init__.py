"""Evaluation: side-by-side comparisons of attention kinds (arms x seeds) and their report."""

from difftransformer.eval.compare import arm_configs, arm_dir, ensure_data, hardware, is_finished, run_compare
from difftransformer.eval.report import paired_diffs, verdict, write_report

__all__ = ["arm_configs", "arm_dir", "ensure_data", "hardware", "is_finished", "paired_diffs", "run_compare",
           "verdict", "write_report"]
