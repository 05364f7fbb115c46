"""The report's honesty on synthetic studies whose answer is known: seed noise, a clear winner, unfinished runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftransformer.experiments import write_report
from tests.helpers import lock_held_by_another_process


def _synthetic(root: Path, finals: dict[str, list[float]], steps: int = 100) -> Path:
    """A compare folder whose arms end at the given final val losses (one per seed)."""
    seeds = list(range(len(next(iter(finals.values())))))
    for arm, values in finals.items():
        for seed, final in zip(seeds, values):
            d = root / (f"seed{seed}" if len(seeds) > 1 else "") / arm
            d.mkdir(parents=True, exist_ok=True)
            (d / "train_config.json").write_text(json.dumps({"max_steps": steps, "seed": seed}))
            lam = [0.3, 0.5] if arm == "diff" else [None, None]
            inits = [0.25, 0.5] if arm == "diff" else [None, None]  # not the schedule: read, not recomputed
            rows = [{"kind": "train", "step": s, "loss": final + 2 * (1 - s / steps), "lr": 1e-3, "grad_norm": 1.0,
                     "tokens": s * 1000, "tokens_per_s": 900.0 if arm == "diff" else 1000.0, "elapsed_s": s,
                     "lambdas": lam, "lambda_inits": inits} for s in range(10, steps + 1, 10)]
            rows += [{"kind": "val", "step": s, "loss": final + 2 * (1 - s / steps), "tokens": s * 1000}
                     for s in range(25, steps + 1, 25)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "compare.json").write_text(json.dumps({"arms": list(finals), "seeds": seeds, "baseline": "transformer"}))
    return root


def test_report_single_seed_says_it_cannot_separate(tmp_path):
    root = _synthetic(tmp_path, {"diff": [3.0], "transformer": [3.5]})
    text = write_report(root, samples=False).read_text()
    assert "single seed cannot separate the arms" in text
    assert "reaches the lower" not in text


def test_report_within_noise(tmp_path):
    root = _synthetic(tmp_path, {"diff": [3.00, 3.20, 2.95], "transformer": [3.10, 3.02, 3.05]})
    text = write_report(root, samples=False).read_text()
    assert "within seed noise" in text and "cannot separate" in text and "reaches the lower" not in text


@pytest.mark.parametrize("finals, lower", [
    ({"diff": [3.00, 3.01, 2.99], "transformer": [3.50, 3.52, 3.49]}, "diff"),
    ({"diff": [3.50, 3.52, 3.49], "transformer": [3.00, 3.01, 2.99]}, "transformer"),
])
def test_report_names_the_lower_arm_when_far_beyond_noise(tmp_path, finals, lower):
    text = write_report(_synthetic(tmp_path, finals), samples=False).read_text()
    assert f"{lower} reaches the lower final validation loss" in text and "within seed noise" not in text
    assert "0.900" in text  # throughput ratio diff / transformer from the synthetic 900 vs 1000 tokens/s
    assert (tmp_path / "loss_curves.png").is_file() and (tmp_path / "lambda.png").is_file()


def test_report_marks_unfinished_runs(tmp_path):
    root = _synthetic(tmp_path, {"diff": [3.0, 3.1], "transformer": [3.2, 3.3]})
    (root / "seed1" / "transformer" / "train_config.json").write_text(json.dumps({"max_steps": 200, "seed": 1}))
    text = write_report(root, samples=False).read_text()
    assert "Incomplete" in text and "step 100 of 200" in text
    assert "single seed cannot separate" in text  # only seed 0 has both arms finished


def test_lambda_table_shows_the_logged_lambda_and_lambda_init(tmp_path):
    text = write_report(
        _synthetic(tmp_path, {"diff": [3.0, 3.1], "transformer": [3.2, 3.3]}), samples=False
    ).read_text()
    table = text.split("## λ per layer")[1]
    assert "| 0 | 0.250 | 0.300 ± 0.000 |" in table and "| 1 | 0.500 | 0.500 ± 0.000 |" in table


@pytest.mark.parametrize("key, value, shown", [("seeds", [0, "1"], '[0, "1"]'), ("arms", ["diff", 5], '["diff", 5]'),
                                               ("tokens", [10**400], "1000000"), ("wall_s", {"diff": "x"}, '"x"')])
def test_a_hand_edited_manifest_is_one_error_naming_file_key_and_value(tmp_path, key, value, shown):
    root = _synthetic(tmp_path, {"diff": [3.0], "transformer": [3.5]})
    manifest = json.loads((root / "compare.json").read_text())
    (root / "compare.json").write_text(json.dumps({**manifest, key: value}))
    with pytest.raises(ValueError, match=f"compare.json: {key} is .*not a") as e:
        write_report(root, samples=False)
    assert shown in str(e.value) and "\n" not in str(e.value)


def test_the_report_holds_the_study_folders_lock(tmp_path):
    """A report written while `compare` (or another report) writes the folder is refused at once, not torn."""
    from difftransformer._io import FolderInUseError

    root = _synthetic(tmp_path, {"diff": [3.0], "transformer": [3.5]})
    with lock_held_by_another_process(root) as proc:
        with pytest.raises(FolderInUseError, match=f"pid {proc.pid}.*; wait for it to finish, or report a copy of "
                                                  f"the folder$"):
            write_report(root, samples=False)
    assert not (root / "report.md").exists()
    assert write_report(root, samples=False).is_file()


def test_the_evaluation_table_leaves_ood_to_its_own_section():
    """ood's metrics are reported by the ood section, which holds out runs below the in-distribution bar; the general
    evaluation table must not repeat them with those runs in."""
    from types import SimpleNamespace

    from difftransformer.experiments.report.runs import Run
    from difftransformer.experiments.report.sections import _eval_metrics

    evals = {"ood": {"metrics": {"accuracy": 0.6, "errors": 4}}, "needle": {"metrics": {"accuracy": 0.5}}}
    ctx = SimpleNamespace(runs={("diff", 0): Run("diff", 0, None, evals=evals)})
    assert _eval_metrics(ctx) == [("needle", "accuracy")]


def test_an_arms_own_recipe_is_what_its_result_files_record():
    """A manifest written before an arm got its own recipe says nothing of it; the runs' records say what ran."""
    from types import SimpleNamespace

    from difftransformer.experiments.report.runs import Run
    from difftransformer.experiments.report.sections import _own_recipe

    shared = {"max_steps": 2000, "lr": 1e-3, "seed": 0}
    runs = [Run("nope", s, None, record={"identity": {"train": {"max_steps": 12000, "lr": 5e-4, "seed": s}}})
            for s in (0, 1)]
    ctx = SimpleNamespace(manifest={"train": shared}, arm_runs=lambda arm: runs, spec=lambda arm: {"train": {}})
    assert _own_recipe(ctx, "nope", shared) == {"max_steps": 12000, "lr": 5e-4}
    runs[1].record["identity"]["train"]["lr"] = 1e-3
    assert _own_recipe(ctx, "nope", shared) == {"per seed": "seed 0 max_steps 12000, lr 0.0005; seed 1 max_steps 12000"}
    ctx.arm_runs = lambda arm: [Run("nope", 0, None)]  # runs read from folders: the manifest's spec
    ctx.spec = lambda arm: {"train": {"max_steps": 6000}}
    assert _own_recipe(ctx, "nope", shared) == {"max_steps": 6000}


def test_the_papers_loss_claim_is_not_set_against_a_synthetic_tasks_loss():
    """The paper's validation loss is language modelling; a task study's loss is on generated answers: no claim, and
    no paper loss set beside its verdicts."""
    from difftransformer.experiments.report.claims import _loss_claim
    from difftransformer.experiments.report.runs import Run
    from difftransformer.experiments.report.sections import Context, ablations, verdicts

    runs = {(arm, s): Run(arm, s, None, val=[{"step": 10, "loss": loss + s / 100}], max_steps=10, last_step=10,
                          finished=True)
            for arm, loss in (("diff", 3.0), ("transformer", 3.1)) for s in range(3)}
    ctx = Context(study=None, manifest={"data": {"corpus": "tinyshakespeare"}}, arms=["transformer", "diff"],
                  seeds=[0, 1, 2], baseline="transformer", runs=runs)
    assert _loss_claim(ctx)["n"] == 3 and "1.4B-parameter ablation" in "\n".join(verdicts(ctx))
    ctx.manifest = {"data": {"corpus": "task:maxret", "task": {"family": "maxret"}}}
    assert _loss_claim(ctx) is None and "1.4B" not in "\n".join(verdicts(ctx))
    ctx.manifest["arm_specs"] = {}
    ctx.arms.append("diff_v2")
    table = "\n".join(ablations(ctx))
    assert "| `diff` |" in table and "Table 6" not in table  # no LM-loss column beside a task's losses


@pytest.mark.parametrize("mode", ["flushed", "kept", None])
def test_hardware_line_says_how_subnormal_floats_were_computed(tmp_path, mode):
    """A CPU step time means little without it (about 10x apart on a converged model); manifests written before
    it was recorded say nothing rather than a guess."""
    root = _synthetic(tmp_path, {"diff": [3.0], "transformer": [3.5]})
    manifest = json.loads((root / "compare.json").read_text())
    hw = {"cpu": "Some CPU", "cpu_count": 2, "torch_threads": 1, "torch": "9.9", "python": "3.11", "platform": "p"}
    manifest["hardware"] = hw | ({"denormals": mode} if mode else {})
    (root / "compare.json").write_text(json.dumps(manifest))
    line = next(x for x in write_report(root, samples=False).read_text().splitlines() if x.startswith("Hardware:"))
    assert ("1 torch threads, subnormal floats flushed)" in line) == (mode == "flushed")
    assert ("subnormal floats kept" in line) == (mode == "kept") and ("subnormal" in line) == (mode is not None)
