"""Fault injection through the real command line: kill -9 at random points of `compare`, `prepare` and `eval`,
then run the same command again. Nothing is lost or mixed: the results equal an uninterrupted run's.

The kill times are drawn from a seeded generator, so a failure reproduces; the runs are tiny, so the
whole module stays within about a minute and a half on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from difftransformer.cli import main
from difftransformer.data import PreparedData

ROOT = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-m", "difftransformer", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _kill_after(proc: subprocess.Popen, seconds: float, once: Path | None = None) -> bool:
    """SIGKILL `proc` `seconds` after it (re)writes `once` (or after its start), unless it ended first;
    True when it was killed. Waiting for a file makes the kill land in a chosen phase on any machine."""
    started, deadline = time.time(), time.monotonic() + 120

    def written() -> bool:
        try:
            return once.stat().st_mtime >= started
        except FileNotFoundError:
            return False

    while once is not None and not written() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "final" / "model.safetensors"))


def test_compare_killed_at_random_points_ends_as_if_never_killed(workdir, tmp_path):
    longer = ("--set", "train.max_steps=48", "--set", "train.ckpt_interval=4", "--set", "train.eval_interval=16",
              "--set", "compare.sample_tokens=2")
    reference = tmp_path / "reference"
    assert main(["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(reference), *longer]) == 0
    out = tmp_path / "killed"
    argv = ("compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out), *longer)
    rng = random.Random(13)
    phases = [out / "compare.json", out / "diff" / "metrics.jsonl", out / "diff" / "checkpoints" / "latest",
              out / "transformer" / "metrics.jsonl", out / "transformer" / "final"]
    kills = sum(_kill_after(_cli(*argv), rng.uniform(0.0, 0.6), rng.choice(phases)) for _ in range(4))
    assert kills >= 1
    assert main(list(argv)) == 0  # the same command continues and finishes
    for arm in ("diff", "transformer"):
        a, b = _weights(out / arm), _weights(reference / arm)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (arm, kills)
    assert not list(out.rglob("*.tmp")) and not (out / "diff" / "checkpoints.replaced").exists()


def test_prepare_killed_while_re_preparing_never_leaves_a_usable_mix(workdir, tmp_path):
    data = tmp_path / "data"
    first = ("prepare", str(workdir / "corpus"), "--out-dir", str(data), "--vocab-size", "300")
    assert main(list(first)) == 0
    rng = random.Random(7)
    for vocab in (280, 290, 260):
        proc = _cli("prepare", str(workdir / "corpus"), "--out-dir", str(data), "--vocab-size", str(vocab))
        _kill_after(proc, rng.uniform(0.0, 1.0), data / ".lock")
        if PreparedData.exists(data):  # old data or new, never a mix: whatever a manifest names is whole
            PreparedData.load(data).verify()
    assert main(list(first)) == 0
    prepared = PreparedData.load(data)
    prepared.verify()
    assert prepared.vocab_size <= 300 and not list(data.glob("*.tmp"))


def test_a_second_writer_started_mid_run_is_refused_and_the_first_finishes(workdir, tmp_path):
    out = tmp_path / "busy"
    argv = ("train", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out), "--set", "train.max_steps=40")
    first = _cli(*argv)
    deadline = time.monotonic() + 60
    while not (out / ".lock").is_file() or not (out / ".lock").read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.05)
    # The first is paused while it holds the lock, so the second (a fresh Python importing torch, seconds)
    # meets it mid-run on any machine, however fast the first's 40 steps would otherwise be.
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = _cli(*argv)
        assert second.wait(timeout=60) == 2 and f"pid {first.pid}" in second.stderr.read()
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()]
    assert len(steps) == 30 and max(steps) == 40  # the first run's log is whole: 20 train rows and 10 val rows


def _evaluated(folder: Path) -> dict[str, object]:
    """What an evaluation decided, by file: each result's metrics, details and settings (no timings), and each
    figure's bytes; every JSON's figure hash must be its PNG's."""
    out: dict[str, object] = {}
    for path in sorted(folder.rglob("*.json")):
        record = json.loads(path.read_text())
        if "metrics" in record and "task" in record:  # eval/<task>.json
            png = path.with_suffix(".png")
            figure = hashlib.sha256(png.read_bytes()).hexdigest() if png.is_file() else None
            assert record["provenance"]["figure_sha256"] == figure, path
            out[str(path.relative_to(folder))] = (record["metrics"], record["details"], record["settings"])
        elif "evals" in record:  # a study's result file
            out[str(path.relative_to(folder))] = {t: (e["metrics"], e["provenance"]["figure_sha256"])
                                                  for t, e in record["evals"].items()}
    out.update({str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.png"))
                if p.parent.name in ("eval", "by-hand")})
    return out


def test_eval_and_a_studys_evaluation_killed_at_random_points_end_as_if_never_killed(compared, workdir, tmp_path):
    """kill -9 at random points of `eval` and of a study's evaluation phase (its units trained, evaluation
    tasks added), then the same command in full: every result, figure and result file equals an uninterrupted
    run's, nothing is left half-written, and every figure belongs to its JSON."""
    rng = random.Random(5)
    copies = {name: Path(shutil.copytree(compared, tmp_path / name)) for name in ("reference", "killed")}
    tasks = ("--set", 'compare.eval_tasks=["heldout-loss"]')
    for name, study in copies.items():
        one = ("eval", "outliers", str(study / "diff"), "--tokens", "4096", "--out-dir", str(study / "by-hand"))
        again = ("compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(study), *tasks)
        if name == "killed":
            for argv, lock, late in ((one, study / "by-hand" / ".lock", 1.0),
                                     (again, study / "diff" / "eval" / ".lock", 1.0)):
                for _ in range(2):
                    _kill_after(_cli(*argv), rng.uniform(0.0, late), lock)
        assert main(list(one)) == 0 and main(list(again)) == 0
    reference, killed = (_evaluated(copies[n]) for n in ("reference", "killed"))
    assert killed.keys() == reference.keys() and len(reference) >= 6
    assert killed == reference
    assert not list(copies["killed"].rglob("*.tmp*"))
