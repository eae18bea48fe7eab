"""Ragged paged attention: packed queries of many sequences over the paged pool.

One scheduler iteration of a packed engine (vLLM v1, SGLang, tpu-inference's
ragged paged attention) is a flat stream of ``T`` query tokens: the decode
token of each running sequence and the prefill pieces of others, end to end
with no padding between them. Sequence ``s`` owns the query tokens
``[cu_q_lens[s], cu_q_lens[s + 1])`` (``q_len = cu_q_lens[s + 1] -
cu_q_lens[s]``, possibly 0) and holds ``kv_lens[s]`` tokens in the pool
*including* those queries, whose K/V the caller wrote before the call. So
query ``i`` of sequence ``s`` sits at position ``kv_lens[s] - q_len + i`` and
attends, causally, every position ``p`` of its sequence with

    ``max(0, pos - sliding_window + 1) <= p <= pos``

read through ``block_tables[s]``: the tokens cached by earlier steps (a
prefix-cache hit, earlier prefill pieces, the decoded tokens) and its own
earlier queries of this step. Tokens ``>= cu_q_lens[S]`` (padding of the
flat stream) get zeros.

Options (those of :func:`kernels_pallas.paged_attention`, plus sinks): GQA
(query head ``h`` uses KV head ``h // (H // KVH)``), bf16/fp16/fp32/fp8 pages
with per-token-per-head scales, a sliding window, a logit soft cap
(``cap * tanh(l / cap)`` of the scaled logit), attention sinks (a learned
logit per query head that joins the softmax's denominator and adds nothing to
the numerator, gpt-oss style), and MLA mode (``v_pages`` None: the value is
the first ``mla_value_dim`` dims of the dequantized K row).

The reference (:func:`ragged_paged_attention_reference`) is pure ``jnp`` and
runs fast on CPU: it cuts each sequence's queries into blocks of
``block_q`` tokens (at most ``ceil(T / block_q) + S`` blocks, a static
bound), gathers each block's pages once and attends the block's queries
together, so its work is ``blocks x block_q x context`` rather than the
``T x context`` of a per-token gather or the ``T x S x context`` of
attending every sequence. Isolation as in the decode reference: K/V outside
the union of a block's attended ranges are replaced by 0 before any
arithmetic, and masked weights are set to exactly 0, so NaN or garbage in
the null page, unreferenced pages, the tail of a last page or before a
window cannot reach the output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_pallas import _dispatch
from kernels_pallas._dispatch import FP8_DTYPES
from kernels_pallas.errors import KernelArgumentError
from kernels_pallas.reference import _pick_layer, attention_scalars, gather_pages

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "ragged_query_blocks"]

_HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT_BLOCK_Q = 8


def ragged_query_blocks(cu_q_lens: Int[Array, " S1"], kv_lens: Int[Array, " S"], num_tokens: int, block_q: int):
    """The query blocks of a packed batch (static count ``ceil(T / block_q) + S``).

    Returns ``(seq [NB], first [NB], rows_ok [NB, block_q], tokens [NB,
    block_q], positions [NB, block_q])``: block ``j`` holds queries
    ``first[j] .. first[j] + block_q - 1`` (offsets within sequence
    ``seq[j]``; ``seq`` is ``S`` for an unused block), ``rows_ok`` marks the
    real ones, ``tokens`` their flat indices (clamped into ``[0, T)``) and
    ``positions`` their positions in the sequence."""
    num_seqs = kv_lens.shape[0]
    num_blocks = -(-num_tokens // block_q) + num_seqs
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    block_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-q_lens // block_q))])
    j = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.sum(block_cu[1:][None, :] <= j[:, None], axis=1).astype(jnp.int32)  # lane owning block j
    s = jnp.minimum(seq, num_seqs - 1)
    first = (j - block_cu[s]) * block_q
    rows = first[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    rows_ok = (seq < num_seqs)[:, None] & (rows < q_lens[s][:, None])
    tokens = jnp.clip(cu[s][:, None] + rows, 0, num_tokens - 1)
    positions = kv_lens.astype(jnp.int32)[s][:, None] - q_lens[s][:, None] + rows
    return seq, first, rows_ok, tokens, positions


@functools.partial(jax.jit, static_argnames=("use_cap", "use_sinks", "mla_value_dim", "block_q"))
def _reference_impl(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks,
                    sm_scale, window, cap, *, use_cap, use_sinks, mla_value_dim, block_q):
    f32 = jnp.float32
    num_tokens, h, dk = q.shape
    kvh, num_pages, ps, _ = k_pages.shape
    g = h // kvh
    num_seqs = kv_lens.shape[0]
    seq, _, rows_ok, tokens, qpos = ragged_query_blocks(cu_q_lens, kv_lens, num_tokens, block_q)
    s = jnp.minimum(seq, num_seqs - 1)
    kv_len = kv_lens.astype(jnp.int32)[s]  # [NB]

    table = jnp.clip(block_tables.astype(jnp.int32)[s], 0, num_pages - 1)  # [NB, M]
    k = gather_pages(k_pages, k_scales, table, heads_first=True)  # [NB, KVH, L, Dk] float32
    v = k[..., :mla_value_dim] if v_pages is None else gather_pages(v_pages, v_scales, table, heads_first=True)
    span = k.shape[2]
    key_pos = jnp.arange(span, dtype=jnp.int32)

    # The union of the block's attended ranges: everything else is zeroed
    # before any arithmetic (isolation), the rest masked per query below.
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.min(jnp.where(rows_ok, qpos, big), axis=1) - window + 1  # window <= INT32_MAX: qpos >= 0 keeps it >= INT32_MIN
    hi = jnp.max(jnp.where(rows_ok, qpos, -1), axis=1)
    kv_ok = (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] <= hi[:, None]) & (key_pos[None, :] < kv_len[:, None])
    k = jnp.where(kv_ok[:, None, :, None], k, 0.0)
    v = jnp.where(kv_ok[:, None, :, None], v, 0.0)

    allowed = ((key_pos[None, None, :] <= qpos[:, :, None]) & (key_pos[None, None, :] > qpos[:, :, None] - window)
               & kv_ok[:, None, :] & rows_ok[:, :, None])  # [NB, BQ, L]
    qb = q[tokens].astype(f32).reshape(-1, block_q, kvh, g, dk) * sm_scale
    logits = jnp.einsum("nqkgd,nksd->nkgqs", qb, k, precision=_HIGHEST)
    if use_cap:
        logits = cap * jnp.tanh(logits / cap)
    mask = allowed[:, None, None, :, :]
    m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    if use_sinks:
        sink = sinks.astype(f32).reshape(1, kvh, g, 1, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if use_sinks:
        denom = denom + jnp.exp(sink - m)
    o = jnp.einsum("nkgqs,nksd->nqkgd", p, v, precision=_HIGHEST)
    o = o / jnp.moveaxis(jnp.where(denom > 0, denom, 1.0), 3, 1)  # [NB, BQ, KVH, G, 1]
    o = o.reshape(-1, block_q, h, v.shape[-1]).astype(q.dtype)
    out = jnp.zeros((num_tokens, h, v.shape[-1]), q.dtype)
    dest = jnp.where(rows_ok, tokens, num_tokens)  # padding rows: out of range, dropped
    return out.at[dest.reshape(-1)].set(o.reshape(-1, h, v.shape[-1]), mode="drop")


def _check(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks, mla_value_dim):
    """Static shape checks shared by the reference and the kernel."""
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise KernelArgumentError(f"q must be float [tokens, heads, head_dim], got {q.dtype} {tuple(q.shape)}")
    if k_pages.ndim != 4:
        raise KernelArgumentError(
            f"k_pages must be [kv_heads, num_pages, page_size, head_dim], got shape {tuple(k_pages.shape)}")
    kvh, num_pages, ps, dk = k_pages.shape
    t, h, dq = q.shape
    if kvh < 1 or h % kvh:
        raise KernelArgumentError(f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    if dq != dk:
        raise KernelArgumentError(f"q head dim {dq} != K head dim {dk}")
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise KernelArgumentError(f"block_tables must be integer [seqs, max_pages], got "
                                  f"{block_tables.dtype} {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if num_seqs < 1:
        raise KernelArgumentError("block_tables has no sequence rows")
    if tuple(kv_lens.shape) != (num_seqs,) or not jnp.issubdtype(kv_lens.dtype, jnp.integer):
        raise KernelArgumentError(f"kv_lens must be integer ({num_seqs},), got {kv_lens.dtype} {tuple(kv_lens.shape)}")
    if tuple(cu_q_lens.shape) != (num_seqs + 1,) or not jnp.issubdtype(cu_q_lens.dtype, jnp.integer):
        raise KernelArgumentError(f"cu_q_lens must be integer ({num_seqs + 1},), got {cu_q_lens.dtype} "
                                  f"{tuple(cu_q_lens.shape)}")
    page_shape = (kvh, num_pages, ps)
    if v_pages is None:
        if mla_value_dim is None or not 1 <= int(mla_value_dim) <= dk:
            raise KernelArgumentError(f"v_pages is None (MLA mode): mla_value_dim must be in [1, {dk}], "
                                      f"got {mla_value_dim}")
        if v_scales is not None:
            raise KernelArgumentError("v_scales given but v_pages is None (MLA mode uses k_scales)")
    else:
        if mla_value_dim is not None:
            raise KernelArgumentError("mla_value_dim is only for MLA mode (v_pages=None)")
        if v_pages.ndim != 4 or tuple(v_pages.shape[:3]) != page_shape:
            raise KernelArgumentError(f"v_pages must be [{kvh}, {num_pages}, {ps}, v_dim] like k_pages, "
                                      f"got shape {tuple(v_pages.shape)}")
    for name, pages, scales in (("k", k_pages, k_scales), ("v", v_pages, v_scales)):
        if pages is None:
            continue
        if scales is None:
            if jnp.dtype(pages.dtype) in FP8_DTYPES:
                raise KernelArgumentError(f"{name}_pages are {pages.dtype} but {name}_scales is None")
        elif tuple(scales.shape) != page_shape:
            raise KernelArgumentError(f"{name}_scales must have shape {page_shape}, got {tuple(scales.shape)}")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise KernelArgumentError(f"sinks must have shape ({h},) (one logit per query head), got "
                                  f"{tuple(sinks.shape)}")


def ragged_paged_attention_reference(
    q: Float[Array, "T H Dk"],
    k_pages: Float[Array, "KVH P ps Dk"],
    v_pages: Float[Array, "KVH P ps Dv"] | None,
    block_tables: Int[Array, "S M"],
    kv_lens: Int[Array, " S"],
    cu_q_lens: Int[Array, " S1"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    layer: int | Int[Array, ""] | None = None,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " H"] | None = None,
    mla_value_dim: int | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
) -> Float[Array, "T H Dv"]:
    """The pure-``jnp`` ragged paged attention (see the module docstring for
    the layout and masking rules; arguments as :func:`ragged_paged_attention`)."""
    if layer is not None:
        k_pages, v_pages, k_scales, v_scales = _pick_layer(layer, k_pages, v_pages, k_scales, v_scales)
    _check(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks, mla_value_dim)
    if int(block_q) < 1:
        raise KernelArgumentError(f"block_q must be >= 1, got {block_q}")
    sm, window, cap, use_cap = attention_scalars(k_pages.shape[-1], sm_scale, sliding_window, logit_soft_cap)
    return _reference_impl(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks,
                           sm, window, cap, use_cap=use_cap, use_sinks=sinks is not None,
                           mla_value_dim=None if mla_value_dim is None else int(mla_value_dim),
                           block_q=int(block_q))


def ragged_paged_attention(
    q: Float[Array, "T H Dk"],
    k_pages: Float[Array, "KVH P ps Dk"],
    v_pages: Float[Array, "KVH P ps Dv"] | None,
    block_tables: Int[Array, "S M"],
    kv_lens: Int[Array, " S"],
    cu_q_lens: Int[Array, " S1"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    layer: int | Int[Array, ""] | None = None,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " H"] | None = None,
    mla_value_dim: int | None = None,
    block_q: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "T H Dv"]:
    """Causal attention of packed queries over the paged pool (module docstring).

    Args:
      q: ``[T, H, Dk]`` the packed queries (not pre-scaled), any float dtype.
      k_pages, v_pages: ``[KVH, P, ps, D]`` one layer's pages (or the stacked
        ``[L, ...]`` pool with ``layer``); ``v_pages`` None is MLA mode.
      block_tables: ``[S, M]`` int, sequence ``s``'s pages (entries past its
        pages may be -1 or anything: clamped for the gather, then masked).
      kv_lens: ``[S]`` int, tokens sequence ``s`` holds, this step's included
        (``q_len <= kv_lens[s] <= M * ps``).
      cu_q_lens: ``[S + 1]`` int, non-decreasing, ``cu_q_lens[0] = 0``,
        ``cu_q_lens[S] <= T``.
      k_scales, v_scales: ``[KVH, P, ps]`` float32 scales (fp8 pages).
      sm_scale: default ``1 / sqrt(Dk)``. sliding_window: ``W >= 1`` or None.
      logit_soft_cap: ``cap > 0`` or None. sinks: ``[H]`` float logits or None.
      mla_value_dim: the value width in MLA mode.
      block_q: query tokens per block (reference and kernel tiling).
      implementation, interpret: see :mod:`kernels_pallas._dispatch`.

    Returns ``[T, H, Dv]`` in ``q.dtype``; tokens past ``cu_q_lens[S]`` and
    queries with nothing to attend are zeros.
    """
    pallas = _dispatch.choose("ragged_paged_attention", implementation, interpret,
                              {"k_pages": k_pages, "v_pages": v_pages})
    if pallas:
        from kernels_pallas import ragged_kernel  # the Pallas kernel (GPU, or interpret mode)

        return ragged_kernel.ragged_paged_attention_pallas(
            q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, layer=layer,
            sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, sinks=sinks,
            mla_value_dim=mla_value_dim, block_q=block_q, interpret=interpret)
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, layer=layer, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, sinks=sinks, mla_value_dim=mla_value_dim,
        block_q=DEFAULT_BLOCK_Q if block_q is None else block_q)
