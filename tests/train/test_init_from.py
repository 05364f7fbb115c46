"""Starting a run from a model folder (`TrainConfig.init_from`, `train --init-from`): the weights at step 0
are the folder's, the model and tokenizer come from it, and every way of getting it wrong is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from difftransformer.model import DiffTransformerLM
from difftransformer.model.serialization import CONFIG_NAME
from difftransformer.run_config import ConfigError, load_run_config
from difftransformer.train import RunDir, train
from tests.helpers import cli_fails, make_cfg, tiny


@pytest.fixture(scope="module")
def source(data_dir, tmp_path_factory):
    """A trained tiny DIFF model's final/ folder (config, weights, tokenizer)."""
    out = tmp_path_factory.mktemp("init_source")
    train(tiny("diff"), make_cfg(data_dir, out, max_steps=3, eval_interval=3, ckpt_interval=3))
    return RunDir(out).final


def test_the_run_starts_from_the_folder_weights(source, data_dir, tmp_path):
    start = DiffTransformerLM.from_pretrained(source).state_dict()
    cfg = make_cfg(data_dir, tmp_path, max_steps=2, init_from=str(source), trainable="attention")
    end = train(DiffTransformerLM.from_pretrained(source).config, cfg).model.state_dict()
    frozen = [k for k in start if ".self_attn." not in k]
    assert frozen and all(torch.equal(start[k], end[k]) for k in frozen)  # a random init would differ everywhere
    assert any(not torch.equal(start[k], end[k]) for k in start if ".self_attn." in k)
    recorded = json.loads((tmp_path / "train_config.json").read_text())
    assert recorded["init_from"] == str(source)


def test_the_first_loss_is_the_source_models(source, data_dir, tmp_path):
    """Step 1's loss is the loss of the source's weights (as init_state gives it), not of a fresh init."""
    from difftransformer.train.metrics import read_metrics

    config = DiffTransformerLM.from_pretrained(source).config

    def first_loss(name, init_state=None, **kw):
        train(config, make_cfg(data_dir, tmp_path / name, max_steps=1, eval_interval=1, **kw), init_state=init_state)
        return read_metrics(tmp_path / name / "metrics.jsonl", "train")[0]["loss"]

    via_folder = first_loss("folder", init_from=str(source))
    via_state = first_loss("state", init_state=DiffTransformerLM.from_pretrained(source).state_dict())
    fresh = first_loss("fresh")
    assert via_folder == via_state and abs(via_folder - fresh) > 1e-2


def test_a_resumed_run_ignores_init_from(source, data_dir, tmp_path):
    config = DiffTransformerLM.from_pretrained(source).config
    train(config, make_cfg(data_dir, tmp_path, max_steps=3, init_from=str(source)))
    again = train(config, make_cfg(data_dir, tmp_path, max_steps=6, init_from=str(source)))
    assert again.final_step == 6


def test_init_state_and_init_from_exclude_each_other(source, data_dir, tmp_path):
    model = DiffTransformerLM.from_pretrained(source)
    with pytest.raises(ValueError, match="either init_state or TrainConfig.init_from"):
        train(model.config, make_cfg(data_dir, tmp_path, init_from=str(source)), init_state=model.state_dict())


def test_a_model_config_other_than_the_folders_is_refused(source, data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"differs from the one in init_from .*hidden_size"):
        train(tiny("diff", hidden_size=96), make_cfg(data_dir, tmp_path, init_from=str(source)))
    assert not (tmp_path / "checkpoints").exists()


def test_the_run_config_takes_model_and_tokenizer_from_the_folder(source):
    cfg = load_run_config(overrides=[f"train.init_from={json.dumps(str(source))}", "model.attn_backend=\"eager\""])
    want = DiffTransformerLM.from_pretrained(source).config
    assert cfg.model.to_dict() == {**want.to_dict(), "attn_backend": "eager"}
    assert cfg.data.tokenizer_path == str(source / "tokenizer.json")
    assert "tokenizer-" in cfg.train.data_dir  # named by the tokenizer's content, not the generic file name
    cfg.resolve_vocab(want.vocab_size - 1)  # a smaller tokenizer keeps the folder's embedding
    assert cfg.model.vocab_size == want.vocab_size
    with pytest.raises(ConfigError, match="token embeddings but the data's tokenizer has"):
        cfg.resolve_vocab(want.vocab_size + 1)


@pytest.mark.parametrize("setting, needle", [
    ("model.hidden_size=64", "hidden_size cannot be set with init_from"),
    ("model.preset=\"tiny\"", "preset cannot be set with init_from"),
    ("model.hiden_size=64", "did you mean 'hidden_size'"),
])
def test_model_settings_that_change_the_model_are_refused(source, setting, needle):
    with pytest.raises(ConfigError, match=needle):
        load_run_config(overrides=[f"train.init_from={json.dumps(str(source))}", setting])


def test_another_tokenizer_than_the_models_is_refused(source, tmp_path):
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["zz-not-in-the-models"] = vocab.pop(next(iter(vocab)))  # one token renamed: another tokenizer
    other = tmp_path / "other.json"
    other.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="is not the tokenizer saved with the model"):
        load_run_config(overrides=[f"train.init_from={json.dumps(str(source))}",
                                   f"data.tokenizer_path={json.dumps(str(other))}"])
    same = tmp_path / "same.json"  # other bytes (indented), the same tokenizer: accepted
    same.write_text(json.dumps(json.loads((source / "tokenizer.json").read_text()), indent=1))
    cfg = load_run_config(overrides=[f"train.init_from={json.dumps(str(source))}",
                                     f"data.tokenizer_path={json.dumps(str(same))}"])
    assert cfg.data.tokenizer_path == str(same)


def test_the_command_trains_from_the_folder(source, data_dir, tmp_path, capsys):
    from difftransformer.cli import main

    out = tmp_path / "run"
    argv = ["train", "--init-from", str(source), "--out-dir", str(out), "--set", f"data.data_dir={data_dir}",
            "--set", f"data.corpus={Path(data_dir).parent / 'corpus'}",
            "--set", "train.max_steps=2", "--set", "train.seq_len=32", "--set", "train.batch_size=4",
            "--set", "train.progress=false", "--set", "train.tensorboard=false", "--set", "train.device=cpu"]
    assert main(argv) == 0
    assert "done: step 2" in capsys.readouterr().out
    assert json.loads((out / "train_config.json").read_text())["init_from"] == str(source)


def test_command_line_mistakes_are_one_line(source, tmp_path, capsys):
    cli_fails(capsys, ["train", "--init-from", str(source), "--preset", "tiny"], "drop --preset/--attention")
    cli_fails(capsys, ["train", "--init-from", str(tmp_path / "missing")], "does not exist")
    cli_fails(capsys, ["train", "--init-from", str(tmp_path)], "has no config.json")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / CONFIG_NAME).write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    cli_fails(capsys, ["train", "--init-from", str(llama)], "holds a 'llama' model", "--to difftransformer")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copyfile(source / CONFIG_NAME, no_weights / CONFIG_NAME)
    cli_fails(capsys, ["train", "--init-from", str(no_weights)], "has no model.safetensors")
    cli_fails(capsys, ["train", "--set", "train.init_from=\"\""], "init_from is empty")
    cli_fails(capsys, ["compare", "--set", f"train.init_from={json.dumps(str(source))}"],
              "a study starts every arm of a seed from one paired random init")


def test_data_tokenized_with_another_tokenizer_is_refused(source, tmp_path):
    from difftransformer.data import prepare_data
    from tests.helpers import write_corpus

    corpus = write_corpus(tmp_path / "corpus", n_docs=12, seed=3)
    prepare_data(corpus=str(corpus), out_dir=tmp_path / "data", vocab_size=280)
    config = DiffTransformerLM.from_pretrained(source).config
    with pytest.raises(ValueError, match="tokenized with another tokenizer than the model's"):
        train(config, make_cfg(str(tmp_path / "data"), tmp_path / "run", init_from=str(source)))
    assert not (tmp_path / "run" / "checkpoints").exists()
