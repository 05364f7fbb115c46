"""The paper's numbers are keyed by metric names that our tasks really produce, and are the ones the paper
prints (docs/evaluation.md quotes them)."""

from __future__ import annotations

import re
from pathlib import Path

from difftransformer.eval import TASKS
from difftransformer.eval.paper import PAPER, STUDY_TASKS, paper_number

EVALUATION = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"
PRINTED = "## The paper's published numbers"  # the section of EVALUATION that quotes the paper


def test_every_entry_names_a_registered_task_and_a_reference():
    for (task, metric), number in PAPER.items():
        assert task in TASKS or task in STUDY_TASKS, task
        assert number.ref and (number.transformer is not None or number.diff is not None)
    assert paper_number("needle", "greedy@N6R2")[:3] == (0.55, 0.85, "Table 2, 4K context, 3B")
    assert paper_number("needle", "no-such-metric") is None


def test_numbers_are_the_ones_the_paper_prints():
    printed = {float(x) for x in re.findall(r"(?<![\w.])\d*\.\d+|(?<![\w.])\d+(?![\w.])",
                                            EVALUATION.read_text("utf-8").split(PRINTED, 1)[1])}
    derived = {0.393, 0.517, 0.31, 0.403}  # the faithfulness means of three printed data sets each
    for (task, metric), number in PAPER.items():
        for value in (number.transformer, number.diff, *(number.arms or {}).values()):
            if value is None:
                continue
            # accuracies printed in points (19.0) are stored as fractions (0.19)
            assert value in derived or value in printed or round(value * 100, 1) in printed, (task, metric, value)
