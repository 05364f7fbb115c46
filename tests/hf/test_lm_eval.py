"""lm-evaluation-harness on our checkpoints (difftransformer.hf.lm_eval): offline, local tasks, our numbers.

A tiny model of ours is saved as a run's final/ is (config.json, model.safetensors, tokenizer.json and
nothing else), and `python -m difftransformer.hf.lm_eval run --model hf --model_args pretrained=DIR`
evaluates local JSONL tasks on it with the hub and datasets offline. Every log-likelihood the harness
reports must equal our own scoring (eval/lm.py: `continuation_logprob` for multiple choice,
`token_nll` after EOS for rolling perplexity), and its accuracy the one our scores give, so a missing
or doubled EOS, a tokenizer that differs from ours or a model that is not ours fails the test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from transformers import AutoTokenizer  # noqa: E402

from difftransformer.data.tokenizer import EOS_TOKEN, Tokenizer  # noqa: E402
from difftransformer.eval.lm import continuation_logprob, generate_text, token_nll  # noqa: E402
from difftransformer.hf.lm_eval import DiffTransformerTokenizerFast, save_tokenizer_for_transformers  # noqa: E402
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM  # noqa: E402

WORDS = "the cat dog sat on mat red blue sky is a big small house tree ran under".split()
ITEMS = [  # multiple choice: lm-eval scores " " + choice after the context (its default target_delimiter)
    {"context": "the cat sat on the", "choices": ["mat", "sky", "tree"], "label": 0},
    {"context": "a big red", "choices": ["house", "dog", "is"], "label": 1},
    {"context": "the sky is", "choices": ["blue", "small", "on the mat"], "label": 0},
    {"context": "a small dog ran", "choices": ["on", "the", "under a tree"], "label": 2},
    {"context": "the dog", "choices": ["sat", "is blue", "red"], "label": 1},
]
TEXTS = ["the cat sat on the mat.", "a big red house is under the blue sky", "the dog ran."]


@pytest.fixture(scope="module")
def final(tmp_path_factory) -> Path:
    """A folder as a run's final/ is: config.json, model.safetensors and the raw tokenizers tokenizer.json."""
    import random

    rng = random.Random(0)
    tok = Tokenizer.train([" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(40)], vocab_size=300)
    torch.manual_seed(0)
    cfg = DiffTransformerConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                max_position_embeddings=128, initializer_range=0.1)  # wide init: scores differ
    folder = tmp_path_factory.mktemp("run") / "final"
    DiffTransformerLM(cfg).save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    return folder


def ours(final: Path) -> tuple[DiffTransformerLM, Tokenizer]:
    return DiffTransformerLM.from_pretrained(final).eval(), Tokenizer.from_file(final / "tokenizer.json")


def run_lm_eval(final: Path, tmp_path: Path, monkeypatch, tasks: list[tuple[dict, list[dict]]], model_args: str = ""):
    """Write local tasks (a JSONL + a YAML each) into tmp_path and run our entry point on them, offline, in
    one process; {task name: (its results, its samples in document order)}."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # the datasets cache goes here, not to ~/.cache
    folder = tmp_path / "tasks"
    folder.mkdir()
    for task, rows in tasks:
        name = task["task"]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                 f"    test: {folder / f'{name}.jsonl'}", "test_split: test",
                 *(f"{k}: {json.dumps(v)}" for k, v in task.items() if k not in ("task", "metric_list")),
                 "metric_list:", *(f"  - metric: {m}" for m in task["metric_list"])]  # JSON values are YAML
        (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    names = [task["task"] for task, _ in tasks]
    out = tmp_path / "out"
    argv = ["run", "--model", "hf", "--model_args", f"pretrained={final},backend=causal{model_args}",
            "--tasks", *names, "--include_path", str(folder), "--device", "cpu", "--batch_size", "2",
            "--output_path", str(out), "--log_samples"]
    done = subprocess.run([sys.executable, "-m", "difftransformer.hf.lm_eval", *argv], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    data = json.loads(results.read_text())
    assert data["tokenizer_bos_token"] == data["tokenizer_eos_token"] == [EOS_TOKEN, "0"]  # (token, id as text)
    found = {}
    for name in names:
        [samples] = out.rglob(f"samples_{name}_*.jsonl")
        rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        found[name] = data["results"][name], rows
    return found


# ------------------------------------------------------------------------------ the tokenizer


def test_autotokenizer_reads_our_final_folder_as_eos_plus_our_ids(final):
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    tok = AutoTokenizer.from_pretrained(final)
    assert isinstance(tok, DiffTransformerTokenizerFast)
    _, mine = ours(final)
    for text in [*TEXTS, "a literal <|endoftext|> stays text", " leading space"]:
        assert tok(text)["input_ids"] == [mine.eos_id, *mine.encode(text)]
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == mine.eos_id
    plain = AutoTokenizer.from_pretrained(final, add_bos_token=False)  # what rolling-perplexity tasks use
    assert plain(TEXTS[0])["input_ids"] == mine.encode(TEXTS[0])
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before  # nothing written, tokenizer.json unchanged


def test_exported_tokenizer_is_plain_transformers_and_encodes_the_same(final, tmp_path):
    out = save_tokenizer_for_transformers(final / "tokenizer.json", tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(out)
    assert not isinstance(tok, DiffTransformerTokenizerFast)  # the generic class: no difftransformer needed
    _, mine = ours(final)
    for text in TEXTS:
        assert tok(text)["input_ids"] == [mine.eos_id, *mine.encode(text)]
    with pytest.raises(ValueError, match="is the folder of .*tokenizer.json.*sha256.*Choose another out_dir"):
        save_tokenizer_for_transformers(final / "tokenizer.json", final)


def test_missing_or_foreign_tokenizer_is_refused_by_name(final, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((final / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json.*Copy that file"):
        AutoTokenizer.from_pretrained(bare)
    foreign = Tokenizer.train(TEXTS * 5, vocab_size=270, special_tokens=("<eos>",))
    foreign.save(bare / "tokenizer.json")
    with pytest.raises(ValueError, match=r"no '<\|endoftext\|>' token"):
        AutoTokenizer.from_pretrained(bare)


# ------------------------------------------------------------------------------ the harness


def test_lm_eval_multiple_choice_and_generation_equal_ours(final, tmp_path, monkeypatch):
    mc = dict(task="dt_tiny_mc", output_type="multiple_choice", doc_to_text="{{context}}",
              doc_to_choice="{{choices}}", doc_to_target="{{label}}", metric_list=["acc"])
    gen = dict(task="dt_tiny_gen", output_type="generate_until", doc_to_text="{{context}}", doc_to_target="{{answer}}",
               generation_kwargs={"until": ["."], "max_gen_toks": 6, "do_sample": False}, metric_list=["exact_match"])
    prompts = [item["context"] for item in ITEMS]
    found = run_lm_eval(final, tmp_path, monkeypatch, [
        (mc, ITEMS), (gen, [{"context": p, "answer": "x"} for p in prompts])])
    model, tok = ours(final)

    result, samples = found["dt_tiny_mc"]
    correct, no_eos_gap = [], 0.0
    for item, sample in zip(ITEMS, samples, strict=True):
        got = [(float(ll), is_greedy == "True") for [[ll, is_greedy]] in sample["resps"]]
        want = [continuation_logprob(model, tok, item["context"], " " + c) for c in item["choices"]]
        for (ll, greedy), score in zip(got, want, strict=True):
            assert ll == pytest.approx(score.logprob, abs=1e-4)
            assert greedy == score.greedy
        correct.append(max(range(len(want)), key=lambda i: want[i].logprob) == item["label"])
        with torch.no_grad():  # the same items scored without the leading EOS: what the test must tell apart
            ids = torch.tensor([tok.encode(item["context"] + " " + item["choices"][0])])
            n = len(tok.encode(" " + item["choices"][0]))
            no_eos = -token_nll(model, ids)[0, -n:].sum().item()
        no_eos_gap = max(no_eos_gap, abs(no_eos - got[0][0]))
    assert result["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert no_eos_gap > 1e-2  # the EOS before the context changes the scores, so the comparison above can fail

    _, samples = found["dt_tiny_gen"]  # greedy, left-padded batches of 2, cut at "." as lm-eval cuts
    for prompt, sample in zip(prompts, samples, strict=True):
        assert sample["resps"] == [[generate_text(model, tok, prompt, 6, temperature=0.0).text.split(".")[0]]]


def test_lm_eval_rolling_loglikelihood_equals_our_token_nll(final, tmp_path, monkeypatch):
    task = dict(task="dt_tiny_ppl", output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                metric_list=["word_perplexity", "byte_perplexity", "bits_per_byte"])
    rows = [{"text": t} for t in TEXTS]
    [(result, samples)] = run_lm_eval(final, tmp_path, monkeypatch, [(task, rows)], ",add_bos_token=False").values()
    model, tok = ours(final)
    total_nll = 0.0
    for text, sample in zip(TEXTS, samples, strict=True):
        [ll] = [float(x) for x in sample["filtered_resps"]]
        nll = token_nll(model, torch.tensor([[tok.eos_id, *tok.encode(text)]])).sum().item()  # EOS + text, as ours
        assert ll == pytest.approx(-nll, abs=1e-4)
        total_nll += nll
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    assert result["bits_per_byte,none"] == pytest.approx(total_nll / n_bytes / math.log(2), rel=1e-5)
