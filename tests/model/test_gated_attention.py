"""`transformer_gated`: the baseline with a head-wise sigmoid gate on the attention output (Gated
Attention, Qiu et al. 2025, position G1), and the presets that hold DIFF at >= 8 heads.

The layer is checked against an explicit float64 computation written here (the heads split by
tests/reference.py, then per-head loops, the causal softmax written out, RoPE from the formula, the
gate applied by hand), with a fresh random gate matrix rather than its init; against known answers
(W_g = 0 halves the baseline's attention output); through gradcheck, every backend, cached decoding
and transformers; and the converters must refuse it rather than drop the gate (one test over it and
`transformer_ssmax`, which no other format holds either).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.func import functional_call

from difftransformer import DiffTransformerLM, KVCache, MultiheadAttention
from difftransformer.convert import ConversionError, convert, ours_to_diffllama, ours_to_llama, ours_to_unilm
from difftransformer.model import ATTENTION_KINDS, build_attention, get_preset
from tests.helpers import BACKENDS, raises_one_line, rel_err, tiny
from tests.hf import loads_both_ways
from tests.reference import project_heads, rope_reference

E, H = 32, 4  # d = 8


def gated_layer(kv: int, dtype=torch.float64, backend="eager", seed=0) -> MultiheadAttention:
    """A gated layer with random weights and a fresh N(0, 1) gate matrix (not the N(0, 0.02) init)."""
    torch.manual_seed(seed)
    layer = MultiheadAttention(E, 0, H, kv, output_gate=True, backend=backend, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (1.0 if p is layer.head_gate.weight else 0.3))
    return layer


def explicit_gated_attention(sd: dict, x: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """float64, by hand: per head, a causal softmax over q·k/sqrt(d), times v, times sigmoid(x·w_h), then o_proj."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    B, T, _ = x.shape
    d = E // num_heads
    q, k, v = project_heads(sd, x, num_heads, num_kv_heads, d)
    pos = list(range(T))
    q, k = rope_reference(q, pos), rope_reference(k, pos)
    o = torch.zeros(B, num_heads, T, d, dtype=torch.float64)
    for b in range(B):
        for h in range(num_heads):
            g = h // (num_heads // num_kv_heads)  # GQA: query head h reads kv head g
            for i in range(T):
                scores = [float(q[b, h, i] @ k[b, g, j]) / math.sqrt(d) for j in range(i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                attn = sum((w / total) * v[b, g, j] for j, w in enumerate(weights))
                gate = 1.0 / (1.0 + math.exp(-float(x[b, i] @ sd["head_gate.weight"][h])))
                o[b, h, i] = gate * attn
    return o.transpose(1, 2).reshape(B, T, E) @ sd["out_proj.weight"].T


# -------------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("kv", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_layer_equals_the_explicit_float64_computation(kv, backend):
    layer = gated_layer(kv, backend=backend)
    x = torch.randn(2, 7, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = explicit_gated_attention(layer.state_dict(), x, H, kv)
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-12)
    assert layer.head_gate.weight.shape == (H, E) and layer.head_gate.bias is None


@pytest.mark.parametrize("kv", [H, 2], ids=["mha", "gqa"])
def test_a_zero_gate_halves_the_baselines_attention_and_a_wide_open_one_is_the_baseline(kv):
    gated = gated_layer(kv)
    plain = MultiheadAttention(E, 0, H, kv, backend="eager", dtype=torch.float64)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("head_gate")})
    x = torch.randn(2, 6, E, dtype=torch.float64)
    with torch.no_grad():
        gated.head_gate.weight.zero_()  # sigmoid(0) = 1/2, and out_proj is linear
        torch.testing.assert_close(gated(x), 0.5 * plain(x), rtol=1e-12, atol=1e-12)
        gated.head_gate.weight.zero_()[:, 0] = 1e3
    x[..., 0] = 1.0  # every gate sigmoid(1000), which is exactly 1 in float64
    torch.testing.assert_close(gated(x), plain(x), rtol=1e-12, atol=1e-12)


def test_gradcheck_through_input_and_gate():
    layer = MultiheadAttention(8, 0, 2, 1, output_gate=True, backend="eager", dtype=torch.float64)
    torch.manual_seed(2)
    params = {k: torch.randn_like(v) * 0.5 for k, v in layer.named_parameters()}
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    w_g = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    w_q = params["q_proj.weight"].requires_grad_()

    def f(x, w_g, w_q):
        return functional_call(layer, {**params, "head_gate.weight": w_g, "q_proj.weight": w_q}, (x,))

    assert torch.autograd.gradcheck(f, (x, w_g, w_q))


def test_every_backend_agrees_with_eager():
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding in one row
    want = gated_layer(2, torch.float32, "eager")
    for backend in BACKENDS:
        got = gated_layer(2, torch.float32, backend)
        assert rel_err(got(x), want(x).detach()) <= 1e-5, backend
        ok = mask[:, :, None]  # rows that see no key are zero by rule; compare the real tokens
        assert rel_err(got(x, attention_mask=mask) * ok, want(x, attention_mask=mask).detach() * ok) <= 1e-5, backend


def test_the_score_hook_and_maps_see_the_ungated_attention():
    gated = gated_layer(2)
    plain = MultiheadAttention(E, 0, H, 2, backend="eager", dtype=torch.float64)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("head_gate")})
    x = torch.randn(1, 5, E, dtype=torch.float64)
    seen = []
    for layer in (gated, plain):
        layer.score_hook = lambda s, vis: seen.append(s.clone())
        _, maps = layer(x, return_attention=True)
        seen.append(maps.diff)
    assert len(seen) == 4
    torch.testing.assert_close(seen[0], seen[2], rtol=0, atol=0)
    torch.testing.assert_close(seen[1], seen[3], rtol=0, atol=0)


# -------------------------------------------------------------------------------- the model


def test_the_kind_builds_the_gated_layer_and_converts_heads_like_the_baseline():
    kind = ATTENTION_KINDS["transformer_gated"]
    assert kind.output_gate and not (kind.differential or kind.head_norm or kind.diff_heads or kind.fused_kernel)
    assert [k for k, v in ATTENTION_KINDS.items() if v.output_gate] == ["transformer_gated"]
    layer = build_attention(tiny("transformer_gated"), depth=1)
    assert type(layer) is MultiheadAttention and layer.head_gate is not None and layer.subln is None
    assert build_attention(tiny("transformer"), depth=1).head_gate is None
    base = tiny("transformer", num_key_value_heads=2)
    gated = base.matched("transformer_gated")
    assert (gated.num_attention_heads, gated.num_key_value_heads, gated.head_dim) == (4, 2, 16)
    assert gated.matched("transformer") == base
    assert gated.matched("diff") == base.matched("diff")


@pytest.mark.parametrize("preset, kv", [("tiny", None), ("tiny", 2), ("cpu-small-h8", None)])
def test_parameter_count_is_the_baselines_plus_hidden_times_heads_per_layer(preset, kv):
    extra = {} if kv is None else dict(num_key_value_heads=kv)
    base = get_preset(preset).config("transformer", **extra)
    gated = get_preset(preset).config("transformer_gated", **extra)
    n_base = DiffTransformerLM(base, device="meta").num_parameters()
    n_gated = DiffTransformerLM(gated, device="meta").num_parameters()
    assert n_gated - n_base == base.num_hidden_layers * base.hidden_size * base.num_attention_heads


def test_init_draws_the_gate_like_every_linear_layer():
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("transformer_gated", num_hidden_layers=4, hidden_size=128))
    w = torch.cat([b.self_attn.head_gate.weight.flatten() for b in model.layers])
    assert abs(w.std().item() - model.config.initializer_range) < 0.002 and abs(w.mean().item()) < 0.002


def test_cached_decoding_equals_the_full_forward_and_greedy_generate_matches():
    torch.manual_seed(4)
    model = DiffTransformerLM(tiny("transformer_gated", num_key_value_heads=2, initializer_range=0.1)).eval()
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.head_gate.weight.normal_(0, 1.0)  # gates far from 1/2
    prompt = torch.randint(0, 512, (2, 5))
    with_cache = model.generate(prompt, 12, temperature=0.0, use_cache=True)
    without = model.generate(prompt, 12, temperature=0.0, use_cache=False)
    assert torch.equal(with_cache, without)
    full = model(with_cache).logits
    cache = KVCache()
    steps = [model(with_cache[:, :5], kv_cache=cache).logits]
    steps += [model(with_cache[:, t:t + 1], kv_cache=cache).logits for t in range(5, with_cache.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------- converters and transformers


@pytest.mark.parametrize("to", [ours_to_llama, ours_to_diffllama, ours_to_unilm], ids=["llama", "diffllama", "unilm"])
@pytest.mark.parametrize("kind, own", [("transformer_gated", "head_gate.weight"), ("transformer_ssmax", "ssmax_scale")],
                         ids=["gated", "ssmax"])
def test_converters_refuse_the_kinds_only_our_format_holds(kind, own, to):
    """A gated layer's gate matrix and an SSMax layer's s have no place in another format: each converter
    refuses the kind by name in one line, called directly or through `convert`; our format keeps and needs them."""
    cfg = tiny(kind, vocab_size=64, hidden_size=32, num_hidden_layers=1)
    state = DiffTransformerLM(cfg).state_dict()
    with raises_one_line(ConversionError, f"'{kind}'"):
        to(state, cfg)
    with pytest.raises(ConversionError, match=f"'{kind}'"):
        convert(state, cfg.to_dict(), "ours", to.__name__.removeprefix("ours_to_"))
    kept, again = convert(state, cfg.to_dict(), "ours", "ours")  # ours holds it, that tensor included
    assert again == cfg and any(k.endswith(own) for k in kept)
    with pytest.raises(ConversionError, match=f"missing layers.0.self_attn.{own}"):
        convert({k: v for k, v in state.items() if not k.endswith(own)}, cfg.to_dict(), "ours", "ours")


def test_the_transformers_wrapper_saves_loads_and_generates_it(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(5)
    cfg = dataclasses.replace(tiny("transformer_gated", num_key_value_heads=2), initializer_range=0.1)
    lm = DiffTransformerLM(cfg).eval()
    ids = torch.randint(0, 512, (1, 6))
    _, again = loads_both_ways(lm, tmp_path, ids)
    with torch.no_grad():
        assert torch.equal(again.generate(ids, max_new_tokens=5, do_sample=False),
                           lm.generate(ids, 5, temperature=0.0))


# -------------------------------------------------------------------------------- presets with >= 8 DIFF heads


@pytest.mark.parametrize("name", ["cpu-small-h8", "cpu-medium-h8"])
def test_h8_presets_hold_diff_at_8_heads_matched_to_twice_the_baseline_heads(name):
    preset = get_preset(name)
    assert preset.description
    diff, base = preset.config("diff"), preset.config("transformer")
    assert diff.num_attention_heads >= 8 and diff.head_dim >= 16
    assert base.num_attention_heads == 2 * diff.num_attention_heads and base.head_dim == diff.head_dim
    assert (base.hidden_size, base.num_hidden_layers, base.intermediate_size) == \
           (diff.hidden_size, diff.num_hidden_layers, diff.intermediate_size)
    assert diff.matched("transformer") == base and base.matched("diff") == diff
    n_diff = DiffTransformerLM(diff, device="meta").num_parameters()
    n_base = DiffTransformerLM(base, device="meta").num_parameters()
    assert n_diff - n_base == 6 * diff.head_dim * diff.num_hidden_layers
    assert preset.config("transformer_gated").num_attention_heads == base.num_attention_heads
