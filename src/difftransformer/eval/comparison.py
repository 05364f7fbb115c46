"""A comparison: two models' evaluation results side by side, in one Markdown table beside the paper's numbers.

    table = compare_table(results_a, results_b, ("runs/demo/transformer", "runs/demo/diff"),
                          ("transformer", "diff"))

`results_*` map task name -> a stored result (the JSON of eval/results.py). Every metric that both
models have gets a row: A, B, B - A, and the paper's Transformer / DIFF values where it has them
(eval/paper.py). Results computed with different settings are not comparable: such a task is listed
under the table with the settings that differ, never put in a row.
"""

from __future__ import annotations

import math
from typing import Any

from difftransformer.eval.paper import paper_number
from difftransformer.eval.results import comparable_settings
from difftransformer.eval.task import TASKS


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def _settings_differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    sa, sb = comparable_settings(a.get("settings", {})), comparable_settings(b.get("settings", {}))
    out = ["task_version"] if sa["task_version"] != sb["task_version"] else []
    keys = sorted({*sa["eval_config"], *sb["eval_config"]})
    out += [k for k in keys if sa["eval_config"].get(k) != sb["eval_config"].get(k) and k != "data_dir"]
    okeys = sorted({*sa["options"], *sb["options"]} - set(getattr(TASKS.get(a.get("task")), "skip_options", ())))
    out += [k for k in okeys if sa["options"].get(k) != sb["options"].get(k)]  # skip options: metrics both have agree
    # data_dir may differ (each run's own folder); the held-out text it holds may not
    ta, tb = a.get("settings", {}), b.get("settings", {})
    return out + [k for k in ("corpus_hash", "split") if k in ta and k in tb and ta[k] != tb[k]]


def compare_table(results_a: dict[str, dict[str, Any]], results_b: dict[str, dict[str, Any]],
                  names: tuple[str, str], kinds: tuple[str, str], skipped: dict[str, str] | None = None,
                  inapplicable: dict[str, str] | None = None) -> str:
    """A Markdown table of every metric both models have, with the paper's numbers beside them; a note for
    each task the two do not share, each task in `skipped` ({task: why it could not run}) and each in
    `inapplicable` ({task: why it does not apply to a model})."""
    head = (f"| task | metric | A: {kinds[0]} | B: {kinds[1]} | B - A | paper T | paper DIFF | paper ref |\n"
            f"|---|---|---|---|---|---|---|---|")
    rows, notes = [], []
    for task in sorted(set(results_a) & set(results_b)):
        a, b = results_a[task], results_b[task]
        differ = _settings_differ(a, b)
        if differ:
            notes.append(f"- {task}: not compared, the two results differ in {', '.join(differ)}; "
                         f"re-run both with the same settings")
            continue
        for metric in (m for m in a.get("metrics", {}) if m in b.get("metrics", {})):
            va, vb = a["metrics"][metric], b["metrics"][metric]
            delta = vb - va if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb)) else None
            paper = paper_number(task, metric)
            rows.append(f"| {task} | {metric} | {_fmt(va)} | {_fmt(vb)} | {_fmt(delta)} | "
                        f"{_fmt(paper.transformer) if paper else ''} | {_fmt(paper.diff) if paper else ''} | "
                        f"{paper.ref if paper else ''} |")
    only = sorted((set(results_a) ^ set(results_b)) - set(skipped or {}) - set(inapplicable or {}))
    if only:
        notes.append(f"- only one model has: {', '.join(only)}")
    notes += [f"- {task}: could not run, {why}" for task, why in sorted((skipped or {}).items())]
    notes += [f"- {task}: does not apply, {why}" for task, why in sorted((inapplicable or {}).items())]
    lines = [f"A = {names[0]} ({kinds[0]}), B = {names[1]} ({kinds[1]}); one model each, one seed: "
             f"a difference here is not yet a finding (studies over seeds give intervals).", "", head, *rows]
    if not rows:
        lines.append("| (no metric in common) | | | | | | | |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)
