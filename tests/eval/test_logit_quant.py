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


@pytest.mark.parametrize("bits", [16, 8, 6, 4])
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
    ref = torch.log_softmax(model(ids).logits, -1)

    def kl(bits):
        with inspect_attention(model, lambda i: (lambda s, vis: fake_quantize(s, vis, bits, "tensor"))):
            got = torch.log_softmax(model(ids).logits, -1)
        return float((ref.exp() * (ref - got)).sum(-1).mean())

    two, eight = kl(2), kl(8)
    assert two > 1e-3 and eight < two / 20


def test_the_task_reference_is_exactly_unquantised(data_dir):
    from difftransformer.data import PreparedData
    from difftransformer.eval import EvalConfig, get_task, run_task

    model = _peaked_model("diff")
    tok = PreparedData.load(data_dir).tokenizer()
    cfg = EvalConfig(data_dir=data_dir, seq_len=32)
    result = run_task(get_task("logit-quant", bits=(16, 2), windows=3, needle_samples=0), model, tok, cfg)
    plain = run_task("heldout-loss", model, tok, EvalConfig(data_dir=data_dir, seq_len=32, max_windows=3))
    # the probe runs eager attention, the plain model its fused kernel: equal to fp32 rounding
    assert result.metrics["loss@tensor/16"] == pytest.approx(plain.metrics["loss"], rel=1e-6)
    assert result.metrics["loss@tensor/16"] == result.metrics["loss@row/16"]
    assert result.metrics["loss_increase@tensor/16"] == 0.0
    assert result.metrics["loss@tensor/2"] != plain.metrics["loss"]
    with pytest.raises(ValueError, match="needs one of this package's models"):
        run_task(get_task("logit-quant"), torch.nn.Linear(2, 2), tok, cfg)
