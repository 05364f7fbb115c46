"""Retrofit: a pretrained Llama-family model (GQA) as a `diff_retrofit` DIFF model with the same logits.

Contract: `retrofit_llama(state, config)` is a pure function on a `LlamaForCausalLM` state dict (or a
safetensors file's, a tied head stored once) and its config.json dict; it returns our state dict (as
`DiffTransformerLM.state_dict()` lists it) and our `DiffTransformerConfig`, attention='diff_retrofit'.
At conversion the model computes the source's function: equal logits up to floating-point rounding
(the only differences are the order of a few additions, no approximation). Training then moves it
towards DIFF V1: λ is learnable from 0, and the head norm is ramped in by the trainer
(`head_norm_ramp_steps`, α = min(1, step / steps)); at α = 1 every layer is V1 arithmetic.

Why this embedding. V1 ties the dims to the width: h DIFF heads × 2 components × d = E, with h half
the baseline's heads. A pretrained model's heads cannot be paired that way (SmolLM2 has 9 query
heads; and two of its maps subtracted are not its function). So each source head i (dim D) becomes
DIFF head i with d = D (`attention_head_dim`, the one new config field; 2hd = 2E, not E):

- A1 is the source map: q1 = the source q head, k1 = its kv head (the same RoPE rows, permuted from
  rotate-half to interleaved as in convert/llama.py), scale d**-0.5 = D**-0.5, the source's own.
- A2 is new: k2 = a copy of k1 and q2 = 0 (`second_map="uniform"`: A2 starts as the uniform average
  over the visible prefix, the common-mode "noise" V1 subtracts; q2 gets gradients at once since k2 is
  not zero; q2 = k2 = 0 would be a saddle where neither ever moves), or q2 = q1 (`"copy"`: A2 = A1).
- λ = exp(lq1·lk1) − exp(lq2·lk2) + λ_init with λ_init = 0 (config lambda_init=0.0) and lq1 = lq2,
  lk1 = lk2 drawn N(0, 0.1²): λ = 0 exactly, and its gradient is not zero (zero vectors would be a
  saddle too). So (A1 − λ A2) V = A1 V.
- V has 2d per kv group: [v; v], the source value twice. out_proj reads [W_o; 0] per head: the first
  half is the source's output projection, the second zero, so the output is W_o A1 v exactly. The
  copy makes the head norm's RMS over 2d equal to the RMS over d of A1 v (so ramping the norm in acts
  like a per-head RMSNorm on the source's head), and the zero half breaks the symmetry between the
  two halves (W_o/2 twice would keep them equal forever) while still receiving gradients.
- The head norm (weight 1, (1 − λ_init) = 1) is not linear, so it cannot start as an identity; the
  kind blends it: o + α (RMSNorm(o) − o), α a buffer saved with the weights, 0 here.

Departures from V1 (docs/interop.md, "Retrofit"): heads are not halved (h = the source's heads, 2hd =
2E, so attention has twice the source's parameters); λ_init = 0, not the depth schedule; the head norm
is blended in by α (V1 only at α = 1). Everything else (striped components, GQA groups, d**-0.5,
scalar reparameterised λ, RMSNorm over 2d with one shared weight, causal RoPE per component) is V1's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from difftransformer.convert.llama import ConversionError, State, llama_to_ours, ours_state
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.norm import compute_dtype

SECOND_MAPS = ("uniform", "copy")
LAMBDA_STD = 0.1  # V1's init of the λ vectors


def retrofit_llama(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], *, second_map: str = "uniform",
                   head_norm_ramp_steps: int = 1000, seed: int = 0) -> tuple[State, DiffTransformerConfig]:
    """A `LlamaForCausalLM` checkpoint as a `diff_retrofit` model with the same logits (see the module doc).

    second_map: how A2 starts, "uniform" (q2 = 0, k2 = k1) or "copy" (q2 = q1, k2 = k1).
    head_norm_ramp_steps: the optimizer steps over which the trainer ramps the head norm in (0: never).
    seed: the λ vectors' draw (they cancel, so any seed gives the same function).
    """
    if second_map not in SECOND_MAPS:
        raise ConversionError(f"second_map={second_map!r} is not a way to start the second map; choose one of "
                              f"{', '.join(SECOND_MAPS)}")
    base, base_cfg = llama_to_ours(state, config)  # checks, names and the RoPE permutation, exactly
    H, KV, D = base_cfg.num_attention_heads, base_cfg.num_key_value_heads, base_cfg.head_dim
    ours_cfg = dataclasses.replace(base_cfg, attention="diff_retrofit", attention_head_dim=D, lambda_init=0.0,
                                   head_norm_ramp_steps=int(head_norm_ramp_steps))
    gen = torch.Generator().manual_seed(seed)
    out: State = {}
    for name, weight in base.items():
        if ".self_attn." not in name:
            out[name] = weight
            continue
        prefix, leaf = name.rsplit(".self_attn.", 1)
        p = prefix + ".self_attn."
        if leaf == "q_proj.weight":  # (H, 2, D, E): component 0 the source head, component 1 A2's query
            q = weight.view(H, D, -1)
            q2 = q if second_map == "copy" else torch.zeros_like(q)
            out[p + leaf] = torch.stack([q, q2], dim=1).reshape(2 * H * D, -1)
        elif leaf == "k_proj.weight":  # (KV, 2, D, E): both components the source kv head
            k = weight.view(KV, D, -1)
            out[p + leaf] = torch.stack([k, k], dim=1).reshape(2 * KV * D, -1)
        elif leaf == "v_proj.weight":  # (KV, 2D, E): the source value twice
            v = weight.view(KV, D, -1)
            out[p + leaf] = torch.cat([v, v], dim=1).reshape(2 * KV * D, -1)
        elif leaf == "out_proj.weight":  # (E, H, 2D): [W_o head i, 0]
            o = weight.view(weight.shape[0], H, D)
            out[p + leaf] = torch.cat([o, torch.zeros_like(o)], dim=2).reshape(weight.shape[0], 2 * H * D)
        else:
            raise ConversionError(f"unexpected attention tensor {name} in the converted Llama state")
        if leaf == "q_proj.weight":  # once per layer: λ vectors, head-norm weight, ramp coefficient
            f = compute_dtype(weight)
            lq = (torch.randn(D, generator=gen, dtype=torch.float64) * LAMBDA_STD).to(f)
            lk = (torch.randn(D, generator=gen, dtype=torch.float64) * LAMBDA_STD).to(f)
            out |= {p + "lambda_q1": lq, p + "lambda_k1": lk, p + "lambda_q2": lq.clone(), p + "lambda_k2": lk.clone(),
                    p + "subln.weight": torch.ones(2 * D, dtype=weight.dtype),
                    p + "head_norm_mix": torch.zeros((), dtype=f)}
    return ours_state(out, ours_cfg), ours_cfg


@torch.no_grad()
def calibrate_head_norm(model: DiffTransformerLM, input_ids: torch.Tensor, batch: int = 1) -> list[float]:
    """Set every layer's head-norm weight w to the least-squares fit of w ∘ RMSNorm(o) ≈ o over the head
    outputs o the model computes on `input_ids` (B, T): w_j = Σ o_j n_j / Σ n_j², n = RMSNorm(o) without
    weight, summed over tokens and heads, divided by (1 − λ_init). Returns each layer's mean w.

    Why: with weight 1 the norm's output has RMS 1 per head while a pretrained head's output is much
    smaller, so ramping α in would scale every attention output up by that ratio (SmolLM2: held-out
    perplexity 35 -> 7.7 M at α = 1). Fitted, α moves the function only by how much a head's RMS varies
    between tokens. Nothing changes at α = 0: the function at conversion stays the source's. A `diff_retrofit`
    model at α = 0 only (the head norm's input is then the out_proj input, which this reads by a hook)."""
    layers = [block.self_attn for block in model.layers]
    if not model.config.kind.head_norm_ramp or any(float(a.head_norm_mix) != 0.0 for a in layers):
        raise ValueError(f"calibrate_head_norm needs a 'diff_retrofit' model at head-norm mix α = 0 (right after "
                         f"retrofit_llama); got attention={model.config.attention!r}")
    sums: dict[int, list[torch.Tensor]] = {}

    def hook(index: int, attn, d2: int):
        def record(module, inputs):
            o = inputs[0].double().reshape(-1, d2)  # (tokens * heads, 2d)
            n = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + attn.subln.eps)
            acc = sums.setdefault(index, [torch.zeros(d2, dtype=torch.float64), torch.zeros(d2, dtype=torch.float64)])
            acc[0] += (o * n).sum(0).cpu()
            acc[1] += n.pow(2).sum(0).cpu()
        return record

    handles = [a.out_proj.register_forward_pre_hook(hook(i, a, 2 * a.head_dim)) for i, a in enumerate(layers)]
    try:
        for start in range(0, input_ids.shape[0], batch):
            model(input_ids[start:start + batch])
    finally:
        for h in handles:
            h.remove()
    means = []
    for i, a in enumerate(layers):
        num, den = sums[i]
        w = num / den.clamp_min(1e-30) / (1.0 - a.lambda_init)
        a.subln.weight.copy_(w.to(a.subln.weight.dtype))
        means.append(float(w.mean()))
    return means
