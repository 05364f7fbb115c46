"""The decoder-only LM shared by DIFF and the matched Transformer (LLaMA layout, no biases).

    h   = x + Attention(RMSNorm(x))
    out = h + SwiGLU(RMSNorm(h))

Parameter names follow Hugging Face's LLaMA modeling file (embed_tokens, layers.N.self_attn,
mlp.gate_proj/up_proj/down_proj, input_layernorm, post_attention_layernorm, norm, lm_head);
inside self_attn the names are the DIFF reference code's (q_proj ... out_proj, lambda_*, subln).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from difftransformer.attention import KVCache, MultiheadAttention, MultiheadDiffAttention, MultiheadDiffAttentionV2
from difftransformer.model.config import DiffTransformerConfig
from difftransformer.model.generation import generate
from difftransformer.model.inputs import check_input_ids, keep_last_positions, last_rows_kept
from difftransformer.model.serialization import load_weights, read_pretrained, save_pretrained
from difftransformer.norm import RMSNorm

IGNORE_INDEX = -100  # a target that is not scored (PyTorch's and transformers' convention)


@torch.no_grad()
def raise_head_norm_mix(layers: nn.ModuleList, config: DiffTransformerConfig, step: int) -> None:
    """diff_retrofit's head-norm ramp before optimizer step `step`: every layer's mix α raised to
    min(1, step / head_norm_ramp_steps), never lowered (on the device, no host sync); other kinds, and a ramp of 0
    steps, are left as they are."""
    steps = config.head_norm_ramp_steps
    if not (config.kind.head_norm_ramp and steps):
        return
    alpha = min(1.0, max(0, step) / steps)
    for block in layers:
        block.self_attn.head_norm_mix.clamp_(min=alpha)


class SwiGLU(nn.Module):
    """(silu(x Wg) * (x W1)) W2."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_attention(config: DiffTransformerConfig, depth: int, device=None, dtype=None) -> nn.Module:
    """The one place that maps `config.attention` (a row of the kinds table) to a layer."""
    common = dict(rope_theta=config.rope_theta, position_encoding=config.position_encoding, backend=config.attn_backend,
                  max_seq_len=config.max_position_embeddings, device=device, dtype=dtype)
    E, H, KV = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    kind = config.kind
    if kind.v2:
        return MultiheadDiffAttentionV2(E, depth, H, KV, **common)
    if kind.differential:
        return MultiheadDiffAttention(E, depth, H, KV, lambda_init=config.lambda_init, head_norm=kind.head_norm,
                                      norm_eps=config.rms_norm_eps, deterministic=config.attn_deterministic,
                                      head_dim=config.attention_head_dim, head_norm_ramp=kind.head_norm_ramp,
                                      **common)
    return MultiheadAttention(E, depth, H, KV, head_norm=kind.head_norm, norm_eps=config.rms_norm_eps,
                              output_gate=kind.output_gate, scalable_softmax=kind.scalable_softmax,
                              ssmax_init_length=config.ssmax_init_length, **common)


class DecoderBlock(nn.Module):
    def __init__(self, config: DiffTransformerConfig, depth: int, device=None, dtype=None):
        super().__init__()
        E, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(E, eps, device=device, dtype=dtype)
        self.self_attn = build_attention(config, depth, device, dtype)
        self.post_attention_layernorm = RMSNorm(E, eps, device=device, dtype=dtype)
        self.mlp = SwiGLU(E, config.intermediate_size, device, dtype)

    def forward(self, x, *, attention_mask=None, position_ids=None, kv_cache=None, return_attention=False,
                outputs_to_keep: int = 0):
        """x (B, T, E) -> (B, T, E); outputs_to_keep n > 0: the last n positions' outputs only, (B, n, E), the
        attention still reading (and caching) every position's keys and values; exact (see the attention)."""
        res = self.self_attn(self.input_layernorm(x), attention_mask=attention_mask, position_ids=position_ids,
                             kv_cache=kv_cache, return_attention=return_attention, outputs_to_keep=outputs_to_keep)
        a, maps = res if return_attention else (res, None)
        h = x[:, -a.shape[1]:] + a
        out = h + self.mlp(self.post_attention_layernorm(h))
        return (out, maps) if return_attention else out


def _check_dtype(dtype) -> None:
    """None (torch's default) or a floating-point torch.dtype: parameters train, so they are floats; anything
    else would fail inside torch on the first parameter, naming neither the argument nor the fix."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, torch.float16 "
                        f"or torch.float64) or None for the default; got {dtype!r}")


class LayerLambda(NamedTuple):
    """One layer's scalar λ now, and the λ_init it started from (and that scales its head-norm output)."""

    value: float
    init: float


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: list | None = None  # one AttentionMaps per layer when asked for
    kv_cache: KVCache | None = None


class DiffTransformerLM(nn.Module):
    """Token embedding -> N decoder blocks -> final RMSNorm -> LM head (optionally tied)."""

    def __init__(self, config: DiffTransformerConfig, device=None, dtype=None):
        super().__init__()
        _check_dtype(dtype)
        self.config = config
        E = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, E, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderBlock(config, i, device, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(E, config.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = nn.Linear(E, config.vocab_size, bias=False, device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, initializer_range) for linear and embedding weights (the output gate's W_g too, so a gated
        model starts with every gate near sigmoid(0) = 1/2); lambda vectors N(0, 0.1); norms 1; SSMax's s
        1 / log(ssmax_init_length)."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)
            elif isinstance(m, MultiheadDiffAttention):
                m.reset_lambda_parameters()
            elif isinstance(m, MultiheadAttention):
                m.reset_ssmax_parameters()

    def num_parameters(self, count_embedding_once: bool = True) -> int:
        """Parameter count; a tied embedding/LM head matrix counts once (as the paper counts)."""
        total = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if not count_embedding_once and self.config.tie_word_embeddings:
            total += self.embed_tokens.weight.numel()
        return total

    def lambdas(self) -> list[LayerLambda | None]:
        """Each layer's λ and λ_init; None for layers whose kind has no scalar λ.

        Also works when FSDP2 has sharded the λ vectors: it then gathers them, a collective that
        every rank must call. This is the one place λ is read for logs and reports."""
        if not self.config.kind.scalar_lambda:
            return [None] * len(self.layers)
        return [LayerLambda(block.self_attn.current_lambda(), block.self_attn.lambda_init) for block in self.layers]

    @torch.no_grad()
    def set_training_step(self, step: int) -> None:
        """Called by the trainer before optimizer step `step` (0-based): a `diff_retrofit` model with
        head_norm_ramp_steps > 0 raises every layer's head-norm mix α to min(1, step / head_norm_ramp_steps).
        α is never lowered (on the device, no host sync), so a new run from an already ramped model
        keeps its head norm; any other model is unchanged."""
        raise_head_norm_mix(self.layers, self.config, step)

    def _check_ids(self, input_ids: torch.Tensor, past: int) -> None:
        check_input_ids(input_ids, self.config.vocab_size)
        total = past + input_ids.shape[1]
        if total > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {total} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}; truncate the input or use a config "
                             f"with a longer context")

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, return_attention: bool = False,
                logits_to_keep: int | torch.Tensor = 0) -> CausalLMOutput:
        """input_ids (B, T). targets (B, T) are the next tokens (already shifted; -100 ignored).

        attention_mask (B, S): 1 for real tokens, 0 for padding, over cached + new tokens.
        logits_to_keep: 0 for the logits of every position, n > 0 for the last n only (B, n, V), or a
        tensor of position indices, as transformers names and takes it: a prompt's prefill in `generate`
        needs only the last position's, and the LM head is a large share of a small model's FLOPs. Not with
        targets (the loss needs all). With n > 0 the last block, whose outputs at the other positions no
        later layer reads, computes its queries, attention rows and MLP for those n positions only (its keys
        and values, and the KV cache, for all): exact, and 1 / num_hidden_layers of the work saved on long
        inputs (unless return_attention, whose maps cover every position).
        """
        if targets is not None and (isinstance(logits_to_keep, torch.Tensor) or logits_to_keep != 0):
            raise ValueError("logits_to_keep keeps only the last positions' logits, but targets need every "
                             "position's for the loss; pass one of them")
        self._check_ids(input_ids, 0 if kv_cache is None else kv_cache.length(0))
        last_rows = 0 if return_attention else last_rows_kept(logits_to_keep)
        x = self.embed_tokens(input_ids)
        maps = [] if return_attention else None
        for i, block in enumerate(self.layers):
            res = block(x, attention_mask=attention_mask, position_ids=position_ids, kv_cache=kv_cache,
                        return_attention=return_attention,
                        outputs_to_keep=last_rows if i == len(self.layers) - 1 else 0)
            if return_attention:
                x, m = res
                maps.append(m)
            else:
                x = res
        logits = self.lm_head(self.norm(keep_last_positions(x, logits_to_keep)))
        loss = None
        if targets is not None:
            if targets.shape != input_ids.shape:
                raise ValueError(f"targets must match input_ids' shape {tuple(input_ids.shape)}; "
                                 f"got {tuple(targets.shape)}")
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=loss, attentions=maps, kv_cache=kv_cache)

    # -- generation and serialisation live in their own modules; thin methods for convenience --
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        return generate(self, input_ids, max_new_tokens, **kwargs)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write config.json and model.safetensors into `directory` (see serialization.py)."""
        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device="cpu", dtype=None) -> "DiffTransformerLM":
        """Build from `directory`'s config.json and load its model.safetensors strictly."""
        config, weights = read_pretrained(directory)
        model = cls(config, device=device, dtype=dtype)  # λ vectors stay at least fp32, as when built
        load_weights(model, weights, device)
        return model


def load_pretrained(directory: str | Path, device="cpu", dtype: torch.dtype | None = None) -> DiffTransformerLM:
    """`DiffTransformerLM.from_pretrained` as a function (the counterpart of `serialization.save_pretrained`)."""
    return DiffTransformerLM.from_pretrained(directory, device=device, dtype=dtype)
