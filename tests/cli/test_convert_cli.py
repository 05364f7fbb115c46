"""`convert`: a destination that is a symbolic link is refused before any work, and nothing half-written is
left by an interrupted or killed conversion."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from difftransformer.cli import main
from tests.cli.conftest import no_work_left
from tests.helpers import cli_fails


@pytest.mark.skipif(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, reason="SIGTERM is handled here")
def test_sigterm_during_convert_leaves_nothing_half_written(compared, tmp_path, capsys, monkeypatch):
    """SIGTERM during a conversion ends the command with 128 + SIGTERM and one line saying nothing half-written was
    kept: the `.DST.converting-PID` folder (as large as the model) is removed. The handler lives only while a command
    runs."""
    import difftransformer.cli.convert as convert

    def write_then_get_killed(fmt, folder, *args):
        (folder / "model.safetensors").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the command")

    monkeypatch.setattr(convert, "_write", write_then_get_killed)
    out = tmp_path / "out"
    assert main(["convert", str(compared / "diff" / "final"), str(out), "--to", "diffllama"]) == 128 + signal.SIGTERM
    assert "terminated (SIGTERM); nothing half-written was kept" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives only while a command runs


def test_a_killed_conversions_folder_is_swept_by_the_next(compared, tmp_path, capsys):
    """The `.DST.converting-PID` folder a SIGKILLed `convert` leaves is removed by the next `convert` into DST. A
    folder of a process still running, or of another destination, is not touched."""
    import subprocess

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


@pytest.mark.parametrize("name, needles", [
    ("dangling", ["is a symbolic link", "does not exist"]),  # to a missing path: no temporary folder is made there
    ("to_empty", ["is a symbolic link", "empty"]),  # to an empty folder: refused before converting, not after
    ("loopA", ["is a symbolic link", "loop"]),  # loopA -> loopB -> loopA: no traceback
])
def test_convert_into_a_symlink_is_refused_up_front(compared, links, capsys, name, needles):
    """`convert RUN DST --to diffllama` with DST a dangling symlink, a symlink to an empty folder, or a symlink loop
    is refused before converting, in one line naming DST, and leaves nothing behind."""
    dst = links / name
    line = cli_fails(capsys, ["convert", str(compared / "diff" / "final"), str(dst), "--to", "diffllama"],
                     f"DST {dst}", *needles)
    assert "converted" not in line
    no_work_left(links)


def test_convert_under_a_looping_folder_is_refused_up_front(compared, links, capsys):
    """DST inside a symlink loop (LOOP/out) is one line naming LOOP and the loop, not a traceback from Path.resolve;
    nothing is left behind."""
    cli_fails(capsys, ["convert", str(compared / "diff" / "final"), str(links / "loopA" / "out"), "--to", "llama"],
              str(links / "loopA"), "loop")
    no_work_left(links)
