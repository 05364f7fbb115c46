"""`heldout-loss`: a model's loss and perplexity on held-out text of a prepared corpus.

The split is cut into non-overlapping windows of seq_len + 1 tokens, in order (the same windows the
trainer validates on), and every window's targets are scored given their window. The result is the
token-weighted mean negative log-likelihood in nats, its perplexity exp(loss), and bits per token.
On the val split with the trainer's seq_len and window count it equals the run's logged val loss.
"""

from __future__ import annotations

import math

import torch

from difftransformer.data import iter_eval_batches, num_eval_windows
from difftransformer.eval.heldout import HeldOutSplit, heldout_split, split_too_short, window_length
from difftransformer.eval.lm import token_nll
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task


def loss_windows(held: HeldOutSplit, seq_len: int, cap: int | None) -> int:
    """How many of the split's validation windows of seq_len + 1 tokens are scored (at most `cap`);
    none is a ValueError naming the split and the fix."""
    windows = num_eval_windows(held.tokens, seq_len)
    if cap is not None:
        windows = min(windows, cap)
    if windows == 0:
        raise split_too_short(held.split, held.data.out_dir, len(held.tokens), f"the {seq_len + 1} of one window "
                              f"(seq_len + 1)")
    return windows


def windowed_nll(model, tokens, seq_len: int, windows: int, batch_size: int, device) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) over the first `windows` validation windows of `tokens`, the
    trainer's windows (data.iter_eval_batches), summed in float64. The one home of the held-out loss:
    `heldout-loss` reports it, `logit-quant` measures it under each quantiser on a split read once."""
    total, count = 0.0, 0
    max_batches = -(-windows // batch_size)
    for inputs, targets in iter_eval_batches(tokens, batch_size, seq_len, max_batches):
        keep = min(inputs.shape[0], windows - count // seq_len)
        ids = torch.cat((inputs[:keep], targets[:keep, -1:]), dim=1).to(device)
        nll = token_nll(model, ids)
        total += float(nll.double().sum())
        count += nll.numel()
    return total, count


@register_task
class HeldOutLoss(Task):
    name = "heldout-loss"
    description = "token-weighted loss, perplexity and bits per token on a held-out split of a prepared corpus"
    derived_metrics = {"perplexity": "loss", "bits_per_token": "loss"}

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        held = heldout_split(cfg, tokenizer, self.name)
        seq_len = window_length(model, cfg)
        windows = loss_windows(held, seq_len, cfg.max_windows)
        total, count = windowed_nll(model, held.tokens, seq_len, windows, cfg.batch_size, cfg.device)
        loss = total / count
        return TaskResult(
            task=self.name,
            metrics={"loss": loss, "perplexity": math.exp(loss), "bits_per_token": loss / math.log(2)},
            settings={**held.settings(), "seq_len": seq_len, "windows": windows, "tokens": count},
        )
