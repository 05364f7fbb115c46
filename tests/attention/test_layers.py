"""The attention layers (DIFF V1, the baseline, DIFF V2) against the float64 reference, as modules."""

import math

import pytest
import torch

from difftransformer import (
    KVCache,
    MultiheadAttention,
    MultiheadDiffAttention,
    MultiheadDiffAttentionV2,
    lambda_init_fn,
)
from tests.helpers import BACKENDS, TRITON_DEVICE, check_forward_and_grads, padding_mask, rel_err, triton_runs_here
from tests.reference import (
    diff_layer_reference,
    lambda_init_reference,
    mha_layer_reference,
    mha_reference,
    rope_reference,
    ssmax_layer_reference,
    v2_layer_reference,
)

# ---------------------------------------------------------------- lambda


def test_lambda_init_schedule():
    assert lambda_init_fn(0) == pytest.approx(0.2)
    for depth in range(40):
        assert lambda_init_fn(depth) == pytest.approx(lambda_init_reference(depth))
    assert lambda_init_fn(39) == pytest.approx(0.8, abs=1e-5)


def test_lambda_reparameterisation_is_fp32_and_shared():
    layer = MultiheadDiffAttention(64, 5, 4).to(torch.bfloat16)
    assert layer.lambda_q1.dtype == torch.bfloat16  # .to() casts, but lambda is still computed in fp32
    lam = layer.lambda_full()
    assert lam.dtype == torch.float32 and lam.dim() == 0
    f = lambda a, b: torch.exp((a.float() * b.float()).sum())  # noqa: E731
    want = f(layer.lambda_q1, layer.lambda_k1) - f(layer.lambda_q2, layer.lambda_k2) + lambda_init_fn(5)
    assert lam.item() == pytest.approx(want.item(), rel=1e-6)


# ---------------------------------------------------------------- the V1 layer


def test_state_dict_matches_reference_names_and_shapes():
    E, h, h_kv = 128, 4, 2
    d = E // h // 2
    sd = MultiheadDiffAttention(E, 0, h, h_kv).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "q_proj.weight": (E, E), "k_proj.weight": (E // 2, E), "v_proj.weight": (E // 2, E),
        "out_proj.weight": (E, E), "lambda_q1": (d,), "lambda_k1": (d,), "lambda_q2": (d,), "lambda_k2": (d,),
        "subln.weight": (2 * d,),
    }
    assert sd["lambda_q1"].dtype == torch.float32
    assert 0.05 < torch.cat([sd[f"lambda_{n}"] for n in ("q1", "k1", "q2", "k2")]).std() < 0.2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E,h,h_kv", [(64, 4, 4), (64, 4, 2), (128, 4, 1)])
@pytest.mark.parametrize("depth", [0, 7])
def test_layer_matches_reference_forward_and_grads(backend, E, h, h_kv, depth):
    torch.manual_seed(depth * 31 + h_kv)
    layer = MultiheadDiffAttention(E, depth, h, h_kv, backend=backend, rope_theta=10000.0)
    with torch.no_grad():  # make lambda far from lambda_init and the norm weight non-trivial
        layer.lambda_q1.mul_(5.0)
        layer.subln.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 23, E, requires_grad=True)
    mask = padding_mask(2, 23, depth)
    y = layer(x, attention_mask=mask)
    sd = {k: v.detach().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    xr = x.detach().double().requires_grad_(True)
    ref = diff_layer_reference(sd, xr, depth=depth, num_heads=h, num_kv_heads=h_kv, key_padding_mask=mask)
    params = dict(layer.named_parameters())
    check_forward_and_grads(y, ref, [x, *(params[n] for n in sd)], [xr, *sd.values()], names=["x", *sd])


def test_layer_constant_lambda_init_and_no_headnorm():
    layer = MultiheadDiffAttention(64, 3, 2, lambda_init=0.5, head_norm=False, backend="sdpa")
    assert layer.subln is None and layer.lambda_init == 0.5
    x = torch.randn(1, 9, 64)
    ref = diff_layer_reference(layer.state_dict(), x, depth=3, num_heads=2, num_kv_heads=2, lambda_init=0.5,
                               head_norm=False)
    assert rel_err(layer(x), ref) <= 1e-5


@pytest.mark.parametrize("cls", [MultiheadDiffAttention, MultiheadAttention, MultiheadDiffAttentionV2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_future_tokens_never_change_past_outputs(cls, backend):
    torch.manual_seed(0)
    layer = cls(64, 1, 4, 2, backend=backend)
    x = torch.randn(2, 30, 64)
    x2 = x.clone()
    x2[:, 17:] = torch.randn(2, 13, 64) * 10
    torch.testing.assert_close(layer(x)[:, :17], layer(x2)[:, :17], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [MultiheadDiffAttention, MultiheadAttention, MultiheadDiffAttentionV2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padding_equals_unpadded(cls, backend):
    """A left-padded row with shifted positions gives the same outputs as the row alone."""
    torch.manual_seed(1)
    layer = cls(64, 2, 4, 2, backend=backend)
    x = torch.randn(1, 12, 64)
    pad = 5
    xp = torch.cat([torch.randn(1, pad, 64) * 3, x], dim=1)
    mask = torch.arange(12 + pad)[None] >= pad
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = layer(xp, attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(out[:, pad:], layer(x), rtol=1e-5, atol=1e-6)


def test_layer_parameter_count_is_baseline_plus_6d():
    for E, h, h_kv in [(64, 2, 2), (256, 4, 2), (1536, 8, 4), (2048, 8, 8)]:
        d = E // h // 2
        diff = sum(p.numel() for p in MultiheadDiffAttention(E, 0, h, h_kv, device="meta").parameters())
        base = sum(p.numel() for p in MultiheadAttention(E, 0, 2 * h, 2 * h_kv, device="meta").parameters())
        assert diff == base + 6 * d


def test_baseline_layer_matches_reference():
    torch.manual_seed(3)
    layer = MultiheadAttention(64, 0, 4, 2, backend="sdpa")
    x = torch.randn(2, 15, 64)
    sd = {k: v.double() for k, v in layer.state_dict().items()}
    q = (x.double() @ sd["q_proj.weight"].T).view(2, 15, 4, 16).transpose(1, 2)
    k = (x.double() @ sd["k_proj.weight"].T).view(2, 15, 2, 16).transpose(1, 2)
    v = (x.double() @ sd["v_proj.weight"].T).view(2, 15, 2, 16).transpose(1, 2)
    pos = list(range(15))
    o = mha_reference(rope_reference(q, pos), rope_reference(k, pos), v)
    ref = o.transpose(1, 2).reshape(2, 15, 64) @ sd["out_proj.weight"].T
    assert rel_err(layer(x), ref) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (4, 1)])
def test_v2_layer_matches_reference(backend, H, H_kv):
    torch.manual_seed(H_kv)
    E, d, T = 64, 16, 19
    layer = MultiheadDiffAttentionV2(E, 0, H, H_kv, backend=backend)
    assert layer.q_proj.weight.shape == (2 * H * d, E) and layer.o_proj.weight.shape == (E, H * d)
    x = torch.randn(2, T, E)
    sd = {k: v.double() for k, v in layer.state_dict().items()}
    xd = x.double()
    q = (xd @ sd["q_proj.weight"].T).view(2, T, 2 * H, d).transpose(1, 2)
    k = (xd @ sd["k_proj.weight"].T).view(2, T, H_kv, d).transpose(1, 2)
    v = (xd @ sd["v_proj.weight"].T).view(2, T, H_kv, d).transpose(1, 2)
    pos = list(range(T))
    q, k = rope_reference(q, pos), rope_reference(k, pos)
    group = 2 * H // H_kv
    assert layer.n_rep == group  # the query heads per kv head of its one attention call
    outs = []
    for i in range(H):  # pair (2i, 2i+1) must read the same kv head
        assert (2 * i) // group == (2 * i + 1) // group
        a = mha_reference(q[:, 2 * i: 2 * i + 1], k[:, (2 * i) // group][:, None], v[:, (2 * i) // group][:, None])
        b = mha_reference(q[:, 2 * i + 1: 2 * i + 2], k[:, (2 * i) // group][:, None], v[:, (2 * i) // group][:, None])
        lam = torch.sigmoid(xd @ sd["lambda_proj.weight"][i])[:, None, :, None]
        outs.append(a - lam * b)
    o = torch.cat(outs, dim=1).transpose(1, 2).reshape(2, T, H * d)
    assert rel_err(layer(x), o @ sd["o_proj.weight"].T) <= 1e-5


def test_bad_layer_configuration_errors():
    with pytest.raises(ValueError, match="divisible by 2 \\* num_heads"):
        MultiheadDiffAttention(60, 0, 8)
    with pytest.raises(ValueError, match="must be divisible by num_kv_heads"):
        MultiheadDiffAttention(64, 0, 4, 3)
    with pytest.raises(ValueError, match="0-based layer index"):
        MultiheadDiffAttention(64, -1, 4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        MultiheadDiffAttention(64, 0, 4, backend="cuda-magic")


def test_bad_layer_input_errors():
    layer = MultiheadDiffAttention(64, 0, 4, max_seq_len=16)
    with pytest.raises(ValueError, match=r"expects input of shape \(batch, seq_len, 64\)"):
        layer(torch.randn(10, 64))
    with pytest.raises(ValueError, match=r"expects input of shape"):
        layer(torch.randn(1, 10, 32))
    with pytest.raises(TypeError, match="floating-point input"):
        layer(torch.ones(1, 3, 64, dtype=torch.long))
    with pytest.raises(TypeError, match="does not match the layer's parameters"):
        layer(torch.randn(1, 3, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="exceeds max_seq_len 16"):
        layer(torch.randn(1, 17, 64))


def test_bf16_layer_under_autocast_is_close_to_fp32():
    torch.manual_seed(0)
    layer = MultiheadDiffAttention(64, 1, 2, backend="sdpa")
    x = torch.randn(2, 32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, layer(x)) < 3e-2
    assert math.isfinite(y.float().sum().item())


# ---------------------------------------------------------------- the fused kernel as a layer backend


@pytest.mark.skipif(not triton_runs_here(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("deterministic", [True, False])
def test_layer_triton_backend_matches_reference(deterministic):
    torch.manual_seed(9)
    layer = MultiheadDiffAttention(64, 2, 2, 1, backend="triton", deterministic=deterministic, device=TRITON_DEVICE)
    x = torch.randn(1, 19, 64, device=TRITON_DEVICE, requires_grad=True)
    y = layer(x)
    sd = {k: v.detach().cpu().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    xr = x.detach().cpu().double().requires_grad_(True)
    ref = diff_layer_reference(sd, xr, depth=2, num_heads=2, num_kv_heads=1)
    assert rel_err(y.cpu(), ref) <= 1e-5
    y.sum().backward()
    ref.sum().backward()
    assert rel_err(x.grad.cpu(), xr.grad) <= 1e-5
    assert rel_err(layer.lambda_q1.grad.cpu(), sd["lambda_q1"].grad) <= 1e-5
    with pytest.raises(ValueError, match="not key padding"):
        layer(x, attention_mask=torch.ones(1, 19, dtype=torch.bool, device=TRITON_DEVICE))


@pytest.mark.skipif(not triton_runs_here(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("deterministic", [True, False])
def test_model_config_chooses_the_triton_backward(monkeypatch, deterministic):
    """config.attn_deterministic reaches the fused kernel of every DIFF layer, in the forward that
    records the backward to run."""
    from difftransformer.kernels import diff_flash
    from difftransformer.model import DiffTransformerLM, get_preset

    calls = []
    real = diff_flash.diff_flash_attention

    def recording(*args, **kwargs):
        calls.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(diff_flash, "diff_flash_attention", recording)
    cfg = get_preset("tiny").config("diff", attn_backend="triton", attn_deterministic=deterministic,
                                    num_hidden_layers=2)
    model = DiffTransformerLM(cfg).to(TRITON_DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), device=TRITON_DEVICE)
    model(ids, ids).loss.backward()
    assert calls == [deterministic] * 2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_cache_is_written_in_place_and_grows_by_doubling():
    from difftransformer import KVCache

    cache = KVCache(chunk=4)
    k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 16)
    ks, vs = cache.update(0, k, v)
    assert torch.equal(ks, k) and torch.equal(vs, v) and len(cache) == 5
    buffer = cache._buffers[0][0]
    assert buffer.shape[2] == 8  # 5 rounded up to the chunk
    for step in range(3):  # 6, 7, 8: written into the same buffer
        k1, v1 = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 16)
        ks, vs = cache.update(0, k1, v1)
        assert cache._buffers[0][0].data_ptr() == buffer.data_ptr() and torch.equal(ks[:, :, -1:], k1)
    ks, vs = cache.update(0, torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 16))  # 9 > 8: doubled, kept
    assert cache._buffers[0][0].shape[2] == 16 and torch.equal(ks[:, :, :5], k) and cache.length(0) == 9
    assert torch.equal(vs[:, :, :5], v)  # the values are kept too
    assert KVCache(capacity=40).update(1, k, v)[0].shape[2] == 5
    with pytest.raises(ValueError, match="capacity must be a positive"):
        KVCache(capacity=0)


def test_a_cache_used_with_gradients_concatenates():
    from difftransformer import KVCache

    cache = KVCache()
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    ks, _ = cache.update(0, k, k.detach())
    ks2, _ = cache.update(0, k * 2, k.detach())
    ks2.sum().backward()
    assert torch.allclose(k.grad, torch.full_like(k, 3.0))


# ---------------------------------------------------------------- no position encoding (NoPE)


def _nope_layer(which: str, backend: str):
    """A layer of each kind's class with position_encoding='none', parameters off their init."""
    E = 64
    if which == "diff":
        layer = MultiheadDiffAttention(E, 3, 2, 1, backend=backend, position_encoding="none")
    elif which == "v2":
        layer = MultiheadDiffAttentionV2(E, 0, 4, 2, backend=backend, position_encoding="none")
    else:
        layer = MultiheadAttention(E, 0, 4, 2, backend=backend, position_encoding="none", max_seq_len=64,
                                   head_norm=which == "headnorm", scalable_softmax=which == "ssmax")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if not name.endswith("proj.weight"):
                p.add_(torch.rand_like(p) * 0.5)  # λ vectors, norm weights, SSMax's s
    return layer


def _nope_reference(which: str, layer, sd: dict, x: torch.Tensor):
    if which == "diff":
        return diff_layer_reference(sd, x, depth=3, num_heads=2, num_kv_heads=1, rope=False)
    if which == "v2":
        return v2_layer_reference(sd, x, num_heads=4, num_kv_heads=2, rope=False)
    if which == "ssmax":
        return ssmax_layer_reference(sd, x, num_heads=4, num_kv_heads=2, rope=False)
    return mha_layer_reference(sd, x, num_heads=4, num_kv_heads=2, head_norm=which == "headnorm", rope=False)


NOPE_LAYERS = ["diff", "v2", "transformer", "headnorm", "ssmax"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", NOPE_LAYERS)
def test_nope_layers_match_the_reference_without_rotation(which, backend):
    torch.manual_seed(11)
    layer = _nope_layer(which, backend)
    assert layer.rotary is None
    x = torch.randn(2, 17, 64, requires_grad=True)
    y = layer(x)
    sd = {k: v.detach().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    xr = x.detach().double().requires_grad_(True)
    ref = _nope_reference(which, layer, sd, xr)
    params = dict(layer.named_parameters())
    check_forward_and_grads(y, ref, [x, *(params[n] for n in sd)], [xr, *sd.values()], names=["x", *sd])


@pytest.mark.parametrize("which", NOPE_LAYERS)
def test_nope_q_and_k_are_the_projections(which):
    layer = _nope_layer(which, "eager")
    x = torch.randn(2, 7, 64)
    heads = {"diff": (4, 2, 16, 32), "v2": (8, 2, 16, 16)}.get(which, (4, 2, 16, 16))
    q, k, v = layer._project(x, torch.arange(40, 47), None, *heads)
    assert torch.equal(q, layer.q_proj(x).view(2, 7, heads[0], heads[2]).transpose(1, 2))
    assert torch.equal(k, layer.k_proj(x).view(2, 7, heads[1], heads[2]).transpose(1, 2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", NOPE_LAYERS)
def test_nope_outputs_do_not_depend_on_positions(which, backend):
    """Decoding after a gap (cached keys at 0..5, new queries at 30 + t) changes nothing without RoPE, and
    changes the outputs with it (so the test can fail)."""
    torch.manual_seed(12)
    layer = _nope_layer(which, backend)
    x = torch.randn(2, 11, 64)

    def with_a_gap():
        cache = KVCache()
        out = [layer(x[:, :6], position_ids=torch.arange(6), kv_cache=cache)]
        out += [layer(x[:, t:t + 1], position_ids=torch.tensor([30 + t]), kv_cache=cache) for t in range(6, 11)]
        return torch.cat(out, dim=1)

    with torch.no_grad():
        torch.testing.assert_close(with_a_gap(), layer(x), rtol=1e-5, atol=1e-6)
        layer._make_rotary(16, 10000.0, "rope")
        assert rel_err(with_a_gap()[:, 6:], layer(x)[:, 6:]) > 1e-3


def test_position_encoding_must_be_rope_or_none():
    with pytest.raises(ValueError, match="position_encoding must be 'rope' .* or 'none' .*, got 'alibi'"):
        MultiheadAttention(64, 0, 4, position_encoding="alibi")
    assert MultiheadDiffAttention(64, 0, 2).rotary is not None
    assert "position_encoding=none" in repr(MultiheadDiffAttention(64, 0, 2, position_encoding="none"))
