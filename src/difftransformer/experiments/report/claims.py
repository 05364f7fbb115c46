"""The report's "The paper's claims" section: each claim the study measured, our interval, a verdict.

A claim is a direction the paper reports between DIFF and the Transformer: lower validation loss,
higher retrieval accuracy, less attention noise, smaller activation outliers, a fraction of the
parameters or tokens below 1. For every one that the study measured (both arms `diff` and
`transformer`, the metric in their results, the paper's two values in eval/paper_numbers.json) the
verdict follows the 95% interval of the paired difference DIFF − Transformer over seeds, qualified by
Holm's adjustment over the family of this table's tests (every claim with a paired t-test: one arm pair, DIFF
vs the Transformer, on many metrics; the convention of fmt.holm_separations):

- "reproduced": the interval excludes 0 on the paper's side and the Holm-adjusted p is below 0.05;
- "opposite": the same on the other side;
- "reproduced before Holm only" / "opposite before Holm only": the interval excludes 0 but the adjusted p
  does not (one of the chance separations expected among m tests: a lead to follow, not a finding);
- "not shown": it contains 0 (this study cannot tell the arms apart on it);
- "one seed": no interval (a single seed says nothing about the spread).

Where every seed gives the same difference (a zero-width interval) there is no test and no p, so nothing to
survive Holm: "reproduced without a test" / "opposite without a test", listed with what did not reproduce (the OOD
glance table files such a separation among the before-Holm ones). The scaling claim's verdict is its bootstrap
interval (no p: outside the family).

Claims that are not "reproduced" are listed again under "What did not reproduce", with what it would
take to test them properly: for a difference, how many paired seeds the observed spread needs to
resolve an effect of the paper's size (n ≈ (z·s / effect)², a normal approximation, stated as such).
"""

from __future__ import annotations

import math
from typing import Any

from difftransformer.eval.paper import PAPER, STUDY_TASKS, paper_number
from difftransformer.experiments.report.fmt import fmt_interval, holm_separations, metric_values, table
from difftransformer.experiments.report.recipes import single_recipe
from difftransformer.experiments.report.runs import finished_val
from difftransformer.experiments.stats import beside, compare_paired, format_p

DIFF, BASE = "diff", "transformer"
VERDICTS = {"better": "reproduced", "worse": "opposite", "inconclusive": "not shown", "single seed": "one seed"}
BEFORE_HOLM = " before Holm only"  # appended to "reproduced"/"opposite" when the adjusted p does not clear 0.05
NO_TEST = " without a test"  # appended when every seed gives the same difference: no p, so nothing survives Holm
_Z = 1.96


def _row(name: str, ref: str, paper_t: float | None, paper_d: float | None, ours: dict[int, float],
         base: dict[int, float], digits: int = 3) -> dict[str, Any] | None:
    """One claim: the paper's direction (DIFF − Transformer sign) against our paired interval."""
    if paper_t is None or paper_d is None or paper_t == paper_d or not ours or not base:
        return None
    lower = paper_d < paper_t  # the paper's DIFF is lower: "better" means lower for us too
    cmp = compare_paired(ours, base, arm=DIFF, baseline=BASE, metric=name, lower_is_better=lower)
    if not cmp.diffs:
        return None
    iv = cmp.interval
    ours_text = fmt_interval(iv, digits, signed=True)
    effect = abs(paper_d - paper_t)
    need = None
    if iv.std and iv.std > 0:
        need = math.ceil((_Z * iv.std / effect) ** 2)
    return {"claim": name, "ref": ref, "paper": f"{paper_t:g} → {paper_d:g} ({paper_d - paper_t:+.3g})",
            "ours": ours_text, "n": len(cmp.diffs), "verdict": VERDICTS.get(cmp.outcome, cmp.outcome),
            "seeds_needed": need, "effect": effect, "cmp": cmp}


def _adjust(rows: list[dict[str, Any]]) -> int:
    """Holm over the rows' paired tests (one family: DIFF vs the Transformer on every claim with a p): a separation
    whose adjusted p is not below the interval's level reads "... before Holm only", a zero-width one (no p) "...
    without a test": neither is a finding. Sets each row's "p", "holm" and "note"; returns m, the family's size."""
    tested = [r for r in rows if r.get("cmp") is not None]
    separations = holm_separations([r["cmp"] for r in tested])
    m = sum(adj is not None for adj, _ in separations)
    for r, (adj, separation) in zip(tested, separations):
        r["p"], r["holm"] = format_p(r["cmp"].p), format_p(adj)
        if separation == "not after Holm":
            r["verdict"] += BEFORE_HOLM
            r["note"] = f"adjusted p {format_p(adj)} over {m} claims"
        elif separation == "no test":
            r["verdict"] += NO_TEST
            r["note"] = "the same difference on every seed: a zero-width interval, no test"
    return m


def _loss_claim(ctx) -> dict[str, Any] | None:
    """The paper's language-modelling loss claim; None for a study on a synthetic task, whose loss (on the answer
    tokens of generated sequences) measures something else."""
    if ctx.task_study:
        return None
    number = paper_number("lm", "final_val_loss")
    return _row("validation loss (DIFF lower)", number.ref, number.transformer, number.diff,
                finished_val(ctx.runs, DIFF, ctx.seeds), finished_val(ctx.runs, BASE, ctx.seeds), 4)


def _eval_claims(ctx) -> list[dict[str, Any]]:
    rows = []
    for (task, metric), number in PAPER.items():
        if task in STUDY_TASKS:
            continue
        row = _row(f"{task} `{metric}`", number.ref, number.transformer, number.diff,
                   metric_values(ctx, DIFF, task, metric), metric_values(ctx, BASE, task, metric))
        if row:
            rows.append(row)
    return rows


def _scaling_claims(ctx) -> list[dict[str, Any]]:
    from difftransformer.experiments.report.scaling_view import axis, fractions, points

    which = axis(ctx)
    if which is None:
        return []
    res = fractions(ctx, which).get(DIFF)
    if res is None or isinstance(res, str):
        return []
    number = paper_number("scaling", "parameter_fraction" if which == "parameters" else "token_fraction")
    if res.fraction is None:
        ours, verdict = "no fraction (the Transformer's fit never reaches DIFF's loss)", "not shown"
    elif res.interval is None:
        ours, verdict = beside(res.fraction, 1.0, 2), "one seed"
    else:
        low, high = res.interval
        ours = f"{beside(res.fraction, 1.0, 2)} [{beside(low, 1.0, 2)}, {beside(high, 1.0, 2)}]"
        verdict = "reproduced" if high < 1 else "opposite" if low > 1 else "not shown"
    if res.fraction is not None and res.extrapolated():
        ours += f"; the Transformer's fit read {res.extrapolated()}"
    pts = points(ctx, which)  # a seed with fewer grid points than another: the fit is over an incomplete grid
    if len({len(series) for arm in (DIFF, ctx.baseline) for series in pts.get(arm, {}).values()}) > 1:
        ours += " (some grid cells lack a seed: see Incomplete)"
    return [{"claim": f"DIFF needs a fraction of the Transformer's {which} (< 1)", "ref": number.ref,
             "paper": f"{number.diff:g}", "ours": ours, "n": len(res.seeds), "verdict": verdict,
             "seeds_needed": None, "effect": None}]


def claim_lines(ctx) -> list[str]:
    if DIFF not in ctx.arms or BASE not in ctx.arms:
        return []
    rows = [r for r in [_loss_claim(ctx), *_eval_claims(ctx), *_scaling_claims(ctx)] if r]
    if not rows:
        return []
    m = _adjust(rows)
    L = ["## The paper's claims", "",
         "Each claim the study measured: the paper's Transformer → DIFF values, ours as the paired difference "
         "DIFF − Transformer (mean [95% interval] over seeds; for scaling, the fraction and its bootstrap interval), "
         f"with the paired t-test's p and Holm's adjusted p over {_family(m)} (one family: DIFF vs the "
         "Transformer). The verdict follows the interval, qualified by Holm: reproduced (excludes 0 on the "
         "paper's side and the adjusted p is below 0.05), opposite (the same on the other side), reproduced or "
         "opposite before Holm only (the interval excludes 0 but the adjusted p does not: among that many tests "
         "about one interval in twenty excludes 0 by chance, so this is a lead to follow with more seeds, not a "
         "finding), not shown (contains 0), one seed (no interval); the same difference on every seed is a "
         "zero-width interval with no test, and the verdict says so. The scaling claim's verdict is its bootstrap "
         "interval (no p). The evaluation table adjusts over its own family (every metric it reports for an arm), "
         "so its Holm p for the same metric can differ. The paper's "
         "models are 100-1000x larger and its contexts longer: a claim not shown here is not refuted at the "
         "paper's scale.", ""]
    L += table(["claim", "paper (T → DIFF)", "ours: DIFF − T", "seeds", "p", "Holm p", "verdict", "paper's source"],
               [[r["claim"], r["paper"], r["ours"], str(r["n"]), r.get("p", "–"), r.get("holm", "–"),
                 f"**{r['verdict']}**" + (f" ({r['note']})" if r.get("note") else ""), r["ref"]] for r in rows])
    L += [""] + _recipes_differ(ctx)
    return L + _not_reproduced(rows)


def _recipes_differ(ctx) -> list[str]:
    """A sentence when `diff` and `transformer` trained on different recipes, each recorded and one per arm: every
    claim's difference then mixes recipe and architecture (`recipes.recipe`)."""
    mine, theirs = single_recipe(ctx, DIFF), single_recipe(ctx, BASE)
    if not (mine and theirs) or mine == theirs:
        return []
    return [f"`{DIFF}` and `{BASE}` trained on different recipes (steps, learning rate or position encoding): each "
            "difference above mixes recipe and architecture, so no verdict here is the architecture's alone.", ""]


def _family(m: int) -> str:
    return {0: "the claims with a test (none here)", 1: "the 1 claim with a test"}.get(m, f"the {m} claims tested here")


def _not_reproduced(rows: list[dict[str, Any]]) -> list[str]:
    """The claims that did not reproduce (after Holm), "opposite" first, then those that separate before Holm only
    or without a test, then "not shown"; one-seed claims in one sentence
    (without an interval there is nothing to say about them one by one)."""
    L = ["### What did not reproduce", ""]
    single = [r for r in rows if r["verdict"] == "one seed"]
    order = ("opposite", *(f"{v}{q}" for q in (BEFORE_HOLM, NO_TEST) for v in ("opposite", "reproduced")),
             "not shown")
    tested = sorted((r for r in rows if r["verdict"] in order), key=lambda r: order.index(r["verdict"]))
    if not tested and not single:
        return L + ["Every measured claim reproduced at this scale.", ""]
    if single:
        L += [f"{len(single)} of the {len(rows)} claims were measured with one seed: no interval, so no verdict. "
              f"Run the study with 3 or more paired seeds (`--seeds 0,1,2`) to test them.", ""]
    for r in tested:
        need = ""
        if r["verdict"].endswith(BEFORE_HOLM):  # the spread resolves it on its own: the question is the family
            need = (" Its interval excludes 0 on its own, not after adjusting for the claims tested: a lead, which "
                    "more paired seeds (or a study testing this claim alone) would confirm or dismiss.")
        elif r["verdict"].endswith(NO_TEST):
            need = (" Every seed gives the same difference, so there is no spread to test it against: seeds that "
                    "vary what they are scored on (or more of them) would test it.")
        elif r["seeds_needed"]:
            need = (f" Resolving a difference of the paper's size ({r['effect']:.3g}) with the seed-to-seed spread "
                    f"seen here would take about {r['seeds_needed']} paired seeds (normal approximation).")
        note = f"; {r['note']}" if r.get("note") else ""
        L += [f"- {r['claim']}: {r['verdict']} with {r['n']} seeds (ours {r['ours']}; paper {r['paper']}{note})."
              f"{need}"]
    L += ["", "Testing these properly needs what the paper had: models of 0.8B+ parameters trained on billions of "
          "tokens, and contexts of 4K-64K for retrieval and long-context claims (the GPU study config "
          "configs/studies/paper-gpu.toml scales this study up), and enough paired seeds for the intervals above "
          "to exclude 0.", ""]
    return L
