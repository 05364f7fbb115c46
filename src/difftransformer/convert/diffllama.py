"""transformers' `DiffLlamaForCausalLM` ⇄ our `diff` kind, exactly.

Contract: `diffllama_to_ours(state, config)` takes a DiffLlama checkpoint's tensors
(`DiffLlamaForCausalLM.state_dict()`, or a safetensors file's, where a tied `lm_head.weight` may be
left out) and its config.json as a dict, and returns our state dict and `DiffTransformerConfig`;
`ours_to_diffllama(state, config)` returns the tensors and a config dict that
`DiffLlamaConfig.from_dict` reads. Both compute the same function (checked by tests against
transformers' own class); tensors keep their dtype. DiffLlama → ours → DiffLlama gives back every
tensor bit for bit; ours → DiffLlama → ours does too when the head-norm weights are 1, and otherwise
gives the same logits with the weight folded into out_proj (see below).

What DiffLlama computes (transformers' modeling_diffllama.py), in its units: H = num_attention_heads
ordinary heads of dim d, H_kv kv heads, n = H / H_kv. Query head j attends with kv head j // n; the
two value halves V1 = kv heads [0, H_kv/2), V2 = [H_kv/2, H_kv) give head j the value
[v_{g mod H_kv/2}, v_{g mod H_kv/2 + H_kv/2}] (2d wide, g = j // n); output heads j and j + H/2 are
subtracted: out_i = A_i V − λ A_{i+H/2} V, then `(1 − λ_init) · RMSNorm_2d(out_i)` (no weight) and o_proj.
So, with h = H/2 DIFF heads and h_kv = H_kv/2 kv groups (n_rep = h / h_kv = n):

- our q component (i, 0) = DiffLlama q head i, component (i, 1) = q head i + h (striped: rows of head
  i are [q_i; q_{i+h}]); k likewise: group g = [k_g; k_{g+h_kv}]; our head i reads group i // n_rep,
  DiffLlama's heads i and i + h read kv heads g and g + h_kv: the same keys;
- our value of group g (2d) = [v head g; v head g + h_kv]: exactly the 2d value DiffLlama gives heads
  i and i + h;
- RoPE: DiffLlama rotates half, we interleave, so the rows of each d-block of q and k are permuted
  (see llama.py); v is not rotated;
- λ: the same reparameterisation and the same λ_init = 0.8 − 0.6·exp(−0.3·depth) (DiffLlama has no
  other), λ vectors copied as they are;
- head norm: ours is `RMSNorm(o, eps) · w · (1 − λ_init)` with a learnable w of 2d shared by the heads;
  DiffLlama's has no weight and the same eps (rms_norm_eps) and factor. The norm is followed by a linear
  map, so w folds exactly into out_proj's columns: o_proj[:, 2d·i + c] = out_proj[:, 2d·i + c] · w[c]
  (the product formed in float64, rounded once to the weight's dtype). Back, subln.weight = 1.

Refused (ConversionError), never approximated: kinds other than `diff` (no head norm, V2, the
baselines: DiffLlama always normalises and always subtracts two softmax maps), a constant λ_init
(DiffLlama's is fixed to the depth schedule), an odd num_key_value_heads or num_attention_heads (it
splits both into halves), biases, another activation, scaled RoPE, head_dim · H ≠ hidden_size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from difftransformer.convert.llama import (
    HF_PREFIX,
    ConversionError,
    State,
    check_rope,
    check_state,
    hf_config,
    hf_expected,
    hf_fields,
    hf_name,
    interleaved_to_rotate_half,
    ours_expected,
    ours_state,
    rotate_half_to_interleaved,
    with_tied_head,
)
from difftransformer.model import DiffTransformerConfig

DIFFLLAMA_ARCHITECTURE = "DiffLlamaForCausalLM"
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


# -- head layout -------------------------------------------------------------------------------------

def _halves_to_striped(weight: torch.Tensor, heads: int, rows: int) -> torch.Tensor:
    """Rows [head 0..heads-1 of the first half; of the second half] (each `rows` tall) -> head i's two
    blocks adjacent: [first_i; second_i] for every i."""
    return weight.view(2, heads, rows, -1).transpose(0, 1).reshape(weight.shape)


def _striped_to_halves(weight: torch.Tensor, heads: int, rows: int) -> torch.Tensor:
    return weight.view(heads, 2, rows, -1).transpose(0, 1).reshape(weight.shape)


def _attention_to_ours(state: Mapping[str, torch.Tensor], prefix: str, h: int, h_kv: int, d: int) -> State:
    """One layer's attention, DiffLlama names and layout -> ours (`prefix` is DiffLlama's)."""
    q = rotate_half_to_interleaved(_halves_to_striped(state[prefix + "q_proj.weight"], h, d), d)
    k = rotate_half_to_interleaved(_halves_to_striped(state[prefix + "k_proj.weight"], h_kv, d), d)
    v = _halves_to_striped(state[prefix + "v_proj.weight"], h_kv, d)
    o = state[prefix + "o_proj.weight"]
    out = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "out_proj.weight": o,
           "subln.weight": torch.ones(2 * d, dtype=o.dtype, device=o.device)}
    return out | {name: state[prefix + name] for name in LAMBDAS}


def _attention_to_diffllama(state: Mapping[str, torch.Tensor], prefix: str, h: int, h_kv: int, d: int) -> State:
    """One layer's attention, our names and layout -> DiffLlama's (`prefix` is ours); subln folded."""
    q = _striped_to_halves(interleaved_to_rotate_half(state[prefix + "q_proj.weight"], d), h, d)
    k = _striped_to_halves(interleaved_to_rotate_half(state[prefix + "k_proj.weight"], d), h_kv, d)
    v = _striped_to_halves(state[prefix + "v_proj.weight"], h_kv, d)
    out_proj, w = state[prefix + "out_proj.weight"], state[prefix + "subln.weight"]
    o = (out_proj.double() * w.double().repeat(h)).to(out_proj.dtype)
    out = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "o_proj.weight": o}
    return out | {name: state[prefix + name] for name in LAMBDAS}


# -- configs ---------------------------------------------------------------------------------------

def _ours_config(config: Mapping[str, Any]) -> DiffTransformerConfig:
    """Our `diff` config for a DiffLlama config.json (heads halved: DiffLlama counts ordinary heads)."""
    source = "the DiffLlama config"
    fields = hf_fields(config, "diffllama", source, 1e-5)
    H, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    if H % 2 or kv % 2:
        raise ConversionError(f"{source} has {H} heads and {kv} kv heads; DiffLlama pairs head i with i + H/2 and kv "
                              f"head g with g + H_kv/2, so both must be even (DiffLlama itself refuses odd kv heads)")
    return DiffTransformerConfig(**{**fields, "num_attention_heads": H // 2, "num_key_value_heads": kv // 2},
                                 attention="diff", lambda_init=None)


def _check_expressible(config: DiffTransformerConfig) -> None:
    """DiffLlama holds our `diff` kind with the depth schedule of λ_init, and nothing else."""
    if config.attention != "diff":
        why = {"diff_no_headnorm": "DiffLlama always applies its head-wise RMSNorm, and a norm cannot be removed "
                                   "by changing weights",
               "diff_v2": "DiffLlama is DIFF V1 (scalar λ, head norm); V2's per-token sigmoid λ has no place in it",
               "transformer": "it is ordinary attention: convert it to Llama instead",
               "transformer_headnorm": "it is ordinary attention with a head norm, which no transformers class "
                                       "holds",
               "transformer_gated": "it is ordinary attention with a per-head sigmoid output gate, which DiffLlama "
                                    "lacks (dropping the gate would change the model)",
               "transformer_ssmax": "it is ordinary attention with scalable softmax (queries times s log n), "
                                    "which DiffLlama lacks"}.get(
            config.attention, "no transformers class holds this kind")
        raise ConversionError(f"attention {config.attention!r} cannot convert to DiffLlama: {why}; only 'diff' does")
    if config.lambda_init is not None:
        raise ConversionError(f"lambda_init={config.lambda_init} is a constant; DiffLlama fixes λ_init to the depth "
                              f"schedule 0.8 - 0.6 exp(-0.3 depth), so only models with lambda_init null convert")
    check_rope(config, "DiffLlamaForCausalLM")


def _diffllama_expected(config: DiffTransformerConfig) -> dict[str, tuple[int, ...]]:
    E, d, kv = config.hidden_size, config.head_dim, 2 * config.num_key_value_heads * config.head_dim
    attention = {}
    for i in range(config.num_hidden_layers):
        p = f"{HF_PREFIX}layers.{i}.self_attn."
        attention |= {p + "q_proj.weight": (E, E), p + "k_proj.weight": (kv, E), p + "v_proj.weight": (kv, E),
                      p + "o_proj.weight": (E, E)} | {p + name: (d,) for name in LAMBDAS}
    return hf_expected(ours_expected(config), attention)


# -- the converters --------------------------------------------------------------------------------

def diffllama_to_ours(state: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any]) -> tuple[State, DiffTransformerConfig]:
    """A `DiffLlamaForCausalLM` checkpoint as our `diff` kind (same function, exactly)."""
    ours_config = _ours_config(config)
    state = with_tied_head(state, ours_config.tie_word_embeddings, HF_PREFIX + "embed_tokens.weight", "lm_head.weight")
    check_state(state, _diffllama_expected(ours_config), "DiffLlama model")
    h, h_kv, d = ours_config.num_attention_heads, ours_config.num_key_value_heads, ours_config.head_dim
    out = {}
    for name in ours_expected(ours_config):
        if ".self_attn." not in name:
            out[name] = state[hf_name(name)]
    for i in range(ours_config.num_hidden_layers):
        attention = _attention_to_ours(state, f"{HF_PREFIX}layers.{i}.self_attn.", h, h_kv, d)
        out |= {f"layers.{i}.self_attn.{k}": v for k, v in attention.items()}
    return out, ours_config


def ours_to_diffllama(state: Mapping[str, torch.Tensor],
                      config: DiffTransformerConfig) -> tuple[State, dict[str, Any]]:
    """Our `diff` kind as a `DiffLlamaForCausalLM` checkpoint + its config.json dict (same function)."""
    _check_expressible(config)
    state = ours_state(state, config)
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = {hf_name(name): weight for name, weight in state.items() if ".self_attn." not in name}
    for i in range(config.num_hidden_layers):
        attention = _attention_to_diffllama(state, f"layers.{i}.self_attn.", h, h_kv, d)
        out |= {f"{HF_PREFIX}layers.{i}.self_attn.{k}": v for k, v in attention.items()}
    return out, hf_config(config, "diffllama", DIFFLLAMA_ARCHITECTURE, 2 * h, 2 * h_kv, d, lambda_std_dev=0.1)
