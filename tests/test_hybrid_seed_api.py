"""KVCacheManager's seed-004 calls and the handle write-back rule.

* ``allocate_block(layer, slot)`` (per-layer allocation on demand) and its
  host path, against the allocator's documented pop order and by-hand table
  contents;
* ``LayerCacheHandle.num_query_heads`` / ``head_dim`` per kind;
* partial block-budget overrides (one group given, the others computed);
* handles: every store is shared by the layers of its kind (DeepSeek-V4's:
  of its store class), so handles of a store are written back one at a
  time, and a stale one is refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.errors import InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind, HybridConfig, LayerSpec
from kernels_pallas import EntryFormat
from kernels_pallas.formats import CompressedEntries
from tests.util import assert_tree_equal

TINY = EntryFormat("tiny", nope_dim=64, rope_dim=16, group_size=32, scale_kind="ue8m0")
CONFIG = HybridConfig(entry_format=TINY, window=8, index_head_dim=16, index_topk=3, num_kv_heads=2,
                      kv_head_dim=16, page_size=4, linear_num_k_heads=1, linear_num_v_heads=2,
                      linear_head_k_dim=8, linear_head_v_dim=8, linear_dtype=jnp.float32, kv_dtype=jnp.float32)
# SWA, CSA (ratio 4: 32 entries per 128-token block), HCA (ratio 32: 4 per block), full, linear.
MIXED = [LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.CSA, 4), LayerSpec(2, AttentionKind.HCA, 32),
         LayerSpec(3, AttentionKind.FULL), LayerSpec(4, AttentionKind.LINEAR)]
CONTEXT = 256  # csa4 and hca32 blocks hold 128 tokens: tables 2 blocks wide; full pages of 4: 64 wide


def _manager(**kwargs):
    kwargs.setdefault("num_blocks", {"csa4": 4, "hca32": 4, "full": 80})
    return KVCacheManager.create(CONFIG, MIXED, 3, max_context_tokens=CONTEXT, **kwargs)


_allocate = jax.jit(KVCacheManager.allocate_block, static_argnames=("layer",))


# --------------------------------------------------------------------------
# allocate_block
# --------------------------------------------------------------------------


def test_allocate_block_appends_the_next_free_block_to_the_group_table():
    """A fresh allocator hands out 1, 2, 3, ... (BlockAllocator.create); each
    call appends one block to the slot's table in the layer's group and
    touches no other group. A later ``reserve`` counts those blocks."""
    manager, (slot,) = _manager().admit_or_raise(1)
    before = {n: int(g.allocator.num_free) for n, g in manager.groups.items()}
    manager, block, ok = _allocate(manager, layer=1, slot=jnp.int32(slot))
    assert bool(ok) and int(block) == 1
    manager, block, ok = _allocate(manager, layer=1, slot=jnp.int32(slot))
    assert bool(ok) and int(block) == 2
    csa = manager.groups["csa4"]
    assert np.asarray(csa.tables)[slot].tolist() == [1, 2]
    assert int(csa.lens[slot]) == 2 and int(csa.allocator.num_free) == before["csa4"] - 2
    assert {n: int(g.allocator.num_free) for n, g in manager.groups.items() if n != "csa4"} == \
        {n: v for n, v in before.items() if n != "csa4"}
    # 200 tokens need 2 csa4 blocks (entries 0..49, 32 per block): both are already held.
    manager, _ = manager.reserve_or_raise([slot], [200], max_new_tokens=200)
    assert int(manager.groups["csa4"].lens[slot]) == 2
    assert int(manager.groups["csa4"].allocator.num_free) == before["csa4"] - 2
    assert int(manager.groups["hca32"].lens[slot]) == 2  # 200 // 32 = 6 entries, 4 per block


def test_allocate_block_failures_change_nothing():
    manager, (a, b) = _manager().admit_or_raise(2)
    for bad_slot in (3, 0, -1, 99):  # free, null, padding, out of range
        after, block, ok = _allocate(manager, layer=1, slot=jnp.int32(bad_slot))
        assert not bool(ok) and int(block) == -1
        assert_tree_equal(after, manager)
    manager, _, _ = _allocate(manager, layer=2, slot=jnp.int32(a))
    manager, _, _ = _allocate(manager, layer=2, slot=jnp.int32(a))
    after, block, ok = _allocate(manager, layer=2, slot=jnp.int32(a))  # table full (2 wide), 1 block free
    assert not bool(ok) and int(block) == -1 and int(manager.groups["hca32"].allocator.num_free) == 1
    assert_tree_equal(after, manager)
    manager, block, ok = _allocate(manager, layer=2, slot=jnp.int32(b))
    assert bool(ok) and int(block) == 3
    after, block, ok = _allocate(manager, layer=2, slot=jnp.int32(b))  # room in the table, no free block
    assert not bool(ok) and int(block) == -1
    assert_tree_equal(after, manager)
    for layer in (0, 4, 5, -1):  # SWA-only and linear allocate nothing; 5 and -1 are not layers
        with pytest.raises(InvalidArgument):
            manager.allocate_block(layer, a)


def test_allocate_block_or_raise():
    manager, (a, b) = _manager().admit_or_raise(2)
    manager, block = manager.allocate_block_or_raise(3, a)  # full attention: pages of 4 tokens
    assert block == 1 and int(manager.groups["full"].tables[a, 0]) == 1
    with pytest.raises(InvalidId, match="not held"):
        manager.allocate_block_or_raise(1, 3)
    with pytest.raises(InvalidId):
        manager.allocate_block_or_raise(1, -1)
    with pytest.raises(InvalidArgument):
        manager.allocate_block_or_raise(1, 1.5)
    with pytest.raises(InvalidArgument, match="allocates no blocks"):
        manager.allocate_block_or_raise(0, a)
    manager, _ = manager.allocate_block_or_raise(2, a)
    manager, _ = manager.allocate_block_or_raise(2, a)
    with pytest.raises(InvalidArgument, match="table is full"):
        manager.allocate_block_or_raise(2, a)
    manager, _ = manager.allocate_block_or_raise(2, b)
    with pytest.raises(KVCacheOOM, match="requested 1 .*0 available"):
        manager.allocate_block_or_raise(2, b)


# --------------------------------------------------------------------------
# Handle facts
# --------------------------------------------------------------------------


def test_handle_reports_query_heads_and_head_dim_per_kind():
    config = dataclasses.replace(CONFIG, num_query_heads=8)
    manager = KVCacheManager.create(config, MIXED, 3, max_context_tokens=CONTEXT,
                                    num_blocks={"csa4": 4, "hca32": 4, "full": 80})
    manager, slots = manager.admit_or_raise(1)
    handles = [manager.acquire(layer, slots, [0]) for layer in range(len(MIXED))]
    # DeepSeek-V4 kinds: the entry (64 NoPE + 16 RoPE); full: K head dim; linear: key head dim.
    assert [h.head_dim for h in handles] == [80, 80, 80, 16, 8]
    assert [h.num_query_heads for h in handles] == [8, 8, 8, 8, 1]  # linear: its q/k heads
    unset = _manager().acquire(3, [1], [0])
    assert unset.head_dim == 16
    with pytest.raises(InvalidArgument, match="num_query_heads is not set"):
        unset.num_query_heads


# --------------------------------------------------------------------------
# Partial block budgets
# --------------------------------------------------------------------------


def test_partial_block_budget_computes_the_groups_not_given():
    """3 requests x 256 tokens: 128-token blocks -> 3 * 2 + 1 = 7 per
    compressed group; 4-token pages -> 3 * 64 + 1 = 193."""
    computed = _manager(num_blocks=None)
    assert {n: g.allocator.num_blocks for n, g in computed.groups.items()} == {"csa4": 7, "hca32": 7, "full": 193}
    partial = _manager(num_blocks={"csa4": 5})
    assert {n: g.allocator.num_blocks for n, g in partial.groups.items()} == {"csa4": 5, "hca32": 7, "full": 193}
    assert partial.layer_cache(1).entries.nope.shape[0] == 5 and partial.layer_cache(2).entries.nope.shape[0] == 7
    assert partial.full_pool.num_pages == 193
    with pytest.raises(InvalidArgument, match=r"\['hca128'\]"):
        _manager(num_blocks={"hca128": 5})
    with pytest.raises(InvalidArgument, match="at least 2 blocks"):
        _manager(num_blocks={"full": 1})


# --------------------------------------------------------------------------
# Handle write-back
# --------------------------------------------------------------------------


def _entries_roundtrip(x):
    return np.asarray(CompressedEntries.quantize(jnp.asarray(x), TINY).dequantize(), np.float32)


def test_v4_layers_of_one_class_share_a_store_one_handle_at_a_time():
    """Two SWA layers are one store class (one stacked ring): handles
    acquired and written back one at a time keep each layer's entries in
    its own row; a handle acquired before the other's update is stale and
    refused (it would undo that write)."""
    schedule = [LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.SWA)]
    manager = KVCacheManager.create(CONFIG, schedule, 2, max_context_tokens=CONTEXT)
    assert len(manager.v4_stores) == 1 and [manager.v4_store_of(i) for i in (0, 1)] == [(0, 0), (0, 1)]
    manager, slots = manager.admit_or_raise(1)
    manager, _ = manager.reserve_or_raise(slots, [1])
    rng = np.random.default_rng()
    xs = [rng.normal(size=(1, 80)).astype(np.float32) for _ in range(2)]
    stale = manager.acquire(1, slots, [0]).write_swa(jnp.asarray(xs[1]))
    m = manager
    for layer, x in enumerate(xs):
        m = m.update(m.acquire(layer, slots, [0]).write_swa(jnp.asarray(x)))
    for layer, x in enumerate(xs):
        ring = m.layer_cache(layer).swa
        got = np.asarray(ring.dequantize(), np.float32)[slots[0], 0]  # position 0 at row 0 % window
        np.testing.assert_array_equal(got, _entries_roundtrip(x)[0])
    with pytest.raises(InvalidArgument, match="stale handle of layer 1"):
        m.update(stale)


def _full_manager():
    schedule = [LayerSpec(0, AttentionKind.FULL), LayerSpec(1, AttentionKind.FULL)]
    manager = KVCacheManager.create(CONFIG, schedule, 2, max_context_tokens=16)
    manager, slots = manager.admit_or_raise(1)
    manager, _ = manager.reserve_or_raise(slots, [2])  # positions 0, 1 on page 1 (the first popped)
    return manager, slots


def _kv(rng):
    return [jnp.asarray(rng.normal(size=(2, 2, 16)), jnp.float32) for _ in range(2)]


def test_full_handles_one_at_a_time_keep_every_layer():
    manager, slots = _full_manager()
    rng = np.random.default_rng()
    written = [_kv(rng) for _ in range(2)]
    for layer, (k, v) in enumerate(written):
        h = manager.acquire(layer, slots, [0, 1], [0, 0])
        manager = manager.update(h.write_kv(k, v))
    pool = manager.full_pool
    for layer, (k, v) in enumerate(written):  # K/V [layer, heads, page, offset, dim]: page 1, offsets 0 and 1
        np.testing.assert_array_equal(np.asarray(pool.k_pages)[layer, :, 1, :2].transpose(1, 0, 2), np.asarray(k))
        np.testing.assert_array_equal(np.asarray(pool.v_pages)[layer, :, 1, :2].transpose(1, 0, 2), np.asarray(v))


def test_stale_full_handle_is_refused():
    """Two full-attention handles acquired before either update: the second
    carries the pool without the first one's writes, so writing it back
    would undo them. It is refused, eagerly and under jaxkv.checked."""
    manager, slots = _full_manager()
    rng = np.random.default_rng()
    (k0, v0), (k1, v1) = _kv(rng), _kv(rng)
    h0 = manager.acquire(0, slots, [0, 1], [0, 0]).write_kv(k0, v0)
    h1 = manager.acquire(1, slots, [0, 1], [0, 0]).write_kv(k1, v1)
    updated = manager.update(h0)
    with pytest.raises(InvalidArgument, match="stale handle of layer 1"):
        updated.update(h1)

    def both(manager, k0, v0, k1, v1):
        h0 = manager.acquire(0, slots, [0, 1], [0, 0]).write_kv(k0, v0)
        h1 = manager.acquire(1, slots, [0, 1], [0, 0]).write_kv(k1, v1)
        return manager.update(h0).update(h1)

    with pytest.raises(InvalidArgument, match="stale handle"):
        jaxkv.checked(both)(manager, k0, v0, k1, v1)
    # The rule kept: acquire after the update, and both layers survive.
    fixed = updated.update(updated.acquire(1, slots, [0, 1], [0, 0]).write_kv(k1, v1))
    for layer, k in ((0, k0), (1, k1)):
        np.testing.assert_array_equal(np.asarray(fixed.full_pool.k_pages)[layer, :, 1, :2].transpose(1, 0, 2),
                                      np.asarray(k))
