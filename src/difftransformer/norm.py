"""RMSNorm and the precision rule for numerically sensitive steps.

Norms, RoPE rotations and λ are computed in `compute_dtype(x)`: fp32 for half-precision inputs (so a
bf16 model normalises with fp32 statistics), and the input's own dtype when that is wider (so a
float64 model agrees with a float64 reference to float64 rounding, not fp32's 1e-7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(*inputs: torch.Tensor | torch.dtype | None) -> torch.dtype:
    """The widest of fp32 and the inputs' floating dtypes (tensors or dtypes): never below fp32, never
    below the input."""
    if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor) and inputs[0].dtype == torch.float32:
        return torch.float32  # the common case, without a promote_types call (this runs per layer and token)
    dtype = torch.float32
    for x in inputs:
        d = x if isinstance(x, torch.dtype) else None if x is None else x.dtype
        if d is not None and d.is_floating_point:
            dtype = torch.promote_types(dtype, d)
    return dtype


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis, computed in `compute_dtype(x)` and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if elementwise_affine else None

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """RMSNorm(x) * scale; a constant scale is folded into the weight (one pass over x)."""
        f = compute_dtype(x)
        w = self.weight
        if w is not None and w.dtype != f:
            w = w.to(f)
        if scale != 1.0:
            w = w * scale if w is not None else torch.full((self.dim,), scale, dtype=f, device=x.device)
        if x.dtype == f:  # no casts to dispatch (the fp32 and float64 cases)
            return F.rms_norm(x, (self.dim,), w, self.eps)
        return F.rms_norm(x.to(f), (self.dim,), w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}"
