"""Typed model configuration, matched DIFF/Transformer pairs, and presets.

`num_attention_heads` always counts the heads *of the configured attention kind* (see kinds.py):
- kinds with `diff_heads` (diff, diff_no_headnorm): DIFF heads h, half the matched Transformer's;
  diff_retrofit counts DIFF heads too, but a retrofitted Llama keeps its own heads (convert/llama_retrofit.py);
- the others (transformer, transformer_headnorm, transformer_gated, transformer_ssmax, diff_v2): ordinary
  heads H, the baseline's own count (transformer_gated adds hidden_size * H gate weights per layer,
  transformer_ssmax H scales, see kinds.py).
`config.matched("transformer")` / `config.matched("diff")` convert between the two so that a
DIFF model and its baseline have the same width, depth, FFN and head_dim, and parameter counts
that differ only by 6 * head_dim per layer (lambda vectors and head-norm weight).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftransformer._config import check_field_types
from difftransformer._io import atomic_write_text
from difftransformer.attention.backends import BACKENDS, resolve_backend
from difftransformer.attention.rope import check_position_encoding
from difftransformer.model.kinds import AttentionKind, attention_kind

_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")  # counted in the configured kind's units
_RETROFIT_FIELDS = ("attention_head_dim", "head_norm_ramp_steps")  # diff_retrofit's own (kinds.head_norm_ramp)
_SSMAX_FIELDS = ("ssmax_init_length",)  # transformer_ssmax's own (kinds.scalable_softmax)
log = logging.getLogger("difftransformer.model")
# Fields that choose how attention is computed, not what the model is: a checkpoint resumes or
# loads under other values of these.
RUNTIME_FIELDS = ("attn_backend", "attn_deterministic")

# config.json's model_type for our folders (also the key transformers' AutoConfig knows us by).
MODEL_TYPE = "difftransformer"


# Keys that a transformers save_pretrained (difftransformer.hf) writes beside ours: its bookkeeping,
# not the model, so a folder saved through transformers loads natively too.
TRANSFORMERS_KEYS = frozenset({"architectures", "transformers_version", "dtype", "torch_dtype", "use_cache",
                               "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path"})


@dataclass
class DiffTransformerConfig:
    """Decoder-only LM: pre-RMSNorm blocks, SwiGLU FFN, RoPE (or NoPE), one attention kind per model."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # heads of `attention`'s kind; see the module docstring
    num_key_value_heads: int | None = None  # None: no GQA (same as num_attention_heads)
    attention: str = "diff"
    intermediate_size: int | None = None  # None: round(8/3 * hidden_size), as in the paper
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # "rope": rotary embedding on every q/k head; "none": no position encoding at all (NoPE), for every kind.
    position_encoding: str = "rope"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    lambda_init: float | None = None  # None: 0.8 - 0.6 exp(-0.3 depth); a constant for ablations
    initializer_range: float = 0.02
    attn_backend: str = "auto"  # auto | eager | sdpa | triton | cpp
    # False lets the fused Triton backward add dQ with fp32 atomics: one pass, the baseline's
    # attention FLOPs, but gradients that round differently from run to run (DIFF V1 only).
    attn_deterministic: bool = True
    # diff_retrofit only (see convert/llama_retrofit.py): the q/k component dim d when it is not
    # hidden_size / (2 * heads) (a retrofitted Llama keeps its own head dim, so 2hd = 2E), and the
    # optimizer steps over which the trainer ramps the head norm in (α = min(1, step / steps)).
    attention_head_dim: int | None = None  # None: hidden_size // (2 * num_attention_heads)
    head_norm_ramp_steps: int = 0  # 0: the trainer leaves α as stored (1 = V1 head norm, 0 = none)
    # Kinds with scalable softmax (transformer_ssmax) only: every head's s starts at 1 / log(this), so the
    # untrained layer is ordinary attention for a query attending this many keys (a study's training length).
    ssmax_init_length: int | None = None  # None: max_position_embeddings

    def __post_init__(self) -> None:
        check_field_types(self, "model")
        attention_kind(self.attention)  # a known kind, or a ValueError naming the nearest one
        check_position_encoding(self.position_encoding, "model.position_encoding")
        if self.ssmax_init_length is not None and not self.kind.scalable_softmax:
            raise ValueError(f"model.ssmax_init_length ({self.ssmax_init_length}) applies to attention="
                             f"'transformer_ssmax' only; got attention={self.attention!r}: leave it at null")
        if self.ssmax_init_length is not None and self.ssmax_init_length < 2:
            raise ValueError(f"model.ssmax_init_length must be an integer >= 2 (s starts at 1 / log of it), or null "
                             f"for max_position_embeddings; got {self.ssmax_init_length}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = round(8 * self.hidden_size / 3)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        ramp = self.kind.head_norm_ramp
        if not ramp and (self.attention_head_dim is not None or self.head_norm_ramp_steps):
            raise ValueError(f"model.attention_head_dim ({self.attention_head_dim}) and model.head_norm_ramp_steps "
                             f"({self.head_norm_ramp_steps}) apply to attention='diff_retrofit' only; got attention="
                             f"{self.attention!r}: leave them at null and 0")
        if self.head_norm_ramp_steps < 0:
            raise ValueError(f"model.head_norm_ramp_steps must be >= 0 (0: no ramp), got {self.head_norm_ramp_steps}")
        if self.attention_head_dim is not None and self.attention_head_dim <= 0:
            raise ValueError(f"model.attention_head_dim must be a positive even integer or null, got "
                             f"{self.attention_head_dim}")
        split = self.head_split
        if self.attention_head_dim is None and self.hidden_size % split:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"{'2 * ' if self.kind.diff_heads else ''}num_attention_heads ({split}) "
                             f"for attention={self.attention!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs of features; odd widths are "
                             f"not supported without RoPE either); change hidden_size or num_attention_heads")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"unknown attn_backend {self.attn_backend!r}; choose one of {BACKENDS}")
        if self.attn_backend == "triton" and not self.kind.fused_kernel:
            raise ValueError(f"attn_backend 'triton' is the fused differential-attention kernel; attention="
                             f"{self.attention!r} has no Triton path. Use attn_backend 'auto' (PyTorch's "
                             f"FlashAttention through SDPA on CUDA, the fused C++ kernel on CPU)")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"model.{name} must be a positive number, got {getattr(self, name)}")
        if self.lambda_init is not None and not 0.0 <= self.lambda_init < 1.0:
            # the head norm's output is scaled by 1 - λ_init: at 1 or above it is zeroed or flipped
            raise ValueError(f"model.lambda_init must lie in [0, 1) (the head-norm output is scaled by 1 - "
                             f"lambda_init), or be null for the depth schedule 0.8 - 0.6 exp(-0.3 layer); got "
                             f"{self.lambda_init}")
        if self.lambda_init is not None and not self.kind.scalar_lambda:  # it would be recorded and do nothing
            raise ValueError(f"model.lambda_init ({self.lambda_init}) applies to the kinds with a scalar λ (DIFF V1: "
                             f"diff, diff_no_headnorm, diff_retrofit); attention={self.attention!r} has none and would "
                             f"ignore it: leave it at null")

    def backend_on(self, device: torch.device) -> str:
        """The backend this model's attention uses on `device` (the one rule of attention/backends.py);
        a ValueError, before anything runs, when it cannot run there ('triton' without CUDA)."""
        return resolve_backend(self.attn_backend, device, ordinary=not self.kind.fused_kernel)

    def gpu_unaligned_dims(self) -> dict[str, int]:
        """The matrix dimensions (width, FFN width, vocabulary) that are not multiples of 8. On CUDA,
        half-precision matrix products with such a dimension cannot use the tensor-core kernels that
        need 16-byte alignment, and cuBLAS falls back to slow kernels (figures: docs/benchmarks.md, "Fused
        Triton kernel on GPU"). Harmless on CPU."""
        dims = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size}
        return {name: value for name, value in dims.items() if value % 8}

    def gpu_aligned_dims(self) -> dict[str, int]:
        """For each dimension gpu_unaligned_dims names, the next multiple of 64 above it that this config
        also accepts: hidden_size must still split into head_split even-width pieces."""
        aligned = {}
        for name, value in self.gpu_unaligned_dims().items():
            step = 64
            if name == "hidden_size" and self.attention_head_dim is None:
                step = math.lcm(64, 2 * self.head_split)
            aligned[name] = -(-value // step) * step
        return aligned

    @property
    def kind(self) -> AttentionKind:
        """The attention kind's row of the kinds table (differential? scalar λ? head norm? V2?)."""
        return attention_kind(self.attention)

    @property
    def head_dim(self) -> int:
        """d: the q/k dim of one component (DIFF) or one head (baseline, V2); equal when matched."""
        if self.attention_head_dim is not None:
            return self.attention_head_dim
        return self.hidden_size // self.head_split

    @property
    def head_split(self) -> int:
        """How many d-wide pieces the width splits into: 2 x heads for DIFF's components, else the heads."""
        return 2 * self.num_attention_heads if self.kind.diff_heads else self.num_attention_heads

    @property
    def baseline_heads(self) -> tuple[int, int]:
        """(query heads, kv heads) of the equivalent ordinary Transformer."""
        f = 2 if self.kind.diff_heads else 1
        return self.num_attention_heads * f, self.num_key_value_heads * f

    def matched(self, attention: str) -> "DiffTransformerConfig":
        """The same size spec with another attention kind, head counts converted.

        A spec that asks for the fused Triton kernel ('triton') gives the kinds without one (the
        baseline, V2) 'auto' instead, which runs their best kernel (FlashAttention through SDPA on
        CUDA); this is logged, and the arm's config records the backend it really uses."""
        kind = attention_kind(attention)
        heads, kv = self.baseline_heads
        if kind.diff_heads:
            if heads % 2 or kv % 2:
                raise ValueError(f"a DIFF model halves the baseline's {heads} q / {kv} kv heads, so both must be even")
            heads, kv = heads // 2, kv // 2
        # The retrofit fields belong to diff_retrofit only; another kind drops them.
        retrofit = {} if kind.head_norm_ramp else dict(attention_head_dim=None, head_norm_ramp_steps=0)
        if not kind.scalable_softmax:  # likewise transformer_ssmax's
            retrofit["ssmax_init_length"] = None
        return dataclasses.replace(self, attention=attention, num_attention_heads=heads, num_key_value_heads=kv,
                                   attn_backend=_backend_for(kind, self.attn_backend), **retrofit)

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DiffTransformerConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a model config is a JSON object of settings, got a {type(data).__name__}; "
                             f"the file is not a difftransformer config.json")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"model_type", "format_version"} - TRANSFORMERS_KEYS)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; valid keys are {sorted(known)}")
        fields = {k: v for k, v in data.items() if k in known}
        if "attention" in fields and "attn_backend" in fields:  # configs saved before 'triton' was refused
            fields["attn_backend"] = _backend_for(attention_kind(fields["attention"]), fields["attn_backend"])
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        payload = {"model_type": MODEL_TYPE, "format_version": 1, **self.to_dict()}
        atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "DiffTransformerConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no model config at {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # not JSON, or not text at all
            raise ValueError(f"{path} is not valid JSON ({e}); the file may be corrupted") from e
        return cls.from_dict(data)


def _backend_for(kind: AttentionKind, backend: str) -> str:
    """`backend`, or 'auto' where it is 'triton' and `kind` has no Triton kernel (logged)."""
    if backend == "triton" and not kind.fused_kernel:
        log.info("attention %r has no Triton kernel (it is DIFF-only); it uses attn_backend 'auto' instead", kind.name)
        return "auto"
    return backend


def model_identity(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict without the fields that only choose how attention is computed (RUNTIME_FIELDS):
    two runs with equal identities train the same model, so one may resume or continue the other."""
    return {k: v for k, v in config.items() if k not in RUNTIME_FIELDS}


# name: (hidden_size, layers, DIFF heads, intermediate_size or None for 8/3 * hidden)
_PAPER_SIZES = {
    "830M": (1536, 24, 8, None),
    "1.4B": (2048, 24, 8, None),
    "2.8B": (2560, 32, 10, None),
    "6.8B": (4096, 32, 16, None),
    "13.1B": (5120, 40, 20, None),
    "3B": (3072, 28, 12, 8192),
}
PAPER_VOCAB_SIZE = 100_288


@dataclass(frozen=True)
class Preset:
    """A size spec in DIFF heads (the paper's tables); `config(kind)` gives either arm."""

    hidden_size: int
    num_hidden_layers: int
    diff_heads: int
    diff_kv_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int = PAPER_VOCAB_SIZE
    max_position_embeddings: int = 4096
    description: str = ""

    def fields(self) -> dict[str, Any]:
        """The DiffTransformerConfig fields of this size spec, in DIFF-head units."""
        return dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                    num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.diff_heads,
                    num_key_value_heads=self.diff_kv_heads, attention="diff",
                    intermediate_size=self.intermediate_size,
                    max_position_embeddings=self.max_position_embeddings)

    def config(self, attention: str = "diff", **overrides) -> DiffTransformerConfig:
        """This size spec as a model of kind `attention`, with DiffTransformerConfig fields overridden.

        Size overrides apply to the spec before it is converted to `attention` (so a changed
        hidden_size re-derives the FFN width); head counts are given in `attention`'s own units
        (DIFF heads for diff kinds, ordinary heads otherwise), as everywhere in a config; the
        backend fields apply to `attention` itself (so 'triton' for a kind without it is an error).
        """
        heads = {k: overrides.pop(k) for k in _HEAD_FIELDS if k in overrides}
        runtime = {k: overrides.pop(k) for k in RUNTIME_FIELDS + _RETROFIT_FIELDS + _SSMAX_FIELDS
                   if k in overrides}  # asked of this kind itself
        spec = {**self.fields(), **overrides}
        # Put the requested heads into the DIFF-unit spec where they convert exactly, so a width that
        # only divides by the new head count is accepted before conversion.
        factor = 1 if attention_kind(attention).diff_heads else 2
        for name, value in heads.items():
            if isinstance(value, int) and value % factor == 0:
                spec[name] = value // factor
        if "num_attention_heads" in heads and "num_key_value_heads" not in heads and self.diff_kv_heads is None:
            spec["num_key_value_heads"] = None
        cfg = DiffTransformerConfig(**spec).matched(attention)
        if heads and "num_key_value_heads" not in heads and cfg.num_key_value_heads == cfg.num_attention_heads:
            heads["num_key_value_heads"] = heads["num_attention_heads"]  # no GQA stays no GQA
        if heads or runtime:
            cfg = dataclasses.replace(cfg, **heads, **runtime)
        return cfg


PRESETS: dict[str, Preset] = {
    **{name: Preset(e, n, h, None, ffn, description=f"paper size {name}") for name, (e, n, h, ffn)
       in _PAPER_SIZES.items()},
    # Small CPU presets (vocab sized for a BPE trained on the bundled corpus).
    "tiny": Preset(64, 2, 2, vocab_size=512, max_position_embeddings=256, description="unit tests"),
    "cpu-small": Preset(256, 4, 4, vocab_size=8192, max_position_embeddings=256,
                        description="5.2M params, the CPU demo size"),
    "cpu-medium": Preset(384, 6, 6, vocab_size=8192, max_position_embeddings=512,
                         description="13.8M params, a longer CPU run"),
    # The authors advise at least 8 DIFF heads; the CPU presets above have 4 and 6. These hold DIFF at
    # 8 heads (16 baseline heads) with head_dim >= 16, so RoPE still has 8+ frequencies per head (a
    # width-128 model would need head_dim 8, so no smaller one). They differ only in width (and the
    # longest context allowed), at equal depth and heads: a width-scaling pair.
    "cpu-small-h8": Preset(256, 4, 8, vocab_size=8192, max_position_embeddings=256,
                           description="5.2M params, cpu-small with 8 DIFF heads of 2 x 16 (16 baseline heads of 16)"),
    "cpu-medium-h8": Preset(512, 4, 8, vocab_size=8192, max_position_embeddings=512,
                            description="16.8M params, 8 DIFF heads of 2 x 32 (16 baseline heads of 32)"),
    # One GPU (the end-to-end pair of docs/benchmarks.md): GPT-2-small depth at width 1024, with the bundled
    # corpus's 8k vocabulary, so that the attention and FFN, not the embeddings, hold the parameters. The FFN
    # width is 8/3 x 1024 rounded up to a multiple of 64 (2752, not 2731): bf16 matrix products on
    # CUDA need dims that are multiples of 8, else cuBLAS falls back to slow kernels.
    "gpu-small": Preset(1024, 12, 8, intermediate_size=2752, vocab_size=8192, max_position_embeddings=4096,
                        description="160M params, 12 layers of width 1024, 8 DIFF heads of 2 x 64 "
                                    "(16 baseline heads of 64)"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def model_config_from_section(section: dict[str, Any]) -> DiffTransformerConfig:
    """A run config's [model] section: `preset` (+ `attention` + overrides), or DiffTransformerConfig
    fields in full. Unknown keys are the caller's to check (run_config names the nearest valid one)."""
    section = dict(section)
    preset = section.pop("preset", None)
    if preset is None:
        return DiffTransformerConfig(**section)
    if preset not in PRESETS:
        close = difflib.get_close_matches(str(preset), list(PRESETS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown preset {preset!r}{hint}; available presets: {', '.join(PRESETS)}")
    return PRESETS[preset].config(section.pop("attention", "diff"), **section)


MODEL_SECTION_KEYS = frozenset({f.name for f in dataclasses.fields(DiffTransformerConfig)} | {"preset"})
