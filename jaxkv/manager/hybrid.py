"""KVCacheManager and LayerCacheHandle: the hybrid cache of seed 004, in JAX.

One pytree owns every cache array of a hybrid model (DeepSeek-V4-style
SWA/CSA/HCA layers, full-attention and MLA layers, Gated DeltaNet layers; see
:mod:`jaxkv.manager.hybrid_schema` for what each kind stores). All operations
are pure and jittable, including admission and release, so a whole serving
loop (admit, decode, release) can run inside one ``lax.scan``:

* :meth:`KVCacheManager.admit` takes request slots and resets their state in
  every layer;
* :meth:`KVCacheManager.reserve` advances requests by ``num_new`` tokens and
  allocates, in every group, the blocks those tokens need: a compressed
  layer gets a new block exactly when a request's completed entries cross a
  block boundary (every 128 original tokens), a full-attention layer every
  ``page_size`` tokens. All or nothing across groups;
* :meth:`KVCacheManager.acquire` builds a :class:`LayerCacheHandle` for one
  layer's forward pass: no allocation, no host sync (the seed's "inside the
  captured graph" contract);
* :meth:`KVCacheManager.update` puts the arrays a handle wrote back;
* :meth:`KVCacheManager.release` returns slots and every block of every
  layer, and resets the slots' state.

Slot ids ``1 .. max_reqs`` index every per-request array (slot 0 is padding,
as in :class:`~jaxkv.ReqToTokenPool` and :class:`~jaxkv.GDNPool`).
Invariants (checked by the tests after every operation): each group's
``tables[s, :lens[s]]`` are the blocks slot ``s`` holds, each once, and
entries past ``lens[s]`` are -1; a free slot holds no block, ``seq_lens`` 0,
compressor rings at their initial value and zeroed SWA rings and GDN state;
allocated + free blocks = total in every group; a failed operation changes
nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv import _host
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerCacheSchema,
    LayerSpec,
    block_budget,
    build_schemas,
)
from jaxkv.pool.gdn_pool import GDNPool
from jaxkv.pool.kv_pool import KVPool
from jaxkv.types import Ok
# Submodules, not the package: ``kernels_pallas`` imports ``jaxkv`` first.
from kernels_pallas.formats import CompressedEntries
from kernels_pallas.gather import gather_all_compressed_kv, gather_compressed_kv, gather_swa_kv
from kernels_pallas.paged_attention import paged_attention

__all__ = ["BlockGroup", "CompressedLayerCache", "KVCacheManager", "LayerCacheHandle"]

_V4_KINDS = (AttentionKind.SWA, AttentionKind.CSA, AttentionKind.HCA)


def _select(ok, new, old):
    """``new`` where ``ok`` else ``old``, leaf by leaf (small pytrees only)."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _drop(keep, ids, size):
    """``ids`` where ``keep``, else ``size`` (an index that scatters drop)."""
    return jnp.where(keep, ids, size)


# --------------------------------------------------------------------------
# Block groups.
# --------------------------------------------------------------------------


@struct.dataclass
class BlockGroup:
    """Blocks of one group of layers (same kind and ratio) and their table.

    Fields:
      allocator: the group's blocks, ``1 .. num_blocks - 1`` (0 = null).
      tables: int32 ``[num_slots, max_blocks]``; ``tables[s, :lens[s]]`` are
        slot ``s``'s blocks in order, -1 after.
      lens: int32 ``[num_slots]``, blocks held per slot.
      tokens_per_entry, entries_per_block: static (compressed: ratio and
        128 / ratio; full/MLA: 1 and page_size).
    """

    allocator: BlockAllocator
    tables: Int[Array, "slots max_blocks"]
    lens: Int[Array, " slots"]
    tokens_per_entry: int = struct.field(pytree_node=False)
    entries_per_block: int = struct.field(pytree_node=False)

    @classmethod
    def create(cls, num_blocks, num_slots, max_blocks, tokens_per_entry, entries_per_block):
        return cls(allocator=BlockAllocator.create(num_blocks),
                   tables=jnp.full((num_slots, max_blocks), -1, jnp.int32),
                   lens=jnp.zeros((num_slots,), jnp.int32),
                   tokens_per_entry=tokens_per_entry, entries_per_block=entries_per_block)

    @property
    def tokens_per_block(self) -> int:
        return self.tokens_per_entry * self.entries_per_block

    def blocks_for(self, seq_lens):
        """Blocks needed once ``seq_lens`` tokens are processed: enough for
        every *completed* entry (``seq_len // tokens_per_entry``)."""
        entries = seq_lens // self.tokens_per_entry
        return (entries + self.entries_per_block - 1) // self.entries_per_block

    def grow(self, slots, new_lens, max_new: int):
        """Give each row of ``slots`` (-1 = padding) the blocks ``new_lens``
        needs. Returns ``(group, ok)``; fails (unchanged) when a row needs more
        than ``max_new`` blocks, more than the table holds, or more than are free."""
        rows = jnp.clip(slots, 0, self.lens.shape[0] - 1)
        active = slots >= 0
        have = self.lens[rows]
        need = jnp.where(active, jnp.maximum(self.blocks_for(new_lens) - have, 0), 0)
        fits = jnp.all((need <= max_new) & (have + need <= self.tables.shape[1]))
        total = jnp.sum(need)
        batch = slots.shape[0]
        allocator, ids, ok = self.allocator.acquire(jnp.where(fits, total, 0), max_n=batch * max_new)
        ok = ok & fits
        # Row b takes ids[offset_b : offset_b + need_b] into columns have_b + j.
        offset = jnp.cumsum(need) - need
        j = jnp.arange(max_new, dtype=jnp.int32)[None, :]
        take = ok & (j < need[:, None])
        new_ids = ids[jnp.clip(offset[:, None] + j, 0, batch * max_new - 1)]
        target_rows = _drop(take, rows[:, None], self.lens.shape[0])
        tables = self.tables.at[target_rows, have[:, None] + j].set(new_ids, mode="drop")
        lens = self.lens.at[_drop(ok & active, rows, self.lens.shape[0])].add(need, mode="drop")
        return self.replace(allocator=allocator, tables=tables, lens=lens), ok

    def release_rows(self, slots):
        """Return every block of ``slots`` (-1 ignored; distinct, held slots)."""
        rows = jnp.clip(slots, 0, self.lens.shape[0] - 1)
        col = jnp.arange(self.tables.shape[1], dtype=jnp.int32)[None, :]
        held = (slots[:, None] >= 0) & (col < self.lens[rows][:, None])
        blocks = jnp.where(held, self.tables[rows], -1)
        allocator, ok = self.allocator.release(blocks, distinct=True)
        cleared = _drop(slots >= 0, rows, self.lens.shape[0])
        return self.replace(allocator=allocator, tables=self.tables.at[cleared].set(-1, mode="drop"),
                            lens=self.lens.at[cleared].set(0, mode="drop")), ok


# --------------------------------------------------------------------------
# Per-layer arrays of the DeepSeek-V4 kinds.
# --------------------------------------------------------------------------


@struct.dataclass
class CompressedLayerCache:
    """The arrays of one SWA / CSA / HCA layer (None where the kind has none).

    Fields:
      swa: the SWA rings, ``[num_slots, window]`` entries (position ``p`` of
        slot ``s`` at ``[s, p % window]``).
      entries: compressed entries, ``[num_blocks, entries_per_block]``
        (entry ``i`` of slot ``s`` at ``[tables[s, i // E], i % E]``).
      index_keys: CSA indexer keys, same layout as ``entries``.
      comp_kv, comp_score: float32 ``[num_slots, rows, width]`` compressor
        ring (initial 0 and -inf).
      index_kv, index_score: the indexer's compressor ring (CSA).
    """

    swa: CompressedEntries
    entries: CompressedEntries | None = None
    index_keys: CompressedEntries | None = None
    comp_kv: Float[Array, "slots rows width"] | None = None
    comp_score: Float[Array, "slots rows width"] | None = None
    index_kv: Float[Array, "slots rows iwidth"] | None = None
    index_score: Float[Array, "slots rows iwidth"] | None = None

    @classmethod
    def create(cls, schema: LayerCacheSchema, num_slots: int, num_blocks: int) -> "CompressedLayerCache":
        swa = CompressedEntries.zeros(schema.entry_format, (num_slots, schema.window))
        if schema.group is None:
            return cls(swa=swa)
        paged = (num_blocks, schema.entries_per_block)
        ring = (num_slots, schema.compressor_rows)
        fields = dict(entries=CompressedEntries.zeros(schema.entry_format, paged),
                      comp_kv=jnp.zeros(ring + (schema.compressor_width,), jnp.float32),
                      comp_score=jnp.full(ring + (schema.compressor_width,), -jnp.inf, jnp.float32))
        if schema.index_format is not None:
            fields.update(index_keys=CompressedEntries.zeros(schema.index_format, paged),
                          index_kv=jnp.zeros(ring + (schema.index_compressor_width,), jnp.float32),
                          index_score=jnp.full(ring + (schema.index_compressor_width,), -jnp.inf, jnp.float32))
        return cls(swa=swa, **fields)

    def reset(self, targets) -> "CompressedLayerCache":
        """Initial state for slots ``targets`` (out-of-range entries dropped)."""
        def zero_rows(entries):
            return entries.replace(nope=entries.nope.at[targets].set(0, mode="drop"),
                                   scales=entries.scales.at[targets].set(entries.fmt.unit_scale, mode="drop"),
                                   rope=entries.rope.at[targets].set(0, mode="drop"))

        out = self.replace(swa=zero_rows(self.swa))
        for kv, score in (("comp_kv", "comp_score"), ("index_kv", "index_score")):
            if getattr(self, kv) is not None:
                out = out.replace(**{kv: getattr(self, kv).at[targets].set(0.0, mode="drop"),
                                     score: getattr(self, score).at[targets].set(-jnp.inf, mode="drop")})
        return out


# --------------------------------------------------------------------------
# Writes shared by the handle (pure functions of arrays).
# --------------------------------------------------------------------------


def _last_position(positions, request_ids, num_requests):
    """Each token's request's newest position in this step."""
    newest = jax.ops.segment_max(positions, request_ids, num_segments=num_requests)
    return newest[request_ids]


def _store_entries(pool: CompressedEntries, rows, values) -> CompressedEntries:
    """Quantize ``values [n, D]`` and store them at flat pool rows (rows past
    the pool are dropped)."""
    q = CompressedEntries.quantize(values, pool.fmt)
    lead = pool.shape

    def put(arr, new):
        flat = arr.reshape(math.prod(lead), arr.shape[-1]).at[rows].set(new, mode="drop")
        return flat.reshape(*lead, arr.shape[-1])

    return pool.replace(nope=put(pool.nope, q.nope), scales=put(pool.scales, q.scales),
                        rope=put(pool.rope, q.rope))


def _compress(ring_kv, ring_score, pool, table, slots, positions, request_ids, newest, kv, score,
              *, ratio, overlap):
    """Advance a compressor by this step's tokens and store completed entries.

    Token ``t`` (slot ``slots[t]``, position ``positions[t]``) brings ``kv[t]``
    and ``score[t]`` (``[overlap * d]``). When ``(pos + 1) % ratio == 0`` it
    completes entry ``e = (pos + 1) // ratio - 1``, which pools the rows of
    positions ``q in [(e + 1) * ratio - overlap * ratio, (e + 1) * ratio)``:
    row ``q`` of window ``k = (q - start) // ratio`` contributes channel block
    ``k``; per channel, ``entry = sum_q softmax_q(score) * kv``. A row comes
    from this step when the same request has a token at ``q`` here, else from
    the ring (``q % rows``; rows before position 0 have score -inf).
    """
    num_tokens, width = kv.shape
    rows = overlap * ratio
    d = width // overlap
    t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    j = jnp.arange(rows, dtype=jnp.int32)[None, :]
    pos = positions[:, None]
    q = pos + 1 - rows + j  # [T, rows] source positions (only meaningful for completing tokens)
    src = t - (pos - q)
    src_c = jnp.clip(src, 0, num_tokens - 1)
    here = (src >= 0) & (request_ids[src_c] == request_ids[:, None]) & (positions[src_c] == q)
    slot = jnp.clip(slots, 0, ring_kv.shape[0] - 1)[:, None]
    block = jnp.broadcast_to(j // ratio, q.shape)  # channel block of each source row

    def pick(from_step, from_ring):
        step_rows = from_step[src_c].reshape(num_tokens, rows, overlap, d)
        ring_rows = from_ring[slot, q % rows].reshape(num_tokens, rows, overlap, d)
        both = jnp.where(here[..., None, None], step_rows, ring_rows)
        return jnp.take_along_axis(both, block[..., None, None], axis=2)[:, :, 0]  # [T, rows, d]

    src_kv = pick(kv, ring_kv)
    src_score = jnp.where((q >= 0)[..., None], pick(score, ring_score), -jnp.inf)
    weights = jax.nn.softmax(src_score, axis=1)
    entry = jnp.sum(weights * src_kv, axis=1)  # [T, d]

    active = (slots >= 0) & (positions >= 0)
    completes = active & ((positions + 1) % ratio == 0)
    e = (positions + 1) // ratio - 1
    epb = pool.shape[1]
    page = table[slot[:, 0], jnp.clip(e // epb, 0, table.shape[1] - 1)]
    store = completes & (page >= 0) & (e // epb < table.shape[1])
    pool_rows = _drop(store, page * epb + e % epb, pool.shape[0] * epb)
    pool = _store_entries(pool, pool_rows, entry)

    # The ring keeps each request's newest `rows` positions of this step.
    keep = active & (positions > newest - rows)
    ring_slot = _drop(keep, slots, ring_kv.shape[0])
    ring_kv = ring_kv.at[ring_slot, positions % rows].set(kv, mode="drop")
    ring_score = ring_score.at[ring_slot, positions % rows].set(score, mode="drop")
    return ring_kv, ring_score, pool


# --------------------------------------------------------------------------
# The handle.
# --------------------------------------------------------------------------


@struct.dataclass
class LayerCacheHandle:
    """One layer's view of the cache for one forward step (a pytree).

    Built by :meth:`KVCacheManager.acquire`; nothing is allocated. Reads
    return data; writes return a new handle, which
    :meth:`KVCacheManager.update` puts back into the manager.

    Fields:
      request_slots: int32 ``[B]`` slot of each request of the batch (-1 =
        padding).
      positions: int32 ``[T]`` position of each token of the step.
      request_ids: int32 ``[T]`` batch row of each token; a request's tokens
        are consecutive positions (one per request when decoding).
      cache: the layer's :class:`CompressedLayerCache` (SWA/CSA/HCA layers).
      kv_pool: the :class:`~jaxkv.KVPool` of the full or MLA layers, used at
        layer ``kv_layer`` (full/MLA layers).
      gdn: the :class:`~jaxkv.GDNPool`, used at layer ``gdn_layer`` (linear).
      block_table, block_lens: the layer's group (``[num_slots, M]``, ``[num_slots]``).
      schema: the layer's :class:`LayerCacheSchema` (static).
      implementation: kernel choice passed to the gathers and attention (static).
    """

    request_slots: Int[Array, " B"]
    positions: Int[Array, " T"]
    request_ids: Int[Array, " T"]
    cache: CompressedLayerCache | None
    kv_pool: KVPool | None
    gdn: GDNPool | None
    block_table: Int[Array, "slots M"] | None
    block_lens: Int[Array, " slots"] | None
    schema: LayerCacheSchema = struct.field(pytree_node=False)
    kv_layer: int = struct.field(pytree_node=False, default=-1)
    gdn_layer: int = struct.field(pytree_node=False, default=-1)
    implementation: str | None = struct.field(pytree_node=False, default=None)

    # ---------------------------------------------------------------- tokens

    @property
    def token_slots(self) -> Int[Array, " T"]:
        """Slot of each token (-1 for padding rows)."""
        return self.request_slots[self.request_ids]

    def num_entries(self) -> Int[Array, " T"]:
        """Compressed entries each token may see: ``(pos + 1) // ratio`` (the
        causal rule; entries completed by later tokens are excluded)."""
        return jnp.maximum(self.positions + 1, 0) // self.schema.compress_ratio

    def _newest(self):
        return _last_position(self.positions, self.request_ids, self.request_slots.shape[0])

    def _need(self, what: str, ok: bool):
        if not ok:
            raise InvalidArgument(f"layer {self.schema.layer_idx} ({self.schema.kind.value}) has no {what}")

    def _check_rows(self, name: str, x, width: int):
        if x.shape != (self.positions.shape[0], width):
            raise InvalidArgument(f"layer {self.schema.layer_idx}: {name} must be [{self.positions.shape[0]} tokens, "
                                  f"{width}], got {list(x.shape)}")

    # ---------------------------------------------------------------- SWA

    def write_swa(self, kv: Float[Array, "T D"]) -> "LayerCacheHandle":
        """Store each token's entry (quantized) in its request's SWA ring.
        Of a request's tokens in this step only the newest ``window`` are
        kept (older ones would be overwritten anyway)."""
        self._need("SWA ring", self.cache is not None)
        ring = self.cache.swa
        self._check_rows("kv", kv, ring.fmt.head_dim)
        num_slots, window = ring.shape
        active = (self.token_slots >= 0) & (self.positions >= 0) & (self.positions > self._newest() - window)
        rows = _drop(active, self.token_slots * window + self.positions % window, num_slots * window)
        return self.replace(cache=self.cache.replace(swa=_store_entries(ring, rows, kv)))

    def gather_swa(self, kv: Float[Array, "T D"] | None = None
                   ) -> tuple[Float[Array, "T W D"], Bool[Array, "T W"]]:
        """Each token's window ``(pos - W, pos]``, oldest first, dequantized
        to bf16, with its validity mask (rows before position 0 are invalid).

        Two ways to call it:

        * ``gather_swa(kv)`` with this step's entries ``kv [T, D]``, *before*
          :meth:`write_swa`: exact for any step, also one with many tokens
          per request (chunked prefill): rows of earlier steps come from the
          ring (:func:`kernels_pallas.gather_swa_kv`), rows of this step from
          ``kv`` rounded through the entry format exactly as the ring stores
          them.
        * ``gather_swa()`` *after* :meth:`write_swa`: the decode fast path,
          exact for one token per request. With several tokens of a request
          in the step, ring rows that a later token of the step overwrote
          come back invalid.
        """
        self._need("SWA ring", self.cache is not None)
        ring = self.cache.swa
        window = ring.shape[1]
        i = jnp.arange(window, dtype=jnp.int32)[None, :]
        count = jnp.clip(self.positions + 1, 0, window)[:, None]
        row_pos = self.positions[:, None] - count + 1 + i  # position of output row i
        if kv is None:
            out, valid = gather_swa_kv(ring, self.token_slots, self.positions, implementation=self.implementation)
            fresh = row_pos > (self._newest() - window)[:, None]
            return jnp.where(fresh[..., None], out, 0).astype(out.dtype), valid & fresh
        self._check_rows("kv", kv, ring.fmt.head_dim)
        # First position of each token's request in this step: the ring holds
        # everything before it (still unwritten by this step). Padding tokens
        # (-1) in the request's row are not among its tokens.
        real = (self.token_slots >= 0) & (self.positions >= 0)
        first = -jax.ops.segment_max(jnp.where(real, -self.positions, -jnp.iinfo(jnp.int32).max),
                                     self.request_ids, num_segments=self.request_slots.shape[0])[self.request_ids]
        old, old_valid = gather_swa_kv(ring, self.token_slots, first - 1, implementation=self.implementation)
        old_count = jnp.clip(first, 0, window)[:, None]  # old row j holds position first - old_count + j
        j = jnp.clip(row_pos - (first[:, None] - old_count), 0, window - 1)
        from_ring = jnp.take_along_axis(old, j[..., None], axis=1)
        ring_ok = jnp.take_along_axis(old_valid, j, axis=1)
        step_rows = CompressedEntries.quantize(kv, ring.fmt).dequantize()  # the ring's rounding
        t = jnp.arange(self.positions.shape[0], dtype=jnp.int32)[:, None]
        src = jnp.clip(t - (self.positions[:, None] - row_pos), 0, self.positions.shape[0] - 1)
        in_step = row_pos >= first[:, None]
        out = jnp.where(in_step[..., None], step_rows[src], from_ring)
        valid = (i < count) & (self.token_slots >= 0)[:, None] & jnp.where(in_step, True, ring_ok)
        return jnp.where(valid[..., None], out, 0).astype(out.dtype), valid

    # ---------------------------------------------------------------- compressed

    def _token_tables(self):
        rows = jnp.clip(self.token_slots, 0, self.block_table.shape[0] - 1)
        return jnp.where((self.token_slots >= 0)[:, None], self.block_table[rows], -1)

    def compress(self, kv: Float[Array, "T W"], score: Float[Array, "T W"]) -> "LayerCacheHandle":
        """Advance the layer's compressor by this step's tokens (``kv`` and
        ``score`` ``[T, overlap * head_dim]``, float32) and store every entry
        they complete, quantized, through the block table (see ``_compress``
        for the pooling rule). :meth:`KVCacheManager.reserve` must have
        allocated the blocks."""
        self._need("compressor", self.cache is not None and self.cache.comp_kv is not None)
        return self._advance(kv, score, self.schema.compressor_width, "comp_kv", "comp_score", "entries")

    def compress_index(self, kv: Float[Array, "T Wi"], score: Float[Array, "T Wi"]) -> "LayerCacheHandle":
        """The same for the CSA indexer's keys (``[T, overlap * index_dim]``)."""
        self._need("indexer", self.cache is not None and self.cache.index_kv is not None)
        return self._advance(kv, score, self.schema.index_compressor_width, "index_kv", "index_score", "index_keys")

    def _advance(self, kv, score, width, ring_kv, ring_score, pool):
        for name, x in (("kv", kv), ("score", score)):
            self._check_rows(name, x, width)
        c = self.cache
        new_kv, new_score, new_pool = _compress(
            getattr(c, ring_kv), getattr(c, ring_score), getattr(c, pool), self.block_table, self.token_slots,
            self.positions, self.request_ids, self._newest(), kv.astype(jnp.float32), score.astype(jnp.float32),
            ratio=self.schema.compress_ratio, overlap=self.schema.overlap)
        return self.replace(cache=c.replace(**{ring_kv: new_kv, ring_score: new_score, pool: new_pool}))

    def gather_compressed(self, indices: Int[Array, "T K"]) -> tuple[Float[Array, "T K D"], Bool[Array, "T K"]]:
        """CSA: each token's selected entries (-1 = none), causally limited
        (:func:`kernels_pallas.gather_compressed_kv`)."""
        self._need("compressed entries", self.cache is not None and self.cache.entries is not None)
        return gather_compressed_kv(self.cache.entries, self.block_table, indices,
                                    jnp.clip(self.token_slots, 0, None),
                                    num_entries=jnp.where(self.token_slots >= 0, self.num_entries(), 0),
                                    implementation=self.implementation)

    def gather_all_compressed(self, max_entries: int) -> tuple[Float[Array, "T N D"], Bool[Array, "T N"]]:
        """HCA: every entry each token may see, in order, padded to ``max_entries``."""
        self._need("compressed entries", self.cache is not None and self.cache.entries is not None)
        return gather_all_compressed_kv(self.cache.entries, self._token_tables(), self.num_entries(),
                                        max_entries=max_entries, implementation=self.implementation)

    def index_keys(self, max_entries: int) -> tuple[Float[Array, "T N Di"], Bool[Array, "T N"]]:
        """CSA: every indexer key each token may see (for top-k scoring)."""
        self._need("indexer", self.cache is not None and self.cache.index_keys is not None)
        # The reference gather: indexer keys have no RoPE part, which the
        # Pallas gather (built for 64 RoPE values) does not take.
        return gather_all_compressed_kv(self.cache.index_keys, self._token_tables(), self.num_entries(),
                                        max_entries=max_entries, implementation="reference")

    # ---------------------------------------------------------------- full / MLA

    def token_kv_slots(self) -> Int[Array, " T"]:
        """Flat ``KVPool`` row of each token (``page * page_size + offset``);
        -1 for padding tokens."""
        ps = self.kv_pool.page_size
        table = self._token_tables()
        page = jnp.take_along_axis(table, jnp.clip(self.positions // ps, 0, table.shape[1] - 1)[:, None], 1)[:, 0]
        ok = (self.token_slots >= 0) & (self.positions >= 0) & (page >= 0)
        return jnp.where(ok, page * ps + self.positions % ps, -1)

    def write_kv(self, k: Float[Array, "T KVH D"], v: Float[Array, "T KVH Dv"] | None = None) -> "LayerCacheHandle":
        """Store this step's K/V (MLA: the latent, ``v=None``) in the pages."""
        self._need("paged K/V", self.kv_pool is not None)
        slots = self.token_kv_slots()
        return self.replace(kv_pool=self.kv_pool.set_kv(self.kv_layer, slots, k, v))

    def attend(self, q: Float[Array, "T H Dk"], **kwargs) -> Float[Array, "T H Dv"]:
        """Each token attends positions ``[0, pos]`` of its request through
        the pages (:func:`kernels_pallas.paged_attention`; keyword arguments
        such as ``sm_scale`` or ``sliding_window`` are passed on)."""
        self._need("paged K/V", self.kv_pool is not None)
        pool = self.kv_pool
        if pool.v_pages is None:
            kwargs.setdefault("mla_value_dim", pool.kv_lora_rank)
        lengths = jnp.where(self.token_slots >= 0, self.positions + 1, 0)
        # The whole stacked pool and the layer index: the kernel reads the
        # layer in place (pool[layer] would be copied before the call).
        return paged_attention(q, pool.k_pages, pool.v_pages, jnp.clip(self._token_tables(), 0, None), lengths,
                               pool.k_scales, pool.v_scales, layer=self.kv_layer,
                               implementation=self.implementation, **kwargs)


# --------------------------------------------------------------------------
# The manager.
# --------------------------------------------------------------------------


@struct.dataclass
class KVCacheManager:
    """Every cache array of one hybrid model, and the operations on them.

    Fields:
      slots: allocator of request slots ``1 .. max_reqs`` (lowest first).
      seq_lens: int32 ``[num_slots]`` tokens reserved per slot.
      groups: ``{group name: BlockGroup}`` (``"csa4"``, ``"hca128"``, ``"full"``, ``"mla"``).
      layers: per layer, its :class:`CompressedLayerCache` (SWA/CSA/HCA) or None.
      full_pool, mla_pool: one :class:`~jaxkv.KVPool` for all full-attention
        (resp. MLA) layers, layer index = the layer's rank among them.
      gdn: one :class:`~jaxkv.GDNPool` for all linear layers.
      schemas, config: static.
    """

    slots: BlockAllocator
    seq_lens: Int[Array, " slots"]
    groups: dict
    layers: tuple
    full_pool: KVPool | None
    mla_pool: KVPool | None
    gdn: GDNPool | None
    schemas: tuple = struct.field(pytree_node=False)
    config: HybridConfig = struct.field(pytree_node=False)

    @classmethod
    def create(cls, config: HybridConfig, schedule: list[LayerSpec], max_concurrent_requests: int, *,
               max_context_tokens: int = 131072, num_blocks: dict[str, int] | None = None,
               kv_bytes: int | None = None, max_track_slots: int = 0) -> "KVCacheManager":
        """A manager with every slot free and every state initial.

        Blocks per group: ``num_blocks`` if given (null block included), else
        :func:`~jaxkv.manager.hybrid_schema.block_budget` from ``kv_bytes`` or
        from ``max_context_tokens`` x ``max_concurrent_requests``. Block
        tables hold ``max_context_tokens`` per request.
        """
        if max_concurrent_requests < 1 or max_context_tokens < 1:
            raise InvalidArgument(f"max_concurrent_requests={max_concurrent_requests} and "
                                  f"max_context_tokens={max_context_tokens} must be >= 1")
        schemas = build_schemas(schedule, config)
        if num_blocks is None:
            num_blocks = block_budget(schemas, config, max_context_tokens=max_context_tokens,
                                      max_concurrent_requests=max_concurrent_requests, kv_bytes=kv_bytes)
        num_slots = max_concurrent_requests + 1
        groups = {}
        for s in schemas:
            if s.group is not None and s.group not in groups:
                if num_blocks.get(s.group, 0) < 2:
                    raise InvalidArgument(f"group {s.group!r} needs at least 2 blocks (block 0 is null), "
                                          f"got {num_blocks.get(s.group)}")
                max_blocks = -(-max_context_tokens // s.tokens_per_block)
                groups[s.group] = BlockGroup.create(num_blocks[s.group], num_slots, max_blocks,
                                                    s.tokens_per_entry, s.entries_per_block)
        layers = tuple(CompressedLayerCache.create(s, num_slots, num_blocks.get(s.group, 0))
                       if s.kind in _V4_KINDS else None for s in schemas)
        count = {k: sum(s.kind == k for s in schemas) for k in AttentionKind}
        full_pool = mla_pool = gdn = None
        if count[AttentionKind.FULL]:
            full_pool = KVPool.create(num_pages=num_blocks["full"], page_size=config.page_size,
                                      num_layers=count[AttentionKind.FULL], k_heads=config.num_kv_heads,
                                      k_dim=config.kv_head_dim, dtype=config.kv_dtype)
        if count[AttentionKind.MLA]:
            mla_pool = KVPool.create_mla(num_pages=num_blocks["mla"], page_size=config.page_size,
                                         num_layers=count[AttentionKind.MLA], kv_lora_rank=config.mla_value_dim,
                                         rope_dim=config.kv_head_dim - config.mla_value_dim, dtype=config.kv_dtype)
        if count[AttentionKind.LINEAR]:
            gdn = GDNPool.create(max_concurrent_requests, count[AttentionKind.LINEAR], config.linear_num_v_heads,
                                 config.linear_head_k_dim, config.linear_head_v_dim,
                                 conv_kernel_size=config.linear_conv_kernel,
                                 num_k_heads=config.linear_num_k_heads, dtype=config.linear_dtype,
                                 max_track_slots=max_track_slots)
        return cls(slots=BlockAllocator.create(num_slots, lowest_first=True),
                   seq_lens=jnp.zeros((num_slots,), jnp.int32), groups=groups, layers=layers,
                   full_pool=full_pool, mla_pool=mla_pool, gdn=gdn, schemas=schemas, config=config)

    # ---------------------------------------------------------------- facts

    @property
    def max_requests(self) -> int:
        return self.slots.num_blocks - 1

    @property
    def num_slots(self) -> int:
        return self.slots.num_blocks

    def memory_bytes(self) -> int:
        """Bytes of every array the manager owns (pools, states, tables,
        allocators), from static shapes."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))

    def _rank(self, layer: int) -> int:
        kind = self.schemas[layer].kind
        return sum(s.kind == kind for s in self.schemas[:layer])

    # ---------------------------------------------------------------- lifecycle

    def admit(self, n=1, *, max_n: int = 1) -> tuple["KVCacheManager", Int[Array, " max_n"], Ok]:
        """Take ``n`` request slots (lowest first) and reset their state in
        every layer. Returns ``(manager, slots, ok)``, ``slots[n:] == -1``;
        fails (unchanged, all -1) when fewer than ``n`` slots are free."""
        allocator, ids, ok = self.slots.acquire(n, max_n=max_n)
        return self.replace(slots=allocator)._reset(ids), ids, ok

    def admit_request(self) -> tuple["KVCacheManager", Int[Array, ""], Ok]:
        """Seed 004's ``admit_request``: one slot (-1 when none is free)."""
        manager, ids, ok = self.admit(1, max_n=1)
        return manager, ids[0], ok

    def release(self, slots) -> tuple["KVCacheManager", Ok]:
        """Return ``slots`` (any shape, -1 ignored) and every block they hold in
        every group; reset their state. Fails (unchanged) when a slot is not
        held or repeats."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        allocator, ok = self.slots.release(slots, what="slot", distinct=True)
        slots = jnp.where(ok, slots, -1)  # nothing below happens on failure
        groups = {}
        for name, group in self.groups.items():
            groups[name], group_ok = group.release_rows(slots)
            ok = ok & group_ok
        return self.replace(slots=allocator, groups=groups)._reset(slots), ok

    def release_request(self, slot) -> tuple["KVCacheManager", Ok]:
        """Seed 004's ``release_request`` for one slot."""
        return self.release(jnp.reshape(slot, (1,)))

    def _reset(self, ids) -> "KVCacheManager":
        """Initial per-request state for ``ids`` (-1 entries skipped)."""
        targets = _drop(ids >= 0, ids, self.num_slots)
        layers = tuple(None if c is None else c.reset(targets) for c in self.layers)
        gdn = self.gdn
        if gdn is not None:
            gdn, _ = gdn.reset_states(jnp.where(ids >= 0, ids, -1))
        return self.replace(seq_lens=self.seq_lens.at[targets].set(0, mode="drop"), layers=layers, gdn=gdn)

    def reserve(self, slots, num_new, *, max_new_tokens: int = 1
                ) -> tuple["KVCacheManager", Int[Array, " B"], Ok]:
        """Advance each slot by ``num_new`` tokens, allocating in every group
        the blocks they need (a compressed layer when its completed entries
        cross a block boundary, a full layer every page).

        ``slots`` ``[B]`` (-1 = padding row), ``num_new`` ``[B]`` (at most
        the static ``max_new_tokens``). Returns ``(manager, starts, ok)``:
        the step's tokens of row ``b`` are positions ``starts[b] + i``. All
        or nothing: fails (unchanged) when a slot is not held or repeats, a
        count is out of range, a table would overflow or a group is out of
        blocks.
        """
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        num_new = jnp.broadcast_to(jnp.asarray(num_new, jnp.int32).reshape(-1), slots.shape)
        active = slots != -1  # only -1 is padding: -2 is a bad slot (not held), and fails
        rows = jnp.clip(slots, 0, self.num_slots - 1)
        held = self.slots.ref_count(jnp.where(active, slots, 0)) > 0
        later = jnp.arange(slots.shape[0])[None, :] > jnp.arange(slots.shape[0])[:, None]
        repeats = jnp.any(later & (slots[:, None] == slots[None, :]) & active[:, None], axis=1)
        ok = jnp.all(~active | (held & (num_new >= 0) & (num_new <= max_new_tokens) & ~repeats))
        starts = self.seq_lens[rows]
        new_lens = starts + jnp.where(active, num_new, 0)
        groups = {}
        for name, group in self.groups.items():
            max_new = -(-max_new_tokens // group.tokens_per_block) + 1
            groups[name], group_ok = group.grow(jnp.where(ok, slots, -1), new_lens, max_new)
            ok = ok & group_ok
        groups = _select(ok, groups, self.groups)
        seq_lens = self.seq_lens.at[_drop(ok & active, rows, self.num_slots)].set(new_lens, mode="drop")
        return self.replace(groups=groups, seq_lens=seq_lens), jnp.where(active, starts, -1), ok

    # ---------------------------------------------------------------- layers

    def acquire(self, layer: int, request_slots, positions, request_ids=None, *,
                implementation: str | None = None) -> LayerCacheHandle:
        """The handle of ``layer`` for one step (no allocation, no host sync).

        ``request_slots`` ``[B]``; ``positions`` ``[T]``; ``request_ids``
        ``[T]`` batch row of each token (default: token ``t`` is row ``t``,
        decoding one token per request). Rows whose slot is not held become
        padding (-1), and so do tokens at positions the request has not
        reserved (outside ``[0, seq_lens[slot])``): they write and read nothing.
        """
        if not 0 <= layer < len(self.schemas):
            raise InvalidArgument(f"layer {layer} out of range: the schedule has {len(self.schemas)} layers")
        schema = self.schemas[layer]
        request_slots = jnp.asarray(request_slots, jnp.int32).reshape(-1)
        positions = jnp.asarray(positions, jnp.int32).reshape(-1)
        if request_ids is None:
            if positions.shape != request_slots.shape:
                raise InvalidArgument(f"request_ids is None, so positions needs one entry per request "
                                      f"({request_slots.shape[0]}), got {positions.shape[0]}")
            request_ids = jnp.arange(request_slots.shape[0], dtype=jnp.int32)
        request_ids = jnp.asarray(request_ids, jnp.int32).reshape(-1)
        # The handle touches held slots at reserved positions only: a row
        # naming any other slot (the null slot 0, a free or out-of-range one)
        # and a token at any other position are padding. Otherwise such a row
        # would write into (and read) the blocks and rings of whatever slot
        # its clipped id lands on, and such a token would overwrite its own
        # window or read entries a previous owner left in a block.
        request_slots = jnp.where(self.slots.ref_count(request_slots) > 0, request_slots, -1)
        token_slots = request_slots[request_ids]
        reserved = self.seq_lens[jnp.clip(token_slots, 0, self.num_slots - 1)]
        positions = jnp.where((token_slots >= 0) & (positions >= 0) & (positions < reserved), positions, -1)
        group = self.groups.get(schema.group)
        kind = schema.kind
        return LayerCacheHandle(
            request_slots=request_slots, positions=positions, request_ids=request_ids,
            cache=self.layers[layer],
            kv_pool={AttentionKind.FULL: self.full_pool, AttentionKind.MLA: self.mla_pool}.get(kind),
            gdn=self.gdn if kind == AttentionKind.LINEAR else None,
            block_table=None if group is None else group.tables,
            block_lens=None if group is None else group.lens,
            schema=schema,
            kv_layer=self._rank(layer) if kind in (AttentionKind.FULL, AttentionKind.MLA) else -1,
            gdn_layer=self._rank(layer) if kind == AttentionKind.LINEAR else -1,
            implementation=implementation)

    def update(self, handle: LayerCacheHandle) -> "KVCacheManager":
        """Put back what ``handle`` wrote (its layer's arrays, or the shared
        K/V or GDN pool)."""
        layer = handle.schema.layer_idx
        kind = handle.schema.kind
        if kind in _V4_KINDS:
            return self.replace(layers=self.layers[:layer] + (handle.cache,) + self.layers[layer + 1:])
        if kind == AttentionKind.FULL:
            return self.replace(full_pool=handle.kv_pool)
        if kind == AttentionKind.MLA:
            return self.replace(mla_pool=handle.kv_pool)
        return self.replace(gdn=handle.gdn)

    # ---------------------------------------------------------------- host paths

    def admit_or_raise(self, n: int = 1) -> tuple["KVCacheManager", list[int]]:
        """Host path of :meth:`admit`; raises ``InvalidArgument`` for a count
        that is not a non-negative integer, ``KVCacheOOM`` (slots)."""
        n = _host.count_or_raise(n, self.max_requests, lambda: self.slots.num_free, "request slots")
        manager, ids, ok = _admit_jit(self, n, max_n=max(1, n))
        if not bool(ok):
            raise KVCacheOOM(n, int(self.slots.num_free), self.max_requests, unit="request slots")
        return manager, [int(i) for i in ids[:n]]

    def reserve_or_raise(self, slots, num_new, *, max_new_tokens: int | None = None
                         ) -> tuple["KVCacheManager", list[int]]:
        """Host path of :meth:`reserve`; raises ``InvalidArgument`` for ids or
        counts that are not integers or a count outside ``[0,
        max_new_tokens]``, ``InvalidId`` for a slot that is not held or
        repeats, ``KVCacheOOM`` naming the group that is short."""
        slots, device_slots = _host_slots(slots, "slots", ndim=1)
        num_new = _host.int_array(num_new, "num_new")
        if num_new.ndim == 0:
            num_new = np.broadcast_to(num_new, slots.shape)
        if num_new.shape != slots.shape:
            raise InvalidArgument(f"reserve: {slots.shape[0]} slots but num_new has shape {num_new.shape}")
        slots, num_new = slots.tolist(), num_new.tolist()
        context = min(g.tables.shape[1] * g.tokens_per_block for g in self.groups.values()) if self.groups else None
        if context is not None and max([0, *num_new]) > context:  # never fits: refuse before compiling for it
            raise InvalidArgument(f"reserve of {num_new} tokens: a request holds at most {context} tokens")
        limit = _host.int_scalar(max_new_tokens, "max_new_tokens") if max_new_tokens else max([1, *num_new])
        counts = np.clip(num_new, -1, limit + 1).astype(np.int32)  # out of range stays out of range
        manager, starts, ok = _reserve_jit(self, jnp.asarray(device_slots), jnp.asarray(counts),
                                           max_new_tokens=limit)
        if bool(ok):
            return manager, [int(s) for s in starts]
        self._raise_for_slots("reserve", slots)
        active = [(s, n) for s, n in zip(slots, num_new) if s != -1]
        if any(not 0 <= n <= limit for _, n in active):
            raise InvalidArgument(f"reserve of {num_new} tokens for slots {slots}: counts must be in "
                                  f"[0, max_new_tokens={limit}]")
        for name, group in self.groups.items():
            need = sum(max(0, int(group.blocks_for(jnp.int32(int(self.seq_lens[s]) + n))) - int(group.lens[s]))
                       for s, n in active)
            free = int(group.allocator.num_free)
            if need > free:
                raise KVCacheOOM(need, free, group.allocator.capacity, unit=f"{name} blocks")
        raise InvalidArgument(f"reserve of {num_new} tokens for slots {slots} does not fit "
                              f"(max_new_tokens={limit}, table width or context limit)")

    def release_or_raise(self, slots) -> "KVCacheManager":
        """Host path of :meth:`release` (``slots`` any shape, -1 ignored);
        raises ``InvalidArgument`` for ids that are not integers,
        ``InvalidId`` for slots not held or repeated."""
        slots, device_slots = _host_slots(slots, "slots")
        manager, ok = _release_jit(self, jnp.asarray(device_slots))
        if not bool(ok):
            self._raise_for_slots("release", slots.tolist())
        return manager

    def _raise_for_slots(self, op: str, slots: list[int]) -> None:
        """``InvalidId`` naming the slots (other than -1) that are not held,
        or else those that repeat; returns if there are none."""
        held = np.asarray(self.slots.ref_counts) > 0
        ids = [s for s in slots if s != -1]
        free = sorted({s for s in ids if not (0 <= s < self.num_slots and held[s])})
        if free:
            raise InvalidId(f"{op} of slots {slots}: {free} not held (slots are 1 .. {self.max_requests})", free)
        repeated = sorted({s for s in ids if ids.count(s) > 1})
        if repeated:
            raise InvalidId(f"{op} of slots {slots}: {repeated} repeated", repeated)


def _host_slots(slots, name: str, ndim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host slot ids (``InvalidArgument`` unless integers), flattened, and
    their int32 copy for the device op (``_host.as_int32_ids``)."""
    ids = _host.int_array(slots, name, ndim=ndim).reshape(-1)
    return ids, _host.as_int32_ids(ids)


_admit_jit = jax.jit(KVCacheManager.admit, static_argnames=("max_n",))
_reserve_jit = jax.jit(KVCacheManager.reserve, static_argnames=("max_new_tokens",))
_release_jit = jax.jit(KVCacheManager.release)
