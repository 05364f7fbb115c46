"""`difftransformer convert SRC DST --to FORMAT`: folders that transformers' own from_pretrained (or ours)
loads and that compute the source's logits; the tokenizer travels along; bad inputs are one-line errors
and never unpickled; a refused conversion leaves no DST behind."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DiffLlamaForCausalLM, LlamaForCausalLM  # noqa: E402

from difftransformer.cli import main  # noqa: E402
from difftransformer.convert.unilm import SETTINGS_NAME  # noqa: E402
from difftransformer.model import DiffTransformerLM  # noqa: E402
from difftransformer.model.serialization import CONFIG_NAME, WEIGHTS_NAME, load_weights, read_pretrained  # noqa: E402
from difftransformer.train.run_dir import TOKENIZER_FILE  # noqa: E402
from tests.convert import config, ids, logits, ours, randomise_, rel, same_tensors  # noqa: E402

TOKENIZER = b'{"stand-in": "the run\'s tokenizer, copied byte for byte"}'


def saved(folder: Path, attention: str = "diff", **overrides) -> DiffTransformerLM:
    """A random model of ours saved into `folder` (a final/-like folder with a tokenizer)."""
    model = ours(config(attention, **overrides))
    model.save_pretrained(folder)
    (folder / TOKENIZER_FILE).write_bytes(TOKENIZER)
    return model


def load_ours(folder: Path) -> DiffTransformerLM:
    cfg, weights = read_pretrained(folder)
    model = DiffTransformerLM(dataclasses.replace(cfg, attn_backend="sdpa")).eval()
    load_weights(model, weights)
    return model


def from_pretrained(cls, folder: Path):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def convert(src: Path, dst: Path, to: str) -> int:
    return main(["convert", str(src), str(dst), "--to", to])


def test_ours_to_diffllama_and_back(tmp_path):
    model = saved(tmp_path / "ours", gqa=True)
    assert convert(tmp_path / "ours", tmp_path / "dl", "diffllama") == 0
    dl = from_pretrained(DiffLlamaForCausalLM, tmp_path / "dl")
    assert rel(logits(dl, ids()), logits(model, ids())) < 1e-5
    assert (tmp_path / "dl" / TOKENIZER_FILE).read_bytes() == TOKENIZER
    assert convert(tmp_path / "dl", tmp_path / "back", "difftransformer") == 0
    assert rel(logits(load_ours(tmp_path / "back"), ids()), logits(model, ids())) < 1e-5


def test_a_diffllama_saved_by_transformers_converts(tmp_path, capsys):
    saved(tmp_path / "seed", gqa=True, tied=True)
    assert convert(tmp_path / "seed", tmp_path / "dl", "diffllama") == 0
    dl = randomise_(from_pretrained(DiffLlamaForCausalLM, tmp_path / "dl"), seed=3)
    dl.save_pretrained(tmp_path / "hf")  # transformers' own folder (tied head stored once)
    assert convert(tmp_path / "hf", tmp_path / "ours", "ours") == 0  # the name before "difftransformer"
    out, err = capsys.readouterr()
    assert "converted" in out and "(difftransformer)" in out
    assert "--to ours is now --to difftransformer; 'ours' will be removed in the next release" in err
    assert rel(logits(load_ours(tmp_path / "ours"), ids()), logits(dl, ids())) < 1e-5


def test_ours_to_llama_and_back_is_exact(tmp_path):
    model = saved(tmp_path / "ours", "transformer", gqa=True, tied=False)
    assert convert(tmp_path / "ours", tmp_path / "llama", "llama") == 0
    assert rel(logits(from_pretrained(LlamaForCausalLM, tmp_path / "llama"), ids()), logits(model, ids())) < 1e-5
    assert convert(tmp_path / "llama", tmp_path / "back", "difftransformer") == 0
    assert same_tensors(load_ours(tmp_path / "back").state_dict(), model.state_dict())


def test_a_run_folder_converts_its_final_to_the_authors_layout_and_back(tmp_path):
    model = saved(tmp_path / "run" / "final")
    assert convert(tmp_path / "run", tmp_path / "unilm", "unilm") == 0
    written = sorted(p.name for p in (tmp_path / "unilm").iterdir())
    assert written == sorted([WEIGHTS_NAME, SETTINGS_NAME, TOKENIZER_FILE])
    settings = json.loads((tmp_path / "unilm" / SETTINGS_NAME).read_text())
    assert settings["attention"]["num_heads"] == 4
    assert convert(tmp_path / "unilm", tmp_path / "back", "difftransformer") == 0
    assert same_tensors(load_ours(tmp_path / "back").state_dict(), model.state_dict())


class _Marker:
    """Unpickling this creates a file: proof that something ran pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _fails(capsys, src: Path, dst: Path, to: str, needle: str) -> None:
    assert convert(src, dst, to) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("difftransformer convert: error:") and "\n" not in err and needle in err, err


def test_bad_inputs_are_one_line_errors_and_nothing_is_unpickled(tmp_path, capsys):
    dst = tmp_path / "dst"
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    _fails(capsys, tmp_path / "notes.txt", dst, "difftransformer", "is a file; convert reads a checkpoint folder")
    (tmp_path / "empty").mkdir()
    _fails(capsys, tmp_path / "empty", dst, "difftransformer", "is not a checkpoint folder")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / CONFIG_NAME).write_text(json.dumps({"model_type": "gpt2"}))
    _fails(capsys, tmp_path / "gpt2", dst, "difftransformer", "describes a model of type 'gpt2'")
    (tmp_path / "gpt2" / CONFIG_NAME).write_text("{not json")
    _fails(capsys, tmp_path / "gpt2", dst, "difftransformer", "is not a JSON config")

    src, marker = tmp_path / "ours", tmp_path / "unpickled"
    saved(src)
    (src / WEIGHTS_NAME).write_bytes(pickle.dumps({"embed_tokens.weight": _Marker(marker)}))
    _fails(capsys, src, dst, "unilm", "is not a readable safetensors file")
    (src / WEIGHTS_NAME).rename(src / "pytorch_model.bin")
    _fails(capsys, src, dst, "unilm", "holds only pickled weights (pytorch_model.bin)")
    assert not marker.exists() and not dst.exists()


def test_refusals_leave_no_destination(tmp_path, capsys):
    saved(tmp_path / "headnorm", "transformer_headnorm")
    _fails(capsys, tmp_path / "headnorm", tmp_path / "dst", "llama", "head-wise RMSNorm that LlamaForCausalLM lacks")
    _fails(capsys, tmp_path / "headnorm", tmp_path / "dst", "difftransformer", "is already in format 'difftransformer'")
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst*"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    saved(tmp_path / "diff")
    _fails(capsys, tmp_path / "diff", tmp_path / "full", "unilm", "already exists and is not an empty folder")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    # a conversion the tensors do not fit (config edited) fails before anything is written
    cfg = json.loads((tmp_path / "diff" / CONFIG_NAME).read_text())
    (tmp_path / "diff" / CONFIG_NAME).write_text(json.dumps(cfg | {"num_hidden_layers": 4}))
    _fails(capsys, tmp_path / "diff", tmp_path / "dst", "diffllama", "missing layers.3.")
    assert not (tmp_path / "dst").exists()


def test_help_lists_the_formats(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "difftransformer, diffllama, llama, unilm" in text
    assert "--to ours, the name difftransformer had before, still works and will be removed" in text


def test_a_transformers_folder_gets_the_eos_token_of_our_tokenizer(tmp_path):
    """transformers reads special tokens from tokenizer_config.json: without it, the exported tokenizer
    has no EOS and neither generation nor `eval` can end a document. EOS starts every text encoded with
    special tokens (transformers' default), as training puts it before every document."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from difftransformer.data.tokenizer import EOS_TOKEN

    saved(tmp_path / "ours", gqa=True)
    vocab = {EOS_TOKEN: 0, **{w: i + 1 for i, w in enumerate(["the", "union", "is", "strong"])}, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "ours" / TOKENIZER_FILE))
    assert convert(tmp_path / "ours", tmp_path / "dl", "diffllama") == 0
    loaded = AutoTokenizer.from_pretrained(tmp_path / "dl")
    assert loaded.eos_token == EOS_TOKEN and loaded.eos_token_id == 0
    assert loaded("the union is strong")["input_ids"] == [0, 1, 2, 3, 4]  # EOS first, as training put it
    assert loaded("the union is strong", add_special_tokens=False)["input_ids"] == [1, 2, 3, 4]
    assert convert(tmp_path / "dl", tmp_path / "back", "difftransformer") == 0  # and it travels back with the tokenizer
    assert (tmp_path / "back" / "tokenizer_config.json").is_file()


def test_transformers_generate_stops_where_ours_does(tmp_path):
    """A converted folder's config.json names our tokenizer's EOS (id 3 here, so it is not a default), also after a
    round trip through ours: transformers' generate stops at <|endoftext|> where `difftransformer generate` does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from difftransformer.data.tokenizer import EOS_TOKEN

    saved(tmp_path / "ours", gqa=True)
    vocab = {**{w: i for i, w in enumerate(["the", "union", "is"])}, EOS_TOKEN: 3, "strong": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "ours" / TOKENIZER_FILE))
    for fmt, cls in (("diffllama", DiffLlamaForCausalLM), ("llama", None)):
        if cls is None:  # llama needs the transformer kind
            saved(tmp_path / "t", "transformer")
            tok.save(str(tmp_path / "t" / TOKENIZER_FILE))
            src, cls = tmp_path / "t", LlamaForCausalLM
        else:
            src = tmp_path / "ours"
        assert convert(src, tmp_path / fmt, fmt) == 0
        assert json.loads((tmp_path / fmt / CONFIG_NAME).read_text())["eos_token_id"] == 3
        model = from_pretrained(cls, tmp_path / fmt)
        assert model.generation_config.eos_token_id == 3
        head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features)
        with torch.no_grad():  # EOS is the argmax everywhere: generate must stop after one token
            head.weight.zero_()
            head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(3), head.out_features).float())
        model.lm_head = head
        out = model.generate(torch.tensor([[0, 1, 2]]), max_new_tokens=5, do_sample=False)
        assert out[0, 3:].tolist() == [3], out
    assert convert(tmp_path / "diffllama", tmp_path / "back", "difftransformer") == 0
    assert convert(tmp_path / "back", tmp_path / "dl2", "diffllama") == 0  # ours: the tokenizer's EOS
    assert json.loads((tmp_path / "dl2" / CONFIG_NAME).read_text())["eos_token_id"] == 3


def test_a_transformers_folders_special_ids_and_generation_settings_travel_both_ways(tmp_path, capsys):
    """A Llama folder's special-token ids (config.json), generation_config.json and chat template go to our folder
    and back: transformers' generate reads the same EOS ids from each, so each stops where the source stops. A
    source whose attention has dropout is refused (the model we write has none)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    import difftransformer.hf  # noqa: F401  (our folders through AutoModelForCausalLM)

    saved(tmp_path / "t", "transformer")
    assert convert(tmp_path / "t", tmp_path / "llama", "llama") == 0
    source = tmp_path / "llama"
    cfg = json.loads((source / CONFIG_NAME).read_text())
    (source / CONFIG_NAME).write_text(json.dumps(cfg | {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 5}))
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=5, repetition_penalty=1.05).save_pretrained(
        source)
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert convert(source, tmp_path / "ours", "difftransformer") == 0
    assert convert(tmp_path / "ours", tmp_path / "back", "llama") == 0
    for folder in (tmp_path / "ours", tmp_path / "back"):
        written = json.loads((folder / CONFIG_NAME).read_text())
        assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, 5), folder
        assert (folder / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()
        generation = AutoModelForCausalLM.from_pretrained(folder).generation_config
        assert generation.eos_token_id == [2, 3] and generation.repetition_penalty == 1.05, folder
    (source / CONFIG_NAME).write_text(json.dumps(cfg | {"attention_dropout": 0.1}))
    _fails(capsys, source, tmp_path / "dst", "difftransformer", "sets attention_dropout=0.1; only 0 converts")
