"""Exact weight converters between our format and others.

    from difftransformer.convert import convert, read_checkpoint
    ckpt = read_checkpoint("hf/diffllama-folder")              # format detected from config.json
    state, config = convert(ckpt.state, ckpt.config, ckpt.format, "difftransformer")

Formats: "difftransformer" (ours: `DiffTransformerLM` state dict + `DiffTransformerConfig`; "ours" is
still accepted for it and will be removed in the next release), "diffllama"
(transformers' `DiffLlamaForCausalLM`, our `diff` kind), "llama" (transformers' `LlamaForCausalLM`,
our `transformer` kind) and "unilm" (the authors' reference layout, our `diff` kind). Each pair is a
pure function on tensors and configs, named by direction (`diffllama_to_ours`, `ours_to_diffllama`,
...), and every conversion goes through ours. "Exact" means the converted model computes the same
function (its logits agree with the source's to the precision of the arithmetic, checked against
transformers' own classes) and a round trip gives back the same tensors; a model the target cannot
express is a `ConversionError` (a ValueError) naming why, never an approximation.

This package reads and writes no transformers objects (configs are plain dicts), so it runs without
transformers; the CLI (`difftransformer convert`) builds the transformers classes to save folders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from difftransformer.convert.detect import FORMAT_ALIASES, FORMATS, Checkpoint, detect_format, read_checkpoint
from difftransformer.convert.diffllama import diffllama_to_ours, ours_to_diffllama
from difftransformer.convert.llama import ConversionError, llama_to_ours, ours_state, ours_to_llama
from difftransformer.convert.llama_retrofit import calibrate_head_norm, retrofit_llama
from difftransformer.convert.unilm import ours_to_unilm, unilm_to_ours
from difftransformer.model import DiffTransformerConfig

State = dict[str, torch.Tensor]
_TO_OURS = {"diffllama": diffllama_to_ours, "llama": llama_to_ours, "unilm": unilm_to_ours}
_FROM_OURS = {"diffllama": ours_to_diffllama, "llama": ours_to_llama, "unilm": ours_to_unilm}


def format_name(name: str) -> str:
    """The format called `name` (one of FORMATS, or an alias of one); a ConversionError names the choices."""
    name = FORMAT_ALIASES.get(name, name)
    if name not in FORMATS:
        raise ConversionError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
    return name


def to_ours(source: str, state: Mapping[str, torch.Tensor], config: Any) -> tuple[State, DiffTransformerConfig]:
    """A checkpoint in format `source` as ours. For "difftransformer" the config may be a dict (config.json)
    or a `DiffTransformerConfig`; the tensors are then only checked."""
    source = format_name(source)
    if source != "difftransformer":
        return _TO_OURS[source](state, config)
    if not isinstance(config, DiffTransformerConfig):
        config = DiffTransformerConfig.from_dict(dict(config))
    return ours_state(state, config), config


def from_ours(target: str, state: Mapping[str, torch.Tensor], config: DiffTransformerConfig) -> tuple[State, Any]:
    """Our model in format `target`: (tensors, config dict), or (tensors, `DiffTransformerConfig`) for
    "difftransformer"."""
    target = format_name(target)
    if target == "difftransformer":
        return to_ours(target, state, config)
    return _FROM_OURS[target](state, config)


def convert(state: Mapping[str, torch.Tensor], config: Any, source: str, target: str) -> tuple[State, Any]:
    """A checkpoint from format `source` to `target`, through ours (see to_ours / from_ours)."""
    return from_ours(target, *to_ours(source, state, config))


__all__ = ["FORMATS", "FORMAT_ALIASES", "Checkpoint", "ConversionError", "calibrate_head_norm", "convert",
           "detect_format", "diffllama_to_ours", "format_name", "from_ours", "llama_to_ours", "ours_to_diffllama",
           "ours_to_llama", "ours_to_unilm", "read_checkpoint", "retrofit_llama", "to_ours", "unilm_to_ours"]
