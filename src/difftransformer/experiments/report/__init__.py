"""report.md for a study folder: what was run, loss curves, final losses with seed noise, throughput,
λ per layer and sample generations, with a verdict that never claims more than the numbers show.

    write_report("runs/demo")      # reads runs/demo/compare.json and each run's metrics.jsonl

Works on a study that is still running or was interrupted (unfinished runs are marked), and on a
folder of run folders without a manifest (arms and seeds are read from its layout).
"""

from __future__ import annotations

from pathlib import Path

from difftransformer._io import atomic_write_text
from difftransformer.experiments.config import baseline_arm
from difftransformer.experiments.report import sections
from difftransformer.experiments.report.plots import plot_lambdas, plot_losses
from difftransformer.experiments.report.runs import Run, load_runs
from difftransformer.experiments.study_dir import MANIFEST_FILE, StudyDir
from difftransformer.train.run_dir import METRICS_FILE


def write_report(study_dir: str | Path, *, samples: bool = True) -> Path:
    """Write <study_dir>/report.md and its PNGs from what is on disk; returns the report's path."""
    ctx = _context(StudyDir(study_dir))
    plot_losses(ctx.runs, ctx.arms, ctx.seeds, ctx.study.loss_plot)
    has_lambda_plot = plot_lambdas(ctx.runs, ctx.arms, ctx.seeds[0], ctx.study.lambda_plot)
    L = sections.header(ctx) + sections.verdicts(ctx) + sections.final_losses(ctx) + sections.loss_curves(ctx)
    L += sections.lambdas(ctx, has_lambda_plot) + sections.evaluation(ctx)
    if samples:
        L += sections.samples(ctx)
    L += sections.what_was_run(ctx)
    atomic_write_text(ctx.study.report, "\n".join(L).rstrip() + "\n")
    return ctx.study.report


def _context(study: StudyDir) -> sections.Context:
    manifest = study.read_manifest() or study.discover()
    arms, seeds = list(manifest["arms"]), sorted(manifest["seeds"])
    if not arms:
        raise FileNotFoundError(f"no runs in {study.path}: expected {MANIFEST_FILE} or <arm>/{METRICS_FILE} "
                                f"folders (run `difftransformer compare` first)")
    baseline = baseline_arm(arms)
    runs = load_runs(study, manifest)
    if not runs:
        raise FileNotFoundError(f"{study.path} lists arms {arms} but none has a {METRICS_FILE} yet")
    return sections.Context(study, manifest, arms, seeds, baseline, runs)


__all__ = ["Run", "write_report"]
