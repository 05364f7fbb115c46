"""Training: the loop, AdamW + schedule, crash-safe checkpoints, DDP/FSDP2, metrics, paired init.

    from difftransformer.train import TrainConfig, train, paired_init
    diff, base = get_preset("tiny").config("diff"), get_preset("tiny").config("transformer")
    states = paired_init([diff, base], seed=0)
    train(diff, TrainConfig(out_dir="runs/diff"), init_state=states[0])
"""

from difftransformer.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from difftransformer.train.config import TrainConfig
from difftransformer.train.init import PairedInit, paired_init
from difftransformer.train.metrics import read_metrics
from difftransformer.train.optim import build_optimizer, classify_parameters, lr_at
from difftransformer.train.trainer import TrainingDivergedError, TrainResult, evaluate, train

__all__ = [
    "CheckpointError", "PairedInit", "TrainConfig", "TrainResult", "TrainingDivergedError", "build_optimizer",
    "classify_parameters", "evaluate", "load_checkpoint", "lr_at", "paired_init", "read_metrics",
    "save_checkpoint", "train", "verify_checkpoint",
]
