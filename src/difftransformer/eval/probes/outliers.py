"""`outliers`: the largest and the typical magnitudes of attention logits and hidden states (paper Table 5).

Protocol (docs/evaluation.md, "`outliers`"):
- Two kinds of values, each reported as top-1, top-2, top-3, top-10, top-100 (the k-th largest value)
  and the median, global over layers, heads, positions and keys / channels, and also per layer:
  * |attention logits|: exactly the `scores` a score hook receives (attention/functional.py), i.e.
    |q1 k1^T / sqrt(d)| and |q2 k2^T / sqrt(d)| (both maps) for differential attention and
    |q k^T / sqrt(d)| for ordinary attention, for every query head (DIFF V2: its 2H paired query heads,
    one ordinary map each; settings["maps_per_layer"] records what each layer gave). Causally masked (future) entries
    are excluded through the hook's `visible` mask; a value a hook earlier in the chain planted at a
    visible entry is counted as the model would use it.
  * |hidden states|: every entry of each decoder block's output, after both residual adds.
- Text: non-overlapping windows of seq_len tokens (cfg.seq_len, else the model's context) cut in
  order from the held-out split (cfg.split), as `heldout-loss` and the trainer's validation cut them
  (windows may span document boundaries, as training windows do). The token budget `tokens` is
  rounded up to whole windows (the paper used 0.4M tokens; the default, 32,768 = 128 windows of the
  demo model's 256, finishes well within 2 minutes on the CPU demo model); cfg.max_windows caps the
  windows too. A budget below 1 is refused.

Streaming, in memory independent of the token budget:
- top-k: a running top-100 per layer and kind; each batch's top-100 is merged with it (top-100 of
  the union), which equals the top-100 over everything seen.
- median: a log-spaced histogram per layer and kind, bins of width 1e-3 in log10 over [1e-8, 1e8)
  (16,000 bins), exact zeros counted apart, values below 1e-8 / at or above 1e8 in an under / overflow
  bin. The median is the lower median (the value of 0-based rank floor((N-1)/2), as torch.median)
  estimated by the geometric centre of its bin: relative error at most 10^0.0005 - 1 = 0.115% (plus
  under 1e-5 from binning by fp32 logarithms when the values are fp32 or narrower). In an under/overflow
  bin it is reported as that bound, 1e-8 or 1e8. NaN entries are counted and left out.
- Memory: the state is 2 kinds x layers x (16,002 int64 bins + 100 values + counters) ~ 128 KiB per
  layer and kind, whatever the budget; the transient peak is a small multiple (about 3x) of ONE
  layer's logits for ONE batch (B x heads x maps x T x S values), while that layer's hook runs.

White box: runs on this package's models only (require_own_model), through eval/probes/hooks.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftransformer.eval.heldout import HeldOutSplit, heldout_split, input_windows, split_too_short, window_length
from difftransformer.eval.probes.hooks import (
    attention_layers,
    capture_layer_outputs,
    inspect_attention,
    probe_batch,
    require_own_model,
)
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task

log = logging.getLogger("difftransformer.eval")

TOP_KS = (1, 2, 3, 10, 100)
LOG10_MIN, LOG10_MAX, LOG10_BIN = -8.0, 8.0, 1e-3
NUM_BINS = round((LOG10_MAX - LOG10_MIN) / LOG10_BIN)  # 16,000 finite bins, plus under- and overflow
MEDIAN_RELATIVE_ERROR = 10 ** (LOG10_BIN / 2) - 1  # half a bin, as a factor: 0.115% (+ < 1e-5 from fp32 logs)
KINDS = ("attention_logits", "hidden_states")


@dataclass
class OutlierOptions:
    tokens: int = field(default=32768, metadata={
        "help": "token budget of held-out text, rounded up to whole windows (the paper: 400000)"})


def merge_topk(current: torch.Tensor, new: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of current and new together (descending; fewer when they hold fewer than k)."""
    both = torch.cat((current.to(new.dtype), new.reshape(-1)))
    return torch.topk(both, min(k, both.numel())).values


class AbsStats:
    """Streaming top-k and log-histogram median of |x| over a stream of tensors; memory is constant.

    update(values) takes any tensor of values already selected (e.g. only the visible logits)."""

    def __init__(self, k: int = max(TOP_KS), device: str | torch.device = "cpu"):
        self.k = k
        self.top = torch.empty(0, dtype=torch.float64, device=device)
        self.hist = torch.zeros(NUM_BINS + 2, dtype=torch.int64, device=device)  # [under, bins..., over]
        self.zeros = torch.zeros((), dtype=torch.int64, device=device)
        self.nans = torch.zeros((), dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, values: torch.Tensor) -> None:
        a = values.detach().reshape(-1)
        a = a.to(torch.promote_types(a.dtype, torch.float32)).abs()  # bins from fp32 logs (or wider), also for bf16
        nan = torch.isnan(a)
        if bool(nan.any()):
            self.nans += nan.sum()
            a = a[~nan]
        if a.numel() == 0:
            return
        self.top = merge_topk(self.top, torch.topk(a, min(self.k, a.numel())).values.double(), self.k)
        zeros = a.numel() - torch.count_nonzero(a)
        index = torch.log10(a).mul_(1 / LOG10_BIN).sub_(LOG10_MIN / LOG10_BIN)  # in place: one temporary
        index = index.floor_().clamp_(-1, NUM_BINS).add_(1).long()  # log10(0) = -inf lands in the underflow bin
        hist = torch.bincount(index, minlength=NUM_BINS + 2)
        hist[0] -= zeros  # exact zeros are counted apart
        self.hist += hist
        self.zeros += zeros

    @property
    def count(self) -> int:
        """How many values (NaNs excluded) were seen."""
        return int(self.zeros) + int(self.hist.sum())

    def kth(self, k: int) -> float | None:
        """The k-th largest |value| seen (exact), or None when fewer than k were seen."""
        return float(self.top[k - 1]) if k <= self.top.numel() else None

    def median(self) -> float | None:
        """The lower median, to the histogram's resolution (see the module doc); None when empty."""
        n = self.count
        if n == 0:
            return None
        rank = (n - 1) // 2
        if rank < int(self.zeros):
            return 0.0
        cum = torch.cumsum(self.hist.cpu(), 0)
        j = int(torch.searchsorted(cum, torch.tensor(rank - int(self.zeros)), right=True))
        if j == 0:
            return 10 ** LOG10_MIN
        if j == NUM_BINS + 1:
            return 10 ** LOG10_MAX
        return 10 ** (LOG10_MIN + (j - 0.5) * LOG10_BIN)

    def merged(self, others: list[AbsStats]) -> AbsStats:
        """A new AbsStats holding self and others together (as if one stream)."""
        out = AbsStats(self.k, self.hist.device)
        for s in (self, *others):
            out.top = merge_topk(out.top, s.top, self.k)
            out.hist += s.hist
            out.zeros += s.zeros
            out.nans += s.nans
        return out

    def nbytes(self) -> int:
        """Bytes the state holds (its tensors); bounded by the constants above, never by the stream's length."""
        return sum(t.numel() * t.element_size() for t in (self.top, self.hist, self.zeros, self.nans))

    def summary(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {f"top{k}": self.kth(k) for k in TOP_KS}
        out.update(median=self.median(), count=self.count, zeros=int(self.zeros), nans=int(self.nans),
                   underflow=int(self.hist[0]), overflow=int(self.hist[-1]))
        return out


class OutlierState:
    """One AbsStats per layer for each kind, and the hooks that feed them."""

    def __init__(self, num_layers: int, device: str | torch.device = "cpu"):
        self.layers = {kind: [AbsStats(device=device) for _ in range(num_layers)] for kind in KINDS}
        self.maps: list[int] = [0] * num_layers

    def score_hook(self, i: int):
        def hook(scores: torch.Tensor, visible: torch.Tensor | None) -> None:
            self.maps[i] = scores.shape[2]
            v = scores.detach()
            self.layers["attention_logits"][i].update(v if visible is None else v.masked_select(visible))
        return hook

    def hidden(self, i: int, h: torch.Tensor) -> None:
        self.layers["hidden_states"][i].update(h)

    def overall(self, kind: str) -> AbsStats:
        first, *rest = self.layers[kind]
        return first.merged(rest)

    def nbytes(self) -> int:
        return sum(s.nbytes() for stats in self.layers.values() for s in stats)


@register_task
class Outliers(Task):
    name = "outliers"
    description = "top-1/2/3/10/100 and median of |attention logits| and |hidden states| on held-out text (Table 5)"
    Options = OutlierOptions
    white_box = True
    version = 2  # 2: NaN counts are metrics (`<kind>_nans`); version 1 left NaNs out of every metric silently

    def check_options(self) -> None:
        if self.options.tokens < 1:
            raise ValueError(f"outliers option tokens is the token budget and must be >= 1, got {self.options.tokens}")

    @torch.no_grad()
    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        model = require_own_model(model, "outliers")
        seq_len = window_length(model, cfg)
        held = heldout_split(cfg, tokenizer, self.name)
        windows = input_windows(held.tokens, seq_len, self.options.tokens, cfg.max_windows)
        if len(windows) == 0:
            raise split_too_short(cfg.split, cfg.data_dir, len(held.tokens), f"the {seq_len} of one window (seq_len)")
        state = OutlierState(len(attention_layers(model)), cfg.device)
        batch = probe_batch(model, seq_len, cfg.batch_size, cfg.device)
        with inspect_attention(model, state.score_hook), capture_layer_outputs(model, state.hidden):
            for i in range(0, len(windows), batch):
                model(torch.from_numpy(windows[i:i + batch]).to(cfg.device))
        return self._result(state, windows.shape, held, cfg, model.config.attention)

    def _result(self, state: OutlierState, shape: tuple[int, int], held: HeldOutSplit, cfg: EvalConfig,
                attention: str) -> TaskResult:
        metrics: dict[str, float] = {}
        merged = {kind: state.overall(kind) for kind in KINDS}
        overall = {}
        for kind in KINDS:
            overall[kind] = merged[kind].summary()
            for key in (*(f"top{k}" for k in TOP_KS), "median"):
                if overall[kind][key] is not None:
                    metrics[f"{kind}_{key}"] = overall[kind][key]
            if overall[kind]["nans"]:  # left out of the values above; the most extreme value there is, so named
                metrics[f"{kind}_nans"] = overall[kind]["nans"]
                log.warning("outliers: %d of the %s are NaN (left out of the top values and the median)",
                            overall[kind]["nans"], kind.replace("_", " "))
        return TaskResult(
            task=self.name,
            metrics=metrics,
            settings={"seq_len": shape[1], "windows": shape[0],
                      "tokens": shape[0] * shape[1], "attention": attention, "maps_per_layer": state.maps,
                      "median_method": {"histogram": "log10 bins", "log10_bin_width": LOG10_BIN,
                                        "range": [10 ** LOG10_MIN, 10 ** LOG10_MAX],
                                        "relative_error": MEDIAN_RELATIVE_ERROR, "median": "lower median",
                                        "zeros": "counted apart"},
                      "state_bytes": state.nbytes(), **held.settings()},
            details={"overall": overall,
                     "per_layer": {kind: [s.summary() for s in state.layers[kind]] for kind in KINDS},
                     "top100": {kind: merged[kind].top.tolist() for kind in KINDS}},
        )

    def plot(self, result: TaskResult, path: Path) -> bool:
        from matplotlib.figure import Figure

        labels = [*(f"top-{k}" for k in TOP_KS), "median"]
        fig = Figure(figsize=(9, 3.6))
        for n, kind in enumerate(KINDS):
            ax = fig.add_subplot(1, 2, n + 1)
            values = [result.metrics.get(f"{kind}_{key}", math.nan) for key in (*(f"top{k}" for k in TOP_KS),
                                                                                 "median")]
            bars = ax.bar(labels, values)
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set_yscale("log")
            ax.set_title(f"|{kind.replace('_', ' ')}|")
            ax.tick_params(axis="x", labelrotation=45)
        fig.suptitle(f"{result.settings['attention']}: {result.settings['tokens']} tokens")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return True
