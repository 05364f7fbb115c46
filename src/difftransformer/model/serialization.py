"""Save and load models as safetensors weights + a JSON config. Loading never unpickles."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from difftransformer._io import atomic_path
from difftransformer.model.config import DiffTransformerConfig
from difftransformer.model.modeling import DiffTransformerLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_pretrained(model: DiffTransformerLM, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (a tied LM head is stored once)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save(directory / CONFIG_NAME)
    with atomic_path(directory / WEIGHTS_NAME) as tmp:  # a crash never leaves a torn weights file
        save_model(model, str(tmp), metadata={"format": "pt", "model_type": "difftransformer"})
    return directory


def load_pretrained(directory: str | Path, device="cpu", dtype: torch.dtype | None = None) -> DiffTransformerLM:
    """Build the model from config.json and load model.safetensors into it, strictly."""
    directory = Path(directory)
    config = DiffTransformerConfig.load(directory / CONFIG_NAME)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no weights at {weights}; expected {WEIGHTS_NAME} next to {CONFIG_NAME}")
    model = DiffTransformerLM(config, device=device)
    try:
        load_model(model, str(weights), strict=True, device=str(device))
    except SafetensorError as e:
        raise ValueError(f"{weights} is not a readable safetensors file ({e}); it may be truncated or corrupted") from e
    except RuntimeError as e:
        raise ValueError(f"the weights in {weights} do not match the model described by {CONFIG_NAME}: {e}") from e
    return model.to(dtype) if dtype is not None else model
