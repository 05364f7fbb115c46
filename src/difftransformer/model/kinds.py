"""The one table of attention kinds: what each kind is, read by modeling, configs, the trainer and reports.

A kind answers four questions (the table), and three features belong to one kind each (below it):

| kind                   | differential | scalar λ | head norm | V2  | heads counted as          |
|------------------------|--------------|----------|-----------|-----|---------------------------|
| `diff`                 | yes          | yes      | yes       | no  | DIFF heads (half of 2h)   |
| `diff_no_headnorm`     | yes          | yes      | no        | no  | DIFF heads                |
| `diff_v2`              | yes          | no       | no        | yes | the baseline's heads      |
| `transformer`          | no           | no       | no        | no  | ordinary heads            |
| `transformer_headnorm` | no           | no       | yes       | no  | ordinary heads            |
| `diff_retrofit`        | yes          | yes      | ramped    | no  | DIFF heads (the source's) |
| `transformer_gated`    | no           | no       | no        | no  | ordinary heads (+ gate)   |
| `transformer_ssmax`    | no           | no       | no        | no  | ordinary heads (+ s/head) |

- differential: each output is one softmax map minus λ times another.
- scalar λ: one learnable λ per layer, λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init (V1). A per-token
  sigmoid λ (V2) is not scalar.
- head norm: a head-wise RMSNorm after attention (V1's, or the baseline's ablation).
- V2: the DIFF V2 layer (2H query heads paired inside one ordinary attention call).
- head-norm ramp (`diff_retrofit` only): the head norm is blended in as o + α (norm(o) − o), α a
  buffer the trainer ramps from 0 to 1 (`head_norm_ramp_steps`), so a retrofitted pretrained model
  (convert/llama_retrofit.py) computes its source's function at α = 0 and exact V1 arithmetic at α = 1.
- output gate (`transformer_gated` only): the control the paper lacks, asking whether DIFF's gain is
  only a nonlinearity before the output projection. Gated Attention (Qiu et al. 2025, arXiv
  2505.06708) at the position it recommends (G1: after scaled-dot-product attention, before o_proj),
  head-wise: o_h <- sigmoid(x W_g)_h * o_h, x the layer's (pre-normed) input, W_g: hidden -> heads
  without bias (the reference code puts these rows in q_proj, with q_proj's bias: none here, as our
  projections have none). One extra hidden x heads matrix per layer, initialised like every linear
  layer; not expressible as Llama/DiffLlama, so the converters refuse it.
- scalable softmax (`transformer_ssmax` only): a control that fixes attention dispersion without any
  subtraction. Scalable-Softmax (SSMax, Nakanishi 2025, arXiv 2501.19399) multiplies each query's
  logits by s_h log n, n the number of keys that query attends (causal: p + 1 at absolute position p
  without padding; only the visible keys with key padding; cached keys count), s_h one learned scalar
  per head (`ssmax_scale`, fp32 like λ). Computed as a query scaling, q_t <- (s_h log n_t) q_t, so the
  ordinary attention call of every backend computes it; equal to softmax attention where s_h log n = 1.
  `heads` extra parameters per layer; not expressible as Llama/DiffLlama, so the converters refuse it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionKind:
    name: str
    description: str
    differential: bool
    scalar_lambda: bool
    head_norm: bool
    v2: bool
    head_norm_ramp: bool = False  # head norm blended in by a ramp coefficient α (diff_retrofit)
    output_gate: bool = False  # a per-head sigmoid gate on the attention output (transformer_gated)
    scalable_softmax: bool = False  # queries scaled by s_h log n, s_h learned per head (transformer_ssmax)

    @property
    def diff_heads(self) -> bool:
        """Head counts are DIFF V1 heads (two q/k components each), half the matched baseline's."""
        return self.differential and not self.v2

    @property
    def fused_kernel(self) -> bool:
        """Runs `differential_attention` (V1), so the fused Triton kernel and its backward options apply: the
        kinds whose heads are DIFF V1 heads."""
        return self.diff_heads


ATTENTION_KINDS: dict[str, AttentionKind] = {k.name: k for k in (
    AttentionKind("diff", "DIFF Transformer V1: differential heads, head-wise RMSNorm, (1 - lambda_init) scale",
                  differential=True, scalar_lambda=True, head_norm=True, v2=False),
    AttentionKind("diff_no_headnorm", "ablation: DIFF V1 without the head-wise RMSNorm (the (1 - lambda_init) "
                  "scale kept)",
                  differential=True, scalar_lambda=True, head_norm=False, v2=False),
    AttentionKind("diff_v2", "DIFF V2: 2H query heads paired in-group, per-token sigmoid lambda, no head norm",
                  differential=True, scalar_lambda=False, head_norm=False, v2=True),
    AttentionKind("transformer", "the matched Transformer baseline (ordinary multi-head attention)",
                  differential=False, scalar_lambda=False, head_norm=False, v2=False),
    AttentionKind("transformer_headnorm", "ablation: the baseline with a head-wise RMSNorm",
                  differential=False, scalar_lambda=False, head_norm=True, v2=False),
    AttentionKind("diff_retrofit", "DIFF V1 retrofitted onto a pretrained Llama: explicit head_dim, head norm "
                  "ramped in by alpha (0 at conversion), see convert/llama_retrofit.py",
                  differential=True, scalar_lambda=True, head_norm=True, v2=False, head_norm_ramp=True),
    AttentionKind("transformer_gated", "control: the baseline with a per-head sigmoid gate on the attention "
                  "output (Gated Attention, Qiu et al. 2025, G1 head-wise): a nonlinearity before o_proj, "
                  "nothing differential",
                  differential=False, scalar_lambda=False, head_norm=False, v2=False, output_gate=True),
    AttentionKind("transformer_ssmax", "control: the baseline with scalable softmax (SSMax, Nakanishi 2025): "
                  "logits times s log n, n the keys attended, s learned per head; nothing differential",
                  differential=False, scalar_lambda=False, head_norm=False, v2=False, scalable_softmax=True),
)}


def attention_kind(name: str, what: str = "attention kind") -> AttentionKind:
    """The kind called `name`; an unknown name is a ValueError with the nearest valid one and the list."""
    kind = ATTENTION_KINDS.get(name)
    if kind is None:
        close = difflib.get_close_matches(str(name), list(ATTENTION_KINDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {what} {name!r}{hint}; choose one of {', '.join(ATTENTION_KINDS)}")
    return kind
