"""Attention-logit fake quantisation: the quantiser by hand, and the probe's bit widths on a tiny model."""

from __future__ import annotations

import pytest
import torch

from difftransformer.eval.probes.logit_quant import fake_quantize


def test_absmax_quantisation_by_hand():
    x = torch.tensor([0.0, 0.3, -1.0, 0.74, 0.76, 7.0]).view(1, 1, 1, 1, 6)
    # 4 bits: levels of 7 / 7 = 1.0
    got = fake_quantize(x, None, 4, "tensor").flatten().tolist()
    assert got == [0.0, 0.0, -1.0, 1.0, 1.0, 7.0]
    # 2 bits: one magnitude level of 7.0: everything below 3.5 rounds to 0
    assert fake_quantize(x, None, 2, "tensor").flatten().tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 7.0]


def test_eight_bit_rounding_by_hand_halves_to_even():
    # 8 bits: absmax 127 / (2^7 - 1) = a step of exactly 1.0; torch.round sends halves to the even level
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 1.27, 63.49, 63.51, -126.5, -127.0]).view(1, 1, 1, 1, 9)
    assert fake_quantize(x, None, 8, "tensor").flatten().tolist() == [0.0, 0.0, 2.0, 2.0, 1.0, 63.0, 64.0, -126.0,
                                                                      -127.0]
    # per row: row 1's absmax 12.7 gives a step of 0.1 there, while row 0 keeps a step of 1.0
    rows = torch.tensor([[127.0, 3.4, 0.6], [12.7, 0.34, -0.06]]).view(1, 1, 1, 2, 3)
    got = fake_quantize(rows, None, 8, "row")[0, 0, 0]
    assert got[0].tolist() == [127.0, 3.0, 1.0]
    assert got[1].tolist() == pytest.approx([12.7, 0.3, -0.1], abs=1e-6)
    # per tensor the larger row sets the step for both: 0.34 and -0.06 round to 0
    assert fake_quantize(rows, None, 8, "tensor")[0, 0, 0, 1].tolist() == [13.0, 0.0, 0.0]


def test_masked_entries_do_not_set_the_scale_and_rows_are_separate():
    x = torch.tensor([[1.0, 100.0], [2.0, 4.0]]).view(1, 1, 1, 2, 2)
    visible = torch.tensor([[True, False], [True, True]]).view(1, 1, 1, 2, 2)
    tensor = fake_quantize(x, visible, 3, "tensor")  # scale 4 / 3 from the visible max 4
    step = 4.0 / 3
    assert tensor[0, 0, 0, 1].tolist() == pytest.approx([round(2.0 / step) * step, 4.0])
    row = fake_quantize(x, visible, 3, "row")  # row 0: scale 1 / 3, row 1: 4 / 3
    assert row[0, 0, 0, 0, 0].item() == pytest.approx(1.0)
    assert row[0, 0, 0, 1].tolist() == pytest.approx(tensor[0, 0, 0, 1].tolist())


def test_tensor_scale_is_per_sequence_and_map():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 2, 4, 4)
    x[0, :, 0] *= 100  # sequence 0, map 0 has a much larger range
    q = fake_quantize(x, None, 8, "tensor")
    err = (q - x).abs()
    assert err[1].max() <= x[1].abs().amax() / 127 / 2 + 1e-6
    assert err[0, :, 1].max() <= x[0, :, 1].abs().amax() / 127 / 2 + 1e-6


@pytest.mark.parametrize("bits", [8, 6, 4, 3])
def test_error_is_at_most_half_a_step_and_grows_as_bits_shrink(bits):
    torch.manual_seed(bits)
    x = torch.randn(2, 2, 2, 5, 5) * 10
    q = fake_quantize(x, None, bits, "row")
    step = x.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert ((q - x).abs() <= step / 2 + 1e-5).all()
    assert torch.allclose(q / step, torch.round(q / step), atol=1e-4)  # on the grid


def test_bad_settings():
    x = torch.zeros(1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="bits must be >= 2"):
        fake_quantize(x, None, 1, "row")
    with pytest.raises(ValueError, match="granularity"):
        fake_quantize(x, None, 4, "head")
    assert fake_quantize(x, None, 4, "row").tolist() == x.tolist()  # all zeros stay zero, no NaN


def _peaked_model(kind):
    from difftransformer.model import DiffTransformerLM
    from tests.helpers import tiny

    torch.manual_seed(0)
    model = DiffTransformerLM(tiny(kind, vocab_size=300)).eval()
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.q_proj.weight.mul_(40)  # large, spread logits: quantisation has something to lose
    return model


@pytest.mark.parametrize("kind", ["diff", "transformer"])
def test_two_bits_change_the_model_far_more_than_eight(kind):
    from difftransformer.eval.probes import inspect_attention

    model = _peaked_model(kind)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits, -1)

    def kl(bits):
        quantise = lambda s, vis: fake_quantize(s, vis, bits, "tensor")  # noqa: E731
        with inspect_attention(model, lambda i: quantise), torch.no_grad():
            got = torch.log_softmax(model(ids).logits, -1)
        return float((ref.exp() * (ref - got)).sum(-1).mean())

    two, eight = kl(2), kl(8)
    assert two > 1e-3 and eight < two / 20


def quantised_nll_by_hand(model, windows: torch.Tensor, bits: int, paired: bool = False) -> float:
    """Mean NLL of the windows (each seq_len + 1 tokens) with every layer's logits quantised per
    (sequence, map) by a quantiser written out here: step = max over heads, queries and visible keys
    of |x|, over 2^(bits-1) - 1. paired (DIFF V2): map c of pair i is head 2i + c, maps = 1."""
    from difftransformer.eval.probes import inspect_attention

    def quantise(scores, visible):
        out = torch.empty_like(scores)
        visible = torch.ones_like(scores, dtype=torch.bool) if visible is None else visible.expand_as(scores)
        groups = [(slice(c, None, 2), 0) for c in (0, 1)] if paired else [(slice(None), m)
                                                                           for m in range(scores.shape[2])]
        for b in range(scores.shape[0]):
            for heads, m in groups:
                x = scores[b, heads, m]
                step = x[visible[b, heads, m]].abs().max() / (2 ** (bits - 1) - 1)
                out[b, heads, m] = torch.round(x / step) * step
        return out

    with inspect_attention(model, lambda i: quantise), torch.no_grad():
        logits = model(windows[:, :-1]).logits.float()
    return float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:]).double())


def test_the_task_at_eight_bits_equals_a_quantiser_written_by_hand(data_dir):
    from difftransformer.data import PreparedData
    from difftransformer.eval import EvalConfig, get_task, run_task

    model = _peaked_model("diff")
    data = PreparedData.load(data_dir)
    tok = data.tokenizer()
    cfg = EvalConfig(data_dir=data_dir, seq_len=32)
    result = run_task(get_task("logit-quant", bits=(16, 8), granularity=("tensor",), windows=3, needle_samples=0),
                      model, tok, cfg)
    plain = run_task("heldout-loss", model, tok, EvalConfig(data_dir=data_dir, seq_len=32, max_windows=3))
    tokens = torch.from_numpy(data.dataset("test").tokens[:3 * 32 + 1].astype("int64"))
    windows = torch.stack([tokens[i * 32:(i + 1) * 32 + 1] for i in range(3)])  # the trainer's validation windows
    # the probe runs eager attention, the plain model its fused kernel: equal to fp32 rounding
    assert result.metrics["loss@tensor/16"] == pytest.approx(plain.metrics["loss"], rel=1e-6)
    want = quantised_nll_by_hand(model, windows, 8)
    assert result.metrics["loss@tensor/8"] == pytest.approx(want, rel=1e-6)
    change = want - plain.metrics["loss"]  # about -1.1e-4 here: 8 bits move the loss of peaked logits
    assert abs(change) > 5e-5
    assert result.metrics["loss_increase@tensor/8"] == pytest.approx(change, abs=2e-6)  # eager vs fused: ~3e-7
    assert (result.settings["windows"], result.settings["tokens"], result.settings["seq_len"]) == (3, 96, 32)
    capped = run_task(get_task("logit-quant", bits=(16,), granularity=("tensor",), windows=3, needle_samples=0),
                      model, tok, EvalConfig(data_dir=data_dir, seq_len=32, max_windows=2))
    two = run_task("heldout-loss", model, tok, EvalConfig(data_dir=data_dir, seq_len=32, max_windows=2))
    assert capped.settings["windows"] == 2 and capped.metrics["loss@tensor/16"] == pytest.approx(
        two.metrics["loss"], rel=1e-6)


def test_diff_v2_quantises_each_map_of_a_pair_with_its_own_scale():
    """The audit's set-up: an outlier of 100 planted in the second map of every pair (head 2i + 1 of V2's one
    attention call). Per tensor, the first map is quantised as if alone, as V1's first map is; with one scale
    for the pair, every entry of the first map rounded to 0 at 4 bits."""
    from difftransformer.eval.probes import inspect_attention
    from difftransformer.model import DiffTransformerLM
    from tests.helpers import tiny

    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff_v2", vocab_size=300, max_position_embeddings=64)).eval()
    seen = {}

    def plant(scores, visible):
        scores = scores.clone()
        scores[:, 1::2, 0, 5, 0] = 100.0
        return scores

    def quantise(scores, visible):
        seen.update(scores=scores, visible=visible.expand_as(scores), out=fake_quantize(scores, visible, 4, "tensor",
                                                                                          paired=True))
        return seen["out"]

    with torch.no_grad(), inspect_attention(model, lambda i: plant if i == 0 else None):
        with inspect_attention(model, lambda i: quantise if i == 0 else None):
            model(torch.randint(0, 300, (1, 32)))
    x, visible, out = seen["scores"], seen["visible"], seen["out"]
    assert x.shape[2] == 1 and x.shape[1] % 2 == 0
    for c in (0, 1):
        alone = fake_quantize(x[:, c::2], visible[:, c::2], 4, "tensor")
        assert torch.equal(out[:, c::2], alone)
    assert int((out[:, 0::2][visible[:, 0::2]] != 0).sum()) > 100  # the first map keeps its own resolution
    as_v1 = torch.stack((x[:, 0::2, 0], x[:, 1::2, 0]), dim=2)  # (B, H, 2, T, S), V1's layout
    v1 = fake_quantize(as_v1, torch.stack((visible[:, 0::2, 0], visible[:, 1::2, 0]), dim=2), 4, "tensor")
    assert torch.equal(out[:, 0::2, 0], v1[:, :, 0]) and torch.equal(out[:, 1::2, 0], v1[:, :, 1])


def test_the_task_quantises_diff_v2_per_map_as_a_quantiser_written_by_hand(data_dir):
    from difftransformer.data import PreparedData
    from difftransformer.eval import EvalConfig, get_task, run_task

    model = _peaked_model("diff_v2")
    data = PreparedData.load(data_dir)
    result = run_task(get_task("logit-quant", bits=(16, 4), granularity=("tensor",), windows=2, needle_samples=0),
                      model, data.tokenizer(), EvalConfig(data_dir=data_dir, seq_len=32))
    tokens = torch.from_numpy(data.dataset("test").tokens[:2 * 32 + 1].astype("int64"))
    windows = torch.stack([tokens[i * 32:(i + 1) * 32 + 1] for i in range(2)])
    paired, shared = quantised_nll_by_hand(model, windows, 4, paired=True), quantised_nll_by_hand(model, windows, 4)
    assert abs(paired - shared) > 1e-4  # the two rules differ on this model
    assert result.metrics["loss@tensor/4"] == pytest.approx(paired, rel=1e-6)
    assert result.settings["task_version"] == 3


def test_a_foreign_model_is_refused(data_dir):
    from difftransformer.data import PreparedData
    from difftransformer.eval import EvalConfig, get_task, run_task

    tok = PreparedData.load(data_dir).tokenizer()
    with pytest.raises(ValueError, match="needs one of this package's models"):
        run_task(get_task("logit-quant"), torch.nn.Linear(2, 2), tok, EvalConfig(data_dir=data_dir, seq_len=32))
