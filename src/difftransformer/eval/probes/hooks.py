"""How a white-box probe looks inside one of our models: through explicit entry points only.

    with inspect_attention(model, lambda i: my_hook_for_layer(i)):   # every layer on the eager path
        model(ids)                                                    # my hook sees each layer's logits
    with capture_layer_outputs(model, lambda i, h: ...):              # each decoder block's output
        model(ids)
    with rescale_queries(model, my_query_hook):                       # every layer on its own backend
        model(ids)

Attention layers expose `score_hook` and `query_hook` attributes (attention/functional.py states their contracts);
decoder blocks are ordinary modules whose outputs a forward hook reads. Both are restored on exit,
also when the forward raises. A model that is not one of ours (a Hugging Face model, a module of
another design) is refused with a one-line error: its attention cannot be opened.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from difftransformer.attention import (
    MultiheadAttention,
    MultiheadDiffAttention,
    MultiheadDiffAttentionV2,
    QueryHook,
    ScoreHook,
)
from difftransformer.eval.task import TaskNotApplicable, running_task
from difftransformer.model import DiffTransformerLM

_ATTENTION_LAYERS = (MultiheadAttention, MultiheadDiffAttention, MultiheadDiffAttentionV2)


def require_own_model(model: nn.Module, task: str) -> DiffTransformerLM:
    """`model` if this package built it; else TaskNotApplicable: a white-box probe cannot open other models."""
    if not isinstance(model, DiffTransformerLM):
        raise TaskNotApplicable(f"{task} looks inside attention and needs one of this package's models (a run folder, "
                         f"final/ folder or checkpoint); got a {type(model).__name__}. Black-box tasks (needle, "
                         f"long-context, icl, hallucination) run on other causal LMs")
    return model


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The attention layer of each decoder block, in depth order."""
    return [block.self_attn for block in require_own_model(model, "this probe").layers]


@contextmanager
def inspect_attention(model: nn.Module, make_hook: Callable[[int], ScoreHook | None] | None = None) -> Iterator[None]:
    """Run every attention layer on the eager backend (explicit maps, return_attention works whatever
    backend the model was built with) and give layer i the score hook make_hook(i), if any.

    A hook already on a layer stays and runs first: the new one sees the scores it left (so a test
    can plant logits that a probe then measures, and probes nest)."""
    layers = attention_layers(model)
    saved = [(layer.backend, layer.score_hook) for layer in layers]
    try:
        for i, layer in enumerate(layers):
            layer.backend = "eager"
            new = make_hook(i) if make_hook is not None else None
            if new is not None:
                layer.score_hook = new if layer.score_hook is None else _chain(layer.score_hook, new)
        yield
    finally:
        for layer, (backend, hook) in zip(layers, saved):
            layer.backend, layer.score_hook = backend, hook


@contextmanager
def rescale_queries(model: nn.Module, hook: QueryHook) -> Iterator[None]:
    """Give every attention layer the query hook `hook`, on the backend it was built with (fused kernels
    included: unlike a score hook, a query hook needs no explicit maps). A layer that already has a
    query hook is refused (two would have to agree on an order); the hooks are removed on exit."""
    layers = attention_layers(model)
    if any(layer.query_hook is not None for layer in layers):
        raise ValueError("a layer already has a query hook; remove it (layer.query_hook = None) before "
                         "rescale_queries sets another")
    try:
        for layer in layers:
            layer.query_hook = hook
        yield
    finally:
        for layer in layers:
            layer.query_hook = None


def _chain(first: ScoreHook, second: ScoreHook) -> ScoreHook:
    def both(scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor | None:
        changed = first(scores, visible)
        scores = scores if changed is None else changed
        again = second(scores, visible)
        return scores if again is None else again
    return both


@contextmanager
def capture_layer_outputs(model: nn.Module, fn: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Call fn(i, hidden) with each decoder block's output (B, T, E), after both residual adds."""
    blocks = require_own_model(model, "this probe").layers

    def hook_for(i: int):
        def hook(_module, _inputs, output):
            fn(i, output[0] if isinstance(output, tuple) else output)
        return hook

    handles = [block.register_forward_hook(hook_for(i)) for i, block in enumerate(blocks)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# (maps, T, T) float32 tensors per window on the eager path: scores, their softmax, the hook's working copy
# and the map it returns (4.1 maps' worth of tensors live at once), and the allocator's slack (the process's
# RSS peaked at 5.3 to 7.7 maps' worth on different machines; 8 leaves headroom for both).
_EAGER_COPIES = 8
_ONE_WINDOW_SHARE = 0.75  # one window alone may take this much of the free memory: the rest for what the
# estimate leaves out (the layer's activations, the allocator's slack)


def probe_batch(model: nn.Module, seq_len: int, batch_size: int, device: str | torch.device,
                maps_kept: int = 0) -> int:
    """How many windows of `seq_len` tokens one eager forward may take (at most batch_size): as many as their
    explicit attention maps fit in half of the free memory, else one while one window fits in 3/4 of it;
    the batch size changes no number.

    maps_kept: layers whose maps the forward returns and keeps (return_attention), besides the working
    copies of the layer being computed. A window that does not fit in 3/4 of the free memory is a one-line ValueError
    naming the window length, the memory and a shorter window that fits (a 135 M model with an 8,192-token
    context asks for ~38 GB of scores per batch of 8 windows: without this, the process is killed for memory):
    beyond the device's whole memory the setting can never run there; within it, other processes hold the memory
    for now and the same command runs once they free it. The shorter window is offered as `--seq-len` only to a
    task that reads it (Task.reads_seq_len)."""
    maps = 2 * model.config.num_attention_heads  # DIFF: two maps per head; ordinary attention: at most as many
    window_bytes = lambda T: 4 * maps * T * T * (_EAGER_COPIES + maps_kept)  # noqa: E731  (float32 maps)
    free, need = _free_bytes(device), window_bytes(seq_len)
    budget = 0.5 * free
    fits = int(budget // need)
    if fits >= 1:
        return min(batch_size, fits)
    if need <= _ONE_WINDOW_SHARE * free:
        return 1  # no room for a batch of them: one window at a time, whatever the rest of the machine does
    shorter = seq_len
    while shorter > 1 and window_bytes(shorter) > budget:
        shorter //= 2
    task = running_task()
    fix = (f"use a shorter window, e.g. --seq-len {shorter}" if task is None or task.reads_seq_len else
           f"use shorter windows ({shorter} tokens fit; {task.name} takes its window lengths from its own options, "
           f"not --seq-len)")
    what = (f"one window of {seq_len} tokens needs ~{_size(need)} of explicit attention maps "
            f"({maps} maps of {seq_len}x{seq_len} per layer)")
    total = _total_bytes(device)
    if need > _ONE_WINDOW_SHARE * total:
        raise ValueError(f"{what}, more than 3/4 of all {_size(total)} of {torch.device(device).type} memory, so it "
                         f"never fits on this machine; {fix}")
    raise ValueError(f"{what}, more than 3/4 of the {_size(free)} free now (of {_size(total)}): other processes hold "
                     f"the rest; run again once they free it, or {fix}")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _free_bytes(device: str | torch.device) -> int:
    """Free memory of `device` for this process: the GPU's free bytes and what PyTorch holds there unused (its
    cache, which it allocates from first), or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return _host_memory("MemAvailable", "SC_AVPHYS_PAGES")


def _total_bytes(device: str | torch.device) -> int:
    """All the memory of `device`: the GPU's, or the host's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return _host_memory("MemTotal", "SC_PHYS_PAGES")


def _host_memory(meminfo_key: str, sysconf_pages: str) -> int:
    """Bytes of host memory: /proc/meminfo's `meminfo_key` (Linux), else sysconf's page count × page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{meminfo_key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf(sysconf_pages) * os.sysconf("SC_PAGE_SIZE")
