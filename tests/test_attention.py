"""Differential attention and its layers against the independent float64 reference (tests/reference.py)."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from difftransformer import (
    MultiheadAttention,
    MultiheadDiffAttention,
    MultiheadDiffAttentionV2,
    RotaryEmbedding,
    differential_attention,
    lambda_init_fn,
)
from conftest import CPP_KERNEL_DISABLED
from difftransformer.attention import multihead_attention
from reference import (
    diff_attention_reference,
    diff_layer_reference,
    lambda_init_reference,
    mha_reference,
    rope_reference,
)

BACKENDS = ["eager", "sdpa"] + ([] if CPP_KERNEL_DISABLED else ["cpp"])


def rel_err(a, b):
    """||a - b|| / ||b||, with ||b|| floored at an RMS of 0.1 (inputs are O(1)) so exact zeros (e.g. the q gradient
    when a query sees one key) are compared absolutely instead of dividing rounding noise by 0."""
    a, b = a.double(), b.double()
    floor = 0.1 * b.numel() ** 0.5
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def check_forward_and_grads(out, ref, inputs, ref_inputs, names="qkv"):
    """out vs its float64 reference, then the gradients of one random projection of both, for each
    input; returns that projection (dO), which the caller may need for further checks."""
    assert rel_err(out, ref) <= 1e-5
    grad_out = torch.randn_like(ref)
    (out * grad_out.float()).sum().backward()
    (ref * grad_out).sum().backward()
    for name, got, want in zip(names, inputs, ref_inputs):
        assert rel_err(got.grad, want.grad) <= 1e-5, name
    return grad_out


def lambda_grad_error(got, want, grad_out, q, k, v, **mask_kwargs):
    """|d lam - reference| over sum |dO * A2 V|: d lam = -sum(dO * A2 V) is a sum of B*h*T*2d terms
    that can cancel to near zero, so float32 rounding is judged against the terms' magnitudes."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    a2v = diff_attention_reference(q, k, v, 0.0, **mask_kwargs) - diff_attention_reference(q, k, v, 1.0, **mask_kwargs)
    return abs(got.item() - want.item()) / (grad_out.double().abs() * a2v.abs()).sum().clamp_min(1e-12).item()


def random_inputs(B, h, h_kv, T, S, d, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 2 * h, T, d, generator=g).to(dtype)
    k = torch.randn(B, 2 * h_kv, S, d, generator=g).to(dtype)
    v = torch.randn(B, h_kv, S, 2 * d, generator=g).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def padding_mask(B, S, seed=0):
    """Random left padding (at least one real key per row)."""
    g = torch.Generator().manual_seed(seed)
    n_pad = torch.randint(0, max(S - 1, 1), (B,), generator=g)
    return torch.arange(S)[None, :] >= n_pad[:, None]


# ---------------------------------------------------------------- the reference itself
def test_reference_with_zero_lambda_is_ordinary_attention():
    """Sanity-check the independent reference against PyTorch's float64 SDPA."""
    q, k, v = random_inputs(2, 3, 3, 9, 9, 8, dtype=torch.float64)
    out = diff_attention_reference(q, k, v, 0.0)
    expected = F.scaled_dot_product_attention(q[:, 0::2], k[:, 0::2], v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- functional backends
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_rep", [1, 2, 4])
@pytest.mark.parametrize("T,S,causal", [(1, 1, True), (13, 13, True), (37, 37, False), (5, 29, True),
                                        (1, 23, True), (150, 150, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_forward_and_gradients_match_reference(backend, n_rep, T, S, causal, padded):
    B, h_kv, d = 2, 2 // min(n_rep, 2), 8
    h = h_kv * n_rep
    seed = hash((backend, n_rep, T, S, causal, padded)) % 10_000
    q, k, v = random_inputs(B, h, h_kv, T, S, d, seed=seed, grad=True)
    lam = torch.tensor(0.37, requires_grad=True)
    mask = padding_mask(B, S, seed) if padded else None
    out = differential_attention(q, k, v, lam, causal=causal, key_padding_mask=mask, backend=backend)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v, lam)]
    ref = diff_attention_reference(*ref_in, causal=causal, key_padding_mask=mask)
    assert out.shape == (B, h, T, 2 * d) and out.dtype == torch.float32
    grad_out = check_forward_and_grads(out, ref, (q, k, v), ref_in[:3])
    assert lambda_grad_error(lam.grad, ref_in[3].grad, grad_out, q, k, v, causal=causal,
                             key_padding_mask=mask) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_padded_gqa_sequence_matches_reference(backend):
    """A few hundred tokens: T=300 queries over S=300 keys, GQA n_rep 2, left padding, fwd + grads."""
    q, k, v = random_inputs(1, 2, 1, 300, 300, 8, seed=300, grad=True)
    lam = torch.tensor(-0.45, requires_grad=True)
    mask = padding_mask(1, 300, 3)
    out = differential_attention(q, k, v, lam, key_padding_mask=mask, backend=backend)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v, lam)]
    ref = diff_attention_reference(*ref_in, key_padding_mask=mask)
    g = check_forward_and_grads(out, ref, (q, k, v), ref_in[:3])
    assert lambda_grad_error(lam.grad, ref_in[3].grad, g, q, k, v, key_padding_mask=mask) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lam", [-0.8, 0.0, 1.7, 3.0])
def test_lambda_negative_and_above_one(backend, lam):
    q, k, v = random_inputs(1, 4, 2, 21, 21, 16, seed=int(lam * 10) + 50)
    out = differential_attention(q, k, v, torch.tensor(lam), backend=backend)
    assert rel_err(out, diff_attention_reference(q, k, v, lam)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype):
    q, k, v = random_inputs(2, 4, 2, 40, 40, 16, dtype=dtype, seed=7, grad=True)
    out = differential_attention(q, k, v, torch.tensor(0.5), backend=backend)
    assert out.dtype == dtype
    ref = diff_attention_reference(q.detach(), k.detach(), v.detach(), 0.5)  # same rounded inputs, float64
    assert rel_err(out, ref) <= 2e-2
    out.float().pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_query_rows_are_zero(backend):
    q, k, v = random_inputs(2, 2, 2, 6, 6, 8, seed=3)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False  # with causal masking, queries 0..2 of row 0 see no key
    out = differential_attention(q, k, v, torch.tensor(0.5), key_padding_mask=mask, backend=backend)
    assert torch.isfinite(out).all()
    assert out[0, :, :3].abs().max() == 0
    ref = diff_attention_reference(q, k, v, 0.5, key_padding_mask=mask)
    assert rel_err(out, ref) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), n_rep=st.sampled_from([1, 2, 4]), T=st.integers(1, 40),
       extra=st.integers(0, 20), d=st.sampled_from([4, 8, 16]), lam=st.floats(-2, 2), causal=st.booleans(),
       backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16))
def test_random_shapes_match_reference(B, h_kv, n_rep, T, extra, d, lam, causal, backend, seed):
    q, k, v = random_inputs(B, h_kv * n_rep, h_kv, T, T + extra, d, seed=seed)
    out = differential_attention(q, k, v, torch.tensor(lam), causal=causal, backend=backend)
    assert rel_err(out, diff_attention_reference(q, k, v, lam, causal=causal)) <= 1e-5


def test_eager_maps_are_the_differential_map():
    q, k, v = random_inputs(1, 2, 1, 10, 10, 8, seed=11)
    out, maps = differential_attention(q, k, v, torch.tensor(0.6), backend="eager", return_maps=True)
    _, ref_maps = diff_attention_reference(q, k, v, 0.6, return_maps=True)
    for got, want in zip(maps, ref_maps):
        assert rel_err(got, want) <= 1e-6
    torch.testing.assert_close(maps.a1.sum(-1), torch.ones(1, 2, 10))
    assert maps.a1.triu(1).abs().max() == 0  # causal
    torch.testing.assert_close(maps.diff, maps.a1 - 0.6 * maps.a2)


def test_maps_only_from_eager():
    q, k, v = random_inputs(1, 2, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="only be returned by the 'eager' backend"):
        differential_attention(q, k, v, 0.5, backend="sdpa", return_maps=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        differential_attention(q, k, v, 0.5, backend="flash9")


def test_bad_functional_shapes():
    q, k, v = random_inputs(1, 2, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"v must be \(batch, h_kv, S, 2d\)"):
        differential_attention(q, k, v[..., :8], 0.5)
    with pytest.raises(ValueError, match="lambda must be a scalar"):
        differential_attention(q, k, v, torch.ones(3))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        differential_attention(q, k, v, 0.5, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_rep", [1, 2])
def test_ordinary_attention_matches_reference(backend, n_rep):
    g = torch.Generator().manual_seed(n_rep)
    q = torch.randn(2, 4, 17, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 4 // n_rep, 17, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 4 // n_rep, 17, 8, generator=g, requires_grad=True)
    mask = padding_mask(2, 17, 5)
    out = multihead_attention(q, k, v, key_padding_mask=mask, backend=backend)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    check_forward_and_grads(out, mha_reference(*ref_in, key_padding_mask=mask), (q, k, v), ref_in)


# ---------------------------------------------------------------- RoPE and lambda
def test_rope_matches_formula():
    x = torch.randn(2, 3, 11, 16)
    pos = torch.arange(5, 16)
    rope = RotaryEmbedding(16, theta=500.0)
    assert rel_err(rope(x, pos), rope_reference(x, pos.tolist(), 500.0)) <= 1e-6
    per_row = torch.stack([pos, pos + 3])  # (B, T) positions
    out = rope(x, per_row)
    assert rel_err(out[1], rope_reference(x[1], (pos + 3).tolist(), 500.0)) <= 1e-6


def test_rope_on_views_that_cannot_be_complex():
    """Odd offsets/strides take the contiguous fallback and still match the formula."""
    base = torch.randn(2, 5, 21)
    x = base[:, :, 1:17]  # storage offset 1: pairs not complex-aligned
    rope = RotaryEmbedding(16)
    pos = torch.arange(5)
    assert rel_err(rope(x, pos), rope_reference(x, pos.tolist())) <= 1e-6
    xt = torch.randn(5, 2, 16).transpose(0, 1)  # a transposed view (layers pass these)
    assert rel_err(rope(xt, pos), rope_reference(xt, pos.tolist())) <= 1e-6


def test_rope_relative():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    rope = RotaryEmbedding(8)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    dots = [(rope(q[None], torch.tensor([m])) @ rope(k[None], torch.tensor([m - 3])).T).item() for m in (3, 50, 999)]
    assert max(dots) - min(dots) < 1e-4


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


# ---------------------------------------------------------------- baseline and V2 layers
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
    outs = []
    for i in range(H):  # pair (2i, 2i+1) must read the same kv head
        assert (2 * i) // group == (2 * i + 1) // group
        a = mha_reference(q[:, 2 * i: 2 * i + 1], k[:, (2 * i) // group][:, None], v[:, (2 * i) // group][:, None])
        b = mha_reference(q[:, 2 * i + 1: 2 * i + 2], k[:, (2 * i) // group][:, None], v[:, (2 * i) // group][:, None])
        lam = torch.sigmoid(xd @ sd["lambda_proj.weight"][i])[:, None, :, None]
        outs.append(a - lam * b)
    o = torch.cat(outs, dim=1).transpose(1, 2).reshape(2, T, H * d)
    assert rel_err(layer(x), o @ sd["o_proj.weight"].T) <= 1e-5


# ---------------------------------------------------------------- bad input
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
def _triton_runs_here() -> bool:
    from difftransformer import kernels

    return kernels.is_available() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


# The Triton interpreter runs the kernels on CPU tensors; compiled, they need CUDA ones.
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.mark.skipif(not _triton_runs_here(), reason="needs CUDA or TRITON_INTERPRET=1")
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


@pytest.mark.skipif(not _triton_runs_here(), reason="needs CUDA or TRITON_INTERPRET=1")
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


def test_auto_takes_triton_on_cuda_for_half_precision_only(monkeypatch):
    from difftransformer import kernels
    from difftransformer.attention.functional import resolve_backend

    monkeypatch.setattr(kernels, "is_available", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, dtype=torch.bfloat16) == "triton"
    assert resolve_backend("auto", cuda, dtype=torch.float16) == "triton"
    assert resolve_backend("auto", cuda, dtype=torch.float32) == "sdpa"  # no tensor-core fp32 path
    assert resolve_backend("auto", cuda, dtype=torch.bfloat16, has_padding=True) == "sdpa"
    assert resolve_backend("triton", cuda, dtype=torch.float32) == "triton"  # asked for: runs exact fp32
    monkeypatch.setattr(kernels, "is_available", lambda: False)
    assert resolve_backend("auto", cuda, dtype=torch.bfloat16) == "sdpa"
