"""The report's out-of-distribution section: tables read from the runs' ood results, verdicts that follow
their intervals, and the in-distribution bar."""

import dataclasses
from types import SimpleNamespace

import pytest

from difftransformer.experiments.report.ood_view import PLOT_FILE, _accuracy, _cells, _share, curves, ood_section
from difftransformer.experiments.report.runs import Run

MASSES = ("target", "distractor", "filler", "other")


def _layers(heads):
    """ood's per-layer masses of a softmax model: heads[layer][head] = (target, distractor, filler, other);
    "diff" and "a1" are the one map."""
    layers = []
    for per_head in heads:
        masses = {m: [h[j] for h in per_head] for j, m in enumerate(MASSES)}
        layers.append({"diff_mass": masses, "a1_mass": masses, "a2_mass": masses})
    return layers


def _diff_layers(positive, negative, measured_apart=True):
    """A DIFF model's layers: positive and negative parts per layer and head; the signed map is their sum."""
    layers = []
    for pos, neg in zip(positive, negative):
        parts = [{m: [h[j] for h in heads] for j, m in enumerate(MASSES)} for heads in (pos, neg)]
        signed = {m: [p + n for p, n in zip(parts[0][m], parts[1][m])] for m in MASSES}
        layer = {"diff_mass": signed, "a1_mass": parts[0], "a2_mass": parts[0]}
        if measured_apart:
            layer["diff_positive_mass"], layer["diff_negative_mass"] = parts
        layers.append(layer)
    return layers


def _cell(condition, length, density, accuracy, target):
    rest = (1 - target) / 3
    return {"condition": condition, "length": length, "density": density, "accuracy": accuracy,
            "adaptive": {"accuracy": accuracy},
            "attention": {"layers": _layers([[(rest, rest, rest, target), (target, rest, rest, rest)]])}}


def _ctx(values):
    """values[arm][seed] = (in-distribution accuracy, 4x-length accuracy)."""
    runs = {}
    for arm, per_seed in values.items():
        for seed, (acc1, acc4) in per_seed.items():
            cells = [_cell("length1x-density1x", 1.0, 1.0, acc1, 0.9),
                     _cell("length4x-density1x", 4.0, 1.0, acc4, 0.5)]
            runs[arm, seed] = Run(arm, seed, None, evals={"ood": {"details": {"cells": cells}}})
    return _study(list(values), [0, 1, 2], runs, recorded=True)


def _study(arms, seeds, runs, specs=None, recorded=False):
    """What ood_section reads of a report's Context: arms, seeds, runs and each arm's definition in the manifest
    (`spec`: by default the arm's name is its attention kind, as Context.spec says). `recorded`: a run given without
    a result file gets one that records a recipe common to every arm (a recipe nothing records is unknown, and never
    read as another's: test_report_recipes.py)."""
    specs = specs or {}
    for (_, seed), run in runs.items() if recorded else ():
        if run.record is None and run.dir is None:
            run.record = {"identity": {"train": {"max_steps": 4000, "lr": 1e-3, "seed": seed}}}
    return SimpleNamespace(arms=arms, seeds=seeds, runs=runs,
                           spec=lambda arm: specs.get(arm) or {"name": arm, "attention": arm})


def test_tables_differences_and_verdicts_follow_the_numbers(tmp_path):
    ctx = _ctx({"diff": {0: (1.0, 0.90), 1: (1.0, 0.92), 2: (0.999, 0.91)},
                "transformer": {0: (1.0, 0.60), 1: (0.995, 0.62), 2: (1.0, 0.61)},
                "transformer_ssmax": {0: (1.0, 0.80), 1: (1.0, 0.95), 2: (1.0, 0.99)}})
    text = "\n".join(ood_section(ctx, tmp_path))
    assert "## Out-of-distribution retrieval" in text and "Every arm and seed is at least 99%" in text
    assert "0.9100 [" in text  # diff's mean accuracy at 4x: (0.90 + 0.92 + 0.91) / 3
    assert "In short: in distribution `diff` 99.97%" in text and "at `length4x-density1x` `diff` 91.00%" in text
    assert "`diff`'s accuracy is higher than the Transformer's (paired Δ +0.300" in text
    rows = [line for line in text.splitlines() if line.startswith("| `transformer") and "length4x" in line]
    t_row = next(r for r in rows if r.startswith("| `transformer` |") and "+0.300" in r)
    assert "`diff` higher" in t_row  # +0.30 on every seed: the interval excludes 0
    ssmax = next(r for r in rows if r.startswith("| `transformer_ssmax` |") and "accuracy" not in r)
    assert "cannot separate" in ssmax  # -0.10 +- 0.08 over 3 seeds: the interval holds 0
    assert (tmp_path / PLOT_FILE).stat().st_size > 1000



def test_curves_along_length_and_density_are_the_means_over_seeds_with_their_t_intervals(tmp_path):
    """The plot's points: mean and 95% t-interval per factor along each axis, the training condition on both;
    one seed gives a point without spread, a factor no seed has is left out."""
    runs = {}
    for seed, (acc_len, acc_den) in enumerate([(0.90, 0.70), (0.92, 0.80), (0.91, 0.90)]):
        cells = [_cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length4x-density1x", 4.0, 1.0, acc_len, 0.5),
                 _cell("length1x-density1.5x", 1.0, 1.5, acc_den, 0.6)]
        runs["diff", seed] = Run("diff", seed, None, evals={"ood": {"details": {"cells": cells}}})
    runs["transformer", 0] = Run("transformer", 0, None, evals={"ood": {"details": {"cells": [
        _cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length4x-density1x", 4.0, 1.0, 0.4, 0.3)]}}})
    ctx = _study(["diff", "transformer"], [0, 1, 2], runs)
    cells = {a: _cells(ctx, a) for a in ctx.arms}
    conditions = ["length1x-density1x", "length4x-density1x", "length1x-density1.5x"]
    half = 4.302653 * 0.01 / 3 ** 0.5  # t(0.975, 2) * std / sqrt(3) of 0.90, 0.92, 0.91
    length = curves(ctx.arms, cells, conditions, "length", _accuracy)
    assert [p[0] for p in length["diff"]] == [1.0, 4.0] and length["diff"][0][1:] == (1.0, 1.0, 1.0)
    assert length["diff"][1][1:] == pytest.approx((0.91, 0.91 - half, 0.91 + half), abs=1e-6)
    assert length["transformer"] == [(1.0, 1.0, 1.0, 1.0), (4.0, 0.4, 0.4, 0.4)]  # one seed: no spread
    density = curves(ctx.arms, cells, conditions, "density", _accuracy)
    assert [p[:2] for p in density["diff"]] == [(1.0, 1.0), (1.5, pytest.approx(0.8))]
    assert [p[0] for p in density["transformer"]] == [1.0]  # no 1.5x result: left out
    target = curves(ctx.arms, cells, conditions, "length", _share("target"))
    assert target["diff"][1][1] == pytest.approx(0.5)  # the planted head's share on the target at 4x
    text = "\n".join(ood_section(ctx, tmp_path))
    assert "against the length and density factors" in text and (tmp_path / PLOT_FILE).stat().st_size > 1000


def test_means_over_different_seeds_say_how_many():
    """An arm with fewer seeds: its mean is over other seeds than the paired difference, and the text says so."""
    ctx = _ctx({"diff": {0: (1.0, 0.50), 1: (1.0, 0.90), 2: (1.0, 0.70)},
                "transformer": {0: (1.0, 0.45), 1: (1.0, 0.86)}})
    text = "\n".join(ood_section(ctx))
    assert "at `length4x-density1x` `diff` 70.00% (3 seeds), `transformer` 65.50% (2 seeds)" in text
    assert "Arms have different seeds so far (`diff` 3, `transformer` 2)" in text
    row = next(r for r in text.splitlines() if r.startswith("| `transformer` | `length4x-density1x` |"))
    assert "| 2 | +0.0450 [" in row  # paired over seeds 0 and 1 only
    one = "\n".join(ood_section(_ctx({"diff": {0: (1.0, 0.50)}, "transformer": {0: (1.0, 0.45), 1: (1.0, 0.86)}})))
    assert "`diff` 50.00% (1 seed), `transformer` 65.50% (2 seeds)" in one


def test_differences_of_one_error_in_ten_thousand_are_printed():
    ctx = _ctx({"diff": {0: (1.0, 0.9999), 1: (1.0, 0.9998), 2: (1.0, 0.9999)},
                "transformer": {0: (1.0, 0.9990), 1: (1.0, 0.9991), 2: (1.0, 0.9989)}})
    row = next(r for r in "\n".join(ood_section(ctx)).splitlines()
               if r.startswith("| `transformer` | `length4x-density1x` |"))
    # diffs 9, 7 and 10 e-4: 8.67e-4 +- t(0.975, 2) 4.303 * sd 1.53e-4 / sqrt(3)
    assert "+0.0009 [+0.0005, +0.0012]" in row and "`diff` higher" in row
    assert "not after Holm" not in row  # the only defined test of its family (p 0.010): nothing to adjust


def test_the_in_distribution_bar_is_at_least_99_percent():
    """9,900 right answers of 10,000 queries is exactly 0.99: past the bar; one fewer is below it."""
    from difftransformer.experiments.report.ood_view import TRAIN_CONDITION, _passed

    assert _passed({TRAIN_CONDITION: {"accuracy": 1 - 100 / 10_000}})
    assert not _passed({TRAIN_CONDITION: {"accuracy": 1 - 101 / 10_000}})
    assert not _passed({TRAIN_CONDITION: {"accuracy": float("nan")}}) and not _passed({})


def test_an_adjusted_p_of_exactly_the_level_is_not_a_separation_after_holm():
    """"After Holm" needs an adjusted p below 0.05; two tests of p 0.025 adjust to exactly 0.05 (and 1 - 0.95 is
    0.05000000000000004 in floating point, which must not let them through)."""
    from difftransformer.experiments.report.fmt import holm_separations
    from difftransformer.experiments.stats import Interval, PairedComparison

    def cmp(p):
        return PairedComparison("a", "b", "accuracy", False, (0, 1, 2), (0.4, 0.5, 0.6),
                                Interval(0.5, 0.1, 0.9, 3, 0.1, 0.95), t=8.66, p=p, wilcoxon_p=None)

    assert [s for _, s in holm_separations([cmp(0.025), cmp(0.025)])] == ["not after Holm"] * 2
    assert [s for _, s in holm_separations([cmp(0.05)])] == ["not after Holm"]
    assert [s for _, s in holm_separations([cmp(0.0249), cmp(0.0249)])] == ["after Holm"] * 2


def test_a_separation_among_several_tests_says_whether_it_survives_holm():
    """Two conditions, one family: at 4x the diffs 0.100, 0.050, 0.075 (t = 5.196, df 2: p = 1 - t / sqrt(t^2 + 2)
    = 0.0351) separate on their own, but Holm doubles the smallest p of two (0.070): the reading says so."""
    ctx = _ctx({"diff": {0: (1.0, 0.700), 1: (1.0, 0.650), 2: (1.0, 0.675)},
                "transformer": {0: (0.999, 0.600), 1: (1.0, 0.600), 2: (0.998, 0.600)}})
    row = next(r for r in "\n".join(ood_section(ctx)).splitlines()
               if r.startswith("| `transformer` | `length4x-density1x` |"))
    assert "| 0.035 | 0.070 | `diff` higher (not after Holm over 2) |" in row


def test_diff_is_compared_with_adaptive_temperature_controls_and_the_nope_arms_with_each_other():
    def run(arm, seed, acc, adaptive):
        cells = [{"condition": "length1x-density1x", "length": 1.0, "density": 1.0, "accuracy": 1.0,
                  "adaptive": {"accuracy": 1.0}},
                 {"condition": "length4x-density1x", "length": 4.0, "density": 1.0, "accuracy": acc,
                  "adaptive": {"accuracy": adaptive}}]
        return Run(arm, seed, None, evals={"ood": {"details": {"cells": cells}}})

    values = {"diff": (0.80, 0.70), "transformer": (0.60, 0.90), "diff_nope": (0.50, 0.50),
              "transformer_nope": (0.40, 0.40)}
    runs = {(a, s): run(a, s, acc + 0.01 * s * s, ad + 0.01 * s) for a, (acc, ad) in values.items() for s in (0, 1, 2)}
    text = "\n".join(ood_section(_study(list(values), [0, 1, 2], runs, specs=_NOPE_SPECS, recorded=True)))
    control = text[text.index("`diff` as trained against each arm with adaptive temperature"):]
    # diff as trained (0.80 + 0.01 s^2) against the transformer with adaptive temperature (0.90 + 0.01 s)
    row = next(r for r in control.splitlines() if r.startswith("| `transformer` | `length4x-density1x` |"))
    # diffs -0.10, -0.10, -0.08: -0.0933 +- 4.303 * 0.01155 / sqrt(3)
    assert "-0.0933 [-0.1220, -0.0646]" in row and "`diff` lower" in row
    nope = _section(text, "### `diff_nope` − each arm, accuracy, both without position encoding")
    row = next(r for r in nope.splitlines() if r.startswith("| `transformer_nope` | `length4x-density1x` |"))
    assert "| 3 | +0.1000 [+0.1000, +0.1000] |" in row
    assert "| `transformer` |" not in nope  # RoPE arms stay out of the position-encoding table


def _section(text, heading):
    """The report's lines from `heading` to the next heading."""
    part = text[text.index(heading):]
    end = part.find("\n#", 1)
    return part if end < 0 else part[:end]


_NOPE_SPECS = {"diff_nope": {"attention": "diff", "overrides": {"position_encoding": "none"}},
               "transformer_nope": {"attention": "transformer", "overrides": {"position_encoding": "none"}},
               "diff_no_headnorm_nope": {"attention": "diff_no_headnorm", "overrides": {"position_encoding": "none"}}}


def test_every_differential_arm_without_position_encoding_is_set_against_the_transformer_without_it():
    """Whatever its name: a task where DIFF V1 does not learn asks the question of DIFF without head norm. The
    differences are taken from the first differential arm with RoPE, never from a NoPE arm listed first."""
    values = {"diff_no_headnorm_nope": {0: (1.0, 0.50), 1: (1.0, 0.55), 2: (1.0, 0.60)},
              "transformer": {0: (1.0, 0.60), 1: (1.0, 0.60), 2: (1.0, 0.60)},
              "diff_no_headnorm": {0: (1.0, 0.70), 1: (1.0, 0.70), 2: (1.0, 0.70)},
              "transformer_nope": {0: (1.0, 0.40), 1: (1.0, 0.40), 2: (1.0, 0.40)}}
    ctx = _ctx(values)
    ctx.spec = lambda arm: _NOPE_SPECS.get(arm) or {"name": arm, "attention": arm}
    text = "\n".join(ood_section(ctx))
    assert "### `diff_no_headnorm` − each arm, accuracy\n" in text
    assert "### `diff_no_headnorm_nope` − each arm, accuracy (each arm" not in text
    nope = _section(text, "### `diff_no_headnorm_nope` − each arm, accuracy, both without position encoding")
    row = next(r for r in nope.splitlines() if r.startswith("| `transformer_nope` | `length4x-density1x` |"))
    assert "| 3 | +0.1500 [+0.0258, +0.2742] |" in row  # diffs 0.10, 0.15, 0.20: 0.15 +- 4.303 * 0.05 / sqrt(3)
    assert "| `transformer` |" not in nope

def _mechanism_table(text, title):
    part = text[text.index(f"**{title}"):]
    return {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in part.split("\n\n")[1 if part.split("\n\n")[1].startswith("|") else 2].splitlines()[2:]}


def test_the_retrieving_head_is_chosen_once_at_the_training_distribution_and_read_as_shares():
    """The head is the one with the largest share of its positive weight on the target at 1x, and every
    condition reads that head: at 4x another head holds up better (0.6 against 0.3), and the table must not
    switch to it. DIFF's rows sum to 1 - λ (0.5 here): shares divide by the positive weight; its negative
    weight is a share too. A DIFF model without the parts measured apart has no entry."""
    def run(arm, layers_1x, layers_4x):
        cells = [{"condition": "length1x-density1x", "length": 1.0, "density": 1.0, "accuracy": 1.0,
                  "attention": {"layers": layers_1x}},
                 {"condition": "length4x-density1x", "length": 4.0, "density": 1.0, "accuracy": 0.9,
                  "attention": {"layers": layers_4x}}]
        return Run(arm, 0, None, evals={"ood": {"details": {"cells": cells}}})

    t_1x = _layers([[(0.5, 0.2, 0.2, 0.1), (0.9, 0.05, 0.05, 0.0)]])
    t_4x = _layers([[(0.6, 0.2, 0.1, 0.1), (0.3, 0.4, 0.3, 0.0)]])
    zero = (0.0, 0.0, 0.0, 0.0)
    d_1x = _diff_layers([[(0.4, 0.05, 0.05, 0.0), (0.1, 0.1, 0.1, 0.2)]], [[(0.0, -0.1, 0.0, 0.0), zero]])
    d_4x = _diff_layers([[(0.2, 0.1, 0.1, 0.1), (0.4, 0.0, 0.0, 0.1)]], [[(0.0, -0.2, 0.0, 0.0), zero]])
    old = _diff_layers([[(0.4, 0.05, 0.05, 0.0)]], [[(0.0, -0.1, 0.0, 0.0)]], measured_apart=False)
    runs = {("transformer", 0): run("transformer", t_1x, t_4x), ("diff", 0): run("diff", d_1x, d_4x),
            ("diff_v2", 0): run("diff_v2", old, old)}
    text = "\n".join(ood_section(_study(["diff", "transformer", "diff_v2"], [0], runs)))
    target = _mechanism_table(text, "Share on the target")
    assert target["`transformer`"] == ["0.900", "0.300"]  # head 1 at 1x, still head 1 at 4x
    assert target["`diff`"] == ["0.800", "0.400"]  # head 0: 0.4 of 0.5 positive weight; at 4x 0.2 of 0.5
    assert target["`diff_v2`"] == ["–", "–"]
    noise = _mechanism_table(text, "Share on distractors + filler")
    assert noise["`transformer`"] == ["0.100", "0.700"] and noise["`diff`"] == ["0.200", "0.400"]
    negative = _mechanism_table(text, "Negative weight")
    assert negative["`diff`"] == ["0.200", "0.400"] and negative["`transformer`"] == ["0.000", "0.000"]


def test_runs_below_the_in_distribution_bar_are_listed_and_left_out_of_means_and_differences(tmp_path):
    ctx = _ctx({"diff": {0: (0.97, 0.1), 1: (1.0, 0.6), 2: (1.0, 0.62)},
                "transformer": {0: (1.0, 0.5), 1: (1.0, 0.5), 2: (1.0, 0.52)},
                "diff_v2": {0: (0.5, 0.2), 1: (0.6, 0.3), 2: (0.7, 0.4)}})
    text = "\n".join(ood_section(ctx, tmp_path))
    assert "Not every run passed the in-distribution bar" in text and "`diff` seed 0 (0.9700)" in text
    assert "| `diff` | 0 | 0.9700 | 0.1000 |" in text  # nothing lost: the run's own accuracy
    assert "| `diff_v2` | 2 | 0.7000 | 0.4000 |" in text and "`diff_v2` 0" not in text and "nan" not in text
    assert "In short: in distribution `diff` 100.00% (2 seeds), `transformer` 100.00% (3 seeds)" in text
    assert text.count("`diff_v2`") == 6  # an arm with no run past the bar is only listed: 3 names, 3 rows
    accuracy = text.split("### Accuracy")[1].split("###")[0]
    row = next(r for r in accuracy.splitlines() if r.startswith("| `diff` |"))
    assert row.split(" | ")[2].startswith("0.6100 [")  # seeds 1 and 2 only: (0.6 + 0.62) / 2, not 0.44
    differences = text.split("− each arm, accuracy")[1]
    diff4 = next(r for r in differences.splitlines() if "`length4x-density1x`" in r)
    assert "| 2 | +0.1000 " in diff4  # paired over the 2 seeds where both passed: 0.1 and 0.1
    got = curves(["diff"], {"diff": _cells(ctx, "diff")}, ["length1x-density1x", "length4x-density1x"],
                 "length", _accuracy)
    assert got["diff"][1][1] == pytest.approx((0.1 + 0.6 + 0.62) / 3)  # curves() itself takes the cells it is given


def test_no_ood_results_no_section():
    ctx = _study(["diff"], [0], {("diff", 0): Run("diff", 0, None)})
    assert ood_section(ctx) == []


def test_a_study_on_a_synthetic_task_trains_evaluates_with_its_options_and_reports(tmp_path):
    from difftransformer.data import DataConfig
    from difftransformer.experiments import Study, StudyConfig, StudyDir, run_study
    from difftransformer.experiments.units import find_results
    from difftransformer.train import TrainConfig
    from tests.helpers import tiny

    data = DataConfig(task={"family": "maxret", "min_items": 2, "max_items": 3, "min_context": 8, "max_context": 10},
                      data_dir=str(tmp_path / "data"))
    recipe = TrainConfig(seq_len=12, batch_size=4, max_steps=2, warmup_steps=1, eval_interval=2, eval_batches=1,
                         log_interval=1, ckpt_interval=2, progress=False, tensorboard=False, device="cpu")
    options = {"ood": {"lengths": [1, 2], "densities": [], "min_queries": 20, "attention_sequences": 2}}
    compare = StudyConfig(arms=["diff", "transformer"], seeds=[0, 1], sample_tokens=2, prompts=["k3 v1 max"],
                            eval_tasks=["ood"], eval_options=options)
    out = run_study(Study(tiny(vocab_size=120, max_position_embeddings=64), recipe, data, compare),
                      tmp_path / "study")
    study = StudyDir(out)
    records = find_results(study.results_dir())
    assert len(records) == 4
    # one process: a unit's result file is written before the next unit trains
    first = study.results_dir() / "seed0" / "diff.json"
    assert first.stat().st_mtime <= (out / "seed0" / "transformer" / "final" / "model.safetensors").stat().st_mtime
    for record in records.values():
        ood = record["evals"]["ood"]
        assert [c["condition"] for c in ood["details"]["cells"]] == ["length1x-density1x", "length2x-density1x"]
        assert ood["settings"]["options"]["min_queries"] == 20 and ood["settings"]["family"]["family"] == "maxret"
    text = StudyDir(out).report.read_text()
    assert "## Out-of-distribution retrieval" in text
    # two steps of training learn nothing: every run is listed below the bar, with its accuracy per condition,
    # and nothing else is said about them
    assert all(f"| `{arm}` | {seed} | " in text for arm in ("diff", "transformer") for seed in (0, 1))
    assert "In short" not in text and "### Accuracy" not in text
    # min_accuracy only skips work: the stored results scored every condition, so they serve it as they are ...
    strict = dataclasses.replace(compare, eval_options={"ood": {**options["ood"], "min_accuracy": 0.99}})
    run_study(Study(tiny(vocab_size=120, max_position_embeddings=64), recipe, data, strict), tmp_path / "study")
    assert find_results(study.results_dir()) == records
    # ... and a new study with it scores the training condition alone of models below it
    cut = StudyDir(run_study(Study(tiny(vocab_size=120, max_position_embeddings=64), recipe, data, strict),
                             tmp_path / "strict"))
    for record in find_results(cut.results_dir()).values():
        ood = record["evals"]["ood"]
        assert [c["condition"] for c in ood["details"]["cells"]] == ["length1x-density1x"]
        assert [s["cause"] for s in ood["details"]["skipped"]] == ["min_accuracy"]
    assert "– where a condition was not scored" in cut.report.read_text()
    with pytest.raises(ValueError, match="not in compare.eval_tasks.*--set compare.eval_options=null"):
        StudyConfig(eval_options={"ood": {}})
    assert StudyConfig(eval_options=None).eval_options == {}  # a study's options dropped: training only
    with pytest.raises(ValueError, match="compare.eval_options.ood: .*min_queries"):
        StudyConfig(eval_tasks=["ood"], eval_options={"ood": {"min_queries": 0}})


def test_a_condition_only_runs_below_the_bar_have_is_listed_with_them_and_nowhere_else():
    ctx = _ctx({"diff": {0: (1.0, 0.6), 1: (1.0, 0.6), 2: (1.0, 0.62)},
                "transformer": {0: (1.0, 0.5), 1: (1.0, 0.5), 2: (1.0, 0.52)}})
    low = Run("diff_v2", 0, None, evals={"ood": {"details": {"cells": [
        _cell("length1x-density1x", 1.0, 1.0, 0.5, 0.9), _cell("length16x-density1x", 16.0, 1.0, 0.1, 0.2)]}}})
    nan = Run("diff_v2", 1, None, evals={"ood": {"details": {"cells": [
        _cell("length1x-density1x", 1.0, 1.0, float("nan"), 0.9)]}}})
    ctx.arms.append("diff_v2")
    ctx.runs["diff_v2", 0], ctx.runs["diff_v2", 1] = low, nan
    text = "\n".join(ood_section(ctx))
    assert "| `diff_v2` | 0 | 0.5000 | – | 0.1000 |" in text and "nan" not in text
    assert text.count("length16x-density1x") == 1  # the listed run's column only
    assert "at `length4x-density1x` `diff` 60.67%, `transformer` 50.67%." in text


def _with_recipes(ctx, recipes):
    """Give each arm's runs the identity a result file records: recipes[arm] = (attention kind, max_steps)."""
    for (arm, seed), run in ctx.runs.items():
        attention, max_steps = recipes[arm]
        run.record = {"identity": {"model": {"attention": attention, "position_encoding": "rope"},
                                   "train": {"max_steps": max_steps, "lr": 1e-3, "seed": seed}}}


def test_diff_is_set_against_the_transformer_on_its_own_recipe():
    """DIFF trained 6,000 steps: the headline pairs it with the Transformer on 6,000 steps, not the 2,000-step one,
    and each difference with an arm on other settings says so."""
    ctx = _ctx({"diff": {0: (1.0, 0.70), 1: (1.0, 0.72), 2: (1.0, 0.71)},
                "transformer": {0: (1.0, 0.40), 1: (1.0, 0.42), 2: (1.0, 0.41)},
                "transformer_6k": {0: (1.0, 0.69), 1: (1.0, 0.73), 2: (1.0, 0.70)}})
    _with_recipes(ctx, {"diff": ("diff", 6000), "transformer": ("transformer", 2000),
                        "transformer_6k": ("transformer", 6000)})
    text = "\n".join(ood_section(ctx))
    assert "`diff`'s accuracy is not separable from the Transformer's on the same recipe (`transformer_6k`)" in text
    assert "| `transformer` (other recipe) | `length4x-density1x` |" in text
    assert "| `transformer_6k` | `length4x-density1x` |" in text


def test_without_a_diff_run_past_the_bar_the_differences_come_from_another_differential_arm():
    ctx = _ctx({"transformer": {0: (1.0, 0.40), 1: (1.0, 0.42), 2: (1.0, 0.41)},
                "diff": {0: (0.30, 0.10), 1: (0.29, 0.10), 2: (0.31, 0.10)},
                "diff_no_headnorm": {0: (1.0, 0.90), 1: (1.0, 0.80), 2: (1.0, 0.85)}})
    _with_recipes(ctx, {arm: (arm, 4000) for arm in ("transformer", "diff", "diff_no_headnorm")})
    text = "\n".join(ood_section(ctx))
    assert "### `diff_no_headnorm` − each arm, accuracy" in text
    assert "`diff_no_headnorm`'s accuracy is higher than the Transformer's (paired Δ +0.4400" in text


def test_the_same_difference_on_every_seed_is_not_read_as_a_tested_separation():
    """One error more in 10,000 on every seed: the interval has zero width and no test exists; the reading says so."""
    ctx = _ctx({"diff": {s: (1.0, 1.0) for s in range(3)}, "transformer": {s: (1.0, 0.9999) for s in range(3)}})
    row = next(r for r in "\n".join(ood_section(ctx)).splitlines()
               if r.startswith("| `transformer` | `length4x-density1x` |"))
    assert row.endswith("`diff` higher (the same difference on every seed: a zero-width interval, no test) |")


def test_skipped_conditions_are_listed_with_their_runs_and_reason():
    ctx = _ctx({"diff": {s: (1.0, 0.9) for s in range(3)}, "transformer": {s: (1.0, 0.8) for s in range(3)}})
    ctx.runs["diff", 1].evals["ood"]["details"]["skipped"] = [
        {"condition": "length32x-density1x", "reason": "2048 tokens exceed the model's 1024 positions"}]
    text = "\n".join(ood_section(ctx))
    assert ("**Skipped conditions** (not in the tables below): `length32x-density1x` for `diff` seed 1 (2048 tokens "
            "exceed the model's 1024 positions).") in text


def test_an_arm_whose_seeds_trained_on_different_recipes_is_never_read_as_recipe_matched():
    """Seed 2 of transformer_6k on 2,000 steps: its recipe is not DIFF's, whichever seed's file is read first."""
    ctx = _ctx({"diff": {s: (1.0, 0.7) for s in range(3)}, "transformer_6k": {s: (1.0, 0.6) for s in range(3)}})
    _with_recipes(ctx, {"diff": ("diff", 6000), "transformer_6k": ("transformer", 6000)})
    ctx.runs["transformer_6k", 2].record["identity"]["train"]["max_steps"] = 2000
    text = "\n".join(ood_section(ctx))
    assert "| `transformer_6k` (other recipe) | `length4x-density1x` |" in text


def test_errors_are_pooled_over_the_seeds_past_the_bar_with_their_wilson_interval():
    """3 + 1 errors in 2 x 10,000 queries (the run below the bar left out): 4/20,000, rate 2e-4, Wilson 95%
    [7.8e-5, 5.1e-4] (by hand: centre (p + z²/2n)/(1 + z²/n), half-width z·sqrt(p(1-p)/n + z²/4n²)/(1 + z²/n))."""
    ctx = _ctx({"diff": {0: (1.0, 0.9), 1: (1.0, 0.9), 2: (0.5, 0.1)}})
    for seed, errors in ((0, 3), (1, 1), (2, 5000)):
        for cell in ctx.runs["diff", seed].evals["ood"]["details"]["cells"]:
            cell.update(errors=errors, queries=10_000)
    text = "\n".join(ood_section(ctx))
    row = next(r for r in text.split("### Errors, pooled over seeds")[1].splitlines() if r.startswith("| `diff`"))
    assert row == "| `diff` | 4/20,000: 0.00020 [0.00008, 0.00051] | 4/20,000: 0.00020 [0.00008, 0.00051] |"
    del ctx.runs["diff", 1].evals["ood"]["details"]["cells"][1]["errors"]  # seed 1 without counts at 4x
    zero = "\n".join(ood_section(ctx)).split("### Errors, pooled over seeds")[1]
    assert "| 3/10,000: 0.00030 [0.00010, 0.00088] (1 of 2 seeds) |" in zero
    ctx.runs["diff", 0].evals["ood"]["details"]["cells"][0]["errors"] = 0
    ctx.runs["diff", 1].evals["ood"]["details"]["cells"][0]["errors"] = 0
    assert "| `diff` | 0/20,000: 0.00000 [0.00000, 0.00019] |" in "\n".join(ood_section(ctx))


def test_a_run_without_error_counts_leaves_the_errors_table_out():
    ctx = _ctx({"diff": {s: (1.0, 0.9) for s in range(3)}})
    assert "### Errors" not in "\n".join(ood_section(ctx))


def test_every_differential_arm_is_set_against_the_arms_with_one_softmax_map():
    ctx = _ctx({"diff": {s: (1.0, 0.70 + s / 100) for s in range(3)},
                "diff_v2": {s: (1.0, 0.90 + s / 100) for s in range(3)},
                "transformer": {s: (1.0, 0.40 + s / 50) for s in range(3)}})
    text = "\n".join(ood_section(ctx))
    v2 = text.split("### `diff_v2` − each arm, accuracy (each arm with a single softmax map)")[1].split("###")[0]
    rows = [r for r in v2.splitlines() if r.startswith("| `")]
    assert [r.split(" | ")[0] for r in rows] == ["| `transformer`"] * 2  # not `diff`: both subtract
    assert "| `transformer` | `length4x-density1x` | 3 | +0.4900 [" in v2  # 0.91 - 0.42 by hand, the seeds' mean


def test_an_arm_is_differential_by_its_attention_kind_not_its_name():
    """`diffuse`, a Transformer by its recorded kind, gets no table of its own; `v2`, DIFF V2 by its kind, does."""
    ctx = _ctx({"diff": {s: (1.0, 0.7) for s in range(3)}, "diffuse": {s: (1.0, 0.5) for s in range(3)},
                "v2": {s: (1.0, 0.8) for s in range(3)}})
    _with_recipes(ctx, {"diff": ("diff", 4000), "diffuse": ("transformer", 4000), "v2": ("diff_v2", 4000)})
    text = "\n".join(ood_section(ctx))
    assert "### `v2` − each arm, accuracy (each arm with a single softmax map)" in text
    assert "### `diffuse` − each arm" not in text
    for run in ctx.runs.values():  # runs read from folders record no identity: the manifest's arm definition
        run.record = None
    ctx.spec = lambda arm: {"name": arm, "attention": {"diffuse": "transformer", "v2": "diff_v2"}.get(arm, arm)}
    folders = "\n".join(ood_section(ctx))
    assert "### `v2` − each arm, accuracy (each arm with a single softmax map)" in folders
    assert "### `diffuse` − each arm" not in folders


def test_each_differential_arm_shows_its_retrieving_heads_two_maps_per_seed():
    """A1 and A2 of the head chosen at 1x, read at every reported condition (the farthest length here), each map's
    mass on target / distractors / filler as stored; the other head's maps never appear, and an arm with one
    softmax map has no such table."""
    def masses(per_head):
        return {m: [h[j] for h in per_head] for j, m in enumerate(MASSES)}

    def layer(a1, a2, retrieving):
        positive = masses([(0.1, 0.1, 0.1, 0.2), (0.4, 0.05, 0.05, 0.0)] if retrieving == 1 else
                          [(0.4, 0.05, 0.05, 0.0), (0.1, 0.1, 0.1, 0.2)])
        negative = masses([(0.0, 0.0, 0.0, 0.0)] * 2)
        return {"diff_mass": positive, "diff_positive_mass": positive, "diff_negative_mass": negative,
                "a1_mass": masses(a1), "a2_mass": masses(a2)}

    decoy = (0.11, 0.22, 0.33, 0.34)
    at_1x = layer([decoy, (0.97, 0.02, 0.01, 0.0)], [decoy, (0.05, 0.25, 0.66, 0.04)], retrieving=1)
    at_16x = layer([decoy, (0.44, 0.17, 0.39, 0.0)], [decoy, (0.0, 0.04, 0.96, 0.0)], retrieving=0)  # decoy wins here
    cells = [{"condition": "length1x-density1x", "length": 1.0, "density": 1.0, "accuracy": 0.999,
              "attention": {"layers": [at_1x]}},
             {"condition": "length16x-density1x", "length": 16.0, "density": 1.0, "accuracy": 0.45,
              "attention": {"layers": [at_16x]}}]
    runs = {("diff_v2", 3): Run("diff_v2", 3, None, evals={"ood": {"details": {"cells": cells}}}),
            ("transformer", 3): Run("transformer", 3, None, evals={"ood": {"details": {"cells": [
                _cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length16x-density1x", 16.0, 1.0, 0.5, 0.5)]}}})}
    text = "\n".join(ood_section(_study(["transformer", "diff_v2"], [3], runs)))
    part = text[text.index("**`diff_v2`: the retrieving head's two maps, per seed**"):]
    rows = [r for r in part.splitlines() if r.startswith("| 3 |")]
    head = "layer 0, head 1"
    assert rows == [f"| 3 | `length1x-density1x` | 0.9990 | {head} | 0.97 / 0.02 / 0.01 | 0.05 / 0.25 / 0.66 |",
                    f"| 3 | `length16x-density1x` | 0.4500 | {head} | 0.44 / 0.17 / 0.39 | 0.00 / 0.04 / 0.96 |"]
    assert "**`transformer`: the retrieving head's two maps" not in text and "0.11 / 0.22" not in text


def test_conditions_left_unscored_below_min_accuracy_are_dashes_below_the_bar_and_listed_above_it():
    """A run cut by the evaluation's min_accuracy has only its training condition: below the bar its other
    conditions read as dashes in its own table; a run past the bar but cut (a min_accuracy above the bar) is
    never missing silently: its skipped conditions are listed."""
    ctx = _ctx({"diff": {s: (1.0, 0.9) for s in range(3)}, "transformer": {s: (1.0, 0.8) for s in range(3)}})
    cut = "accuracy 0.5000 at the training condition is below min_accuracy 0.99: the model has not learned the task"
    for seed, accuracy in ((0, 0.5), (1, 0.992)):
        details = ctx.runs["diff", seed].evals["ood"]["details"]
        details["cells"] = details["cells"][:1]
        details["cells"][0]["accuracy"] = accuracy
        details["skipped"] = [{"condition": "length4x-density1x", "cause": "min_accuracy", "reason": cut}]
    text = "\n".join(ood_section(ctx))
    assert "| `diff` | 0 | 0.5000 | – |" in text and "– where a condition was not scored" in text
    skipped = next(line for line in text.splitlines() if line.startswith("**Skipped conditions**"))
    assert "`length4x-density1x` for `diff` seed 1 (accuracy 0.5000" in skipped and "seed 0" not in skipped


def test_each_control_is_set_against_the_transformer_on_its_own_recipe():
    """The gated control on a recipe of its own is read against the Transformer on that recipe, not the other one;
    the plain Transformers get no such table."""
    ctx = _ctx({"diff": {s: (1.0, 0.70) for s in range(3)},
                "transformer": {s: (1.0, 0.40 + s / 100) for s in range(3)},
                "transformer_gated": {s: (1.0, 0.50 + s / 50) for s in range(3)},
                "transformer_lr": {s: (1.0, 0.45) for s in range(3)}})
    _with_recipes(ctx, {"diff": ("diff", 2000), "transformer": ("transformer", 2000),
                        "transformer_gated": ("transformer_gated", 6000), "transformer_lr": ("transformer", 6000)})
    text = "\n".join(ood_section(ctx))
    gated = text.split("### `transformer_gated` − each arm, accuracy (a control against the Transformer")[1]
    rows = [r for r in gated.split("###")[0].splitlines() if r.startswith("| `")]
    assert [r.split(" | ")[0] for r in rows] == ["| `transformer_lr`"] * 2
    assert "| `transformer_lr` | `length4x-density1x` | 3 | +0.0700 [" in gated  # 0.52 - 0.45: the seeds' mean
    assert "### `transformer_lr` − each arm, accuracy (a control" not in text
    assert "### `transformer` − each arm" not in text
    del ctx.runs["transformer_lr", 0], ctx.runs["transformer_lr", 1], ctx.runs["transformer_lr", 2]
    ctx.arms.remove("transformer_lr")  # no Transformer on the control's recipe: no table against another recipe's
    assert "a control against the Transformer" not in "\n".join(ood_section(ctx))


def test_the_position_encoding_is_read_from_the_result_files_before_the_manifest():
    """Result files record each unit's model: a NoPE record makes an arm NoPE whatever the manifest says (and a
    RoPE record keeps an arm out of the position-encoding table even if the manifest says otherwise)."""
    def run(arm, seed, acc4, attention, encoding):
        cells = [_cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length4x-density1x", 4.0, 1.0, acc4, 0.5)]
        record = {"identity": {"model": {"attention": attention, "position_encoding": encoding}, "train": {"lr": 5e-4}}}
        return Run(arm, seed, None, evals={"ood": {"details": {"cells": cells}}}, record=record)

    arms = {"diff": ("diff", "rope", 0.7), "transformer": ("transformer", "rope", 0.6),
            "d_plain": ("diff", "none", 0.5), "t_plain": ("transformer", "none", 0.3),
            "d_listed": ("diff", "rope", 0.9)}
    runs = {(a, s): run(a, s, acc + 0.01 * s, kind, enc) for a, (kind, enc, acc) in arms.items() for s in (0, 1, 2)}
    wrong = {"d_listed": {"attention": "diff", "overrides": {"position_encoding": "none"}}}
    text = "\n".join(ood_section(_study(list(arms), [0, 1, 2], runs, specs=wrong)))
    nope = _section(text, "### `d_plain` − each arm, accuracy, both without position encoding")
    row = next(r for r in nope.splitlines() if r.startswith("| `t_plain` | `length4x-density1x` |"))
    assert "| 3 | +0.2000 [+0.2000, +0.2000] |" in row
    assert "### `d_listed` − each arm, accuracy, both without position encoding" not in text
    assert "### `d_listed` − each arm, accuracy (each arm with a single softmax map)" in text


def test_each_arm_on_another_recipe_is_set_against_the_same_architecture_on_the_first():
    """What the recipe alone does: each arm against the arm named after its attention kind, of the same position
    encoding, when their recorded recipes differ (in any order of the arms); never across kinds, across position
    encodings, or between arms on one recipe."""
    def run(arm, seed, acc4, attention, encoding, lr):
        cells = [_cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length4x-density1x", 4.0, 1.0, acc4, 0.5)]
        record = {"identity": {"model": {"attention": attention, "position_encoding": encoding},
                               "train": {"lr": lr, "seed": seed}}}
        return Run(arm, seed, None, evals={"ood": {"details": {"cells": cells}}}, record=record)

    arms = {"diff": ("diff", "rope", 1e-3, 0.60), "transformer": ("transformer", "rope", 1e-3, 0.40),
            "transformer_lr": ("transformer", "rope", 5e-4, 0.70), "diff_lr": ("diff", "rope", 5e-4, 0.50),
            "transformer_again": ("transformer", "rope", 1e-3, 0.45),
            "transformer_nope": ("transformer", "none", 5e-4, 0.20)}
    runs = {(a, s): run(a, s, acc + 0.01 * s * (a == "transformer_lr"), kind, enc, lr)
            for a, (kind, enc, lr, acc) in arms.items() for s in (0, 1, 2)}
    order = ["transformer_lr", "diff_lr", "diff", "transformer_again", "transformer", "transformer_nope"]
    text = "\n".join(ood_section(_study(order, [0, 1, 2], runs)))
    what = "accuracy (the same architecture on another recipe: what the recipe alone does)"
    lift = _section(text, f"### `transformer_lr` − each arm, {what}")
    rows = [r for r in lift.splitlines() if r.startswith("| `")]
    assert [r.split(" | ")[:2] for r in rows] == [["| `transformer`", "`length1x-density1x`"],
                                                  ["| `transformer`", "`length4x-density1x`"]]
    assert "mixes recipe and architecture" not in lift  # one architecture: the recipe is all that differs
    assert "| 3 | +0.3100 [" in rows[1]  # 0.70 + 0.01 s - 0.40 over seeds 0-2: +0.31 on average
    diff = _section(text, f"### `diff_lr` − each arm, {what}")
    assert "| `diff` | `length4x-density1x` | 3 | -0.1000 [-0.1000, -0.1000] |" in diff
    assert text.count(what) == 2  # not transformer_again (the same recipe), not the NoPE Transformer (no RoPE)


def test_each_nope_arm_is_set_against_its_architecture_with_rope_on_the_same_training_settings():
    """What position encoding alone does: the NoPE Transformer against the RoPE Transformer trained on the same
    settings (not the one on other settings); a NoPE arm with no such partner (DIFF here) gets no table."""
    def run(arm, seed, acc4, attention, encoding, lr, steps):
        cells = [_cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length4x-density1x", 4.0, 1.0, acc4, 0.5)]
        record = {"identity": {"model": {"attention": attention, "position_encoding": encoding},
                               "train": {"lr": lr, "max_steps": steps, "seed": seed}}}
        return Run(arm, seed, None, evals={"ood": {"details": {"cells": cells}}}, record=record)

    arms = {"transformer": ("transformer", "rope", 1e-3, 4000, 0.40),
            "transformer_12k": ("transformer", "rope", 5e-4, 12000, 0.60),
            "transformer_nope": ("transformer", "none", 5e-4, 12000, 0.90),
            "diff_nope": ("diff", "none", 5e-4, 12000, 0.80)}
    runs = {(a, s): run(a, s, acc + 0.01 * s * (a == "transformer_nope"), kind, enc, lr, steps)
            for a, (kind, enc, lr, steps, acc) in arms.items() for s in (0, 1, 2)}
    text = "\n".join(ood_section(_study(list(arms), [0, 1, 2], runs)))
    what = "accuracy (the same architecture and training settings with RoPE: what position encoding alone does)"
    table_ = _section(text, f"### `transformer_nope` − each arm, {what}")
    rows = [r for r in table_.splitlines() if r.startswith("| `")]
    assert [r.split(" | ")[0] for r in rows] == ["| `transformer_12k`"] * 2
    assert "| 3 | +0.3100 [" in rows[1]  # 0.90 + 0.01 s - 0.60 over seeds 0-2
    assert text.count(what) == 1  # diff_nope has no RoPE DIFF on its settings
    assert _glance_rows(text)["`transformer_nope` − `transformer_12k` (position encoding alone)"][0] == "3"


def test_an_arm_whose_architecture_fails_on_the_first_recipe_says_the_recipe_is_not_measured():
    """DIFF below the bar on every seed of lr 1e-3 and past it on lr 5e-4: no table, and a line that says why,
    rather than silence or a difference against another architecture."""
    ctx = _ctx({"diff": {s: (0.30, 0.10) for s in range(3)}, "diff_lr": {s: (1.0, 0.50) for s in range(3)},
                "transformer": {s: (1.0, 0.40) for s in range(3)}})
    _with_recipes(ctx, {"diff": ("diff", 4000), "diff_lr": ("diff", 4000), "transformer": ("transformer", 4000)})
    for seed in range(3):
        ctx.runs["diff_lr", seed].record["identity"]["train"]["lr"] = 5e-4
    text = "\n".join(ood_section(ctx))
    assert "what the recipe alone does)" not in text
    assert ("What the recipe alone does to `diff_lr` is not measured: it and `diff`, the same architecture on the "
            "other recipe, passed the in-distribution bar on no common seed.") in text
    assert "to `transformer`" not in text and "to `diff`" not in text


def _glance_rows(text):
    """The verdicts-at-a-glance table: {comparison: [seeds, after Holm, before Holm only, at the farthest length]}."""
    rows = [r for r in _section(text, "### Verdicts at a glance").splitlines() if r.startswith("| `")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in r.split("|")[1:-1]] for r in rows)}


def test_the_glance_table_has_one_row_per_comparison_on_a_common_recipe():
    """DIFF on 6,000 steps against the Transformer on them (diffs +0.01, -0.01, +0.01 at 4x: no separation) and the
    recipe alone (transformer_6k − transformer: +0.29, +0.31, +0.29, t = 44.5 on 2 df, the only test of its family);
    DIFF against the 2,000-step Transformer mixes recipe and architecture, so it has no row."""
    ctx = _ctx({"diff": {0: (1.0, 0.70), 1: (1.0, 0.72), 2: (1.0, 0.71)},
                "transformer": {0: (1.0, 0.40), 1: (1.0, 0.42), 2: (1.0, 0.41)},
                "transformer_6k": {0: (1.0, 0.69), 1: (1.0, 0.73), 2: (1.0, 0.70)}})
    _with_recipes(ctx, {"diff": ("diff", 6000), "transformer": ("transformer", 2000),
                        "transformer_6k": ("transformer", 6000)})
    rows = _glance_rows("\n".join(ood_section(ctx)))
    # 0.2967 +- t(0.975, 2) 4.303 * sd 0.01155 / sqrt(3)
    assert rows["`transformer_6k` − `transformer` (the recipe alone)"] == [
        "3", "higher at 4x length (+0.297)", "none", "4x length: +0.297 [+0.268, +0.325]"]
    assert rows["`diff` − `transformer_6k`"][:3] == ["3", "none", "none"]
    assert set(rows) == {"`diff` − `transformer_6k`", "`diff` − `transformer_6k` (both with adaptive temperature)",
                         "`diff` − `transformer_6k` (the other with adaptive temperature)",
                         "`transformer_6k` − `transformer` (the recipe alone)"}


def test_the_glance_table_tells_a_separation_before_holm_and_one_without_a_test_from_one_after_it():
    """The family of test_a_separation_among_several_tests_says_whether_it_survives_holm (p 0.035, Holm 0.070), and
    one error more in 10,000 on every seed (a zero-width interval: no test)."""
    ctx = _ctx({"diff": {0: (1.0, 0.700), 1: (1.0, 0.650), 2: (1.0, 0.675)},
                "transformer": {0: (0.999, 0.600), 1: (1.0, 0.600), 2: (0.998, 0.600)}})
    assert _glance_rows("\n".join(ood_section(ctx)))["`diff` − `transformer`"][1:3] == [
        "none", "higher at 4x length (+0.075)"]
    ctx = _ctx({"diff": {s: (1.0, 1.0) for s in range(3)}, "transformer": {s: (1.0, 0.9999) for s in range(3)}})
    assert _glance_rows("\n".join(ood_section(ctx)))["`diff` − `transformer`"][1:3] == [
        "none", "higher at 4x length (+1.0e-04, no test)"]


def test_a_run_without_a_finite_accuracy_at_the_training_condition_is_below_the_bar(tmp_path):
    """A NaN accuracy at 1x, or no 1x result at all, has not shown that the run learned the task: it is listed
    below the bar with the reason, and its other conditions are in no mean or difference."""
    ctx = _ctx({"diff": {0: (1.0, 0.6), 1: (1.0, 0.6), 2: (float("nan"), 0.1)},
                "transformer": {0: (1.0, 0.5), 1: (1.0, 0.5), 2: (1.0, 0.52)}})
    del ctx.runs["transformer", 2].evals["ood"]["details"]["cells"][0]  # 4x only
    text = "\n".join(ood_section(ctx, tmp_path))
    assert ("`diff` seed 2 (accuracy NaN at the training condition), `transformer` seed 2 (no result at the "
            "training condition)") in text
    assert "| `diff` | 2 | NaN | 0.1000 |" in text and "| `transformer` | 2 | – | 0.5200 |" in text
    assert "at `length4x-density1x` `diff` 60.00%, `transformer` 50.00%." in text  # seeds 0 and 1 of each


@pytest.mark.parametrize("read, what", [("accuracy", "accuracy"),
                                        ("adaptive", "accuracy with adaptive temperature")])
def test_a_non_finite_value_of_a_run_past_the_bar_is_an_error_naming_arm_seed_and_condition(read, what):
    """Never dropped silently (the mean, interval and paired difference would be over the other seeds with
    nothing said), as stats.compare_paired treats a non-finite value."""
    ctx = _ctx({"diff": {s: (1.0, 0.6) for s in range(3)}, "transformer": {s: (1.0, 0.5) for s in range(3)}})
    cell = ctx.runs["diff", 1].evals["ood"]["details"]["cells"][1]
    if read == "accuracy":
        cell["accuracy"] = float("nan")
    else:
        cell["adaptive"]["accuracy"] = float("inf")
    with pytest.raises(ValueError, match=f"^ood {what} of arm 'diff' at seed 1, condition length4x-density1x, is "):
        ood_section(ctx)


def test_the_retrieving_heads_entropy_and_largest_logit_are_read_per_condition():
    """The head chosen at 1x (head 1 here: its positive weight puts 0.9 on the target) is read at every condition:
    its A1 entropy and largest logit, means over seeds (head 0's numbers never enter)."""
    runs = {}
    for seed in (0, 1, 2):
        cells = []
        for condition, length, entropy in (("length1x-density1x", 1.0, 0.1), ("length4x-density1x", 4.0, 1.0)):
            cell = _cell(condition, length, 1.0, 1.0, 0.9)
            for layer in cell["attention"]["layers"]:
                layer["a1_entropy"] = [9.0, entropy + 0.1 * seed]
                layer["a1_max_logit"] = [-9.0, 20.0 - length]
            cells.append(cell)
        runs["diff", seed] = Run("diff", seed, None, evals={"ood": {"details": {"cells": cells}}})
    text = "\n".join(ood_section(_study(["diff"], [0, 1, 2], runs)))
    entropy = text[text.index("**Entropy of its first map A1"):].split("\n\n")[1].splitlines()
    assert entropy[2].startswith("| `diff` | 0.200 [") and "| 1.100 [" in entropy[2]  # 0.1 + 0.1 s; 1.0 + 0.1 s
    logit = text[text.index("**Largest pre-softmax logit of A1"):].split("\n\n")[1].splitlines()
    assert logit[2] == "| `diff` | 19.000 [19.000, 19.000] | 16.000 [16.000, 16.000] |"  # every seed the same
