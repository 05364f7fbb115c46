"""Rotary position embedding in the GPT-J ("interleaved") layout used by the reference code."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates pairs (x[2i], x[2i+1]) of the last axis by pos * theta**(-2i/dim).

    Angles are computed in float64 and rotations in fp32, so long positions stay exact to fp32
    precision. Works on (B, H, T, dim) with positions (T,) or (B, T).
    """

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even dimension, got {dim}")
        self.dim, self.theta = dim, float(theta)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.theta ** (-torch.arange(0, self.dim, 2, dtype=torch.float64,
                                                device=positions.device) / self.dim)
        ang = positions.to(torch.float64)[..., None] * inv_freq  # (..., T, dim/2)
        return ang.cos().float(), ang.sin().float()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.angles(positions)
        if cos.dim() == 3:  # per-sequence positions (B, T, dim/2) -> broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        pairs = x.float().unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta:g}, layout=interleaved"
