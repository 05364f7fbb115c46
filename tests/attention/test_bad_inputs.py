"""What the attention functions refuse: tensors on several devices, integer tensors and batch sizes that do
not match, each in one error naming the values and the fix (no backend reads them wrongly)."""

from __future__ import annotations

import pytest
import torch

from difftransformer.attention import differential_attention, multihead_attention
from tests.helpers import BACKENDS


def _diff_inputs(B=2, h=2, T=8, d=4):
    torch.manual_seed(0)
    return torch.randn(B, 2 * h, T, d), torch.randn(B, 2 * h, T, d), torch.randn(B, h, T, 2 * d)


def _mha_inputs(B=2, T=8, d=4):
    torch.manual_seed(0)
    return torch.randn(B, 4, T, d), torch.randn(B, 2, T, d), torch.randn(B, 2, T, d)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("which", [1, 2])
def test_differential_attention_refuses_k_or_v_on_another_device(backend, which):
    """k or v on another device than q ('meta' here) is refused by every backend in one error naming the devices and
    the fix: no kernel reads another device's data pointers as CPU memory."""
    q, k, v = _diff_inputs()
    args = [q, k, v]
    args[which] = args[which].to("meta")
    devices = ", ".join(str(t.device) for t in args)
    with pytest.raises(ValueError, match=rf"q, k, v must be on one device; got {devices}.*\.to\(q\.device\)"):
        differential_attention(*args, 0.5, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_multihead_attention_refuses_k_on_another_device(backend):
    """multihead_attention with k on another device than q ('meta' here) gets the same one-device error on every
    backend."""
    q, k, v = _mha_inputs()
    with pytest.raises(ValueError, match=r"q, k, v must be on one device; got cpu, meta, cpu"):
        multihead_attention(q, k.to("meta"), v, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_attention_refuses_a_key_padding_mask_on_another_device(backend):
    """A key_padding_mask on another device than q ('meta' here) gets the one-device error, naming the mask, from
    both functions on every backend."""
    q, k, v = _diff_inputs()
    mask = torch.ones(2, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError,
                       match=r"q, k, v and key_padding_mask must be on one device; got cpu, cpu, cpu, meta"):
        differential_attention(q, k, v, 0.5, key_padding_mask=mask, backend=backend)
    q, k, v = _mha_inputs()
    with pytest.raises(ValueError, match=r"q, k, v and key_padding_mask must be on one device"):
        multihead_attention(q, k, v, key_padding_mask=mask, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_attention_refuses_integer_tensors(backend):
    """Integer q, k, v (int64) are refused on every backend, naming the dtypes and asking for floating point
    (`.float()`)."""
    q, k, v = _diff_inputs()
    with pytest.raises(TypeError, match=r"q, k, v must be floating point; got torch.int64, torch.int64, "
                                        r"torch.int64.*\.float\(\)"):
        differential_attention(q.long(), k.long(), v.long(), 0.5, backend=backend)
    q, k, v = _mha_inputs()
    with pytest.raises(TypeError, match=r"q, k, v must be floating point; got torch.float32, torch.int64"):
        multihead_attention(q, k.long(), v, backend=backend)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_multihead_attention_batch_mismatch_names_the_shapes(backend):
    """k, v of batch 1 with q of batch 2: the error names the same-batch rule and the three shapes."""
    q, k, v = _mha_inputs()
    with pytest.raises(ValueError, match=r"same batch.*\(2, 4, 8, 4\), \(1, 2, 8, 4\), \(1, 2, 8, 4\)"):
        multihead_attention(q, k[:1], v[:1], backend=backend)
