"""Helpers of the transformers integration's tests."""

from __future__ import annotations

from pathlib import Path

import torch


def loads_both_ways(lm: torch.nn.Module, folder: Path, ids: torch.Tensor):
    """Our model `lm` saved into folder/ours loads through transformers' AutoModelForCausalLM as our wrapper class,
    with `lm`'s logits on `ids` bit for bit; that model saved by transformers into folder/theirs loads again with
    the same logits. Returns both loaded models (eval mode)."""
    from transformers import AutoModelForCausalLM

    from difftransformer.hf import DiffTransformerForCausalLM

    lm.save_pretrained(folder / "ours")
    hf = AutoModelForCausalLM.from_pretrained(folder / "ours", use_safetensors=True).eval()
    assert type(hf) is DiffTransformerForCausalLM
    with torch.no_grad():
        want = lm(ids).logits
        assert torch.equal(hf(ids).logits, want)
        hf.save_pretrained(folder / "theirs")
        again = AutoModelForCausalLM.from_pretrained(folder / "theirs", use_safetensors=True).eval()
        assert torch.equal(again(ids).logits, want)
    return hf, again
