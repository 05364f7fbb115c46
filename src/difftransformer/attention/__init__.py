"""Differential attention: the math (functional), the backend rule, decoding's seam, RoPE, KV cache and layers."""

from difftransformer.attention.backends import BACKENDS, resolve_backend
from difftransformer.attention.cache import KVCache, StaticKVCache
from difftransformer.attention.functional import (
    AttentionMaps,
    QueryHook,
    ScoreHook,
    differential_attention,
    lambda_init_fn,
    multihead_attention,
    reparameterized_lambda,
)
from difftransformer.attention.layers import MultiheadAttention, MultiheadDiffAttention, MultiheadDiffAttentionV2
from difftransformer.attention.rope import RotaryEmbedding

__all__ = [
    "BACKENDS", "AttentionMaps", "KVCache", "MultiheadAttention", "MultiheadDiffAttention",
    "MultiheadDiffAttentionV2", "QueryHook", "RotaryEmbedding", "ScoreHook", "StaticKVCache", "differential_attention",
    "lambda_init_fn", "multihead_attention", "reparameterized_lambda", "resolve_backend",
]
