"""The retrofit evaluation table of docs/interop.md, read from the result files (nothing typed by hand).

    python benchmarks/retrofit_eval_table.py results/retrofit-smollm2

Reads <dir>/eval-conversion/<task>.json and <dir>/eval-trained160/<task>.json (written by
`difftransformer eval ... --out-dir`; the commands are in results/retrofit-smollm2/README.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [
    ("needle", "greedy@N1R1", "retrieval, greedy, 1 needle"),
    ("needle", "greedy@N2R1", "retrieval, greedy, 2 needles (1 asked)"),
    ("needle", "greedy@N4R2", "retrieval, greedy, 4 needles (2 asked)"),
    ("needle", "forced_choice", "retrieval, forced choice, mean"),
    ("attention-noise", "answer", "attention to the answer needle"),
    ("attention-noise", "noise", "attention noise (rest of the context)"),
    ("hallucination", "faithful_qa", "hallucination: faithful QA answers"),
    ("hallucination", "faithful_summary", "hallucination: faithful summaries"),
    ("hallucination", "faithful_counterfactual", "hallucination: faithful counterfactual answers"),
    ("hallucination", "choice", "hallucination: forced choice of the context's value"),
    ("icl", "accuracy_k0", "ICL (synthetic, 4 classes): 0 shots"),
    ("icl", "accuracy_k2", "ICL: 2 shots"),
    ("icl", "accuracy_k8", "ICL: 8 shots"),
    ("outliers", "attention_logits_top1", "top-1 abs. attention logit"),
    ("outliers", "attention_logits_median", "median abs. attention logit"),
    ("outliers", "hidden_states_top1", "top-1 abs. hidden state"),
    ("outliers", "hidden_states_median", "median abs. hidden state"),
    ("logit-quant", "loss@tensor/16", "held-out loss, 16-bit logits (4 x 256 tokens)"),
    ("logit-quant", "loss_increase@tensor/8", "loss increase, 8-bit attention logits"),
    ("logit-quant", "loss_increase@tensor/4", "loss increase, 4-bit attention logits"),
]
COLUMNS = ["eval-conversion", "eval-trained160"]


def fmt(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def main(root: Path) -> None:
    print("| measurement | at conversion (= SmolLM2) | after 160 steps |")
    print("|---|---|---|")
    for task, metric, label in ROWS:
        vals = []
        for column in COLUMNS:
            f = root / column / f"{task}.json"
            vals.append(fmt(json.loads(f.read_text())["metrics"].get(metric)) if f.is_file() else "–")
        print(f"| {label} | {vals[0]} | {vals[1]} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
