"""`generate` (and the sampling behind it): bad arguments, prompts and model folders are refused in one line
naming the fix; sampling at numeric edges (a tiny top-p or temperature) gives the greedy token."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys

import pytest
import torch

from difftransformer.cli import main
from difftransformer.model import filter_logits, sample_next_token
from difftransformer.model.generation import scale_logits
from difftransformer.numerics import denormals_flushed
from tests.cli.conftest import last_error_line, tiny_run_config, train_argv, trained_model
from tests.helpers import cli_fails


@pytest.fixture(scope="module")
def run(workdir, tmp_path_factory):
    """One tiny trained run (2 steps) with its tokenizer."""
    tmp = tmp_path_factory.mktemp("generate")
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


def test_a_checkpoint_is_never_decoded_with_a_tokenizer_it_was_not_trained_with(workdir, tmp_path, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(train_argv(workdir, run, "train.max_steps=4", f'data.data_dir="{data}"')) == 0
    shutil.rmtree(run / "final")
    assert main(["prepare", str(workdir / "corpus"), "--out-dir", str(data), "--vocab-size", "280", "--force"]) == 0
    capsys.readouterr()
    cli_fails(capsys, ["generate", str(run), "the union", "-n", "3"], "no tokenizer found", "--tokenizer")
    other = next(data.glob("tokenizer-280*.json"))
    cli_fails(capsys, ["generate", str(run), "the union", "--tokenizer", str(other)], "is not the tokenizer",
           "was trained with")


@pytest.mark.parametrize("extra, needle", [
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--sample-seed", "99999999999999999999"], "--sample-seed must be in"),
])
def test_bad_device_and_sample_seed_are_refused(compared, capsys, extra, needle):
    cli_fails(capsys, ["generate", str(compared / "diff"), "the", *extra], needle)


def test_a_prompt_that_is_not_utf8_is_refused(compared, capsys):
    cli_fails(capsys, ["generate", str(compared / "diff"), b"\xff\xfe".decode("utf-8", "surrogateescape")],
           "not valid UTF-8")


def test_a_model_config_that_does_not_fit_its_weights_is_one_line(compared, tmp_path, capsys):
    final = tmp_path / "final"
    shutil.copytree(compared / "diff" / "final", final)
    (final / "config.json").write_text("{}")
    cli_fails(capsys, ["generate", str(final), "x"], "do not match the model described by config.json",
              "more)", "edited")


def test_a_prompt_that_fills_the_context_is_counted_with_its_start_token(compared, capsys):
    """A 255-token prompt for a 256-token context: the refusal counts the start token (256 in all) and gives the
    longest prompt that leaves room to generate (at most 254 tokens); asking for no new tokens is not refused."""
    from difftransformer.data import Tokenizer

    run = compared / "diff"
    tok = Tokenizer.from_file(run / "final" / "tokenizer.json")
    prompt = tok.decode(tok.encode("the union " * 200)[:255])
    assert len(tok.encode(prompt)) == 255
    cli_fails(capsys, ["generate", str(run), prompt, "-n", "5"], "256 in all", "at most 254 tokens")
    assert main(["generate", str(run), prompt, "-n", "0"]) == 0  # nothing asked, nothing refused


def test_generate_on_a_transformers_folder_names_it(compared, tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = tmp_path / "exported"
    shutil.copytree(compared / "diff" / "final", folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "diffllama", "hidden_size": 64}))
    cli_fails(capsys, ["generate", str(folder), "the"], "holds a transformers model (diffllama)",
              "--to difftransformer")


def test_load_model_names_a_device_it_cannot_use(compared):
    from difftransformer.train import load_model

    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        load_model(compared / "diff", "tpu")  # names the devices it takes


def test_a_config_json_that_is_not_text_is_named(workdir, tmp_path, capsys):
    model = trained_model(workdir, tmp_path, max_steps=4, ckpt_interval=2)
    (model / "config.json").write_bytes(b"\xff\xfe{")
    capsys.readouterr()
    assert main(["generate", str(model), "the", "-n", "2"]) == 2
    assert "config.json" in last_error_line(capsys)


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-8])
def test_a_tiny_top_p_keeps_exactly_the_top_token(top_p):
    """A tiny --top-p (1e-300 is 0 in float32) keeps the top token, never an all -inf row that sampling cannot draw
    from. The nucleus of a tiny p is the top token alone: always the argmax."""
    x = _logits()[:3]
    kept = torch.isfinite(filter_logits(x, top_p=top_p))
    assert torch.equal(kept, torch.nn.functional.one_hot(x.argmax(-1), 50).bool())
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert torch.equal(sample_next_token(x, temperature=0.8, top_p=top_p, generator=g), x.argmax(-1))


@pytest.mark.parametrize("flushed", [False, True], ids=["subnormals-kept", "subnormals-flushed"])
@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-320])
def test_a_tiny_temperature_is_greedy(temperature, flushed):
    """A tiny --temperature (1e-40, 1e-320) must not overflow logits / temperature to inf and the softmax to nan. The
    limit of softmax(x / t) as t -> 0 puts all the mass on the top logit: the argmax, and for tied top tokens each of
    them, never another. Also where subnormal floats are flushed, as the CLI runs (1e-40 reads as 0 in float32
    there)."""
    with denormals_flushed() if flushed else contextlib.nullcontext():
        _check_tiny_temperature(temperature)


def _check_tiny_temperature(temperature: float) -> None:
    x = _logits()
    g = torch.Generator().manual_seed(2)
    draws = torch.stack([sample_next_token(x, temperature=temperature, generator=g) for _ in range(40)])
    assert torch.equal(draws[:, :3], x[:3].argmax(-1).expand(40, 3))
    assert set(draws[:, 3].tolist()) <= {7, 11}
    if temperature == 1e-40:  # not 0 in float32: the exact limit, each tied token about half the time
        assert set(draws[:, 3].tolist()) == {7, 11}


def test_ordinary_temperatures_divide_bit_for_bit_as_before():
    """The overflow guard changes no ordinary result: the scaled logits are exactly logits / temperature wherever
    that is finite, and only an overflowing row is shifted by its top."""
    x = _logits() * 100
    for t in (1.0, 0.8, 0.3, 1.7, 1e-3, 1e-30, 1e30):
        assert torch.equal(scale_logits(x, t), x / t)
    big = torch.tensor([[3e38, 0.0, -3e38], [1.0, 2.0, 0.5]])
    scaled = scale_logits(big, 0.5)
    assert scaled[0].tolist() == [0.0, float("-inf"), float("-inf")]  # by hand: shifted by 3e38, then / 0.5
    assert torch.equal(scaled[1], big[1] / 0.5)


def test_generate_at_numeric_edges_gives_the_greedy_text(run, capsys):
    """Through the command, each of those numeric edges gives the greedy text (the top token at every step), as
    worked out above, never a traceback."""
    greedy = _generated(capsys, run, "--temperature", "0")
    for flags in (["--top-p", "1e-300"], ["--top-p", "1e-46"], ["--temperature", "1e-40"],
                  ["--temperature", "1e-320"]):
        assert _generated(capsys, run, *flags) == greedy, flags


def test_a_prompt_standard_output_cannot_encode_names_the_fix(run, capsys, monkeypatch):
    """`PYTHONIOENCODING=ascii generate RUN 'ünï'`: standard output cannot encode the prompt, and the refusal names
    the encoding, the character and the fix (PYTHONIOENCODING=utf-8), before the model is loaded."""
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert main(["generate", str(run), "ünï", "-n", "2"]) == 2
    line = last_error_line(capsys)
    assert "(ascii)" in line and "'ü'" in line and "PYTHONIOENCODING=utf-8" in line, line


def test_a_prompt_after_the_options_is_read_as_the_prompt(compared, capsys):
    """A prompt given both as an argument and with --prompt is refused naming the rule, in either order (also
    `generate RUN --prompt a b`, where argparse gives PROMPT its empty value before reaching --prompt). An option
    after the prompt works, and a word too many is refused."""
    run = str(compared / "diff")
    for argv in (["generate", run, "--prompt", "a", "b"], ["generate", run, "b", "--prompt", "a"]):
        assert main(argv) == 2
        assert "give the prompt either as an argument or with --prompt, not both" in last_error_line(capsys)
    assert main(["generate", run, "-n", "2", "the", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the")
    with pytest.raises(SystemExit):
        main(["generate", run, "the", "union", "-n", "2"])
    assert "unrecognized arguments: union" in capsys.readouterr().err
