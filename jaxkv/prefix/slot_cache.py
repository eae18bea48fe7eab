"""SlotPrefixCacheManager: slot mode of the radix prefix cache (seed 001).

The K/V cache is dense: any pytree of arrays shaped ``[slots, max_len, ...]``
(e.g. ``(k, v)`` each ``[slots, max_len, layers, heads, dim]``); a request
owns one row (*slot*) for its whole life, handed out by the device
``SlotAllocator``. The tree (host Python, ids only) maps token sequences to
the slot that holds their K/V: every node on an inserted path records
``(slot, slot_version)`` (both halves of a split keep it, because a slot
holding a sequence holds every prefix of it). The tree does not own slots:
a request frees its slot when it finishes and the contents stay usable until
the slot is handed out again.

Life of a request::

    alloc, kv, slot, cached, direct = cache.acquire_slot(alloc, kv, tokens)
    # compute positions cached.. of the row `slot`, then
    cache.insert(tokens, slot, int(alloc.version(slot)))
    alloc = alloc.free_or_raise(slot)          # when the request finishes

``acquire_slot`` is ``find`` plus one jitted, donated device call, ``claim``,
which decides on device (the versions live there):

(a) the cached slot is free and its version is the one recorded: ``occupy`` it
    (no version bump) and reuse its rows as they are, nothing copied;
(b) the version is the recorded one but the slot is busy (the request that
    inserted it still runs): ``alloc`` a fresh slot and copy ``[:prefix_len]``
    of the source row into it, for every layer (the seed's ``copy_kv``);
(c) the version changed (the slot was handed out again since, its rows may be
    overwritten): ``alloc`` a fresh slot and copy nothing: a miss.

Fixes relative to the seed:

* The seed's ``find`` returned ``(slot, slot_ver)`` and its ``copy_kv`` copied
  from ``node.slot`` without ever comparing ``slot_ver`` with the allocator's
  current version, so a prefix whose slot had been re-allocated to another
  request was copied from (or reused with) someone else's K/V. Here a slot's
  content counts for a node only while the slot's *current* version equals
  the recorded one, and that is checked on device in ``claim`` (and in the
  manager's ``copy_kv``) before anything is reused or copied.
* Direct reuse does not bump the version, so the version alone cannot tell
  that the new owner overwrites positions ``>= prefix_len``. After a direct
  reuse at ``p`` every node recorded with that ``(slot, version)`` loses its
  value beyond ``p`` (the seed kept them, and a later request matching the
  longer sequence reused overwritten rows). Callers that ``occupy`` slots
  themselves must call ``forget(slot, version, keep_len=p)``.
* The seed's LRU eviction cleared a node's children even when a descendant was
  still referenced; here only unlocked leaves are evicted, tail first.

Events (``enable_events=True``) describe the set of facts "slot ``s`` holds
the K/V of the prefix ``tokens``" (one per node with a value; ``tokens`` is the
node's whole path from the root): ``BlockStored(namespace, tokens, (slot,))``
when a fact appears (a new node, a node whose value changes, the upper half of
a split), ``BlockRemoved`` when it goes (eviction, invalidation, a value
replaced), ``AllBlocksCleared`` on ``reset``. Replaying them reproduces the
tree's contents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from jaxkv import _host
from jaxkv._ops import INT32_MAX, where_ok
from jaxkv.alloc.slot import SlotAllocator
from jaxkv.errors import CacheLocked, InvalidArgument
from jaxkv.prefix.block_cache import AllBlocksCleared, BlockRemoved, BlockStored
from jaxkv.prefix.radix import DEVICE, Node, RadixTree, token_bytes

__all__ = ["SlotPrefixCacheManager", "SlotPrefixCacheStats", "claim", "copy_kv"]


# ---------------------------------------------------------------------- device


def _copy_rows(kv_cache, src, dst, prefix_len, n_layers=None):
    """``kv[dst, :prefix_len, :n_layers] = kv[src, :prefix_len, :n_layers]``
    for every leaf (static shapes: a masked row write; ``n_layers`` None: all
    layers, i.e. the whole row past the position axis). Invalid ``src`` /
    ``dst`` (outside ``[1, slots)``) copy nothing."""

    def one(cache):
        slots, max_len = cache.shape[0], cache.shape[1]
        valid = (src >= 1) & (src < slots) & (dst >= 1) & (dst < slots)
        pos = jnp.arange(max_len, dtype=jnp.int32).reshape((max_len,) + (1,) * (cache.ndim - 2))
        copied = pos < prefix_len
        if n_layers is not None:
            layers = cache.shape[2]
            layer = jnp.arange(layers, dtype=jnp.int32).reshape((1, layers) + (1,) * (cache.ndim - 3))
            copied = copied & (layer < n_layers)
        row = jnp.where(copied, cache[jnp.clip(src, 0, slots - 1)], cache[jnp.clip(dst, 0, slots - 1)])
        return cache.at[jnp.where(valid, dst, slots)].set(row, mode="drop")

    return jax.tree.map(one, kv_cache)


def _copy_kv(kv_cache, src_slot, dst_slot, prefix_len, n_layers=None):
    src = jnp.asarray(src_slot, jnp.int32)
    dst = jnp.asarray(dst_slot, jnp.int32)
    return _copy_rows(kv_cache, src, dst, jnp.asarray(prefix_len, jnp.int32), n_layers)


copy_kv = jax.jit(_copy_kv, donate_argnums=0, static_argnames="n_layers")
copy_kv.__doc__ = """Copy positions ``[:prefix_len]`` of row ``src_slot`` into row ``dst_slot``
of every array of ``kv_cache`` (a pytree of ``[slots, max_len, ...]`` arrays);
positions ``>= prefix_len`` of the target are kept. ``n_layers`` (static;
None = all) copies only layers ``[:n_layers]`` of arrays laid out ``[slots,
max_len, layers, ...]`` (the seed's ``n_layers`` argument). Jitted;
``kv_cache`` is donated (the write is in place). A slot outside ``[1,
slots)`` makes it a no-op."""


def _claim(slot_alloc: SlotAllocator, kv_cache, slot, slot_ver, prefix_len):
    slot = jnp.asarray(slot, jnp.int32)
    slot_ver = jnp.asarray(slot_ver, jnp.int32)
    prefix_len = jnp.asarray(prefix_len, jnp.int32)
    in_range = (slot >= 1) & (slot < slot_alloc.max_slots)
    current = (prefix_len > 0) & in_range & (slot_alloc.version(slot) == slot_ver)
    direct = current & slot_alloc.is_free(slot)
    occupied, _ = slot_alloc.occupy(jnp.where(direct, slot, -1)[None])  # -1: a no-op
    allocated, fresh, alloc_ok = slot_alloc.alloc()
    ok = direct | alloc_ok
    new_alloc = where_ok(direct, occupied, allocated)
    copy = ~direct & current & alloc_ok
    kv_cache = jax.lax.cond(
        copy, lambda kv: _copy_rows(kv, slot, fresh, prefix_len), lambda kv: kv, kv_cache
    )
    target = jnp.where(direct, slot, jnp.where(alloc_ok, fresh, -1))
    reused = jnp.where(direct | copy, prefix_len, 0)
    return new_alloc, kv_cache, target, reused, direct, ok


claim = jax.jit(_claim, donate_argnums=1)
claim.__doc__ = """Claim a slot for a request whose longest cached prefix is ``prefix_len``
tokens of ``slot`` recorded at version ``slot_ver`` (``find``'s result), in
one device call (jitted; ``kv_cache`` is donated).

Returns ``(slot_alloc, kv_cache, target_slot, reused_prefix_len,
reused_directly, ok)``:

* ``slot`` free and its version ``== slot_ver``: it is ``occupy``-ed (version
  unchanged) and reused as is: ``target_slot == slot``, ``reused_prefix_len ==
  prefix_len``, ``reused_directly`` True, nothing copied;
* version ``== slot_ver`` but ``slot`` busy: a fresh slot is ``alloc``-ed and
  ``[:prefix_len]`` of ``slot`` copied into it (all arrays, all layers):
  ``reused_prefix_len == prefix_len``;
* version changed (or ``slot < 1``, or ``prefix_len <= 0``: a miss): a fresh
  slot, nothing copied, ``reused_prefix_len == 0``.

``ok`` False when a fresh slot is needed and none is free: then the
allocator and the cache are unchanged and ``target_slot == -1``."""


def _copy_if_current(kv_cache, versions, src, src_ver, dst, prefix_len, n_layers=None):
    src = jnp.asarray(src, jnp.int32)
    slots = versions.shape[0]
    current = (src >= 1) & (src < slots) & (versions[jnp.clip(src, 0, slots - 1)] == src_ver) & (prefix_len > 0)
    kv_cache = jax.lax.cond(
        current,
        lambda kv: _copy_rows(kv, src, jnp.asarray(dst, jnp.int32), prefix_len, n_layers),
        lambda kv: kv,
        kv_cache,
    )
    return kv_cache, jnp.where(current, prefix_len, 0)


_copy_if_current_jit = jax.jit(_copy_if_current, donate_argnums=0, static_argnames="n_layers")


# ---------------------------------------------------------------------- host


@dataclasses.dataclass(frozen=True)
class SlotPrefixCacheStats:
    """Cumulative counters and current sizes.

    ``query_tokens`` / ``hit_tokens``: tokens asked for and found by ``find``
    and ``acquire_slot`` (for ``acquire_slot``, what was actually reused, after
    the device's version check); ``hit_rate = hit_tokens / query_tokens``.
    ``direct_reuses`` / ``copies`` / ``stale_misses``: outcomes of
    ``acquire_slot`` (paths a, b, c of ``claim``). ``evictions``: leaves
    evicted to respect ``max_capacity``. ``invalidated_nodes``: node values
    dropped because their slot was overwritten or handed out again.
    ``num_nodes``: nodes in the tree (what ``max_capacity`` counts),
    ``cached_nodes`` those with a value, ``protected_nodes`` the locked ones.
    """

    query_tokens: int
    hit_tokens: int
    hit_rate: float
    direct_reuses: int
    copies: int
    stale_misses: int
    evictions: int
    invalidated_nodes: int
    num_nodes: int
    cached_nodes: int
    protected_nodes: int


def _rows_len(slot_alloc: SlotAllocator, kv_cache) -> int:
    """``max_len`` of a ``[slots, max_len, ...]`` cache pytree matching the allocator
    (checked on the host, before anything is donated)."""
    leaves = jax.tree.leaves(kv_cache)
    if not leaves:
        raise InvalidArgument("kv_cache has no arrays")
    for leaf in leaves:
        if leaf.ndim < 2 or leaf.shape[0] != slot_alloc.max_slots:
            raise InvalidArgument(f"kv_cache arrays must be [slots={slot_alloc.max_slots}, max_len, ...], got {leaf.shape}")
    return min(leaf.shape[1] for leaf in leaves)


def _check_prefix(prefix_len: int, max_len: int) -> None:
    if prefix_len > max_len:
        raise InvalidArgument(f"cached prefix of {prefix_len} tokens is longer than the cache rows ({max_len})")


def _keep_both(value, units):
    return value, value


def _int(value, what: str) -> int:
    """``value`` as a Python int; ``InvalidArgument`` for bools (``True`` is not
    slot 1), floats, strings, None and arrays (``jaxkv._host.int_scalar``)."""
    return _host.int_scalar(value, what)


class SlotPrefixCacheManager:
    """Radix-tree prefix cache over the slots of a dense ``[slots, max_len,
    ...]`` K/V cache (slot mode; see the module docstring).

    Args:
        max_capacity: most tree nodes kept; ``insert`` evicts least recently
            used unlocked leaves beyond it (pinned nodes are never evicted, so
            the tree may stay above it while they are held).
        enable_events: record ``BlockStored`` / ``BlockRemoved`` /
            ``AllBlocksCleared`` (``block_ids == (slot,)``) for
            ``take_events()``.
    """

    def __init__(self, max_capacity: int = 1000, *, enable_events: bool = False):
        max_capacity = _int(max_capacity, "max_capacity")
        if max_capacity < 1:
            raise InvalidArgument(f"max_capacity={max_capacity}: must be at least 1")
        self.max_capacity = max_capacity
        self.tree = RadixTree(1, _keep_both)
        self.enable_events = enable_events
        self._events: list = []
        self._by_slot: dict[int, set[Node]] = {}  # slot -> nodes whose value names it
        self._query_tokens = self._hit_tokens = 0
        self._direct = self._copies = self._stale = self._evictions = self._invalidated = 0

    # ------------------------------------------------------------------ lookup

    def find(self, token_ids, namespace: Hashable = None, *, max_tokens: int | None = None) -> tuple[int, int, int]:
        """Longest cached prefix of ``token_ids`` under ``namespace``:
        ``(prefix_len, slot, slot_ver)``, ``(0, -1, 0)`` on a miss.

        The match may end inside a node; the slot is that of the deepest
        matched node with a value (a node whose slot was overwritten has none,
        and the match falls back to its deepest valid ancestor). At most
        ``max_tokens`` tokens are matched when given. Host only: whether the
        slot still holds the prefix is decided on device (``claim``). Counts
        toward the hit metrics and marks the path as recently used.
        """
        query = token_bytes(token_ids)
        path, index, prefix_len = self._match(query, namespace, max_tokens)  # validates max_tokens
        self._query_tokens += self.tree.num_tokens(query)
        if index < 0:
            return 0, -1, 0
        self.tree.touch(path[: index + 1])
        self._hit_tokens += prefix_len
        slot, version = path[index].value
        return prefix_len, slot, version

    def _match(self, query: bytes, namespace: Hashable, max_tokens: int | None) -> tuple[list, int, int]:
        """(path, index of the deepest valued node or -1, prefix_len); changes nothing."""
        tree = self.tree
        if max_tokens is not None:
            query = tree.token_prefix(query, _int(max_tokens, "max_tokens"))
        path, matched = tree.walk(query, namespace, split=False)
        ends, total = [], 0
        for node in path:
            total += node.num_tokens
            ends.append(total)
        if ends:
            ends[-1] = tree.num_tokens(query[:matched])  # the match may end inside the last node
        for index in range(len(path) - 1, -1, -1):
            if path[index].value is not None:
                return path, index, ends[index]
        return path, -1, 0

    # ------------------------------------------------------------------ insert

    def insert(self, token_ids, slot: int, slot_ver: int, namespace: Hashable = None, *, pin: bool = False) -> None:
        """Record that ``slot`` (at version ``slot_ver``) holds the K/V of
        ``token_ids``: every node on the path gets ``(slot, slot_ver)``, the
        missing tail becomes a new node. With ``pin`` the sequence is also
        pinned (the seed's insert took that reference; ``release`` it later).
        Then least recently used unlocked leaves are evicted while the tree has
        more than ``max_capacity`` nodes.

        Raises ``InvalidArgument`` for ``slot < 1`` (0 is the null slot), a
        negative version, or values outside int32.
        """
        slot = _int(slot, "slot")
        slot_ver = _int(slot_ver, "slot_ver")
        if slot < 1:
            raise InvalidArgument(f"insert with slot {slot}: slots start at 1 (0 is the null slot)")
        if slot_ver < 0:
            raise InvalidArgument(f"insert with slot version {slot_ver}: versions are >= 0")
        if max(slot, slot_ver) > INT32_MAX:
            raise InvalidArgument(f"insert with slot {slot}, version {slot_ver}: the device keeps int32")
        query = token_bytes(token_ids)
        if not query:
            return
        value = (slot, slot_ver)
        tree = self.tree
        path, matched = tree.walk(query, namespace, split=True)
        tree.touch(path)
        for node in path:
            self._set_value(node, value)
        node = path[-1] if path else tree.root(namespace, create=True)
        if matched < len(query):
            node = tree.add_child(node, query[matched:], value)
            self._index(node)
            self._record(BlockStored, node, value)
        if pin:
            tree.lock(node)
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        tree = self.tree
        while tree.num_nodes > self.max_capacity:
            leaf = tree.pop_lru_leaf(DEVICE)
            if leaf is None:  # everything left is pinned
                break
            self._evictions += 1
            self._remove(leaf)

    # ------------------------------------------------------------------ locks

    def pin(self, token_ids, namespace: Hashable = None) -> bool:
        """Pin the prefix ``token_ids``: protect the node where it ends (split
        so that it ends exactly there) and its whole path from eviction. The
        pin contract is the same on both prefix caches (``jaxkv.prefix.radix``
        module doc, "Pins"). Returns True; False, and nothing changes, when
        the sequence is empty or not wholly in the tree (the seed ignored a
        missing path)."""
        query = token_bytes(token_ids)
        if not query or self.tree.walk(query, namespace, split=False)[1] < len(query):
            return False
        path, _ = self.tree.walk(query, namespace, split=True)
        for node in path:
            self._adopt(node)
        self.tree.lock(path[-1])
        return True

    def release(self, token_ids, namespace: Hashable = None) -> bool:
        """Undo one ``pin(token_ids)`` (the pin contract of
        ``jaxkv.prefix.radix``): True once done. ``InvalidArgument``, and
        nothing changes, when there is no pin of exactly this prefix left to
        undo (released twice, never pinned, or not in the tree). An empty
        sequence is a no-op returning False (like ``pin([])``)."""
        query = token_bytes(token_ids)
        if not query:
            return False
        tree = self.tree
        path, matched = tree.walk(query, namespace, split=False)
        node = path[-1] if path else None
        if matched < len(query) or tree.depth_tokens(node) != tree.num_tokens(query) or node.pins <= 0:
            raise InvalidArgument(f"release of a prefix that is not pinned ({tree.num_tokens(query)} tokens)")
        tree.unlock(node)
        self._prune(node)
        return True

    # ------------------------------------------------------------------ device paths

    def acquire_slot(
        self, slot_alloc: SlotAllocator, kv_cache, token_ids, namespace: Hashable = None, *, max_tokens: int | None = None
    ) -> tuple[SlotAllocator, object, int, int, bool]:
        """``find`` + ``claim`` in one device call, then the host bookkeeping.

        Returns ``(slot_alloc, kv_cache, target_slot, prefix_len,
        reused_directly)``: the request owns ``target_slot`` and positions
        ``[:prefix_len]`` of that row already hold its prefix's K/V. ``kv_cache``
        is donated: use the returned one. When no slot is free,
        ``target_slot == -1`` and the returned allocator and cache are
        unchanged (nothing is raised, so the donated cache is never lost).
        ``max_tokens`` caps the match (e.g. ``len(tokens) - 1`` so one token is
        computed and yields logits).

        Bookkeeping: after a direct reuse at ``p`` the nodes recorded with that
        slot and version lose their value beyond ``p`` (the request overwrites
        those positions); a stale hit drops the stale nodes; every node
        recording a freshly allocated slot is dropped (its version moved on).
        """
        max_len = _rows_len(slot_alloc, kv_cache)
        query = token_bytes(token_ids)
        path, index, prefix_len = self._match(query, namespace, max_tokens)
        slot, version = path[index].value if index >= 0 else (-1, 0)
        _check_prefix(prefix_len, max_len)
        slot_alloc, kv_cache, target, reused, direct, ok = claim(slot_alloc, kv_cache, slot, version, prefix_len)
        target, reused, direct, ok = (x.item() for x in jax.device_get((target, reused, direct, ok)))
        if not ok:
            return slot_alloc, kv_cache, -1, 0, False
        self._query_tokens += self.tree.num_tokens(query)
        self._hit_tokens += reused
        if index >= 0:
            self.tree.touch(path[: index + 1])
        if direct:
            self._direct += 1
            self.forget(target, version, keep_len=prefix_len)
        else:
            if prefix_len and not reused:
                self._stale += 1
                self.forget(slot, version)
            elif reused:
                self._copies += 1
            self.forget(target)
        return slot_alloc, kv_cache, int(target), int(reused), bool(direct)

    def copy_kv(
        self,
        token_ids,
        target_slot: int,
        kv_cache,
        slot_alloc: SlotAllocator,
        namespace: Hashable = None,
        *,
        n_layers: int | None = None,
    ) -> tuple[object, int]:
        """The seed's ``copy_kv``: copy the K/V of the longest cached prefix of
        ``token_ids`` from its slot into ``target_slot`` (all arrays;
        ``kv_cache`` donated), only if the source slot's current version is
        the recorded one. ``n_layers`` (the seed's argument) copies only
        layers ``[:n_layers]`` of arrays laid out ``[slots, max_len, layers,
        ...]``; None copies every layer. The target's other layers keep
        their contents, so a partial copy is for a caller that recomputes
        the rest (the target's nodes are dropped either way). Returns ``(kv_cache, copied_len)``
        (0 when nothing was cached or the source was stale). Every node that
        names ``target_slot`` is dropped (its rows are overwritten).
        ``InvalidArgument`` (nothing donated) for a target outside ``[1,
        slots)`` or when the prefix is recorded in ``target_slot`` at its
        current version (a copy into itself); a record of it at an older
        version is stale, a miss like any other."""
        target_slot = _int(target_slot, "target_slot")
        if not 1 <= target_slot < slot_alloc.max_slots:
            raise InvalidArgument(f"target slot {target_slot} outside [1, {slot_alloc.max_slots})")
        max_len = _rows_len(slot_alloc, kv_cache)
        if n_layers is not None:
            n_layers = _int(n_layers, "n_layers")
            layers = min((leaf.shape[2] for leaf in jax.tree.leaves(kv_cache) if leaf.ndim >= 3), default=0)
            if any(leaf.ndim < 3 for leaf in jax.tree.leaves(kv_cache)) or not 0 <= n_layers <= layers:
                raise InvalidArgument(
                    f"copy_kv(n_layers={n_layers}): arrays must be [slots, max_len, layers, ...] "
                    f"with at least n_layers >= 0 layers (have {layers})")
        query = token_bytes(token_ids)
        path, index, prefix_len = self._match(query, namespace, None)
        if index < 0:
            return kv_cache, 0
        slot, version = path[index].value
        _check_prefix(prefix_len, max_len)
        if slot == target_slot and int(jax.device_get(slot_alloc.versions)[slot]) == version:
            # A stale record of the target (it was handed out again since: the
            # seed's alloc-then-copy_kv) is an ordinary stale miss below.
            raise InvalidArgument(f"copy_kv from slot {slot} (version {version}) into itself")
        kv_cache, copied = _copy_if_current_jit(
            kv_cache, slot_alloc.versions, slot, version, target_slot, prefix_len, n_layers=n_layers)
        copied = int(copied)
        if not copied:
            self.forget(slot, version)
        self.forget(target_slot)
        return kv_cache, copied

    # ------------------------------------------------------------------ invalidation

    def forget(self, slot: int, slot_ver: int | None = None, *, keep_len: int = 0) -> int:
        """The rows of ``slot`` (at version ``slot_ver``; every version when
        None) no longer hold anything past position ``keep_len``: nodes that
        record it lose their value beyond that depth (a node straddling it is
        split, the upper part keeping the value). Returns the number of node
        values dropped. ``InvalidArgument`` for a slot outside ``[1, 2**31)``
        (no such slot can be recorded: it is a caller's bug, not a miss)."""
        slot = _int(slot, "slot")
        if not 1 <= slot <= INT32_MAX:
            raise InvalidArgument(f"forget of slot {slot}: slots are in [1, 2**31) (0 is the null slot)")
        if slot_ver is not None:
            slot_ver = _int(slot_ver, "slot_ver")
        keep_len = _int(keep_len, "keep_len")
        dropped = 0
        for node in list(self._by_slot.get(slot, ())):
            if node.parent is None or node.value is None or node.value[0] != slot:
                continue
            if slot_ver is not None and node.value[1] != slot_ver:
                continue
            end = self.tree.depth_tokens(node)
            if end <= keep_len:
                continue
            start = end - node.num_tokens
            if start < keep_len:
                upper = self.tree.split(node, keep_len - start)
                self._adopt(upper)
            self._drop_value(node)
            self._prune(node)
            dropped += 1
        self._invalidated += dropped
        return dropped

    # ------------------------------------------------------------------ whole cache

    def reset(self) -> None:
        """Empty the cache. Raises ``CacheLocked`` (nothing changes) while
        anything is pinned."""
        tree = self.tree
        if tree.protected_units or any(node.lock for node in tree.nodes()):
            raise CacheLocked(tree.protected_units)
        tree.clear()
        self._by_slot.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())

    def stats(self) -> SlotPrefixCacheStats:
        nodes = list(self.tree.nodes())
        return SlotPrefixCacheStats(
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            hit_rate=self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            direct_reuses=self._direct,
            copies=self._copies,
            stale_misses=self._stale,
            evictions=self._evictions,
            invalidated_nodes=self._invalidated,
            num_nodes=self.tree.num_nodes,
            cached_nodes=sum(node.value is not None for node in nodes),
            protected_nodes=sum(node.lock > 0 for node in nodes),
        )

    def take_events(self) -> list:
        """The events recorded since the last call (oldest first)."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """The tree's own invariants, plus: values are ``(slot >= 1, version
        >= 0)``, the slot index lists exactly the valued nodes, and no unlocked
        leaf is valueless (tests call this)."""
        self.tree.check_invariants()
        valued = set()
        for node in self.tree.nodes():
            if node.value is None:
                assert node.children or node.lock, f"valueless unlocked leaf {node!r}"
                continue
            slot, version = node.value
            assert type(slot) is int and type(version) is int and slot >= 1 and version >= 0, node.value
            assert node in self._by_slot.get(slot, ()), f"{node!r} missing from the slot index"
            valued.add(node)
        indexed = set()
        for slot, nodes in self._by_slot.items():
            assert nodes, f"empty index entry for slot {slot}"
            for node in nodes:
                assert node.value is not None and node.value[0] == slot, (slot, node.value)
            indexed |= nodes
        assert indexed == valued, "slot index out of sync with the tree"

    # ------------------------------------------------------------------ internals

    def _index(self, node: Node) -> None:
        self._by_slot.setdefault(node.value[0], set()).add(node)

    def _unindex(self, node: Node) -> None:
        nodes = self._by_slot.get(node.value[0])
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self._by_slot[node.value[0]]

    def _indexed(self, node: Node) -> bool:
        return node.value is not None and node in self._by_slot.get(node.value[0], ())

    def _adopt(self, node: Node) -> None:
        """Index the upper half of a split (a new node that inherited a value)."""
        if node.value is not None and not self._indexed(node):
            self._index(node)
            self._record(BlockStored, node, node.value)

    def _set_value(self, node: Node, value: tuple) -> None:
        if self._indexed(node):
            if node.value == value:
                return
            self._record(BlockRemoved, node, node.value)
            self._unindex(node)
        node.value = value
        self._index(node)
        self._record(BlockStored, node, value)

    def _drop_value(self, node: Node) -> None:
        if self._indexed(node):
            self._record(BlockRemoved, node, node.value)
            self._unindex(node)
        node.value = None

    def _remove(self, leaf: Node) -> None:
        """Evict an unlocked leaf, then any valueless ancestors it leaves bare."""
        parent = leaf.parent
        self._drop_value(leaf)
        self.tree.remove_leaf(leaf)
        self._prune(parent)

    def _prune(self, node: Node) -> None:
        """Remove ``node`` and its ancestors while they are valueless, unlocked leaves."""
        while node.parent is not None and node.value is None and not node.children and not node.lock:
            parent = node.parent
            self.tree.remove_leaf(node)
            node = parent

    def _record(self, kind, node: Node, value: tuple) -> None:
        if self.enable_events:
            self._events.append(kind(node.namespace, node.path_tokens(), (value[0],)))
