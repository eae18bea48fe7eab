"""The radix tree shared by both prefix-cache modes (host Python, ids only).

A tree maps token sequences to cached values. Edges are compressed: one node
holds a run of tokens (its ``key``) and the values of that run, and a node is
split in two when a new sequence diverges inside it. Children are keyed by
their first *unit* (one page of ``page_size`` tokens), so every node's run is
a whole number of units and matching is unit-aligned: a partial page is never
matched or stored.

Tokens are kept as the bytes of an int32 array: comparing two runs is one
``memcmp`` and a child lookup hashes ``4 * page_size`` bytes, which keeps a
match of a 2,000-token prompt in the microseconds.

Invariants (checked by ``check_invariants`` in the tests):

* each namespace has its own root; a sequence inserted under one namespace is
  never matched under another;
* ``len(node.key) == 4 * page_size * node.num_units`` and, for the paged mode,
  ``len(node.value) == node.num_units``;
* ``node.lock == node.pins + sum(child.lock for child in node.children)``
  for every node below a root (a root's ``lock`` is always 1 and its
  ``pins`` count the pins of misses):
  ``pins`` counts ``lock(node)`` calls not yet undone at exactly this node,
  ``lock`` those at the node or below it (``lock`` walks to the root), so a
  locked node's whole path is locked;
* tiers are monotone along a path: a device-tier node never has a host-tier
  ancestor (eviction takes the tail of a chain first);
* ``evictable_units + protected_units`` is the number of device-tier units
  in the tree; ``protected_units`` counts those of locked nodes;
  ``namespace_units[owner_key(ns)]`` counts the device-tier units of the
  namespaces of one owner (absent when 0; quotas count per owner). These
  counters (and ``host_units``, ``num_nodes``) are written only by this
  module: the caches move nodes between tiers with ``to_host`` /
  ``to_device``, add and drop them with ``add_child`` / ``remove_leaf`` and
  protect them with ``lock`` / ``unlock``.

Pins (one contract for both prefix caches, ``PrefixCacheManager`` and
``SlotPrefixCacheManager``):

* ``pin`` protects one node -- the node where the pinned prefix ends (a node
  is split so that the prefix ends exactly at one) -- and, through it, every
  ancestor, from eviction. Pins are counted: pinning twice needs two
  releases.
* ``release`` undoes exactly one pin *of that same node*; a pin held on a
  longer or shorter prefix does not count.
* A ``release`` with no pin left to undo there (a double release, a prefix
  never pinned, or one no longer in the cache) raises ``InvalidArgument``
  and changes nothing.
* ``reset`` refuses (``CacheLocked``) while any pin is held, a pin of a
  namespace root included: ``PrefixCacheManager.match`` returns the root on
  a miss and its callers pin whatever ``match`` returned, so a miss's pin
  is counted too (it protects nothing) and its ``release`` must find the
  root still there.

Tokens are stored as int32 bytes: ``TOKEN_BYTES`` bytes per token;
``RadixTree.num_tokens`` / ``token_prefix`` convert between the two.
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from jaxkv import _host
from jaxkv._ops import INT32_MAX
from jaxkv.errors import InvalidArgument

__all__ = ["DEVICE", "HOST", "TOKEN_BYTES", "Node", "RadixTree", "namespace_key", "owner_key", "token_bytes"]

DEVICE = 0
HOST = 1
#: Bytes per token in a tree key (tokens are int32).
TOKEN_BYTES = 4
#: The ``array`` type code of a native int32 (``token_bytes``' list path; numpy's int32 bytes are native too).
_INT32_CODE = next(code for code in "il" if array.array(code).itemsize == TOKEN_BYTES)


def token_bytes(tokens) -> bytes:
    """The int32 bytes of a 1-D token sequence (list, tuple or integer array;
    ``bytes`` are taken to be such bytes already).

    Raises ``InvalidArgument`` for a token id outside int32, a non-integer
    token (float, bool, string, None) or a shape that is not one-dimensional
    (a nested list is refused like a 2-D array, not flattened).
    """
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise InvalidArgument(f"token bytes of length {len(tokens)}: not a whole number of int32 ids")
        return tokens
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
        return tokens.tobytes()  # no copy through int64
    if _host.plain_ints(tokens):  # the engine's case, packed without numpy
        try:
            return array.array(_INT32_CODE, tokens).tobytes()
        except OverflowError:
            pass  # an id outside int32: the checked path below says which
    ids = _host.int_array(tokens, "tokens", ndim=1)
    if ids.size and (ids.min() < -INT32_MAX - 1 or ids.max() > INT32_MAX):
        raise InvalidArgument(f"token ids must fit in int32, got range [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32).tobytes()


def namespace_key(namespace: Hashable) -> tuple:
    """The dictionary key of a namespace's root. Python says ``False == 0``
    and ``True == 1`` (same hash), so a bool namespace is told apart by
    its type; numpy and Python integers of the same value stay one
    namespace."""
    return (isinstance(namespace, (bool, np.bool_)), namespace)


def owner_key(namespace: Hashable) -> tuple:
    """Whose quota a namespace counts toward: a server tenant's namespaces
    ``("tenant", name, salt)`` all count toward ``("tenant", name)`` (a
    tenant cannot multiply its share by sending many salts); any other
    namespace is its own owner."""
    if isinstance(namespace, tuple) and len(namespace) >= 2 and namespace[0] == "tenant":
        namespace = namespace[:2]
    return namespace_key(namespace)


class Node:
    """One compressed edge of the tree and the values of its tokens.

    ``value`` is mode-specific: the list of block ids of the node's pages
    (paged mode, or host page ids when ``tier == HOST``) or a ``(slot,
    version)`` pair (slot mode). ``lock`` counts holders (see module doc).
    """

    __slots__ = ("by_first", "children", "key", "last_access", "lock", "namespace", "parent", "pins", "tier",
                 "value")

    def __init__(self, key: bytes, value: Any, parent: Node | None, namespace: Hashable, tier: int = DEVICE):
        self.key = key
        self.value = value
        self.children: dict[bytes, Node] = {}
        # first token's bytes -> the keys of ``children`` that begin with it (insertion-ordered set): a
        # token-grain lookup (RadixTree.children_from) reads the few children that can share a token.
        self.by_first: dict[bytes, dict[bytes, None]] = {}
        self.parent = parent
        self.lock = 0  # pins held at this node or below it
        self.pins = 0  # pins held at exactly this node (what ``unlock`` may undo)
        self.last_access = 0
        self.tier = tier
        self.namespace = namespace

    @property
    def num_tokens(self) -> int:
        """Length of the node's own token run."""
        return len(self.key) // TOKEN_BYTES

    def tokens(self) -> np.ndarray:
        """The node's own token run as an int32 array."""
        return np.frombuffer(self.key, np.int32).copy()

    def path_tokens(self) -> np.ndarray:
        """All tokens from the root to the end of this node."""
        parts = []
        node = self
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.frombuffer(b"".join(reversed(parts)), np.int32).copy()

    def __repr__(self) -> str:
        return f"Node(tokens={self.num_tokens}, lock={self.lock}, tier={'host' if self.tier else 'device'})"


class RadixTree:
    """Compressed radix tree over token runs, one root per namespace.

    ``split_value(value, k)`` cuts a node's value after its first ``k`` units
    and returns ``(head, tail)``. Sizes are counted in units (pages).
    """

    def __init__(self, page_size: int, split_value: Callable[[Any, int], tuple[Any, Any]]):
        if page_size < 1:
            raise InvalidArgument(f"page_size={page_size}: must be at least 1")
        self.page_size = page_size
        self.unit_bytes = TOKEN_BYTES * page_size
        self.split_value = split_value
        self.roots: dict[tuple, Node] = {}  # by namespace_key
        self.clock = 0  # logical time: deterministic LRU order, cheaper than time.time()
        self.evictable_units = 0
        self.protected_units = 0
        self.host_units = 0
        self.num_nodes = 0
        self.namespace_units: dict[tuple, int] = {}  # device-tier units per owner key
        self._heaps: tuple[list, list] = ([], [])  # per tier: (last_access, seq, node), lazily pruned
        self._seq = 0

    # ------------------------------------------------------------------ shape

    def root(self, namespace: Hashable, create: bool = False) -> Node | None:
        root = self.roots.get(namespace_key(namespace))
        if root is None and create:
            root = self.roots[namespace_key(namespace)] = Node(b"", None, None, namespace)
            root.lock = 1  # roots are never evicted
        return root

    def units(self, node: Node) -> int:
        return len(node.key) // self.unit_bytes

    @staticmethod
    def num_tokens(data: bytes | Node) -> int:
        """Tokens in a key (``bytes``) or in a node's own run."""
        return len(data.key if isinstance(data, Node) else data) // TOKEN_BYTES

    @staticmethod
    def token_prefix(query: bytes, max_tokens: int) -> bytes:
        """The first ``max(max_tokens, 0)`` tokens of a key."""
        return query[: TOKEN_BYTES * max(max_tokens, 0)]

    @staticmethod
    def depth_tokens(node: Node) -> int:
        """Tokens from the root to the end of ``node``."""
        depth = 0
        while node.parent is not None:
            depth += len(node.key)
            node = node.parent
        return depth // TOKEN_BYTES

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def common_units(self, key: bytes, query: bytes, offset: int) -> int:
        """Number of whole units ``key`` shares with ``query[offset:]``."""
        length = min(len(key), len(query) - offset)
        length -= length % self.unit_bytes
        if key[:length] == query[offset : offset + length]:
            return length // self.unit_bytes
        low, high = 1, length // self.unit_bytes  # first unit matched (child key); last one does not
        while high - low > 1:
            middle = (low + high) // 2
            end = middle * self.unit_bytes
            if key[:end] == query[offset : offset + end]:
                low = middle
            else:
                high = middle
        return low

    def walk(self, query: bytes, namespace: Hashable, *, split: bool) -> tuple[list[Node], int]:
        """The nodes matching the longest unit-aligned prefix of ``query`` and
        its length in bytes. With ``split``, a node matched only in part is
        split so that the last returned node ends exactly at the match."""
        node = self.root(namespace)
        path: list[Node] = []
        offset = 0
        if node is None:
            return path, 0
        unit = self.unit_bytes
        end = len(query) - len(query) % unit
        while offset < end:
            child = node.children.get(query[offset : offset + unit])
            if child is None:
                break
            key = child.key
            if query[offset : offset + len(key)] == key:
                matched = len(key)
            else:
                units = self.common_units(key, query, offset)
                if not split:
                    path.append(child)
                    offset += units * unit
                    break
                child = self.split(child, units)
                matched = units * unit
            path.append(child)
            offset += matched
            node = child
            if matched < len(key):
                break
        return path, offset

    def split(self, node: Node, units: int) -> Node:
        """Cut ``node`` after ``units`` units; returns the new upper part,
        which takes the node's place under its parent (same lock, tier and
        access time, so the lock accounting is unchanged)."""
        cut = units * self.unit_bytes
        head_value, tail_value = self.split_value(node.value, units)
        upper = Node(node.key[:cut], head_value, node.parent, node.namespace, node.tier)
        upper.lock = node.lock
        upper.last_access = node.last_access
        node.parent.children[node.key[: self.unit_bytes]] = upper
        node.key = node.key[cut:]
        node.value = tail_value
        node.parent = upper
        self._link(upper, node)
        self.num_nodes += 1
        return upper

    def add_child(self, parent: Node, key: bytes, value: Any, tier: int = DEVICE) -> Node:
        child = Node(key, value, parent, parent.namespace, tier)
        child.last_access = self.clock
        self._link(parent, child)
        self.num_nodes += 1
        units = len(key) // self.unit_bytes
        if tier == DEVICE:
            self.evictable_units += units
            self._count(child.namespace, units)
        else:
            self.host_units += units
        self.push_if_leaf(child)
        return child

    def _link(self, parent: Node, child: Node) -> None:
        """Put ``child`` under ``parent`` (its first unit is the key)."""
        unit_key = child.key[: self.unit_bytes]
        parent.children[unit_key] = child
        parent.by_first.setdefault(unit_key[:TOKEN_BYTES], {})[unit_key] = None

    def children_from(self, node: Node, token: int) -> list[Node]:
        """The children of ``node`` whose run begins with ``token`` (a dict
        lookup, not a scan of every child: a root holds one per distinct
        first page)."""
        if not -INT32_MAX - 1 <= token <= INT32_MAX:
            return []
        keys = node.by_first.get(np.int32(token).tobytes(), ())
        return [node.children[key] for key in keys]

    def remove_leaf(self, node: Node) -> None:
        """Detach a childless, unlocked node; its parent may become a leaf."""
        parent = node.parent
        unit_key = node.key[: self.unit_bytes]
        del parent.children[unit_key]
        same = parent.by_first[unit_key[:TOKEN_BYTES]]
        del same[unit_key]
        if not same:
            del parent.by_first[unit_key[:TOKEN_BYTES]]
        node.parent = None
        self.num_nodes -= 1
        units = self.units(node)
        if node.tier == DEVICE:
            self.evictable_units -= units
            self._count(node.namespace, -units)
        else:
            self.host_units -= units
        self.push_if_leaf(parent)

    def _count(self, namespace: Hashable, units: int) -> None:
        key = owner_key(namespace)
        total = self.namespace_units.get(key, 0) + units
        if total:
            self.namespace_units[key] = total
        else:
            self.namespace_units.pop(key, None)

    # ------------------------------------------------------------------ tiers

    def to_host(self, node: Node, host_value: Any) -> None:
        """Move an unlocked device-tier ``node`` to the host tier, now holding
        ``host_value`` (its evictable units become host units); it and its
        parent may become eviction candidates."""
        if node.tier != DEVICE or node.lock:
            raise InvalidArgument(f"to_host of {node!r}: only an unlocked device-tier node moves to host")
        units = self.units(node)
        node.value = host_value
        node.tier = HOST
        self.evictable_units -= units
        self._count(node.namespace, -units)
        self.host_units += units
        self.push_if_leaf(node)
        self.push_if_leaf(node.parent)

    def to_device(self, node: Node, device_value: Any) -> None:
        """Move a host-tier ``node`` back to the device tier, now holding
        ``device_value``; its units count as protected when it is locked,
        evictable otherwise."""
        if node.tier != HOST:
            raise InvalidArgument(f"to_device of {node!r}: not a host-tier node")
        units = self.units(node)
        node.value = device_value
        node.tier = DEVICE
        self.host_units -= units
        self._count(node.namespace, units)
        if node.lock:
            self.protected_units += units
        else:
            self.evictable_units += units
            self.push_if_leaf(node)

    def owns(self, node: Node) -> bool:
        """Whether ``node`` is in this tree now: not evicted (removed nodes
        lose their parent), not another tree's. O(depth)."""
        while node.parent is not None:
            node = node.parent
        return self.roots.get(namespace_key(node.namespace)) is node

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node) -> None:
        """One more holder of ``node`` and of every ancestor. A namespace
        root (what a miss matches) protects nothing, but its pins are
        counted like any node's: ``reset`` refuses while one is held, so
        its ``unlock`` never finds the root gone."""
        if node.parent is None:
            self._check_root(node, "pin")
            node.pins += 1  # a namespace root: counted in ``pins`` only (its ``lock`` stays 1)
            return
        node.pins += 1
        while node.parent is not None:
            if node.lock == 0 and node.tier == DEVICE:
                units = self.units(node)
                self.evictable_units -= units
                self.protected_units += units
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)`` of this very node (a pin held below it does
        not count); nodes whose count reaches zero become evictable again.
        Raises ``InvalidArgument``, changing nothing, when there is none
        (for a namespace root too)."""
        if node.parent is None:
            self._check_root(node, "release")
        if node.pins <= 0:
            raise InvalidArgument(f"release of a prefix that is not pinned ({node!r})")
        node.pins -= 1
        if node.parent is None:
            return  # a namespace root: nothing was protected
        while node.parent is not None:
            node.lock -= 1
            if node.lock == 0:
                if node.tier == DEVICE:
                    units = self.units(node)
                    self.protected_units -= units
                    self.evictable_units += units
                self.push_if_leaf(node)
            node = node.parent

    def _check_root(self, node: Node, op: str) -> None:
        """A node without a parent must be one of this tree's roots (an
        evicted node has none either)."""
        if self.roots.get(namespace_key(node.namespace)) is not node:
            raise InvalidArgument(f"{op} of {node!r}: not in this tree (evicted, or dropped by a reset)")

    def root_pins(self) -> int:
        """Pins held on namespace roots (misses pinned by their caller)."""
        return sum(root.pins for root in self.roots.values())

    def touch(self, path: list[Node]) -> None:
        """Mark ``path`` as just used. No heap work: a leaf's stale heap entry
        is re-queued with its new time when it reaches the top."""
        now = self.tick()
        for node in path:
            node.last_access = now

    # ------------------------------------------------------------------ LRU

    def is_leaf(self, node: Node, tier: int) -> bool:
        """Evictable leaf of ``tier``: unlocked, in that tier, and with no child
        in that tier (a device node whose children all went to host is a
        device leaf)."""
        if node.parent is None or node.lock or node.tier != tier:
            return False
        if tier == HOST:
            return not node.children
        return all(child.tier != DEVICE for child in node.children.values())

    def push_if_leaf(self, node: Node) -> None:
        """Queue ``node`` as an eviction candidate if it is an evictable leaf
        (called whenever a node may have become one). Every evictable leaf has
        at least one heap entry whose time is at most its ``last_access``."""
        tier = node.tier
        if self.is_leaf(node, tier):
            self._push(node, tier)

    def _push(self, node: Node, tier: int) -> None:
        self._seq += 1
        heap = self._heaps[tier]
        heapq.heappush(heap, (node.last_access, self._seq, node))
        if len(heap) > 4 * self.num_nodes + 64:  # drop stale entries now and then
            self._heaps = tuple(self._rebuilt(t) for t in (DEVICE, HOST))

    def _rebuilt(self, tier: int) -> list:
        heap = [entry for entry in self._heaps[tier] if entry[2].parent is not None and self.is_leaf(entry[2], tier)]
        heapq.heapify(heap)
        return heap

    def pop_lru_leaf(self, tier: int, namespaces: set | None = None) -> Node | None:
        """The least recently used evictable leaf of ``tier`` (removed from the
        candidates; the caller evicts it or pushes it back); with
        ``namespaces`` (owner keys, :func:`owner_key`), the least recently
        used one of those owners' namespaces (None when they have none;
        the others' leaves stay queued)."""
        heap = self._heaps[tier]
        passed = []  # other namespaces' leaves, queued again at the end
        found = None
        while heap:
            time, _, node = heapq.heappop(heap)
            if node.parent is None or not self.is_leaf(node, tier):
                continue  # evicted, locked or grown since it was queued
            if time < node.last_access:  # used since: queue it again at its real time
                self._push(node, tier)
                heap = self._heaps[tier]
                continue
            if namespaces is not None and owner_key(node.namespace) not in namespaces:
                passed.append(node)
                continue
            found = node
            break
        for node in passed:
            self._push(node, tier)
        return found

    # ------------------------------------------------------------------ traversal

    def nodes(self, namespace: Hashable | None = ...) -> Iterator[Node]:
        """Every non-root node (of one namespace, or all)."""
        roots = self.roots.values() if namespace is ... else [self.root(namespace)]
        stack = [child for root in roots if root is not None for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def clear(self) -> None:
        self.roots.clear()
        self.evictable_units = self.protected_units = self.host_units = self.num_nodes = 0
        self.namespace_units = {}
        self._heaps = ([], [])

    def check_invariants(self) -> None:
        """Recount everything from scratch and compare (tests call this)."""
        evictable = protected = host = count = 0
        per_namespace: dict = {}
        for key, root in self.roots.items():
            assert root.lock == 1 and root.pins >= 0 and root.parent is None and namespace_key(root.namespace) == key
            for node in [root, *self.nodes(root.namespace)]:
                firsts: dict = {}
                for k in node.children:
                    firsts.setdefault(k[:TOKEN_BYTES], {})[k] = None
                assert node.by_first == firsts, (node, "children by first token")
                if node is root:
                    continue
                count += 1
                assert namespace_key(node.namespace) == key
                assert len(node.key) % self.unit_bytes == 0 and node.key
                assert node.parent.children[node.key[: self.unit_bytes]] is node
                held = sum(child.lock for child in node.children.values())
                assert node.pins >= 0 and node.lock == node.pins + held, (node, node.pins, held)
                if node.parent.parent is not None and node.tier == DEVICE:
                    assert node.parent.tier == DEVICE, "host-tier node above a device-tier node"
                units = self.units(node)
                if node.tier == DEVICE:
                    owner = owner_key(node.namespace)
                    per_namespace[owner] = per_namespace.get(owner, 0) + units
                if node.tier == HOST:
                    host += units
                elif node.lock:
                    protected += units
                else:
                    evictable += units
        assert (evictable, protected, host, count) == (
            self.evictable_units, self.protected_units, self.host_units, self.num_nodes,
        ), ((evictable, protected, host, count), (self.evictable_units, self.protected_units, self.host_units, self.num_nodes))
        assert per_namespace == self.namespace_units, (per_namespace, self.namespace_units)
