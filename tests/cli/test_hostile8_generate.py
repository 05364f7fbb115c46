"""Regressions from the eighth hostile pass (issue 13, docs/hostile-pass.md) in `generate` and `eval
logit-quant`: sampling at numeric edges (a top-p or a temperature that float32 rounds to 0 or overflows
on) gave a RuntimeError traceback, a prompt that standard output cannot encode gave a codec error with
no fix, and `--windows 0` was refused without naming the value."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from difftransformer.cli import main
from difftransformer.model import filter_logits, sample_next_token
from difftransformer.model.generation import scale_logits
from tests.cli.conftest import last_error_line, tiny_run_config


@pytest.fixture(scope="module")
def run(workdir, tmp_path_factory):
    """One tiny trained run (2 steps) with its tokenizer."""
    tmp = tmp_path_factory.mktemp("hostile8-generate")
    out = tmp / "run"
    assert main(["train", "--config", tiny_run_config(workdir, tmp, max_steps=2, eval_interval=2),
                 "--out-dir", str(out)]) == 0
    return out


def _generated(capsys, run, *flags: str) -> str:
    capsys.readouterr()
    assert main(["generate", str(run), "the union", "-n", "6", *flags]) == 0
    return capsys.readouterr().out


def _logits() -> torch.Tensor:
    """(4, 50) logits of an ordinary scale, one row with two tokens tied at the top."""
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    x[3, 7] = x[3, 11] = x[3].max() + 1
    return x


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-8])
def test_a_tiny_top_p_keeps_exactly_the_top_token(top_p):
    """G19, G19c: `--top-p 1e-300` (0 in float32) dropped the top token too, so every logit was -inf and
    sampling raised a RuntimeError. The nucleus of a tiny p is the top token alone: always the argmax."""
    x = _logits()[:3]
    kept = torch.isfinite(filter_logits(x, top_p=top_p))
    assert torch.equal(kept, torch.nn.functional.one_hot(x.argmax(-1), 50).bool())
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert torch.equal(sample_next_token(x, temperature=0.8, top_p=top_p, generator=g), x.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-320])
def test_a_tiny_temperature_is_greedy(temperature):
    """G20, G22: `--temperature 1e-40` (and 1e-320) overflowed logits / temperature to inf and the
    softmax to nan. The limit of softmax(x / t) as t -> 0 puts all the mass on the top logit: the argmax,
    and for tied top tokens each of them, never another."""
    x = _logits()
    g = torch.Generator().manual_seed(2)
    draws = torch.stack([sample_next_token(x, temperature=temperature, generator=g) for _ in range(40)])
    assert torch.equal(draws[:, :3], x[:3].argmax(-1).expand(40, 3))
    assert set(draws[:, 3].tolist()) <= {7, 11}
    if temperature == 1e-40:  # not 0 in float32: the exact limit, each tied token about half the time
        assert set(draws[:, 3].tolist()) == {7, 11}


def test_ordinary_temperatures_divide_bit_for_bit_as_before():
    """G20: the overflow guard must leave every ordinary result as it was: the scaled logits are exactly
    logits / temperature wherever that is finite, and only an overflowing row is shifted by its top."""
    x = _logits() * 100
    for t in (1.0, 0.8, 0.3, 1.7, 1e-3, 1e-30, 1e30):
        assert torch.equal(scale_logits(x, t), x / t)
    big = torch.tensor([[3e38, 0.0, -3e38], [1.0, 2.0, 0.5]])
    scaled = scale_logits(big, 0.5)
    assert scaled[0].tolist() == [0.0, float("-inf"), float("-inf")]  # by hand: shifted by 3e38, then / 0.5
    assert torch.equal(scaled[1], big[1] / 0.5)


def test_generate_at_numeric_edges_gives_the_greedy_text(run, capsys):
    """G19, G19c, G20, G22 through the command: each ran into a RuntimeError traceback; each now gives
    the greedy text (the top token at every step), as worked out above."""
    greedy = _generated(capsys, run, "--temperature", "0")
    for flags in (["--top-p", "1e-300"], ["--top-p", "1e-46"], ["--temperature", "1e-40"],
                  ["--temperature", "1e-320"]):
        assert _generated(capsys, run, *flags) == greedy, flags


def test_a_prompt_standard_output_cannot_encode_names_the_fix(run, capsys, monkeypatch):
    """EN17: `PYTHONIOENCODING=ascii generate RUN 'ünï'` said only "'ascii' codec can't encode character
    '\\xfc' ...". The refusal names the encoding and the fix, before the model is loaded."""
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert main(["generate", str(run), "ünï", "-n", "2"]) == 2
    line = last_error_line(capsys)
    assert "(ascii)" in line and "'ü'" in line and "PYTHONIOENCODING=utf-8" in line, line


def test_logit_quant_names_the_window_count_it_refuses(run, tmp_path, capsys):
    """E40: `eval logit-quant RUN --windows 0 --needle-samples 0` said "windows must be >= 1,
    needle_samples and needle_length >= 0" without the value given, unlike every other eval option."""
    capsys.readouterr()
    assert main(["eval", "logit-quant", str(run), "--windows", "0", "--needle-samples", "0",
                 "--out-dir", str(tmp_path / "ev")]) == 2
    line = last_error_line(capsys)
    assert "logit-quant windows must be >= 1" in line and "got 0" in line, line
    assert main(["eval", "logit-quant", str(run), "--needle-length", "-3", "--out-dir", str(tmp_path / "ev")]) == 2
    assert "needle_length must be >= 0 (0: the model's context), got -3" in last_error_line(capsys)


def test_a_prompt_after_the_options_is_read_as_the_prompt(compared, capsys):
    """G10: `generate RUN --prompt a b` said only "unrecognized arguments: b" (argparse gave PROMPT its empty
    value before reaching --prompt), while `generate RUN b --prompt a` named the rule. Both now do; an
    option after the prompt still works, and a word too many is still refused."""
    run = str(compared / "diff")
    for argv in (["generate", run, "--prompt", "a", "b"], ["generate", run, "b", "--prompt", "a"]):
        assert main(argv) == 2
        assert "give the prompt either as an argument or with --prompt, not both" in last_error_line(capsys)
    assert main(["generate", run, "-n", "2", "the", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the")
    with pytest.raises(SystemExit):
        main(["generate", run, "the", "union", "-n", "2"])
    assert "unrecognized arguments: union" in capsys.readouterr().err
