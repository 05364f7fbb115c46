"""Training: the loop, AdamW + schedule, crash-safe checkpoints, DDP/FSDP2, metrics, the run folder.

    from difftransformer.train import TrainConfig, train
    train(get_preset("tiny").config("diff"), TrainConfig(out_dir="runs/diff"))

Studies over many runs (paired DIFF/baseline comparisons) are in `difftransformer.experiments`.
"""

from difftransformer.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from difftransformer.train.config import TrainConfig
from difftransformer.train.metrics import MetricSeries, read_metric_series, read_metrics
from difftransformer.train.optim import build_optimizer, classify_parameters, lr_at
from difftransformer.train.run_dir import LoadedModel, RunDir, load_model
from difftransformer.train.trainer import TrainingDivergedError, TrainResult, evaluate, train

__all__ = [
    "CheckpointError", "LoadedModel", "MetricSeries", "RunDir", "TrainConfig", "TrainResult", "TrainingDivergedError",
    "build_optimizer", "classify_parameters", "evaluate", "load_checkpoint", "load_model", "lr_at",
    "read_metric_series", "read_metrics", "save_checkpoint", "train", "verify_checkpoint",
]
