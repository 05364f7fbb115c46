"""The runs of a study as the report reads them: one `Run` per (arm, seed) found on disk."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from difftransformer.experiments.study_dir import StudyDir
from difftransformer.train import RunDir


@dataclass
class Run:
    """One arm trained with one seed: its folder and what it logged."""

    arm: str
    seed: int
    dir: RunDir
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    max_steps: int | None = None
    model: dict[str, Any] = field(default_factory=dict)  # the run's model_config.json
    last_step: int = 0  # read once with the rows, so every number of a report comes from one snapshot
    finished: bool = False  # trained to max_steps: the last validation loss is final (final/ need not exist)

    @classmethod
    def read(cls, arm: str, seed: int, run_dir: RunDir, default_max_steps: int | None = None) -> Run:
        series = run_dir.metric_series()
        max_steps = run_dir.max_steps()
        max_steps = max_steps if max_steps is not None else default_max_steps
        last = run_dir.last_step(series)
        return cls(arm, seed, run_dir, series.train, series.val, max_steps, run_dir.read_json(run_dir.model_config),
                   last, max_steps is not None and last >= max_steps)

    @property
    def final_val(self) -> float | None:
        return self.val[-1]["loss"] if self.val and self.val[-1].get("loss") is not None else None

    @property
    def tokens(self) -> int:
        return max([int(r.get("tokens", 0)) for r in self.train], default=0)

    @property
    def tokens_per_s(self) -> float | None:
        """Median over logged windows, skipping the first (it includes start-up and warm-up)."""
        rates = [r["tokens_per_s"] for r in self.train[1:] if r.get("tokens_per_s")]
        rates = rates or [r["tokens_per_s"] for r in self.train if r.get("tokens_per_s")]
        return statistics.median(rates) if rates else None

    def _last_lambda_row(self, key: str) -> list[float | None] | None:
        if not self.train or not self.train[-1].get(key):
            return None
        values = self.train[-1][key]
        return None if all(x is None for x in values) else values

    @property
    def lambdas(self) -> list[float | None] | None:
        """Each layer's λ at the last logged step, as the trainer logged it (None: no scalar λ)."""
        return self._last_lambda_row("lambdas")

    @property
    def lambda_inits(self) -> list[float | None] | None:
        """Each layer's λ_init, as the trainer logged it (None for runs logged before λ_init was)."""
        return self._last_lambda_row("lambda_inits")


def load_runs(study: StudyDir, manifest: dict[str, Any]) -> dict[tuple[str, int], Run]:
    """Every (arm, seed) of the manifest that has a run folder with metrics."""
    runs = {}
    default_max_steps = (manifest.get("train") or {}).get("max_steps")
    for arm in manifest["arms"]:
        for seed in manifest["seeds"]:
            found = study.find_run(arm, seed)
            if found is not None:
                runs[arm, seed] = Run.read(arm, seed, found, default_max_steps)
    return runs


def finished_val(runs: dict[tuple[str, int], Run], arm: str, seeds: list[int]) -> dict[int, float]:
    """seed -> final validation loss of `arm`, over the seeds whose run of it has finished."""
    out = {}
    for s in seeds:
        run = runs.get((arm, s))
        if run is not None and run.finished and run.final_val is not None:
            out[s] = run.final_val
    return out
