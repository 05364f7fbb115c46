"""ours ⇄ the authors' reference layout (unilm Diff-Transformer): their layer, fed our converted tensors,
computes our logits; round trips are exact; what their code cannot express is refused.

`AuthorsDiffAttn` below is written from the authors' published layer (multihead_diffattn.py and
multihead_flashdiff_1.py): their parameter names and shapes (loaded with strict=True), interleaved
RoPE, explicit maps, a scalar λ, the weighted head RMSNorm with eps 1e-5, (1 - λ_init), out_proj. It
shares no code with the package. `gqa` picks how key components reach the heads: "flash" (their
recommended flash files: group i // n_rep) or "naive" (multihead_diffattn.py's repeat_kv of the 2h_kv
components), which differ when n_rep > 1.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftransformer.convert import ConversionError, ours_to_unilm, unilm_to_ours
from difftransformer.model import DiffTransformerLM
from tests.convert import config, ids, logits, ours, ours_from, rel, same_tensors
from tests.helpers import raises_one_line

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


class AuthorsDiffAttn(nn.Module):
    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None, gqa="flash"):
        super().__init__()
        self.h, self.h_kv = num_heads, num_kv_heads or num_heads
        self.n_rep, self.d, self.gqa = self.h // self.h_kv, embed_dim // num_heads // 2, gqa
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(self.d)))
        self.subln = nn.Module()
        self.subln.weight = nn.Parameter(torch.ones(2 * self.d))

    @staticmethod
    def rotary(x, cos, sin):  # x (B, T, heads, d), cos/sin (T, d/2); interleaved: pairs (2i, 2i+1)
        x0, x1, cos, sin = x[..., 0::2], x[..., 1::2], cos[:, None], sin[:, None]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def forward(self, x, rel_pos):
        B, T, E = x.shape
        h, h_kv, d = self.h, self.h_kv, self.d
        q = self.rotary(self.q_proj(x).view(B, T, 2 * h, d), *rel_pos).transpose(1, 2)
        k = self.rotary(self.k_proj(x).view(B, T, 2 * h_kv, d), *rel_pos).transpose(1, 2)
        v = self.v_proj(x).view(B, T, h_kv, 2 * d).transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        if self.gqa == "flash":  # group g's two components serve heads g*n_rep .. (g+1)*n_rep - 1
            k = k.view(B, h_kv, 2, T, d).repeat_interleave(self.n_rep, dim=1).reshape(B, 2 * h, T, d)
        else:  # repeat_kv over the 2*h_kv components, as multihead_diffattn.py does
            k = k.repeat_interleave(self.n_rep, dim=1)
        scores = (q * d ** -0.5) @ k.transpose(-1, -2)
        scores = scores + torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
        w = F.softmax(scores, dim=-1, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype).type_as(x)
        lam = (torch.exp((self.lambda_q1 * self.lambda_k1).sum()) - torch.exp((self.lambda_q2 * self.lambda_k2).sum())
               + self.lambda_init)
        w = w.view(B, h, 2, T, T)
        attn = (w[:, :, 0] - lam * w[:, :, 1]) @ v
        attn = attn * torch.rsqrt(attn.pow(2).mean(-1, keepdim=True) + 1e-5) * self.subln.weight
        attn = attn * (1 - self.lambda_init)
        return self.out_proj(attn.transpose(1, 2).reshape(B, T, E))


class _InOurBlock(nn.Module):
    """The authors' layer where our block calls its attention (their rel_pos: cos/sin of pos * theta^(-2i/d))."""

    def __init__(self, layer: AuthorsDiffAttn, theta: float):
        super().__init__()
        self.layer, self.theta = layer, theta

    def forward(self, x, **_):
        d = self.layer.d
        ang = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * self.theta ** (
            -torch.arange(0, d, 2, dtype=torch.float64) / d)
        return self.layer(x, (ang.cos().to(x.dtype), ang.sin().to(x.dtype)))


def authors_lm(state: dict, settings: dict, dtype, gqa: str = "flash") -> DiffTransformerLM:
    """An LM whose attention layers are the authors', each loaded strictly from its slice of the file."""
    cfg, a = unilm_to_ours(state, settings)[1], settings["attention"]
    lm = ours_from(unilm_to_ours(state, settings)[0], cfg, dtype)
    for depth, block in enumerate(lm.layers):
        layer = AuthorsDiffAttn(a["embed_dim"], depth, a["num_heads"], a["num_kv_heads"], gqa=gqa).to(dtype)
        prefix = a["prefix"].format(depth=depth)
        layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
        block.self_attn = _InOurBlock(layer, a["rotary"]["theta"])
    return lm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("gqa, tied", [(False, True), (True, False)], ids=["mha-tied", "gqa-untied"])
def test_the_authors_layers_compute_our_logits(gqa, tied, dtype):
    cfg = config(gqa=gqa, tied=tied, rope_theta=500.0)
    model = ours(cfg, dtype)
    state, settings = ours_to_unilm(model.state_dict(), cfg)
    assert ("lm_head.weight" in state) is not tied
    assert settings["attention"] | {"rotary": None} == dict(
        embed_dim=64, num_heads=4, num_kv_heads=2 if gqa else 4, head_dim=8, prefix="layers.{depth}.self_attn.",
        subln_eps=1e-5, lambda_init="0.8 - 0.6 * exp(-0.3 * depth)", rotary=None,
        gqa="flash: head i reads key components 2g, 2g+1 and value g of group g = i // n_rep")
    assert rel(logits(authors_lm(state, settings, dtype), ids()), logits(model, ids())) < TOL[dtype]


def test_with_gqa_the_naive_file_pairs_other_components():
    """multihead_diffattn.py's repeat_kv routes key components across groups when n_rep > 1: not this layout."""
    cfg = config(gqa=True)
    model = ours(cfg)
    state, settings = ours_to_unilm(model.state_dict(), cfg)
    assert rel(logits(authors_lm(state, settings, torch.float32, gqa="naive"), ids()), logits(model, ids())) > 1e-3
    mha = config()
    state, settings = ours_to_unilm(ours(mha).state_dict(), mha)  # n_rep = 1: both files agree
    assert rel(logits(authors_lm(state, settings, torch.float32, gqa="naive"), ids()),
               logits(authors_lm(state, settings, torch.float32), ids())) < 1e-6


@pytest.mark.parametrize("tied", [True, False])
def test_round_trips_are_exact(tied):
    cfg = config(gqa=True, tied=tied)
    model = ours(cfg)
    state, settings = ours_to_unilm(model.state_dict(), cfg)
    back, back_cfg = unilm_to_ours(state, settings)
    assert same_tensors(back, model.state_dict()) and back_cfg.to_dict() == cfg.to_dict() | {"attn_backend": "auto"}
    again, again_settings = ours_to_unilm(back, back_cfg)
    assert same_tensors(again, state) and again_settings == settings


@pytest.mark.parametrize("overrides, message", [
    (dict(attention="diff_no_headnorm"), "only the 'diff' kind has"),
    (dict(attention="transformer", num_attention_heads=8, num_key_value_heads=8), "only the 'diff' kind has"),
    (dict(lambda_init=0.5), "lambda_init=0.5 is a constant"),
    (dict(rms_norm_eps=1e-6), "head norm uses eps 1e-05"),
    (dict(attention="diff_retrofit", lambda_init=0.0, attention_head_dim=8, head_norm_ramp_steps=4),
     "only the 'diff' kind has"),
], ids=["no-headnorm", "transformer", "constant-lambda-init", "eps", "retrofit"])
def test_models_the_authors_code_cannot_express_are_refused(overrides, message):
    cfg = config(**overrides)
    with raises_one_line(ConversionError, message):
        ours_to_unilm(ours(cfg).state_dict(), cfg)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["attention"].update(subln_eps=1e-6), "attention.subln_eps=1e-06"),
    (lambda s: s["attention"].update(rotary={"interleaved": False, "theta": 1e4}), "rotates interleaved pairs"),
    (lambda s: s["attention"].update(lambda_init="0.8"), "attention.lambda_init='0.8'"),
    (lambda s: s["model"].pop("ffn_dim"), "lack 'ffn_dim'"),
    (lambda s: s["attention"].update(head_dim=16), "head_dim=16"),
    (lambda s: s.update(format="other"), "format 'other'"),
], ids=["eps", "rotary", "lambda-init", "missing", "head-dim", "format"])
def test_settings_claiming_other_semantics_are_refused(edit, message):
    cfg = config()
    state, settings = ours_to_unilm(ours(cfg).state_dict(), cfg)
    settings = {k: dict(v) if isinstance(v, dict) else v for k, v in settings.items()}
    edit(settings)
    with pytest.raises(ConversionError, match=message):
        unilm_to_ours(state, settings)


def test_a_tied_file_holding_a_head_is_refused():
    cfg = config(tied=False)
    state, settings = ours_to_unilm(ours(cfg).state_dict(), cfg)
    settings["model"]["tie_word_embeddings"] = True
    with pytest.raises(ConversionError, match="tie the embeddings but the file holds lm_head.weight"):
        unilm_to_ours(state, settings)
