"""Our `diff` kind ⇄ the authors' reference layout (microsoft/unilm, Diff-Transformer/), exactly.

The authors publish the attention layer only (`multihead_diffattn.py`: `MultiheadDiffAttn`, and the
flash versions `multihead_flashdiff_1.py` / `_2.py`, which they recommend); they publish no LM around
it. This layout is therefore defined at two levels.

Attention level (the authors' own). For layer N, the tensors under `layers.N.self_attn.` are exactly
the state dict of `MultiheadDiffAttn(embed_dim=E, depth=N, num_heads=h, num_kv_heads=h_kv)` (and of
`MultiheadFlashDiff1` with `decoder_kv_attention_heads=h_kv`), h counted in DIFF heads, d = E/(2h),
n_rep = h/h_kv; `load_state_dict(strict=True)` takes them after the prefix is stripped:

    q_proj.weight   (E, E)          rows: 2h components of d, component c of head i at 2i + c
    k_proj.weight   (E/n_rep, E)    rows: 2h_kv components of d, component c of group g at 2g + c
    v_proj.weight   (E/n_rep, E)    rows: h_kv values of 2d
    out_proj.weight (E, E)          columns: head i's 2d outputs at [2d·i, 2d·(i+1))
    lambda_q1, lambda_k1, lambda_q2, lambda_k2  (d,)   (fp32 in their code; kept in their dtype here)
    subln.weight    (2d,)           the head-wise RMSNorm's weight (eps 1e-5, fixed in their code)

with their semantics: RoPE `apply_rotary_emb(..., interleaved=True)` (GPT-J pairs, as ours),
λ_init = 0.8 − 0.6·exp(−0.3·N) (their only schedule), output `(1 − λ_init)·subln(attn)` → out_proj.
These are our names and our layout, so the attention tensors are copied unchanged.

GQA: the flash files give head i the two key components of group i // n_rep (ours, and the
semantics this layout means). The naive `multihead_diffattn.py` instead repeats the 2h_kv key
components n_rep times each, so with n_rep > 1 it pairs components of different groups: for GQA
models load the tensors into `MultiheadFlashDiff1` (or any flash-semantics layer). With h_kv = h
both files compute the same function.

Model level (ours, as the paper describes the LM: LLaMA layout, pre-RMSNorm, SwiGLU, no biases):
`embed_tokens.weight`, `layers.N.input_layernorm.weight`, `layers.N.post_attention_layernorm.weight`,
`layers.N.mlp.{gate,up,down}_proj.weight`, `norm.weight`, and `lm_head.weight` unless the embeddings
are tied (then it is left out: one matrix, as the paper counts it).

The settings (a JSON dict, `SETTINGS_NAME` beside the safetensors file): {"format": FORMAT,
"format_version": 1, "attention": {the constructor arguments embed_dim, num_heads, num_kv_heads,
and head_dim, prefix, subln_eps, lambda_init, rotary, gqa}, "model": {vocab_size, num_layers,
ffn_dim, rms_norm_eps, tie_word_embeddings, max_positions, initializer_range}}. Reading checks every fixed value
(a file that claims other semantics is refused, not reinterpreted).

Refused (ConversionError): kinds other than `diff` (their layer always has the weighted head norm
and a scalar λ), a constant λ_init (their code has the depth schedule only), and rms_norm_eps ≠ 1e-5
(their head norm's eps is fixed at 1e-5, and our model uses one eps for every norm).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from difftransformer.convert.llama import ConversionError, State, check_rope, check_state, ours_expected, ours_state
from difftransformer.model import DiffTransformerConfig

FORMAT = "unilm-diff-transformer"
FORMAT_VERSION = 1
SETTINGS_NAME = "unilm_settings.json"
SUBLN_EPS = 1e-5
LAMBDA_INIT = "0.8 - 0.6 * exp(-0.3 * depth)"
PREFIX = "layers.{depth}.self_attn."
# The attention settings every file of this layout has (written for the reader, checked when read).
FIXED = {"prefix": PREFIX, "subln_eps": SUBLN_EPS, "lambda_init": LAMBDA_INIT,
         "gqa": "flash: head i reads key components 2g, 2g+1 and value g of group g = i // n_rep"}


def _check_expressible(config: DiffTransformerConfig) -> None:
    if config.attention != "diff":
        raise ConversionError(f"attention {config.attention!r} cannot convert to the authors' layout: their "
                              f"MultiheadDiffAttn is DIFF V1 with a scalar λ and a weighted head-wise RMSNorm, "
                              f"which only the 'diff' kind has")
    if config.lambda_init is not None:
        raise ConversionError(f"lambda_init={config.lambda_init} is a constant; the authors' code fixes λ_init to "
                              f"{LAMBDA_INIT}, so only models with lambda_init null convert")
    check_rope(config, "the authors' layer")
    if config.rms_norm_eps != SUBLN_EPS:
        raise ConversionError(f"rms_norm_eps={config.rms_norm_eps}: the authors' head norm uses eps {SUBLN_EPS} and "
                              f"our model one eps for every norm, so only rms_norm_eps {SUBLN_EPS} converts")


def settings_of(config: DiffTransformerConfig) -> dict[str, Any]:
    """The settings dict of the layout for our `config` (checked to be expressible)."""
    _check_expressible(config)
    attention = dict(embed_dim=config.hidden_size, num_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, **FIXED,
                     rotary={"interleaved": True, "theta": config.rope_theta})
    model = dict(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers, ffn_dim=config.intermediate_size,
                 rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
                 max_positions=config.max_position_embeddings, initializer_range=config.initializer_range)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "attention": attention, "model": model}


def config_of(settings: Mapping[str, Any]) -> DiffTransformerConfig:
    """Our `diff` config for a settings dict; anything but the fixed semantics is refused."""
    if settings.get("format") != FORMAT or settings.get("format_version") != FORMAT_VERSION:
        raise ConversionError(f"the settings say format {settings.get('format')!r} version "
                              f"{settings.get('format_version')!r}; this reader knows {FORMAT!r} "
                              f"version {FORMAT_VERSION}")
    attention, model = dict(settings.get("attention") or {}), dict(settings.get("model") or {})
    rotary = attention.pop("rotary", None)
    for key, value in FIXED.items():
        if attention.get(key) != value:
            raise ConversionError(f"the settings give attention.{key}={attention.get(key)!r}; the authors' layer "
                                  f"(and this converter) has {value!r}")
    if not isinstance(rotary, dict) or rotary.get("interleaved") is not True:
        raise ConversionError(f"the settings give attention.rotary={rotary!r}; the authors' layer rotates "
                              f"interleaved pairs: {{\"interleaved\": true, \"theta\": ...}}")
    try:
        config = DiffTransformerConfig(
            vocab_size=model["vocab_size"], hidden_size=attention["embed_dim"], num_hidden_layers=model["num_layers"],
            num_attention_heads=attention["num_heads"], num_key_value_heads=attention.get("num_kv_heads"),
            attention="diff", intermediate_size=model["ffn_dim"], max_position_embeddings=model["max_positions"],
            rope_theta=float(rotary["theta"]), rms_norm_eps=float(model["rms_norm_eps"]),
            tie_word_embeddings=model["tie_word_embeddings"], lambda_init=None,
            initializer_range=float(model.get("initializer_range", 0.02)))
    except KeyError as e:
        raise ConversionError(f"the settings lack {e.args[0]!r}; see difftransformer.convert.unilm for "
                              f"the format") from None
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the settings do not describe a valid model: {e}") from None
    if attention.get("head_dim") not in (None, config.head_dim):
        raise ConversionError(f"the settings give head_dim={attention['head_dim']}, but embed_dim // num_heads // 2 "
                              f"= {config.head_dim}")
    _check_expressible(config)
    return config


def ours_to_unilm(state: Mapping[str, torch.Tensor], config: DiffTransformerConfig) -> tuple[State, dict[str, Any]]:
    """Our `diff` model in the authors' layout: (tensors, settings). The tensors are ours, unchanged."""
    settings = settings_of(config)
    state = ours_state(state, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state, settings


def unilm_to_ours(state: Mapping[str, torch.Tensor],
                  settings: Mapping[str, Any]) -> tuple[State, DiffTransformerConfig]:
    """Tensors in the authors' layout + their settings as our `diff` model (state dict, config)."""
    config = config_of(settings)
    expected = ours_expected(config)
    if config.tie_word_embeddings:
        if "lm_head.weight" in state:
            raise ConversionError("the settings tie the embeddings but the file holds lm_head.weight too; set "
                                  "model.tie_word_embeddings to false in the settings")
        expected.pop("lm_head.weight")
    check_state(state, expected, "authors'-layout model")
    return ours_state(state, config), config
