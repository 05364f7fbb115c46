"""Tests for the command line, run configs, the compare orchestration and the report (CPU, < 90 s)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from difftransformer.cli import main
from difftransformer.config_files import ConfigError, apply_overrides, load_run_config, parse_scalar
from difftransformer.eval.report import verdict, write_report

TINY_TRAIN = dict(seq_len=32, batch_size=8, max_steps=8, warmup_steps=2, eval_interval=4, eval_batches=2,
                  log_interval=2, ckpt_interval=4, progress=False, tensorboard=False, device="cpu")
WORDS = ("the union congress people nation state law year war peace freedom economy work tax our we must "
         "will and of to in a is for").split()


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


# ----------------------------------------------------------------------------------------------
# --help


@pytest.mark.parametrize("command, needles", [
    (None, ["prepare", "train", "compare", "generate", "report", "examples"]),
    ("prepare", ["--vocab-size", "--tokenizer", "--val-fraction", "--test-fraction", "--seed", "--force",
                 "--out-dir", "examples"]),
    ("train", ["--config", "--preset", "--attention", "--set", "--out-dir", "--no-resume", "torchrun", "examples"]),
    ("compare", ["--config", "--arms", "--seeds", "--set", "--out-dir", "--no-resume", "examples"]),
    ("generate", ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--tokenizer", "examples"]),
    ("report", ["--no-samples", "examples"]),
])
def test_help_mentions_key_options(command, needles, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"] if command else ["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in needles:
        assert needle in text, f"{needle!r} missing from `{command} --help`"


def test_python_dash_m_entry_point():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    r = subprocess.run([sys.executable, "-m", "difftransformer", "compare", "--help"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0 and "--seeds" in r.stdout


# ----------------------------------------------------------------------------------------------
# configs


def test_toml_and_yaml_configs_agree(tmp_path):
    (tmp_path / "a.toml").write_text('[model]\npreset = "tiny"\nattention = "transformer"\nhidden_size = 128\n'
                                     '[train]\nlr = 3e-4\nseq_len = 64\n[data]\nvocab_size = 512\n'
                                     '[compare]\narms = ["transformer", "diff"]\n')
    (tmp_path / "a.yaml").write_text("model: {preset: tiny, attention: transformer, hidden_size: 128}\n"
                                     "train: {lr: 3e-4, seq_len: 64}\ndata: {vocab_size: 512}\n"
                                     "compare: {arms: [transformer, diff]}\n")
    a, b = load_run_config(tmp_path / "a.toml"), load_run_config(tmp_path / "a.yaml")
    assert a.to_dict() == b.to_dict()
    assert a.model.attention == "transformer" and a.model.num_attention_heads == 4  # tiny: 2 DIFF heads = 4
    assert a.model.intermediate_size == round(8 * 128 / 3)  # a changed width re-derives the FFN
    assert a.train.lr == 3e-4 and a.train.data_dir == "cache/data/sotu-512"


def test_set_overrides_parse_scalars_and_win_over_the_file(tmp_path):
    (tmp_path / "c.toml").write_text('[model]\npreset = "tiny"\n[train]\nlr = 1e-3\n')
    cfg = load_run_config(tmp_path / "c.toml", attention="transformer",
                          overrides=["train.lr=3e-4", "train.max_steps=7", "train.tensorboard=false",
                                     "model.num_hidden_layers=3", "data.corpus=notes/", 'compare.arms=["diff"]',
                                     "model.lambda_init=0.5", "model.num_key_value_heads=null"])
    assert cfg.train.lr == 3e-4 and cfg.train.max_steps == 7 and cfg.train.tensorboard is False
    assert cfg.model.attention == "transformer" and cfg.model.num_hidden_layers == 3
    assert cfg.model.lambda_init == 0.5
    assert cfg.data.corpus == "notes/" and cfg.compare.arms == ["diff"]
    assert parse_scalar("[1, 2]") == [1, 2] and parse_scalar("none") is None and parse_scalar("abc") == "abc"


def test_preset_flag_and_head_counts_in_the_kinds_units():
    cfg = load_run_config(preset="cpu-small", attention="transformer", overrides=["model.num_attention_heads=4"])
    assert cfg.model.num_attention_heads == 4 and cfg.model.num_key_value_heads == 4 and cfg.model.head_dim == 64


def test_unknown_key_names_it_and_suggests(tmp_path):
    (tmp_path / "bad.toml").write_text('[model]\npreset = "tiny"\n[train]\nlearning_rat = 1e-3\n')
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "bad.toml")
    msg = str(e.value)
    assert "learning_rat" in msg and "[train]" in msg and "valid keys" in msg and "warmup_steps" in msg
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        load_run_config(overrides=["model.hiden_size=8"])
    with pytest.raises(ConfigError, match="did you mean 'vocab_size'"):
        load_run_config(overrides=["data.vocab_sise=8"])


def test_unknown_section_and_bare_set_key(tmp_path):
    (tmp_path / "s.yaml").write_text("trian:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trian\].*did you mean 'train'"):
        load_run_config(tmp_path / "s.yaml")
    with pytest.raises(ConfigError, match="did you mean train.lr"):
        apply_overrides({"model": {}, "train": {}, "data": {}, "compare": {}}, ["lr=1"])


def test_unknown_preset_lists_presets(tmp_path):
    (tmp_path / "p.toml").write_text('[model]\npreset = "cpu-smal"\n')
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "p.toml")
    assert "cpu-smal" in str(e.value) and "cpu-small" in str(e.value) and "tiny" in str(e.value)


def test_seq_len_above_the_model_limit_names_both():
    with pytest.raises(ConfigError) as e:
        load_run_config(preset="tiny", overrides=["train.seq_len=1024"])
    assert "1024" in str(e.value) and "max_position_embeddings" in str(e.value) and "256" in str(e.value)


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="unknown arm 'transfomer'.*did you mean 'transformer'"):
        load_run_config(preset="tiny", overrides=['compare.arms=["diff", "transfomer"]'])
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_run_config(preset="tiny", overrides=["train.lr_schedule=wavy"])


def test_cli_reports_config_errors_in_one_line(workdir, capsys):
    assert main(["train", "--config", str(workdir / "tiny.toml"), "--set", "train.max_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "max_stepz" in err and "did you mean 'max_steps'" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------
# end to end on the tiny corpus


def test_prepare_prints_a_summary(workdir, tmp_path, capsys):
    out = tmp_path / "prep"
    assert main(["prepare", str(workdir / "corpus"), "--out-dir", str(out), "--vocab-size", "300",
                 "--val-fraction", "0.2", "--test-fraction", "0.1"]) == 0
    text = capsys.readouterr().out
    assert (out / "prepared.json").is_file()
    for needle in ("train", "val", "test", "documents", "tokens", "300 tokens"):
        assert needle in text
    manifest = json.loads((out / "prepared.json").read_text())
    assert sum(manifest["num_documents"].values()) == 12


def test_compare_end_to_end(compared, capsys):
    for arm in ("diff", "transformer"):
        assert (compared / arm / "final" / "model.safetensors").is_file()
        assert (compared / arm / "final" / "tokenizer.json").is_file()
    report = (compared / "report.md").read_text()
    assert (compared / "loss_curves.png").stat().st_size > 1000 and (compared / "lambda.png").is_file()
    assert "![validation and training loss](loss_curves.png)" in report
    assert "| `diff` |" in report and "| `transformer` |" in report and "final val loss" in report
    assert "cannot separate" in report  # a single seed
    assert "λ per layer" in report and "Samples" in report and "greedy" in report
    # the "What was run" table: the DIFF arm's backward is deterministic, the baseline has no such option
    assert "deterministic backward" in report
    run_rows = [line for line in report.split("## What was run")[1].splitlines() if line.startswith("| `")]
    assert run_rows[0].startswith("| `diff` |") and run_rows[0].split("|")[-3].strip() == "yes"
    assert run_rows[1].startswith("| `transformer` |") and run_rows[1].split("|")[-3].strip() == "–"
    manifest = json.loads((compared / "compare.json").read_text())
    assert manifest["parameters"]["diff"] - manifest["parameters"]["transformer"] == 2 * 6 * 16  # 6d per layer
    # Paired init: every tensor the arms share by name and shape starts equal (checked via the λ-free FFN
    # would need the initial weights; instead check both arms saw the same batches: equal token counts).
    tokens = [json.loads(line)["tokens"] for arm in ("diff", "transformer")
              for line in (compared / arm / "metrics.jsonl").read_text().splitlines()[-1:]]
    assert tokens[0] == tokens[1] == 8 * 8 * 32


def test_compare_rerun_skips_finished_arms(compared, workdir, caplog):
    before = (compared / "diff" / "final" / "model.safetensors").stat().st_mtime_ns
    caplog.set_level("INFO")
    assert main(["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(compared)]) == 0
    assert (compared / "diff" / "final" / "model.safetensors").stat().st_mtime_ns == before
    assert "already finished" in caplog.text


def test_generate_prints_text(compared, capsys):
    assert main(["generate", str(compared / "diff"), "the union", "-n", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the union") and len(out.strip()) > len("the union")
    # from a checkpoint folder: the tokenizer comes from the run's prepared data
    assert main(["generate", str(compared / "transformer" / "checkpoints"), "--prompt", "we must", "-n", "4",
                 "--top-k", "5", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("we must") == 2 and "sample 2" in out
    # a compare folder is not a model: the error names the arms
    assert main(["generate", str(compared), "x"]) == 2
    assert "pick one arm" in capsys.readouterr().err


def test_report_command_rewrites_the_report(compared, capsys):
    (compared / "report.md").unlink()
    assert main(["report", str(compared), "--no-samples"]) == 0
    assert (compared / "report.md").is_file() and "cannot separate" in capsys.readouterr().out


def test_train_command_and_multi_seed_compare(workdir, tmp_path):
    run = tmp_path / "one"
    assert main(["train", "--config", str(workdir / "tiny.toml"), "--attention", "transformer",
                 "--set", "train.max_steps=4", "--out-dir", str(run)]) == 0
    assert (run / "final" / "config.json").is_file()
    assert json.loads((run / "final" / "config.json").read_text())["attention"] == "transformer"

    out = tmp_path / "seeds"
    assert main(["compare", "--config", str(workdir / "tiny.toml"), "--out-dir", str(out), "--seeds", "0,1",
                 "--set", "train.max_steps=4", "--set", "compare.sample_tokens=4"]) == 0
    for s in (0, 1):
        for arm in ("diff", "transformer"):
            assert (out / f"seed{s}" / arm / "final" / "model.safetensors").is_file()
    report = (out / "report.md").read_text()
    assert "mean ± std" in report and "Per seed" in report


# ----------------------------------------------------------------------------------------------
# report honesty on synthetic metrics


def _synthetic(root: Path, finals: dict[str, list[float]], steps: int = 100) -> Path:
    """A compare folder whose arms end at the given final val losses (one per seed)."""
    seeds = list(range(len(next(iter(finals.values())))))
    for arm, values in finals.items():
        for seed, final in zip(seeds, values):
            d = root / (f"seed{seed}" if len(seeds) > 1 else "") / arm
            d.mkdir(parents=True, exist_ok=True)
            (d / "train_config.json").write_text(json.dumps({"max_steps": steps, "seed": seed}))
            lam = [0.3, 0.5] if arm == "diff" else [None, None]
            rows = [{"kind": "train", "step": s, "loss": final + 2 * (1 - s / steps), "lr": 1e-3, "grad_norm": 1.0,
                     "tokens": s * 1000, "tokens_per_s": 900.0 if arm == "diff" else 1000.0, "elapsed_s": s,
                     "lambdas": lam} for s in range(10, steps + 1, 10)]
            rows += [{"kind": "val", "step": s, "loss": final + 2 * (1 - s / steps), "tokens": s * 1000}
                     for s in range(25, steps + 1, 25)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "compare.json").write_text(json.dumps({"arms": list(finals), "seeds": seeds, "baseline": "transformer"}))
    return root


def test_report_single_seed_says_it_cannot_separate(tmp_path):
    root = _synthetic(tmp_path, {"diff": [3.0], "transformer": [3.5]})
    text = write_report(root, samples=False).read_text()
    assert "single seed cannot separate the arms" in text
    assert "reaches the lower" not in text


def test_report_within_noise(tmp_path):
    root = _synthetic(tmp_path, {"diff": [3.00, 3.20, 2.95], "transformer": [3.10, 3.02, 3.05]})
    text = write_report(root, samples=False).read_text()
    assert "within seed noise" in text and "cannot separate" in text and "reaches the lower" not in text


@pytest.mark.parametrize("finals, lower", [
    ({"diff": [3.00, 3.01, 2.99], "transformer": [3.50, 3.52, 3.49]}, "diff"),
    ({"diff": [3.50, 3.52, 3.49], "transformer": [3.00, 3.01, 2.99]}, "transformer"),
])
def test_report_names_the_lower_arm_when_far_beyond_noise(tmp_path, finals, lower):
    text = write_report(_synthetic(tmp_path, finals), samples=False).read_text()
    assert f"{lower} reaches the lower validation loss" in text and "within seed noise" not in text
    assert "0.900" in text  # throughput ratio diff / transformer from the synthetic 900 vs 1000 tokens/s
    assert (tmp_path / "loss_curves.png").is_file() and (tmp_path / "lambda.png").is_file()


def test_verdict_rules():
    assert "cannot separate" in verdict("diff", "transformer", [-0.3])
    assert "within seed noise" in verdict("diff", "transformer", [-0.01, 0.02, -0.03])
    assert "diff reaches the lower" in verdict("diff", "transformer", [-0.10, -0.11, -0.09])
    assert "nothing to compare" in verdict("diff", "transformer", [])


def test_report_marks_unfinished_runs(tmp_path):
    root = _synthetic(tmp_path, {"diff": [3.0, 3.1], "transformer": [3.2, 3.3]})
    (root / "seed1" / "transformer" / "train_config.json").write_text(json.dumps({"max_steps": 200, "seed": 1}))
    text = write_report(root, samples=False).read_text()
    assert "Incomplete" in text and "step 100 of 200" in text
    assert "single seed cannot separate" in text  # only seed 0 has both arms finished


def test_compare_continues_unfinished_arms_and_refuses_another_study(workdir, tmp_path, caplog):
    out, cfg = tmp_path / "grow", str(workdir / "tiny.toml")
    assert main(["compare", "--config", cfg, "--out-dir", str(out), "--set", "train.max_steps=4",
                 "--set", "compare.sample_tokens=2"]) == 0
    caplog.set_level("INFO")
    assert main(["compare", "--config", cfg, "--out-dir", str(out), "--set", "train.max_steps=8",
                 "--set", "compare.sample_tokens=2"]) == 0
    assert "resumed from" in caplog.text  # from the step-4 checkpoint, not from scratch
    for arm in ("diff", "transformer"):
        steps = [json.loads(line)["step"] for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
        assert max(steps) == 8
    assert main(["compare", "--config", cfg, "--out-dir", str(out), "--set", "model.num_hidden_layers=3"]) == 2
