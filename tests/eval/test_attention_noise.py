"""The attention-noise probe: the segment arithmetic on hand-made maps, and models forced onto the answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from difftransformer.data import PreparedData
from difftransformer.eval.probes.attention_noise import SEGMENTS, attention_allocation, segment_shares
from difftransformer.eval.task import EvalConfig, get_task, run_task
from difftransformer.eval.tasks.needle import haystack_text, needle_samples
from difftransformer.model import DiffTransformerLM
from tests.helpers import tiny

CONTEXT = 420


@pytest.fixture(scope="module")
def tok(data_dir):
    return PreparedData.load(data_dir).tokenizer()


def model_of(kind: str, seed: int = 0) -> DiffTransformerLM:
    torch.manual_seed(seed)
    return DiffTransformerLM(tiny(kind, vocab_size=300, max_position_embeddings=CONTEXT)).eval()


# ------------------------------------------------------------------------- the segment arithmetic


def test_segment_shares_of_a_softmax_row():
    row = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.2, 0.1, 0.05, 0.05], dtype=torch.float64)
    raw, norm = segment_shares(row, (3, 5), 6)  # BOS | 1-2 before | 3-4 answer | 5 after | 6-7 query
    assert raw.tolist() == pytest.approx([0.1, 0.2, 0.5, 0.1, 0.1])
    assert norm.tolist() == pytest.approx([0.1, 0.2, 0.5, 0.1, 0.1])


def test_segment_shares_of_a_differential_row_with_negative_entries():
    a1 = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.1, 0.1, 0.0, 0.0], dtype=torch.float64)
    a2 = torch.tensor([0.1, 0.3, 0.2, 0.0, 0.0, 0.2, 0.1, 0.1], dtype=torch.float64)
    diff = a1 - 0.5 * a2  # [0.35, -0.05, 0, 0.2, 0.1, 0, -0.05, -0.05]: sums to 1 - λ = 0.5
    raw, norm = segment_shares(diff, (3, 5), 6)
    assert raw.tolist() == pytest.approx([0.35, -0.05, 0.3, 0.0, -0.1])
    assert float(raw.sum()) == pytest.approx(0.5)
    assert norm.tolist() == pytest.approx([0.7, -0.1, 0.6, 0.0, -0.2])  # each row / its sum: sums to 1
    # batches of rows keep their leading shape; each row is normalised by its own sum
    rows = torch.stack([diff, a1, 2 * a1])[None]  # (1, 3, 8)
    raw, norm = segment_shares(rows, (3, 5), 6)
    assert raw.shape == norm.shape == (1, 3, 5)
    assert norm[0, 1].tolist() == pytest.approx([0.4, 0.2, 0.3, 0.1, 0.0])
    assert norm[0, 2].tolist() == pytest.approx([0.4, 0.2, 0.3, 0.1, 0.0])
    assert raw[0, 2].tolist() == pytest.approx([0.8, 0.4, 0.6, 0.2, 0.0])
    assert torch.allclose(norm.sum(-1), torch.ones(1, 3, dtype=torch.float64))


def test_segment_shares_refuse_segments_that_do_not_tile():
    for answer, q in [((0, 2), 3), ((3, 3), 5), ((3, 6), 5), ((2, 4), 9)]:
        with pytest.raises(ValueError, match="segments must satisfy"):
            segment_shares(torch.ones(8), answer, q)


# ------------------------------------------------------------------------- models forced onto the answer


def only_keys(a: int, b: int):
    """A score hook that leaves only keys a..b-1 to every query (a large negative logit elsewhere,
    finite so rows that cannot see the answer stay defined)."""
    def hook(scores, visible):
        out = scores.clone()
        out[..., :a] = -1e9
        out[..., b:] = -1e9
        return out
    return hook


def plant(model, hook_for_layer):
    for block in model.layers:
        block.self_attn.score_hook = hook_for_layer


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_a_model_attending_only_to_the_answer_has_share_one_and_no_noise(tok, data_dir, kind):
    model = model_of(kind)
    text = haystack_text(EvalConfig(data_dir=data_dir), tok, "t")[0]
    (sample,) = needle_samples(tok, needles=2, queries=1, depth=50, length=CONTEXT, count=1, seed=1, text=text)
    for answer in ("sentence", "number"):
        span = sample.segments.answer if answer == "sentence" else sample.segments.number
        plant(model, only_keys(*span))
        alloc = attention_allocation(model, sample)
        for rows in ("last", "question"):
            raw, norm = alloc[(rows, answer)]
            assert norm.shape == (len(model.layers), 5)
            assert torch.allclose(norm, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64).expand_as(norm),
                                  atol=1e-6)
            want = [1 - lam.value for lam in model.lambdas()] if kind == "diff" else [1.0] * len(model.layers)
            assert raw[:, 2].tolist() == pytest.approx(want, abs=1e-5)  # DIFF rows sum to 1 - λ
        other = alloc[("last", "number" if answer == "sentence" else "sentence")][1]
        if answer == "sentence":  # the sentence around the number is context when "answer" is the number
            assert 0.01 < float(other[:, 2].mean()) < 0.99 and float(other[:, 1].mean() + other[:, 3].mean()) > 0.01
        else:
            assert torch.allclose(other[:, 2], torch.ones(len(model.layers), dtype=torch.float64), atol=1e-6)
    plant(model, None)


def test_the_task_reports_answer_one_and_noise_zero_for_a_forced_model(tok, data_dir):
    """The whole task, with a planted hook that finds each prompt's answer span by its ids."""
    model = model_of("diff", seed=2)
    cfg = EvalConfig(data_dir=data_dir, eval_seed=5)
    depths = (0, 100)
    text = haystack_text(cfg, tok, "t")[0]
    spans = {s.ids: s.segments.answer for d in depths for s in needle_samples(
        tok, needles=1, queries=1, depth=d, length=CONTEXT, count=2, seed=5, text=text, context=CONTEXT)}
    current = {}
    handle = model.register_forward_pre_hook(lambda _m, args: current.update(span=spans[tuple(args[0][0].tolist())]))

    def hook(scores, visible):
        return only_keys(*current["span"])(scores, visible)

    plant(model, hook)
    try:
        result = run_task(get_task("attention-noise", depths=depths, samples=2), model, tok, cfg)
    finally:
        handle.remove()
        plant(model, None)
    m = result.metrics
    assert m["answer"] == pytest.approx(1, abs=1e-6) and m["noise"] == pytest.approx(0, abs=1e-6)
    for d in depths:
        assert m[f"answer@{d}"] == pytest.approx(1, abs=1e-6) and m[f"noise@{d}"] == pytest.approx(0, abs=1e-6)
    lam = [1 - x.value for x in model.lambdas()]
    assert m["raw_answer"] == pytest.approx(sum(lam) / len(lam), abs=1e-5)
    assert m["raw_total"] == pytest.approx(m["raw_answer"], abs=1e-5)
    assert result.details["variants"]["question/sentence"]["answer"] == pytest.approx(1, abs=1e-6)


# ------------------------------------------------------------------------- uniform attention, known by hand


def uniform(scores, visible):
    """A score hook giving every key the same logit: each row attends uniformly to the keys it may see."""
    return torch.zeros_like(scores)


def uniform_shares(sample, rows: str, answer: str) -> list[float]:
    """The normalised shares of uniform causal attention, counted by hand: a row at position t sees the
    t + 1 keys 0..t, so each segment gets (its keys at or before t) / (t + 1); averaged over the rows."""
    a, b = sample.segments.answer if answer == "sentence" else sample.segments.number
    q, S = sample.segments.query[0], len(sample.ids)
    positions = [S - 1] if rows == "last" else list(range(q, S))
    edges = (0, 1, a, b, q, S)
    per_row = [[max(0, min(edges[i + 1], t + 1) - edges[i]) / (t + 1) for i in range(5)] for t in positions]
    return [sum(r[i] for r in per_row) / len(per_row) for i in range(5)]


def row_sums(model, kind: str) -> list[float]:
    """What each layer's map rows sum to: 1 - λ for DIFF (A1 = A2 here), 1 for softmax attention."""
    return [1 - lam.value for lam in model.lambdas()] if kind == "diff" else [1.0] * len(model.layers)


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_uniform_attention_gives_each_segment_its_share_of_the_visible_keys(tok, data_dir, kind):
    model = model_of(kind, seed=3)
    text = haystack_text(EvalConfig(data_dir=data_dir), tok, "t")[0]
    (sample,) = needle_samples(tok, needles=3, queries=1, depth=40, length=CONTEXT, count=1, seed=4, text=text)
    plant(model, uniform)
    try:
        alloc = attention_allocation(model, sample)
    finally:
        plant(model, None)
    sums = row_sums(model, kind)
    for rows in ("last", "question"):
        for answer in ("sentence", "number"):
            raw, norm = alloc[(rows, answer)]
            want = uniform_shares(sample, rows, answer)
            assert 0 < want[2] < 0.2 and want[1] > 0.1  # a real spread: a wrong segment edge would show
            for layer in range(len(model.layers)):
                assert norm[layer].tolist() == pytest.approx(want, abs=1e-6)
                assert raw[layer].tolist() == pytest.approx([w * sums[layer] for w in want], abs=1e-6)


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_a_run_reports_the_hand_counted_shares_of_uniform_attention_as_json_and_a_plot(tok, data_dir, tmp_path,
                                                                                         kind):
    cfg = EvalConfig(data_dir=data_dir, eval_seed=7)
    model = model_of(kind)
    depths = (25, 75)
    task = get_task("attention-noise", depths=depths, samples=2, query_rows="question", answer="number")
    plant(model, uniform)
    try:
        result = run_task(task, model, tok, cfg)
    finally:
        plant(model, None)
    text = haystack_text(cfg, tok, "t")[0]
    prompts = {d: needle_samples(tok, needles=1, queries=1, depth=d, length=CONTEXT, count=2, seed=7, text=text,
                                 context=CONTEXT) for d in depths}

    def expected(rows, answer, depth=None):
        chosen = [s for d in depths if depth in (None, d) for s in prompts[d]]
        shares = [uniform_shares(s, rows, answer) for s in chosen]
        return [sum(x[i] for x in shares) / len(shares) for i in range(5)]

    m, sums = result.metrics, row_sums(model, kind)
    want = expected("question", "number")
    assert [m[s] for s in SEGMENTS] == pytest.approx(want, abs=1e-6)
    assert m["noise"] == pytest.approx(want[1] + want[3], abs=1e-6)
    assert m["raw_answer"] == pytest.approx(want[2] * sum(sums) / len(sums), abs=1e-6)
    assert m["raw_total"] == pytest.approx(sum(sums) / len(sums), abs=1e-6)
    for d in depths:
        at = expected("question", "number", d)
        assert m[f"answer@{d}"] == pytest.approx(at[2], abs=1e-6)
        assert m[f"noise@{d}"] == pytest.approx(at[1] + at[3], abs=1e-6)
    last = expected("last", "sentence")
    assert result.details["variants"]["last/sentence"]["answer"] == pytest.approx(last[2], abs=1e-6)
    assert result.details["variants"]["last/sentence"]["noise"] == pytest.approx(last[1] + last[3], abs=1e-6)
    assert result.settings["length"] == CONTEXT and len(result.details["per_layer"]["normalised"]) == 2
    json.dumps(result.to_dict())
    assert task.plot(result, tmp_path / "noise.png") and (tmp_path / "noise.png").stat().st_size > 10_000


def test_length_zero_takes_the_eval_seq_len_before_the_models_context(tok, data_dir):
    shorter = run_task(get_task("attention-noise", depths=(50,), samples=1), model_of("diff"), tok,
                       EvalConfig(data_dir=data_dir, seq_len=380))
    assert shorter.settings["length"] == 380


def test_bad_inputs_are_one_line_value_errors(tok, data_dir):
    cfg = EvalConfig(data_dir=data_dir)

    def bad(match, model=None, cfg=cfg, **options):
        with pytest.raises(ValueError, match=match) as e:
            run_task(get_task("attention-noise", **options), model or model_of("diff"), tok, cfg)
        assert "\n" not in str(e.value)

    bad(f"beyond the model's context of {CONTEXT} tokens", length=CONTEXT + 1)
    bad("outside 0..100", depths=(0, 120))
    bad("query_rows must be one of", query_rows="first")
    bad("answer must be one of", answer="city")
    bad("EvalConfig.data_dir", cfg=EvalConfig())
    bad("do not fit", needles=12)
    fake = torch.nn.Module()
    fake.config = SimpleNamespace(max_position_embeddings=CONTEXT)
    bad("needs one of this package's models", model=fake)
