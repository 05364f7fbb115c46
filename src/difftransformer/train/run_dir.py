"""One definition of a run folder: what a training run writes where, whether it finished, how to load it.

    <run>/
      model_config.json   DiffTransformerConfig of the run (written at start)
      train_config.json   TrainConfig of the run (written at start; max_steps is the target)
      metrics.jsonl       one JSON row per logged step: kind "train" (loss, lr, λ, λ_init, ...) or "val"
      tb/                 TensorBoard event files (when train.tensorboard)
      checkpoints/        step_XXXXXXXX/ folders and `latest` (see checkpoint.py)
      replaced/           a fresh start's predecessor (its checkpoints, metrics, final/, done.json, tb/, configs),
                          kept until the new run has saved a checkpoint of its own
      final/              config.json, model.safetensors, tokenizer.json: the trained model
      done.json           written by train() after final/: final step, val loss, tokens/s, wall time, peak CUDA MiB
      samples.json        the report's cached sample generations (experiments/report)
      eval/               evaluation results of the final model: <task>.json (+ .png), see eval/results.py

Everything outside train/ asks a `RunDir` for these paths. The names are spelled once: here, or by
the module that owns the file's format (metrics.py, checkpoint.py, model/serialization.py), and
imported from there. Two questions have one answer each here:
- `trained_to(max_steps)`: training reached max_steps (its last val loss is final), from metrics.jsonl
  or done.json;
- `is_finished(max_steps)`: a train() call to max_steps completed, final/ included: nothing is left to do.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difftransformer._io import Folder, atomic_write_text, folder_entry, register_folder_kind
from difftransformer.data import PreparedData
from difftransformer.data.tokenizer import TOKENIZER_FILE
from difftransformer.dist import is_device_name
from difftransformer.model import DiffTransformerLM
from difftransformer.model.serialization import CONFIG_NAME, WEIGHTS_NAME, is_pretrained_dir
from difftransformer.train.checkpoint import (
    CHECKPOINTS_DIR,
    LATEST,
    MODEL_CONFIG_FILE,
    STATE_FILE,
    TRAIN_CONFIG_FILE,
    load_checkpoint,
)
from difftransformer.train.metrics import METRICS_FILE, MetricSeries, read_metric_series

log = logging.getLogger("difftransformer.train")

FINAL_DIR = "final"
TENSORBOARD_DIR = "tb"
DONE_FILE = "done.json"
SAMPLES_FILE = "samples.json"
REPLACED_DIR = "replaced"
EVAL_DIR = "eval"


register_folder_kind("a training run", TRAIN_CONFIG_FILE, METRICS_FILE)


class RunDir(Folder):
    """The folder of one training run (it need not exist yet)."""

    __slots__ = ()

    # -- where things are ---------------------------------------------------------------------------
    model_config = folder_entry(MODEL_CONFIG_FILE)
    train_config = folder_entry(TRAIN_CONFIG_FILE)
    metrics = folder_entry(METRICS_FILE)
    tensorboard = folder_entry(TENSORBOARD_DIR)
    checkpoints = folder_entry(CHECKPOINTS_DIR)
    replaced = folder_entry(REPLACED_DIR)  # a fresh start's predecessor (checkpoints, metrics, final/ ...)
    replaced_checkpoints = folder_entry(REPLACED_DIR, CHECKPOINTS_DIR)
    final = folder_entry(FINAL_DIR)
    final_weights = folder_entry(FINAL_DIR, WEIGHTS_NAME)
    final_tokenizer = folder_entry(FINAL_DIR, TOKENIZER_FILE)
    done = folder_entry(DONE_FILE)
    samples = folder_entry(SAMPLES_FILE)
    evals = folder_entry(EVAL_DIR)

    # -- what is there ------------------------------------------------------------------------------
    def has_metrics(self) -> bool:
        """Whether a run has logged here (the sign that this folder is a run folder)."""
        return self.metrics.is_file()

    def has_final(self) -> bool:
        return is_pretrained_dir(self.final)

    def check_layout(self) -> None:
        """ValueError naming the entry when something in the folder has the wrong kind (a file where the run
        keeps a folder, or the reverse): found now, not when training reaches its first checkpoint."""
        for entry in (self.checkpoints, self.final, self.tensorboard, self.replaced, self.evals):
            if (entry.exists() or entry.is_symlink()) and not entry.is_dir():
                raise ValueError(f"{entry} is not a folder, but a run keeps its {entry.name}/ there; move it away, "
                                 f"or train into another out_dir")
        for entry in (self.metrics, self.done, self.model_config, self.train_config, self.checkpoints / LATEST):
            if entry.is_dir():
                raise ValueError(f"{entry} is a folder, but a run keeps a file there; move it away, or train into "
                                 f"another out_dir")

    def unreadable_json(self, which: Path) -> bool:
        """Whether `which` exists but does not hold a JSON object (edited, or torn by a crash)."""
        return which.exists() and not self.read_json(which)

    def read_json(self, which: Path) -> dict[str, Any]:
        """One of this run's JSON files as a dict; {} when it is missing or unreadable (a run still starting)."""
        try:
            data = json.loads(which.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def max_steps(self) -> int | None:
        """The run's target step count, from its train_config.json."""
        value = self.read_json(self.train_config).get("max_steps")
        return int(value) if value is not None else None

    def seed(self) -> int | None:
        """The run's training seed, from its train_config.json."""
        value = self.read_json(self.train_config).get("seed")
        return int(value) if value is not None else None

    def seq_len(self) -> int | None:
        """The length the run trained at, from its train_config.json."""
        value = self.read_json(self.train_config).get("seq_len")
        return int(value) if value is not None else None

    def data_dir(self) -> Path | None:
        """The run's prepared-data folder, from its train_config.json (relative paths as written)."""
        value = self.read_json(self.train_config).get("data_dir")
        return Path(value) if value else None

    def metric_series(self) -> MetricSeries:
        """Train and val rows by step (empty when nothing is logged yet)."""
        return read_metric_series(self.metrics)

    def done_step(self) -> int | None:
        """The step of the last train() call that completed (wrote final/ and then done.json)."""
        step = self.read_json(self.done).get("final_step")
        return int(step) if step is not None else None

    def last_step(self, series: MetricSeries | None = None) -> int:
        """The last step with a metrics row or a done.json record (0 before the first log); `series`:
        rows already read, so that a caller's numbers all come from one reading of the file."""
        series = self.metric_series() if series is None else series
        logged = max((int(r["step"]) for r in series.train + series.val), default=0)
        return max(logged, self.done_step() or 0)

    def trained_to(self, max_steps: int | None = None) -> bool:
        """Training reached `max_steps` (default: the run's own); its last validation loss is final."""
        target = self.max_steps() if max_steps is None else max_steps
        return target is not None and self.last_step() >= target

    def is_finished(self, max_steps: int | None = None) -> bool:
        """Nothing is left to do: a train() call to at least `max_steps` completed, final/ included
        (final/ weights from a shorter run, or a call killed before final/, do not count)."""
        target = self.max_steps() if max_steps is None else max_steps
        done = self.done_step()
        return target is not None and done is not None and done >= target and self.has_final()

    def write_done(self, record: dict[str, Any]) -> None:
        atomic_write_text(self.done, json.dumps(record, indent=2) + "\n")


@dataclass
class LoadedModel:
    model: DiffTransformerLM
    tokenizer_path: Path | None  # None when neither the model folder nor the run's data has one
    source: str  # what was loaded, for messages: "final weights in ..." or "checkpoint ... at step N"
    checkpoint_step: int | None = None  # the step, when no final/ model existed and a checkpoint was loaded
    tokenizer_hash: str | None = None  # of the tokenizer the model was trained with, when it is known


def load_model(path: str | Path, device: str = "cpu") -> LoadedModel:
    """A trained model from a final/ folder, a run folder (its final/, else its newest checkpoint), a
    checkpoints/ folder or one checkpoint step folder; with the tokenizer it was trained with."""
    if not is_device_name(device):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")  # torch's lists 20 types
    path = Path(path)
    for final in (path, RunDir(path).final):
        lone_weights = (final / WEIGHTS_NAME).is_file() and not (final / STATE_FILE).is_file()  # not a checkpoint
        if lone_weights and not (final / CONFIG_NAME).is_file():
            raise ValueError(f"{final} holds {WEIGHTS_NAME} but no {CONFIG_NAME}, which describes the model; "
                             f"restore it (it is written beside the weights), or load the run's checkpoint folder "
                             f"instead")
        if is_pretrained_dir(final):
            tok = final / TOKENIZER_FILE
            return LoadedModel(DiffTransformerLM.from_pretrained(final, device=device),
                               tok if tok.is_file() else None, f"final weights in {final}")
    ckpt = load_checkpoint(path, map_location=device)  # raises CheckpointError naming what it expected
    model = DiffTransformerLM(ckpt["model_config"], device=device)
    model.load_state_dict(ckpt["model"], strict=True)
    trained_with = ckpt["state"].get("data", {}).get("tokenizer_hash")
    return LoadedModel(model, _data_tokenizer(Path(ckpt["train_config"].data_dir), trained_with),
                       f"checkpoint {ckpt['path']} at step {ckpt['step']}", ckpt["step"], trained_with)


def _data_tokenizer(data_dir: Path, trained_with: str | None) -> Path | None:
    """The tokenizer of the run's prepared data, if that folder still holds the one it trained with
    (a relative data_dir is read from here; prepared again since, it may hold another)."""
    if not PreparedData.exists(data_dir):
        return None
    data = PreparedData.load(data_dir)
    if trained_with is not None and data.tokenizer_hash != trained_with:
        log.warning("%s now holds another tokenizer than the run trained with; pass --tokenizer", data_dir)
        return None
    return data.tokenizer_path
