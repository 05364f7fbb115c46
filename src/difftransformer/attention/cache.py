"""A key/value cache for incremental decoding, written in place."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer keys and values, (B, heads, S, dim) each, grown along S as tokens are decoded.

    Keys are stored after RoPE, so a cached step never re-rotates the past. Layers index their
    slot by their 0-based depth.

    Storage is allocated ahead (`capacity` positions, else the first update's length rounded up to
    `chunk`) and each step writes its keys and values in place; when it is full it grows by doubling,
    so decoding n tokens copies the cache O(log n) times instead of once per token. `update` returns
    views of the filled part. When gradients flow into the new keys (a cache used in training), it
    concatenates instead, which autograd can differentiate.

    `constants` is a slot per layer for the values a layer derives from its parameters (DIFF's λ and
    folded head-norm weight), held for the cache's life by `attention.decode.layer_constants`, which
    alone reads and writes it.
    """

    def __init__(self, capacity: int | None = None, chunk: int = 256) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be a positive number of positions, got {capacity}")
        if chunk <= 0:
            raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
        self.capacity, self.chunk = capacity, chunk
        self.keys: dict[int, torch.Tensor] = {}  # the filled part of each layer's keys (a view)
        self.values: dict[int, torch.Tensor] = {}
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.constants: dict[int, tuple] = {}  # attention/decode.py's slot (see the class doc)

    def length(self, layer: int = 0) -> int:
        return 0 if layer not in self.keys else self.keys[layer].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, heads, T, dim) to the layer's cache; returns all its keys and values.

        New keys and values must have the cached ones' batch, heads and dim: a cache belongs to one model
        and one batch. A mismatch is refused naming both shapes, where a size-1 batch or head axis would
        otherwise be broadcast into the cache without a word (plain shape compares: this runs per layer
        per decoding step)."""
        cached = self.keys.get(layer)
        past = 0
        if cached is not None:
            if _sizes(k) != _sizes(cached):
                raise self._mismatch(layer, k)
            if _sizes(v) != _sizes(self.values[layer]):
                raise self._mismatch(layer, v, "values")
            past = cached.shape[2]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            if past:
                k, v = torch.cat((cached, k), dim=2), torch.cat((self.values[layer], v), dim=2)
            self._buffers.pop(layer, None)
            self.keys[layer], self.values[layer] = k, v
            return k, v
        total = past + k.shape[2]
        kbuf, vbuf = self._room(layer, k, v, total)
        kbuf[:, :, past:total] = k
        vbuf[:, :, past:total] = v
        self.keys[layer], self.values[layer] = kbuf[:, :, :total], vbuf[:, :, :total]
        return self.keys[layer], self.values[layer]

    def _mismatch(self, layer: int, new: torch.Tensor, what: str = "keys") -> ValueError:
        held = (self.keys if what == "keys" else self.values)[layer]
        return ValueError(f"this KVCache holds {_shape(held)} {what} for layer {layer}; the new ones are {_shape(new)} "
                          f"(batch, heads, ·, dim): a cache belongs to the model and batch that filled it; use a new "
                          f"KVCache per model and batch")

    def _room(self, layer: int, k: torch.Tensor, v: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers, allocated or grown (keeping what is filled) to hold `total` positions."""
        buffers = self._buffers.get(layer)
        if buffers is not None and buffers[0].shape[2] >= total:
            return buffers
        size = buffers[0].shape[2] * 2 if buffers is not None else (self.capacity or 0)
        size = max(size, -(-total // self.chunk) * self.chunk)
        kbuf = k.new_empty(k.shape[0], k.shape[1], size, k.shape[3])
        vbuf = v.new_empty(v.shape[0], v.shape[1], size, v.shape[3])
        past = self.length(layer)
        if past:
            kbuf[:, :, :past] = self.keys[layer]
            vbuf[:, :, :past] = self.values[layer]
        self._buffers[layer] = (kbuf, vbuf)
        return kbuf, vbuf

    def __len__(self) -> int:
        return self.length(next(iter(self.keys), 0))


def _sizes(t: torch.Tensor) -> tuple[int, ...]:
    """(batch, heads, dim) of a (B, heads, S, dim) tensor: what must stay fixed over a cache's lifetime."""
    return (t.shape[0], t.shape[1], t.shape[-1]) if t.dim() == 4 else tuple(t.shape)


def _shape(t: torch.Tensor) -> str:
    """(B, heads, ·, dim): a cached tensor's shape with its growing length left out."""
    return "({}, {}, ·, {})".format(*_sizes(t)) if t.dim() == 4 else str(tuple(t.shape))


class StaticKVCache:
    """Keys and values in buffers of a fixed `capacity`, for a decoding step that can be captured in a CUDA graph.

    A captured step replays the same kernels on the same memory, so nothing it touches may move or change
    shape, and it may not read a device value on the host. This cache keeps that contract:

    - Buffers (B, heads, capacity, dim) per layer are allocated by the first write and never reallocated.
    - The prompt is written by `update` in *prefill* mode (`step_index` None), at positions [length, length + T):
      attention sees only the filled part (views), exactly as with `KVCache`.
    - A decoding step runs in *step* mode: `step_index` is a (1,) int64 tensor on the buffers' device holding the
      slot to write; `update` writes the new key and value there (`index_copy_`, no host read) and returns the
      whole buffers. The caller masks what is not yet written (a (B, capacity) key-padding mask) and advances
      `step_index` on the device; `advance(n)` keeps the host count `length()` in step with it, for the host-side
      checks that run before a step (positions never pass `capacity`).

    `position_bound` = capacity tells RoPE that every position is below it, so a rotation is a gather from a table
    built before the step instead of computed from the positions (the same values, fewer kernels). `constants`
    is the per-layer slot of `attention.decode.layer_constants`, as in `KVCache`.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be a positive number of positions, got {capacity}")
        self.capacity = self.position_bound = int(capacity)
        self.step_index: torch.Tensor | None = None
        self.constants: dict[int, tuple] = {}
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._length = 0

    def length(self, layer: int = 0) -> int:
        return self._length if layer in self._buffers else 0

    def __len__(self) -> int:
        return self._length if self._buffers else 0

    def reset(self) -> None:
        """Forget what is written (the buffers stay, to be written again from position 0)."""
        self._length, self.step_index = 0, None

    def advance(self, n: int) -> None:
        """Count n more positions as written: after a prefill, or after each decoding step."""
        if self._length + n > self.capacity:
            raise ValueError(f"this StaticKVCache holds {self.capacity} positions; {self._length} are written and "
                             f"{n} more do not fit; make one with a larger capacity")
        self._length += n

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, heads, T, dim); returns the keys and values attention reads (see the class doc).
        In prefill mode the count `length()` is advanced by the caller (`advance`), once for every layer."""
        kbuf, vbuf = self._room(layer, k, v)
        if self.step_index is not None:
            kbuf.index_copy_(2, self.step_index, k)
            vbuf.index_copy_(2, self.step_index, v)
            return kbuf, vbuf
        start, end = self._length, self._length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"this StaticKVCache holds {self.capacity} positions; writing {k.shape[2]} after "
                             f"{start} does not fit; make one with a larger capacity")
        kbuf[:, :, start:end] = k
        vbuf[:, :, start:end] = v
        return kbuf[:, :, :end], vbuf[:, :, :end]

    def _room(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self._buffers.get(layer)
        if buffers is None:
            kbuf = k.new_zeros(k.shape[0], k.shape[1], self.capacity, k.shape[3])
            vbuf = v.new_zeros(v.shape[0], v.shape[1], self.capacity, v.shape[3])
            buffers = self._buffers[layer] = (kbuf, vbuf)
        elif (_sizes(k), k.dtype, k.device) != (_sizes(buffers[0]), buffers[0].dtype, buffers[0].device) or (
                _sizes(v), v.dtype) != (_sizes(buffers[1]), buffers[1].dtype):
            raise ValueError(f"this StaticKVCache holds {_shape(buffers[0])} {buffers[0].dtype} keys for layer "
                             f"{layer}; the new ones are {_shape(k)} {k.dtype}: a cache belongs to the model, batch "
                             f"and dtype that filled it; make a new StaticKVCache")
        return buffers
