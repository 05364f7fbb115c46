"""Which recipe each arm trained on, as every report section reads it (report/recipes.py): from the result files or,
for a report built from run folders, from the folders' configs in the same form; an unknown recipe is never read as
another arm's; and the verdicts and final losses say when two arms compared trained on different recipes."""

from __future__ import annotations

from types import SimpleNamespace

from difftransformer.experiments.report.ood_view import ood_section
from difftransformer.experiments.report.runs import Run
from difftransformer.experiments.report.sections import Context, final_losses, verdicts
from difftransformer.model import DiffTransformerConfig
from difftransformer.model.config import model_identity
from difftransformer.train import RunDir, TrainConfig
from tests.experiments.test_ood_report import _cell, _glance_rows, _study

# DIFF and transformer_6k trained 6,000 steps, transformer 2,000 (test_ood_report's recipe-matching case)
_ARMS = {"diff": ("diff", 6000, [0.70, 0.72, 0.71]), "transformer": ("transformer", 2000, [0.40, 0.42, 0.41]),
         "transformer_6k": ("transformer", 6000, [0.69, 0.73, 0.70])}


def _configs(attention: str, max_steps: int, seed: int, lr: float = 1e-3) -> tuple[DiffTransformerConfig, TrainConfig]:
    model = DiffTransformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  attention=attention, max_position_embeddings=64)
    return model, TrainConfig(max_steps=max_steps, lr=lr, seed=seed, out_dir=f"runs/x/seed{seed}")


def _recorded_identity(model: DiffTransformerConfig, train: TrainConfig) -> dict:
    """The identity a unit's result file records (study.unit_identity, the data aside)."""
    from difftransformer.experiments.study import _recipe

    return {"model": model_identity(model.to_dict()), "train": _recipe(train)}


def _ood(acc4: float) -> dict:
    cells = [_cell("length1x-density1x", 1.0, 1.0, 1.0, 0.9), _cell("length4x-density1x", 4.0, 1.0, acc4, 0.5)]
    return {"ood": {"details": {"cells": cells}}}


def _runs(tmp_path, from_folders: bool) -> dict:
    """The same accuracies, read from result files or (a report built from run folders: `Run.read`, no record)
    from run folders holding train_config.json and model_config.json."""
    runs = {}
    for arm, (attention, max_steps, accs) in _ARMS.items():
        for seed, acc4 in enumerate(accs):
            model, train = _configs(attention, max_steps, seed)
            if from_folders:
                folder = RunDir(tmp_path / f"seed{seed}" / arm)
                folder.path.mkdir(parents=True)
                model.save(folder.model_config)
                train.save(folder.train_config)
                runs[arm, seed] = Run.read(arm, seed, folder, evals=_ood(acc4))
                assert runs[arm, seed].record is None
            else:
                runs[arm, seed] = Run(arm, seed, None, evals=_ood(acc4),
                                      record={"identity": _recorded_identity(model, train)})
    return runs


def test_a_report_from_run_folders_reads_each_arms_recipe_as_one_from_result_files_does(tmp_path):
    """Built from run folders, the ood section is the one built from result files: the 2,000-step Transformer
    is marked as on another recipe, has no row among the verdicts at a glance, and DIFF's headline is against
    the Transformer on its own 6,000 steps."""
    specs = {"transformer_6k": {"name": "transformer_6k", "attention": "transformer"}}
    records = "\n".join(ood_section(_study(list(_ARMS), [0, 1, 2], _runs(tmp_path / "r", False), specs)))
    folders = "\n".join(ood_section(_study(list(_ARMS), [0, 1, 2], _runs(tmp_path / "f", True), specs)))
    assert folders == records
    assert "| `transformer` (other recipe) | `length4x-density1x` |" in folders
    assert "| `transformer_6k` | `length4x-density1x` |" in folders
    assert "`diff`'s accuracy is not separable from the Transformer's on the same recipe (`transformer_6k`)" in folders
    assert "`diff` − `transformer`" not in "".join(_glance_rows(folders))


def test_an_unknown_recipe_is_never_read_as_a_common_one():
    """Runs whose recipe nothing records (no result file, no run folder) compare as unknown: each difference
    says so, none gets a row among the verdicts at a glance, and the headline says the recipe is not recorded."""
    runs = {(arm, seed): Run(arm, seed, None, evals=_ood(acc4))
            for arm, (_, _, accs) in _ARMS.items() for seed, acc4 in enumerate(accs)}
    text = "\n".join(ood_section(_study(list(_ARMS), [0, 1, 2], runs)))
    assert "| `transformer` (recipe not recorded) | `length4x-density1x` |" in text
    assert "| `transformer_6k` (recipe not recorded) | `length4x-density1x` |" in text
    assert "\"(recipe not recorded)\": no result file or run folder records its recipe or `diff`'s" in text
    assert "### Verdicts at a glance" not in text
    assert ("`diff`'s accuracy is higher than the Transformer's (recipe not recorded: the difference may mix recipe "
            "and architecture)") in text


def test_a_run_folder_and_a_result_file_of_one_recipe_give_one_recipe(tmp_path):
    """The two sources in one normalised form: the seed aside, a setting a record predates at its default; another
    learning rate or position encoding is another recipe."""
    from difftransformer.experiments.report.recipes import recipe, same_recipe

    model, train = _configs("diff", 4000, seed=0)
    folder = RunDir(tmp_path / "diff")
    folder.path.mkdir()
    model.save(folder.model_config)
    train.save(folder.train_config)
    older = _recorded_identity(*_configs("diff", 4000, seed=1))
    del older["train"]["init_from"]  # a record written before the setting existed
    runs = {("folder", 0): Run.read("folder", 0, folder, evals={}),
            ("record", 0): Run("record", 0, None, record={"identity": older})}
    ctx = SimpleNamespace(seeds=[0], runs=runs, spec=lambda arm: {"attention": arm})
    assert recipe(ctx, "folder") is not None and same_recipe(ctx, "folder", "record") is True
    assert runs["folder", 0].identity["model"] == older["model"]  # the saved file's own keys are not the model's
    runs["record", 0].record["identity"]["train"]["lr"] = 5e-4
    assert same_recipe(ctx, "folder", "record") is False
    runs["record", 0].record = {"identity": _recorded_identity(*_configs("diff", 4000, seed=0))}
    runs["record", 0].record["identity"]["model"]["position_encoding"] = "none"
    assert same_recipe(ctx, "folder", "record") is False
    runs["record", 0].record = None  # neither a result file nor a run folder: unknown, never the same
    assert recipe(ctx, "record") is None and same_recipe(ctx, "folder", "record") is None


def _loss_ctx(finals: dict[str, tuple[str, float, list[float]]], recorded: bool = True) -> Context:
    """A study whose arms end at the given final losses: finals[arm] = (attention kind, lr, loss per seed)."""
    runs = {}
    for arm, (attention, lr, losses) in finals.items():
        for seed, loss in enumerate(losses):
            identity = {"model": {"attention": attention, "position_encoding": "rope"},
                        "train": {"max_steps": 10, "lr": lr, "seed": seed}}
            runs[arm, seed] = Run(arm, seed, None, val=[{"step": 10, "loss": loss}], max_steps=10, last_step=10,
                                  finished=True, record={"identity": identity} if recorded else None)
    return Context(study=None, manifest={"data": {"task": {"family": "maxret"}}}, arms=list(finals), seeds=[0, 1, 2],
                   baseline="transformer", runs=runs)


_FINALS = {"transformer": ("transformer", 1e-3, [2.90, 2.91, 2.92]), "diff": ("diff", 1e-3, [2.95, 2.97, 2.96]),
           "diff_lr": ("diff", 5e-4, [3.00, 3.02, 3.01]), "transformer_lr": ("transformer", 5e-4, [3.20, 3.21, 3.22]),
           "diff_v2_lr": ("diff_v2", 2e-4, [3.00, 3.01, 3.03])}


def test_a_verdict_across_recipes_compares_the_architectures_on_one_recipe_or_says_what_it_mixes():
    """DIFF on lr 5e-4 is behind the lr 1e-3 Transformer, but ahead of the Transformer on its own recipe: the
    verdict is the latter. The Transformer on lr 5e-4 against the baseline is the recipe's difference alone; DIFF V2
    on a recipe no Transformer shares is set against the baseline with a sentence that it mixes the two."""
    text = "\n".join(verdicts(_loss_ctx(_FINALS)))
    lines = {line.split(":**")[0] + ":**": line for line in text.splitlines() if line.startswith("**")}
    assert "recipe" not in lines["**diff vs transformer:**"]
    matched = lines["**diff_lr vs transformer_lr:**"]
    assert matched.startswith("**diff_lr vs transformer_lr:** diff_lr reaches the lower final validation loss")
    assert "(transformer_lr has the baseline's architecture on diff_lr's recipe;" in matched
    assert "**diff_lr vs transformer:**" not in lines
    assert lines["**transformer_lr vs transformer:**"].endswith(
        "transformer_lr has transformer's attention on another recipe (training settings or position encoding): the "
        "difference is the recipe's, not the architecture's.")
    assert lines["**diff_v2_lr vs transformer:**"].endswith("the difference mixes recipe and architecture.")


def test_the_final_loss_table_marks_each_arm_on_another_recipe_than_the_baseline():
    text = "\n".join(final_losses(_loss_ctx(_FINALS)))
    assert "| `diff` | – |" in text and "| `transformer` | – |" in text
    for arm in ("diff_lr", "transformer_lr", "diff_v2_lr"):
        assert f"| `{arm}` (other recipe) | – |" in text
    assert "\"(other recipe)\": trained on other settings than `transformer`" in text
    unknown = "\n".join(final_losses(_loss_ctx(_FINALS, recorded=False)))
    assert "| `diff` (recipe not recorded) | – |" in unknown and "\"(recipe not recorded)\": no result file" in unknown
    assert "may mix recipe and architecture" in "\n".join(verdicts(_loss_ctx(_FINALS, recorded=False)))


def test_a_throughput_ratio_over_runs_of_other_machines_or_world_sizes_is_marked():
    """tokens/s ÷ the baseline's compares arms only on one machine: where the recorded runs of an arm and of the
    baseline trained on more than one (CPU, GPU, world size), the ratio says so; runs without a record are not
    counted (a run folder's machine is not known)."""
    def run(arm, seed, world_size, tps):
        hardware = {"cpu": "Xeon", "world_size": world_size}
        return Run(arm, seed, None, train=[{"step": 1, "tokens_per_s": tps}, {"step": 2, "tokens_per_s": tps}],
                   val=[{"step": 2, "loss": 3.0 + seed / 100 + (arm == "diff") / 50}], max_steps=2, last_step=2,
                   finished=True, record={"identity": {"train": {"max_steps": 2}}, "hardware": hardware})

    def table(world_sizes: dict) -> str:
        runs = {(arm, s): run(arm, s, world_sizes[arm], 100.0 * (1 + (arm == "diff"))) for arm in world_sizes
                for s in (0, 1)}
        ctx = Context(study=None, manifest={}, arms=list(world_sizes), seeds=[0, 1], baseline="transformer", runs=runs)
        return "\n".join(final_losses(ctx))

    mixed = table({"transformer": 2, "diff": 1})
    assert "| 2.000 (other machines) |" in mixed and "\"(other machines)\": the runs of the arm" in mixed
    same = table({"transformer": 1, "diff": 1})
    assert "| 2.000 |" in same and "other machines" not in same
