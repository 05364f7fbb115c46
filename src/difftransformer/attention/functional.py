"""The one definition of differential attention, and interchangeable backends for it.

Everything the layers compute goes through `differential_attention` (V1) or
`multihead_attention` (ordinary attention, used by the baseline and by DIFF V2, whose pairing of its
heads' outputs is `paired_difference`). Which implementation
runs is decided in `backends.py` (eager, sdpa, cpp, triton, and the one 'auto' rule); a decoding step
on the CPU may go straight to the fused kernel's decode function, as `decode.py` decides; this module
holds the math, the checks, the masking rules and the eager and SDPA paths.

Precision: maps and the difference A1 - lam*A2 are computed in `compute_dtype` (fp32 for fp32 and
half-precision inputs, float64 for float64), and the output is returned in q's dtype. The sdpa backend is
the exception: SDPA returns each map's A_c V in q's dtype, so with fp16/bf16 inputs the two terms are
rounded to it (and each map's probabilities before their product with V) before A1 V - lam * A2 V is taken
in fp32, as in the authors' FlashAttention path. Where the two terms nearly cancel, the difference then
carries their rounding, up to u |out| + 2u (A1 |V| + |lam| A2 |V|), not only the output's own u |out|
(u = 2^-8 in bf16, 2^-11 in fp16); eager, cpp and triton subtract before rounding.

Layout used everywhere (B batch, h DIFF heads, h_kv kv groups, T queries, S keys, d comp. dim):
    q: (B, 2h, T, d)      component c of head i at index 2i + c ("striped")
    k: (B, 2h_kv, S, d)   component c of kv group g at index 2g + c
    v: (B, h_kv, S, 2d)
    out: (B, h, T, 2d) = (A1 - lam * A2) V, head i reading kv group i // (h / h_kv)
Causal masks are bottom-right aligned: query t sits at absolute position t + S - T, so the same
call serves full sequences and cached decoding.

Score hooks: white-box probes (activation outliers, attention-logit quantisation) read or replace
the pre-softmax logits through the explicit `score_hook` argument, never by patching this module.
A hook is called as `hook(scores, visible)` with
    scores   (B, heads, maps, T, S) = q k^T * scale in the compute dtype, for every query head
             (GQA already expanded); maps = 2 for differential attention ([Q1 K1^T, Q2 K2^T]),
             1 for ordinary attention
    visible  bool, broadcastable to scores, True where the query may read the key; None if all may
and returns None (it only looked) or a tensor of scores' shape that replaces them; entries that
are not visible are masked afterwards whatever it holds. A hook needs the explicit maps, so the
call runs on the eager backend (as with return_maps).

Query hooks: a probe that only rescales or replaces the queries (a temperature per query row, as
adaptive temperature at inference) does it through `query_hook`, which keeps every backend, fused
kernels included. It is called once per call, before any backend runs, as `hook(q, k, scale, visible)`
with
    q        the queries as given (layout above), after position encoding and any query scaling
    k        the keys expanded to q's heads: query head j reads key head j (GQA repeated; for
             differential attention component c of head i reads component c of its kv group)
    visible  as for score hooks, broadcastable to (B, heads of q, T, S); None if all may
and returns the queries to use, of q's shape and dtype. Logits are then (hook's q) k^T * scale.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from difftransformer.attention.backends import resolve_backend
from difftransformer.attention.decode import cpu_decode_diff, cpu_decode_ordinary
from difftransformer.kernels import ops_observed
from difftransformer.kernels.flash_cpu import diff_flash_attention_cpu, flash_attention_cpu
from difftransformer.norm import compute_dtype

ScoreHook = Callable[[torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]
QueryHook = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]


class AttentionMaps(NamedTuple):
    """Maps returned by the eager backend for analysis, each (B, h, T, S) in the compute dtype (fp32 or float64).
    A layer with one softmax map (the baseline and its controls) returns (A, A, None)."""

    diff: torch.Tensor  # A1 - lam * A2
    a1: torch.Tensor
    a2: torch.Tensor | None


def lambda_init_fn(depth: int) -> float:
    """lambda_init schedule of the paper: 0.2 at layer 0, rising to ~0.8 in deep layers."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def reparameterized_lambda(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init: float):
    """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a 0-d tensor in `compute_dtype` of the
    vectors: fp32 for fp32 or half-precision vectors, float64 for float64 ones."""
    f = compute_dtype(lambda_q1, lambda_k1, lambda_q2, lambda_k2)
    dot1 = torch.sum(lambda_q1.to(f) * lambda_k1.to(f))
    dot2 = torch.sum(lambda_q2.to(f) * lambda_k2.to(f))
    return torch.exp(dot1) - torch.exp(dot2) + lambda_init


def _visibility(T: int, S: int, causal: bool, key_padding_mask, device) -> torch.Tensor | None:
    """Bool mask (B|1, 1, T, S), True where query t may read key s; None when all may."""
    mask = None
    if causal and not (T == 1 and S >= 1):
        q_pos = torch.arange(T, device=device)[:, None] + (S - T)
        mask = (torch.arange(S, device=device)[None, :] <= q_pos)[None, None]
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = kpm if mask is None else mask & kpm
    return mask


def _may_have_empty_rows(T: int, S: int, key_padding_mask) -> bool:
    """Whether a query may see no key: only with key padding or more queries than keys (bottom-right causal
    alignment lets query 0 see keys 0 .. S - T). Decided from shapes alone, so no host sync."""
    return key_padding_mask is not None or S < T


def attended_key_counts(T: int, S: int, *, causal: bool = True, key_padding_mask=None,
                        device=None) -> torch.Tensor:
    """n: how many keys each of T queries reads among S keys, by the masking rule of every backend (query t
    at absolute index t + S - T; causal, it reads keys 0 .. t + S - T, none when that is negative), int64:
    (T,) without key padding, (B, T) with a (B, S) key_padding_mask, which counts only the visible keys.
    Scalable softmax's n."""
    if key_padding_mask is None:
        first = S - T + 1 if causal else S
        return torch.arange(first, first + T, device=device).clamp(0, S)
    _check_key_padding_mask(key_padding_mask, key_padding_mask.shape[0] if key_padding_mask.dim() else 0, S)
    keep = key_padding_mask.to(device=device, dtype=torch.bool).long()
    if not causal:
        return keep.sum(-1, keepdim=True).expand(-1, T)
    seen = F.pad(keep.cumsum(-1), (max(T - S, 0), 0))  # the queries before key 0 (S < T) see none
    return seen[:, seen.shape[1] - T:]


def _check_key_padding_mask(key_padding_mask, B: int, S: int) -> None:
    if key_padding_mask.shape != (B, S):
        raise ValueError(
            f"key_padding_mask must have shape (batch, key_len) = ({B}, {S}), got "
            f"{tuple(key_padding_mask.shape)}; it marks keys to keep with True/1, including any cached keys")


def _check_operands(q, k, v, key_padding_mask) -> None:
    """q, k, v (and the key padding mask) on one device, and q, k, v floating point, or an error naming them.

    The backend is chosen from q alone, and the fused CPU kernel reads k's, v's and the mask's memory as
    CPU data whatever device holds it; integer tensors would fail deep inside a backend. Mixed floating
    dtypes stay allowed: the callers cast k and v to q's dtype (`_in_query_dtype`) before any backend."""
    mask_elsewhere = key_padding_mask is not None and key_padding_mask.device != q.device
    if mask_elsewhere or not ((q.is_cpu and k.is_cpu and v.is_cpu) or q.device == k.device == v.device):
        names, tensors = ("q, k, v", (q, k, v)) if not mask_elsewhere else (
            "q, k, v and key_padding_mask", (q, k, v, key_padding_mask))
        raise ValueError(f"{names} must be on one device; got {', '.join(str(t.device) for t in tensors)}; "
                         f"move them there with .to(q.device)")
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise TypeError(f"q, k, v must be floating point; got {q.dtype}, {k.dtype}, {v.dtype}; "
                        f"convert them with .float() (or .to(torch.bfloat16), ...)")


def _in_query_dtype(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v in q's dtype (no copy when they already are): every backend then computes in q's."""
    return (k if k.dtype == q.dtype else k.to(q.dtype)), (v if v.dtype == q.dtype else v.to(q.dtype))


def _keys_per_head(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Differential keys (B, 2h_kv, S, d) as (B, h, 2, S, d): component c of head i is component c of its kv
    group i // n_rep (GQA repeated)."""
    B, two_h_kv, S, d = k.shape
    return k.view(B, two_h_kv // 2, 2, S, d).repeat_interleave(n_rep, dim=1)


def _check_diff_shapes(q, k, v, lam) -> None:
    qs, ks, vs = q.shape, k.shape, v.shape  # read once: this runs per layer per decoding step
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, length, dim); got {len(qs)}, {len(ks)}, {len(vs)} dims")
    B, two_h, T, d = qs
    if two_h % 2 or ks[1] % 2:
        raise ValueError(f"q and k carry two components per head, so their head axes must be even; "
                         f"got {two_h} and {ks[1]}")
    h, h_kv = two_h // 2, ks[1] // 2
    if ks[0] != B or ks[3] != d:
        raise ValueError(f"k must be (batch={B}, 2*h_kv, S, d={d}); got {tuple(ks)}")
    if vs != (B, h_kv, ks[2], 2 * d):
        raise ValueError(f"v must be (batch, h_kv, S, 2d) = {(B, h_kv, ks[2], 2 * d)}; got {tuple(vs)}")
    if h % h_kv:
        raise ValueError(f"the {h} DIFF heads must split evenly over the {h_kv} kv groups")
    if torch.is_tensor(lam) and lam.dim() != 0:
        raise ValueError(f"lambda must be a scalar (one per layer); got shape {tuple(lam.shape)}")


def _check_out_norm(out_norm, d: int) -> None:
    if out_norm[0].shape != (2 * d,):
        raise ValueError(f"out_norm's weight must have shape (2d,) = ({2 * d},), one entry per output "
                         f"feature of a head; got {tuple(out_norm[0].shape)}")


def differential_attention(q, k, v, lam, *, causal: bool = True, key_padding_mask=None,
                           scale: float | None = None, backend: str = "auto",
                           return_maps: bool = False, deterministic: bool = True,
                           score_hook: ScoreHook | None = None, query_hook: QueryHook | None = None,
                           out_norm: tuple[torch.Tensor, float] | None = None):
    """(softmax(Q1 K1^T s) - lam * softmax(Q2 K2^T s)) V for every head; see the module doc.

    Returns the (B, h, T, 2d) output in q's dtype, and `AttentionMaps` when `return_maps`.
    A query that sees no key (fully padded) outputs zeros.
    deterministic=False lets the Triton backend use its one-pass backward (dQ summed with atomics);
    eager and cpp are deterministic anyway, sdpa follows torch.use_deterministic_algorithms.
    score_hook, query_hook: see the module doc (a score hook runs the eager backend; a query hook any).
    out_norm: None, or (weight (2d,), eps): the output rows go through RMSNorm with this weight
    (DIFF's head norm, its constant folded into the weight), computed in `compute_dtype` of the
    output as `RMSNorm` does. Given here rather than applied by the caller so that the cpp and
    triton backends can fuse it into their kernels.
    """
    _check_operands(q, k, v, key_padding_mask)
    k, v = _in_query_dtype(q, k, v)
    _check_diff_shapes(q, k, v, lam)
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2])
    if out_norm is not None:
        _check_out_norm(out_norm, q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if query_hook is not None:
        keys = _keys_per_head(k, q.shape[1] // k.shape[1]).flatten(1, 2)  # (B, 2h, S, d), q's heads
        q = _apply_query_hook(query_hook, q, keys, scale, causal, key_padding_mask)
    need_maps = return_maps or score_hook is not None
    if not need_maps and key_padding_mask is None:  # a decoding step may go straight to the CPU kernel
        out = cpu_decode_diff(q, k, v, lam, causal, scale, out_norm, backend)
        if out is not None:
            return out
    f = compute_dtype(q)
    if not (isinstance(lam, torch.Tensor) and lam.dtype == f and lam.device == q.device):  # skips as_tensor + to
        lam = torch.as_tensor(lam, device=q.device).to(f)
    decode_row = q.shape[2] == 1 and not need_maps and _no_gradient(q, k, v, lam, out_norm) and not ops_observed()
    which = resolve_backend(backend, q.device, need_maps=need_maps, has_padding=key_padding_mask is not None,
                            dtype=q.dtype, decode_row=decode_row)
    if which == "eager":
        out, maps = _diff_eager(q, k, v, lam, causal, key_padding_mask, scale, score_hook)
        out = _apply_out_norm(out, out_norm)
        return (out, maps) if return_maps else out
    if which == "sdpa":
        return _apply_out_norm(_diff_sdpa(q, k, v, lam, causal, key_padding_mask, scale), out_norm)
    if which == "cpp":
        return diff_flash_attention_cpu(q, k, v, lam, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                        out_norm=out_norm)
    if decode_row:  # one query row sees every key but padding, causal or not: the decoding kernel
        from difftransformer.kernels.diff_decode import diff_decode_attention

        return diff_decode_attention(q, k, v, lam, key_padding_mask=key_padding_mask, scale=scale, out_norm=out_norm)
    from difftransformer.kernels.diff_flash import diff_flash_attention

    return diff_flash_attention(q, k, v, lam, causal=causal, scale=scale, deterministic=deterministic,
                                out_norm=out_norm)


def _no_gradient(q, k, v, lam, out_norm) -> bool:
    """Whether no gradient can flow from this call (the decoding kernel has no backward)."""
    if not torch.is_grad_enabled():
        return True
    return not (q.requires_grad or k.requires_grad or v.requires_grad or lam.requires_grad
                or (out_norm is not None and out_norm[0].requires_grad))


def _apply_out_norm(out: torch.Tensor, out_norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """RMSNorm of each output row with out_norm = (weight, eps), as `RMSNorm` computes it."""
    if out_norm is None:
        return out
    weight, eps = out_norm
    f = compute_dtype(out)
    return F.rms_norm(out.to(f), (out.shape[-1],), weight.to(f), eps).to(out.dtype)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, empty_rows: bool = True) -> torch.Tensor:
    """Softmax over the last axis in scores' dtype; rows with no visible key become zeros instead of NaN.
    empty_rows=False promises that every row sees a key (`_may_have_empty_rows`), which skips their repair."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~mask, float("-inf"))
    if not empty_rows:
        return torch.softmax(scores, dim=-1)
    any_visible = mask.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~any_visible, 0.0), dim=-1)
    return probs * any_visible


def _apply_score_hook(hook: ScoreHook | None, scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """scores (B, heads, maps, T, S) after the hook; a returned tensor must keep the shape."""
    if hook is None:
        return scores
    new = hook(scores, visible)
    if new is None:
        return scores
    if new.shape != scores.shape:
        raise ValueError(f"a score hook must return scores of shape {tuple(scores.shape)} (or None); "
                         f"got {tuple(new.shape)}")
    return new


def _apply_query_hook(hook: QueryHook, q: torch.Tensor, keys: torch.Tensor, scale: float, causal: bool,
                      key_padding_mask) -> torch.Tensor:
    """q after the hook, given the keys expanded to q's heads; the result must keep q's shape and dtype."""
    visible = _visibility(q.shape[2], keys.shape[2], causal, key_padding_mask, q.device)
    new = hook(q, keys, scale, visible)
    if not isinstance(new, torch.Tensor) or new.shape != q.shape or new.dtype != q.dtype:
        got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
        raise ValueError(f"a query hook must return queries of shape {tuple(q.shape)} and dtype {q.dtype}; "
                         f"got {got}")
    return new


def _diff_eager(q, k, v, lam, causal, key_padding_mask, scale, score_hook=None):
    B, two_h, T, d = q.shape
    h, h_kv, S = two_h // 2, k.shape[1] // 2, k.shape[2]
    n_rep = h // h_kv
    f = lam.dtype  # compute_dtype(q): differential_attention has cast λ to it
    qc = q.to(f).view(B, h, 2, T, d)
    kc = _keys_per_head(k.to(f), n_rep)  # (B, h, 2, S, d)
    vc = v.to(f).repeat_interleave(n_rep, dim=1)  # (B, h, S, 2d)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # (B, h, 2, T, S)
    mask = _visibility(T, S, causal, key_padding_mask, q.device)
    mask = None if mask is None else mask[:, :, None]
    scores = _apply_score_hook(score_hook, scores, mask)
    probs = _masked_softmax(scores, mask, _may_have_empty_rows(T, S, key_padding_mask))
    a1, a2 = probs[:, :, 0], probs[:, :, 1]
    diff = a1 - lam * a2
    out = torch.matmul(diff, vc).to(q.dtype)
    return out, AttentionMaps(diff, a1, a2)


def _sdpa(q, k, v, mask, causal: bool, scale: float, gqa: bool):
    """One SDPA call with explicit bottom-right masking and all-masked rows zeroed."""
    T, S = q.shape[2], k.shape[2]
    is_causal = False
    if mask is None and causal and T == S and T > 1:
        is_causal = True
    elif causal and mask is None and T != S and T > 1:
        mask = _visibility(T, S, True, None, q.device)
    mask, empty_rows = _with_empty_rows_open(mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=gqa)
    return out if empty_rows is None else out.masked_fill(empty_rows, 0.0)


def _with_empty_rows_open(mask):
    """(mask with every key opened in rows that see none, those rows) for SDPA, whose output the caller then
    zeroes in those rows; (None, None) without a mask. Computed without reading the mask on the host, so a
    masked call can run inside a CUDA graph."""
    if mask is None:
        return None, None
    empty_rows = ~mask.any(dim=-1, keepdim=True)
    return mask | empty_rows, empty_rows


def _diff_sdpa(q, k, v, lam, causal, key_padding_mask, scale):
    B, two_h, T, d = q.shape
    h, h_kv, S = two_h // 2, k.shape[1] // 2, k.shape[2]
    if T == 1:
        return _diff_sdpa_row(q, k, v, lam, key_padding_mask, scale, gqa=h != h_kv)
    # Component-major head order [c0 of every head, c1 of every head]: with GQA, query head
    # c*h + i then reads kv head (c*h + i) // n_rep = c*h_kv + i // n_rep, exactly its own group.
    qc = q.view(B, h, 2, T, d).transpose(1, 2)
    kc = k.view(B, h_kv, 2, S, d).transpose(1, 2)
    if q.device.type == "cpu":
        # CPU flash needs equal head dims; zero-padding q and k leaves every score unchanged.
        # The pad also does the reorder, so each of q and k is copied once.
        qc, kc = F.pad(qc, (0, d)), F.pad(kc, (0, d))
    dq = qc.shape[-1]
    qc, kc = qc.reshape(B, two_h, T, dq), kc.reshape(B, 2 * h_kv, S, dq)
    vc = v.unsqueeze(1).expand(B, 2, h_kv, S, 2 * d).reshape(B, 2 * h_kv, S, 2 * d)
    mask = _visibility(T, S, causal, key_padding_mask, q.device) if key_padding_mask is not None else None
    o = _sdpa(qc, kc, vc, mask, causal, scale, gqa=h != h_kv).view(B, 2, h, T, 2 * d)
    return _combine(o[:, 0], o[:, 1], lam)


def _combine(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """o1 - lam * o2 in lam's dtype (the compute dtype), in one pass, returned in o1's."""
    if o1.dtype == lam.dtype:
        return torch.addcmul(o1, o2, lam, value=-1.0)
    return torch.addcmul(o1.to(lam.dtype), o2.to(lam.dtype), lam, value=-1.0).to(o1.dtype)


def _diff_sdpa_row(q, k, v, lam, key_padding_mask, scale, gqa: bool):
    """A decoding step (one query row, which sees every key that is not padding): one SDPA call per softmax map
    on strided views of q and k (component c of every head and kv group) and on v itself. Reordering the heads
    into one call, as longer queries do, would copy every cached key and value at every step."""
    mask, empty_rows = _with_empty_rows_open(_visibility(1, k.shape[2], True, key_padding_mask, q.device))
    o1, o2 = (F.scaled_dot_product_attention(q[:, c::2], k[:, c::2], v, attn_mask=mask, scale=scale, enable_gqa=gqa)
              for c in (0, 1))
    out = _combine(o1, o2, lam)
    return out if empty_rows is None else out.masked_fill(empty_rows, 0.0)


def multihead_attention(q, k, v, *, causal: bool = True, key_padding_mask=None, scale: float | None = None,
                        backend: str = "auto", return_maps: bool = False, score_hook: ScoreHook | None = None,
                        query_hook: QueryHook | None = None):
    """Ordinary (GQA) attention with the same masking rules. q (B, H, T, d), k/v (B, H_kv, S, d).

    Returns (B, H, T, d_v), and the (B, H, T, S) softmax map when `return_maps`; score_hook, query_hook:
    see the module doc (maps = 1; a score hook runs the eager backend, a query hook any)."""
    _check_operands(q, k, v, key_padding_mask)
    k, v = _in_query_dtype(q, k, v)
    qs, ks, vs = q.shape, k.shape, v.shape
    if (len(qs) != 4 or len(ks) != 4 or vs[:-1] != ks[:-1] or ks[0] != qs[0] or ks[3] != qs[3]
            or qs[1] % ks[1]):
        raise ValueError(f"expected q (B, H, T, d), k/v (B, H_kv, S, d): the same batch B and q/k dim d, "
                         f"H % H_kv == 0; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, d = qs
    H_kv, S = ks[1], ks[2]
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, B, S)
    scale = d ** -0.5 if scale is None else scale
    if query_hook is not None:
        q = _apply_query_hook(query_hook, q, k.repeat_interleave(H // H_kv, dim=1), scale, causal, key_padding_mask)
    need_maps = return_maps or score_hook is not None
    if not need_maps and key_padding_mask is None:  # a decoding step may go straight to the CPU kernel
        out = cpu_decode_ordinary(q, k, v, causal, scale, backend)
        if out is not None:
            return out
    which = resolve_backend(backend, q.device, need_maps=need_maps, has_padding=key_padding_mask is not None,
                            dtype=q.dtype, ordinary=True)
    if which == "eager":
        n_rep = H // H_kv
        f = compute_dtype(q)
        scores = torch.matmul(q.to(f), k.to(f).repeat_interleave(n_rep, 1).transpose(-1, -2)) * scale
        mask = _visibility(T, S, causal, key_padding_mask, q.device)
        if score_hook is not None:
            hooked = _apply_score_hook(score_hook, scores[:, :, None], None if mask is None else mask[:, :, None])
            scores = hooked[:, :, 0]
        probs = _masked_softmax(scores, mask, _may_have_empty_rows(T, S, key_padding_mask))
        out = torch.matmul(probs, v.to(f).repeat_interleave(n_rep, 1)).to(q.dtype)
        return (out, probs) if return_maps else out
    if which == "cpp" and v.shape[-1] == d:  # the C++ kernel's ordinary path has v's dim = q's dim
        return flash_attention_cpu(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    mask = _visibility(T, S, causal, key_padding_mask, q.device) if key_padding_mask is not None else None
    return _sdpa(q, k, v, mask, causal, scale, gqa=H != H_kv)


def paired_difference(attn: torch.Tensor, lam: torch.Tensor, probs: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, AttentionMaps | None]:
    """DIFF V2's combination of one ordinary attention call over 2H heads, adjacent heads paired:
    out_i = attn_{2i} - lam_i * attn_{2i+1}, computed in `compute_dtype` and returned in attn's dtype.

    attn (B, 2H, T, d) and lam (B, H, T, 1) (per token and head: sigmoid(lambda_proj(x))). Returns (out, maps):
    with the call's softmax maps probs (B, 2H, T, S), maps = `AttentionMaps` (A_{2i} - lam_i A_{2i+1}, A_{2i},
    A_{2i+1}); without them None."""
    f = compute_dtype(attn)
    lam = lam.to(f)
    out = (attn[:, 0::2].to(f) - lam * attn[:, 1::2].to(f)).to(attn.dtype)
    if probs is None:
        return out, None
    a1, a2 = probs[:, 0::2], probs[:, 1::2]
    return out, AttentionMaps(a1 - lam * a2, a1, a2)
