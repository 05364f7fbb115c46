"""`logit-quant`: how a model degrades when its pre-softmax attention logits are quantised (Fig. 8).

Protocol (paper §3.8; docs/evaluation.md): dynamic absmax post-training fake quantisation of the
attention logits, both maps for DIFF (Q1K1ᵀ/√d and Q2K2ᵀ/√d, each its own tensor), the one map of
ordinary attention:

    s = max|x| / (2^(b-1) - 1),    x̂ = round(x / s) · s,    then the softmax as usual.

Choices where the paper is silent, all recorded in the result:
- 16 bits means unquantised (the paper's reference is its BF16 model); 8, 6, 4 (and any b >= 2) are
  quantised as above.
- Granularity: "tensor" = one scale per sequence, layer and map (the max over every head, query and
  key: the harshest), "row" = one scale per query row of each head and map. Both by default. DIFF V2
  computes its two maps in one attention call (heads 2i and 2i + 1 of pair i); they are quantised as
  V1's, each map with its own scale (`fake_quantize(..., paired=True)`).
- The max is over the entries a query may see: causally masked logits are never computed by a real
  kernel, so they neither set the scale nor matter after the softmax.
- The metrics are the held-out loss (the `heldout-loss` windows of the test split, read once for
  every cell) and, as a task accuracy, forced-choice multi-needle retrieval (the `needle` task's
  scoring) at each bit width; the paper used zero-shot HellaSwag, which does not exist offline.

The quantiser is applied through the layers' explicit score hook (eval/probes/hooks.py); nothing is
patched, and the model is restored afterwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from difftransformer.eval.heldout import heldout_split, window_length
from difftransformer.eval.probes.hooks import inspect_attention, probe_batch, require_own_model
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task
from difftransformer.eval.tasks.heldout_loss import loss_windows, windowed_nll

UNQUANTISED_BITS = 16
GRANULARITIES = ("tensor", "row")


def fake_quantize(scores: torch.Tensor, visible: torch.Tensor | None, bits: int, granularity: str,
                  paired: bool = False) -> torch.Tensor:
    """Dynamic absmax fake quantisation of scores (B, heads, maps, T, S) to `bits` bits.

    The scale comes from the visible entries only: per (sequence, map) for "tensor", per
    (sequence, head, map, query) for "row". A group whose visible entries are all 0 stays 0.
    paired: DIFF V2's scores (B, 2H, 1, T, S), where head 2i + c holds map c of pair i (one ordinary
    attention call, attention/functional.py `paired_difference`); they are quantised as V1's (B, H, 2, T, S),
    so "tensor" gives each of the two maps its own scale, as V1 gets."""
    if bits < 2:
        raise ValueError(f"bits must be >= 2 (one sign bit and at least one magnitude bit), got {bits}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if paired:
        if scores.shape[1] % 2 or scores.shape[2] != 1:
            raise ValueError(f"paired scores are (B, 2H, 1, T, S) with an even head count, got {tuple(scores.shape)}")
        as_v1 = lambda x: x.unflatten(1, (-1, 2)).flatten(2, 3)  # noqa: E731  (B, 2H, 1, T, S) -> (B, H, 2, T, S)
        seen = None if visible is None else as_v1(visible.expand_as(scores))
        return fake_quantize(as_v1(scores), seen, bits, granularity).unflatten(2, (2, 1)).flatten(1, 2)
    magnitude = scores.abs() if visible is None else scores.abs().masked_fill(~visible, 0.0)
    if granularity == "row":
        absmax = magnitude.amax(dim=-1, keepdim=True)
    else:  # over heads, queries and keys, separately for each sequence and map
        absmax = magnitude.amax(dim=(1, 3, 4), keepdim=True)
    step = absmax / (2 ** (bits - 1) - 1)
    step = torch.where(step > 0, step, torch.ones_like(step))  # all-zero groups: x / 1 rounds to 0 already
    return torch.round(scores / step) * step


@dataclass
class LogitQuantOptions:
    bits: tuple[int, ...] = field(default=(16, 8, 6, 4), metadata={"help": "bit widths; 16 is the unquantised "
                                                                           "reference"})
    granularity: tuple[str, ...] = field(default=GRANULARITIES, metadata={
        "help": "scale per 'tensor' (sequence, layer, map) and/or per 'row' (query row of a head)"})
    windows: int = field(default=32, metadata={"help": "held-out windows (of the model's context) for the loss; "
                                                       "EvalConfig.max_windows caps it too"})
    needle_samples: int = field(default=40, metadata={
        "help": "forced-choice needle prompts for the accuracy (0: loss only)"})
    needle_length: int = field(default=0, metadata={"help": "needle prompt length in tokens (0: the model's "
                                                             "context)"})


@register_task
class LogitQuant(Task):
    name = "logit-quant"
    description = ("held-out loss and forced-choice needle accuracy with the attention logits quantised to "
                   "16/8/6/4 bits (dynamic absmax, per tensor and per row)")
    Options = LogitQuantOptions
    white_box = True
    # 2: EvalConfig.max_windows caps the loss windows, as in heldout-loss (version 1 ignored it); 3: DIFF V2's two
    # maps get a scale each under "tensor", as V1's (version 2 gave the pair one scale)
    version = 3

    def check_options(self) -> None:
        o = self.options
        if not o.bits or any(not 2 <= b <= UNQUANTISED_BITS for b in o.bits):
            raise ValueError(f"logit-quant bits must each lie in 2..{UNQUANTISED_BITS} ({UNQUANTISED_BITS} = the "
                             f"unquantised reference), got {list(o.bits)}")
        bad = [g for g in o.granularity if g not in GRANULARITIES]
        if bad or not o.granularity:
            raise ValueError(f"logit-quant granularity takes {', '.join(GRANULARITIES)}, got {list(o.granularity)}")
        minimums = (("windows", 1, "held-out windows for the loss"), ("needle_samples", 0, "0: loss only"),
                    ("needle_length", 0, "0: the model's context"))
        for key, least, meaning in minimums:
            if getattr(o, key) < least:
                raise ValueError(f"logit-quant {key} must be >= {least} ({meaning}), got {getattr(o, key)}")

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        require_own_model(model, self.name)
        o = self.options
        held = heldout_split(cfg, tokenizer, self.name)  # read (and re-tokenised) once for every cell
        seq_len = window_length(model, cfg)
        windows = loss_windows(held, seq_len, min(o.windows, cfg.max_windows or o.windows))
        text = (held.tokens, seq_len, windows)
        samples = self._needle_samples(model, tokenizer, cfg) if o.needle_samples else None
        cells: dict[str, dict[str, float]] = {}
        reference = self._measure(model, cfg, text, samples, None, "tensor")
        for granularity in o.granularity:
            for bits in sorted(set(o.bits), reverse=True):
                measured = reference if bits == UNQUANTISED_BITS else self._measure(
                    model, cfg, text, samples, bits, granularity)
                cells[f"{granularity}/{bits}"] = measured
        metrics = {}
        for key, m in cells.items():
            metrics[f"loss@{key}"] = m["loss"]
            metrics[f"loss_increase@{key}"] = m["loss"] - reference["loss"]
            if "needle_accuracy" in m:
                metrics[f"needle_accuracy@{key}"] = m["needle_accuracy"]
        return TaskResult(
            task=self.name, metrics=metrics,
            settings={"formula": "s = max|x| / (2^(b-1) - 1) over visible entries; x_hat = round(x / s) * s",
                      "unquantised_bits": UNQUANTISED_BITS, **held.settings(), "seq_len": seq_len,
                      "windows": windows, "tokens": windows * seq_len,
                      "needle": None if samples is None else {"prompts": len(samples), "length": self._length(model)}},
            details={"cells": cells, "reference": reference})

    def _length(self, model) -> int:
        return self.options.needle_length or model.config.max_position_embeddings

    def _needle_samples(self, model, tokenizer, cfg: EvalConfig):
        from difftransformer.eval.tasks import needle

        try:
            return needle.forced_choice_samples(model, tokenizer, cfg, self.options.needle_samples,
                                                self._length(model))
        except ValueError as e:  # its advice (fewer needles...) names options of `needle`, not of this task
            raise ValueError(f"logit-quant's forced-choice needle prompts cannot be built for this model "
                             f"({str(e).split('; ')[0]}); "
                             f"measure the loss alone with --needle-samples 0 (needle_samples=0)") from None

    def _measure(self, model, cfg: EvalConfig, text: tuple, samples, bits: int | None,
                 granularity: str) -> dict[str, float]:
        """The held-out loss over `text` (tokens, seq_len, windows) and the needle accuracy, with the
        attention logits quantised to `bits` (None: as they are)."""
        paired = model.config.kind.v2  # DIFF V2: a pair's two maps sit side by side in the head axis

        def make_hook(_layer: int):
            if bits is None:
                return None
            return lambda scores, visible: fake_quantize(scores, visible, bits, granularity, paired)

        with inspect_attention(model, make_hook):
            total, count = windowed_nll(model, *text, probe_batch(model, text[1], cfg.batch_size, cfg.device),
                                        cfg.device)
            out = {"loss": total / count}
            if samples is not None:
                from difftransformer.eval.tasks import needle

                length = max(len(s.ids) for s in samples) + 16  # + the longest candidate
                fitting = dataclasses.replace(cfg, batch_size=probe_batch(model, length, cfg.batch_size, cfg.device))
                out["needle_accuracy"] = needle.forced_choice_accuracy(model, samples, fitting)
        return out

    def plot(self, result: TaskResult, path) -> bool:
        from matplotlib.figure import Figure

        cells = result.details["cells"]
        keys = ["loss"] + (["needle_accuracy"] if "needle_accuracy" in result.details["reference"] else [])
        fig = Figure(figsize=(4.2 * len(keys), 3.4))
        for i, key in enumerate(keys):
            ax = fig.add_subplot(1, len(keys), i + 1)
            for granularity in self.options.granularity:
                pts = sorted((int(k.split("/")[1]), v[key]) for k, v in cells.items() if k.startswith(granularity))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"per {granularity}")
            ax.set_xlabel("bits of the attention logits")
            ax.set_ylabel("held-out loss (nats)" if key == "loss" else "needle accuracy (forced choice)")
            ax.invert_xaxis()
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle("Attention-logit quantisation (cf. paper Fig. 8)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return True
