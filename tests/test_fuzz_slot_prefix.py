"""Fuzzing ``SlotPrefixCacheManager`` with real slot data, against a plain-Python model.

``tests/test_prefix_slot.py`` checks the tree alone (``TreeMachine``) and
request lifecycles with an unbounded tree (``LifecycleMachine``). This machine
puts everything together, on a small node capacity so that LRU eviction runs
all the time:

* requests ``acquire_slot`` (find + claim), prefill the rest of their row with
  **fresh random K/V** (one draw per write, so two requests with the same
  tokens write different data and a reuse of the wrong row shows), insert
  (some of them pinned while they run), grow by decode steps, and finish;
* requests admitted the seed's way (``alloc`` a fresh slot, then ``copy_kv``);
* unrelated owners take a slot, scribble over it and free it; foreign
  inserts name slots the allocator does not have; ``forget``, ``pin`` /
  ``release`` of arbitrary (foreign, evicted, never pinned) sequences;
  ``reset``;
* bad inputs: bad slot ids and versions, double frees, float / bool / str /
  None ids and counts, a prefix longer than the cache rows.

The model is a whole compressed radix tree kept as a dict ``(namespace,
path) -> (value, pins, last use)`` (a node's parent is its longest proper
prefix in the dict), plus the allocator (free set, versions), the K/V arrays
in NumPy and, per slot and position, which ``(namespace, prefix)`` produced
the K/V there (*provenance*). It predicts every result exactly: matches,
claim paths, copies, the node structure, pins, statistics, and which leaves
an insert evicts (in LRU order, read back from the ``BlockRemoved`` events).

After every step: device arrays == the NumPy mirror; the allocator == the
model (each usable slot is free or held by exactly one running request,
never both, never neither; slot 0 never); the tree (values, pins, events
replayed) == the model; and every cached fact whose slot is still at the
recorded version names rows that really hold the K/V of that prefix. A
failed operation must leave the allocator, the cache arrays and the tree's
observable state exactly as they were.

Every device call has the same shapes, so ``claim``, the ``copy_kv`` step,
the row write and the allocator ops compile once each.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.alloc.slot import SlotAllocator
from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.prefix.block_cache import AllBlocksCleared, BlockRemoved, BlockStored, CacheLocked
from jaxkv.prefix.slot_cache import SlotPrefixCacheManager
from tests.util import lcp

SLOTS = 6  # slot 0 is the null slot: 5 usable
MAX_LEN = 6
K_ROW = (2, 1, 2)  # layers, heads, dim
V_ROW = (2, 1, 3)  # V differs in width and dtype: every leaf must be handled
V_DTYPE = jnp.bfloat16
USABLE = frozenset(range(1, SLOTS))

NAMESPACES = st.sampled_from([None, "b", 0, False])  # 0 and False are two namespaces
TOKEN = st.integers(0, 2)
SEEDS = st.integers(0, 2**32 - 1)
BAD_SCALARS = [True, False, 1.0, 2.5, "1", None, float("nan"), np.float32(1), np.bool_(True)]
BAD_INTS = BAD_SCALARS + [[1]]  # where one integer belongs


def nskey(namespace):
    """How the tree tells namespaces apart (``False`` is not ``0``)."""
    return (isinstance(namespace, (bool, np.bool_)), namespace)


# ---------------------------------------------------------------------- device


def _write(kv, slot, rows, mask):
    def one(cache, row):
        keep = mask.reshape((-1,) + (1,) * (cache.ndim - 2))
        return cache.at[slot].set(jnp.where(keep, row, cache[slot]))

    return tuple(one(c, r) for c, r in zip(kv, rows))


WRITE = jax.jit(_write, donate_argnums=0)


def random_rows(seed: int):
    """One row of fresh random K and V (never zero; V already in its dtype, so
    the device's cast is exact)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((MAX_LEN,) + K_ROW).astype(np.float32)
    v = rng.standard_normal((MAX_LEN,) + V_ROW).astype(V_DTYPE)
    return k, v


def random_kv(seed: int):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((SLOTS, MAX_LEN) + K_ROW).astype(np.float32)
    v = rng.standard_normal((SLOTS, MAX_LEN) + V_ROW).astype(V_DTYPE)
    return k, v


def free_set(alloc: SlotAllocator) -> set:
    words = np.asarray(alloc.free_mask)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)).tolist())


# ---------------------------------------------------------------------- regression
# Defects the machine below found, one focused test each.


def test_bool_and_float_ids_are_refused():
    """``True`` was taken as slot (or version, count) 1 by every host argument."""
    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    kv = tuple(jnp.asarray(leaf) for leaf in random_kv(1))
    for slot, ver in ((True, 0), (1, True), (np.bool_(True), 0), (1.0, 0), ("1", 0), (None, 0)):
        with pytest.raises(InvalidArgument):
            cache.insert([1, 2], slot, ver)
    assert cache.stats().num_nodes == 0
    cache.insert([1, 2], 1, 1)
    with pytest.raises(InvalidArgument):
        cache.forget(True)
    with pytest.raises(InvalidArgument):
        cache.forget(1, keep_len=True)
    with pytest.raises(InvalidArgument):
        cache.copy_kv([1, 2], True, kv, alloc)
    with pytest.raises(InvalidArgument):
        SlotPrefixCacheManager(max_capacity=True)
    assert cache.find([1, 2]) == (2, 1, 1)


def test_forget_checks_the_version():
    """``forget(slot, slot_ver)`` compared any object with the versions: ``1.5``
    silently matched nothing and ``True`` dropped the version-1 entries."""
    cache = SlotPrefixCacheManager()
    cache.insert([1, 2], 1, 1)
    for bad in (True, 1.0, 1.5, "1"):
        with pytest.raises(InvalidArgument, match="slot_ver"):
            cache.forget(1, bad)
    assert cache.find([1, 2]) == (2, 1, 1)
    assert cache.forget(1, np.int64(1)) == 1


def test_failed_find_counts_nothing():
    """``find`` counted the query tokens before checking ``max_tokens``: a call
    that raised still moved the hit-rate statistics."""
    cache = SlotPrefixCacheManager()
    cache.insert([1, 2], 1, 0)
    for bad in (1.0, True, "1"):
        with pytest.raises(InvalidArgument, match="max_tokens"):
            cache.find([1, 2], max_tokens=bad)
    assert (cache.stats().query_tokens, cache.stats().hit_tokens) == (0, 0)


def test_copy_kv_into_a_fresh_slot_that_once_held_the_prefix():
    """The seed's flow, ``alloc`` then ``copy_kv``, raised "copy_kv from slot 1
    into itself" when the fresh slot was the one the tree recorded for the
    prefix at an older version: that record is stale, an ordinary miss."""
    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    kv = tuple(jnp.asarray(leaf) for leaf in random_kv(2))
    alloc, slot = alloc.alloc_or_raise()
    cache.insert([7, 7], slot, 1)
    alloc = alloc.free_or_raise(slot)
    alloc, again = alloc.alloc_or_raise()  # the same slot, version 2
    assert again == slot
    before = [np.asarray(leaf).copy() for leaf in kv]
    kv, copied = cache.copy_kv([7, 7], again, kv, alloc)
    assert copied == 0
    for b, a in zip(before, kv):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert cache.find([7, 7]) == (0, -1, 0)  # the stale record is gone
    cache.check_invariants()
    # a record at the slot's current version really is a copy into itself
    cache.insert([7, 7], again, 2)
    with pytest.raises(InvalidArgument, match=f"copy_kv from slot {again} \\(version 2\\) into itself"):
        cache.copy_kv([7, 7], again, kv, alloc)
    assert np.asarray(kv[0]).shape == (SLOTS, MAX_LEN) + K_ROW  # refused before the cache was donated


# ---------------------------------------------------------------------- model


@dataclasses.dataclass
class Rec:
    value: tuple | None
    pins: int = 0
    time: int = 0


class TreeModel:
    """The compressed radix tree of the slot cache, written plainly: nodes are
    keyed by ``(nskey, full path)``; a node's parent is the longest proper
    prefix of its path that is a node (the namespace root is ``()``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.nodes: dict[tuple, Rec] = {}
        self.clock = 0
        self.stats = dict(query=0, hit=0, direct=0, copies=0, stale=0, evictions=0, invalidated=0)

    # structure
    def parent(self, key):
        k, path = key
        for i in range(len(path) - 1, 0, -1):
            if (k, path[:i]) in self.nodes:
                return (k, path[:i])
        return (k, ())

    def children(self, key):
        k, path = key
        n = len(path)
        return [c for c in self.nodes if c[0] == k and len(c[1]) > n and c[1][:n] == path and self.parent(c) == key]

    def locked(self, key) -> bool:
        k, path = key
        n = len(path)
        return any(rec.pins for c, rec in self.nodes.items() if c[0] == k and c[1][:n] == path)

    def walk(self, k, query: tuple, split: bool):
        cur, path = (), []
        while len(cur) < len(query):
            nxt = [c for c in self.children((k, cur)) if c[1][len(cur)] == query[len(cur)]]
            if not nxt:
                break
            (child,) = nxt
            cpath = child[1]
            if query[: len(cpath)] == cpath:
                path.append(child)
                cur = cpath
                continue
            common = lcp(cpath, query)
            if split:
                rec = self.nodes[child]
                upper = (k, cpath[:common])
                self.nodes[upper] = Rec(rec.value, 0, rec.time)
                path.append(upper)
            else:
                path.append(child)
            return path, common
        return path, len(cur)

    def touch(self, path):
        self.clock += 1
        for key in path:
            self.nodes[key].time = self.clock

    def prune(self, key):
        while key[1] and self.nodes[key].value is None and not self.children(key) and not self.locked(key):
            parent = self.parent(key)
            del self.nodes[key]
            key = parent

    def evict(self) -> list:
        evicted = []
        while len(self.nodes) > self.capacity:
            leaves = [key for key in self.nodes if not self.children(key) and not self.locked(key)]
            if not leaves:
                break
            oldest = min(self.nodes[key].time for key in leaves)
            lru = [key for key in leaves if self.nodes[key].time == oldest]
            assert len(lru) == 1, f"two LRU leaves with one time: {lru}"
            leaf = lru[0]
            evicted.append((leaf, self.nodes[leaf].value[0]))
            parent = self.parent(leaf)
            del self.nodes[leaf]
            self.stats["evictions"] += 1
            self.prune(parent)
        return evicted

    # operations
    def insert(self, ns, tokens: tuple, slot: int, ver: int, pin: bool = False) -> list:
        if not tokens:
            return []
        k = nskey(ns)
        path, matched = self.walk(k, tokens, split=True)
        self.touch(path)
        for key in path:
            self.nodes[key].value = (slot, ver)
        if matched < len(tokens):
            node = (k, tokens)
            self.nodes[node] = Rec((slot, ver), 0, self.clock)
        else:
            node = path[-1]
        if pin:
            self.nodes[node].pins += 1
        return self.evict()

    def match(self, ns, tokens: tuple, max_tokens=None):
        if max_tokens is not None:
            tokens = tokens[: max(max_tokens, 0)]
        path, matched = self.walk(nskey(ns), tokens, split=False)
        ends = [len(key[1]) for key in path]
        if ends:
            ends[-1] = matched
        for i in range(len(path) - 1, -1, -1):
            if self.nodes[path[i]].value is not None:
                return path, i, ends[i]
        return path, -1, 0

    def find(self, ns, tokens: tuple, max_tokens=None):
        self.stats["query"] += len(tokens)
        path, i, p = self.match(ns, tokens, max_tokens)
        if i < 0:
            return 0, -1, 0
        self.touch(path[: i + 1])
        self.stats["hit"] += p
        return (p,) + self.nodes[path[i]].value

    def covered(self, ns, tokens: tuple) -> bool:
        return bool(tokens) and self.walk(nskey(ns), tokens, split=False)[1] == len(tokens)

    def pin(self, ns, tokens: tuple) -> bool:
        if not self.covered(ns, tokens):
            return False
        path, _ = self.walk(nskey(ns), tokens, split=True)
        self.nodes[path[-1]].pins += 1
        return True

    def release_outcome(self, ns, tokens: tuple):
        """True / False / InvalidArgument, changing nothing."""
        if not tokens:
            return False  # the empty prefix: a no-op, like pin([])
        if not self.covered(ns, tokens):
            return InvalidArgument  # nothing pinned there to undo
        path, _ = self.walk(nskey(ns), tokens, split=False)
        node = path[-1]
        if len(node[1]) != len(tokens) or self.nodes[node].pins == 0:
            return InvalidArgument
        return True

    def release(self, ns, tokens: tuple) -> None:
        node = (nskey(ns), tokens)
        self.nodes[node].pins -= 1
        self.prune(node)

    def forget(self, slot, ver=None, keep=0) -> int:
        dropped = 0
        for key in list(self.nodes):
            rec = self.nodes.get(key)
            if rec is None or rec.value is None or rec.value[0] != slot or ver not in (None, rec.value[1]):
                continue
            end = len(key[1])
            if end <= keep:
                continue
            if len(self.parent(key)[1]) < keep:
                self.nodes[(key[0], key[1][:keep])] = Rec(rec.value, 0, rec.time)
            rec.value = None
            self.prune(key)
            dropped += 1
        self.stats["invalidated"] += dropped
        return dropped

    def any_pins(self) -> bool:
        return any(rec.pins for rec in self.nodes.values())

    def facts(self) -> dict:
        return {key: rec.value for key, rec in self.nodes.items() if rec.value is not None}


@dataclasses.dataclass
class Request:
    ns: object
    tokens: tuple
    version: int
    pinned: bool


def tree_state(cache: SlotPrefixCacheManager) -> dict:
    """Everything observable about the tree, for "a failed op changed nothing"."""
    nodes = {
        (nskey(n.namespace), tuple(n.path_tokens().tolist())): (n.value, n.pins, n.lock, n.last_access)
        for n in cache.tree.nodes()
    }
    return dict(nodes=nodes, stats=cache.stats(), clock=cache.tree.clock)


# ---------------------------------------------------------------------- machine


class SlotCacheMachine(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([2, 3, 5, 8]), seed=SEEDS)
    def start(self, capacity, seed):
        self.cache = SlotPrefixCacheManager(max_capacity=capacity, enable_events=True)
        self.model = TreeModel(capacity)
        self.alloc = SlotAllocator.create(SLOTS)
        self.mirror = [np.array(leaf) for leaf in random_kv(seed)]
        self.kv = tuple(jnp.asarray(leaf) for leaf in self.mirror)
        self.free = set(USABLE)
        self.versions = [0] * SLOTS
        self.running: dict[int, Request] = {}
        self.prov = [[None] * MAX_LEN for _ in range(SLOTS)]  # who wrote each row position
        self.seen: list = []  # (ns, tokens) of earlier requests and inserts
        self.finished: list = []  # (ns, tokens) of finished requests
        self.extra_pins: dict = {}  # pins taken by the pin rule, (nskey, tokens) -> count
        self.replayed: dict = {}  # the tree's facts, rebuilt from its events

    # -------------------------------------------------------------- helpers

    def _tokens(self, data, ns, tail, limit=MAX_LEN):
        """Fresh tokens, or (half the time) a prefix of earlier ones plus a tail."""
        if self.seen and data.draw(st.booleans(), label="share"):
            ns, earlier = data.draw(st.sampled_from(self.seen), label="earlier")
            tail = earlier[: data.draw(st.integers(1, len(earlier)), label="cut")] + tuple(tail)
        return ns, tuple(tail)[:limit]

    def _alloc_model(self) -> int:
        slot = min(self.free)
        self.free.remove(slot)
        self.versions[slot] += 1
        return slot

    def _write(self, slot, start, stop, seed, owner):
        """Positions ``[start, stop)`` of row ``slot`` := fresh random K/V written by ``owner``
        (``(nskey, tokens)``, or None for garbage)."""
        rows = random_rows(seed)
        mask = (np.arange(MAX_LEN) >= start) & (np.arange(MAX_LEN) < stop)
        self.kv = WRITE(self.kv, np.int32(slot), rows, mask)
        for leaf, row in zip(self.mirror, rows):
            leaf[slot, start:stop] = row[start:stop]
        for pos in range(start, stop):
            self.prov[slot][pos] = None if owner is None else (owner[0], owner[1][: pos + 1])

    def _copy_model(self, src, dst, length):
        for leaf in self.mirror:
            leaf[dst, :length] = leaf[src, :length]
        self.prov[dst][:length] = self.prov[src][:length]

    def _holds(self, slot, ns, tokens, length):
        """Row ``slot`` really holds the K/V of ``tokens[:length]`` under ``ns``."""
        want = [(nskey(ns), tuple(tokens[: i + 1])) for i in range(length)]
        assert self.prov[slot][:length] == want, (slot, self.prov[slot][:length], want)

    def _drain(self) -> list:
        """Take the tree's events and replay them onto ``self.replayed``."""
        events = self.cache.take_events()
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.replayed.clear()
                continue
            key = (nskey(ev.namespace), tuple(ev.tokens.tolist()))
            if isinstance(ev, BlockStored):
                assert key not in self.replayed, key
                self.replayed[key] = ev.block_ids[0]
            else:
                assert isinstance(ev, BlockRemoved)
                assert self.replayed.pop(key) == ev.block_ids[0], key
        return events

    def _insert(self, ns, tokens, slot, ver, pin=False):
        """Insert into both, and check that exactly the predicted leaves were
        evicted, in LRU order, none of them in use."""
        self._drain()
        evictions = self.cache.stats().evictions
        self.cache.insert(list(tokens), slot, ver, namespace=ns, pin=pin)
        expected = self.model.insert(ns, tokens, slot, ver, pin)
        events = self._drain()
        last_stored = max((i for i, ev in enumerate(events) if isinstance(ev, BlockStored)), default=-1)
        got = [((nskey(ev.namespace), tuple(ev.tokens.tolist())), ev.block_ids[0]) for ev in events[last_stored + 1 :]]
        assert got == expected, (got, expected)
        assert self.cache.stats().evictions - evictions == len(expected)
        for (k, path), _ in expected:  # never a prefix a running request holds pinned
            for req in self.running.values():
                assert not (req.pinned and nskey(req.ns) == k and req.tokens[: len(path)] == path), (path, req)
        if expected:
            event(f"insert evicted {len(expected)}")
        if tokens:
            self.seen.append((ns, tuple(tokens)))

    def _unchanged(self, tree_before, alloc_before):
        assert tree_state(self.cache) == tree_before
        chex.assert_trees_all_equal(alloc_before, self.alloc, strict=True)
        assert self.cache.take_events() == []

    # -------------------------------------------------------------- requests

    @rule(ns=NAMESPACES, tail=st.lists(TOKEN, min_size=1, max_size=MAX_LEN), data=st.data(),
          pin=st.booleans(), insert=st.sampled_from([True, True, True, False]), seed=SEEDS)
    def request(self, ns, tail, data, pin, insert, seed):
        ns, tokens = self._tokens(data, ns, tail)
        self._request(ns, tokens, data, pin, insert, seed)

    def _request(self, ns, tokens, data, pin, insert, seed):
        """acquire_slot (predicted by the model), prefill with fresh data, insert."""
        max_tokens = data.draw(st.sampled_from([None, len(tokens) - 1, "any"]), label="max_tokens")
        if max_tokens == "any":
            max_tokens = data.draw(st.integers(-1, MAX_LEN + 1), label="max_tokens")

        model = self.model
        path, index, p = model.match(ns, tokens, max_tokens)
        src, ver = model.nodes[path[index]].value if index >= 0 else (-1, 0)
        current = p > 0 and 1 <= src < SLOTS and self.versions[src] == ver
        direct = current and src in self.free
        tree_before, alloc_before = tree_state(self.cache), self.alloc

        self.alloc, self.kv, target, reused, got_direct = self.cache.acquire_slot(
            self.alloc, self.kv, list(tokens), namespace=ns, max_tokens=max_tokens)

        if not direct and not self.free:  # no slot: nothing may change
            assert (target, reused, got_direct) == (-1, 0, False)
            self._unchanged(tree_before, alloc_before)
            event("acquire: oom")
            return
        if direct:
            expected = (src, p, True)
            self.free.remove(src)
        else:
            fresh = self._alloc_model()
            expected = (fresh, p if current else 0, False)
            if current:
                self._copy_model(src, fresh, p)
        assert (target, reused, got_direct) == expected, ((target, reused, got_direct), expected)
        model.stats["query"] += len(tokens)
        model.stats["hit"] += reused
        if index >= 0:
            model.touch(path[: index + 1])
        if direct:
            model.stats["direct"] += 1
            model.forget(target, ver, keep=p)
        else:
            if p and not current:
                model.stats["stale"] += 1
                model.forget(src, ver)
            elif current:
                model.stats["copies"] += 1
            model.forget(target)
        event("acquire: " + ("direct" if direct else "copy" if current else "stale" if p else "miss"))

        self._holds(target, ns, tokens, reused)  # the reused rows are this prefix's K/V
        self._write(target, reused, len(tokens), seed, (nskey(ns), tokens))  # prefill the rest
        self.running[target] = Request(ns, tokens, self.versions[target], pin and insert)
        if insert:
            self._insert(ns, tokens, target, self.versions[target], pin=pin)
        self.seen.append((ns, tokens))

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), tail=st.lists(TOKEN, max_size=2), pin=st.booleans(), seed=SEEDS)
    def request_again(self, data, tail, pin, seed):
        """A request that extends what a finished one ran: its slot may still
        be free at the recorded version (direct reuse) or handed out since."""
        ns, tokens = data.draw(st.sampled_from(self.finished[-3:]))
        self._request(ns, (tokens + tuple(tail))[:MAX_LEN], data, pin, True, seed)

    @precondition(lambda self: self.free)
    @rule(ns=NAMESPACES, tail=st.lists(TOKEN, min_size=1, max_size=MAX_LEN), data=st.data(), seed=SEEDS)
    def request_by_copy_kv(self, ns, tail, data, seed):
        """The seed's flow: allocate a fresh slot, then ``copy_kv`` the cached prefix into it."""
        ns, tokens = self._tokens(data, ns, tail)
        self.alloc, target = self.alloc.alloc_or_raise()
        assert target == self._alloc_model()
        path, index, p = self.model.match(ns, tokens)
        tree_before, alloc_before = tree_state(self.cache), self.alloc
        if index < 0:
            self.kv, copied = self.cache.copy_kv(list(tokens), target, self.kv, self.alloc, namespace=ns)
            assert copied == 0
            self._unchanged(tree_before, alloc_before)
        else:
            src, ver = self.model.nodes[path[index]].value
            current = 1 <= src < SLOTS and self.versions[src] == ver
            self.kv, copied = self.cache.copy_kv(list(tokens), target, self.kv, self.alloc, namespace=ns)
            assert copied == (p if current else 0), (copied, p, current)
            if current:
                self._copy_model(src, target, p)
            else:
                self.model.forget(src, ver)
            self.model.forget(target)
            event("copy_kv: " + ("copy" if current else "stale"))
        self._holds(target, ns, tokens, copied)
        self._write(target, copied, len(tokens), seed, (nskey(ns), tokens))
        self.running[target] = Request(ns, tokens, self.versions[target], False)
        self._insert(ns, tokens, target, self.versions[target])

    @precondition(lambda self: any(len(r.tokens) < MAX_LEN for r in self.running.values()))
    @rule(data=st.data(), more=st.lists(TOKEN, min_size=1, max_size=3), seed=SEEDS)
    def decode(self, data, more, seed):
        """A running request grows by a few tokens and inserts the longer sequence
        (moving its pin there)."""
        slot = data.draw(st.sampled_from(sorted(s for s, r in self.running.items() if len(r.tokens) < MAX_LEN)))
        req = self.running[slot]
        tokens = (req.tokens + tuple(more))[:MAX_LEN]
        self._write(slot, len(req.tokens), len(tokens), seed, (nskey(req.ns), tokens))
        self._insert(req.ns, tokens, slot, req.version, pin=req.pinned)
        if req.pinned:
            assert self.cache.release(list(req.tokens), namespace=req.ns) is True
            self.model.release(req.ns, req.tokens)
        req.tokens = tokens

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        slot = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(slot)
        self.finished.append((req.ns, req.tokens))
        if req.pinned:
            assert self.cache.release(list(req.tokens), namespace=req.ns) is True
            self.model.release(req.ns, req.tokens)
        self.alloc = self.alloc.free_or_raise(slot)
        self.free.add(slot)

    @precondition(lambda self: self.free)
    @rule(seed=SEEDS)
    def unrelated_owner(self, seed):
        """Someone else takes a slot (its version moves on), overwrites it, frees it."""
        self.alloc, slot = self.alloc.alloc_or_raise()
        assert slot == self._alloc_model()
        self._write(slot, 0, MAX_LEN, seed, None)
        self.alloc = self.alloc.free_or_raise(slot)
        self.free.add(slot)

    # -------------------------------------------------------------- the tree alone

    @rule(ns=NAMESPACES, tail=st.lists(TOKEN, max_size=MAX_LEN + 1), data=st.data(),
          max_tokens=st.none() | st.integers(-1, MAX_LEN + 1))
    def find(self, ns, tail, data, max_tokens):
        ns, tokens = self._tokens(data, ns, tail, limit=MAX_LEN + 2)
        got = self.cache.find(list(tokens), namespace=ns, max_tokens=max_tokens)
        assert got == self.model.find(ns, tokens, max_tokens), (got, tokens)
        p, slot, ver = got
        if 1 <= slot < SLOTS and self.versions[slot] == ver:  # a live hit reads this prefix's K/V
            self._holds(slot, ns, tokens, p)

    @rule(ns=NAMESPACES, tail=st.lists(TOKEN, min_size=1, max_size=MAX_LEN + 2), data=st.data(),
          slot=st.integers(SLOTS, SLOTS + 3) | st.just(2**31 - 1), ver=st.integers(0, 3))
    def foreign_insert(self, ns, tail, data, slot, ver):
        """A fact naming a slot this allocator does not have: never reused."""
        ns, tokens = self._tokens(data, ns, tail, limit=MAX_LEN + 2)
        self._insert(ns, tokens, slot, ver)

    @rule(slot=st.integers(-1, SLOTS + 1), ver=st.none() | st.integers(0, 3), keep=st.integers(0, MAX_LEN),
          reset=st.sampled_from([False] * 7 + [True]))
    def forget(self, slot, ver, keep, reset):
        """``forget`` some facts; now and then ``reset`` the whole cache instead."""
        if reset:
            self._reset()
            return
        if slot < 1:  # no such slot can be recorded: refused, nothing changes
            before, alloc_before = tree_state(self.cache), self.alloc
            with pytest.raises(InvalidArgument, match="forget of slot"):
                self.cache.forget(slot, ver, keep_len=keep)
            self._unchanged(before, alloc_before)
            return
        assert self.cache.forget(slot, ver, keep_len=keep) == self.model.forget(slot, ver, keep)

    @rule(ns=NAMESPACES, tail=st.lists(TOKEN, max_size=4), data=st.data())
    def pin(self, ns, tail, data):
        ns, tokens = self._tokens(data, ns, tail, limit=MAX_LEN + 2)
        expected = self.model.pin(ns, tokens)
        assert self.cache.pin(list(tokens), namespace=ns) is expected
        if expected:
            key = (nskey(ns), tokens)
            self.extra_pins[key] = self.extra_pins.get(key, 0) + 1

    @precondition(lambda self: any(self.extra_pins.values()))
    @rule(data=st.data())
    def release_pin(self, data):
        key = data.draw(st.sampled_from(sorted((k for k, c in self.extra_pins.items() if c), key=repr)))
        (is_bool, ns), tokens = key
        assert self.cache.release(list(tokens), namespace=ns) is True
        self.model.release(ns, tokens)
        self.extra_pins[key] -= 1

    @rule(ns=NAMESPACES, tail=st.lists(TOKEN, max_size=4), data=st.data())
    def release_foreign(self, ns, tail, data):
        """Release of what was never pinned, was evicted, or lives in another namespace."""
        ns, tokens = self._tokens(data, ns, tail, limit=MAX_LEN + 2)
        expected = self.model.release_outcome(ns, tokens)
        if expected is True:
            return  # a pin some request or the pin rule holds: not ours to drop
        before, alloc_before = tree_state(self.cache), self.alloc
        if expected is InvalidArgument:
            with pytest.raises(InvalidArgument, match=f"not pinned \\({len(tokens)} tokens\\)"):
                self.cache.release(list(tokens), namespace=ns)
        else:
            assert self.cache.release(list(tokens), namespace=ns) is False
        self._unchanged(before, alloc_before)

    def _reset(self):
        if self.model.any_pins():
            before, alloc_before = tree_state(self.cache), self.alloc
            with pytest.raises(CacheLocked):
                self.cache.reset()
            self._unchanged(before, alloc_before)
            return
        self.cache.reset()
        self.model.nodes.clear()

    # -------------------------------------------------------------- bad inputs

    @rule(data=st.data(), kind=st.sampled_from(
        ["insert", "host args", "copy_kv target", "too long", "free", "alloc when full"]))
    def bad_input(self, data, kind):
        """One bad call; it must raise its typed error and change nothing."""
        getattr(self, "_bad_" + kind.replace(" ", "_"))(data)

    def _bad_insert(self, data):
        tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=3))
        slot, ver = data.draw(st.sampled_from([
            (0, 0), (-1, 0), (-(2**31), 0), (2**31, 0), (1, -1), (1, 2**31), (2**70, 0),
        ]) | st.tuples(st.sampled_from(BAD_INTS), st.just(0)) | st.tuples(st.just(1), st.sampled_from(BAD_INTS)))
        before, alloc_before = tree_state(self.cache), self.alloc
        with pytest.raises(InvalidArgument):
            self.cache.insert(tokens, slot, ver)
        self._unchanged(before, alloc_before)

    def _bad_host_args(self, data):
        """Float / bool / str / None where an integer belongs."""
        bad = data.draw(st.sampled_from(BAD_INTS))
        call = data.draw(st.sampled_from(["forget slot", "forget version", "forget keep", "find max_tokens",
                                          "acquire max_tokens", "copy_kv target", "tokens", "capacity"]))
        if bad is None and call in ("forget version", "find max_tokens", "acquire max_tokens"):
            return  # None means "any version" / "no cap" there
        before, alloc_before = tree_state(self.cache), self.alloc
        with pytest.raises(InvalidArgument):
            if call == "forget slot":
                self.cache.forget(bad)
            elif call == "forget version":
                self.cache.forget(1, bad)
            elif call == "forget keep":
                self.cache.forget(1, keep_len=bad)
            elif call == "find max_tokens":
                self.cache.find([0, 1], max_tokens=bad)
            elif call == "acquire max_tokens":
                self.alloc, self.kv, *_ = self.cache.acquire_slot(self.alloc, self.kv, [0, 1], max_tokens=bad)
            elif call == "copy_kv target":
                self.kv, _ = self.cache.copy_kv([0, 1], bad, self.kv, self.alloc)
            elif call == "tokens":
                self.cache.insert([0, bad], 1, 0)
            else:
                SlotPrefixCacheManager(max_capacity=bad)
        self._unchanged(before, alloc_before)

    def _bad_copy_kv_target(self, data):
        target = data.draw(st.sampled_from([0, -1, SLOTS, SLOTS + 5, 2**40]))
        before, alloc_before = tree_state(self.cache), self.alloc
        with pytest.raises(InvalidArgument, match=f"target slot {target} outside \\[1, {SLOTS}\\)"):
            self.kv, _ = self.cache.copy_kv([0, 1], target, self.kv, self.alloc)
        self._unchanged(before, alloc_before)

    def _bad_too_long(self, data):
        """A cached prefix longer than the cache rows is refused before the cache
        is donated (only foreign inserts can be that long)."""
        long = [(ns, t) for ns, t in self.seen if len(t) > MAX_LEN]
        if not long:
            return
        ns, tokens = data.draw(st.sampled_from(long))
        _, _, p = self.model.match(ns, tokens)
        if p <= MAX_LEN:
            return
        before, alloc_before = tree_state(self.cache), self.alloc
        with pytest.raises(InvalidArgument, match=f"cached prefix of {p} tokens is longer than the cache rows \\({MAX_LEN}\\)"):
            self.alloc, self.kv, *_ = self.cache.acquire_slot(self.alloc, self.kv, list(tokens), namespace=ns)
        self._unchanged(before, alloc_before)
        event("acquire: too long")

    def _bad_free(self, data):
        """Double free, the null slot, out-of-range and non-integer ids: typed errors, nothing freed."""
        choices = [0, -2, SLOTS, 2**40] + sorted(self.free)
        if self.running:
            running = sorted(self.running)
            choices += [[running[0], running[0]]]  # one held slot named twice
        slot = data.draw(st.sampled_from(choices) | st.sampled_from(BAD_SCALARS))
        before = self.alloc
        if isinstance(slot, list):
            error = DoubleFree
        elif isinstance(slot, int) and not isinstance(slot, bool):
            error = DoubleFree if slot in USABLE else InvalidId
        else:
            error = InvalidArgument
        with pytest.raises(error):
            self.alloc.free_or_raise(slot)
        chex.assert_trees_all_equal(before, self.alloc, strict=True)

    def _bad_alloc_when_full(self, data):
        if self.free:
            return
        before = self.alloc
        with pytest.raises(KVCacheOOM, match=f"requested 1 slots, 0 available \\(of {SLOTS - 1} total\\)"):
            self.alloc.alloc_or_raise()
        chex.assert_trees_all_equal(before, self.alloc, strict=True)

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        # the cache arrays: what was written, nothing else
        for leaf, mirrored in zip(self.kv, self.mirror):
            np.testing.assert_array_equal(np.asarray(leaf).astype(np.float32), mirrored.astype(np.float32))
        # no slot leaked: each usable slot is free or held by one running request
        free = free_set(self.alloc)
        assert free == self.free, (free, self.free)
        assert not free & set(self.running) and free | set(self.running) == USABLE, (free, self.running)
        np.testing.assert_array_equal(np.asarray(self.alloc.versions), self.versions)
        assert self.versions[0] == 0
        # the tree == the model, and its events replay to it
        self._drain()
        self.cache.check_invariants()
        real = {
            (nskey(n.namespace), tuple(n.path_tokens().tolist())): (n.value, n.pins)
            for n in self.cache.tree.nodes()
        }
        assert real == {key: (rec.value, rec.pins) for key, rec in self.model.nodes.items()}
        assert self.replayed == {key: value[0] for key, value in self.model.facts().items()}
        s, m = self.cache.stats(), self.model.stats
        assert (s.query_tokens, s.hit_tokens, s.direct_reuses, s.copies, s.stale_misses, s.evictions,
                s.invalidated_nodes) == (m["query"], m["hit"], m["direct"], m["copies"], m["stale"],
                                         m["evictions"], m["invalidated"])
        assert (s.num_nodes, s.cached_nodes) == (len(self.model.nodes), len(self.model.facts()))
        assert s.protected_nodes == sum(self.model.locked(key) for key in self.model.nodes)
        # every live fact names rows that hold exactly that prefix's K/V
        for (k, path), (slot, ver) in self.model.facts().items():
            assert ver <= self.versions[slot] if slot < SLOTS else True
            if slot < SLOTS and self.versions[slot] == ver:
                assert self.prov[slot][: len(path)] == [(k, path[: i + 1]) for i in range(len(path))], (path, slot)


# The profile's settings (ci: 30 x 60 steps, about 5 s here; long: 400 x 100).
TestSlotCacheMachine = pytest.mark.slow(SlotCacheMachine.TestCase)
