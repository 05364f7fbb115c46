"""`attention-noise`: how the answer-producing attention is spread over a retrieval prompt (paper Fig. 1, Table 3).

Protocol (docs/evaluation.md, "`attention-noise`"): needle prompts from `data/needle.py` (default:
one needle in held-out text; the option `length`, else EvalConfig.seq_len, else the model's context
long; the answer needle at depth 0/25/50/75/100%). Each prompt is cut into five segments: BOS, the
context before the answer needle (the instruction included), the answer, the context after it,
and the query (the question through its completion cue). The attention rows that produce the answer are
summed over each segment:

- The map: `AttentionMaps.diff` of every layer, i.e. A1 - λA2 for DIFF (its rows sum to 1 - λ and
  may hold negative entries), A1 - λ_t A2 for DIFF V2, and the softmax map of ordinary attention.
- Normalised shares: each row divided by its own sum, so the five segments sum to 1 (the paper's
  Fig. 1 numbers); raw shares: the sums as they are (DIFF: they sum to 1 - λ), reported too.
  A row whose sum is near 0 (λ near 1) has unbounded normalised shares: read `raw_total` beside them.
- Averaged over heads and layers (the maintainers' answer), then over prompts; per layer too.
- "Attention to answer" = the answer segment; "attention noise" = the two context segments
  (before + after) together, as in Table 3; both reported per answer depth.

The two choices the paper leaves open are options, and every combination is in the details:
- query_rows: "last" = the row of the last prompt token (the one that predicts the answer's first
  token); "question" = the mean over the rows of every query token.
- answer: "sentence" = the whole answer needle; "number" = its number tokens only (the rest of the
  sentence then counts as context before / after).
Rows are averaged after normalising (each row's shares sum to 1, so their mean does too).

White box: runs on this package's models only (require_own_model); maps come from the eager path
through `eval/probes/hooks.inspect_attention`, which keeps any score hook already on a layer (a
test plants one that forces attention onto the answer). Memory: one prompt at a time, with every
layer's three maps (B=1, heads x T x T each, fp32) alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftransformer.data.needle import NeedleSample, check_needle_args
from difftransformer.eval.heldout import window_length
from difftransformer.eval.probes.hooks import inspect_attention, probe_batch, require_own_model
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task
from difftransformer.eval.tasks.needle import DEPTHS, haystack_text, needle_samples

SEGMENTS = ("bos", "before", "answer", "after", "query")
QUERY_ROWS = ("last", "question")
ANSWERS = ("sentence", "number")


def segment_shares(rows: torch.Tensor, answer: tuple[int, int], query_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, normalised) allocation of attention rows over the five segments.

    rows (..., S): attention over a prompt's S keys (entries a row may not see are 0). The segments
    are [0, 1) BOS, [1, a) before, [a, b) answer, [b, q) after, [q, S) query, with (a, b) = answer
    and q = query_start. raw (..., 5): each row's sum over each segment; normalised: raw divided by
    the row's total, so it sums to 1 even where rows sum to 1 - λ or hold negative entries."""
    S = rows.shape[-1]
    a, b = answer
    if not 1 <= a < b <= query_start <= S:
        raise ValueError(f"segments must satisfy 1 <= answer start < answer end <= query start <= keys; got answer "
                         f"({a}, {b}), query start {query_start}, {S} keys")
    edges = (0, 1, a, b, query_start, S)
    raw = torch.stack([rows[..., edges[i]:edges[i + 1]].sum(-1) for i in range(5)], dim=-1)
    return raw, raw / raw.sum(-1, keepdim=True)


def answer_span(sample: NeedleSample, answer: str) -> tuple[int, int]:
    return sample.segments.answer if answer == "sentence" else sample.segments.number


@torch.no_grad()
def attention_allocation(model, sample: NeedleSample, device: str | torch.device = "cpu"
                         ) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """For each (query_rows, answer) choice: (raw, normalised) shares per layer, (layers, 5) float64,
    each averaged over heads and the chosen rows."""
    ids = torch.tensor([sample.ids], device=device)
    with inspect_attention(model):
        out = model(ids, return_attention=True)
    q = sample.segments.query[0]
    per: dict[tuple[str, str], tuple[list, list]] = {(r, a): ([], []) for r in QUERY_ROWS for a in ANSWERS}
    for maps in out.attentions:
        m = maps.diff[0].double()  # (heads, T, S)
        for rows_mode in QUERY_ROWS:
            rows = m[:, -1:, :] if rows_mode == "last" else m[:, q:, :]
            for ans in ANSWERS:
                raw, norm = segment_shares(rows, answer_span(sample, ans), q)
                per[(rows_mode, ans)][0].append(raw.mean(dim=(0, 1)))
                per[(rows_mode, ans)][1].append(norm.mean(dim=(0, 1)))
    return {k: (torch.stack(raw).cpu(), torch.stack(norm).cpu()) for k, (raw, norm) in per.items()}


def mean_allocation(model, samples: list[NeedleSample], device: str | torch.device = "cpu"
                    ) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """`attention_allocation` averaged over prompts: per choice, (raw, normalised) per layer."""
    allocs = [attention_allocation(model, s, device) for s in samples]
    return {k: (torch.stack([a[k][0] for a in allocs]).mean(0), torch.stack([a[k][1] for a in allocs]).mean(0))
            for k in allocs[0]}


def _named(vec: torch.Tensor) -> dict[str, float]:
    d = {s: float(v) for s, v in zip(SEGMENTS, vec)}
    d["noise"] = d["before"] + d["after"]
    return d


def summarise(per_depth: dict[float, dict], chosen: tuple[str, str]) -> tuple[dict[str, float], dict]:
    """(metrics, details) from each depth's `mean_allocation`; `chosen` = (query_rows, answer).

    Layers are averaged with equal weight, then depths (every depth has the same prompt count)."""
    def over(choice, kind: int, layers: bool = True) -> torch.Tensor:  # kind 0 raw, 1 normalised
        stacked = torch.stack([alloc[choice][kind] for alloc in per_depth.values()]).mean(0)
        return stacked.mean(0) if layers else stacked

    metrics = _named(over(chosen, 1))
    raw = over(chosen, 0)
    metrics.update({f"raw_{k}": v for k, v in _named(raw).items()})
    metrics["raw_total"] = float(raw.sum())
    depths = {}
    for d, alloc in per_depth.items():
        r, n = alloc[chosen]
        depths[str(d)] = {"normalised": _named(n.mean(0)), "raw": _named(r.mean(0)),
                          "per_layer": {"normalised": n.tolist(), "raw": r.tolist()}}
        metrics[f"answer@{d}"] = depths[str(d)]["normalised"]["answer"]
        metrics[f"noise@{d}"] = depths[str(d)]["normalised"]["noise"]
    variants = {}
    for choice in next(iter(per_depth.values())):
        r, n = _named(over(choice, 0)), _named(over(choice, 1))
        variants[f"{choice[0]}/{choice[1]}"] = {"answer": n["answer"], "noise": n["noise"],
                                               "raw_answer": r["answer"], "raw_noise": r["noise"]}
    per_layer = {"segments": list(SEGMENTS), "normalised": over(chosen, 1, layers=False).tolist()}
    return metrics, {"depths": depths, "variants": variants, "per_layer": per_layer}


@dataclass
class AttentionNoiseOptions:
    depths: tuple[int, ...] = field(default=DEPTHS, metadata={"help": "answer-needle depths in percent of the context"})
    samples: int = field(default=10, metadata={"help": "prompts per depth"})
    length: int = field(default=0, metadata={
        "help": "prompt length in tokens; 0: EvalConfig.seq_len, else the model's context"})
    needles: int = field(default=1, metadata={"help": "needles per prompt (the answer needle and N - 1 others)"})
    haystack: str = field(default="text", metadata={
        "help": "text: held-out text of EvalConfig.data_dir; needles: only other needles"})
    digits: int = field(default=7, metadata={"help": "digits of the magic numbers"})
    query_rows: str = field(default="last", metadata={
        "help": "rows measured: last (the last prompt token) or question (mean over the query tokens)"})
    answer: str = field(default="sentence", metadata={
        "help": "the answer segment: sentence (the whole needle) or number (its number tokens only)"})


@register_task
class AttentionNoise(Task):
    name = "attention-noise"
    description = ("attention of the answer-producing rows to the answer needle vs the rest of the context (attention "
                   "noise), per answer depth, DIFF map A1 - λA2 normalised per row (paper Fig. 1, Table 3)")
    Options = AttentionNoiseOptions
    white_box = True
    version = 2  # 2: a prompt's needle numbers have one token count (data/needle.py draw_needles): other prompts

    def check_options(self) -> None:
        o = self.options
        if o.query_rows not in QUERY_ROWS:
            raise ValueError(f"attention-noise query_rows must be one of {', '.join(QUERY_ROWS)}, got {o.query_rows!r}")
        if o.answer not in ANSWERS:
            raise ValueError(f"attention-noise answer must be one of {', '.join(ANSWERS)}, got {o.answer!r}")
        if not o.depths:
            raise ValueError("attention-noise depths must list at least one depth in 0..100")
        for d in o.depths:
            check_needle_args(length=1, depth=d, needles=o.needles, queries=1, haystack=o.haystack, digits=o.digits,
                              context=None)
        if o.samples < 1 or o.length < 0:
            raise ValueError(f"attention-noise samples must be >= 1 and length >= 0, got {o.samples} and {o.length}")

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        require_own_model(model, self.name)
        o = self.options
        context = model.config.max_position_embeddings
        length = window_length(model, cfg, "attention-noise length", o.length)
        probe_batch(model, length, 1, cfg.device, maps_kept=model.config.num_hidden_layers)  # one prompt must fit
        check_needle_args(length=length, depth=0, needles=o.needles, queries=1, haystack=o.haystack, digits=o.digits,
                          context=context)
        if tokenizer is None:
            raise ValueError("attention-noise needs the model's tokenizer (the tokenizer.json saved with it)")
        text, source = (None, {})
        if o.haystack == "text":
            text, source = haystack_text(cfg, tokenizer, self.name)
        prompts = {d: needle_samples(tokenizer, needles=o.needles, queries=1, depth=d, length=length, count=o.samples,
                                     seed=cfg.eval_seed, haystack=o.haystack, text=text, digits=o.digits,
                                     context=context) for d in o.depths}  # every prompt built (and checked) first
        per_depth = {d: mean_allocation(model, samples, cfg.device) for d, samples in prompts.items()}
        metrics, details = summarise(per_depth, (o.query_rows, o.answer))
        settings = {"context": context, "length": length, "attention": getattr(model.config, "attention", None),
                    "map": "AttentionMaps.diff (A1 - λA2 for DIFF, the softmax map for ordinary attention)",
                    "average": "rows, then heads, then layers, then prompts; normalised = each row / its sum",
                    "segments": list(SEGMENTS), "noise": "before + after", **source}
        return TaskResult(task=self.name, metrics=metrics, settings=settings, details=details)

    def plot(self, result: TaskResult, path: Path) -> bool:
        """Fig. 1 bars (the five segments), Table 3 (answer and noise vs depth), and per-layer shares."""
        from matplotlib.figure import Figure

        m, details = result.metrics, result.details
        fig = Figure(figsize=(13, 3.8))
        ax = fig.add_subplot(1, 3, 1)
        values = [m[s] for s in SEGMENTS]
        bars = ax.bar(range(5), values, color=["#999999", "#d62728", "#2ca02c", "#d62728", "#1f77b4"])
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
        ax.set_xticks(range(5), ["BOS", "context\nbefore", "answer", "context\nafter", "query"], fontsize=8)
        ax.set_ylabel("normalised attention")
        ax.set_title(f"allocation (answer {m['answer']:.2f}, noise {m['noise']:.2f})", fontsize=9)
        ax.axhline(0, color="black", lw=0.5)
        ax = fig.add_subplot(1, 3, 2)
        depths = list(details["depths"])
        xs = [float(d) for d in depths]
        ax.plot(xs, [details["depths"][d]["normalised"]["answer"] for d in depths], marker="o", label="answer")
        ax.plot(xs, [details["depths"][d]["normalised"]["noise"] for d in depths], marker="s", label="noise")
        ax.set_xticks(xs)
        ax.set_xlabel("answer depth (%)")
        ax.set_ylabel("normalised attention")
        ax.set_title("per depth (cf. Table 3)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = fig.add_subplot(1, 3, 3)
        layers = details["per_layer"]["normalised"]
        ax.plot(range(len(layers)), [row[2] for row in layers], marker="o", label="answer")
        ax.plot(range(len(layers)), [row[1] + row[3] for row in layers], marker="s", label="noise")
        ax.set_xticks(range(len(layers)))
        ax.set_xlabel("layer")
        ax.set_title("per layer (mean over depths)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        o = result.settings.get("options", {})
        fig.suptitle(f"Attention to the answer vs attention noise ({result.settings.get('attention')}; rows "
                     f"{o.get('query_rows', '?')}, answer {o.get('answer', '?')}; cf. paper Fig. 1)", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return True
