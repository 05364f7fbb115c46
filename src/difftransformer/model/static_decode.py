"""Decoding on a static KV cache, each step replayed from a CUDA graph on CUDA.

Why: a decoding step of a small model is a few hundred kernel launches of a few microseconds of work each,
so on a GPU the host's launch loop, not the GPU, sets the pace (a 160 M model made ~125 tokens/s on an
H100 eagerly). A CUDA graph records the step's kernels once and replays them with one launch. Replaying
needs a step that touches the same memory with the same shapes every time and never reads a device value
on the host; `StaticKVCache` and this module's step are that step:

- the keys and values of every layer live in buffers of a fixed capacity (`StaticKVCache`); the step writes
  the new ones at a slot held in a device tensor and attends over the whole buffer under a (B, capacity)
  key mask that holds the prompt's mask (left padding) and, slot by slot, the tokens decoded so far;
- the token ids, positions, slot and key mask are tensors the decoder owns; the step reads them and then
  advances them on the device (positions + 1, slot + 1, the next slot made visible when it is written);
- DIFF's λ and folded head norm are held for the cache's life (`attention.decode.layer_constants`), and a
  decoder used again for a new prompt copies the new ones into the same tensors, so a graph captured earlier
  reads the current parameters.

The step computes the same function as `generate`'s growing-cache step: masked slots get zero attention
weight, RoPE rotations come from the same table, and the visible keys are the same; only the attention
kernel may differ (a masked call over the buffer), so logits agree to rounding and greedy tokens match
(tests compare them, on CPU and on CUDA).

`StaticDecoder(graph=False)` runs the same step eagerly (on any device: the CPU tests use it); `graph=True`
runs the first step eagerly on a side stream (CUDA's warm-up before a capture), captures the second call
and replays it from then on. `decoder_for` keeps the two most recent decoders of a model for reuse (a graph
is captured once per batch size, capacity bucket and dtype, not once per `generate` call), keyed also by
the parameters' storage, so a model whose parameters were replaced (`.to()`, `.half()`) gets new ones.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from difftransformer.attention import StaticKVCache
from difftransformer.attention.decode import graph_refusal
from difftransformer.model.inputs import positions_from_mask

DECODERS = ("auto", "dynamic", "static", "graph")
CAPACITY_BUCKET = 256  # a static cache's capacity is rounded up to this, so nearby lengths share a graph
_KEEP = 2  # decoders held per model (each holds its cache's buffers and, on CUDA, a graph)
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_decoder(decoder: str) -> None:
    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {DECODERS} ('auto': CUDA graphs on CUDA, "
                         f"the growing KV cache elsewhere)")


def graph_unsupported(model: nn.Module, device: torch.device) -> str | None:
    """Why `model` cannot decode from a CUDA graph on `device` now, or None when it can."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, and the input is on {device.type}"
    if torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is already being captured"
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return "the parameters are not plain tensors (sharded?)"
    return graph_refusal(model)


def capacity_for(total: int, limit: int) -> int:
    """A static cache's capacity for `total` positions: rounded up to CAPACITY_BUCKET, at most `limit`."""
    return min(limit, -(-total // CAPACITY_BUCKET) * CAPACITY_BUCKET)


class StaticDecoder:
    """Prefill and single-token steps on a `StaticKVCache` of `capacity` for `batch` rows (see the module doc)."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, device: torch.device, graph: bool,
                 weak: bool = False) -> None:
        """weak: hold `model` by a weak reference (the model's own cache of decoders, `decoder_for`, must not keep
        the model alive)."""
        if graph and device.type != "cuda":
            raise ValueError(f"a CUDA-graph decoder needs a CUDA device, got {device}; use graph=False")
        self._model = weakref.ref(model) if weak else (lambda: model)
        self.graph, self.capacity = graph, capacity
        self.cache = StaticKVCache(capacity)
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(batch, 1, **long)
        self.positions = torch.zeros(batch, 1, **long)
        self.slot = torch.zeros(1, **long)
        self.keys = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the captured step's output
        self._warm = False

    @property
    def model(self) -> nn.Module:
        return self._model()

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Write the (B, T) prompt into the cache; returns its last position's (B, V) logits."""
        T = input_ids.shape[1]
        self.cache.reset()
        held, self.cache.constants = self.cache.constants, {}
        mask = None if attention_mask is None else attention_mask.bool()
        positions = None if mask is None else positions_from_mask(attention_mask)
        logits = self.model(input_ids, attention_mask=mask, position_ids=positions, kv_cache=self.cache,
                            logits_to_keep=1).logits[:, -1]
        self.cache.advance(T)
        self._keep_constants(held)
        self.keys.zero_()
        self.keys[:, :T] = True if mask is None else mask
        if positions is None:
            self.positions.fill_(T)
        else:
            self.positions.copy_(positions[:, -1:] + 1)
        self.slot.fill_(T)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the (B,) tokens just sampled; returns the (B, V) logits of the position after them. The logits
        of a replayed graph live in its output buffer: read them before the next step."""
        self.ids.copy_(tokens[:, None])
        if self._graph is not None:
            self.cache.advance(1)
            self._graph.replay()
            return self._logits
        if self.graph and self._warm:
            if self._capture():
                return self.step(tokens)
            self.graph = False  # the capture failed (and said why): go on without a graph
        logits = self._warm_up() if self.graph else self._run()
        self.cache.advance(1)
        self._warm = True
        return logits

    def _run(self) -> torch.Tensor:
        """One step on the decoder's tensors, advancing them on the device (what a graph captures)."""
        self.keys.index_fill_(1, self.slot, True)
        self.cache.step_index = self.slot
        try:
            logits = self.model(self.ids, attention_mask=self.keys, position_ids=self.positions, kv_cache=self.cache,
                                logits_to_keep=1).logits[:, -1]
        finally:
            self.cache.step_index = None
        self.positions.add_(1)
        self.slot.add_(1)
        return logits

    def _warm_up(self) -> torch.Tensor:
        """The first step, run on a side stream as CUDA asks before a capture (libraries set up their handles)."""
        stream = torch.cuda.Stream(self.ids.device)
        stream.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(stream):
            logits = self._run()
        torch.cuda.current_stream(self.ids.device).wait_stream(stream)
        return logits

    def _capture(self) -> bool:
        """Record one step (`_run`) into a graph; nothing runs while it is recorded, so the state is unchanged.
        False, with a warning naming the error, when this step cannot be captured: the caller then runs it
        eagerly (the same results, at the eager pace)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._run()
        except RuntimeError as err:
            warnings.warn(f"decoding without a CUDA graph: capturing the decoding step failed ({err}); pass "
                          f"decoder='dynamic' to generate() to skip the attempt", RuntimeWarning, stacklevel=4)
            return False
        self._graph, self._logits = graph, logits
        return True

    def _keep_constants(self, held: dict) -> None:
        """Keep the tensors a captured step reads: copy the prompt's freshly derived layer constants into the ones
        held before, where both exist with the same layout; otherwise keep the new ones and capture again."""
        fresh = self.cache.constants
        for depth, entry in fresh.items():
            old = held.get(depth)
            new_tensors, old_tensors = _tensors(entry), _tensors(old) if old is not None else None
            if old is None or old[0] != entry[0] or [t.shape for t in new_tensors] != [t.shape for t in old_tensors]:
                self._graph, self._warm = None, False
                continue
            for target, source in zip(old_tensors, new_tensors):
                target.copy_(source)
            fresh[depth] = old
        if held.keys() - fresh.keys():
            self._graph, self._warm = None, False


def _tensors(entry: tuple) -> list[torch.Tensor]:
    """The tensors of a `layer_constants` cache entry (key, (λ, (weight, eps) | None)), in order."""
    lam, norm = entry[1]
    return [lam] if norm is None else [lam, norm[0]]


def decoder_for(model: nn.Module, batch: int, capacity: int, device: torch.device, graph: bool,
                runner: Callable[[], nn.Module] | None = None) -> StaticDecoder:
    """A `StaticDecoder` for these sizes, reused from the model's two most recent ones when it matches.
    runner: makes the module whose forward the decoder calls, when that is not `model` itself (the transformers
    wrapper decodes on the native model sharing its modules); called only when a decoder is made."""
    key = (batch, capacity, device, graph, torch.is_inference_mode_enabled(), torch.is_autocast_enabled(device.type),
           tuple(t.data_ptr() for t in model.parameters()), tuple(t.data_ptr() for t in model.buffers()))
    held: OrderedDict = _DECODERS.setdefault(model, OrderedDict())
    decoder = held.pop(key, None)
    if decoder is None:
        while len(held) >= _KEEP:
            held.popitem(last=False)
        decoder = (StaticDecoder(model, batch, capacity, device, graph, weak=True) if runner is None
                   else StaticDecoder(runner(), batch, capacity, device, graph))
    held[key] = decoder
    return decoder


def release_decoders(model: nn.Module) -> None:
    """Free the static caches and CUDA graphs held for `model` (they are also freed with the model)."""
    _DECODERS.pop(model, None)
