"""Where the numbers go: metrics.jsonl (the source of truth), TensorBoard, and a tqdm bar.

Only rank 0 creates a MetricsWriter with enabled=True; the others get a silent one, so the loop
never branches on rank to log. On resume, lines after the resumed step are dropped first, so the
file ends up equal to an uninterrupted run's (timings aside) and TensorBoard purges the same steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from difftransformer._io import atomic_write_text

log = logging.getLogger("difftransformer.train")

METRICS_FILE = "metrics.jsonl"


def _parse(line: str) -> dict[str, Any] | None:
    """One row, or None for a line that is not a JSON object (a torn last line after a crash)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def _lines(path: str | Path) -> list[str]:
    """The lines of a metrics file; bytes that are not UTF-8 (a torn or edited line) become U+FFFD, so
    that line fails to parse and is skipped instead of making the whole log unreadable."""
    return Path(path).read_text(encoding="utf-8", errors="replace").splitlines()


def _step_at_most(row: dict[str, Any], last: int) -> bool:
    step = row.get("step")
    return isinstance(step, (int, float)) and not isinstance(step, bool) and step <= last


def truncate_metrics(path: Path, keep_through_step: int) -> None:
    """Keep the rows whose step <= keep_through_step; drop a torn line and rows without a numeric step."""
    if not path.exists():
        return
    kept = [line for line in _lines(path)
            if (row := _parse(line)) is not None and _step_at_most(row, keep_through_step)]
    atomic_write_text(path, "".join(line + "\n" for line in kept), fsync=True)  # a crash here keeps the old file


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl in file order (optionally only "train" or "val"); a torn line is skipped,
    so a run that is still writing, or was killed mid-line, can be read."""
    rows = (_parse(line) for line in _lines(path))
    return [r for r in rows if r is not None and (kind is None or r.get("kind") == kind)]


class MetricSeries(NamedTuple):
    """A run's logged rows per kind, one per step in step order (what curves and final values are read from)."""

    train: list[dict[str, Any]]
    val: list[dict[str, Any]]


def read_metric_series(path: str | Path) -> MetricSeries:
    """`read_metrics` split by kind and keyed by step: a repeated step keeps its last row. A missing
    file gives empty series (a run that has not logged yet)."""
    path = Path(path)
    by_kind: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "val": {}}
    for row in (read_metrics(path) if path.is_file() else []):
        if row.get("kind") in by_kind and isinstance(row.get("step"), int):  # a row without a step is not one
            by_kind[row["kind"]][int(row["step"])] = row
    return MetricSeries(*([rows[s] for s in sorted(rows)] for rows in by_kind.values()))


def _json_float(x: float | None) -> float | None:
    """JSON has no NaN/Inf; write null rather than an unparseable token."""
    return None if x is None or not math.isfinite(x) else float(x)


class MetricsWriter:
    """Appends rows to `path` and mirrors them to TensorBoard event files in `tensorboard_dir` (None: off)."""

    def __init__(self, path: Path, *, tensorboard_dir: Path | None, enabled: bool, progress: bool,
                 start_step: int, max_steps: int):
        self.enabled = enabled
        self.path = path
        self._fh = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        truncate_metrics(self.path, start_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tensorboard_dir), purge_step=start_step + 1)
            except ImportError as e:  # tensorboard is an optional dependency
                log.warning("TensorBoard logging disabled (%s); pip install tensorboard to enable it", e)
        if progress:
            # Redirected to a file or CI log, redraw every 30 s instead of flooding it with every step.
            interval = 0.1 if sys.stderr.isatty() else 30.0
            self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                             mininterval=interval)

    def _write(self, row: dict[str, Any]) -> None:
        assert self._fh is not None
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def sync(self) -> None:
        """Put the rows written so far on disk (fsync). Called before each checkpoint: a resume keeps the rows up
        to its checkpoint's step and never writes them again, so they must not be lost while the checkpoint lives."""
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def train(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, tokens_per_s: float,
              elapsed_s: float, lambdas: list[float | None], lambda_inits: list[float | None]) -> None:
        """One training row; lambdas / lambda_inits: each layer's λ and λ_init (None without a scalar λ)."""
        if not self.enabled:
            return
        self._write({"kind": "train", "step": step, "loss": _json_float(loss), "lr": lr,
                     "grad_norm": _json_float(grad_norm), "tokens": tokens, "tokens_per_s": tokens_per_s,
                     "elapsed_s": elapsed_s, "lambdas": lambdas, "lambda_inits": lambda_inits})
        if self._tb is not None:
            for name, value in (("train/loss", loss), ("train/lr", lr), ("train/grad_norm", grad_norm),
                                ("train/tokens_per_s", tokens_per_s)):
                self._tb.add_scalar(name, value, step)
            for i, lam in enumerate(lambdas):
                if lam is not None:
                    self._tb.add_scalar(f"lambda/layer_{i}", lam, step)
        log.debug("step %d loss %.4f lr %.3g grad_norm %.3f %.0f tok/s", step, loss, lr, grad_norm, tokens_per_s)

    def val(self, step: int, loss: float, tokens: int) -> None:
        if not self.enabled:
            return
        self._write({"kind": "val", "step": step, "loss": _json_float(loss), "tokens": tokens})
        if self._tb is not None:
            self._tb.add_scalar("val/loss", loss, step)
        msg = f"step {step}: val loss {loss:.4f}"
        if self._bar is not None:
            self._bar.write(msg)  # above the bar; logging would tear it
            log.debug(msg)
        else:
            log.info(msg)

    def progress(self, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._fh is not None:
            self._fh.close()
        self._fh = self._tb = self._bar = None
