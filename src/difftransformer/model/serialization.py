"""Save and load models as safetensors weights + a JSON config. Loading never unpickles.

A pretrained folder holds `config.json` (DiffTransformerConfig) and `model.safetensors` (a tied LM
head stored once). The model class builds itself from these (`DiffTransformerLM.from_pretrained`);
this module only reads and writes the files, so it does not depend on the model's code.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from difftransformer._io import atomic_path, canonical_safetensors, default_permissions
from difftransformer.model.config import MODEL_TYPE, DiffTransformerConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def is_pretrained_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a complete pretrained model (config and weights)."""
    directory = Path(directory)
    return (directory / CONFIG_NAME).is_file() and (directory / WEIGHTS_NAME).is_file()


def folder_model_type(directory: str | Path) -> str | None:
    """The model_type that `directory`'s config.json names (ours is MODEL_TYPE), or None when there is
    no readable JSON object with a string model_type there: a cheap look before choosing a reader, whose
    own errors then say what is wrong with the file. A config.json that is no regular file (a FIFO, a
    device: reading it would wait forever) is a ValueError naming it."""
    check_regular(Path(directory) / CONFIG_NAME)
    try:
        data: Any = json.loads((Path(directory) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = data.get("model_type") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def check_regular(path: Path) -> None:
    """ValueError when `path` exists but is no regular file (a FIFO, a socket, a device): reading one blocks
    or returns endless bytes. A missing path is left to the reader, whose message names it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ValueError(f"{path} is {what}, not a regular file; put the file it should be there (or remove it)")


def save_pretrained(model: nn.Module, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (a tied LM head is stored once)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save(directory / CONFIG_NAME)
    with atomic_path(directory / WEIGHTS_NAME) as tmp:  # a crash never leaves a torn weights file
        save_model(model, str(tmp), metadata={"format": "pt", "model_type": MODEL_TYPE})
        canonical_safetensors(tmp)  # equal weights give equal bytes (safetensors orders metadata at random)
        default_permissions(tmp)
    return directory


def read_pretrained(directory: str | Path) -> tuple[DiffTransformerConfig, Path]:
    """(config, weights path) of a pretrained folder; a missing file is a FileNotFoundError naming it."""
    directory = Path(directory)
    if directory.is_file():
        raise ValueError(f"{directory} is a file; give the folder that holds {CONFIG_NAME} and {WEIGHTS_NAME} "
                         f"(this file's folder is {directory.parent})")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        check_regular(directory / name)
    config = DiffTransformerConfig.load(directory / CONFIG_NAME)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no weights at {weights}; expected {WEIGHTS_NAME} next to {CONFIG_NAME}")
    return config, weights


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes model weights are stored in


def check_weight_dtypes(weights: str | Path) -> None:
    """ValueError naming the file, the tensor and its dtype when a safetensors file holds a tensor that is not
    floating point (bool, integers): loading would cast it silently into a model that computes garbage."""
    try:
        with safe_open(str(weights), "pt") as fh:
            found = next(((n, fh.get_slice(n).get_dtype()) for n in fh.keys()
                          if fh.get_slice(n).get_dtype() not in FLOAT_DTYPES), None)
    except (SafetensorError, OSError):
        return  # an unreadable file: the loader that follows names what is wrong with it
    if found is not None:
        raise ValueError(f"{weights}: tensor {found[0]!r} is stored as {found[1]}, not as floating point "
                         f"({', '.join(FLOAT_DTYPES)}) like model weights; the file was not written by save_pretrained "
                         f"or a conversion (edited, or another kind of file?): restore or re-export it")


def load_weights(model: nn.Module, weights: Path, device="cpu") -> None:
    """Load a safetensors file into `model` strictly; errors name the file and what is wrong (a tensor that
    is not floating point included: check_weight_dtypes)."""
    check_weight_dtypes(weights)
    try:
        load_model(model, str(weights), strict=True, device=str(device))
    except SafetensorError as e:
        raise ValueError(f"{weights} is not a readable safetensors file ({e}); it may be truncated or corrupted") from e
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0] if lines else type(e).__name__
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        raise ValueError(f"the weights in {weights} do not match the model described by {CONFIG_NAME} next to them: "
                         f"{detail}{more}; was the config edited, or copied from another model?") from None
