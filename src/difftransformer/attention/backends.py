"""Which implementation computes attention: the one place that decides, including what 'auto' means.

    eager   explicit maps in the compute dtype; the only backend that can return them
    sdpa    torch.nn.functional.scaled_dot_product_attention (FlashAttention/cuDNN/efficient on CUDA)
    cpp     the fused C++ CPU kernel (differential and ordinary attention), fp32 compute
    triton  the fused Triton kernels for DIFFERENTIAL attention (CUDA, or the Triton interpreter): one for
            whole sequences (no key padding), one for a decoding step (`decode_row`: one query row, no
            gradient; key padding allowed, as a static KV cache's step needs)
    auto    triton on CUDA for fp16/bf16 differential attention without key padding (or a decoding step),
            when Triton runs; cpp on CPU for fp32 and half-precision inputs, when it builds; else sdpa

Ordinary attention (the matched baseline, DIFF V2's paired heads) has no Triton kernel here: on
CUDA the fastest ordinary attention is PyTorch's own FlashAttention behind SDPA, so asking for
'triton' there is an error that says so, never a silent substitution. The fused kernels compute in
fp32 at most, so float64 inputs are never sent to them ('auto' takes sdpa; asking for 'cpp' or
'triton' with float64 is an error), which keeps a float64 model exact to float64 rounding.
"""

from __future__ import annotations

import os

import torch

from difftransformer.kernels import flash_cpu

BACKENDS = ("auto", "eager", "sdpa", "triton", "cpp")
_HALF = (torch.float16, torch.bfloat16)
_FUSED_DTYPES = (torch.float32, *_HALF)  # what the fused kernels compute exactly (fp32 accumulation)


def check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def resolve_backend(backend: str, device: torch.device, *, need_maps: bool = False, has_padding: bool = False,
                    dtype: torch.dtype | None = None, ordinary: bool = False, decode_row: bool = False) -> str:
    """The concrete backend for one attention call ('auto' resolved, impossible requests refused).

    device/dtype: of the inputs (dtype None: not known yet); ordinary: the call is
    `multihead_attention` (the baseline's, or DIFF V2's paired heads), not `differential_attention`;
    need_maps: the caller wants the attention maps, or a score hook that reads the explicit logits;
    decode_row: a differential call with one query row and no gradient, whose Triton kernel takes key padding.
    """
    check_backend_name(backend)
    if need_maps:
        if backend not in ("auto", "eager"):
            raise ValueError(f"attention maps and score hooks need the explicit maps of the 'eager' backend, "
                             f"not {backend!r}; use backend 'eager' or 'auto'")
        return "eager"
    if backend == "auto":
        return _auto(device, has_padding and not decode_row, dtype, ordinary)
    if backend == "triton":
        _check_triton(has_padding and not decode_row, dtype, ordinary, device)
    if backend == "cpp":
        _check_cpp(device, dtype)
    return backend


def _auto(device: torch.device, has_padding: bool, dtype: torch.dtype | None, ordinary: bool) -> str:
    """The 'auto' rule. On CUDA, Triton for half precision only: exact fp32 products have no
    tensor-core path there and SDPA's fp32 kernels are the better choice."""
    if device.type == "cuda" and not ordinary and not has_padding and dtype in (None, *_HALF):
        from difftransformer import kernels

        if kernels.triton_runs():
            return "triton"
    if device.type == "cpu" and dtype in (None, *_FUSED_DTYPES) and flash_cpu.is_available():
        return "cpp"
    return "sdpa"


def _check_triton(has_padding: bool, dtype: torch.dtype | None, ordinary: bool, device: torch.device | None) -> None:
    if device is not None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' runs on CUDA, and these tensors are on {device.type}; use 'auto' "
                         f"(the fused C++ kernel on CPU) or move the model to a GPU")
    if ordinary:
        raise ValueError("backend 'triton' is the fused kernel for differential attention; ordinary attention "
                         "(the Transformer baseline, DIFF V2) has no Triton kernel here. Use 'auto' or 'sdpa' "
                         "(PyTorch's FlashAttention on CUDA), or 'cpp' on CPU")
    if has_padding:
        raise ValueError("the 'triton' backend supports causal/non-causal masks only, not key padding (except in a "
                         "one-row decoding call without gradients); use backend='sdpa' (or 'auto') for padded batches")
    if dtype is not None and dtype not in _FUSED_DTYPES:
        raise ValueError(f"the 'triton' kernel computes in fp32 at most and would round {dtype} inputs; "
                         f"use backend 'sdpa' or 'eager' (or 'auto', which picks sdpa for {dtype})")


def _check_cpp(device: torch.device, dtype: torch.dtype | None) -> None:
    if device.type != "cpu":
        raise ValueError(f"the 'cpp' backend is the fused CPU kernel; tensors on {device.type} need "
                         "backend='triton', 'sdpa' or 'auto'")
    if dtype is not None and dtype not in _FUSED_DTYPES:
        raise ValueError(f"the 'cpp' kernel computes in fp32 and would round {dtype} inputs; use backend "
                         f"'sdpa' or 'eager' (or 'auto', which picks sdpa for {dtype})")


def prepare_backend(backend: str, device, dtype: torch.dtype | None = None, *, ordinary: bool = False) -> None:
    """Check a layer's backend at construction and build what `resolve_backend` would pick on `device`.

    Building here, not in the first forward, matters because that forward may be traced by
    torch.compile, where no build can happen and 'auto' would fall back to SDPA. Impossible requests
    ('triton' for ordinary attention, a fused kernel for float64) fail here, not at the first forward.
    A layer made on the CPU of a machine with CUDA is taken to be on its way to the GPU, and nothing
    is built for it.
    """
    check_backend_name(backend)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if backend == "triton":
        _check_triton(False, dtype, ordinary, None)  # a layer made on CPU may be moved to the GPU later
    if device.type == "cpu" and (backend == "cpp" or not torch.cuda.is_available()):
        if resolve_backend(backend, device, dtype=dtype, ordinary=ordinary) == "cpp":  # 'auto' built it to decide
            flash_cpu.is_available()  # builds it (once per process; then cached on disk)
