"""Saving converted weights as a transformers folder, through transformers' own classes.

It lives in `hf`, not beside the converters, because `hf` is the only part that may import
transformers (docs/architecture.md, dependency rules): `difftransformer.convert` holds pure state-dict
functions that run without it, and this module is where a converted (state dict, config dict) becomes a folder that
`DiffLlamaForCausalLM.from_pretrained` / `LlamaForCausalLM.from_pretrained` load with no missing
or unexpected keys: the class is built on the meta device, the weights are assigned, and its own
`save_pretrained` writes config.json and model.safetensors. `save_transformers_tokenizer` writes the
tokenizer of such a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

TRANSFORMERS_CLASSES = {"diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM"),
                        "llama": ("LlamaConfig", "LlamaForCausalLM")}


def save_transformers_folder(fmt: str, folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Save `state` as transformers' `fmt` model ("diffllama" or "llama") with `config` into `folder`."""
    transformers.utils.logging.disable_progress_bar()  # one summary line is the command's output
    config_name, model_name = TRANSFORMERS_CLASSES[fmt]
    hf_config = getattr(transformers, config_name).from_dict(config)
    with torch.device("meta"):
        model = getattr(transformers, model_name)(hf_config)
    model.load_state_dict(state, strict=True, assign=True)
    if hf_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(folder)


def save_transformers_tokenizer(tokenizer_json: Path, folder: Path, context: int | None = None) -> None:
    """Our tokenizer.json as `folder`'s transformers tokenizer: EOS is its BOS, EOS and pad token and starts every
    text encoded with special tokens (transformers' default), as training puts EOS before every document
    (hf.lm_eval.save_tokenizer_for_transformers; encodings without special tokens are ours unchanged)."""
    from difftransformer.hf.lm_eval import save_tokenizer_for_transformers

    save_tokenizer_for_transformers(tokenizer_json, folder, model_max_length=context)
