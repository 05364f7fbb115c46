"""An independent float64 implementation of differential attention, written from the spec.

It shares no code with the library on purpose: explicit per-head loops, explicit maps, explicit
RoPE from the formula, weights read straight from a state dict. Every backend is tested against
it. Keep it simple and obviously right rather than fast.
"""

from __future__ import annotations

import math

import torch


def visible(T: int, S: int, causal: bool, key_padding_mask=None, b: int = 0) -> torch.Tensor:
    """(T, S) bool: query i sits at absolute position i + S - T (bottom-right alignment)."""
    vis = torch.ones(T, S, dtype=torch.bool)
    if causal:
        for i in range(T):
            for j in range(S):
                vis[i, j] = j <= i + S - T
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[b].bool()[None, :]
    return vis


def softmax_rows(scores: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """Masked softmax; a row that sees no key is all zeros."""
    out = torch.zeros_like(scores)
    for i in range(scores.shape[0]):
        cols = vis[i]
        if cols.any():
            s = scores[i, cols]
            e = torch.exp(s - s.max())
            out[i, cols] = e / e.sum()
    return out


def diff_attention_reference(q, k, v, lam, *, causal=True, key_padding_mask=None, scale=None,
                             return_maps=False):
    """(A1 - lam*A2) V per head, float64.

    q: (B, 2h, T, d), component c of head i at index 2i+c; k: (B, 2h_kv, S, d) likewise;
    v: (B, h_kv, S, 2d); lam: scalar, or (B, h, T) for a per-query lambda.
    Returns (B, h, T, 2d) float64 (and the maps (B, h, T, S) x3 if asked).
    """
    q, k, v = q.double(), k.double(), v.double()
    lam = torch.as_tensor(lam).double()
    B, two_h, T, d = q.shape
    h, h_kv, S = two_h // 2, k.shape[1] // 2, k.shape[2]
    n_rep = h // h_kv
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(B, h, T, v.shape[-1], dtype=torch.float64)
    maps = torch.zeros(3, B, h, T, S, dtype=torch.float64)
    for b in range(B):
        vis = visible(T, S, causal, key_padding_mask, b)
        for i in range(h):
            g = i // n_rep
            a1 = softmax_rows(q[b, 2 * i] @ k[b, 2 * g].T * scale, vis)
            a2 = softmax_rows(q[b, 2 * i + 1] @ k[b, 2 * g + 1].T * scale, vis)
            li = lam if lam.dim() == 0 else lam[b, i][:, None]
            diff = a1 - li * a2
            out[b, i] = diff @ v[b, g]
            maps[0, b, i], maps[1, b, i], maps[2, b, i] = diff, a1, a2
    return (out, maps) if return_maps else out


def rope_reference(x: torch.Tensor, positions, theta: float = 10000.0) -> torch.Tensor:
    """GPT-J interleaved RoPE on the last dim of x (..., T, d): pairs (2i, 2i+1)."""
    x = x.double()
    d = x.shape[-1]
    out = x.clone()
    for t, pos in enumerate(positions):
        for i in range(d // 2):
            ang = float(pos) * theta ** (-2 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b_ = x[..., t, 2 * i], x[..., t, 2 * i + 1]
            out[..., t, 2 * i] = a * c - b_ * s
            out[..., t, 2 * i + 1] = a * s + b_ * c
    return out


def lambda_init_reference(depth: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def maybe_rope(x: torch.Tensor, positions, theta: float, rope: bool) -> torch.Tensor:
    """x rotated by `rope_reference`, or x itself (float64) for a model without position encoding (NoPE)."""
    return rope_reference(x, positions, theta) if rope else x.double()


def project_heads(sd: dict, x: torch.Tensor, q_heads: int, k_heads: int, d: int, v_heads: int | None = None,
                  v_dim: int | None = None):
    """x through a layer's q/k/v projections (its state dict `sd`), split into heads, float64:
    q (B, q_heads, T, d), k (B, k_heads, T, d), v (B, v_heads, T, v_dim) (v_heads, v_dim: k_heads, d unless given)."""
    x = x.double()
    B, T, _ = x.shape

    def heads(name: str, n: int, width: int) -> torch.Tensor:
        return (x @ sd[f"{name}.weight"].double().T).view(B, T, n, width).transpose(1, 2)

    return heads("q_proj", q_heads, d), heads("k_proj", k_heads, d), heads("v_proj", v_heads or k_heads, v_dim or d)


def diff_layer_reference(sd: dict, x: torch.Tensor, *, depth: int, num_heads: int, num_kv_heads: int,
                         rope_theta: float = 10000.0, key_padding_mask=None, positions=None,
                         lambda_init: float | None = None, head_norm: bool = True, rope: bool = True):
    """The whole V1 layer from its state dict, float64. x: (B, T, E). Causal self-attention."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    B, T, E = x.shape
    h, h_kv = num_heads, num_kv_heads
    d = E // h // 2
    positions = list(range(T)) if positions is None else positions
    q, k, v = project_heads(sd, x, 2 * h, 2 * h_kv, d, v_heads=h_kv, v_dim=2 * d)
    q, k = maybe_rope(q, positions, rope_theta, rope), maybe_rope(k, positions, rope_theta, rope)
    lam_init = lambda_init_reference(depth) if lambda_init is None else lambda_init
    lam = (torch.exp((sd["lambda_q1"] * sd["lambda_k1"]).sum())
           - torch.exp((sd["lambda_q2"] * sd["lambda_k2"]).sum()) + lam_init)
    o = diff_attention_reference(q, k, v, lam, causal=True, key_padding_mask=key_padding_mask)
    if head_norm:
        rms = torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5)
        o = o / rms * sd["subln.weight"]
    o = o * (1 - lam_init)
    o = o.transpose(1, 2).reshape(B, T, E)
    return o @ sd["out_proj.weight"].T


def mha_reference(q, k, v, *, causal=True, key_padding_mask=None, scale=None):
    """Ordinary (GQA) attention, float64. q (B, H, T, d), k/v (B, H_kv, S, d)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, T, d = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        vis = visible(T, S, causal, key_padding_mask, b)
        for i in range(H):
            g = i // (H // H_kv)
            out[b, i] = softmax_rows(q[b, i] @ k[b, g].T * scale, vis) @ v[b, g]
    return out


def mha_layer_reference(sd: dict, x: torch.Tensor, *, num_heads: int, num_kv_heads: int, rope_theta: float = 10000.0,
                        head_norm: bool = False, rope: bool = True):
    """The baseline layer (ordinary GQA attention, RoPE, optional head-wise RMSNorm) from its state dict, float64."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    B, T, E = x.shape
    d = E // num_heads
    q, k, v = project_heads(sd, x, num_heads, num_kv_heads, d)
    pos = list(range(T))
    o = mha_reference(maybe_rope(q, pos, rope_theta, rope), maybe_rope(k, pos, rope_theta, rope), v)
    if head_norm:
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * sd["subln.weight"]
    return o.transpose(1, 2).reshape(B, T, E) @ sd["out_proj.weight"].T


def v2_layer_reference(sd: dict, x: torch.Tensor, *, num_heads: int, num_kv_heads: int, rope_theta: float = 10000.0,
                       rope: bool = True):
    """DIFF V2 from its state dict, float64: heads 2i and 2i+1 of one attention call (same kv group),
    out_i = attn_2i - sigmoid(x . lambda_proj_i) * attn_2i+1, then o_proj."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    B, T, E = x.shape
    H, H_kv = num_heads, num_kv_heads
    d = sd["q_proj.weight"].shape[0] // (2 * H)
    q, k, v = project_heads(sd, x, 2 * H, H_kv, d)
    pos = list(range(T))
    q, k = maybe_rope(q, pos, rope_theta, rope), maybe_rope(k, pos, rope_theta, rope)
    group = 2 * H // H_kv
    outs = []
    for i in range(H):
        g = (2 * i) // group
        a = mha_reference(q[:, 2 * i:2 * i + 1], k[:, g:g + 1], v[:, g:g + 1])
        b = mha_reference(q[:, 2 * i + 1:2 * i + 2], k[:, g:g + 1], v[:, g:g + 1])
        lam = torch.sigmoid(x @ sd["lambda_proj.weight"][i])[:, None, :, None]
        outs.append(a - lam * b)
    return torch.cat(outs, dim=1).transpose(1, 2).reshape(B, T, H * d) @ sd["o_proj.weight"].T


def ssmax_reference(q, k, v, s, *, causal=True, key_padding_mask=None, scale=None, return_maps=False):
    """Scalable-softmax (SSMax, Nakanishi 2025) GQA attention, float64, with explicit maps.

    For query i of head h: n = the number of keys it sees (causal and key padding applied, so cached keys
    count and padded ones do not); its logits over the visible keys j are s_h * log(n) * (q_i . k_j) * scale,
    and its output is their softmax times V (zeros when n = 0). q (B, H, T, d), k/v (B, H_kv, S, d), s (H,).
    Returns (B, H, T, d_v) (and the maps (B, H, T, S) if asked)."""
    q, k, v, s = q.double(), k.double(), v.double(), torch.as_tensor(s).double()
    B, H, T, d = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    maps = torch.zeros(B, H, T, S, dtype=torch.float64)
    for b in range(B):
        vis = visible(T, S, causal, key_padding_mask, b)
        for h in range(H):
            g = h // (H // H_kv)
            for i in range(T):
                keys = [j for j in range(S) if vis[i, j]]
                if not keys:
                    continue
                factor = s[h] * math.log(len(keys)) * scale
                logits = torch.stack([factor * (q[b, h, i] @ k[b, g, j]) for j in keys])
                weights = torch.exp(logits - logits.max())
                weights = weights / weights.sum()
                for w, j in zip(weights, keys):
                    maps[b, h, i, j] = w
                    out[b, h, i] = out[b, h, i] + w * v[b, g, j]
    return (out, maps) if return_maps else out


def ssmax_layer_reference(sd: dict, x: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                          rope_theta: float = 10000.0, key_padding_mask=None, positions=None, rope: bool = True):
    """The SSMax layer (`transformer_ssmax`) from its state dict, float64: the baseline layer whose softmax is
    `ssmax_reference` with s = sd["ssmax_scale"]. x: (B, T, E). Causal self-attention."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    B, T, E = x.shape
    d = E // num_heads
    positions = list(range(T)) if positions is None else positions
    q, k, v = project_heads(sd, x, num_heads, num_kv_heads, d)
    q, k = maybe_rope(q, positions, rope_theta, rope), maybe_rope(k, positions, rope_theta, rope)
    o = ssmax_reference(q, k, v, sd["ssmax_scale"], causal=True, key_padding_mask=key_padding_mask)
    return o.transpose(1, 2).reshape(B, T, E) @ sd["out_proj.weight"].T
