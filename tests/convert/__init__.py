"""Helpers of the converter tests: tiny random models with every weight non-trivial, and transformers in float64.

`transformers_in_float64(monkeypatch)` exists because transformers' Llama-family code computes its
RMSNorms, RoPE angles and DiffLlama's λ dot products in fp32 even inside a float64 model (a choice made
for half precision), which caps any float64 comparison at fp32's ~1e-7. The patches make exactly
those steps compute in the input's dtype, nothing else, so a float64 comparison shows that a
mapping is exact to float64 rounding. They are undone after each test (monkeypatch).
"""

from __future__ import annotations

import dataclasses

import torch

from difftransformer.model import ATTENTION_KINDS, DiffTransformerConfig, DiffTransformerLM

VOCAB, T = 96, 10


def config(attention: str = "diff", gqa: bool = False, tied: bool = True, **overrides) -> DiffTransformerConfig:
    """3 layers (three λ_init values), width 64: 4 DIFF heads of d = 8 (8 ordinary heads for the baselines);
    GQA: 2 DIFF kv groups (n_rep 2), 2 ordinary kv heads (4 queries each)."""
    diff = ATTENTION_KINDS[attention].diff_heads
    heads, kv = (4, 2 if gqa else 4) if diff else (8, 2 if gqa else 8)
    fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=heads,
                  num_key_value_heads=kv, attention=attention, tie_word_embeddings=tied,
                  max_position_embeddings=64, initializer_range=0.1, attn_backend="sdpa")
    return DiffTransformerConfig(**{**fields, **overrides})


@torch.no_grad()
def randomise_(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every norm weight in [0.5, 1.5] (head norms included) and λ vectors N(0, 0.3²): nothing is 1 or tiny."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or "subln" in name:
            p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.5)
        elif "lambda" in name:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return model


def ours(cfg: DiffTransformerConfig, dtype=torch.float32, seed: int = 0) -> DiffTransformerLM:
    torch.manual_seed(seed)
    return randomise_(DiffTransformerLM(cfg).to(dtype).eval(), seed + 1)


def ours_from(state: dict, cfg: DiffTransformerConfig, dtype=torch.float32) -> DiffTransformerLM:
    """Our model from converted tensors (loaded strictly), on the sdpa backend."""
    model = DiffTransformerLM(dataclasses.replace(cfg, attn_backend="sdpa")).to(dtype).eval()
    model.load_state_dict(state, strict=True)
    return model


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def same_tensors(a: dict, b: dict) -> bool:
    """The same names, dtypes and values, bit for bit."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def transformers_model(cls, hf_config: dict, state: dict | None = None, dtype=torch.float32):
    """transformers' own `cls` built from a config dict (attention on SDPA), weights loaded strictly if given."""
    from transformers import AutoModelForCausalLM

    cfg = cls.config_class.from_dict(hf_config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval()
    assert type(model) is cls
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


# -- float64 transformers (see the module docstring) ---------------------------------------------------

def _rms_norm_forward(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rope_forward(self, x, position_ids):
    params = getattr(self.config, "rope_parameters", None) or {"rope_theta": self.config.rope_theta}
    d = self.config.head_dim
    inv_freq = params["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class _TorchWithWideSums:
    """torch, except that `sum(..., dtype=float32)` of a float64 tensor sums in float64 (DiffLlama's λ)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def sum(x, *args, dtype=None, **kwargs):
        return torch.sum(x, *args, dtype=None if dtype is None else torch.promote_types(dtype, x.dtype), **kwargs)


def transformers_in_float64(monkeypatch) -> None:
    from transformers.models.diffllama import modeling_diffllama as diffllama
    from transformers.models.llama import modeling_llama as llama

    for norm, rope in ((diffllama.DiffLlamaRMSNorm, diffllama.DiffLlamaRotaryEmbedding),
                       (llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding)):
        monkeypatch.setattr(norm, "forward", _rms_norm_forward)
        monkeypatch.setattr(rope, "forward", _rope_forward)
    monkeypatch.setattr(diffllama, "torch", _TorchWithWideSums())
