"""Paired initialisation: every tensor two arms share by name and shape starts equal."""

import dataclasses

import torch

from difftransformer.experiments import PairedInit, paired_init
from difftransformer.model import DiffTransformerLM
from tests.helpers import tiny


def test_paired_init_shares_every_common_parameter():
    diff, base = tiny("diff"), tiny("transformer")
    states = paired_init([diff, base], seed=7)
    d, b = states
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.mlp.up_proj.weight",
                 "layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight",
                 "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                 "layers.1.self_attn.out_proj.weight"):
        assert torch.equal(d[name], b[name]), name
        assert name in states.shared[1]
    lam = [k for k in d if "lambda_" in k]
    assert lam and not any("lambda_" in k for k in b) and set(lam) <= set(states.own[0]) | set(states.shared[0])
    assert states.own[1] == []  # the baseline has nothing DIFF lacks
    assert not any("subln" in k for k in b)
    model = DiffTransformerLM(base)
    model.load_state_dict(b)  # loadable as init_state
    assert torch.equal(model.lm_head.weight, d["embed_tokens.weight"])
    again = paired_init([diff, base], seed=7)
    assert all(torch.equal(again[0][k], d[k]) for k in d)
    # a dataclass of three parallel lists; indexing, unpacking and dropping a used state act on `states`
    assert isinstance(again, PairedInit) and dataclasses.is_dataclass(again) and not isinstance(again, list)
    assert len(again) == 2 and [s is t for s, t in zip(again, again.states)] == [True, True]
    again[0] = None
    assert again.states[0] is None and again[1] is again.states[1] and len(again.shared) == len(again.own) == 2
