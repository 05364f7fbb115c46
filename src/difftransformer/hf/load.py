"""Loading a pretrained transformers Llama-family model (a safetensors folder or a GGUF file) for
`difftransformer retrofit`: the one place that builds it, since only hf/ may import transformers.

Contract: `load_llama_model(path)` builds the source model (fp32), e.g. as the reference of a logits
check; `load_llama(path)` returns its (tensors, config.json dict, tokenizer.json text or None), the
inputs `convert.retrofit_llama` takes (a safetensors folder is read directly by
`convert.read_checkpoint`, in its own dtype; only a GGUF file goes through here). A GGUF file is
dequantised by transformers (needs the `gguf` package); what it holds is then the dequantised model,
and the retrofit is exact with respect to that.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import transformers


def load_llama_model(path: str | Path) -> transformers.PreTrainedModel:
    """transformers' model at `path` (a folder with config.json + safetensors, or a .gguf file), fp32, eval."""
    path = Path(path)
    transformers.utils.logging.disable_progress_bar()
    if path.is_file() and path.suffix == ".gguf":
        if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF through it
            raise ValueError(f"{path} is a GGUF file; reading it needs the gguf package: pip install "
                             f"'difftransformer[gguf]'")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    elif path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                  use_safetensors=True)
    else:
        raise ValueError(f"{path} is neither a transformers model folder nor a .gguf file; give the folder "
                         f"holding config.json and model.safetensors, or the .gguf file")
    if model.config.model_type != "llama":
        raise ValueError(f"{path} holds a {model.config.model_type!r} model; retrofit takes a Llama-family "
                         f"model (model_type 'llama')")
    return model.eval()


def load_llama(path: str | Path, model: transformers.PreTrainedModel | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any], str | None]:
    """(state dict, config dict, tokenizer.json text or None) of the Llama model at `path`."""
    model = load_llama_model(path) if model is None else model
    return dict(model.state_dict()), model.config.to_dict(), _tokenizer_json(Path(path))


def _tokenizer_json(path: Path) -> str | None:
    """The source's tokenizer as tokenizers' JSON (a GGUF file carries its vocabulary), or None."""
    try:
        kw = dict(gguf_file=path.name) if path.is_file() else {}
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent if path.is_file() else path), **kw)
        return tok.backend_tokenizer.to_str()
    except (OSError, ValueError):  # a model folder without a tokenizer: the model converts all the same
        return None

