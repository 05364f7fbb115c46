"""`transformer_ssmax`: the baseline with scalable softmax (SSMax, Nakanishi 2025), logits times s_h log n.

The layer is checked against the independent float64 reference (tests/reference.py: `ssmax_reference`
counts each query's visible keys itself and writes the logits out), forward and every gradient, on
every backend it claims (eager, sdpa, cpp); against a known answer (s log n = 1 is ordinary
attention); and through key padding, cached decoding, generation, saving, configs and converters.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from difftransformer import DiffTransformerLM, KVCache, MultiheadAttention
from difftransformer.model import ATTENTION_KINDS, DiffTransformerConfig, build_attention, get_preset
from tests.helpers import BACKENDS, check_forward_and_grads, padding_mask, rel_err, tiny
from tests.reference import ssmax_layer_reference, ssmax_reference

E = 64


def ssmax_layer(H: int, kv: int, backend: str = "eager", dtype=torch.float32, seed: int = 0) -> MultiheadAttention:
    """An SSMax layer whose heads have different s, far from their init (0.2 .. 0.9)."""
    torch.manual_seed(seed)
    layer = MultiheadAttention(E, 0, H, kv, scalable_softmax=True, backend=backend, max_seq_len=64, dtype=dtype)
    with torch.no_grad():
        layer.ssmax_scale.copy_(torch.linspace(0.2, 0.9, H))
    return layer


def plain_twin(layer: MultiheadAttention) -> MultiheadAttention:
    """The ordinary layer with `layer`'s projections."""
    plain = MultiheadAttention(E, 0, layer.num_heads, layer.num_kv_heads, backend=layer.backend,
                               dtype=layer.q_proj.weight.dtype)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "ssmax_scale"})
    return plain


# -------------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,kv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_layer_matches_reference_forward_and_grads(backend, H, kv, padded):
    layer = ssmax_layer(H, kv, backend, seed=H * 7 + kv)
    x = torch.randn(2, 23, E, requires_grad=True)
    mask = padding_mask(2, 23, seed=kv) if padded else None
    y = layer(x, attention_mask=mask)
    sd = {k: v.detach().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    xr = x.detach().double().requires_grad_(True)
    ref = ssmax_layer_reference(sd, xr, num_heads=H, num_kv_heads=kv, key_padding_mask=mask)
    params = dict(layer.named_parameters())
    assert set(params) == set(sd) and params["ssmax_scale"].shape == (H,)
    check_forward_and_grads(y, ref, [x, *(params[n] for n in sd)], [xr, *sd.values()], names=["x", *sd])


def test_maps_and_the_score_hook_see_the_scaled_logits():
    layer = ssmax_layer(4, 2, dtype=torch.float64)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    seen = []
    layer.score_hook = lambda scores, visible: seen.append(scores[:, :, 0])
    _, maps = layer(x, return_attention=True)
    q, k, v = layer._project(x, None, None, 4, 2, 16, 16)  # after RoPE, before the SSMax factor
    want_maps = ssmax_reference(q, k, v, layer.ssmax_scale.detach(), return_maps=True)[1]
    torch.testing.assert_close(maps.diff, want_maps, rtol=1e-12, atol=1e-14)
    n = torch.arange(1, 10, dtype=torch.float64)
    logits = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0  # d = 16
    factor = layer.ssmax_scale.detach()[:, None, None] * n.log()[:, None]
    visible = torch.ones(9, 9).tril().bool()
    torch.testing.assert_close(seen[0][..., visible], (logits * factor)[..., visible], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
def test_equals_ordinary_attention_where_s_log_n_is_one(kv):
    """Query t attends n = t + 1 keys: with every s_h = 1 / log(t + 1) its output is the baseline's."""
    layer = ssmax_layer(4, kv, dtype=torch.float64)
    plain = plain_twin(layer)
    x = torch.randn(2, 12, E, dtype=torch.float64)
    want = plain(x)
    with torch.no_grad():
        assert not torch.allclose(layer(x)[:, 5], want[:, 5])  # at init-free s it differs
        torch.testing.assert_close(layer(x)[:, 0], want[:, 0], rtol=1e-12, atol=1e-13)  # one key: any s
        for t in range(1, 12):
            layer.ssmax_scale.fill_(1.0 / math.log(t + 1))
            torch.testing.assert_close(layer(x)[:, t], want[:, t], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decoding_step_with_s_log_n_one_is_the_baselines_on_every_backend(backend):
    """With a KV cache the cached keys count: S keys in all, s = 1 / log S gives the baseline's last step."""
    layer = ssmax_layer(4, 2, backend)
    plain = plain_twin(layer)
    x = torch.randn(2, 15, E)
    with torch.no_grad():
        layer.ssmax_scale.fill_(1.0 / math.log(15))
        cache = KVCache()
        layer(x[:, :14], kv_cache=cache)
        step = layer(x[:, 14:], kv_cache=cache)
        assert rel_err(step, plain(x)[:, 14:]) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padding_counts_only_the_visible_keys(backend):
    """A left-padded row with shifted positions gives the row's own outputs: n counts real keys only."""
    layer = ssmax_layer(4, 2, backend, seed=1)
    x = torch.randn(1, 12, E)
    pad = 5
    xp = torch.cat([torch.randn(1, pad, E) * 3, x], dim=1)
    mask = torch.arange(12 + pad)[None] >= pad
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = layer(xp, attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(out[:, pad:], layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_with_padding_equals_the_full_forward(backend):
    layer = ssmax_layer(4, 1, backend, seed=2)
    x = torch.randn(2, 13, E)
    mask = padding_mask(2, 13, seed=3)
    with torch.no_grad():
        full = layer(x, attention_mask=mask)
        cache = KVCache()
        steps = [layer(x[:, :6], attention_mask=mask[:, :6], kv_cache=cache)]
        steps += [layer(x[:, t:t + 1], attention_mask=mask[:, :t + 1], kv_cache=cache) for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


def test_scale_is_fp32_in_a_half_precision_layer_and_init_is_one_over_log_length():
    layer = MultiheadAttention(E, 0, 4, scalable_softmax=True, ssmax_init_length=64, dtype=torch.bfloat16)
    assert layer.ssmax_scale.dtype == torch.float32
    torch.testing.assert_close(layer.ssmax_scale, torch.full((4,), 1 / math.log(64)))
    assert MultiheadAttention(E, 0, 4, scalable_softmax=True, max_seq_len=300).ssmax_scale[0].item() == \
        pytest.approx(1 / math.log(300))
    assert MultiheadAttention(E, 0, 4).ssmax_scale is None
    with pytest.raises(ValueError, match="must be an integer >= 2; got None"):
        MultiheadAttention(E, 0, 4, scalable_softmax=True)
    with pytest.raises(ValueError, match="must be an integer >= 2; got 1"):
        MultiheadAttention(E, 0, 4, scalable_softmax=True, ssmax_init_length=1)


def test_bf16_under_autocast_is_close_to_fp32():
    layer = ssmax_layer(4, 2, "sdpa")
    x = torch.randn(2, 20, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and rel_err(y, layer(x)) < 3e-2


# -------------------------------------------------------------------------------- the kind and the model


def test_the_kind_builds_the_ssmax_layer_and_converts_heads_like_the_baseline():
    kind = ATTENTION_KINDS["transformer_ssmax"]
    assert kind.scalable_softmax and not (kind.differential or kind.head_norm or kind.diff_heads or kind.output_gate)
    assert [k for k, v in ATTENTION_KINDS.items() if v.scalable_softmax] == ["transformer_ssmax"]
    layer = build_attention(tiny("transformer_ssmax"), depth=1)
    assert type(layer) is MultiheadAttention and layer.ssmax_scale is not None and layer.head_gate is None
    assert build_attention(tiny("transformer"), depth=1).ssmax_scale is None
    base = tiny("transformer", num_key_value_heads=2)
    ssmax = base.matched("transformer_ssmax")
    assert (ssmax.num_attention_heads, ssmax.num_key_value_heads, ssmax.head_dim) == (4, 2, 16)
    assert ssmax.matched("transformer") == base and ssmax.matched("diff") == base.matched("diff")


@pytest.mark.parametrize("preset, kv", [("tiny", None), ("tiny", 2), ("cpu-small-h8", None)])
def test_parameter_count_is_the_baselines_plus_heads_per_layer(preset, kv):
    extra = {} if kv is None else dict(num_key_value_heads=kv)
    base = get_preset(preset).config("transformer", **extra)
    ssmax = get_preset(preset).config("transformer_ssmax", **extra)
    n_base = DiffTransformerLM(base, device="meta").num_parameters()
    n_ssmax = DiffTransformerLM(ssmax, device="meta").num_parameters()
    assert n_ssmax - n_base == base.num_hidden_layers * base.num_attention_heads


def test_init_length_is_the_kinds_own_config_field():
    cfg = get_preset("tiny").config("transformer_ssmax", ssmax_init_length=64)
    assert cfg.ssmax_init_length == 64
    model = DiffTransformerLM(cfg)
    for block in model.layers:
        torch.testing.assert_close(block.self_attn.ssmax_scale, torch.full((4,), 1 / math.log(64)))
    with torch.no_grad():
        model.layers[0].self_attn.ssmax_scale.fill_(3.0)
    model.reset_parameters()
    assert model.layers[0].self_attn.ssmax_scale[0].item() == pytest.approx(1 / math.log(64))
    default = DiffTransformerLM(tiny("transformer_ssmax")).layers[1].self_attn.ssmax_scale
    torch.testing.assert_close(default, torch.full((4,), 1 / math.log(256)))  # max_position_embeddings
    assert cfg.matched("transformer").ssmax_init_length is None
    assert cfg.matched("transformer_ssmax") == cfg
    with pytest.raises(ValueError, match="ssmax_init_length \\(64\\) applies to attention='transformer_ssmax' only"):
        tiny("transformer", ssmax_init_length=64)
    with pytest.raises(ValueError, match="ssmax_init_length must be an integer >= 2"):
        tiny("transformer_ssmax", ssmax_init_length=1)
    assert DiffTransformerConfig.from_dict(cfg.to_dict()) == cfg


def _trained_like(model: DiffTransformerLM) -> DiffTransformerLM:
    """s far from its init, different per head and layer."""
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            block.self_attn.ssmax_scale.copy_(torch.linspace(0.1, 1.2, block.self_attn.num_heads) + 0.1 * i)
    return model


def test_cached_decoding_equals_the_full_forward_and_greedy_generate_matches():
    torch.manual_seed(4)
    model = _trained_like(DiffTransformerLM(tiny("transformer_ssmax", num_key_value_heads=2,
                                                 initializer_range=0.1)).eval())
    prompt = torch.randint(0, 512, (2, 5))
    with_cache = model.generate(prompt, 12, temperature=0.0, use_cache=True)
    without = model.generate(prompt, 12, temperature=0.0, use_cache=False)
    assert torch.equal(with_cache, without)
    full = model(with_cache).logits
    cache = KVCache()
    steps = [model(with_cache[:, :5], kv_cache=cache).logits]
    steps += [model(with_cache[:, t:t + 1], kv_cache=cache).logits for t in range(5, with_cache.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(5)
    model = _trained_like(DiffTransformerLM(tiny("transformer_ssmax", ssmax_init_length=32)).eval())
    model.save_pretrained(tmp_path)
    loaded = DiffTransformerLM.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    ids = torch.randint(0, 512, (1, 10))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(loaded.layers[1].self_attn.ssmax_scale, model.layers[1].self_attn.ssmax_scale)


# -------------------------------------------------------------------------------- converters and transformers


# The converters' refusal of this kind: tests/model/test_gated_attention.py::
# test_converters_refuse_the_kinds_only_our_format_holds[ssmax-*], beside the gated kind's.


def test_the_transformers_wrapper_saves_loads_and_generates_it(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from difftransformer.hf import DiffTransformerForCausalLM

    torch.manual_seed(5)
    cfg = dataclasses.replace(tiny("transformer_ssmax", num_key_value_heads=2), initializer_range=0.1)
    lm = _trained_like(DiffTransformerLM(cfg)).eval()
    lm.save_pretrained(tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", use_safetensors=True).eval()
    assert type(hf) is DiffTransformerForCausalLM
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        want = lm(ids).logits
        assert torch.equal(hf(ids).logits, want)
        assert torch.equal(hf.generate(ids, max_new_tokens=5, do_sample=False), lm.generate(ids, 5, temperature=0.0))
