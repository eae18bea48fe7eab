"""DeepSeek-V4's KV compressor: the pooling arithmetic of CSA and HCA layers.

This is model arithmetic, owned by the DeepSeek-V4 model (its CSA layers
compress every 4 tokens with overlapping windows, its HCA layers every 128):
it sits here, beside the manager, because the cache applies it while
writing, in :meth:`jaxkv.manager.layer_handle.LayerCacheHandle.compress`, and
layers run alloc -> pool -> manager -> nn: the manager may not import
``jaxkv.nn``. A DeepSeek-V4 model under ``jaxkv/nn`` imports it from here (as
the reference layer in ``tests/reference/dsv4_reference.py`` recomputes the
same rule without the cache, to check it).

The rule (a layer with ratio ``r`` and overlap ``o``; rows ``o * r``):
token ``t`` at position ``pos`` brings ``kv[t]`` and ``score[t]``
(``[o * d]``). When ``(pos + 1) % r == 0`` it completes entry
``e = (pos + 1) // r - 1``, which pools the rows of positions
``q in [(e + 1) * r - o * r, (e + 1) * r)``: row ``q`` of window
``k = (q - start) // r`` contributes channel block ``k``; per channel,
``entry = sum_q softmax_q(score) * kv``. Rows before position 0 have score
-inf (they weigh nothing). A model may transform the pooled vector before it
is stored (DeepSeek-V4 applies its RMSNorm, then RoPE at position ``e * r``):
``finish(pooled [T, d], e [T]) -> [T, d]``.

Invariants (checked against the no-cache reference in
``tests/test_hybrid_equivalence.py``):

* a row comes from this step when the same request has a token at that
  position in the step, else from the ring (``q % rows``), so a step of any
  length (decode, chunked prefill) pools exactly what one long step would;
* the ring keeps each request's newest ``rows`` positions; padding tokens
  (slot or position -1) write nothing, and an entry whose block is not in
  the table (not reserved) is dropped, never stored elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from collections.abc import Callable

from jaxtyping import Array, Float, Int

from jaxkv.pool.compressed import store_entries
from kernels_pallas.formats import CompressedEntries

__all__ = ["compress_step", "last_position", "pool_entries"]


def last_position(positions: Int[Array, " T"], request_ids: Int[Array, " T"], num_requests: int) -> Int[Array, " T"]:
    """Each token's request's newest position in this step."""
    newest = jax.ops.segment_max(positions, request_ids, num_segments=num_requests)
    return newest[request_ids]


def compress_step(ring_kv: Float[Array, "slots rows width"], ring_score: Float[Array, "slots rows width"],
                  pool: CompressedEntries, table: Int[Array, "slots M"], slots: Int[Array, " T"],
                  positions: Int[Array, " T"], request_ids: Int[Array, " T"], newest: Int[Array, " T"],
                  kv: Float[Array, "T width"], score: Float[Array, "T width"], *, ratio: int, overlap: int,
                  finish: Callable | None = None, layer=None
                  ) -> tuple[Float[Array, "slots rows width"], Float[Array, "slots rows width"], CompressedEntries]:
    """Advance a compressor by this step's tokens and store completed entries.

    ``slots[t]`` is token ``t``'s request slot (-1 = padding), ``newest`` its
    request's newest position in the step (:func:`last_position`), ``table``
    the layer group's block table. ``finish(pooled, entry_index)`` (static)
    turns each pooled vector into the stored entry (default: stored as
    pooled). ``layer`` (an int or a traced int32): the rings and the pool
    are stacked (``[L, slots, rows, width]``, ``[L, num_blocks, E]``) and
    layer ``layer`` is read and written in place (gathers and scatters at
    ``[layer, ...]``; nothing is sliced out). Returns ``(ring_kv,
    ring_score, pool)``.
    """
    num_tokens, width = kv.shape
    rows = overlap * ratio
    d = width // overlap
    at = () if layer is None else (layer,)  # the leading index of every ring / pool access
    num_slots = ring_kv.shape[len(at)]
    pool_blocks, epb = pool.shape[len(at):]
    active = (slots >= 0) & (positions >= 0)
    completes = active & ((positions + 1) % ratio == 0)

    def pool_and_store(pool):
        """Pool the entry each completing token ends and store it; also returns
        ``[T, 1]`` values computed from every ring row read (see below)."""
        t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
        j = jnp.arange(rows, dtype=jnp.int32)[None, :]
        pos = positions[:, None]
        q = pos + 1 - rows + j  # [T, rows] source positions (only meaningful for completing tokens)
        src = t - (pos - q)
        src_c = jnp.clip(src, 0, num_tokens - 1)
        here = (src >= 0) & (request_ids[src_c] == request_ids[:, None]) & (positions[src_c] == q)
        slot = jnp.clip(slots, 0, num_slots - 1)
        block = jnp.arange(rows, dtype=jnp.int32) // ratio  # row j feeds channel block j // ratio

        def pick(from_step, from_ring):
            """``[T, rows, d]``: each row's channel block, from the step or the
            ring (only that block is gathered: half the bytes with overlap 2)."""
            step_rows = from_step.reshape(num_tokens, overlap, d)[src_c, block]
            split = from_ring.reshape(from_ring.shape[:-2] + (rows, overlap, d))  # a view: no copy
            ring_rows = split[(*at, slot[:, None], q % rows, block)]
            return jnp.where(here[..., None], step_rows, ring_rows)

        src_kv = pick(kv, ring_kv)
        src_score = jnp.where((q >= 0)[..., None], pick(score, ring_score), -jnp.inf)
        # softmax over the rows, weighting kv: normalised once per entry
        # ([T, d]), not per row (a pass over [T, rows, d] less).
        weight = jnp.exp(src_score - jnp.max(src_score, axis=1, keepdims=True))
        entry = jnp.sum(weight * src_kv, axis=1) / jnp.sum(weight, axis=1)  # [T, d]
        e = (positions + 1) // ratio - 1
        if finish is not None:
            entry = finish(entry, jnp.maximum(e, 0))
        page = table[slot, jnp.clip(e // epb, 0, table.shape[1] - 1)]
        store = completes & (page >= 0) & (e // epb < table.shape[1])
        # Rows past the pool (pool_blocks * epb) are dropped by the scatter.
        pool = store_entries(pool, jnp.where(store, page * epb + e % epb, pool_blocks * epb), entry, layer=layer)
        return pool, entry[:, :1].astype(kv.dtype)

    # Only a step in which some token completes an entry needs to pool its
    # rows (a decode step of an HCA layer completes one in 128): skipping
    # saves reading the ring's rows, [T, rows, d] twice. But a branch that
    # updates the pool in place costs a copy of the whole (stacked) pool
    # where XLA:GPU copies a conditional's operand: a predicated cond's
    # always, and, in a program partitioned over a mesh, an index switch's
    # too (DeepSeek-V4-Flash on tp=8: 0.59 GB per CSA layer and step,
    # compiled for H100; docs/gpu.md). So the switch is taken only where the
    # rows it skips outweigh the pool (HCA's: 256 rows against one entry a
    # block); elsewhere every step pools and stores (the stores of entries
    # no token completes are dropped: the same pool). ``read`` depends on
    # every ring row read (see below).
    ring_bytes = 2 * num_tokens * rows * d * 4
    if ring_bytes > sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pool)):
        pool, read = jax.lax.switch(jnp.any(completes).astype(jnp.int32),
                                    [lambda pool: (pool, jnp.zeros((num_tokens, 1), kv.dtype)), pool_and_store],
                                    pool)
    else:
        pool, read = pool_and_store(pool)

    # The ring keeps each request's newest `rows` positions of this step.
    keep = active & (positions > newest - rows)
    ring_slot = jnp.where(keep, slots, num_slots)  # out of range: dropped
    # The rows not kept are dropped, so their values are free: taking them
    # from `read` makes the writes depend on the ring rows read above. XLA's
    # CPU backend otherwise copies the whole ring (twice) to keep the old rows
    # for reads it may not order before the scatters.
    ring_at = (*at, ring_slot, positions % rows)
    ring_kv = ring_kv.at[ring_at].set(jnp.where(keep[:, None], kv, read), mode="drop")
    ring_score = ring_score.at[ring_at].set(jnp.where(keep[:, None], score, read), mode="drop")
    return ring_kv, ring_score, pool


def pool_entries(kv: Float[Array, "T width"], score: Float[Array, "T width"], *, ratio: int, overlap: int,
                 num_entries: int) -> Float[Array, "E d"]:
    """The same rule without a cache: entries ``0 .. num_entries - 1`` of one
    sequence from its per-token rows (positions ``0 .. T - 1``). The
    no-cache forward of a model uses it; :func:`compress_step` must store
    what this returns (the tests check both against an independent
    reference)."""
    num_tokens, width = kv.shape
    d, rows = width // overlap, overlap * ratio
    i = jnp.arange(num_entries, dtype=jnp.int32)[:, None]
    j = jnp.arange(rows, dtype=jnp.int32)[None, :]
    q = (i + 1) * ratio - rows + j  # [E, rows] source positions
    block = jnp.broadcast_to(j // ratio, q.shape)  # window k of the overlap -> channel block k
    qc = jnp.clip(q, 0, num_tokens - 1)
    kv_rows = kv.astype(jnp.float32).reshape(num_tokens, overlap, d)[qc, block]
    score_rows = jnp.where((q >= 0)[..., None],
                           score.astype(jnp.float32).reshape(num_tokens, overlap, d)[qc, block], -jnp.inf)
    return jnp.sum(jax.nn.softmax(score_rows, axis=1) * kv_rows, axis=1)
