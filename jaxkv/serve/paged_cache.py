"""The paged adapter of the cache contract (:mod:`jaxkv.serve.caches`): a
paged :class:`~jaxkv.KVPool` under a :class:`~jaxkv.BlockSpaceManager`, the
radix prefix cache of page ids and swapping to a host pool.

Host tier of the prefix cache (``host_prefix_pages > 0``, SGLang HiCache-like):
a second host pool of that many pages, apart from the swap pool, holds the
pages the prefix cache evicts. Invariants:

* :meth:`PagedCache.evict` copies every evicted page that moves to the host
  tier (``Evicted.offload_from`` -> ``offload_to``, one transfer call) BEFORE
  its device block is released, so the copy reads the page's last contents;
* a hit may run into host-tier pages: :meth:`PagedCache.match` counts them in
  ``PrefixHit.tokens`` but not in ``PrefixHit.blocks`` (they hold no device
  block yet), so the engine reserves free blocks for them as for a cold
  prefill; :meth:`PagedCache.begin_prefill` loads them (one acquire, one
  transfer call for the whole batch) into fresh blocks that the tree owns,
  one reference each, as for inserted pages, before the rows take theirs;
* host page ids are the prefix cache's own (``0 .. host_prefix_pages - 1``,
  no null page: nothing but these copies reads that pool); the tree's host
  free list accounts for every one of them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _host
from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import BookkeepingError, CacheLocked, InvalidArgument, KVCacheOOM
from jaxkv.manager.block_space import ON_DEVICE, BlockSpaceManager
from jaxkv.nn.packed import PackedBatch
from jaxkv.nn.sampling import RowSampling
from jaxkv.nn.speculative import paged_packed_verify_step
from jaxkv.nn.steps import (PROGRAM_OPTIONS, paged_decode_peak, paged_packed_step, paged_row_blocks, paged_window,
                            prefill_chunk)
from jaxkv.pool import host as host_swap
from jaxkv.pool.kv_pool import KVPool
from jaxkv.pool.scrub import freed_blocks, scrub_kv_pool
from jaxkv.prefix import PrefixCacheManager, PrefixCacheStats
from jaxkv.prefix.radix import HOST
from jaxkv.serve import sizing
from jaxkv.serve.caches import (CacheBase, PackedResult, PrefillLane, PrefixHit, apply_history_updates, fetch,
                                fixed_ids, keys_as_given, pack_stream, remembers_arguments, sample_first, typed_keys)
from jaxkv.serve.sizing import CachePlan, GroupPlan

__all__ = ["HostTierRate", "PagedCache", "PagedPrefixStats", "host_tier_rate", "jitted_packed",
           "jitted_packed_verify", "jitted_prefill"]

logger = logging.getLogger("jaxkv.serve")


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,), compiler_options=PROGRAM_OPTIONS)
def _paged_prefill(graphdef, params, manager: BlockSpaceManager, pool: KVPool, rows, starts, num_new, tokens,
                   sampling: RowSampling, keys):
    """Prefill one chunk of admitted rows and sample from each lane's last
    chunk position. Returns ``(pool, sampled, keys, logprobs)``."""
    pool, last_logits = prefill_chunk(graphdef, params, manager.in_step(), pool, rows, tokens, starts,
                                      num_new)
    sampled, advanced, logprobs = sample_first(last_logits, typed_keys(keys), sampling)
    return pool, sampled, keys_as_given(advanced, keys), logprobs



@partial(jax.jit, static_argnames=("graphdef", "window", "scrub"), donate_argnums=(2, 3),
         compiler_options=PROGRAM_OPTIONS)
def _paged_packed(graphdef, params, manager: BlockSpaceManager, pool: KVPool, admission, batch: PackedBatch,
                  sampling: RowSampling, keys, *, window, scrub=False):
    """The engine's admission of new rows, then
    :func:`jaxkv.nn.steps.paged_packed_step`, in ONE call (manager and pool
    donated). ``admission``: ``BlockSpaceManager.admit_with_prefix``'s
    ``(rows, prefix blocks, lengths)`` (every row -1: nothing to admit).
    Returns the step's results, then whether the admission took place.
    When it did not (a bookkeeping bug: the engine checked the rows and
    blocks first), no token of the step is real (every position -1, so
    nothing is written) and the engine raises ``BookkeepingError``, which
    its fault containment answers by dropping the cache."""
    manager, admitted = manager.in_step().admit_with_prefix(*admission)
    batch = batch.replace(positions=jnp.where(admitted, batch.positions, -1))
    manager, pool, tokens, advanced, *rest = paged_packed_step(graphdef, params, manager, pool, batch, sampling,
                                                               typed_keys(keys), window=window, scrub=scrub)
    return (manager, pool, tokens, keys_as_given(advanced, keys), *rest, admitted)


@partial(jax.jit, static_argnames=("graphdef", "config", "window", "scrub", "draft_graphdef"),
         donate_argnums=(2, 3, 7), compiler_options=PROGRAM_OPTIONS)
def _paged_packed_verify(graphdef, params, manager: BlockSpaceManager, pool: KVPool, batch: PackedBatch,
                         sampling: RowSampling, keys, history, history_len, verify, history_updates=None,
                         draft_params=None, *, config, window, scrub=False, draft_graphdef=None):
    """:func:`jaxkv.nn.speculative.paged_packed_verify_step` jitted (manager,
    pool and the rows' histories donated; ``history_updates`` written into
    the histories first, which come back last; ``draft_graphdef`` /
    ``draft_params``: an early exit's drafts instead of n-gram's)."""
    history = apply_history_updates(history, history_updates)
    manager, pool, tokens, counts, advanced, *rest = paged_packed_verify_step(
        graphdef, params, manager.in_step(), pool, batch, sampling, typed_keys(keys), history,
        history_len, verify, config=config, window=window, scrub=scrub, draft_graphdef=draft_graphdef,
        draft_params=draft_params)
    return (manager, pool, tokens, counts, keys_as_given(advanced, keys), *rest, history)


@partial(jax.jit, donate_argnums=(0, 1))
def _retire_scrubbed(manager: BlockSpaceManager, pool: KVPool, incref, rows, release):
    """``BlockSpaceManager.retire`` and the pages it freed zeroed, in one
    call (scrub-on-free). Returns ``(manager, pool, ok)``."""
    manager = manager.in_step()
    retired, ok = manager.retire(incref, rows, release)
    return retired, scrub_kv_pool(pool, freed_blocks(manager.device, retired.device)), ok


@partial(jax.jit, donate_argnums=(0,))
def _scrub_freed(pool: KVPool, before: BlockAllocator, after: BlockAllocator) -> KVPool:
    """The pages ``before`` held and ``after`` does not, zeroed (after a
    host-path swap-out, which frees device blocks outside a jitted step of ours)."""
    return scrub_kv_pool(pool, freed_blocks(before, after))



# A forked sibling's copy of its parent's partly filled page (pairs of -1 skipped; the pool updated in place).
_copy_pages = jax.jit(lambda pool, src, dst: pool.copy_pages(src, dst)[0], donate_argnums=(0,))
_retire_paged = jax.jit(lambda manager, *ids: manager.in_step().retire(*ids))
_admit_paged = jax.jit(lambda manager, *args: manager.in_step().admit_with_prefix(*args),
                       donate_argnums=(0,))
# Fresh blocks for host-tier pages loaded back (one owner: the prefix cache's).
_acquire_blocks = jax.jit(lambda device, n, max_n: device.acquire(n, max_n=max_n), static_argnums=(2,))


@dataclasses.dataclass(frozen=True)
class PagedPrefixStats:
    """The prefix cache's figures (:meth:`PagedCache.prefix_stats`).

    ``tree``: the radix tree's own counters (:class:`~jaxkv.prefix.PrefixCacheStats`;
    its ``host_hit_tokens`` counts host-tier tokens every ``match`` found,
    a request matched again after waiting included). Host tier:
    ``host_pages`` its capacity (0: none), ``host_free_pages`` pages not
    holding a cached page, ``host_bytes`` the host pool's bytes,
    ``loaded_tokens`` tokens actually copied back into device blocks for a
    hit, ``offloaded_tokens`` tokens copied to the host tier on eviction,
    ``load_calls`` / ``offload_calls`` the transfer calls that did it.
    ``disk``: the disk tier's figures (:class:`~jaxkv.prefix.disk.DiskStats`;
    None without one), ``disk_tokens`` the tokens it read back into the host
    tier.
    """

    tree: PrefixCacheStats
    host_pages: int
    host_free_pages: int
    host_bytes: int
    loaded_tokens: int
    offloaded_tokens: int
    load_calls: int
    offload_calls: int
    disk: object = None
    disk_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class HostTierRate:
    """Measured host-tier transfer rates (:func:`host_tier_rate`): ``num_pages``
    pages of ``bytes`` in all, the best of the timed repeats each way, in
    GB/s (1e9 bytes per second): ``offload_gbps`` device -> host,
    ``load_gbps`` host -> device; ``memory_kind`` ``"pinned_host"`` or
    ``"numpy"``."""

    num_pages: int
    bytes: int
    offload_gbps: float
    load_gbps: float
    memory_kind: str


# The jitted steps never touch host blocks (they free only ON_DEVICE rows; swaps
# go through the manager's swap_*_or_raise). They get the manager without its
# host allocator and make a placeholder inside the program
# (BlockSpaceManager.in_step), so engines that differ only in
# ``num_host_pages`` share compiled programs and a step costs no dispatch for
# it; the real host allocator is put back on the result.
def _device_view(manager: BlockSpaceManager) -> BlockSpaceManager:
    return _with_host(manager, None)


def _with_host(manager: BlockSpaceManager, host) -> BlockSpaceManager:
    """``manager.replace(host=host)``, without ``dataclasses.replace``'s
    field walk and checked ``__init__`` (about 3.4 us a call hot, 20 us in
    the step against 0.5 us: a packed iteration makes six of these). Only
    the host allocator changes: the other fields are the same objects, and
    the manager defines no ``__post_init__`` to re-run (a test checks that
    both give equal pytrees)."""
    out = object.__new__(BlockSpaceManager)
    out.__dict__.update(manager.__dict__)
    out.__dict__["host"] = host
    return out


# ------------------------------------------------------------ shared prefill loop


class PagedCache(CacheBase):
    """A paged :class:`~jaxkv.KVPool` under a :class:`~jaxkv.BlockSpaceManager`
    (Llama family, DeepSeek-V3's MLA pool), with the radix prefix cache and
    swapping to a host pool. One group, ``"pages"``.

    ``host_prefix_pages`` (> 0, with the prefix cache on) gives the prefix
    cache a host tier of that many pages in a host pool of its own
    (``prefix_host_pool``; the module docstring states its invariants). A
    pool whose every layer is windowed gets none (logged): decode trims a
    hit's blocks out of its rows, and the engine's reserve counts the hit's
    blocks as shared from admission on."""

    can_swap = True

    @remembers_arguments
    def __init__(self, model, *, num_pages: int, page_size: int, max_seqs: int, max_blocks_per_seq: int,
                 num_host_pages: int, prefix_cache: bool, kv_dtype, prefill_chunk: int, host_memory_kind: str,
                 max_model_len: int | None = None, host_prefix_pages: int = 0):
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # The longest request (prompt + output); the tables hold at least that.
        self.max_context_tokens = max_blocks_per_seq * page_size if max_model_len is None else max_model_len
        self.prefill_width = min(pow2_at_least(prefill_chunk), pow2_at_least(self.max_context_tokens))
        self.manager = BlockSpaceManager.create(
            num_device_blocks=num_pages, num_host_blocks=max(num_host_pages, 2), block_size=page_size,
            max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq, watermark=0.0)
        self.pool = model.make_pool(num_pages, page_size, dtype=kv_dtype)
        self.host_pool = (host_swap.create_host_pool(self.pool, max(num_host_pages, 2), memory_kind=host_memory_kind)
                          if num_host_pages else None)
        self.can_swap = self.host_pool is not None
        self.window = paged_window(model)  # every layer windowed: decode trims blocks out of it
        if host_prefix_pages and self.window is not None:
            logger.warning("host_prefix_pages=%d: every layer of %s is windowed; its prefix cache gets no host "
                           "tier", host_prefix_pages, type(model).__name__)
            host_prefix_pages = 0
        if not prefix_cache:
            host_prefix_pages = 0
        self.host_memory_kind = host_memory_kind
        # The prefix cache's host tier: its own pool, so its pages never meet the swap allocator's.
        self.prefix_host_pool = (host_swap.create_host_pool(self.pool, host_prefix_pages,
                                                            memory_kind=host_memory_kind)
                                 if host_prefix_pages else None)
        self.prefix_cache = PrefixCacheManager(page_size, disable=not prefix_cache, host_pages=host_prefix_pages)
        self._loaded_tokens = self._load_calls = self._offload_calls = 0
        self.disk = None  # the disk tier (attach_disk)
        self.unit = page_size
        self.hit_grain = page_size  # hits are whole pages
        self._insert_at: list[set] = [set() for _ in range(max_seqs)]  # per row: prefixes others wait for
        self._pending_incref: list = []  # the tree's references to pages a packed step inserted (end_step)
        self.groups = ("pages",)
        self.capacity = np.asarray([self.manager.device.capacity], np.int64)
        leaves = jax.tree.leaves(self.pool)
        self.bytes_per_token = sum(x.size * x.dtype.itemsize for x in leaves) / (num_pages * page_size)
        self.bytes_per_block = self.bytes_per_token * page_size  # storage; the plan's figure adds the allocator's
        self.plan = self._plan(budget=None, source="num_pages (expert option)")
        if self.prefix_host_pool is not None:
            logger.info("prefix cache host tier: %d pages of %d tokens, %d bytes (%s)", host_prefix_pages, page_size,
                        sizing.tree_bytes(self.prefix_host_pool),
                        "pinned_host" if host_swap.is_pinned(self.prefix_host_pool) else "numpy")

    def _plan(self, *, budget, source, per_block: int | None = None) -> CachePlan:
        blocks = int(self.capacity[0])
        per_block = int(self.bytes_per_block) if per_block is None else per_block
        host_pages = self.host_pool and int(jax.tree.leaves(self.host_pool)[0].shape[2])
        return CachePlan(
            cache="paged", max_model_len=self.max_context_tokens, max_seqs=self.max_seqs,
            groups=(GroupPlan("pages", blocks, self.page_size, blocks * self.page_size, self.bytes_per_token,
                              per_block, per_block * (blocks + 1)),),
            prefix_unit_tokens=self.unit, num_snapshots=0, snapshot_bytes=0, host_pages=host_pages or 0,
            host_bytes=sizing.tree_bytes(self.host_pool) if self.host_pool is not None else 0,
            device_bytes=self.device_bytes(), budget_bytes=budget, source=source)

    def _host_tiers(self) -> list[str]:
        return ((["num_host_pages / host_kv_memory"] if self.host_pool is not None else [])
                + (["host_prefix_pages / host_prefix_memory"] if self.prefix_host_pool is not None else []))

    def device_bytes(self) -> int:
        """Bytes of every device array of the cache: the pool and the block
        manager (tables and allocators)."""
        return sizing.tree_bytes((self.manager, self.pool))

    # ---------------------------------------------------------------- blocks

    def _host_leaves(self, manager) -> tuple:
        return [manager.device.num_free], manager.status

    def _status_from(self, source: np.ndarray) -> np.ndarray:
        return source.copy()

    def blocks_for(self, num_tokens: int) -> np.ndarray:
        return np.asarray([ceil_div(num_tokens, self.page_size)], np.int64)

    def blocks_for_many(self, num_tokens: np.ndarray) -> np.ndarray:
        return ceil_div(np.asarray(num_tokens, np.int64), self.page_size)[:, None]

    def held_blocks_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """:func:`jaxkv.nn.steps.paged_row_blocks` of each entry."""
        num_tokens = np.asarray(num_tokens, np.int64)
        held = ceil_div(num_tokens, self.page_size)
        if self.window is None:
            return held[:, None]
        trimmed = np.maximum(num_tokens - self.window, 0) // self.page_size
        return np.where(num_tokens < 1, held, held - trimmed)[:, None]

    def decode_peak_many(self, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        first, last = np.asarray(first, np.int64), np.asarray(last, np.int64)
        if self.window is None:
            return np.where(last > first, ceil_div(last, self.page_size), 0)[:, None]
        return np.asarray([paged_decode_peak(f, l, self.page_size, self.window)  # (a window: rarely many rows)
                           for f, l in zip(first.tolist(), last.tolist())], np.int64).reshape(-1, 1)

    def growth_many(self, num_tokens: np.ndarray, steps: np.ndarray, held: np.ndarray,
                    shared: np.ndarray) -> np.ndarray:
        if self.window is None:
            return super().growth_many(num_tokens, steps, held, shared)
        num_tokens = np.asarray(num_tokens, np.int64)
        peak = self.decode_peak_many(num_tokens, num_tokens + np.asarray(steps, np.int64))
        return np.maximum(peak - np.maximum(held - shared, 0), 0)

    def decode_peak(self, first: int, last: int) -> np.ndarray:
        """With a window on every layer a step holds only the blocks of the
        window and the position it appends (:func:`jaxkv.nn.steps.paged_decode_peak`)."""
        return np.asarray([paged_decode_peak(first, last, self.page_size, self.window)], np.int64)

    def held_blocks(self, num_tokens: int) -> np.ndarray:
        return np.asarray([paged_row_blocks(num_tokens, self.page_size, self.window)], np.int64)

    def growth(self, num_tokens: int, steps: int, held: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """With a window, decode trims the hit's blocks out of the table
        too, while the prefix cache may still hold them: any block of the
        row's future window may have to come from the free blocks, and of
        the blocks it holds now only those that are not the hit's give room
        back when trimmed."""
        if self.window is None:
            return super().growth(num_tokens, steps, held, shared)
        peak = self.decode_peak(num_tokens, num_tokens + steps)
        return np.maximum(peak - np.maximum(held - shared, 0), 0)

    def first_blocks(self) -> np.ndarray:
        """Each row's first table entry (-1: none, or trimmed out of the window)."""
        return self._block_tables()[:, 0].copy()

    def blocks_in_use(self) -> int:
        return int(self.capacity[0] - self.free_blocks()[0])  # the allocator's num_used

    def limits(self) -> str:
        return (f"max_model_len={self.max_context_tokens} tokens per request (max_blocks_per_seq="
                f"{self.max_blocks_per_seq} pages of {self.page_size}); the pool has {int(self.capacity[0])} blocks")

    # ---------------------------------------------------------------- prefix

    def match(self, tokens: list, namespace) -> PrefixHit:
        """The cached prefix of ``tokens`` (capped at ``len - 1`` tokens, page
        aligned), its node pinned until :meth:`unpin`.

        With a host tier the hit runs on into host-tier pages: ``tokens``
        counts them, ``blocks`` holds only the device part (the blocks the
        request shares now), so the engine reserves free blocks for the host
        pages as for pages it would compute; :meth:`begin_prefill` loads
        them. The pin keeps them on the host until then (a pinned host node
        is never dropped)."""
        if self.disk is not None:  # records past the tree's prefix become host-tier pages first
            self.disk.extend(tokens, namespace, len(tokens) - 1)
        match = self.prefix_cache.match(tokens, namespace, max_tokens=len(tokens) - 1)
        self.prefix_cache.pin(match.node)
        blocks = list(match.blocks)
        return PrefixHit(len(blocks) * self.page_size + match.num_host_tokens, (blocks,), match.node)

    def cached_length(self, tokens: list, namespace) -> int:
        """The tokens :meth:`match` would hit now from the device and host
        tiers (page aligned, at most ``len - 1``), changing nothing; with a
        disk tier, the prompt's records on disk are read into the host tier
        first, as :meth:`match` would read them."""
        if self.disk is not None:
            self.disk.extend(tokens, namespace, len(tokens) - 1)
        return self.prefix_cache.cached_length(tokens[: max(len(tokens) - 1, 0)], namespace)

    def attach_disk(self, model, directory, budget_bytes: int) -> None:
        """Give the prefix cache a disk tier in ``directory`` of at most
        ``budget_bytes`` (:mod:`jaxkv.serve.disk_tier`); it reads back
        through the host tier (:meth:`ensure_host_tier`)."""
        from jaxkv.prefix.disk import DiskStore
        from jaxkv.serve.disk_tier import PagedDiskTier, paged_identity

        self.ensure_host_tier()  # the way back from disk
        store = DiskStore(directory, budget_bytes=budget_bytes,
                          identity=paged_identity(model, self.pool, self.page_size))
        self.disk = PagedDiskTier(self, store)
        stats = store.stats()
        logger.info("prefix cache disk tier: %s, %d records (%d bytes) of this model found, budget %d bytes",
                    store.directory, stats.records, stats.bytes, budget_bytes)

    # ---------------------------------------------------------------- moving prefixes between caches

    def export_prefix(self, tokens, namespace):
        """The device pages the prefix cache holds of ``tokens`` (whole pages
        of at most ``len - 1`` tokens, the device tier's part of a hit):
        ``(num_tokens, data)``, ``data`` a snapshot of those pages (device
        arrays shaped like the pool's leaves, pages on axis 2 padded to a
        power of two; later writes do not change it), or None when nothing
        is cached. For a prefill engine handing a prompt to a decode engine
        (:mod:`jaxkv.serve.disaggregated`)."""
        match = self.prefix_cache.match(tokens, namespace, max_tokens=len(tokens) - 1)
        if not match.blocks:
            return None
        return len(match.blocks) * self.page_size, host_swap.read_pages(self.pool, match.blocks)

    def import_prefix(self, tokens, namespace, num_tokens: int, data) -> int:
        """Take the first ``num_tokens`` (whole pages) of ``tokens`` into the
        prefix cache's host tier, page ``i``'s data at index ``i`` of axis
        2 of ``data``'s host arrays (:meth:`export_prefix`'s, fetched; a
        disk tier's records, stacked): the pages past what the tree holds
        become host-tier pages, and a later hit loads them as any host hit.
        Returns the tokens added (0: all cached already, or no host tier
        room)."""
        if self.prefix_cache.disable:
            return 0
        self.ensure_host_tier()
        pages = num_tokens // self.page_size
        host_pages, _ = self.prefix_cache.insert_host(tokens[: pages * self.page_size], namespace)
        if not host_pages:
            return 0
        start = pages - len(host_pages)  # the tree held the pages before these
        self._clear_freed_host()  # scrub-on-free zeroes pages the tier let go: before they are written
        self.prefix_host_pool = host_swap.write_host_pages(
            self.prefix_host_pool, host_pages,
            jax.tree.map(lambda leaf: np.asarray(leaf)[:, :, start:pages], data))
        return len(host_pages) * self.page_size

    def ensure_host_tier(self) -> None:
        """The prefix cache's host tier; made, of two longest requests'
        pages, when ``host_prefix_pages`` gave none (the way in for pages
        from a disk tier or another engine). ``InvalidArgument`` for a pool
        whose every layer is windowed (no host tier: decode trims a hit's
        blocks out of its rows)."""
        if self.prefix_host_pool is not None:
            return
        if self.window is not None:
            raise InvalidArgument(f"every layer of this pool is windowed ({self.window} tokens): its prefix "
                                  "cache has no host tier, so no prefix can be taken in")
        pages = 2 * self.max_blocks_per_seq
        self.prefix_host_pool = host_swap.create_host_pool(self.pool, pages, memory_kind=self.host_memory_kind)
        self.prefix_cache.add_host_tier(pages)
        logger.info("prefix cache host tier: %d pages (for prefixes taken in)", pages)

    def unpin(self, hit: PrefixHit | None) -> None:
        if hit is not None:
            self.prefix_cache.release(hit.node)

    def evict(self, shortfall: np.ndarray) -> None:
        """Evict at least ``shortfall`` blocks from the prefix cache (fewer if
        not enough are evictable) and drop the tree's references to them.
        With a host tier the pages that move there are copied first, in one
        transfer call, so the copy reads them before anyone reuses a block."""
        num_blocks = int(shortfall[0])
        if num_blocks <= 0 or self.prefix_cache.evictable_blocks == 0:
            return
        released = self._offload(self.prefix_cache.evict(num_blocks))
        if released:
            self.update(release=released)

    def _offload(self, evicted) -> list:
        """Copy the pages of ``evicted`` that move to the host tier (one
        transfer call, before anyone reuses their blocks); returns the
        blocks to release. With scrub-on-free the host pages the tier let
        go are zeroed first."""
        self._clear_freed_host()
        if evicted.offload_from:
            self.prefix_host_pool = host_swap.swap_out_pages(self.pool, self.prefix_host_pool, evicted.offload_from,
                                                             evicted.offload_to)
            self._offload_calls += 1
        return list(evicted.blocks)

    def _clear_freed_host(self) -> None:
        pages = self.prefix_cache.take_freed_host_pages()
        if self.scrub and pages and self.prefix_host_pool is not None:
            self.prefix_host_pool = host_swap.clear_host_pages(self.prefix_host_pool, pages)

    def _trim(self, namespaces) -> list:
        """With a prefix quota: each of ``namespaces`` evicted down to it
        (:meth:`~jaxkv.prefix.PrefixCacheManager.trim`); returns the blocks
        to release (copies to the host tier done)."""
        if self.prefix_cache.quota is None:
            return []
        return [b for ns in dict.fromkeys(namespaces) for b in self._offload(self.prefix_cache.trim(ns))]

    def reset_prefix(self) -> bool:
        """Drop every cached prefix, device and host tier (blocks released,
        pages scrubbed when on). False, nothing changed, while a running
        request holds a cached prefix."""
        try:
            blocks = self.prefix_cache.reset()
        except CacheLocked:
            return False
        self._clear_freed_host()
        if blocks:
            self.update(release=blocks)
        return True

    def prefix_stats(self) -> PagedPrefixStats:
        """The radix tree's counters and the host tier's figures
        (:class:`PagedPrefixStats`)."""
        tree = self.prefix_cache.stats()
        pool = self.prefix_host_pool
        return PagedPrefixStats(
            tree=tree, host_pages=self.prefix_cache.host_capacity, host_free_pages=self.prefix_cache.host_free_pages,
            host_bytes=sizing.tree_bytes(pool) if pool is not None else 0, loaded_tokens=self._loaded_tokens,
            offloaded_tokens=tree.offloaded_tokens, load_calls=self._load_calls, offload_calls=self._offload_calls,
            disk=self.disk.store.stats() if self.disk is not None else None,
            disk_tokens=self.disk.loaded_tokens if self.disk is not None else 0)

    def _load_host_hits(self, lanes: list[PrefillLane]) -> list[list]:
        """Each lane's prefix blocks, with the host-tier pages of its hit
        loaded first: the distinct host nodes of every lane (two lanes may
        hit one) get fresh blocks in ONE acquire and ONE transfer call, then
        ``loaded`` hands the blocks to the tree (its one reference). The
        engine reserved those blocks (the hit's ``blocks`` leave them out):
        short of them is a bug (``BookkeepingError``, nothing changed)."""
        prefixes, nodes, seen = [], [], set()
        for lane in lanes:
            hit = lane.hit
            device_pages = len(hit.blocks[0])
            if hit.node is None or hit.tokens == device_pages * self.page_size:
                prefixes.append(None)
                continue
            path = []  # the hit's nodes, root side first (walked now: a later match may have split one)
            node = hit.node
            while node.parent is not None:
                path.append(node)
                node = node.parent
            path.reverse()
            prefixes.append(path)
            for node in path:
                if node.tier == HOST and id(node) not in seen:
                    seen.add(id(node))
                    nodes.append(node)
        if nodes:
            pages = [page for node in nodes for page in node.value]
            device, ids, ok = _acquire_blocks(self.manager.device, len(pages), int(self.capacity[0]))
            if not bool(ok):
                raise BookkeepingError(
                    f"loading {len(pages)} host-tier prefix pages: {int(self.free_blocks()[0])} of "
                    f"{int(self.capacity[0])} blocks free (the engine reserves them at admission)")
            blocks = np.asarray(ids)[: len(pages)].tolist()
            # The transfer first: if it raised, the allocator is as it was.
            self.pool = host_swap.swap_in_pages(self.pool, self.prefix_host_pool, pages, blocks)
            self.manager = self.manager.replace(device=device)
            self.prefix_cache.loaded(nodes, blocks)
            self._clear_freed_host()  # the host copies of the pages now back on the device
            self._loaded_tokens += len(pages) * self.page_size
            self._load_calls += 1
        out = []
        for lane, path in zip(lanes, prefixes):
            if path is None:
                out.append(list(lane.hit.blocks[0]))
                continue
            blocks = [b for node in path for b in node.value]
            if len(blocks) * self.page_size != lane.hit.tokens:
                raise BookkeepingError(f"row {lane.row}: its prefix hit of {lane.hit.tokens} tokens is now "
                                       f"{len(blocks)} pages of {self.page_size} in the prefix cache")
            out.append(blocks)
        return out

    def usage(self) -> list[dict]:
        """One row, the pool: ``blocks`` in use of ``capacity``, ``free``,
        their ``tokens`` and ``bytes``, ``cached_blocks`` (the prefix
        cache's), the hit unit and smallest hit (a page)."""
        free = int(self.free_blocks()[0])
        used = int(self.capacity[0]) - free
        return [dict(group="pages", blocks=used, capacity=int(self.capacity[0]), free=free,
                     tokens=used * self.page_size, bytes=int(used * self.bytes_per_block),
                     cached_blocks=len(self.prefix_cache.device_blocks()), hit_unit=self.page_size,
                     min_hit=self.page_size)]

    def fork_hit(self, row: int, num_tokens: int) -> PrefixHit | None:
        """Row ``row``'s first ``num_tokens`` tokens (written: the engine
        forks only past them) straight from its block table, as a hit with
        no tree node: its whole pages get one more owner at admission (the
        sibling shares them with the row, not with the prefix cache), and a
        partly filled last page is ``copied`` into the sibling's own fresh
        block (:meth:`_begin_prefill`), as ``BlockSpaceManager.fork``'s
        copy-on-write would. None for a windowed pool (decode trims a row's
        first pages) or for no token."""
        pages = -(-num_tokens // self.page_size)
        if self.window is not None or pages == 0:
            return None
        blocks = self._block_tables()[row, :pages]
        if (blocks < 0).any():
            return None
        return PrefixHit(num_tokens, (blocks.tolist(),), copied=(int(num_tokens % self.page_size > 0),))

    def add_cut(self, row: int, position: int) -> bool:
        """Insert row ``row``'s whole pages into the prefix cache as soon as
        its prefill passes ``position`` (another request waits for that
        prefix). Returns False: no piece needs to end there."""
        self._insert_at[row].add(position)
        return False

    def _after_prefill(self, lanes: list[PrefillLane], starts, num_new, defer: bool = False) -> None:
        """Insert the prompt pages of rows whose piece passed a point another
        request waits for, or ended the prompt (requests arriving while
        this one decodes hit them), in one device call. Not for a pool
        whose every layer is windowed. ``defer`` (a packed step): the
        tree's references to the new pages are taken by the step's next
        device call that changes references (its retirement's, or
        :meth:`end_step`'s), unless blocks are released now too."""
        waiting = [(lane, int(starts[i]) + int(num_new[i])) for i, lane in enumerate(lanes) if num_new[i]]
        waiting = [(lane, end) for lane, end in waiting if self._inserts_at(lane, end)]
        if not waiting or self.prefix_cache.disable or self.window is not None:
            return  # a windowed pool caches at retire only: decode trims a prefix out of the row
        tables = self._block_tables()
        incref = []
        for lane, end in waiting:
            self._insert_at[lane.row] = {p for p in self._insert_at[lane.row] if p > end}
            pages = end // self.page_size
            if pages and (tables[lane.row, :pages] >= 0).all():
                result = self.prefix_cache.insert(lane.tokens[: pages * self.page_size],
                                                  tables[lane.row, :pages].tolist(), lane.namespace)
                incref += result.new_blocks
                if self.disk is not None:
                    self.disk.written(lane.tokens, result.blocks, lane.namespace)
        release = self._trim(lane.namespace for lane, _ in waiting)
        if defer and not release:
            self._pending_incref += incref
        elif incref or release:
            self.update(incref=incref, release=release)

    def end_step(self) -> None:
        """Take the references :meth:`_after_prefill` deferred, if the
        step's retirement did not (one call, as before the deferral)."""
        if self._pending_incref:
            self.update()

    def _inserts_at(self, lane: PrefillLane, end: int) -> bool:
        """Whether a piece of ``lane`` ending at ``end`` inserts its pages
        (:meth:`_after_prefill`): it ends the prompt or passes a point
        another request waits for."""
        return end >= len(lane.tokens) or any(end >= p for p in self._insert_at[lane.row])

    def _wants_tables(self, prefill) -> bool:
        if self.prefix_cache.disable or self.window is not None:
            return False
        return any(end > start and self._inserts_at(lane, end) for lane, (start, end) in prefill)

    def _block_tables(self) -> np.ndarray:
        """The block tables on the host: read once per change of the
        manager (or with the packed call's results, :meth:`_wants_tables`)."""
        if self.__dict__.get("_host_tables") is None:
            self._host_tables = fetch(self.manager.block_tables)
        return self._host_tables

    # ---------------------------------------------------------------- steps

    def _begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """``admit_with_prefix``: each row's cached blocks (one more owner
        each; host-tier pages of its hit loaded first) then fresh blocks for
        the rest of its prompt. Put off to the next packed step's call
        (:meth:`_defer_admission`) unless a fork's partly filled page must
        be copied (that needs the new tables at once)."""
        self.end_step()  # (nothing deferred outside a packed step; kept exact anyway)
        if self._deferred is not None:  # an admission no step took (its prompts failed their screening)
            self._run_deferred()
        batch = self.max_seqs
        rows = fixed_ids([lane.row for lane in lanes], batch)
        prefix = np.full((batch, self.max_blocks_per_seq), -1, np.int32)
        lengths = np.zeros((batch,), np.int32)
        copies = []  # (row, page index, parent's block): a fork's partly filled page, copied once admitted
        for i, (lane, blocks) in enumerate(zip(lanes, self._load_host_hits(lanes))):
            if lane.hit.copied and lane.hit.copied[0]:
                copies.append((lane.row, len(blocks) - 1, blocks[-1]))
                blocks = blocks[:-1]
            prefix[i, : len(blocks)] = blocks
            lengths[i] = len(lane.tokens)
        if not copies:
            self._defer_admission(rows, prefix, lengths)
            return
        self._admit(rows, prefix, lengths)
        tables = self._block_tables()
        src, dst = np.full((batch,), -1, np.int32), np.full((batch,), -1, np.int32)
        for i, (row, page, parent_block) in enumerate(copies):
            src[i], dst[i] = parent_block, tables[row, page]
        self.pool = _copy_pages(self.pool, src, dst)

    def _defer_admission(self, rows: np.ndarray, prefix: np.ndarray, lengths: np.ndarray) -> None:
        """Put the admission off to the next packed step's call (one device
        call per packed iteration instead of two; any other reader of
        ``manager`` makes it first, in its own call). The host mirror takes
        what it will make: the rows ON_DEVICE, and each row's fresh blocks
        (its pages less its cached ones) out of the free count, as
        ``admit_with_prefix`` does when it succeeds; the tables are read
        from the device again."""
        free, status = self._host_view()
        given = rows >= 0
        status = status.copy()
        status[rows[given]] = ON_DEVICE
        fresh = int(np.sum(ceil_div(lengths[given].astype(np.int64), self.page_size)
                           - np.sum(prefix[given] >= 0, axis=1)))
        self._host, self._host_tables = (free - fresh, status), None
        self._deferred = (rows, prefix, lengths)

    def _run_deferred(self) -> None:
        admission, self._deferred = self._deferred, None
        self._admit(*admission)

    def _admit(self, rows: np.ndarray, prefix: np.ndarray, lengths: np.ndarray) -> None:
        """``admit_with_prefix`` in its own call."""
        host = self._manager.host
        manager, ok = _admit_paged(_device_view(self._manager), rows, prefix, lengths)
        self.manager = _with_host(manager, host)
        ok, host = fetch((ok, self._host_leaves(manager)))
        self._mirror(host)
        self._check_admitted(bool(ok), rows, prefix, lengths)

    def _check_admitted(self, ok: bool, rows: np.ndarray, prefix: np.ndarray, lengths: np.ndarray) -> None:
        if not ok:  # the engine checked rows and blocks: this is a bug, not memory pressure
            raise BookkeepingError(
                f"engine admission failed: rows {rows[rows >= 0].tolist()} with "
                f"{int(sum(ceil_div(int(n), self.page_size) for n in lengths))} blocks "
                f"({int((prefix >= 0).sum())} cached), {int(self.free_blocks()[0])} of {int(self.capacity[0])} "
                "blocks free")

    def _admission_arguments(self) -> tuple:
        """The admission the packed step's call makes: the deferred one
        (:meth:`_defer_admission`), taken, or none (every row -1, made
        once)."""
        if self._deferred is not None:
            admission, self._deferred = self._deferred, None
            return admission
        none = self.__dict__.get("_no_admission")
        if none is None:
            batch = self.max_seqs
            none = self._no_admission = (np.full((batch,), -1, np.int32),
                                         np.full((batch, self.max_blocks_per_seq), -1, np.int32),
                                         np.zeros((batch,), np.int32))
        return none

    def _prefill_call(self, graphdef, params, lanes, starts, num_new, tokens, sampling, keys):
        rows = np.where(num_new > 0, fixed_ids([lane.row for lane in lanes], self.max_seqs), -1).astype(np.int32)
        self.pool, sampled, new_keys, logprobs = _paged_prefill(graphdef, params, _device_view(self.manager),
                                                                self.pool, rows, starts, num_new, tokens, sampling,
                                                                keys)
        sampled, new_keys, logprobs = fetch((sampled, new_keys, logprobs))
        self._after_prefill(lanes, starts, num_new)
        return sampled, np.asarray(new_keys), self.blocks_in_use(), logprobs

    #: Speculative verify lanes run in the packed step (:func:`jaxkv.nn.speculative.paged_packed_verify_step`).
    packs_verify_lanes = True

    def _packed_call(self, graphdef, params, prefill, decode, sampling, keys, num_tokens, *, want_tables=False,
                     prefill_width=None, speculation=None, scored=None):
        counts = drafted = accepted = logprobs = scores = history = admitted = None
        if speculation is None:
            batch = pack_stream(prefill, *decode, num_lanes=self.max_seqs, num_tokens=num_tokens,
                                num_prefill_lanes=self.max_seqs, max_prefill_len=num_tokens,
                                scored=scored)  # one program per bucket
            admission = self._admission_arguments()  # the deferred admission, made by this call
            host = self._manager.host
            manager, self.pool, tokens, keys, ok, blocked, used, logprobs, scores, admitted = _paged_packed(
                graphdef, params, _device_view(self._manager), self.pool, admission, batch, sampling, keys,
                window=self.window, scrub=self.scrub)
        else:
            host = self.manager.host  # (a deferred admission made first, in its own call)
            config, (history, updates), history_len, verify, draft = speculation
            draft_graphdef, draft_params = (None, None) if draft is None else draft
            widths = np.where(verify, config.num_speculative_tokens + 1, 1)
            batch = pack_stream(prefill, *decode, num_lanes=self.max_seqs, num_tokens=num_tokens,
                                num_prefill_lanes=self.max_seqs, max_prefill_len=num_tokens, decode_widths=widths)
            lanes = np.zeros((self.max_seqs,), bool)
            lanes[len(prefill):len(prefill) + len(verify)] = verify
            (manager, self.pool, tokens, counts, keys, ok, blocked, used, drafted, accepted,
             history) = _paged_packed_verify(graphdef, params, _device_view(self.manager), self.pool, batch, sampling,
                                             keys, history, history_len, lanes, updates, draft_params,
                                             config=config, window=self.window, scrub=self.scrub,
                                             draft_graphdef=draft_graphdef)
        self.manager = _with_host(manager, host)
        tokens, keys, ok, blocked, used, host, tables, counts, drafted, accepted, logprobs, scores, admitted = fetch(
            (tokens, keys, ok, blocked, used, self._host_leaves(manager),
             manager.block_tables if want_tables else None, counts, drafted, accepted, logprobs, scores, admitted))
        self._mirror(host)
        if admitted is not None:
            self._check_admitted(bool(admitted), *admission)
        if want_tables:
            self._host_tables = np.asarray(tables)
        return PackedResult(tokens, np.asarray(keys), bool(ok), blocked, int(used), counts, drafted, accepted,
                            logprobs, scores, None if speculation is None else history)

    def _decode_view(self):
        self._host_allocator = self.manager.host
        return _device_view(self.manager), self.pool

    def _decode_done(self, manager, pool) -> None:
        self.manager, self.pool = _with_host(manager, self._host_allocator), pool

    def retire(self, finished: list) -> None:
        """``finished``: ``(row, tokens whose K/V are cached, namespace,
        hit)`` per request. Insert their full pages into the prefix cache
        (the tree increfs the pages it keeps), free the rows, unpin."""
        if not finished:
            return
        tables = self._block_tables()
        incref = []
        for row, tokens, namespace, _ in finished:
            full_pages = len(tokens) // self.page_size
            # A windowed row's leading pages may be gone (-1): a prefix starts at page 0.
            if full_pages and (tables[row, :full_pages] >= 0).all():
                result = self.prefix_cache.insert(tokens, tables[row, :full_pages].tolist(), namespace)
                incref += result.new_blocks
                if self.disk is not None:
                    self.disk.written(tokens, result.blocks, namespace)
        self.update(incref=incref, rows=[row for row, *_ in finished],
                    release=self._trim(namespace for _, _, namespace, _ in finished))
        for row, *_, hit in finished:
            self.unpin(hit)
            self._insert_at[row].clear()

    def update(self, *, incref=(), rows=(), release=()) -> None:
        """One jitted call: incref ``incref``, free sequence ``rows``, release
        ``release``; fixed-size id arrays so it compiles once."""
        # References deferred by this step's prefill (_after_prefill) first: the tree holds those pages already.
        incref, self._pending_incref = self._pending_incref + list(incref), []
        host = self.manager.host
        tables = None if len(rows) else self.__dict__.get("_host_tables")  # no row freed: the tables stay as they are
        ids = (fixed_ids(incref, self.max_seqs * self.max_blocks_per_seq), fixed_ids(rows, self.max_seqs),
               fixed_ids(release, int(self.capacity[0]) + 1))
        if self.scrub:
            manager, self.pool, ok = _retire_scrubbed(_device_view(self.manager), self.pool, *ids)
        else:
            manager, ok = _retire_paged(_device_view(self.manager), *ids)
        self.manager = _with_host(manager, host)
        ok, host = fetch((ok, self._host_leaves(manager)))
        self._mirror(host)
        if bool(ok) and tables is not None:
            self._host_tables = tables
        if not bool(ok):
            raise BookkeepingError(
                f"engine bookkeeping failed: incref {len(incref)} blocks {list(incref)[:8]}, "
                f"free {len(rows)} rows {list(rows)}, release {len(release)} blocks {list(release)[:8]} "
                f"({int(self.free_blocks()[0])} of {int(self.capacity[0])} blocks free)")

    def swap_out(self, row: int) -> bool:
        self.end_step()  # (nothing deferred outside a packed step; kept exact anyway)
        before = self.manager.device
        try:
            self.manager, self.host_pool = self.manager.swap_out_or_raise(self.pool, self.host_pool, [row])
        except KVCacheOOM:
            return False
        if self.scrub:  # the row's K/V is on host now: its device pages go back zeroed
            self.pool = _scrub_freed(self.pool, before, self.manager.device)
        return True

    def free_swapped(self, row: int) -> None:
        """Free a swapped-out row and its host blocks (an aborted request)."""
        self.end_step()  # (nothing deferred outside a packed step; kept exact anyway)
        before = self.manager.host
        self.manager = self.manager.free_or_raise([row])
        self._clear_swap_pages(before)

    def swap_in(self, row: int) -> bool:
        self.end_step()  # (nothing deferred outside a packed step; kept exact anyway)
        before = self.manager.host
        try:
            self.manager, self.pool = self.manager.swap_in_or_raise(self.pool, self.host_pool, [row])
        except KVCacheOOM:
            return False
        self._clear_swap_pages(before)
        return True

    def _clear_swap_pages(self, before: BlockAllocator) -> None:
        """With scrub-on-free: zero the swap pool's pages that ``before``
        held and the host allocator no longer does."""
        if self.scrub:
            freed = np.flatnonzero(np.asarray(jax.device_get(freed_blocks(before, self.manager.host, null=False))))
            self.host_pool = host_swap.clear_host_pages(self.host_pool, freed)


# ------------------------------------------------------------ hybrid cache


def host_tier_rate(cache, num_pages: int, *, repeats: int = 3) -> HostTierRate:
    """Measure the host tier's transfer rates for ``num_pages`` pages (a
    :class:`PagedCache`, or an engine with one as ``.cache``), as the
    host tier moves them: ONE :func:`~jaxkv.pool.host.swap_out_pages` call
    (offload) and ONE :func:`~jaxkv.pool.host.swap_in_pages` call (load),
    each timed ``repeats`` times after an untimed call that compiles it;
    the best time counts. Nothing is printed.

    A scratch host pool of ``num_pages`` pages (the memory kind the host
    tier uses) takes the copies, so no cached page changes: it loads its
    zeros into free device blocks (never read; zeros are what a scrubbed
    block holds anyway), then offloads device pages ``1 .. num_pages``
    (only read). Works with or without a host tier configured.

    Raises ``InvalidArgument`` for ``num_pages < 1``, more pages than the
    pool's free blocks or its allocatable blocks, or ``repeats < 1``."""
    cache = getattr(cache, "cache", cache)
    if not isinstance(cache, PagedCache):
        raise InvalidArgument(f"host_tier_rate of a {type(cache).__name__}: needs a PagedCache or an engine over one")
    num_pages = _host.int_at_least(num_pages, "num_pages", 1)
    repeats = _host.int_at_least(repeats, "repeats", 1)
    device = cache.manager.device
    free = int(device.num_free)
    if num_pages > free:
        raise InvalidArgument(f"host_tier_rate of {num_pages} pages: {free} of {device.capacity} blocks are free "
                              "(loads are timed into free blocks)")
    scratch = host_swap.create_host_pool(cache.pool, num_pages, memory_kind=cache.host_memory_kind)
    host_pages = list(range(num_pages))
    counts = np.asarray(jax.device_get(device.ref_counts))
    free_blocks = (np.flatnonzero(counts[1:] == 0) + 1)[:num_pages].tolist()  # not taken: nothing runs meanwhile
    device_pages = list(range(1, num_pages + 1))

    def best(step) -> float:
        step()  # compiles
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step())
            times.append(time.perf_counter() - start)
        return min(times)

    def load():
        cache.pool = host_swap.swap_in_pages(cache.pool, scratch, host_pages, free_blocks)
        return cache.pool

    def offload():
        nonlocal scratch
        scratch = host_swap.swap_out_pages(cache.pool, scratch, device_pages, host_pages)
        return scratch

    load_s = best(load)
    offload_s = best(offload)
    nbytes = int(sizing.tree_bytes(scratch))
    return HostTierRate(num_pages=num_pages, bytes=nbytes, offload_gbps=nbytes / max(offload_s, 1e-12) / 1e9,
                        load_gbps=nbytes / max(load_s, 1e-12) / 1e9,
                        memory_kind="pinned_host" if host_swap.is_pinned(scratch) else "numpy")


#: The engine's jitted steps of this cache kind, by public name (``jaxkv.bench.engine_aot`` compiles them
#: at real sizes without a GPU).
jitted_packed, jitted_prefill, jitted_packed_verify = _paged_packed, _paged_prefill, _paged_packed_verify
