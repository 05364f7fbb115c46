"""Autoregressive generation with the KV cache: greedy, temperature, top-k and top-p sampling."""

from __future__ import annotations

import operator
from typing import Callable

import torch

from difftransformer.attention import KVCache
from difftransformer.model.inputs import check_input_ids, positions_from_mask
from difftransformer.model.static_decode import capacity_for, check_decoder, decoder_for, graph_unsupported


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set logits outside the top-k / the top-p nucleus to -inf; (B, V) in, (B, V) out."""
    if top_k is not None:
        if top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p. The top token always stays:
        # the mass before it is 0, and a top_p that float32 rounds to 0 (1e-300) would reach that too.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# The largest temperature that float32 rounds to 0 (half its smallest subnormal, 2**-150): dividing by it
# is dividing by 0, so it is greedy, as 0 is.
_ZERO_IN_FLOAT32 = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps / 2


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, V) logits / temperature (> 0), whose softmax is exact at any temperature.

    A row whose top logit / temperature overflows (temperature 1e-40: inf, and the softmax's inf - inf is
    nan) is divided after subtracting its top logit: the same softmax, with 0 for the top token and a
    finite or -inf value below it. Every other row is `logits / temperature` bit for bit, and no value
    is read back to the host (no device sync per decoding step).
    """
    top = logits.amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(top / temperature), 0.0, top)
    return (logits - shift) / temperature


def sample_next_token(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 is greedy; so is one that float32 rounds to 0 (1e-320),
    and any other temperature > 0 samples softmax(logits / temperature) without overflowing to nan. One that is
    subnormal in float32 (1e-40) is applied in float64: a CPU that flushes subnormals (difftransformer.numerics)
    would read it as 0 in float32."""
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be >= 0 (0 is greedy) and finite, got {temperature}")
    logits = logits.float()
    if temperature <= _ZERO_IN_FLOAT32:
        return logits.argmax(dim=-1)
    if temperature < torch.finfo(torch.float32).tiny:
        logits = logits.double()
    logits = filter_logits(scale_logits(logits, temperature), top_k, top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def _check_arguments(input_ids: torch.Tensor, max_new_tokens, attention_mask: torch.Tensor | None) -> int:
    """max_new_tokens as an int, once generate's arguments are checked as it reads them: the prompt's shape and
    dtype as forward checks them (its ids' range is checked by the first forward), a whole max_new_tokens >= 0
    and a mask of the prompt's shape; else an error naming the argument (a mistake would otherwise surface as
    another argument's error, or as Python's own on a float)."""
    check_input_ids(input_ids, None)
    try:
        if isinstance(max_new_tokens, bool):
            raise TypeError
        n = operator.index(max_new_tokens)  # any integer: int, numpy's, a 0-d integer tensor
    except TypeError:
        raise TypeError(f"max_new_tokens must be an int (the number of tokens to add), got {max_new_tokens!r} "
                        f"({type(max_new_tokens).__name__})") from None
    if n < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {n}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)} (1 for each prompt "
                         f"token, 0 for left padding); got {tuple(attention_mask.shape)}")
    return n


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True, decoder: str = "auto",
             on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Extend (B, T) prompts by up to max_new_tokens; returns (B, T + n).

    Batched prompts of different lengths are left-padded with attention_mask 0 on the padding;
    each row then gets its own positions, so its output equals generating it alone. Rows that
    produced eos_token_id keep emitting it until every row is done.

    decoder: how the steps after the prompt run (`model.static_decode`). 'dynamic': a KV cache grown as
    tokens come; 'static': a cache of fixed capacity, every step the same kernels on the same memory;
    'graph': that step captured once in a CUDA graph and replayed (CUDA only), which removes the launch
    overhead that bounds a small model's decoding on a GPU; 'auto': 'graph' on CUDA where a graph can run
    (no score hook, no torch.compile trace: `static_decode.graph_unsupported`), else 'dynamic'. All give the
    same tokens up to rounding (greedy tokens equal; tests compare them). use_cache=False recomputes the
    whole sequence at each step (no cache, so 'dynamic').

    on_token: called with each step's (B,) new tokens (on the model's device) as soon as they are sampled,
    before the next step runs: for streaming output, or timing the first token.
    """
    max_new_tokens = _check_arguments(input_ids, max_new_tokens, attention_mask)
    check_decoder(decoder)
    limit = model.config.max_position_embeddings
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the "
                         f"model's max_position_embeddings {limit}")
    was_training = model.training
    model.eval()
    try:
        steps = _steps(model, input_ids, attention_mask, max_new_tokens, use_cache, decoder)
        B = input_ids.shape[0]
        tokens, done = [], torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        logits = steps.first() if max_new_tokens else None
        if logits is not None and not bool(torch.isfinite(logits).all()):  # checked once, on the prompt
            raise ValueError("the model produced non-finite logits (NaN or inf) for the prompt: its weights are "
                             "diverged or corrupt; generate from an earlier checkpoint")
        for i in range(max_new_tokens):
            nxt = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            tokens.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                break
            logits = steps.next(nxt)
        return torch.cat((input_ids, torch.stack(tokens, dim=1)), dim=1) if tokens else input_ids
    finally:
        model.train(was_training)


def _steps(model, input_ids, attention_mask, max_new_tokens: int, use_cache: bool, decoder: str):
    """The forward passes of one generate call: `_GrowingCache` or a `StaticDecoder`, as `decoder` asks."""
    device = input_ids.device
    if decoder in ("static", "graph") and not use_cache:
        raise ValueError(f"decoder={decoder!r} decodes on a KV cache, and use_cache=False asks for none; "
                         f"drop one of them")
    if decoder == "graph":
        why = graph_unsupported(model, device)
        if why is not None:
            raise ValueError(f"decoder='graph' cannot run here: {why}; use decoder='auto' or 'dynamic'")
    if decoder == "auto":
        decoder = "graph" if use_cache and graph_unsupported(model, device) is None else "dynamic"
    if decoder == "dynamic":
        return _GrowingCache(model, input_ids, attention_mask, max_new_tokens, use_cache)
    total = input_ids.shape[1] + max_new_tokens
    capacity = capacity_for(total, model.config.max_position_embeddings)
    static = decoder_for(model, input_ids.shape[0], capacity, device, graph=decoder == "graph")
    return _Static(static, input_ids, attention_mask)


class _Static:
    """A `StaticDecoder`'s prefill and steps, as `generate` calls them."""

    def __init__(self, decoder, input_ids, attention_mask):
        self.decoder, self.input_ids = decoder, input_ids
        self.mask = None if attention_mask is None else attention_mask.to(input_ids.device, torch.long)

    def first(self) -> torch.Tensor:
        return self.decoder.start(self.input_ids, self.mask)

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder.step(tokens)


class _GrowingCache:
    """Forward passes on a `KVCache` grown as tokens come (or, without a cache, on the whole sequence)."""

    def __init__(self, model, input_ids, attention_mask, max_new_tokens: int, use_cache: bool):
        self.model, self.seq = model, input_ids
        self.mask = None if attention_mask is None else attention_mask.to(input_ids.device, torch.long)
        self.positions = None if self.mask is None else positions_from_mask(self.mask)
        self.cache = KVCache(capacity=input_ids.shape[1] + max_new_tokens) if use_cache else None

    def first(self) -> torch.Tensor:
        return self._forward(self.seq, self.positions)

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        B = tokens.shape[0]
        if self.mask is not None:
            self.mask = torch.cat((self.mask, self.mask.new_ones(B, 1)), dim=1)
            self.positions = torch.cat((self.positions, self.positions[:, -1:] + 1), dim=1)
        if self.cache is not None:
            return self._forward(tokens[:, None], None if self.positions is None else self.positions[:, -1:])
        self.seq = torch.cat((self.seq, tokens[:, None]), dim=1)
        return self._forward(self.seq, self.positions)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        mask = None if self.mask is None else self.mask.bool()
        return self.model(ids, attention_mask=mask, position_ids=positions, kv_cache=self.cache,
                          logits_to_keep=1).logits[:, -1]
