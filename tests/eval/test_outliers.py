"""outliers: streaming top-k and median against exact answers, planted logits and hidden states, the memory bound."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

import difftransformer.eval.probes.outliers as ol
from difftransformer.data import PreparedData
from difftransformer.eval import EvalConfig, get_task, run_task
from difftransformer.eval.probes import capture_layer_outputs, inspect_attention
from difftransformer.model import DiffTransformerLM
from tests.helpers import raises_one_line, tiny

CONTEXT = 16


def model_of(kind: str, seed: int = 0) -> DiffTransformerLM:
    torch.manual_seed(seed)
    return DiffTransformerLM(tiny(kind, vocab_size=300, max_position_embeddings=CONTEXT)).eval()


def probe(model, data_dir, tokens: int = 2 * CONTEXT, **cfg):
    cfg = EvalConfig(data_dir=data_dir, batch_size=2, **cfg)
    return run_task(get_task("outliers", tokens=tokens), model, None, cfg)


def test_streamed_topk_equals_topk_over_everything():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    chunks = [torch.randn(n, generator=g) * 10 for n in (7, 300, 1, 64, 1000, 99)]
    stats = ol.AbsStats()
    for c in chunks:
        stats.update(c)
    everything = torch.cat(chunks).abs().double()
    assert torch.equal(stats.top, torch.topk(everything, 100).values)
    assert stats.kth(3) == float(torch.topk(everything, 3).values[-1]) and stats.count == everything.numel()
    few = ol.AbsStats()
    few.update(torch.tensor([-2.0, 1.0]))
    assert few.kth(1) == 2.0 and few.kth(2) == 1.0 and few.kth(3) is None  # fewer than k seen
    assert ol.merge_topk(torch.tensor([5.0, 1.0]), torch.tensor([3.0, 4.0, 0.5]), 3).tolist() == [5.0, 4.0, 3.0]


def test_the_histogram_median_is_within_its_stated_resolution():
    assert ol.MEDIAN_RELATIVE_ERROR == pytest.approx(0.00115, abs=1e-5)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    for n in (1, 2, 1001, 20000):
        values = 10 ** (torch.rand(n, generator=g, dtype=torch.float64) * 12 - 6)  # magnitudes 1e-6 .. 1e6
        values *= torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
        stats = ol.AbsStats()
        for part in values.split(333):
            stats.update(part)
        exact = float(values.abs().median())  # the lower median, as the histogram's
        assert stats.median() == pytest.approx(exact, rel=ol.MEDIAN_RELATIVE_ERROR + 1e-6), n
    stats = ol.AbsStats()
    stats.update(torch.tensor([3.0, -1.0, 2.0]))
    assert stats.median() == pytest.approx(2.0, rel=ol.MEDIAN_RELATIVE_ERROR)
    zeros = ol.AbsStats()
    zeros.update(torch.tensor([0.0, 0.0, 0.0, 5.0, float("nan")]))  # exact zeros counted apart, NaN left out
    assert zeros.median() == 0.0 and zeros.summary()["zeros"] == 3 and zeros.summary()["nans"] == 1
    extremes = ol.AbsStats()
    extremes.update(torch.tensor([1e-12, 1e-12, 1e12], dtype=torch.float64))
    assert extremes.median() == 1e-8 and extremes.summary()["underflow"] == 2 and extremes.kth(1) == 1e12


@pytest.mark.parametrize("kind", ["diff", "transformer", "diff_v2"])
def test_the_probe_equals_a_brute_force_pass_over_every_value(data_dir, kind):
    model = model_of(kind)
    result = probe(model, data_dir, tokens=3 * CONTEXT)
    logits, hidden = [], []

    def keep(i):
        def hook(scores, visible):
            logits.append(scores.abs().masked_select(visible).double())
        return hook

    tokens = PreparedData.load(data_dir).dataset("test").tokens
    windows = torch.tensor(tokens[:3 * CONTEXT].astype("int64")).view(3, CONTEXT)  # the split's first windows
    with torch.no_grad(), inspect_attention(model, keep), \
            capture_layer_outputs(model, lambda i, h: hidden.append(h.abs().reshape(-1).double())):
        model(windows)
    for name, values in (("attention_logits", torch.cat(logits)), ("hidden_states", torch.cat(hidden))):
        for k in ol.TOP_KS:
            assert result.metrics[f"{name}_top{k}"] == float(torch.topk(values, k).values[-1]), (name, k)
        assert result.metrics[f"{name}_median"] == pytest.approx(float(values.median()),
                                                                  rel=ol.MEDIAN_RELATIVE_ERROR + 1e-5)  # fp32 logs
        assert result.details["overall"][name]["count"] == values.numel()
    cfg = model.config
    maps = 2 if kind == "diff" else 1  # DIFF: two maps per head; V2: 2H query heads of one map each
    query_maps = cfg.num_attention_heads * (1 if kind == "transformer" else 2)
    visible = CONTEXT * (CONTEXT + 1) // 2  # causal: the future is excluded
    assert result.details["overall"]["attention_logits"]["count"] == 3 * cfg.num_hidden_layers * query_maps * visible
    assert result.settings["maps_per_layer"] == [maps] * cfg.num_hidden_layers
    json.dumps(result.to_dict(), allow_nan=False)


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_a_planted_logit_is_top1_and_a_planted_future_logit_is_not_counted(data_dir, kind):
    model = model_of(kind)
    query, key, future = 5, 3, 9
    seen = []

    def plant(scores, visible):
        assert visible[0, 0, 0, query, key] and not visible[0, 0, 0, query, future]
        seen.append(True)
        scores = scores.clone()
        scores[0, 0, -1, query, key] = -1234.5  # visible: counted as |-1234.5|
        scores[0, -1, 0, query, future] = 9999.0  # the future: masked, never counted
        return scores

    model.layers[1].self_attn.score_hook = plant
    result = probe(model, data_dir)
    assert seen and model.layers[1].self_attn.score_hook is plant  # the probe left the layer's hook in place
    assert result.metrics["attention_logits_top1"] == 1234.5
    assert result.metrics["attention_logits_top2"] < 100
    per_layer = result.details["per_layer"]["attention_logits"]
    assert per_layer[1]["top1"] == 1234.5 and per_layer[0]["top1"] < 100
    assert 9999.0 not in result.details["top100"]["attention_logits"]


def test_a_planted_hidden_state_is_top1_with_its_exact_value(data_dir):
    model = model_of("diff")

    def plant(_module, _inputs, output):
        output = output.clone()
        output[1, 4, 7] = -777.25
        return output

    handle = model.layers[-1].register_forward_hook(plant)  # the last block: the residual stream carries it no further
    try:
        result = probe(model, data_dir)
    finally:
        handle.remove()
    assert result.metrics["hidden_states_top1"] == 777.25 and result.metrics["hidden_states_top2"] < 100
    per_layer = result.details["per_layer"]["hidden_states"]
    assert per_layer[-1]["top1"] == 777.25 and max(layer["top1"] for layer in per_layer[:-1]) < 100


def test_the_state_does_not_grow_with_the_token_budget(data_dir, tmp_path):
    model = model_of("diff")
    small, large = probe(model, data_dir, tokens=1), probe(model, data_dir, tokens=5 * CONTEXT)
    assert small.settings["windows"] == 1 and large.settings["windows"] == 5  # a budget rounds up to whole windows
    counts = [r.details["overall"]["hidden_states"]["count"] for r in (small, large)]
    assert counts[1] == 5 * counts[0]
    assert small.settings["state_bytes"] == large.settings["state_bytes"]
    assert small.settings["state_bytes"] <= 2 * model.config.num_hidden_layers * ((ol.NUM_BINS + 2) * 8 + 100 * 8 + 16)
    capped = probe(model, data_dir, tokens=5 * CONTEXT, max_windows=2)
    assert capped.settings["windows"] == 2 and capped.settings["tokens"] == 2 * CONTEXT
    path = tmp_path / "outliers.png"
    assert get_task("outliers").plot(large, path) and path.stat().st_size > 0


class Foreign(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=CONTEXT)


BAD = {  # what is asked -> the start of the one-line error
    "a model not of this package": (lambda d: probe(Foreign(), d), "outliers looks inside attention and needs one"),
    "no token budget": (lambda d: get_task("outliers", tokens=0), "option tokens is the token budget and must be >= 1"),
    "no data": (lambda d: run_task("outliers", model_of("diff"), None, EvalConfig()),
                "outliers reads held-out text: set EvalConfig.data_dir"),
    "beyond the context": (lambda d: probe(model_of("diff"), d, seq_len=2 * CONTEXT),
                           "seq_len 32 is beyond the model's context of 16 tokens"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_are_one_line_errors(data_dir, name):
    ask, needle = BAD[name]
    with raises_one_line(ValueError, needle):
        ask(data_dir)


def test_the_batch_shrinks_to_what_memory_holds_and_changes_no_number(data_dir, monkeypatch):
    """probe_batch: with room for one window of explicit maps only, windows go one at a time (same result);
    with room for none, a one-line error names the window, the memory and a shorter window that fits."""
    import difftransformer.eval.probes.hooks as hooks

    model = model_of("diff")
    full = probe(model, data_dir, tokens=4 * CONTEXT)
    maps = 2 * model.config.num_attention_heads
    one_window = 4 * maps * CONTEXT * CONTEXT * hooks._EAGER_COPIES
    monkeypatch.setattr(hooks, "_free_bytes", lambda device: 2 * one_window + 1)
    assert hooks.probe_batch(model, CONTEXT, 8, "cpu") == 1
    seen = []
    forward = DiffTransformerLM.forward
    monkeypatch.setattr(DiffTransformerLM, "forward", lambda self, ids, *a, **kw: seen.append(ids.shape[0]) or
                        forward(self, ids, *a, **kw))
    alone = probe(model, data_dir, tokens=4 * CONTEXT)
    assert seen == [1, 1, 1, 1] and alone.metrics == full.metrics
    monkeypatch.setattr(hooks, "_free_bytes", lambda device: one_window // 3)
    # 128 T² bytes <= 5,461
    with pytest.raises(ValueError, match=r"one window of 16 tokens needs ~32.0 KiB of explicit attention maps "
                                         r"\(4 maps of 16x16 per layer\).*use a shorter window, e.g. --seq-len 4$"):
        probe(model, data_dir, tokens=4 * CONTEXT)


def test_nan_values_are_counted_in_the_metrics_not_dropped_silently(data_dir):
    """A NaN is left out of the top values and the median (it has no size) and counted where the numbers are."""
    model = model_of("diff")

    def plant(_module, _inputs, output):
        output = output.clone()
        output[0, 2, :5] = float("nan")
        return output

    clean = probe(model, data_dir)
    assert "hidden_states_nans" not in clean.metrics and "attention_logits_nans" not in clean.metrics
    handle = model.layers[-1].register_forward_hook(plant)
    try:
        result = probe(model, data_dir)
    finally:
        handle.remove()
    assert result.metrics["hidden_states_nans"] == 5 and math.isfinite(result.metrics["hidden_states_top1"])
