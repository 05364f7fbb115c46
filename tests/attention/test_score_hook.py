"""The score hook: the explicit entry point through which probes read or replace pre-softmax logits."""

from __future__ import annotations

import pytest
import torch

from difftransformer.attention import differential_attention, multihead_attention
from difftransformer.eval.probes import attention_layers, capture_layer_outputs, inspect_attention
from difftransformer.eval.probes.hooks import rescale_queries
from difftransformer.model import DiffTransformerLM
from tests.helpers import random_inputs, tiny


def _reference_scores(q, k, scale, maps):
    """Logits (B, heads, maps, T, S) in float64, GQA expanded by hand."""
    B, QH, T, d = q.shape
    heads = QH // maps
    qc = q.double().view(B, heads, maps, T, d)
    kv_groups = k.shape[1] // maps
    kc = k.double().view(B, kv_groups, maps, k.shape[2], d).repeat_interleave(heads // kv_groups, dim=1)
    return torch.einsum("bhmtd,bhmsd->bhmts", qc, kc) * scale


@pytest.mark.parametrize("h,h_kv", [(2, 2), (4, 2)])
def test_diff_hook_sees_both_maps_and_the_causal_mask(h, h_kv):
    q, k, v = random_inputs(2, h, h_kv, 5, 7, 8, seed=h)
    seen = {}

    def hook(scores, visible):
        seen["scores"], seen["visible"] = scores.clone(), visible
    out = differential_attention(q, k, v, 0.3, score_hook=hook)
    torch.testing.assert_close(seen["scores"].double(), _reference_scores(q, k, 8 ** -0.5, 2), rtol=1e-5, atol=1e-6)
    vis = seen["visible"].expand(2, h, 2, 5, 7)
    # bottom-right aligned: query t reads keys 0 .. t + 2
    assert vis[0, 0, 0].sum(-1).tolist() == [3, 4, 5, 6, 7]
    torch.testing.assert_close(out, differential_attention(q, k, v, 0.3, backend="eager"))


def test_replacing_scores_changes_the_output_exactly():
    q, k, v = random_inputs(1, 2, 2, 4, 4, 8, seed=3)
    # Zeroing every logit makes both maps uniform over the visible keys: out = (1 - λ) * mean of v so far
    out = differential_attention(q, k, v, 0.25, score_hook=lambda s, vis: torch.zeros_like(s))
    counts = torch.arange(1, 5, dtype=torch.float32)[:, None]
    mean_v = v.cumsum(2) / counts
    want = (1 - 0.25) * mean_v.repeat_interleave(1, dim=1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_ordinary_attention_hook_has_one_map():
    q = torch.randn(1, 4, 3, 8)
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    seen = []
    out = multihead_attention(q, k, v, score_hook=lambda s, vis: seen.append(s.shape))
    assert seen == [torch.Size([1, 4, 1, 3, 3])]
    torch.testing.assert_close(out, multihead_attention(q, k, v, backend="eager"))
    with pytest.raises(ValueError, match="shape"):
        multihead_attention(q, k, v, score_hook=lambda s, vis: s[..., :2])


def test_hook_refuses_a_fused_backend_by_name():
    q, k, v = random_inputs(1, 2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="score hooks need"):
        differential_attention(q, k, v, 0.5, backend="sdpa", score_hook=lambda s, vis: None)


@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2"])
def test_inspect_attention_restores_the_layers_and_leaves_logits_unchanged(kind):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny(kind, attn_backend="sdpa"))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    ref = model(ids).logits
    calls, outputs = [], []
    with inspect_attention(model, lambda i: (lambda s, vis: calls.append(i))), \
            capture_layer_outputs(model, lambda i, hidden: outputs.append((i, hidden.shape))):
        got = model(ids).logits
    n = model.config.num_hidden_layers
    assert calls == list(range(n)) and outputs == [(i, (2, 9, model.config.hidden_size)) for i in range(n)]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert all(layer.backend == "sdpa" and layer.score_hook is None for layer in attention_layers(model))
    with pytest.raises(RuntimeError), inspect_attention(model):
        raise RuntimeError("a probe failing half-way")
    assert all(layer.backend == "sdpa" for layer in attention_layers(model))


def test_a_foreign_model_is_refused_in_one_line():
    with pytest.raises(ValueError, match="needs one of this package's models"):
        attention_layers(torch.nn.Linear(2, 2))


def test_hooks_nest_the_earlier_one_first():
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff"))
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    layer = attention_layers(model)[0]
    layer.score_hook = lambda s, vis: torch.full_like(s, 7.0)  # plants a known logit everywhere
    seen = []
    with inspect_attention(model, lambda i: (lambda s, vis: seen.append(float(s.max())) if i == 0 else None)):
        model(ids)
    assert seen == [7.0] and layer.score_hook is not None


def _expanded_keys64(k: torch.Tensor, query_heads: int, maps: int) -> torch.Tensor:
    """Keys (B, query_heads, S, d) in float64, query head j's own, GQA expanded by hand."""
    B, KH, S, d = k.shape
    groups, per = KH // maps, query_heads // KH
    return k.double().view(B, groups, maps, S, d).repeat_interleave(per, dim=1).reshape(B, query_heads, S, d)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "cpp"])
@pytest.mark.parametrize("ordinary", [False, True])
def test_query_hook_sees_the_expanded_keys_and_its_queries_replace_q_on_any_backend(backend, ordinary):
    seed = int(torch.randint(0, 2**31, (1,)))
    q, k, v = random_inputs(2, 4, 2, 6, 9, 8, seed=seed)  # 4 DIFF heads on 2 kv groups (ordinary: 8 on 4)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :2] = False
    scale_rows = torch.rand(2, q.shape[1], 6, 1, generator=torch.Generator().manual_seed(seed)) + 0.5
    seen = {}

    def hook(queries, keys, scale, visible):
        seen.update(q=queries, k=keys, scale=scale, visible=visible)
        return queries * scale_rows

    if ordinary:
        v = v.reshape(2, 4, 9, 8)  # ordinary attention: v of q's dim, one per kv head
        attend = lambda qq, **kw: multihead_attention(qq, k, v, key_padding_mask=mask, backend=backend, **kw)  # noqa: E731
    else:
        attend = lambda qq, **kw: differential_attention(qq, k, v, 0.4, key_padding_mask=mask, backend=backend, **kw)  # noqa: E731
    got = attend(q, query_hook=hook)
    assert torch.equal(seen["q"], q) and seen["scale"] == 8 ** -0.5
    torch.testing.assert_close(seen["k"].double(), _expanded_keys64(k, q.shape[1], 1 if ordinary else 2))
    vis = seen["visible"].expand(2, q.shape[1], 6, 9)
    assert vis[0, 0].sum(-1).tolist() == [4, 5, 6, 7, 8, 9] and vis[1, 0].sum(-1).tolist() == [2, 3, 4, 5, 6, 7]
    torch.testing.assert_close(got, attend(q * scale_rows), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="query hook must return queries of shape"):
        attend(q, query_hook=lambda queries, keys, scale, visible: queries[..., :4])


def test_rescale_queries_keeps_the_backend_and_removes_the_hook_also_when_the_forward_raises():
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff", attn_backend="sdpa"))
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    ref = model(ids).logits
    with rescale_queries(model, lambda q, k, scale, visible: q):  # the identity: same logits, same backend
        assert all(layer.backend == "sdpa" for layer in attention_layers(model))
        torch.testing.assert_close(model(ids).logits, ref)
        with pytest.raises(ValueError, match="already has a query hook"), rescale_queries(model, lambda *a: a[0]):
            pass
    with pytest.raises(RuntimeError), rescale_queries(model, lambda q, k, scale, visible: q):
        raise RuntimeError("a probe failing half-way")
    assert all(layer.query_hook is None for layer in attention_layers(model))
