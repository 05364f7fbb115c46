"""`eval` refuses what it would read wrongly (empty splits, stale or edited results, options a task does not
read) in one line naming the fix, and never shows one model's result as another's."""

from __future__ import annotations

import errno
import json
import random
import shutil
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from difftransformer.cli import main
from tests.cli.conftest import last_error_line, tiny_run_config
from tests.helpers import cli_fails


class _LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of the tensor storages that ops return inside the mode while a returned tensor still
    refers to them: what a forward's tensors hold, free of the allocator's slack and of the file-backed pages
    that make a process's RSS vary with the machine's memory pressure."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage data pointer -> [bytes, live tensors returned on it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.live:
            self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.now += self.live[ptr][0]
            self.peak = max(self.peak, self.now)
        self.live[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]



def _eval_fails(capsys, argv: list[str], *needles: str) -> str:
    """An eval that fails: exit 2, no traceback, its last stderr line (after the progress lines) naming
    every needle."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def _corpus(folder, words, seed: int, docs: int = 10):
    folder.mkdir()
    rng = random.Random(seed)
    for i in range(docs):
        (folder / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(900)) + ".\n")
    return folder


def _prepare(corpus, out, tokenizer, *extra: str) -> None:
    assert main(["prepare", str(corpus), "--out-dir", str(out), "--tokenizer", str(tokenizer), *extra]) == 0


def test_two_models_never_share_one_results_folder(compared, tmp_path, capsys):
    """`eval compare A B --out-dir X` is refused before anything is written: X would hold both models' results, each
    replacing the other's, and a later --no-run would show B's numbers in both columns."""
    a, b = str(compared / "transformer"), str(compared / "diff")
    _eval_fails(capsys, ["eval", "compare", a, b, "--tasks", "heldout-loss", "--out-dir", str(tmp_path / "x")],
                "would hold the results of both models")
    assert not (tmp_path / "x").exists()


def test_no_run_shows_no_result_of_other_weights(compared, tmp_path, capsys):
    """A result left in a model's eval/ folder by other weights (an earlier final/, another model) is not shown by
    --no-run as this model's: it is named as computed from other weights, and the table has no row for it."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compared / "transformer", a, ignore=shutil.ignore_patterns("eval"))
    shutil.copytree(compared / "diff", b, ignore=shutil.ignore_patterns("eval"))
    assert main(["eval", "heldout-loss", str(a)]) == 0
    (b / "eval").mkdir()
    shutil.copy(a / "eval" / "heldout-loss.json", b / "eval" / "heldout-loss.json")
    capsys.readouterr()
    assert main(["eval", "compare", str(a), str(b), "--tasks", "heldout-loss", "--no-run"]) == 0
    out, err = capsys.readouterr()
    assert "computed from other weights" in err and str(b) in err
    assert "heldout-loss | loss" not in out  # no row: B has no result of its own


def test_a_result_for_a_data_folder_prepared_again_is_not_reused(workdir, compared, tmp_path, capsys):
    model = compared / "diff"
    tokenizer = model / "final" / "tokenizer.json"
    data, results = tmp_path / "data", tmp_path / "results"
    _prepare(workdir / "corpus", data, tokenizer, "--test-fraction", "0.2")
    argv = ["eval", "heldout-loss", str(model), "--data-dir", str(data), "--out-dir", str(results)]
    assert main(argv) == 0
    first = json.loads((results / "heldout-loss.json").read_text())["metrics"]["loss"]
    other = _corpus(tmp_path / "other", ["zebra", "quantum", "fjord", "kiwi", "jazz"], seed=5)
    _prepare(other, data, tokenizer, "--test-fraction", "0.2", "--force")  # same folder, other text
    capsys.readouterr()
    assert main(argv) == 0
    assert "reusing" not in capsys.readouterr().err
    assert json.loads((results / "heldout-loss.json").read_text())["metrics"]["loss"] != first


@pytest.mark.parametrize("edit", [
    lambda d: d.update(settings=[]),
    lambda d: d.update(provenance="x"),
    lambda d: d["settings"].update(eval_config=[1]),
    lambda d: d.update(metrics=[1, 2]),
    lambda d: d.update(metrics=None),
    lambda d: d["metrics"].update(loss="abc"),
], ids=["settings-list", "provenance-str", "eval_config-list", "metrics-list", "metrics-null", "loss-str"])
def test_a_hand_edited_eval_result_is_computed_again(compared, tmp_path, capsys, edit):
    model, results = str(compared / "diff"), tmp_path / "results"
    argv = ["eval", "heldout-loss", model, "--out-dir", str(results)]
    assert main(argv) == 0
    record = json.loads((results / "heldout-loss.json").read_text())
    edit(record)
    (results / "heldout-loss.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["eval", "compare", model, model, "--no-run", "--tasks", "heldout-loss", "--out-dir",
                 str(results)]) == 0
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().err
    assert isinstance(json.loads((results / "heldout-loss.json").read_text())["metrics"]["loss"], float)


@pytest.mark.parametrize("task, extra", [("heldout-loss", []), ("long-context", []), ("outliers", []),
                                         ("logit-quant", ["--needle-samples", "0"])])
def test_an_empty_split_is_named_with_a_fix_the_command_offers(workdir, compared, tmp_path, capsys, task, extra):
    """A data folder prepared without a test split: every task that reads it names the split, its 0 tokens and a fix
    the command offers (--split val), never a flag that does not exist."""
    model = compared / "diff"
    data = tmp_path / "data"
    _prepare(workdir / "corpus", data, model / "final" / "tokenizer.json", "--test-fraction", "0")
    capsys.readouterr()
    _eval_fails(capsys, ["eval", task, str(model), "--data-dir", str(data), "--out-dir", str(tmp_path / "r"),
                         *extra], "test split", "has 0 tokens", "prepared without a test split", "--split val")


def test_logit_quant_names_its_own_option_when_needles_do_not_fit(compared, capsys):
    """When its needles do not fit, logit-quant names its own option (--needle-samples 0), not the needle task's
    advice ('fewer needles')."""
    last = _eval_fails(capsys, ["eval", "logit-quant", str(compared / "diff"), "--out-dir", "/nonexistent/never"],
                       "--needle-samples 0")
    assert "fewer needles" not in last


@pytest.mark.parametrize("kwargs, needle", [
    ({"eval_seed": -1}, "EvalConfig.eval_seed must be in [0, 2**63)"),  # the API refuses what the flag refuses
    ({"device": "tpu"}, "EvalConfig.device must be 'cpu', 'cuda' or 'cuda:N'"),  # when made, not at run time
])
def test_eval_config_refuses_what_the_command_line_refuses(kwargs, needle):
    from difftransformer.eval import EvalConfig

    with pytest.raises(ValueError) as e:
        EvalConfig(**kwargs)
    assert needle in str(e.value)


def test_run_task_names_a_task_of_the_wrong_type():
    from difftransformer.eval import run_task

    with pytest.raises(TypeError, match=r"run_task takes a task name or a Task, got 5 \(int\)"):
        run_task(5, None, None)  # a TypeError naming what run_task takes


@pytest.mark.parametrize("task", ["needle", "icl", "hallucination"])
def test_seq_len_given_to_a_task_that_sizes_its_own_prompts_is_refused(compared, task, capsys):
    """A task that sizes its own prompts (needle, icl, hallucination) refuses --seq-len by name, with the fix (drop
    it), rather than ignoring it."""
    cli_fails(capsys, ["eval", task, str(compared / "diff"), "--seq-len", "32"],
              f"{task} does not read --seq-len (32)", "drop --seq-len")


def test_a_prompt_too_short_for_one_needle_does_not_advise_fewer_needles(compared, capsys):
    assert main(["eval", "attention-noise", str(compared / "diff"), "--seq-len", "32", "--samples", "1"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in last and "use a length of at least" in last, last
    assert "fewer needles" not in last, last


def test_the_explicit_map_estimate_covers_the_tensors_of_a_window_with_room_for_the_allocator():
    """probe_batch sizes batches by _EAGER_COPIES maps per window. The tensors one eager 2,048-token forward with the
    outlier probe's hooks holds at once (4.1 maps' worth) must fit in that estimate with half again to spare: the
    process's RSS adds the allocator's slack and reaches 5.3 to 7.7 maps' worth, depending on the machine, so an
    estimate without that room lets a batch grow past the half of free memory it was sized to. An estimate over 4x
    the tensors wastes batch."""
    from difftransformer.eval.probes import hooks
    from difftransformer.eval.probes.outliers import OutlierState
    from difftransformer.model import DiffTransformerLM, get_preset

    T = 2048
    model = DiffTransformerLM(get_preset("tiny").config("diff", vocab_size=300, max_position_embeddings=T)).eval()
    state = OutlierState(len(hooks.attention_layers(model)), "cpu")
    tokens = torch.randint(0, 300, (1, T))
    with torch.no_grad(), hooks.inspect_attention(model, state.score_hook), \
            hooks.capture_layer_outputs(model, state.hidden), _LiveTensorBytes() as live:
        model(tokens)
    one_map = 4 * T * T * 2 * model.config.num_attention_heads
    estimate = one_map * hooks._EAGER_COPIES
    assert 1.5 * live.peak <= estimate <= 4 * live.peak, (live.peak / one_map, hooks._EAGER_COPIES)
    assert live.now < one_map / 10, "the tracker lost frees: what is live after the forward is a small rest"


def test_a_damaged_shard_names_the_command_that_restores_the_folders_own_data(workdir, tmp_path, capsys):
    """A damaged shard: eval's advice is a `difftransformer prepare` command line for the folder's own corpus and
    vocabulary (not the default corpus, and no Python keyword such as force=True); followed, it restores the very
    bytes."""
    config, data = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2), tmp_path / "data"
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "run")]) == 0
    good = (data / "test.bin").read_bytes()
    (data / "test.bin").write_bytes(good[: len(good) // 2])
    capsys.readouterr()
    assert main(["eval", "heldout-loss", str(tmp_path / "run"), "--data-dir", str(data)]) == 2
    err = last_error_line(capsys)
    assert "force=True" not in err and str(workdir / "corpus") in err and "--vocab-size 300" in err, err
    command = err.split("`")[1].split()
    assert command[:2] == ["difftransformer", "prepare"]
    assert main(command[1:]) == 0  # the advice, followed, restores the very bytes
    assert (data / "test.bin").read_bytes() == good


def test_eval_on_a_model_folder_it_cannot_write_names_out_dir(workdir, tmp_path, capsys, monkeypatch):
    """A model folder eval cannot write (read-only): the result cannot be saved in its eval/ folder, and the error
    names --out-dir, the flag that keeps the results elsewhere. With --out-dir given, the folder is the user's own
    and the plain message stands."""
    import difftransformer.cli.eval as cli_eval

    run = tmp_path / "run"
    config = tiny_run_config(workdir, tmp_path, max_steps=4, ckpt_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(run)]) == 0

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(run / "eval"))

    monkeypatch.setattr(cli_eval, "evaluate_cached", read_only)
    capsys.readouterr()
    assert main(["eval", "heldout-loss", str(run)]) == 2
    err = last_error_line(capsys)
    assert "--out-dir" in err and "Read-only file system" in err, err
    # with --out-dir given, the folder named is the user's own: the plain message stands
    assert main(["eval", "heldout-loss", str(run), "--out-dir", str(tmp_path / "ev")]) == 2
    assert "--out-dir DIR" not in last_error_line(capsys)


def test_an_empty_task_list_is_refused_not_read_as_all(workdir, tmp_path, capsys):
    """`eval all MODEL --tasks ''` names no task: it is refused, not read as if --tasks were absent (every task would
    run), and no result is written."""
    run = tmp_path / "run"
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "all", str(run), "--tasks", "", "--out-dir", str(tmp_path / "ev")]) == 2
    assert "names no task" in last_error_line(capsys)
    assert not (tmp_path / "ev").exists() or not any((tmp_path / "ev").rglob("*.json"))


def test_logit_quant_names_the_window_count_it_refuses(compared, tmp_path, capsys):
    """`eval logit-quant RUN --windows 0` and `--needle-length -3` are refused naming the option, its rule and
    the value given, like every other eval option."""
    run = compared / "diff"
    capsys.readouterr()
    assert main(["eval", "logit-quant", str(run), "--windows", "0", "--needle-samples", "0",
                 "--out-dir", str(tmp_path / "ev")]) == 2
    line = last_error_line(capsys)
    assert "logit-quant windows must be >= 1" in line and "got 0" in line, line
    assert main(["eval", "logit-quant", str(run), "--needle-length", "-3", "--out-dir", str(tmp_path / "ev")]) == 2
    assert "needle_length must be >= 0 (0: the model's context), got -3" in last_error_line(capsys)


def test_a_judge_that_raises_is_one_line_naming_it(compared, tmp_path, capsys):
    """`eval hallucination RUN --judge python:os:getcwd` (a function that does not take the records) is one line
    naming the judge, what it raised and the call a judge must take (fn(records)), like every other bad judge."""
    assert main(["eval", "hallucination", str(compared / "diff"), "--samples", "1", "--subtasks", "qa",
                 "--judge", "python:os:getcwd", "--out-dir", str(tmp_path / "ev")]) == 2
    line = last_error_line(capsys)  # after the task's own progress line
    assert "judge python:os:getcwd raised TypeError" in line and "takes no arguments" in line, line
    assert "fn(records)" in line, line


def test_lm_eval_on_a_folder_without_tokenizer_is_one_line(compared, tmp_path, monkeypatch, capsys):
    """`python -m difftransformer.hf.lm_eval run --model hf --model_args pretrained=DIR` with DIR a folder without
    tokenizer.json exits 2 with one line naming DIR and the fix, not a traceback through lm-eval."""
    pytest.importorskip("lm_eval")
    from difftransformer.hf.lm_eval import main as lm_eval_main

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((compared / "diff" / "final" / name).read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("DIFFTRANSFORMER_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])  # main() sets sys.argv for lm-eval's CLI
    with pytest.raises(SystemExit) as exit_:
        lm_eval_main(["run", "--model", "hf", "--model_args", f"pretrained={bare},backend=causal", "--tasks",
                      "arc_easy", "--device", "cpu", "--output_path", str(tmp_path / "out")])
    assert exit_.value.code == 2
    line = last_error_line(capsys)
    assert f"{bare} has no tokenizer.json" in line and "Copy that file" in line, line


def test_eval_compare_no_run_names_a_broken_result_file(compared, capsys):
    """`eval compare --no-run` with B's heldout-loss.json unreadable (a `"loss"` that is no number, or broken JSON)
    names the file, why it cannot be read and the fix, not a result only one model has."""
    a, b = compared / "diff", compared / "transformer"
    args = ["eval", "compare", str(a), str(b), "--tasks", "heldout-loss"]
    assert main(args) == 0
    stored = b / "eval" / "heldout-loss.json"
    good = json.loads(stored.read_text())
    for content, why in ((json.dumps({**good, "metrics": {**good["metrics"], "loss": "x"}}),
                          "metric 'loss' is 'x', not a number"), ("{broken", "not JSON")):
        stored.write_text(content)
        capsys.readouterr()
        assert main([*args, "--no-run"]) == 0
        err = capsys.readouterr().err
        assert f"{stored} is not a readable result ({why}" in err and "delete it or run without --no-run" in err
    stored.write_text(json.dumps(good))


def test_a_chosen_results_folder_never_loses_another_models_result(compared, tmp_path, capsys):
    """`eval TASK B --out-dir X` where X holds A's result: A is not gone, so its result is not replaced silently;
    --force replaces it on purpose. A model's own eval/ folder still takes a new final model's result."""
    a, b, shared = str(compared / "transformer"), str(compared / "diff"), tmp_path / "shared"
    assert main(["eval", "heldout-loss", a, "--out-dir", str(shared)]) == 0
    kept = (shared / "heldout-loss.json").read_text()
    _eval_fails(capsys, ["eval", "heldout-loss", b, "--out-dir", str(shared)],
                "heldout-loss's result for other weights", "perhaps another model's", "--force")
    assert (shared / "heldout-loss.json").read_text() == kept
    assert main(["eval", "heldout-loss", b, "--out-dir", str(shared), "--force"]) == 0
    assert (shared / "heldout-loss.json").read_text() != kept


def test_no_run_shows_no_result_of_other_settings_than_the_flags_ask(compared, tmp_path, capsys):
    """`eval compare A B --no-run --split val` never shows the stored test-split losses as the val split's: the
    results are named as computed with other settings and left out; without --split, they are shown."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compared / "transformer", a, ignore=shutil.ignore_patterns("eval"))
    shutil.copytree(compared / "diff", b, ignore=shutil.ignore_patterns("eval"))
    for model in (a, b):
        assert main(["eval", "heldout-loss", str(model)]) == 0  # the test split
    capsys.readouterr()
    assert main(["eval", "compare", str(a), str(b), "--tasks", "heldout-loss", "--no-run", "--split", "val"]) == 0
    out, err = capsys.readouterr()
    assert "computed with other settings than these flags ask for" in err and "split" in err
    assert "heldout-loss | loss" not in out
    assert main(["eval", "compare", str(a), str(b), "--tasks", "heldout-loss", "--no-run"]) == 0  # as stored: shown
    assert "heldout-loss | loss" in capsys.readouterr().out
