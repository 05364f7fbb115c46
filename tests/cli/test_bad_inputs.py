"""Bad input through the command line: a one-line error naming the value or file and the fix, exit
code 2, never a traceback, and nothing of the user's work touched."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from difftransformer.cli import main
from tests.helpers import cli_fails

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("override, needle", [
    ("model.hidden_size=64.0", "model.hidden_size must be an int, got 64.0"),
    ("model.initializer_range=-0.1", "initializer_range must be a positive number"),
    ("model.rope_theta=-5.0", "rope_theta must be a positive number"),
    ("model.lambda_init=nan", "lambda_init must lie in [0, 1)"),
    ("model.lambda_init=1e30", "lambda_init must lie in [0, 1)"),
    ("model.lambda_init=-0.1", "lambda_init must lie in [0, 1)"),
    ('model.attn_deterministic="no"', "attn_deterministic must be true or false"),
    ('train.lr="fast"', "train] settings: TrainConfig.lr must be a float"),
    ("train.max_weight_growth=-2.0", "max_weight_growth must be >= 0"),
    ("data.split_seed=true", "split_seed must be an integer >= 0"),
] + ([("train.device=cuda", "CUDA is not available")] if NO_CUDA else []))
def test_bad_settings(workdir, tmp_path, capsys, override, needle):
    cli_fails(capsys, ["train", "--config", str(workdir / "tiny.toml"), "--set", override,
                             "--out-dir", str(tmp_path / "run")], needle)


def test_out_dirs_that_cannot_be_written(workdir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "below"):
        cli_fails(capsys, ["train", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out)], str(blocker))
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("extra, needle", [
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--num-samples", "0"], "--num-samples must be at least 1"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "0"], "--top-k must be a positive integer"),
    (["-n", "-3"], "--max-new-tokens must be >= 0"),
] + ([(["--device", "cuda"], "CUDA is not available")] if NO_CUDA else []))
def test_bad_generation_settings(compared, capsys, extra, needle):
    cli_fails(capsys, ["generate", str(compared / "diff"), "the union", *extra], needle)


def test_a_file_that_is_not_a_tokenizer_and_a_foreign_tokenizer(compared, tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}')
    cli_fails(capsys, ["generate", str(compared / "diff"), "x", "--tokenizer", str(junk)],
                    "is not a tokenizer.json file")
    from difftransformer.data import Tokenizer

    Tokenizer.train(["a b c d e f g"] * 10, vocab_size=270).save(tmp_path / "foreign.json")
    cli_fails(capsys, ["generate", str(compared / "diff"), "x", "--tokenizer", str(tmp_path / "foreign.json")],
                    "is not the tokenizer", "Leave --tokenizer out")


def test_a_model_config_holding_nulls_or_strings(compared, tmp_path, capsys):
    for bad in (None, "256"):
        final = tmp_path / f"final-{bad}"
        shutil.copytree(compared / "diff" / "final", final)
        cfg = json.loads((final / "config.json").read_text())
        cfg["hidden_size"] = bad
        (final / "config.json").write_text(json.dumps(cfg))
        cli_fails(capsys, ["generate", str(final), "x"], "hidden_size must be an int")


def test_a_corrupt_data_manifest_is_named(workdir, tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["prepare", str(workdir / "corpus"), "--out-dir", str(data), "--vocab-size", "300",
                 "--val-fraction", "0.2", "--test-fraction", "0.1"]) == 0
    capsys.readouterr()
    (data / "prepared.json").write_text('{"tokenizer": ')
    cli_fails(capsys, ["train", "--config", str(workdir / "tiny.toml"), "--set", f'data.data_dir="{data}"',
                             "--out-dir", str(tmp_path / "run")], str(data / "prepared.json"), "--force")


def test_a_latest_pointer_outside_its_folder_is_not_followed(workdir, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    argv = ["train", "--config", str(workdir / "tiny.toml"), "--set", "train.max_steps=4", "--out-dir", str(run)]
    assert main(argv) == 0
    (run / "checkpoints" / "latest").write_bytes(b"../../elsewhere\xff")
    from difftransformer.train.checkpoint import find_latest

    assert find_latest(run / "checkpoints").name == "step_00000004"  # the newest complete one, with a warning


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_dir(workdir, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cli_fails(capsys, ["train", "--config", str(workdir / "tiny.toml"), "--out-dir", str(ro / "run")],
                        str(ro))
    finally:
        ro.chmod(0o700)


def test_weights_of_a_wrong_dtype_are_one_line_for_every_command(compared, tmp_path, capsys):
    """Integer "weights" (int64) are refused at load by generate, eval and convert, in one line naming the file, the
    tensor and its dtype: never cast silently and run on, and convert writes nothing."""
    from safetensors.torch import load_file, save_file

    final = shutil.copytree(compared / "diff" / "final", tmp_path / "final")
    state = load_file(str(final / "model.safetensors"))
    state["norm.weight"] = state["norm.weight"].to(torch.int64)
    save_file(state, str(final / "model.safetensors"))
    needle = "tensor 'norm.weight' is stored as I64, not as floating point"
    cli_fails(capsys, ["generate", str(final), "--prompt", "the", "--max-new-tokens", "2"], needle)
    cli_fails(capsys, ["eval", "heldout-loss", str(final)], needle)
    cli_fails(capsys, ["convert", str(final), str(tmp_path / "out"), "--to", "diffllama"], needle)
    assert not (tmp_path / "out").exists()


def test_a_second_conversion_into_one_destination_fails_at_once(compared, tmp_path, capsys):
    """A conversion into DST holds the flock of its `.DST.converting-PID` folder; a second one into DST is refused at
    once, before reading anything, not at the end after all its work."""
    import subprocess
    import sys

    claim = tmp_path / ".out.converting-1"
    hold = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n")
    claim.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", hold, str(claim)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        cli_fails(capsys, ["convert", str(compared / "diff"), str(tmp_path / "out"), "--to", "diffllama"],
                  "another conversion into", ".out.converting-1 is in use")
    finally:
        proc.kill()
        proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [claim.name]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_config_json_that_is_a_fifo_is_named_not_waited_on(compared, tmp_path, capsys):
    final = shutil.copytree(compared / "diff" / "final", tmp_path / "final")
    (final / "config.json").unlink()
    os.mkfifo(final / "config.json")  # reading it would block until someone writes: forever
    for argv in (["generate", str(final), "--prompt", "the"], ["eval", "heldout-loss", str(final)]):
        cli_fails(capsys, argv, f"{final / 'config.json'} is a FIFO, not a regular file")


def test_an_empty_folder_argument_is_not_taken_for_here(compared, capsys):
    cli_fails(capsys, ["report", ""], "DIR is empty")
    cli_fails(capsys, ["eval", "heldout-loss", str(compared / "diff"), "--out-dir", " "], "--out-dir is empty")
