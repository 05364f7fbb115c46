"""The `ood` probe: accuracy per query with Wilson intervals, adaptive temperature, and attention masses, each on
cases whose answer is known by hand (an oracle, a guesser, attention planted on the target)."""

import contextlib
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from difftransformer import DiffTransformerLM, get_preset
from difftransformer.data.ood import MQAR, TRAIN, Condition, FlipFlop, Induction
from difftransformer.data.ood.sampler import eval_set
from difftransformer.data.prepare import prepare_task
from difftransformer.eval import EvalConfig, get_task, run_task
from difftransformer.eval.probes.hooks import inspect_attention, rescale_queries
from difftransformer.eval.probes.ood import (
    ADAPTIVE_POLY,
    MASSES,
    OODOptions,
    adaptive_beta,
    adaptive_temperature_queries,
    conditions,
    mechanism,
    position_masses,
    query_accuracy,
    row_entropy,
    score,
    wilson_interval,
)
from difftransformer.model.inputs import keep_last_positions


def test_wilson_interval_matches_hand_values():
    lo, hi = wilson_interval(5, 10)  # p = 0.5, n = 10: the textbook 95% interval
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson_interval(0, 10_000)
    assert lo == 0 and hi == pytest.approx(3.8415 / (10_000 + 3.8415), rel=1e-3)  # z^2 / (n + z^2) at 0 errors
    lo, hi = wilson_interval(10, 10_000)  # a 1e-3 error rate is resolved from 0 at the default query count
    assert 0 < lo < 1e-3 < hi < 2e-3
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert all(wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0 for n in range(1, 40_000, 997))


def test_a_query_is_right_only_when_every_answer_token_is():
    correct = np.array([True, False, True, True, True])
    queries = np.array([1, 1, 2, 3, 3])
    assert query_accuracy(correct, queries) == (3, 1)


class Oracle(nn.Module):
    """Logits that put the answer first at every position: reads the answers of known episodes."""

    def __init__(self, episodes, vocab, wrong=False):
        super().__init__()
        self.answers = {tuple(r[:n]): t for r, t, n in zip(episodes.inputs, episodes.targets, episodes.lengths)}
        self.vocab, self.wrong = vocab, wrong

    def forward(self, ids, logits_to_keep=0):
        out = torch.zeros(*ids.shape, self.vocab)
        for b, row in enumerate(ids.tolist()):
            for n in range(len(row), 0, -1):
                if tuple(row[:n]) in self.answers:
                    targets = torch.as_tensor(self.answers[tuple(row[:n])])
                    break
            keep = targets >= 0
            pos = torch.nonzero(keep).squeeze(1)
            out[b, pos, (targets[keep] + int(self.wrong)) % self.vocab] = 1.0
        return type("Out", (), {"logits": keep_last_positions(out, logits_to_keep)})()


class Guesser(nn.Module):
    """Random logits over the value tokens only: a model that knows the format but not the pairs."""

    def __init__(self, family):
        super().__init__()
        self.values = family.ids()["value"], family.ids()["value"] + family.num_values
        self.vocab = family.vocab_size

    def forward(self, ids, logits_to_keep=0):
        logits = torch.full((*ids.shape, self.vocab), -1e9)
        logits[..., self.values[0]:self.values[1]] = torch.rand(*ids.shape, self.values[1] - self.values[0])
        return type("Out", (), {"logits": keep_last_positions(logits, logits_to_keep)})()


def test_an_oracle_scores_one_a_wrong_oracle_zero_and_a_guesser_chance():
    family = MQAR(num_values=8)
    episodes = eval_set(family, TRAIN, 300)
    total, errors = query_accuracy(*score(Oracle(episodes, family.vocab_size), episodes, 64, "cpu"))
    assert total == 300 * family.queries and errors == 0
    total, errors = query_accuracy(*score(Oracle(episodes, family.vocab_size, wrong=True), episodes, 64, "cpu"))
    assert errors == total
    torch.manual_seed(0)
    total, errors = query_accuracy(*score(Guesser(family), episodes, 64, "cpu"))
    lo, hi = wilson_interval(total - errors, total)
    assert lo < 1 / 8 < hi  # chance is 1 / num_values


def test_conditions_are_the_training_one_then_lengths_then_densities():
    got = conditions(OODOptions(lengths=(1.0, 2.0, 4.0), densities=(1.0, 3.0)))
    assert got == [TRAIN, Condition(length=2), Condition(length=4), Condition(density=3)]


def test_adaptive_beta_is_the_authors_fit_above_half_a_nat():
    h = torch.tensor([0.1, 0.5, 0.6, 1.0, 2.0, 3.0], dtype=torch.float64)
    want = np.where(h.numpy() > 0.5, np.maximum(1.0, np.polyval(ADAPTIVE_POLY, h.numpy())), 1.0)
    assert torch.allclose(adaptive_beta(h), torch.from_numpy(want))
    assert adaptive_beta(torch.tensor([2.0])).item() > 1  # a dispersed map is sharpened


def _entropy64(logits: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """-sum p log p over the visible keys of every row, in float64, from explicit logits."""
    logits = logits.double()
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True).nan_to_num(nan=0.0)  # no key: 0


def test_row_entropy_matches_explicit_maps_over_blocks_of_rows():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q, k = torch.randn(2, 3, 37, 8, generator=g) * 2, torch.randn(2, 3, 41, 8, generator=g) * 2
    visible = torch.ones(2, 1, 37, 41, dtype=torch.bool).tril(41 - 37)
    visible[1, ..., :6] = False  # padded keys: the first 2 rows of sequence 1 (keys 0..4, 0..5) see none
    want = _entropy64(torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * 0.3, visible)
    for block in (1, 5 * 2 * 3 * 41 * 4, 1 << 22):  # one row per block, 5 rows, every row at once
        got = row_entropy(q, k, 0.3, visible, block_bytes=block)
        assert got.shape == (2, 3, 37, 1) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(row_entropy(q, k, 0.3, visible)[1, :, :2], torch.zeros(3, 2, 1))
    uniform = row_entropy(torch.zeros(1, 1, 1, 4), torch.randn(1, 1, 8, 4), 1.0, None)
    assert uniform.item() == pytest.approx(math.log(8), abs=1e-6)  # a uniform row over 8 keys: log 8


def test_adaptive_temperature_sharpens_dispersed_rows_and_keeps_sharp_ones():
    k = torch.eye(8)[None, None]  # key j = e_j: the logits of a query are its coordinates
    q = torch.stack([torch.arange(8.0) / 10, torch.tensor([20.0] + [0.0] * 7)])[None, None].reshape(1, 1, 2, 8)
    out = adaptive_temperature_queries(q, k, 1.0, None)
    h = _entropy64(q.double(), None)[0, 0, 0, 0].item()  # near uniform over 8: H ~ 2.07
    beta = max(1.0, float(np.polyval(ADAPTIVE_POLY, h)))
    assert beta > 1 and torch.allclose(out[0, 0, 0], q[0, 0, 0] * beta)
    assert torch.equal(out[0, 0, 1], q[0, 0, 1])  # one-hot: H ~ 0, beta = 1
    visible = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    visible[..., 4:] = False  # hidden keys do not count in the entropy
    masked = adaptive_temperature_queries(q, k, 1.0, visible)
    assert torch.allclose(masked[0, 0, 0], q[0, 0, 0] * adaptive_beta(_entropy64(q[..., :4], None)[0, 0, 0]).float())


def _reference_adaptive_scores(scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Adaptive temperature by its definition, as a score hook on explicit float64 logits: each row times β(H)."""
    return scores * adaptive_beta(_entropy64(scores, visible)).to(scores.dtype)


@pytest.mark.parametrize("attention,position", [(kind, "rope") for kind in (
    "transformer", "diff", "diff_v2", "transformer_ssmax", "transformer_gated")] + [("transformer", "none"),
                                                                                   ("diff", "none")])
def test_adaptive_temperature_on_the_fast_backend_equals_its_definition_on_explicit_maps(attention, position):
    """The query hook on the model's own backend (the fused CPU kernel) gives the logits of the definition
    (every map's logits times β of its entropy) computed on explicit float64 maps, GQA and NoPE included."""
    cfg = get_preset("tiny").config(attention)
    heads = 4 if attention == "diff" else 8  # two kv groups of two query heads (DIFF: of two DIFF heads)
    cfg = type(cfg)(**{**cfg.to_dict(), "num_attention_heads": heads, "num_key_value_heads": heads // 2,
                       "position_encoding": position})
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = DiffTransformerLM(cfg).eval()
    with torch.no_grad():
        for layer in model.modules():  # large logits, so that some rows are sharp (β = 1) and some dispersed
            if isinstance(layer, nn.Linear) and layer.out_features != cfg.vocab_size:
                layer.weight.mul_(3.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    with torch.no_grad():
        plain = model(ids).logits
        with rescale_queries(model, adaptive_temperature_queries):
            fast = model(ids).logits
        reference = DiffTransformerLM(cfg).double().eval()
        reference.load_state_dict(model.state_dict())
        with inspect_attention(reference, lambda _: _reference_adaptive_scores):
            want = reference(ids).logits
    assert all(layer.query_hook is None for layer in (b.self_attn for b in model.layers))
    assert (fast - plain).abs().max() > 1e-3  # it changed something
    torch.testing.assert_close(fast.double(), want, rtol=1e-4, atol=1e-4)


def _planted(model, episodes):
    """Score hooks that put every answer row's attention on its target item (logits 0 there, -1e4 elsewhere)."""
    masks = torch.zeros(*episodes.inputs.shape, episodes.inputs.shape[1], dtype=torch.bool)
    for b, t in zip(*np.nonzero(episodes.answer_mask)):
        keys = (np.arange(episodes.inputs.shape[1]) < t) & (episodes.support[b] == episodes.answer_item[b, t])
        masks[b, t] = torch.from_numpy(keys)
    answer_rows = torch.from_numpy(episodes.answer_mask)

    def hook(scores, visible):
        T, S = scores.shape[-2:]
        planted = torch.where(masks[:, None, None, :T, :S], 0.0, -1e4).to(scores.dtype)
        return torch.where(answer_rows[:, None, None, :T, None], planted, scores)

    for block in model.layers:
        block.self_attn.score_hook = hook


@pytest.mark.parametrize("attention", ["transformer", "diff", "transformer_ssmax"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_batches_of_like_length_score_every_query_as_the_sequence_alone(attention, adaptive):
    """score() sorts sequences by length into padded batches; every answer must be scored as the model predicts
    it on its sequence alone (no padding at all), with and without adaptive temperature. The answers are set to
    those lone predictions, so every query is right exactly when batching changed nothing."""
    family = MQAR(num_keys=16, num_values=16, min_pairs=2, max_pairs=6, queries=2, min_context=12, max_context=40)
    episodes = eval_set(family, TRAIN, 40)
    assert len(set(episodes.lengths.tolist())) > 5  # lengths vary, so batches are padded differently
    cfg = get_preset("tiny").config(attention)
    torch.manual_seed(1)
    model = DiffTransformerLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size})).eval()
    hook = adaptive_temperature_queries if adaptive else None
    for i, n in enumerate(episodes.lengths):
        with torch.no_grad(), (rescale_queries(model, hook) if hook else contextlib.nullcontext()):
            alone = model(torch.from_numpy(episodes.inputs[i:i + 1, :n])).logits[0].argmax(-1).numpy()
        answer = episodes.targets[i, :n] >= 0
        episodes.targets[i, :n][answer] = alone[answer]
    correct, queries = score(model, episodes, 7, "cpu", query_hook=hook)
    assert correct.all() and len(correct) == int(episodes.answer_mask.sum())
    assert len(np.unique(queries)) == len(episodes) * family.queries  # every query keeps its own id


@pytest.mark.parametrize("attention", ["transformer", "diff"])
def test_attention_planted_on_the_target_measures_target_mass_one(attention):
    family = FlipFlop(min_instructions=8, max_instructions=12)
    episodes = eval_set(family, TRAIN, 6)
    cfg = get_preset("tiny").config(attention)
    torch.manual_seed(0)
    model = DiffTransformerLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size})).eval()
    _planted(model, episodes)
    got = mechanism(model, episodes, "cpu")
    assert got["answer_positions"] == int(episodes.answer_mask.sum())
    for layer, block in zip(got["layers"], model.layers):
        for which in ("a1", "a2"):
            masses = layer[f"{which}_mass"]
            assert masses["target"] == pytest.approx([1.0] * len(masses["target"]), abs=1e-6)
            for other in ("distractor", "filler", "other"):
                assert masses[other] == pytest.approx([0.0] * len(masses[other]), abs=1e-6)
        want = 1 - block.self_attn.lambda_full().item() if attention == "diff" else 1.0
        assert layer["diff_mass"]["target"] == pytest.approx([want] * len(layer["diff_mass"]["target"]), abs=1e-5)
        assert all(h >= 0 for h in layer["a1_entropy"]) and all(abs(x) < 1e-3 for x in layer["a1_max_logit"])



def test_attention_on_the_answer_positions_own_key_is_other_mass_not_target():
    """On induction the answer position holds the trigger, whose key supports the answer item: attention on it is
    "other" (a query never reads its answer from itself); on the trigger's earlier occurrence it is target mass."""
    episodes = eval_set(Induction(), TRAIN, 4)
    b, t = (int(i) for i in np.argwhere(episodes.answer_mask)[0])
    item = episodes.answer_item[b, t]
    S = episodes.inputs.shape[1]
    earlier = [j for j in range(t) if episodes.support[b, j] == item]
    assert earlier and episodes.support[b, t] == item  # the case that tells "< t" from "<= t"
    rows = torch.zeros(2, S, dtype=torch.float64)
    rows[0, t], rows[1, earlier[0]] = 1.0, 1.0
    assert position_masses(rows, episodes, b, t).tolist() == [[0, 0, 0, 1], [1, 0, 0, 0]]


def test_the_signed_map_keeps_its_positive_and_negative_parts_apart():
    """DIFF with A1 planted on the target and A2 on the leading EOS (key 0, "other"): A1 - λA2 is +1 on the
    target and -λ on key 0; the signed masses say target 1, other -λ; the parts say positive target 1 and
    negative other -λ, nothing else."""
    family = FlipFlop(min_instructions=8, max_instructions=12)
    episodes = eval_set(family, TRAIN, 5)
    cfg = get_preset("tiny").config("diff")
    torch.manual_seed(0)
    model = DiffTransformerLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size})).eval()
    _planted(model, episodes)
    answer_rows = torch.from_numpy(episodes.answer_mask)
    for block in model.layers:
        on_target = block.self_attn.score_hook

        def hook(scores, visible, on_target=on_target):
            planted = on_target(scores, visible).clone()
            on_eos = torch.full_like(scores[:, :, 1], -1e4)
            on_eos[..., 0] = 0.0
            planted[:, :, 1] = torch.where(answer_rows[:, None, :scores.shape[-2], None], on_eos, scores[:, :, 1])
            return planted

        block.self_attn.score_hook = hook
    for layer, block in zip(mechanism(model, episodes, "cpu")["layers"], model.layers):
        lam = block.self_attn.lambda_full().item()
        heads = len(layer["diff_mass"]["target"])
        want = {"diff": {"target": 1.0, "other": -lam}, "diff_positive": {"target": 1.0},
                "diff_negative": {"other": -lam}}
        for which, nonzero in want.items():
            for part in MASSES:
                assert layer[f"{which}_mass"][part] == pytest.approx([nonzero.get(part, 0.0)] * heads, abs=1e-5), \
                    (which, part)


@pytest.mark.parametrize("attention", ["transformer", "diff", "diff_v2"])
def test_largest_logits_are_per_head_and_per_map(attention):
    """Planted logits: 5 at key 0 for every head's first map, 9 for its second (DIFF V1: map axis 0 and 1; DIFF V2:
    its query heads 2i and 2i + 1; ordinary attention: one map, so even heads 5 and odd heads 9)."""
    family = FlipFlop(min_instructions=8, max_instructions=12)
    episodes = eval_set(family, TRAIN, 4)
    cfg = get_preset("tiny").config(attention)
    torch.manual_seed(0)
    model = DiffTransformerLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size})).eval()

    def hook(scores, visible):
        planted = torch.zeros_like(scores)
        if scores.shape[2] == 2:
            planted[:, :, 0, :, 0], planted[:, :, 1, :, 0] = 5.0, 9.0
        else:
            planted[:, 0::2, 0, :, 0], planted[:, 1::2, 0, :, 0] = 5.0, 9.0
        return planted

    for block in model.layers:
        block.self_attn.score_hook = hook
    for layer in mechanism(model, episodes, "cpu")["layers"]:
        heads = len(layer["a1_mass"]["target"])
        if attention == "transformer":
            want = [5.0 if h % 2 == 0 else 9.0 for h in range(heads)]
            assert layer["a1_max_logit"] == layer["a2_max_logit"] == want
        else:
            assert layer["a1_max_logit"] == [5.0] * heads and layer["a2_max_logit"] == [9.0] * heads

def test_the_task_runs_on_a_model_of_its_task_folder(tmp_path, caplog):
    family = MQAR(min_pairs=2, max_pairs=4, min_context=16, max_context=24, queries=2)
    data = prepare_task(family, tmp_path / "data")
    cfg = get_preset("tiny").config("diff")
    cfg = type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size, "max_position_embeddings": 64})
    model = DiffTransformerLM(cfg)
    task = get_task("ood", lengths=(1.0, 2.0, 4.0), densities=(1.0, 2.0), min_queries=40, attention_sequences=4)
    with caplog.at_level("INFO", logger="difftransformer.eval"):
        result = run_task(task, model, data.tokenizer(), EvalConfig(data_dir=str(data.out_dir)))
    names = [c["condition"] for c in result.details["cells"]]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ood ")]
    assert [m.split(":")[0] for m in progress] == [f"ood {n}" for n in names]  # one line per condition, as it ends
    cells = result.details["cells"]
    assert f"accuracy {cells[1]['accuracy']:.4f} over {cells[1]['queries']} queries, adaptive" in progress[1]
    assert names == ["length1x-density1x", "length2x-density1x", "length1x-density2x"]
    assert [s["condition"] for s in result.details["skipped"]] == ["length4x-density1x"]  # > 64 positions
    cell = result.details["cells"][0]
    assert cell["queries"] >= 40 and 0 <= cell["accuracy"] <= 1 and "adaptive" in cell
    lo, hi = cell["error_rate_ci95"]
    assert lo <= 1 - cell["accuracy"] <= hi
    assert set(cell["attention"]["mean"]["diff"]) == {"target", "distractor", "filler", "other"}
    shares = {(i, h): lay["diff_positive_mass"]["target"][h] / sum(lay["diff_positive_mass"][m][h] for m in MASSES)
              for i, lay in enumerate(cell["attention"]["layers"]) for h in range(len(lay["diff_mass"]["target"]))}
    head = max(shares, key=shares.get)  # the training condition's retrieving head, by hand
    for other in result.details["cells"]:  # read at every condition, the same head
        assert (other["attention"]["retrieving"]["layer"], other["attention"]["retrieving"]["head"]) == head
    assert cell["attention"]["retrieving"]["target"] == pytest.approx(shares[head])
    assert result.metrics["accuracy"] == cell["accuracy"]
    assert task.plot(result, tmp_path / "ood.png") and (tmp_path / "ood.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="synthetic task"):
        get_task("ood").run(model, None, EvalConfig())


def test_a_model_that_cannot_hold_the_training_condition_is_an_error_not_a_shifted_baseline(tmp_path):
    """Accuracy, the retrieving head and every other condition are read against the training condition: without
    it the task stops with the reason, instead of treating the next condition as the baseline."""
    family = MQAR(min_pairs=2, max_pairs=4, min_context=16, max_context=24, queries=2)
    data = prepare_task(family, tmp_path / "data")
    cfg = get_preset("tiny").config("transformer")
    model = DiffTransformerLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size,
                                           "max_position_embeddings": family.max_length(TRAIN) - 1}))
    task = get_task("ood", lengths=(1.0, 0.5), densities=(1.0,), min_queries=8, attention_sequences=0)
    with pytest.raises(ValueError, match=r"cannot score the training condition: \d+ tokens exceed the model's "
                                         r"max_position_embeddings"):
        run_task(task, model, data.tokenizer(), EvalConfig(data_dir=str(data.out_dir)))


def test_options_are_bounded():
    with pytest.raises(ValueError, match="min_queries"):
        get_task("ood", min_queries=0)
    with pytest.raises(ValueError, match="factor"):
        get_task("ood", lengths=(0.0,))
    assert math.isfinite(get_task("ood").options.min_queries)


def _fake_cells(accuracy: float) -> list[dict]:
    return [{"condition": TRAIN.name, "accuracy": accuracy}]


def test_min_accuracy_skips_every_condition_out_of_distribution_below_it_and_none_at_it():
    family = MQAR(min_pairs=2, max_pairs=4, min_context=16, max_context=24, queries=2)
    task = get_task("ood", min_accuracy=0.99)
    far = Condition(length=2.0)
    assert task._skip(family, far, 1024, _fake_cells(0.99)) is None  # reaching the bar is enough
    skip = task._skip(family, far, 1024, _fake_cells(0.9899))
    assert skip["cause"] == "min_accuracy" and "accuracy 0.9899 at the training condition is below" in skip["reason"]
    assert task._skip(family, TRAIN, 1024, _fake_cells(0.5)) is None  # the training condition itself is scored
    assert get_task("ood")._skip(family, far, 1024, _fake_cells(0.0)) is None  # 0: always
    assert task._skip(family, far, 20, _fake_cells(1.0))["cause"] == "position_limit"
    longest = family.max_length(far)  # a model whose positions just hold the condition's longest sequence scores it
    assert task._skip(family, far, longest, []) is None
    assert task._skip(family, far, longest - 1, [])["cause"] == "position_limit"
    with pytest.raises(ValueError, match=r"min_accuracy is an accuracy in \[0, 1\]"):
        get_task("ood", min_accuracy=1.5)


def test_a_stored_result_serves_every_min_accuracy_whose_conditions_it_scored(tmp_path):
    """min_accuracy only skips work: a result that scored every condition serves any threshold (also one stored
    before the option existed); one that skipped them serves only a threshold that would skip them too."""
    from difftransformer.eval.comparison import compare_table
    from difftransformer.eval.results import ResultsDir, StoredResultError, evaluate_cached
    from difftransformer.eval.task import task_settings
    from difftransformer.experiments.evaluate import stale_evaluations

    family = MQAR(min_pairs=2, max_pairs=4, min_context=16, max_context=24, queries=2)
    data = prepare_task(family, tmp_path / "data")
    cfg = get_preset("tiny").config("transformer")
    torch.manual_seed(0)
    model = DiffTransformerLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": family.vocab_size,
                                           "max_position_embeddings": 64}))
    small = dict(lengths=(1.0, 2.0), densities=(1.0,), min_queries=40, attention_sequences=0,
                 adaptive_temperature=False)
    results, ecfg = ResultsDir(tmp_path / "eval"), EvalConfig(data_dir=str(data.out_dir))
    full, reused = evaluate_cached(get_task("ood", **small), model, data.tokenizer(), ecfg, results)
    accuracy = full["metrics"]["accuracy"]
    assert not reused and accuracy < 0.5
    assert [c["condition"] for c in full["details"]["cells"]] == [TRAIN.name, "length2x-density1x"]
    _, reused = evaluate_cached(get_task("ood", **small, min_accuracy=0.99), model, data.tokenizer(), ecfg, results)
    assert reused
    legacy = json.loads(json.dumps(full))
    del legacy["settings"]["options"]["min_accuracy"]  # stored before the option existed
    for record in (full, legacy):
        assert stale_evaluations({"ood": record}, ["ood"], {"ood": {**small, "min_accuracy": 0.99}}) == {}
    results.json_path("ood").write_text(json.dumps(legacy))
    digest, asked = full["provenance"]["weights_sha256"], get_task("ood", **small, min_accuracy=0.99)
    settings = task_settings(asked, ecfg, model)
    assert results.conflict("ood", digest, settings) is None and results.cached("ood", digest, settings) == legacy
    b = json.loads(json.dumps(full))
    b["settings"]["options"]["min_accuracy"] = 0.5
    assert "not compared" not in compare_table({"ood": legacy}, {"ood": b}, ("a", "b"), ("t", "d"))
    cut, _ = evaluate_cached(get_task("ood", **small, min_accuracy=0.99), model, data.tokenizer(), ecfg, results,
                             force=True)
    assert [c["condition"] for c in cut["details"]["cells"]] == [TRAIN.name]
    assert {s["cause"] for s in cut["details"]["skipped"]} == {"min_accuracy"}
    assert "accuracy_length2x-density1x" not in cut["metrics"]
    assert stale_evaluations({"ood": cut}, ["ood"], {"ood": {**small, "min_accuracy": 0.6}}) == {}
    stale = stale_evaluations({"ood": cut}, ["ood"], {"ood": small})
    assert "min_accuracy: 0.99 before, 0.0 now" in stale["ood"]
    assert stale_evaluations({"ood": cut}, ["ood"], {"ood": {**small, "min_accuracy": accuracy}})  # reaches it
    with pytest.raises(StoredResultError, match="min_accuracy"):
        evaluate_cached(get_task("ood", **small), model, data.tokenizer(), ecfg, results)
    _, reused = evaluate_cached(get_task("ood", **small, min_accuracy=0.6), model, data.tokenizer(), ecfg, results)
    assert reused
