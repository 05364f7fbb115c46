"""difftransformer: the Differential Transformer (Ye et al., ICLR 2025), exact and fast.

    from difftransformer import MultiheadDiffAttention, DiffTransformerConfig, DiffTransformerLM
"""

from difftransformer._version import __version__  # noqa: F401  (the package version)
from difftransformer.attention import (
    AttentionMaps,
    KVCache,
    MultiheadAttention,
    MultiheadDiffAttention,
    MultiheadDiffAttentionV2,
    RotaryEmbedding,
    differential_attention,
    lambda_init_fn,
)
from difftransformer.model import (
    ATTENTION_KINDS,
    PRESETS,
    DiffTransformerConfig,
    DiffTransformerLM,
    get_preset,
    load_pretrained,
    save_pretrained,
)
from difftransformer.norm import RMSNorm

__all__ = [
    "ATTENTION_KINDS", "PRESETS", "AttentionMaps", "DiffTransformerConfig", "DiffTransformerLM", "KVCache",
    "MultiheadAttention", "MultiheadDiffAttention", "MultiheadDiffAttentionV2", "RMSNorm", "RotaryEmbedding",
    "differential_attention", "get_preset", "lambda_init_fn", "load_pretrained", "save_pretrained",
]
