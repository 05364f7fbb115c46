"""`ood`: accuracy and attention on a synthetic task out of distribution (docs/evaluation.md, `ood`).

The model was trained on a task family of data/ood/ (its prepared-data folder, EvalConfig.data_dir,
names the family and its settings). For each test condition, a fixed seeded test set (`eval_set`:
sequences never trained on) is scored:

- Conditions: the training distribution scaled in context `lengths` (factors; the number of items
  unchanged, so the filler grows; flipflop has no filler and scales its instructions, so there the
  write-to-read distance hardly grows) and in distractor `densities` (more items at the training length).
  A condition whose sequences exceed the model's position limit is skipped and listed as such, and so is
  every condition out of distribution when the accuracy at the training condition is below `min_accuracy`
  (a model that has not learned the task; a study's bar, which saves most of its evaluation time).
- Accuracy: teacher-forced greedy prediction at every answer position; a query (one key's value, one
  read, one induction successor, the max) is right when all its answer tokens are. Error counts with
  95% Wilson intervals per condition; about `min_queries` queries per condition (10,000 by default: an error
  rate of 1e-3 is then 10 +- 3 errors, resolved from 0; the sequence count comes from a pilot's mean, so
  the count may fall short of it by a few percent). The Wilson interval takes queries as independent; the
  queries of one sequence share its positions, so their errors cluster and the interval is too narrow
  where a sequence holds many queries (long flip-flop sequences): compare arms over seeds, not by it.
- Mechanism (attention=True), on the first `attention_sequences` sequences of each condition, at every
  answer position, per layer and head: attention mass on the target (the positions of the item the
  answer is read from, before the query), on distractors (every other item), on filler, and on the rest
  (the leading EOS, the query part); the entropy of the non-negative maps; the largest pre-softmax
  logit. For DIFF V1 and V2 the masses are measured on A1 - λA2 and on A1 and A2 apart ("diff", "a1",
  "a2"), and on the positive and negative parts of A1 - λA2 apart ("diff_positive", "diff_negative": the
  signed masses net one against the other); for ordinary attention "diff" and "a1" are the one softmax
  map. Summaries: the mean over layers and heads, and the retrieving head's shares (`retrieving_head`:
  chosen once, at the training condition, as the head whose positive weight puts the largest share on
  the target; `head_shares` at every condition). Flip-flop's target is the last write: the earlier
  reads after it echo the same bit, and attention on them counts as "other" (the query part), so its
  target mass is a lower bound on the mass on tokens that carry the answer.
- adaptive_temperature=True: each condition is scored a second time with adaptive temperature at
  inference (Veličković et al. 2024, "softmax is not enough"), a dispersion fix without any subtraction
  and without training: every softmax map's logits are multiplied by β(H) = max(1, p(H)) when the map's
  entropy H exceeds 0.5 (β = 1 otherwise), p the authors' quartic fit (`ADAPTIVE_POLY`). On DIFF it
  applies to each of the two maps. It goes through the layers' query hooks: β multiplies each query row,
  so the model keeps its own backend (fused kernels included) and only the entropies are computed from
  logits, in blocks of rows. The mechanism is measured without it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from difftransformer.attention import QueryHook
from difftransformer.data import PreparedData
from difftransformer.data.ood import TRAIN, Condition, Episodes, Family
from difftransformer.data.ood.episodes import FILLER, ITEM
from difftransformer.data.ood.sampler import eval_set
from difftransformer.eval.probes.hooks import inspect_attention, probe_batch, require_own_model, rescale_queries
from difftransformer.eval.task import EvalConfig, Task, TaskNotApplicable, TaskResult, register_task
from difftransformer.norm import compute_dtype

log = logging.getLogger("difftransformer.eval")

ADAPTIVE_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)  # highest degree first, as numpy.polyval takes it
MASSES = ("target", "distractor", "filler", "other")
Z95 = 1.959963984540054


def wilson_interval(errors: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of an error rate errors / n (95% by default); (0, 1) when n is 0. Its bound at 0
    errors is exactly 0 and at n errors exactly 1 (the formula gives them, up to rounding)."""
    if n == 0:
        return 0.0, 1.0
    p = errors / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if errors == 0 else max(0.0, centre - half)), (1.0 if errors == n else min(1.0, centre + half))


def adaptive_beta(entropy: torch.Tensor) -> torch.Tensor:
    """β(H) of adaptive temperature: max(1, p(H)) where H > 0.5, else 1 (p: ADAPTIVE_POLY)."""
    poly = torch.zeros_like(entropy)
    for c in ADAPTIVE_POLY:
        poly = poly * entropy + c
    return torch.where(entropy > 0.5, poly.clamp(min=1.0), torch.ones_like(entropy))


def row_entropy(q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None,
                block_bytes: int = 1 << 24) -> torch.Tensor:
    """(B, H, T, 1): the entropy of every query row's softmax(q k^T * scale) over its visible keys, in
    `compute_dtype` (0 for a row that sees no key). q (B, H, T, d), k (B, H, S, d), visible as a query hook
    gets it. Computed over blocks of query rows of about `block_bytes` of logits each, so no (T, S) map is
    held whole, and each block reads the keys up to the last one it may see (causal: half the work)."""
    f = compute_dtype(q)
    B, H, T, _ = q.shape
    S = k.shape[2]
    rows = max(1, block_bytes // (B * H * S * torch.finfo(f).bits // 8))
    keys = k.to(f).transpose(-1, -2)
    if visible is not None:  # a mask broadcast over rows (key padding, not causal) is sliced by row below
        visible = visible.expand(*visible.shape[:-2], T, S)
    out = []
    for t in range(0, T, rows):
        seen = S if visible is None else _keys_seen(visible[..., t:t + rows, :])
        logits = torch.matmul(q[:, :, t:t + rows].to(f), keys[..., :seen]) * scale
        if visible is not None:
            logits = logits.masked_fill(~visible[..., t:t + rows, :seen], float("-inf"))
        out.append(torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1, keepdim=True))  # 0 log 0 = 0
    return torch.cat(out, dim=2).nan_to_num(nan=0.0)  # a row with no visible key: softmax of -inf is NaN


def _keys_seen(visible: torch.Tensor) -> int:
    """1 + the last key index any row of `visible` (..., rows, S) may read (1 when none may)."""
    cols = visible.reshape(-1, visible.shape[-1]).any(0).nonzero()
    return int(cols[-1]) + 1 if len(cols) else 1


def adaptive_temperature_queries(q: torch.Tensor, k: torch.Tensor, scale: float,
                                 visible: torch.Tensor | None) -> torch.Tensor:
    """A query hook (attention/functional.py): every query row times `adaptive_beta` of its map's entropy,
    which multiplies the row's logits by β as adaptive temperature defines it, on the layer's own backend."""
    beta = adaptive_beta(row_entropy(q, k, scale, visible))
    return (q.to(beta.dtype) * beta).to(q.dtype)


@dataclass
class OODOptions:
    lengths: tuple[float, ...] = field(default=(1.0, 2.0, 4.0, 8.0, 16.0), metadata={
        "help": "context-length factors over the training distribution (items unchanged)"})
    densities: tuple[float, ...] = field(default=(1.0, 2.0, 3.0, 4.0), metadata={
        "help": "distractor-density factors: items x factor at the training length"})
    min_queries: int = field(default=10_000, metadata={"help": "queries scored per condition (about)"})
    attention: bool = field(default=True, metadata={"help": "measure the attention maps (mechanism)"})
    attention_sequences: int = field(default=64, metadata={"help": "sequences per condition whose maps are measured"})
    adaptive_temperature: bool = field(default=True, metadata={
        "help": "also score every condition with adaptive temperature at inference (Velickovic et al. 2024)"})
    min_accuracy: float = field(default=0.0, metadata={
        "help": "score the conditions out of distribution only when the accuracy at the training condition reaches "
                "this (0: always): a model that has not learned the task has no out-of-distribution result to compare"})


def conditions(options: OODOptions) -> list[Condition]:
    """The training condition, the length factors at training density, the density factors at training
    length (each once, in that order)."""
    out = [TRAIN]
    for c in [Condition(length=f) for f in options.lengths] + [Condition(density=f) for f in options.densities]:
        if c not in out:
            out.append(c)
    return out


def task_family(cfg: EvalConfig) -> Family:
    """The family of the prepared-data folder cfg.data_dir, or a ValueError naming the fix."""
    if cfg.data_dir is None:
        raise ValueError("ood needs the prepared-data folder of the synthetic task the model was trained on (a "
                         "run folder brings its own; else --data-dir cache/data/task-...): it names the family "
                         "and its settings")
    family = PreparedData.load(cfg.data_dir).family()
    if family is None:
        raise TaskNotApplicable(f"{cfg.data_dir} holds a corpus, not a synthetic task (data.task); ood tests a model "
                         f"trained on one, with that task's prepared-data folder as --data-dir")
    return family


@torch.no_grad()
def score(model, episodes: Episodes, batch_size: int, device,
          query_hook: QueryHook | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(correct, query) at every answer position of `episodes`, flat over sequences: whether the greedy
    next token is the answer, and a query id unique over the set (sequence * 2^20 + query). query_hook:
    every attention layer's, for this scoring (`adaptive_temperature_queries`). Batches hold sequences of
    like length (each is cut to its longest): the model is causal, so padding after a sequence changes none of
    its logits, and far less of it is computed at the long conditions. Only the logits from the batch's first
    answer position on are computed (`logits_to_keep`: the last block then computes those rows alone; where the
    answers come last, as in max retrieval, a 2-layer model scores in about 0.6x the time, benchmarks/ood_eval.py)."""
    correct, queries = [], []
    order = np.argsort(episodes.lengths, kind="stable")
    for start in range(0, len(episodes), batch_size):
        rows_here = order[start:start + batch_size]
        part = episodes.take(rows_here)
        answered = np.flatnonzero(part.answer_mask.any(0))
        if not len(answered):
            continue
        first = int(answered[0])
        ids = torch.from_numpy(part.inputs).to(device)
        with rescale_queries(model, query_hook) if query_hook is not None else contextlib.nullcontext():
            logits = model(ids, logits_to_keep=ids.shape[1] - first).logits
        answer = part.answer_mask[:, first:]
        pred = logits.argmax(-1).cpu().numpy()
        correct.append((pred == part.targets[:, first:])[answer])
        rows = rows_here[np.nonzero(answer)[0]]
        queries.append(rows.astype(np.int64) * 2**20 + part.answer_query[:, first:][answer])
    return np.concatenate(correct), np.concatenate(queries)


def query_accuracy(correct: np.ndarray, queries: np.ndarray) -> tuple[int, int]:
    """(queries, errors): a query is right when every one of its answer tokens is."""
    ids, inverse = np.unique(queries, return_inverse=True)
    wrong = np.zeros(len(ids), bool)
    np.logical_or.at(wrong, inverse, ~correct)
    return len(ids), int(wrong.sum())


def position_masses(rows: torch.Tensor, episodes: Episodes, b: int, t: int) -> torch.Tensor:
    """(..., 4) sums of attention rows (..., S) for the answer position t of sequence b over the target
    item, the distractors, the filler and the rest (MASSES), over the keys before t (t's own key counts
    as "other": a query never reads its answer from itself)."""
    support, role = episodes.support[b], episodes.role[b]
    item = episodes.answer_item[b, t]
    S = rows.shape[-1]
    keys = np.arange(S) < t
    groups = [keys & (support[:S] == item), keys & (role[:S] == ITEM) & (support[:S] != item),
              keys & (role[:S] == FILLER)]
    groups.append(~(groups[0] | groups[1] | groups[2]))
    masks = torch.from_numpy(np.stack(groups, -1).astype(np.float64)).to(rows.device, rows.dtype)  # (S, 4)
    return rows @ masks


def entropy(rows: torch.Tensor) -> torch.Tensor:
    p = rows.clamp(min=0)
    return -(p * p.log().nan_to_num(neginf=0.0)).sum(-1)  # 0 log 0 = 0


@torch.no_grad()
def mechanism(model, episodes: Episodes, device) -> dict[str, Any]:
    """Per layer and head, averaged over every answer position of `episodes`: masses on "diff", "a1",
    "a2" (MASSES each), entropy of a1 and a2, and the largest logit of each map. The signed map's masses
    net positive weights against negative ones, so its positive and negative parts are kept apart too
    ("diff_positive", "diff_negative"; the negative part is 0 for a softmax map): a negative weight
    still adds its value, with the opposite sign, to the output."""
    layers = len(model.layers)
    sums: dict[tuple[int, str], torch.Tensor] = {}
    count = 0
    batch = probe_batch(model, episodes.inputs.shape[1], 8, device, maps_kept=layers)
    for start in range(0, len(episodes), batch):
        part = episodes.take(np.arange(start, min(start + batch, len(episodes))))
        top: list[torch.Tensor | None] = [None] * layers

        def hook_for(i: int):
            def hook(scores, visible):
                shown = scores if visible is None else scores.masked_fill(~visible, float("-inf"))
                top[i] = shown.amax(-1)  # (B, heads, maps, T)
            return hook

        with inspect_attention(model, hook_for):
            out = model(torch.from_numpy(part.inputs).to(device), return_attention=True)
        for b, t in zip(*np.nonzero(part.answer_mask)):
            count += 1
            for i, maps in enumerate(out.attentions):
                a2 = maps.a2 if maps.a2 is not None else maps.a1
                signed = maps.diff[b, :, t].double()
                rows = {"diff": signed, "diff_positive": signed.clamp(min=0), "diff_negative": signed.clamp(max=0),
                        "a1": maps.a1[b, :, t].double(), "a2": a2[b, :, t].double()}
                record = {f"{name}_mass": position_masses(r, part, b, t) for name, r in rows.items()}
                record["a1_entropy"], record["a2_entropy"] = entropy(rows["a1"]), entropy(rows["a2"])
                logit = _logits_per_map(top[i], maps.a1.shape[1])[b, :, :, t].double()  # (heads, maps)
                record["a1_max_logit"] = logit[:, 0]
                record["a2_max_logit"] = logit[:, -1]
                for key, value in record.items():
                    sums[(i, key)] = value + sums[(i, key)] if (i, key) in sums else value
    per_layer = []
    for i in range(layers):
        entry = {}
        for (layer, key), total in sums.items():
            if layer == i:
                mean = (total / max(count, 1)).tolist()
                entry[key] = ({m: [h[j] for h in mean] for j, m in enumerate(MASSES)} if key.endswith("_mass")
                              else mean)
        per_layer.append(entry)
    return {"answer_positions": count, "layers": per_layer}


def _logits_per_map(top: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, heads, maps, T) from the largest logits (B, H_s, M, T) of a layer's score hook. DIFF V1 scores its
    two maps as M = 2; DIFF V2 scores them as 2 * heads ordinary heads (2i: A1, 2i + 1: A2 of head i), paired
    here; ordinary attention has one map per head (M = 1, H_s = heads)."""
    B, Hs, M, T = top.shape
    if M == 1 and Hs == 2 * heads:
        return top.reshape(B, heads, 2, T)
    return top


def summary_masses(layers: list[dict[str, Any]], which: str = "diff") -> dict[str, float]:
    """The masses of `which` map averaged over layers and heads."""
    out = {}
    for m in MASSES:
        values = [v for layer in layers for v in layer[f"{which}_mass"][m]]
        out[m] = float(np.mean(values)) if values else float("nan")
    return out


def head_weights(layer: dict[str, Any], h: int) -> tuple[dict[str, float], dict[str, float]] | None:
    """(positive, negative) parts of head h's A1 − λA2 masses (MASSES each) in one layer of a `mechanism`
    record, or None where they were not measured apart. A softmax map ("diff" is "a1") has no negative part."""
    if "diff_positive_mass" in layer:
        return ({m: layer["diff_positive_mass"][m][h] for m in MASSES},
                {m: layer["diff_negative_mass"][m][h] for m in MASSES})
    if layer.get("a1_mass") == layer.get("diff_mass"):
        return {m: layer["diff_mass"][m][h] for m in MASSES}, dict.fromkeys(MASSES, 0.0)
    return None


def map_masses(attention: dict[str, Any] | None, head: tuple[int, int] | None, which: str) -> dict[str, float] | None:
    """Head `head`'s mass on each of MASSES in one softmax map of a `mechanism` record: `which` "a1" or "a2" (a
    map's rows sum to 1, so these are its shares); None where the record has no such head or map."""
    layers = (attention or {}).get("layers") or []
    if head is None or head[0] >= len(layers) or f"{which}_mass" not in layers[head[0]]:
        return None
    masses = layers[head[0]][f"{which}_mass"]
    return {m: masses[m][head[1]] for m in MASSES}


def retrieving_head(attention: dict[str, Any] | None) -> tuple[int, int] | None:
    """The (layer, head) of a `mechanism` record at the training distribution whose positive attention weight
    puts the largest share on the target: the head that retrieves. Chosen once per model, so that every
    condition reads the same head (choosing per condition would pick whichever head holds up best out of
    distribution); the share, not the mass: A1 − λA2's rows sum to about 1 − λ, so raw masses would favour
    small λ."""
    best, best_share = None, -1.0
    for i, layer in enumerate((attention or {}).get("layers") or []):
        for h in range(len(layer["diff_mass"]["target"])):
            parts = head_weights(layer, h)
            total = sum(parts[0].values()) if parts else 0.0
            if total > 0 and parts[0]["target"] / total > best_share:
                best, best_share = (i, h), parts[0]["target"] / total
    return best


def head_shares(attention: dict[str, Any] | None, head: tuple[int, int] | None) -> dict[str, Any] | None:
    """Head `head`'s shares in one condition's `mechanism` record: of its positive weight, the share on the
    target and on distractors + filler (the "noise"), and its negative weight as a share of the positive one."""
    layers = (attention or {}).get("layers") or []
    if head is None or head[0] >= len(layers):
        return None
    parts = head_weights(layers[head[0]], head[1])
    total = sum(parts[0].values()) if parts else 0.0
    if total <= 0:
        return None
    positive, negative = parts
    return {"layer": head[0], "head": head[1], "target": positive["target"] / total,
            "noise": (positive["distractor"] + positive["filler"]) / total,
            "negative": (0.0 - sum(negative.values())) / total}


@register_task
class OOD(Task):
    name = "ood"
    skip_options = ("min_accuracy",)
    description = ("a synthetic task out of distribution: accuracy with Wilson intervals at longer contexts and "
                   "denser distractors, and where each answer's attention goes (target, distractors, filler)")
    Options = OODOptions
    white_box = True
    reads_seq_len = False

    def check_options(self) -> None:
        o = self.options
        for name in ("lengths", "densities"):
            for f in getattr(o, name):
                Condition(length=f) if name == "lengths" else Condition(density=f)
        if not 1 <= o.min_queries <= 10_000_000:
            raise ValueError(f"ood.min_queries must lie in [1, 10,000,000], got {o.min_queries}")
        if not 0 <= o.attention_sequences <= 100_000:
            raise ValueError(f"ood.attention_sequences must lie in [0, 100,000], got {o.attention_sequences}")
        if not 0 <= o.min_accuracy <= 1:
            raise ValueError(f"ood.min_accuracy is an accuracy in [0, 1] (0 scores every condition), "
                             f"got {o.min_accuracy}")

    def run(self, model, tokenizer, cfg: EvalConfig) -> TaskResult:
        model = require_own_model(model, "ood")
        family = task_family(cfg)
        o = self.options
        limit = model.config.max_position_embeddings
        cells, skipped = [], []
        for c in conditions(o):
            skip = self._skip(family, c, limit, cells)
            if skip:
                skipped.append({"condition": c.name, **skip})
                continue
            cells.append(self._cell(model, family, c, cfg))
        if not cells or cells[0]["condition"] != TRAIN.name:  # every reading below is relative to it
            raise ValueError(f"ood cannot score the training condition: {skipped[0]['reason']}; evaluate the model "
                             f"on the task it was trained on, with its own prepared-data folder")
        cut = [s for s in skipped if s["cause"] == "min_accuracy"]
        if cut:
            log.info("ood: %d conditions not scored: %s", len(cut), cut[0]["reason"])
        base = cells[0]
        head = retrieving_head(base.get("attention"))  # the training condition's, read at every condition
        for cell in cells:
            if "attention" in cell:
                cell["attention"]["retrieving"] = head_shares(cell["attention"], head)
        metrics = {"accuracy": base["accuracy"], "errors": base["errors"], "queries": base["queries"]}
        for cell in cells[1:]:
            metrics[f"accuracy_{cell['condition']}"] = cell["accuracy"]
        for cell in cells if o.adaptive_temperature else ():
            metrics[f"adaptive_accuracy_{cell['condition']}"] = cell["adaptive"]["accuracy"]
        settings = {"family": family.to_dict(), "position_limit": limit}
        return TaskResult(self.name, metrics, settings, {"cells": cells, "skipped": skipped})

    def covers(self, stored: dict[str, Any]) -> bool:
        """A stored result covers this task's work unless it left conditions unscored for `min_accuracy` that this
        task's threshold would score (its training accuracy reaches this task's `min_accuracy`)."""
        details = stored.get("details") if isinstance(stored, dict) else None
        skipped = (details or {}).get("skipped") if isinstance(details, dict) else None
        if not any(isinstance(s, dict) and s.get("cause") == "min_accuracy" for s in skipped or ()):
            return True
        accuracy = (stored.get("metrics") or {}).get("accuracy")
        return isinstance(accuracy, (int, float)) and accuracy < self.options.min_accuracy

    def _skip(self, family: Family, c: Condition, limit: int, cells: list[dict[str, Any]]) -> dict[str, str] | None:
        """Why condition `c` is not scored ({"cause", "reason"}), or None: the family cannot build it, its
        sequences exceed the model's positions, or (`min_accuracy`) the model failed the training condition."""
        try:
            family.check_condition(c)
        except ValueError as e:
            return {"cause": "condition", "reason": str(e)}
        if family.max_length(c) > limit:
            return {"cause": "position_limit",
                    "reason": f"{family.max_length(c)} tokens exceed the model's max_position_embeddings {limit}"}
        trained = next((cell for cell in cells if cell["condition"] == TRAIN.name), None)
        if c != TRAIN and trained is not None and trained["accuracy"] < self.options.min_accuracy:
            return {"cause": "min_accuracy", "reason": f"accuracy {trained['accuracy']:.4f} at the training condition "
                    f"is below min_accuracy {self.options.min_accuracy:g}: the model has not learned the task"}
        return None

    def _cell(self, model, family: Family, c: Condition, cfg: EvalConfig) -> dict[str, Any]:
        t0 = time.perf_counter()
        per_seq = _queries_per_sequence(family, c, cfg.eval_seed)
        n = max(1, math.ceil(self.options.min_queries / per_seq))
        episodes = eval_set(family, c, n, seed=cfg.eval_seed)
        cell = {"condition": c.name, "length": c.length, "density": c.density, "sequences": len(episodes),
                "tokens": int(family.max_length(c)),
                **_accuracy(*score(model, episodes, cfg.batch_size * 4, cfg.device))}
        if self.options.adaptive_temperature:
            cell["adaptive"] = _accuracy(*score(model, episodes, cfg.batch_size * 4, cfg.device,
                                                adaptive_temperature_queries))
        if self.options.attention and self.options.attention_sequences:
            sample = episodes.take(np.arange(min(self.options.attention_sequences, len(episodes))))
            cell["attention"] = mechanism(model, sample, cfg.device)
            layers = cell["attention"]["layers"]
            cell["attention"]["mean"] = {w: summary_masses(layers, w) for w in ("diff", "a1", "a2")}
        adaptive = f", adaptive temperature {cell['adaptive']['accuracy']:.4f}" if "adaptive" in cell else ""
        log.info("ood %s: accuracy %.4f over %d queries%s (%.0f s)", c.name, cell["accuracy"], cell["queries"],
                 adaptive, time.perf_counter() - t0)
        return cell

    def plot(self, result: TaskResult, path: Path) -> bool:
        """Accuracy (with its Wilson interval) against the length and the density factor, and the retrieving
        head's shares of its positive weight on the target and on distractors + filler (the "noise") on the
        same axes (`retrieving_head`: chosen at the training condition)."""
        from matplotlib.figure import Figure

        cells = result.details["cells"]
        fig = Figure(figsize=(10, 3.6))
        for n, axis in enumerate(("length", "density")):
            ax = fig.add_subplot(1, 2, n + 1)
            row = [c for c in cells if c["length" if axis == "density" else "density"] == 1.0]
            x = [c[axis] for c in row]
            acc = [c["accuracy"] for c in row]
            err = [[c["accuracy"] - (1 - c["error_rate_ci95"][1]) for c in row],
                   [(1 - c["error_rate_ci95"][0]) - c["accuracy"] for c in row]]
            ax.errorbar(x, acc, yerr=err, marker="o", capsize=3, label="accuracy")
            shares = [(c.get("attention") or {}).get("retrieving") for c in row]
            if all(shares):
                ax.plot(x, [m["target"] for m in shares], "s--", label="retrieving head: share on target")
                ax.plot(x, [m["noise"] for m in shares], "v:", label="retrieving head: share on noise")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"{axis} factor")
            ax.legend(fontsize=8)
        fig.suptitle(f"{result.settings['family']['family']}: out of distribution")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return True


def _accuracy(correct: np.ndarray, queries: np.ndarray) -> dict[str, Any]:
    total, errors = query_accuracy(correct, queries)
    return {"queries": total, "errors": errors, "accuracy": 1 - errors / total,
            "error_rate_ci95": list(wilson_interval(errors, total))}


def _queries_per_sequence(family: Family, condition: Condition, seed: int) -> float:
    """The mean number of queries of a sequence under `condition` (from a small pilot draw)."""
    rng = np.random.default_rng([seed, 0x9170])
    pilot = family.generate(rng, 64, condition)
    return max(1.0, float((pilot.answer_query.max(axis=1) + 1).mean()))
