"""`needle`: multi-needle retrieval (paper §3.4, Table 2 / Fig. 5), scored greedily and by forced choice.

Protocol (docs/evaluation.md, "`needle`"; prompts from `data/needle.py`, whose module doc
states the layout): N needles "The special magic {city} number is: {number}." in a haystack, R of
the cities asked for after it; the first queried city's needle (the answer needle) at depth
0/25/50/75/100% of the context, the others elsewhere; a grid of (N, R) pairs x depths x lengths,
`samples` prompts per (depth, length) cell. Cities and numbers are distinct within a prompt.

Two scorings of every queried city (R > 1: each city has its own prompt ending with its cue):
- greedy: up to `max_new_tokens` tokens decoded greedily (stopping at EOS); correct when the
  target number's digit string appears in the output (the protocol's substring rule).
- forced choice (not the paper's; for small models): the log-likelihood of " {number}" as the
  continuation, for each of the N needles' numbers; correct when the target ranks first. A tie
  for first place among k candidates earns 1/k (the expected score of breaking it at random), so
  a model without preference scores chance, 1/N, exactly.

Choices where the paper is silent:
- Likelihood = the SUM of the number's token log-probabilities (numbers have the same digit count,
  so this is the full likelihood of equally long strings; no length normalisation).
- Forced choice covers the N needles only: filler needles of a "needles" haystack are distractors
  for greedy decoding but not candidates (each would cost a forward pass). With N = 1 forced
  choice is trivially 1.0 (left out of the headline `forced_choice`); the cell's chance level (mean 1/N) is
  in the details as `forced_choice_chance`.
- Lengths: exact token counts of the prompt of the first queried city (BOS, instruction, context,
  question). Left empty, each (N, R) pair gets the lengths among 1/4, 1/2, 3/4, 1 x the longest
  usable length that leave a typical draw a haystack of at least one needle's length, which every
  exact depth needs (`min_prompt_length(..., typical=True)`; at least the longest). The
  longest usable length is the model's context minus room for the answer: max(max_new_tokens,
  digits + 1) tokens, and for R > 1 also the cue slack (another city's cue may be longer).
- Haystack "text" comes from cfg.split (test by default, never train) of cfg.data_dir, EOS ids
  removed; a data folder tokenised with another tokenizer than the model's is tokenised again with the
  model's (eval/heldout.py; checked by hash when the tokenizer has one).
- Prompts are seeded per cell from cfg.eval_seed, N, R, depth, length, haystack and digits, so a
  cell's prompts do not change when the grid around it does. Every cell's prompts are built before
  the first forward pass (and again, the same, when the cell is scored), so a length that cannot hold
  the needles drawn is refused before any work is done.
- Headline metrics: per (N, R), the mean over every scored (prompt, city) of the pair's cells;
  `greedy` / `forced_choice` are the unweighted means over the pairs.

Black box: only model(ids).logits, model.generate(ids, n, temperature=0, eos_token_id=...) and
model.config.max_position_embeddings are used.

Reuse: `needle_samples` builds a cell's prompts; `forced_choice_accuracy(model, samples, cfg)` scores
any list of them; `forced_choice_samples(model, tokenizer, cfg, count, length)` makes a default set
that fits within `length` tokens together with the answer (used by the logit-quantisation probe).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from difftransformer.data.needle import (
    HeldoutText,
    NeedleSample,
    check_needle_args,
    cue_slack,
    min_prompt_length,
    needle_prompt,
)
from difftransformer.eval.heldout import heldout_split, window_length
from difftransformer.eval.lm import continuation_token_logprobs, first_place_share, until_eos
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task

DEPTHS = (0, 25, 50, 75, 100)
AUTO_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


@dataclass
class NeedleOptions:
    needles: tuple[int, ...] = field(default=(1, 2, 4, 6), metadata={
        "help": "N, needles per prompt, one grid row per entry (paired with queries)"})
    queries: tuple[int, ...] = field(default=(1, 2, 2, 2), metadata={
        "help": "R, cities asked for, one per entry of needles (R <= N)"})
    depths: tuple[int, ...] = field(default=DEPTHS, metadata={
        "help": "answer-needle depths in percent of the context (0 = first, 100 = last before the question)"})
    lengths: tuple[int, ...] = field(default=(), metadata={
        "help": "prompt lengths in tokens; empty: automatic, a few up to the model's context minus the answer room"})
    samples: int = field(default=5, metadata={"help": "prompts per (depth, length) cell (the paper: 50)"})
    haystack: str = field(default="text", metadata={
        "help": "text: held-out text of EvalConfig.data_dir; needles: only other needles (RULER niah_multikey_2)"})
    digits: int = field(default=7, metadata={"help": "digits of the magic numbers (LWM: 7)"})
    max_new_tokens: int = field(default=20, metadata={"help": "tokens decoded greedily per question"})


# --------------------------------------------------------------------------------------------- reuse


def haystack_text(cfg: EvalConfig, tokenizer, task: str) -> tuple[HeldoutText, dict[str, Any]]:
    """The held-out tokens of cfg.data_dir / cfg.split, and the settings that identify them.

    A missing data_dir is a ValueError; a folder tokenised with another tokenizer than the model's is
    re-tokenised with the model's (eval/heldout.py)."""
    if cfg.data_dir is None:
        raise ValueError(f"{task} with haystack 'text' reads held-out text: set EvalConfig.data_dir (--data-dir) to a "
                         f"prepared-data folder (e.g. cache/data/sotu-8192), or use haystack 'needles'")
    split = heldout_split(cfg, tokenizer, task)
    text = HeldoutText(split.tokens, split.eos_id, f"the {cfg.split} split of {cfg.data_dir}")
    return text, {**split.settings(), "haystack_tokens": int(len(text.tokens))}


def needle_samples(tokenizer, *, needles: int, queries: int, depth: float, length: int, count: int, seed: int,
                   haystack: str = "text", text: HeldoutText | None = None, digits: int = 7,
                   context: int | None = None) -> list[NeedleSample]:
    """`count` prompts of one (N, R, depth, length) cell, seeded by the cell and `seed` alone."""
    rng = random.Random(f"needle/{seed}/{haystack}/{digits}/{needles}/{queries}/{depth}/{length}")
    return [needle_prompt(tokenizer, rng, length=length, depth=depth, needles=needles, queries=queries,
                          haystack=haystack, text=text, digits=digits, context=context) for _ in range(count)]


def forced_choice_samples(model, tokenizer, cfg: EvalConfig, count: int, length: int, *, needles: int = 4,
                          queries: int = 1, haystack: str = "text", digits: int = 7) -> list[NeedleSample]:
    """`count` prompts (depths cycling over 0..100) whose prompt plus the longest possible answer
    (digits + 1 tokens) fits in `length` tokens, for `forced_choice_accuracy`."""
    context = model.config.max_position_embeddings
    window_length(model, cfg, "needle length", length)
    text = haystack_text(cfg, tokenizer, "needle")[0] if haystack == "text" else None
    prompt_length = length - (digits + 1)
    out: list[NeedleSample] = []
    for i, depth in enumerate(DEPTHS):
        n = count // len(DEPTHS) + (i < count % len(DEPTHS))
        out += needle_samples(tokenizer, needles=needles, queries=queries, depth=depth, length=prompt_length,
                              count=n, seed=cfg.eval_seed, haystack=haystack, text=text, digits=digits,
                              context=context)
    return out


def _by_length(jobs: list[tuple[int, int, tuple[int, ...]]], batch: int):
    """Batches of jobs (sample, query, prompt) whose prompts have one length (no padding needed)."""
    groups: dict[int, list] = defaultdict(list)
    for job in jobs:
        groups[len(job[2])].append(job)
    for size in sorted(groups):
        group = groups[size]
        for i in range(0, len(group), batch):
            yield group[i:i + batch]


@torch.no_grad()
def forced_choice_scores(model, samples: list[NeedleSample], cfg: EvalConfig) -> list[list[float]]:
    """Per sample, per queried city: 1 when its number is the likeliest candidate continuation, 1/k
    when it ties with k - 1 others for first, else 0 (see the module doc)."""
    jobs = [(si, qi, p) for si, s in enumerate(samples) for qi, p in enumerate(s.prompts)]
    scores: list[list[float]] = [[0.0] * len(s.prompts) for s in samples]
    rows = [(job, ci) for job in jobs for ci in range(len(samples[job[0]].candidate_ids))]
    # rows of one prompt length share a batch; each row is prompt + one candidate
    grouped: dict[int, list] = defaultdict(list)
    for row in rows:
        grouped[len(row[0][2])].append(row)
    logprob: dict[tuple[int, int, int], float] = {}
    for _, group in sorted(grouped.items()):
        picked = continuation_token_logprobs(model, [(job[2], samples[job[0]].candidate_ids[ci]) for job, ci in group],
                                             batch_size=max(1, cfg.batch_size), device=cfg.device)
        for (job, ci), lp in zip(group, picked):
            logprob[(job[0], job[1], ci)] = float(lp.double().sum())
    for si, qi, _ in jobs:
        sample = samples[si]
        values = [logprob[(si, qi, ci)] for ci in range(len(sample.candidate_ids))]
        scores[si][qi] = first_place_share(values, sample.target_index[qi])
    return scores


def forced_choice_accuracy(model, samples: list[NeedleSample], cfg: EvalConfig) -> float:
    """Mean forced-choice score over every queried city of `samples` (chance: mean 1/N)."""
    scores = [v for row in forced_choice_scores(model, samples, cfg) for v in row]
    if not scores:
        raise ValueError("forced_choice_accuracy needs at least one needle prompt")
    return sum(scores) / len(scores)


@torch.no_grad()
def greedy_outputs(model, tokenizer, samples: list[NeedleSample], max_new_tokens: int,
                   cfg: EvalConfig) -> list[list[str]]:
    """Per sample, per queried city: the greedy continuation (up to max_new_tokens, cut at EOS)."""
    context = model.config.max_position_embeddings
    out: list[list[str]] = [[""] * len(s.prompts) for s in samples]
    jobs = [(si, qi, p) for si, s in enumerate(samples) for qi, p in enumerate(s.prompts)]
    for batch in _by_length(jobs, max(1, cfg.batch_size)):
        P = len(batch[0][2])
        n = min(max_new_tokens, context - P)
        if n <= 0:
            raise ValueError(f"a needle prompt of {P} tokens leaves no room for an answer in the model's context "
                             f"of {context} tokens; use shorter lengths")
        ids = torch.tensor([list(job[2]) for job in batch], device=cfg.device)
        gen = model.generate(ids, n, temperature=0.0, eos_token_id=tokenizer.eos_id)[:, P:].tolist()
        for (si, qi, _), toks in zip(batch, gen):
            out[si][qi] = tokenizer.decode(until_eos(toks, tokenizer.eos_id))
    return out


def greedy_scores(outputs: list[list[str]], samples: list[NeedleSample]) -> list[list[float]]:
    """1.0 where the target's digit string appears in the output, else 0.0."""
    return [[float(t in o) for t, o in zip(s.targets, outs)] for s, outs in zip(samples, outputs)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _example(tokenizer, sample: NeedleSample, outputs: list[str]) -> dict[str, Any]:
    """One prompt of a pair, for reading the result: its answer needle, question, targets and outputs."""
    return {"depth": sample.depth, "length": sample.length, "queried": list(sample.queried),
            "targets": list(sample.targets), "outputs": outputs,
            "answer_needle": tokenizer.decode(sample.ids[slice(*sample.segments.answer)]),
            "question": tokenizer.decode(sample.ids[slice(*sample.segments.query)])}


# ---------------------------------------------------------------------------------------------- task


@register_task
class Needle(Task):
    name = "needle"
    reads_seq_len = False  # prompt lengths come from its own options and the model's context
    description = ("multi-needle retrieval (city -> magic number): accuracy per (N needles, R queried) by greedy "
                   "decoding and by forced choice, over answer depths and prompt lengths")
    Options = NeedleOptions
    version = 2  # 2: a prompt's needle numbers have one token count (forced choice compares equally long candidates)

    def check_options(self) -> None:
        o = self.options
        if not o.needles or len(o.needles) != len(o.queries):
            raise ValueError(f"needle needs one queries entry (R) per needles entry (N); got needles {list(o.needles)} "
                             f"and queries {list(o.queries)}")
        for n, r in zip(o.needles, o.queries):
            check_needle_args(length=1, depth=0, needles=n, queries=r, haystack=o.haystack, digits=o.digits,
                              context=None)
        if not o.depths:
            raise ValueError("needle depths must list at least one depth in 0..100")
        for d in o.depths:
            check_needle_args(length=1, depth=d, needles=1, queries=1, haystack=o.haystack, digits=o.digits,
                              context=None)
        if any(length <= 0 for length in o.lengths):
            raise ValueError(f"needle lengths must be positive token counts, got {list(o.lengths)}")
        if o.samples < 1 or o.max_new_tokens < 1:
            raise ValueError(f"needle samples and max_new_tokens must be >= 1, got {o.samples} and {o.max_new_tokens}")

    def room(self, queries: int, slack: int) -> int:
        """Tokens kept after a prompt: the greedy answer or the longest number, and the cue slack."""
        o = self.options
        return max(o.max_new_tokens, o.digits + 1) + (slack if queries > 1 else 0)

    def grid_lengths(self, tokenizer, context: int, needles: int, queries: int, slack: int) -> list[int]:
        """The (N, R) pair's lengths: the option's, checked, or the automatic ones (module doc)."""
        o = self.options
        longest = context - self.room(queries, slack)
        shortest = min_prompt_length(tokenizer, needles, queries, o.digits)
        if o.lengths:
            for length in o.lengths:
                if length > longest:
                    raise ValueError(f"needle length {length} does not fit the model's context of {context} tokens "
                                     f"with {context - longest} tokens kept for the answer; use lengths <= {longest}")
                if length < shortest:
                    raise ValueError(f"{needles} needles with the instruction and question do not fit in a "
                                     f"{length}-token prompt (the shortest possible is {shortest}); use longer lengths "
                                     f"or fewer needles")
            return sorted(set(o.lengths))
        if longest < shortest:
            raise ValueError(f"{needles} needles do not fit the model's context of {context} tokens (a prompt needs at "
                             f"least {shortest} tokens plus {context - longest} for the answer); use fewer needles")
        typical = min_prompt_length(tokenizer, needles, queries, o.digits, typical=True)
        picked = sorted({round(f * longest) for f in AUTO_FRACTIONS if round(f * longest) >= typical})
        return picked or [longest]

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        o = self.options
        context = model.config.max_position_embeddings
        if tokenizer is None:
            raise ValueError("needle needs the model's tokenizer (the tokenizer.json saved with it)")
        text, source = (None, {})
        if o.haystack == "text":
            text, source = haystack_text(cfg, tokenizer, self.name)
        slack = cue_slack(tokenizer)
        pairs = list(zip(o.needles, o.queries))
        plan = {pair: self.grid_lengths(tokenizer, context, *pair, slack) for pair in pairs}
        grid = [(n, r, length, depth) for (n, r), lengths in plan.items() for length in lengths for depth in o.depths]

        def cell_samples(n: int, r: int, length: int, depth: int) -> list[NeedleSample]:
            return needle_samples(tokenizer, needles=n, queries=r, depth=depth, length=length, count=o.samples,
                                  seed=cfg.eval_seed, haystack=o.haystack, text=text, digits=o.digits, context=context)

        # every cell's prompts are built (tokenizer work only) before any forward pass, so a length that cannot
        # hold the needles drawn is refused before anything is scored; they are built again (the same: seeded
        # by the cell) when scored, as holding every cell's prompts at once could take gigabytes at long lengths
        for cell in grid:
            cell_samples(*cell)

        cells, examples, scores = [], {}, {}
        for n, r, length, depth in grid:
            key = f"N{n}R{r}"
            samples = cell_samples(n, r, length, depth)
            outputs = greedy_outputs(model, tokenizer, samples, o.max_new_tokens, cfg)
            g = [v for row in greedy_scores(outputs, samples) for v in row]
            f = [v for row in forced_choice_scores(model, samples, cfg) for v in row]
            scores.setdefault(key, ([], []))
            scores[key][0].extend(g)
            scores[key][1].extend(f)
            cells.append({"needles": n, "queries": r, "depth": depth, "length": length, "greedy": _mean(g),
                          "forced_choice": _mean(f), "forced_choice_chance": 1 / n, "scored": len(g)})
            examples.setdefault(key, _example(tokenizer, samples[0], outputs[0]))
        metrics = {}
        for key, (g, f) in scores.items():
            metrics[f"greedy@{key}"], metrics[f"forced_choice@{key}"] = _mean(g), _mean(f)
        metrics["greedy"] = _mean([metrics[f"greedy@{key}"] for key in scores])
        # with one needle there is nothing to choose between (always 1.0): such rows stay out of the mean
        choices = [key for (n, r) in pairs for key in [f"N{n}R{r}"] if n > 1]
        metrics["forced_choice"] = _mean([metrics[f"forced_choice@{key}"] for key in choices or scores])
        settings = {"context": context, "haystack": o.haystack, **source,
                    "lengths": {f"N{n}R{r}": ls for (n, r), ls in plan.items()},
                    "room": {f"N{n}R{r}": self.room(r, slack) for n, r in pairs}, "cue_slack": slack,
                    "greedy_rule": "target digit string appears in the output (up to max_new_tokens, cut at EOS)",
                    "forced_choice_rule": "sum of log-probs of ' {number}'; first place wins, a k-way tie earns 1/k"}
        return TaskResult(task=self.name, metrics=metrics, settings=settings,
                          details={"cells": cells, "examples": examples})

    def plot(self, result: TaskResult, path: Path) -> bool:
        """Depth x length heatmaps, one column per (N, R), greedy above and forced choice below."""
        from matplotlib.figure import Figure

        cells = result.details["cells"]
        pairs = list(dict.fromkeys((c["needles"], c["queries"]) for c in cells))
        fig = Figure(figsize=(3.2 * len(pairs) + 1.2, 6.6), layout="constrained")
        for col, (n, r) in enumerate(pairs):
            mine = [c for c in cells if (c["needles"], c["queries"]) == (n, r)]
            depths = sorted({c["depth"] for c in mine})
            lengths = sorted({c["length"] for c in mine})
            for row, key in enumerate(("greedy", "forced_choice")):
                ax = fig.add_subplot(2, len(pairs), row * len(pairs) + col + 1)
                grid = [[next(c[key] for c in mine if c["depth"] == d and c["length"] == L) for L in lengths]
                        for d in depths]
                im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                for i, line in enumerate(grid):
                    for j, v in enumerate(line):
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
                ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
                ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
                chance = f", chance {1 / n:.2f}" if key == "forced_choice" else ""
                ax.set_title(f"N={n}, R={r}: {key.replace('_', ' ')} "
                             f"{result.metrics[f'{key}@N{n}R{r}']:.2f}{chance}", fontsize=8)
                ax.set_xlabel("prompt length (tokens)", fontsize=7)
                if col == 0:
                    ax.set_ylabel("answer depth", fontsize=7)
        fig.colorbar(im, ax=fig.axes, shrink=0.6, label="accuracy")
        fig.suptitle(f"Multi-needle retrieval ({result.settings['haystack']} haystack; cf. paper Fig. 5)")
        fig.savefig(path, dpi=110)
        return True
