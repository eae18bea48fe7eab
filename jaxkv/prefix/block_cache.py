"""PrefixCacheManager: the radix-tree prefix cache over paged block ids of a
device ``BlockAllocator`` (SGLang RadixCache / vLLM prefix caching behaviour).

The tree lives on the host and holds ids only, never K/V data. Ownership is
counted by the device allocator's reference counts: the tree owns one
reference to every block it holds. A request that matched a prefix may either
*borrow* those blocks under a pin (``PrefixScheduler`` does this: a hit costs
no device work, and the pin keeps the tree from evicting them) or take its own
reference with ``incref`` (a ``BlockSpaceManager`` table that outlives the
pin). Either way a block returns to the free stack exactly when the tree has
evicted it and nobody else holds it.

The manager itself makes no device call: its methods return the ids whose
ownership changes and the caller batches them into its own jitted step
(``PrefixScheduler``: one device call per scheduler step).

Life of a request (what ``PrefixScheduler`` does):

1. ``match(tokens, namespace=)`` -> ``MatchResult`` (page-aligned; splits a
   node at the match point); ``pin(result.node)`` so the prefix cannot be
   evicted while the request runs.
2. Allocate the rest (``evict(n)`` first when the allocator is short, and
   release what it returns).
3. After prefill ``insert(tokens, blocks)``: ``result.new_blocks`` are now the
   tree's (the request hands its reference over, or increfs if it keeps
   one); pages the tree already had come back in ``result.duplicates``: the
   request releases them and uses ``result.replacements`` instead. ``pin``
   the new node, ``release`` the old one.
4. On finish: release the request's own blocks and ``release`` its node.

Locked (pinned) nodes are *protected*; unlocked device-tier nodes are
*evictable*. Eviction takes least-recently-used unlocked leaves, cutting a
chain from its end (never its middle), and a parent becomes a candidate once
its last child is gone.

Namespaces and quotas (tenants): every lookup, insert and event is scoped
to a namespace (``match(tokens, namespace)``; a vLLM ``cache_salt``, an
API key's tenant). With ``set_quota(units)`` the device-tier pages of an
owner's namespaces (``radix.owner_key``: a server tenant's salts count as one)
are capped at ``units`` (``trim(namespace)`` evicts its own least
recently used unlocked leaves down to it; callers trim after inserting),
and ``evict`` takes from namespaces holding more than their fair share
first (``fair_share``: the cached pages over the namespaces holding any),
so one tenant's traffic cannot flush another's prefixes. Pinned pages
(running requests) are never evicted, by either.

Host tier (optional, ``host_pages > 0``): an evicted device leaf moves to host
page ids instead of being dropped (the caller copies the pages with
``swap_out_pages``); a later match returns those nodes in
``MatchResult.host_nodes`` and the caller loads them into fresh device blocks
(``swap_in_pages``) and calls ``loaded(...)``. The host tier has its own
capacity and LRU: when it is full its least-recently-used leaves are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from jaxkv import _host
from jaxkv._ops import INT32_MAX
from jaxkv.errors import CacheLocked, InvalidArgument
from jaxkv.prefix.radix import DEVICE, HOST, Node, RadixTree, owner_key, token_bytes

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheLocked",
    "Evicted",
    "InsertResult",
    "MatchResult",
    "PrefixCacheManager",
    "PrefixCacheStats",
]


class MatchResult(NamedTuple):
    """What ``match`` found.

    ``num_tokens``: length of the matched prefix (a multiple of ``page_size``),
    device and host tiers together. ``blocks``: device block ids of the
    device-tier part, one per page, in order. ``node``: the last matched node
    (the root of the namespace when nothing matched): pass it to ``pin`` /
    ``release``. ``host_nodes``: the matched host-tier nodes, in order, after
    the device part (load them with ``loaded`` before using them).
    """

    num_tokens: int
    blocks: list
    node: Node | None
    host_nodes: list

    @property
    def num_host_tokens(self) -> int:
        return sum(node.num_tokens for node in self.host_nodes)


class InsertResult(NamedTuple):
    """What ``insert`` did with a request's pages.

    ``blocks``: the block ids the tree holds for the inserted pages (use these
    from now on). ``new_blocks``: the request's ids the tree now owns (hand
    the reference over, or ``incref`` to keep one). ``duplicates``: the
    request's ids for pages the tree already had, in the tree as
    ``replacements`` (same order): release the duplicates. ``node``: the last
    node of the inserted path.
    """

    blocks: list
    new_blocks: list
    duplicates: list
    replacements: list
    node: Node | None


class Evicted(NamedTuple):
    """What ``evict`` took from the device tier.

    ``blocks``: device ids the tree no longer owns: ``release`` them (they are
    free once no sequence holds them). ``offload_from`` / ``offload_to``: pairs
    of device block -> host page to copy *before* those blocks are reused (only
    with a host tier).
    """

    blocks: list
    offload_from: list
    offload_to: list


@dataclasses.dataclass(frozen=True)
class _BlockEvent:
    namespace: Hashable
    tokens: np.ndarray
    block_ids: tuple
    medium: str = "device"


class BlockStored(_BlockEvent):
    """Event: pages entered the cache (``medium`` 'device' or 'host')."""


class BlockRemoved(_BlockEvent):
    """Event: pages left the cache (``medium`` 'device' or 'host')."""


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """Event: ``reset`` emptied the cache."""


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative counters and current sizes, in tokens.

    ``hit_rate = hit_tokens / query_tokens`` over every ``match`` so far.
    ``evictable_tokens`` / ``protected_tokens``: device-tier tokens in unlocked
    / locked nodes. ``host_tokens``: tokens in the host tier.
    """

    query_tokens: int
    hit_tokens: int
    host_hit_tokens: int
    hit_rate: float
    evictable_tokens: int
    protected_tokens: int
    host_tokens: int
    evicted_tokens: int
    offloaded_tokens: int
    evictions: int
    num_nodes: int


def _split_pages(value: list, units: int) -> tuple[list, list]:
    return value[:units], value[units:]


class PrefixCacheManager:
    """Radix-tree prefix cache over device block ids (paged mode).

    Args:
        page_size: tokens per block; only whole pages are matched and stored.
        disable: when True every match misses and insert stores nothing
            (a cache that is turned off but keeps the same calling code).
        host_pages: capacity of the host tier in pages (0 = no host tier).
        enable_events: record ``BlockStored``/``BlockRemoved``/
            ``AllBlocksCleared`` for ``take_events()``.
    """

    def __init__(self, page_size: int, *, disable: bool = False, host_pages: int = 0, enable_events: bool = False):
        page_size = _host.int_scalar(page_size, "page_size")
        host_pages = _host.int_scalar(host_pages, "host_pages")
        if host_pages < 0:
            raise InvalidArgument(f"host_pages={host_pages}: must be >= 0")
        self.tree = RadixTree(page_size, _split_pages)
        self.page_size = page_size
        self.disable = disable
        self.host_capacity = host_pages
        self._host_free = list(range(host_pages - 1, -1, -1))  # host page ids, a stack
        self._owned: set = set()  # device block ids in the tree (refuses a second insert of one)
        self.enable_events = enable_events
        self._events: list = []
        self._query_tokens = self._hit_tokens = self._host_hit_tokens = 0
        self._evicted_tokens = self._offloaded_tokens = self._evictions = 0
        self.quota: int | None = None  # device-tier pages one owner's namespaces may hold (None: no cap, plain LRU)
        self._freed_host: list = []  # host pages let go since take_freed_host_pages (scrub-on-free)

    def add_host_tier(self, host_pages: int) -> None:
        """Give a cache made without a host tier one of ``host_pages`` pages
        (ids ``0 .. host_pages - 1``); ``InvalidArgument`` when it has one."""
        host_pages = _host.int_at_least(host_pages, "host_pages", 1)
        if self.host_capacity:
            raise InvalidArgument(f"the prefix cache has a host tier of {self.host_capacity} pages already")
        self.host_capacity = host_pages
        self._host_free = list(range(host_pages - 1, -1, -1))

    def take_freed_host_pages(self) -> list:
        """Host-tier pages let go (dropped, or loaded back to the device)
        since the last call: a caller that scrubs zeroes them before their
        next use. Pages a later offload of the same call reuses are in it
        too (zeroing them first is harmless)."""
        pages, self._freed_host = self._freed_host, []
        return pages

    # ------------------------------------------------------------------ quotas

    def set_quota(self, units: int | None) -> None:
        """Cap every owner's device-tier pages at ``units`` (>= 1; None: no
        cap and plain LRU eviction). Takes effect at the next ``trim`` and
        ``evict``."""
        if units is not None:
            units = _host.int_at_least(units, "quota", 1)
        self.quota = units

    def fair_share(self) -> float:
        """Device-tier pages per owner holding any (0 when empty)."""
        held = self.tree.namespace_units
        return sum(held.values()) / len(held) if held else 0.0

    def namespace_pages(self, namespace: Hashable = None) -> int:
        """Device-tier pages cached under ``namespace`` and the other
        namespaces of its owner (:func:`~jaxkv.prefix.radix.owner_key`)."""
        return self.tree.namespace_units.get(owner_key(namespace), 0)

    def trim(self, namespace: Hashable = None) -> Evicted:
        """Evict the least recently used unlocked leaves of ``namespace``'s
        owner until it holds at most the quota (nothing without one); as
        ``evict``."""
        if self.quota is None:
            return Evicted([], [], [])
        key = owner_key(namespace)
        excess = self.tree.namespace_units.get(key, 0) - self.quota
        return self._evict(excess, lambda: self.tree.pop_lru_leaf(DEVICE, {key}))

    def _over_share(self) -> Node | None:
        """With a quota: the least recently used evictable leaf of the
        owners over their fair share, else of any namespace."""
        tree = self.tree
        if self.quota is not None and len(tree.namespace_units) > 1:
            share = self.fair_share()
            over = {key for key, units in tree.namespace_units.items() if units > share}
            node = tree.pop_lru_leaf(DEVICE, over)
            if node is not None:
                return node
        return tree.pop_lru_leaf(DEVICE)

    # ------------------------------------------------------------------ lookup

    def match(self, tokens, namespace: Hashable = None, *, max_tokens: int | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` under ``namespace``,
        at most ``max_tokens`` long (vLLM caps a hit at ``len(tokens) - 1`` so
        at least one token is computed and yields logits).

        Counts toward the hit-rate metrics and marks the path as recently used.
        A node matched only in part is split at the match point so the result
        can be pinned exactly.
        """
        tree = self.tree
        query = token_bytes(tokens)
        self._query_tokens += tree.num_tokens(query)
        if self.disable:
            return MatchResult(0, [], None, [])
        if max_tokens is not None:
            query = tree.token_prefix(query, _host.int_scalar(max_tokens, "max_tokens"))
        path, matched = tree.walk(query, namespace, split=True)
        tree.touch(path)
        blocks: list = []
        host_nodes = []
        for node in path:
            if node.tier == DEVICE:
                blocks += node.value
            else:
                host_nodes.append(node)
        matched_tokens = tree.num_tokens(query[:matched])
        self._hit_tokens += matched_tokens
        self._host_hit_tokens += sum(node.num_tokens for node in host_nodes)
        return MatchResult(matched_tokens, blocks, path[-1] if path else tree.root(namespace), host_nodes)

    def cached_length(self, tokens, namespace: Hashable = None) -> int:
        """Like ``match(...).num_tokens`` but changes nothing (no split, no
        metrics, no LRU update)."""
        if self.disable:
            return 0
        query = token_bytes(tokens)
        _, matched = self.tree.walk(query, namespace, split=False)
        return self.tree.num_tokens(query[:matched])

    def cached_blocks(self, tokens, namespace: Hashable = None) -> list:
        """The device blocks of the longest cached prefix of ``tokens``
        (``match(...).blocks``) but changes nothing (no split, no metrics,
        no LRU update). A node matched in part gives its first pages only;
        host-tier nodes sit below device ones, so the device blocks are the
        first of the match."""
        if self.disable:
            return []
        query = token_bytes(tokens)
        path, matched = self.tree.walk(query, namespace, split=False)
        blocks = [block for node in path if node.tier == DEVICE for block in node.value]
        return blocks[: matched // self.tree.unit_bytes]

    # ------------------------------------------------------------------ insert

    def insert(self, tokens, blocks: Sequence[int], namespace: Hashable = None) -> InsertResult:
        """Record that ``blocks[i]`` holds page ``i`` of ``tokens`` (whole pages
        only: a trailing partial page and any block past ``len(tokens) //
        page_size`` are ignored and stay the caller's).

        Raises ``InvalidArgument``, changing nothing, when ``blocks`` covers
        fewer pages than the whole pages of ``tokens`` would need, holds a
        non-integer, an id below 1 or an id twice, or names a block the tree
        already owns for another page (a second owner of one block would be
        released twice by ``evict``).
        """
        query = token_bytes(tokens)
        unit = self.tree.unit_bytes
        num_pages = len(query) // unit
        # Plain ints (the engine's) need no numpy round trip; ids outside [1, 2**31): _check_insert_blocks.
        if not _host.plain_ints(blocks):
            blocks = _host.int_array(blocks, "blocks", ndim=1).tolist()
        if len(blocks) < num_pages:
            raise InvalidArgument(
                f"insert of {num_pages} whole pages ({self.tree.num_tokens(query)} tokens, page_size={self.page_size}) "
                f"with only {len(blocks)} block ids"
            )
        blocks = list(blocks[:num_pages])  # the tree's own list: never the caller's object
        query = query[: num_pages * unit]
        self._check_insert_blocks(query, blocks, namespace)
        if self.disable or not num_pages:
            return InsertResult([], [], [], [], None)
        tree = self.tree
        path, matched = tree.walk(query, namespace, split=True)
        tree.touch(path)
        tree_blocks: list = []
        new_blocks, duplicates, replacements = [], [], []
        for node in path:
            start = len(tree_blocks)
            if node.tier == HOST:  # the request recomputed these pages: they become the tree's
                self._refill(node, blocks[start : start + len(node.value)])
                new_blocks += node.value
            else:
                mine_run = blocks[start : start + len(node.value)]
                if mine_run != node.value:  # the tree already had these pages: the request's copies go
                    for mine, cached in zip(mine_run, node.value):
                        if mine != cached:
                            duplicates.append(mine)
                            replacements.append(cached)
            tree_blocks += node.value
        node = path[-1] if path else tree.root(namespace, create=True)
        if matched < len(query):
            rest = blocks[matched // unit :]
            node = tree.add_child(node, query[matched:], rest)
            self._owned.update(rest)
            new_blocks += rest
            tree_blocks += rest
            self._record(BlockStored, node, rest)
        return InsertResult(tree_blocks, new_blocks, duplicates, replacements, node)

    def insert_host(self, tokens, namespace: Hashable = None) -> tuple[list, Node | None]:
        """Add the whole pages of ``tokens`` past the cached prefix to the host
        tier (pages read back from a disk tier): returns ``(host pages, node)``,
        the host page ids to fill with those pages' data (in order) and the
        new node, or ``([], None)`` when the tree holds them all already or
        the host tier cannot make room (nothing changed). Room is made by
        dropping least recently used host leaves, never the path being
        extended."""
        if self.disable or not self.host_capacity:
            return [], None
        tree = self.tree
        query = token_bytes(tokens)
        unit = tree.unit_bytes
        query = query[: len(query) - len(query) % unit]
        path, matched = tree.walk(query, namespace, split=True)
        units = (len(query) - matched) // unit
        if not units or units > self.host_capacity:
            return [], None
        parent = path[-1] if path else tree.root(namespace, create=True)
        if parent.parent is not None:
            tree.lock(parent)  # its path cannot be dropped to make room below it
        try:
            host_pages = self._host_pages_for(units, {})
        finally:
            if parent.parent is not None:
                tree.unlock(parent)
        if host_pages is None:
            return [], None
        node = tree.add_child(parent, query[matched:], host_pages, tier=HOST)
        self._record(BlockStored, node, host_pages, medium="host")
        return host_pages, node

    def _check_insert_blocks(self, query: bytes, blocks: list, namespace: Hashable) -> None:
        """Validate ``insert``'s block ids before the tree changes at all."""
        if not blocks:
            return
        if min(blocks) < 1 or max(blocks) > INT32_MAX:
            bad = min(blocks) if min(blocks) < 1 else max(blocks)
            raise InvalidArgument(f"insert with block id {bad}: block ids are in [1, 2**31) (0 is the null block)")
        if len(set(blocks)) != len(blocks):
            seen: set = set()
            repeated = sorted({b for b in blocks if b in seen or seen.add(b)})
            raise InvalidArgument(f"insert with block ids {_host.preview(repeated)} for more than one page")
        if self.disable:
            return
        if self._owned.isdisjoint(blocks):  # the common case: no page the tree holds already (no walk)
            return
        cached = self._cached_pages(query, namespace)
        for page, block in enumerate(blocks):
            if block in self._owned and (page >= len(cached) or cached[page] != block):
                raise InvalidArgument(
                    f"insert with block id {block} for page {page}: the cache already owns that block "
                    "for another page (release the request's reference, never hand a cached block over twice)"
                )

    def _cached_pages(self, query: bytes, namespace: Hashable) -> list:
        """The tree's device block per matched page of ``query`` (None for a
        host-tier page), without splitting anything."""
        path, matched = self.tree.walk(query, namespace, split=False)
        pages: list = []
        for node in path:
            pages += node.value if node.tier == DEVICE else [None] * self.tree.units(node)
        return pages[: matched // self.tree.unit_bytes]

    # ------------------------------------------------------------------ locks

    def pin(self, node: Node | None) -> None:
        """Protect ``node`` and its whole path from eviction (SGLang's
        ``inc_lock_ref``). ``None`` (a disabled cache's match, or a miss in
        a namespace with nothing cached) is ignored. A miss's node (the
        namespace root) protects nothing but is counted: ``release`` it as
        any other, and ``reset`` refuses until then.
        Raises ``InvalidArgument`` for a node that is not in this cache
        (evicted, dropped by ``reset``, or another cache's)."""
        if node is not None:
            self.tree.lock(self._own_node(node, "pin"))

    def release(self, node: Node | None) -> None:
        """Undo one ``pin(node)`` (SGLang's ``dec_lock_ref``). Raises
        ``InvalidArgument`` (and changes nothing) if the node is not pinned
        or not in this cache."""
        if node is not None:
            self.tree.unlock(self._own_node(node, "release"))

    def _own_node(self, node, op: str) -> Node:
        if not isinstance(node, Node):
            raise InvalidArgument(f"{op}(node) takes a Node from match/insert, got {type(node).__name__}")
        if not self.tree.owns(node):
            raise InvalidArgument(
                f"{op} of {node!r}: not a node of this cache (evicted, dropped by reset, "
                "or from another PrefixCacheManager)")
        return node

    def pin_prefix(self, tokens, namespace: Hashable = None) -> Node | None:
        """Pin the cached part of ``tokens`` (e.g. a system prompt) until
        ``release`` of the returned node. Does not count toward hit metrics."""
        path, _ = self.tree.walk(token_bytes(tokens), namespace, split=True)
        node = path[-1] if path else None
        self.pin(node)
        return node

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int) -> Evicted:
        """Free at least ``num_blocks`` device blocks (fewer only if not enough
        are evictable) from least-recently-used unlocked leaves, tail first;
        with a quota, from the owners over their fair share first.

        A leaf larger than what is still needed is split and only its tail
        evicted. With a host tier the pages move there (see ``Evicted``);
        each host page appears at most once in ``offload_to`` (a page given
        in this call to a node that a later step of the same call drops is
        taken out of the copy list with it). ``num_blocks`` must be a
        non-negative integer (``InvalidArgument`` before anything changes).
        """
        num_blocks = _host.int_scalar(num_blocks, "num_blocks")
        if num_blocks < 0:
            raise InvalidArgument(f"evict(num_blocks={num_blocks}): the count must be >= 0")
        return self._evict(num_blocks, self._over_share)

    def _evict(self, num_blocks: int, pick) -> Evicted:
        """``evict``'s loop over the leaves ``pick()`` gives (None: no more)."""
        tree = self.tree
        released: list = []
        offloads: dict = {}  # host page -> device block to copy there, in order
        while len(released) < num_blocks:
            node = pick()
            if node is None:
                break
            need = num_blocks - len(released)
            units = tree.units(node)
            if units > need:  # take only the tail of the run
                tree.split(node, units - need)
                units = need
            blocks = node.value
            released += blocks
            self._owned.difference_update(blocks)
            self._evictions += 1
            self._evicted_tokens += units * self.page_size
            self._record(BlockRemoved, node, blocks)
            host_pages = self._host_pages_for(units, offloads)
            if host_pages is None:
                self._drop_node(node, offloads)
            else:
                offloads.update(zip(host_pages, blocks))
                tree.to_host(node, host_pages)
                self._offloaded_tokens += units * self.page_size
                self._record(BlockStored, node, host_pages, medium="host")
        return Evicted(released, list(offloads.values()), list(offloads.keys()))

    def loaded(self, host_nodes: Sequence[Node], blocks: Sequence[int]) -> None:
        """Record that the pages of ``host_nodes`` (from a ``MatchResult``, in
        order) were copied into device ``blocks`` (one per page, in order); the
        tree owns those blocks from now on and their host pages are freed.
        Raises ``InvalidArgument``, changing nothing, for a node that is not
        a host-tier node of this cache, a block count that differs from the
        pages, or a block id that is below 1, repeated or already the tree's."""
        blocks = _host.int_array(blocks, "blocks", ndim=1).tolist()
        for node in host_nodes:
            self._own_node(node, "loaded")
            if node.tier != HOST:
                raise InvalidArgument(f"{node!r} is not a host-tier node of this cache")
        wanted = sum(self.tree.units(node) for node in host_nodes)
        if len(blocks) != wanted:
            raise InvalidArgument(f"loaded {len(blocks)} blocks for {wanted} host pages")
        if len(set(blocks)) != len(blocks) or (blocks and min(blocks) < 1) or self._owned.intersection(blocks):
            raise InvalidArgument(
                f"loaded into blocks {_host.preview(blocks)}: ids must be >= 1, distinct and not already the cache's")
        start = 0
        for node in host_nodes:
            units = self.tree.units(node)
            self._refill(node, blocks[start : start + units])
            start += units

    def _refill(self, node: Node, blocks: list) -> None:
        """A host-tier node's pages are on the device again, in ``blocks``."""
        self._record(BlockRemoved, node, node.value, medium="host")
        self._drop_host_pages(node)
        self.tree.to_device(node, blocks)
        self._owned.update(blocks)
        self._record(BlockStored, node, blocks)

    def _host_pages_for(self, units: int, offloads: dict) -> list | None:
        """Host page ids for ``units`` pages, dropping host LRU leaves to make
        room; None when there is no host tier or it cannot hold them.
        ``offloads`` are the copies queued by the current ``evict``: a
        dropped leaf's pages leave it (their data is never needed)."""
        if units > self.host_capacity:
            return None
        while len(self._host_free) < units:
            victim = self.tree.pop_lru_leaf(HOST)
            if victim is None:
                return None
            self._record(BlockRemoved, victim, victim.value, medium="host")
            self._drop_host_pages(victim, offloads)
            self.tree.remove_leaf(victim)
        return [self._host_free.pop() for _ in range(units)]

    def _drop_host_pages(self, node: Node, offloads: dict | None = None) -> None:
        self._host_free += node.value
        self._freed_host += node.value
        if offloads:
            for page in node.value:
                offloads.pop(page, None)

    def _drop_node(self, node: Node, offloads: dict) -> None:
        """Remove an evicted device leaf; host-tier children go with it (a
        host node never hangs below a missing device node)."""
        for child in list(node.children.values()):
            self._drop_subtree(child, offloads)
        self.tree.remove_leaf(node)

    def _drop_subtree(self, node: Node, offloads: dict) -> None:
        for child in list(node.children.values()):
            self._drop_subtree(child, offloads)
        self._record(BlockRemoved, node, node.value, medium="host")
        self._drop_host_pages(node, offloads)
        self.tree.remove_leaf(node)

    # ------------------------------------------------------------------ whole cache

    def reset(self) -> list:
        """Empty the cache and return every device block id it owned (release
        them). Raises ``CacheLocked`` (nothing changes) while anything is
        pinned, the namespace root a miss returned included (its
        ``release`` must still find it)."""
        tree = self.tree
        root_pins = tree.root_pins()
        if tree.protected_units or root_pins or any(node.lock for node in tree.nodes()):
            error = CacheLocked(tree.protected_units * self.page_size)
            if root_pins:  # no tokens to count: say what is held
                error.args = (f"{error} ({root_pins} pin(s) of a miss, on a namespace root, not released)",)
            raise error
        blocks = [b for node in tree.nodes() if node.tier == DEVICE for b in node.value]
        self._freed_host += [p for node in tree.nodes() if node.tier == HOST for p in node.value]
        tree.clear()
        self._owned.clear()
        self._host_free = list(range(self.host_capacity - 1, -1, -1))
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return blocks

    def device_blocks(self) -> list:
        """Every device block id the tree owns (each once)."""
        return [b for node in self.tree.nodes() if node.tier == DEVICE for b in node.value]

    def stats(self) -> PrefixCacheStats:
        tree = self.tree
        ps = self.page_size
        return PrefixCacheStats(
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            host_hit_tokens=self._host_hit_tokens,
            hit_rate=self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            evictable_tokens=tree.evictable_units * ps,
            protected_tokens=tree.protected_units * ps,
            host_tokens=tree.host_units * ps,
            evicted_tokens=self._evicted_tokens,
            offloaded_tokens=self._offloaded_tokens,
            evictions=self._evictions,
            num_nodes=tree.num_nodes,
        )

    @property
    def evictable_blocks(self) -> int:
        return self.tree.evictable_units

    @property
    def protected_blocks(self) -> int:
        return self.tree.protected_units

    @property
    def host_free_pages(self) -> int:
        return len(self._host_free)

    def take_events(self) -> list:
        """The events recorded since the last call (oldest first)."""
        events, self._events = self._events, []
        return events

    def _record(self, kind, node: Node, block_ids, medium: str = "device") -> None:
        if self.enable_events:
            self._events.append(kind(node.namespace, node.tokens(), tuple(block_ids), medium))

    def check_invariants(self) -> None:
        """Recount the tree and the host free list (tests call this)."""
        self.tree.check_invariants()
        device, host = [], list(self._host_free)
        for node in self.tree.nodes():
            assert len(node.value) == self.tree.units(node)
            (host if node.tier == HOST else device).extend(node.value)
        assert len(device) == len(set(device)), "a device block is held by two nodes"
        assert set(device) == self._owned, "the owned-block index differs from the tree"
        assert sorted(host) == list(range(self.host_capacity)), "host pages lost or held twice"
