"""`DiffTransformerHFConfig`: our `DiffTransformerConfig` as a Hugging Face `PretrainedConfig`.

Contract:
- `model_type = "difftransformer"`, the value our own serializer already writes into config.json, so
  `AutoConfig.from_pretrained(dir)` reads a folder written by `DiffTransformerLM.save_pretrained`
  unchanged (after `import difftransformer.hf`, which registers the type).
- Every field of `DiffTransformerConfig` is an explicit keyword argument with the same default. Our
  names already are Hugging Face's where one exists (vocab_size, hidden_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, intermediate_size, max_position_embeddings, rope_theta,
  rms_norm_eps, tie_word_embeddings, initializer_range); the others (attention, lambda_init,
  attn_backend, attn_deterministic, and diff_retrofit's attention_head_dim, head_norm_ramp_steps) are ours.
- Validation is ours, not a copy: the fields are handed to `DiffTransformerConfig`, whose checks run,
  and the resolved values (num_key_value_heads, intermediate_size) are stored back.
- `num_attention_heads` / `num_key_value_heads` count heads of the configured attention kind, as
  everywhere in this package: DIFF heads (half the matched Transformer's) for `diff` and
  `diff_no_headnorm`. Generic code that derives `hidden_size // num_attention_heads` as a q/k head
  dim is therefore wrong for those kinds (it gets the value dim 2d); nothing in the wrapper does.
- `to_native()` gives the `DiffTransformerConfig` back; `from_native(config)` the other way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from difftransformer.model import DiffTransformerConfig
from difftransformer.model.config import MODEL_TYPE

FORMAT_VERSION = 1  # the config.json format our serializer writes (DiffTransformerConfig.save)
NATIVE_FIELDS = tuple(f.name for f in dataclasses.fields(DiffTransformerConfig))


class DiffTransformerHFConfig(PretrainedConfig):
    """The model config for `DiffTransformerForCausalLM`; see the module docstring."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache's name up to transformers 5.23, from 5.24

    def __init__(
        self,
        vocab_size: int = 8192,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        attention: str = "diff",
        intermediate_size: int | None = None,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        tie_word_embeddings: bool = True,
        lambda_init: float | None = None,
        initializer_range: float = 0.02,
        attn_backend: str = "auto",
        attn_deterministic: bool = True,
        attention_head_dim: int | None = None,
        head_norm_ramp_steps: int = 0,
        position_encoding: str = "rope",
        ssmax_init_length: int | None = None,
        use_cache: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs: Any,
    ):
        _check_header(kwargs)
        native = _native(dict(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, attention=attention,
            intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie_word_embeddings,
            lambda_init=lambda_init, initializer_range=initializer_range, attn_backend=attn_backend,
            attn_deterministic=attn_deterministic, attention_head_dim=attention_head_dim,
            head_norm_ramp_steps=head_norm_ramp_steps, position_encoding=position_encoding,
            ssmax_init_length=ssmax_init_length))
        for name in NATIVE_FIELDS:
            if name != "tie_word_embeddings":  # the base class owns that one (transformers 4.x sets it there)
                setattr(self, name, getattr(native, name))
        self.format_version = FORMAT_VERSION
        # Transformers 5 treats these as generation settings and drops them from **kwargs, so set them here.
        self.use_cache, self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            use_cache, bos_token_id, eos_token_id, pad_token_id)
        super().__init__(tie_word_embeddings=native.tie_word_embeddings, **kwargs)

    def to_native(self) -> DiffTransformerConfig:
        """The `DiffTransformerConfig` these fields describe (validated again: fields may have been edited)."""
        return _native({name: getattr(self, name) for name in NATIVE_FIELDS})

    @classmethod
    def from_native(cls, config: DiffTransformerConfig, **kwargs: Any) -> "DiffTransformerHFConfig":
        """The Hugging Face config of a `DiffTransformerConfig`; kwargs add Hugging Face settings (eos_token_id...)."""
        return cls(**config.to_dict(), **kwargs)


def _check_header(kwargs: dict[str, Any]) -> None:
    """Remove and check the keys our config.json carries besides the fields (model_type, format_version)."""
    model_type = kwargs.pop("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ValueError(f"config has model_type {model_type!r}, but DiffTransformerHFConfig reads only "
                         f"{MODEL_TYPE!r}; load that checkpoint with its own config class")
    version = kwargs.pop("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"config format_version {version!r} is not the one this difftransformer reads "
                         f"({FORMAT_VERSION}); upgrade difftransformer to load it")


def _native(fields: dict[str, Any]) -> DiffTransformerConfig:
    """Our config from `fields`; its own checks run, and their errors name the field and the rule."""
    try:
        return DiffTransformerConfig(**fields)
    except (TypeError, ValueError) as e:
        raise type(e)(f"invalid difftransformer config: {e}") from None
