"""Formatting shared by the report's sections: tables, mean and interval cells, p-values, metric lookups."""

from __future__ import annotations

import math
import re
from typing import Any

from difftransformer.experiments.stats import (
    Interval,
    PairedComparison,
    format_p,
    holm,
    mean_std,
    number_format,
    t_interval,
)

Lines = list[str]


def table(header: list[str], rows: list[list[str]]) -> Lines:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def fmt_ms(xs: list[float], digits: int = 4, signed: bool = False) -> str:
    """'mean ± std' over seeds ('mean' alone for one value, '–' for none)."""
    if not xs:
        return "–"
    m, s = mean_std(xs)
    sep = "," if digits == 0 else ""  # thousands separators for counts like tokens/s
    mean = f"{m:+{sep}.{digits}f}" if signed else f"{m:{sep}.{digits}f}"
    return mean if s is None else f"{mean} ± {s:{sep}.{digits}f}"


def fmt_ci(xs: list[float], digits: int = 4, signed: bool = False) -> str:
    """'mean [low, high]' with the 95% t-interval over seeds ('mean' alone for one value, '–' for none), in one
    `number_format`."""
    return fmt_interval(t_interval(xs), digits, signed) if xs else "–"


def fmt_interval(iv: Interval, digits: int = 4, signed: bool = False) -> str:
    """'mean [low, high]' ('mean' alone without an interval), in one `number_format`."""
    f = number_format([iv.mean, iv.low, iv.high], digits, signed)
    return f(iv.mean) if iv.low is None else f"{f(iv.mean)} [{f(iv.low)}, {f(iv.high)}]"


def metric_values(ctx, arm: str, task: str, metric: str, runs=None) -> dict[int, float]:
    """{seed: value} of one evaluation metric of `arm`, over the seeds whose run has it as a number.

    A non-finite value is an error naming task, metric, arm and seed, as stats.compare_paired makes it for losses:
    dropping that seed would compute the mean and the paired difference over the others with no sign of it, biased
    towards the arm whose evaluation diverged."""
    out = {}
    for seed in ctx.seeds:
        run = (runs or ctx.runs).get((arm, seed))
        value = run and ((run.evals.get(task) or {}).get("metrics") or {}).get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{task} {metric} of arm {arm!r} at seed {seed} is {value!r}, not a finite number; "
                                 f"a non-finite metric is not dropped from the report (it would bias the comparison): "
                                 f"look at that run's evaluation, then evaluate it again or fix its result file")
            out[seed] = float(value)
    return out


def direction(outcome: str, arm: str) -> str:
    """A paired comparison's outcome in words that take no side on which direction is good."""
    return {"better": f"`{arm}` lower", "worse": f"`{arm}` higher", "inconclusive": "cannot separate",
            "single seed": "one seed", "no data": "–"}.get(outcome, outcome)


def holm_separations(cmps: list[PairedComparison]) -> list[tuple[float | None, str]]:
    """(Holm-adjusted p, separation) for each comparison of one family (one arm pair's conditions). separation:
    "after Holm" where the interval excludes 0 and the adjusted p is below the interval's level (0.05 for 95%),
    "not after Holm" where the interval excludes 0 but the adjusted p is not, "no test" where it excludes 0 with
    zero width (every seed the same difference, so no p), "none" where it holds 0 or there is no interval."""
    out = []
    for cmp, adj in zip(cmps, holm([c.p for c in cmps])):
        level = round(1 - cmp.interval.confidence, 12) if cmp.interval else 0.05  # 1 - 0.95 is 0.05000000000000004
        if cmp.outcome not in ("better", "worse"):
            out.append((adj, "none"))
        elif cmp.p is None:
            out.append((adj, "no test"))
        else:
            out.append((adj, "after Holm" if adj < level else "not after Holm"))
    return out


def holm_readings(cmps: list[PairedComparison], arm: str) -> list[tuple[str, str]]:
    """(Holm-adjusted p, reading) for each comparison of one family (one arm pair's rows of a table).

    The reading follows the interval (`direction`); where the interval separates the arms but the Holm-adjusted p
    is not below the interval's level (0.05 for 95%), it says "not after Holm over m": among m tests about one
    interval in twenty excludes 0 by chance, and this one is not clear of that. Where every seed gives the same
    difference (an interval of zero width, e.g. one error more on a shared test set), it says so: no test
    stands behind that separation."""
    separations = holm_separations(cmps)
    m = sum(adj is not None for adj, _ in separations)
    out = []
    for cmp, (adj, separation) in zip(cmps, separations):
        reading = direction(cmp.outcome, arm)
        if separation == "not after Holm":
            reading += f" (not after Holm over {m})"
        elif separation == "no test":
            reading += " (the same difference on every seed: a zero-width interval, no test)"
        out.append((format_p(adj), reading))
    return out


def fmt_num(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"


def code_span(text: Any) -> str:
    """`text` as a Markdown code span that no character in it can end or format (R09-R12).

    Names and prompts come from the user (arm names, compare.prompts): in a code span `*`, `_`, `|` and
    `<tag>` stay literal in report.md and are escaped in report.html. The fence is one backtick longer
    than the longest run of backticks in the text, padded with spaces when the text starts or ends with one."""
    text = str(text)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_name(text: str) -> str:
    """A name for prose: as it is when it is plain (letters, digits, `.`, `/`, `+`, `-`, inner `_`), else a code
    span."""
    return text if _PLAIN.fullmatch(text) else code_span(text)


_PLAIN = re.compile(r"[A-Za-z0-9./+-]+(?:_[A-Za-z0-9./+-]+)*")
