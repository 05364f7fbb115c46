"""The report's out-of-distribution section: the `ood` probe's results over arms and seeds.

For a study whose runs were evaluated with `ood` (eval/probes/ood.py): accuracy per test condition (context length
and distractor density factors) per arm, mean [95% t-interval over seeds], and the errors pooled over seeds with
their Wilson interval; the paired differences DIFF − each other arm per condition, with the verdict their interval
supports (and each other differential arm − each arm with one softmax map); the same for adaptive temperature at
inference (both arms with it, and DIFF as trained against each arm with it: the control without subtraction); each
differential arm without position encoding (NoPE) − the Transformer without it; each NoPE arm − its architecture with
RoPE on the same training settings (what position encoding alone does); each control with one softmax map
(gated, scalable softmax, head norm) − the Transformer on its recipe; each arm on another recipe − the arm of its
architecture named after it (what the recipe alone does); above them, one row per comparison on a common recipe with
the conditions that separate after Holm and before it (verdicts at a glance); where each model's retrieving head attends
(chosen once at the training distribution, read as shares of its positive weight on the target, on distractors +
filler, and its negative weight; for a differential arm, per seed, where that head's two maps A1 and A2 each put
their mass). A run below the in-distribution bar (no finite accuracy of at least 99% at the training condition) has
not learned the task, so a difference out of distribution says nothing about its attention: such runs are listed
with their accuracy per condition and left out of every mean, difference and figure (paired differences use the
seeds where both arms passed). Arms' recipes are read by `recipes` (result files, else run folders); a comparison
with an arm whose recipe neither records is marked so and never counted as one on a common recipe. A non-finite
value of a run past the bar is an error naming arm, seed and condition, never dropped silently.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from difftransformer._io import atomic_path
from difftransformer.eval.probes.ood import MASSES, head_shares, map_masses, retrieving_head, wilson_interval
from difftransformer.experiments.report.fmt import (
    Lines,
    code_span,
    fmt_ci,
    holm_readings,
    holm_separations,
    table,
)
from difftransformer.experiments.report.recipes import (
    arm_kind,
    matched_arm,
    recipe_mark,
    recipe_note,
    same_recipe,
    single_recipe,
    unencoded,
)
from difftransformer.experiments.stats import compare_paired, format_p, t_interval
from difftransformer.model import ATTENTION_KINDS

TASK = "ood"
IN_DISTRIBUTION_BAR = 0.99
PLOT_FILE = "ood.png"
TRAIN_CONDITION = "length1x-density1x"


def _cells(ctx, arm: str) -> dict[int, dict[str, dict[str, Any]]]:
    """{seed: {condition: cell}} of the arm's ood results."""
    out = {}
    for seed in ctx.seeds:
        run = ctx.runs.get((arm, seed))
        result = run.evals.get(TASK) if run else None
        if result:
            by_condition = {c["condition"]: c for c in (result.get("details") or {}).get("cells", [])}
            head = retrieving_head((by_condition.get(TRAIN_CONDITION) or {}).get("attention"))
            out[seed] = {name: {**c, "arm": arm, "retrieving": head_shares(c.get("attention"), head)}
                         for name, c in by_condition.items()}
    return out


def _values(cells: dict[int, dict[str, dict[str, Any]]], condition: str, read) -> dict[int, float]:
    """{seed: `read` of its cell at `condition`} over the seeds that measured it. A non-finite value is a
    ValueError naming arm, seed and condition, as in `stats.compare_paired`: never dropped silently, since a
    diverged run is a result to look at (a run with no finite accuracy at the training condition never gets
    here: it is listed below the in-distribution bar, `_bar`)."""
    out = {}
    for seed, by_condition in cells.items():
        cell = by_condition.get(condition)
        value = read(cell) if cell else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"ood {getattr(read, 'what', 'value')} of arm {cell.get('arm')!r} at seed {seed}, "
                                 f"condition {condition}, is {value!r}, not a finite number; that evaluation "
                                 f"diverged or its result file is damaged: fix or rerun it before reporting")
            out[seed] = float(value)
    return out


def _accuracy(cell):
    return cell.get("accuracy")


def _adaptive(cell):
    return (cell.get("adaptive") or {}).get("accuracy")


_accuracy.what, _adaptive.what = "accuracy", "accuracy with adaptive temperature"


def _share(part: str):
    """Reads the retrieving head's share `part` ("target", "noise", "negative"; `head_shares`)."""
    def read(cell):
        return (cell.get("retrieving") or {}).get(part)
    read.what = f"retrieving head's share ({part})"
    return read


def _reference_arm(ctx, arms) -> str | None:
    """The arm the differences are taken from: `diff` when any of its runs passed the bar, else the first
    differential arm with position encoding that has (DIFF V1 may not learn a task that DIFF V2 or DIFF without
    head norm learns), else the first differential arm."""
    if "diff" in arms:
        return "diff"
    differential = _differential(ctx, arms)
    return next((a for a in differential if not unencoded(ctx, a)), next(iter(differential), None))


def _nope_pairs(ctx, arms) -> list[tuple[str, str]]:
    """(differential arm, Transformer), both without position encoding: whether position encoding decides
    what DIFF does out of distribution. The Transformer is the one on the same recipe when there is one."""
    nope = [a for a in arms if unencoded(ctx, a)]
    transformers = [a for a in nope if arm_kind(ctx, a) == "transformer"]
    pairs = [(arm, _matched_transformer(ctx, arm, nope) or next(iter(transformers), None))
             for arm in _differential(ctx, nope)]
    return [(arm, base) for arm, base in pairs if base is not None]


def _recipe_pairs(ctx, arms) -> list[tuple[str, str]]:
    """(arm, base): each arm against the arm of the same attention kind and position encoding that is named after
    the kind (`transformer_lr5e-4` against `transformer`; the first such arm in `arms` when none is), where their
    recorded recipes differ (both recorded: `same_recipe` is False). Paired by seed, both start from the same weights
    and see the same batches, so the difference is the recipe's alone: the yardstick for differences between
    architectures on different recipes."""
    groups: dict[tuple[str, bool], list[str]] = {}
    for arm in arms:
        groups.setdefault((arm_kind(ctx, arm), unencoded(ctx, arm)), []).append(arm)
    pairs = []
    for (kind, _), members in groups.items():
        base = kind if kind in members else members[0]
        pairs += [(arm, base) for arm in members if arm != base and same_recipe(ctx, arm, base) is False]
    return pairs


def _encoding_pairs(ctx, arms) -> list[tuple[str, str]]:
    """(NoPE arm, RoPE arm): each arm without position encoding against the first arm of its attention kind with
    RoPE trained on the same settings (`transformer_nope` against `transformer_lr5e-4_12k`). Paired by seed, the
    difference is the position encoding's alone: whether it, rather than the architecture or the recipe, sets how
    far a model extrapolates in length."""
    pairs = []
    for arm in (a for a in arms if unencoded(ctx, a)):
        mine = single_recipe(ctx, arm)
        if mine is None:
            continue
        rope = [o for o in arms if not unencoded(ctx, o) and arm_kind(ctx, o) == arm_kind(ctx, arm)
                and (theirs := single_recipe(ctx, o)) is not None and theirs[0] == mine[0]]  # same training settings
        if rope:
            pairs.append((arm, rope[0]))
    return pairs


def _unmeasured_recipe(arm: str, base: str) -> Lines:
    """Why an arm on a recipe of its own has no table of what the recipe alone does: no seed on which both it
    and its architecture's arm on the other recipe passed the bar (that arm failed on every seed, as a rule)."""
    return [f"What the recipe alone does to {code_span(arm)} is not measured: it and {code_span(base)}, the same "
            "architecture on the other recipe, passed the in-distribution bar on no common seed.", ""]


def _differential(ctx, arms) -> list[str]:
    """The arms whose attention is a difference of two maps (DIFF V1, V2, without head norm), in `arms`' order."""
    return [a for a in arms if getattr(ATTENTION_KINDS.get(arm_kind(ctx, a)), "differential", False)]


def _controls(ctx, arms) -> list[str]:
    """The arms with one softmax map that are not the plain Transformer (the gated control, scalable softmax, the
    Transformer with DIFF's head norm), in `arms`' order."""
    return [a for a in arms if a not in _differential(ctx, arms) and arm_kind(ctx, a) != "transformer"]


def _matched_transformer(ctx, ref: str, arms) -> str | None:
    """The Transformer arm to set against `ref`: one on the same recipe and position encoding when there is one
    (`transformer_6k` beside DIFF's 6,000-step recipe: `recipes.matched_arm`), else `transformer`, else none."""
    plain = "transformer" in arms and ref != "transformer" and arm_kind(ctx, "transformer") == "transformer"
    return matched_arm(ctx, ref, "transformer", arms) or ("transformer" if plain else None)


def ood_section(ctx, out_dir: Path | None = None) -> Lines:
    """The section's lines ([] when no run has an ood result); draws `PLOT_FILE` into out_dir when given."""
    arms = [a for a in ctx.arms if _cells(ctx, a)]
    if not arms:
        return []
    every = {a: _cells(ctx, a) for a in arms}
    conditions = list(dict.fromkeys(c for a in arms for s in every[a].values() for c in s))
    cells = {a: _passing(every[a]) for a in arms}
    listed, arms = arms, [a for a in arms if cells[a]]  # an arm with no run past the bar is only listed
    kept = [c for c in conditions if any(c in s for a in arms for s in cells[a].values())]
    L = ["## Out-of-distribution retrieval", "",
         "Accuracy per query (a query is right when every answer token is) on fixed test sets never trained on, "
         "at the training distribution (`length1x-density1x`), at longer contexts (same items, more filler; "
         "flip-flop: more instructions at the same ignore odds, so the distance from a write to its read hardly "
         "grows) and at denser distractors (more items at the training length); mean [95% interval] over seeds. "
         "Protocol: docs/evaluation.md, `ood`.", ""]
    L += _bar(listed, every, conditions) + _skipped(ctx, listed, every)
    if not arms:
        return L
    conditions = kept
    verdicts: list[list[str]] = []
    comparisons = _comparisons(ctx, arms, listed, cells, conditions, verdicts)
    L += _summary(ctx, arms, cells, conditions) + _glance(verdicts)
    L += _table("Accuracy", arms, cells, conditions, _accuracy, 4)
    L += _errors(arms, cells, conditions)
    if any(_values(cells[a], c, _adaptive) for a in arms for c in conditions):
        L += _table("Accuracy with adaptive temperature at inference", arms, cells, conditions, _adaptive, 4)
    L += comparisons
    L += _mechanism(arms, cells, conditions)
    L += _two_maps(_differential(ctx, arms), cells, conditions)
    if out_dir is not None and _plot(arms, cells, conditions, Path(out_dir) / PLOT_FILE):
        L += [f"![accuracy and target share against the length and density factors]({PLOT_FILE})", ""]
    return L


def _comparisons(ctx, arms, listed, cells, conditions, verdicts: list[list[str]]) -> Lines:
    """The paired-difference tables: the reference arm − each arm (as trained, both with adaptive temperature, and
    as trained against each with it), each other differential arm − each one-map arm, each control − its
    Transformer, each NoPE differential arm − the NoPE Transformer, each arm − its architecture on another recipe.
    Each comparison on a common recipe also adds its row to `verdicts` (`_glance`)."""
    L: Lines = []
    if len(ctx.seeds) < 2:
        return L
    ref = _reference_arm(ctx, arms)
    if ref in arms:
        L += _differences(ctx, ref, arms, cells, conditions, _accuracy, "accuracy", verdicts=verdicts)
        if any(_values(cells[ref], c, _adaptive) for c in conditions):
            L += _differences(ctx, ref, arms, cells, conditions, _adaptive, "accuracy with adaptive temperature "
                              "(both arms)", verdicts=verdicts, glance="both with adaptive temperature")
            L += _differences(ctx, ref, arms, cells, conditions, _accuracy,
                              f"accuracy: {code_span(ref)} as trained against each arm with adaptive temperature at "
                              "inference (the dispersion fix without subtraction as a control)", read_other=_adaptive,
                              verdicts=verdicts, glance="the other with adaptive temperature")
        differential = _differential(ctx, arms)
        single = [a for a in arms if a not in differential]
        for other in (a for a in differential if a != ref and not unencoded(ctx, a)):
            L += _differences(ctx, other, [other, *single], cells, conditions, _accuracy,
                              "accuracy (each arm with a single softmax map)", verdicts=verdicts)
        for control in _controls(ctx, arms):
            base = _matched_transformer(ctx, control, arms)
            if base and same_recipe(ctx, base, control):  # another (or an unknown) recipe's would mix the two
                L += _differences(ctx, control, [base], cells, conditions, _accuracy,
                                  "accuracy (a control against the Transformer on its recipe: what it does "
                                  "without a subtraction)", verdicts=verdicts)
    for arm, base in _nope_pairs(ctx, arms):
        L += _differences(ctx, arm, [base], cells, conditions, _accuracy, "accuracy, both without position encoding",
                          verdicts=verdicts, glance="both without position encoding")
    for arm, base in _encoding_pairs(ctx, arms):
        L += _differences(ctx, arm, [base], cells, conditions, _accuracy,
                          "accuracy (the same architecture and training settings with RoPE: what position encoding "
                          "alone does)", same_architecture=True, verdicts=verdicts, glance="position encoding alone")
    for arm, base in _recipe_pairs(ctx, listed):
        if arm in arms:  # an arm below the bar on every seed has no differences of its own
            L += _differences(ctx, arm, [base], cells, conditions, _accuracy,
                              "accuracy (the same architecture on another recipe: what the recipe alone does)",
                              same_architecture=True, verdicts=verdicts, glance="the recipe alone") \
                or _unmeasured_recipe(arm, base)
    return L


def _glance(verdicts: list[list[str]]) -> Lines:
    """One row per comparison on a common recipe: where it separates after Holm, where before Holm only, and the
    difference at the farthest length; the tables further down give every condition."""
    if not verdicts:
        return []
    return ["### Verdicts at a glance", "",
            "Each comparison of two arms on a common recipe (the same training settings and position encoding; "
            "\"the recipe alone\": one architecture on two recipes), paired by seed, in accuracy: the conditions "
            "where the 95% interval of the differences excludes 0 after Holm's adjustment over the pair's "
            "conditions (1x: the training condition), those where it does before the adjustment only (or with zero "
            "width: the same difference on every seed, no test), and the difference at the farthest length. \"The "
            "other with adaptive temperature\": the first arm as trained against the second with adaptive "
            "temperature at inference. The tables below give every condition.", ""] \
        + table(["comparison", "seeds", "separates after Holm", "before Holm only", "Δ at the farthest length"],
                verdicts) + [""]


def _condition_label(condition: str) -> str:
    """"1x" (the training condition), "16x length", "2x density", "2x length 2x density"."""
    factors = [(_factor(condition, axis), axis) for axis in ("length", "density")]
    return " ".join(f"{f:g}x {axis}" for f, axis in factors if f != 1.0) or "1x"


def _separations(kept) -> tuple[str, str]:
    """(after Holm, before Holm only) over one arm pair's (condition, comparison)s: "higher at 8x length (+0.120);
    lower at ..." or "none". A zero-width interval (no p: nothing survives Holm) counts as before Holm only, marked
    "no test", as the claims table reads it ("... without a test")."""
    def say(found) -> str:
        by_sign: dict[str, list[str]] = {}
        for (c, cmp), separation in found:
            mean = sum(cmp.diffs) / cmp.n
            shown = (f"{mean:+.3f}" if abs(mean) >= 5e-4 else f"{mean:+.1e}") + (
                ", no test" if separation == "no test" else "")
            by_sign.setdefault("higher" if mean > 0 else "lower", []).append(f"{_condition_label(c)} ({shown})")
        return "; ".join(f"{sign} at " + ", ".join(items) for sign, items in by_sign.items()) or "none"
    found = list(zip(kept, (s for _, s in holm_separations([cmp for _, cmp in kept]))))
    return (say(f for f in found if f[1] == "after Holm"),
            say(f for f in found if f[1] in ("not after Holm", "no test")))


def _mechanism(arms, cells, conditions) -> Lines:
    """Where the retrieving head's attention goes, per condition: its share on the target, on the noise, and
    its negative weight (A1 − λA2 only); how far its first map spreads (entropy) and how sharp it can be (its
    largest logit)."""
    L = ["### Where the retrieving head attends", "",
         "Answer rows of the first sequences of each condition (`attention_sequences`). The retrieving head is "
         "chosen once per model, at `length1x-density1x`: the head (any layer) whose positive attention weight "
         "puts the largest share on the target. Shares are of that head's positive weight (A1 − λA2 for DIFF, "
         "whose rows sum to about 1 − λ; the softmax map otherwise), so arms compare whatever their λ. A DIFF "
         "model measured before the positive and negative parts were kept apart has no entry here.", ""]
    parts = [(_share("target"), "Share on the target"),
             (_share("noise"), "Share on distractors + filler (the \"attention noise\")"),
             (_share("negative"), "Negative weight, as a share of the positive weight (what the subtraction removes)"),
             (_head_stat("a1_entropy"), "Entropy of its first map A1 (the one softmax map for the other arms), nats: "
                                        "how far it spreads"),
             (_head_stat("a1_max_logit"), "Largest pre-softmax logit of A1: how sharp it can be")]
    shown = 0
    for read, title in parts:
        values = [v for a in arms for c in conditions for v in _values(cells[a], c, read).values()]
        if any(values):
            L += [f"**{title}**", ""] + _table(title, arms, cells, conditions, read)[2:]
            shown += 1
    return L if shown else []


def _head_stat(key: str):
    """Reads the retrieving head's `key` in a cell's mechanism record (per layer, one value per head:
    "a1_entropy", "a1_max_logit"; `eval.probes.ood.mechanism`), None where the cell has no retrieving head."""
    def read(cell):
        head, layers = cell.get("retrieving"), (cell.get("attention") or {}).get("layers") or []
        values = layers[head["layer"]].get(key) if head and head["layer"] < len(layers) else None
        return values[head["head"]] if isinstance(values, list) and head["head"] < len(values) else None
    read.what = f"retrieving head's {key}"
    return read


def _two_maps(arms, cells, conditions) -> Lines:
    """Per differential arm and seed, where the retrieving head's two softmax maps A1 and A2 put their mass, at
    the training distribution and the farthest length and density: whether a model that holds up out of
    distribution keeps A1 itself on the target, or lets A1 spread and cancels the spread by subtracting A2."""
    where = [c for c in (TRAIN_CONDITION, _farthest(conditions, "length"), _farthest(conditions, "density")) if c]
    L = []
    for arm in arms:
        rows = []
        for seed, by_condition in sorted(cells[arm].items()):
            head = retrieving_head((by_condition.get(TRAIN_CONDITION) or {}).get("attention"))
            for c in where:
                maps = [map_masses((by_condition.get(c) or {}).get("attention"), head, m) for m in ("a1", "a2")]
                if head is None or None in maps:
                    continue
                rows.append([str(seed), code_span(c), _fmt(by_condition[c].get("accuracy")),
                             f"layer {head[0]}, head {head[1]}",
                             *(" / ".join(f"{m[part]:.2f}" for part in MASSES[:3]) for m in maps)])
        if rows:
            L += [f"**{code_span(arm)}: the retrieving head's two maps, per seed**", "",
                  "Mass of each softmax map of the retrieving head on target / distractors / filler (the rest is "
                  "on other tokens); the head's output is A1 − λA2.", ""]
            L += table(["seed", "condition", "accuracy", "retrieving head", "A1", "A2"], rows) + [""]
    return L


def _passed(by_condition: dict[str, dict[str, Any]]) -> bool:
    """Whether a run passed the in-distribution bar: a finite accuracy at the training condition of at least
    IN_DISTRIBUTION_BAR (a run without one has not shown that it learned the task)."""
    value = (by_condition.get(TRAIN_CONDITION) or {}).get("accuracy")
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return finite and value >= IN_DISTRIBUTION_BAR


def _below(by_condition: dict[str, dict[str, Any]]) -> str:
    """Why a run did not pass the bar: its training-condition accuracy, or that it has no finite one."""
    if TRAIN_CONDITION not in by_condition:
        return "no result at the training condition"
    value = by_condition[TRAIN_CONDITION].get("accuracy")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "no accuracy at the training condition"
    return f"{value:.4f}" if math.isfinite(value) else f"accuracy {_fmt(value)} at the training condition"


def _passing(cells: dict[int, dict[str, dict[str, Any]]]) -> dict[int, dict[str, dict[str, Any]]]:
    return {seed: by_condition for seed, by_condition in cells.items() if _passed(by_condition)}


def _bar(arms, every, conditions) -> Lines:
    """The runs below the in-distribution bar, with their accuracy per condition (left out of everything else)."""
    below = [(arm, seed, by_condition) for arm in arms for seed, by_condition in sorted(every[arm].items())
             if not _passed(by_condition)]
    if not below:
        return [f"Every arm and seed is at least {IN_DISTRIBUTION_BAR:.0%} accurate in distribution: differences "
                f"out of distribution are differences in how retrieval generalises.", ""]
    rows = [[code_span(arm), str(seed), *(_fmt(by_condition.get(c, {}).get("accuracy")) for c in conditions)]
            for arm, seed, by_condition in below]
    return [f"**Not every run passed the in-distribution bar ({IN_DISTRIBUTION_BAR:.0%}):** "
            + ", ".join(f"{code_span(arm)} seed {seed} ({_below(by_condition)})" for arm, seed, by_condition in below)
            + ". A model that has not learned the task in distribution says nothing about attention noise out of "
            "it, so these runs are left out of every mean, difference and figure below (train them longer, or "
            "report them as not learning the task). Their accuracy (– where a condition was not scored: below "
            "the evaluation's `min_accuracy`, or a skipped condition):", ""] \
        + table(["arm", "seed", *(code_span(c) for c in conditions)], rows) + [""]


def _skipped(ctx, arms, every) -> Lines:
    """The conditions an evaluation skipped (the family cannot build them, their sequences exceed the model's
    position limit, or the run was below `min_accuracy`), with the runs and the reason, so a condition missing
    from the tables is never missing silently. Those skipped below the
    evaluation's `min_accuracy` are listed only for a run that passed the bar (a `min_accuracy` above it); a run
    below the bar has them as dashes in its own table (`_bar`)."""
    where: dict[str, list[str]] = {}
    reasons: dict[str, str] = {}
    for arm in arms:
        for seed in ctx.seeds:
            run = ctx.runs.get((arm, seed))
            below = seed in every[arm] and not _passed(every[arm][seed])
            for item in (((run.evals.get(TASK) if run else None) or {}).get("details") or {}).get("skipped") or []:
                if below and item.get("cause") == "min_accuracy":
                    continue
                where.setdefault(item["condition"], []).append(f"{code_span(arm)} seed {seed}")
                reasons.setdefault(item["condition"], item.get("reason", ""))
    if not where:
        return []
    return ["**Skipped conditions** (not in the tables below): " + "; ".join(
        f"{code_span(c)} for {', '.join(runs)} ({reasons[c]})" for c, runs in where.items()) + ".", ""]


def _seeds(n: int) -> str:
    return f"{n} seed" + "s" * (n != 1)


def _fmt(value) -> str:
    """An accuracy in 4 decimals; a non-finite one as such ("NaN", "inf"); "–" when there is none."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "–"
    if math.isfinite(value):
        return f"{value:.4f}"
    return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _summary(ctx, arms, cells, conditions) -> Lines:
    """One paragraph: how accuracy moves from the training distribution to the farthest length and density,
    per arm, and what the seeds allow to say about DIFF against the Transformer there."""
    farthest = [c for c in (_farthest(conditions, "length"), _farthest(conditions, "density")) if c]
    if not farthest:
        return []

    def accs(condition: str) -> str:
        values = {a: v for a in arms if (v := _values(cells[a], condition, _accuracy))}
        uneven = len({len(v) for v in values.values()}) > 1  # means over different seeds: say how many
        return ", ".join(f"{code_span(a)} {_mean(v):.2%}" + (f" ({_seeds(len(v))})" if uneven else "")
                         for a, v in values.items())

    places = [("in distribution", TRAIN_CONDITION), *((f"at {code_span(c)}", c) for c in farthest)]
    said = [f"{where} {accs(c)}" for where, c in places if accs(c)]
    if not said:
        return []
    text = "In short: " + "; ".join(said) + "."
    ref = _reference_arm(ctx, arms)
    base = _matched_transformer(ctx, ref, arms) if ref else None
    if base and len(ctx.seeds) > 1:
        which = "the Transformer's" + ("" if base == "transformer" else f" on the same recipe ({code_span(base)})")
        same = same_recipe(ctx, ref, base)
        if same is False:
            which += " (on another recipe: the difference mixes recipe and architecture)"
        elif same is None:
            which += " (recipe not recorded: the difference may mix recipe and architecture)"
        for c in farthest:
            cmp = compare_paired(_values(cells[ref], c, _accuracy), _values(cells[base], c, _accuracy),
                                 arm=ref, baseline=base, metric=c)
            if cmp.diffs:
                said = {"better": "lower than", "worse": "higher than"}.get(cmp.outcome, "not separable from")
                text += (f" At {code_span(c)}, {code_span(ref)}'s accuracy is {said} {which} (paired Δ "
                         f"{fmt_ci(list(cmp.diffs), 4, signed=True)} over {_seeds(cmp.n)}).")
    elif len(ctx.seeds) == 1:
        text += " One seed per arm: these are observations, not verdicts."
    return [text, ""]


def _factor(condition: str, axis: str) -> float:
    """The `axis` ("length" or "density") factor of a condition name such as "length4x-density1x"."""
    part = condition.split("-")[0 if axis == "length" else 1]
    return float(part[len(axis):-1])


def _along(conditions: list[str], axis: str) -> list[str]:
    """The conditions on the `axis` line (the other factor at 1x, the training condition included), nearest first."""
    other = "density" if axis == "length" else "length"
    return sorted((c for c in conditions if _factor(c, other) == 1.0), key=lambda c: _factor(c, axis))


def _farthest(conditions: list[str], axis: str) -> str | None:
    """The condition farthest out along `axis` (the other factor at 1x), if any beyond the training one."""
    along = [c for c in _along(conditions, axis) if _factor(c, axis) > 1.0]
    return along[-1] if along else None


def _table(title: str, arms, cells, conditions, read, digits: int = 3) -> Lines:
    """Mean [95% interval] of `read` per arm and condition; accuracies take 4 digits, since the rare errors
    flip-flop is about (1e-4 to 1e-3) vanish in 3."""
    rows = [[code_span(a), *(fmt_ci(list(_values(cells[a], c, read).values()), digits) for c in conditions)]
            for a in arms]
    if all(cell == "–" for row in rows for cell in row[1:]):
        return []
    counts = {a: max(len(_values(cells[a], c, read)) for c in conditions) for a in arms}
    note = []
    if len(set(counts.values())) > 1:
        note = ["Arms have different seeds so far (" + ", ".join(f"{code_span(a)} {n}" for a, n in counts.items())
                + "): each mean is over its own seeds; the paired differences use the seeds both arms have.", ""]
    return [f"### {title}", ""] + note + table(["arm", *(code_span(c) for c in conditions)], rows) + [""]


def _errors(arms, cells, conditions) -> Lines:
    """Errors / queries per arm and condition, summed over the arm's seeds past the bar, with the error rate and
    its 95% Wilson interval: the rare errors an accuracy near 1 hides (flip-flop's 1e-4 against 1e-3), and how
    many queries stand behind them. A cell pooled over fewer seeds than the arm has past the bar says how many."""
    rows = []
    for arm in arms:
        row = [code_span(arm)]
        for c in conditions:
            counted = [n for by_condition in cells[arm].values() if (n := _counts(by_condition.get(c)))]
            if not counted:
                row.append("–")
                continue
            errors, queries = sum(e for e, _ in counted), sum(n for _, n in counted)
            part = f" ({len(counted)} of {len(cells[arm])} seeds)" if len(counted) < len(cells[arm]) else ""
            row.append(f"{errors:,}/{queries:,}: {_rates(errors / queries, *wilson_interval(errors, queries))}{part}")
        rows.append(row)
    if all(cell == "–" for row in rows for cell in row[1:]):
        return []
    return ["### Errors, pooled over seeds", "",
            "Wrong queries / queries of every seed past the bar, the error rate and its 95% Wilson interval. The "
            "interval is the test sets' sampling error of the pooled rate; how much the rate moves from seed to "
            "seed is in the accuracy table above.", ""] \
        + table(["arm", *(code_span(c) for c in conditions)], rows) + [""]


def _counts(cell: dict[str, Any] | None) -> tuple[int, int] | None:
    """(errors, queries) of a cell that records both (queries > 0), else None."""
    errors, queries = (cell or {}).get("errors"), (cell or {}).get("queries")
    ok = isinstance(errors, int) and isinstance(queries, int) and queries > 0
    return (errors, queries) if ok else None


def _rates(rate: float, low: float, high: float) -> str:
    """'rate [low, high]' in fixed decimals, enough to give the interval's width two significant digits."""
    decimals = min(8, max(2, math.ceil(-math.log10(high - low)) + 1)) if high > low else 4
    return f"{rate:.{decimals}f} [{low:.{decimals}f}, {high:.{decimals}f}]"


def _differences(ctx, ref: str, arms, cells, conditions, read, what: str, read_other=None,
                 same_architecture: bool = False, verdicts: list[list[str]] | None = None,
                 glance: str = "") -> Lines:
    """ref − each other arm per condition, paired by seed: `read` of ref against `read_other` (default `read`)
    of the other arm. Each arm pair's conditions are one family for the Holm-adjusted p. `same_architecture`:
    the arms differ in their recipe alone, so an arm on other settings is not marked as mixing the two. Each pair
    on a common recipe appends its row (named with `glance`, if any) to `verdicts`, once per pair and glance."""
    rows, marks = [], set()
    for other in (a for a in arms if a != ref):
        cmps = [compare_paired(_values(cells[ref], c, read), _values(cells[other], c, read_other or read),
                               arm=ref, baseline=other, metric=f"ood {c}") for c in conditions]
        kept = [(c, cmp) for c, cmp in zip(conditions, cmps) if cmp.diffs]
        mark = "" if same_architecture else recipe_mark(ctx, other, ref)
        name = code_span(other) + mark
        for (c, cmp), (adjusted, reading) in zip(kept, holm_readings([cmp for _, cmp in kept], ref)):
            rows.append([name, code_span(c), str(cmp.n), fmt_ci(list(cmp.diffs), 4, signed=True),
                         format_p(cmp.p), adjusted, reading])
        marks.add(mark if kept else "")
        if verdicts is not None and kept and not mark:
            _add_verdict(verdicts, ref, other, glance, conditions, kept)
    if not rows:
        return []
    recipes = "" if same_architecture else recipe_note(marks, ref)  # explains the marks its rows carry
    return [f"### {code_span(ref)} − each arm, {what}", "",
            "Paired by seed; the reading follows the 95% interval (an interval that holds 0 cannot separate). "
            "Holm p adjusts each arm pair's p-values over its conditions: a separation marked \"not after Holm\" "
            "may be one of the chance results expected among that many tests." + recipes, ""] \
        + table(["other arm", "condition", "seeds", "Δ [95% interval]", "p", "Holm p", "reading"], rows) + [""]


def _add_verdict(verdicts: list[list[str]], ref: str, other: str, glance: str, conditions, kept) -> None:
    """Appends ref − other's row for `_glance`, unless that pair (either way round) already has one with this
    glance."""
    name = f"{code_span(ref)} − {code_span(other)}" + (f" ({glance})" if glance else "")
    twin = f"{code_span(other)} − {code_span(ref)}" + (f" ({glance})" if glance else "")
    if any(row[0] in (name, twin) for row in verdicts):
        return
    farthest = _farthest(conditions, "length")
    at_far = next((cmp for c, cmp in kept if c == farthest), None)
    far = "–" if at_far is None else f"{_condition_label(farthest)}: {fmt_ci(list(at_far.diffs), 3, signed=True)}"
    verdicts.append([name, str(max(cmp.n for _, cmp in kept)), *_separations(kept), far])


def curves(arms, cells, conditions, axis: str, read) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per arm, (factor, mean, low, high) of `read` along `axis` (conditions with the other factor at 1x): the
    mean over seeds and its 95% t-interval (low = high = mean with one seed); factors no seed has are left out."""
    out = {}
    for arm in arms:
        points = []
        for c in _along(conditions, axis):
            values = list(_values(cells[arm], c, read).values())
            if values:
                iv = t_interval(values)
                lo, hi = (iv.low, iv.high) if iv.low is not None else (iv.mean, iv.mean)
                points.append((_factor(c, axis), iv.mean, lo, hi))
        out[arm] = points
    return out


def _plot(arms, cells, conditions, path: Path) -> bool:
    """Accuracy (top) and the retrieving head's share on the target (bottom) against the length factor (left)
    and the density factor (right), one colour per arm in every panel: the mean over seeds, shaded over its
    95% interval; one legend below."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    axes = [a for a in ("length", "density") if len(_along(conditions, a)) > 1]
    if not axes:
        return False
    fig = Figure(figsize=(5 * len(axes), 7))
    palette = [f"C{n}" for n in range(10)] if len(arms) <= 10 else list(colormaps["tab20"].colors)
    panels = ((_accuracy, "accuracy"), (_share("target"), "retrieving head: share on target"))
    for row, (read, label) in enumerate(panels):
        for col, axis in enumerate(axes):
            ax = fig.add_subplot(2, len(axes), row * len(axes) + col + 1)
            for n, (arm, points) in enumerate(curves(arms, cells, conditions, axis, read).items()):
                if points:
                    x, mean, lo, hi = zip(*points)
                    colour = palette[n % len(palette)]
                    ax.plot(x, mean, marker="o", color=colour, label=arm)
                    ax.fill_between(x, lo, hi, color=colour, alpha=0.12, linewidth=0)
            factors = [_factor(c, axis) for c in _along(conditions, axis)]
            ax.set_xscale("log", base=2)
            ax.set_xticks(factors, [f"{f:g}x" for f in factors])
            ax.set_xlabel(f"{axis} factor (x the training {'context length' if axis == 'length' else 'distractors'})")
            ax.set_ylabel(label)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110)
    return True


def _mean(values: dict[int, float]) -> float:
    return sum(values.values()) / len(values) if values else math.nan
