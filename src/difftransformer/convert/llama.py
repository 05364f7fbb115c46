"""transformers' `LlamaForCausalLM` ⇄ our `transformer` kind, exactly; and the Llama-family pieces the
other converters share (state checks, the RoPE row permutation, the model-level names).

Contract: pure functions on state dicts. `llama_to_ours(state, config)` takes the tensors of a Llama
checkpoint (`LlamaForCausalLM.state_dict()`, or a safetensors file's, where a tied `lm_head.weight`
may be left out) and its config.json as a dict; it returns our state dict (as
`DiffTransformerLM.state_dict()` lists it: a tied head under both names, the same tensor) and our
`DiffTransformerConfig`. `ours_to_llama` is the inverse and returns a dict that
`LlamaConfig.from_dict` reads (transformers 4.56 and 5). Nothing is approximated: a model that one
side cannot express (biases, another activation, scaled RoPE, a head norm, an output gate, a differential kind) is a
`ConversionError` naming the value, the rule and what to do; tensors keep their dtype, and a round
trip gives back every tensor bit for bit.

Why a permutation: both sides rotate pairs of q/k features by the same angles, but Llama pairs
feature j with j + d/2 of each head ("rotate half") and we pair 2j with 2j + 1 (GPT-J's interleaved
layout, the authors'). Reordering the rows of q_proj and k_proj within each head, our row 2j = Llama
row j and our row 2j + 1 = Llama row j + d/2, makes the rotated q·k products identical (the same
permutation on q and k leaves every dot product unchanged), so attention is unchanged. v_proj and
o_proj are untouched.

Names (ours ← Llama): `X` ← `model.X` for every tensor except `lm_head.weight` (the same name) and
`layers.N.self_attn.out_proj.weight` ← `model.layers.N.self_attn.o_proj.weight`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from difftransformer.model import DiffTransformerConfig, DiffTransformerLM

State = dict[str, torch.Tensor]
HF_PREFIX = "model."
# Buffers older transformers versions saved beside the weights; they are recomputed, never needed.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LLAMA_ARCHITECTURE = "LlamaForCausalLM"


class ConversionError(ValueError):
    """A checkpoint that cannot be converted exactly (a one-line message naming the value and the fix)."""


# -- shared: checks ------------------------------------------------------------------------------

def check_state(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Every expected tensor present with its shape and nothing else (IGNORED_SUFFIXES aside)."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(k for k in set(state) - set(expected) if not k.endswith(IGNORED_SUFFIXES))
    if missing or extra:
        parts = ([f"missing {_few(missing)}"] if missing else []) + ([f"unexpected {_few(extra)}"] if extra else [])
        raise ConversionError(f"the tensors do not match the {what} its config describes: {'; '.join(parts)}; "
                              f"was the config edited, or copied from another model?")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ConversionError(f"{name} has shape {tuple(state[name].shape)} but the {what} its config describes "
                                  f"needs {tuple(shape)}; was the config edited, or copied from another model?")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def ours_expected(config: DiffTransformerConfig) -> dict[str, tuple[int, ...]]:
    """Our state-dict names and shapes for `config` (the model built on the meta device: no memory)."""
    meta = DiffTransformerLM(dataclasses.replace(config, attn_backend="eager"), device="meta")
    return {k: tuple(v.shape) for k, v in meta.state_dict().items()}


def with_tied_head(state: Mapping[str, torch.Tensor], tied: bool, embed: str, head: str) -> State:
    """`state` with a tied LM head under both names (a file stores it once, under either)."""
    state = dict(state)
    if tied:
        if embed in state and head in state and not torch.equal(state[embed], state[head]):
            raise ConversionError(f"the config ties the embeddings (tie_word_embeddings=true) but {embed} and {head} "
                                  f"differ; set tie_word_embeddings to false in config.json")
        weight = state.get(embed, state.get(head))
        if weight is not None:
            state[embed] = state[head] = weight
    return state


def ours_state(state: Mapping[str, torch.Tensor], config: DiffTransformerConfig) -> State:
    """Our tensors, checked against `config` (a tied head under both names)."""
    state = with_tied_head(state, config.tie_word_embeddings, "embed_tokens.weight", "lm_head.weight")
    expected = ours_expected(config)
    check_state(state, expected, f"{config.attention!r} model")
    return {name: state[name] for name in expected}


# -- shared: RoPE layout ---------------------------------------------------------------------------

def _pairs_perm(d: int) -> torch.Tensor:
    """perm[2j] = j, perm[2j+1] = j + d/2: the rotate-half feature order read in interleaved pairs."""
    return torch.arange(d).view(2, d // 2).t().reshape(-1)


def rotate_half_to_interleaved(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection, each block of head_dim rows reordered from rotate-half to interleaved."""
    return weight.view(-1, head_dim, weight.shape[-1])[:, _pairs_perm(head_dim)].reshape(weight.shape)


def interleaved_to_rotate_half(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `rotate_half_to_interleaved`."""
    inverse = torch.argsort(_pairs_perm(head_dim))
    return weight.view(-1, head_dim, weight.shape[-1])[:, inverse].reshape(weight.shape)


# -- shared: names and configs of the Llama family -------------------------------------------------

def hf_name(ours: str) -> str:
    """The Llama-family name of one of our tensors (the attention's out_proj is transformers' o_proj)."""
    if ours == "lm_head.weight":
        return ours
    return HF_PREFIX + ours.replace(".self_attn.out_proj.", ".self_attn.o_proj.")


def hf_rope_theta(config: Mapping[str, Any], source: str) -> float:
    """theta of plain RoPE from a transformers config (5.x `rope_parameters`, 4.x `rope_theta` +
    `rope_scaling`); scaled RoPE variants are refused (we implement the unscaled rotation only)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ConversionError(f"{source} uses RoPE type {rope_type!r}; only the plain rotation ('default') "
                              f"converts exactly, as our RoPE has no scaling")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if "rope_theta" in params and "rope_theta" in config and float(config["rope_theta"]) != float(params["rope_theta"]):
        raise ConversionError(f"{source} gives two RoPE thetas ({config['rope_theta']} and {params['rope_theta']}); "
                              f"keep one in config.json")
    return float(theta)


def hf_fields(config: Mapping[str, Any], model_type: str, source: str, eps: float) -> dict[str, Any]:
    """Our config fields from a Llama-family config.json, after refusing what we cannot express
    (`eps`: the class's default rms_norm_eps, for a config that leaves it out)."""
    if config.get("model_type") != model_type:
        raise ConversionError(f"{source} has model_type {config.get('model_type')!r}, not {model_type!r}")
    refuse = [("hidden_act", "silu", "our MLP is SwiGLU (silu gate)"),
              ("attention_bias", False, "our projections have no bias"),
              ("mlp_bias", False, "our MLP has no bias")]
    for key, allowed, why in refuse:
        if config.get(key, allowed) != allowed:
            raise ConversionError(f"{source} sets {key}={config[key]!r}; only {allowed!r} converts exactly ({why})")
    if float(config.get("attention_dropout") or 0.0) != 0.0:  # the logits convert; training would not
        raise ConversionError(f"{source} sets attention_dropout={config['attention_dropout']}; only 0 converts "
                              f"(our attention has no dropout)")
    need = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if not isinstance(config.get(k), int) or isinstance(config.get(k), bool) or config[k] <= 0]
    if need:
        raise ConversionError(f"{source} lacks a positive integer {', '.join(need)}; is it a complete config.json?")
    E, H = config["hidden_size"], config["num_attention_heads"]
    kv = int(config.get("num_key_value_heads") or H)
    head_dim = int(config.get("head_dim") or E // H)
    if head_dim * H != E:
        raise ConversionError(f"{source} has head_dim={head_dim} with {H} heads for hidden_size={E}; we need "
                              f"head_dim * num_attention_heads == hidden_size")
    if head_dim % 2 or H % kv:
        raise ConversionError(f"{source}: head_dim ({head_dim}) must be even and num_attention_heads ({H}) a "
                              f"multiple of num_key_value_heads ({kv})")
    return dict(vocab_size=config["vocab_size"], hidden_size=E, num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=H, num_key_value_heads=kv, intermediate_size=config["intermediate_size"],
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                rope_theta=hf_rope_theta(config, source), rms_norm_eps=float(config.get("rms_norm_eps", eps)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                initializer_range=float(config.get("initializer_range", 0.02)))


def hf_config(config: DiffTransformerConfig, model_type: str, architecture: str, heads: int, kv_heads: int,
              head_dim: int, **extra: Any) -> dict[str, Any]:
    """A Llama-family config.json dict for `config` (rope written both ways: transformers 5 and 4.x)."""
    return dict(model_type=model_type, architectures=[architecture], vocab_size=config.vocab_size,
                hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, hidden_act="silu", max_position_embeddings=config.max_position_embeddings,
                initializer_range=config.initializer_range, rms_norm_eps=config.rms_norm_eps,
                tie_word_embeddings=config.tie_word_embeddings, attention_bias=False, attention_dropout=0.0,
                rope_theta=config.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)


def hf_expected(ours_shapes: Mapping[str, tuple[int, ...]], attention: Mapping[str, tuple[int, ...]]) -> dict:
    """A Llama-family checkpoint's names and shapes: our block tensors renamed, plus `attention` (HF names)."""
    blocks = {hf_name(n): s for n, s in ours_shapes.items() if ".self_attn." not in n}
    return {**blocks, **attention}


# -- Llama ⇄ ours ----------------------------------------------------------------------------------

def _llama_attention(config: DiffTransformerConfig) -> dict[str, tuple[int, ...]]:
    E, d = config.hidden_size, config.head_dim
    kv = config.num_key_value_heads * d
    out = {}
    for i in range(config.num_hidden_layers):
        p = f"{HF_PREFIX}layers.{i}.self_attn."
        out |= {p + "q_proj.weight": (E, E), p + "k_proj.weight": (kv, E), p + "v_proj.weight": (kv, E),
                p + "o_proj.weight": (E, E)}
    return out


def llama_to_ours(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> tuple[State, DiffTransformerConfig]:
    """A `LlamaForCausalLM` checkpoint as our `transformer` kind (same function, exactly)."""
    fields = hf_fields(config, "llama", "the Llama config", 1e-6)
    ours_config = DiffTransformerConfig(attention="transformer", **fields)
    state = with_tied_head(state, ours_config.tie_word_embeddings, HF_PREFIX + "embed_tokens.weight", "lm_head.weight")
    shapes = ours_expected(ours_config)
    check_state(state, hf_expected(shapes, _llama_attention(ours_config)), "Llama model")
    d, out = ours_config.head_dim, {}
    for name in shapes:
        weight = state[hf_name(name)]
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = rotate_half_to_interleaved(weight, d)
        out[name] = weight
    return out, ours_config


def ours_to_llama(state: Mapping[str, torch.Tensor], config: DiffTransformerConfig) -> tuple[State, dict[str, Any]]:
    """Our `transformer` kind as a `LlamaForCausalLM` checkpoint + its config.json dict (exactly)."""
    if config.attention != "transformer":
        raise ConversionError(_not_llama(config.attention))
    check_rope(config, "LlamaForCausalLM")
    state = ours_state(state, config)
    d, out = config.head_dim, {}
    for name, weight in state.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = interleaved_to_rotate_half(weight, d)
        out[hf_name(name)] = weight
    return out, hf_config(config, "llama", LLAMA_ARCHITECTURE, config.num_attention_heads,
                          config.num_key_value_heads, d, mlp_bias=False, pretraining_tp=1)


def check_rope(config: DiffTransformerConfig, target: str) -> None:
    """A ConversionError unless `config` rotates q and k with RoPE, the only position encoding `target` has."""
    if config.position_encoding != "rope":
        raise ConversionError(f"position_encoding={config.position_encoding!r}: {target} always applies RoPE, so "
                              f"only models with position_encoding 'rope' convert")


def _not_llama(attention: str) -> str:
    if attention in ("diff", "diff_no_headnorm", "diff_v2"):
        where = ("convert it to DiffLlama or the authors' layout instead" if attention == "diff"
                 else "no transformers class holds this kind")
        return (f"a {attention!r} model is differential; LlamaForCausalLM is ordinary attention and cannot hold "
                f"it ({where})")
    if attention == "transformer_ssmax":
        return (f"attention {attention!r} scales each query by s log n (scalable softmax), which LlamaForCausalLM "
                f"lacks (dropping it would change the model); only the 'transformer' kind converts to Llama")
    if attention == "transformer_gated":
        return (f"attention {attention!r} gates each head's output with a sigmoid that LlamaForCausalLM lacks "
                f"(dropping the gate would change the model); only the 'transformer' kind converts to Llama")
    return (f"attention {attention!r} has a head-wise RMSNorm that LlamaForCausalLM lacks, and a norm cannot be "
            f"folded into a linear layer; only the 'transformer' kind converts to Llama")
