"""The decoder-only LM, its typed config and presets, generation and serialisation."""

from difftransformer.model.config import ATTENTION_KINDS, PRESETS, DiffTransformerConfig, Preset, get_preset
from difftransformer.model.generation import filter_logits, generate, sample_next_token
from difftransformer.model.modeling import CausalLMOutput, DecoderBlock, DiffTransformerLM, SwiGLU, build_attention
from difftransformer.model.serialization import load_pretrained, save_pretrained

__all__ = [
    "ATTENTION_KINDS", "PRESETS", "CausalLMOutput", "DecoderBlock", "DiffTransformerConfig", "DiffTransformerLM",
    "Preset", "SwiGLU", "build_attention", "filter_logits", "generate", "get_preset", "load_pretrained",
    "sample_next_token", "save_pretrained",
]
