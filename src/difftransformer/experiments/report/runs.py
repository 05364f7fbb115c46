"""The runs of a study as the report reads them: one `Run` per unit, from its result file or run folder.

A `Run` is everything the report needs of one training: learning curves, final loss, λ, throughput,
evaluation results and sample generations. It is read from a run folder (`Run.read`) or from a unit's
result file (`Run.from_record`), and written as one (`Run.to_record`), so a report built from
committed result files alone is the same as one built from the run folders.
"""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import dataclass, field
from typing import Any

from difftransformer._version import __version__
from difftransformer.experiments.evaluate import stored_results
from difftransformer.experiments.units import UNIT_FORMAT, Unit
from difftransformer.model.config import DiffTransformerConfig, model_identity
from difftransformer.train import RunDir
from difftransformer.train.config import FREELY_CHANGEABLE

MAX_TRAIN_ROWS = 250  # a result file keeps at most this many training-log rows (evenly spaced, last kept)
_TRAIN_KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "lambdas", "lambda_inits")


@dataclass
class Run:
    """One arm trained with one seed: its folder and what it logged."""

    arm: str
    seed: int
    dir: RunDir | None  # None: read from a result file (no run folder on this machine)
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    max_steps: int | None = None
    model: dict[str, Any] = field(default_factory=dict)  # the run's model_config.json
    last_step: int = 0  # read once with the rows, so every number of a report comes from one snapshot
    finished: bool = False  # trained to max_steps: the last validation loss is final (final/ need not exist)
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # task -> stored evaluation result
    samples: list[dict[str, str]] | None = None  # the report's generations, when made
    parameters: int | None = None
    record: dict[str, Any] | None = None  # the result file it was read from
    folder_identity: dict[str, Any] | None = None  # Run.read: the identity its run folder's configs give

    @property
    def identity(self) -> dict[str, Any] | None:
        """What the run's result depends on (model, train recipe, ...): the identity its result file records,
        else the one its run folder's configs give (`folder_identity`); None when neither is known."""
        return (self.record or {}).get("identity") or self.folder_identity

    @classmethod
    def read(cls, arm: str, seed: int, run_dir: RunDir, default_max_steps: int | None = None, *,
             evals: dict[str, dict[str, Any]] | None = None) -> Run:
        """The run in `run_dir`; `evals`: its evaluation results when the caller has them (a study that has
        just evaluated it), else those stored for its final model (`stored_results`)."""
        series = run_dir.metric_series()
        max_steps = run_dir.max_steps()
        max_steps = max_steps if max_steps is not None else default_max_steps
        last = run_dir.last_step(series)
        cached = run_dir.read_json(run_dir.samples)
        return cls(arm, seed, run_dir, series.train, series.val, max_steps, run_dir.read_json(run_dir.model_config),
                   last, max_steps is not None and last >= max_steps,
                   stored_results(run_dir) if evals is None else dict(evals),
                   cached.get("samples"), folder_identity=folder_identity(run_dir))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Run:
        unit = Unit.from_dict(record["unit"])
        return cls(unit.arm, unit.seed, None, list(record.get("train", [])), list(record.get("val", [])),
                   record.get("max_steps"), dict(record.get("model", {})), int(record.get("last_step", 0)),
                   bool(record.get("finished")), dict(record.get("evals", {})), record.get("samples"),
                   record.get("parameters"), record)

    def to_record(self, unit: Unit, identity: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """This run as a unit's result file (`identity`: what must match for it to be reused)."""
        step = max(1, -(-len(self.train) // MAX_TRAIN_ROWS))
        rows = self.train[::-1][::step][::-1]  # evenly spaced, the last row kept
        return {"format": UNIT_FORMAT, "unit": unit.to_dict(), "identity": identity,
                "written": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "version": __version__,
                "model": self.model, "parameters": self.parameters, "max_steps": self.max_steps,
                "last_step": self.last_step, "finished": self.finished, "final_val_loss": self.final_val,
                "tokens_per_s": self.tokens_per_s, **extra,
                "val": self.val, "train": [{k: r[k] for k in _TRAIN_KEYS if k in r} for r in rows],
                "evals": self.evals, "samples": self.samples}

    @property
    def machine(self) -> tuple | None:
        """Where its tokens/s was measured: (CPU, GPU, GPU count, world size) as its result file records them; None
        for a run read from its folder (the study's manifest records the machine of the last call only)."""
        hw = (self.record or {}).get("hardware")
        if not hw:
            return None
        return hw.get("cpu"), hw.get("gpu"), hw.get("gpu_count"), hw.get("world_size", 1)

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


def folder_identity(run_dir: RunDir) -> dict[str, Any] | None:
    """The model and recipe of the run in `run_dir`, read from its model_config.json and train_config.json in the
    form a unit's result file records them (`study.unit_identity`: the model's identity, the training settings
    but the freely changeable ones, with max_steps), so both sources give one recipe; None without a readable
    train_config.json."""
    train = run_dir.read_json(run_dir.train_config)
    if not train:
        return None
    recipe = {k: v for k, v in train.items() if k not in FREELY_CHANGEABLE}
    if "max_steps" in train:
        recipe["max_steps"] = train["max_steps"]
    model = run_dir.read_json(run_dir.model_config)
    try:  # the config as the model reads it (the saved file adds its format's keys), as a result file records it
        model = DiffTransformerConfig.from_dict(model).to_dict()
    except (TypeError, ValueError):
        pass  # a config this version cannot read keeps its own keys: its recipe then matches no result file's
    return {"model": model_identity(model), "train": recipe}


def finished_val(runs: dict[tuple[str, int], Run], arm: str, seeds: list[int]) -> dict[int, float]:
    """seed -> final validation loss of `arm`, over the seeds whose run of it has finished."""
    out = {}
    for s in seeds:
        run = runs.get((arm, s))
        if run is not None and run.finished and run.final_val is not None:
            out[s] = run.final_val
    return out
