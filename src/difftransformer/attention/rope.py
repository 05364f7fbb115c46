"""Rotary position embedding in the GPT-J ("interleaved") layout used by the reference code."""

from __future__ import annotations

import torch
from torch import nn

from difftransformer.norm import compute_dtype

# A model's `position_encoding`: RoPE on every q/k head, or none at all (NoPE: causal masking alone
# tells the tokens apart, and no layer holds a rotation).
POSITION_ENCODINGS = ("rope", "none")


def check_position_encoding(value: str, what: str = "position_encoding") -> None:
    """A ValueError naming `value` unless it is one of POSITION_ENCODINGS."""
    if value not in POSITION_ENCODINGS:
        raise ValueError(f"{what} must be 'rope' (rotary embedding) or 'none' (NoPE: no position encoding), "
                         f"got {value!r}")


class RotaryEmbedding(nn.Module):
    """Rotates pairs (x[2i], x[2i+1]) of the last axis by pos * theta**(-2i/dim).

    Angles are computed in float64 and rotations in `compute_dtype` (fp32 for fp32 and half-precision
    inputs, float64 for float64), so long positions stay exact to the compute precision. Works on
    (B, H, T, dim) with positions (T,) or (B, T).
    """

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even dimension, got {dim}")
        self.dim, self.theta = dim, float(theta)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.theta ** (-torch.arange(0, self.dim, 2, dtype=torch.float64,
                                                device=positions.device) / self.dim)
        ang = positions.to(torch.float64)[..., None] * inv_freq  # (..., T, dim/2)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                 start: int | None = None, bound: int | None = None) -> torch.Tensor:
        """Unit complex numbers e^(i * pos * freq), (T, dim/2) or (B, 1, T, dim/2) for per-row positions.

        dtype is the real dtype of the rotation: `compute_dtype` of the tensors it will rotate.
        start: set when positions are exactly start .. start + T - 1 (a layer's default positions):
        the rotation is then a slice of a table shared by every layer with this dim and theta, built
        once with the same float64 arithmetic (so the same values), instead of ~10 ops per layer and
        token while decoding. bound: set when every position is known to lie in [0, bound) (a static KV
        cache's capacity): the rotation is gathered from that table by the positions, without reading them
        on the host (a CUDA-graph step). Otherwise it is computed directly.

        Under torch.compile it is (cos, sin) pairs instead, a real (..., dim/2, 2) tensor: Inductor generates
        no kernels for complex tensors, so a complex rotation there ran as copies into and out of complex
        layout around an eager multiply (four copies per layer); `rotate` takes either form."""
        if not torch.compiler.is_compiling():
            if start is not None and positions.dim() == 1:
                n = positions.shape[0]
                return self._table(start + n, dtype, positions.device)[start:start + n]
            if bound is not None:
                rotation = self._table(bound, dtype, positions.device)[positions]
                return rotation[:, None] if rotation.dim() == 3 else rotation
        cos, sin = self.angles(positions, dtype)
        if torch.compiler.is_compiling():
            pairs = torch.stack((cos, sin), dim=-1)
            return pairs[:, None] if pairs.dim() == 4 else pairs
        rotation = torch.complex(cos, sin)
        return rotation[:, None] if rotation.dim() == 3 else rotation

    def _table(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`rotation(arange(L))` for L >= length (grown by doubling), shared through `_TABLES`."""
        key = (self.dim, self.theta, dtype, device)
        table = _TABLES.get(key)
        if table is None or table.shape[0] < length:
            size = max(256, 1 << (length - 1).bit_length())
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable later under autograd
                cos, sin = self.angles(torch.arange(size, device=device), dtype)
                table = _TABLES[key] = torch.complex(cos, sin)
        return table

    def rotate(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Apply a `rotation()` table to x (..., T, dim); computed in `compute_dtype(x)`, returned in x's dtype."""
        # Pair (x[2i], x[2i+1]) is the complex number x[2i] + i x[2i+1]; rotating it is one complex
        # multiply (x0 cos - x1 sin, x0 sin + x1 cos), far faster in eager mode than strided real arithmetic.
        # Real (cos, sin) pairs (under torch.compile) get that arithmetic written out, which Inductor fuses.
        xf = x.to(compute_dtype(x))
        if not rotation.is_complex():
            return _rotate_pairs(xf, *rotation.unbind(-1)).to(x.dtype)
        if not torch.compiler.is_compiling() and not _pairs_adjacent(xf):
            xf = xf.contiguous()  # view_as_complex needs pairs adjacent in memory
        z = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
        return torch.view_as_real(z * rotation).flatten(-2).to(x.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, self.rotation(positions, compute_dtype(x)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta:g}, layout=interleaved"


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, dim) rotated by (cos, sin) of shape (T, dim/2) or (B, 1, T, dim/2), written in x's memory order.

    A layer's q and k are token-major views, (B, T, H, d) seen as (B, H, T, d); the stack below would write a new
    tensor head-major. Under torch.compile the attention ops then see head-major q and k, and the gradients they
    return (laid out like their inputs) need a transposing copy before the projections' weight gradients, one per
    tensor and layer. Rotating the token-major view keeps the projections' layout from end to end."""
    if x.dim() == 4 and x.stride(1) < x.stride(2):  # token-major: rotate (B, T, H, d), the heads broadcast
        cos, sin = ((c.transpose(1, 2) if c.dim() == 4 else c.unsqueeze(-2)) for c in (cos, sin))
        return _rotate_pairs(x.transpose(1, 2), cos, sin).transpose(1, 2)
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


# (dim, theta, dtype, device) -> the rotations of positions 0 .. L-1; see `RotaryEmbedding.rotation`.
_TABLES: dict[tuple, torch.Tensor] = {}


def _pairs_adjacent(x: torch.Tensor) -> bool:
    """Whether x's last axis can be viewed as complex pairs (the layers' q/k views always can)."""
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in x.stride()[:-1])
