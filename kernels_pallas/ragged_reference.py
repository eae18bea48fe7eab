"""The ragged paged attention reference and its query blocks (pure ``jnp``).

The layout, masking rules, numerics and isolation guarantee are those of
:mod:`kernels_pallas.ragged_attention` (the public entry point, which
dispatches between this reference and the Pallas kernel of
:mod:`kernels_pallas.ragged_kernel`); both import the query-block helpers
from here, so neither imports the other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas._dispatch import FP8_DTYPES
from kernels_pallas.errors import KernelArgumentError
from kernels_pallas.reference import attention_scalars, check_stacked, split_layer, traced_layer

__all__ = [
    "clean_cu_q_lens",
    "max_query_blocks",
    "ragged_paged_attention_reference",
    "ragged_query_blocks",
    "reference_block_q",
]

_HIGHEST = jax.lax.Precision.HIGHEST
#: The reference's largest default block (see :func:`reference_block_q`).
DEFAULT_BLOCK_Q = 16
# Context tokens per step of the reference's loop: ~128 measured fastest on CPU.
_CHUNK_TOKENS = 128


def max_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The static number of query blocks of ``T`` packed tokens over ``S``
    sequences: ``sum_s ceil(q_len_s / block_q) <= (T + S * (block_q - 1)) //
    block_q`` (the floors of a sum bound the sum of floors) and every block
    holds a token, so at most ``T`` (at least 1)."""
    block_q = int(block_q)
    return max(1, min(int(num_tokens), (int(num_tokens) + int(num_seqs) * (block_q - 1)) // block_q))


def reference_block_q(num_tokens: int, num_seqs: int) -> int:
    """The reference's default query tokens per block: the average query
    length ``ceil(T / S)`` rounded up to a power of two, at most
    ``DEFAULT_BLOCK_Q`` (16): a batch of decode tokens (``T == S``) runs one
    token per block and wastes no rows, long prefill pieces share each
    gathered chunk among 16 queries (measured fastest on CPU)."""
    average = 1 << max(0, -(-max(1, num_tokens) // max(1, num_seqs)) - 1).bit_length()
    return max(1, min(DEFAULT_BLOCK_Q, average))


def clean_cu_q_lens(cu_q_lens: Int[Array, " S1"], num_tokens: int) -> Int[Array, " S1"]:
    """``cu_q_lens`` as int32, clipped into ``[0, T]`` and made
    non-decreasing (a running max): the same for inputs that keep the
    contract, and for any other input every token below ``cu[S]`` lies in
    exactly one block of :func:`ragged_query_blocks` (so the static count of
    :func:`max_query_blocks` holds)."""
    return jax.lax.cummax(jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens))


def ragged_query_blocks(cu_q_lens: Int[Array, " S1"], kv_lens: Int[Array, " S"], num_tokens: int, block_q: int,
                        num_blocks: int | None = None):
    """The query blocks of a packed batch.

    Blocks of ``block_q`` tokens of one sequence each, sequence after
    sequence; their count is static (:func:`max_query_blocks` unless
    ``num_blocks`` is given), the unused ones last. Returns ``(seq [NB],
    first [NB], rows_ok [NB, block_q], tokens [NB, block_q], positions [NB,
    block_q])``: block ``j`` holds queries ``first[j] .. first[j] + block_q -
    1`` (offsets within sequence ``seq[j]``; ``seq`` is ``S`` for an unused
    block), ``rows_ok`` marks the real ones, ``tokens`` their flat indices
    (clamped into ``[0, T)``) and ``positions`` their positions in the
    sequence (``kv_len - q_len + offset``, ``kv_len`` clipped into ``[0,
    2**30]``). ``cu_q_lens`` goes through :func:`clean_cu_q_lens` first."""
    num_seqs = kv_lens.shape[0]
    if num_blocks is None:
        num_blocks = max_query_blocks(num_tokens, num_seqs, block_q)
    cu = clean_cu_q_lens(cu_q_lens, num_tokens)
    q_lens = cu[1:] - cu[:-1]
    block_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-q_lens // block_q))])
    j = jnp.arange(num_blocks, dtype=jnp.int32)
    # The lane owning block j: one fused compare-and-count (S is small; a
    # binary search would be a loop of tiny launches on a GPU).
    seq = jnp.sum(block_cu[1:][None, :] <= j[:, None], axis=1, dtype=jnp.int32)
    s = jnp.minimum(seq, num_seqs - 1)
    first = (j - block_cu[s]) * block_q
    rows = first[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    rows_ok = (seq < num_seqs)[:, None] & (rows < q_lens[s][:, None])
    tokens = jnp.clip(cu[s][:, None] + rows, 0, max(0, num_tokens - 1))
    kv = jnp.clip(kv_lens.astype(jnp.int32), 0, 2**30)  # keeps positions and their differences in int32
    positions = kv[s][:, None] - q_lens[s][:, None] + rows
    return seq, first, rows_ok, tokens, positions


def _dot_dtype(q_dtype, pages_dtype):
    """The dtype ``q @ K.T`` runs in: bf16 (exact products, float32
    accumulation) for bf16 or fp8 pages with a bf16 ``q``, else float32."""
    pages_dtype = jnp.dtype(pages_dtype)
    if pages_dtype in FP8_DTYPES:
        pages_dtype = jnp.dtype(jnp.bfloat16)  # e4m3 and e5m2 convert to bf16 exactly
    if jnp.dtype(q_dtype) == pages_dtype == jnp.dtype(jnp.bfloat16):
        return pages_dtype
    return jnp.dtype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("use_cap", "use_sinks", "mla_value_dim", "block_q", "chunk_tokens"))
def _reference_impl(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks, layer,
                    sm_scale, window, cap, *, use_cap, use_sinks, mla_value_dim, block_q, chunk_tokens=_CHUNK_TOKENS):
    # Pages and scales are stacked ([L, KVH, P, ...]); the loop gathers from
    # layer ``layer`` directly (slicing the layer out first would copy it).
    f32, i32 = jnp.float32, jnp.int32
    num_tokens, h, dk = q.shape
    _, kvh, num_pages, ps, _ = k_pages.shape
    g = h // kvh
    num_seqs, width = block_tables.shape
    seq, _, rows_ok, tokens, qpos = ragged_query_blocks(cu_q_lens, kv_lens, num_tokens, block_q)
    nb = seq.shape[0]
    s = jnp.minimum(seq, num_seqs - 1)
    kv_len = jnp.clip(kv_lens.astype(i32), 0, width * ps)[s]  # [NB]
    qpos = jnp.where(rows_ok, qpos, -1)  # no real query: attends nothing

    # The union of the block's attended ranges, [lo, hi): V is zeroed
    # outside it (isolation), logits are masked per query below.
    hi = jnp.clip(jnp.max(qpos, axis=1) + 1, 0, kv_len)
    top = jnp.min(jnp.where(rows_ok, qpos, jnp.iinfo(i32).max), axis=1) + 1
    lo = jnp.where(top > window, top - window, 0)  # subtract only where it stays >= 0: no overflow
    live = hi > lo

    # Chunks of the context, and the traced range of them any block attends.
    chunk_pages = max(1, min(width, -(-chunk_tokens // ps)))
    chunk = chunk_pages * ps
    num_chunks = -(-width // chunk_pages)
    table = jnp.clip(block_tables.astype(i32)[s], 0, num_pages - 1)  # [NB, M]: clamped for the gather only
    table = jnp.pad(table, ((0, 0), (0, num_chunks * chunk_pages - width)))
    c_end = (jnp.max(jnp.where(live, hi, 0)) + chunk - 1) // chunk
    c_first = jnp.minimum(jnp.min(jnp.where(live, lo, jnp.iinfo(i32).max)) // chunk, c_end)

    dt = _dot_dtype(q.dtype, k_pages.dtype)
    qb = jnp.transpose(q[tokens].astype(dt).reshape(nb, block_q, kvh, g, dk), (2, 0, 1, 3, 4))  # [KVH, NB, BQ, G, Dk]
    dv = mla_value_dim if v_pages is None else v_pages.shape[-1]

    def gather(pages, scales, tab, dtype):  # [KVH, NB, chunk, D] (no transpose) and [KVH, NB, chunk] scales
        def pick(x):  # the layer, fused into the gather (no copy of it)
            return jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)[:, tab]

        x = pick(pages).reshape(kvh, nb, chunk, pages.shape[-1]).astype(dtype)
        return x, None if scales is None else pick(scales).reshape(kvh, nb, chunk).astype(f32)

    def body(c, carry):
        m_prev, l_prev, acc = carry
        # The pool passes a barrier with the loop index: otherwise XLA:CPU
        # converts the whole bf16/fp8 pool to float32 once before the loop
        # (gather(convert(pool)), then hoisted) instead of the pages gathered.
        kp, vp, ks, vs = jax.lax.optimization_barrier(((k_pages, v_pages, k_scales, v_scales), c))[0]
        tab = jax.lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages, axis=1)
        key_pos = c * chunk + jnp.arange(chunk, dtype=i32)
        kv_ok = (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] < hi[:, None])  # [NB, chunk]
        # Per query: causal and window; pos <= qpos first, so qpos - pos >= 0.
        allowed = (kv_ok[:, None, :] & (key_pos[None, None, :] <= qpos[:, :, None])
                   & (qpos[:, :, None] - key_pos[None, None, :] < window))[None, :, :, None, :]  # [1, NB, BQ, 1, chunk]

        k, k_s = gather(kp, ks, tab, dt)
        logits = jnp.einsum("knqgd,knsd->knqgs", qb, k, precision=_HIGHEST, preferred_element_type=f32)
        logits = logits * (sm_scale if k_s is None else sm_scale * k_s[:, :, None, None, :])
        if use_cap:
            logits = cap * jnp.tanh(logits / cap)
        # NaN logits of masked positions never pass the wheres below.
        m_next = jnp.maximum(m_prev, jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # nothing attended yet: any finite shift
        correction = jnp.where(jnp.isfinite(m_prev), jnp.exp(m_prev - m_safe), 0.0)
        p = jnp.where(allowed, jnp.exp(logits - m_safe[..., None]), 0.0)

        if v_pages is None:
            v, v_s = k[..., :mla_value_dim].astype(f32), k_s  # MLA: the value is the latent's first dims
        else:
            v, v_s = gather(vp, vs, tab, f32)
        if v_s is not None:
            v = v * v_s[..., None]
        v = jnp.where(kv_ok[None, :, :, None], v, 0.0)  # isolation: 0 * NaN would be NaN
        acc = acc * correction[..., None] + jnp.einsum("knqgs,knsd->knqgd", p, v, precision=_HIGHEST)
        return m_next, l_prev * correction + jnp.sum(p, axis=-1), acc

    shape = (kvh, nb, block_q, g)
    init = (jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32), jnp.zeros(shape + (dv,), f32))
    m, l, acc = jax.lax.fori_loop(c_first, c_end, body, init)
    if use_sinks:
        # The sink joins the denominator only: l + exp(sink - m).
        sink = sinks.astype(f32).reshape(kvh, 1, 1, g)
        m_fin = jnp.maximum(m, sink)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_fin), 0.0)
        l = l * alpha + jnp.exp(sink - m_fin)
        acc = acc * alpha[..., None]
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # nothing attended (and no sink): 0 / 1
    o = jnp.transpose(o, (1, 2, 0, 3, 4)).reshape(nb * block_q, h, dv).astype(q.dtype)
    out = jnp.zeros((num_tokens, h, dv), q.dtype)
    dest = jnp.where(rows_ok, tokens, num_tokens).reshape(-1)  # padding rows: out of range, dropped
    return out.at[dest].set(o, mode="drop")


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
    if sinks is not None and (tuple(sinks.shape) != (h,) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise KernelArgumentError(f"sinks must be float with shape ({h},) (one logit per query head), got "
                                  f"{sinks.dtype} {tuple(sinks.shape)}")


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
    block_q: int | None = None,
) -> Float[Array, "T H Dv"]:
    """The pure-``jnp`` ragged paged attention (see the module docstring for
    the layout and masking rules; arguments as :func:`ragged_paged_attention`;
    ``block_q`` defaults to :func:`reference_block_q`)."""
    stacked = (k_pages, v_pages, k_scales, v_scales)
    if layer is None:
        stacked = tuple(None if x is None else x[None] for x in stacked)  # a free reshape
        layer = 0
    else:
        check_stacked(layer, *stacked)
    one = [None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in stacked]
    _check(q, one[0], one[1], block_tables, kv_lens, cu_q_lens, one[2], one[3], sinks, mla_value_dim)
    if split_layer(layer)[0] is None:  # traced: clamped, and out of range it attends nothing
        layer, kv_lens = traced_layer(layer, stacked[0].shape[0], kv_lens)
    if block_q is None:
        block_q = reference_block_q(q.shape[0], block_tables.shape[0])
    if int(block_q) < 1:
        raise KernelArgumentError(f"block_q must be >= 1, got {block_q}")
    sm, window, cap, use_cap = attention_scalars(q.shape[-1], sm_scale, sliding_window, logit_soft_cap)
    if q.shape[0] == 0:  # no tokens: nothing to attend, and no block to gather for
        dv = int(mla_value_dim) if v_pages is None else v_pages.shape[-1]
        return jnp.zeros((0, q.shape[1], dv), q.dtype)
    k_pages, v_pages, k_scales, v_scales = stacked
    return _reference_impl(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks,
                           jnp.asarray(layer, jnp.int32), sm, window, cap, use_cap=use_cap,
                           use_sinks=sinks is not None,
                           mla_value_dim=None if mla_value_dim is None else int(mla_value_dim),
                           block_q=int(block_q), chunk_tokens=_CHUNK_TOKENS)
