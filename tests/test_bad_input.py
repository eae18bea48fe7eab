"""The 16 defects an independent fuzzer found on the host paths (issue 13),
one test each, written to fail before its fix. The table of every public
host entry point against every kind of bad value is in
``test_bad_input_table.py``."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
    BlockAllocator,
    BlockSpaceManager,
    CacheLocked,
    DoubleFree,
    InvalidArgument,
    InvalidId,
    KVCacheError,
    KVCacheOOM,
    KVPool,
    PrefixCacheManager,
    PrefixScheduler,
    ReqToTokenPool,
    SlotAllocator,
    TokenToKVPoolAllocator,
)
from jaxkv.manager.block_space import ALLOC_NEVER
from jaxkv.pool.host import create_host_pool

BS = 4


def _manager(num_device_blocks=8, num_host_blocks=4, max_seqs=4, max_blocks=4):
    return BlockSpaceManager.create(num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                                    block_size=BS, max_seqs=max_seqs, max_blocks_per_seq=max_blocks, watermark=0.0)


def _pool(num_pages=8, dtype=jnp.float32, layers=2):
    return KVPool.create(num_pages=num_pages, page_size=BS, num_layers=layers, k_heads=2, k_dim=4, dtype=dtype)


def _filled(pool: KVPool, rng) -> KVPool:
    """Every page of every layer holds fresh random K/V (never zeros)."""
    rows = np.arange(pool.buffer_size, dtype=np.int32)
    shape = (rows.size, pool.k_heads, pool.k_dim)
    for layer in range(pool.num_layers):
        k = rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape)
        pool = pool.set_kv(layer, rows, k, rng.uniform(0.5, 2.0, shape))
    return pool


# ------------------------------------------------- 1. swap to a small host pool


def test_1_swap_checks_host_pool_size_and_never_drops_a_page():
    rng = np.random.default_rng()
    pool = _filled(_pool(), rng)
    # One host block means no host tier (block 0 is the null block): the swap
    # is refused as out of memory instead of writing past a one-page pool.
    m = _manager(num_host_blocks=1).allocate_or_raise([0], 6)
    with pytest.raises(KVCacheOOM, match="0 available"):
        m.swap_out_or_raise(pool, create_host_pool(pool, 1, memory_kind="numpy"), [0])
    # A host pool smaller than the manager's host allocator is refused before
    # anything moves, naming both sizes.
    m = _manager(num_host_blocks=4).allocate_or_raise([0], 6)
    small = create_host_pool(pool, 2, memory_kind="numpy")
    with pytest.raises(InvalidArgument, match="host_pool has 2 pages .* num_pages >= 4"):
        m.swap_out_or_raise(pool, small, [0])
    # The matching size round-trips every byte.
    host = create_host_pool(pool, 4, memory_kind="numpy")
    table = np.asarray(m.block_tables[0, :2])
    before = pool.get_kv(1, (table[:, None] * BS + np.arange(BS)).reshape(-1))
    m2, host = m.swap_out_or_raise(pool, host, [0])
    wiped = _pool()
    m3, wiped = m2.swap_in_or_raise(wiped, host, [0])
    table = np.asarray(m3.block_tables[0, :2])
    after = wiped.get_kv(1, (table[:, None] * BS + np.arange(BS)).reshape(-1))
    np.testing.assert_array_equal(np.asarray(after[0]), np.asarray(before[0]))


def test_1_page_copies_refuse_pages_outside_either_pool():
    from jaxkv.pool.host import swap_in_pages, swap_out_pages

    pool = _pool()
    host = create_host_pool(pool, 2, memory_kind="numpy")
    snapshot = jax.device_get(host)
    with pytest.raises(InvalidId, match=r"target pages \[3\] outside"):
        swap_out_pages(pool, host, [1, 2], [1, 3])
    chex.assert_trees_all_equal(snapshot, host, strict=True)
    with pytest.raises(InvalidId, match=r"source pages \[5\] outside"):
        swap_in_pages(pool, host, [5], [1])
    with pytest.raises(InvalidArgument, match="more than once"):
        swap_out_pages(pool, host, [1, 2], [1, 1])


# ------------------------------------------ 2-4, 14, 16: the prefix tree


def _tree_state(cache: PrefixCacheManager):
    cache.check_invariants()
    return (sorted(cache.device_blocks()), cache.stats(), cache.host_free_pages,
            sorted((n.path_tokens().tolist(), n.lock, n.tier) for n in cache.tree.nodes()))


@pytest.mark.parametrize("count", [2.0, np.float64(1), True, "2", None, float("nan"), -1, [1]])
def test_2_evict_validates_its_count_before_touching_the_tree(count):
    cache = PrefixCacheManager(2)
    cache.insert([1, 2, 3, 4], [5, 6])
    before = _tree_state(cache)
    with pytest.raises(InvalidArgument, match="num_blocks"):
        cache.evict(count)
    assert _tree_state(cache) == before
    assert sorted(cache.evict(100).blocks) == [5, 6]  # still all there, LRU queue intact
    assert cache.evictable_blocks == 0


def test_3_insert_refuses_blocks_the_tree_owns_repeats_and_non_integers():
    cache = PrefixCacheManager(2)
    cache.insert([1, 2], [5])
    before = _tree_state(cache)
    for blocks, message in (([5], "already owns"), ([7, 7], "more than one page"), ([7.5], "blocks must be integers"),
                            ([True], "blocks must be integers"), (["7"], "blocks must be integers"), ([0], "null block"),
                            ([2**31], r"block ids are in \[1, 2\*\*31\)"), ([2**70], r"block ids are in \[1, 2\*\*31\)"),
                            ((7.0,), "blocks must be integers"), ([[7]], "dimension")):
        with pytest.raises(InvalidArgument, match=message):
            cache.insert([8, 8, 9, 9][: 2 * len(blocks)], blocks)
        assert _tree_state(cache) == before
    # The same pages with the tree's own block: a re-insert, not a second owner.
    result = cache.insert([1, 2, 3, 4], [5, 9])
    assert (result.new_blocks, result.duplicates) == ([9], [])
    assert sorted(cache.evict(10).blocks) == [5, 9]  # each exactly once


def test_4_pin_and_release_refuse_foreign_and_evicted_nodes():
    cache, other = PrefixCacheManager(2), PrefixCacheManager(2)
    node = other.insert([1, 2], [5]).node
    before = _tree_state(cache)
    with pytest.raises(InvalidArgument, match="another PrefixCacheManager"):
        cache.pin(node)
    with pytest.raises(InvalidArgument, match="not a node of this cache"):
        cache.release(node)
    assert _tree_state(cache) == before
    with pytest.raises(InvalidArgument, match="takes a Node"):
        cache.pin("node")
    mine = cache.insert([1, 2], [5]).node
    cache.evict(1)
    with pytest.raises(InvalidArgument, match="evicted"):
        cache.pin(mine)
    with pytest.raises(InvalidArgument, match="evicted"):
        cache.release(mine)


def test_14_evict_lists_each_host_page_once_when_the_host_tier_fills():
    cache = PrefixCacheManager(1, host_pages=2)
    cache.insert([1, 2], [11, 12])
    cache.insert([3, 4], [13, 14])  # two leaves of two pages; the host holds two pages
    evicted = cache.evict(4)
    assert sorted(evicted.blocks) == [11, 12, 13, 14]
    assert len(set(evicted.offload_to)) == len(evicted.offload_to)
    # What is copied is exactly what the host tier holds now.
    held = {page: None for node in cache.tree.nodes() if node.tier == 1 for page in node.value}
    assert sorted(evicted.offload_to) == sorted(held)
    pairs = dict(zip(evicted.offload_to, evicted.offload_from))
    for node in cache.tree.nodes():
        if node.tier == 1:
            assert [pairs[p] for p in node.value] == {(3, 4): [13, 14], (1, 2): [11, 12]}[
                tuple(node.path_tokens().tolist())]
    cache.check_invariants()


def test_16_scheduler_reset_refuses_while_requests_run_and_finish_refuses_twice():
    cache = PrefixCacheManager(2)
    sched = PrefixScheduler(cache, BlockAllocator.create(16))
    [adm] = sched.admit([[1, 2, 3]])  # nothing cached: no pin, still running
    with pytest.raises(CacheLocked, match="1 requests are running"):
        sched.reset()
    sched.finish([adm])
    with pytest.raises(InvalidArgument, match="not running"):
        sched.finish([adm])
    sched.reset()
    sched.check_mirror()


def test_16_namespaces_false_and_zero_are_apart():
    cache = PrefixCacheManager(2)
    cache.insert([1, 2], [5], namespace=0)
    assert cache.match([1, 2, 3], namespace=False).num_tokens == 0
    assert cache.match([1, 2, 3], namespace=np.int64(0)).num_tokens == 2  # same value, same namespace


def test_16_nested_token_lists_are_refused_like_2d_arrays():
    cache = PrefixCacheManager(2)
    for tokens in ([[1, 2], [3, 4]], np.array([[1, 2], [3, 4]])):
        with pytest.raises(InvalidArgument, match="1 dimension"):
            cache.match(tokens)


# ---------------------------------------------------------- 5. KVPool pages


def test_5_page_copies_validate_ids_on_host_and_report_ok_when_traced():
    rng = np.random.default_rng()
    pool = _filled(_pool(), rng)
    snapshot = jax.device_get(pool)
    for call in (lambda: pool.copy_pages([1], [-2]), lambda: pool.copy_pages([100], [3]),
                 lambda: pool.read_pages([8]), lambda: pool.write_pages([-3], pool.read_pages([1])[0])):
        with pytest.raises(InvalidId, match="outside"):
            call()
    with pytest.raises(InvalidArgument, match="more than once"):
        pool.copy_pages([1, 2], [3, 3])
    copy = jax.jit(KVPool.copy_pages)
    out, ok = copy(pool, jnp.array([1, 100]), jnp.array([3, 4]))
    assert not bool(ok)
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.k_pages[:, :, 3], snapshot.k_pages[:, :, 1])  # the good pair is copied
    np.testing.assert_array_equal(out.k_pages[:, :, 4], snapshot.k_pages[:, :, 4])  # the bad pair is skipped
    out, ok = copy(pool, jnp.array([1]), jnp.array([-2]))
    assert not bool(ok)
    chex.assert_trees_all_equal(snapshot, out, strict=True)  # page num_pages-2 untouched
    data, ok = jax.jit(KVPool.read_pages)(pool, jnp.array([2, 9]))
    assert not bool(ok)
    np.testing.assert_array_equal(np.asarray(data.k_pages[:, :, 0]), snapshot.k_pages[:, :, 2])


# ------------------------------------------------- 6, 10, 12, 15: the manager


def test_6_append_slots_refuses_a_negative_count():
    m = _manager().allocate_or_raise([0], 5)
    with pytest.raises(InvalidArgument, match="cannot shrink"):
        m.append_slots(_pool(), np.array([0], np.int32), num_new_tokens=-1)
    with pytest.raises(InvalidArgument, match="num_new_tokens"):
        m.append_slots(_pool(), np.array([0], np.int32), num_new_tokens=1.0)


def test_10_fork_refuses_lists_of_different_lengths():
    m = _manager().allocate_or_raise([0], 5)
    with pytest.raises(InvalidArgument, match="3 sources but 4 destinations"):
        m.fork_or_raise([0, 0, 0], [1, 2, 3, 4])


def test_12_can_allocate_says_never_for_negative_and_huge_counts():
    m = _manager()
    for n in (2**31 - 2, 2**31 - 1, 2**40, -5, 0):
        assert int(m.can_allocate(n)) == ALLOC_NEVER, n
    with pytest.raises(InvalidArgument, match="num_tokens"):
        m.can_allocate(2.5)


def test_15_huge_and_infinite_counts_raise_jaxkv_errors():
    m = _manager()
    with pytest.raises(InvalidArgument, match="at most 4 blocks per sequence"):
        m.allocate_or_raise([1], 2**40)
    with pytest.raises(InvalidArgument):
        m.allocate_or_raise([1], -2**40)
    with pytest.raises(InvalidArgument, match="number of blocks"):
        BlockAllocator.create(4).acquire_or_raise(float("inf"))


# ----------------------------------------------------------------- 7. fp8


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_7_fp8_keeps_a_rows_finite_values_beside_inf_and_nan(dtype):
    rng = np.random.default_rng()
    pool = KVPool.create(num_pages=2, page_size=4, num_layers=1, k_heads=1, k_dim=4, dtype=dtype)
    finite = rng.uniform(0.01, 1000.0, (4, 4)) * rng.choice([-1, 1], (4, 4))
    rows = finite.copy()
    rows[0, 0], rows[1, 0], rows[2, 0] = np.inf, np.nan, -np.inf
    rows[3] = [np.inf, np.nan, -np.inf, np.inf]
    pool = pool.set_kv(0, np.arange(4, 8), rows[:, None], rows[:, None])
    k, _ = pool.get_kv(0, np.arange(4, 8))
    k = np.asarray(k)[:, 0]
    # The other entries keep fp8 precision relative to the row's finite max.
    rtol = {jnp.float8_e4m3fn: 2**-3, jnp.float8_e5m2: 2**-2}[dtype]
    for r in range(3):
        amax = np.abs(finite[r, 1:]).max()
        np.testing.assert_allclose(k[r, 1:], finite[r, 1:], rtol=rtol, atol=amax * rtol / 8)
    assert k[0, 0] == pytest.approx(np.abs(finite[0, 1:]).max(), rel=rtol)  # +inf saturates to the finite max
    assert np.isnan(k[1, 0])  # NaN stays NaN
    assert k[2, 0] == pytest.approx(-np.abs(finite[2, 1:]).max(), rel=rtol)
    fp8_max = float(jnp.finfo(dtype).max)
    np.testing.assert_array_equal(k[3, [0, 2, 3]], [fp8_max, -fp8_max, fp8_max])  # no finite entry: scale 1
    assert np.isnan(k[3, 1])


# ------------------------------------------------- 8, 9, 13: allocator hosts


BAD_IDS = [[1.5], ["2"], [True], 2.7, [None], [float("nan")]]


@pytest.mark.parametrize("ids", BAD_IDS, ids=repr)
def test_8_float_string_and_bool_ids_are_refused_everywhere(ids):
    blocks, _ = BlockAllocator.create(8).acquire_or_raise(3)
    slots, _ = SlotAllocator.create(8).alloc_many_or_raise(3)
    tokens, _ = TokenToKVPoolAllocator.create(8).alloc_or_raise(3)
    rows = ReqToTokenPool.create(4, 8)
    rows, _ = rows.alloc_or_raise(2)
    calls = [
        lambda: blocks.release_or_raise(ids), lambda: blocks.incref_or_raise(ids),
        lambda: slots.free_or_raise(ids), lambda: slots.occupy_or_raise(ids),
        lambda: tokens.free_or_raise(ids), lambda: rows.free_or_raise(ids),
        lambda: rows.write_or_raise(1, 0, ids), lambda: _manager().allocate_or_raise(ids, 4),
        lambda: _pool().set_kv(0, ids, np.ones((1, 2, 4)), np.ones((1, 2, 4))),
        lambda: PrefixCacheManager(1).match(ids), lambda: PrefixCacheManager(1).insert([1], ids),
        lambda: PrefixScheduler(PrefixCacheManager(1), BlockAllocator.create(4)).admit([ids]),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument, match="integers|one integer"):
            call()
    for count_call in (blocks.acquire_or_raise, slots.alloc_many_or_raise, tokens.alloc_or_raise, rows.alloc_or_raise):
        with pytest.raises(InvalidArgument, match="integer"):
            count_call(2.7)


def test_9_write_to_row_minus_one_is_an_invalid_id():
    rows = ReqToTokenPool.create(4, 8)
    with pytest.raises(InvalidId, match="row -1"):
        rows.write_or_raise(-1, 0, [5])


def test_11_concrete_out_of_range_jax_layer_raises_and_traced_reads_nan():
    pool = _pool(layers=2)
    k = np.ones((1, 2, 4))
    for layer in (jnp.int32(2), np.int64(-1), 2):
        with pytest.raises(InvalidId, match="layer"):
            pool.set_kv(layer, [5], k, k)
        with pytest.raises(InvalidId, match="layer"):
            pool.get_kv(layer, [5])
    read = jax.jit(lambda p, layer: p.get_kv(layer, jnp.array([5]))[0])
    assert np.isnan(np.asarray(read(pool, 2))).all()
    assert not np.isnan(np.asarray(read(pool, 1))).any()


def test_13_incref_refuses_to_wrap_a_count_past_int32_max():
    a = BlockAllocator.create(4)
    a, ids, ok = jax.jit(BlockAllocator.acquire, static_argnames="max_n")(a, 1, max_n=1, owners=2**31 - 1)
    assert bool(ok) and ids.tolist() == [1]
    with pytest.raises(InvalidArgument, match="INT32_MAX"):
        a.incref_or_raise([1])
    b, ok = jax.jit(BlockAllocator.incref)(a, jnp.array([2, 1, -1, -1]))
    assert not bool(ok)
    chex.assert_trees_all_equal(a, b, strict=True)


def test_16_duplicate_targets_in_one_host_write_are_refused():
    pool = _pool()
    k = np.ones((2, 2, 4))
    with pytest.raises(InvalidArgument, match="more than once"):
        pool.set_kv(0, [5, 5], k, k)
    pool.set_kv(0, [5, -1, -1], np.ones((3, 2, 4)), np.ones((3, 2, 4)))  # padding may repeat
    assert issubclass(DoubleFree, KVCacheError)
