"""transformers' LlamaForCausalLM ⇄ our `transformer` kind: the same logits both ways, exact round trips,
clear refusals (fp32 within 1e-5 relative; float64 within 1e-12 with transformers made to compute its
norms and RoPE in float64, see tests/convert/__init__.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from difftransformer.convert import ConversionError, llama_to_ours, ours_to_llama  # noqa: E402
from difftransformer.convert.llama import interleaved_to_rotate_half, rotate_half_to_interleaved  # noqa: E402
from tests.convert import (  # noqa: E402
    config,
    ids,
    logits,
    ours,
    ours_from,
    randomise_,
    rel,
    same_tensors,
    transformers_in_float64,
    transformers_model,
)
from tests.helpers import raises_one_line  # noqa: E402

CASES = [dict(gqa=False, tied=True), dict(gqa=True, tied=False)]
IDS = ["mha-tied", "gqa-untied"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_both_directions_give_the_same_logits_and_round_trip_exactly(case, dtype, monkeypatch):
    if dtype == torch.float64:
        transformers_in_float64(monkeypatch)
    cfg = config("transformer", **case)
    model = ours(cfg, dtype)
    state, hf_config = ours_to_llama(model.state_dict(), cfg)
    llama = transformers_model(LlamaForCausalLM, hf_config, state, dtype)
    assert rel(logits(llama, ids()), logits(model, ids())) < TOL[dtype]
    # and from a Llama of transformers' own (weights re-randomised there)
    randomise_(llama, seed=5)
    back, back_cfg = llama_to_ours(llama.state_dict(), llama.config.to_dict())
    assert back_cfg.attention == "transformer" and back_cfg.num_key_value_heads == cfg.num_key_value_heads
    assert rel(logits(ours_from(back, back_cfg, dtype), ids()), logits(llama, ids())) < TOL[dtype]
    assert same_tensors(ours_to_llama(back, back_cfg)[0], llama.state_dict())
    assert same_tensors(llama_to_ours(*ours_to_llama(model.state_dict(), cfg))[0], model.state_dict())


def test_a_file_with_the_tied_head_stored_once_converts():
    cfg = config("transformer")
    state, hf_config = ours_to_llama(ours(cfg).state_dict(), cfg)
    del state["lm_head.weight"]  # as transformers' save_pretrained stores a tied head
    back, _ = llama_to_ours(state, hf_config)
    assert back["lm_head.weight"] is back["embed_tokens.weight"]


def test_the_rope_permutation_pairs_j_with_j_plus_half():
    w = torch.arange(2 * 8, dtype=torch.float32)[:, None]  # two heads of d = 8, rotate-half order
    ours_rows = rotate_half_to_interleaved(w, 8).flatten().tolist()
    assert ours_rows == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(interleaved_to_rotate_half(rotate_half_to_interleaved(w, 8), 8), w)


@pytest.mark.parametrize("attention, message", [
    ("transformer_headnorm", "head-wise RMSNorm that LlamaForCausalLM lacks"),
    ("diff", "convert it to DiffLlama or the authors' layout"),
    ("diff_v2", "no transformers class holds this kind"),
    ("diff_retrofit", "head-wise RMSNorm that LlamaForCausalLM lacks"),
])
def test_kinds_llama_cannot_hold_are_refused(attention, message):
    extra = dict(lambda_init=0.0, attention_head_dim=8, head_norm_ramp_steps=4) if attention == "diff_retrofit" else {}
    cfg = config(attention, **extra)
    with raises_one_line(ConversionError, message):
        ours_to_llama(ours(cfg).state_dict(), cfg)


@pytest.mark.parametrize("change, message", [
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
    (dict(rope_theta=5e5), "two RoPE thetas"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(hidden_size=None), "lacks a positive integer hidden_size"),
], ids=["mlp-bias", "rope-scaling", "two-thetas", "kv", "incomplete"])
def test_llama_configs_we_cannot_express_are_refused(change, message):
    cfg = config("transformer")
    state, hf_config = ours_to_llama(ours(cfg).state_dict(), cfg)
    with pytest.raises(ConversionError, match=message):
        llama_to_ours(state, hf_config | change)
