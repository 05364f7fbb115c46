"""The one definition of differential (and ordinary) attention, every backend against the float64 reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from difftransformer import differential_attention
from difftransformer.attention import multihead_attention
from difftransformer.attention.functional import attended_key_counts
from tests.helpers import BACKENDS, check_forward_and_grads, lambda_grad_error, padding_mask, random_inputs, rel_err
from tests.reference import diff_attention_reference, mha_reference, ssmax_reference, visible

# ---------------------------------------------------------------- the reference itself


def test_reference_with_zero_lambda_is_ordinary_attention():
    """Sanity-check the independent reference against PyTorch's float64 SDPA."""
    q, k, v = random_inputs(2, 3, 3, 9, 9, 8, dtype=torch.float64)
    out = diff_attention_reference(q, k, v, 0.0)
    expected = F.scaled_dot_product_attention(q[:, 0::2], k[:, 0::2], v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_ssmax_reference_with_s_log_n_one_is_ordinary_attention():
    """The SSMax reference's last query (n = S keys) with s = 1 / log S equals float64 SDPA's."""
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 8, dtype=torch.float64), torch.randn(2, 2, 9, 8, dtype=torch.float64)
    out = ssmax_reference(q, k, v, torch.full((4,), 1 / math.log(9), dtype=torch.float64))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out[:, :, -1], expected[:, :, -1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out[:, :, 4], expected[:, :, 4])  # query 4 reads 5 keys: s log 5 != 1


@pytest.mark.parametrize("T,S,causal", [(1, 1, True), (6, 6, True), (3, 10, True), (1, 7, True), (5, 5, False),
                                        (4, 2, True), (6, 3, True), (4, 2, False)])
@pytest.mark.parametrize("padded", [False, True])
def test_attended_key_counts_count_the_visible_keys(T, S, causal, padded):
    """Fewer keys than queries included: the queries before key 0 (bottom-right alignment) see none."""
    mask = padding_mask(3, S, seed=T + S) if padded else None
    if padded:
        mask[1, S // 2] = False  # a hole, not only left padding
    got = attended_key_counts(T, S, causal=causal, key_padding_mask=mask)
    want = torch.stack([visible(T, S, causal, mask, b).sum(-1) for b in range(3)])
    assert torch.equal(got.expand(3, T), want)
    assert got.shape == ((3, T) if padded else (T,))


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
def test_near_cancelling_maps_in_bf16_lose_only_what_the_module_doc_says(backend):
    """Two nearly equal maps and λ = 0.95: the output is about 1/20 of each term. Subtracting in fp32 before
    rounding (eager, cpp) leaves each element within bf16's rounding of the output itself, u |out| (u = 2^-8);
    sdpa rounds each map's probabilities and A_c V to bf16 first, so its error is bounded by the terms',
    u |out| + 2u (A1 |V| + λ A2 |V|), and not by the output's: the bound functional.py's module doc states."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 1, 48, 16, generator=g).expand(2, 4, 2, 48, 16).reshape(2, 8, 48, 16)
    k = torch.randn(2, 2, 1, 48, 16, generator=g).expand(2, 2, 2, 48, 16).reshape(2, 4, 48, 16)
    q = (q + 0.02 * torch.randn(q.shape, generator=g)).bfloat16()  # component 2 a little off component 1
    k = (k + 0.02 * torch.randn(k.shape, generator=g)).bfloat16()
    v = torch.randn(2, 2, 48, 32, generator=g).bfloat16()
    out = differential_attention(q, k, v, torch.tensor(0.95), backend=backend).double()
    ref = diff_attention_reference(q, k, v, 0.95)  # the same rounded inputs, in float64
    swapped = [1, 0, 3, 2, 5, 4, 7, 6]  # A2 as the first map of the swapped components
    terms = (diff_attention_reference(q, k, v.abs(), 0.0)
             + 0.95 * diff_attention_reference(q[:, swapped], k[:, [1, 0, 3, 2]], v.abs(), 0.0))  # A1|V| + λ A2|V|
    err, u = (out - ref).abs(), 2.0 ** -8
    subtracted_first = (err <= u * ref.abs() + 2.0 ** -16 * terms).all()
    assert subtracted_first if backend != "sdpa" else (err <= u * ref.abs() + 2 * u * terms).all()
    if backend == "sdpa":  # the terms' bound is needed: the output's own rounding does not cover sdpa's error
        assert not subtracted_first


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_floating_dtypes_compute_in_the_query_dtype(backend):
    """k and v in float64 beside fp32 queries: every backend computes in q's dtype (k and v cast first)."""
    q, k, v = random_inputs(2, 2, 1, 9, 9, 8, seed=13)
    out = differential_attention(q, k.double(), v.double(), torch.tensor(0.5), backend=backend)
    assert out.dtype == torch.float32 and rel_err(out, diff_attention_reference(q, k, v, 0.5)) <= 1e-5
    qo, ko, vo = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    out = multihead_attention(qo, ko.double(), vo.double(), backend=backend)
    assert out.dtype == torch.float32 and rel_err(out, mha_reference(qo, ko, vo)) <= 1e-5


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_queries_than_keys_leave_the_first_rows_empty(backend):
    """Causal masks align bottom-right: with 6 queries on 4 keys queries 0 and 1 see no key, without any
    padding (the eager path decides from the shapes alone whether such rows can exist)."""
    q, k, v = random_inputs(2, 2, 2, 6, 4, 8, seed=5)
    out = differential_attention(q, k, v, torch.tensor(0.5), backend=backend)
    assert torch.isfinite(out).all() and out[:, :, :2].abs().max() == 0
    assert rel_err(out, diff_attention_reference(q, k, v, 0.5)) <= 1e-5
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (6, 4, 4))
    plain = multihead_attention(q, k, v, backend=backend)
    assert torch.isfinite(plain).all() and plain[:, :, :2].abs().max() == 0
    assert rel_err(plain, mha_reference(q, k, v)) <= 1e-5


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
    with pytest.raises(ValueError, match="explicit maps of the 'eager' backend"):
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
