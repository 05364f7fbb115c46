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
from difftransformer.eval.heldout import heldout_split
from difftransformer.eval.lm import token_nll
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task


@register_task
class HeldOutLoss(Task):
    name = "heldout-loss"
    description = "token-weighted loss, perplexity and bits per token on a held-out split of a prepared corpus"

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        held = heldout_split(cfg, tokenizer, self.name)
        split = held.tokens
        seq_len = cfg.seq_len or model.config.max_position_embeddings
        if seq_len > model.config.max_position_embeddings:
            raise ValueError(f"seq_len {seq_len} is beyond the model's context of {model.config.max_position_embeddings} "
                             f"tokens; use seq_len <= {model.config.max_position_embeddings}")
        windows = num_eval_windows(split, seq_len)
        if cfg.max_windows is not None:
            windows = min(windows, cfg.max_windows)
        if windows == 0:
            raise ValueError(f"the {cfg.split} split of {cfg.data_dir} has fewer than seq_len + 1 = {seq_len + 1} "
                             f"tokens; lower seq_len")
        total, count = 0.0, 0
        max_batches = -(-windows // cfg.batch_size)
        for inputs, targets in iter_eval_batches(split, cfg.batch_size, seq_len, max_batches):
            keep = min(inputs.shape[0], windows - count // seq_len)
            ids = torch.cat((inputs[:keep], targets[:keep, -1:]), dim=1).to(cfg.device)
            nll = token_nll(model, ids)
            total += float(nll.double().sum())
            count += nll.numel()
        loss = total / count
        return TaskResult(
            task=self.name,
            metrics={"loss": loss, "perplexity": math.exp(loss), "bits_per_token": loss / math.log(2)},
            settings={**held.settings(), "seq_len": seq_len, "windows": windows, "tokens": count},
        )
