"""Black-box evaluation tasks on a plain transformers causal LM: our Transformer converted to
transformers' LlamaForCausalLM scores the same held-out loss as itself, white-box probes refuse it,
and the CLI takes the folder with --data-dir."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from difftransformer.cli import main  # noqa: E402
from difftransformer.data import PreparedData  # noqa: E402
from difftransformer.data.tokenizer import EOS_TOKEN  # noqa: E402
from difftransformer.eval import EvalConfig, get_task, run_task  # noqa: E402
from difftransformer.hf.causal_lm import load_causal_lm  # noqa: E402
from difftransformer.model import DiffTransformerLM  # noqa: E402
from tests.helpers import cli_fails, tiny  # noqa: E402


@pytest.fixture(scope="module")
def pair(data_dir, tmp_path_factory):
    """(our transformer, its transformers Llama folder with the data's tokenizer)."""
    root = tmp_path_factory.mktemp("hf_eval")
    torch.manual_seed(0)
    data = PreparedData.load(data_dir)
    ours = DiffTransformerLM(tiny("transformer", vocab_size=data.vocab_size, max_position_embeddings=320)).eval()
    ours.save_pretrained(root / "ours")
    assert main(["convert", str(root / "ours"), str(root / "llama"), "--to", "llama"]) == 0
    tok = PreTrainedTokenizerFast(tokenizer_file=str(data.tokenizer_path), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN)
    tok.save_pretrained(root / "llama")
    return ours, root / "llama"


def test_the_same_weights_give_the_same_held_out_loss(pair, data_dir):
    ours, folder = pair
    model, tok = load_causal_lm(folder)
    cfg = EvalConfig(data_dir=data_dir, seq_len=32, max_windows=6)
    native = run_task("heldout-loss", ours, PreparedData.load(data_dir).tokenizer(), cfg)
    foreign = run_task("heldout-loss", model, tok, cfg)
    assert foreign.settings["retokenized"] is True  # another tokenizer object: the documents were encoded again
    assert foreign.metrics["loss"] == pytest.approx(native.metrics["loss"], rel=1e-5)


def test_greedy_generation_has_our_shape_and_tokens(pair, data_dir):
    ours, folder = pair
    model, tok = load_causal_lm(folder)
    ids = torch.tensor([[tok.eos_id, *tok.encode("the of and")]])
    mine = ours.generate(ids, 6, temperature=0.0)
    theirs = model.generate(ids, 6, temperature=0.0, eos_token_id=None)
    assert theirs.shape == (1, ids.shape[1] + 6)
    if tok.eos_id not in mine[0, ids.shape[1]:].tolist():
        assert torch.equal(theirs, mine)


def test_the_folders_generation_config_does_not_change_the_tasks_decoding(pair, tmp_path):
    """A folder whose generation_config.json sets processors (a repetition penalty, an n-gram ban): temperature 0
    is still argmax decoding, and the model keeps its generation config after the call."""
    import shutil

    from transformers import GenerationConfig

    ours, folder = pair
    shipped = tmp_path / "shipped"
    shutil.copytree(folder, shipped)
    GenerationConfig(repetition_penalty=3.0, no_repeat_ngram_size=1).save_pretrained(shipped)
    model, tok = load_causal_lm(shipped)
    assert model.hf.generation_config.repetition_penalty == 3.0
    ids = torch.tensor([[tok.eos_id, *tok.encode("the of and the of")]])
    got = model.generate(ids, 8, temperature=0.0, eos_token_id=None)
    want = ids
    with torch.no_grad():
        for _ in range(8):
            want = torch.cat([want, model(want).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got.tolist() == want.tolist()
    assert model.hf.generation_config.repetition_penalty == 3.0


def test_black_box_tasks_run_and_probes_refuse(pair, data_dir):
    model, tok = load_causal_lm(pair[1])
    result = run_task(get_task("needle", needles=(2,), queries=(1,), depths=(50,), samples=2, haystack="needles",
                               digits=3, max_new_tokens=4), model, tok, EvalConfig(data_dir=data_dir))
    assert 0 <= result.metrics["forced_choice"] <= 1
    with pytest.raises(ValueError, match="needs one of this package's models"):
        run_task("outliers", model, tok, EvalConfig(data_dir=data_dir))


def test_the_cli_takes_a_transformers_folder(pair, data_dir, capsys, tmp_path):
    folder = pair[1]
    assert main(["eval", "heldout-loss", str(folder), "--data-dir", data_dir]) == 0
    record = json.loads((folder / "eval" / "heldout-loss.json").read_text())
    assert record["settings"]["retokenized"] is True and record["metrics"]["loss"] > 0
    capsys.readouterr()
    cli_fails(capsys, ["eval", "outliers", str(folder), "--data-dir", data_dir], "runs on this package's models only")
    # no data: after its progress line, one line of error (into a folder of its own: the stored result stays)
    assert main(["eval", "heldout-loss", str(folder), "--out-dir", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err) and "set EvalConfig.data_dir (--data-dir)" in err[-1]


def test_a_result_is_kept_for_the_folders_configuration(pair, data_dir, tmp_path):
    """A transformers folder's result records its configuration: the same tensors with another RoPE base (the usual
    context-extension edit of config.json) are evaluated again, not served the stored result."""
    import shutil

    from difftransformer.eval.results import ResultsDir, evaluate_cached

    _, folder = pair
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    config = json.loads((edited / "config.json").read_text())
    if "rope_parameters" in config:
        config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": 10.0}
    config["rope_theta"] = 10.0
    (edited / "config.json").write_text(json.dumps(config))
    cfg, results = EvalConfig(data_dir=data_dir, seq_len=32, max_windows=4), ResultsDir(tmp_path / "eval")
    task = get_task("heldout-loss")
    (a, tok), (b, _) = load_causal_lm(folder), load_causal_lm(edited)
    first, _ = evaluate_cached(task, a, tok, cfg, results)
    assert first["settings"]["model"]["context"] == a.config.max_position_embeddings
    again, reused = evaluate_cached(task, b, tok, cfg, results)
    assert not reused and again["metrics"]["loss"] != first["metrics"]["loss"]
    assert evaluate_cached(task, b, tok, cfg, results)[1]  # the same configuration again: reused
