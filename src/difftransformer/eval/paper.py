"""The paper's published numbers (arXiv 2410.05258 v2), keyed by our task and metric names.

One home for them: the data file paper_numbers.json beside this module (each entry names its table
or figure); `eval compare` and the study reports print them beside our measurements. The paper measured
3B-13B models on 4K-64K contexts with a GPT-4o
judge where we measure small models offline: the numbers are a reference for direction and size of
an effect, not a target a small model should reach (docs/evaluation.md says what each compares to).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import NamedTuple

PAPER_FILE = "paper_numbers.json"
# numbers about training (loss, scaling fits), read by study reports
# package data beside this module: the numbers with their references
STUDY_TASKS = ("lm", "scaling")


class PaperNumber(NamedTuple):
    transformer: float | None
    diff: float | None
    ref: str  # table / figure, and the setting that differs from ours
    arms: dict[str, float] | None = None  # per-arm values where the paper's table has more rows (Table 6)


def _load() -> dict[tuple[str, str], PaperNumber]:
    doc = json.loads(resources.files(__package__).joinpath(PAPER_FILE).read_text(encoding="utf-8"))
    return {(e["task"], e["metric"]): PaperNumber(e.get("transformer"), e.get("diff"), e["ref"], e.get("arms"))
            for e in doc["numbers"]}


PAPER: dict[tuple[str, str], PaperNumber] = _load()  # (task, metric) -> the paper's numbers


def paper_number(task: str, metric: str) -> PaperNumber | None:
    """The paper's Transformer and DIFF values for one of our metrics, if it reports one."""
    return PAPER.get((task, metric))
