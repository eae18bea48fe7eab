"""PrefixScheduler: what an engine does each step with a batch of new
requests and the prefix cache, in one device call per step.

Per step, ``admit(prompts)``:

1. match every prompt in the tree (page-aligned, hit capped at ``len - 1`` so
   one token is always computed) and pin the matched prefixes;
2. count the blocks each request still needs (its uncached pages, plus fresh
   blocks for cached pages that sit in the host tier), evict from the tree
   when the allocator is short, and refuse (unpin, return ``None``) the
   requests that still do not fit, in arrival order;
3. make **one** jitted call on the ``BlockAllocator`` that releases
   everything pending since the last call (duplicates, evicted blocks,
   finished requests' own blocks) and acquires the new blocks.

``prefill_done(admissions)`` inserts the requests' pages into the tree and
``finish(admissions)`` ends them; both only queue device work for the next
call (``flush()`` applies it at once).

Ownership (the allocator's reference counts): the tree owns one reference to
each block it holds; a running request owns the blocks it was given fresh and
*borrows* its cached prefix, which its pin keeps from being evicted, so a hit
costs no device work. ``insert`` hands the request's new pages to the tree
(ownership moves, no device work either) and returns the request's copies of
pages the tree already had, which are released. Hence, at every step::

    allocator free count + blocks in the tree + requests' own blocks == capacity

The scheduler keeps a host mirror of the free count (exact, by the rule
above) so it decides evictions without reading the device; ``check_mirror()``
compares it with the allocator (tests call it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _host
from jaxkv._ops import ceil_div
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import CacheLocked, InvalidArgument, KVCacheError
from jaxkv.prefix.block_cache import MatchResult, PrefixCacheManager
from jaxkv.prefix.radix import DEVICE, HOST, Node, RadixTree, token_bytes

__all__ = ["Admission", "PrefixScheduler"]

_MIN_BUCKET = 64  # smallest padded id array: fewer shapes, fewer compiles


@dataclasses.dataclass
class Admission:
    """One admitted request.

    ``blocks``: the request's block ids, one per page of its prompt (cached
    prefix first). ``num_cached_tokens``: tokens whose K/V are already in
    ``blocks`` (prefill only computes the rest). ``node``: the tree node the
    request keeps pinned. ``num_exclusive``: how many blocks, at the end of
    ``blocks``, the request owns (the tree does not): what ``finish`` frees.
    """

    tokens: bytes
    namespace: Hashable
    blocks: list
    num_cached_tokens: int
    node: Node | None
    num_exclusive: int

    @property
    def num_tokens(self) -> int:
        return RadixTree.num_tokens(self.tokens)


def _bucket(n: int) -> int:
    return max(_MIN_BUCKET, _host.pow2_at_least(n))


@partial(jax.jit, static_argnames=("max_new",), donate_argnums=0)
def _step(allocator: BlockAllocator, packed, *, max_new: int):
    """One scheduler step on the device: release ``packed[:-1]`` (-1 padded),
    then acquire ``packed[-1]`` blocks, all or nothing (one host-to-device
    transfer). Returns the new state and one int32 array: the acquired ids
    (-1 padded), then ``ok`` and the free count (one transfer back)."""
    allocator, new_ids, ok = allocator.update(None, packed[:-1], packed[-1], max_n=max_new, distinct=True)
    return allocator, jnp.concatenate([new_ids, ok.astype(jnp.int32)[None], allocator.num_free[None]])


class PrefixScheduler:
    """Admission and bookkeeping for a ``PrefixCacheManager`` over a device
    ``BlockAllocator`` (see the module docstring).

    Args:
        cache: the prefix cache (its ``page_size`` is the block size).
        allocator: the device allocator whose ids the cache holds.
        pool, host_pool: the device ``KVPool`` and its host pool
            (``create_host_pool``), needed only when the cache has a host tier:
            evicted pages are copied out and host hits copied back in.
        verify: compare the host mirror with the device after every call
            (one more transfer per step; for tests).
    """

    def __init__(self, cache: PrefixCacheManager, allocator: BlockAllocator, *, pool=None, host_pool=None,
                 verify: bool = False):
        if cache.host_capacity and (pool is None or host_pool is None):
            raise InvalidArgument("a cache with a host tier needs pool= and host_pool= to copy pages")
        self.cache = cache
        self.page_size = cache.page_size
        self._allocator = allocator
        self.pool = pool
        self.host_pool = host_pool
        self.verify = verify
        self.num_free = int(allocator.num_free)  # host mirror, pending work included
        self._pending_release: list = []
        self._running: dict[int, Admission] = {}  # id(admission) -> admission, until finish
        self.device_calls = 0

    # ------------------------------------------------------------------ admission

    def admit(self, prompts: Sequence, namespaces: Sequence[Hashable] | None = None) -> list:
        """Admit as many of ``prompts`` as fit, in order; returns one
        ``Admission`` per prompt, ``None`` for those refused (nothing of theirs
        is pinned or allocated; retry them later)."""
        cache = self.cache
        tree = cache.tree
        page_bytes = tree.unit_bytes
        if namespaces is None:
            namespaces = [None] * len(prompts)
        elif len(namespaces) != len(prompts):
            raise InvalidArgument(f"{len(prompts)} prompts but {len(namespaces)} namespaces")
        keys = [token_bytes(p) for p in prompts]
        if not all(keys):
            raise InvalidArgument("an empty prompt cannot be admitted")
        matches = []
        for key, namespace in zip(keys, namespaces):
            match = cache.match(key, namespace, max_tokens=cache.tree.num_tokens(key) - 1)
            cache.pin(match.node)
            matches.append(match)
        if any(match.host_nodes for match in matches):
            # A later match may have split a host node an earlier one listed:
            # list each match's nodes again now that the splits are done.
            matches = [self._relisted(key, namespace, match) for key, namespace, match in zip(keys, namespaces, matches)]
        # Who fits, in arrival order; host-tier nodes shared by several
        # requests are loaded once.
        budget = self.num_free + cache.evictable_blocks
        loads: dict[int, Node] = {}
        fresh_counts = []
        need_total = 0
        for key, match in zip(keys, matches):
            fresh = ceil_div(len(key), page_bytes) - match.num_tokens // self.page_size
            new_loads = [n for n in match.host_nodes if id(n) not in loads]
            need = fresh + sum(tree.units(n) for n in new_loads)
            if need_total + need > budget:
                break
            need_total += need
            fresh_counts.append(fresh)
            for node in new_loads:
                loads[id(node)] = node
        admitted = len(fresh_counts)
        for match in matches[admitted:]:
            cache.release(match.node)
        if need_total > self.num_free:
            self._evict(need_total - self.num_free)
        new_ids = self._call(self._pending_release, need_total)
        self._pending_release = []
        self.num_free -= need_total
        load_nodes = list(loads.values())
        cursor = sum(tree.units(n) for n in load_nodes)  # the loads come first
        if load_nodes:
            from jaxkv.pool.host import (
                swap_in_pages,  # late: the pool modules are heavier
            )

            loaded = new_ids[:cursor]
            host_pages = [p for node in load_nodes for p in node.value]
            self.pool = swap_in_pages(self.pool, self.host_pool, host_pages, loaded)
            cache.loaded(load_nodes, loaded.tolist())
        new_ids = new_ids.tolist()
        results: list = []
        for i, match in enumerate(matches[:admitted]):
            blocks = match.blocks
            for node in match.host_nodes:
                blocks = blocks + node.value
            fresh = new_ids[cursor : cursor + fresh_counts[i]]
            cursor += fresh_counts[i]
            results.append(Admission(keys[i], namespaces[i], blocks + fresh, match.num_tokens, match.node, len(fresh)))
        self._running.update((id(adm), adm) for adm in results)
        return results + [None] * (len(prompts) - admitted)

    def prefill_done(self, admissions: Sequence[Admission | None]) -> None:
        """Insert each request's whole pages into the tree (after its K/V are
        written): its new pages become the tree's, its copies of pages the
        tree already had are released and replaced by the tree's. Raises
        ``InvalidArgument``, changing nothing, for an admission that is not
        running here."""
        cache = self.cache
        self._check_running(admissions, "prefill_done")
        for adm in admissions:
            if adm is None:
                continue
            result = cache.insert(adm.tokens, adm.blocks, adm.namespace)
            if result.duplicates:
                self._pending_release += result.duplicates
                self.num_free += len(result.duplicates)
            adm.blocks[: len(result.blocks)] = result.blocks
            adm.num_exclusive = len(adm.blocks) - len(result.blocks)
            if result.node is not None:
                cache.pin(result.node)
                cache.release(adm.node)
                adm.node = result.node

    def finish(self, admissions: Sequence[Admission | None]) -> None:
        """End each request: release the blocks it owns (not the tree's) and
        unpin its prefix. Raises ``InvalidArgument``, changing nothing, for an
        admission that is not running here (finished already, or another
        scheduler's), or one named twice."""
        self._check_running(admissions, "finish")
        for adm in admissions:
            if adm is None:
                continue
            del self._running[id(adm)]
            if adm.num_exclusive:
                self._pending_release += adm.blocks[len(adm.blocks) - adm.num_exclusive :]
                self.num_free += adm.num_exclusive
            self.cache.release(adm.node)
            adm.blocks = []
            adm.node = None
            adm.num_exclusive = 0

    def reset(self) -> None:
        """Empty the cache and give its blocks back to the allocator (queued
        for the next call). Raises ``CacheLocked`` while requests run or
        prefixes are pinned."""
        if self._running:
            raise CacheLocked(self.cache.protected_blocks * self.page_size, len(self._running))
        blocks = self.cache.reset()
        self._pending_release += blocks
        self.num_free += len(blocks)

    def flush(self) -> None:
        """Apply the pending device work now (one call; nothing if none)."""
        if self._pending_release:
            self._call(self._pending_release, 0)
            self._pending_release = []

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator with all pending work applied."""
        self.flush()
        return self._allocator

    def check_mirror(self) -> None:
        """Raise ``KVCacheError`` if the host mirror of the free count differs
        from the device allocator (after flushing)."""
        device = int(self.allocator.num_free)
        if device != self.num_free:
            raise KVCacheError(f"host mirror says {self.num_free} free blocks, the allocator {device}")

    # ------------------------------------------------------------------ internals

    def _check_running(self, admissions: Sequence[Admission | None], op: str) -> None:
        given = [adm for adm in admissions if adm is not None]
        stale = [adm for adm in given if self._running.get(id(adm)) is not adm]
        if stale or len({id(adm) for adm in given}) != len(given):
            raise InvalidArgument(
                f"{op} of {len(stale)} admission(s) not running in this scheduler (finished already or "
                f"another scheduler's), or of one admission twice; {len(self._running)} are running")

    def _relisted(self, key: bytes, namespace: Hashable, match: MatchResult) -> MatchResult:
        """``match`` with its blocks and host nodes read again from the tree
        (same pinned node: a split keeps the lower part's identity)."""
        path, _ = self.cache.tree.walk(RadixTree.token_prefix(key, match.num_tokens), namespace, split=False)
        blocks = [b for node in path if node.tier == DEVICE for b in node.value]
        return MatchResult(match.num_tokens, blocks, match.node, [node for node in path if node.tier == HOST])

    def _evict(self, num_blocks: int) -> None:
        evicted = self.cache.evict(num_blocks)
        if evicted.offload_from:
            from jaxkv.pool.host import swap_out_pages

            self.host_pool = swap_out_pages(self.pool, self.host_pool, evicted.offload_from, evicted.offload_to)
        self._pending_release += evicted.blocks
        self.num_free += len(evicted.blocks)

    def _call(self, release: list, num_new: int) -> np.ndarray:
        """One device call; returns the acquired ids."""
        max_new = _bucket(num_new)
        packed = np.full(_bucket(len(release)) + 1, -1, np.int32)
        packed[: len(release)] = release
        packed[-1] = num_new
        # The old state is donated: keep the returned one even on failure (it
        # is then an unchanged copy).
        self._allocator, report = _step(self._allocator, packed, max_new=max_new)
        self.device_calls += 1
        report = np.asarray(report)
        ids, ok, num_free = report[:-2], report[-2], int(report[-1])
        if not ok:
            raise KVCacheError(
                f"prefix scheduler step failed on the device (acquire {num_new} with {self.num_free} "
                "free by the host's count): the allocator was changed behind the scheduler's back"
            )
        if self.verify and num_free != self.num_free - num_new:
            raise KVCacheError(f"host mirror {self.num_free - num_new} free blocks, device {num_free}")
        return ids
