"""Held-out text reaches a model in its own tokenizer: stored ids when the tokenizer is the data's,
re-tokenised documents (the same text) when it is not, so no task scores ids of a foreign vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from difftransformer.data import PreparedData, Tokenizer, iter_eval_batches
from difftransformer.eval import EvalConfig, run_task
from difftransformer.eval.heldout import documents, heldout_split, input_windows, window_length
from tests.helpers import UniformLM


def _other_tokenizer(data: PreparedData) -> Tokenizer:
    """A genuinely different BPE (another vocabulary size, so other ids) trained on the same text."""
    texts = [data.tokenizer().decode(d.tolist()) for d in documents(np.asarray(data.dataset("val").tokens),
                                                                        data.dataset("val").eos_id)]
    return Tokenizer.train(texts, vocab_size=280, min_frequency=1)


def test_the_datas_own_tokenizer_reads_the_stored_ids(data_dir):
    data = PreparedData.load(data_dir)
    split = heldout_split(EvalConfig(data_dir=data_dir), data.tokenizer(), "t")
    assert not split.retokenized and np.array_equal(split.tokens, np.asarray(data.dataset("test").tokens))
    assert heldout_split(EvalConfig(data_dir=data_dir), None, "t").retokenized is False


def test_another_tokenizer_gets_the_same_text_in_its_own_ids(data_dir):
    data = PreparedData.load(data_dir)
    other = _other_tokenizer(data)
    assert other.hash != data.tokenizer_hash
    split = heldout_split(EvalConfig(data_dir=data_dir), other, "t")
    assert split.retokenized and split.eos_id == other.eos_id and split.settings()["retokenized"] is True
    mine = documents(split.tokens, split.eos_id)
    theirs = documents(np.asarray(data.dataset("test").tokens), data.dataset("test").eos_id)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert other.decode(a.tolist()) == data.tokenizer().decode(b.tolist())  # the same text, byte for byte
    assert not np.array_equal(split.tokens[:50], np.asarray(data.dataset("test").tokens)[:50])


def test_heldout_loss_scores_re_tokenised_text(data_dir):
    data = PreparedData.load(data_dir)
    other = _other_tokenizer(data)
    result = run_task("heldout-loss", UniformLM(other.vocab_size), other,
                      EvalConfig(data_dir=data_dir, seq_len=16, max_windows=3))
    assert result.settings["retokenized"] is True
    assert result.metrics["loss"] == pytest.approx(np.log(other.vocab_size))
    with pytest.raises(ValueError, match="set EvalConfig.data_dir"):
        heldout_split(EvalConfig(), other, "t")


def test_window_length_takes_the_option_then_seq_len_then_the_context_and_refuses_more():
    from types import SimpleNamespace

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    assert window_length(model, EvalConfig()) == 64
    assert window_length(model, EvalConfig(seq_len=32)) == 32
    assert window_length(model, EvalConfig(seq_len=32), "length", 48) == 48
    with pytest.raises(ValueError, match=r"^length 65 is beyond the model's context of 64 tokens .*use length <= 64$"):
        window_length(model, EvalConfig(), "length", 65)


def test_input_windows_are_the_inputs_of_the_trainers_validation_windows():
    tokens = np.arange(23)
    got = input_windows(tokens, 5, budget=12, cap=None)  # 12 tokens round up to 3 windows of 5
    assert got.dtype == np.int64 and got.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    assert input_windows(tokens, 5, budget=10 ** 6, cap=None).shape == (4, 5)  # the split runs out: 23 // 5
    assert input_windows(tokens, 5, budget=10 ** 6, cap=2).shape == (2, 5)
    inputs = next(iter_eval_batches(tokens, 3, 5))[0]
    assert got.tolist() == inputs.tolist()
