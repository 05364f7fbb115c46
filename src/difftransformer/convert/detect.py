"""Which format a checkpoint folder is in, and reading it: safetensors only, never a pickle.

Contract: `detect_format(folder)` answers "difftransformer", "diffllama", "llama" or "unilm" from the
folder's config files alone (`config.json`'s model_type: "difftransformer" is ours, "diffllama" and "llama"
are transformers'; the authors' layout has `unilm.SETTINGS_NAME` instead), and `read_checkpoint`
returns that format, the config dict and the tensors. Anything else is a `ConversionError` in one
line that names the file and what was expected: a path that is a file, a folder without a config, a
config that is not JSON, a model of another architecture, weights that are only pickled
(`pytorch_model.bin`, `.pt`, ...: refused unread, since unpickling runs arbitrary code), or a file
named like safetensors that is not (a renamed pickle, a truncated file). Sharded transformers
checkpoints (`<weights>.index.json` + shards) are read too; their shards must lie in the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from difftransformer.convert.llama import ConversionError
from difftransformer.convert.unilm import SETTINGS_NAME
from difftransformer.model.serialization import CONFIG_NAME, WEIGHTS_NAME

FORMATS = ("difftransformer", "diffllama", "llama", "unilm")
# "ours" is what "difftransformer" was called before; it is still accepted and will be removed in the next release
FORMAT_ALIASES = {"ours": "difftransformer"}
MODEL_TYPES = {"difftransformer": "difftransformer", "diffllama": "diffllama", "llama": "llama"}
INDEX_NAME = WEIGHTS_NAME + ".index.json"  # transformers' sharded checkpoints
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class Checkpoint:
    """A checkpoint as read: its format, its config (config.json or the authors'-layout settings) and tensors."""

    format: str
    config: dict[str, Any]
    state: dict[str, torch.Tensor] = field(repr=False)
    folder: Path


def detect_format(folder: str | Path) -> str:
    """The format of the checkpoint folder `folder` (see the module docstring)."""
    folder = _checkpoint_folder(folder)
    if (folder / SETTINGS_NAME).is_file():
        return "unilm"
    model_type = _read_json(folder / CONFIG_NAME).get("model_type")
    if model_type not in MODEL_TYPES:
        known = ", ".join(f"{t!r}" for t in MODEL_TYPES)
        raise ConversionError(f"{folder / CONFIG_NAME} describes a model of type {model_type!r}; convert reads "
                              f"{known} checkpoints and the authors' layout ({SETTINGS_NAME})")
    return MODEL_TYPES[model_type]


def read_checkpoint(folder: str | Path) -> Checkpoint:
    """Format, config and tensors of a checkpoint folder."""
    fmt = detect_format(folder)
    folder = Path(folder)
    config = _read_json(folder / (SETTINGS_NAME if fmt == "unilm" else CONFIG_NAME))
    return Checkpoint(fmt, config, read_weights(folder), folder)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors weights (one file, or transformers' shards)."""
    if (folder / WEIGHTS_NAME).is_file():
        return _load(folder / WEIGHTS_NAME)
    if (folder / INDEX_NAME).is_file():
        return _load_shards(folder)
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConversionError(f"{folder} holds only pickled weights ({', '.join(pickled)}); convert reads safetensors "
                              f"only and never unpickles (it can run code): re-save them as {WEIGHTS_NAME}, e.g. with "
                              f"transformers' save_pretrained(..., safe_serialization=True), where you trust the file")
    raise ConversionError(f"{folder} has a config but no weights; expected {WEIGHTS_NAME} (or {INDEX_NAME} and shards)")


def _checkpoint_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"no such folder: {folder}")
    if not folder.is_dir():
        raise ConversionError(f"{folder} is a file; convert reads a checkpoint folder ({CONFIG_NAME} + {WEIGHTS_NAME}, "
                              f"or the authors' layout: {SETTINGS_NAME} + {WEIGHTS_NAME})")
    if not (folder / CONFIG_NAME).is_file() and not (folder / SETTINGS_NAME).is_file():
        raise ConversionError(f"{folder} is not a checkpoint folder: it has neither {CONFIG_NAME} nor {SETTINGS_NAME}")
    return folder


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path} is not a JSON config ({e}); is it the right file?") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not a config object")
    return data


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConversionError(f"{path} is not a readable safetensors file ({e}); it may be a pickle under that name, "
                              f"truncated or corrupted (convert never unpickles)") from None


def _load_shards(folder: Path) -> dict[str, torch.Tensor]:
    index = _read_json(folder / INDEX_NAME).get("weight_map")
    if not isinstance(index, dict) or not index:
        raise ConversionError(f"{folder / INDEX_NAME} has no weight_map; is it a transformers shard index?")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise ConversionError(f"{folder / INDEX_NAME} names the shard {shard!r}; shards must be .safetensors files "
                                  f"in the same folder")
        state |= _load(folder / shard)
    return state
