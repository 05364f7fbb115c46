"""Regressions from the seventh hostile pass (issue 13, docs/hostile-pass.md): `eval all --tasks ''` ran
every task, a `train` into an arm of a study replaced the arm's weights while the study kept the old
results, and an unreadable --init-from folder was blamed on the run config's file."""

from __future__ import annotations

import os
import shutil

from difftransformer.cli import main
from tests.cli.conftest import TINY_TRAIN, _toml, last_error_line, tiny_run_config


def test_an_empty_task_list_is_refused_not_read_as_all(workdir, tmp_path, capsys):
    """E02: `eval all MODEL --tasks ''` ran all eight tasks (71 s) as if --tasks were absent."""
    run = tmp_path / "run"
    assert main(["train", "--config", tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2), "--out-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "all", str(run), "--tasks", "", "--out-dir", str(tmp_path / "ev")]) == 2
    assert "names no task" in last_error_line(capsys)
    assert not (tmp_path / "ev").exists() or not any((tmp_path / "ev").rglob("*.json"))


def test_training_into_a_study_is_refused(workdir, tmp_path, capsys):
    """T03: `train --out-dir STUDY/diff` replaced the arm's final/ while compare then skipped the arm
    ("result file exists") and report printed the old numbers. Arms, seeds and cells are compare's."""
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    study = tmp_path / "study"
    assert main(["compare", "--config", config, "--out-dir", str(study)]) == 0
    final = study / "diff" / "final" / "model.safetensors"
    before = final.read_bytes()
    capsys.readouterr()
    for inside in (study / "diff", study / "new-arm", study / "diff" / "sub"):
        assert main(["train", "--config", config, "--out-dir", str(inside), "--set", "train.max_steps=3"]) == 2
        line = last_error_line(capsys)
        assert f"inside the study {study.resolve()}" in line and "difftransformer compare" in line, line
    assert final.read_bytes() == before
    assert main(["train", "--config", config, "--out-dir", str(tmp_path / "elsewhere")]) == 0  # outside: fine


def test_an_unreadable_init_from_folder_is_not_blamed_on_the_run_config(workdir, tmp_path, capsys):
    """F03 (pass 6, held in part in pass 7): the message named config.json but put the run config's name
    in front, as if that file were at fault."""
    run = tmp_path / "run"
    config = tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2)
    assert main(["train", "--config", config, "--out-dir", str(run)]) == 0
    model = tmp_path / "model"
    shutil.copytree(run / "final", model)
    (model / "config.json").write_bytes(b"\xff\xfe\x00")
    init = tmp_path / "init.toml"
    init.write_text(_toml({"train": {**TINY_TRAIN, "max_steps": 2}, "data": {"data_dir": str(tmp_path / "data")}}))
    capsys.readouterr()
    assert main(["train", "--config", str(init), "--init-from", str(model), "--out-dir", str(tmp_path / "r2")]) == 2
    line = last_error_line(capsys)
    assert "config.json" in line and f"{init}:" not in line, line


def test_a_killed_conversions_folder_is_swept_by_the_next(compared, tmp_path, capsys):
    """K02: a SIGKILLed `convert` left its `.DST.converting-PID` folder, and the next `convert` into DST
    (which succeeded) kept it forever. A folder of a process still running is not touched."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    out = tmp_path / "out"
    abandoned = tmp_path / f".out.converting-{int(dead.stdout)}"
    (abandoned / "half").mkdir(parents=True)
    (abandoned / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".out.converting-{os.getppid()}"  # our parent: alive
    live.mkdir()
    other = tmp_path / f".other.converting-{int(dead.stdout)}"  # another destination's: not ours to sweep
    other.mkdir()
    assert main(["convert", str(compared / "diff" / "final"), str(out), "--to", "diffllama"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, live.name, other.name])
