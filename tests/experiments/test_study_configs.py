"""The shipped run and study configs load, build every arm, and an out-of-distribution study can test every
condition it names.

A study's config is read hours before its evaluations run: an arm whose overrides its kind refuses fails at
that arm's turn, and a condition the family cannot make (more items than the context holds) or the model
cannot read (past max_position_embeddings) is skipped in every unit's result (eval/probes/ood.py). These
tests catch both when the config is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftransformer.eval.probes.ood import conditions
from difftransformer.eval.task import get_task
from difftransformer.experiments.study import Study
from difftransformer.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*") if p.suffix in (".toml", ".yaml"))
OOD_STUDIES = [p for p in CONFIGS if "ood" in load_run_config(p).compare.eval_tasks]


def _study(path: Path) -> Study:
    cfg = load_run_config(path)
    return Study(cfg.model, cfg.train, cfg.data, cfg.compare, cfg.source)


def test_the_configs_are_found():
    names = {p.name for p in CONFIGS}
    assert {"demo.toml", "demo-ood.toml", "ood-flipflop.toml", "ood-induction.toml", "ood-maxret.toml"} <= names
    assert {p.name for p in OOD_STUDIES} >= {"demo-ood.toml", "ood-flipflop.toml", "ood-induction.toml",
                                             "ood-maxret.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_loads_and_builds_each_arm_and_its_recipe(path):
    study = _study(path)
    arms = study.compare.arm_names
    for config in study.arm_configs(arms):
        assert config.num_hidden_layers == study.model.num_hidden_layers
    for arm in arms:
        for _, tokens in study.cells():
            assert study.arm_train(arm, tokens).max_steps > study.train.warmup_steps


@pytest.mark.parametrize("path", OOD_STUDIES, ids=lambda p: p.name)
def test_every_ood_condition_fits_the_family_and_every_arms_position_limit(path):
    study = _study(path)
    family = study.data.task
    assert family is not None, f"{path.name} evaluates ood but trains on no synthetic task (data.task)"
    options = get_task("ood", **study.compare.eval_options.get("ood", {})).options
    limit = min(c.max_position_embeddings for c in study.arm_configs(study.compare.arm_names))
    for condition in conditions(options):
        family.check_condition(condition)  # a ValueError names the condition the family cannot make
        assert family.max_length(condition) <= limit, (condition, family.max_length(condition), limit)
