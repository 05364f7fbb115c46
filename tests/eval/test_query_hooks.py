"""Query hooks (adaptive temperature as a query hook) against independent references: explicit float64 maps
and full-sequence passes, on every backend, through KV-cache decoding, with NoPE, GQA and padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftransformer.attention import KVCache, differential_attention, multihead_attention
from difftransformer.eval.probes.hooks import rescale_queries
from difftransformer.eval.probes.ood import adaptive_beta, adaptive_temperature_queries, row_entropy
from difftransformer.model import DiffTransformerLM, get_preset


def _entropy64(logits: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    logits = logits.double()
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True).nan_to_num(nan=0.0)


def _reference_adaptive_scores(scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    return scores * adaptive_beta(_entropy64(scores, visible)).to(scores.dtype)


def _model(attention: str, **changes) -> DiffTransformerLM:
    cfg = get_preset("tiny").config(attention)
    heads = 4 if attention == "diff" else 8
    cfg = type(cfg)(**{**cfg.to_dict(), "num_attention_heads": heads, "num_key_value_heads": heads // 2, **changes})
    torch.manual_seed(1)
    model = DiffTransformerLM(cfg).eval()
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear) and layer.out_features != cfg.vocab_size:
                layer.weight.mul_(3.0)
    return model


KINDS = [("transformer", {}), ("diff", {}), ("diff_v2", {}), ("transformer_ssmax", {}), ("transformer_gated", {}),
         ("transformer", {"position_encoding": "none"}), ("diff", {"position_encoding": "none"})]


@pytest.mark.parametrize("attention,changes", KINDS)
def test_decoding_with_a_kv_cache_applies_the_query_hook_as_the_full_pass_does(attention, changes):
    """One-row steps on a KV cache (the CPU kernel's decode route) give the full pass's last-row logits."""
    model = _model(attention, **changes)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        no_hook = model(ids).logits
        with rescale_queries(model, adaptive_temperature_queries):
            full = model(ids).logits
            cache = KVCache()
            model(ids[:, :20], kv_cache=cache)
            steps = [model(ids[:, t:t + 1], kv_cache=cache).logits[:, -1] for t in range(20, 24)]
    assert (full - no_hook).abs().max() > 1e-3  # the hook changed something
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 20:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ordinary", [False, True])
def test_more_queries_than_keys_and_padding_rows_with_no_key_match_the_definition(ordinary):
    """Bottom-right causal with T > S (the first rows see no key) and a fully padded sequence, GQA."""
    g = torch.Generator().manual_seed(5)
    B, T, S, d = 2, 7, 5, 8
    q = torch.randn(B, 8, T, d, generator=g) * 3
    k = torch.randn(B, 4, S, d, generator=g) * 3
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1] = False
    mask[1, 3] = True  # sequence 1 sees only key 3
    if ordinary:
        v = torch.randn(B, 4, S, d, generator=g)
        fn = lambda qq, kk, vv, **kw: multihead_attention(qq, kk, vv, key_padding_mask=mask, **kw)  # noqa: E731
    else:
        v = torch.randn(B, 2, S, 2 * d, generator=g)
        fn = lambda qq, kk, vv, **kw: differential_attention(qq, kk, vv, 0.3, key_padding_mask=mask, **kw)  # noqa: E731
    got = fn(q, k, v, query_hook=adaptive_temperature_queries, backend="cpp")
    want = fn(q.double(), k.double(), v.double(), score_hook=_reference_adaptive_scores, backend="eager")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_bf16_queries_keep_their_dtype_and_beta_is_computed_in_fp32():
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(1, 2, 9, 8, generator=g) * 0.3).bfloat16()
    k = torch.randn(1, 2, 9, 8, generator=g).bfloat16()
    out = adaptive_temperature_queries(q, k, 8 ** -0.5, None)
    assert out.dtype == torch.bfloat16
    beta = adaptive_beta(_entropy64(q.double() @ k.double().transpose(-1, -2) * 8 ** -0.5, None))
    torch.testing.assert_close(out.double(), (q.double() * beta).bfloat16().double(), rtol=1e-2, atol=1e-2)


def test_row_entropy_over_blocks_with_padding_but_no_causal_mask():
    """visible may be (B, 1, 1, S): key padding without a causal mask (the contract: broadcastable to
    (B, heads, T, S))."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 2, 6, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)
    visible = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    visible[1, ..., 3:] = False
    want = _entropy64(q.double() @ k.double().transpose(-1, -2), visible)
    got = row_entropy(q, k, 1.0, visible, block_bytes=1)  # one row per block
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_non_causal_padded_attention_with_the_adaptive_hook_at_the_default_block_size():
    """The same through multihead_attention (causal=False, key padding), 2,100 rows: two blocks by default; every
    row must get its own beta, as the definition on explicit float64 maps gives."""
    g = torch.Generator().manual_seed(8)
    T = 2100
    q, k, v = (torch.randn(1, 1, T, 4, generator=g) * 2 for _ in range(3))
    mask = torch.rand(1, T, generator=g) > 0.3
    got = multihead_attention(q, k, v, causal=False, key_padding_mask=mask, backend="cpp",
                              query_hook=adaptive_temperature_queries)
    want = multihead_attention(q.double(), k.double(), v.double(), causal=False, key_padding_mask=mask,
                               backend="eager", score_hook=_reference_adaptive_scores)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["diff", "transformer_ssmax", "diff_v2"])
def test_static_and_growing_cache_decoding_with_the_hook_match_recomputing_every_step(attention):
    """Left-padded prompts: the static cache's prefill and steps (a (B, capacity) key mask) and the growing
    cache give the greedy tokens of recomputing the whole sequence at every step, all with the hook."""
    from difftransformer.attention.decode import graph_refusal

    model = _model(attention)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    assert graph_refusal(model) is None
    with torch.no_grad(), rescale_queries(model, adaptive_temperature_queries):
        assert "query hook" in graph_refusal(model)
        want = model.generate(ids, 8, temperature=0, attention_mask=mask, use_cache=False)
        for decoder in ("static", "dynamic"):
            assert torch.equal(model.generate(ids, 8, temperature=0, attention_mask=mask, decoder=decoder), want)
        hooked = want
    assert graph_refusal(model) is None
    plain = model.generate(ids, 8, temperature=0, attention_mask=mask, use_cache=False)
    assert not torch.equal(plain, hooked)  # the hook changes some greedy token
