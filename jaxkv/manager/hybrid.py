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
* :meth:`KVCacheManager.allocate_block` gives one slot one more block in
  one layer's group, for a caller that allocates per layer on demand (seed
  004's ``allocate_block``);
* :meth:`KVCacheManager.acquire` builds a :class:`LayerCacheHandle` for one
  layer's forward pass: no allocation, no host sync (the seed's "inside the
  captured graph" contract);
* :meth:`KVCacheManager.update` puts the arrays a handle wrote back; one
  handle per store is acquired, written and updated at a time, and a stale
  handle is refused (see :mod:`jaxkv.manager.layer_handle`);
* :meth:`KVCacheManager.release` returns slots and every block of every
  layer, and resets the slots' state;
* :meth:`KVCacheManager.attach_prefix` starts an admitted slot from a cached
  prefix of any length: full blocks shared by reference, a partly filled
  last block copied into a fresh one (:meth:`KVCacheManager.copy_blocks`);
* :meth:`KVCacheManager.fork` starts a slot as a copy of another (parallel
  sampling, beam search) the same way, its state rows copied;
  :meth:`KVCacheManager.clear` empties a slot and keeps it.

Slot ids ``1 .. max_reqs`` index every per-request array (slot 0 is padding,
as in :class:`~jaxkv.ReqToTokenPool` and :class:`~jaxkv.GDNPool`).
Invariants (checked by the tests after every operation): each group's
``tables[s, :lens[s]]`` are the blocks slot ``s`` holds, each once, and
entries past ``lens[s]`` are -1; a free slot holds no block, ``seq_lens`` 0,
compressor rings at their initial value and zeroed SWA rings and GDN state;
allocated + free blocks = total in every group; a failed operation changes
nothing; ``write_epochs[store]`` counts the write-backs of each store
(one per DeepSeek-V4 store class, then the full pool, the MLA pool, the
GDN pool, the window pool).

Every store is stacked (a leading layer axis), DeepSeek-V4's too: its
layers are grouped into *store classes* (layers whose schemas are equal but
for the layer index: same kind, group, ratio and formats), each one
:class:`CompressedLayerCache` with a row per layer of the class. So a layer
reached by a traced index (a model whose layers run under one ``lax.scan``)
reads and writes its arrays in place, whatever its kind.

The pieces live beside this module: :mod:`jaxkv.manager.block_group`
(allocator + table of a group), :mod:`jaxkv.manager.layer_handle` (the
handle), :mod:`jaxkv.manager.dsv4_compressor` (DeepSeek-V4's pooling rule),
:mod:`jaxkv.pool.compressed` (a DeepSeek-V4 layer's arrays). ``BlockGroup``,
``CompressedLayerCache`` and ``LayerCacheHandle`` are re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Int

from jaxkv import _host
from jaxkv._ops import ceil_div, ids_distinct, where_ok
from jaxkv.alloc.block import BlockAllocator
from jaxkv.checks import require
from jaxkv.errors import InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager.block_group import BlockGroup
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerCacheSchema,
    LayerSpec,
    block_budget,
    build_schemas,
)
from jaxkv.manager.layer_handle import LayerCacheHandle
from jaxkv.manager.rows import slot_of
from jaxkv.pool.compressed import CompressedLayerCache
from jaxkv.pool.gdn_pool import GDNPool
from jaxkv.pool.kv_pool import KVPool
from jaxkv.pool.window import WindowLayerCache
from jaxkv.types import Ok

__all__ = ["BlockGroup", "CompressedLayerCache", "KVCacheManager", "LayerCacheHandle", "v4_layout"]

_V4_KINDS = (AttentionKind.SWA, AttentionKind.CSA, AttentionKind.HCA)
#: Shared stores after the DeepSeek-V4 store classes, in ``write_epochs``
#: order: one array per kind with a leading layer axis (the layer's rank
#: among its kind), so a layer reached by a traced index (layers under a
#: scan) reads and writes it in place.
_SHARED_STORES = (AttentionKind.FULL, AttentionKind.MLA, AttentionKind.LINEAR, AttentionKind.WINDOW)


@functools.lru_cache(maxsize=64)
def v4_layout(schemas: tuple[LayerCacheSchema, ...]) -> tuple[tuple[LayerCacheSchema, ...], tuple[int, ...],
                                                              tuple[int, ...]]:
    """The DeepSeek-V4 store classes of a schedule: ``(classes, store,
    row)``: ``classes[c]`` the schema of class ``c``'s first layer (classes
    in order of first layer), and per layer of the schedule its class
    ``store[i]`` and its row in it ``row[i]`` (both -1 for a layer of
    another kind). Layers of one class have equal schemas but for
    ``layer_idx``, so they stack."""
    keys, classes, store, row = [], [], [], []
    for schema in schemas:
        if schema.kind not in _V4_KINDS:
            store.append(-1)
            row.append(-1)
            continue
        key = dataclasses.replace(schema, layer_idx=0)
        if key not in keys:
            keys.append(key)
            classes.append(schema)
        c = keys.index(key)
        row.append(store.count(c))
        store.append(c)
    return tuple(classes), tuple(store), tuple(row)


@struct.dataclass
class KVCacheManager:
    """Every cache array of one hybrid model, and the operations on them.

    Fields:
      slots: allocator of request slots ``1 .. max_reqs`` (lowest first).
      seq_lens: int32 ``[num_slots]`` tokens reserved per slot.
      groups: ``{group name: BlockGroup}`` (``"csa4"``, ``"hca128"``,
        ``"full"``, ``"mla"``), in schedule order of first use.
      v4_stores: one stacked :class:`CompressedLayerCache` per DeepSeek-V4
        store class (:func:`v4_layout`), layer ``i`` at row ``row[i]`` of
        store ``store[i]`` (:meth:`v4_store_of`; read one layer with
        :meth:`layer_cache`); empty without SWA/CSA/HCA layers.
      full_pool, mla_pool: one :class:`~jaxkv.KVPool` for all full-attention
        (resp. MLA) layers, layer index = the layer's rank among them.
      gdn: one :class:`~jaxkv.GDNPool` for all linear layers.
      window_pool: one :class:`WindowLayerCache` for all window layers'
        rings, layer index = the layer's rank among them.
      write_epochs: int32 ``[len(v4_stores) + 4]``, write-backs per store
        (each DeepSeek-V4 store class, then the full, MLA, GDN and window pools):
        ``update`` refuses a handle acquired before the last write-back of
        its store.
      schemas, config: static.
      num_snapshots: static; per-request state (SWA, window and compressor rings,
        GDN states) has this many extra rows after the slots: snapshot ``i``
        is state row ``num_slots + i`` (a GDN track slot). See
        :meth:`copy_state`.
      capture_every: static; when > 0, every step that leaves slot ``s`` at
        a multiple of this many tokens copies its state into snapshot
        ``s - 1`` (its staging snapshot; :meth:`capture`), so a prefix cache
        can keep the state at the last such boundary.
    """

    slots: BlockAllocator
    seq_lens: Int[Array, " slots"]
    groups: dict[str, BlockGroup]
    v4_stores: tuple[CompressedLayerCache, ...]
    full_pool: KVPool | None
    mla_pool: KVPool | None
    gdn: GDNPool | None
    window_pool: WindowLayerCache | None
    write_epochs: Int[Array, " stores"]
    schemas: tuple[LayerCacheSchema, ...] = struct.field(pytree_node=False)
    config: HybridConfig = struct.field(pytree_node=False)
    num_snapshots: int = struct.field(pytree_node=False, default=0)
    capture_every: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(cls, config: HybridConfig, schedule: list[LayerSpec], max_concurrent_requests: int, *,
               max_context_tokens: int = 131072, num_blocks: dict[str, int] | None = None,
               kv_bytes: int | None = None, max_track_slots: int = 0, num_snapshots: int = 0,
               capture_every: int = 0) -> "KVCacheManager":
        """A manager with every slot free and every state initial.

        Blocks per group (null block included): ``num_blocks[name]`` for the
        groups it names (a partial dict is allowed: seed 004's
        ``num_blocks_per_csa_layer`` alone), and for the others
        :func:`~jaxkv.manager.hybrid_schema.block_budget` from ``kv_bytes``
        or from ``max_context_tokens`` x ``max_concurrent_requests``, as if
        none were given. Block tables hold ``max_context_tokens`` per
        request. ``num_snapshots`` extra state rows (see the fields; the GDN
        pool gets at least that many track slots) and ``capture_every``
        (needs a staging snapshot per slot: ``num_snapshots >=
        max_concurrent_requests``). Raises ``InvalidArgument`` for a group
        name the schedule does not have.
        """
        if max_concurrent_requests < 1 or max_context_tokens < 1:
            raise InvalidArgument(f"max_concurrent_requests={max_concurrent_requests} and "
                                  f"max_context_tokens={max_context_tokens} must be >= 1")
        if num_snapshots < 0 or capture_every < 0 or (capture_every and num_snapshots < max_concurrent_requests):
            raise InvalidArgument(f"num_snapshots={num_snapshots}, capture_every={capture_every}: both >= 0, and "
                                  f"capturing needs a staging snapshot per slot ({max_concurrent_requests})")
        schemas = build_schemas(schedule, config)
        names = list(dict.fromkeys(s.group for s in schemas if s.group is not None))
        given = dict(num_blocks or {})
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise InvalidArgument(f"num_blocks names groups {unknown}; the schedule's groups are {names}")
        if set(given) != set(names):
            num_blocks = {**block_budget(schemas, config, max_context_tokens=max_context_tokens,
                                         max_concurrent_requests=max_concurrent_requests, kv_bytes=kv_bytes),
                          **given}
        else:
            num_blocks = given
        num_slots = max_concurrent_requests + 1
        groups = {}
        for s in schemas:
            if s.group is not None and s.group not in groups:
                if num_blocks.get(s.group, 0) < 2:
                    raise InvalidArgument(f"group {s.group!r} needs at least 2 blocks (block 0 is null), "
                                          f"got {num_blocks.get(s.group)}")
                max_blocks = ceil_div(max_context_tokens, s.tokens_per_block)
                groups[s.group] = BlockGroup.create(num_blocks[s.group], num_slots, max_blocks,
                                                    s.tokens_per_entry, s.entries_per_block)
        classes, store_of, _ = v4_layout(schemas)
        v4_stores = tuple(_store_cache(s, config, num_slots + num_snapshots, num_blocks.get(s.group, 0),
                                       store_of.count(c)) for c, s in enumerate(classes))
        count = {k: sum(s.kind == k for s in schemas) for k in AttentionKind}
        full_pool = mla_pool = gdn = window_pool = None
        if count[AttentionKind.WINDOW]:
            window_pool = WindowLayerCache.create(num_slots + num_snapshots, config.window, config.num_kv_heads,
                                                  config.kv_head_dim, config.window_dtype or config.kv_dtype,
                                                  num_layers=count[AttentionKind.WINDOW], slack=config.ring_slack)
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
                                 max_track_slots=max(max_track_slots, num_snapshots))
        return cls(slots=BlockAllocator.create(num_slots, lowest_first=True),
                   seq_lens=jnp.zeros((num_slots,), jnp.int32), groups=groups, v4_stores=v4_stores,
                   full_pool=full_pool, mla_pool=mla_pool, gdn=gdn, window_pool=window_pool,
                   write_epochs=jnp.zeros((len(v4_stores) + len(_SHARED_STORES),), jnp.int32),
                   schemas=schemas, config=config, num_snapshots=num_snapshots, capture_every=capture_every)

    # ---------------------------------------------------------------- facts

    @property
    def max_requests(self) -> int:
        return self.slots.num_blocks - 1

    @property
    def num_slots(self) -> int:
        return self.slots.num_blocks

    # ------------------------------------------------ rows (RowCache)

    #: A table per group, not per row (:class:`~jaxkv.manager.rows.RowCache`).
    ROW_TABLES = False

    def in_step(self) -> "KVCacheManager":
        """:meth:`~jaxkv.manager.rows.RowCache.in_step`: always passed whole."""
        return self

    @property
    def blocks_in_use(self) -> Int[Array, ""]:
        """Blocks held by requests, summed over every group."""
        return sum((g.allocator.num_used for g in self.groups.values()), jnp.int32(0))

    def free_rows(self, rows, *, keep: bool = False) -> tuple["KVCacheManager", Ok]:
        """Rows ``rows`` are slots :func:`~jaxkv.manager.rows.slot_of`:
        :meth:`clear` them (``keep``: held, empty) or :meth:`release` them."""
        slots = slot_of(rows)
        return self.clear(slots) if keep else self.release(slots)

    def fork_rows(self, src, dst) -> tuple["KVCacheManager", Ok]:
        """:meth:`fork` of the rows' slots (the children held already)."""
        return self.fork(slot_of(src), slot_of(dst))

    def block_totals(self) -> tuple[int, int]:
        """``(free, total)`` blocks summed over the groups, read to the host."""
        groups = self.groups.values()
        return (int(sum(int(g.allocator.num_free) for g in groups)),
                int(sum(int(g.allocator.capacity) for g in groups)))

    def memory_bytes(self) -> int:
        """Bytes of every array the manager owns (pools, states, tables,
        allocators), from static shapes."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))

    def _rank(self, layer, like: int):
        """Index of ``layer`` in its store: its row in its DeepSeek-V4 store
        class, or its rank among the layers of its kind (shared pools). A
        static lookup for an int, a table read for a traced index
        (``like``: a static layer of the same store)."""
        kind = self.schemas[like].kind
        if kind in _V4_KINDS:
            ranks = list(v4_layout(self.schemas)[2])
        else:
            ranks = [sum(s.kind == kind for s in self.schemas[:i]) for i in range(len(self.schemas))]
        if isinstance(layer, jax.core.Tracer):
            return jnp.asarray(ranks, jnp.int32)[layer]
        return ranks[layer]

    def _store(self, layer: int) -> int:
        """Index in ``write_epochs`` of the store ``layer`` writes back to."""
        kind = self.schemas[layer].kind
        if kind in _V4_KINDS:
            return v4_layout(self.schemas)[1][layer]
        return len(self.v4_stores) + _SHARED_STORES.index(kind)

    def v4_store_of(self, layer: int) -> tuple[int, int]:
        """``(store, row)``: DeepSeek-V4 layer ``layer``'s arrays are row
        ``row`` of ``v4_stores[store]``. ``InvalidArgument`` for a layer out
        of range or of another kind."""
        schema = self._check_layer(layer)
        if schema.kind not in _V4_KINDS:
            raise InvalidArgument(f"layer {layer} ({schema.kind.value}) is not a DeepSeek-V4 layer: its arrays "
                                  "are in a shared pool")
        _, store, row = v4_layout(self.schemas)
        return store[schema.layer_idx], row[schema.layer_idx]

    def layer_cache(self, layer: int) -> CompressedLayerCache | None:
        """DeepSeek-V4 layer ``layer``'s arrays as a one-layer
        :class:`CompressedLayerCache` (no layer axis), or None for a layer of
        another kind: a copy, for reading (tests, host tools); steps write
        the stacked stores through their handles."""
        if self._check_layer(layer).kind not in _V4_KINDS:
            return None
        store, row = self.v4_store_of(layer)
        return self.v4_stores[store].layer(row)

    def v4_group_stores(self, group: str) -> list[int]:
        """Indices of the DeepSeek-V4 stores whose layers are in ``group``."""
        return [c for c, s in enumerate(v4_layout(self.schemas)[0]) if s.group == group]

    def _check_layer(self, layer: int) -> LayerCacheSchema:
        """The schema of ``layer`` (a static int), or ``InvalidArgument``."""
        try:
            index = operator.index(layer)
        except TypeError:
            index = None
        if isinstance(layer, bool) or index is None or not 0 <= index < len(self.schemas):
            raise InvalidArgument(f"layer {layer!r} out of range: the schedule has {len(self.schemas)} layers")
        return self.schemas[index]

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
        groups: dict[str, BlockGroup] = {}
        for name, group in self.groups.items():
            groups[name], group_ok = group.release_rows(slots)
            ok = ok & group_ok
        return self.replace(slots=allocator, groups=groups)._reset(slots), ok

    def release_request(self, slot) -> tuple["KVCacheManager", Ok]:
        """Seed 004's ``release_request`` for one slot."""
        return self.release(jnp.reshape(slot, (1,)))

    def _reset(self, ids) -> "KVCacheManager":
        """Initial per-request state for ``ids`` (-1 entries skipped)."""
        targets = jnp.where(ids >= 0, ids, self.num_slots + self.num_snapshots)  # out of range: dropped
        stores = tuple(c.reset(targets) for c in self.v4_stores)
        gdn = self.gdn
        if gdn is not None:
            gdn, _ = gdn.reset_states(jnp.where(ids >= 0, ids, -1))
        window = None if self.window_pool is None else self.window_pool.reset(targets)
        return self.replace(seq_lens=self.seq_lens.at[targets].set(0, mode="drop"), v4_stores=stores, gdn=gdn,
                            window_pool=window)

    def reset_state_rows(self, rows) -> "KVCacheManager":
        """Initial state (zeroed SWA, window and GDN states, compressor rings
        at their initial value) in state rows ``rows`` (any shape; -1
        skipped): snapshot rows a prefix cache let go (scrub-on-free).
        Blocks, tables and allocators are untouched; a row outside
        ``1 .. num_slots + num_snapshots - 1`` is skipped."""
        rows = jnp.asarray(rows, jnp.int32).reshape(-1)
        return self._reset(jnp.where((rows >= 1) & (rows < self.num_slots + self.num_snapshots), rows, -1))

    # ---------------------------------------------------------------- prefix sharing

    def copy_state(self, src, dst) -> "KVCacheManager":
        """State row ``dst[i] <- src[i]`` in every layer (SWA and compressor
        rings, GDN conv and recurrent states): a slot into a snapshot row
        (``num_slots + i``) or back. All sources are read before any
        destination is written. Blocks and ``seq_lens`` are not state rows:
        see :meth:`attach_prefix`.

        Rows are ``1 .. num_slots + num_snapshots - 1``; a pair with any
        other id on either side (the -1 padding, the null row 0, negatives,
        ids past the rows) is skipped. All or nothing: when two copied pairs
        name the same destination (which copy would win is undefined; the
        GDN pool refuses it) nothing is copied at all, in any layer. There
        is no ``ok``: callers give distinct destinations (:meth:`capture`
        does). ``src`` and ``dst`` must have the same size
        (``InvalidArgument`` at trace time)."""
        src = jnp.asarray(src, jnp.int32).reshape(-1)
        dst = jnp.asarray(dst, jnp.int32).reshape(-1)
        if src.shape != dst.shape:
            raise InvalidArgument(f"copy_state: {src.shape[0]} sources but {dst.shape[0]} destinations "
                                  "(one source per destination)")
        rows = self.num_slots + self.num_snapshots
        pair = (src >= 1) & (src < rows) & (dst >= 1) & (dst < rows)
        pair = pair & ids_distinct(dst, pair, rows)  # else none: all layers agree with the GDN pool's refusal
        source = jnp.where(pair, src, 0)
        target = jnp.where(pair, dst, rows)  # out of range: dropped
        stores = tuple(c.copy_rows(source, target) for c in self.v4_stores)
        gdn = self.gdn
        if gdn is not None:
            gdn, _ = gdn.copy_states(jnp.where(pair, src, -1), jnp.where(pair, dst, -1))
        window = None if self.window_pool is None else self.window_pool.copy_rows(source, target)
        return self.replace(v4_stores=stores, gdn=gdn, window_pool=window)

    def capture(self, slots, advanced) -> "KVCacheManager":
        """With ``capture_every`` > 0: copy the state of every slot of
        ``slots`` that ``advanced`` this step and now holds a multiple of
        ``capture_every`` tokens into its staging snapshot ``slot - 1``
        (skipped entirely when no row is on a boundary). A no-op otherwise.
        jaxkv's own steps (``jaxkv.nn.steps``, the engine) never call it: a
        caller that enables ``capture_every`` calls it after each of its
        steps.

        Ids outside the request slots ``1 .. max_requests`` (-1 padding, the
        null slot 0, other negatives, snapshot rows and anything past them)
        are ignored, and a slot named twice is captured once (both copies
        would be the same). Without the range check an id past the slots
        read the last slot's length (clipped) and copied one snapshot row
        over another."""
        if not self.capture_every:
            return self
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        advanced = jnp.broadcast_to(jnp.asarray(advanced, bool).reshape(-1), slots.shape)
        is_slot = (slots >= 1) & (slots < self.num_slots)
        rows = jnp.where(is_slot, slots, 0)
        lane = jnp.arange(slots.shape[0], dtype=jnp.int32)
        first_lane = jnp.full((self.num_slots,), slots.shape[0], jnp.int32).at[
            jnp.where(is_slot, slots, self.num_slots)].min(lane, mode="drop")
        once = is_slot & (first_lane[rows] == lane)  # a repeated destination would make copy_state refuse
        lens = self.seq_lens[rows]
        on_boundary = once & advanced & (lens > 0) & (lens % self.capture_every == 0)
        src = jnp.where(on_boundary, slots, -1)
        dst = jnp.where(on_boundary, self.num_slots + slots - 1, -1)
        return jax.lax.cond(jnp.any(on_boundary), lambda m: m.copy_state(src, dst), lambda m: m, self)

    def attach_prefix(self, slots, blocks: dict, num_tokens, snapshots) -> tuple["KVCacheManager", Ok]:
        """Start admitted, empty slots from a cached prefix: ``blocks[g]``
        ``[B, M]`` (leading ids, then -1) become the first entries of slot
        ``slots[b]``'s table in group ``g`` (one more owner each: the cache
        keeps its own), ``seq_lens`` becomes ``num_tokens[b]`` and the state
        rows of snapshot ``snapshots[b]`` (-1: none) are copied into the
        slot. ``slots`` -1: skipped (only -1 is padding).

        Token-grain prefixes: ``num_tokens`` need not be a multiple of any
        group's block. Where it leaves a group's last block partly filled
        (:meth:`BlockGroup.partly_filled`: the slot will append entries
        into it), that block is not shared: the slot gets a fresh block of
        the group in its place, holding a copy of the cached block's data
        in every layer of the group (:meth:`copy_blocks`), and the cached
        block keeps exactly its owners. Full blocks are shared by
        reference. The caller's cost is at most one free block per group
        per attached row; the slot's table still holds
        ``blocks_for(num_tokens[b])`` blocks, so :meth:`reserve` and
        :meth:`preallocate` grow it as for any slot of that length.

        All or nothing: fails (``ok`` False, unchanged: tables, ref counts,
        allocators, pools, ``seq_lens``, state rows) when a slot is not
        held (0, other negatives and ids past the slots are not held), not
        empty or repeated; a row's blocks in a group are not exactly the
        ``blocks_for(num_tokens[b])`` its tokens need (a shorter row would
        let the slot read positions no block of its own holds: another
        request's leftovers), have a -1 among them, repeat an id or name a
        block that is not held; a group has fewer free blocks than the
        partly filled blocks it must copy; or a snapshot is outside ``-1 ..
        num_snapshots - 1``. ``blocks`` names exactly the manager's groups
        and each is ``[len(slots), M]`` (``InvalidArgument`` at trace time
        otherwise)."""
        self._check_groups(blocks, "attach_prefix")
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        snapshots = jnp.broadcast_to(jnp.asarray(snapshots, jnp.int32).reshape(-1), slots.shape)
        in_range = (snapshots >= -1) & (snapshots < self.num_snapshots)
        state_rows = jnp.where(in_range & (snapshots >= 0), self.num_slots + snapshots, -1)
        return self._adopt(slots, blocks, num_tokens, state_rows, in_range)

    def fork(self, parents, children) -> tuple["KVCacheManager", Ok]:
        """Start admitted, empty slots ``children[i]`` as copies of held
        slots ``parents[i]`` (parallel sampling, beam search): every group's
        full blocks shared by reference, a partly filled last block copied
        into a fresh block (as :meth:`attach_prefix`), ``seq_lens`` and
        every state row (window and SWA rings, compressor rings, Gated
        DeltaNet states) copied. Pairs with a -1 on either side are skipped.
        All or nothing, ``ok`` False and unchanged as :meth:`attach_prefix`
        (a parent not held, or holding more blocks than its length needs,
        fails too)."""
        parents = jnp.asarray(parents, jnp.int32).reshape(-1)
        children = jnp.asarray(children, jnp.int32).reshape(-1)
        if parents.shape != children.shape:
            raise InvalidArgument(f"fork: {parents.shape[0]} parents but {children.shape[0]} children")
        pair = (parents != -1) & (children != -1)
        in_range = (parents >= 1) & (parents < self.num_slots)
        rows = jnp.where(in_range, parents, 0)
        held = in_range & (self.slots.ref_count(rows) > 0)
        blocks = {name: jnp.where(pair[:, None], group.tables[rows], -1) for name, group in self.groups.items()}
        return self._adopt(jnp.where(pair, children, -1), blocks, jnp.where(pair, self.seq_lens[rows], 0),
                           jnp.where(pair, parents, -1), ~pair | held)

    def clear(self, slots) -> tuple["KVCacheManager", Ok]:
        """Give back every block ``slots`` hold and reset their state and
        length, keeping the slots held (a beam row about to be forked into).
        Fails (unchanged) when a slot is not held or repeats; -1 skipped."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        active = slots != -1
        in_range = (slots >= 1) & (slots < self.num_slots)
        held = in_range & (self.slots.ref_count(jnp.where(in_range, slots, 0)) > 0)
        ok = jnp.all(~active | held) & ids_distinct(slots, active & in_range, self.num_slots)
        slots = jnp.where(ok, slots, -1)  # nothing below happens on failure
        groups: dict[str, BlockGroup] = {}
        for name, group in self.groups.items():
            groups[name], group_ok = group.release_rows(slots)
            ok = ok & group_ok
        return self.replace(groups=groups)._reset(slots), ok

    def _adopt(self, slots, blocks: dict, num_tokens, state_rows, rows_ok) -> tuple["KVCacheManager", Ok]:
        """:meth:`attach_prefix` and :meth:`fork`: ``state_rows`` are the
        absolute state rows copied into the slots (-1: none); ``rows_ok``
        the caller's own per-row checks."""
        batch = slots.shape[0]
        blocks = {name: jnp.asarray(blocks[name], jnp.int32) for name in self.groups}
        for name, ids in blocks.items():
            if ids.ndim != 2 or ids.shape[0] != batch:
                raise InvalidArgument(f"attach_prefix: blocks[{name!r}] has shape {ids.shape}, expected "
                                      f"[{batch}, M] (one row per slot)")
        num_tokens = jnp.broadcast_to(jnp.asarray(num_tokens, jnp.int32).reshape(-1), slots.shape)
        active = slots != -1
        in_range = (slots >= 1) & (slots < self.num_slots)
        rows = jnp.where(in_range, slots, 0)
        held = in_range & (self.slots.ref_count(rows) > 0)
        row_ok = held & (self.seq_lens[rows] == 0) & (num_tokens >= 0) & rows_ok
        for name, group in self.groups.items():
            row_ok = row_ok & _prefix_row_ok(blocks[name], group, num_tokens)
        ok = jnp.all(~active | row_ok) & ids_distinct(slots, active & in_range, self.num_slots)
        groups, src, dst = {}, {}, {}
        for name, group in self.groups.items():
            groups[name], src[name], dst[name], group_ok = group.adopt_prefix(
                jnp.where(ok & active, slots, -1), blocks[name], num_tokens)
            ok = ok & group_ok
        groups = where_ok(ok, groups, self.groups)
        # A later group that failed leaves the earlier ones unchanged, so
        # their fresh blocks are not theirs to fill: no copy happens.
        src = {name: jnp.where(ok, ids, -1) for name, ids in src.items()}
        dst = {name: jnp.where(ok, ids, -1) for name, ids in dst.items()}
        seq_lens = self.seq_lens.at[jnp.where(ok & active, rows, self.num_slots)].set(num_tokens, mode="drop")
        out = self.replace(groups=groups, seq_lens=seq_lens).copy_blocks(src, dst)
        sources = jnp.where(ok & active, state_rows, -1)
        return out.copy_state(sources, jnp.where(sources >= 0, slots, -1)), ok

    def copy_blocks(self, src: dict, dst: dict) -> "KVCacheManager":
        """Block ``dst[g][i] <- src[g][i]`` of group ``g`` in every layer of
        that group: the compressed entries and CSA indexer keys of its
        DeepSeek-V4 layers, and the pages (K, V, scales, every layer) of
        ``full_pool`` for the full-attention group and ``mla_pool`` for the
        MLA group. Data only: ref counts, tables and per-request state rows
        are untouched (copy-on-write: the caller has allocated ``dst``;
        see :meth:`attach_prefix`).

        Ids are blocks ``1 .. num_blocks - 1`` of their group; a pair with
        any other id on either side (the -1 padding, the null block 0,
        negatives, ids past the group's blocks) is skipped. All sources are
        read before any destination is written. All or nothing: when two
        copied pairs of a group name the same destination (which copy would
        win is undefined), nothing is copied at all, in any group. There
        is no ``ok``. Every write is a ``mode="drop"`` scatter, so a manager
        donated into a jitted call is updated in place. ``src`` and ``dst``
        name exactly the manager's groups and ``src[g]``, ``dst[g]`` have
        the same size (``InvalidArgument`` at trace time)."""
        self._check_groups(src, "copy_blocks")
        self._check_groups(dst, "copy_blocks")
        pairs, distinct = {}, jnp.bool_(True)
        for name, group in self.groups.items():
            s = jnp.asarray(src[name], jnp.int32).reshape(-1)
            d = jnp.asarray(dst[name], jnp.int32).reshape(-1)
            if s.shape != d.shape:
                raise InvalidArgument(f"copy_blocks: group {name!r} has {s.shape[0]} sources but {d.shape[0]} "
                                      "destinations (one source per destination)")
            num_blocks = group.allocator.num_blocks
            pair = (s >= 1) & (s < num_blocks) & (d >= 1) & (d < num_blocks)
            distinct = distinct & ids_distinct(d, pair, num_blocks)
            pairs[name] = (s, d, pair)
        copies = {name: (jnp.where(pair & distinct, s, -1), jnp.where(pair & distinct, d, -1))
                  for name, (s, d, pair) in pairs.items()}
        stores = []
        for schema, cache in zip(v4_layout(self.schemas)[0], self.v4_stores):
            if schema.group is not None:
                s, d = copies[schema.group]
                num_blocks = self.groups[schema.group].allocator.num_blocks
                # Skipped pairs read block 0 and write past the blocks (dropped).
                cache = cache.copy_blocks(jnp.where(d >= 0, s, 0), jnp.where(d >= 0, d, num_blocks))
            stores.append(cache)
        pools = {}
        for kind, pool in ((AttentionKind.FULL, self.full_pool), (AttentionKind.MLA, self.mla_pool)):
            if pool is not None:
                # Every layer of one kind is in one group (its name is the kind's).
                s, d = copies[next(x.group for x in self.schemas if x.kind == kind)]
                pool, _ = pool.copy_pages(s, d)  # -1 pairs are skipped; the rest are in range and distinct
            pools[kind] = pool
        return self.replace(v4_stores=tuple(stores), full_pool=pools[AttentionKind.FULL],
                            mla_pool=pools[AttentionKind.MLA])

    def incref_blocks(self, blocks: dict) -> tuple["KVCacheManager", Ok]:
        """One more owner of each id of ``blocks[g]`` (any shape, -1 ignored)
        in group ``g``: a prefix cache taking its own reference. ``blocks``
        names exactly the manager's groups (``InvalidArgument`` at trace
        time otherwise; give an empty or all -1 array for a group with no
        ids)."""
        return self._owners(blocks, "incref")

    def release_blocks(self, blocks: dict) -> tuple["KVCacheManager", Ok]:
        """Drop one owner of each id of ``blocks[g]`` (-1 ignored): a
        block with no owner left returns to its group's free blocks.
        Fails (``ok`` False, unchanged) when an id is out of range or would
        lose more owners than it has outside the slots' tables (a
        prefix cache's references): a block a table names is never freed
        under it. ``blocks`` names exactly the manager's groups, as in
        :meth:`incref_blocks`."""
        return self._owners(blocks, "release")

    def _owners(self, blocks: dict, op: str) -> tuple["KVCacheManager", Ok]:
        """``BlockAllocator.<op>`` of ``blocks[g]`` in each group, all or nothing."""
        self._check_groups(blocks, f"{op}_blocks")
        ok = jnp.bool_(True)
        groups = dict(self.groups)
        for name in self.groups:
            ids = jnp.asarray(blocks[name], jnp.int32).reshape(-1)
            if op == "release":
                # Only the references held outside the tables may go: dropping
                # one a table holds would free a block a slot still reads.
                ok = ok & _outside_tables(groups[name], ids)
            allocator, group_ok = getattr(groups[name].allocator, op)(ids)
            groups[name] = groups[name].replace(allocator=allocator)
            ok = ok & group_ok
        return self.replace(groups=where_ok(ok, groups, self.groups)), ok

    def _check_groups(self, blocks, op: str) -> None:
        """``InvalidArgument`` unless ``blocks`` is a dict naming exactly this
        manager's groups (static: raised at trace time). A missing group
        would be a ``KeyError`` deep in the op, an unknown one silently
        ignored."""
        names = sorted(self.groups)
        if not isinstance(blocks, dict):
            raise InvalidArgument(f"{op}: blocks must be a dict of group name -> ids with the groups {names}, "
                                  f"got {type(blocks).__name__}")
        given = sorted(map(str, blocks))
        if given != names:
            missing = sorted(set(names) - set(given))
            unknown = sorted(set(given) - set(names))
            raise InvalidArgument(f"{op}: blocks names the groups {given}, expected exactly {names}"
                                  + (f" (missing {missing})" if missing else "")
                                  + (f" (unknown {unknown})" if unknown else ""))

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
        ok = (jnp.all(~active | (held & (num_new >= 0) & (num_new <= max_new_tokens)))
              & ids_distinct(slots, active, self.num_slots))
        starts = self.seq_lens[rows]
        new_lens = starts + jnp.where(active, num_new, 0)
        limits = {name: ceil_div(max_new_tokens, g.tokens_per_block) + 1 for name, g in self.groups.items()}
        # Every group is checked before any grows, so a failed reserve grows
        # none (no select over the groups' arrays: that would cost a pass
        # over every block table and ref count per step).
        for name, group in self.groups.items():
            ok = ok & group.can_grow(slots, new_lens, limits[name])
        groups = {name: group.grow(jnp.where(ok, slots, -1), new_lens, limits[name])[0]
                  for name, group in self.groups.items()}
        seq_lens = self.seq_lens.at[jnp.where(ok & active, rows, self.num_slots)].set(new_lens, mode="drop")
        return self.replace(groups=groups, seq_lens=seq_lens), jnp.where(active, starts, -1), ok

    def truncate(self, slots, lengths) -> tuple["KVCacheManager", Ok]:
        """Shorten each held slot of ``slots`` (-1: padding) to ``lengths``
        tokens, releasing in every group the blocks past what that many
        tokens need (:meth:`BlockGroup.shrink`): the undo of a
        :meth:`reserve` whose last tokens were rejected (speculative
        decoding). State rows (GDN states, SWA, window and compressor
        rings) are not positions and are not touched: the caller restores
        them (:meth:`copy_state` from a checkpoint row) and replays the
        tokens it keeps, unless :meth:`rolls_back_by_length` (window rings
        with slack are right as they are). All or nothing: fails
        (unchanged) when a slot is not held or repeats, or a length is
        negative or past the slot's."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), slots.shape)
        active = slots != -1
        rows = jnp.clip(slots, 0, self.num_slots - 1)
        held = self.slots.ref_count(jnp.where(active, slots, 0)) > 0
        ok = (jnp.all(~active | (held & (lengths >= 0) & (lengths <= self.seq_lens[rows])))
              & ids_distinct(slots, active, self.num_slots))
        groups = {}
        for name, group in self.groups.items():  # distinct held slots: each release succeeds
            groups[name], _ = group.shrink(jnp.where(ok, slots, -1), lengths)
        seq_lens = self.seq_lens.at[jnp.where(ok & active, rows, self.num_slots)].set(lengths, mode="drop")
        return self.replace(groups=groups, seq_lens=seq_lens), ok

    def rolls_back_by_length(self, num_drafts: int) -> bool:
        """Whether a verify step of ``num_drafts`` drafts rolls back by
        :meth:`truncate` alone (static): true when the only state rows are
        window rings with at least that much slack
        (:class:`~jaxkv.pool.window.WindowLayerCache`); Gated DeltaNet
        states and DeepSeek-V4's rings and compressors have been overwritten
        by the rejected tokens and need a checkpoint and a replay."""
        if self.gdn is not None or self.v4_stores:
            return False
        return self.window_pool is None or self.window_pool.slack >= num_drafts

    def preallocate(self, slots, num_tokens) -> tuple["KVCacheManager", Ok]:
        """Give each held slot of ``slots`` (-1: padding) the blocks
        ``num_tokens`` tokens need in every group now, without reserving the
        tokens (:meth:`reserve` later counts the blocks already held): a
        scheduler that admits a prompt takes all its blocks at once, so no
        later prefill chunk can find the groups empty. All or nothing
        (fails, unchanged, when a group is short or a slot not held)."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        num_tokens = jnp.broadcast_to(jnp.asarray(num_tokens, jnp.int32).reshape(-1), slots.shape)
        active = slots != -1
        held = self.slots.ref_count(jnp.where(active, slots, 0)) > 0
        ok = jnp.all(~active | held) & ids_distinct(slots, active, self.num_slots)
        for name, group in self.groups.items():  # checked before any grows, as in reserve
            ok = ok & group.can_grow(slots, num_tokens, group.max_blocks)
        groups = {name: group.grow(jnp.where(ok, slots, -1), num_tokens, group.max_blocks)[0]
                  for name, group in self.groups.items()}
        return self.replace(groups=groups), ok

    def allocate_block(self, layer: int, slot) -> tuple["KVCacheManager", Int[Array, ""], Ok]:
        """One more block for ``slot`` in ``layer``'s group, appended to its
        block table (seed 004's ``allocate_block``, for a caller that
        allocates per layer on demand; :meth:`reserve` allocates every group
        at once). Layers of one group share its table, so the block serves
        them all. ``layer`` is static (a Python int), ``slot`` may be traced.
        Tokens are still reserved with :meth:`reserve` (handles write only
        reserved positions), which counts the blocks already held.

        Returns ``(manager, block_id, ok)``; fails (unchanged, -1) when the
        slot is not held, its table is full or the group has no free block.
        Raises ``InvalidArgument`` (at trace time) for a layer out of range
        or one that allocates nothing (SWA-only, linear).
        """
        schema = self._check_layer(layer)
        if schema.group is None:
            raise InvalidArgument(f"layer {layer} ({schema.kind.value}) allocates no blocks")
        slot = jnp.asarray(slot, jnp.int32).reshape(())
        in_range = (slot >= 1) & (slot < self.num_slots)
        held = in_range & (self.slots.ref_count(jnp.clip(slot, 0, self.num_slots - 1)) > 0)
        group, block, ok = self.groups[schema.group].append_block(jnp.where(held, slot, -1))
        return self.replace(groups={**self.groups, schema.group: group}), block, ok

    # ---------------------------------------------------------------- layers

    def acquire(self, layer, request_slots, positions, request_ids=None, *,
                implementation: str | None = None, like: int | None = None) -> LayerCacheHandle:
        """The handle of ``layer`` for one step (no allocation, no host sync).

        ``request_slots`` ``[B]``; ``positions`` ``[T]``; ``request_ids``
        ``[T]`` batch row of each token (default: token ``t`` is row ``t``,
        decoding one token per request). Rows whose slot is not held become
        padding (-1), and so do tokens at positions the request has not
        reserved (outside ``[0, seq_lens[slot])``): they write and read nothing.

        ``layer`` is an int, or a traced int32 for a layer under a scan
        (:meth:`jaxkv.nn.scan.DecoderStack.run`); then ``like`` names a
        static layer of the same store (the scan's column), whose schema the
        handle takes. The caller guarantees the traced layer is in
        ``like``'s store: of its kind, and for a DeepSeek-V4 layer of its
        store class (:func:`v4_layout`; a layer under a scan's column is,
        when the model's layer signature captures its kind and ratio).
        """
        traced = isinstance(layer, jax.core.Tracer)
        if traced:
            if like is None:
                raise InvalidArgument("acquire of a traced layer index needs like=<a static layer of its kind>")
            schema = self._check_layer(like)
            layer = jnp.asarray(layer, jnp.int32)
        else:
            schema = self._check_layer(layer)
            layer = like = schema.layer_idx
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
        rank = self._rank(layer, like)
        return LayerCacheHandle(
            request_slots=request_slots, positions=positions, request_ids=request_ids,
            cache=(self.window_pool if kind == AttentionKind.WINDOW
                   else self.v4_stores[self._store(like)] if kind in _V4_KINDS else None),
            kv_pool={AttentionKind.FULL: self.full_pool, AttentionKind.MLA: self.mla_pool}.get(kind),
            gdn=self.gdn if kind == AttentionKind.LINEAR else None,
            block_table=None if group is None else group.tables,
            block_lens=None if group is None else group.lens,
            epoch=self.write_epochs[self._store(like)],
            schema=schema,
            kv_layer=rank if kind in (AttentionKind.FULL, AttentionKind.MLA) else -1,
            gdn_layer=rank if kind == AttentionKind.LINEAR else -1,
            window_layer=rank if kind == AttentionKind.WINDOW else -1,
            cache_layer=rank if kind in _V4_KINDS else -1,
            implementation=implementation)

    def update(self, handle: LayerCacheHandle) -> "KVCacheManager":
        """Put back what ``handle`` wrote (its layer's arrays, or the shared
        K/V or GDN pool) and count the write-back.

        One handle per store at a time (see :mod:`jaxkv.manager.layer_handle`):
        a handle acquired before another handle of the same store (any layer
        of the same DeepSeek-V4 store class or shared full/MLA/GDN/window pool) was
        written back is stale, and writing it back would undo that write.
        Refused with ``InvalidArgument`` when called eagerly and under
        :func:`jaxkv.checked`; inside a plain ``jit`` the check cannot
        raise, so the rule is the caller's.
        """
        layer = handle.schema.layer_idx
        kind = handle.schema.kind
        store = self._store(layer)  # a traced layer's handle carries its like's schema: the same store
        current = self.write_epochs[store]
        fresh = handle.epoch == current
        if not isinstance(fresh, jax.core.Tracer) and not bool(fresh):
            raise InvalidArgument(f"stale handle of layer {layer} ({kind.value}): acquired at write-back "
                                  f"{int(handle.epoch)} of its store, which is now at {int(current)} (another "
                                  f"handle of the store was updated since; acquire after that update)")
        require(fresh, InvalidArgument, f"stale handle of layer {layer} ({kind.value}): acquired at write-back "
                "{} of its store, which is now at {}", handle.epoch, current)
        out = self.replace(write_epochs=self.write_epochs.at[store].add(1))
        if kind in _V4_KINDS:
            return out.replace(v4_stores=self.v4_stores[:store] + (handle.cache,) + self.v4_stores[store + 1:])
        if kind == AttentionKind.FULL:
            return out.replace(full_pool=handle.kv_pool)
        if kind == AttentionKind.MLA:
            return out.replace(mla_pool=handle.kv_pool)
        if kind == AttentionKind.WINDOW:
            return out.replace(window_pool=handle.cache)
        return out.replace(gdn=handle.gdn)

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

    def allocate_block_or_raise(self, layer: int, slot: int) -> tuple["KVCacheManager", int]:
        """Host path of :meth:`allocate_block`: ``(manager, block_id)``.
        Raises ``InvalidArgument`` for a layer out of range or without
        blocks, a slot that is not an integer, or a full block table;
        ``InvalidId`` for a slot not held; ``KVCacheOOM`` naming the group."""
        schema = self._check_layer(layer)
        if schema.group is None:
            raise InvalidArgument(f"layer {layer} ({schema.kind.value}) allocates no blocks")
        slot = _host.int_scalar(slot, "slot")
        device_slot = jnp.int32(_host.as_int32_ids(np.int64(slot)))  # out of int32: a slot no one holds
        manager, block, ok = _allocate_block_jit(self, schema.layer_idx, device_slot)
        if bool(ok):
            return manager, int(block)
        self._raise_for_slots("allocate_block", [slot])
        if slot == -1:
            raise InvalidId("allocate_block for slot -1: -1 is padding, not a request slot", [slot])
        group = self.groups[schema.group]
        if int(group.lens[slot]) >= group.max_blocks:
            raise InvalidArgument(f"allocate_block for slot {slot}: its {schema.group} table is full "
                                  f"({group.max_blocks} blocks, max_context_tokens reached)")
        raise KVCacheOOM(1, int(group.allocator.num_free), group.allocator.capacity, unit=f"{schema.group} blocks")

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


def _prefix_row_ok(blocks: Int[Array, "B M"], group: BlockGroup, num_tokens: Int[Array, " B"]) -> Array:
    """Per row: ``blocks`` holds exactly the ``blocks_for(num_tokens)`` ids a
    prefix of that many tokens needs in ``group``, leading (no -1 among
    them), each once and in ``[1, num_blocks)`` (whether they are held is
    ``adopt_prefix``'s check). A sort per row: attaching is once per admission, not
    per decode step."""
    present = blocks != -1
    count = jnp.sum(present, axis=1, dtype=jnp.int32)
    column = jnp.arange(blocks.shape[1], dtype=jnp.int32)[None, :]
    leading = jnp.all(present == (column < count[:, None]), axis=1)
    in_range = jnp.all(~present | ((blocks >= 1) & (blocks < group.allocator.num_blocks)), axis=1)
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(present, blocks, big), axis=1)
    repeated = jnp.any((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != big), axis=1)
    return leading & in_range & ~repeated & (count == group.blocks_for(jnp.maximum(num_tokens, 0)))


def _outside_tables(group: BlockGroup, ids: Int[Array, " n"]) -> Array:
    """Whether releasing ``ids`` (-1 ignored, one owner per occurrence)
    leaves every block at least as many owners as the group's tables name
    it (out-of-range ids are the allocator's to refuse)."""
    num_blocks = group.allocator.num_blocks
    in_tables = jnp.zeros((num_blocks,), jnp.int32).at[
        jnp.where(group.tables >= 0, group.tables, num_blocks)].add(1, mode="drop")
    dropped = jnp.zeros((num_blocks,), jnp.int32).at[
        jnp.where((ids >= 0) & (ids < num_blocks), ids, num_blocks)].add(1, mode="drop")
    return jnp.all(dropped <= group.allocator.ref_counts - in_tables)


def _host_slots(slots, name: str, ndim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host slot ids (``InvalidArgument`` unless integers), flattened, and
    their int32 copy for the device op (``_host.as_int32_ids``)."""
    ids = _host.int_array(slots, name, ndim=ndim).reshape(-1)
    return ids, _host.as_int32_ids(ids)


_admit_jit = jax.jit(KVCacheManager.admit, static_argnames=("max_n",))
_reserve_jit = jax.jit(KVCacheManager.reserve, static_argnames=("max_new_tokens",))
_release_jit = jax.jit(KVCacheManager.release)
_allocate_block_jit = jax.jit(KVCacheManager.allocate_block, static_argnames=("layer",))


def _store_cache(schema: LayerCacheSchema, config: HybridConfig, num_slots: int, num_blocks: int,
                 num_layers: int) -> CompressedLayerCache:
    """The stacked arrays of a DeepSeek-V4 store class of ``num_layers``
    layers, as its schema says."""
    return CompressedLayerCache.create(
        schema.entry_format, num_slots, schema.window, num_blocks=num_blocks,
        entries_per_block=schema.entries_per_block if schema.group is not None else 0,
        compressor_rows=schema.compressor_rows, compressor_width=schema.compressor_width,
        index_format=schema.index_format, index_compressor_width=schema.index_compressor_width,
        num_layers=num_layers)
