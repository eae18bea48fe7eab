"""Swap to host and back: bit-exact data, conserved ref counts, admission, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.manager.block_space import ALLOC_LATER, ALLOC_NEVER, ALLOC_OK, ON_DEVICE, SWAPPED, BlockSpaceManager
from jaxkv.pool import KVPool
from jaxkv.pool import host

BS, LAYERS = 4, 2
APPEND = jax.jit(BlockSpaceManager.append_slots, static_argnames=("num_new_tokens",))


def _setup(dtype, device_blocks=16, host_blocks=10, memory_kind="auto"):
    manager = BlockSpaceManager.create(num_device_blocks=device_blocks, num_host_blocks=host_blocks, block_size=BS,
                                       max_seqs=6, max_blocks_per_seq=5, watermark=0.0)
    pool = KVPool.create(num_pages=device_blocks, page_size=BS, num_layers=LAYERS, k_heads=2, k_dim=4,
                         v_heads=1, v_dim=8, dtype=dtype)
    return manager, pool, host.create_host_pool(pool, host_blocks, memory_kind=memory_kind)


def _fill(manager, pool, seqs, rng):
    """Random K/V (never zero) at every position of each sequence, all layers."""
    for seq in seqs:
        n = int(manager.seq_lens[seq])
        slots = manager.token_slots(jnp.array([seq]), jnp.arange(n)[None])[0]
        for layer in range(LAYERS):
            pool = pool.set_kv(layer, slots, rng.normal(size=(n, 2, 4)) + 3.0, rng.uniform(1, 5, size=(n, 1, 8)))
    return pool


def _contents(manager, pool, seq):
    """K/V (raw stored values and scales, not dequantized) of every position."""
    n = int(manager.seq_lens[seq])
    slots = np.asarray(manager.token_slots(jnp.array([seq]), jnp.arange(n)[None])[0])
    page, offset = slots // BS, slots % BS
    return [np.asarray(leaf[:, :, page, offset].astype(jnp.float32)) for leaf in jax.tree_util.tree_leaves(pool)]


def _conserved(manager):
    """Every block's ref count equals its references from rows in the matching state."""
    tables, status = np.asarray(manager.block_tables), np.asarray(manager.status)
    for allocator, state in ((manager.device, ON_DEVICE), (manager.host, SWAPPED)):
        refs = np.zeros(allocator.num_blocks, np.int64)
        for row in np.flatnonzero(status == state):
            live = tables[row][tables[row] >= 0]
            np.add.at(refs, live, 1)
        np.testing.assert_array_equal(np.asarray(allocator.ref_counts), refs)
        assert int(allocator.num_free) == allocator.capacity - int((refs[1:] > 0).sum())


@pytest.mark.parametrize("memory_kind", ["numpy", "pinned_host"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_group_round_trip_is_bit_exact_and_keeps_sharing(dtype, memory_kind):
    rng = np.random.default_rng()
    manager, pool, host_pool = _setup(dtype, memory_kind=memory_kind)
    assert host.is_pinned(host_pool) == (memory_kind == "pinned_host")
    prompt = int(rng.integers(5, 12))
    manager, ok = manager.allocate(jnp.array([0]), prompt)
    manager, ok2 = manager.fork(jnp.array([0, 0]), jnp.array([1, 2]))
    manager, pool, _, _, ok3 = APPEND(manager, pool, jnp.array([0, 1, 2, -1]), num_new_tokens=3)
    manager, ok4 = manager.allocate(jnp.array([3]), 6)  # another sequence stays on device
    assert bool(ok & ok2 & ok3 & ok4)
    pool = _fill(manager, pool, [0, 1, 2, 3], rng)
    before = {s: _contents(manager, pool, s) for s in range(4)}
    _conserved(manager)

    out, host_pool = manager.swap_out_or_raise(pool, host_pool, [0, 1, 2])
    if memory_kind == "pinned_host":  # the pages really live in pinned host memory
        assert {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(host_pool)} == {"pinned_host"}
    _conserved(out)
    assert np.asarray(out.status[:4]).tolist() == [SWAPPED] * 3 + [ON_DEVICE]
    # The shared prompt blocks are one host block each, owned by all three.
    shared = np.asarray(out.block_tables[0, : prompt // BS])
    assert (np.asarray(out.host.ref_counts)[shared] == 3).all()

    # Reuse the freed device blocks for someone else before swapping back.
    out, ok = out.allocate(jnp.array([4]), 4 * BS)
    pool = _fill(out, pool, [4], rng)
    back, pool = out.swap_in_or_raise(pool, host_pool, [0, 1, 2])
    _conserved(back)
    for seq in range(4):
        for a, b in zip(before[seq], _contents(back, pool, seq)):
            np.testing.assert_array_equal(a, b)


def test_block_shared_outside_the_group_stays_on_device():
    rng = np.random.default_rng()
    manager, pool, host_pool = _setup(jnp.float32)
    manager, _ = manager.allocate(jnp.array([0]), 9)
    manager, _ = manager.fork(jnp.array([0]), jnp.array([1]))
    pool = _fill(manager, pool, [0], rng)
    out, host_pool = manager.swap_out_or_raise(pool, host_pool, [1])
    _conserved(out)
    # Row 0 still holds its blocks on device, each now with one owner.
    np.testing.assert_array_equal(np.asarray(out.device.ref_count(out.block_tables[0, :3])), [1, 1, 1])
    back, pool = out.swap_in_or_raise(pool, host_pool, [1])
    _conserved(back)
    for a, b in zip(_contents(manager, pool, 0), _contents(back, pool, 1)):
        np.testing.assert_array_equal(a, b)


def test_free_of_a_swapped_sequence_returns_host_blocks():
    manager, pool, host_pool = _setup(jnp.float32)
    manager, _ = manager.allocate(jnp.array([2]), 10)
    manager, host_pool = manager.swap_out_or_raise(pool, host_pool, [2])
    assert int(manager.host.num_free) == manager.host.capacity - 3
    manager, ok = manager.free(jnp.array([2]))
    assert bool(ok) and int(manager.host.num_free) == manager.host.capacity
    assert int(manager.device.num_free) == manager.device.capacity
    _conserved(manager)


def test_host_pool_memory_kinds():
    pool = KVPool.create(num_pages=4, page_size=2, num_layers=1, k_heads=1, k_dim=2)
    assert not host.is_pinned(host.create_host_pool(pool, 3, memory_kind="numpy"))
    with pytest.raises(jaxkv.InvalidArgument, match="memory_kind='disk'"):
        host.create_host_pool(pool, 3, memory_kind="disk")


def test_admission_answers_and_errors_leave_state_unchanged():
    manager, pool, host_pool = _setup(jnp.float32, device_blocks=8, host_blocks=4)  # 3 usable host blocks
    manager, _ = manager.allocate(jnp.array([0]), 12)  # 3 blocks
    manager, _ = manager.allocate(jnp.array([1]), 13)  # 4 blocks: device now full
    assert bool(manager.can_swap_out(jnp.array([0])))
    assert not bool(manager.can_swap_out(jnp.array([1])))
    with pytest.raises(jaxkv.KVCacheOOM, match=r"requested 4 host blocks, 3 available \(of 3 total\)") as info:
        manager.swap_out_or_raise(pool, host_pool, [1])
    assert (info.value.requested, info.value.available) == (4, 3)
    with pytest.raises(jaxkv.InvalidId, match="swap in: sequence 0 is ON_DEVICE, not SWAPPED"):
        manager.swap_in_or_raise(pool, host_pool, [0])
    with pytest.raises(jaxkv.InvalidId, match="swap out: sequence 5 is FREE"):
        manager.swap_out_or_raise(pool, host_pool, [5])
    before = manager
    state, _, _, ok = BlockSpaceManager.swap_out(manager, jnp.array([1, -1]))
    assert not bool(ok)
    chex.assert_trees_all_equal(before, state, strict=True)

    out, host_pool2 = manager.swap_out_or_raise(pool, host.create_host_pool(pool, 6), [0])
    assert int(out.can_swap_in(jnp.array([0]))) == ALLOC_OK
    out, _ = out.allocate(jnp.array([2]), 9)  # takes the 3 freed blocks
    assert int(out.can_swap_in(jnp.array([0]))) == ALLOC_LATER
    big = BlockSpaceManager.create(num_device_blocks=4, num_host_blocks=8, block_size=BS, max_seqs=2,
                                   max_blocks_per_seq=6)
    assert int(big.can_allocate(5 * BS)) == ALLOC_NEVER
