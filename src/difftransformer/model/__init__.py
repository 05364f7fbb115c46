"""The decoder-only LM, its typed config and presets, the attention-kind table, generation and serialisation."""

from difftransformer.model.config import PRESETS, DiffTransformerConfig, Preset, get_preset
from difftransformer.model.generation import filter_logits, generate, sample_next_token
from difftransformer.model.kinds import ATTENTION_KINDS, AttentionKind, attention_kind
from difftransformer.model.modeling import (
    CausalLMOutput,
    DecoderBlock,
    DiffTransformerLM,
    LayerLambda,
    SwiGLU,
    build_attention,
    load_pretrained,
)
from difftransformer.model.serialization import save_pretrained

__all__ = [
    "ATTENTION_KINDS", "PRESETS", "AttentionKind", "CausalLMOutput", "DecoderBlock", "DiffTransformerConfig",
    "DiffTransformerLM", "LayerLambda", "Preset", "SwiGLU", "attention_kind", "build_attention", "filter_logits",
    "generate", "get_preset", "load_pretrained", "sample_next_token", "save_pretrained",
]
