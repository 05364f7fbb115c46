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


def _rows(task: str, ref: str, names: list[str], transformer: list[float], diff: list[float]) -> dict:
    return {(task, n): PaperNumber(t, d, ref) for n, t, d in zip(names, transformer, diff, strict=True)}


_DEPTHS = (0, 25, 50, 75, 100)
PAPER: dict[tuple[str, str], PaperNumber] = {
    # Table 2 / Fig. 5: 4K context, 50 samples per (depth, length) cell, greedy, 3B models
    **_rows("needle", "Table 2, 4K context, 3B", ["greedy@N1R1", "greedy@N2R2", "greedy@N4R2", "greedy@N6R2"],
            [1.00, 0.85, 0.62, 0.55], [1.00, 0.92, 0.84, 0.85]),
    # Fig. 1: allocation of the answer-producing row, averaged over heads and layers
    **_rows("attention-noise", "Fig. 1, 4K needle, 3B", ["bos", "before", "answer", "after", "query"],
            [0.32, 0.18, 0.03, 0.34, 0.13], [0.19, 0.01, 0.31, 0.01, 0.48]),
    # Table 3: attention to the answer and noise (both context segments) per answer depth
    **_rows("attention-noise", "Table 3, 4K needle, 3B", [f"answer@{d}" for d in _DEPTHS],
            [0.03, 0.03, 0.03, 0.07, 0.09], [0.27, 0.30, 0.31, 0.32, 0.40]),
    **_rows("attention-noise", "Table 3, 4K needle, 3B", [f"noise@{d}" for d in _DEPTHS],
            [0.51, 0.54, 0.52, 0.49, 0.49], [0.01, 0.02, 0.02, 0.02, 0.01]),
    # Table 5: 0.4M tokens, 3B models
    **_rows("outliers", "Table 5, 0.4M tokens, 3B",
            [f"attention_logits_{k}" for k in ("top1", "top2", "top3", "top10", "top100", "median")],
            [318.0, 308.2, 304.9, 284.7, 251.5, 5.4], [38.8, 38.8, 37.3, 32.0, 27.4, 3.3]),
    **_rows("outliers", "Table 5, 0.4M tokens, 3B",
            [f"hidden_states_{k}" for k in ("top1", "top2", "top3", "top10", "top100", "median")],
            [3608.6, 3607.4, 3603.6, 3552.1, 2448.2, 0.6], [1688.2, 1672.5, 1672.1, 1624.3, 740.9, 1.2]),
    # §3.6: fraction judged faithful by GPT-4o, mean of the three data sets of each kind
    ("hallucination", "faithful_summary"): PaperNumber(0.393, 0.517, "§3.6, XSum/CNN-DM/MultiNews mean, GPT-4o judge"),
    ("hallucination", "faithful_qa"): PaperNumber(0.31, 0.403, "§3.6, Qasper/HotpotQA/2WikiMQA mean, GPT-4o judge"),
    # Fig. 7: best - worst accuracy over demonstration orders, TREC, in accuracy points / 100
    ("icl", "order_margin_random"): PaperNumber(0.190, 0.040, "Fig. 7a, TREC, 64K models"),
    ("icl", "order_margin_alternating"): PaperNumber(0.567, 0.134, "Fig. 7b, TREC, 64K models"),
}


def paper_number(task: str, metric: str) -> PaperNumber | None:
    """The paper's Transformer and DIFF values for one of our metrics, if it reports one."""
    return PAPER.get((task, metric))
