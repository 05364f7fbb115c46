"""Any Hugging Face causal LM behind the interface the black-box evaluation tasks use (eval/lm.py).

    model, tokenizer = load_causal_lm("path/to/llama-or-gpt2-folder")
    run_task("needle", model, tokenizer, EvalConfig(data_dir="cache/data/sotu-8192"))

The tasks need from a model only `model(ids).logits`, `model.config.max_position_embeddings` and
`model.generate(ids, n, temperature=..., top_k=..., top_p=..., eos_token_id=..., generator=...)`
returning (B, T + n) ids, and from a tokenizer `encode`, `decode`, `eos_id`, `vocab_size` and a
`hash`. `HFCausalLM` and `HFTokenizer` give exactly that on top of transformers' classes; white-box
probes refuse these models (they cannot open foreign attention).

Choices:
- `eos_id` is the token a document starts with (the tasks put it first, as our training does):
  the tokenizer's BOS where it has one, else its EOS. Generation stops at that id and at the
  model's own EOS ids; tokens after a stop are the stop id repeated, as in our generate.
- Text is encoded without special tokens (the tasks place the start token themselves) and decoded
  without them.
- Loading is local and safetensors-only (`local_files_only=True`, `use_safetensors=True`): nothing
  is downloaded, and no pickle is opened.
- Decoding is what the task asks for and nothing else: the folder's generation_config.json (a
  repetition penalty, an n-gram ban, suppressed tokens, as chat models often ship) is set aside for
  the call, so temperature 0 is argmax decoding, as in our generate.
- Sampling draws from torch's global generator seeded from the `generator` argument, since
  transformers' generate takes no generator; greedy decoding (what the tasks use) is unaffected.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import difftransformer.hf  # noqa: F401  (our own folders load through the auto classes too)
from difftransformer.model.config import MODEL_TYPE
from difftransformer.model.serialization import folder_model_type


class HFTokenizer:
    """A transformers tokenizer with the interface of difftransformer.data.Tokenizer used by eval."""

    def __init__(self, tok, name: str):
        self._tok = tok
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if start is None:
            raise ValueError(f"the tokenizer of {name} has neither a BOS nor an EOS token; the evaluation tasks start "
                             f"every text with one. Use a model whose tokenizer defines eos_token")
        self.eos_id = int(start)
        self.vocab_size = len(tok)
        text = tok.backend_tokenizer.to_str() if getattr(tok, "is_fast", False) else json.dumps(tok.get_vocab(),
                                                                                                  sort_keys=True)
        self.hash = hashlib.sha256(text.encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class HFCausalLM(nn.Module):
    """A transformers causal LM with the `forward` / `generate` / `config` interface of our LM."""

    def __init__(self, model: nn.Module, context: int):
        super().__init__()
        self.hf = model
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self._stop_ids = {int(e) for e in ([] if eos is None else eos if isinstance(eos, list) else [eos])}
        source = model.config
        # to_dict: the folder's configuration and the context the tasks give it, what an evaluation result is kept for
        self.config = SimpleNamespace(max_position_embeddings=context, vocab_size=source.vocab_size,
                                      attention=f"hf:{source.model_type}",
                                      to_dict=lambda: {**source.to_dict(), "context": context})

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds the model's context of "
                             f"{self.config.max_position_embeddings} tokens; shorten the input")
        return SimpleNamespace(logits=self.hf(input_ids=input_ids, use_cache=False).logits)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """(B, T) prompts (no padding) -> (B, T + max_new_tokens); after a stop token, the stop token."""
        stops = sorted(self._stop_ids | ({int(eos_token_id)} if eos_token_id is not None else set()))
        kwargs = dict(do_sample=False) if temperature == 0 else dict(
            do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
        with torch.random.fork_rng(devices=[]), self._generation_config_set_aside():
            if generator is not None and temperature != 0:
                torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
            out = self.hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                                   pad_token_id=stops[0] if stops else 0, **kwargs)
        return _pad_after_stop(out, input_ids.shape[1] + max_new_tokens, input_ids.shape[1], stops)

    @contextlib.contextmanager
    def _generation_config_set_aside(self):
        """The model's generation config replaced by transformers' defaults for one call: generate() fills every
        setting a call leaves unset from the model's, even from a GenerationConfig passed to it, so the folder's
        processors (repetition penalty, n-gram bans, suppressed tokens) would change the tasks' decoding."""
        saved = self.hf.generation_config
        self.hf.generation_config = GenerationConfig()
        try:
            yield
        finally:
            self.hf.generation_config = saved


def _pad_after_stop(out: torch.Tensor, width: int, prompt: int, stops: list[int]) -> torch.Tensor:
    """Our generate's shape: exactly `width` columns, each row its first stop id repeated after it."""
    if out.shape[1] < width:
        fill = stops[0] if stops else 0
        out = torch.cat([out, out.new_full((out.shape[0], width - out.shape[1]), fill)], dim=1)
    for row in out:
        new = row[prompt:]
        hit = [i for i, t in enumerate(new.tolist()) if t in stops]
        if hit:
            new[hit[0]:] = new[hit[0]]
    return out


def is_transformers_folder(path: str | Path) -> bool:
    """A folder with a config.json naming a transformers model_type other than ours."""
    return folder_model_type(path) not in (None, MODEL_TYPE)


def _context(config) -> int:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"the config of this {config.model_type} model names no context length "
                     f"(max_position_embeddings, n_positions, n_ctx); the evaluation tasks need one")


def load_causal_lm(path: str | Path, device: str = "cpu") -> tuple[HFCausalLM, HFTokenizer]:
    """A local transformers causal-LM folder (safetensors weights and a tokenizer) for evaluation."""
    path = Path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} does not load as a transformers causal LM with safetensors weights and a "
                         f"tokenizer ({first})") from None
    model = model.to(device).eval()
    return HFCausalLM(model, _context(model.config)), HFTokenizer(tok, str(path))
