"""Atomic writes and folder locks: nothing torn, and one writer per folder with no stale locks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from difftransformer._io import FolderInUseError, folder_lock
from tests.helpers import lock_held_by_another_process, start_lock_holder


def test_a_second_process_is_refused_at_once_and_told_who_holds_the_folder(tmp_path):
    with lock_held_by_another_process(tmp_path / "run") as proc:
        t0 = time.monotonic()
        with pytest.raises(FolderInUseError, match=rf"run is in use by another process \(pid {proc.pid} on .*-c"):
            with folder_lock(tmp_path / "run"):
                pass
        assert time.monotonic() - t0 < 2


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    proc = start_lock_holder(tmp_path / "run")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "pid" in (tmp_path / "run" / ".lock").read_text()  # the file still names the dead holder ...
    with folder_lock(tmp_path / "run"):  # ... but the lock went with it
        pass


def test_the_lock_is_reentrant_in_one_process_and_released_after(tmp_path):
    with folder_lock(tmp_path / "x"):
        with folder_lock(tmp_path / "x"):
            pass
        with folder_lock(tmp_path / "x" / "."):  # the same folder spelled differently
            pass
    proc = start_lock_holder(tmp_path / "x")  # released: another process can take it
    proc.kill()
    proc.wait()


def test_taking_a_lock_clears_what_a_killed_atomic_write_left_in_the_folders_it_owns(tmp_path):
    """A writer killed between creating its temporary file and the rename leaves `<name>.<8 hex>.tmp`; the next
    holder of the folder's lock deletes those in the folder and the subfolders it owns, and nothing else: not
    other .tmp names (a checkpoint's step_X.tmp/ folder, a user's notes.tmp), not other subfolders' files."""
    from difftransformer._io import _new_tmp

    run = tmp_path / "run"
    with lock_held_by_another_process(run):  # the files appear while another process holds the lock:
        for sub in ("", "checkpoints", "other"):  # a refused taker touches none
            (run / sub).mkdir(parents=True, exist_ok=True)
            _new_tmp(run / sub / "latest").write_text("half")  # named as a real atomic write names it
        (run / "notes.tmp").write_text("mine")
        (run / "checkpoints" / "step_00000004.tmp").mkdir()
        (run / "metrics.jsonl.0123abcd.tmp").symlink_to(run / "notes.tmp")  # a link: never followed, left
        with pytest.raises(FolderInUseError):
            with folder_lock(run, owns=("checkpoints",)):
                pass
        assert len(list(run.glob("latest.*.tmp"))) == 1
    with folder_lock(run, owns=("checkpoints",)):
        left = sorted(str(p.relative_to(run)) for p in run.rglob("*.tmp"))
    assert left[:3] == ["checkpoints/step_00000004.tmp", "metrics.jsonl.0123abcd.tmp", "notes.tmp"]
    assert len(left) == 4 and left[3].startswith("other/latest.")
    assert (run / "notes.tmp").read_text() == "mine"


def test_sweeping_a_whole_tree_stops_at_a_folder_with_a_lock_of_its_own(tmp_path):
    """A results folder swept whole (sweep_all) may hold, by mistake, another study's results folder: that one has
    its own lock and holder, who may be writing its temporary files now, so they are left; a plain subfolder's go."""
    from difftransformer._io import _new_tmp

    results = tmp_path / "results"
    with lock_held_by_another_process(results / "other-study"):
        for sub in ("seed0", "other-study", "other-study/seed0"):  # written while the other study holds its lock
            (results / sub).mkdir(parents=True, exist_ok=True)
            _new_tmp(results / sub / "diff.json").write_text("half")
        with folder_lock(results, sweep_all=True):
            left = sorted(str(p.relative_to(results)) for p in results.rglob("*.tmp"))
    assert [p.rsplit(".", 2)[0] for p in left] == ["other-study/diff.json", "other-study/seed0/diff.json"]


def test_the_command_line_knows_every_kind_of_output_folder():
    """Each owner registers its folder kind when imported; the command line imports all of them."""
    subprocess.run([sys.executable, "-c", "import difftransformer.cli\nfrom difftransformer._io import FOLDER_MARKERS\n"
                    "assert set(FOLDER_MARKERS) == {'prepared data', 'a training run', 'a study'}, FOLDER_MARKERS"],
                   check=True)
    from difftransformer._io import FOLDER_MARKERS
    from difftransformer.data.prepare import PREPARED_FILE
    from difftransformer.experiments.study_dir import MANIFEST_FILE
    from difftransformer.train.checkpoint import TRAIN_CONFIG_FILE
    from difftransformer.train.metrics import METRICS_FILE

    assert FOLDER_MARKERS == {"prepared data": (PREPARED_FILE,), "a training run": (TRAIN_CONFIG_FILE, METRICS_FILE),
                              "a study": (MANIFEST_FILE,)}


def test_broken_link_says_loop_missing_or_nothing(tmp_path):
    """The one check behind the messages about a symbolic link (convert's DST, the CLI's out dirs)."""
    from difftransformer._io import broken_link

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "real").mkdir()
    (tmp_path / "good").symlink_to(tmp_path / "real")
    assert [broken_link(tmp_path / n) for n in ("a", "dangling", "good", "real")] == ["loop", "missing", None, None]
