"""Decoding's seam: where a decoding step leaves the general route, what a layer holds for a KV cache's life, and
what keeps a step out of a CUDA graph (`graph_refusal`).

A decoding step calls attention once per layer and token with one query row per head. Two things make
that call differ from the general route of `functional.py`, and both live here, nowhere else:

- The short route (`cpu_decode_diff`, `cpu_decode_ordinary`). After `differential_attention` / `multihead_attention`
  have checked a call, it goes straight to the fused CPU kernel's decode function (the extension's plain
  function, no dispatcher, no backend wrapper) when all of these hold:
    * the backend named resolves to 'cpp' for fp32 CPU tensors: `backends.resolve_backend` is asked,
      once per backend name and kind while the kernel is loaded, so 'auto' means what it means there;
    * the kernel is loaded (`flash_cpu.loaded_module`; nothing is built here);
    * nothing must observe op calls (`kernels.ops_observed`: torch.compile, jit traces, torch function
      and dispatch modes);
    * q, k, v are fp32 on the CPU, gradients are off, there is no key padding, no maps and no score hook;
    * the kernel's decode path takes the call: n_rep * T <= `flash_cpu.DECODE_MAX_ROWS`;
    * DIFF: λ is a 0-d fp32 CPU tensor and the head-norm weight None or a contiguous fp32 CPU tensor;
      ordinary attention: v's dim equals q's.
  The function then returns the kernel's output, which is the output the general route computes for that
  call (the same kernel and path: `flash_cpu.decode_path_applies`); otherwise it returns None and the
  caller takes the general route.
- The layer constants (`layer_constants`). A `MultiheadDiffAttention` derives λ and its folded head-norm
  weight from its parameters (`attention_constants`). With a KV cache, the pair derived at the cache's
  first use by a layer is held in the cache's `constants` slot for that layer and reused for the rest of
  the cache's life: the cached keys and values already assume parameters that do not change while the
  cache is in use. A new cache derives them anew, so it sees any parameter change made in between.
  A pair is held only where no gradient can reach it: gradients off, or no parameter of the layer
  requiring one (checked at every step that runs with gradients on); the layer's parameters must be
  plain `nn.Parameter`s (not FSDP's DTensors) and no torch.compile trace may be running. Entries are
  keyed by the input dtype and inference mode (an inference-mode tensor cannot be saved for a backward
  outside it). Without a cache the pair is derived at every call.
"""

from __future__ import annotations

import torch
from torch import nn

from difftransformer.attention.backends import resolve_backend
from difftransformer.kernels import flash_cpu, ops_observed
from difftransformer.kernels.flash_cpu import DECODE_MAX_ROWS

_CPU = torch.device("cpu")
_F32 = torch.float32
_picks_cpp: dict[tuple[str, bool], bool] = {}  # (backend, ordinary) -> resolves to 'cpp' for fp32 CPU tensors


def _decode_kernel(q, k, v, backend: str, ordinary: bool):
    """The loaded extension module when this call meets the module doc's rule (all of it but the DIFF-only and
    v-dim conditions, which the callers check), else None. q, k, v are on one device: the caller checked."""
    qs = q.shape
    if not (q.dtype is _F32 and k.dtype is _F32 and v.dtype is _F32 and q.is_cpu and not torch.is_grad_enabled()
            and qs[2] * (qs[1] // k.shape[1]) <= DECODE_MAX_ROWS):
        return None
    picks = _picks_cpp.get((backend, ordinary))
    module = None if picks is False else flash_cpu.loaded_module()
    if module is None:
        return None
    if picks is None:  # asked only once the kernel is loaded: asking about 'auto' before would build it
        picks = resolve_backend(backend, _CPU, dtype=_F32, ordinary=ordinary) == "cpp"
        _picks_cpp[backend, ordinary] = picks
    return module if picks and not ops_observed() else None


def cpu_decode_diff(q, k, v, lam, causal: bool, scale: float, out_norm, backend: str):
    """`differential_attention`'s output for a checked call without key padding, maps or score hook, from the
    kernel's decode function; None when the call must take the general route (see the module doc)."""
    weight = None if out_norm is None else out_norm[0]
    if not (type(lam) is torch.Tensor and lam.dtype is _F32 and lam.is_cpu and (weight is None or (
            weight.dtype is _F32 and weight.is_cpu and weight.is_contiguous()))):
        return None
    module = _decode_kernel(q, k, v, backend, False)
    if module is None:
        return None
    eps = 0.0 if weight is None else float(out_norm[1])
    return module.diff_flash_decode(q, k, v, lam, bool(causal), float(scale), None, weight, eps)


def cpu_decode_ordinary(q, k, v, causal: bool, scale: float, backend: str):
    """`multihead_attention`'s output for a checked call without key padding, maps or score hook, from the
    kernel's decode function; None when the call must take the general route (see the module doc)."""
    module = _decode_kernel(q, k, v, backend, True) if v.shape[3] == q.shape[3] else None
    if module is None:
        return None
    return module.flash_decode(q, k, v, bool(causal), float(scale), None)


def layer_constants(layer, x: torch.Tensor, kv_cache=None):
    """`layer.attention_constants(x.dtype)` (λ, and the head norm as `differential_attention(out_norm=...)`
    takes it, or None), held in `kv_cache` for its life where the module doc allows; `layer` is a
    `MultiheadDiffAttention` (its `depth` names its slot in the cache)."""
    if kv_cache is None:
        return layer.attention_constants(x.dtype)
    key = (x.dtype, torch.is_inference_mode_enabled())
    held = kv_cache.constants.get(layer.depth)
    if held is not None and held[0] == key and (not torch.is_grad_enabled() or not _wants_grad(layer)):
        return held[1]
    constants = layer.attention_constants(x.dtype)
    if _holdable(layer):
        kv_cache.constants[layer.depth] = (key, constants)
    return constants


def _wants_grad(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def _holdable(layer: nn.Module) -> bool:
    """Whether constants derived now may be held: no gradient can reach them, plain parameters, no trace."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    return all(type(p) is nn.Parameter and not (grad and p.requires_grad) for p in layer.parameters())


def graph_refusal(model: nn.Module) -> str | None:
    """Why the attention layers in `model` cannot run a static KV cache's decoding step inside a CUDA graph, or
    None when they can: nothing may observe op calls (a replay runs none of them) and no layer may have a score
    or query hook (a replay would not call it). Every backend takes the step's key mask (its one query row takes the
    Triton decoding kernel on 'triton')."""
    if ops_observed():
        return "torch.compile, a jit trace or a torch function/dispatch mode is observing the calls"
    for hook in ("score_hook", "query_hook"):
        if any(getattr(module, hook, None) is not None for module in model.modules()):
            return f"a layer has a {hook.replace('_', ' ')}, which a replayed graph would not call"
    return None

