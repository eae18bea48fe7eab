"""Attention over the paged KV pool: prefill reference and the NNX layer.

:func:`paged_prefill_attention` is the prefill counterpart of
:func:`jaxkv.paged_decode_attention`: several new tokens per sequence, each
attending causally to everything its sequence holds up to itself, read from
the pages through the block table (so a prefix written by an earlier call,
e.g. a prefix-cache hit, is attended like the tokens of this call).

:class:`PagedAttention` is the Flax NNX attention layer of the Llama family:
it projects q/k/v, applies the optional q/k RMSNorm and RoPE, writes this
step's K/V into the pool at the given slots, then attends.

Kernel selection follows the one rule of :mod:`kernels_pallas`: the layer's
``implementation`` (``None``: the Pallas kernel on GPU, the ``jnp``
reference elsewhere; ``"pallas"``; ``"reference"``) and ``interpret`` are
passed to :func:`kernels_pallas.paged_attention` for decode steps. Prefill
always runs :func:`paged_prefill_attention` (there is no prefill kernel).
The model (:class:`~jaxkv.nn.LlamaForCausalLM`) takes the same two
arguments and hands them to every layer; a layer's ``decode_attention_fn``
/ ``prefill_attention_fn`` constructor arguments replace the function
outright (custom kernels and tests).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels_pallas import paged_attention
from kernels_pallas.ragged_attention import ragged_paged_attention
from kernels_pallas.reference import gather_pages
from jaxkv._ops import INT32_MAX, is_fp8, on_local_heads, place_kv
from jaxkv.errors import InvalidArgument
from jaxkv.nn.config import LlamaConfig, RopeScaling
from jaxkv.nn.rope import apply_rope, rope_inv_freq
from jaxkv.pool.kv_pool import KVPool, dequantize, quantize_fp8

__all__ = [
    "IMPLEMENTATIONS",
    "PagedAttention",
    "RMSNorm",
    "causal_attention",
    "check_implementation",
    "check_mode",
    "paged_prefill_attention",
]

#: The ``implementation`` choices besides None (those of kernels_pallas).
IMPLEMENTATIONS = ("pallas", "reference")
_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------
# The shared causal core (paged prefill and the dense no-cache forward).
# --------------------------------------------------------------------------


def causal_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KVH D"],
    v: Float[Array, "B S KVH Dv"],
    q_positions: Int[Array, "B T"],
    q_valid: Array,
    kv_lengths: Int[Array, " B"],
    *,
    sm_scale: float | Array,
    sliding_window: int | Array | None = None,
) -> Float[Array, "B T H Dv"]:
    """Causal GQA attention over contiguous K/V where key ``s`` of row ``b``
    sits at position ``s``.

    Query ``t`` of row ``b`` (position ``q_positions[b, t]``) attends the keys
    at positions ``p`` with ``p <= q_pos``, ``p > q_pos - sliding_window``
    and ``p < kv_lengths[b]``; a query with ``q_valid`` False, or with no such
    key, gets zeros. K/V at positions ``>= kv_lengths[b]`` are replaced by 0
    before any arithmetic, so garbage (NaN included) there never reaches the
    output. Float32 math; returns ``q.dtype``.
    """
    b, s, kvh, dk = k.shape
    t, h = q.shape[1], q.shape[2]
    g = h // kvh
    f32 = jnp.float32
    window = INT32_MAX if sliding_window is None else sliding_window
    key_pos = jnp.arange(s, dtype=jnp.int32)
    kv_ok = key_pos[None, :] < kv_lengths.astype(jnp.int32)[:, None]  # [B, S]
    k = jnp.where(kv_ok[:, :, None, None], k.astype(f32), 0.0)
    v = jnp.where(kv_ok[:, :, None, None], v.astype(f32), 0.0)

    qp = q_positions.astype(jnp.int32)[:, :, None]  # [B, T, 1]
    allowed = (
        (key_pos[None, None, :] <= qp)
        & (key_pos[None, None, :] > qp - window)  # qp >= 0, window <= INT32_MAX: no overflow
        & kv_ok[:, None, :]
        & jnp.asarray(q_valid, bool)[:, :, None]
    )  # [B, T, S]
    qf = q.astype(f32).reshape(b, t, kvh, g, dk) * sm_scale  # head i uses KV head i // g
    logits = jnp.einsum("btkgd,bskd->bkgts", qf, k, precision=_HIGHEST)
    mask = allowed[:, None, None, :, :]
    m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=_HIGHEST)
    o = o / jnp.moveaxis(jnp.where(denom > 0, denom, 1.0), 3, 1)  # [B, T, KVH, G, 1]
    return o.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("use_window",))
def _prefill_impl(q, k_pages, v_pages, block_tables, starts, num_new, k_scales, v_scales,
                  sm_scale, window, *, use_window):
    num_pages = k_pages.shape[1]
    table = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1)  # masked past the sequence
    k = gather_pages(k_pages, k_scales, table)  # [B, M*ps, KVH, D] float32
    v = gather_pages(v_pages, v_scales, table)
    t = q.shape[1]
    starts = starts.astype(jnp.int32)
    num_new = num_new.astype(jnp.int32)
    offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_positions = starts[:, None] + offsets
    q_valid = offsets < num_new[:, None]
    return causal_attention(q, k, v, q_positions, q_valid, starts + num_new, sm_scale=sm_scale,
                            sliding_window=window if use_window else None)


def paged_prefill_attention(
    q: Float[Array, "B T H D"],
    k_pages: Float[Array, "KVH P ps D"],
    v_pages: Float[Array, "KVH P ps Dv"],
    block_tables: Int[Array, "B M"],
    starts: Int[Array, " B"],
    num_new: Int[Array, " B"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    sm_scale: float | None = None,
    sliding_window: int | Array | None = None,
) -> Float[Array, "B T H Dv"]:
    """Prefill attention over one layer of the paged pool (pure ``jnp``).

    Token ``t`` of row ``b`` is at position ``starts[b] + t`` and is real
    when ``t < num_new[b]``. It attends positions
    ``[max(0, pos - sliding_window + 1), pos]`` of its sequence, read through
    ``block_tables[b]`` (entry ``j`` holds positions ``[j*ps, (j+1)*ps)``), so
    the K/V of all those positions, including this call's own tokens, must
    already be in the pages (:class:`PagedAttention` writes them first).
    Positions below ``starts[b]`` were written by earlier calls (a prefix
    cache hit, or the earlier chunks of a chunked prefill).

    Args:
      q: ``[B, T, H, D]`` queries (not pre-scaled), any float dtype.
      k_pages, v_pages: ``[KVH, P, ps, D]`` one layer's pages (any pool dtype).
      block_tables: ``[B, M]`` int, ``M`` static; entries past
        ``ceil((starts + num_new) / ps)`` may be -1 or anything (clamped for
        the gather, then masked).
      starts, num_new: ``[B]`` int; ``starts + num_new <= M * ps``.
      k_scales, v_scales: ``[KVH, P, ps]`` float32 scales (fp8 pools).
      sm_scale: default ``1 / sqrt(D)``.
      sliding_window: ``W >= 1`` or None (full causal).

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype``; padding queries (``t >= num_new[b]``)
      are exact zeros. Float32 math. Like the decode reference, values outside
      the attended positions (null page, stale pages, the tail of the last
      page) cannot affect the output, NaN included.
    """
    if q.ndim != 4:
        raise InvalidArgument(f"q must be [batch, tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if k_pages.ndim != 4 or v_pages is None or v_pages.ndim != 4 or tuple(v_pages.shape[:3]) != tuple(k_pages.shape[:3]):
        raise InvalidArgument(
            f"k_pages/v_pages must be [kv_heads, num_pages, page_size, dim] with the same first three sizes, "
            f"got {tuple(k_pages.shape)} and {None if v_pages is None else tuple(v_pages.shape)}")
    kvh, num_pages, ps, dk = k_pages.shape
    b, _, h, dq = q.shape
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise InvalidArgument(f"block_tables must be [{b}, max_pages], got shape {tuple(block_tables.shape)}")
    for name, x in (("starts", starts), ("num_new", num_new)):
        if tuple(jnp.shape(x)) != (b,):
            raise InvalidArgument(f"{name} must have shape ({b},), got {tuple(jnp.shape(x))}")
    if kvh < 1 or h % kvh:
        raise InvalidArgument(f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    if dq != dk:
        raise InvalidArgument(f"q head dim {dq} != K head dim {dk}")
    for name, pages, scales in (("k", k_pages, k_scales), ("v", v_pages, v_scales)):
        if scales is None:
            if is_fp8(pages.dtype):
                raise InvalidArgument(f"{name}_pages are {pages.dtype} but {name}_scales is None")
        elif tuple(scales.shape) != (kvh, num_pages, ps):
            raise InvalidArgument(f"{name}_scales must have shape {(kvh, num_pages, ps)}, got {tuple(scales.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(dk)
    use_window = sliding_window is not None
    if use_window and not isinstance(sliding_window, jax.core.Tracer) and int(np.asarray(sliding_window)) < 1:
        raise InvalidArgument(f"sliding_window must be >= 1, got {sliding_window}")
    window = jnp.asarray(sliding_window if use_window else INT32_MAX, jnp.int32)
    return _prefill_impl(q, k_pages, v_pages, block_tables, jnp.asarray(starts), jnp.asarray(num_new),
                         k_scales, v_scales, jnp.asarray(sm_scale, jnp.float32), window, use_window=use_window)


def check_mode(mode: str, b: int, t: int, batch) -> None:
    """``InvalidArgument`` unless ``mode`` is ``"prefill"``, ``"decode"``
    (``T == 1``) or ``"ragged"`` (``B == 1`` with a packed ``batch`` whose
    tables are filled in)."""
    if mode not in ("prefill", "decode", "ragged"):
        raise InvalidArgument(f"mode must be 'prefill', 'decode' or 'ragged', got {mode!r}")
    if mode == "decode" and t != 1:
        raise InvalidArgument(f"decode mode takes one token per sequence, got T={t}")
    if mode == "ragged" and (b != 1 or batch is None or batch.block_tables is None):
        raise InvalidArgument(f"ragged mode takes one flat stream (B == 1, got {b}) and a PackedBatch with "
                              "block_tables")


def check_implementation(implementation: str | None, interpret: bool = False) -> None:
    """``InvalidArgument`` unless ``implementation`` is None, ``"pallas"`` or
    ``"reference"`` and ``interpret`` is not combined with ``"reference"``
    (checked when the model is built, not at the first trace)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise InvalidArgument(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if interpret and implementation == "reference":
        raise InvalidArgument("interpret=True runs the Pallas kernel; it cannot be combined with "
                              "implementation='reference'")


# --------------------------------------------------------------------------
# NNX modules.
# --------------------------------------------------------------------------


def _pages(pool) -> tuple:
    """``(k_pages, v_pages, k_scales, v_scales)`` of a stacked pool (``None``
    where absent: an MLA pool's values and a bf16 pool's scales), the KV
    heads on axis 1: what :func:`jaxkv._ops.on_local_heads` takes."""
    return (pool.k_pages, pool.v_pages, pool.k_scales, pool.v_scales)


class RMSNorm(nnx.Module):
    """HF's LlamaRMSNorm: normalize in float32, cast back to the compute
    dtype, then multiply by ``weight`` (init ones)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = float(eps)
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(self.dtype) * xf.astype(self.dtype)).astype(self.dtype)


class PagedAttention(nnx.Module):
    """Llama-family self-attention over the paged KV pool.

    Parameters (transformers' names): ``q_proj [hidden, H*D]``, ``k_proj``
    and ``v_proj [hidden, KVH*D]``, ``o_proj [H*D, hidden]`` (``nnx.Linear``
    kernels are ``[in, out]``, the transpose of HF's weights), biases when
    asked, and ``q_norm``/``k_norm`` (RMSNorm over ``D``) with ``qk_norm``.

    Call it with :meth:`__call__`; one layer of a model uses one layer of the
    pool (``layer``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        precision=None,
        implementation: str | None = None,
        interpret: bool = False,
        decode_attention_fn: Callable | None = None,
        prefill_attention_fn: Callable | None = None,
        rngs: nnx.Rngs,
    ):
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise InvalidArgument(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise InvalidArgument(f"sliding_window must be >= 1 or None, got {sliding_window}")
        check_implementation(implementation, interpret)
        linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.q_proj = linear(hidden_size, num_heads * head_dim, use_bias=qkv_bias)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, use_bias=qkv_bias)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, use_bias=qkv_bias)
        self.o_proj = linear(num_heads * head_dim, hidden_size, use_bias=out_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.qk_norm = bool(qk_norm)
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.rope_theta = float(rope_theta)
        self.rope_scaling = rope_scaling
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.sm_scale = 1.0 / math.sqrt(head_dim)
        self.dtype = dtype
        self.implementation = implementation
        self.interpret = bool(interpret)
        self.decode_attention_fn = decode_attention_fn
        self.prefill_attention_fn = prefill_attention_fn
        #: Set on a mesh (:func:`jaxkv.nn.sharding.place_heads`): the kernels run on each device's heads.
        self.heads_placement = None

    @classmethod
    def from_config(cls, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype=jnp.float32,
                    param_dtype=jnp.float32, precision=None, implementation: str | None = None,
                    interpret: bool = False) -> PagedAttention:
        """The attention of decoder layer ``layer`` of ``config``."""
        return cls(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            rope_theta=config.rope_theta, rope_scaling=config.rope_scaling, qkv_bias=config.attention_bias,
            out_bias=config.attention_out_bias, qk_norm=config.qk_norm, norm_eps=config.rms_norm_eps,
            sliding_window=config.layer_sliding_window(layer), dtype=dtype, param_dtype=param_dtype,
            precision=precision, implementation=implementation, interpret=interpret, rngs=rngs)

    # ------------------------------------------------------------- pieces

    def qkv(self, x: Float[Array, "B T E"], positions: Int[Array, "B T"]) -> tuple[Array, Array, Array]:
        """``q [B,T,H,D]``, ``k``, ``v [B,T,KVH,D]`` after bias, q/k norm and
        RoPE (in the compute dtype)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, attn: Float[Array, "B T H D"]) -> Float[Array, "B T E"]:
        b, t = attn.shape[:2]
        return self.o_proj(attn.reshape(b, t, self.num_heads * self.head_dim).astype(self.dtype))

    # -------------------------------------------------------------- calls

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        pool: KVPool,
        layer: int,
        slots: Int[Array, "B T"],
        block_tables: Int[Array, "B M"],
        starts: Int[Array, " B"],
        num_new: Int[Array, " B"],
        *,
        mode: str = "prefill",
        batch=None,
    ) -> tuple[Float[Array, "B T E"], KVPool]:
        """Write this step's K/V into ``pool`` and attend through the tables.

        Args:
          x: ``[B, T, hidden]`` this step's hidden states.
          positions: ``[B, T]`` positions for RoPE (normally
            ``starts[:, None] + arange(T)``).
          pool: the :class:`~jaxkv.KVPool` (all layers).
          layer: the pool layer this module owns (static int).
          slots: ``[B, T]`` pool token index of each new token
            (``page * page_size + offset``, e.g. from
            ``BlockSpaceManager.token_slots`` or ``append_slots``); -1 for
            padding. Padding tokens (``t >= num_new[b]``) are written to the
            null page whatever their slot says.
          block_tables: ``[B, M]`` pages of each sequence.
          starts: ``[B]`` tokens the sequence held before this step (the
            position of token 0 of this step).
          num_new: ``[B]`` real tokens of this step per row (``<= T``; 0 for
            an idle row).
          mode: ``"prefill"`` (any ``T``; :func:`paged_prefill_attention`),
            ``"decode"`` (``T == 1``; :func:`kernels_pallas.paged_attention`
            with the layer's ``implementation``, ``lengths = starts + 1``, 0
            for rows with ``num_new == 0``) or ``"ragged"``: a packed step
            (``B == 1``, the flat stream of ``batch``, a
            :class:`~jaxkv.nn.packed.PackedBatch` whose ``block_tables``
            and ``kv_lens`` the attention reads through
            :func:`kernels_pallas.ragged_attention.ragged_paged_attention`;
            ``block_tables``, ``starts`` and ``num_new`` are unused, padding
            tokens are those with a negative position).

        Returns:
          ``(out [B, T, hidden], pool)``; outputs of padding tokens are those
          of a zero attention output (finite, never NaN).
        """
        b, t, _ = x.shape
        check_mode(mode, b, t, batch)
        if tuple(slots.shape) != (b, t) or tuple(positions.shape) != (b, t):
            raise InvalidArgument(
                f"slots and positions must be [{b}, {t}], got {tuple(slots.shape)} and {tuple(positions.shape)}")
        if mode == "ragged":
            real = positions >= 0
            positions = jnp.maximum(positions, 0)
        else:
            starts = jnp.asarray(starts, jnp.int32)
            num_new = jnp.asarray(num_new, jnp.int32)
            real = jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None]
        q, k, v = self.qkv(x, positions)
        slots = jnp.where(real, jnp.asarray(slots, jnp.int32), -1)  # padding never overwrites a page
        k, v = place_kv(self.heads_placement, k.reshape(b * t, self.num_kv_heads, self.head_dim),
                        v.reshape(b * t, self.num_kv_heads, self.head_dim))
        pool = pool.set_kv(layer, slots.reshape(-1), k, v)
        if mode == "decode":
            fn = self.decode_attention_fn or functools.partial(
                paged_attention, implementation=self.implementation, interpret=self.interpret)
            lengths = jnp.where(num_new > 0, starts + 1, 0)

            def decode(q, k_pages, v_pages, k_scales, v_scales, _sinks, tables, lengths, layer):
                return fn(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, layer=layer,
                          sm_scale=self.sm_scale, sliding_window=self.sliding_window)

            attn = on_local_heads(self.heads_placement, decode, q[:, 0], _pages(pool),
                                  (block_tables, lengths, layer))[:, None]
        elif mode == "ragged":
            def ragged(q, k_pages, v_pages, k_scales, v_scales, _sinks, tables, kv_lens, cu_q_lens, layer):
                return ragged_paged_attention(
                    q, k_pages, v_pages, tables, kv_lens, cu_q_lens, k_scales, v_scales, layer=layer,
                    sm_scale=self.sm_scale, sliding_window=self.sliding_window, implementation=self.implementation,
                    interpret=self.interpret)

            attn = on_local_heads(self.heads_placement, ragged, q[0], _pages(pool),
                                  (batch.block_tables, batch.kv_lens, batch.cu_q_lens, layer))[None]
        else:
            k_pages, v_pages, k_scales, v_scales = pool.layer_arrays(layer)
            fn = self.prefill_attention_fn or paged_prefill_attention
            attn = fn(q, k_pages, v_pages, block_tables, starts, num_new, k_scales, v_scales,
                      sm_scale=self.sm_scale, sliding_window=self.sliding_window)
        return self.out(attn), pool

    def forward_dense(
        self, x: Float[Array, "B T E"], positions: Int[Array, "B T"], *, kv_dtype=None
    ) -> Float[Array, "B T E"]:
        """No-cache causal self-attention over ``x`` (position ``t`` of row
        ``b`` at ``positions[b, t]``, increasing along ``t``). ``kv_dtype``:
        round K/V through that pool storage dtype first (fp8 by the pool's
        per-token-per-head quantization), to reproduce a paged run on a pool
        of that dtype."""
        q, k, v = self.qkv(x, positions)
        if kv_dtype is not None:
            k, v = _round_like_pool(k, kv_dtype), _round_like_pool(v, kv_dtype)
        # Keys are indexed by t; causality by position (equal to t in the
        # common case positions = arange(T)).
        attn = _dense_causal(q, k, v, positions, self.sm_scale, self.sliding_window)
        return self.out(attn)


def _dense_causal(q, k, v, positions, sm_scale, window):
    b, t = positions.shape
    f32 = jnp.float32
    kvh = k.shape[2]
    g = q.shape[2] // kvh
    qp = positions.astype(jnp.int32)
    allowed = qp[:, None, :] <= qp[:, :, None]  # [B, Tq, Tk]
    if window is not None:
        allowed &= qp[:, None, :] > qp[:, :, None] - window
    qf = q.astype(f32).reshape(b, t, kvh, g, -1) * sm_scale
    logits = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(f32), precision=_HIGHEST)
    logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(f32), precision=_HIGHEST)
    return o.reshape(b, t, q.shape[2], v.shape[-1]).astype(q.dtype)


def _round_like_pool(x, kv_dtype):
    if is_fp8(kv_dtype):
        stored, scale = quantize_fp8(x, kv_dtype)
        return dequantize(stored, scale, x.dtype)
    return x.astype(kv_dtype).astype(x.dtype)
