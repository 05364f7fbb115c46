"""Text in, text out for one trained model: the scoring that generation, reports and evaluation tasks share.

Every text is scored as the start of a new document: the tokenizer's EOS id comes first, as in
training, where EOS separates documents.

    ids = encode_prompt(tokenizer, "The state of the Union is")       # (1, T): EOS, then the prompt
    gen = generate_text(model, tokenizer, "The state of the Union is", 48, temperature=0.0)
    nll = token_nll(model, ids)                                       # (1, T - 1) nats per token
    score = continuation_logprob(model, tokenizer, "The capital of France is", " Paris")
    per_token = continuation_token_logprobs(model, [(context_ids, cont_ids), ...], batch_size=8, pad_id=eos)

`model` is any module with `config.max_position_embeddings`, `generate(ids, n, ...)` and a forward
returning `.logits` (DiffTransformerLM); `tokenizer` has `encode`, `decode` and `eos_id`
(difftransformer.data.Tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def encode_prompt(tokenizer, prompt: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """(1, T) token ids: EOS (a document starts here), then the prompt's tokens."""
    return torch.tensor([[tokenizer.eos_id, *tokenizer.encode(prompt)]], device=device)


def new_token_budget(model, prompt_ids: torch.Tensor, wanted: int) -> int:
    """How many of `wanted` new tokens fit in the model's context after the prompt.

    A prompt that leaves no room is a ValueError naming both lengths."""
    context = model.config.max_position_embeddings
    room = context - prompt_ids.shape[-1]
    if room < 0 or (room == 0 and wanted > 0):
        n = prompt_ids.shape[-1] - 1
        raise ValueError(f"the prompt is {n} tokens; the model's context is {context}, and with the "
                         f"start-of-document token ({n + 1} in all) no room is left for a new token; shorten the "
                         f"prompt to at most {context - 2} tokens")
    return min(wanted, room)


@dataclass
class Generation:
    prompt: str
    text: str  # the continuation only, cut before the first EOS
    tokens: list[int]  # its token ids
    max_new_tokens: int  # the budget actually used (less than asked when the context was the limit)


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None, device: str | torch.device = "cpu") -> Generation:
    """Continue `prompt`: encode it, generate up to max_new_tokens (fewer if the context ends first),
    stop at EOS, decode. temperature 0 is greedy; `generator` seeds sampling."""
    ids = encode_prompt(tokenizer, prompt, device)
    n = new_token_budget(model, ids, max_new_tokens)
    out = model.generate(ids, n, temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=tokenizer.eos_id,
                         generator=generator)[0, ids.shape[1]:].tolist()
    out = until_eos(out, tokenizer.eos_id)
    return Generation(prompt, tokenizer.decode(out), out, n)


def until_eos(tokens: list[int], eos_id: int) -> list[int]:
    """The generated tokens before the first EOS (all of them when there is none): the answer a
    generation gives, since EOS ends the document it writes."""
    return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


@torch.no_grad()
def token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood in nats of each token given the ones before it: (B, T) ids -> (B, T - 1),
    entry t scoring ids[:, t + 1]. Computed from fp32 (or wider) logits. The last id is only a target,
    never an input, so T may be one more than the model's context (a causal model's logits at earlier
    positions do not depend on later inputs)."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"token_nll needs (batch, seq_len) ids with seq_len >= 2, got shape {tuple(ids.shape)}")
    logits = model(ids[:, :-1]).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


@dataclass
class ContinuationScore:
    logprob: float  # sum of log p(token | everything before it) over the continuation's tokens
    num_tokens: int
    greedy: bool  # whether every continuation token is the model's argmax at its position


def split_continuation(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the text reads when joined.

    The joined text is encoded once and split after the context's own tokens, so the continuation
    is tokenised as the model would see it in running text. Spaces that end the context are moved to
    the front of the continuation first (BPE merges a space into the following word)."""
    stripped = context.rstrip(" ")
    continuation = context[len(stripped):] + continuation
    context_ids = tokenizer.encode(stripped)
    whole = tokenizer.encode(stripped + continuation)
    if whole[:len(context_ids)] != context_ids:  # a merge across the boundary: score the pieces apart
        return context_ids, tokenizer.encode(continuation)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def continuation_token_logprobs(model, rows: Sequence[tuple[Sequence[int], Sequence[int]]], *, batch_size: int = 8,
                                pad_id: int | None = None, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """For each (context ids, continuation ids) row: the log-probs of the continuation's tokens, each
    given every id before it, as a 1-D tensor computed from fp32 (or wider) logits.

    Rows go through the model `batch_size` at a time in the given order, each batch right-padded to
    its longest row with `pad_id` (None: each row repeats its own last token). The model is causal,
    so padding after a row never reaches its scores; the caller owns any EOS at the front and sums
    the tensors at the precision it documents. Callers that keep prompts of one length together
    (needle) pass those rows as one call, so batches are what they always were."""
    out: list[torch.Tensor] = []
    for i in range(0, len(rows), batch_size):
        batch = [(list(ctx), list(cont)) for ctx, cont in rows[i:i + batch_size]]
        width = max(len(ctx) + len(cont) for ctx, cont in batch)
        ids = torch.tensor([ctx + cont + [cont[-1] if pad_id is None else pad_id] * (width - len(ctx) - len(cont))
                            for ctx, cont in batch], device=device)
        logits = model(ids).logits
        for r, (ctx, cont) in enumerate(batch):
            scored = logits[r, len(ctx) - 1:len(ctx) - 1 + len(cont)]
            lp = torch.log_softmax(scored.to(torch.promote_types(scored.dtype, torch.float32)), dim=-1)
            out.append(lp[torch.arange(len(cont), device=lp.device), torch.tensor(cont, device=lp.device)])
    return out


@torch.no_grad()
def continuation_logprob(model, tokenizer, context: str, continuation: str,
                         device: str | torch.device = "cpu") -> ContinuationScore:
    """log p(continuation | EOS + context) under `model`, and whether greedy decoding would produce it."""
    context_ids, cont_ids = split_continuation(tokenizer, context, continuation)
    if not cont_ids:
        raise ValueError(f"the continuation {continuation!r} encodes to no tokens; nothing to score")
    ids = torch.tensor([[tokenizer.eos_id, *context_ids, *cont_ids]], device=device)
    logits = model(ids).logits[0, -len(cont_ids) - 1:-1]
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    target = ids[0, -len(cont_ids):]
    picked = logprobs.gather(-1, target[:, None]).squeeze(-1)
    return ContinuationScore(float(picked.sum()), len(cont_ids), bool((logprobs.argmax(-1) == target).all()))


def first_place_share(scores: Sequence[float], index: int) -> float:
    """The credit of choice `index` in forced choice among `scores` (log-likelihoods): 1 when it scores above every
    other choice, 1/k when it ties with k - 1 others for the top (within a relative 1e-9: sums of the same
    log-probabilities in another order), else 0; so a model without preference scores chance, 1/len(scores).
    NaN when a score is NaN (a diverged model, an overflow): no choice can be credited, and a mean over such
    samples stays NaN instead of turning into a believable accuracy."""
    if any(math.isnan(v) for v in scores):
        return math.nan
    best = max(scores)
    tied = [i for i, v in enumerate(scores) if v >= best - 1e-9 * max(1.0, abs(best))]
    return 1.0 / len(tied) if index in tied else 0.0
