"""LayerCacheHandle: one layer's view of the hybrid cache for one forward step.

Built by :meth:`KVCacheManager.acquire <jaxkv.manager.hybrid.KVCacheManager.acquire>`
with no allocation and no host sync (seed 004's "inside the captured graph"
contract). Reads return data; writes return a new handle, which
:meth:`KVCacheManager.update <jaxkv.manager.hybrid.KVCacheManager.update>`
puts back. Each kind of layer reads and writes through its own methods:

* SWA / CSA / HCA (DeepSeek-V4): :meth:`~LayerCacheHandle.write_swa`,
  :meth:`~LayerCacheHandle.gather_swa`, :meth:`~LayerCacheHandle.compress`
  (the pooling of :mod:`jaxkv.manager.dsv4_compressor`),
  :meth:`~LayerCacheHandle.gather_compressed`,
  :meth:`~LayerCacheHandle.gather_all_compressed`,
  :meth:`~LayerCacheHandle.index_keys`;
* full attention / MLA: :meth:`~LayerCacheHandle.write_kv`,
  :meth:`~LayerCacheHandle.attend`;
* linear (Gated DeltaNet): the :class:`~jaxkv.GDNPool` in ``gdn`` at layer
  ``gdn_layer``, replaced with ``handle.replace(gdn=...)``;
* window (the sliding-window layers of interleaved models):
  :meth:`~LayerCacheHandle.attend_window` reads, attends and writes the
  layer's K/V ring in one call.

The write-back rule. Every store is stacked, so that a layer reached by a
traced index (layers under a ``lax.scan``) reads and writes its arrays in
place: full/MLA layers share one :class:`~jaxkv.KVPool`, linear layers one
:class:`~jaxkv.GDNPool`, window layers one :class:`~jaxkv.pool.window.WindowLayerCache`,
and the DeepSeek-V4 layers of one store class (same kind, group, ratio and
formats) one :class:`~jaxkv.pool.compressed.CompressedLayerCache`; a handle
carries the whole store and its layer's row in it. Writing back a handle
whose store is older than the manager's would undo another layer's writes,
and writing back only the handle's layer would copy the store. So, per
store: **acquire, write and update one handle at a time**; handles that are
only read need no update. ``epoch`` records the
store's write-back count at acquire; ``update`` refuses a stale handle
(another handle of the same store was written back since) with
``InvalidArgument`` when called eagerly, and under :func:`jaxkv.checked`.

Invariants:

* a handle touches held slots at reserved positions only: a row naming any
  other slot, and a token at a position outside ``[0, seq_lens[slot])``,
  are padding (-1) and write and read nothing;
* nothing is allocated: blocks come from ``KVCacheManager.reserve`` (or
  ``allocate_block``) before the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv._ops import INT32_MAX, on_local_heads
from jaxkv.errors import InvalidArgument
from jaxkv.manager.dsv4_compressor import compress_step, last_position
from jaxkv.manager.hybrid_schema import LayerCacheSchema
from jaxkv.pool.compressed import CompressedLayerCache, store_entries
from jaxkv.pool.gdn_pool import GDNPool
from jaxkv.pool.kv_pool import KVPool
from jaxkv.pool.window import WindowLayerCache
# Submodules, not the package: ``kernels_pallas/__init__`` loads every kernel.
from kernels_pallas.formats import CompressedEntries
from kernels_pallas.gather import gather_all_compressed_kv, gather_compressed_kv, gather_swa_kv
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.ragged_attention import ragged_paged_attention

__all__ = ["LayerCacheHandle"]



@struct.dataclass
class LayerCacheHandle:
    """One layer's view of the cache for one forward step (a pytree).

    Built by :meth:`KVCacheManager.acquire`; nothing is allocated. Reads
    return data; writes return a new handle, which
    :meth:`KVCacheManager.update` puts back into the manager (one handle per
    store at a time: see the module docstring).

    Fields:
      request_slots: int32 ``[B]`` slot of each request of the batch (-1 =
        padding).
      positions: int32 ``[T]`` position of each token of the step.
      request_ids: int32 ``[T]`` batch row of each token; a request's tokens
        are consecutive positions (one per request when decoding).
      cache: the :class:`CompressedLayerCache` of the layer's store class,
        used at row ``cache_layer`` (SWA/CSA/HCA layers), or the
        :class:`WindowLayerCache` of every window layer, used at layer
        ``window_layer`` (window layers).
      kv_pool: the :class:`~jaxkv.KVPool` of the full or MLA layers, used at
        layer ``kv_layer`` (full/MLA layers).
      gdn: the :class:`~jaxkv.GDNPool`, used at layer ``gdn_layer`` (linear).
      kv_layer, gdn_layer, window_layer, cache_layer: the layer's index in
        its shared store (its rank among the layers of its kind, or of its
        DeepSeek-V4 store class; -1 for the other stores): an int, or a
        traced int32 when the layer runs under a scan (:mod:`jaxkv.nn.scan`).
        Every op indexes the store at it directly (gathers at, scatters
        into ``[layer, ...]``), never slicing the layer out.
      block_table, block_lens: the layer's group (``[num_slots, M]``, ``[num_slots]``).
      epoch: int32 scalar, write-backs of the layer's store when acquired
        (``update`` refuses a stale handle).
      schema: the layer's :class:`LayerCacheSchema` (static).
      implementation: kernel choice passed to the gathers and attention (static).
    """

    request_slots: Int[Array, " B"]
    positions: Int[Array, " T"]
    request_ids: Int[Array, " T"]
    cache: CompressedLayerCache | WindowLayerCache | None
    kv_pool: KVPool | None
    gdn: GDNPool | None
    block_table: Int[Array, "slots M"] | None
    block_lens: Int[Array, " slots"] | None
    epoch: Int[Array, ""]
    schema: LayerCacheSchema = struct.field(pytree_node=False)
    kv_layer: Int[Array, ""] | int = -1
    gdn_layer: Int[Array, ""] | int = -1
    window_layer: Int[Array, ""] | int = -1
    cache_layer: Int[Array, ""] | int = -1
    implementation: str | None = struct.field(pytree_node=False, default=None)

    # ---------------------------------------------------------------- facts

    @property
    def head_dim(self) -> int:
        """Dims per head of what the layer stores (DeepSeek-V4 kinds: the
        entry, ``nope + rope``; full: K; MLA: latent + RoPE; linear: key)."""
        return self.schema.head_dim

    @property
    def num_query_heads(self) -> int:
        """Query heads of the layer: ``HybridConfig.num_query_heads``
        (linear layers: ``linear_num_k_heads``). Raises ``InvalidArgument``
        when the config does not give it."""
        if self.schema.num_query_heads is None:
            raise InvalidArgument(f"layer {self.schema.layer_idx}: HybridConfig.num_query_heads is not set")
        return self.schema.num_query_heads

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
        return last_position(self.positions, self.request_ids, self.request_slots.shape[0])

    def _need(self, what: str, ok: bool):
        if not ok:
            raise InvalidArgument(f"layer {self.schema.layer_idx} ({self.schema.kind.value}) has no {what}")

    def _check_rows(self, name: str, x, width: int):
        if x.shape != (self.positions.shape[0], width):
            raise InvalidArgument(f"layer {self.schema.layer_idx}: {name} must be [{self.positions.shape[0]} tokens, "
                                  f"{width}], got {list(x.shape)}")

    # ---------------------------------------------------------------- SWA

    def write_swa(self, kv: Float[Array, "T D"], *, after: Array | None = None) -> "LayerCacheHandle":
        """Store each token's entry (quantized) in its request's SWA ring.
        Of a request's tokens in this step only the newest ``window`` are
        kept (older ones would be overwritten anyway).

        ``after``: what an earlier read of this ring in the same step returned
        (``gather_swa(kv)``'s window). The write is made to depend on it, so
        XLA orders the read first and updates the ring in place; without it,
        XLA copies the whole ring to keep the old rows for the read. (The
        dependency costs nothing: only rows the write drops take its value.)
        """
        self._need("SWA ring", isinstance(self.cache, CompressedLayerCache))
        ring = self.cache.swa
        self._check_rows("kv", kv, ring.fmt.head_dim)
        _, num_slots, window = ring.shape
        active = (self.token_slots >= 0) & (self.positions >= 0) & (self.positions > self._newest() - window)
        rows = jnp.where(active, self.token_slots * window + self.positions % window,
                         num_slots * window)  # past the ring: dropped
        if after is not None:
            kv = jnp.where(active[:, None], kv, after.reshape(-1)[:1].astype(kv.dtype))
        return self.replace(cache=self.cache.replace(swa=store_entries(ring, rows, kv, layer=self.cache_layer)))

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
        self._need("SWA ring", isinstance(self.cache, CompressedLayerCache))
        ring, layer = self.cache.swa, self.cache_layer
        window = ring.shape[2]
        i = jnp.arange(window, dtype=jnp.int32)[None, :]
        count = jnp.clip(self.positions + 1, 0, window)[:, None]
        row_pos = self.positions[:, None] - count + 1 + i  # position of output row i
        if kv is None:
            out, valid = gather_swa_kv(ring, self.token_slots, self.positions, layer=layer,
                                       implementation=self.implementation)
            fresh = row_pos > (self._newest() - window)[:, None]
            return jnp.where(fresh[..., None], out, 0).astype(out.dtype), valid & fresh
        self._check_rows("kv", kv, ring.fmt.head_dim)
        # First position of each token's request in this step: the ring holds
        # everything before it (still unwritten by this step). Padding tokens
        # (-1) in the request's row are not among its tokens.
        real = (self.token_slots >= 0) & (self.positions >= 0)
        first = -jax.ops.segment_max(jnp.where(real, -self.positions, -INT32_MAX),
                                     self.request_ids, num_segments=self.request_slots.shape[0])[self.request_ids]
        old, old_valid = gather_swa_kv(ring, self.token_slots, first - 1, layer=layer,
                                       implementation=self.implementation)
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

    def compress(self, kv: Float[Array, "T W"], score: Float[Array, "T W"], finish=None) -> "LayerCacheHandle":
        """Advance the layer's compressor by this step's tokens (``kv`` and
        ``score`` ``[T, overlap * head_dim]``, float32) and store every entry
        they complete, quantized, through the block table (see
        :mod:`jaxkv.manager.dsv4_compressor` for the pooling rule and
        ``finish``, the model's transform of a pooled vector before it is
        stored). :meth:`KVCacheManager.reserve` must have allocated the blocks."""
        self._need("compressor", isinstance(self.cache, CompressedLayerCache) and self.cache.comp_kv is not None)
        return self._advance(kv, score, self.schema.compressor_width, "comp_kv", "comp_score", "entries", finish)

    def compress_index(self, kv: Float[Array, "T Wi"], score: Float[Array, "T Wi"], finish=None
                       ) -> "LayerCacheHandle":
        """The same for the CSA indexer's keys (``[T, overlap * index_dim]``)."""
        self._need("indexer", isinstance(self.cache, CompressedLayerCache) and self.cache.index_kv is not None)
        return self._advance(kv, score, self.schema.index_compressor_width, "index_kv", "index_score", "index_keys",
                             finish)

    def _advance(self, kv, score, width, ring_kv, ring_score, pool, finish):
        for name, x in (("kv", kv), ("score", score)):
            self._check_rows(name, x, width)
        c = self.cache
        new_kv, new_score, new_pool = compress_step(
            getattr(c, ring_kv), getattr(c, ring_score), getattr(c, pool), self.block_table, self.token_slots,
            self.positions, self.request_ids, self._newest(), kv.astype(jnp.float32), score.astype(jnp.float32),
            ratio=self.schema.compress_ratio, overlap=self.schema.overlap, finish=finish, layer=self.cache_layer)
        return self.replace(cache=c.replace(**{ring_kv: new_kv, ring_score: new_score, pool: new_pool}))

    def gather_compressed(self, indices: Int[Array, "T K"]) -> tuple[Float[Array, "T K D"], Bool[Array, "T K"]]:
        """CSA: each token's selected entries (-1 = none), causally limited
        (:func:`kernels_pallas.gather_compressed_kv`)."""
        self._need("compressed entries", isinstance(self.cache, CompressedLayerCache)
                   and self.cache.entries is not None)
        return gather_compressed_kv(self.cache.entries, self.block_table, indices,
                                    jnp.clip(self.token_slots, 0, None),
                                    num_entries=jnp.where(self.token_slots >= 0, self.num_entries(), 0),
                                    layer=self.cache_layer, implementation=self.implementation)

    def gather_all_compressed(self, max_entries: int) -> tuple[Float[Array, "T N D"], Bool[Array, "T N"]]:
        """HCA: every entry each token may see, in order, padded to ``max_entries``."""
        self._need("compressed entries", isinstance(self.cache, CompressedLayerCache)
                   and self.cache.entries is not None)
        return gather_all_compressed_kv(self.cache.entries, self._token_tables(), self.num_entries(),
                                        max_entries=max_entries, layer=self.cache_layer,
                                        implementation=self.implementation)

    def index_keys(self, max_entries: int) -> tuple[Float[Array, "T N Di"], Bool[Array, "T N"]]:
        """CSA: every indexer key each token may see (for top-k scoring)."""
        self._need("indexer", isinstance(self.cache, CompressedLayerCache) and self.cache.index_keys is not None)
        # The reference gather: indexer keys have no RoPE part, which the
        # Pallas gather (built for 64 RoPE values) does not take.
        return gather_all_compressed_kv(self.cache.index_keys, self._token_tables(), self.num_entries(),
                                        max_entries=max_entries, layer=self.cache_layer, implementation="reference")

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

    def attend(self, q: Float[Array, "T H Dk"], *, sinks: Float[Array, " H"] | None = None, heads=None,
               **kwargs) -> Float[Array, "T H Dv"]:
        """Each token attends positions ``[0, pos]`` of its request through
        the pages (:func:`kernels_pallas.paged_attention`; keyword arguments
        such as ``sm_scale`` or ``sliding_window`` are passed on).

        A step with more tokens than request rows (prefill pieces), and one
        with ``sinks`` (per-head logits that join the softmax denominator
        only, gpt-oss's: the decode kernel has none), goes through
        :func:`kernels_pallas.ragged_paged_attention` instead, each token a
        one-query sequence: its reference walks the context in chunks, where
        the decode reference gathers every token's whole context at once
        (``[T, KVH, context, D]``: 35 GB for a 2048-token Gemma 3 piece).

        ``heads``: the model's :class:`~jaxkv.nn.layers.HeadPlacement` on a
        mesh (the kernel runs on each device's heads under ``shard_map``,
        not on a pool gathered whole), or None."""
        self._need("paged K/V", self.kv_pool is not None)
        pool = self.kv_pool
        if pool.v_pages is None:
            kwargs.setdefault("mla_value_dim", pool.kv_lora_rank)
        lengths = jnp.where(self.token_slots >= 0, self.positions + 1, 0)
        num_tokens = q.shape[0]
        pages = (pool.k_pages, pool.v_pages, pool.k_scales, pool.v_scales)
        tables = jnp.clip(self._token_tables(), 0, None)
        if sinks is not None or num_tokens > self.request_slots.shape[0]:
            # A padding token attends one (masked-out) key of the null page:
            # the ragged layout needs kv_len >= q_len; its output is zeroed.
            def ragged(q, k_pages, v_pages, k_scales, v_scales, sinks, tables, kv_lens, cu_q_lens, layer):
                return ragged_paged_attention(q, k_pages, v_pages, tables, kv_lens, cu_q_lens, k_scales, v_scales,
                                              layer=layer, sinks=sinks, implementation=self.implementation, **kwargs)

            cu_q_lens = jnp.arange(num_tokens + 1, dtype=jnp.int32)  # each token a one-query sequence
            out = on_local_heads(heads, ragged, q, pages, (tables, jnp.maximum(lengths, 1), cu_q_lens, self.kv_layer),
                                 sinks)
            return jnp.where((lengths > 0)[:, None, None], out, 0).astype(out.dtype)

        # The whole stacked pool and the layer index: the kernel reads the
        # layer in place (pool[layer] would be copied before the call).
        def decode(q, k_pages, v_pages, k_scales, v_scales, _sinks, tables, lengths, layer):
            return paged_attention(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, layer=layer,
                                   implementation=self.implementation, **kwargs)

        return on_local_heads(heads, decode, q, pages, (tables, lengths, self.kv_layer), None)

    # ---------------------------------------------------------------- window

    def attend_window(self, q: Float[Array, "T H D"], k: Float[Array, "T KVH D"], v: Float[Array, "T KVH Dv"], *,
                      sm_scale: float | None = None, sinks: Float[Array, " H"] | None = None,
                      logit_soft_cap: float | None = None) -> tuple[Float[Array, "T H Dv"], "LayerCacheHandle"]:
        """A window layer's step: each token attends its request's keys at
        positions ``(p - W, p]`` (``W`` the ring's window), those of earlier
        steps from the ring and those of this step from ``k``/``v``; then
        the ring keeps each request's newest ``W`` tokens. Exact for any
        step: decodes, prefill chunks longer than the window, both packed.

        ``sm_scale`` (default ``D ** -0.5``) scales the logits, then
        ``logit_soft_cap`` (``cap * tanh(l / cap)``) applies; ``sinks`` join
        the softmax denominator only. Math in float32 (the ring's values as
        stored, this step's rounded to the ring's dtype, as a later step
        would read them). Returns ``(out [T, H, Dv] in q.dtype, handle)``;
        padding tokens get zeros."""
        self._need("window ring", isinstance(self.cache, WindowLayerCache))
        ring, layer = self.cache, self.window_layer
        num_tokens = self.positions.shape[0]
        kv_heads, head_dim = ring.num_kv_heads, ring.head_dim
        if k.shape != (num_tokens, kv_heads, head_dim) or v.shape != k.shape[:2] + v.shape[2:]:
            raise InvalidArgument(f"layer {self.schema.layer_idx}: k/v must be [{num_tokens} tokens, "
                                  f"{kv_heads} kv heads, {head_dim}], got {list(k.shape)} and {list(v.shape)}")
        slots, positions = self.token_slots, self.positions
        real = (slots >= 0) & (positions >= 0)
        rows = jnp.clip(slots, 0, ring.num_rows - 1)
        # The ring holds earlier steps only; this step's keys come from k/v,
        # rounded as the ring stores them.
        k_step, v_step = k.astype(ring.dtype), v.astype(ring.dtype)
        first = -jax.ops.segment_max(jnp.where(real, -positions, -INT32_MAX), self.request_ids,
                                     num_segments=self.request_slots.shape[0])[self.request_ids]
        lo = positions - ring.window  # keys must be > lo

        # Tokens in blocks (``lax.map``): a block gathers its tokens' rings
        # ([block, KVH, slots, D], a few MiB), never the whole step's ([T,
        # KVH, slots, D]: tens of GiB for a Gemma 3 prefill piece).
        block = max(1, min(num_tokens, _WINDOW_BLOCK_ELEMENTS // (ring.slots * k.shape[1] * k.shape[2])))
        padded = -(-num_tokens // block) * block

        def blocked(x, fill):
            x = jnp.pad(x, [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
            return x.reshape((padded // block, block) + x.shape[1:])

        def attend_block(args):
            qb, rows_b, pos_b, first_b, lo_b, real_b, ids_b = args
            ring_k, ring_v, ring_pos = ring.read(layer, rows_b)  # [block, KVH, W, D]
            ring_ok = real_b[:, None] & (ring_pos >= 0) & (ring_pos < first_b[:, None]) & (ring_pos > lo_b[:, None])
            step_ok = (real_b[:, None] & (ids_b[:, None] == self.request_ids[None, :]) & real[None, :]
                       & (positions[None, :] <= pos_b[:, None]) & (positions[None, :] > lo_b[:, None]))
            return _window_softmax(qb, ring_k, ring_v, ring_ok, k_step, v_step, step_ok, sm_scale=sm_scale,
                                   sinks=sinks, logit_soft_cap=logit_soft_cap)

        out = jax.lax.map(attend_block, (blocked(q, 0), blocked(rows, 0), blocked(positions, -1), blocked(first, 0),
                                         blocked(lo, 0), blocked(real, False), blocked(self.request_ids, -1)))
        out = out.reshape((padded,) + out.shape[2:])[:num_tokens]
        # Each request keeps its newest ``slots`` tokens (the window and the
        # slack). The written values depend on the reads (through ``out``;
        # rows the write drops take it), so XLA orders the reads first and
        # scatters into the ring in place instead of copying it.
        keep = real & (positions > self._newest() - ring.slots)
        target = jnp.where(keep, slots, ring.num_rows)  # past the rows: dropped
        after = out[:, :1, :1]
        k_w = jnp.where(keep[:, None, None], k_step, after.astype(k_step.dtype))
        v_w = jnp.where(keep[:, None, None], v_step, after.astype(v_step.dtype))
        written = ring.write(layer, target, jnp.where(keep, positions, after[:, 0, 0].astype(jnp.int32)), k_w, v_w)
        return jnp.where(real[:, None, None], out, 0).astype(q.dtype), self.replace(cache=written)


#: Ring elements (tokens x window x KV heads x head dim) one block of
#: :meth:`LayerCacheHandle.attend_window` gathers: 16 MiB of float32.
_WINDOW_BLOCK_ELEMENTS = 1 << 22


def _window_softmax(q, ring_k, ring_v, ring_ok, k, v, step_ok, *, sm_scale, sinks, logit_soft_cap):
    """Softmax attention of ``q [T, H, D]`` over two key sets: each token's
    ring ``[T, KVH, W, D]`` (mask ``[T, W]``) and this step's ``[S, KVH, D]``
    (mask ``[T, S]``), in float32; GQA by head groups; ``sinks [H]`` in the
    denominator only. A token with no key and no sink gets zeros."""
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    num_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.astype(f32).reshape(num_tokens, kv_heads, heads // kv_heads, dim)
    scale = dim ** -0.5 if sm_scale is None else sm_scale
    l_ring = jnp.einsum("tkgd,tkwd->tkgw", qg, ring_k.astype(f32), precision=hi) * scale
    l_step = jnp.einsum("tkgd,skd->tkgs", qg, k.astype(f32), precision=hi) * scale
    logits = jnp.concatenate([l_ring, l_step], axis=-1)
    if logit_soft_cap is not None:
        logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    mask = jnp.concatenate([ring_ok, step_ok], axis=-1)[:, None, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(f32).reshape(1, kv_heads, heads // kv_heads, 1)
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(mask, jnp.exp(logits - top), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    weights = weights / jnp.where(total > 0, total, 1.0)
    width = ring_k.shape[2]
    out = (jnp.einsum("tkgw,tkwd->tkgd", weights[..., :width], ring_v.astype(f32), precision=hi)
           + jnp.einsum("tkgs,skd->tkgd", weights[..., width:], v.astype(f32), precision=hi))
    return out.reshape(num_tokens, heads, -1)
