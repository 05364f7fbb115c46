"""Fixtures of the CLI tests: a tiny corpus and run config, and one real `compare` run shared by several tests."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from difftransformer.cli import main

TINY_TRAIN = dict(seq_len=32, batch_size=8, max_steps=8, warmup_steps=2, eval_interval=4, eval_batches=2,
                  log_interval=2, ckpt_interval=4, progress=False, tensorboard=False, device="cpu")


WORDS = ("the union congress people nation state law year war peace freedom economy work tax our we must "
         "will and of to in a is for").split()


def tiny_run_config(workdir: Path, tmp_path: Path, **train) -> str:
    """A run config file in tmp_path for the workdir's tiny DIFF run on its corpus, with its own data folder
    (tmp_path/data) and `train` overriding TINY_TRAIN."""
    data = {"corpus": str(workdir / "corpus"), "vocab_size": 300, "data_dir": str(tmp_path / "data"),
            "val_fraction": 0.2, "test_fraction": 0.1}
    path = tmp_path / "run.toml"
    path.write_text(_toml({"model": {"preset": "tiny", "attention": "diff"}, "train": {**TINY_TRAIN, **train},
                           "data": data}))
    return str(path)


def trained_model(workdir: Path, tmp_path: Path, **train) -> Path:
    """The final folder of a tiny run trained with `tiny_run_config(workdir, tmp_path, **train)` into
    tmp_path/run, copied to tmp_path/model (a model folder of its own, free to be damaged)."""
    run = tmp_path / "run"
    assert main(["train", "--config", tiny_run_config(workdir, tmp_path, **train), "--out-dir", str(run)]) == 0
    model = tmp_path / "model"
    shutil.copytree(run / "final", model)
    return model


def last_error_line(capsys) -> str:
    """The last line the command wrote to stderr, after checking it printed no traceback."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


def _toml(d: dict) -> str:
    out = []
    for section, body in d.items():
        out.append(f"[{section}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny corpus (12 documents) and a tiny run config pointing at it."""
    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(1200)) + ".\n")
    cfg = {"model": {"preset": "tiny", "attention": "diff"}, "train": TINY_TRAIN,
           "data": {"corpus": str(corpus), "vocab_size": 300, "data_dir": str(root / "data"),
                    "val_fraction": 0.2, "test_fraction": 0.1},
           "compare": {"prompts": ["the union", "we must"], "sample_tokens": 8}}
    (root / "tiny.toml").write_text(_toml(cfg))
    return root


@pytest.fixture(scope="module")
def compared(workdir) -> Path:
    """One real `compare` run (DIFF vs matched Transformer, one seed) shared by several tests."""
    out = workdir / "cmp"
    assert main(["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny transformers Llama folder with a tokenizer.json (context 128), and a calibration text beside it."""
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {w: i for i, w in enumerate(["[UNK]", *(f"w{i}" for i in range(299))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    text = folder.parent / "calib.txt"
    text.write_text(" ".join(f"w{i % 299}" for i in range(1000)))
    return folder, text


def train_argv(workdir: Path, out: Path, *sets: str) -> list[str]:
    """`train` of the workdir's tiny run config into `out`, each of `sets` a `--set` override."""
    argv = ["train", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out)]
    for item in sets:
        argv += ["--set", item]
    return argv


@pytest.fixture
def links(tmp_path) -> Path:
    """tmp_path/links with `dangling` (to a missing path), `to_empty` (to an empty folder) and `loopA`/`loopB`
    (each to the other)."""
    root = tmp_path / "links"
    (root / "empty").mkdir(parents=True)
    (root / "dangling").symlink_to(root / "missing")
    (root / "to_empty").symlink_to(root / "empty")
    (root / "loopA").symlink_to(root / "loopB")
    (root / "loopB").symlink_to(root / "loopA")
    return root


def no_work_left(links: Path) -> None:
    """Nothing was written beside the `links` fixture's links (no `.DST.converting-PID`), and the empty target
    stayed empty."""
    assert sorted(p.name for p in links.iterdir()) == ["dangling", "empty", "loopA", "loopB", "to_empty"]
    assert not any((links / "empty").iterdir())
