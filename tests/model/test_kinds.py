"""The one table of attention kinds, and everything that reads it: layers, λ reporting, head counts."""

import math

import pytest
import torch

from difftransformer import MultiheadAttention, MultiheadDiffAttention, MultiheadDiffAttentionV2
from difftransformer.model import ATTENTION_KINDS, DiffTransformerLM, LayerLambda, attention_kind, build_attention
from tests.helpers import tiny

# kind -> (layer class, head norm present, scalar λ)
EXPECTED = {
    "diff": (MultiheadDiffAttention, True, True),
    "diff_no_headnorm": (MultiheadDiffAttention, False, True),
    "diff_v2": (MultiheadDiffAttentionV2, False, False),
    "transformer": (MultiheadAttention, False, False),
    "transformer_headnorm": (MultiheadAttention, True, False),
    "diff_retrofit": (MultiheadDiffAttention, True, True),
    "transformer_gated": (MultiheadAttention, False, False),
    "transformer_ssmax": (MultiheadAttention, False, False),
}


def test_the_table_answers_the_four_questions():
    assert set(ATTENTION_KINDS) == set(EXPECTED)
    rows = {k.name: (k.differential, k.scalar_lambda, k.head_norm, k.v2) for k in ATTENTION_KINDS.values()}
    assert rows == {"diff": (True, True, True, False), "diff_no_headnorm": (True, True, False, False),
                    "diff_v2": (True, False, False, True), "transformer": (False, False, False, False),
                    "transformer_headnorm": (False, False, True, False),
                    "diff_retrofit": (True, True, True, False), "transformer_gated": (False, False, False, False),
                    "transformer_ssmax": (False, False, False, False)}
    assert [k for k, v in ATTENTION_KINDS.items() if v.diff_heads] == ["diff", "diff_no_headnorm", "diff_retrofit"]
    assert [k for k, v in ATTENTION_KINDS.items() if v.head_norm_ramp] == ["diff_retrofit"]
    assert [k for k, v in ATTENTION_KINDS.items() if v.output_gate] == ["transformer_gated"]
    assert [k for k, v in ATTENTION_KINDS.items() if v.scalable_softmax] == ["transformer_ssmax"]
    assert all(v.description for v in ATTENTION_KINDS.values())


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_layers_follow_the_table(kind):
    cls, head_norm, scalar = EXPECTED[kind]
    layer = build_attention(tiny(kind), depth=1)
    assert type(layer) is cls
    assert (getattr(layer, "subln", None) is not None) == head_norm
    assert hasattr(layer, "lambda_q1") == scalar
    assert (getattr(layer, "ssmax_scale", None) is not None) == ATTENTION_KINDS[kind].scalable_softmax
    assert layer.rotary is not None and build_attention(tiny(kind, position_encoding="none"), depth=1).rotary is None


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_model_reports_lambda_and_lambda_init_per_layer(kind):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny(kind, num_hidden_layers=3))
    got = model.lambdas()
    assert len(got) == 3
    if not ATTENTION_KINDS[kind].scalar_lambda:
        assert got == [None, None, None]
        return
    for depth, (block, row) in enumerate(zip(model.layers, got)):
        attn = block.self_attn
        assert isinstance(row, LayerLambda)
        assert row.init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * depth))
        by_hand = (torch.exp((attn.lambda_q1 * attn.lambda_k1).sum())
                   - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum()) + row.init)
        assert row.value == pytest.approx(by_hand.item(), abs=1e-6)
    constant = DiffTransformerLM(tiny(kind, lambda_init=0.5)).lambdas()
    assert [r.init for r in constant] == [0.5, 0.5]


def test_unknown_kind_suggests_the_nearest():
    with pytest.raises(ValueError, match="unknown attention kind 'transfomer' \\(did you mean 'transformer'\\?\\)"):
        attention_kind("transfomer")
    with pytest.raises(ValueError, match="did you mean 'diff'"):
        tiny("dif")
