"""Attention layers: DIFF (V1), DIFF V2, and the ordinary multi-head baseline.

Head-count conventions (the source of most bugs in public re-implementations):
- `MultiheadDiffAttention(num_heads=h)`: h is the number of *differential* heads, half of the
  matched baseline's. Each head has two q/k components of dim d = embed_dim / (2h) and a value
  of dim 2d. num_kv_heads is halved the same way.
- `MultiheadAttention(num_heads=H)`: H ordinary heads of dim embed_dim / H (H = 2h when matched);
  output_gate=True adds one sigmoid gate per head and token on the attention output, scalable_softmax=True
  scales each query by s_h log n (SSMax; see the class).
- `MultiheadDiffAttentionV2(num_heads=H)`: H is the baseline's own head count; 2H query heads
  are computed internally and paired.
All layers do causal self-attention with RoPE at positions 0..T-1 (or after the cached prefix), or with no
position encoding at all (position_encoding='none', NoPE: `rotary` is None and q, k are the projections).

Every layer has a `score_hook` attribute (None by default): set it to a `ScoreHook` and each
forward hands the pre-softmax logits to it (see attention/functional.py) on the eager backend.
A `query_hook` attribute likewise hands it the queries (after RoPE and SSMax) and the keys, on the
layer's own backend. These are the explicit entry points of the white-box probes (eval/probes/);
nothing is patched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from difftransformer.attention.backends import prepare_backend
from difftransformer.attention.cache import KVCache
from difftransformer.attention.decode import layer_constants
from difftransformer.attention.functional import (
    AttentionMaps,
    QueryHook,
    ScoreHook,
    attended_key_counts,
    differential_attention,
    lambda_init_fn,
    multihead_attention,
    paired_difference,
    reparameterized_lambda,
)
from difftransformer.attention.rope import RotaryEmbedding, check_position_encoding
from difftransformer.dist import full_tensor
from difftransformer.norm import RMSNorm, compute_dtype


def _last_positions(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, T, ...) cut to its last n positions (all of them for n = 0 or n >= T)."""
    if n < 0:
        raise ValueError(f"outputs_to_keep must be >= 0 (0 keeps every position), got {n}")
    return x if n == 0 or n >= x.shape[1] else x[:, -n:]


def _last_rotations(rotation: torch.Tensor, n: int) -> torch.Tensor:
    """A `RotaryEmbedding.rotation` table cut to its last n positions: complex (..., T, dim/2), or under
    torch.compile real (..., T, dim/2, 2) pairs."""
    axis = -2 if rotation.is_complex() else -3
    return rotation.narrow(axis, rotation.shape[axis] - n, n)


class _SelfAttention(nn.Module):
    """Input checks, positions and KV-cache plumbing shared by every attention kind."""

    # Whether the layer's attention is `multihead_attention` (the baseline, DIFF V2) rather than
    # `differential_attention`: the backends differ (no Triton kernel for ordinary attention).
    ordinary_attention = True

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads: int | None,
                 backend: str, max_seq_len: int | None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim <= 0 or num_heads <= 0 or num_kv_heads <= 0:
            raise ValueError(f"embed_dim, num_heads and num_kv_heads must be positive; got "
                             f"{embed_dim}, {num_heads}, {num_kv_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}) "
                             f"so that every kv head serves the same number of query heads")
        if depth < 0:
            raise ValueError(f"depth is the 0-based layer index and must be >= 0; got {depth}")
        prepare_backend(backend, device, dtype, ordinary=self.ordinary_attention)  # checks the name too
        self.embed_dim, self.depth, self.backend = embed_dim, depth, backend
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.n_rep = num_heads // num_kv_heads
        self.max_seq_len = max_seq_len
        self.score_hook: ScoreHook | None = None  # see the module doc
        self.query_hook: QueryHook | None = None

    def _make_rotary(self, dim: int, rope_theta: float, position_encoding: str) -> None:
        """`rotary`: RoPE over `dim`-wide q/k heads, or None for position_encoding 'none' (NoPE)."""
        check_position_encoding(position_encoding)
        self.rotary = RotaryEmbedding(dim, rope_theta) if position_encoding == "rope" else None

    def _make_projections(self, q_dim: int, kv_dim: int, o_dim: int, out_name: str, device, dtype) -> None:
        """q/k/v projections from embed_dim and the output projection back, all without bias."""
        E, kw = self.embed_dim, dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(E, q_dim, **kw)
        self.k_proj = nn.Linear(E, kv_dim, **kw)
        self.v_proj = nn.Linear(E, kv_dim, **kw)
        setattr(self, out_name, nn.Linear(o_dim, E, **kw))

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"{type(self).__name__} expects input of shape (batch, seq_len, {self.embed_dim}); "
                             f"got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}; "
                            f"token ids go through an embedding first")
        w = self.q_proj.weight  # the λ vectors stay at least fp32 in a half-precision layer
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"input dtype {x.dtype} does not match the layer's parameters ({w.dtype}); "
                            f"cast one of them (layer.to({x.dtype})) or run under torch.autocast")

    def _positions(self, x: torch.Tensor, position_ids, kv_cache: KVCache | None) -> tuple[torch.Tensor, int | None]:
        """The positions of x's tokens, and their start when they are the default past .. past + T - 1."""
        past = 0 if kv_cache is None else kv_cache.length(self.depth)
        T = x.shape[1]
        if self.max_seq_len is not None and past + T > self.max_seq_len:
            raise ValueError(f"sequence length {past + T} (cached {past} + new {T}) exceeds max_seq_len "
                             f"{self.max_seq_len}; shorten the input or raise max_seq_len")
        if position_ids is not None:
            if position_ids.shape[-1] != T:
                raise ValueError(f"position_ids must end in seq_len={T}; got {tuple(position_ids.shape)}")
            return position_ids.to(x.device), None
        return torch.arange(past, past + T, device=x.device), past

    def _project(self, x, position_ids, kv_cache, q_heads, kv_heads, q_dim, v_dim, outputs_to_keep: int = 0):
        """q (B, q_heads, Tq, q_dim) and k (B, kv_heads, S, q_dim) after RoPE (as projected without it), v
        (B, v_proj's width // v_dim, S, v_dim). Tq = T, or `outputs_to_keep` (> 0): queries of x's last positions
        only; the keys and values (and the KV cache's update) still come from every position."""
        B, T, _ = x.shape
        positions, start = self._positions(x, position_ids, kv_cache)  # checked with or without RoPE
        xq = _last_positions(x, outputs_to_keep)
        q = self.q_proj(xq).view(B, xq.shape[1], q_heads, q_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, kv_heads, q_dim).transpose(1, 2)
        if self.rotary is not None:
            bound = getattr(kv_cache, "position_bound", None)  # a StaticKVCache's capacity
            rotation = self.rotary.rotation(positions, compute_dtype(x), start=start, bound=bound)  # q's and k's
            q, k = self.rotary.rotate(q, _last_rotations(rotation, q.shape[2])), self.rotary.rotate(k, rotation)
        v = self.v_proj(x).view(B, T, -1, v_dim).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.depth, k, v)
        return q, k, v


class MultiheadDiffAttention(_SelfAttention):
    """Differential attention (V1), parameter-compatible with the authors' reference code.

    The λ vectors are stored in at least fp32 whatever `dtype` is (as in the authors' code), and λ
    is computed in `compute_dtype` of them: fp32 in a half-precision layer, float64 in a float64 one.

    num_heads: DIFF heads h (half the matched Transformer's); num_kv_heads: kv groups h_kv (GQA; None: h).
    head_dim: d, each component's width; None: embed_dim // h // 2 (given by a retrofitted model).
    lambda_init: a constant (ablations use 0.8 or 0.5); None uses 0.8 - 0.6 exp(-0.3 depth).
    head_norm: the head-wise RMSNorm over 2d with one shared weight (False only for ablation). Without it
    the output is still scaled by (1 - lambda_init), so the ablation removes the norm alone.
    head_norm_ramp: blend the head norm in as o + α (norm(o) - o), α a buffer the trainer raises from 0 to 1
    (`diff_retrofit`: a converted model computes its source's function at α = 0).
    position_encoding: "rope" or "none" (NoPE); max_seq_len: the longest past + new length accepted, or None.
    deterministic: False lets the fused Triton backend compute dQ with atomics in one backward pass
    (see `diff_flash_attention`); the other backends are unaffected.
    """

    ordinary_attention = False

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads: int | None = None, *,
                 rope_theta: float = 10000.0, lambda_init: float | None = None, head_norm: bool = True,
                 norm_eps: float = 1e-5, backend: str = "auto", deterministic: bool = True,
                 max_seq_len: int | None = None, head_dim: int | None = None, head_norm_ramp: bool = False,
                 position_encoding: str = "rope", device=None, dtype=None):
        super().__init__(embed_dim, depth, num_heads, num_kv_heads, backend, max_seq_len, device, dtype)
        self.deterministic = bool(deterministic)
        if head_dim is None:
            if embed_dim % (2 * num_heads):
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by 2 * num_heads ({2 * num_heads}): "
                                 f"each of the {num_heads} DIFF heads splits into two components of equal dim")
            head_dim = embed_dim // num_heads // 2
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim = {head_dim} (embed_dim // num_heads // 2 unless given) must be a positive "
                             f"even number (RoPE rotates pairs of features; odd widths are not supported without "
                             f"RoPE either); change embed_dim, num_heads or head_dim")
        if head_norm_ramp and not head_norm:
            raise ValueError("head_norm_ramp=True blends the head norm in, so it needs head_norm=True")
        d = head_dim
        self.head_dim, self.scaling = d, d ** -0.5
        inner = 2 * num_heads * d  # E unless head_dim is given (a retrofitted model: 2 * its own width)
        self._make_projections(inner, inner // self.n_rep, inner, "out_proj", device, dtype)
        self.lambda_init = lambda_init_fn(depth) if lambda_init is None else float(lambda_init)
        lambda_dtype = compute_dtype(dtype or torch.get_default_dtype())
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.empty(d, device=device, dtype=lambda_dtype)))
        self.subln = RMSNorm(2 * d, eps=norm_eps, device=device, dtype=dtype) if head_norm else None
        # α of the head-norm ramp: o + α (norm(o) - o). A persistent buffer (saved with the weights,
        # so a model is self-describing mid-ramp), set by the trainer, never by the optimizer.
        self.head_norm_ramp = bool(head_norm_ramp)
        if self.head_norm_ramp:
            self.register_buffer("head_norm_mix", torch.zeros((), device=device, dtype=lambda_dtype))
        self._make_rotary(d, rope_theta, position_encoding)
        self.reset_lambda_parameters()

    def reset_lambda_parameters(self) -> None:
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=0.1)

    def _head_norm_and_scale(self, o: torch.Tensor) -> torch.Tensor:
        """(1 - lambda_init) * RMSNorm(o); the constant is folded into the 2d-element norm weight."""
        scale = 1.0 - self.lambda_init
        if self.subln is None:
            return o * scale
        normed = self.subln(o, scale)
        if not self.head_norm_ramp:
            return normed
        # o + α (normed - o), in compute_dtype: exactly o at α = 0, exactly V1's normed output at α = 1.
        f = compute_dtype(o)
        alpha = self.head_norm_mix.to(f)
        return (o.to(f) + alpha * (normed.to(f) - o.to(f))).to(o.dtype)

    @torch.no_grad()
    def set_head_norm_mix(self, alpha: float) -> None:
        """Set α of the head-norm ramp (0: no head norm, 1: V1's); only for a layer built with head_norm_ramp."""
        if not self.head_norm_ramp:
            raise ValueError("this layer has no head-norm ramp (built with head_norm_ramp=False)")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"the head-norm mix alpha must lie in [0, 1], got {alpha}")
        self.head_norm_mix.fill_(alpha)

    def lambda_full(self) -> torch.Tensor:
        """The layer's current lambda, a differentiable 0-d tensor (fp32, or float64 in a float64 layer)."""
        return reparameterized_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2,
                                      self.lambda_init)

    def attention_constants(self, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, float] | None]:
        """λ (`lambda_full()`) and the head norm as `differential_attention(out_norm=...)` takes it: (the norm's
        weight times (1 - lambda_init) in `compute_dtype(dtype)`, eps), or None where the norm is not the plain
        V1 one (no head norm, or the head-norm ramp: `_head_norm_and_scale` then runs after attention).
        Derived afresh at each call; `attention.decode.layer_constants` holds them for a KV cache's life."""
        lam = self.lambda_full()
        if self.subln is None or self.head_norm_ramp:
            return lam, None
        folded = self.subln.weight.to(compute_dtype(dtype)) * (1.0 - self.lambda_init)  # as RMSNorm folds it
        return lam, (folded, self.subln.eps)

    @torch.no_grad()
    def current_lambda(self) -> float:
        """λ now, as a float, also when FSDP2 has sharded the λ vectors (then it gathers them: a
        collective, so every rank must call it). For logging and reports; forward uses `lambda_full`."""
        vectors = [full_tensor(p).detach() for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)]
        return float(reparameterized_lambda(*vectors, self.lambda_init))

    def forward(self, x: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                return_attention: bool = False, outputs_to_keep: int = 0):
        """x (B, T, E) -> (B, T, E); with return_attention also the fp32 maps (eager backend).

        attention_mask: (B, S) True/1 for keys to keep (S counts cached keys too).
        outputs_to_keep: n > 0 computes the outputs (and maps) of the last n positions only, (B, n, E): their
        keys and values still come from all T (and all go to kv_cache). Exact: an output row depends on its own
        query and the keys and values alone, never on another row's query, so the rows kept equal the full call's.
        """
        self._check_input(x)
        B = x.shape[0]
        d = self.head_dim
        q, k, v = self._project(x, position_ids, kv_cache, 2 * self.num_heads, 2 * self.num_kv_heads, d, 2 * d,
                                outputs_to_keep)
        T = q.shape[2]
        lam, out_norm = layer_constants(self, x, kv_cache)  # the head norm goes to the attention call (may fuse it)
        res = differential_attention(q, k, v, lam, causal=True, key_padding_mask=attention_mask,
                                     scale=self.scaling, backend=self.backend, return_maps=return_attention,
                                     deterministic=self.deterministic, score_hook=self.score_hook,
                                     query_hook=self.query_hook, out_norm=out_norm)
        o, maps = res if return_attention else (res, None)
        if out_norm is None:
            o = self._head_norm_and_scale(o)
        out = self.out_proj(o.transpose(1, 2).reshape(B, T, 2 * self.num_heads * d))
        return (out, maps) if return_attention else out

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, depth={self.depth}, diff_heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, lambda_init={self.lambda_init:.4f}, "
                f"backend={self.backend}" + ("" if self.deterministic else ", deterministic=False")
                + (", head_norm_ramp=True" if self.head_norm_ramp else "")
                + ("" if self.rotary is not None else ", position_encoding=none"))


class MultiheadAttention(_SelfAttention):
    """The matched Transformer baseline: ordinary causal GQA attention with RoPE (or none: NoPE).

    head_norm=True adds a head-wise RMSNorm (the paper's "Transformer + GroupNorm" ablation).
    output_gate=True is Gated Attention (Qiu et al. 2025, arXiv 2505.06708), head-wise at position G1:
    each query head's output is scaled by g = sigmoid(x W_g), W_g = `head_gate` (embed_dim -> num_heads,
    no bias), x the layer's input, before out_proj (after the head norm when both are on). The gate
    is computed from the same tokens as the queries, so it needs nothing from the KV cache and works
    with every backend; the attention maps and the score hook see the ungated attention.
    scalable_softmax=True is SSMax (Nakanishi 2025, arXiv 2501.19399): query t of head h is multiplied by
    s_h log n_t after RoPE, n_t the number of keys it attends (`attended_key_counts`: cached keys count,
    padded ones do not), s = `ssmax_scale` (num_heads,) learned, stored in at least fp32 like λ. So the
    logits are s_h log n_t q.k / sqrt(d) on every backend, through the ordinary attention call; the maps
    and the score hook see these scaled logits. s starts at 1 / log(ssmax_init_length) (default
    max_seq_len): the untrained layer is ordinary attention for a query that attends that many keys.
    """

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads: int | None = None, *,
                 rope_theta: float = 10000.0, head_norm: bool = False, norm_eps: float = 1e-5,
                 output_gate: bool = False, scalable_softmax: bool = False, ssmax_init_length: int | None = None,
                 position_encoding: str = "rope", backend: str = "auto", max_seq_len: int | None = None,
                 device=None, dtype=None):
        super().__init__(embed_dim, depth, num_heads, num_kv_heads, backend, max_seq_len, device, dtype)
        if embed_dim % num_heads or (embed_dim // num_heads) % 2:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) "
                             f"into an even head_dim for RoPE")
        E, d = embed_dim, embed_dim // num_heads
        self.head_dim, self.scaling = d, d ** -0.5
        self._make_projections(E, E // self.n_rep, E, "out_proj", device, dtype)
        self.subln = RMSNorm(d, eps=norm_eps, device=device, dtype=dtype) if head_norm else None
        self.head_gate = nn.Linear(E, num_heads, bias=False, device=device, dtype=dtype) if output_gate else None
        self.ssmax_scale = None
        if scalable_softmax:
            length = max_seq_len if ssmax_init_length is None else ssmax_init_length
            if length is None or length < 2:
                raise ValueError(f"scalable softmax starts s at 1 / log(ssmax_init_length), so ssmax_init_length "
                                 f"(or max_seq_len when it is None) must be an integer >= 2; got {length}")
            self.ssmax_init_length = int(length)
            self.ssmax_scale = nn.Parameter(torch.empty(num_heads, device=device,
                                                        dtype=compute_dtype(dtype or torch.get_default_dtype())))
            self.reset_ssmax_parameters()
        self._make_rotary(d, rope_theta, position_encoding)

    @torch.no_grad()
    def reset_ssmax_parameters(self) -> None:
        """Every head's s = 1 / log(ssmax_init_length): s log n = 1 for a query attending that many keys."""
        if self.ssmax_scale is not None:
            self.ssmax_scale.fill_(1.0 / math.log(self.ssmax_init_length))

    def _scale_queries(self, q: torch.Tensor, S: int, attention_mask) -> torch.Tensor:
        """SSMax: q (B, H, T, d) times s_h log n_t, computed in `compute_dtype(q)`, returned in q's dtype. A
        query that sees no key (n = 0) gets the factor 0: its output is zero whatever its logits."""
        f = compute_dtype(q)
        n = attended_key_counts(q.shape[2], S, causal=True, key_padding_mask=attention_mask, device=q.device)
        log_n = n.clamp_min(1).to(f).log()  # (T,) or (B, T)
        factor = self.ssmax_scale.to(f)[:, None] * log_n[..., None, :]  # (H, T) or (B, H, T)
        return (q.to(f) * factor[..., None]).to(q.dtype)

    def _gate(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, H, T, d) times sigmoid(x W_g) per head and token, in compute_dtype (as V2's λ)."""
        f = compute_dtype(o)
        g = torch.sigmoid(self.head_gate(x).to(f)).transpose(1, 2)[..., None]  # (B, H, T, 1)
        return (o.to(f) * g).to(o.dtype)

    def forward(self, x: torch.Tensor, *, attention_mask=None, position_ids=None, kv_cache=None,
                return_attention: bool = False, outputs_to_keep: int = 0):
        """x (B, T, E) -> (B, T, E), or the last `outputs_to_keep` positions' (as `MultiheadDiffAttention`)."""
        self._check_input(x)
        B, _, E = x.shape
        d = self.head_dim
        q, k, v = self._project(x, position_ids, kv_cache, self.num_heads, self.num_kv_heads, d, d, outputs_to_keep)
        x, T = _last_positions(x, outputs_to_keep), q.shape[2]  # the gate reads the kept positions' inputs
        if self.ssmax_scale is not None:
            q = self._scale_queries(q, k.shape[2], attention_mask)
        res = multihead_attention(q, k, v, causal=True, key_padding_mask=attention_mask, scale=self.scaling,
                                  backend=self.backend, return_maps=return_attention, score_hook=self.score_hook,
                                  query_hook=self.query_hook)
        o, probs = res if return_attention else (res, None)
        if self.subln is not None:
            o = self.subln(o)
        if self.head_gate is not None:
            o = self._gate(o, x)
        out = self.out_proj(o.transpose(1, 2).reshape(B, T, E))
        return (out, AttentionMaps(probs, probs, None)) if return_attention else out


class MultiheadDiffAttentionV2(_SelfAttention):
    """DIFF V2: 2H query heads in one ordinary attention call, adjacent heads paired.

    out_i = attn_{2i} - sigmoid(lambda_proj(x))_i * attn_{2i+1}, a lambda per token and head
    (`paired_difference`). Both heads of a pair sit in the same GQA group (the call's 2H / H_kv query heads
    per kv head is even), so K/V (and the KV cache) match the baseline.
    """

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads: int | None = None, *,
                 head_dim: int | None = None, rope_theta: float = 10000.0, position_encoding: str = "rope",
                 backend: str = "auto", max_seq_len: int | None = None, device=None, dtype=None):
        super().__init__(embed_dim, depth, num_heads, num_kv_heads, backend, max_seq_len, device, dtype)
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
            head_dim = embed_dim // num_heads
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number (RoPE rotates pairs of features; odd widths "
                             f"are not supported without RoPE either), got {head_dim}")
        E, H, d = embed_dim, num_heads, head_dim
        self.n_rep = 2 * H // self.num_kv_heads  # query heads per kv head in the one attention call
        self.head_dim, self.scaling = d, d ** -0.5
        self._make_projections(2 * H * d, self.num_kv_heads * d, H * d, "o_proj", device, dtype)
        self.lambda_proj = nn.Linear(E, H, bias=False, device=device, dtype=dtype)
        self._make_rotary(d, rope_theta, position_encoding)

    def forward(self, x: torch.Tensor, *, attention_mask=None, position_ids=None, kv_cache=None,
                return_attention: bool = False, outputs_to_keep: int = 0):
        """x (B, T, E) -> (B, T, E), or the last `outputs_to_keep` positions' (as `MultiheadDiffAttention`)."""
        self._check_input(x)
        B = x.shape[0]
        H, d = self.num_heads, self.head_dim
        q, k, v = self._project(x, position_ids, kv_cache, 2 * H, self.num_kv_heads, d, d, outputs_to_keep)
        x, T = _last_positions(x, outputs_to_keep), q.shape[2]  # λ is read from the kept positions' inputs
        res = multihead_attention(q, k, v, causal=True, key_padding_mask=attention_mask, scale=self.scaling,
                                  backend=self.backend, return_maps=return_attention, score_hook=self.score_hook,
                                  query_hook=self.query_hook)
        attn, probs = res if return_attention else (res, None)
        lam = torch.sigmoid(self.lambda_proj(x).to(compute_dtype(attn))).transpose(1, 2)[..., None]  # (B, H, T, 1)
        o, maps = paired_difference(attn, lam, probs)
        out = self.o_proj(o.transpose(1, 2).reshape(B, T, H * d))
        return (out, maps) if return_attention else out
