"""The comparison runner through its Python API: data folder reconciled, arms added later, the baseline rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from difftransformer.data import DataConfig, PreparedData
from difftransformer.experiments import CompareConfig, Study, StudyDir, StudyMismatchError, run_compare
from difftransformer.experiments.config import baseline_arm
from difftransformer.train import TrainConfig
from tests.helpers import tiny


def _study(data_dir: str, arms: list[str], **train) -> Study:
    prepared = PreparedData.load(data_dir)
    data = DataConfig(corpus=prepared.corpus, data_dir=data_dir, vocab_size=prepared.vocab_size)
    recipe = TrainConfig(seq_len=32, batch_size=4, max_steps=2, warmup_steps=1, eval_interval=2, eval_batches=1,
                         log_interval=1, ckpt_interval=2, progress=False, tensorboard=False, device="cpu", **train)
    # TrainConfig.data_dir keeps its default: run_compare points it at the prepared folder
    return Study(tiny(vocab_size=prepared.vocab_size), recipe, data, CompareConfig(arms=arms, sample_tokens=2))


def test_the_api_reconciles_the_data_folder_and_continues_with_new_arms(data_dir, tmp_path):
    out = run_compare(_study(data_dir, ["diff", "transformer"]), tmp_path / "study", report=False)
    study = StudyDir(out)
    manifest = study.read_manifest()
    assert manifest["baseline"] == "transformer" and manifest["train"]["data_dir"] == data_dir
    for arm in ("diff", "transformer"):
        run = study.run_dir(arm, 0, multi_seed=False)
        assert run.is_finished(2) and run.read_json(run.done)["final_step"] == 2
    # a later call adds an arm: the baseline stays the transformer, the report covers all three
    run_compare(_study(data_dir, ["diff_v2"]), out)
    manifest = study.read_manifest()
    assert manifest["arms"] == ["diff_v2", "diff", "transformer"] and manifest["baseline"] == "transformer"
    assert "paired Δ vs transformer" in study.report.read_text()
    # another model in the same folder is refused; another backend of the same model is not another study
    with pytest.raises(StudyMismatchError, match="models differ"):
        run_compare(dataclass_with_layers(_study(data_dir, ["diff"]), 3), out, report=False)
    relaxed = _study(data_dir, ["diff"])
    relaxed.model = relaxed.model.__class__(**{**relaxed.model.to_dict(), "attn_backend": "eager"})
    run_compare(relaxed, out, report=False)


def dataclass_with_layers(study: Study, layers: int) -> Study:
    study.model = study.model.__class__(**{**study.model.to_dict(), "num_hidden_layers": layers})
    return study


def test_baseline_rule_and_the_backend_of_derived_arms():
    assert baseline_arm(["diff", "transformer", "diff_v2"]) == "transformer"
    assert baseline_arm(["diff", "diff_v2"]) == "diff_v2"
    spec = tiny(attn_backend="triton")
    arms = Study(spec, TrainConfig(), DataConfig(), CompareConfig(arms=["diff", "transformer"])).arm_configs(
        ["diff", "transformer", "diff_v2"])
    assert [c.attn_backend for c in arms] == ["triton", "auto", "auto"]  # the kernel is DIFF-only


def test_a_manifest_from_before_keeps_working(tmp_path):
    """Manifests written before the baseline was recomputed on merge: the report takes the rule, not the file."""
    root = tmp_path / "s"
    (root / "diff").mkdir(parents=True)
    (root / "diff" / "metrics.jsonl").write_text(
        json.dumps({"kind": "val", "step": 1, "loss": 1.0, "tokens": 8}) + "\n"
    )
    (root / "compare.json").write_text(json.dumps({"arms": ["diff_v2", "diff"], "seeds": [0], "baseline": "diff_v2"}))
    from difftransformer.experiments import write_report

    assert "baseline for differences is `diff`" in Path(write_report(root, samples=False)).read_text()


def test_finished_arms_are_evaluated_once_and_reported(data_dir, tmp_path, caplog):
    study = _study(data_dir, ["diff", "transformer"])
    study.compare = CompareConfig(arms=["diff", "transformer"], sample_tokens=2,
                                  eval_tasks=["heldout-loss", "long-context"])
    out = run_compare(study, tmp_path / "study")
    folder = StudyDir(out)
    records = {}
    for arm in ("diff", "transformer"):
        evals = folder.run_dir(arm, 0, multi_seed=False).evals
        records[arm] = json.loads((evals / "heldout-loss.json").read_text())
        assert (evals / "long-context.json").is_file() and (evals / "long-context.png").is_file()
    report = folder.report.read_text()
    loss = {a: r["metrics"]["loss"] for a, r in records.items()}
    assert (
        "## Evaluation" in report
        and f"| heldout-loss | loss | {loss['transformer']:.4g} | {loss['diff']:.4g} |" in report
    )
    # a second call trains nothing and evaluates nothing: each unit has its result file
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_compare(study, out)
    assert caplog.text.count("result file exists; skipping") == 2 and "evaluated" not in caplog.text
    # without result files, the stored evaluations are reused: they belong to the same weights
    shutil.rmtree(folder.results)
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_compare(study, out)
    assert "evaluated" not in caplog.text and caplog.text.count("reused") == 4
    assert (folder.results / "diff.json").is_file() and (folder.results / "transformer.json").is_file()
    with pytest.raises(ValueError, match="compare.eval_tasks: unknown evaluation task 'neddle'"):
        CompareConfig(eval_tasks=["neddle"])
