"""Starting a run from a model folder (`TrainConfig.init_from`, `difftransformer train --init-from DIR`).

Contract: DIR is one of our model folders (config.json + model.safetensors: a run's final/, the output of
`retrofit` or of `convert --to difftransformer`, a `save_pretrained` folder). The run's model is DIR's model:
its config is DIR's config.json, and only fields that do not change what the weights compute at step 0 may
differ (`MAY_CHANGE`: how attention is computed, the retrofit ramp length, the RoPE context length). The
weights are loaded strictly, before anything is trained; a resumed run takes its checkpoint instead.

Why here: the trainer owns "which weights does step 0 start from"; the run config (run_config.py) asks
this module which model a folder implies, so a config file, the CLI and the Python API agree. Folders of
other formats (transformers Llama / DiffLlama, the authors' layout) are refused with the command that
converts them: one reader per format lives in `convert`, which the trainer does not import.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from difftransformer.data import PreparedData
from difftransformer.data.tokenizer import TOKENIZER_FILE, Tokenizer
from difftransformer.model import DiffTransformerConfig
from difftransformer.model.config import MODEL_TYPE, RUNTIME_FIELDS
from difftransformer.model.serialization import CONFIG_NAME, WEIGHTS_NAME, folder_model_type, load_weights
from difftransformer.train.run_dir import RunDir

log = logging.getLogger("difftransformer.train")

# Model fields a run started from a folder may set differently from the folder's config.json.
MAY_CHANGE = (*RUNTIME_FIELDS, "head_norm_ramp_steps", "max_position_embeddings")


def init_folder(folder: str | Path) -> Path:
    """DIR as a model folder of ours, or a one-line error naming what it is and the fix."""
    path = Path(folder)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise FileNotFoundError(f"init_from {folder} {what}; give a model folder (config.json + {WEIGHTS_NAME}), "
                                f"e.g. a run's final/ or the output of `difftransformer retrofit`")
    config = path / CONFIG_NAME
    if not config.is_file():
        raise FileNotFoundError(f"init_from {folder} has no {CONFIG_NAME}; give a model folder (config.json + "
                                f"{WEIGHTS_NAME}), e.g. a run's final/")
    model_type = folder_model_type(path)  # None: DiffTransformerConfig.load names what is wrong with the file
    if model_type not in (None, MODEL_TYPE):
        raise ValueError(f"init_from {folder} holds a {model_type!r} model, not ours; convert it first "
                         f"(`difftransformer convert {folder} OUT --to difftransformer`, or `difftransformer retrofit "
                         f"{folder} OUT` to turn a Llama into DIFF) and start from OUT")
    if not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"init_from {folder} has no {WEIGHTS_NAME} next to its {CONFIG_NAME}")
    return path


def check_init_overrides(folder: str | Path, overrides: Mapping[str, Any]) -> None:
    """Model settings given beside init_from may only be MAY_CHANGE fields (a mistake of the run config,
    not of the folder: checked without reading it)."""
    fixed = sorted(k for k in overrides if k not in MAY_CHANGE)
    if fixed:
        raise ValueError(f"model setting(s) {', '.join(fixed)} cannot be set with init_from: the model (size, kind, "
                         f"vocabulary) is the one in {Path(folder) / CONFIG_NAME}; remove them (only "
                         f"{', '.join(MAY_CHANGE)} may change)")


def init_model_config(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> DiffTransformerConfig:
    """The model a run started from `folder` trains: its config.json with `overrides` (MAY_CHANGE fields only)."""
    overrides = dict(overrides or {})
    check_init_overrides(folder, overrides)
    path = init_folder(folder)
    config = DiffTransformerConfig.load(path / CONFIG_NAME)
    return dataclasses.replace(config, **overrides) if overrides else config


def folder_tokenizer(folder: str | Path) -> Path | None:
    """The tokenizer saved with the model in `folder`, if any."""
    path = Path(folder) / TOKENIZER_FILE
    return path if path.is_file() else None


def check_init_config(folder: str | Path, model_config: DiffTransformerConfig) -> None:
    """`model_config` must be the folder's, up to MAY_CHANGE fields (the Python API may pass any config)."""
    theirs = DiffTransformerConfig.load(init_folder(folder) / CONFIG_NAME).to_dict()
    ours = model_config.to_dict()
    differ = sorted(k for k in theirs if k not in MAY_CHANGE and theirs[k] != ours.get(k))
    if differ:
        detail = ", ".join(f"{k} {ours.get(k)!r} vs {theirs[k]!r}" for k in differ[:4])
        raise ValueError(f"the run's model differs from the one in init_from {folder} ({detail}); build the model "
                         f"config from the folder (train.init_from in a run config does) or drop init_from")


def check_init_tokenizer(folder: str | Path, data: PreparedData) -> None:
    """The data must be tokenized with the tokenizer saved beside the weights (when the folder has one):
    the same ids would otherwise mean other strings, and training would silently relearn the embedding.
    A folder without one cannot be checked: that is said, not passed over."""
    saved = folder_tokenizer(folder)
    if saved is None:
        log.warning("init_from %s has no %s, so the data's tokenizer (%s) cannot be checked against the one the "
                    "model learned; if it is another, the ids mean other strings: put the model's %s in %s",
                    folder, TOKENIZER_FILE, data.out_dir, TOKENIZER_FILE, folder)
    elif Tokenizer.from_file(saved).hash != data.tokenizer_hash:
        raise ValueError(f"{data.out_dir} was tokenized with another tokenizer than the model's ({saved}); prepare "
                         f"the data with it (data.tokenizer_path = {saved}) or point data.data_dir elsewhere")


def check_init_outside_run(folder: str | Path, run: RunDir) -> None:
    """The run must not write where its starting model lies: its final/ is replaced by the trained
    weights, and its checkpoints/ and replaced/ are pruned, so the model a run starts from (a retrofit or a
    conversion, maybe hours of work) would be lost the first time the run saves."""
    source = Path(folder).resolve()
    for owned, inside in ((run.final, False), (run.checkpoints, True), (run.replaced, True)):
        owned = owned.resolve()
        if source == owned or (inside and owned in source.parents):
            raise ValueError(f"init_from {folder} lies in the run's own {owned.name}/ folder ({owned}), which "
                             f"training overwrites or prunes: the model it starts from would be lost; choose another "
                             f"--out-dir (train.out_dir), or copy {folder} elsewhere and start from the copy")


def load_init_weights(model: nn.Module, folder: str | Path) -> None:
    """Load the folder's weights into `model` (strict; errors name the file)."""
    load_weights(model, init_folder(folder) / WEIGHTS_NAME)
