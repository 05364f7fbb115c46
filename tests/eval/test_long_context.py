"""long-context: NLL by position and the AR-hit / Others slices, against answers computed by hand or directly."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

import difftransformer.eval.tasks.long_context as lc
from difftransformer.data import PreparedData
from difftransformer.eval import EvalConfig, get_task, run_task
from difftransformer.eval.heldout import documents
from difftransformer.model import DiffTransformerLM
from tests.helpers import UniformLM, raises_one_line, tiny


def reference_hits(row: list[int]) -> list[bool]:
    """AR hits by the definition, with a set: was (row[t-1], row[t]) seen ending before t?"""
    seen, out = set(), [False]
    for t in range(1, len(row)):
        bigram = (row[t - 1], row[t])
        out.append(bigram in seen)
        seen.add(bigram)
    return out


def test_ar_hits_of_a_hand_written_sequence():
    # positions:   0  1  2  3  4  5  6  7  8  9 10 11
    ids = torch.tensor([[0, 5, 6, 7, 5, 6, 5, 6, 7, 7, 7, 7],
                        [0, 5, 6, 1, 2, 3, 4, 8, 9, 10, 11, 12]])  # row 1 shares (5, 6) with row 0: rows are apart
    F_, T_ = False, True
    want = [[F_, F_, F_, F_, F_, T_, F_, T_, T_, F_, T_, T_], [F_] * 12]
    assert lc.ar_hits(ids).tolist() == want
    assert lc.ar_hits(torch.tensor([[3]])).tolist() == [[False]]


def test_ar_hits_match_the_definition_on_random_rows():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    ids = torch.randint(0, 6, (3, 80), generator=g)
    assert lc.ar_hits(ids).tolist() == [reference_hits(r) for r in ids.tolist()]


def test_documents_and_buckets():
    eos = 9
    docs = documents(np.array([3, 4, eos, eos, 5, eos, 6, 7]), eos)
    assert [d.tolist() for d in docs] == [[3, 4], [5], [6, 7]]  # empty piece dropped, unterminated tail kept
    assert lc.position_buckets(10) == [(1, 1), (2, 3), (4, 7), (8, 10)]
    assert lc.position_buckets(1) == [(1, 1)]


def test_a_uniform_model_costs_log_vocab_at_every_position(data_dir):
    vocab = PreparedData.load(data_dir).vocab_size
    result = run_task(get_task("long-context", length=40, train_length=16), UniformLM(vocab, context=64), None,
                      EvalConfig(data_dir=data_dir, batch_size=1))
    m, log_v = result.metrics, math.log(vocab)
    assert result.settings["documents"] == 2 and result.settings["tokens"] == 80
    assert m["final_cumulative_nll"] == pytest.approx(log_v)
    assert result.details["positions_nll"] == pytest.approx([log_v] * 40)
    assert [k for k in m if k.startswith("nll_positions_")] == [
        "nll_positions_1_1", "nll_positions_2_3", "nll_positions_4_7", "nll_positions_8_15", "nll_positions_16_31",
        "nll_positions_32_40"]
    for key in ("ar_hit_loss", "others_loss", "nll_within_train_length", "nll_beyond_train_length",
                "nll_positions_32_40"):
        assert m[key] == pytest.approx(log_v), key
    slices = result.details["slices"]
    assert slices["ar_hit"]["tokens"] + slices["others"]["tokens"] == 80 and slices["ar_hit"]["tokens"] > 0
    json.dumps(result.to_dict(), allow_nan=False)
    from difftransformer.eval.paper import PAPER  # the paper's numbers for this task sit on metrics it produces

    keyed = {metric for task, metric in PAPER if task == "long-context"}
    assert keyed == {"ar_hit_loss", "others_loss"} and keyed <= set(m)


def direct_nll(model, seq: list[int]) -> list[float]:
    """NLL of seq[t] given seq[:t], one forward per prefix (no batching, no shared computation)."""
    out = []
    for t in range(1, len(seq)):
        logits = model(torch.tensor([seq[:t]])).logits[0, -1].double()
        out.append(float(-torch.log_softmax(logits, -1)[seq[t]]))
    return out


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_a_random_model_matches_a_direct_cross_entropy_loop(data_dir, kind):
    torch.manual_seed(1)
    model = DiffTransformerLM(tiny(kind, vocab_size=300, max_position_embeddings=24)).eval()
    L, train_length = 24, 10
    result = run_task(get_task("long-context", train_length=train_length), model, None,
                      EvalConfig(data_dir=data_dir, batch_size=1))
    split = PreparedData.load(data_dir).dataset("test")
    tokens, eos = split.tokens.tolist(), split.eos_id
    first_end = tokens.index(eos)
    seqs = [[eos, *tokens[:L]], [eos, *tokens[first_end + 1:first_end + 1 + L]]]  # both documents, from their start
    with torch.no_grad():
        nll = np.array([direct_nll(model, s) for s in seqs])  # (2, L)
    hits = np.array([reference_hits(s)[1:] for s in seqs])
    per_position = nll.mean(0)
    cumulative = np.cumsum(per_position) / np.arange(1, L + 1)
    tol = dict(rel=1e-5, abs=1e-6)
    assert result.settings["length"] == L  # the default: the model's context
    assert result.details["positions_nll"] == pytest.approx(per_position.tolist(), **tol)
    assert result.details["cumulative_nll"] == pytest.approx(cumulative.tolist(), **tol)
    m = result.metrics
    assert m["final_cumulative_nll"] == pytest.approx(nll.mean(), **tol)
    assert m["nll_positions_8_15"] == pytest.approx(per_position[7:15].mean(), **tol)
    assert m["nll_positions_16_24"] == pytest.approx(per_position[15:].mean(), **tol)
    assert m["ar_hit_loss"] == pytest.approx(nll[hits].mean(), **tol)
    assert m["others_loss"] == pytest.approx(nll[~hits].mean(), **tol)
    assert result.details["slices"]["ar_hit"]["tokens"] == hits.sum() > 0
    assert m["ar_hit_fraction"] == pytest.approx(hits.mean())
    assert m["nll_within_train_length"] == pytest.approx(per_position[:train_length].mean(), **tol)
    assert m["nll_beyond_train_length"] == pytest.approx(per_position[train_length:].mean(), **tol)
    batched = run_task(get_task("long-context", train_length=train_length), model, None,
                       EvalConfig(data_dir=data_dir, batch_size=2))
    assert batched.metrics == pytest.approx(m, **tol)


def test_short_documents_are_skipped_and_counts_are_capped(data_dir, tmp_path):
    split = PreparedData.load(data_dir).dataset("test")
    lengths = [len(d) for d in documents(split.tokens, split.eos_id)]
    assert len(lengths) == 2 and lengths[0] != lengths[1]  # the fixture's test split
    model = UniformLM(300, context=4096)
    cfg = EvalConfig(data_dir=data_dir)
    between = min(lengths) + 1
    only_long = run_task(get_task("long-context", length=between), model, None, cfg)
    longer = int(np.argmax(lengths))
    assert only_long.details["documents"] == [{"index": longer, "tokens": lengths[longer]}]
    assert (only_long.settings["documents_in_split"], only_long.settings["documents_long_enough"]) == (2, 1)
    assert run_task(get_task("long-context", length=16, documents=1), model, None, cfg).settings["documents"] == 1
    capped = run_task(get_task("long-context", length=16), model, None, EvalConfig(data_dir=data_dir, max_windows=1))
    assert capped.details["documents"] == [{"index": 0, "tokens": lengths[0]}]
    assert (capped.settings["documents"], capped.settings["documents_long_enough"]) == (1, 2)
    by_seq_len = run_task("long-context", model, None, EvalConfig(data_dir=data_dir, seq_len=12))
    assert by_seq_len.settings["length"] == 12 and by_seq_len.settings["train_length"] is None
    assert "nll_within_train_length" not in by_seq_len.metrics
    within = run_task(get_task("long-context", length=12, train_length=50), model, None, cfg).metrics
    assert "nll_within_train_length" in within and "nll_beyond_train_length" not in within
    path = tmp_path / "curve.png"
    assert get_task("long-context").plot(only_long, path) and path.stat().st_size > 0


BAD = {  # what is asked -> the start of the one-line error
    "beyond the context": (lambda d: run_task(get_task("long-context", length=65), UniformLM(300, 64), None,
                                              EvalConfig(data_dir=d)),
                           "length 65 is beyond the model's context of 64 tokens"),
    "seq_len beyond the context": (lambda d: run_task("long-context", UniformLM(300, 64), None,
                                                      EvalConfig(data_dir=d, seq_len=100)),
                                   "length 100 is beyond the model's context of 64"),
    "no data": (lambda d: run_task("long-context", UniformLM(300, 64), None, EvalConfig()),
                "long-context reads held-out text: set EvalConfig.data_dir"),
    "no document that long": (lambda d: run_task(get_task("long-context", length=4000), UniformLM(300, 4096), None,
                                                 EvalConfig(data_dir=d)),
                              "no document in the test split .* has 4000 tokens or more \\(the longest has"),
    "a negative length": (lambda d: get_task("long-context", length=-1), "option length must be >= 0"),
    "a negative train length": (lambda d: get_task("long-context", train_length=-5), "option train_length must be"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_are_one_line_errors(data_dir, name):
    ask, needle = BAD[name]
    with raises_one_line(ValueError, needle):
        ask(data_dir)
