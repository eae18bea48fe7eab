"""Exports of jaxkv block tables in the formats of the paged-attention kernels.

jaxkv's block table convention (see the pool layout): ``block_tables`` int32
``[batch, max_pages]``, entry ``j`` of row ``b`` is the page holding tokens
``[j*page_size, (j+1)*page_size)`` of sequence ``b``; entries past the
sequence's ``n_b = ceil(lengths[b] / page_size)`` live pages are -1;
``lengths`` int32 ``[batch]``. Page 0 is the null page: never live, its
contents are garbage.

Three peers read a paged KV cache, each with its own page-table format:

* :func:`pallas_gpu_block_tables` -- ``jax.experimental.pallas.ops.gpu.
  paged_attention``: a dense ``[batch, pages_per_seq]`` table whose width
  satisfies the kernel's divisibility asserts and whose every entry (padding
  included, since the kernel reads whole compute blocks) is a valid page.
* :func:`flashinfer_page_table` -- FlashInfer's CSR table: ``kv_indptr``,
  ``kv_indices``, ``kv_last_page_len``.
* :func:`tpu_ragged_tables` -- ``jax.experimental.pallas.ops.tpu.
  ragged_paged_attention``: ``kv_lens``, ``page_indices``, ``cu_q_lens``,
  ``num_seqs``.

All three are pure and jittable: output shapes depend only on the static
input shapes and static arguments (padded to the static maxima), never on the
values. Device code never raises: a -1 or (with ``num_pages``) out-of-range
entry is exported as the null page 0, so a kernel never reads out of bounds,
and under :func:`jaxkv.checked` the same conditions raise the typed error. On
the host path call :func:`check_block_tables` (and :func:`check_query_lens`)
first: it raises :class:`~jaxkv.errors.InvalidArgument` /
:class:`~jaxkv.errors.InvalidId` naming the sequence, column and numbers.

Preconditions of the exports (what :func:`check_block_tables` verifies):
``0 <= lengths[b] <= max_pages * page_size`` and every live entry
``block_tables[b, j]``, ``j < n_b``, is in ``[1, num_pages)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv import _host
from jaxkv._ops import INT32_MAX, ceil_div
from jaxkv.checks import first_where, require
from jaxkv.errors import InvalidArgument, InvalidId
from jaxkv.types import Array, ArrayLike, Bool, Int

__all__ = [
    "check_block_tables",
    "check_query_lens",
    "flashinfer_page_table",
    "pallas_gpu_block_tables",
    "pallas_gpu_pages_per_seq",
    "tpu_ragged_tables",
]


# ----------------------------------------------------------------- helpers


def _positive(name: str, value: int) -> int:
    """A static positive int argument, or ``InvalidArgument`` at trace time."""
    if int(value) != value or int(value) < 1:
        raise InvalidArgument(f"{name}={value}: must be a positive integer")
    return int(value)


def _as_tables(block_tables: ArrayLike, lengths: ArrayLike) -> tuple[Array, Array]:
    block_tables = jnp.asarray(block_tables, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if block_tables.ndim != 2 or lengths.shape != block_tables.shape[:1]:
        raise InvalidArgument(
            f"block_tables {block_tables.shape} and lengths {lengths.shape}: need "
            f"int32 [batch, max_pages] and [batch]"
        )
    return block_tables, lengths


def _num_live_pages(lengths: Int[Array, "batch"], page_size: int) -> Int[Array, "batch"]:
    """``ceil(lengths / page_size)``: pages holding at least one token (0 for an
    empty or negative length)."""
    return (jnp.maximum(lengths, 0) + page_size - 1) // page_size


def _live_mask(
    block_tables: Int[Array, "batch max_pages"], lengths: Int[Array, "batch"], page_size: int
) -> Bool[Array, "batch max_pages"]:
    """True at the entries that hold tokens (``column < n_b``)."""
    column = jnp.arange(block_tables.shape[1], dtype=jnp.int32)
    return column[None, :] < _num_live_pages(lengths, page_size)[:, None]


def _in_range(block_tables: Int[Array, "..."], num_pages: int | None) -> Bool[Array, "..."]:
    """Entries a kernel may read: ``>= 0`` and, when known, ``< num_pages``."""
    ok = block_tables >= 0
    if num_pages is not None:
        ok &= block_tables < num_pages
    return ok


def _require_valid(
    block_tables: Int[Array, "batch max_pages"],
    lengths: Int[Array, "batch"],
    page_size: int,
    num_pages: int | None,
) -> Bool[Array, "batch max_pages"]:
    """Checked-mode versions of :func:`check_block_tables`; returns the live mask."""
    max_pages = block_tables.shape[1]
    capacity = max_pages * page_size
    require(jnp.all((lengths >= 0) & (lengths <= capacity)), InvalidArgument,
            f"length {{}} outside [0, {capacity}] ({max_pages} table columns of {page_size} tokens)",
            first_where(lengths, (lengths < 0) | (lengths > capacity)))
    live = _live_mask(block_tables, lengths, page_size)
    upper = num_pages if num_pages is not None else INT32_MAX
    bad = live & ((block_tables < 1) | (block_tables >= upper))
    require(~jnp.any(bad), InvalidId,
            f"live block-table entry: page id {{}} outside [1, {upper}) (page 0 is the null page)",
            first_where(block_tables, bad))
    return live


# ------------------------------------------------------- Pallas GPU (Triton)


def pallas_gpu_pages_per_seq(max_pages: int, *, pages_per_compute_block: int = 8, k_splits: int = 16) -> int:
    """Smallest table width ``>= max(max_pages, 1)`` accepted by JAX's Pallas GPU
    ``paged_attention`` with these ``pages_per_compute_block`` and ``k_splits``.

    The kernel asserts ``pages_per_seq % k_splits == 0`` and, with
    ``pages_per_partition = pages_per_seq // k_splits`` and
    ``block = min(pages_per_partition, pages_per_compute_block)`` (it clamps
    the compute block to the partition), ``pages_per_partition % block == 0``.
    So the width is ``k_splits * ppp`` with ``ppp >= 1`` and either
    ``ppp <= pages_per_compute_block`` or ``ppp % pages_per_compute_block == 0``.
    A width of 0 is never returned (the kernel would divide by zero).
    """
    ppcb = _positive("pages_per_compute_block", pages_per_compute_block)
    splits = _positive("k_splits", k_splits)
    ppp = max(ceil_div(int(max_pages), splits), 1)
    if ppp > ppcb:
        ppp = ceil_div(ppp, ppcb) * ppcb
    return splits * ppp


def pallas_gpu_block_tables(
    block_tables: Int[ArrayLike, "batch max_pages"],
    lengths: Int[ArrayLike, "batch"],
    *,
    pages_per_compute_block: int = 8,
    k_splits: int = 16,
    page_size: int | None = None,
    num_pages: int | None = None,
) -> tuple[Int[Array, "batch pages_per_seq"], Int[Array, "batch"]]:
    """Block tables for ``jax.experimental.pallas.ops.gpu.paged_attention``.

    Pass the same ``pages_per_compute_block`` and ``k_splits`` to the kernel.

    Returns ``(tables, lengths)``:
        tables: int32 ``[batch, pages_per_seq]`` with ``pages_per_seq =``
            :func:`pallas_gpu_pages_per_seq` ``(max_pages, ...)``. Columns
            ``< max_pages`` are ``block_tables``; every -1, every entry outside
            ``[0, num_pages)`` (when ``num_pages`` is given), every entry past
            the live pages (when ``page_size`` is given) and every added
            column is the null page 0. So every entry is in ``[0, P)``, as the
            kernel requires: it loads whole compute blocks of pages and masks
            tokens ``>= length`` only after the load.
        lengths: int32 ``[batch]``, the input lengths unchanged (the kernel
            masks with them).

    Invariant: for ``t < lengths[b]`` the kernel's page for token ``t`` is
    ``tables[b, t // ps] == block_tables[b, t // ps]`` (given the
    preconditions of the module).

    Caveat of the peer: a masked logit gets weight exactly 0 but the kernel
    still multiplies that 0 by the V rows it loaded, so NaN/Inf garbage in the
    null page (or in the tail of a sequence's last page) leaks NaN into the
    output. Keep page 0 finite when using this kernel.
    """
    block_tables, lengths = _as_tables(block_tables, lengths)
    max_pages = block_tables.shape[1]
    width = pallas_gpu_pages_per_seq(max_pages, pages_per_compute_block=pages_per_compute_block, k_splits=k_splits)
    keep = _in_range(block_tables, num_pages)
    if page_size is not None:
        keep &= _require_valid(block_tables, lengths, _positive("page_size", page_size), num_pages)
    tables = jnp.where(keep, block_tables, 0)
    tables = jnp.pad(tables, ((0, 0), (0, width - max_pages)))
    return tables, lengths


# --------------------------------------------------------------- FlashInfer


def flashinfer_page_table(
    block_tables: Int[ArrayLike, "batch max_pages"],
    lengths: Int[ArrayLike, "batch"],
    page_size: int,
    *,
    num_pages: int | None = None,
) -> tuple[Int[Array, "batch+1"], Int[Array, "batch*max_pages"], Int[Array, "batch"]]:
    """FlashInfer's CSR page table (``BatchDecodeWithPagedKVCacheWrapper.plan``
    / ``BatchPrefillWithPagedKVCacheWrapper.plan`` arguments).

    Returns ``(kv_indptr, kv_indices, kv_last_page_len)``, all int32:
        kv_indptr: ``[batch + 1]``, ``kv_indptr[0] == 0``,
            ``kv_indptr[b+1] - kv_indptr[b] == n_b = ceil(lengths[b] / page_size)``.
        kv_indices: ``[batch * max_pages]`` (static size; FlashInfer reads only
            the first ``kv_indptr[-1]``). ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]
            == block_tables[b, :n_b]``; entries from ``kv_indptr[-1]`` on are 0
            (the null page), never -1. Slice with ``kv_indptr[-1]`` on the host
            if the peer wants an exact-length array.
        kv_last_page_len: ``[batch]``, tokens in the last page:
            ``lengths[b] - (n_b - 1) * page_size``, in ``1 .. page_size``.

    A length-0 sequence has 0 pages and ``kv_last_page_len == page_size``
    (vLLM's ``seq_len % page_size or page_size``). FlashInfer ignores the last
    page length of a sequence with no pages, and with this choice the identity
    ``lengths[b] == (n_b - 1) * page_size + kv_last_page_len[b]`` holds for
    every row, empty ones included, and every entry is in ``1 .. page_size``.

    Out-of-range live entries (-1, or outside ``[0, num_pages)`` when
    ``num_pages`` is given) are exported as 0. Lengths above
    ``max_pages * page_size`` are a precondition violation: ``n_b`` is then
    capped at ``max_pages`` (so the CSR arrays stay in bounds).
    """
    page_size = _positive("page_size", page_size)
    block_tables, lengths = _as_tables(block_tables, lengths)
    batch, max_pages = block_tables.shape
    live = _require_valid(block_tables, lengths, page_size, num_pages)
    pages = jnp.minimum(_num_live_pages(lengths, page_size), max_pages)
    kv_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(pages, dtype=jnp.int32)])
    # Live entry (b, j) goes to kv_indptr[b] + j; the rest to an index past the
    # end, which the scatter drops. Targets are distinct, so the order of
    # writes is irrelevant.
    column = jnp.arange(max_pages, dtype=jnp.int32)
    target = jnp.where(live, kv_indptr[:-1, None] + column[None, :], batch * max_pages)
    values = jnp.where(_in_range(block_tables, num_pages), block_tables, 0)
    kv_indices = jnp.zeros((batch * max_pages,), jnp.int32).at[target.reshape(-1)].set(
        values.reshape(-1), mode="drop", unique_indices=True
    )
    kv_last_page_len = jnp.maximum(lengths, 0) - (pages - 1) * page_size
    kv_last_page_len = jnp.clip(kv_last_page_len, 1, page_size)
    return kv_indptr, kv_indices, kv_last_page_len


# ------------------------------------------------------ TPU ragged attention


def tpu_ragged_tables(
    block_tables: Int[ArrayLike, "batch max_pages"],
    lengths: Int[ArrayLike, "batch"],
    query_lens: Int[ArrayLike, "batch"],
    page_size: int,
    *,
    num_pages: int | None = None,
) -> tuple[Int[Array, "batch"], Int[Array, "batch max_pages"], Int[Array, "batch+1"], Int[Array, "1"]]:
    """Arguments of ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``
    (and its ``ref_ragged_paged_attention``).

    ``query_lens[b]`` is the number of new query tokens of sequence ``b`` (1
    for decode); they are the last ``query_lens[b]`` of its ``lengths[b]``
    tokens (the peer's causal mask puts query ``i`` at position
    ``kv_len - q_len + i``), so ``0 <= query_lens[b] <= lengths[b]``
    (:func:`check_query_lens`). The queries array handed to the kernel holds
    the rows' query tokens back to back, row ``b`` at
    ``[cu_q_lens[b], cu_q_lens[b+1])``.

    Returns ``(kv_lens, page_indices, cu_q_lens, num_seqs)``, all int32:
        kv_lens: ``[batch]``, ``lengths``.
        page_indices: ``[batch, max_pages]``, ``block_tables`` with every entry
            past the live pages, every -1 and (with ``num_pages``) every entry
            outside ``[0, num_pages)`` replaced by the null page 0.
        cu_q_lens: ``[batch + 1]``, ``[0, cumsum(query_lens)]``.
        num_seqs: ``[1]``, ``batch``: every row is a sequence; a row with
            ``query_lens == 0`` contributes no query tokens (an idle slot has
            ``lengths == query_lens == 0``).

    The KV pages for this peer are ``[P, page_size, 2 * KVH, D]`` with K of
    head ``h`` at combined head ``2h`` and V at ``2h + 1`` (jaxkv's pool keeps
    K and V apart as ``[KVH, P, page_size, D]``; interleave them to call it).
    """
    page_size = _positive("page_size", page_size)
    block_tables, lengths = _as_tables(block_tables, lengths)
    batch, _ = block_tables.shape
    query_lens = jnp.asarray(query_lens, jnp.int32)
    if query_lens.shape != (batch,):
        raise InvalidArgument(f"query_lens {query_lens.shape}: need [{batch}] like lengths")
    live = _require_valid(block_tables, lengths, page_size, num_pages)
    require(jnp.all((query_lens >= 0) & (query_lens <= lengths)), InvalidArgument,
            "query length {} outside [0, length of its sequence]",
            first_where(query_lens, (query_lens < 0) | (query_lens > lengths)))
    page_indices = jnp.where(live & _in_range(block_tables, num_pages), block_tables, 0)
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
    num_seqs = jnp.full((1,), batch, jnp.int32)
    return lengths, page_indices, cu_q_lens, num_seqs


# --------------------------------------------------------------- host checks


def check_block_tables(block_tables, lengths, page_size: int, num_pages: int) -> None:
    """Host validation of a block table before exporting it (numpy, no device
    call). Raises, with the numbers in the message:

    * ``InvalidArgument``: shapes other than ``[batch, max_pages]`` /
      ``[batch]``, ``page_size < 1``, ``num_pages < 2``, a negative length,
      or a length needing more pages than the table has columns
      (``ceil(length / page_size) > max_pages``);
    * ``InvalidId`` (``ids`` = the offending entries): a live entry
      (``column < ceil(length / page_size)``) that is -1 or outside
      ``[1, num_pages)`` -- page 0 is the null page and is never live.

    Entries past the live pages are not inspected (-1 by convention, but a
    manager may keep reserved pages there).
    """
    block_tables = np.asarray(block_tables)
    lengths = np.asarray(lengths)
    if block_tables.ndim != 2 or lengths.shape != block_tables.shape[:1]:
        raise InvalidArgument(
            f"block_tables {block_tables.shape} and lengths {lengths.shape}: need "
            f"[batch, max_pages] and [batch]"
        )
    if int(page_size) < 1:
        raise InvalidArgument(f"page_size={page_size}: must be >= 1")
    if int(num_pages) < 2:
        raise InvalidArgument(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
    block_tables = block_tables.astype(np.int64)
    lengths = lengths.astype(np.int64)
    max_pages = block_tables.shape[1]
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        b = int(negative[0])
        raise InvalidArgument(
            f"sequence {b} has negative length {int(lengths[b])} "
            f"({negative.size} negative length(s) in all)"
        )
    pages = ceil_div(lengths, int(page_size))
    over = np.flatnonzero(pages > max_pages)
    if over.size:
        b = int(over[0])
        raise InvalidArgument(
            f"sequence {b} has length {int(lengths[b])}, needing {int(pages[b])} pages of "
            f"{int(page_size)} tokens, but the block table has {max_pages} columns "
            f"(capacity {max_pages * int(page_size)} tokens; {over.size} sequence(s) too long)"
        )
    live = np.arange(max_pages)[None, :] < pages[:, None]
    bad = live & ((block_tables < 1) | (block_tables >= int(num_pages)))
    if bad.any():
        rows, cols = np.nonzero(bad)
        b, j = int(rows[0]), int(cols[0])
        ids = np.unique(block_tables[bad])
        raise InvalidId(
            f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is a live entry "
            f"(sequence {b} has length {int(lengths[b])}, {int(pages[b])} pages of "
            f"{int(page_size)}) but not a page in [1, {int(num_pages)}) (page 0 is the null page, "
            f"-1 means no page); offending ids {_host.preview(ids)} in {int(bad.sum())} live entries",
            ids,
        )


def check_query_lens(query_lens, lengths) -> None:
    """Host validation of :func:`tpu_ragged_tables`'s ``query_lens``: shape
    ``[batch]`` like ``lengths`` and ``0 <= query_lens[b] <= lengths[b]`` (the
    query tokens are the last tokens of the sequence). Raises
    ``InvalidArgument`` naming the first offending sequence."""
    query_lens = np.asarray(query_lens).astype(np.int64)
    lengths = np.asarray(lengths).astype(np.int64)
    if query_lens.shape != lengths.shape or query_lens.ndim != 1:
        raise InvalidArgument(f"query_lens {query_lens.shape} and lengths {lengths.shape}: need [batch] each")
    bad = np.flatnonzero((query_lens < 0) | (query_lens > lengths))
    if bad.size:
        b = int(bad[0])
        raise InvalidArgument(
            f"sequence {b} has query length {int(query_lens[b])} outside [0, {int(lengths[b])}] "
            f"(its length); {bad.size} sequence(s) in all"
        )
