"""The one backend rule: what 'auto' picks where, and the requests that are refused with a clear error."""

import pytest
import torch

from difftransformer import differential_attention
from difftransformer.attention.backends import resolve_backend
from difftransformer.kernels import flash_cpu
from tests.helpers import CPP_KERNEL_DISABLED, random_inputs


def test_auto_takes_triton_on_cuda_for_half_precision_only(monkeypatch):
    from difftransformer import kernels

    monkeypatch.setattr(kernels, "triton_runs", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, dtype=torch.bfloat16) == "triton"
    assert resolve_backend("auto", cuda, dtype=torch.float16) == "triton"
    assert resolve_backend("auto", cuda, dtype=torch.float32) == "sdpa"  # no tensor-core fp32 path
    assert resolve_backend("auto", cuda, dtype=torch.bfloat16, has_padding=True) == "sdpa"
    assert resolve_backend("triton", cuda, dtype=torch.float32) == "triton"  # asked for: runs exact fp32
    monkeypatch.setattr(kernels, "triton_runs", lambda: False)
    assert resolve_backend("auto", cuda, dtype=torch.bfloat16) == "sdpa"


@pytest.mark.skipif(CPP_KERNEL_DISABLED, reason="DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1")
def test_auto_prefers_cpp_on_cpu_and_falls_back_when_unbuilt(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "cpp"
    monkeypatch.setitem(flash_cpu._state, "ok", False)
    monkeypatch.setitem(flash_cpu._state, "error", "simulated build failure")
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    q, k, v = random_inputs(1, 1, 1, 4, 4, 8)
    with pytest.raises(RuntimeError, match="simulated build failure.*backend='sdpa'"):
        differential_attention(q, k, v, 0.5, backend="cpp")


def test_cpp_backend_rejects_other_devices():
    with pytest.raises(ValueError, match="fused CPU kernel"):
        resolve_backend("cpp", torch.device("cuda"))


def test_layers_build_the_kernel_when_made(monkeypatch):
    """So that a first forward under torch.compile (which cannot build) still gets the kernel."""
    from difftransformer import MultiheadAttention, MultiheadDiffAttention

    builds = []
    monkeypatch.setattr(flash_cpu, "_state", {})
    monkeypatch.setattr(flash_cpu, "_build", lambda: builds.append(1))
    monkeypatch.setattr(flash_cpu, "_register_fakes", lambda: None)
    MultiheadDiffAttention(32, 0, 2, backend="sdpa")
    MultiheadAttention(32, 0, 2, backend="cpp", device="meta")
    assert builds == []
    MultiheadDiffAttention(32, 0, 2, backend="cpp")
    assert builds == [1] and flash_cpu._state["ok"] is True


def test_triton_on_ordinary_attention_is_a_clear_error_never_a_fallback():
    """The Triton kernel is differential-only: asking for it on ordinary attention names the way out."""
    from difftransformer import MultiheadAttention, MultiheadDiffAttentionV2
    from difftransformer.attention import multihead_attention

    for make in (lambda: MultiheadAttention(32, 0, 4, backend="triton"),
                 lambda: MultiheadDiffAttentionV2(32, 0, 2, backend="triton")):
        with pytest.raises(ValueError, match="no Triton kernel here.*'auto' or 'sdpa'"):
            make()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no Triton kernel"):
        multihead_attention(q, q, q, backend="triton")
    with pytest.raises(ValueError, match="no Triton kernel"):
        resolve_backend("triton", torch.device("cuda"), ordinary=True)
    assert resolve_backend("auto", torch.device("cuda"), ordinary=True, dtype=torch.bfloat16) == "sdpa"


def test_model_config_refuses_triton_for_kinds_without_the_kernel():
    from difftransformer.model import DiffTransformerConfig
    from tests.helpers import tiny

    assert tiny("diff", attn_backend="triton").attn_backend == "triton"
    for kind in ("transformer", "transformer_headnorm", "diff_v2"):
        with pytest.raises(ValueError, match=f"attention='{kind}' has no Triton path.*'auto'"):
            tiny(kind, attn_backend="triton")
    # A study that asks for the fused kernel on DIFF runs its baseline on 'auto' (recorded in its config),
    # and a config saved before the rule loads the same way.
    assert tiny("diff", attn_backend="triton").matched("transformer").attn_backend == "auto"
    assert tiny("diff", attn_backend="triton").matched("diff_no_headnorm").attn_backend == "triton"
    saved = {**tiny("transformer").to_dict(), "attn_backend": "triton"}
    assert DiffTransformerConfig.from_dict(saved).attn_backend == "auto"


def test_float64_never_reaches_the_fp32_kernels():
    """'auto' keeps float64 exact (sdpa); asking a fused kernel for float64 is an error, not a silent fp32."""
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, dtype=torch.float64) == "sdpa"
    assert resolve_backend("auto", torch.device("cuda"), dtype=torch.float64) == "sdpa"
    for backend, device in (("cpp", cpu), ("triton", torch.device("cuda"))):
        with pytest.raises(ValueError, match="would round torch.float64 inputs.*'sdpa' or 'eager'"):
            resolve_backend(backend, device, dtype=torch.float64)
    q, k, v = random_inputs(1, 1, 1, 4, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="would round"):
        differential_attention(q, k, v, 0.5, backend="cpp")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*'auto', 'eager'"):
        resolve_backend("fast", torch.device("cpu"))
