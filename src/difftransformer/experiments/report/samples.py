"""The report's sample generations: greedy and one seeded sample per prompt, cached in each run folder."""

from __future__ import annotations

import json

import torch

from difftransformer._io import atomic_write_text
from difftransformer.data import Tokenizer
from difftransformer.eval import generate_text
from difftransformer.model import DiffTransformerLM
from difftransformer.train import RunDir


def sample_texts(run: RunDir, prompts: list[str], max_new_tokens: int, temperature: float,
                 top_k: int | None, sample_seed: int = 0) -> list[dict[str, str]] | None:
    """Greedy and one sampled continuation per prompt from the run's final model (None without one).

    The sampled one uses a generator seeded with `sample_seed` afresh for every prompt, so each
    prompt's sample does not depend on the others. Cached in the run's samples.json, keyed by the
    settings and the weights file's modification time."""
    if not run.has_final() or not run.final_tokenizer.is_file():
        return None
    settings = {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                "sample_seed": sample_seed, "weights_mtime_ns": run.final_weights.stat().st_mtime_ns}
    cached = run.read_json(run.samples)
    if cached.get("settings") == settings:
        return cached["samples"]

    model = DiffTransformerLM.from_pretrained(run.final).eval()
    tok = Tokenizer.from_file(run.final_tokenizer)
    out = []
    for prompt in prompts:
        row = {"prompt": prompt}
        for name, kw in (("greedy", {"temperature": 0.0}),
                         ("sampled", {"temperature": temperature, "top_k": top_k,
                                      "generator": torch.Generator().manual_seed(sample_seed)})):
            try:
                row[name] = generate_text(model, tok, prompt, max_new_tokens, **kw).text
            except ValueError as e:  # a prompt longer than the model's context: say so, keep the report
                row[name] = f"({e})"
        out.append(row)
    atomic_write_text(run.samples, json.dumps({"settings": settings, "samples": out}, indent=2) + "\n")
    return out
