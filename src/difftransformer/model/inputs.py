"""What a causal LM's forward takes: token ids checked once, positions from a padding mask, and which positions
get logits.

Shared by the native model (`modeling`), its `generate` (`generation`) and the transformers wrapper
(`difftransformer.hf`), so each states the same rule in the same words.
"""

from __future__ import annotations

import torch


def check_input_ids(input_ids: torch.Tensor, vocab_size: int | None) -> None:
    """(batch, seq_len) integer token ids inside [0, vocab_size), or a one-line error saying what is wrong.
    vocab_size None checks the shape and dtype only (`generate`, before its first forward checks the range)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len); got shape {tuple(input_ids.shape)} "
                         f"(use input_ids[None] for a single sequence)")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty")
    # The range check reads the ids on the host, which would break a torch.compile graph or a CUDA graph's
    # capture; there the embedding's own bounds check has to do (a captured decoding step feeds it the ids
    # that the step before it sampled, which lie in the vocabulary by construction).
    if vocab_size is not None and not torch.compiler.is_compiling() and not (
            input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()  # one host sync, not two
        if lo < 0 or hi >= vocab_size:
            bad = hi if hi >= vocab_size else lo
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}); "
                             f"was the input encoded with this model's tokenizer?")


def keep_last_positions(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of x (B, T, ...) whose logits are computed: all (0), the last n (int n), or the
    given position indices (a tensor, transformers' other form)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep]
    return x if last_rows_kept(logits_to_keep) == 0 else x[:, -logits_to_keep:]


def last_rows_kept(logits_to_keep: int | torch.Tensor) -> int:
    """n when logits_to_keep keeps the last n positions, 0 when it keeps all or names positions (a tensor)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return 0
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0 (0 keeps every position), got {logits_to_keep}")
    return int(logits_to_keep)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position, counting only the tokens its row keeps: (B, S) 1/True for real tokens, 0 for left
    padding, in; (B, S) int64 out, 0 at the padding. So a left-padded row gets the positions it would have alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

