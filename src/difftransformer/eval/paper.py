"""The paper's published numbers (arXiv 2410.05258 v2), keyed by our task and metric names.

One home for them: `eval compare` and the study reports print them beside our measurements. Each
entry names its table or figure. The paper measured 3B-13B models on 4K-64K contexts with a GPT-4o
judge where we measure small models offline: the numbers are a reference for direction and size of
an effect, not a target a small model should reach (docs/evaluation.md says what each compares to).
"""

from __future__ import annotations

from typing import NamedTuple


class PaperNumber(NamedTuple):
    transformer: float | None
    diff: float | None
    ref: str  # table / figure, and the setting that differs from ours


PAPER: dict[tuple[str, str], PaperNumber] = {}


def paper_number(task: str, metric: str) -> PaperNumber | None:
    """The paper's Transformer and DIFF values for one of our metrics, if it reports one."""
    return PAPER.get((task, metric))
