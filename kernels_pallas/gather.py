"""Gather compressed KV entries into dense rows, dequantizing in the same pass.

Rows come out in the format's ``out_dtype``: bf16 for the fp8 formats (what
the text below says), the stored dtype for a lossless format.

Three entry points, one per attention kind of a DeepSeek-V4-style model (seed
004's ``LayerCacheHandle.gather_*``). Each reads :class:`CompressedEntries`
(fp8 NoPE + block scales + bf16 RoPE) and writes bf16 ``[..., nope + rope]``
rows ready for attention, plus a validity mask; invalid rows are exact zeros.

``gather_compressed_kv`` (CSA, top-k)
    For each query token ``t``, the entries ``indices[t, :]`` of its request,
    through the request's block table. Entry ``j`` of a request lives in
    logical page ``j // entries_per_page`` at offset ``j % entries_per_page``.
``gather_all_compressed_kv`` (HCA)
    For each request ``b``, its entries ``0 .. num_entries[b] - 1`` in order,
    padded to a static ``max_entries``.
``gather_swa_kv`` (SWA)
    For each request, the last ``min(pos + 1, W)`` tokens of its sliding
    window ring buffer (position ``p`` lives in ring slot ``p % W``), oldest
    first, padded to ``W``.

Validity (all kernels; anything else is a zero row with mask False):
an index is valid iff it is ``>= 0``, below the caller's entry count, its
logical page is inside the block table row and that table entry names a page
in ``[0, num_pages)``. So ``-1`` (the peers' "no entry") and stale or garbage
values can never read memory outside the pool, and rows past a request's
entries never show another request's data.

The Pallas kernels: one program per (output row, tile of ``TILE`` entries).
It computes the tile's pool rows, issues every load of the tile (each scale
group's fp8 values and scales, the RoPE part), then dequantizes in float32 and
stores bf16 (all loads before the first store, so they are in flight
together). Float8 conversion needs sm_89+: on older GPUs, and for 1-byte
arrays of 2 to 4 GiB, the default dispatch runs the reference (see
:mod:`kernels_pallas._dispatch`). Every piece moved is a power of two wide (group sizes 64
and 128, RoPE 64) because Triton needs that; entry counts that are not a
multiple of the tile are padded by the wrapper (and sliced off after).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas.errors import KernelArgumentError
from kernels_pallas import _dispatch
from kernels_pallas.formats import CompressedEntries, ue8m0_to_float32

__all__ = [
    "gather_all_compressed_kv",
    "gather_all_compressed_kv_reference",
    "gather_compressed_kv",
    "gather_compressed_kv_reference",
    "gather_swa_kv",
    "gather_swa_kv_reference",
]

TILE = 32  # entries per program: 32 x 584 B in, 32 x 1 KiB out
_BIG = 2**30  # "no entry limit"


# --------------------------------------------------------------------------
# Index rules, shared by the kernels and the references (pure integer math).
# --------------------------------------------------------------------------


def _paged_rows(entry, limit, lookup, width, entries_per_page, num_pages):
    """Pool rows and validity of logical ``entry`` ids.

    ``lookup(logical_page) -> page id`` reads the request's block table row
    (``width`` entries): a ref in the kernel, an array in the reference."""
    logical_page = entry // entries_per_page
    in_range = (entry >= 0) & (entry < limit) & (logical_page < width)
    page = lookup(jnp.clip(logical_page, 0, width - 1))
    valid = in_range & (page >= 0) & (page < num_pages)
    rows = jnp.clip(page, 0, num_pages - 1) * entries_per_page + jnp.clip(entry, 0, None) % entries_per_page
    return rows, valid


def _ring_rows(i, slot, pos, window, num_slots):
    """Ring rows and validity of output positions ``i`` (0 = oldest) for the
    request whose newest written position is ``pos`` in ring ``slot``."""
    count = jnp.clip(pos + 1, 0, window)  # tokens in the window so far
    position = pos - count + 1 + i
    valid = (i < count) & (slot >= 0) & (slot < num_slots)
    rows = jnp.clip(slot, 0, num_slots - 1) * window + jnp.clip(position, 0, None) % window
    return rows, valid


# --------------------------------------------------------------------------
# The Pallas kernel body shared by the three gathers.
# --------------------------------------------------------------------------


def _emit_tile(rows, valid, nope_ref, scales_ref, rope_ref, out_ref, valid_ref, out_row, tile0, fmt, lead=()):
    """Dequantize pool ``rows`` ([TILE] int32) into
    ``out_ref[out_row, tile0:tile0+TILE]``; invalid rows become zeros.
    ``lead``: ``(layer,)`` when the pool refs keep a leading layer axis
    (a stacked pool read in place: every load indexes the layer), else ``()``.

    Every load is issued before the first store: the loads are independent,
    so the GPU keeps them all in flight at once (a load-store-load chain would
    wait out one memory round trip per group)."""
    tile = pl.ds(tile0, rows.shape[0])
    keep = valid[:, None]
    group_cols = [pl.ds(g * fmt.group_size, fmt.group_size) for g in range(fmt.num_groups)]
    groups = [(cols, nope_ref[(*lead, rows, cols)], scales_ref[(*lead, rows, g)])  # [TILE, group], [TILE] scales
              for g, cols in enumerate(group_cols)]
    ropes = [(pl.ds(fmt.nope_dim + start, size), rope_ref[(*lead, rows, pl.ds(start, size))])
             for start, size in _dispatch.pow2_chunks(fmt.rope_dim)]
    for cols, values, raw_scale in groups:
        if fmt.scale_kind == "ue8m0":
            scale = ue8m0_to_float32(raw_scale)
        else:
            scale = raw_scale.astype(jnp.float32)
        # where() before the store, not a multiply: a garbage row may hold NaN.
        dequantized = values.astype(jnp.float32) * scale[:, None]
        out_ref[out_row, tile, cols] = jnp.where(keep, dequantized, 0.0).astype(out_ref.dtype)
    for cols, rope in ropes:
        out_ref[out_row, tile, cols] = jnp.where(keep, rope, 0).astype(out_ref.dtype)
    valid_ref[out_row, tile] = valid.astype(valid_ref.dtype)


def _lead(refs, layered):
    """``(lead, refs)``: a layered kernel's first input is the ``[1]`` layer
    index (clamped into the pool by the wrapper), which every pool load
    takes as its leading index."""
    return ((refs[0][0],), refs[1:]) if layered else ((), refs)


def _compressed_kernel(*refs, fmt, entries_per_page, num_pages, layered=False):
    lead, refs = _lead(refs, layered)
    token_rows_ref, limits_ref, indices_ref, table_ref, nope_ref, scales_ref, rope_ref, *outs = refs
    out_ref, valid_ref = outs[-2:]  # leading outs are the interpret-mode poison inputs
    t, k = pl.program_id(0), pl.program_id(1)
    tile0 = k * TILE
    entry = indices_ref[t, pl.ds(tile0, TILE)]
    row = token_rows_ref[t]
    rows, valid = _paged_rows(entry, limits_ref[t], lambda lp: table_ref[row, lp], table_ref.shape[1],
                              entries_per_page, num_pages)
    _emit_tile(rows, valid, nope_ref, scales_ref, rope_ref, out_ref, valid_ref, t, tile0, fmt, lead)


def _all_kernel(*refs, fmt, entries_per_page, num_pages, layered=False):
    lead, refs = _lead(refs, layered)
    num_entries_ref, table_ref, nope_ref, scales_ref, rope_ref, *outs = refs
    out_ref, valid_ref = outs[-2:]
    b, k = pl.program_id(0), pl.program_id(1)
    tile0 = k * TILE
    entry = tile0 + jnp.arange(TILE, dtype=jnp.int32)
    rows, valid = _paged_rows(entry, num_entries_ref[b], lambda lp: table_ref[b, lp], table_ref.shape[1],
                              entries_per_page, num_pages)
    _emit_tile(rows, valid, nope_ref, scales_ref, rope_ref, out_ref, valid_ref, b, tile0, fmt, lead)


def _swa_kernel(*refs, fmt, window, num_slots, layered=False):
    lead, refs = _lead(refs, layered)
    slots_ref, positions_ref, nope_ref, scales_ref, rope_ref, *outs = refs
    out_ref, valid_ref = outs[-2:]
    b, k = pl.program_id(0), pl.program_id(1)
    tile0 = k * TILE
    i = tile0 + jnp.arange(TILE, dtype=jnp.int32)
    rows, valid = _ring_rows(i, slots_ref[b], positions_ref[b], window, num_slots)
    _emit_tile(rows, valid, nope_ref, scales_ref, rope_ref, out_ref, valid_ref, b, tile0, fmt, lead)


def _launch(kernel, inputs, num_out_rows, padded_width, fmt, interpret):
    """Run ``kernel`` on a ``(num_out_rows, padded_width / TILE)`` grid.

    Outputs: ``fmt.out_dtype`` (bf16 for fp8 formats)
    ``[rows, padded_width, head_dim]`` and int8 validity. In
    interpret mode both start poisoned (NaN / int8 min) through
    ``input_output_aliases``, so unwritten elements show."""
    out_shapes = [jax.ShapeDtypeStruct((num_out_rows, padded_width, fmt.head_dim), fmt.out_dtype),
                  jax.ShapeDtypeStruct((num_out_rows, padded_width), jnp.int8)]
    aliases, extra = {}, []
    if interpret:
        extra = [_dispatch.poisoned(s.shape, s.dtype) for s in out_shapes]
        aliases = {len(inputs): 0, len(inputs) + 1: 1}
    out, valid = pl.pallas_call(
        kernel,
        grid=(num_out_rows, padded_width // TILE),
        out_shape=out_shapes,
        input_output_aliases=aliases,
        interpret=interpret,
        # Triton, not Mosaic GPU: these are gathers of scattered rows, which
        # Triton's pointer loads express directly. The float8 conversion needs
        # sm_89+ (H100, L40, ...); on A100 the dispatch runs the reference.
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
        name="jaxkv_gather_" + kernel.func.__name__.strip("_").removesuffix("_kernel"),
    )(*inputs, *extra)
    return out, valid


def _flat(entries: CompressedEntries):
    """Pool arrays with their last two leading dims merged into one row axis
    (a stacked pool keeps its layer axis first: ``[L, rows, ...]``)."""
    *layers, a, b = entries.shape
    rows = a * b  # explicit: a 0-wide RoPE part cannot infer -1
    return tuple(x.reshape(*layers, rows, x.shape[-1]) for x in (entries.nope, entries.scales, entries.rope))


def _layer_input(layer):
    """The ``[1]`` int32 input of a layered kernel (None: an unstacked pool)."""
    return () if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1),)


def _padded(width):
    return max(TILE, _dispatch.ceil_div(width, TILE) * TILE)


# ``layer``: None for an unstacked pool, else the (clamped) layer index of a
# stacked one, a traced input: one compiled kernel serves every layer.


@functools.partial(jax.jit, static_argnames=("interpret",))
def _compressed_pallas(pages, block_table, token_rows, indices, limits, layer, *, interpret):
    num_tokens, k = indices.shape
    width = _padded(k)
    indices = jnp.pad(indices, ((0, 0), (0, width - k)), constant_values=-1)
    kernel = functools.partial(_compressed_kernel, fmt=pages.fmt, entries_per_page=pages.shape[-1],
                               num_pages=pages.shape[-2], layered=layer is not None)
    out, valid = _launch(kernel, (*_layer_input(layer), token_rows, limits, indices, block_table, *_flat(pages)),
                         num_tokens, width, pages.fmt, interpret)
    return out[:, :k], valid[:, :k] == 1


@functools.partial(jax.jit, static_argnames=("max_entries", "interpret"))
def _all_pallas(pages, block_table, num_entries, layer, *, max_entries, interpret):
    width = _padded(max_entries)
    kernel = functools.partial(_all_kernel, fmt=pages.fmt, entries_per_page=pages.shape[-1],
                               num_pages=pages.shape[-2], layered=layer is not None)
    out, valid = _launch(kernel, (*_layer_input(layer), num_entries, block_table, *_flat(pages)),
                         block_table.shape[0], width, pages.fmt, interpret)
    return out[:, :max_entries], valid[:, :max_entries] == 1


@functools.partial(jax.jit, static_argnames=("interpret",))
def _swa_pallas(ring, slots, positions, layer, *, interpret):
    num_slots, window = ring.shape[-2:]
    width = _padded(window)
    kernel = functools.partial(_swa_kernel, fmt=ring.fmt, window=window, num_slots=num_slots,
                               layered=layer is not None)
    out, valid = _launch(kernel, (*_layer_input(layer), slots, positions, *_flat(ring)), slots.shape[0], width,
                         ring.fmt, interpret)
    return out[:, :window], valid[:, :window] == 1


# --------------------------------------------------------------------------
# References: the same index rules, vectorized with plain jnp.
# --------------------------------------------------------------------------


def _dequantized_rows(entries: CompressedEntries, rows, valid, layer=None):
    nope, scales, rope = _flat(entries)
    at = rows if layer is None else (layer, rows)  # a stacked pool: gathered at its layer, never sliced out
    picked = CompressedEntries.from_parts(nope[at], scales[at], rope[at], entries.fmt)
    return jnp.where(valid[..., None], picked.dequantize(), jnp.zeros((), entries.fmt.out_dtype))


def _table_lookup(tables):
    """``lookup(logical_page[r, k]) = tables[r, logical_page[r, k]]``."""
    return lambda logical_page: jnp.take_along_axis(tables, logical_page, axis=1)


@jax.jit
def _compressed_reference(pages, block_table, token_rows, indices, limits, layer):
    tables = block_table[token_rows]  # each token's copy of its request's row
    rows, valid = _paged_rows(indices, limits[:, None], _table_lookup(tables), tables.shape[1],
                              pages.shape[-1], pages.shape[-2])
    return _dequantized_rows(pages, rows, valid, layer), valid


@functools.partial(jax.jit, static_argnames=("max_entries",))
def _all_reference(pages, block_table, num_entries, layer, *, max_entries):
    entry = jnp.broadcast_to(jnp.arange(max_entries, dtype=jnp.int32), (block_table.shape[0], max_entries))
    rows, valid = _paged_rows(entry, num_entries[:, None], _table_lookup(block_table), block_table.shape[1],
                              pages.shape[-1], pages.shape[-2])
    return _dequantized_rows(pages, rows, valid, layer), valid


@jax.jit
def _swa_reference(ring, slots, positions, layer):
    num_slots, window = ring.shape[-2:]
    i = jnp.arange(window, dtype=jnp.int32)[None, :]
    rows, valid = _ring_rows(i, slots[:, None], positions[:, None], window, num_slots)
    return _dequantized_rows(ring, rows, valid, layer), valid


# --------------------------------------------------------------------------
# Public entry points: check static shapes, then run the kernel or reference.
# --------------------------------------------------------------------------


def _arrays(entries: CompressedEntries) -> dict:
    return {"nope": entries.nope, "scales": entries.scales, "rope": entries.rope}


def _int_array(x, name, shape):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise KernelArgumentError(f"{name} must be an integer array, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise KernelArgumentError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x.astype(jnp.int32)


def _check_pool(entries, what, leading_names, layer=None):
    if not isinstance(entries, CompressedEntries):
        raise KernelArgumentError(f"{what} must be CompressedEntries, got {type(entries).__name__}")
    if layer is not None:
        leading_names = ("layers", *leading_names)
    if len(entries.shape) != len(leading_names) or min(entries.shape) < 1:
        raise KernelArgumentError(
            f"{what} must have leading shape [{', '.join(leading_names)}]"
            + (" (layer= reads a stacked pool)" if layer is not None else "") + f", got {list(entries.shape)}")
    entries.check(what)


def _layer_index(layer, entries):
    """``(layer, ok)`` of a stacked pool's ``layer`` (None: unstacked, ok):
    clamped into ``[0, L)`` so no load leaves the pool; ``ok`` False for a
    layer outside it, whose reads the caller turns invalid (zeros). A Python
    int out of range raises."""
    if layer is None:
        return None, True
    num_layers = entries.shape[0]
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= layer < num_layers:
            raise KernelArgumentError(f"layer {int(layer)} out of range: the pool has {num_layers} layers")
    layer = jnp.asarray(layer)
    if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise KernelArgumentError(f"layer must be an integer scalar, got {layer.dtype}{list(layer.shape)}")
    layer = layer.astype(jnp.int32)
    return jnp.clip(layer, 0, num_layers - 1), (layer >= 0) & (layer < num_layers)


def _check_table(block_table, rows=None):
    block_table = jnp.asarray(block_table)
    if block_table.ndim != 2 or block_table.shape[1] < 1:
        raise KernelArgumentError(f"block_table must be [rows, max_pages] with max_pages >= 1, "
                              f"got shape {tuple(block_table.shape)}")
    if rows is not None and block_table.shape[0] != rows:
        raise KernelArgumentError(f"block_table has {block_table.shape[0]} rows, expected {rows}")
    return _int_array(block_table, "block_table", block_table.shape)


def gather_compressed_kv(
    pages: CompressedEntries,
    block_table: Int[Array, "R M"],
    indices: Int[Array, "T K"],
    token_rows: Int[Array, " T"] | None = None,
    *,
    num_entries: Int[Array, " T"] | None = None,
    layer: int | Int[Array, ""] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T K D"], Bool[Array, "T K"]]:
    """CSA top-k gather: for each query token, its selected entries, dequantized.

    Args:
      pages: the layer's paged pool, leading shape ``[num_pages,
        entries_per_page]`` (e.g. 32 CSA entries per 128-token block).
      block_table: ``[R, M]`` int; ``block_table[r, j]`` is the page holding
        entries ``[j*E, (j+1)*E)`` of request row ``r`` (``E`` entries per
        page); -1 or out-of-range ids are invalid.
      indices: ``[T, K]`` int, the top-k entry ids of each query token in its
        request's entry space; -1 means "no entry".
      token_rows: ``[T]`` int, the ``block_table`` row of each token (e.g.
        ``request_slots[request_ids]``). None: token ``t`` uses row ``t``
        (decode, one token per request; needs ``T == R``).
      num_entries: ``[T]`` int, entries visible to each token; ids at or past
        it are invalid. For the causal rule pass ``(position + 1) // ratio``.
        None: no limit beyond the table.
      layer: None, or the layer of a stacked pool (``pages`` leading shape
        ``[L, num_pages, entries_per_page]``), a Python int or a traced
        int32 scalar (a ``lax.scan`` index): that layer is read in place
        (slicing ``pages[layer]`` first would copy it). A traced layer
        outside ``[0, L)`` reads nothing (all invalid).
      implementation, interpret: see :mod:`kernels_pallas._dispatch`.

    Returns:
      ``(kv, valid)``: bf16 ``[T, K, nope + rope]`` (row ``[t, k]`` = entry
      ``indices[t, k]`` dequantized, zeros where invalid) and bool ``[T, K]``.
    """
    _check_pool(pages, "pages", ("num_pages", "entries_per_page"), layer)
    layer, layer_ok = _layer_index(layer, pages)
    block_table = _check_table(block_table)
    indices = jnp.asarray(indices)
    if indices.ndim != 2 or indices.shape[1] < 1:
        raise KernelArgumentError(f"indices must be [tokens, k] with k >= 1, got shape {tuple(indices.shape)}")
    num_tokens = indices.shape[0]
    indices = _int_array(indices, "indices", indices.shape)
    if token_rows is None:
        if num_tokens != block_table.shape[0]:
            raise KernelArgumentError(f"token_rows is None, so indices needs one row per block_table row "
                                  f"({block_table.shape[0]}), got {num_tokens}")
        token_rows = jnp.arange(num_tokens, dtype=jnp.int32)
    token_rows = jnp.clip(_int_array(token_rows, "token_rows", (num_tokens,)), 0, block_table.shape[0] - 1)
    if num_entries is None:
        limits = jnp.full((num_tokens,), _BIG, jnp.int32)
    else:
        limits = _int_array(num_entries, "num_entries", (num_tokens,))
    limits = jnp.where(layer_ok, limits, 0)
    if _dispatch.choose("gather_compressed_kv", implementation, interpret, _arrays(pages)):
        return _compressed_pallas(pages, block_table, token_rows, indices, limits, layer, interpret=interpret)
    return _compressed_reference(pages, block_table, token_rows, indices, limits, layer)


def gather_all_compressed_kv(
    pages: CompressedEntries,
    block_table: Int[Array, "B M"],
    num_entries: Int[Array, " B"],
    *,
    max_entries: int,
    layer: int | Int[Array, ""] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B N D"], Bool[Array, "B N"]]:
    """HCA gather: every completed entry of each request, in order.

    Args:
      pages: the layer's paged pool, leading shape ``[num_pages, entries_per_page]``.
      block_table: ``[B, M]`` int, one row per request (see
        :func:`gather_compressed_kv`).
      num_entries: ``[B]`` int, completed entries per request (at decode
        position ``pos`` with ratio ``r``: ``(pos + 1) // r``).
      max_entries: static ``N``, the padded output width.
      layer: a stacked pool's layer, read in place (see
        :func:`gather_compressed_kv`).

    Returns:
      ``(kv, valid)``: bf16 ``[B, N, nope + rope]``, row ``[b, j]`` = entry
      ``j`` for ``j < num_entries[b]`` (and a valid table entry), zeros
      after; bool ``[B, N]``.
    """
    _check_pool(pages, "pages", ("num_pages", "entries_per_page"), layer)
    layer, layer_ok = _layer_index(layer, pages)
    block_table = _check_table(block_table)
    max_entries = int(max_entries)
    if max_entries < 1:
        raise KernelArgumentError(f"max_entries must be >= 1, got {max_entries}")
    num_entries = jnp.where(layer_ok, _int_array(num_entries, "num_entries", (block_table.shape[0],)), 0)
    if _dispatch.choose("gather_all_compressed_kv", implementation, interpret, _arrays(pages)):
        return _all_pallas(pages, block_table, num_entries, layer, max_entries=max_entries, interpret=interpret)
    return _all_reference(pages, block_table, num_entries, layer, max_entries=max_entries)


def gather_swa_kv(
    ring: CompressedEntries,
    slots: Int[Array, " B"],
    positions: Int[Array, " B"],
    *,
    layer: int | Int[Array, ""] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B W D"], Bool[Array, "B W"]]:
    """SWA gather: each request's sliding window from its ring buffer, in order.

    Args:
      ring: the layer's ring buffers, leading shape ``[num_slots, W]``;
        position ``p`` of the request in slot ``s`` is stored at ``[s, p % W]``.
      slots: ``[B]`` int, each request's ring slot (out of range: all invalid).
      positions: ``[B]`` int, the newest position written to each ring (the
        decode token's own position once its entry is written); -1 = empty.
      layer: a stacked ring's layer (``ring`` leading shape ``[L,
        num_slots, W]``), read in place (see :func:`gather_compressed_kv`).

    Returns:
      ``(kv, valid)``: bf16 ``[B, W, nope + rope]`` where, with ``n =
      min(pos + 1, W)``, row ``i < n`` is position ``pos - n + 1 + i`` (oldest
      first) and rows ``i >= n`` are zeros (ring slots not yet written before
      the ring first fills, so never stale data); bool ``[B, W]``.
    """
    _check_pool(ring, "ring", ("num_slots", "window"), layer)
    layer, layer_ok = _layer_index(layer, ring)
    slots = jnp.asarray(slots)
    if slots.ndim != 1:
        raise KernelArgumentError(f"slots must be [batch], got shape {tuple(slots.shape)}")
    slots = _int_array(slots, "slots", slots.shape)
    positions = _int_array(positions, "positions", slots.shape)
    slots = jnp.where(layer_ok, slots, -1)  # a layer outside the stack: every row invalid
    if _dispatch.choose("gather_swa_kv", implementation, interpret, _arrays(ring)):
        return _swa_pallas(ring, slots, positions, layer, interpret=interpret)
    return _swa_reference(ring, slots, positions, layer)


def gather_compressed_kv_reference(pages, block_table, indices, token_rows=None, *, num_entries=None):
    """:func:`gather_compressed_kv` with ``implementation="reference"``."""
    return gather_compressed_kv(pages, block_table, indices, token_rows, num_entries=num_entries,
                                implementation="reference")


def gather_all_compressed_kv_reference(pages, block_table, num_entries, *, max_entries):
    """:func:`gather_all_compressed_kv` with ``implementation="reference"``."""
    return gather_all_compressed_kv(pages, block_table, num_entries, max_entries=max_entries,
                                    implementation="reference")


def gather_swa_kv_reference(ring, slots, positions):
    """:func:`gather_swa_kv` with ``implementation="reference"``."""
    return gather_swa_kv(ring, slots, positions, implementation="reference")
