"""A key/value cache for incremental decoding."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer keys and values, (B, heads, S, dim) each, grown along S as tokens are decoded.

    Keys are stored after RoPE, so a cached step never re-rotates the past. Layers index their
    slot by their 0-based depth.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def length(self, layer: int = 0) -> int:
        return 0 if layer not in self.keys else self.keys[layer].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def __len__(self) -> int:
        return self.length(next(iter(self.keys), 0))
