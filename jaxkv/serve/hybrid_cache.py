"""The hybrid adapter of the cache contract (:mod:`jaxkv.serve.caches`): a
hybrid model's :class:`~jaxkv.KVCacheManager` and its prefix cache of
snapshots."""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.errors import BookkeepingError, CacheLocked, InvalidArgument
from jaxkv.manager import hybrid_host
from jaxkv.manager.block_space import FREE, ON_DEVICE, SWAPPED
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_swap import RequestImages, release_blocks_scrubbed, release_scrubbed, reset_rows
from jaxkv.nn.packed import PackedBatch
from jaxkv.nn.sampling import RowSampling
from jaxkv.nn.speculative import hybrid_cache_options, hybrid_packed_verify_step
from jaxkv.nn.steps import PROGRAM_OPTIONS, hybrid_packed_step, hybrid_prefill_chunk
from jaxkv.prefix.snapshot_cache import BlockOps, SnapshotCache
from jaxkv.prefix.snapshot_host import SnapshotHostTier
from jaxkv.prefix.snapshot_points import SnapshotPoints
from jaxkv.serve.caches import (CacheBase, DecodeResult, PackedResult, PrefillLane, PrefixHit, apply_history_updates,
                                fetch, fixed_ids, keys_as_given, pack_stream, pow2_ids, remembers_arguments, row_of,
                                sample_first, slot_of, typed_keys)
from jaxkv.serve import sizing
from jaxkv.serve.sizing import CachePlan

__all__ = ["HybridCache", "jitted_packed", "jitted_packed_verify", "jitted_prefill"]

logger = logging.getLogger("jaxkv.serve")


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,), compiler_options=PROGRAM_OPTIONS)
def _hybrid_prefill(graphdef, params, manager: KVCacheManager, slots, tokens, num_new, sampling: RowSampling, keys):
    """Reserve and prefill one chunk of the slots' tokens, sample each lane's
    first token. Returns ``(manager, sampled, keys, ok, used, logprobs)``."""
    manager, last_logits, ok = hybrid_prefill_chunk(graphdef, params, manager, slots, tokens, num_new)
    sampled, advanced, logprobs = sample_first(last_logits, typed_keys(keys), sampling)
    return manager, sampled, keys_as_given(advanced, keys), ok, manager.blocks_in_use, logprobs



@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,), compiler_options=PROGRAM_OPTIONS)
def _hybrid_packed(graphdef, params, manager: KVCacheManager, batch: PackedBatch, sampling: RowSampling, keys):
    """:func:`jaxkv.nn.steps.hybrid_packed_step` jitted (manager donated)."""
    manager, tokens, advanced, *rest = hybrid_packed_step(graphdef, params, manager, batch, sampling, typed_keys(keys))
    return (manager, tokens, keys_as_given(advanced, keys), *rest)


@partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnums=(2, 6), compiler_options=PROGRAM_OPTIONS)
def _hybrid_packed_verify(graphdef, params, manager: KVCacheManager, batch: PackedBatch, sampling: RowSampling, keys,
                          history, history_len, verify, history_updates=None, *, config):
    """:func:`jaxkv.nn.speculative.hybrid_packed_verify_step` jitted (manager
    and the rows' histories donated; ``history_updates`` written into the
    histories first, which come back last)."""
    history = apply_history_updates(history, history_updates)
    manager, tokens, counts, advanced, *rest = hybrid_packed_verify_step(
        graphdef, params, manager, batch, sampling, typed_keys(keys), history, history_len, verify, config=config)
    return (manager, tokens, counts, keys_as_given(advanced, keys), *rest, history)



_preallocate_hybrid = jax.jit(KVCacheManager.preallocate, donate_argnums=(0,))
_admit_hybrid = jax.jit(lambda manager, n, max_n: manager.admit(n, max_n=max_n), static_argnums=(2,),
                        donate_argnums=(0,))
_release_hybrid = jax.jit(KVCacheManager.release, donate_argnums=(0,))
_attach_prefix = jax.jit(KVCacheManager.attach_prefix, donate_argnums=(0,))
_copy_state = jax.jit(KVCacheManager.copy_state, donate_argnums=(0,))
_incref_blocks = jax.jit(KVCacheManager.incref_blocks, donate_argnums=(0,))
_release_blocks = jax.jit(KVCacheManager.release_blocks, donate_argnums=(0,))


@partial(jax.jit, static_argnames=("max_n",), donate_argnums=(0,))
def _admit_grown(manager: KVCacheManager, n, want, lengths, *, max_n: int):
    """``admit(n)``, then ``preallocate(want, lengths)`` only where the
    admission took exactly the slots ``want`` names (``[max_n]``, -1
    padded): one call for a batch with no cached prefix to attach.
    Returns ``(manager, slots, admitted, grown)``; ``grown`` is False when
    the slots differ (nothing grown) or a group is short."""
    manager, slots, admitted = manager.admit(n, max_n=max_n)
    same = admitted & jnp.all(slots == want)
    manager, grown = manager.preallocate(jnp.where(same, want, -1), lengths)
    return manager, slots, admitted, grown & same


@partial(jax.jit, donate_argnums=(0,))
def _incref_and_copy(manager: KVCacheManager, blocks: dict, src, dst):
    """``incref_blocks(blocks)``, then ``copy_state(src, dst)`` only if the
    increfs were taken: a snapshot store's device work in one call (when
    nothing is spilled or released between them). Returns ``(manager,
    ok)``."""
    manager, ok = manager.incref_blocks(blocks)
    return manager.copy_state(jnp.where(ok, src, -1), jnp.where(ok, dst, -1)), ok


@partial(jax.jit, static_argnames=("width",), donate_argnums=(0,))
def _take_blocks(manager: KVCacheManager, counts: dict, *, width: int):
    """``counts[g]`` fresh blocks of each group (one reference each, owned
    by the caller: the prefix cache), all or nothing. Returns ``(manager,
    {group: ids [width], -1 padded}, ok)``."""
    ok = jnp.all(jnp.asarray([counts[name] <= g.allocator.num_free for name, g in manager.groups.items()]))
    groups, ids = {}, {}
    for name, group in manager.groups.items():
        allocator, ids[name], _ = group.allocator.acquire(jnp.where(ok, counts[name], 0), max_n=width)
        groups[name] = group.replace(allocator=allocator)
    return manager.replace(groups=groups), ids, ok


@dataclasses.dataclass(eq=False)
class _HostHit:
    """A hit on host record ``key`` (pinned there: it stays until the hit
    is admitted or unpinned); once loaded (:meth:`HybridCache._load_host_hit`),
    ``loaded`` holds the pinned tree node of its pages and the tail blocks
    per group the load holds one reference to."""

    key: int
    loaded: tuple | None = None


class HybridCache(CacheBase):
    """A hybrid model's :class:`~jaxkv.KVCacheManager` (DeepSeek-V4's
    SWA/CSA/HCA layers, Qwen3-Next's full-attention group and Gated DeltaNet
    state): one group per block group of the manager. Preemption is by
    swap when ``host_kv_memory`` gives host bytes for the images of
    swapped-out rows (:meth:`swap_out`), else by recomputation.

    **Host tier** (``host_prefix_memory`` bytes): a snapshot record leaving
    the device (dropped for its row by the retention policy, or with a page
    evicted under block pressure) is copied to host memory whole (its
    blocks in every group and its state row); a later request whose prompt
    it prefixes better than the device can hits it: the admission counts
    fresh blocks for it, :meth:`begin_prefill` loads the data into them,
    puts its pages back into the tree, writes its state straight into the
    request's slot, and keeps it on the device again as a record when the
    retention policy gives it a row.

    **Prefix cache** (:class:`~jaxkv.prefix.snapshot_cache.SnapshotCache`,
    which holds the tree of ``unit``-token pages and the snapshot records;
    this adapter applies the device work it returns). A snapshot is a copy
    of a request's state rows (SWA window, compressor and indexer rings,
    GDN states) at an exact token position, taken between device calls with
    no capture inside the jitted steps: at the end of a prefill piece that
    :class:`~jaxkv.prefix.snapshot_points.SnapshotPoints` chooses (a cut the
    pieces are made to end on, or an interval), and when a request retires,
    finished or preempted, at its exact length (the next turn of a
    conversation hits all of it).

    A hit shares the whole blocks by reference and gets a private copy of
    each group's partly filled last block (copy on write, in
    :meth:`~jaxkv.KVCacheManager.attach_prefix`), so a hit is as long as the
    state that was kept, at token grain.

    **Speculation** (``lookahead``: the verify step's drafts,
    ``num_speculative_tokens``): window rings get ``lookahead`` slots of
    slack (they then roll back by length alone); a model with other state
    (Gated DeltaNet, DeepSeek-V4's rings and compressors) gets ``max_seqs``
    checkpoint state rows after the prefix cache's snapshot rows (one per
    row: a verify step copies a row's states there before it runs the
    drafts, and a row that rejected one gets them back and replays what it
    kept: :mod:`jaxkv.nn.speculative`); tables have room for ``lookahead``
    tokens past ``max_context_tokens``. The plan counts the checkpoint
    rows (``CachePlan.checkpoint_rows``).
    """

    @remembers_arguments
    def __init__(self, model, *, max_seqs: int, max_context_tokens: int, num_blocks: dict | None,
                 entry_format: str, prefill_chunk: int, prefix_cache: bool = True, num_snapshots: int | None = None,
                 retention: str = "value", snapshot_interval: int | None = None, host_kv_memory: int = 0,
                 host_prefix_memory: int = 0, lookahead: int = 0):
        self.max_seqs = max_seqs
        self.max_context_tokens = max_context_tokens
        self.prefill_width = min(pow2_at_least(prefill_chunk), pow2_at_least(max_context_tokens))
        probe = jax.eval_shape(lambda: model.make_cache(1, max_context_tokens, entry_format=entry_format,
                                                        num_blocks=num_blocks))  # static sizes only
        block_sizes = [g.tokens_per_block for g in probe.groups.values()]
        self.unit = math.lcm(*block_sizes) if block_sizes else 1
        cached = (2 * max_seqs if num_snapshots is None else num_snapshots) if prefix_cache else 0
        self.num_cached_snapshots = cached
        self.lookahead = lookahead
        #: Speculation's checkpoint rows: the state rows after the prefix cache's (one per row, for a model
        #: whose state a rejected token overwrites: jaxkv.nn.speculative.hybrid_cache_options); window rings
        #: get ``lookahead`` slots of slack instead.
        options, self.num_checkpoints = (
            hybrid_cache_options(model, lookahead, max_seqs, max_context_tokens=max_context_tokens,
                                 entry_format=entry_format, num_blocks=num_blocks) if lookahead else ({}, 0))
        # The tables hold a verify step's rejected tokens past a request's end too.
        self.manager = model.make_cache(max_seqs, max_context_tokens + lookahead, entry_format=entry_format,
                                        num_blocks=num_blocks, num_snapshots=cached + self.num_checkpoints, **options)
        self.pool = None
        groups = self.manager.groups
        self.groups = tuple(groups)
        self.capacity = np.asarray([g.allocator.capacity for g in groups.values()], np.int64)
        self._per_block = [(g.tokens_per_entry, g.entries_per_block) for g in groups.values()]
        costs = sizing.hybrid_bytes(self.manager)
        self.bytes_per_token, self.group_block_bytes = costs.per_token, list(costs.per_block)
        self.state_bytes_per_request = costs.per_state_row
        self.host_prefixes = (SnapshotHostTier(hybrid_host.HostStore(host_prefix_memory, memory_kind="auto"))
                              if host_prefix_memory and cached else None)
        self.snapshots = SnapshotCache(self.unit, self.groups, self.blocks_for, cached, retention=retention,
                                       row_bytes=int(self.state_bytes_per_request),
                                       block_bytes=self.group_block_bytes, spill=self.host_prefixes is not None)
        self.prefix_cache = self.snapshots.tree
        self.hit_grain = 1  # hits end where a snapshot was taken, at any token
        #: Where each row is snapshotted (its length, last snapshot and cuts).
        self.points = SnapshotPoints(max_seqs, max(self.unit, 256) if snapshot_interval is None else snapshot_interval,
                                     enabled=cached > 0)
        self._released: set = set()  # ids of the snapshot hits unpinned at admission (see unpin)
        self.disk = None  # the disk tier (attach_disk)
        self._block_axes = None  # record_block_axes, found once
        self.host_bytes = int(host_kv_memory or 0)  # host memory for swapped-out rows
        self.can_swap = self.host_bytes > 0
        self.images = RequestImages(self.host_bytes, self.state_bytes_per_request, self.group_block_bytes)
        self.plan = self._plan(budget=None, source="num_blocks (expert option)" if num_blocks else
                               "every sequence row at max_context_tokens")

    # The host tier's counters (benchmarks and tests read them here).
    host_stored_tokens = property(lambda self: self.host_prefixes.stored_tokens if self.host_prefixes else 0)
    host_loaded_tokens = property(lambda self: self.host_prefixes.loaded_tokens if self.host_prefixes else 0)

    def _host_tiers(self) -> list[str]:
        return ((["host_kv_memory"] if self.can_swap else [])
                + (["host_prefix_memory"] if self.host_prefixes is not None else []))

    def isolate(self, *, scrub_on_free: bool = False, prefix_quota: float | None = None) -> None:
        super().isolate(scrub_on_free=scrub_on_free, prefix_quota=prefix_quota)
        if self.host_prefixes is not None:
            self.host_prefixes.scrub = self.scrub

    def _set_quota(self, quota: float) -> None:
        """Pages: the quota's share of the group holding the fewest pages;
        snapshot rows: its share of them (at least one each)."""
        pages = min((int(cap) // per for cap, per in zip(self.capacity, self.snapshots.blocks_per_page) if per),
                    default=1)
        self.snapshots.set_quota(max(1, int(quota * pages)), max(1, int(quota * self.num_cached_snapshots)))

    def device_bytes(self) -> int:
        """Bytes of every device array of the cache (the manager's pools,
        state rows, tables and allocators)."""
        return self.manager.memory_bytes()

    def _plan(self, *, budget, source, per_block: list[int] | None = None) -> CachePlan:
        return sizing.hybrid_plan(self.manager, max_seqs=self.max_seqs, max_model_len=self.max_context_tokens,
                                  unit=self.unit, num_snapshots=self.num_cached_snapshots, host_bytes=self.host_bytes,
                                  budget=budget, source=source, per_block=per_block,
                                  checkpoint_rows=self.num_checkpoints)

    # ---------------------------------------------------------------- blocks

    def _host_leaves(self, manager) -> tuple:
        return [g.allocator.num_free for g in manager.groups.values()], manager.slots.ref_counts

    def blocks_for(self, num_tokens: int) -> np.ndarray:
        """Blocks a request of ``num_tokens`` holds per group (a compressed
        group's blocks hold only completed entries)."""
        return np.asarray([ceil_div(num_tokens // per_entry, per_block) for per_entry, per_block in self._per_block],
                          np.int64)

    def blocks_for_many(self, num_tokens: np.ndarray) -> np.ndarray:
        num_tokens = np.asarray(num_tokens, np.int64)
        out = np.zeros((num_tokens.size, len(self._per_block)), np.int64)
        for g, (per_entry, per_block) in enumerate(self._per_block):
            out[:, g] = ceil_div(num_tokens // per_entry, per_block)
        return out

    def blocks_in_use(self) -> int:
        return int((self.capacity - self.free_blocks()).sum())  # the manager's blocks_in_use

    def limits(self) -> str:
        return (f"max_model_len={self.max_context_tokens} tokens per request (max_context_tokens="
                f"{self.max_context_tokens}); the groups have "
                f"{self.capacity.tolist()} blocks")

    # ---------------------------------------------------------------- prefix

    def prefix_stats(self) -> dict:
        """Metrics of the prefix cache: the hit unit of whole pages
        (tokens), what :meth:`SnapshotCache.usage` reports, the tree's
        counters, and the disk tier's (:class:`~jaxkv.prefix.disk.DiskStats`,
        None without one; ``disk_tokens`` it put into the host tier)."""
        return dict(unit_tokens=self.unit, **self.snapshots.usage(), tree=self.prefix_cache.stats(),
                    disk=self.disk.store.stats() if self.disk is not None else None,
                    disk_tokens=self.disk.loaded_tokens if self.disk is not None else 0)

    # ---------------------------------------------------------------- moving prefixes between caches

    def record_data(self, record):
        """``(blocks per group, data)`` of snapshot ``record``: ``data`` its
        blocks' contents in every group and its state row, gathered now (a
        snapshot; the host tier's layout: ids padded to powers of two)."""
        snapshots = self.snapshots
        blocks = [[b for h in record.path for b in snapshots.pages[h][g]] + list(record.tail[g])
                  for g in range(len(self.groups))]
        ids = {name: pow2_ids(b) for name, b in zip(self.groups, blocks)}
        data = (hybrid_host.read_blocks(self.manager, ids),
                hybrid_host.read_state_rows(self.manager, [self.manager.num_slots + record.row]))
        return [len(b) for b in blocks], data

    def record_as(self, counts, leaves: list):
        """A record's data (:meth:`record_data`'s structure) rebuilt from its
        arrays ``leaves`` (host arrays, in leaf order) for ``counts`` blocks
        per group; ``InvalidArgument`` when they do not have this cache's
        shapes and dtypes (another model or cache layout)."""
        want = self._record_shape(counts)
        expected = jax.tree.leaves(want)
        if len(expected) != len(leaves) or any(a is None or a.shape != w.shape or a.dtype != w.dtype
                                               for a, w in zip(leaves, expected)):
            raise InvalidArgument(f"a snapshot record of {len(leaves)} arrays does not fit this cache ({len(expected)} "
                                  "expected, or other shapes or dtypes: another model or cache layout)")
        return jax.tree.unflatten(jax.tree.structure(want), list(leaves))

    def record_block_axes(self) -> list[tuple[int, int]]:
        """For each block leaf of a record's data (the leaves before the
        state row's), its group's index and the axis its blocks lie on
        (found by growing one group's count at a time)."""
        if self._block_axes is None:
            def shapes(counts):
                return [leaf.shape for leaf in jax.tree.leaves(self._record_shape(counts)[0])]

            base = shapes([1] * len(self.groups))
            axes = [None] * len(base)
            for g in range(len(self.groups)):
                grown = shapes([2 if i == g else 1 for i in range(len(self.groups))])
                for n, (a, b) in enumerate(zip(base, grown)):
                    if a != b:
                        axes[n] = (g, next(k for k in range(len(a)) if a[k] != b[k]))
            if None in axes:
                raise InvalidArgument("a block leaf of this cache grows with no group's blocks: its records "
                                      "cannot be cut into pages")
            self._block_axes = axes
        return self._block_axes

    def _record_shape(self, counts):
        """The shapes and dtypes of :meth:`record_data`'s data for ``counts``
        blocks per group."""
        return jax.eval_shape(lambda m: (
            hybrid_host.read_blocks(m, {g: jnp.asarray(pow2_ids([1] * int(n))) for g, n in zip(self.groups, counts)}),
            hybrid_host.read_state_rows(m, jnp.ones((1,), jnp.int32))), self.manager)

    def export_prefix(self, tokens, namespace):
        """The longest snapshot record of ``tokens`` the device holds (at
        most ``len - 1`` tokens): ``(prefix tokens, kind, blocks per group,
        data)`` (:meth:`record_data`), or None. For a prefill engine handing
        a prompt to a decode engine (:mod:`jaxkv.serve.disaggregated`)."""
        hit = self.snapshots.match(tokens, namespace)
        if hit.record is None:
            return None
        try:
            record = self.snapshots.records[hit.record]
            counts, data = self.record_data(record)
            return tuple(record.prefix), record.kind, counts, data
        finally:
            self.snapshots.release(hit)

    def import_prefix(self, prefix, namespace, kind: str, counts, data) -> int:
        """Keep a snapshot record of ``prefix`` (:meth:`export_prefix`'s
        ``data``, or a disk record's) in the host tier, made if missing
        (:meth:`ensure_host_tier`); a later prompt it begins hits it as any
        host-tier record. Returns its tokens (0: the host tier could not
        take it)."""
        host = self.ensure_host_tier()
        if host.put(namespace, tuple(prefix), kind, list(counts), data, hybrid_host.tree_nbytes(data)):
            return len(prefix)
        return 0

    def ensure_host_tier(self) -> SnapshotHostTier:
        """The prefix cache's host tier; made, of two longest requests'
        records, when ``host_prefix_memory`` gave none (the way in for
        records from a disk tier or another engine)."""
        if not self.num_cached_snapshots:
            raise InvalidArgument("this cache keeps no snapshots (prefix_cache off, or num_snapshots 0): no "
                                  "prefix can be taken in")
        if self.host_prefixes is None:
            nbytes = int(2 * (self.max_context_tokens * self.bytes_per_token + self.state_bytes_per_request))
            self.host_prefixes = SnapshotHostTier(hybrid_host.HostStore(nbytes, memory_kind="auto"))
            self.host_prefixes.scrub = self.scrub
            self.snapshots.spill = True
            logger.info("prefix cache host tier: %d bytes (for prefixes taken in)", nbytes)
        return self.host_prefixes

    def attach_disk(self, model, directory, budget_bytes: int, entry_format: str) -> None:
        """Give the prefix cache a disk tier in ``directory`` of at most
        ``budget_bytes`` (:class:`~jaxkv.serve.disk_tier.HybridDiskTier`);
        it reads back through the host tier (made, of two longest requests'
        records, when ``host_prefix_memory`` gave none)."""
        from jaxkv.prefix.disk import DiskStore
        from jaxkv.serve.disk_tier import HybridDiskTier, hybrid_identity

        self.ensure_host_tier()  # the way back from disk
        store = DiskStore(directory, budget_bytes=budget_bytes,
                          identity=hybrid_identity(model, self.manager, self.unit, entry_format))
        self.disk = HybridDiskTier(self, store)
        stats = store.stats()
        logger.info("prefix cache disk tier: %s, %d records (%d bytes) of this model found, budget %d bytes",
                    store.directory, stats.records, stats.bytes, budget_bytes)

    def usage(self) -> list[dict]:
        """Per group: ``tokens`` and ``blocks`` held by running requests and
        the prefix cache, ``bytes``, ``free`` blocks, the whole-page unit
        and the smallest hit (one token: hits are token grain)."""
        free = self.free_blocks()
        held = self.snapshots.held_blocks()
        rows = []
        for g, name in enumerate(self.groups):
            used = int(self.capacity[g] - free[g])
            per = self._per_block[g][0] * self._per_block[g][1]
            rows.append(dict(group=name, blocks=used, capacity=int(self.capacity[g]), free=int(free[g]),
                             tokens=used * per, bytes=used * self.group_block_bytes[g],
                             cached_blocks=len(held[name]), hit_unit=self.unit, min_hit=1))
        usage = self.snapshots.usage()
        rows.append(dict(group="snapshots", blocks=usage["snapshots"], capacity=self.num_cached_snapshots,
                         free=usage["free_snapshots"], tokens=0, bytes=usage["snapshot_bytes"], cached_blocks=0,
                         hit_unit=self.unit, min_hit=1))
        return rows

    def take_events(self) -> list:
        """The snapshot events since the last call (``SnapshotCache.events``)."""
        return self.snapshots.take_events()

    def match(self, tokens: list, namespace) -> PrefixHit:
        """The longest cached prefix of ``tokens`` with a snapshot (at most
        ``len - 1`` tokens, token grain), pinned until :meth:`unpin`.
        ``blocks[g]``: group ``g``'s blocks of the hit; ``copied[g]``: 1
        when the last of them is partly filled (the request gets a copy)."""
        hit = self.snapshots.match(tokens, namespace)
        best = self._host_candidate(tokens, namespace, hit.tokens)
        if best is not None:  # loaded at admission (begin_prefill), into blocks the admission counted
            self.snapshots.release(hit)
            self.host_prefixes.pin(best)
            length = len(self.host_prefixes.entry(best)[1])
            return PrefixHit(length, tuple([] for _ in self.groups), _HostHit(best), snapshot=-1, matched=length,
                             loads=self._copied(length))
        return PrefixHit(hit.tokens, hit.blocks, hit if hit.record is not None else None, snapshot=hit.row,
                         matched=hit.branch, copied=self._copied(hit.tokens))

    def cached_length(self, tokens: list, namespace) -> int:
        """The tokens :meth:`match` would hit now from the device's records
        and the host tier (at most ``len - 1``), changing nothing; with a
        disk tier, a longer record on disk is read into the host tier first,
        as :meth:`match` would read it."""
        device = self.snapshots.cached_length(tokens, namespace)
        best = self._host_candidate(tokens, namespace, device)
        return device if best is None else len(self.host_prefixes.entry(best)[1])

    def _host_candidate(self, tokens: list, namespace, device: int):
        """The key of the host tier's longest record of ``tokens`` longer
        than ``device`` tokens (the device's hit), or None; a longer record
        on disk goes into the host tier first."""
        if self.host_prefixes is None:
            return None
        if self.disk is not None:
            known = self.host_prefixes.candidate(tokens, namespace, device)
            self.disk.extend(tokens, namespace, len(self.host_prefixes.entry(known)[1]) if known is not None
                             else device)
        return self.host_prefixes.candidate(tokens, namespace, device)

    def _copied(self, tokens: int) -> tuple:
        """Per group, 1 when a hit of ``tokens`` ends inside a block (copied on attach)."""
        return tuple(int(bool((tokens // per_entry) % per_block)) for per_entry, per_block in self._per_block)

    def unpin(self, hit) -> None:
        """Undo :meth:`match`'s pins (a hit attached to a row was unpinned
        at admission: its slot holds the blocks and the state by then, so
        the record and its pages are free to go while the request runs)."""
        if hit is None or hit.node is None:
            return
        if id(hit.node) in self._released:
            self._released.discard(id(hit.node))
        elif isinstance(hit.node, _HostHit):  # never admitted: nothing was loaded
            self.host_prefixes.unpin(hit.node.key)
        else:
            self.snapshots.release(hit.node)

    def reset_prefix(self) -> bool:
        """Drop every cached prefix: records, pages and host-tier copies
        (their blocks released, scrubbed when on). False, nothing changed,
        while a request holds a hit it has not attached yet."""
        if self.host_prefixes is not None and self.host_prefixes.pinned:
            return False
        try:
            ops = self.snapshots.clear()
        except CacheLocked:
            return False
        self._apply(ops)
        if self.host_prefixes is not None:
            self.host_prefixes.clear()
        return True

    def can_evict(self) -> bool:
        return self.snapshots.evictable

    def evict(self, shortfall: np.ndarray) -> None:
        """Evict least recently used tree pages (and the snapshots keyed at
        them), then snapshots holding tail blocks, until each group has
        ``shortfall`` references back (or nothing is evictable)."""
        self._apply(self.snapshots.evict_blocks([int(n) for n in shortfall]))

    def _block_tables(self) -> dict:
        """Every group's block tables on the host (``name -> [slots,
        blocks]``): read once per change of the tables (with the packed
        call's results where :meth:`_wants_tables`; kept across
        :meth:`_apply`, which changes references and state rows only)."""
        if self.__dict__.get("_host_tables") is None:
            self._host_tables = self._tables_as_host(fetch(self._device_tables(self.manager)))
        return self._host_tables

    @staticmethod
    def _device_tables(manager) -> dict:
        return {name: g.tables for name, g in manager.groups.items()}

    @staticmethod
    def _tables_as_host(tables: dict) -> dict:
        return {name: np.asarray(t) for name, t in tables.items()}

    def _wants_tables(self, prefill) -> bool:
        return bool(self.num_cached_snapshots) and any(
            end > start and self.points.stores_at(lane.row, end, lane.hit.matched, len(lane.tokens))
            for lane, (start, end) in prefill)

    def _apply(self, ops: BlockOps) -> None:
        """The device work of a snapshot-cache operation: increfs, copies of
        the records leaving to the host tier, releases (one call each),
        then state copies into snapshot rows (a store's increfs and copy in
        one call where nothing else is asked). None of it changes a slot's
        block table: the host's copy of the tables stays."""
        tables = self.__dict__.get("_host_tables")
        self._apply_ops(ops)
        self._host_tables = tables

    def _apply_ops(self, ops: BlockOps) -> None:
        copies = None
        if ops.copies:
            dst, src = zip(*((self.manager.num_slots + row, source) for row, source in ops.copies.items()))
            width = self._copy_width(len(src))
            copies = fixed_ids(src, width), fixed_ids(dst, width)
        rows = [self.manager.num_slots + row for row in ops.cleared] if self.scrub else []
        if (copies is not None and any(ops.incref.values()) and not ops.spills and not any(ops.release.values())
                and not rows):  # a store's common case: its increfs and its copy, one call
            self._block_call(_incref_and_copy, ops.incref, "the prefix cache's reference to stored blocks", *copies)
            return
        if any(ops.incref.values()):
            self._block_call(_incref_blocks, ops.incref, "the prefix cache's reference to stored blocks")
        for spill in ops.spills:  # before their blocks are released and their rows reused
            self._to_host(spill)
        if any(ops.release.values()):
            self._drop_references(ops.release, "releasing evicted prefix blocks", rows=rows)
        elif rows:
            self.manager = reset_rows(self.manager, pow2_ids(rows))
        if copies is not None:
            self.manager = _copy_state(self.manager, *copies)

    # ---------------------------------------------------------------- host tier

    def _to_host(self, spill) -> None:
        """Copy a record leaving the device (its blocks in every group and
        its snapshot row) to the host tier, which makes room by dropping its
        oldest records; one that cannot fit is not kept."""
        blocks = {name: pow2_ids(ids) for name, ids in zip(self.groups, spill.blocks)}
        data = (hybrid_host.read_blocks(self.manager, blocks),
                hybrid_host.read_state_rows(self.manager, [self.manager.num_slots + spill.row]))
        self.host_prefixes.put(spill.namespace, spill.tokens, spill.kind, [len(ids) for ids in spill.blocks], data,
                               hybrid_host.tree_nbytes(data))

    def _load_host_hit(self, lane: PrefillLane) -> PrefillLane:
        """Load ``lane``'s host-tier hit into fresh blocks (the admission
        counted them): its data written, its whole pages into the tree
        (pages the tree has meanwhile keep the tree's blocks). Returns the
        lane with the hit's blocks, for :meth:`_attach_hits`; its tail
        blocks are this call's until :meth:`_finish_host_hit`."""
        key = lane.hit.node.key
        _, prefix, _, counts = self.host_prefixes.entry(key)
        self.manager, ids, ok = _take_blocks(self.manager, {name: np.int32(n) for name, n in zip(self.groups, counts)},
                                             width=pow2_at_least(max(max(counts), 1)))
        ids = jax.device_get(ids)
        if not bool(ok):
            raise BookkeepingError(f"loading a {len(prefix)}-token host prefix needs {counts} blocks of groups "
                                   f"{list(self.groups)}; {self.free_blocks().tolist()} free (admission counted them)")
        blocks, _ = self.host_prefixes.get(key)
        targets = {name: pow2_ids(ids[name][:n].tolist()) for name, n in zip(self.groups, counts)}  # as read
        self.manager = hybrid_host.write_blocks(self.manager, targets, jax.device_put(blocks))
        given = [ids[name][:n].tolist() for name, n in zip(self.groups, counts)]
        handles, ops = self.snapshots.adopt_pages(prefix, given, lane.namespace)
        self._apply(ops)
        depth = len(prefix) // self.unit
        tail = tuple(given[g][depth * per:] for g, per in enumerate(self.snapshots.blocks_per_page))
        node = self.prefix_cache.pin_prefix(list(prefix[: depth * self.unit]), lane.namespace) if depth else None
        lane.hit.node.loaded = (node, tail)
        self.host_prefixes.loaded_tokens += len(prefix)
        logger.debug("prefix cache: a %d-token prefix came back from host memory", len(prefix))
        hit_blocks = tuple([b for h in handles for b in self.snapshots.pages[h][g]] + list(tail[g])
                           for g in range(len(self.groups)))
        return dataclasses.replace(lane, hit=dataclasses.replace(lane.hit, blocks=hit_blocks))

    def _finish_host_hit(self, lane: PrefillLane) -> None:
        """After the attach: the state straight from host memory into the
        slot, the load's own references dropped, and the prefix kept on
        the device again as a record (its row taken by the retention
        policy) or, failing that, left on host."""
        host = lane.hit.node
        _, prefix, kind, _ = self.host_prefixes.entry(host.key)
        _, state = self.host_prefixes.get(host.key)
        self.manager = hybrid_host.write_state_rows(self.manager, [slot_of(lane.row)], jax.device_put(state))
        node, tail = host.loaded
        self.prefix_cache.release(node)
        self._drop_references(dict(zip(self.groups, (list(ids) for ids in tail))),
                              "releasing a host hit's load references")
        self.host_prefixes.unpin(host.key)
        tables = {name: np.asarray(jax.device_get(g.tables[slot_of(lane.row)])) for name, g in self.manager.groups.items()}
        dropped = self.snapshots.dropped
        self._apply(self.snapshots.store(list(prefix), [tables[name] for name in self.groups], slot_of(lane.row),
                                         kind=kind, namespace=lane.namespace))
        if self.disk is not None:
            self.disk.written()
        if (self.snapshots.dropped == dropped and host.key in self.host_prefixes
                and not self.host_prefixes.is_pinned(host.key)):
            self.host_prefixes.discard(host.key)  # on the device again (or it was there already)

    def _copy_width(self, n: int) -> int:
        return max(self.max_seqs, pow2_at_least(n))

    def _block_call(self, fn, blocks: dict, what: str, *extra) -> None:
        """``fn(manager, blocks, *extra)`` (incref or release) of ``blocks``
        per group, ids padded to a power of two."""
        width = pow2_at_least(max(len(ids) for ids in blocks.values()))
        padded = {name: fixed_ids(ids, width) for name, ids in blocks.items()}
        self.manager, ok = fn(self.manager, padded, *extra)
        ok, host = fetch((ok, self._host_leaves(self.manager)))
        self._mirror(host)
        if not bool(ok):
            raise BookkeepingError(f"{what} was refused: {blocks}")

    def _drop_references(self, blocks: dict, what: str, rows=()) -> None:
        """Drop one reference to each of ``blocks``; with scrub-on-free the
        call zeroes what it frees and resets the snapshot ``rows`` let go."""
        if self.scrub:
            self._block_call(release_blocks_scrubbed, blocks, what, pow2_ids(rows))
        else:
            self._block_call(_release_blocks, blocks, what)

    def _store(self, items: list) -> None:
        """Snapshot ``(row, tokens, namespace, kind, hit)`` per request: its
        state at exactly ``len(tokens)`` tokens (one device call per kind of
        work, for all of them; per request with a host tier, whose copies
        read the rows the earlier stores wrote)."""
        if not items or not self.num_cached_snapshots:
            return
        tables = self._block_tables()
        ops = self.snapshots.empty_ops()
        for row, tokens, namespace, kind, hit in items:
            record = getattr(hit.node, "record", None) if hit is not None else None  # (a host hit has none)
            row_blocks = [tables[name][slot_of(row)] for name in self.groups]
            ops.extend(self.snapshots.store(tokens, row_blocks, slot_of(row), kind=kind, namespace=namespace,
                                            supersedes=record))
            self.points.stored(row, len(tokens))
            if self.snapshots.spill:  # a later store may spill this record: its row must hold its state by then
                self._apply(ops)
                ops = self.snapshots.empty_ops()
                if self.disk is not None:  # its row holds its state now: read before a later store reuses it
                    self.disk.written()
        self._apply(ops)
        if self.disk is not None:
            self.disk.written()

    # ---------------------------------------------------------------- steps

    def _begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """Take the lanes' request slots (the lowest free ones, which must be
        their rows' slot_of: the engine gives out the lowest free rows) and start
        the hits from their cached prefixes; then every prompt's blocks. With
        no hit to start from, one device call does both."""
        want = [slot_of(lane.row) for lane in lanes]
        lengths = np.zeros((self.max_seqs,), np.int32)
        lengths[: len(lanes)] = [len(lane.tokens) for lane in lanes]
        if all(lane.hit.node is None and not lane.hit.tokens for lane in lanes):
            self.manager, slots, admitted, ok = _admit_grown(self.manager, len(lanes), fixed_ids(want, self.max_seqs),
                                                             lengths, max_n=self.max_seqs)
            slots, admitted, ok, host = fetch((slots, admitted, ok, self._host_leaves(self.manager)))
            self._check_admitted(lanes, want, slots, admitted)
            for lane in lanes:
                self.points.start(lane.row, 0)
        else:
            self._admit_with_hits(lanes, want)
            self.manager, ok = _preallocate_hybrid(self.manager, fixed_ids(want, self.max_seqs), lengths)
            ok, host = fetch((ok, self._host_leaves(self.manager)))
        self._mirror(host)
        if not bool(ok):
            need = sum(self.blocks_for(len(lane.tokens)) for lane in lanes)
            raise BookkeepingError(f"engine admission failed: rows {[lane.row for lane in lanes]} need "
                                   f"{need.tolist()} blocks of groups {list(self.groups)}, "
                                   f"{self.free_blocks().tolist()} free")

    def _check_admitted(self, lanes: list[PrefillLane], want: list, slots: np.ndarray, admitted) -> None:
        """``BookkeepingError`` unless the admission took exactly the slots
        ``want`` (the lanes' rows')."""
        if not admitted or slots[: len(lanes)].tolist() != want:
            raise BookkeepingError(f"hybrid admission gave slots {slots[: len(lanes)].tolist()} "
                                   f"(ok={bool(admitted)}) for rows {[lane.row for lane in lanes]}, which need "
                                   f"slots {want}")

    def _admit_with_hits(self, lanes: list[PrefillLane], want: list) -> None:
        """The lanes' slots, and their rows started from their hits
        (attached; a host tier's loaded first)."""
        self.manager, slots, admitted = _admit_hybrid(self.manager, len(lanes), self.max_seqs)
        slots, admitted = fetch((slots, admitted))
        self._check_admitted(lanes, want, slots, admitted)
        for lane in lanes:
            self.points.start(lane.row, lane.hit.tokens)
        loaded = [self._load_host_hit(lane) if isinstance(lane.hit.node, _HostHit) else lane for lane in lanes]
        self._attach_hits([lane for lane in loaded if lane.hit.tokens])
        for lane in loaded:  # attached: the slot holds the blocks and the state, the record needs no pin
            node = lane.hit.node
            if isinstance(node, _HostHit):
                self._finish_host_hit(lane)
            elif node is not None:
                self.snapshots.release(node)
            if node is not None:
                self._released.add(id(node))

    def _attach_hits(self, hits: list[PrefillLane]) -> None:
        """Start the rows of ``hits`` from their cached prefixes."""
        if not hits:
            return
        batch = self.max_seqs
        width = max(1, max(len(lane.hit.blocks[g]) for lane in hits for g in range(len(self.groups))))
        blocks = {name: np.full((batch, width), -1, np.int32) for name in self.groups}
        slots, tokens, snapshots = np.full(batch, -1, np.int32), np.zeros(batch, np.int32), np.full(batch, -1, np.int32)
        for i, lane in enumerate(hits):
            slots[i], tokens[i], snapshots[i] = slot_of(lane.row), lane.hit.tokens, lane.hit.snapshot
            for g, name in enumerate(self.groups):
                blocks[name][i, : len(lane.hit.blocks[g])] = lane.hit.blocks[g]
        self.manager, ok = _attach_prefix(self.manager, slots, blocks, tokens, snapshots)
        if not bool(ok):
            raise BookkeepingError(f"attaching cached prefixes to rows {[lane.row for lane in hits]} was refused "
                                   f"(copies of partly filled blocks need one free block per group and row; "
                                   f"{self.free_blocks().tolist()} free)")

    def add_cut(self, row: int, position: int) -> bool:
        """Snapshot row ``row`` when its prefill reaches ``position``
        (another request waits for that prefix). Returns whether the
        engine must cut the row's prefill pieces there
        (:meth:`SnapshotPoints.add_cut`)."""
        return self.points.add_cut(row, position)

    def _cuts(self, lane: PrefillLane) -> list[int]:
        """Where a prefill piece must end so that the state there is
        snapshotted (:meth:`SnapshotPoints.cuts`)."""
        return self.points.cuts(lane.row, lane.hit.matched, len(lane.tokens))

    def _prefill_call(self, graphdef, params, lanes, starts, num_new, tokens, sampling, keys):
        slots = fixed_ids([slot_of(lane.row) for lane in lanes], self.max_seqs)
        slots = np.where(num_new > 0, slots, -1).astype(np.int32)
        self.manager, sampled, new_keys, ok, used, logprobs = _hybrid_prefill(graphdef, params, self.manager, slots,
                                                                              tokens, num_new, sampling, keys)
        sampled, ok, used, new_keys, logprobs = fetch((sampled, ok, used, new_keys, logprobs))
        if not ok:  # every prompt's blocks were taken at admission
            raise BookkeepingError(f"engine prefill refused rows {[lane.row for lane in lanes]} (pieces "
                                   f"{list(zip(starts[: len(lanes)].tolist(), num_new[: len(lanes)].tolist()))})")
        self._after_prefill(lanes, starts, num_new)
        return sampled, np.asarray(new_keys), int(used), logprobs

    def _after_prefill(self, lanes, starts, num_new, defer: bool = False) -> None:
        """Snapshot the rows whose piece ended on a cut, or an interval past
        their last snapshot (before a later piece moves their state on)."""
        items = []
        for i, lane in enumerate(lanes):
            if not num_new[i]:
                continue
            end = int(starts[i]) + int(num_new[i])
            kind = self.points.piece_ran(lane.row, end, lane.hit.matched, len(lane.tokens))
            if kind is not None:
                items.append((lane.row, lane.tokens[:end], lane.namespace, kind, lane.hit))
        self._store(items)

    def _seq_id(self, row: int) -> int:
        return slot_of(row)

    def _seq_ids(self, rows: np.ndarray) -> np.ndarray:
        return np.where(rows >= 0, rows + 1, -1)  # slot_of

    def _prefill_rows(self, num_prefill: int) -> int:
        """The prefill-lane class of a packed step: Gated DeltaNet views the
        prefill lanes as ``[P, width]``, so ``P`` is a power of two; a model
        without such layers never looks at it (every lane: one program per
        bucket)."""
        if self.manager.gdn is None:
            return self.max_seqs
        return min(pow2_at_least(max(num_prefill, 1)), self.max_seqs)

    def prefill_lane_cap(self, num_prefill: int, budget: int) -> int:
        """With Gated DeltaNet layers, ``budget // P`` (``P`` prefill lanes,
        :meth:`_prefill_rows`): their ``[P, width]`` view then holds at most
        ``budget`` token slots. A width of the whole budget made it ``P x
        budget`` (Qwen3-Next at the GPU default of 8,192 tokens: 256 lanes of
        8,192, 210 GB of temporaries compiled for H100; docs/gpu.md); a
        piece cut here runs on in the next step, as a budget cut does."""
        if self.manager.gdn is None:
            return budget
        return max(budget // self._prefill_rows(num_prefill), 1)

    #: A packed step takes speculative verify lanes (:func:`jaxkv.nn.speculative.hybrid_packed_verify_step`).
    packs_verify_lanes = True

    def _packed_call(self, graphdef, params, prefill, decode, sampling, keys, num_tokens, *, want_tables=False,
                     prefill_width=None, speculation=None, scored=None):
        rows = self._prefill_rows(len(prefill))
        width = num_tokens if self.manager.gdn is None else min(num_tokens, prefill_width or num_tokens)
        num_decode = len(decode[0])
        counts = drafted = accepted = logprobs = scores = history = None
        if speculation is None:
            batch = pack_stream(prefill, *decode, num_lanes=self.max_seqs, num_tokens=num_tokens,
                                num_prefill_lanes=rows, max_prefill_len=width, scored=scored)
            self.manager, tokens, keys, prefill_ok, ok, used, logprobs, scores = _hybrid_packed(
                graphdef, params, self.manager, batch, sampling, keys)
        else:
            config, (history, updates), history_len, verify, draft = speculation
            if draft is not None:  # the engine refuses an early exit over a hybrid cache at start-up
                raise InvalidArgument("a hybrid cache's packed step verifies n-gram drafts only")
            batch = pack_stream(prefill, *decode, num_lanes=self.max_seqs, num_tokens=num_tokens,
                                num_prefill_lanes=rows, max_prefill_len=width,
                                decode_widths=np.where(verify, config.num_speculative_tokens + 1, 1))
            lanes = np.zeros((self.max_seqs,), bool)
            lanes[len(prefill):len(prefill) + num_decode] = verify
            self.manager, tokens, counts, keys, prefill_ok, ok, used, drafted, accepted, history = (
                _hybrid_packed_verify(graphdef, params, self.manager, batch, sampling, keys, history, history_len,
                                      lanes, updates, config=config))
        tokens, keys, prefill_ok, ok, used, host, tables, logprobs, scores, counts, drafted, accepted = fetch(
            (tokens, keys, prefill_ok, ok, used, self._host_leaves(self.manager),
             self._device_tables(self.manager) if want_tables else None, logprobs, scores, counts, drafted,
             accepted))
        self._mirror(host)
        if want_tables:
            self._host_tables = self._tables_as_host(tables)
        if not prefill_ok:  # every prompt's blocks were taken at admission
            raise BookkeepingError(f"engine packed prefill refused slots {[lane.seq_id for lane in prefill]}"
                                   f" (pieces {[(lane.start, len(lane.tokens)) for lane in prefill]})")
        if ok:  # each decode lane's row grew by its token (and a verify lane's kept drafts)
            rows = [row_of(slot) for slot in decode[0].tolist()]
            grew = np.ones(len(rows), np.int64) if counts is None else counts[len(prefill):len(prefill) + num_decode]
            self.points.grew_many(rows, grew)
        # The reserve is all or nothing and does not say which row was short.
        blocked = np.zeros((self.max_seqs,), bool)
        if not ok:
            blocked[len(prefill):len(prefill) + num_decode] = True
        return PackedResult(tokens, np.asarray(keys), bool(ok), blocked, int(used), counts, drafted, accepted,
                            logprobs, scores, history)

    def _decode_view(self):
        return self.manager, None

    def _decode_done(self, manager, pool) -> None:
        self.manager = manager

    def decode(self, graphdef, params, last, active, num_generated, max_new, eos_id, sampling, key_data,
               num_steps, speculation=None) -> DecodeResult:
        if speculation is not None and speculation[0].num_speculative_tokens > self.lookahead:
            raise InvalidArgument(f"speculative decode chunks of {speculation[0].num_speculative_tokens} drafts over "
                                  f"a hybrid cache built with lookahead={self.lookahead}: build it with "
                                  "lookahead=num_speculative_tokens (Engine(..., speculative=...) does)")
        result = super().decode(graphdef, params, last, active, num_generated, max_new, eos_id, sampling, key_data,
                                num_steps, speculation)
        rows = np.flatnonzero(active)
        self.points.grew_many(rows, result.count[rows])  # each token written is one step
        return result

    def retire(self, finished: list) -> None:
        """``finished``: ``(row, tokens whose K/V are cached, namespace, hit)``
        per request. Snapshot each row at its exact length (a turn end),
        then release the rows' slots and blocks and unpin their hits."""
        if not finished:
            return
        self._store([(row, tokens, namespace, "turn_end", hit) for row, tokens, namespace, hit in finished
                     if len(tokens) > (hit.tokens if hit is not None else 0)])
        rows = [row for row, *_ in finished]
        self.manager, ok = self._release(fixed_ids([slot_of(r) for r in rows], self.max_seqs))
        ok, host = fetch((ok, self._host_leaves(self.manager)))
        self._mirror(host)
        if not bool(ok):
            raise BookkeepingError(f"engine bookkeeping failed: releasing rows {rows} (slots "
                                   f"{[slot_of(r) for r in rows]}) was refused")
        for row, *_, hit in finished:
            self.unpin(hit)
            self.points.clear(row)

    def _release(self, slots):
        """``KVCacheManager.release`` of ``slots`` (scrubbed when on)."""
        return (release_scrubbed if self.scrub else _release_hybrid)(self.manager, slots)

    def swap_out(self, row: int) -> bool:
        """Preempt row ``row`` to host memory (:class:`~jaxkv.manager.hybrid_swap.RequestImages`):
        its state rows (rings, windows, GDN states) and the data of every
        block of its tables, in every group. False (nothing changed) without
        a host budget (``host_kv_memory``) or when the image does not fit."""
        self.manager, ok = self.images.swap_out(self.manager, slot_of(row), scrub=self.scrub)
        return ok

    def host_used(self) -> int:
        """Host bytes the swapped-out rows' images hold."""
        return self.images.used()

    def swap_in(self, row: int) -> bool:
        """Bring row ``row``'s image back into its slot (fresh blocks in
        every group, all or nothing); False when a group is short."""
        self.manager, ok = self.images.swap_in(self.manager, slot_of(row), scrub=self.scrub)
        return ok

    def free_swapped(self, row: int) -> None:
        """Drop a swapped-out row's image and free its slot (an aborted request)."""
        self.images.drop(slot_of(row), scrub=self.scrub)
        self.manager, ok = self._release(fixed_ids([slot_of(row)], self.max_seqs))
        if not bool(ok):
            raise BookkeepingError(f"freeing swapped-out row {row} (slot {slot_of(row)}) was refused")
        self.points.clear(row)

    def _status_from(self, counts: np.ndarray) -> np.ndarray:
        """From the slot allocator's reference counts (``slots.ref_count``'s
        rule on the host) and the swapped-out rows' images."""
        slots = np.arange(1, self.max_seqs + 1)  # slot_of each row
        held = np.where(slots < counts.size, counts[np.minimum(slots, counts.size - 1)], 0) > 0
        status = np.where(held, ON_DEVICE, FREE)
        # Indexing the few swapped rows, not np.isin over every row (this runs before every decoding call).
        swapped = np.asarray([row_of(slot) for slot in self.images.slots()], np.int64)
        swapped = swapped[(swapped >= 0) & (swapped < self.max_seqs)]
        status[swapped[held[swapped]]] = SWAPPED
        return status


#: The engine's jitted steps of this cache kind, by public name (``jaxkv.bench.engine_aot`` compiles them
#: at real sizes without a GPU).
jitted_packed, jitted_prefill, jitted_packed_verify = _hybrid_packed, _hybrid_prefill, _hybrid_packed_verify
