"""ours ⇄ transformers' DiffLlamaForCausalLM: the same logits both ways, exact round trips, clear refusals.

Every weight is non-trivial (head-norm weights, block norms and λ vectors random), so a wrong pairing
(adjacent vs i / i + H/2), a missed RoPE permutation, a dropped head-norm fold or a swapped λ vector
changes the logits far beyond the tolerances: fp32 1e-5 relative, float64 1e-12 (transformers made
to compute its norms, RoPE and λ in float64: see tests/convert/__init__.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DiffLlamaForCausalLM  # noqa: E402

from difftransformer.convert import ConversionError, diffllama_to_ours, ours_to_diffllama  # noqa: E402
from difftransformer.model import DiffTransformerLM  # noqa: E402
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

CASES = [dict(gqa=False, tied=True), dict(gqa=True, tied=False), dict(gqa=True, tied=True)]
IDS = ["mha-tied", "gqa-untied", "gqa-tied"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def diffllama(case: dict, dtype=torch.float32) -> DiffLlamaForCausalLM:
    """A random DiffLlama (its λ vectors and norms randomised too), built by transformers from a config."""
    _, hf_config = ours_to_diffllama(ours(config(**case)).state_dict(), config(**case))
    return randomise_(transformers_model(DiffLlamaForCausalLM, hf_config, dtype=dtype), seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ours_to_diffllama_gives_the_same_logits(case, dtype, monkeypatch):
    if dtype == torch.float64:
        transformers_in_float64(monkeypatch)
    cfg = config(**case)
    model = ours(cfg, dtype)
    state, hf_config = ours_to_diffllama(model.state_dict(), cfg)
    assert hf_config["num_attention_heads"] == 8 and hf_config["num_key_value_heads"] == (4 if case["gqa"] else 8)
    dl = transformers_model(DiffLlamaForCausalLM, hf_config, state, dtype)
    assert rel(logits(dl, ids()), logits(model, ids())) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_diffllama_to_ours_gives_the_same_logits_and_round_trips_exactly(case, dtype, monkeypatch):
    if dtype == torch.float64:
        transformers_in_float64(monkeypatch)
    dl = diffllama(case, dtype)
    state, cfg = diffllama_to_ours(dl.state_dict(), dl.config.to_dict())
    assert (cfg.attention, cfg.num_attention_heads, cfg.lambda_init) == ("diff", 4, None)
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in state.items() if k.endswith("subln.weight"))
    assert rel(logits(ours_from(state, cfg, dtype), ids()), logits(dl, ids())) < TOL[dtype]
    back, hf_config = ours_to_diffllama(state, cfg)
    assert same_tensors(back, dl.state_dict())
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters", "tie_word_embeddings",
                "rms_norm_eps", "intermediate_size", "vocab_size"):
        assert hf_config[key] == getattr(dl.config, key), key


def test_ours_round_trip_is_exact_with_unit_head_norms_and_folds_them_otherwise():
    cfg = config(gqa=True)
    model = ours(cfg)
    unit = {k: (torch.ones_like(v) if k.endswith("subln.weight") else v) for k, v in model.state_dict().items()}
    back, back_cfg = diffllama_to_ours(*ours_to_diffllama(unit, cfg))
    assert same_tensors(back, unit) and back_cfg == dataclasses.replace(cfg, attn_backend="auto")
    # Non-unit weights fold into out_proj: the same function, the weight now 1.
    back, back_cfg = diffllama_to_ours(*ours_to_diffllama(model.state_dict(), cfg))
    assert rel(logits(ours_from(back, back_cfg), ids()), logits(model, ids())) < 1e-6
    sd = model.state_dict()
    w, o = sd["layers.1.self_attn.subln.weight"], sd["layers.1.self_attn.out_proj.weight"]
    assert torch.allclose(back["layers.1.self_attn.out_proj.weight"], o * w.repeat(4), rtol=1e-7, atol=0)


def test_dtypes_are_kept():
    """A bf16 model of ours keeps its λ vectors in fp32; both stay as they are, both ways."""
    cfg = config()
    model = DiffTransformerLM(cfg, dtype=torch.bfloat16)
    state, hf_config = ours_to_diffllama(model.state_dict(), cfg)
    p = "model.layers.0.self_attn."
    assert [state[p + n].dtype for n in ("q_proj.weight", "o_proj.weight", "lambda_q1")] == \
        [torch.bfloat16, torch.bfloat16, torch.float32]
    back, _ = diffllama_to_ours(state, hf_config)
    assert back["layers.0.self_attn.subln.weight"].dtype == torch.bfloat16
    assert back["layers.0.self_attn.lambda_q1"].dtype == torch.float32


@pytest.mark.parametrize("overrides, message", [
    (dict(attention="diff_no_headnorm"), "always applies its head-wise RMSNorm"),
    (dict(attention="diff_v2", num_attention_heads=8, num_key_value_heads=8), "V2's per-token sigmoid"),
    (dict(attention="transformer", num_attention_heads=8, num_key_value_heads=8), "convert it to Llama"),
    (dict(lambda_init=0.8), "lambda_init=0.8 is a constant"),
    (dict(attention="diff_retrofit", lambda_init=0.0, attention_head_dim=8, head_norm_ramp_steps=4),
     "no transformers class holds this kind"),
], ids=["no-headnorm", "v2", "transformer", "constant-lambda-init", "retrofit"])
def test_kinds_diffllama_cannot_hold_are_refused(overrides, message):
    cfg = config(**overrides)
    with raises_one_line(ConversionError, message):
        ours_to_diffllama(ours(cfg).state_dict(), cfg)


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=1), "both must be even"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "RoPE type 'linear'"),
    (dict(head_dim=16), "head_dim=16 with 8 heads"),
    (dict(model_type="llama"), "model_type 'llama', not 'diffllama'"),
], ids=["odd-kv", "gelu", "bias", "scaled-rope", "head-dim", "model-type"])
def test_diffllama_configs_we_cannot_express_are_refused(change, message):
    cfg = config()
    state, hf_config = ours_to_diffllama(ours(cfg).state_dict(), cfg)
    with pytest.raises(ConversionError, match=message):
        diffllama_to_ours(state, hf_config | change)


def test_tensors_of_another_model_are_refused():
    cfg = config()
    state, hf_config = ours_to_diffllama(ours(cfg).state_dict(), cfg)
    with pytest.raises(ConversionError, match="missing model.layers.2.self_attn.q_proj.weight"):
        diffllama_to_ours({k: v for k, v in state.items() if "layers.2.self_attn.q_proj" not in k}, hf_config)
    with pytest.raises(ConversionError, match=r"k_proj.weight has shape \(64, 64\) but .* needs \(32, 64\)"):
        diffllama_to_ours(state, hf_config | dict(num_key_value_heads=4))
