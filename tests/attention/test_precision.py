"""Precision: norms, RoPE and λ compute in at least fp32 and never below the input's precision.

A float64 layer must agree with the float64 reference to float64 rounding (<= 1e-10 relative, forward
and every gradient), not to fp32's 1e-7; a layer or model built with `dtype=` (bf16, float64) must run.
"""

import pytest
import torch

from difftransformer import (
    DiffTransformerLM,
    MultiheadAttention,
    MultiheadDiffAttention,
    MultiheadDiffAttentionV2,
    RMSNorm,
    RotaryEmbedding,
    differential_attention,
)
from difftransformer.attention import reparameterized_lambda
from difftransformer.norm import compute_dtype
from tests.helpers import random_inputs, rel_err, tiny
from tests.reference import (
    diff_attention_reference,
    diff_layer_reference,
    mha_layer_reference,
    rope_reference,
    v2_layer_reference,
)

F64_TOL = 1e-10
FLOAT64_BACKENDS = ["eager", "sdpa", "auto"]  # 'auto' must route float64 to an exact path


def _rel(a, b) -> float:
    """Plain ||a - b|| / ||b|| in float64 (no floor: float64 results are compared at rounding level)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_layer_f64(layer, ref_fn, x):
    """Forward and the gradients of x and of every parameter, against a float64 reference of the layer."""
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in layer.state_dict().items()}
    xr = x.detach().clone().requires_grad_(True)
    y, ref = layer(x), ref_fn(sd, xr)
    assert y.dtype == torch.float64 and _rel(y, ref) <= F64_TOL
    grad_out = torch.randn_like(ref)
    (y * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    assert _rel(x.grad, xr.grad) <= F64_TOL
    for name, p in layer.named_parameters():
        assert p.dtype == torch.float64, name
        assert _rel(p.grad, sd[name].grad) <= F64_TOL, name


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("h,h_kv,depth", [(2, 1, 2), (4, 4, 0)])
def test_float64_diff_layer_matches_the_reference_to_rounding(backend, h, h_kv, depth):
    torch.manual_seed(h * 10 + depth)
    layer = MultiheadDiffAttention(64, depth, h, h_kv, backend=backend, dtype=torch.float64)
    with torch.no_grad():
        layer.subln.weight.uniform_(0.5, 1.5)  # a non-trivial head-norm weight
    x = torch.randn(2, 13, 64, dtype=torch.float64, requires_grad=True)
    _check_layer_f64(layer, lambda sd, xr: diff_layer_reference(sd, xr, depth=depth, num_heads=h, num_kv_heads=h_kv), x)


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("head_norm", [False, True])
def test_float64_baseline_layer_matches_the_reference_to_rounding(backend, head_norm):
    torch.manual_seed(5)
    layer = MultiheadAttention(64, 0, 4, 2, backend=backend, head_norm=head_norm, dtype=torch.float64)
    x = torch.randn(2, 11, 64, dtype=torch.float64, requires_grad=True)
    _check_layer_f64(layer, lambda sd, xr: mha_layer_reference(sd, xr, num_heads=4, num_kv_heads=2,
                                                               head_norm=head_norm), x)


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_float64_v2_layer_matches_the_reference_to_rounding(backend):
    torch.manual_seed(6)
    layer = MultiheadDiffAttentionV2(64, 0, 4, 2, backend=backend, dtype=torch.float64)
    x = torch.randn(2, 9, 64, dtype=torch.float64, requires_grad=True)
    _check_layer_f64(layer, lambda sd, xr: v2_layer_reference(sd, xr, num_heads=4, num_kv_heads=2), x)


def test_float64_functional_attention_and_lambda_gradient():
    q, k, v = random_inputs(2, 2, 1, 7, 10, 8, dtype=torch.float64, grad=True, seed=3)
    lam = torch.tensor(0.37, dtype=torch.float64, requires_grad=True)
    out = differential_attention(q, k, v, lam, backend="sdpa")
    ref_in = [t.detach().clone().requires_grad_(True) for t in (q, k, v, lam)]
    ref = diff_attention_reference(*ref_in)
    assert out.dtype == torch.float64 and _rel(out, ref) <= F64_TOL
    out.sum().backward()
    ref.sum().backward()
    for got, want in zip((q, k, v, lam), ref_in):
        assert abs(got.grad - want.grad).max() <= F64_TOL * max(1.0, want.grad.abs().max().item())


def test_float64_layer_passes_gradcheck():
    """Finite differences against autograd, in float64, for every input of a small V1 layer."""
    torch.manual_seed(0)
    layer = MultiheadDiffAttention(16, 1, 2, 1, backend="sdpa", dtype=torch.float64)
    x = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, lq: layer(x_) + 0 * lq.sum(), (x, layer.lambda_q1))
    assert torch.autograd.gradcheck(
        lambda q1: torch.func.functional_call(layer, {"lambda_q1": q1}, (x,)),
        (layer.lambda_q1.detach().requires_grad_(),))


def test_rmsnorm_rope_and_lambda_keep_float64_and_lift_half_precision():
    x64 = torch.randn(3, 5, 16, dtype=torch.float64)
    norm = RMSNorm(16, dtype=torch.float64)
    want = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5)
    assert _rel(norm(x64), want) <= 1e-14  # fp32 would give ~1e-7
    rope = RotaryEmbedding(16)
    pos = torch.arange(5) + 1000  # large angles: fp32 rotations would be off by ~1e-4
    got = rope(x64[None], pos)
    assert got.dtype == torch.float64 and _rel(got, rope_reference(x64[None], pos.tolist())) <= 1e-13
    vecs64 = [torch.randn(8, dtype=torch.float64) * 0.1 for _ in range(4)]
    lam64 = reparameterized_lambda(*vecs64, 0.2)
    want_lam = torch.exp((vecs64[0] * vecs64[1]).sum()) - torch.exp((vecs64[2] * vecs64[3]).sum()) + 0.2
    assert lam64.dtype == torch.float64 and abs(lam64 - want_lam) <= 1e-15
    lam_bf16 = reparameterized_lambda(*(v.bfloat16() for v in vecs64), 0.2)
    assert lam_bf16.dtype == torch.float32  # computed in fp32 from bf16 vectors, not in bf16
    x16 = x64.bfloat16()
    assert norm.to(torch.bfloat16)(x16).dtype == torch.bfloat16
    assert compute_dtype(x16) == torch.float32 and compute_dtype(x64) == torch.float64
    assert rel_err(norm(x16).double(), want) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2", "diff_no_headnorm", "transformer_headnorm"])
def test_model_built_with_dtype_runs_and_trains(dtype, kind):
    torch.manual_seed(1)
    cfg = tiny(kind)
    model = DiffTransformerLM(cfg, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    out = model(ids, ids)
    assert out.logits.dtype == dtype and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    for name, p in model.named_parameters():  # λ vectors stay at least fp32; everything else is `dtype`
        assert p.dtype == (compute_dtype(dtype) if ".lambda_q" in name or ".lambda_k" in name
                           else dtype), name
    reference = DiffTransformerLM(cfg)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    tol = 1e-5 if dtype == torch.float64 else 5e-2
    assert rel_err(out.logits.float(), reference(ids).logits) <= tol
