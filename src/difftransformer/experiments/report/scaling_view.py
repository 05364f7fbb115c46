"""The report's scaling section: final loss over a grid of sizes or token budgets, fits and the headline.

The paper (Fig. 3) fits loss against parameters (830M-13.1B, 10B tokens) and against training tokens
(3B), and reads off "DIFF matches the Transformer with 62.2% of the parameters / 63.7% of the tokens".
We do the same on our grid (experiments/scaling.py: a power law per arm, the fraction at a point of the
measured range, and a bootstrap interval over paired seeds).

Choice where the paper is silent at our scale: the x axis of the parameter fit counts NON-EMBEDDING
parameters. At CPU scale the embedding (vocab x hidden) is a third or more of the model and does not
grow with depth, so total parameters would compress the axis and exaggerate any fraction; at the
paper's sizes the two counts differ by a few percent. The fraction is evaluated at the geometric mean
of the arm's measured x values, inside the grid, so it is never an extrapolation of the arm's fit.
"""

from __future__ import annotations

import math
from typing import Any

from difftransformer.experiments.report.fmt import code_span
from difftransformer.experiments.report.runs import Run

AXES = {"parameters": "non-embedding parameters", "tokens": "training tokens"}


def non_embedding(model: dict[str, Any], total: int) -> int:
    """Parameters minus the token embedding (and the LM head when it is not tied)."""
    emb = int(model.get("vocab_size", 0)) * int(model.get("hidden_size", 0))
    return total - emb * (1 if model.get("tie_word_embeddings", True) else 2)


def _count(ctx, cell, arm: str, run: Run) -> int | None:
    total = run.parameters or (ctx.manifest.get("parameters") or {}).get(f"{cell[0]}/{arm}" if cell[0] else arm)
    return non_embedding(run.model, total) if total else None


def _tokens_trained(ctx, cell, run: Run) -> int:
    """The tokens the run trained on: its steps × the recipe's tokens per step (C04). A budget that is not a
    whole number of steps trains ceil(budget / per step) steps (`Study.train_for`), so the budget itself is
    not the x of the token fit; the budget (or the logged tokens) only when the recipe is not recorded."""
    tr = ctx.manifest.get("train") or {}
    per_step = (tr.get("batch_size") or 0) * (tr.get("seq_len") or 0)
    if per_step and run.max_steps:
        return run.max_steps * per_step
    return cell[1] or run.tokens


def axis(ctx) -> str | None:
    """'parameters' when the grid has several sizes, else 'tokens' when it has several budgets."""
    sizes = {c[0] for c in ctx.cells}
    tokens = {c[1] for c in ctx.cells}
    return "parameters" if len(sizes) > 1 else "tokens" if len(tokens) > 1 else None


def points(ctx, which: str) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """points[arm][seed] = [(x, final val loss)] over the grid's line through the headline cell: sizes at
    the largest budget, or budgets at the largest size."""
    out: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for cell, runs in ctx.cells.items():
        if (which == "parameters" and cell[1] != ctx.headline[1]) or (which == "tokens" and cell[0] != ctx.headline[0]):
            continue
        for (arm, seed), run in runs.items():
            if not run.finished or run.final_val is None:
                continue
            x = _count(ctx, cell, arm, run) if which == "parameters" else _tokens_trained(ctx, cell, run)
            if x:
                out.setdefault(arm, {}).setdefault(seed, []).append((float(x), float(run.final_val)))
    return out


def fractions(ctx, which: str) -> dict[str, Any]:
    """arm -> ScalingResult (or the error message when a fit is impossible), for every arm but the baseline.

    Computed once per report (the bootstrap refits 1000 times) and kept on the context for the
    scaling section, its plot and the claims."""
    key = ("scaling", which)
    if key not in ctx.memo:
        ctx.memo[key] = _fractions(ctx, which)
    return ctx.memo[key]


def _fractions(ctx, which: str) -> dict[str, Any]:
    from difftransformer.experiments.scaling import scaling_fraction

    pts = points(ctx, which)
    out: dict[str, Any] = {}
    if ctx.baseline not in pts:
        return out
    for arm in ctx.others:
        if arm not in pts:
            continue
        xs = sorted({x for series in pts[arm].values() for x, _ in series})
        at = math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 1.0
        try:
            out[arm] = scaling_fraction(pts, arm, ctx.baseline, at=at, n_boot=1000, seed=0)
        except ValueError as e:
            out[arm] = str(e)
    return out


def scaling_lines(ctx, has_plot: bool) -> list[str]:
    from difftransformer.experiments.report.fmt import fmt_ci, table
    from difftransformer.experiments.scaling import MIN_DISTINCT_X_IRREDUCIBLE, MIN_POINTS_IRREDUCIBLE, headline

    which = axis(ctx)
    L = ["## Scaling", ""]
    rows = []
    for cell, runs in ctx.cells.items():
        label = " / ".join(p for p in (cell[0] or "", f"{cell[1]:,} tokens" if cell[1] else "") if p)
        vals = []
        for arm in ctx.arms:
            finals = [r.final_val for (a, _), r in sorted(runs.items()) if a == arm and r.finished
                      and r.final_val is not None]
            short = f" ({len(finals)} of {len(ctx.seeds)} seeds)" if len(finals) < len(ctx.seeds) else ""
            vals.append(fmt_ci(finals) + short)  # R21: a cell with fewer seeds than the study says so
        rows.append([label, *vals])
    L += ["Final validation loss in every cell of the grid (mean [95% interval] over seeds):", ""]
    L += table(["cell", *[code_span(a) for a in ctx.arms]], rows) + [""]
    if which is None:
        return L
    if has_plot:
        L += ["![scaling](scaling.png)", ""]
    L += [f"Fits: L(x) = c + a·x^(−α) per arm over {AXES[which]} (c is fitted where the arm and "
          f"{code_span(ctx.baseline)} each have at least {MIN_POINTS_IRREDUCIBLE} points, pooled over their paired "
          f"seeds, at {MIN_DISTINCT_X_IRREDUCIBLE} or more distinct {AXES[which]}; else c is fixed at 0); the "
          f"fraction is read at the geometric mean of the arm's grid, its interval from 1000 bootstrap resamples of "
          f"the paired seeds.", ""]
    for arm, res in fractions(ctx, which).items():
        if isinstance(res, str):
            L += [f"- {code_span(arm)} vs {code_span(ctx.baseline)}: no fit ({res}).", ""]
            continue
        fit_rows = [[code_span(a), f"{f.a:.4g}", f"{f.alpha:.4g}", f"{f.c:.4g}"] for a, f in res.fits.items()]
        L += table(["arm", "a", "α", "c"], fit_rows) + [""]
        L += [f"c {'fitted' if res.irreducible else 'fixed at 0'} for {code_span(arm)} vs {code_span(ctx.baseline)}.",
              ""]
        L += [f"- {headline(res, arm, ctx.baseline, what=AXES[which])}", ""]
    paper = {"parameters": "62.2% of the parameters (Fig. 3a, 830M-13.1B)",
             "tokens": "63.7% of the training tokens (Fig. 3b, 3B)"}[which]
    L += [f"The paper: DIFF matches the Transformer with {paper}.", ""]
    return L


def plot_scaling(ctx, folder) -> bool:
    """scaling.png: final val loss against x per arm (each seed a dot, the fit a line); False without a grid."""
    which = axis(ctx)
    if which is None:
        return False
    from difftransformer.experiments.report.plots import _pyplot, _save

    pts = points(ctx, which)
    if not pts:
        return False
    fits = {a: r for a, r in fractions(ctx, which).items() if not isinstance(r, str)}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(a for a in ctx.arms if a in pts):
        c = colors[i % len(colors)]
        xy = [p for series in pts[arm].values() for p in series]
        ax.scatter([x for x, _ in xy], [y for _, y in xy], color=c, s=14, alpha=0.7, label=arm)
        fit = next((r.fits[arm] for r in fits.values() if arm in r.fits), None)
        if fit is not None:
            lo, hi = min(x for x, _ in xy), max(x for x, _ in xy)
            grid = [lo * (hi / lo) ** (k / 50) for k in range(51)]
            ax.plot(grid, [fit(x) for x in grid], color=c, lw=1.5)
    ax.set_xscale("log")
    ax.set_xlabel(AXES[which])
    ax.set_ylabel("final validation loss (nats/token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    _save(fig, folder / "scaling.png")
    return True
