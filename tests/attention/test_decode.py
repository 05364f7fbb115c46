"""Decoding's seam (attention/decode.py): the short route of a CPU decoding step and the constants a KV cache holds.

The short route is held to the general route (the fused kernel reached through `flash_cpu`'s wrapper) and to
the independent float64 reference (tests/reference.py); its choice of backend to `resolve_backend`; the held
constants to the layer's parameters at each new cache.
"""

import pytest
import torch

from difftransformer.attention import KVCache, MultiheadDiffAttention, decode
from difftransformer.attention.decode import cpu_decode_diff, cpu_decode_ordinary, layer_constants
from difftransformer.kernels import flash_cpu
from difftransformer.kernels.flash_cpu import diff_flash_attention_cpu, flash_attention_cpu
from tests.helpers import CPP_KERNEL_DISABLED, random_inputs, rel_err
from tests.reference import diff_attention_reference, mha_reference

needs_kernel = pytest.mark.skipif(CPP_KERNEL_DISABLED, reason="DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1")


@pytest.fixture
def fresh_answers(monkeypatch):
    """The seam's remembered answers of `resolve_backend`, emptied for this test and restored after it."""
    monkeypatch.setattr(decode, "_picks_cpp", {})
    assert flash_cpu.is_available()


# (B, h, h_kv, T, S): one row per head, GQA with n_rep 2 and 4, a few rows (speculative or chunked steps)
SHAPES = [(1, 2, 2, 1, 7), (2, 4, 2, 1, 130), (1, 4, 1, 3, 300), (3, 2, 1, 2, 64)]


@needs_kernel
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}h{}kv{}T{}S{}".format(*s))
def test_the_direct_route_equals_the_general_route_and_the_reference(shape, causal, fresh_answers):
    B, h, h_kv, T, S = shape
    q, k, v = random_inputs(B, h, h_kv, T, S, 16, seed=S + 10 * T)
    lam, weight = torch.tensor(0.35), torch.rand(32, generator=torch.Generator().manual_seed(S)) + 0.5
    with torch.no_grad():
        for out_norm in (None, (weight, 1e-5)):
            direct = cpu_decode_diff(q, k, v, lam, causal, 0.3, out_norm, "auto")
            general = diff_flash_attention_cpu(q, k, v, lam, causal=causal, scale=0.3, out_norm=out_norm)
            assert torch.equal(direct, general)
        ref = diff_attention_reference(q, k, v, 0.35, causal=causal, scale=0.3)
        assert rel_err(cpu_decode_diff(q, k, v, lam, causal, 0.3, None, "cpp"), ref) <= 1e-5
        qo = q.reshape(B, 2 * h, T, 16)
        direct = cpu_decode_ordinary(qo, k, k, causal, 0.3, "cpp")
        assert torch.equal(direct, flash_attention_cpu(qo, k, k, causal=causal, scale=0.3))
        assert rel_err(direct, mha_reference(qo, k, k, causal=causal, scale=0.3)) <= 1e-5


@needs_kernel
def test_the_direct_route_declines_every_call_outside_its_rule(fresh_answers):
    """None (the general route) for gradients on, other dtypes, too many rows for the decode path, λ not a 0-d fp32
    tensor, a strided norm weight, v's dim other than q's, an observer, and an unloaded kernel."""
    q, k, v = random_inputs(1, 2, 1, 1, 20, 16, seed=5)
    lam, weight = torch.tensor(0.4), torch.rand(32) + 0.5
    with torch.no_grad():
        assert cpu_decode_diff(q, k, v, lam, True, 0.25, (weight, 1e-5), "cpp") is not None
        declined = [cpu_decode_diff(q.double(), k.double(), v.double(), lam, True, 0.25, None, "cpp"),
                    cpu_decode_diff(q, k, v, 0.4, True, 0.25, None, "cpp"),
                    cpu_decode_diff(q, k, v, lam.double(), True, 0.25, None, "cpp"),
                    cpu_decode_diff(q, k, v, lam, True, 0.25, (torch.stack([weight, weight], 1)[:, 0], 1e-5), "cpp"),
                    cpu_decode_diff(q.expand(1, 4, 65, 16), k, v, lam, True, 0.25, None, "cpp"),  # 130 rows > 64
                    cpu_decode_ordinary(q, k, v[..., :16].repeat(1, 2, 1, 2), True, 0.25, "cpp")]
    assert declined == [None] * len(declined)
    assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "cpp") is None  # gradients on
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "ops_observed", lambda: True)
        assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "cpp") is None
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setitem(flash_cpu._state, "ok", False)
        assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "cpp") is None


@needs_kernel
def test_the_direct_route_asks_the_backend_rule_once_per_name(monkeypatch, fresh_answers):
    """Which backend names take the kernel is `resolve_backend`'s answer for fp32 CPU tensors, asked once per
    (name, kind): a rule that said otherwise for 'auto' would send 'auto' to the general route."""
    asked = []
    real = decode.resolve_backend
    monkeypatch.setattr(decode, "resolve_backend",
                        lambda *a, **kw: asked.append((a[0], kw["ordinary"])) or real(*a, **kw))
    q, k, v = random_inputs(1, 2, 2, 1, 9, 16, seed=2)
    lam = torch.tensor(0.2)
    with torch.no_grad():
        for _ in range(3):
            assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "auto") is not None
            assert cpu_decode_ordinary(q, k, k, True, 0.25, "auto") is not None
            assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "sdpa") is None
            assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "eager") is None
        assert asked == [("auto", False), ("auto", True), ("sdpa", False), ("eager", False)]
        monkeypatch.setattr(decode, "_picks_cpp", {})
        monkeypatch.setattr(decode, "resolve_backend", lambda *a, **kw: "sdpa")
        assert cpu_decode_diff(q, k, v, lam, True, 0.25, None, "auto") is None


def test_a_cache_holds_the_constants_for_its_life_and_a_new_cache_derives_them_anew(monkeypatch):
    """Within one cache λ and the folded weight are derived once per layer (parameter changes meanwhile are the
    caller's contract to avoid); a new cache after an in-place change derives the new ones."""
    torch.manual_seed(3)
    layer = MultiheadDiffAttention(64, 2, 2, backend="sdpa")
    derived = []
    real = MultiheadDiffAttention.attention_constants
    monkeypatch.setattr(MultiheadDiffAttention, "attention_constants",
                        lambda self, dtype: derived.append(dtype) or real(self, dtype))
    first, x = KVCache(), torch.randn(1, 1, 64)
    with torch.no_grad():
        held = layer_constants(layer, x, first)
        for _ in range(3):
            assert layer_constants(layer, x, first) is held
        assert len(derived) == 1
        layer.lambda_q1.add_(0.25)
        layer.subln.weight.mul_(2.0)
        assert layer_constants(layer, x, first) is held  # the same cache: what it was made with
        lam, (weight, eps) = layer_constants(layer, x, KVCache())
    expected = torch.exp(torch.dot(layer.lambda_q1, layer.lambda_k1)) - torch.exp(
        torch.dot(layer.lambda_q2, layer.lambda_k2)) + layer.lambda_init
    torch.testing.assert_close(lam, expected.detach())
    assert not torch.equal(lam, held[0]) and len(derived) == 2
    torch.testing.assert_close(weight, layer.subln.weight.detach() * (1 - layer.lambda_init))
    assert eps == layer.subln.eps


def test_without_a_cache_or_with_a_ramped_norm_nothing_is_fused_or_held():
    torch.manual_seed(4)
    layer = MultiheadDiffAttention(64, 0, 2, backend="sdpa", head_norm_ramp=True)
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        lam, out_norm = layer_constants(layer, x)
        assert out_norm is None and layer_constants(layer, x)[0] is not lam  # no cache: derived at each call
        torch.testing.assert_close(lam, layer.lambda_full())
