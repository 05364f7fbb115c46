"""The Hugging Face transformers integration (optional extra: `pip install 'difftransformer[hf]'`).

    import difftransformer.hf  # registers "difftransformer" with AutoConfig and AutoModelForCausalLM
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("runs/x/final", use_safetensors=True)
    out = model.generate(input_ids, max_new_tokens=20)  # greedy, sampling, beam search

Importing this package registers `DiffTransformerHFConfig` (model_type "difftransformer", the value
our config.json already carries) and `DiffTransformerForCausalLM` with transformers' auto classes,
so a folder written by `DiffTransformerLM.save_pretrained` loads with `AutoModelForCausalLM` in any
process that has imported `difftransformer.hf`. Registration happens once, on import; `register()`
may be called again (it is idempotent).

The attention kernel is our config field `attn_backend` (`from_pretrained(dir, attn_backend="sdpa")`),
not transformers' `attn_implementation`, which stays "eager" (transformers refuses "sdpa" for this class).

Tested with transformers 5.23 (pinned) and the newest release (CI's `make test-interop-latest`);
`difftransformer.hf.compat` says which releases run the wrapper's faster private paths (others run
transformers' own code, with the same tokens).

This is the only part of the package that imports transformers: the core package imports and runs
without it (docs/architecture.md), and nothing else imports this one.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("difftransformer.hf needs the transformers package (>= 5); install it with "
                      "pip install 'difftransformer[hf]'") from e

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - the message is the point
    raise ImportError(f"difftransformer.hf needs transformers >= 5, found {transformers.__version__}: the wrapper "
                      f"builds on transformers 5's cache layers and generation steps (4.x's have other interfaces). "
                      f"pip install 'difftransformer[hf]'")

from transformers import AutoConfig, AutoModelForCausalLM

from difftransformer.hf.configuration import MODEL_TYPE, DiffTransformerHFConfig
from difftransformer.hf.modeling import DiffTransformerForCausalLM


def register() -> None:
    """Register the config and the causal-LM class with transformers' auto classes (idempotent)."""
    AutoConfig.register(MODEL_TYPE, DiffTransformerHFConfig, exist_ok=True)
    AutoModelForCausalLM.register(DiffTransformerHFConfig, DiffTransformerForCausalLM, exist_ok=True)


register()

def __getattr__(name: str):
    """`HeadNormRampCallback` on first use: its module imports transformers' trainer utilities (and with them peft
    and accelerate, where installed), which no other use of this package needs."""
    if name == "HeadNormRampCallback":
        from difftransformer.hf.callbacks import HeadNormRampCallback

        return HeadNormRampCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DiffTransformerForCausalLM", "DiffTransformerHFConfig", "HeadNormRampCallback", "register"]
