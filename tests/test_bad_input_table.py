"""Every public host entry point against every kind of bad value (issue 13).

Each row of ``ENTRY_POINTS`` names an entry point, the argument under test
and how the bad value is passed. Each of ``BAD`` must then raise a
``KVCacheError`` (or ``TypeError``); type-level errors must name the
argument; and the state must be unchanged afterwards. Kinds that are legal
for an argument (0 is a valid count, a row id, a token; repeated sources
may be forked) are listed per entry as ``legal``, and are checked to
succeed, so the table cannot silently skip a case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
    BlockAllocator,
    BlockSpaceManager,
    GDNPool,
    KVCacheManager,
    KVCacheError,
    KVPool,
    PrefixCacheManager,
    PrefixScheduler,
    ReqToTokenPool,
    SlotAllocator,
    SlotPrefixCacheManager,
    TokenToKVPoolAllocator,
)
from jaxkv.pool.host import create_host_pool

#: The kinds of bad value, as a scalar would be passed.
BAD = {
    "negative": -5,
    "null": 0,
    "out_of_range": 10**6,
    "huge": 2**40,
    "float": 1.5,
    "bool": True,
    "string": "2",
    "none": None,
    "nan": float("nan"),
    "wrong_shape": [[1, 2], [3]],
    "wrong_dtype": np.float32(2.0),
    "duplicates": [1, 1],
}
#: Kinds that are wrong in type (not in value): the error names the argument.
TYPE_KINDS = {"float", "bool", "string", "none", "nan", "wrong_dtype"}


def as_ids(kind: str):
    """The bad value placed in an id list."""
    value = BAD[kind]
    if kind == "wrong_dtype":
        return np.array([1.0, 2.0], np.float32)
    if kind in ("wrong_shape", "duplicates"):
        return value
    return [value]


def as_scalar(kind: str):
    return BAD[kind]


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # entry point, for the test id
    argument: str  # the name the error must carry for type-level kinds
    make: Callable  # () -> state (a pytree, or a host object with a snapshot)
    call: Callable  # (state, bad value) -> anything
    place: Callable = as_ids
    legal: frozenset = frozenset()


# ---------------------------------------------------------------- states

BS = 4


def _blocks():
    return BlockAllocator.create(8).acquire_or_raise(2)[0]  # blocks 1, 2 held once


def _slots():
    return SlotAllocator.create(8).alloc_many_or_raise(2)[0]


def _free_slots():
    return SlotAllocator.create(8)


def _tokens():
    return TokenToKVPoolAllocator.create(8).alloc_or_raise(2)[0]


def _rows():
    return ReqToTokenPool.create(4, 8).alloc_or_raise(2)[0]


def _manager(rows=()):
    m = BlockSpaceManager.create(num_device_blocks=8, num_host_blocks=8, block_size=BS, max_seqs=4,
                                 max_blocks_per_seq=4, watermark=0.0)
    for row in rows:
        m = m.allocate_or_raise([row], 5)
    return m


def _pool():
    return KVPool.create(num_pages=8, page_size=BS, num_layers=2, k_heads=2, k_dim=4, dtype=jnp.float32)


def _swap_state():
    pool = _pool()
    return _manager(rows=(1,)), pool, create_host_pool(pool, 8, memory_kind="numpy")


def _cache():
    cache = PrefixCacheManager(2)
    cache.insert([1, 2, 3, 4], [5, 6])
    return cache


def _scheduler():
    return PrefixScheduler(_cache(), BlockAllocator.create(16))


def _gdn():
    """Request slots 1..2, track slots 3..4 (both held)."""
    pool = GDNPool.create(2, 2, 1, 2, 2, conv_dim=4, conv_kernel_size=2, dtype=jnp.float32, max_track_slots=2)
    pool, _ = pool.alloc_track_slot_or_raise()
    return pool.alloc_track_slot_or_raise()[0]


def _slot_cache():
    cache = SlotPrefixCacheManager(8)
    cache.insert([1, 2, 3], 2, 1)
    return cache


def _hybrid():
    """Request slots 1 and 2 held, 3 free (a DeepSeek-V4 SWA/CSA/HCA stack)."""
    from jaxkv import HybridConfig, deepseek_v4_schedule

    manager = KVCacheManager.create(HybridConfig(), deepseek_v4_schedule([0, 4, 128]), 3, max_context_tokens=256)
    return manager.admit_or_raise(2)[0]


K1 = np.ones((1, 2, 4), np.float32)


ENTRY_POINTS = [
    Entry("BlockAllocator.acquire_or_raise", "number of blocks", _blocks, lambda s, v: s.acquire_or_raise(v),
          as_scalar, frozenset({"null"})),
    Entry("BlockAllocator.release_or_raise", "ids", _blocks, lambda s, v: s.release_or_raise(v)),
    Entry("BlockAllocator.incref_or_raise", "ids", _blocks, lambda s, v: s.incref_or_raise(v),
          legal=frozenset({"duplicates"})),
    Entry("SlotAllocator.alloc_many_or_raise", "number of slots", _slots, lambda s, v: s.alloc_many_or_raise(v),
          as_scalar, frozenset({"null"})),
    Entry("SlotAllocator.free_or_raise", "ids", _slots, lambda s, v: s.free_or_raise(v)),
    Entry("SlotAllocator.occupy_or_raise", "ids", _free_slots, lambda s, v: s.occupy_or_raise(v)),
    Entry("TokenToKVPoolAllocator.alloc_or_raise", "number of tokens", _tokens, lambda s, v: s.alloc_or_raise(v),
          as_scalar, frozenset({"null"})),
    Entry("TokenToKVPoolAllocator.free_or_raise", "ids", _tokens, lambda s, v: s.free_or_raise(v)),
    Entry("ReqToTokenPool.alloc_or_raise", "number of rows", _rows, lambda s, v: s.alloc_or_raise(v),
          as_scalar, frozenset({"null"})),
    Entry("ReqToTokenPool.free_or_raise", "ids", _rows, lambda s, v: s.free_or_raise(v)),
    Entry("ReqToTokenPool.write_or_raise(row)", "row", _rows, lambda s, v: s.write_or_raise(v, 0, [5]), as_scalar),
    Entry("ReqToTokenPool.write_or_raise(start)", "start", _rows, lambda s, v: s.write_or_raise(1, v, [5]),
          as_scalar, frozenset({"null"})),
    # Values are KV indices (the table does not know the pool): 0 (padding),
    # 10**6 and repeats are legal; what int32 cannot hold is not.
    Entry("ReqToTokenPool.write_or_raise(values)", "values", _rows, lambda s, v: s.write_or_raise(1, 0, v),
          legal=frozenset({"null", "out_of_range", "duplicates"})),
    Entry("BlockSpaceManager.allocate_or_raise(seq_ids)", "seq_ids", _manager,
          lambda s, v: s.allocate_or_raise(v, 5), legal=frozenset({"null"})),
    Entry("BlockSpaceManager.allocate_or_raise(num_tokens)", "num_tokens", _manager,
          lambda s, v: s.allocate_or_raise([0], v), as_scalar),
    Entry("BlockSpaceManager.fork_or_raise(dst_ids)", "dst_ids", lambda: _manager(rows=(0,)),
          lambda s, v: s.fork_or_raise([0], v)),
    Entry("BlockSpaceManager.fork_or_raise(src_ids)", "src_ids", lambda: _manager(rows=(0,)),
          lambda s, v: s.fork_or_raise(v, [3]), legal=frozenset({"null"})),
    Entry("BlockSpaceManager.free_or_raise", "ids", lambda: _manager(rows=(0, 1)), lambda s, v: s.free_or_raise(v),
          legal=frozenset({"null"})),
    Entry("KVPool.set_kv(layer)", "layer", _pool, lambda s, v: s.set_kv(v, [5], K1, K1), as_scalar,
          frozenset({"null"})),
    Entry("KVPool.set_kv(indices)", "indices", _pool, lambda s, v: s.set_kv(0, v, K1, K1), legal=frozenset({"null"})),
    Entry("KVPool.get_kv(layer)", "layer", _pool, lambda s, v: s.get_kv(v, [5]), as_scalar, frozenset({"null"})),
    Entry("KVPool.get_kv(indices)", "indices", _pool, lambda s, v: s.get_kv(0, v),
          legal=frozenset({"null", "duplicates"})),
    Entry("KVPool.copy_pages(src)", "src_pages", _pool, lambda s, v: s.copy_pages(v, _distinct_like(v)),
          legal=frozenset({"null", "duplicates"})),
    Entry("KVPool.copy_pages(dst)", "dst_pages", _pool, lambda s, v: s.copy_pages([1] * len(np.atleast_1d(
        np.asarray(v, object))), v), legal=frozenset({"null"})),
    Entry("KVPool.read_pages", "pages", _pool, lambda s, v: s.read_pages(v), legal=frozenset({"null", "duplicates"})),
    Entry("KVPool.write_pages", "pages", _pool, lambda s, v: s.write_pages(v, s.read_pages([1] * len(np.atleast_1d(
        np.asarray(v, object))))[0]), legal=frozenset({"null"})),
    Entry("swap_out", "seq_ids", _swap_state, lambda s, v: s[0].swap_out_or_raise(*s[1:], v)),
    Entry("swap_in", "seq_ids", _swap_state, lambda s, v: s[0].swap_in_or_raise(*s[1:], v)),
    Entry("PrefixCacheManager.match", "tokens", _cache, lambda s, v: s.match(v),
          legal=frozenset({"negative", "null", "out_of_range", "duplicates"})),
    Entry("PrefixCacheManager.insert(tokens)", "tokens", _cache, lambda s, v: s.insert(v, [7, 8]),
          legal=frozenset({"negative", "null", "out_of_range", "duplicates"})),
    Entry("PrefixCacheManager.insert(blocks)", "blocks", _cache,
          lambda s, v: s.insert([9, 9, 8, 8], list(v) + [11] if isinstance(v, list) and len(v) == 1 else v),
          legal=frozenset({"out_of_range"})),
    # Asking for more than is evictable evicts what there is.
    Entry("PrefixCacheManager.evict", "num_blocks", _cache, lambda s, v: s.evict(v), as_scalar,
          frozenset({"null", "out_of_range", "huge"})),
    # None is what a disabled cache's match returns: pin/release ignore it.
    Entry("PrefixCacheManager.pin", "node", _cache, lambda s, v: s.pin(v), as_scalar, frozenset({"none"})),
    Entry("PrefixCacheManager.release", "node", _cache, lambda s, v: s.release(v), as_scalar, frozenset({"none"})),
    Entry("PrefixScheduler.admit", "tokens", _scheduler, lambda s, v: s.admit([v]),
          legal=frozenset({"negative", "null", "out_of_range", "duplicates"})),
    Entry("GDNPool.free_track_slot_or_raise", "ids", _gdn, lambda s, v: s.free_track_slot_or_raise(v)),
    Entry("GDNPool.reset_states_or_raise", "ids", _gdn, lambda s, v: s.reset_states_or_raise(v),
          legal=frozenset({"duplicates"})),
    Entry("GDNPool.copy_states_or_raise(src)", "src", _gdn, lambda s, v: s.copy_states_or_raise(v, [2])),
    Entry("GDNPool.copy_states_or_raise(dst)", "dst", _gdn, lambda s, v: s.copy_states_or_raise([1], v)),
    Entry("GDNPool.get_states(layer)", "layer", _gdn, lambda s, v: s.get_states(v, [1]), as_scalar,
          frozenset({"null"})),
    Entry("KVCacheManager.admit_or_raise", "request slots", _hybrid, lambda s, v: s.admit_or_raise(v), as_scalar,
          frozenset({"null"})),
    Entry("KVCacheManager.reserve_or_raise(slots)", "slots", _hybrid,
          lambda s, v: s.reserve_or_raise(v, [1] * len(np.atleast_1d(np.asarray(v, object))))),
    Entry("KVCacheManager.reserve_or_raise(num_new)", "num_new", _hybrid, lambda s, v: s.reserve_or_raise([1], v),
          as_scalar, frozenset({"null"})),
    Entry("KVCacheManager.release_or_raise", "slots", _hybrid, lambda s, v: s.release_or_raise(v)),
    Entry("KVCacheManager.allocate_block_or_raise", "slot", _hybrid, lambda s, v: s.allocate_block_or_raise(1, v), as_scalar),
    Entry("SlotPrefixCacheManager.find", "tokens", _slot_cache, lambda s, v: s.find(v),
          legal=frozenset({"negative", "null", "out_of_range", "duplicates"})),
    Entry("SlotPrefixCacheManager.insert(slot)", "slot", _slot_cache, lambda s, v: s.insert([4, 5], v, 1), as_scalar,
          frozenset({"out_of_range"})),
    Entry("SlotPrefixCacheManager.forget(slot)", "slot", _slot_cache, lambda s, v: s.forget(v), as_scalar,
          frozenset({"out_of_range"})),
]


def _distinct_like(value) -> list:
    """Distinct valid pages, as many as ``value`` has entries (its partner list)."""
    return list(range(3, 3 + len(np.atleast_1d(np.asarray(value, object)))))


def snapshot(state):
    """What must not change: a pytree's leaves, a host object's observable
    state (tree contents, counters, the allocator it schedules)."""
    if isinstance(state, PrefixScheduler):
        return snapshot(state.cache), jax.device_get(state.allocator), state.num_free
    if isinstance(state, PrefixCacheManager):
        state.check_invariants()
        return (sorted((n.path_tokens().tolist(), list(n.value), n.lock, n.tier) for n in state.tree.nodes()),
                state.stats(), sorted(state._owned))
    if isinstance(state, SlotPrefixCacheManager):
        state.check_invariants()
        return (sorted((n.path_tokens().tolist(), n.value, n.lock) for n in state.tree.nodes()), state.stats())
    return jax.tree_util.tree_map(np.array, jax.device_get(state))  # copies: numpy host pools change in place


def assert_same(before, after):
    if isinstance(before, tuple) and any(isinstance(b, (list, int)) for b in before):
        assert repr(before) == repr(after)
    else:
        chex.assert_trees_all_equal(before, after, strict=True)


CASES = [pytest.param(entry, kind, id=f"{entry.name}-{kind}") for entry in ENTRY_POINTS for kind in BAD]


@pytest.mark.parametrize("entry,kind", CASES)
def test_bad_input_is_refused_and_changes_nothing(entry: Entry, kind: str):
    state = entry.make()
    before = snapshot(state)
    value = entry.place(kind)
    if kind in entry.legal:
        entry.call(state, value)  # legal here: must simply work
        return
    with pytest.raises((KVCacheError, TypeError)) as info:
        entry.call(state, value)
    if kind in TYPE_KINDS:
        assert entry.argument in str(info.value), f"{info.value!r} does not name {entry.argument!r}"
    assert_same(before, snapshot(state))
