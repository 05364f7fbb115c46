"""`icl`: many-shot in-context classification and its robustness to the order of demonstrations
(paper §3.5, Fig. 6-7), with the protocol of Bertsch et al. 2024 (code: abertsch72/long-context-icl).

What it measures. A labelled set (eval/labelled.py) gives a fixed test set and a pool of
demonstrations. A prompt is k demonstrations `{x_prefix}{text}\\n{y_prefix}{label}` joined by
"\\n==\\n", then the test item `{x_prefix}{text}\\n{y_prefix}` (its trailing space removed, as in the
original), after EOS (a document starts there, as in training). The model answers by constrained
greedy decoding, and accuracy is the share of test items whose answer is their (cut) label.

- Constrained decoding: every label is encoded as " " + label; a label whose tokens are a prefix of
  another's gets the tokens of "\\n" appended (the original appends its stop sequence); each is then
  cut to its shortest token prefix that no other label shares. A trie over the cut labels allows, at
  every step, only the tokens that continue some label; the model's greedy choice among them (argmax
  of its logits over the allowed tokens, ties to the lowest id) is taken until a leaf, so every answer
  is a label. A step with a single allowed token needs no forward pass (greedy would take it anyway).
  A NaN or infinite logit among the allowed tokens (a diverged model, an overflow) is a ValueError, not
  an answer: argmax over NaN would name the lowest-id label, a believable accuracy.
- Accuracy vs k: for each shot count, `draws` independent draws of k demonstrations from the pool
  (by eval_seed; each k has its own stream, so adding a k changes no other cell), each scored on the
  whole test set; the result gives mean, min and max over draws. k = 0 (zero-shot) has one draw.
- Shots that fit: one set of demonstrations is shared by all test items, so a draw must fit with the
  longest test item and the label's tokens (prompt + label steps - 1 <= context). A draw that does
  not fit is drawn again (as in the original), at most 100 times; the redraws are reported.
  `shots` empty = automatic: 1, 2, 4, ... and k_max, the largest k at which at least 90% of 200
  simulated random draws fit (from the token lengths of the pool), so redraws rarely bias the sample.
- Order robustness: one fixed set of demonstrations (k = order_shots, default the largest shot count;
  balanced over classes, floor(k / C) each and the remainder to random classes), permuted over seeds:
  `orders` random orders, and `orders` class-alternating orders (round-robin interleave of classes:
  the class order and the order within each class vary with the seed; once a class runs out the
  others continue in turn). The metric is best - worst accuracy over the orders of each kind. The set
  is drawn (and refused, where it cannot be: k < 2, k beyond the pool, no draw that fits) before the
  accuracy curve is scored, so a refusal loses no work.

Choices where the paper is silent, or where a CPU budget differs from it:
- Defaults: 5 draws, 50 test items, 5 orders of each kind, so that they take about a minute on a
  5M-parameter model with a 256-token context on 2 CPU cores. The paper's scale is 10 draws, 250 test
  items, 10 random and 30 alternating orders (`draws=10 test_size=250 orders=10`, or orders=30).
- The test set is fixed by the data (labelled.py), not by the seed.
- A draw that does not fit is drawn again, never truncated.
- Demonstrations are drawn uniformly (not balanced) for the accuracy curve, as in the original, but
  balanced for the order experiment, so that alternating orders alternate throughout.
- Every forward pass sees the whole prompt (black box: logits only), so the demonstrations are
  recomputed for each test item; test items of one cell are batched (right-padded).
- The headline numbers include the majority share of the test labels (the accuracy of always
  answering the most frequent label), against which accuracy should be read.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftransformer.data.templates import ICL_SEPARATOR as SEPARATOR  # the prompt format, shared with training
from difftransformer.data.templates import icl_demo as format_demo
from difftransformer.data.templates import icl_prompt as build_prompt
from difftransformer.data.templates import icl_query as format_query
from difftransformer.eval.labelled import LabelledSet, check_labelled_name, labelled_names, load_labelled
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task

STOP = "\n"  # appended to a label whose tokens are a prefix of another label's
FIT_SHARE, FIT_SIMULATIONS, MAX_REDRAWS = 0.9, 200, 100

Item = tuple[str, str]


# ----------------------------------------------------------------------------------------------
# prompts


def _encode_many(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(list(texts))
    return [tokenizer.encode(t) for t in texts]


# ----------------------------------------------------------------------------------------------
# labels: shortest unique prefixes and the trie


class LabelTrie:
    """Labels as token sequences cut to their shortest unique prefix, and the tokens allowed after a prefix.

    sequences: label -> its full token ids (" " + label). stop: token ids appended to a label that is a
    prefix of another, so that it can still be chosen. Raises ValueError when two labels cannot be told
    apart by their tokens."""

    def __init__(self, sequences: dict[str, Sequence[int]], stop: Sequence[int] = ()):
        if len(sequences) < 2:
            raise ValueError(f"constrained decoding needs at least two labels, got {list(sequences)}")
        full = {y: tuple(s) for y, s in sequences.items()}
        for y, s in full.items():
            if not s:
                raise ValueError(f"label {y!r} encodes to no tokens")
            if any(o != y and len(t) > len(s) and t[:len(s)] == s for o, t in full.items()):
                full[y] = s + tuple(stop)
        for y, s in full.items():
            twins = [o for o, t in full.items() if o != y and (t == s or t[:len(s)] == s)]
            if twins:
                raise ValueError(f"labels {y!r} and {twins[0]!r} share all their tokens; they cannot be told apart")
        self.cut: dict[str, tuple[int, ...]] = {}
        for y, s in full.items():
            j = next(j for j in range(1, len(s) + 1)
                     if not any(o != y and t[:j] == s[:j] for o, t in full.items()))
            self.cut[y] = s[:j]
        self._children: dict[tuple[int, ...], set[int]] = {}
        self._leaf = {s: y for y, s in self.cut.items()}
        for s in self.cut.values():
            for j in range(len(s)):
                self._children.setdefault(s[:j], set()).add(s[j])
        self.depth = max(len(s) for s in self.cut.values())

    @classmethod
    def from_tokenizer(cls, tokenizer, labels: Sequence[str]) -> LabelTrie:
        """Each label as the model sees it after the label prefix: " " + label."""
        return cls({y: tokenizer.encode(" " + y) for y in labels}, tokenizer.encode(STOP))

    def allowed(self, prefix: Sequence[int]) -> list[int]:
        """Tokens that continue `prefix` towards some label (sorted ids); empty at a leaf."""
        return sorted(self._children.get(tuple(prefix), ()))

    def label_at(self, prefix: Sequence[int]) -> str | None:
        """The label whose cut tokens are exactly `prefix`, else None."""
        return self._leaf.get(tuple(prefix))

    def cut_text(self, tokenizer) -> dict[str, str]:
        """label -> the text of its cut tokens, stripped (what exact match compares)."""
        return {y: tokenizer.decode(list(s)).strip() for y, s in self.cut.items()}


@torch.no_grad()
def constrained_decode(model, prompts: Sequence[Sequence[int]], trie: LabelTrie, *, batch_size: int = 8,
                       pad_id: int = 0, device: str | torch.device = "cpu") -> list[str]:
    """The label greedy decoding picks for each prompt (token ids), restricted to the trie: at each
    step the allowed token with the largest logit (ties: the lowest id). Prompts are right-padded in
    batches and each row's logits are read at its own last token (causal: padding after it is unseen).
    A non-finite logit among the allowed tokens (NaN or inf: a diverged model, an overflow) is a ValueError,
    never an answer."""
    prefixes: list[list[int]] = [[] for _ in prompts]
    answers: list[str | None] = [None] * len(prompts)
    pending = list(range(len(prompts)))
    while pending:
        need = []
        for i in pending:
            while trie.label_at(prefixes[i]) is None and len(trie.allowed(prefixes[i])) == 1:
                prefixes[i].append(trie.allowed(prefixes[i])[0])
            if trie.label_at(prefixes[i]) is not None:
                answers[i] = trie.label_at(prefixes[i])
            else:
                need.append(i)
        need.sort(key=lambda i: len(prompts[i]) + len(prefixes[i]))
        for start in range(0, len(need), batch_size):
            rows = need[start:start + batch_size]
            seqs = [[*prompts[i], *prefixes[i]] for i in rows]
            ids = torch.full((len(rows), max(map(len, seqs))), pad_id, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, :len(s)] = torch.tensor(s)
            logits = model(ids.to(device)).logits
            last = logits[torch.arange(len(rows)), torch.tensor([len(s) - 1 for s in seqs])].float().cpu()
            for r, i in enumerate(rows):
                allowed = trie.allowed(prefixes[i])
                if allowed[-1] >= last.shape[-1]:
                    raise ValueError(f"label token id {allowed[-1]} is beyond the model's vocabulary of "
                                     f"{last.shape[-1]}; the tokenizer does not belong to this model")
                scores = last[r, allowed]
                if not torch.isfinite(scores).all():  # argmax over NaN would answer the lowest-id label
                    bad = scores[~torch.isfinite(scores)][0].item()
                    raise ValueError(f"the model's logits are not finite ({bad} at a label token of test prompt {i}): "
                                     f"a diverged model or an overflow; check the model's weights")
                prefixes[i].append(allowed[int(torch.argmax(scores))])
        pending = need
    return answers  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# demonstrations: draws, fit, orders


def alternating_order(items: Sequence[Item], labels: Sequence[str], rng: random.Random) -> list[Item]:
    """A round-robin interleave of classes: the class order and each class's own order shuffled by rng;
    when a class runs out the remaining ones keep taking turns."""
    classes = [y for y in labels if any(it[1] == y for it in items)]
    rng.shuffle(classes)
    queues = {y: [it for it in items if it[1] == y] for y in classes}
    for q in queues.values():
        rng.shuffle(q)
    out: list[Item] = []
    while any(queues.values()):
        for y in classes:
            if queues[y]:
                out.append(queues[y].pop(0))
    return out


def random_order(items: Sequence[Item], rng: random.Random) -> list[Item]:
    out = list(items)
    rng.shuffle(out)
    return out


def balanced_draw(pool: Sequence[Item], labels: Sequence[str], k: int, rng: random.Random) -> list[Item]:
    """k items with floor(k / C) per class and the remainder to randomly chosen classes (fewer from a
    class with fewer items, the shortfall taken from the others)."""
    by = {y: [it for it in pool if it[1] == y] for y in labels}
    classes = [y for y in labels if by[y]]
    want = {y: k // len(classes) for y in classes}
    for y in rng.sample(classes, k % len(classes)):
        want[y] += 1
    chosen = {y: rng.sample(by[y], min(want[y], len(by[y]))) for y in classes}
    taken = {it for picks in chosen.values() for it in picks}
    short = k - len(taken)
    out = [it for y in classes for it in chosen[y]]
    if short > 0:
        out += rng.sample([it for it in pool if it not in taken], short)
    position = {it: i for i, it in enumerate(pool)}
    return sorted(out, key=position.__getitem__)  # a set, in pool order: orders are applied afterwards


@dataclass
class _Plan:
    """Token counts that decide whether k demonstrations fit in the model's context."""

    context: int
    demo_len: dict[Item, int]  # tokens of each pool item's demonstration text
    sep_len: int  # tokens of the separator
    query_len: int  # tokens of the longest test query, with the separator before it
    query_alone: int  # tokens of the longest test query on its own (k = 0)
    depth: int  # the most label tokens decoded

    def tokens(self, demo_lengths: Sequence[int]) -> int:
        """Tokens the longest prompt takes with demonstrations of these token lengths: EOS, the
        demonstrations and separators, the longest query, and all label steps but the last. The one
        home of the fit rule: draws, the automatic k_max and the shot checks all count with it."""
        if not demo_lengths:
            return 1 + self.query_alone + self.depth - 1
        return 1 + sum(demo_lengths) + (len(demo_lengths) - 1) * self.sep_len + self.query_len + self.depth - 1

    def needed(self, demos: Sequence[Item]) -> int:
        """`tokens` of these demonstrations."""
        return self.tokens([self.demo_len[d] for d in demos])

    def fits(self, demos: Sequence[Item]) -> bool:
        return self.needed(demos) <= self.context


def _plan(model, tokenizer, data: LabelledSet, test: Sequence[Item], pool: Sequence[Item], trie: LabelTrie) -> _Plan:
    demo_lens = _encode_many(tokenizer, [format_demo(data, it) for it in pool])
    queries = [format_query(data, t) for t, _ in test]
    return _Plan(context=model.config.max_position_embeddings,
                 demo_len={it: len(ids) for it, ids in zip(pool, demo_lens)},
                 sep_len=len(tokenizer.encode(SEPARATOR)),
                 query_len=max(map(len, _encode_many(tokenizer, [SEPARATOR + q for q in queries]))),
                 query_alone=max(map(len, _encode_many(tokenizer, queries))), depth=trie.depth)


def automatic_max_shots(plan: _Plan, pool: Sequence[Item], rng: random.Random) -> int:
    """The largest k at which at least FIT_SHARE of FIT_SIMULATIONS random draws fit (0 if none); a
    binary search, since the share of draws that fit falls as k grows."""
    lengths = [plan.demo_len[it] for it in pool]

    def share(k: int) -> float:
        fit = 0
        for _ in range(FIT_SIMULATIONS):
            fit += plan.tokens(rng.sample(lengths, k)) <= plan.context
        return fit / FIT_SIMULATIONS

    lo, hi = 0, len(pool)  # share(lo) is enough (k = 0 is checked apart); find the largest such k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if share(mid) >= FIT_SHARE else (lo, mid - 1)
    return lo


def automatic_shots(k_max: int) -> list[int]:
    """1, 2, 4, ... below k_max, then k_max."""
    out, k = [], 1
    while k < k_max:
        out.append(k)
        k *= 2
    return [*out, k_max] if k_max >= 1 else []


def _draw(pool: Sequence[Item], k: int, plan: _Plan, rng: random.Random, what: str, hint: str,
          draw=None) -> tuple[list[Item], int]:
    """A draw of k demonstrations that fits, and how many draws were refused before it."""
    draw = draw or (lambda: rng.sample(pool, k))
    for attempt in range(MAX_REDRAWS):
        demos = draw()
        if plan.fits(demos):
            return demos, attempt
    raise ValueError(f"{what}: none of {MAX_REDRAWS} random draws of {k} demonstrations fit with the longest test "
                     f"item in the model's context of {plan.context} tokens; {hint}")


# ----------------------------------------------------------------------------------------------
# the task


@dataclass
class ICLOptions:
    dataset: str = field(default="synthetic", metadata={
        "help": "labelled set: " + ", ".join(labelled_names())})
    shots: tuple[int, ...] = field(default=(), metadata={
        "help": "numbers of demonstrations k (0 = zero-shot); empty: 1, 2, 4, ... up to what fits the context"})
    draws: int = field(default=5, metadata={"help": "random draws of demonstrations per k (the paper: 10)"})
    test_size: int = field(default=50, metadata={"help": "items in the fixed test set (the paper: 250)"})
    orders: int = field(default=5, metadata={
        "help": "orders of each kind (random, class-alternating) for order robustness; 0 skips it "
                "(the paper: 10 random, 30 alternating)"})
    order_shots: int = field(default=0, metadata={
        "help": "demonstrations in the order experiment's fixed set; 0: the largest shot count"})


@register_task
class ICL(Task):
    name = "icl"
    reads_seq_len = False  # prompt lengths come from its own options and the model's context
    description = ("many-shot in-context classification (Bertsch et al. 2024): accuracy vs number of "
                   "demonstrations, constrained decoding, and best-minus-worst accuracy over demonstration orders")
    Options = ICLOptions

    def check_options(self) -> None:
        o = self.options
        check_labelled_name(o.dataset)
        if any(k < 0 for k in o.shots):
            raise ValueError(f"icl.shots must be numbers of demonstrations >= 0, got {list(o.shots)}")
        if len(set(o.shots)) != len(o.shots):
            raise ValueError(f"icl.shots lists a shot count twice: {list(o.shots)}; give each once")
        for name in ("draws", "test_size"):
            if getattr(o, name) < 1:
                raise ValueError(f"icl.{name} must be at least 1, got {getattr(o, name)}")
        if o.orders == 1 or o.orders < 0:
            raise ValueError(f"icl.orders must be 0 (skip) or at least 2 (best - worst needs two), got {o.orders}")
        if o.order_shots < 0 or o.order_shots == 1:
            raise ValueError(f"icl.order_shots must be 0 (the largest shot count) or at least 2, got {o.order_shots}")

    # -------------------------------------------------------------------------------- helpers

    def _accuracy(self, model, tokenizer, data, demos, test, trie, cfg) -> tuple[float, Counter]:
        prompts = [[tokenizer.eos_id, *ids] for ids in
                   _encode_many(tokenizer, [build_prompt(data, demos, t) for t, _ in test])]
        context = model.config.max_position_embeddings
        longest = max(map(len, prompts)) + trie.depth - 1
        if longest > context:  # the plan counts pieces; a merge across a boundary could differ
            raise ValueError(f"a prompt of {longest} tokens exceeds the model's context of {context}; "
                             f"lower icl.shots")
        answers = constrained_decode(model, prompts, trie, batch_size=cfg.batch_size, pad_id=tokenizer.eos_id,
                                     device=cfg.device)
        return sum(a == y for a, (_, y) in zip(answers, test)) / len(test), Counter(answers)

    def _shots(self, data: LabelledSet, pool: list[Item], plan: _Plan, seed: str) -> tuple[list[int], int, str]:
        """(the shot counts to run, the automatic k_max, the hint for errors); refuses counts that cannot fit."""
        k_auto = automatic_max_shots(plan, pool, random.Random(f"{seed}/plan"))
        hint = (f"use shots <= {k_auto} (at least {FIT_SHARE:.0%} of draws fit), or leave shots empty for automatic"
                if k_auto else "the model's context is too short for this data set; use a shorter one (e.g. "
                               "synthetic)")
        if not plan.fits([]):
            raise ValueError(f"icl on {data.name}: the longest test item needs {plan.needed([])} tokens; the model's "
                             f"context is {plan.context} tokens")
        shots = sorted(self.options.shots) if self.options.shots else automatic_shots(k_auto)
        if not shots:
            raise ValueError(f"icl on {data.name}: not even one demonstration fits with the longest test item in the "
                             f"model's context of {plan.context} tokens; {hint}")
        shortest = sorted(plan.demo_len.values())
        for k in shots:
            if k > len(pool):
                raise ValueError(f"icl.shots {k} is more than the {len(pool)} demonstrations left beside the test "
                                 f"set of {data.name}; lower shots or test_size")
            least = plan.tokens(shortest[:k])
            if k and least > plan.context:
                raise ValueError(f"icl.shots {k} does not fit: even the {k} shortest demonstrations of {data.name} "
                                 f"with the longest test item take {least} tokens; the model's context is "
                                 f"{plan.context} tokens; {hint}")
        return shots, k_auto, hint

    def _curve(self, model, tokenizer, data, test, pool, plan, trie, cfg, seed, shots, hint) -> list[dict]:
        """Accuracy per shot count: `draws` draws each (one for k = 0), with their spread and redraws."""
        curve = []
        for k in shots:
            rng = random.Random(f"{seed}/shots/{k}")
            accs, redraws, predicted, longest = [], 0, Counter(), 0
            for _ in range(self.options.draws if k else 1):
                demos, refused = _draw(pool, k, plan, rng, f"icl.shots {k} on {data.name}", hint)
                acc, pred = self._accuracy(model, tokenizer, data, demos, test, trie, cfg)
                accs.append(acc)
                redraws += refused
                predicted += pred
                longest = max(longest, plan.needed(demos))
            curve.append({"k": k, "mean": math.fsum(accs) / len(accs), "min": min(accs), "max": max(accs),
                          "draws": accs, "redraws": redraws, "prompt_tokens_max": longest,
                          "predicted": {y: predicted[y] for y in data.labels}})
        return curve

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        if tokenizer is None:
            raise ValueError("icl writes prompts as text: pass the model's tokenizer (its saved tokenizer.json)")
        o = self.options
        data = load_labelled(o.dataset)
        test, pool = data.split(o.test_size)
        trie = LabelTrie.from_tokenizer(tokenizer, data.labels)
        plan = _plan(model, tokenizer, data, test, pool, trie)
        seed = f"{cfg.eval_seed}/{data.name}"
        shots, k_auto, hint = self._shots(data, pool, plan, seed)
        fixed = self._order_set(data, pool, plan, seed, shots, hint)  # refused (if at all) before anything is scored
        curve = self._curve(model, tokenizer, data, test, pool, plan, trie, cfg, seed, shots, hint)
        orders = self._orders(model, tokenizer, data, test, trie, cfg, seed, fixed)
        test_counts = data.counts(test)
        metrics = {f"accuracy_k{c['k']}": c["mean"] for c in curve}
        metrics["accuracy_at_max_k"] = curve[-1]["mean"]
        metrics["majority_share"] = max(test_counts.values()) / len(test)
        if orders:
            metrics["order_margin_random"] = orders["random"]["margin"]
            metrics["order_margin_alternating"] = orders["alternating"]["margin"]
        cut = trie.cut_text(tokenizer)
        return TaskResult(
            task=self.name,
            metrics=metrics,
            settings={"dataset": data.name, "source": data.source, "labels": list(data.labels),
                      "cut_labels": [cut[y] for y in data.labels],
                      "cut_label_tokens": [len(trie.cut[y]) for y in data.labels],
                      "format": {"demonstration": format_demo(data, ("{text}", "{label}")),
                                 "query": format_query(data, "{text}"), "separator": SEPARATOR,
                                 "label_encoding": "' ' + label, cut to the shortest unique token prefix"},
                      "context": plan.context, "test_size": len(test), "pool_size": len(pool),
                      "shots": shots, "shots_automatic": not o.shots, "automatic_max_shots": k_auto,
                      "fit_rule": f"a draw fits when prompt + label steps - 1 <= context with the longest test "
                                  f"item; automatic k_max: >= {FIT_SHARE:.0%} of {FIT_SIMULATIONS} simulated "
                                  f"draws fit; refused draws are redrawn (at most {MAX_REDRAWS})",
                      "draws": o.draws, "eval_seed": cfg.eval_seed},
            details={"curve": curve, "orders": orders, "test_labels": test_counts},
        )

    def _order_set(self, data, pool, plan, seed, shots, hint) -> list[Item] | None:
        """The order experiment's fixed balanced set (None when orders = 0); a ValueError where it cannot be drawn."""
        o = self.options
        if not o.orders:
            return None
        k = o.order_shots or max(shots)
        if k < 2:
            raise ValueError(f"icl order robustness needs at least 2 demonstrations, but the largest shot count is "
                             f"{k}; set icl.order_shots >= 2 or icl.orders = 0")
        if k > len(pool):
            raise ValueError(f"icl.order_shots {k} is more than the {len(pool)} demonstrations left beside the "
                             f"test set of {data.name}; lower it")
        rng = random.Random(f"{seed}/orders/set")
        return _draw(pool, k, plan, rng, f"icl.order_shots {k} on {data.name}", hint,
                     draw=lambda: balanced_draw(pool, data.labels, k, rng))[0]

    def _orders(self, model, tokenizer, data, test, trie, cfg, seed, fixed: list[Item] | None) -> dict:
        """The order experiment on the fixed set: `orders` random and `orders` alternating permutations."""
        o = self.options
        if fixed is None:
            return {}
        k = len(fixed)
        out: dict = {"shots": k, "set_labels": data.counts(fixed)}
        for kind in ("random", "alternating"):
            accs, sequences = [], []
            for i in range(o.orders):
                r = random.Random(f"{seed}/orders/{kind}/{i}")
                demos = random_order(fixed, r) if kind == "random" else alternating_order(fixed, data.labels, r)
                acc, _ = self._accuracy(model, tokenizer, data, demos, test, trie, cfg)
                accs.append(acc)
                sequences.append([data.labels.index(y) for _, y in demos])
            out[kind] = {"accuracy": accs, "margin": max(accs) - min(accs), "mean": math.fsum(accs) / len(accs),
                         "label_sequences": sequences}
        return out

    def plot(self, result: TaskResult, path: Path) -> bool:
        from matplotlib.figure import Figure

        curve, orders = result.details["curve"], result.details.get("orders") or {}
        fig = Figure(figsize=(10, 4) if orders else (5.5, 4))
        ax = fig.add_subplot(1, 2 if orders else 1, 1)
        ks = [c["k"] for c in curve]
        xs = [max(k, 0.5) for k in ks]  # k = 0 drawn at 0.5 on the log axis
        ax.fill_between(xs, [c["min"] for c in curve], [c["max"] for c in curve], alpha=0.25,
                        label="min-max over draws")
        ax.plot(xs, [c["mean"] for c in curve], marker="o", label="mean")
        for x, c in zip(xs, curve):
            ax.scatter([x] * len(c["draws"]), c["draws"], s=8, color="k", alpha=0.4)
        ax.axhline(result.metrics["majority_share"], ls="--", color="grey", label="majority label")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(k) for k in ks])
        ax.set_ylim(0, 1)
        ax.set_xlabel("demonstrations k")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{result.settings['dataset']}: {result.settings['test_size']} test items")
        ax.legend(fontsize=8)
        if orders:
            ax2 = fig.add_subplot(1, 2, 2)
            kinds = ["random", "alternating"]
            bars = ax2.bar(kinds, [orders[k]["margin"] for k in kinds], color=["tab:blue", "tab:orange"], alpha=0.6,
                           label="best - worst")
            ax2.bar_label(bars, fmt="%.3f", fontsize=8)
            for i, k in enumerate(kinds):
                ax2.scatter([i] * len(orders[k]["accuracy"]), orders[k]["accuracy"], s=12, color="k", alpha=0.5,
                            label="accuracy of one order" if i == 0 else None)
            ax2.set_ylim(0, 1)
            ax2.set_ylabel("accuracy")
            ax2.set_title(f"order robustness: k = {orders['shots']}, {len(orders['random']['accuracy'])} orders each")
            ax2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return True
