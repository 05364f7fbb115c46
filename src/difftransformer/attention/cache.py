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

    `constants` holds, per layer, values a layer derives from its parameters (DIFF's λ and folded
    head-norm weight) for the cache's lifetime: cached keys and values already assume the parameters
    do not change while the cache is in use, so one derivation per generation is as exact as one per
    token, and saves each layer its check of the parameters at every step.
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
        self.constants: dict[int, tuple] = {}  # see the class doc

    def length(self, layer: int = 0) -> int:
        return 0 if layer not in self.keys else self.keys[layer].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, heads, T, dim) to the layer's cache; returns all its keys and values."""
        past = self.length(layer)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            if past:
                k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
            self._buffers.pop(layer, None)
            self.keys[layer], self.values[layer] = k, v
            return k, v
        total = past + k.shape[2]
        kbuf, vbuf = self._room(layer, k, v, total)
        kbuf[:, :, past:total] = k
        vbuf[:, :, past:total] = v
        self.keys[layer], self.values[layer] = kbuf[:, :, :total], vbuf[:, :, :total]
        return self.keys[layer], self.values[layer]

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
