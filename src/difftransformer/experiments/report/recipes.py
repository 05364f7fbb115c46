"""Which architecture and recipe each arm of a report trained on: read here, once, for every section that compares
arms (the verdicts, the final-loss table, the out-of-distribution section).

An arm's recipe is what besides its attention sets its results: its training settings (the seed aside: the unit
names it) and its model's position encoding. It is read from the identity each unit's result file records, else
from the unit's run folder (its train_config.json and model_config.json, in the form a result file records:
`Run.identity`), so a report built from result files and one built from run folders see the same recipes. A
recipe that neither records is unknown, and never taken to equal another (`same_recipe` is None): a comparison
with such an arm is never read as one on a common recipe, and says that its recipe is not recorded.
"""

from __future__ import annotations

import functools
from typing import Any

from difftransformer.experiments.report.fmt import code_span

OTHER_RECIPE = " (other recipe)"
NOT_RECORDED = " (recipe not recorded)"
MIXED = "mixed recipes"  # `recipe` of an arm whose seeds trained on different recipes


def identities(ctx, arm: str) -> dict[int, dict[str, Any]]:
    """{seed: identity (model, train, ...)} of the arm's runs that record one (`Run.identity`)."""
    runs = ((seed, ctx.runs.get((arm, seed))) for seed in ctx.seeds)
    return {seed: ident for seed, run in runs if run is not None and (ident := run.identity)}


def arm_kind(ctx, arm: str) -> str:
    """The arm's attention kind, as its runs record it, else as the manifest defines the arm, else its name
    (which names the kind by default)."""
    recorded = next((k for i in identities(ctx, arm).values() if (k := (i.get("model") or {}).get("attention"))),
                    None)
    return recorded or ctx.spec(arm).get("attention") or arm


def unencoded(ctx, arm: str) -> bool:
    """Whether the arm has no position encoding (NoPE), as its runs record, else as the manifest defines the arm."""
    recorded = {(i.get("model") or {}).get("position_encoding") for i in identities(ctx, arm).values()} - {None}
    if recorded:
        return recorded == {"none"}
    return (ctx.spec(arm).get("overrides") or {}).get("position_encoding") == "none"


@functools.cache
def _train_defaults() -> tuple[tuple[str, Any], ...]:
    """The recipe-setting defaults (`units.train_defaults` less the freely changeable settings), once."""
    from difftransformer.experiments.units import train_defaults
    from difftransformer.train.config import FREELY_CHANGEABLE

    return tuple((k, v) for k, v in train_defaults().items() if k not in FREELY_CHANGEABLE)


def recipe(ctx, arm: str) -> tuple[str, Any] | None:
    """The arm's recipe: its training settings (the seed aside; a setting its records predate at its default, as
    `units.identity_differences` reads them) and its position encoding. None (unknown) when a run of the arm
    records no identity. Seeds of one arm on different recipes give a value no other arm shares, so every
    comparison with that arm reads as one across recipes."""
    runs = [run for seed in ctx.seeds if (run := ctx.runs.get((arm, seed))) is not None]
    if not runs or any(not (run.identity or {}).get("train") for run in runs):
        return None
    recipes = set()
    for run in runs:
        train = {**dict(_train_defaults()), **{k: v for k, v in run.identity["train"].items() if k != "seed"}}
        recipes.add((repr(sorted(train.items())), (run.identity.get("model") or {}).get("position_encoding")))
    if len(recipes) > 1:
        return (MIXED, arm)
    return next(iter(recipes))


def single_recipe(ctx, arm: str) -> tuple[str, Any] | None:
    """The arm's recipe where every run of it records the same one; None when unknown or mixed over seeds."""
    mine = recipe(ctx, arm)
    return None if mine is None or mine[0] == MIXED else mine


def same_recipe(ctx, arm: str, other: str) -> bool | None:
    """Whether the two arms trained on one recipe; None when either's is unknown (never read as the same)."""
    mine, theirs = recipe(ctx, arm), recipe(ctx, other)
    return None if mine is None or theirs is None else mine == theirs


def recipe_mark(ctx, arm: str, other: str) -> str:
    """"" when `arm` trained on `other`'s recipe, else the mark its name carries in a comparison with `other`:
    OTHER_RECIPE, or NOT_RECORDED when either recipe is unknown."""
    return {True: "", False: OTHER_RECIPE, None: NOT_RECORDED}[same_recipe(ctx, arm, other)]


def recipe_note(marks, ref: str) -> str:
    """The sentences that explain the marks (`recipe_mark`) a table's rows carry against `ref` ("" for none)."""
    text = ""
    if OTHER_RECIPE in marks:
        text += (f" \"{OTHER_RECIPE.strip()}\": trained on other settings than {code_span(ref)} (steps, "
                 "learning rate or position encoding), so its difference mixes recipe and architecture.")
    if NOT_RECORDED in marks:
        text += (f" \"{NOT_RECORDED.strip()}\": no result file or run folder records its recipe or "
                 f"{code_span(ref)}'s, so its difference may mix recipe and architecture.")
    return text


def matched_arm(ctx, arm: str, kind: str, arms) -> str | None:
    """The first arm of `arms` (not `arm`) with attention `kind` on `arm`'s recipe and position encoding, if any:
    what `arm` is set against to compare architectures without mixing in the recipe. None when `arm`'s recipe is
    unknown."""
    return next((a for a in arms if a != arm and arm_kind(ctx, a) == kind and same_recipe(ctx, arm, a)), None)
