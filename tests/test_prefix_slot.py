"""Slot mode of the prefix cache (seed 001): ``SlotPrefixCacheManager``,
``claim`` and ``copy_kv`` on a dense ``[slots, max_len, layers, heads, dim]``
K/V cache.

* one test per seed path of ``claim``: direct reuse (occupy, nothing copied,
  version kept), copy from a busy source (every layer, only ``[:p]``), and a
  miss when the slot was handed out again (no stale copy);
* the fix over the seed: after a direct reuse at ``p`` a longer sequence that
  lived in the same slot is no longer found past ``p``;
* LRU eviction over the node capacity (pinned nodes skipped), namespaces,
  partial matches, pin/release, reset, events, metrics, argument errors;
* two state machines: the tree alone against naive models (a list of cached
  sequences for the longest common prefix, a per-prefix dict for the slot),
  events replayed against the tree; and whole request lifecycles on a real
  cache where each position's K/V is a function of the prefix that produced
  it, so any reuse of stale or overwritten rows shows up as wrong data.

Every device call uses the same shapes (``SLOTS`` x ``MAX_LEN`` rows), so
``claim``, ``copy_kv`` and the row write compile once each.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jaxkv.alloc.slot import SlotAllocator
from jaxkv.errors import InvalidArgument
from jaxkv.prefix.block_cache import AllBlocksCleared, BlockRemoved, BlockStored, CacheLocked
from jaxkv.prefix.slot_cache import SlotPrefixCacheManager, claim, copy_kv
from tests.util import lcp

SLOTS = 4  # slot 0 is the null slot: 3 usable
MAX_LEN = 8
LAYERS, HEADS, DIM = 2, 1, 2
ROW = (LAYERS, HEADS, DIM)


def random_kv(seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (SLOTS, MAX_LEN) + ROW
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))


def host(kv) -> list[np.ndarray]:
    return [np.asarray(leaf).copy() for leaf in kv]


def _write_rows(kv, slot, rows, mask):
    return tuple(c.at[slot].set(jnp.where(mask[:, None, None, None], r, c[slot])) for c, r in zip(kv, rows))


WRITE_ROWS = jax.jit(_write_rows, donate_argnums=0)


def write_rows(kv, slot: int, start: int, stop: int, rows):
    """Positions ``[start, stop)`` of row ``slot`` := ``rows`` (one [MAX_LEN, ...] per leaf)."""
    mask = (np.arange(MAX_LEN) >= start) & (np.arange(MAX_LEN) < stop)
    return WRITE_ROWS(kv, np.int32(slot), tuple(np.asarray(r, np.float32) for r in rows), mask)


def version(alloc: SlotAllocator, slot: int) -> int:
    return int(alloc.versions[slot])


def is_free(alloc: SlotAllocator, slot: int) -> bool:
    return bool(alloc.is_free(slot))


# ---------------------------------------------------------------------- seed paths


def test_direct_reuse_when_free_and_version_unchanged():
    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(1)
    alloc, slot = alloc.alloc_or_raise()
    ver = version(alloc, slot)
    cache.insert([5, 6, 7, 8], slot, ver)
    alloc = alloc.free_or_raise(slot)  # the request finished; its rows stay as they are
    before, free_before = host(kv), int(alloc.free_count)

    alloc, kv, target, prefix_len, direct = cache.acquire_slot(alloc, kv, [5, 6, 7, 8, 9, 10])

    assert (target, prefix_len, direct) == (slot, 4, True)
    assert version(alloc, slot) == ver, "direct reuse must not bump the version"
    assert not is_free(alloc, slot) and int(alloc.free_count) == free_before - 1
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a, b)  # nothing copied, nothing written
    assert cache.find([5, 6, 7, 8]) == (4, slot, ver)  # still valid: the request writes from position 4 on
    s = cache.stats()
    assert (s.direct_reuses, s.copies, s.stale_misses) == (1, 0, 0)
    cache.check_invariants()


def test_copy_from_busy_source_copies_prefix_of_every_layer():
    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(2)
    alloc, src = alloc.alloc_or_raise()  # still running: busy
    src_ver = version(alloc, src)
    cache.insert([1, 2, 3, 4, 5, 6], src, src_ver)
    before = host(kv)

    alloc, kv, target, prefix_len, direct = cache.acquire_slot(alloc, kv, [1, 2, 3, 9])

    assert target not in (src, 0, -1) and (prefix_len, direct) == (3, False)
    assert version(alloc, src) == src_ver and version(alloc, target) == 1
    after = host(kv)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a[target, :3], b[src, :3])  # every layer, head, dim
        np.testing.assert_array_equal(a[target, 3:], b[target, 3:])  # untouched past the prefix
        others = [s for s in range(SLOTS) if s != target]
        np.testing.assert_array_equal(a[others], b[others])
        assert not np.array_equal(b[target, :3], b[src, :3])  # the copy really changed something
    assert cache.stats().copies == 1

    # a full match capped one short of the prompt (so one token yields logits)
    before = host(kv)
    alloc, kv, third, prefix_len, direct = cache.acquire_slot(alloc, kv, [1, 2, 3, 4, 5, 6], max_tokens=5)
    assert third not in (src, target, -1) and (prefix_len, direct) == (5, False)
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a[third, :5], b[src, :5])
        np.testing.assert_array_equal(a[third, 5:], b[third, 5:])
    cache.check_invariants()


def test_version_changed_is_a_miss_without_stale_copy():
    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(3)
    alloc, slot = alloc.alloc_or_raise()
    cache.insert([4, 4, 4], slot, version(alloc, slot))
    alloc = alloc.free_or_raise(slot)
    alloc, other = alloc.alloc_or_raise()  # an unrelated request gets the same slot: new version
    assert other == slot
    kv = write_rows(kv, other, 0, MAX_LEN, [np.full((MAX_LEN,) + ROW, 7.0)] * 2)  # and overwrites it
    before = host(kv)

    alloc, kv, target, prefix_len, direct = cache.acquire_slot(alloc, kv, [4, 4, 4, 1])

    assert target not in (slot, -1) and (prefix_len, direct) == (0, False)
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a, b)  # nothing copied
    assert cache.find([4, 4, 4]) == (0, -1, 0), "the stale entry is dropped"
    s = cache.stats()
    assert (s.stale_misses, s.copies, s.direct_reuses, s.hit_tokens) == (1, 0, 0, 0)
    cache.check_invariants()


def test_version_changed_and_slot_free_again_is_not_reused():
    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(4)
    alloc, slot = alloc.alloc_or_raise()
    old_ver = version(alloc, slot)
    alloc, _ = alloc.alloc_or_raise()
    alloc = alloc.free_or_raise(slot)
    alloc, again = alloc.alloc_or_raise()  # handed out again (version bump) ...
    alloc = alloc.free_or_raise(again)  # ... and freed: free, but not the recorded version
    before = host(kv)
    alloc, kv, target, reused, direct, ok = claim(alloc, kv, slot, old_ver, 3)
    assert bool(ok) and not bool(direct) and int(reused) == 0
    assert version(alloc, int(target)) == old_ver + 2  # a fresh alloc, never an occupy
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a, b)


def test_claim_when_full_changes_nothing():
    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(5)
    cache = SlotPrefixCacheManager()
    slots = []
    for _ in range(SLOTS - 1):
        alloc, s = alloc.alloc_or_raise()
        slots.append(s)
    cache.insert([1, 2], slots[0], version(alloc, slots[0]))
    before_kv, before_alloc = host(kv), jax.device_get(alloc)
    alloc, kv, target, prefix_len, direct = cache.acquire_slot(alloc, kv, [1, 2, 3])  # source busy, none free
    assert (target, prefix_len, direct) == (-1, 0, False)
    np.testing.assert_array_equal(np.asarray(alloc.free_mask), before_alloc.free_mask)
    np.testing.assert_array_equal(np.asarray(alloc.versions), before_alloc.versions)
    for b, a in zip(before_kv, host(kv)):
        np.testing.assert_array_equal(a, b)
    assert cache.find([1, 2]) == (2, slots[0], 1)  # the tree is untouched too
    assert cache.stats().query_tokens == 2  # only the find above counted


def test_copy_kv_function_and_method():
    kv = random_kv(6)
    before = host(kv)
    kv = copy_kv(kv, 1, 3, 5)
    after = host(kv)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a[3, :5], b[1, :5])
        np.testing.assert_array_equal(a[3, 5:], b[3, 5:])
        np.testing.assert_array_equal(a[:3], b[:3])
    kv = copy_kv(kv, 1, 0, 5)  # the null slot is never written
    kv = copy_kv(kv, 1, -1, 5)  # nor is a negative slot taken as "the last one"
    for b, a in zip(after, host(kv)):
        np.testing.assert_array_equal(a, b)

    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    alloc, src = alloc.alloc_or_raise()
    alloc, dst = alloc.alloc_or_raise()
    cache.insert([9, 8, 7], src, version(alloc, src))
    before = host(kv)
    kv, copied = cache.copy_kv([9, 8, 5], dst, kv, alloc)
    assert copied == 2
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a[dst, :2], b[src, :2])
        np.testing.assert_array_equal(a[dst, 2:], b[dst, 2:])
    alloc = alloc.free_or_raise(src)
    alloc, _ = alloc.alloc_or_raise()  # src handed out again
    before = host(kv)
    kv, copied = cache.copy_kv([9, 8, 7], dst, kv, alloc)
    assert copied == 0
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a, b)
    assert cache.find([9, 8, 7]) == (0, -1, 0)


def test_copy_kv_n_layers_copies_only_the_first_layers():
    """The seed's ``copy_kv(..., n_layers)``: layers ``[:n_layers]`` of the
    prefix positions are copied, the target's other layers and positions kept."""
    kv = random_kv(7)
    before = host(kv)
    kv = copy_kv(kv, 1, 3, 5, n_layers=1)
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a[3, :5, :1], b[1, :5, :1])
        np.testing.assert_array_equal(a[3, :5, 1:], b[3, :5, 1:])
        np.testing.assert_array_equal(a[3, 5:], b[3, 5:])
        np.testing.assert_array_equal(a[:3], b[:3])

    cache = SlotPrefixCacheManager()
    alloc = SlotAllocator.create(SLOTS)
    alloc, src = alloc.alloc_or_raise()
    alloc, dst = alloc.alloc_or_raise()
    cache.insert([9, 8, 7], src, version(alloc, src))
    before = host(kv)
    kv, copied = cache.copy_kv([9, 8, 7], dst, kv, alloc, n_layers=1)
    assert copied == 3
    for b, a in zip(before, host(kv)):
        np.testing.assert_array_equal(a[dst, :3, :1], b[src, :3, :1])
        np.testing.assert_array_equal(a[dst, :3, 1:], b[dst, :3, 1:])
    for bad in (-1, LAYERS + 1):
        with pytest.raises(InvalidArgument, match="n_layers"):
            cache.copy_kv([9, 8, 7], dst, kv, alloc, n_layers=bad)


# ---------------------------------------------------------------------- the fix over the seed


def test_direct_reuse_invalidates_longer_sequences_in_that_slot():
    cache = SlotPrefixCacheManager(enable_events=True)
    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(7)
    alloc, s2 = alloc.alloc_or_raise()
    alloc, s = alloc.alloc_or_raise()
    v2, v = version(alloc, s2), version(alloc, s)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], s2, v2)  # still running in s2
    cache.insert([1, 2, 3, 4, 5, 6], s, v)  # path [1..6] now names s; [7, 8] still s2
    alloc = alloc.free_or_raise(s)
    cache.take_events()

    alloc, kv, target, prefix_len, direct = cache.acquire_slot(alloc, kv, [1, 2, 3, 9, 9])
    assert (target, prefix_len, direct) == (s, 3, True)
    # the new owner overwrites positions >= 3 of s: [1..6] is no longer in s
    assert cache.find([1, 2, 3, 4, 5, 6]) == (3, s, v)
    assert cache.find([1, 2, 3, 4, 5, 6, 7, 8]) == (8, s2, v2)  # s2 still holds all 8
    assert cache.find([1, 2, 3, 4, 5, 6, 0]) == (3, s, v)  # [4..6] has no slot left: fall back
    events = cache.take_events()
    assert [(type(e), tuple(e.tokens), e.block_ids) for e in events] == [
        (BlockStored, (1, 2, 3), (s,)),  # the split's upper half keeps the slot
        (BlockRemoved, (1, 2, 3, 4, 5, 6), (s,)),
    ]
    assert cache.stats().invalidated_nodes == 1
    cache.check_invariants()

    # the same through a later insert of the new owner: consistent again
    cache.insert([1, 2, 3, 9, 9], s, v)
    assert cache.find([1, 2, 3, 9, 9, 1]) == (5, s, v)
    cache.check_invariants()


# ---------------------------------------------------------------------- tree behaviour


def test_find_partial_matches():
    cache = SlotPrefixCacheManager()
    cache.insert([1, 2, 3, 4, 5, 6], 1, 10)
    cache.insert([1, 2, 3, 7, 8], 2, 20)  # overwrites [1, 2, 3]; splits the first node
    assert cache.find([1, 2, 3, 4, 5]) == (5, 1, 10)  # ends inside a node
    assert cache.find([1, 2, 3, 4, 5, 6, 7]) == (6, 1, 10)
    assert cache.find([1, 2]) == (2, 2, 20)
    assert cache.find([1, 2, 3, 7, 9]) == (4, 2, 20)
    assert cache.find([1, 2, 3, 5]) == (3, 2, 20)
    assert cache.find([9, 1]) == (0, -1, 0)
    assert cache.find([]) == (0, -1, 0)
    assert cache.find(np.array([1, 2, 3, 4, 5, 6], np.int64), max_tokens=4) == (4, 1, 10)
    assert cache.stats().num_nodes == 3
    cache.check_invariants()


def test_pin_release():
    cache = SlotPrefixCacheManager()
    cache.insert([1, 2, 3, 4], 1, 0)
    assert cache.pin([1, 2]) is True  # ends inside a node: split there
    assert cache.stats().num_nodes == 2 and cache.stats().protected_nodes == 1
    assert cache.pin([1, 2, 5]) is False and cache.pin([]) is False  # not cached: ignored
    with pytest.raises(InvalidArgument):
        cache.release([7])  # not in the cache: no pin to undo
    assert cache.release([]) is False  # the empty prefix: a no-op, like pin([])
    with pytest.raises(InvalidArgument):
        cache.release([1, 2, 3, 4])  # cached but never pinned
    with pytest.raises(InvalidArgument):
        cache.release([1])  # ends inside the pinned node
    assert cache.release([1, 2]) is True
    with pytest.raises(InvalidArgument):
        cache.release([1, 2])  # released twice
    cache.insert([3, 3], 2, 0, pin=True)  # the seed's insert-and-hold
    assert cache.stats().protected_nodes == 1
    assert cache.release([3, 3]) is True
    cache.check_invariants()


def test_lru_eviction_over_node_capacity_skips_pinned():
    cache = SlotPrefixCacheManager(max_capacity=3, enable_events=True)
    cache.insert([1, 1], 1, 0)
    cache.insert([2, 2], 2, 0)
    cache.insert([3, 3], 3, 0)
    assert cache.pin([1, 1])  # the least recently used, but pinned
    cache.take_events()

    cache.insert([4, 4], 1, 1)  # 4 nodes: evict the LRU unpinned leaf, [2, 2]
    assert cache.find([2, 2]) == (0, -1, 0)
    assert cache.find([1, 1]) == (2, 1, 0)
    assert cache.find([3, 3]) == (2, 3, 0)  # touch [3, 3]: now [4, 4] is the LRU
    cache.insert([5, 5], 2, 1)
    assert cache.find([4, 4]) == (0, -1, 0)
    assert [cache.find(t)[0] for t in ([1, 1], [3, 3], [5, 5])] == [2, 2, 2]
    events = cache.take_events()
    removed = [tuple(e.tokens) for e in events if isinstance(e, BlockRemoved)]
    assert removed == [(2, 2), (4, 4)]
    assert cache.stats().evictions == 2 and cache.stats().num_nodes == 3

    assert cache.release([1, 1])
    cache.insert([6, 6], 3, 1)  # [1, 1] was last used before [3, 3] and [5, 5]
    assert cache.find([1, 1]) == (0, -1, 0)
    assert cache.stats().evictions == 3

    # all pinned: the tree stays above capacity rather than drop a pinned node
    for tokens in ([3, 3], [5, 5], [6, 6]):
        assert cache.pin(tokens)
    cache.insert([7, 7], 1, 2)  # the only unpinned leaf: evicted at once
    assert cache.find([7, 7]) == (0, -1, 0) and cache.stats().evictions == 4
    cache.insert([8, 8], 2, 2, pin=True)  # nothing evictable: above capacity
    assert cache.stats().num_nodes == 4 and cache.stats().evictions == 4
    cache.check_invariants()


def test_eviction_removes_chains_tail_first():
    cache = SlotPrefixCacheManager(max_capacity=3)
    cache.insert([1, 2, 3, 4], 1, 0)
    cache.insert([1, 2, 5], 2, 0)  # [1, 2] / [3, 4], [5]
    cache.insert([1, 2, 3, 6], 3, 0)  # [1, 2] / [3] / [4], [6] and [5]: 5 nodes -> evict 2 LRU leaves
    assert cache.stats().num_nodes == 3
    assert cache.find([1, 2, 3, 6]) == (4, 3, 0)
    assert cache.find([1, 2, 5]) == (2, 3, 0) and cache.find([1, 2, 3, 4]) == (3, 3, 0)
    cache.check_invariants()


def test_namespaces_are_disjoint():
    cache = SlotPrefixCacheManager()
    cache.insert([1, 2, 3], 1, 0, namespace="lora-a")
    assert cache.find([1, 2, 3], namespace="lora-b") == (0, -1, 0)
    assert cache.find([1, 2, 3]) == (0, -1, 0)
    assert cache.find([1, 2, 3], namespace="lora-a") == (3, 1, 0)
    cache.insert([1, 2], 2, 5, namespace="lora-b")
    assert cache.find([1, 2, 3], namespace="lora-b") == (2, 2, 5)
    assert cache.find([1, 2, 3], namespace="lora-a") == (3, 1, 0)  # untouched by the other namespace
    assert cache.pin([1, 2, 3], namespace="lora-b") is False
    assert cache.pin([1, 2, 3], namespace="lora-a") is True
    with pytest.raises(InvalidArgument):
        cache.release([1, 2, 3], namespace="lora-b")

    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(8)
    alloc, kv, _, prefix_len, _ = cache.acquire_slot(alloc, kv, [1, 2, 3], namespace="other")
    assert prefix_len == 0
    cache.check_invariants()


def test_reset_refuses_while_pinned():
    cache = SlotPrefixCacheManager(enable_events=True)
    cache.insert([1, 2, 3], 1, 0)
    cache.insert([4], 2, 0, namespace="b")
    assert cache.pin([1, 2])
    with pytest.raises(CacheLocked) as raised:
        cache.reset()
    assert raised.value.protected_tokens == 2
    assert cache.find([1, 2, 3]) == (3, 1, 0) and cache.stats().num_nodes == 3  # nothing changed
    assert cache.release([1, 2])
    cache.take_events()
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.find([1, 2, 3]) == (0, -1, 0) and cache.find([4], namespace="b") == (0, -1, 0)
    assert cache.stats().num_nodes == 0
    cache.check_invariants()


def test_events():
    cache = SlotPrefixCacheManager(max_capacity=3, enable_events=True)
    cache.insert([1, 2, 3], 1, 0, namespace="n")
    cache.insert([1, 2, 3], 1, 0, namespace="n")  # nothing new
    cache.insert([1, 2, 4], 2, 0, namespace="n")  # split [1, 2] / [3], new [4]; [1, 2] now names 2
    cache.insert([5], 3, 0, namespace="n")  # 4 nodes: the LRU leaf [1, 2, 3] goes
    got = [(type(e), e.namespace, tuple(e.tokens), e.block_ids) for e in cache.take_events()]
    assert got == [
        (BlockStored, "n", (1, 2, 3), (1,)),
        (BlockStored, "n", (1, 2), (2,)),  # the upper half of the split, now naming slot 2
        (BlockStored, "n", (1, 2, 4), (2,)),
        (BlockStored, "n", (5,), (3,)),
        (BlockRemoved, "n", (1, 2, 3), (1,)),
    ]
    assert cache.take_events() == []
    quiet = SlotPrefixCacheManager()
    quiet.insert([1], 1, 0)
    assert quiet.take_events() == []


def test_metrics():
    cache = SlotPrefixCacheManager(max_capacity=2)
    s = cache.stats()
    assert (s.query_tokens, s.hit_tokens, s.hit_rate, s.num_nodes) == (0, 0, 0.0, 0)
    cache.insert([1, 2, 3, 4], 1, 0)
    cache.find([1, 2, 9, 9])  # 2 of 4
    cache.find([7, 7, 7, 7])  # 0 of 4
    s = cache.stats()
    assert (s.query_tokens, s.hit_tokens, s.hit_rate) == (8, 2, 0.25)
    cache.insert([1, 2, 5], 2, 0)  # 3 nodes > 2: one eviction
    cache.pin([1, 2, 5])
    s = cache.stats()
    assert (s.num_nodes, s.cached_nodes, s.protected_nodes, s.evictions) == (2, 2, 2, 1)

    alloc = SlotAllocator.create(SLOTS)
    kv = random_kv(9)
    alloc, kv, *_ = cache.acquire_slot(alloc, kv, [1, 2, 5, 6])  # slot 2 free, version 0: direct, 3 hits
    s = cache.stats()
    assert (s.query_tokens, s.hit_tokens, s.hit_rate, s.direct_reuses) == (12, 5, 5 / 12, 1)


def test_invalid_arguments():
    cache = SlotPrefixCacheManager()
    with pytest.raises(InvalidArgument):
        cache.insert([1], 0, 0)  # the null slot
    with pytest.raises(InvalidArgument):
        cache.insert([1], -1, 0)
    with pytest.raises(InvalidArgument):
        cache.insert([1], 1, -1)
    with pytest.raises(InvalidArgument):
        cache.insert([1], 1.5, 0)
    with pytest.raises(InvalidArgument):
        cache.insert([1], 1, 2**31)
    with pytest.raises(InvalidArgument):
        SlotPrefixCacheManager(max_capacity=0)
    assert cache.stats().num_nodes == 0
    alloc = SlotAllocator.create(SLOTS)
    bad_kv = (jnp.zeros((SLOTS + 1, MAX_LEN) + ROW),)
    with pytest.raises(InvalidArgument):
        cache.acquire_slot(alloc, bad_kv, [1])
    cache.insert(list(range(MAX_LEN + 2)), 1, 0)
    kv = random_kv(10)
    with pytest.raises(InvalidArgument):  # refused before the cache is donated
        cache.acquire_slot(alloc, kv, list(range(MAX_LEN + 2)))
    assert np.asarray(kv[0]).shape == (SLOTS, MAX_LEN) + ROW
    with pytest.raises(InvalidArgument):
        cache.copy_kv([1], 0, kv, alloc)
    with pytest.raises(InvalidArgument):
        cache.copy_kv(list(range(MAX_LEN + 2)), 2, kv, alloc)
    assert np.asarray(kv[1]).shape == (SLOTS, MAX_LEN) + ROW  # still usable: nothing was donated


# ---------------------------------------------------------------------- models


class PrefixModel:
    """The seed's uncompressed tree: one entry per cached prefix,
    ``(namespace, tokens) -> (slot, version)``, or None once forgotten."""

    def __init__(self):
        self.values: dict = {}

    def insert(self, ns, tokens, slot, ver):
        for i in range(1, len(tokens) + 1):
            self.values[(ns, tokens[:i])] = (slot, ver)

    def find(self, ns, tokens):
        for i in range(len(tokens), 0, -1):
            value = self.values.get((ns, tokens[:i]))
            if value is not None:
                return (i,) + value
        return 0, -1, 0

    def forget(self, slot, ver=None, keep_len=0):
        for key, value in self.values.items():
            if value is not None and value[0] == slot and ver in (None, value[1]) and len(key[1]) > keep_len:
                self.values[key] = None

    def structural(self, ns, tokens, pins) -> bool:
        """Whether the tree still holds ``tokens``' path: some cached prefix or
        pinned sequence extends it."""
        n = len(tokens)
        return any(k[0] == ns and k[1][:n] == tokens and v is not None for k, v in self.values.items()) or any(
            k[0] == ns and k[1][:n] == tokens and count for k, count in pins.items()
        )


NAMESPACES = st.sampled_from([None, "b"])
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=6).map(tuple)


def tree_facts(cache: SlotPrefixCacheManager) -> dict:
    return {
        (node.namespace, tuple(node.path_tokens().tolist())): node.value[0]
        for node in cache.tree.nodes()
        if node.value is not None
    }


class TreeMachine(RuleBasedStateMachine):
    """The tree alone (no eviction) against the two naive models; the event
    stream replayed must always equal the tree's contents."""

    def __init__(self):
        super().__init__()
        self.cache = SlotPrefixCacheManager(max_capacity=10**6, enable_events=True)
        self.sequences: list = []  # (ns, tokens, slot, version), in insertion order
        self.model = PrefixModel()
        self.pins: dict = {}
        self.forgot = False
        self.replayed: dict = {}

    @rule(ns=NAMESPACES, tokens=TOKENS, slot=st.integers(1, 4), ver=st.integers(0, 3))
    def insert(self, ns, tokens, slot, ver):
        self.cache.insert(list(tokens), slot, ver, namespace=ns)
        if tokens:
            self.sequences.append((ns, tokens, slot, ver))
            self.model.insert(ns, tokens, slot, ver)

    @rule(ns=NAMESPACES, tokens=TOKENS, data=st.data())
    def find(self, ns, tokens, data):
        if self.sequences and data.draw(st.booleans()):
            ns, cached, *_ = data.draw(st.sampled_from(self.sequences))
            tokens = cached[: data.draw(st.integers(0, len(cached)))] + tokens
        got = self.cache.find(tokens, namespace=ns)
        assert got == self.model.find(ns, tokens), (got, self.model.find(ns, tokens))
        if not self.forgot:
            best = max((lcp(t, tokens) for n, t, _, _ in self.sequences if n == ns), default=0)
            assert got[0] == best

    @rule(slot=st.integers(1, 4), ver=st.none() | st.integers(0, 3), keep=st.integers(0, 6))
    def forget(self, slot, ver, keep):
        self.cache.forget(slot, ver, keep_len=keep)
        self.model.forget(slot, ver, keep)
        self.forgot = True

    @rule(data=st.data())
    def pin(self, data):
        if self.sequences and data.draw(st.booleans()):
            ns, tokens, *_ = data.draw(st.sampled_from(self.sequences))
            tokens = tokens[: data.draw(st.integers(0, len(tokens)))]
        else:
            ns, tokens = data.draw(NAMESPACES), data.draw(TOKENS)
        expected = bool(tokens) and self.model.structural(ns, tokens, self.pins)
        assert self.cache.pin(tokens, namespace=ns) is expected
        if expected:
            self.pins[(ns, tokens)] = self.pins.get((ns, tokens), 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def release(self, data):
        key = data.draw(st.sampled_from(sorted((k for k, c in self.pins.items() if c), key=repr)))
        assert self.cache.release(key[1], namespace=key[0]) is True
        self.pins[key] -= 1

    @rule(ns=NAMESPACES, tokens=TOKENS)
    def release_unpinned(self, ns, tokens):
        if self.pins.get((ns, tokens)):
            return
        if tokens:
            with pytest.raises(InvalidArgument):
                self.cache.release(tokens, namespace=ns)
        else:
            assert self.cache.release(tokens, namespace=ns) is False

    @rule()
    def reset(self):
        if any(self.pins.values()):
            with pytest.raises(CacheLocked):
                self.cache.reset()
            return
        self.cache.reset()
        self.sequences.clear()
        self.model = PrefixModel()
        self.forgot = False

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        for stored in self.cache.take_events():
            if isinstance(stored, AllBlocksCleared):
                self.replayed.clear()
                continue
            key = (stored.namespace, tuple(stored.tokens.tolist()))
            if isinstance(stored, BlockStored):
                assert key not in self.replayed, key
                self.replayed[key] = stored.block_ids[0]
            else:
                assert isinstance(stored, BlockRemoved)
                assert self.replayed.pop(key) == stored.block_ids[0], key
        assert self.replayed == tree_facts(self.cache)
        assert self.cache.stats().protected_nodes == sum(node.lock > 0 for node in self.cache.tree.nodes())


TestTreeMachine = TreeMachine.TestCase


def position_kv(ns, prefix: tuple) -> tuple:
    """The K and V a model would compute at position ``len(prefix) - 1``: a
    function of the namespace and the whole prefix up to there."""
    rng = np.random.default_rng(zlib.crc32(repr((ns, prefix)).encode()))
    return rng.standard_normal(ROW), rng.standard_normal(ROW)


def expected_rows(ns, tokens: tuple, stop: int) -> list:
    rows = [np.zeros((MAX_LEN,) + ROW, np.float32) for _ in range(2)]
    for i in range(stop):
        k, v = position_kv(ns, tokens[: i + 1])
        rows[0][i], rows[1][i] = k, v
    return rows


class LifecycleMachine(RuleBasedStateMachine):
    """Requests on a real cache: acquire (find + claim), compute the rest,
    insert, finish; plus unrelated owners that take a slot, scribble over it
    and free it. Checked against ``PrefixModel`` plus a model of the
    allocator, and every reused prefix must read back the K/V of its tokens."""

    @initialize()
    def start(self):
        self.cache = SlotPrefixCacheManager(max_capacity=10**6)
        self.alloc = SlotAllocator.create(SLOTS)
        self.kv = random_kv(11)
        self.mirror = host(self.kv)
        self.model = PrefixModel()
        self.free = set(range(1, SLOTS))
        self.versions = [0] * SLOTS
        self.running: dict = {}
        self.seen: list = []  # (ns, tokens) of every request so far

    def _alloc_model(self) -> int:
        slot = min(self.free)
        self.free.remove(slot)
        self.versions[slot] += 1
        return slot

    @rule(ns=NAMESPACES, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple), data=st.data())
    def request(self, ns, tokens, data):
        if self.seen and data.draw(st.booleans()):  # share a prefix with an earlier request
            ns, earlier = data.draw(st.sampled_from(self.seen))
            tokens = (earlier[: data.draw(st.integers(1, len(earlier)))] + tokens)[:6]
        self.seen.append((ns, tokens))
        p, src, ver = self.model.find(ns, tokens)
        current = p > 0 and self.versions[src] == ver
        if current and src in self.free:
            expected = (src, p, True)
            self.free.remove(src)
            self.model.forget(src, ver, p)
        elif not self.free:
            expected = (-1, 0, False)
        else:
            target = self._alloc_model()
            for leaf in self.mirror:
                if current:
                    leaf[target, :p] = leaf[src, :p]
            if p and not current:
                self.model.forget(src, ver)
            self.model.forget(target)
            expected = (target, p if current else 0, False)

        self.alloc, self.kv, *got = self.cache.acquire_slot(self.alloc, self.kv, tokens, namespace=ns)
        assert tuple(got) == expected, (got, expected)
        event("acquire: " + ("oom" if got[0] < 0 else "direct" if got[2] else "copy" if got[1] else "stale" if p else "miss"))
        for leaf, mirrored in zip(host(self.kv), self.mirror):
            np.testing.assert_array_equal(leaf, mirrored)
        np.testing.assert_array_equal(np.asarray(self.alloc.versions), self.versions)
        target, reused, _ = got
        if target < 0:
            return
        truth = expected_rows(ns, tokens, len(tokens))
        for leaf, rows in zip(self.mirror, truth):  # the reused part is this request's K/V
            np.testing.assert_array_equal(leaf[target, :reused], rows[:reused])
        self.kv = write_rows(self.kv, target, reused, len(tokens), truth)  # "prefill" the rest
        for leaf, rows in zip(self.mirror, truth):
            leaf[target, reused : len(tokens)] = rows[reused : len(tokens)]
        self.cache.insert(tokens, target, self.versions[target], namespace=ns)
        self.model.insert(ns, tokens, target, self.versions[target])
        self.running[target] = tokens

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        slot = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[slot]
        self.alloc = self.alloc.free_or_raise(slot)
        self.free.add(slot)

    @precondition(lambda self: self.free)
    @rule(value=st.floats(-4, 4, width=32))
    def unrelated_owner(self, value):
        self.alloc, slot = self.alloc.alloc_or_raise()
        assert slot == self._alloc_model()
        rows = [np.full((MAX_LEN,) + ROW, value, np.float32)] * 2
        self.kv = write_rows(self.kv, slot, 0, MAX_LEN, rows)
        for leaf in self.mirror:
            leaf[slot] = value
        self.alloc = self.alloc.free_or_raise(slot)
        self.free.add(slot)

    @rule(ns=NAMESPACES, tokens=st.lists(st.integers(0, 2), max_size=6).map(tuple))
    def find(self, ns, tokens):
        assert self.cache.find(tokens, namespace=ns) == self.model.find(ns, tokens)

    @invariant()
    def consistent(self):
        self.cache.check_invariants()


TestLifecycleMachine = LifecycleMachine.TestCase
