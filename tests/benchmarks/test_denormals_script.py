"""benchmarks/denormals.py runs end to end on a model of a prepared task (tiny sizes: its timings mean nothing here,
only the table's shape), and refuses a corpus folder in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftransformer import DiffTransformerLM, get_preset
from difftransformer.data.ood import MQAR
from difftransformer.data.prepare import prepare_task

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "denormals.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_prints_both_models_with_kept_flushed_and_their_ratio(tmp_path):
    family = MQAR(min_pairs=2, max_pairs=4, min_context=16, max_context=24, queries=2)
    data = prepare_task(family, tmp_path / "data")
    cfg = get_preset("tiny").config("transformer")
    cfg = type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size, "max_position_embeddings": 64})
    DiffTransformerLM(cfg).save_pretrained(tmp_path / "final")
    run = _run("--checkpoint", str(tmp_path / "final"), "--data-dir", str(data.out_dir), "--batch-size", "2",
               "--rounds", "3")
    assert run.returncode == 0, run.stderr
    rows = {cells[0]: cells[1:] for line in run.stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.split("|")[1:-1]]] if cells[0] != "model"}
    assert set(rows) == {"trained", "fresh initialisation"} and all(len(r) == 3 for r in rows.values())
    assert "mqar, 2 x " in run.stdout and "3 rounds" in run.stdout


def test_refuses_a_corpus_folder_in_one_line(tmp_path, data_dir):
    run = _run("--checkpoint", str(tmp_path), "--data-dir", str(data_dir))
    assert run.returncode == 2 and "holds a corpus, not a synthetic task" in run.stderr.splitlines()[-1]
