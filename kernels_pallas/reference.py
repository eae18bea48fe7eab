"""Decode attention over the paged KV pool: the pure-``jnp`` reference.

Re-exported by jaxkv as ``jaxkv.paged_decode_attention`` and
``jaxkv.dense_decode_attention`` (and the module ``jaxkv.attention``).

:func:`paged_decode_attention` computes one decode step (one query token per
sequence) of attention over one layer of the :class:`jaxkv.KVPool`
layout, the layout of JAX's Pallas GPU ``paged_attention``. It uses no Pallas,
runs (fast) on CPU, works under ``jax.jit`` and is the numerical reference the
kernels and the benchmarks are checked against. :func:`dense_decode_attention`
is the same computation over contiguous ``[B, S, KVH, D]`` K/V (the no-paging
baseline); the paged version gathers its pages into that contiguous form and
calls the same core, so the two cannot drift apart.

Masking rules (both functions). With ``len = lengths[b]`` the query is the
token at position ``len - 1``; it attends the positions

    ``[max(0, len - sliding_window), len)``   (``[0, len)`` without a window)

and nothing else. A sequence with no attended position (``len == 0``) gets an
all-zero output, not NaN.

Isolation guarantee: every K/V value (and scale) outside the attended
positions, i.e. the null page 0, pages no live table entry names, the table
entries past ``ceil(len / page_size)`` (which may be -1 or any other integer),
the tail of a partially used last page and the positions before a sliding
window, is replaced by 0 with ``jnp.where`` *before* any arithmetic that could
mix it into the result, and the softmax weights of those positions are
exactly 0. So NaN, inf or huge garbage there cannot reach the output: the
output is bit-identical to the one with any other contents there.

Differences from JAX's ``paged_attention`` kernel: the softmax scale is an
argument (``sm_scale``, default ``1/sqrt(Dk)``) instead of being folded into
``q`` by the caller; the soft cap is applied, as in JAX, to the *scaled*
logits (``cap * tanh(sm_scale * q.k / cap)``); block-table entries outside
``[0, num_pages)`` are allowed (clamped for the gather, then masked); no
padding of ``max_pages`` is needed; K and V may have different head dims; MLA
mode (no V pages) and sliding windows are supported; the math is float32
throughout (JAX's kernel multiplies bf16 probabilities into bf16 V).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_pallas._dispatch import FP8_DTYPES
from kernels_pallas.errors import KernelArgumentError

__all__ = ["attention_scalars", "check_stacked", "dense_decode_attention", "gather_pages", "paged_decode_attention",
           "split_layer", "traced_layer"]

_INT32_MAX = int(np.iinfo(np.int32).max)
_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------
# The shared core.
# --------------------------------------------------------------------------


def _attend(q, k, v, lengths, sm_scale, window, cap, *, use_cap: bool, heads_first: bool = False):
    """Masked decode attention over contiguous float32 K/V.

    q [B, H, Dk]; k [B, S, KVH, Dk]; v [B, S, KVH, Dv] (any contents at masked
    positions, NaN included), or with ``heads_first`` [B, KVH, S, D] (the
    layout gathered pages come in: no transpose before the dots); lengths
    int [B]; sm_scale f32 scalar; window int32 scalar (>= 1; INT32_MAX means
    no window); cap f32 scalar, used when ``use_cap``. Returns [B, H, Dv] in
    q.dtype.
    """
    if heads_first:
        b, kvh, s, dk = k.shape
    else:
        b, s, kvh, dk = k.shape
    dv = v.shape[-1]
    h = q.shape[1]
    g = h // kvh
    f32 = jnp.float32

    pos = jnp.arange(s, dtype=jnp.int32)[None, :]
    length = lengths.astype(jnp.int32)[:, None]
    # [max(0, len - W), len); len >= 0 and W <= INT32_MAX, so len - W cannot overflow.
    valid = (pos < length) & (pos >= length - window)  # [B, S]

    # Isolation: masked K/V become exact zeros before any arithmetic, so
    # NaN/inf there cannot propagate (NaN * 0 is NaN, so masking only the
    # weights would not be enough).
    kv_mask = valid[:, None, :, None] if heads_first else valid[:, :, None, None]
    k = jnp.where(kv_mask, k.astype(f32), 0.0)
    v = jnp.where(kv_mask, v.astype(f32), 0.0)
    kv = "bksd" if heads_first else "bskd"

    qf = q.astype(f32).reshape(b, kvh, g, dk) * sm_scale  # head i uses kv head i // g
    logits = jnp.einsum(f"bkgd,{kv}->bkgs", qf, k, precision=_HIGHEST)
    if use_cap:
        logits = cap * jnp.tanh(logits / cap)

    w_mask = valid[:, None, None, :]  # [B, 1, 1, S]
    m = jnp.max(jnp.where(w_mask, logits, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # nothing attended: any finite shift
    p = jnp.where(w_mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum(f"bkgs,{kv}->bkgd", p, v, precision=_HIGHEST)
    o = o / jnp.where(denom > 0, denom, 1.0)  # length 0: 0 / 1 = 0
    return o.reshape(b, h, dv).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("use_cap",))
def _dense_impl(q, k, v, lengths, sm_scale, window, cap, *, use_cap):
    return _attend(q, k, v, lengths, sm_scale, window, cap, use_cap=use_cap)


def gather_pages(pages, scales, table, *, heads_first: bool = False):
    """[KVH, P, ps, D] pages (+ [KVH, P, ps] scales, or None) and a [B, M]
    table of page ids already clamped into ``[0, P)`` -> dequantized float32
    [B, M * ps, KVH, D], the contiguous K or V the decode core reads (with
    ``heads_first``: [B, KVH, M * ps, D], one transpose fewer)."""
    kvh, _, ps, d = pages.shape
    b, mp = table.shape
    x = pages[:, table].astype(jnp.float32)  # [KVH, B, M, ps, D]
    if scales is not None:
        x = x * scales[:, table].astype(jnp.float32)[..., None]
    if heads_first:
        return jnp.moveaxis(x, 0, 1).reshape(b, kvh, mp * ps, d)
    return jnp.moveaxis(x, 0, 3).reshape(b, mp * ps, kvh, d)


@functools.partial(jax.jit, static_argnames=("use_cap", "mla_value_dim"))
def _paged_impl(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
                sm_scale, window, cap, *, use_cap, mla_value_dim):
    num_pages = k_pages.shape[1]
    # Clamp for the gather only: entries past a sequence's pages (-1, garbage)
    # read some page, whose values the core then masks.
    table = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1)
    k = gather_pages(k_pages, k_scales, table, heads_first=True)
    if v_pages is None:
        v = k[..., :mla_value_dim]  # MLA: the value is the first dims of the latent
    else:
        v = gather_pages(v_pages, v_scales, table, heads_first=True)
    return _attend(q, k, v, lengths, sm_scale, window, cap, use_cap=use_cap, heads_first=True)


# --------------------------------------------------------------------------
# Argument checks (static shapes only, so they work under tracing).
# --------------------------------------------------------------------------


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def attention_scalars(dk, sm_scale, sliding_window, logit_soft_cap):
    """The scalar options of every decode attention here, checked and as
    device values: ``(sm_scale f32, window int32, cap f32, use_cap)``; no
    window is INT32_MAX, the default scale ``1/sqrt(dk)``."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(dk)
    if sliding_window is None:
        window = _INT32_MAX
    else:
        if _is_concrete(sliding_window):
            w = int(np.asarray(sliding_window))
            if w < 1:
                raise KernelArgumentError(f"sliding_window must be >= 1, got {w}")
        window = sliding_window
    use_cap = logit_soft_cap is not None
    if use_cap and _is_concrete(logit_soft_cap):
        c = float(np.asarray(logit_soft_cap))
        if not c > 0:
            raise KernelArgumentError(f"logit_soft_cap must be > 0, got {c}")
    cap = logit_soft_cap if use_cap else 1.0
    return (jnp.asarray(sm_scale, jnp.float32), jnp.asarray(window, jnp.int32),
            jnp.asarray(cap, jnp.float32), use_cap)


def _check_q_lengths(q, lengths, b):
    if q.ndim != 3:
        raise KernelArgumentError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise KernelArgumentError(f"q must be floating point, got {q.dtype}")
    if q.shape[0] != b:
        raise KernelArgumentError(f"q has batch {q.shape[0]} but the K/V side has batch {b}")
    if tuple(lengths.shape) != (b,):
        raise KernelArgumentError(f"lengths must have shape ({b},), got {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise KernelArgumentError(f"lengths must be integer, got {lengths.dtype}")


def _check_heads(h, kvh, dq, dk):
    if kvh < 1 or h % kvh:
        raise KernelArgumentError(
            f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    if dq != dk:
        raise KernelArgumentError(f"q head dim {dq} != K head dim {dk}")


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


def paged_decode_attention(
    q: Float[Array, "B H Dk"],
    k_pages: Float[Array, "KVH P ps Dk"],
    v_pages: Float[Array, "KVH P ps Dv"] | None,
    block_tables: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    layer: int | Int[Array, ""] | None = None,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
    mla_value_dim: int | None = None,
) -> Float[Array, "B H Dv"]:
    """One decode step of attention over one layer of the paged KV pool.

    Args:
      q: ``[B, H, Dk]`` queries, any float dtype (the output has this dtype).
        Not pre-scaled: ``sm_scale`` is applied here.
      k_pages: ``[KVH, P, ps, Dk]`` one layer's K pages, any storage dtype
        (bfloat16, float16, float32, float8_e4m3fn, float8_e5m2).
      v_pages: ``[KVH, P, ps, Dv]`` one layer's V pages, or None in MLA mode:
        then the value is the dequantized K latent's first ``mla_value_dim``
        dims (``Dv = mla_value_dim``), and ``v_scales`` must be None.
      block_tables: ``[B, M]`` int; entry ``j`` of row ``b`` is the page holding
        tokens ``[j*ps, (j+1)*ps)`` of sequence ``b``. Entries at and past
        ``ceil(lengths[b] / ps)`` may be -1 or any integer: they are clamped
        into ``[0, P)`` for the gather and their values masked, never used.
      lengths: ``[B]`` int, tokens held per sequence (``0 <= len <= M*ps``).
      k_scales, v_scales: ``[KVH, P, ps]`` per-token-per-head float32 scales;
        required for fp8 pages. Dequantized value =
        ``pages.astype(float32) * scales[..., None]``.
      sm_scale: softmax scale, default ``1 / sqrt(Dk)``.
      sliding_window: ``W >= 1`` (static or traced int): the query (position
        ``len - 1``) attends only ``[max(0, len - W), len)``. None: ``[0, len)``.
      logit_soft_cap: ``cap``: logits become ``cap * tanh(l / cap)``, ``l`` the
        already scaled logit (as in JAX's kernel, where q is pre-scaled).
      mla_value_dim: MLA mode's value width; required iff ``v_pages`` is None.
      layer: None, or the layer to attend when pages and scales are the
        whole stacked pool (``KVPool``'s ``[L, KVH, P, ps, D]`` and
        ``[L, KVH, P, ps]``): the pool is passed as is and the layer picked
        inside, so a kernel can read it in place. A Python or NumPy int
        (static; outside ``[0, L)`` it raises) or an integer scalar array,
        e.g. traced (the loop index of a ``lax.scan`` over the layers): one
        outside ``[0, L)`` attends nothing, so the output is zeros (as for
        ``len == 0``), and no load leaves the pool.

    Returns:
      ``[B, H, Dv]`` in ``q.dtype``. Query head ``i`` uses KV head
      ``i // (H // KVH)`` (GQA; MQA when KVH == 1). Logits, softmax and the
      weighted sum are float32. A sequence with no attended position returns
      zeros.

    Isolation: nothing outside the attended positions (null page 0, pages not
    named by a live table entry, the tail of a partial last page, positions
    before the window, and the scales of all of these) can affect the output,
    even if it is NaN or inf: masked K/V values are replaced by 0 before use.

    Raises:
      KernelArgumentError: static shapes that cannot work (H not a multiple of KVH,
        q/K head dim mismatch, block_tables not rank 2, batch mismatches, scale
        shapes, missing fp8 scales, MLA arguments inconsistent, a stacked
        pool misshaped or a static ``layer`` out of range, a ``layer`` that
        is not an integer scalar).
    """
    if layer is not None:
        check_stacked(layer, k_pages, v_pages, k_scales, v_scales)
        if split_layer(layer)[0] is None:  # traced: clamped, and out of range it attends nothing
            layer, lengths = traced_layer(layer, k_pages.shape[0], lengths)
        k_pages, v_pages, k_scales, v_scales = (
            None if x is None else x[layer] for x in (k_pages, v_pages, k_scales, v_scales))
    if k_pages.ndim != 4:
        raise KernelArgumentError(
            f"k_pages must be [kv_heads, num_pages, page_size, head_dim], got shape {tuple(k_pages.shape)}")
    kvh, num_pages, ps, dk = k_pages.shape
    if block_tables.ndim != 2:
        raise KernelArgumentError(
            f"block_tables must be [batch, max_pages] (rank 2), got rank {block_tables.ndim} "
            f"shape {tuple(block_tables.shape)}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise KernelArgumentError(f"block_tables must be integer, got {block_tables.dtype}")
    b = block_tables.shape[0]
    _check_q_lengths(q, lengths, b)
    _check_heads(q.shape[1], kvh, q.shape[2], dk)
    if num_pages < 1 or ps < 1:
        raise KernelArgumentError(f"k_pages has {num_pages} pages of size {ps}")

    page_shape = (kvh, num_pages, ps)
    if v_pages is None:
        if mla_value_dim is None:
            raise KernelArgumentError("v_pages is None (MLA mode) but mla_value_dim is not given")
        mla_value_dim = int(mla_value_dim)
        if not 1 <= mla_value_dim <= dk:
            raise KernelArgumentError(f"mla_value_dim must be in [1, {dk}], got {mla_value_dim}")
        if v_scales is not None:
            raise KernelArgumentError("v_scales given but v_pages is None (MLA mode uses k_scales)")
    else:
        if mla_value_dim is not None:
            raise KernelArgumentError("mla_value_dim is only for MLA mode (v_pages=None)")
        if v_pages.ndim != 4 or tuple(v_pages.shape[:3]) != page_shape:
            raise KernelArgumentError(
                f"v_pages must be [{kvh}, {num_pages}, {ps}, v_dim] like k_pages, "
                f"got shape {tuple(v_pages.shape)}")
    for name, pages, scales in (("k", k_pages, k_scales), ("v", v_pages, v_scales)):
        if pages is None:
            continue
        if scales is None:
            if jnp.dtype(pages.dtype) in FP8_DTYPES:
                raise KernelArgumentError(f"{name}_pages are {pages.dtype} but {name}_scales is None")
        elif tuple(scales.shape) != page_shape:
            raise KernelArgumentError(
                f"{name}_scales must have shape {page_shape}, got {tuple(scales.shape)}")

    sm, window, cap, use_cap = attention_scalars(dk, sm_scale, sliding_window, logit_soft_cap)
    return _paged_impl(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
                       sm, window, cap, use_cap=use_cap, mla_value_dim=mla_value_dim)


def split_layer(layer) -> tuple[int | None, Int[Array, ""] | None]:
    """``(int, None)`` for a static layer (a Python or NumPy int), ``(None,
    layer)`` for any other (a traced or device integer scalar). The kernels
    pick a static layer with their block specs and index a traced one
    inside the kernel."""
    if isinstance(layer, (int, np.integer)):
        return int(layer), None
    return None, layer


def check_stacked(layer, k_pages, v_pages, k_scales, v_scales) -> None:
    """Checks of a stacked ``[L, ...]`` pool read with ``layer=`` (the
    references' and kernels' own): ranks and layer counts, a static layer in
    ``[0, L)``, any other layer an integer scalar.

    Raises:
      KernelArgumentError: as above.
    """
    if k_pages.ndim != 5:
        raise KernelArgumentError(f"with layer=, k_pages must be the stacked pool [layers, kv_heads, num_pages, "
                                  f"page_size, head_dim], got shape {tuple(k_pages.shape)}")
    num_layers = k_pages.shape[0]
    for name, x, rank in (("v_pages", v_pages, 5), ("k_scales", k_scales, 4), ("v_scales", v_scales, 4)):
        if x is not None and (x.ndim != rank or x.shape[0] != num_layers):
            raise KernelArgumentError(f"with layer=, {name} must be stacked like k_pages ({num_layers} layers, "
                                      f"rank {rank}), got shape {tuple(x.shape)}")
    static, _ = split_layer(layer)
    if static is not None:
        if not 0 <= static < num_layers:
            raise KernelArgumentError(f"layer {layer} is out of range for a pool of {num_layers} layers")
    elif not (jnp.ndim(layer) == 0 and jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise KernelArgumentError(f"layer must be an int or an integer scalar, got {layer!r}")


def traced_layer(layer, num_layers: int, lengths):
    """A traced layer's semantics, shared by the references and the kernels:
    ``(clamped layer, lengths)``, the layer clamped into ``[0, L)`` (so every
    load stays in the pool) and ``lengths`` zeroed when it was out of range
    (so nothing is attended and the output is zeros)."""
    layer = jnp.asarray(layer, jnp.int32)
    ok = (layer >= 0) & (layer < num_layers)
    lengths = jnp.asarray(lengths)
    return jnp.clip(layer, 0, num_layers - 1), jnp.where(ok, lengths, jnp.zeros_like(lengths))


def dense_decode_attention(
    q: Float[Array, "B H Dk"],
    k: Float[Array, "B S KVH Dk"],
    v: Float[Array, "B S KVH Dv"],
    lengths: Int[Array, " B"],
    *,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
) -> Float[Array, "B H Dv"]:
    """:func:`paged_decode_attention` over contiguous K/V (no paging).

    ``k``: ``[B, S, KVH, Dk]``, ``v``: ``[B, S, KVH, Dv]`` (the layout of
    JAX's ``paged_attention_reference``), any float dtype, already
    dequantized; position ``t`` of sequence ``b`` is ``k[b, t]``. Same
    masking rules, defaults, isolation guarantee and output as the paged
    version (which gathers its pages into this form and runs the same core).
    """
    if k.ndim != 4:
        raise KernelArgumentError(f"k must be [batch, seq, kv_heads, head_dim], got shape {tuple(k.shape)}")
    b, s, kvh, dk = k.shape
    if v.ndim != 4 or tuple(v.shape[:3]) != (b, s, kvh):
        raise KernelArgumentError(f"v must be [{b}, {s}, {kvh}, v_dim] like k, got shape {tuple(v.shape)}")
    _check_q_lengths(q, lengths, b)
    _check_heads(q.shape[1], kvh, q.shape[2], dk)
    sm, window, cap, use_cap = attention_scalars(dk, sm_scale, sliding_window, logit_soft_cap)
    return _dense_impl(q, k, v, lengths, sm, window, cap, use_cap=use_cap)
