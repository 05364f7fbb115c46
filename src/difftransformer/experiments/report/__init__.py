"""report.md for a study folder: what was run, loss curves, final losses with seed noise, throughput,
λ per layer and sample generations, with a verdict that never claims more than the numbers show.

    write_report("runs/demo")      # reads runs/demo/compare.json and each run's metrics.jsonl

Works on a study that is still running or was interrupted (unfinished runs are marked), and on a
folder of run folders without a manifest (arms and seeds are read from its layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from difftransformer._io import atomic_write_text, folder_lock
from difftransformer.experiments.config import baseline_arm
from difftransformer.experiments.report import sections
from difftransformer.experiments.report.html import write_html
from difftransformer.experiments.report.ood_view import ood_section
from difftransformer.experiments.report.plots import plot_lambdas, plot_losses
from difftransformer.experiments.report.runs import Run
from difftransformer.experiments.report.scaling_view import plot_scaling
from difftransformer.experiments.study_dir import MANIFEST_FILE, StudyDir
from difftransformer.experiments.units import Unit, find_results
from difftransformer.train.run_dir import METRICS_FILE


def write_report(study_dir: str | Path, *, samples: bool = True, html: bool = True) -> Path:
    """Write <study_dir>/report.md (and report.html, self-contained) with its PNGs; returns report.md's path.

    `study_dir` is a study folder, or a results folder alone (its result files and the manifest copy):
    both give the same report, because every number is read from the units' result records, or from a
    run folder for a unit that has no result file yet. It holds the folder's lock while it writes (a
    `compare` running there refuses, and the reverse: FolderInUseError)."""
    if not str(study_dir).strip():
        raise ValueError("the study folder is empty ''; name it (e.g. runs/demo, or . for the current folder)")
    if not Path(study_dir).is_dir():
        raise FileNotFoundError(f"{study_dir} is not a folder; give the --out-dir of a `difftransformer compare` run")
    with folder_lock(study_dir, purpose="report a copy of the folder", kind="a study"):
        return _write_report(StudyDir(study_dir), samples, html)


def _write_report(study: StudyDir, samples: bool, html: bool) -> Path:
    ctx = _context(study, samples)
    plot_losses(ctx.runs, ctx.arms, ctx.seeds, ctx.study.loss_plot)
    has_lambda_plot = plot_lambdas(ctx.runs, ctx.arms, ctx.seeds[0], ctx.study.lambda_plot)
    has_scaling = plot_scaling(ctx, ctx.study.path)
    L = sections.header(ctx) + sections.verdicts(ctx) + sections.final_losses(ctx) + sections.ablations(ctx)
    L += sections.loss_curves(ctx) + sections.lambdas(ctx, has_lambda_plot) + sections.evaluation(ctx)
    L += ood_section(ctx, ctx.study.path)
    L += sections.scaling(ctx, has_scaling) + sections.claims(ctx)
    if samples:
        L += sections.samples(ctx)
    L += sections.what_was_run(ctx)
    text = "\n".join(L).rstrip() + "\n"
    atomic_write_text(ctx.study.report, text)
    if html:
        write_html(text, ctx.study.html, ctx.study.path, title=L[0].lstrip("# "))
    return ctx.study.report


def _cells(manifest: dict[str, Any]) -> list[tuple[str | None, int | None]]:
    """The (size, budget) cells the study has run: as the manifest lists them, or (a manifest written before it
    listed them) every size with every budget."""
    if manifest.get("cells"):
        return [(size, tokens) for size, tokens in manifest["cells"]]
    sizes = [s["name"] for s in manifest.get("sizes") or []] or [None]
    tokens = list(manifest.get("tokens") or []) or [None]
    return [(s, t) for s in sizes for t in tokens]


def _headline(manifest: dict[str, Any], cells: list[tuple[str | None, int | None]],
              arms: list[str]) -> tuple[str | None, int | None] | None:
    """The cell the report's sections up to "Scaling" describe: the largest size (most parameters of any arm) with
    results, at its largest token budget; None without a cell with results."""
    parameters = manifest.get("parameters") or {}

    def size(cell):
        return max((parameters.get(f"{cell[0]}/{a}", 0) for a in arms), default=0) if cell[0] else 0
    return max(cells, key=lambda c: (size(c), c[1] or 0, cells.index(c)), default=None)


def _with_every_result(manifest: dict[str, Any], arms: list[str], seeds: list[int],
                       records: dict[Unit, Any]) -> tuple[list[str], list[int]]:
    """The manifest's arms and seeds, plus those of result files it does not list (files copied in from another
    machine's or folder's run): every result in the folder is reported. New arms follow the order of the
    manifest's arm_specs (the config's), then their names."""
    cells = set(_cells(manifest))
    units = [u for u in records if (u.size, u.tokens) in cells]
    order = list(manifest.get("arm_specs") or [])
    extra = sorted({u.arm for u in units} - set(arms), key=lambda a: (order.index(a) if a in order else len(order), a))
    return arms + extra, sorted(set(seeds) | {u.seed for u in units})


def _context(study: StudyDir, samples: bool = False) -> sections.Context:
    manifest = study.read_manifest() or study.discover()
    arms, seeds = list(manifest["arms"]), sorted(manifest["seeds"])
    if not arms:
        raise FileNotFoundError(f"no runs in {study.path}: expected {MANIFEST_FILE} or <arm>/{METRICS_FILE} "
                                f"folders (run `difftransformer compare` first)")
    records = find_results(study.results_dir(manifest))
    arms, seeds = _with_every_result(manifest, arms, seeds, records)
    default_max_steps = (manifest.get("train") or {}).get("max_steps")
    cells: dict[tuple[str | None, int | None], dict[tuple[str, int], Run]] = {}
    for cell in _cells(manifest):
        found = {}
        for arm in arms:
            for seed in seeds:
                unit = Unit(cell[0], cell[1], seed, arm)
                if unit in records:
                    found[arm, seed] = Run.from_record(records[unit])
                    continue
                run = study.find_unit(unit)
                if run is not None:
                    found[arm, seed] = Run.read(arm, seed, run, default_max_steps if cell[1] is None else None)
        cells[cell] = found
    headline = _headline(manifest, [c for c in cells if cells[c]], arms)
    if headline is None:
        raise FileNotFoundError(f"{study.path} lists arms {arms} but none has a {METRICS_FILE} or a result file yet")
    return sections.Context(study, manifest, arms, seeds, baseline_arm(arms), cells[headline], cells, headline)


__all__ = ["Run", "write_report"]
