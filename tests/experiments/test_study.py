"""Studies through their Python API: the data folder reconciled, arms added later, the baseline rule; grids of
sizes and token budgets, result files that survive the machine, resuming, and the report rebuilt from result
files alone."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from difftransformer.data import DataConfig, PreparedData
from difftransformer.experiments import (
    Size,
    Study,
    StudyConfig,
    StudyDir,
    StudyMismatchError,
    Unit,
    run_study,
    write_report,
)
from difftransformer.experiments.config import baseline_arm
from difftransformer.experiments.report.runs import Run
from difftransformer.experiments.units import ResultFileError, find_results, read_result, result_path
from difftransformer.model import get_preset
from difftransformer.train import TrainConfig
from tests.helpers import lock_held_by_another_process, tiny, unit_record

SIZES = [{"name": "s32", "hidden_size": 32, "num_hidden_layers": 1, "diff_heads": 1},
         {"name": "s64", "hidden_size": 64, "num_hidden_layers": 2, "diff_heads": 2}]


def _study(data_dir: str, results_dir: Path | None = None, **compare) -> Study:
    prepared = PreparedData.load(data_dir)
    data = DataConfig(corpus=prepared.corpus, data_dir=data_dir, vocab_size=prepared.vocab_size)
    recipe = TrainConfig(seq_len=32, batch_size=4, max_steps=2, warmup_steps=1, eval_interval=1, eval_batches=1,
                         log_interval=1, ckpt_interval=2, progress=False, tensorboard=False, device="cpu")
    settings = dict(arms=["diff", "transformer"], sample_tokens=2, prompts=["a"],
                    results_dir=str(results_dir) if results_dir else None)
    return Study(tiny(vocab_size=prepared.vocab_size), recipe, data, StudyConfig(**{**settings, **compare}))


def test_sizes_and_budgets_in_the_config():
    cfg = StudyConfig(sizes=["cpu-small", *SIZES], tokens="1_000,500")
    assert [s.name for s in cfg.sizes] == ["cpu-small", "s32", "s64"] and cfg.tokens == [500, 1000]
    assert cfg.sizes[0] == Size("cpu-small", 256, 4, 4)
    spec = cfg.sizes[1].spec(get_preset("tiny").config("transformer"))
    assert (spec.attention, spec.hidden_size, spec.num_attention_heads, spec.head_dim, spec.intermediate_size) == (
        "diff", 32, 1, 16, round(8 * 32 / 3))  # the FFN follows the width unless given
    assert StudyConfig(**cfg.to_dict()).sizes == cfg.sizes
    study = Study(tiny(), TrainConfig(seq_len=32, batch_size=4, warmup_steps=2), DataConfig(), cfg)
    assert study.train_for(1000).max_steps == 8 and study.train_for(None) is study.train  # ceil(1000 / 128)
    with pytest.raises(ValueError, match="not more than train.warmup_steps"):
        study.train_for(200)
    for bad, message in (({"sizes": ["cpu-smal"]}, "did you mean 'cpu-small'"),
                         ({"sizes": [{"name": "x", "hidden_size": 32}]}, "lacks num_hidden_layers, diff_heads"),
                         ({"sizes": [{"name": "x", "hidden_size": 0, "num_hidden_layers": 1, "diff_heads": 1}]},
                          "positive integer"),
                         ({"sizes": [{"name": "x", "width": 3}]}, "unknown keys"),
                         ({"sizes": ["tiny", "tiny"]}, "size name twice"),
                         ({"tokens": [100, -1]}, "positive token budgets"),
                         ({"tokens": [100, 100]}, "budget twice")):
        with pytest.raises(ValueError, match=message):
            StudyConfig(**bad)
    with pytest.raises(ValueError, match="size 'odd' is not a valid model"):
        Size("odd", 30, 1, 4).spec(tiny())


def test_a_grid_study_writes_result_files_and_continues_from_them_elsewhere(data_dir, tmp_path, caplog):
    results = tmp_path / "committed" / "grid"
    study = _study(data_dir, results, sizes=SIZES, seeds=[0, 1])
    out = run_study(study, tmp_path / "machine1")
    folder = StudyDir(out)
    for size in ("s32", "s64"):
        for seed in (0, 1):
            for arm in ("diff", "transformer"):
                unit = Unit(size, None, seed, arm)
                record = json.loads(result_path(results, unit, True).read_text())
                run = folder.unit_dir(unit, True)
                assert run.is_finished(2) and run.path == out / size / f"seed{seed}" / arm
                assert record["unit"] == unit.to_dict() and record["finished"] and record["model"]["hidden_size"] == \
                    int(size[1:])
                assert record["final_val_loss"] == run.metric_series().val[-1]["loss"]
                assert record["samples"] and record["samples"][0]["prompt"] == "a"
                assert record["identity"]["train"]["seed"] == record["train_config"]["seed"] == seed  # as trained
    # paired per (size, seed): both arms of a cell start from the same embedding
    assert (results / "compare.json").is_file()
    report = folder.report.read_text()
    assert "## Scaling" in report and "| s32 |" in report and "| s64 |" in report
    html = folder.html.read_text()
    assert "data:image/png;base64," in html and 'src="loss_curves.png"' not in html

    # another machine: only the committed result files; nothing is trained again, not even a unit whose file
    # records the study's seed rather than its own (as older versions wrote every seed's)
    older = result_path(results, Unit("s32", None, 1, "diff"), True)
    record = json.loads(older.read_text())
    record["identity"]["train"]["seed"] = record["train_config"]["seed"] = 0
    older.write_text(json.dumps(record))
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study, tmp_path / "machine2")
    assert caplog.text.count("result file exists; skipping") == 8 and "training into" not in caplog.text

    # the result files alone rebuild the same report
    copy = tmp_path / "copy"
    shutil.copytree(results, copy)
    rebuilt = write_report(copy, samples=True).read_text()

    def numbers(text: str) -> list[str]:
        skip = ("Report written", "Run folders", "Training wall time")
        keep = [ln for ln in text.splitlines() if not ln.startswith(skip)
                and "read from their result files" not in ln and "Started" not in ln and "Command" not in ln]
        return keep

    assert numbers(rebuilt) == numbers(report)


def test_a_killed_study_resumes_and_a_foreign_result_file_is_refused(data_dir, tmp_path, monkeypatch):
    import difftransformer.experiments.study as study_module

    study = _study(data_dir, None, tokens=[256, 384])
    calls = []
    real = study_module.train

    def dies_on_second(*args, **kwargs):
        calls.append(kwargs.get("resume"))
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while training the second unit
        return real(*args, **kwargs)

    monkeypatch.setattr(study_module, "train", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_study(study, tmp_path / "s")
    monkeypatch.setattr(study_module, "train", real)
    out = run_study(study, tmp_path / "s")
    folder = StudyDir(out)
    for tokens, steps in ((256, 2), (384, 3)):
        for arm in ("diff", "transformer"):
            unit = Unit(None, tokens, 0, arm)
            assert folder.unit_dir(unit, False).is_finished(steps)
            record = json.loads(result_path(folder.results, unit, False).read_text())
            assert record["max_steps"] == steps and record["identity"]["train"]["max_steps"] == steps
    assert "## Scaling" in folder.report.read_text()
    # a result file written for another model is never taken for this one
    path = result_path(folder.results, Unit(None, 256, 0, "diff"), False)
    record = json.loads(path.read_text())
    record["identity"]["model"]["hidden_size"] = 999
    path.write_text(json.dumps(record))
    with pytest.raises(ResultFileError, match=re.escape(str(path)) + ".*another experiment \\(model"):
        run_study(study, out)
    path.write_text("{not json")
    with pytest.raises(ResultFileError, match="not a readable result file"):
        run_study(study, out)


def _write_results(root: Path, records: list[dict], sizes: list[str], seeds: list[int]) -> None:
    manifest = {"arms": ["diff", "transformer"], "seeds": seeds, "baseline": "transformer",
                "sizes": [{"name": s} for s in sizes] if sizes else [], "tokens": []}
    root.mkdir(parents=True)
    (root / "compare.json").write_text(json.dumps(manifest))
    for r in records:
        unit = Unit.from_dict(r["unit"])
        p = result_path(root, unit, len(seeds) > 1)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(r))


def test_an_unfinished_run_is_never_shown_as_a_final_loss_and_a_grid_counts_every_cell(tmp_path):
    """Seed 2's DIFF stopped at step 3 of 10: the per-seed table gives its latest loss with the step, never as a
    final one; a grid's note on runs read from result files alone counts the runs of every cell."""
    records = []
    for seed in (0, 1, 2):
        records.append(unit_record(Unit(None, None, seed, "transformer"), 3.00 + 0.01 * seed))
        record = unit_record(Unit(None, None, seed, "diff"), 2.98 + 0.01 * seed)
        if seed == 2:
            record.update(finished=False, last_step=3, max_steps=10, final_val_loss=7.5,
                          val=[{"step": 3, "loss": 7.5, "tokens": 300}])
        records.append(record)
    _write_results(tmp_path / "one", records, [], [0, 1, 2])
    lines = Path(write_report(tmp_path / "one", samples=False)).read_text().splitlines()
    assert "| 2 | 7.5000 (step 3 of 10) | 3.0200 |" in lines
    grid = [unit_record(Unit(size, None, seed, arm), loss) for size, loss in (("s32", 3.0), ("s64", 2.5))
            for seed in (0, 1) for arm in ("diff", "transformer")]
    _write_results(tmp_path / "grid", grid, ["s32", "s64"], [0, 1])
    text = Path(write_report(tmp_path / "grid", samples=False)).read_text()
    assert "8 of the 8 runs were read from their result files alone" in text


def test_scaling_section_reads_the_known_fraction_off_result_files(tmp_path):
    """Losses from L(x) = 1 + 10 x^-0.3 (Transformer) and L(x / 0.6) (DIFF), over non-embedding parameters:
    the report must say DIFF matches the Transformer with about 60% of the parameters."""
    sizes = {"a": 1e4, "b": 3e4, "c": 1e5, "d": 3e5}
    records = []
    for seed, noise in ((0, 0.0), (1, 4e-4), (2, -3e-4)):
        for name, x in sizes.items():
            base = 1 + 10 * x ** -0.3
            records.append(unit_record(Unit(name, None, seed, "transformer"), base + noise, int(x) + 100))
            records.append(unit_record(Unit(name, None, seed, "diff"), 1 + 10 * (x / 0.6) ** -0.3 - noise,
                                   int(x) + 100))
    _write_results(tmp_path / "r", records, list(sizes), [0, 1, 2])
    text = write_report(tmp_path / "r", samples=False).read_text()
    line = next(ln for ln in text.splitlines() if "diff matches the transformer with" in ln)
    pct = int(re.search(r"with (\d+)%", line).group(1))
    assert 57 <= pct <= 63, line
    assert "## The paper's claims" in text and "DIFF needs a fraction of the Transformer's parameters" in text
    claim = next(ln for ln in text.splitlines() if ln.startswith("| DIFF needs a fraction"))
    assert "**reproduced**" in claim  # the interval lies below 1


def test_claims_follow_the_interval(tmp_path):
    """Needle accuracy clearly higher for DIFF (the paper's direction): reproduced; loss inside noise: not shown;
    the outlier metric in the opposite direction: opposite; and the not-reproduced list names them. The same
    needle difference on every seed has no test: "reproduced without a test", listed with what did not reproduce."""
    records = []
    for seed in range(3):
        for arm, acc, loss, top1 in (("diff", 0.9 + 0.02 * seed, 3.0 + (0.02, -0.03, 0.01)[seed], 50.0 + 2 * seed),
                                     ("transformer", 0.5 + 0.01 * seed, 3.0, 20.0 + seed)):
            evals = {"needle": {"metrics": {"greedy@N2R2": acc}},
                     "outliers": {"metrics": {"attention_logits_top1": top1}}}
            records.append(unit_record(Unit(None, None, seed, arm), loss, 1000, evals))
    _write_results(tmp_path / "r", records, [], [0, 1, 2])
    text = write_report(tmp_path / "r", samples=False).read_text()
    rows = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "**reproduced**" in rows["needle `greedy@N2R2`"]
    assert "+0.410 [" in rows["needle `greedy@N2R2`"]  # 0.40, 0.41, 0.42
    assert "**not shown**" in rows["validation loss (DIFF lower)"]
    assert "**opposite**" in rows["outliers `attention_logits_top1`"]
    missed = text.split("### What did not reproduce")[1]
    assert "validation loss" in missed and "outliers" in missed and "needle" not in missed.split("Testing")[0]
    assert "paired seeds" in missed  # how many seeds the observed spread would need
    assert missed.index("outliers") < missed.index("validation loss")  # "opposite" listed before "not shown"


def test_the_same_claim_difference_on_every_seed_is_reproduced_without_a_test(tmp_path):
    """+0.4 needle accuracy on every seed: a zero-width interval, no p, so nothing to survive Holm: the claim reads
    "reproduced without a test" and is listed with what did not reproduce, as the OOD glance table files it."""
    records = [unit_record(Unit(None, None, seed, arm), 3.0, 1000, {"needle": {"metrics": {"greedy@N2R2": acc}}})
               for seed in range(3) for arm, acc in (("diff", 0.9), ("transformer", 0.5))]
    _write_results(tmp_path / "r", records, [], [0, 1, 2])
    text = write_report(tmp_path / "r", samples=False).read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| needle `greedy@N2R2`"))
    assert "**reproduced without a test** (the same difference on every seed" in row
    missed = text.split("### What did not reproduce")[1].split("Testing")[0]
    assert "needle `greedy@N2R2`: reproduced without a test" in missed and "no spread to test it against" in missed


def test_one_seed_claims_get_one_sentence_not_a_list(tmp_path):
    records = []
    for arm, loss, top1 in (("diff", 3.1, 50.0), ("transformer", 3.0, 20.0)):
        evals = {"outliers": {"metrics": {"attention_logits_top1": top1}}}
        records.append(unit_record(Unit(None, None, 0, arm), loss, 1000, evals))
    _write_results(tmp_path / "r", records, [], [0])
    text = write_report(tmp_path / "r", samples=False).read_text()
    missed = text.split("### What did not reproduce")[1].split("##")[0]
    assert "2 of the 2 claims were measured with one seed" in missed
    assert "\n- " not in missed  # no per-claim bullets without an interval


def test_recipe_line_gives_the_steps_of_each_token_budget(tmp_path):
    """With token budgets, max_steps differs per cell: the recipe line says the steps of each budget
    (ceil(tokens / (16 x 32)): 1000 -> 2, 5000 -> 10), not the base recipe's max_steps."""
    records = [unit_record(Unit(None, tokens, 0, arm), 3.0, 1000) for tokens in (1000, 5000)
               for arm in ("diff", "transformer")]
    _write_results(tmp_path / "r", records, [], [0])
    manifest_path = tmp_path / "r" / "compare.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(tokens=[1000, 5000], train={"max_steps": 999, "batch_size": 16, "seq_len": 32})
    manifest_path.write_text(json.dumps(manifest))
    text = write_report(tmp_path / "r", samples=False).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Training (identical"))
    assert "2 steps for the 1,000-token budget, 10 steps for the 5,000-token budget" in line
    assert "999" not in line


def test_a_study_reuses_another_studys_identical_units(data_dir, tmp_path, caplog):
    """compare.reuse: a unit another study already trained and evaluated with the same identity is copied
    (its evals cut to this study's tasks), not trained again; a unit of another recipe is not taken."""
    first = tmp_path / "first"
    run_study(_study(data_dir, first, eval_tasks=["heldout-loss", "outliers"]), tmp_path / "a", report=False)
    second = tmp_path / "second"
    study = _study(data_dir, second, arms=["diff", "transformer", "diff_v2"], eval_tasks=["heldout-loss"],
                   reuse=[str(first)])
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study, tmp_path / "b", report=False)
    assert caplog.text.count("result reused from") == 2 and caplog.text.count("training into") == 1  # diff_v2 only
    for arm in ("diff", "transformer"):
        source = json.loads(result_path(first, Unit(None, None, 0, arm), False).read_text())
        copy = json.loads(result_path(second, Unit(None, None, 0, arm), False).read_text())
        assert copy["identity"] == source["identity"] and copy["final_val_loss"] == source["final_val_loss"]
        assert set(copy["evals"]) == {"heldout-loss"} and copy["reused_from"] == str(first)
    assert "| `diff_v2` |" in write_report(second, samples=False).read_text()  # reused and trained units together
    # another recipe (one more step): nothing of the first study fits, everything is trained
    base = _study(data_dir, tmp_path / "third", eval_tasks=["heldout-loss"], reuse=[str(first)])
    longer = dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=3))
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(longer, tmp_path / "c", report=False)
    assert "result reused" not in caplog.text and caplog.text.count("training into") == 2
    with pytest.raises(ValueError, match="compare.reuse must be a list"):
        StudyConfig(reuse="results/paper-cpu")


def test_a_copied_unit_of_an_older_task_version_follows_its_source(data_dir, tmp_path, caplog, monkeypatch):
    """A unit copied from another study (compare.reuse) has no model here to evaluate again: while its source is
    outdated too, the warning names the source; once the source study has evaluated it again, the next compare
    copies the new result."""
    from difftransformer.eval.tasks.heldout_loss import HeldOutLoss

    first, second = tmp_path / "first", tmp_path / "second"
    run_study(_study(data_dir, first, eval_tasks=["heldout-loss"]), tmp_path / "a", report=False)
    reusing = _study(data_dir, second, eval_tasks=["heldout-loss"], reuse=[str(first)])
    run_study(reusing, tmp_path / "b", report=False)
    version = lambda folder: json.loads(result_path(folder, Unit(None, None, 0, "diff"), False).read_text())[  # noqa
        "evals"]["heldout-loss"]["settings"]["task_version"]
    monkeypatch.setattr(HeldOutLoss, "version", 2)
    caplog.clear()
    run_study(reusing, tmp_path / "b", report=False)
    assert version(second) == 1 and f"copied from {first}: evaluate it again there" in caplog.text
    run_study(_study(data_dir, first, eval_tasks=["heldout-loss"]), tmp_path / "a", report=False)
    assert version(first) == 2
    caplog.clear()
    run_study(reusing, tmp_path / "b", report=False)
    assert version(second) == 2 and "older version" not in caplog.text


def test_a_result_evaluated_with_other_options_is_not_reused(data_dir, tmp_path, caplog):
    """compare.reuse takes another study's unit only where its evaluations used this study's eval options: one
    made with others is skipped with a warning naming its file and what differs (copied, it would enter this
    report and be refused only by the next invocation), and the unit is trained here; one made with the same
    options is copied."""
    first = tmp_path / "first"

    def study(results: Path, documents: int, **compare) -> Study:
        return _study(data_dir, results, eval_tasks=["long-context"],
                      eval_options={"long-context": {"documents": documents}}, **compare)

    run_study(study(first, 2), tmp_path / "a", report=False)
    source = result_path(first, Unit(None, None, 0, "diff"), False)
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study(tmp_path / "second", 3, reuse=[str(first)]), tmp_path / "b", report=False)
    assert "result reused" not in caplog.text and caplog.text.count("training into") == 2
    assert re.search(re.escape(f"{source} not reused: evaluated with other options") + r".*long-context: documents: 2 "
                     r"before, 3 now", caplog.text)
    record = json.loads(result_path(tmp_path / "second", Unit(None, None, 0, "diff"), False).read_text())
    assert "reused_from" not in record and record["evals"]["long-context"]["settings"]["options"]["documents"] == 3
    run_study(study(tmp_path / "second", 3), tmp_path / "b", report=False)  # consistent: the next invocation agrees
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study(tmp_path / "third", 2, reuse=[str(first)]), tmp_path / "c", report=False)
    assert caplog.text.count("result reused from") == 2 and "training into" not in caplog.text
    assert "not reused" not in caplog.text
    assert json.loads(result_path(tmp_path / "third", Unit(None, None, 0, "diff"), False).read_text())[
        "reused_from"] == str(first)


def test_a_stored_result_is_never_replaced_by_another_training_length(data_dir, tmp_path):
    """Committed result files (no run folders) and a run of the same study with another max_steps: refused
    before anything is written, naming train.max_steps; with the run folders there, a shorter recipe is refused
    even without result files (their weights are no result of it); --replace-results replaces, on purpose."""

    results = tmp_path / "committed"
    base = _study(data_dir, results)

    def recipe(steps: int) -> Study:
        return dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=steps))

    run_study(recipe(3), tmp_path / "machine1", report=False)
    files = sorted(results.rglob("*.json"))
    before = {p: p.read_bytes() for p in files}
    for out, steps in ((tmp_path / "machine2", 2), (tmp_path / "machine2", 4), (tmp_path / "machine1", 2)):
        with pytest.raises(ResultFileError, match=r"train\.max_steps: 3 before, %d now.*--replace-results" % steps):
            run_study(recipe(steps), out, report=False)
        assert {p: p.read_bytes() for p in files} == before  # nothing rewritten, the manifest copy included
    assert not (tmp_path / "machine2" / "diff").exists()
    for p in files:
        if p.name != "compare.json":
            p.unlink()
    with pytest.raises(StudyMismatchError, match="trained to step 3, past train.max_steps 2.*--no-resume"):
        run_study(recipe(2), tmp_path / "machine1", report=False)
    run_study(recipe(3), tmp_path / "machine1", report=False)  # the result files come back from the runs
    with pytest.raises(StudyMismatchError, match="3-step cosine schedule .* asks for 4 steps: .* stretch"):
        run_study(recipe(4), tmp_path / "machine1", report=False, replace_results=True)
    for arm in ("diff", "transformer"):
        shutil.rmtree(tmp_path / "machine1" / arm)
    run_study(recipe(4), tmp_path / "machine1", report=False, replace_results=True)
    record = json.loads(result_path(results, Unit(None, None, 0, "diff"), False).read_text())
    assert record["max_steps"] == record["last_step"] == record["identity"]["train"]["max_steps"] == 4


def test_the_manifest_describes_every_arm_as_the_config_defines_it_now(data_dir, tmp_path):
    """An arm's own recipe edited in the config reaches the manifest and the report's recipe line even when the
    invocation runs other arms only: the merged manifest takes the config's spec, not the one it held."""
    base = _study(data_dir, tmp_path / "results")
    run_study(base, tmp_path / "a", arms=["transformer"], report=False)
    edited = dataclasses.replace(base, compare=dataclasses.replace(
        base.compare, arms=[{"name": "diff", "attention": "diff", "train": {"max_steps": 3}}, "transformer"]))
    run_study(edited, tmp_path / "a", arms=["transformer"], report=False)
    manifest = json.loads((tmp_path / "results" / "compare.json").read_text())
    assert manifest["arm_specs"]["diff"]["train"] == {"max_steps": 3} and manifest["arms"] == ["transformer"]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_a_run_continues_toward_another_max_steps_only_where_its_schedule_stays_the_same(data_dir, tmp_path,
                                                                                         schedule):
    """A run folder left without its result file, asked for more steps: on a schedule shaped by max_steps the
    continued run would follow no recipe (its learning rate stretched mid-run), so it is refused before anything
    is written; on a constant schedule continuing is exact, and it equals a run trained straight through."""
    base = _study(data_dir, tmp_path / "results", arms=["diff"])

    def recipe(steps: int) -> Study:
        return dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=steps, lr_schedule=schedule))

    run_study(recipe(2), tmp_path / "a", report=False)
    for p in (tmp_path / "results").rglob("diff.json"):
        p.unlink()
    if schedule != "constant":
        with pytest.raises(StudyMismatchError, match=f"2-step {schedule} schedule and .* asks for 3 steps"):
            run_study(recipe(3), tmp_path / "a", report=False)
        assert json.loads((tmp_path / "a" / "diff" / "train_config.json").read_text())["max_steps"] == 2
        return
    run_study(recipe(3), tmp_path / "a", report=False)
    continued = json.loads(result_path(tmp_path / "results", Unit(None, None, 0, "diff"), False).read_text())
    straight_study = dataclasses.replace(recipe(3), compare=dataclasses.replace(
        base.compare, results_dir=str(tmp_path / "straight")))
    run_study(straight_study, tmp_path / "b", report=False)
    straight = json.loads(result_path(tmp_path / "straight", Unit(None, None, 0, "diff"), False).read_text())
    assert continued["last_step"] == straight["last_step"] == 3
    assert continued["final_val_loss"] == straight["final_val_loss"]


@pytest.mark.parametrize("edit, problem", [
    ({"evals": {"needle": {"metrics": {"acc": 10**400}}}}, r"evals.needle.metrics.acc is 1000000.*, not a number"),
    ({"samples": [5]}, "samples is not a list of {prompt, greedy, sampled} texts"),
    ({"samples": [{"prompt": 5, "greedy": "a", "sampled": "b"}]}, "samples is not a list of"),
    ({"train": [{"step": 1, "loss": 3.0, "tokens": 10, "lambdas": "x"}]}, "train is not a list of rows whose λ"),
])
def test_a_hand_edited_result_file_is_named_not_a_traceback(tmp_path, edit, problem):
    record = {**unit_record(Unit(None, None, 0, "diff"), 3.0, 1000), **edit}
    _write_results(tmp_path / "r", [record, unit_record(Unit(None, None, 0, "transformer"), 3.1, 1000)], [], [0])
    with pytest.raises(ResultFileError, match=r"diff.json is not a valid result file \(" + problem.replace("{", r"\{")):
        write_report(tmp_path / "r", samples=True)


def test_a_unit_kept_in_both_layouts_is_named_not_chosen(tmp_path):
    """<arm>.json and seed<s>/<arm>.json for the same unit: which one the report reads is never guessed; the error
    names both files and the fix. Either layout alone is read."""
    root = tmp_path / "r"
    records = [unit_record(Unit(None, None, s, a), 3.0 + 0.1 * s, 1000)
               for s in (0, 1) for a in ("diff", "transformer")]
    _write_results(root, records, [], [0, 1])
    assert len(find_results(root)) == 4  # the several-seed layout alone
    unit = Unit(None, None, 0, "diff")
    single, several = result_path(root, unit, False), result_path(root, unit, True)
    single.write_text(json.dumps({**records[0], "final_val_loss": 2.5}))
    both = re.escape(f"{single} and {several} both hold the result of seed 0, arm diff") + ".*delete the one"
    with pytest.raises(ResultFileError, match=both):
        find_results(root)
    with pytest.raises(ResultFileError, match=both):
        write_report(root, samples=False)
    several.unlink()  # the one-seed layout alone, for seed 0 (seed 1 stays in seed1/)
    found = find_results(root)
    assert len(found) == 4 and found[unit]["final_val_loss"] == 2.5


def test_a_result_replaced_after_the_layout_changed_stays_one_file(data_dir, tmp_path):
    """A one-seed study continued with two seeds and another training length (--replace-results): seed 0's
    result is replaced where it is (<arm>.json), not written beside it in the new layout (seed0/<arm>.json),
    which would leave two result files for one unit."""
    results = tmp_path / "committed"
    run_study(_study(data_dir, results), tmp_path / "machine1", report=False)
    base = _study(data_dir, results, seeds=[0, 1])
    longer = dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=3))
    run_study(longer, tmp_path / "machine2", replace_results=True)  # the report reads every result file
    for arm in ("diff", "transformer"):
        assert not result_path(results, Unit(None, None, 0, arm), True).exists()
        for unit, multi in ((Unit(None, None, 0, arm), False), (Unit(None, None, 1, arm), True)):
            assert json.loads(result_path(results, unit, multi).read_text())["identity"]["train"]["max_steps"] == 3


def test_studies_sharing_a_results_dir_keep_every_arm_and_one_writes_at_a_time(data_dir, tmp_path):
    """Study folders a and b write one results_dir: the manifest beside the result files keeps the arms of both
    whichever runs last, so the report of the result files lists every arm; while one study writes there,
    another is refused at once; temporaries that killed writes left among the result files are swept."""
    from difftransformer._io import FolderInUseError

    results = tmp_path / "shared"
    run_study(_study(data_dir, results), tmp_path / "a", report=False)
    run_study(_study(data_dir, results, arms=["diff_v2"]), tmp_path / "b", report=False)
    left = [results / "diff.json.0123abcd.tmp", results / "sub" / "x.json.89abcdef.tmp"]
    for p in left:
        p.parent.mkdir(exist_ok=True)
        p.write_text("half")
    run_study(_study(data_dir, results), tmp_path / "a", report=False)  # a again: nothing to train
    assert json.loads((results / "compare.json").read_text())["arms"] == ["diff", "transformer", "diff_v2"]
    assert "| `diff_v2` |" in write_report(results, samples=False).read_text()
    assert not any(p.exists() for p in left)
    with lock_held_by_another_process(results) as proc:
        with pytest.raises(FolderInUseError, match=f"pid {proc.pid}.*another compare.results_dir"):
            run_study(_study(data_dir, results), tmp_path / "c", report=False)



def _arms_study(data_dir: str, arms: list[str], **train) -> Study:
    """A one-size study of `arms` (train settings from `train`), results in the study folder."""
    prepared = PreparedData.load(data_dir)
    data = DataConfig(corpus=prepared.corpus, data_dir=data_dir, vocab_size=prepared.vocab_size)
    recipe = TrainConfig(seq_len=32, batch_size=4, max_steps=2, warmup_steps=1, eval_interval=2, eval_batches=1,
                         log_interval=1, ckpt_interval=2, progress=False, tensorboard=False, device="cpu", **train)
    # TrainConfig.data_dir keeps its default: run_study points it at the prepared folder
    return Study(tiny(vocab_size=prepared.vocab_size), recipe, data, StudyConfig(arms=arms, sample_tokens=2))


def test_the_api_reconciles_the_data_folder_and_continues_with_new_arms(data_dir, tmp_path):
    out = run_study(_arms_study(data_dir, ["diff", "transformer"]), tmp_path / "study", report=False)
    study = StudyDir(out)
    manifest = study.read_manifest()
    assert manifest["baseline"] == "transformer" and manifest["train"]["data_dir"] == data_dir
    for arm in ("diff", "transformer"):
        run = study.run_dir(arm, 0, multi_seed=False)
        assert run.is_finished(2) and run.read_json(run.done)["final_step"] == 2
    # a later call adds an arm: the baseline stays the transformer, the report covers all three
    run_study(_arms_study(data_dir, ["diff_v2"]), out)
    manifest = study.read_manifest()
    assert manifest["arms"] == ["diff_v2", "diff", "transformer"] and manifest["baseline"] == "transformer"
    assert "paired Δ vs transformer" in study.report.read_text()
    # another model in the same folder is refused; another backend of the same model is not another study
    with pytest.raises(StudyMismatchError, match="models differ"):
        run_study(dataclass_with_layers(_arms_study(data_dir, ["diff"]), 3), out, report=False)
    relaxed = _arms_study(data_dir, ["diff"])
    relaxed.model = relaxed.model.__class__(**{**relaxed.model.to_dict(), "attn_backend": "eager"})
    run_study(relaxed, out, report=False)


def dataclass_with_layers(study: Study, layers: int) -> Study:
    study.model = study.model.__class__(**{**study.model.to_dict(), "num_hidden_layers": layers})
    return study


def test_baseline_rule_and_the_backend_of_derived_arms():
    assert baseline_arm(["diff", "transformer", "diff_v2"]) == "transformer"
    assert baseline_arm(["diff", "diff_v2"]) == "diff_v2"
    spec = tiny(attn_backend="triton")
    arms = Study(spec, TrainConfig(), DataConfig(), StudyConfig(arms=["diff", "transformer"])).arm_configs(
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
    assert "baseline for differences is `diff`" in Path(write_report(root, samples=False)).read_text()


def test_results_and_manifests_recorded_before_a_model_field_existed_continue(data_dir, tmp_path, caplog):
    """A model field added later (position_encoding, ssmax_init_length) is read at its default in what was recorded
    before it existed: what the code built then. The study continues from its result files, training nothing,
    rather than refusing them as another experiment's."""
    results = tmp_path / "results"
    out = run_study(_study(data_dir, results), tmp_path / "study", report=False)
    for path in {Path(out) / "compare.json", *results.glob("*.json")}:
        record = json.loads(path.read_text())
        models = record["models"].values() if "models" in record else [record["identity"]["model"]]
        for model in models:
            assert model.pop("position_encoding") == "rope" and model.pop("ssmax_init_length") is None
        path.write_text(json.dumps(record))
    before = {p: p.stat().st_mtime_ns for p in results.glob("*.json") if p.name != "compare.json"}
    with caplog.at_level(logging.INFO, logger="difftransformer"):
        run_study(_study(data_dir, results), out, report=False)
    assert "training into" not in caplog.text
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_grid_narrowed_later_keeps_every_cell_and_the_baseline_follows_the_config(data_dir, tmp_path):
    """A token budget dropped from the config keeps its cell (its results are still the study's) and the report's
    headline is the largest budget; re-running one arm of a study without `transformer` keeps the config's last
    arm as the baseline (the sign of every difference)."""
    per_step = 4 * 32
    out = run_study(_study(data_dir, tokens=[3 * per_step, 4 * per_step], arms=["diff", "diff_v2"]),
                    tmp_path / "grid", report=False)
    narrowed = _study(data_dir, tokens=[3 * per_step], arms=["diff", "diff_v2"])
    run_study(narrowed, out, arms=["diff_v2"])
    manifest = StudyDir(out).read_manifest()
    assert manifest["tokens"] == [3 * per_step, 4 * per_step]
    assert manifest["cells"] == [[None, 3 * per_step], [None, 4 * per_step]]  # the cells run, none made up
    assert manifest["arms"] == ["diff", "diff_v2"] and manifest["baseline"] == "diff_v2"
    report = StudyDir(out).report.read_text()
    assert "the sections up to \"Scaling\" are for the largest one, 512 tokens" in report
    assert "## Scaling" in report and "`diff` vs `diff_v2`" in report.replace("**", "")


def test_finished_arms_are_evaluated_once_and_reported(data_dir, tmp_path, caplog):
    study = _arms_study(data_dir, ["diff", "transformer"])
    study.compare = StudyConfig(arms=["diff", "transformer"], sample_tokens=2,
                                eval_tasks=["heldout-loss", "long-context"])
    out = run_study(study, tmp_path / "study")
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
        run_study(study, out)
    assert caplog.text.count("result file exists; skipping") == 2 and "evaluated" not in caplog.text
    # without result files, the stored evaluations are reused: they belong to the same weights
    shutil.rmtree(folder.results)
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study, out)
    assert "evaluated" not in caplog.text and caplog.text.count("reused") == 4
    assert (folder.results / "diff.json").is_file() and (folder.results / "transformer.json").is_file()
    # a result file records this model's results of the study's tasks, not whatever else lies in its eval/ folder
    foreign = dict(records["diff"], task="needle")  # another model's result, of a task the study does not run
    (folder.run_dir("transformer", 0, multi_seed=False).evals / "needle.json").write_text(json.dumps(foreign))
    shutil.rmtree(folder.results)
    run_study(study, out)
    written = json.loads((folder.results / "transformer.json").read_text())["evals"]
    assert sorted(written) == ["heldout-loss", "long-context"]
    assert written["heldout-loss"]["metrics"]["loss"] == loss["transformer"]
    with pytest.raises(ValueError, match="compare.eval_tasks: unknown evaluation task 'neddle'"):
        StudyConfig(eval_tasks=["neddle"])


def test_the_names_before_study_still_import_for_one_release():
    from difftransformer import experiments

    assert experiments.CompareConfig is StudyConfig and experiments.run_compare is run_study
    assert "CompareConfig" not in experiments.__all__ and "run_compare" not in experiments.__all__


def test_an_arm_on_its_own_recipe_trains_to_it_is_recorded_and_named_in_the_report(data_dir, tmp_path):
    arms = ["transformer", "diff", {"name": "diff_long", "attention": "diff", "train": {"max_steps": 3, "lr": 5e-4}}]
    study = _study(data_dir, tmp_path / "results", arms=arms)
    out = run_study(study, tmp_path / "study")
    folder = StudyDir(out)
    long = json.loads((tmp_path / "results" / "diff_long.json").read_text())
    base = json.loads((tmp_path / "results" / "transformer.json").read_text())
    assert (long["max_steps"], long["last_step"], long["train_config"]["lr"]) == (3, 3, 5e-4)
    assert (base["max_steps"], base["last_step"], base["train_config"]["lr"]) == (2, 2, study.train.lr)
    assert folder.run_dir("diff_long", 0, multi_seed=False).last_step() == 3
    report = Path(write_report(tmp_path / "results", samples=False)).read_text()
    assert "Training (every arm but diff_long): 2 steps × 4 sequences × 32 tokens per step = 256 training" in report
    assert "Arms on their own recipe" in report and "diff_long: lr 0.0005, max_steps 3." in report
    assert "at the same size and recipe (but diff_long, trained on its own: see Training)" in report
    run_study(study, out)  # continues: both result files match their own recipes
    with pytest.raises(ValueError, match="sets its own train.max_steps, but compare.tokens"):
        run_study(_study(data_dir, arms=arms, tokens=[256]), tmp_path / "grid")


def test_a_study_refuses_other_validation_windows_or_an_arms_recipe_changed_after_it_trained(data_dir, tmp_path):
    """Every final loss a study compares is measured on the first eval_batches validation windows, and every seed of
    an arm trains on its one recipe: a continued study that changes either (for seeds it does not run now: an arm's
    own train changes against the results of its other seeds) is refused before anything trains, naming it; an arm
    that has no result yet may still change its table."""
    arms = ["transformer", {"name": "diff_lr", "attention": "diff", "train": {"lr": 5e-4}},
            {"name": "diff_later", "attention": "diff", "train": {"lr": 2e-3}}]
    out = run_study(_study(data_dir, arms=arms[:2]), tmp_path / "study", report=False)
    more_windows = _study(data_dir, arms=arms[:2])
    more_windows.train = dataclasses.replace(more_windows.train, eval_batches=2)
    with pytest.raises(StudyMismatchError, match=r"eval_batches: 1 before, 2 now.*same validation windows"):
        run_study(more_windows, out, seeds=[1], report=False)
    edited = [arms[0], {**arms[1], "train": {"lr": 1e-3}}, {**arms[2], "train": {"lr": 3e-3}}]
    with pytest.raises(ResultFileError, match=r"diff_lr\.json holds the result of another experiment \(train "
                                              r"differ: train\.lr: 0\.0005 before, 0\.001 now\)"):
        run_study(_study(data_dir, arms=edited), out, seeds=[1], report=False)
    longer = [arms[0], {**arms[1], "train": {"lr": 5e-4, "max_steps": 3}}, arms[2]]
    with pytest.raises(ResultFileError, match=r"another training length .* Seed 0 is not run by this command, so "
                                              r"diff_lr's seeds would pool two recipes"):
        run_study(_study(data_dir, arms=longer), out, seeds=[1], report=False)
    assert not (Path(out) / "seed1").exists()  # refused before anything trained
    run_study(_study(data_dir, arms=[arms[0], arms[1], edited[2]]), out, arms=["diff_later"], seeds=[1],
              report=False)  # an arm that has no result yet takes its new table


def test_units_evaluated_with_other_options_are_refused_then_evaluated_again_on_request(data_dir, tmp_path):
    study = _arms_study(data_dir, ["diff", "transformer"])
    study.compare = StudyConfig(arms=["diff", "transformer"], sample_tokens=2, eval_tasks=["long-context"],
                                eval_options={"long-context": {"documents": 2}})
    out = run_study(study, tmp_path / "study", report=False)
    folder = StudyDir(out)
    options = lambda arm: json.loads((folder.results / f"{arm}.json").read_text())[  # noqa: E731
        "evals"]["long-context"]["settings"]["options"]
    assert options("diff")["documents"] == 2
    before = (folder.results / "diff.json").read_text()
    study.compare = dataclasses.replace(study.compare, eval_options={"long-context": {"documents": 3}})
    with pytest.raises(StudyMismatchError, match=r"evaluated with other options \(long-context: documents: 2 before, "
                                                 r"3 now\).*--replace-results"):
        run_study(study, out, report=False)
    assert (folder.results / "diff.json").read_text() == before  # refused before anything was written
    record = json.loads(before)  # as if trained on another machine than this one
    (folder.results / "diff.json").write_text(json.dumps(record | {"hardware": {**record["hardware"], "cpu": "A"}}))
    run_study(study, out, report=False, replace_results=True)
    assert options("diff")["documents"] == options("transformer")["documents"] == 3
    hardware = json.loads((folder.results / "diff.json").read_text())["hardware"]
    assert hardware["cpu"] == "A"  # evaluated again here: the machine it trained on stays its record
    run_study(study, out, report=False)  # now consistent: continues without a word
    shutil.rmtree(folder.run_dir("diff", 0, multi_seed=False).final)  # no model left to evaluate again
    study.compare = dataclasses.replace(study.compare, eval_options={})
    with pytest.raises(StudyMismatchError, match="is not on this machine to be evaluated again"):
        run_study(study, out, report=False, replace_results=True)


def test_units_evaluated_by_an_older_task_version_are_evaluated_again_or_marked(data_dir, tmp_path, caplog,
                                                                               monkeypatch):
    """A metric fixed in a new task version reaches a study's stored results: a unit whose model is here is
    evaluated again; one whose model is gone keeps its numbers, and the report names them as an older version's."""
    from difftransformer.eval.tasks.heldout_loss import HeldOutLoss

    study = _arms_study(data_dir, ["diff", "transformer"])
    study.compare = StudyConfig(arms=["diff", "transformer"], sample_tokens=2, eval_tasks=["heldout-loss"])
    out = run_study(study, tmp_path / "study", report=False)
    folder = StudyDir(out)
    version = lambda arm: json.loads((folder.results / f"{arm}.json").read_text())[  # noqa: E731
        "evals"]["heldout-loss"]["settings"]["task_version"]
    assert version("diff") == version("transformer") == 1
    monkeypatch.setattr(HeldOutLoss, "version", 2)
    caplog.clear()
    with caplog.at_level("INFO", logger="difftransformer.experiments"):
        run_study(study, out, report=False)
    assert caplog.text.count("evaluating heldout-loss again: computed by an older version") == 2
    assert version("diff") == version("transformer") == 2
    shutil.rmtree(folder.run_dir("diff", 0, multi_seed=False).final)  # no model left to evaluate again
    monkeypatch.setattr(HeldOutLoss, "version", 3)
    caplog.clear()
    run_study(study, out)
    assert "diff: heldout-loss computed by an older version of the task (version 2, now 3)" in caplog.text
    assert version("diff") == 2 and version("transformer") == 3
    from difftransformer.experiments.evaluate import outdated_evaluations

    evals = json.loads((folder.results / "transformer.json").read_text())["evals"]
    monkeypatch.setattr(HeldOutLoss, "version", 2)  # an older checkout: version 3 is not "older", but newer
    assert outdated_evaluations(evals, ["heldout-loss"]) == {}
    assert outdated_evaluations(evals, ["heldout-loss"], newer=True) == {"heldout-loss": "version 3, here 2"}
    from difftransformer.experiments.report import write_report
    older_checkout = write_report(folder.path, samples=False).read_text()
    assert "**heldout-loss (version 3, here 2)** was computed by a newer version of the task than this package's " \
           "for 1 of 2 units (transformer seed 0): update the package" in older_checkout
    monkeypatch.setattr(HeldOutLoss, "version", 3)
    report = write_report(folder.path, samples=False).read_text()
    assert "**heldout-loss (version 2, now 3)** was computed by an older version of the task for 1 of 2 units " \
           "(diff seed 0)" in report


def test_a_report_from_run_folders_leaves_out_results_of_other_weights(data_dir, tmp_path, caplog):
    """Without result files, the report reads each run's eval/ folder: a result another model wrote there is
    not this run's."""
    study = _arms_study(data_dir, ["diff", "transformer"])
    study.compare = StudyConfig(arms=["diff", "transformer"], sample_tokens=2, eval_tasks=["heldout-loss"])
    out = run_study(study, tmp_path / "study", report=False)
    folder = StudyDir(out)
    diff_eval = folder.run_dir("diff", 0, multi_seed=False).evals
    theirs = json.loads((diff_eval / "heldout-loss.json").read_text())
    theirs["task"] = "long-context"  # the diff model's result, planted in the transformer's folder
    planted = folder.run_dir("transformer", 0, multi_seed=False).evals / "long-context.json"
    planted.write_text(json.dumps(theirs))
    shutil.rmtree(folder.results)
    run = Run.read("transformer", 0, folder.run_dir("transformer", 0, multi_seed=False))
    assert sorted(run.evals) == ["heldout-loss"] and "long-context.json was computed from other weights" in caplog.text
    weights = folder.run_dir("transformer", 0, multi_seed=False).final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a final model that does not load
    caplog.clear()
    assert Run.read("transformer", 0, folder.run_dir("transformer", 0, multi_seed=False)).evals == {}
    assert "does not load, so they cannot be told to be its" in caplog.text
    assert write_report(out, samples=False).is_file()  # the report is still written
    shutil.rmtree(folder.run_dir("transformer", 0, multi_seed=False).final)
    assert Run.read("transformer", 0, folder.run_dir("transformer", 0, multi_seed=False)).evals == {}


def test_no_resume_trains_again_but_never_over_a_result_of_another_recipe(data_dir, tmp_path):
    """--no-resume (resume=False) trains every unit again and writes its result file anew, replacing one of another
    max_steps; one of another model, recipe (an arm's own train changes) or data is refused before anything is
    written, as without the flag: never overwritten without a word."""
    def study(**train):
        return _study(data_dir, tmp_path / "results", arms=[{"name": "d", "attention": "diff", "train": train}])

    run_study(study(lr=1e-3), tmp_path / "study", report=False)
    path = tmp_path / "results" / "d.json"
    before = path.read_bytes()
    with pytest.raises(ResultFileError, match=r"d\.json holds the result of another experiment \(train differ: "
                                              r"train\.lr: 0\.001 before, 0\.0005 now\); use another "
                                              r"compare\.results_dir, or delete the file"):
        run_study(study(lr=5e-4), tmp_path / "study", report=False, resume=False)
    assert path.read_bytes() == before
    run_study(study(lr=1e-3, max_steps=3), tmp_path / "study", report=False, resume=False)
    record = json.loads(path.read_text())
    assert record["identity"]["train"]["max_steps"] == record["last_step"] == 3


def test_a_run_of_an_arms_earlier_recipe_is_never_written_up_under_its_new_one(data_dir, tmp_path):
    """A run folder trained with another recipe than its unit's (an arm's own train changes edited since) is
    refused, not continued or written up under the new recipe; without that run folder, the arm trains on its
    new recipe in the same study folder."""
    def study(**train):
        return _study(data_dir, tmp_path / "results", arms=["transformer", {"name": "d", "attention": "diff",
                                                                            "train": train}])

    out = run_study(study(lr=5e-4), tmp_path / "study", report=False)
    (tmp_path / "results" / "d.json").unlink()  # stopped after training, before its result file was written
    with pytest.raises(StudyMismatchError, match=r"was trained with another recipe than .*\(lr: 0.0005 before, "
                                                 r"0.0002 now\).*delete that run folder"):
        run_study(study(lr=2e-4), out, report=False)
    assert not (tmp_path / "results" / "d.json").exists()
    run_study(study(lr=5e-4), out, report=False)  # the same recipe continues
    assert json.loads((tmp_path / "results" / "d.json").read_text())["train_config"]["lr"] == 5e-4
    (tmp_path / "results" / "d.json").unlink()
    shutil.rmtree(out / "d")
    run_study(study(lr=2e-4), out, report=False)  # a failed arm retrained on a new recipe, same study folder
    assert json.loads((tmp_path / "results" / "d.json").read_text())["train_config"]["lr"] == 2e-4


def test_a_unit_trained_again_from_scratch_records_its_own_wall_time_only(data_dir, tmp_path):
    study = _arms_study(data_dir, ["diff", "transformer"])
    out = run_study(study, tmp_path / "study", report=False)
    folder = StudyDir(out)
    manifest = json.loads(folder.manifest.read_text())
    key = next(k for k in manifest["wall_s"] if k.endswith("diff"))
    manifest["wall_s"][key] = 1e6  # the time of a run that is then deleted
    folder.manifest.write_text(json.dumps(manifest))
    shutil.rmtree(folder.run_dir("diff", 0, multi_seed=False).path)
    (folder.results / "diff.json").unlink()
    run_study(study, out, report=False)
    assert json.loads(folder.manifest.read_text())["wall_s"][key] < 1e5  # its own time, not added to the old
    assert json.loads((folder.results / "diff.json").read_text())["wall_s"] < 1e5


def test_a_unit_whose_train_call_was_killed_records_the_training_its_run_kept(data_dir, tmp_path, monkeypatch):
    """A call killed before train() returned records nothing itself; the run's own clock (elapsed_s, carried from
    checkpoint to checkpoint into metrics.jsonl) still counts its training, so the unit's wall time is not the
    last call's alone."""
    import difftransformer.experiments.study as study_mod

    real, calls = study_mod.train, []

    def killed_once(config, cfg, **kw):
        result = real(config, cfg, **kw)
        if not calls:  # the steps are trained and checkpointed, then the process dies before train() returns
            calls.append(cfg.out_dir)
            with open(Path(cfg.out_dir) / "metrics.jsonl", "a") as f:  # as if those steps had taken 1,000 s
                f.write(json.dumps({"kind": "train", "step": 2, "loss": 5.0, "elapsed_s": 1000.0}) + "\n")
            (Path(cfg.out_dir) / "done.json").unlink()
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(study_mod, "train", killed_once)
    study = _arms_study(data_dir, ["diff"])
    with pytest.raises(KeyboardInterrupt):
        run_study(study, tmp_path / "study", report=False)
    out = run_study(study, tmp_path / "study", report=False)
    walls = json.loads(StudyDir(out).manifest.read_text())["wall_s"]
    assert list(walls.values()) == [1000.0]


def test_a_results_folder_reports_its_own_files_not_the_results_dir_its_manifest_names(tmp_path, monkeypatch):
    """A results folder copied elsewhere keeps its manifest's results_dir, a path relative to where the study
    ran; where a folder of that name exists (another version of the study in this checkout), the report must
    still read the copy's own result files."""
    here = [unit_record(Unit(None, None, s, a), 3.0 + 0.1 * s, 1000)
            for s in (0, 1, 2) for a in ("diff", "transformer")]
    _write_results(tmp_path / "copy", here, [], [0, 1, 2])
    _write_results(tmp_path / "results" / "study", here[:2], [], [0, 1, 2])  # the named folder: seed 0 only
    manifest = json.loads((tmp_path / "copy" / "compare.json").read_text())
    (tmp_path / "copy" / "compare.json").write_text(json.dumps({**manifest, "results_dir": "results/study"}))
    monkeypatch.chdir(tmp_path)
    assert StudyDir(tmp_path / "copy").results_dir(manifest | {"results_dir": "results/study"}) == tmp_path / "copy"
    text = write_report(tmp_path / "copy", samples=False).read_text()
    assert "| 2 | " in text and "missing" not in text.lower()  # seed 2 is reported: the copy's files were read
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "compare.json").write_text(json.dumps({**manifest, "results_dir": "copy"}))
    assert StudyDir(tmp_path / "runs").results_dir({"results_dir": "copy"}) == Path("copy")  # a study's own folder


def test_the_report_shows_every_result_file_even_of_arms_and_seeds_its_manifest_does_not_list(tmp_path):
    """Result files copied in from another machine or folder (the manifest lists diff and transformer, seeds 0-1):
    a third arm and a third seed are reported, new arms in the config's order (arm_specs)."""
    records = [unit_record(Unit(None, None, seed, arm), 3.0 + 0.01 * seed, 1000)
               for seed in (0, 1, 2) for arm in ("diff", "transformer", "transformer_6k", "diff_v2")]
    _write_results(tmp_path / "r", records, [], [0, 1])
    manifest_path = tmp_path / "r" / "compare.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["arm_specs"] = {a: {} for a in ("transformer", "diff", "transformer_6k", "diff_v2")}
    manifest_path.write_text(json.dumps(manifest))
    for seed in (0, 1, 2):  # the layout of a multi-seed folder
        for arm in ("diff", "transformer", "transformer_6k", "diff_v2"):
            assert result_path(tmp_path / "r", Unit(None, None, seed, arm), True).exists()
    text = write_report(tmp_path / "r", samples=False).read_text()
    rows = [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| `")]
    assert "`transformer_6k`" in rows and "`diff_v2`" in rows
    first = next(i for i, r in enumerate(rows) if r in ("`transformer_6k`", "`diff_v2`"))
    assert rows[first] == "`transformer_6k`"  # arm_specs order, not alphabetical
    assert "**transformer_6k vs transformer:** identical final validation loss on all 3 seeds" in text  # seed 2 too
    assert "| seed | `diff` | `transformer` | `transformer_6k` | `diff_v2` |" in text


def test_a_units_initial_weights_do_not_depend_on_the_arms_one_command_trains(data_dir, tmp_path, monkeypatch):
    """Paired initialisation copies shared tensors from the study's first arm (here `diff`) even when a command
    trains another arm alone (`--arms transformer`): the unit starts from the same weights either way."""
    import torch

    import difftransformer.experiments.study as study_module

    seen = {}

    def record_init(config, train_cfg, init_state=None, resume=True):
        seen[Path(train_cfg.out_dir).parent.name, config.attention] = init_state

    monkeypatch.setattr(study_module, "train", record_init)
    study = _study(data_dir)
    run_study(study, tmp_path / "both", report=False)
    run_study(study, tmp_path / "alone", arms=["transformer"], report=False)
    together, alone = seen["both", "transformer"], seen["alone", "transformer"]
    assert together.keys() == alone.keys()
    for name, tensor in together.items():
        assert torch.equal(tensor, alone[name]), name
    assert torch.equal(alone["embed_tokens.weight"], seen["both", "diff"]["embed_tokens.weight"])


def test_a_one_seed_study_continued_with_more_seeds_uses_the_first_seeds_run_where_it_is(data_dir, tmp_path):
    """A one-seed study whose unit trained into <arm>/ but has no result file yet (stopped before its evaluation),
    continued with two seeds: seed 0 continues in <arm>/, as its result file would be found there, and is not
    trained again from its start in seed0/<arm>/."""
    results, out = tmp_path / "committed", tmp_path / "machine"
    run_study(_study(data_dir, results), out, report=False)
    for arm in ("diff", "transformer"):
        result_path(results, Unit(None, None, 0, arm), False).unlink()  # as if stopped before its result file
    run_study(_study(data_dir, results, seeds=[0, 1]), out, report=False)
    assert not (out / "seed0").exists() and (out / "seed1" / "diff").is_dir()
    for arm in ("diff", "transformer"):
        assert read_result(result_path(results, Unit(None, None, 0, arm), True))["final_val_loss"] is not None
