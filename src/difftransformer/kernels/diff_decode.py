"""One decoding step of differential attention, fused in Triton (split-KV, "flash-decoding").

    diff_decode_attention(q, k, v, lam, *, key_padding_mask=None, scale=None, out_norm=None, splits=None)

Per DIFF head i (kv group g = i // n_rep, n_rep = h / h_kv), for its single query row:

    out_i = A1 V_g - lam * A2 V_g,   A_c = softmax(q_c K_c^T * scale + mask),  c = 1, 2

Arguments (B batch, h DIFF heads, h_kv kv groups, S keys, d component dim):
    q     (B, 2h, 1, d)      component c of head i at index 2i + c ("striped")
    k     (B, 2h_kv, S, d)   component c of kv group g at index 2g + c
    v     (B, h_kv, S, 2d)
    lam   0-d fp32 tensor on q's device, read by the kernel (no host synchronisation)
    key_padding_mask  None or (B, S) bool, True where the key may be read; a row that sees no key outputs zeros
    scale  default d ** -0.5
    out_norm  None or (weight (2d,) fp32 contiguous, eps): each output row of 2d is then RMS-normalised
    splits  None (chosen from S, B * h and the device, see `split_plan`) or the number of key splits wanted
q, k, v share one dtype (fp32, bf16 or fp16) and one CUDA device (or the CPU under TRITON_INTERPRET=1);
any strides are read in place (k, v may be views of longer cache buffers, buf[:, :, :S]) as long as the
last dim of each is contiguous. Any d works (blocks are padded to the next power of two and masked).

Returns (B, h, 1, 2d) in q's dtype. Arithmetic: scores, both softmaxes and o = A1 V - lam A2 V in fp32
(inputs upcast, no intermediate rounding), o rounded to q's dtype; with out_norm, y = rms_norm(o as fp32)
* weight in fp32, rounded to q's dtype, as `attention.functional._apply_out_norm` computes it after an
unfused path.

Two launches, no host synchronisation, nothing allocated but the output and one fp32 workspace, so a
step can be captured in a CUDA graph:
    kernel 1, grid (B * h, n_split): program (row, split) streams keys [split * keys_per_split, ...) of
        its row's kv group in blocks of BLOCK_N, reading each K1, K2 and V block once for both maps, and
        keeps two online softmaxes (running max m_c and sum l_c, fp32 accumulator acc_c of 2d per map).
        Padded or masked keys score -inf. It writes (acc1, acc2, m1, l1, m2, l2) to its workspace row.
    kernel 2, grid (B * h): merges the n_split partials of a row (rescaling each by exp2(m_s - max m)),
        forms acc1 / l1 - lam * acc2 / l2, rounds, applies the optional norm and stores.
Workspace: fp32 (B * h, n_split, 4d + 4), each row [acc1 (2d), acc2 (2d), m1, l1, m2, l2], scores in
log2 units. n_split depends on host values only (S, B * h, d, the dtype, the device's SM count), so a
captured graph stays valid for its shapes; every split gets at least one key block and none is empty.
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # kernel 2 reads the splits' statistics as one vector of at most this many
_INTERPRET_PROGRAMS = 8  # the interpreter's stand-in for "enough programs to fill the device"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROGRAMS_PER_SM = 10


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def tile_for(d: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N keys per block, warps) of kernel 1. One warp per program (its reductions stay inside the warp;
    parallelism comes from many programs, see `split_plan`) with 16-key blocks, or 32 for half-precision
    inputs with 64 < d <= 128; above d = 128, one more warp per 128 columns. In the interpreter: 32 keys
    (still several blocks at test sizes). None of these spills registers on sm_90 (ptxas -v)."""
    if _INTERPRET:
        return 32, 1
    block_d = _pow2(d)
    if block_d <= 64:
        return 16, 1
    if block_d == 128:
        return (16 if dtype == torch.float32 else 32), 1
    return 16, block_d // 128


def _target_programs(device: torch.device) -> int:
    """How many programs kernel 1 should have to fill the device: _PROGRAMS_PER_SM per SM on CUDA."""
    if device.type != "cuda":
        return _INTERPRET_PROGRAMS
    return _cuda_programs(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_programs(index: int) -> int:
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(index).multi_processor_count


def split_plan(S: int, rows: int, d: int, dtype: torch.dtype, device: torch.device,
               splits: int | None = None) -> tuple[int, int]:
    """(n_split, keys_per_split) for `rows` = B * h query rows over S keys.

    Without `splits`, n_split is enough splits for rows * n_split to reach `_target_programs`
    (_PROGRAMS_PER_SM per SM: one-warp programs need many to keep the memory system busy), at most one per
    key block and at most MAX_SPLITS. With `splits`, that many are wanted (capped the same way). Either way
    keys_per_split is then a whole number of blocks and n_split = cdiv(S, keys_per_split), so no split is
    empty: e.g. 3 splits over 4 blocks become 2 splits of 2 blocks."""
    block_n = tile_for(d, dtype)[0]
    n_blocks = max(1, _cdiv(S, block_n))
    wanted = _cdiv(_target_programs(device), max(rows, 1)) if splits is None else splits
    wanted = max(1, min(wanted, n_blocks, MAX_SPLITS))
    blocks_per_split = _cdiv(n_blocks, wanted)
    return _cdiv(n_blocks, blocks_per_split), blocks_per_split * block_n


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _decode_split_kernel(Q, K, V, Mask, WS,
                         sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_s,
                         H, N_REP, S, KEYS_PER_SPLIT, qk_scale,
                         HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """Program (row = b * H + i, split): both online softmaxes over its keys, partials to WS."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = row // H
    i = row % H
    g = i // N_REP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_D
    dv_ok = offs_dv < 2 * HEAD_D

    Q1 = Q + b * sq_b + (2 * i) * sq_h
    q1 = tl.load(Q1 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    q2 = tl.load(Q1 + sq_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    K1 = K + b * sk_b + (2 * g) * sk_h
    K2 = K1 + sk_h
    Vg = V + b * sv_b + g * sv_h

    # Running maxima (log2 units), sums and accumulators; a map that has seen no visible key keeps
    # m = -inf and is shifted by 0 instead, so every exp2 is exp2(-inf) = 0 rather than NaN.
    m1 = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    m2 = m1
    l1 = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    l2 = l1
    acc1 = tl.zeros([BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_DV], tl.float32)

    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, S)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        vis = offs_n < hi
        if HAS_MASK:
            keep = tl.load(Mask + b * sm_b + offs_n.to(tl.int64) * sm_s, mask=vis, other=0)
            vis = vis & (keep != 0)
        rows_n = offs_n.to(tl.int64)
        k_ptrs = rows_n[:, None] * sk_s + offs_d[None, :]
        k_mask = vis[:, None] & d_ok[None, :]
        k1 = tl.load(K1 + k_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        k2 = tl.load(K2 + k_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(Vg + rows_n[:, None] * sv_s + offs_dv[None, :], mask=vis[:, None] & dv_ok[None, :],
                    other=0.0).to(tl.float32)
        s1 = tl.where(vis, tl.sum(q1[None, :] * k1, 1) * qk_scale, float("-inf"))
        s2 = tl.where(vis, tl.sum(q2[None, :] * k2, 1) * qk_scale, float("-inf"))
        m1_new = tl.maximum(m1, tl.max(s1, 0))
        m2_new = tl.maximum(m2, tl.max(s2, 0))
        m1_use = tl.where(m1_new == float("-inf"), 0.0, m1_new)
        m2_use = tl.where(m2_new == float("-inf"), 0.0, m2_new)
        alpha1 = tl.exp2(m1 - m1_use)
        alpha2 = tl.exp2(m2 - m2_use)
        p1 = tl.exp2(s1 - m1_use)
        p2 = tl.exp2(s2 - m2_use)
        l1 = l1 * alpha1 + tl.sum(p1, 0)
        l2 = l2 * alpha2 + tl.sum(p2, 0)
        acc1 = acc1 * alpha1 + tl.sum(p1[:, None] * v, 0)  # the one V block serves both maps
        acc2 = acc2 * alpha2 + tl.sum(p2[:, None] * v, 0)
        m1 = m1_new
        m2 = m2_new

    W = WS + (row * tl.num_programs(1) + split) * (4 * HEAD_D + 4)
    tl.store(W + offs_dv, acc1, mask=dv_ok)
    tl.store(W + 2 * HEAD_D + offs_dv, acc2, mask=dv_ok)
    tl.store(W + 4 * HEAD_D, m1)
    tl.store(W + 4 * HEAD_D + 1, l1)
    tl.store(W + 4 * HEAD_D + 2, m2)
    tl.store(W + 4 * HEAD_D + 3, l2)


@triton.jit
def _merged_scale(W, offs_s, s_ok, stat: tl.constexpr, ROW: tl.constexpr):
    """(max m, sum_s l_s * exp2(m_s - max m)) of one map over the splits; the max is 0 if all are -inf."""
    m = tl.load(W + offs_s * ROW + stat, mask=s_ok, other=float("-inf"))
    l_s = tl.load(W + offs_s * ROW + stat + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    return m_max, tl.sum(l_s * tl.exp2(m - m_max), 0)


@triton.jit
def _decode_merge_kernel(WS, Lam, Out, Wn, so_b, so_h, H, N_SPLIT, eps,
                         HEAD_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
                         NORM: tl.constexpr):
    """Program row = b * H + i: merge the splits, o = A1 V - lam A2 V, round, optional RMSNorm, store."""
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    i = row % H
    ROW = 4 * HEAD_D + 4  # a constexpr: the workspace row
    W = WS + row * N_SPLIT * ROW
    offs_s = tl.arange(0, BLOCK_SPLIT)
    s_ok = offs_s < N_SPLIT
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < 2 * HEAD_D
    m1, l1 = _merged_scale(W, offs_s, s_ok, 4 * HEAD_D, ROW)
    m2, l2 = _merged_scale(W, offs_s, s_ok, 4 * HEAD_D + 2, ROW)
    acc1 = tl.zeros([BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_DV], tl.float32)
    for s in range(0, N_SPLIT):
        Ws = W + s * ROW
        acc1 += tl.load(Ws + offs_dv, mask=dv_ok, other=0.0) * tl.exp2(tl.load(Ws + 4 * HEAD_D) - m1)
        acc2 += tl.load(Ws + 2 * HEAD_D + offs_dv, mask=dv_ok, other=0.0) * tl.exp2(tl.load(Ws + 4 * HEAD_D + 2) - m2)
    # A row that saw no key has l = 0 and acc = 0: it outputs zeros.
    o1 = acc1 / tl.where(l1 == 0.0, 1.0, l1)
    o2 = acc2 / tl.where(l2 == 0.0, 1.0, l2)
    lam = tl.load(Lam).to(tl.float32)
    out = (o1 - lam * o2).to(Out.dtype.element_ty)
    if NORM:  # padded columns are 0 and do not count in the mean
        z = out.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(z * z, 0) / (2 * HEAD_D) + eps)
        w = tl.load(Wn + offs_dv, mask=dv_ok, other=0.0)
        out = (z * rstd * w).to(Out.dtype.element_ty)
    tl.store(Out + b * so_b + i * so_h + offs_dv, out, mask=dv_ok)


# ----------------------------------------------------------------------------------------------
# host side


def _check_inputs(q, k, v, lam, key_padding_mask, out_norm, splits) -> None:
    """One-line ValueErrors naming the value and the rule."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or (q.dim(), k.dim(), v.dim()) != (4, 4, 4):
        dims = tuple(t.dim() if isinstance(t, torch.Tensor) else type(t).__name__ for t in (q, k, v))
        raise ValueError(f"q, k, v must be 4-D tensors (B, 2h, 1, d), (B, 2h_kv, S, d), (B, h_kv, S, 2d); "
                         f"got dims {dims}")
    B, two_h, T, d = q.shape
    if T != 1:
        raise ValueError(f"q must hold one query row per head (T = 1) for a decoding step; got T = {T} in "
                         f"{tuple(q.shape)}; use diff_flash_attention for longer queries")
    if two_h % 2 or two_h == 0 or k.shape[1] % 2 or k.shape[1] == 0:
        raise ValueError(f"q's and k's head axes hold two components per head and must be even and > 0; "
                         f"got {two_h} and {k.shape[1]}")
    h, h_kv, S = two_h // 2, k.shape[1] // 2, k.shape[2]
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"k must be (B={B}, 2h_kv, S, d={d}); got {tuple(k.shape)}")
    if tuple(v.shape) != (B, h_kv, S, 2 * d):
        raise ValueError(f"v must be (B, h_kv, S, 2d) = {(B, h_kv, S, 2 * d)}; got {tuple(v.shape)}")
    if h % h_kv:
        raise ValueError(f"the {h} DIFF heads must split evenly over the {h_kv} kv groups (h % h_kv == 0)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among fp32, bf16, fp16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device) or not (q.is_cuda or (_INTERPRET and q.is_cpu)):
        raise ValueError(f"q, k, v must be on one CUDA device (or the CPU under TRITON_INTERPRET=1); got "
                         f"{q.device}, {k.device}, {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1); got strides {t.stride()}; "
                             f"pass a view of a buffer laid out (..., dim) or call .contiguous()")
    if not isinstance(lam, torch.Tensor) or lam.dim() != 0 or lam.dtype != torch.float32 or lam.device != q.device:
        got = (f"{tuple(lam.shape)} {lam.dtype} on {lam.device}" if isinstance(lam, torch.Tensor)
               else type(lam).__name__)
        raise ValueError(f"lam must be a 0-d fp32 tensor on {q.device} (read by the kernel); got {got}")
    _check_mask(key_padding_mask, B, S, q.device)
    _check_norm(out_norm, d, q.device)
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be None or a positive int; got {splits!r}")


def _check_mask(key_padding_mask, B: int, S: int, device) -> None:
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__
        raise ValueError(f"key_padding_mask must be a bool tensor (True = the key may be read); got {got}; "
                         f"convert it with .bool()")
    if tuple(key_padding_mask.shape) != (B, S):
        raise ValueError(f"key_padding_mask must have shape (B, S) = ({B}, {S}); got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != device:
        raise ValueError(f"key_padding_mask must be on {device}, with q; got {key_padding_mask.device}")


def _check_norm(out_norm, d: int, device) -> None:
    if out_norm is None:
        return
    if not isinstance(out_norm, (tuple, list)) or len(out_norm) != 2:
        raise ValueError(f"out_norm must be None or (weight, eps); got {type(out_norm).__name__}")
    weight, eps = out_norm
    if (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (2 * d,) or weight.dtype != torch.float32
            or not weight.is_contiguous() or weight.device != device):
        got = (f"{tuple(weight.shape)} {weight.dtype} on {weight.device}" if isinstance(weight, torch.Tensor)
               else type(weight).__name__)
        raise ValueError(f"out_norm's weight must be a contiguous fp32 (2d,) = ({2 * d},) tensor on {device}; "
                         f"got {got}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"out_norm's eps must be a float >= 0; got {eps!r}")


def _device_guard(t):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def diff_decode_attention(q, k, v, lam, *, key_padding_mask=None, scale=None, out_norm=None, splits=None):
    """One decoding step of differential attention, fused: (B, h, 1, 2d) in q's dtype; see the module doc.

    q (B, 2h, 1, d), k (B, 2h_kv, S, d), v (B, h_kv, S, 2d) striped, any strides with a contiguous last dim;
    lam a 0-d fp32 tensor on q's device; key_padding_mask None or (B, S) bool (True = read); scale default
    d ** -0.5; out_norm None or (weight (2d,) fp32 contiguous, eps); splits None (automatic) or the number
    of key splits wanted (see `split_plan`). No gradient; no host synchronisation."""
    _check_inputs(q, k, v, lam, key_padding_mask, out_norm, splits)
    B, two_h, _, d = q.shape
    h, h_kv, S = two_h // 2, k.shape[1] // 2, k.shape[2]
    out = torch.empty(B, h, 1, 2 * d, device=q.device, dtype=q.dtype)
    rows = B * h
    if rows == 0:
        return out
    n_split, keys_per_split = split_plan(S, rows, d, q.dtype, q.device, splits)
    block_n, warps = tile_for(d, q.dtype)
    ws = torch.empty(rows * n_split * (4 * d + 4), device=q.device, dtype=torch.float32)
    scale = float(d ** -0.5 if scale is None else scale)
    block_d, block_dv = max(16, _pow2(d)), max(16, _pow2(2 * d))
    if key_padding_mask is None:
        mask, sm_b, sm_s = ws, 0, 0  # never read without HAS_MASK
    else:
        mask, (sm_b, sm_s) = key_padding_mask.view(torch.uint8), key_padding_mask.stride()
    weight, eps = (ws, 0.0) if out_norm is None else (out_norm[0], float(out_norm[1]))
    with _device_guard(q):
        _decode_split_kernel[(rows, n_split)](
            q, k, v, mask, ws, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), sm_b, sm_s, h, h // h_kv, S, keys_per_split, scale * _LOG2E,
            HEAD_D=d, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
            HAS_MASK=key_padding_mask is not None, num_warps=warps)
        _decode_merge_kernel[(rows,)](
            ws, lam, out, weight, out.stride(0), out.stride(1), h, n_split, eps,
            HEAD_D=d, BLOCK_DV=block_dv, BLOCK_SPLIT=max(2, _pow2(n_split)), NORM=out_norm is not None,
            num_warps=4)
    return out


__all__ = ["MAX_SPLITS", "diff_decode_attention", "split_plan", "tile_for"]
