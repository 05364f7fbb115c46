"""The report's figures: loss curves and λ per layer over training, as PNGs beside report.md."""

from __future__ import annotations

import statistics
from pathlib import Path

from difftransformer._io import atomic_savefig
from difftransformer.experiments.report.runs import Run


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (reports are written on headless machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Write `fig` to `path` as a PNG and free it: atomically, so that a full disk or a kill mid-write
    leaves the previous plot intact (the next `report` redraws it) rather than a truncated file."""
    try:
        atomic_savefig(fig, path, dpi=110)
    finally:
        _pyplot().close(fig)


def _mtok(row: dict) -> float:
    """Training tokens of a logged row, in millions (0 for a row that does not say)."""
    tokens = row.get("tokens")
    return tokens / 1e6 if isinstance(tokens, (int, float)) else 0.0


def _ema(xs: list[float], span: float) -> list[float]:
    alpha, out, v = 2.0 / (span + 1.0), [], None
    for x in xs:
        v = x if v is None else alpha * x + (1 - alpha) * v
        out.append(v)
    return out


def _mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Average over seeds at the x values every seed has."""
    common = set.intersection(*(set(x for x, _ in c) for c in curves))
    by = [dict(c) for c in curves]
    return [(x, statistics.fmean(d[x] for d in by)) for x in sorted(common)]


def plot_losses(runs: dict[tuple[str, int], Run], arms: list[str], seeds: list[int], path: Path) -> None:
    """Validation loss (left) and EMA-smoothed training loss (right) against training tokens, per arm;
    with several seeds, each seed faint and their mean bold."""
    plt = _pyplot()

    fig, (ax_val, ax_tr) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        c = colors[i % len(colors)]
        arm_runs = [runs[arm, s] for s in seeds if (arm, s) in runs]
        val_curves = [[(_mtok(r), r["loss"]) for r in run.val if r.get("loss") is not None]
                      for run in arm_runs]
        train_curves = []
        for run in arm_runs:
            pts = [(_mtok(r), r["loss"]) for r in run.train if r.get("loss") is not None]
            if pts:
                train_curves.append(list(zip([x for x, _ in pts], _ema([y for _, y in pts], max(2, len(pts) / 20)))))
        for ax, curves in ((ax_val, val_curves), (ax_tr, train_curves)):
            curves = [cv for cv in curves if cv]
            if not curves:
                continue
            if len(curves) > 1:
                for cv in curves:
                    ax.plot(*zip(*cv), color=c, alpha=0.3, lw=1)
                mean = _mean_curve(curves)
                if mean:
                    ax.plot(*zip(*mean), color=c, lw=2, label=f"{arm} (mean of {len(curves)} seeds)")
            else:
                ax.plot(*zip(*curves[0]), color=c, lw=2, marker="o" if ax is ax_val and len(curves[0]) < 30 else None,
                        ms=3, label=arm)
    ax_val.set_title("validation loss")
    ax_tr.set_title("training loss (EMA-smoothed)")
    for ax in (ax_val, ax_tr):
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    _save(fig, path)


def plot_lambdas(runs: dict[tuple[str, int], Run], arms: list[str], seed: int, path: Path) -> bool:
    """λ of every layer over training, one panel per DIFF arm (first seed); False if there is none."""
    plt = _pyplot()

    panels = [runs[a, seed] for a in arms if (a, seed) in runs and runs[a, seed].lambdas is not None]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, run in zip(axes[0], panels):
        rows = [r for r in run.train if r.get("lambdas")]
        n_layers = len(rows[-1]["lambdas"])
        cmap = plt.get_cmap("viridis")
        for layer in range(n_layers):
            pts = [(_mtok(r), r["lambdas"][layer]) for r in rows
                   if layer < len(r["lambdas"]) and r["lambdas"][layer] is not None]
            color = cmap(layer / max(1, n_layers - 1))
            if pts:
                ax.plot(*zip(*pts), color=color, label=f"layer {layer}")
            inits = run.lambda_inits
            if inits and layer < len(inits) and inits[layer] is not None:  # where λ started, for reference
                ax.plot([0], [inits[layer]], marker="x", ms=7, color=color, ls="none")
        ax.set_title(f"λ per layer: {run.arm} (seed {run.seed}; × = λ_init)")
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("λ")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if n_layers > 6 else 1)
    fig.tight_layout()
    _save(fig, path)
    return True
