"""Cache writes of the hybrid structures are in place when donated (compiled HLO).

XLA's CPU backend cannot scatter into a bfloat16 / float16 / fp8 array in
place: it converts the whole operand to a wider float, scatters, and converts
back, so each write costs time proportional to the pool. The fp8 / bf16 parts
of :class:`CompressedEntries` and the bf16 conv state of :class:`GDNPool` are
therefore stored as raw integer bits (:mod:`kernels_pallas.bits`). These
tests compile each write op with the cache donated and assert that no
instruction materializes a whole-array-sized buffer other than the scatter
itself: no ``copy``, ``convert`` or ``bitcast-convert`` of that size, and no
fusion of that size that is not a scatter. They check sizes, not timings, so
small arrays (a few hundred rows) suffice.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.pool.compressed import CompressedLayerCache, store_entries
from jaxkv.pool.gdn_pool import GDNPool
from kernels_pallas.formats import DSV4_FP8, CompressedEntries
from tests.util import pool_sized_copies, pool_sized_updates

def _compiled(fn, *args) -> str:
    hlo = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
    assert "input_output_alias" in hlo.splitlines()[0], "the donated cache is not aliased to the output"
    return hlo


def _check(fn, args, min_bytes):
    hlo = _compiled(fn, *args)
    assert pool_sized_updates(hlo, min_bytes), "no whole-array scatter parsed: the HLO text format changed?"
    copies = pool_sized_copies(hlo, min_bytes)
    assert not copies, "a donated write copies the whole array:\n" + "\n".join(copies)


# --------------------------------------------------------------------------
# CompressedEntries / CompressedLayerCache (fp8 NoPE, bf16 RoPE).
# --------------------------------------------------------------------------

ROWS, PER_BLOCK = 128, 4  # 512 entries


def test_store_entries_is_in_place():
    pool = CompressedEntries.zeros(DSV4_FP8, (ROWS, PER_BLOCK))
    rows = jnp.asarray([3, 7, 600, 9], jnp.int32)  # 600: past the pool, dropped
    values = jnp.ones((4, DSV4_FP8.head_dim), jnp.float32)
    # The smallest stored part (scales excepted: [.., 7] uint8) bounds what a copy would be.
    _check(store_entries, (pool, rows, values), ROWS * PER_BLOCK * DSV4_FP8.rope_dim * 2)


def test_compressed_layer_cache_copy_and_reset_are_in_place():
    cache = CompressedLayerCache.create(DSV4_FP8, num_slots=64, window=8)
    source = jnp.asarray([1, 2], jnp.int32)
    target = jnp.asarray([3, 70], jnp.int32)
    min_bytes = 64 * 8 * DSV4_FP8.rope_dim * 2  # bytes of the bf16 RoPE part
    _check(lambda c, s, t: c.copy_rows(s, t), (cache, source, target), min_bytes)
    _check(lambda c, t: c.reset(t), (cache, target), min_bytes)


def test_entries_store_bits():
    x = jnp.linspace(-3, 3, 2 * DSV4_FP8.head_dim, dtype=jnp.float32).reshape(2, -1)
    entries = CompressedEntries.quantize(x, DSV4_FP8)
    assert entries.nope_bits.dtype == jnp.uint8 and entries.rope_bits.dtype == jnp.uint16
    assert entries.nope.dtype == jnp.float8_e4m3fn and entries.rope.dtype == jnp.bfloat16
    assert entries.nbytes() == 2 * DSV4_FP8.bytes_per_entry
    stored = store_entries(CompressedEntries.zeros(DSV4_FP8, (2, 2)), jnp.asarray([1, 2]), x)
    got = np.asarray(stored.dequantize(), np.float32).reshape(4, -1)
    np.testing.assert_array_equal(got[1:3], np.asarray(entries.dequantize(), np.float32))
    assert not got[[0, 3]].any()


def test_from_parts_refuses_other_dtypes():
    from kernels_pallas.errors import KernelArgumentError

    good = CompressedEntries.zeros(DSV4_FP8, (2,))
    with pytest.raises(KernelArgumentError, match=r"nope must be float8_e4m3fn"):
        CompressedEntries.from_parts(good.nope.astype(jnp.bfloat16), good.scales, good.rope, DSV4_FP8)


# --------------------------------------------------------------------------
# GDNPool (bf16 conv state).
# --------------------------------------------------------------------------

SLOTS = 511  # pool_size 512 (+ padding slot 0)


@pytest.fixture(scope="module")
def gdn_pool():
    return GDNPool.create(SLOTS, num_gdn_layers=2, num_v_heads=2, head_k_dim=4, head_v_dim=4, num_k_heads=1,
                          conv_kernel_size=4, dtype=jnp.bfloat16)


def test_gdn_pool_stores_conv_bits(gdn_pool):
    assert gdn_pool.conv_bits.dtype == jnp.uint16 and gdn_pool.dtype == jnp.bfloat16
    assert gdn_pool.conv_state.dtype == jnp.bfloat16 and gdn_pool.conv_state.shape == gdn_pool.conv_bits.shape
    conv = jnp.full((1, gdn_pool.conv_dim, 3), 1.5, jnp.bfloat16)
    rec = jnp.ones((1, 2, 4, 4), jnp.float32)
    pool = gdn_pool.set_layer_state(1, jnp.asarray([5]), rec, conv)
    _, got = pool.get_states(1, jnp.asarray([5, -1]))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.stack([np.full((16, 3), 1.5), np.zeros((16, 3))]))
    spec = jax.eval_shape(lambda: gdn_pool)
    assert spec.conv_state.dtype == jnp.bfloat16 and spec.memory_bytes() == gdn_pool.memory_bytes()


def test_gdn_pool_writes_are_in_place(gdn_pool):
    min_bytes = gdn_pool.conv_bits.nbytes  # the smaller of the two state arrays
    conv = jnp.ones((3, gdn_pool.conv_dim, 3), jnp.bfloat16)
    rec = jnp.ones((3, 2, 4, 4), jnp.float32)
    ids = jnp.asarray([1, 4, -1], jnp.int32)

    _check(lambda p, i, r, c: p.set_layer_state(1, i, r, c), (gdn_pool, ids, rec, conv), min_bytes)
    _check(lambda p, i: p.reset_states(i), (gdn_pool, ids), min_bytes)
    _check(lambda p, s, d: p.copy_states(s, d), (gdn_pool, ids, jnp.asarray([7, 8, 9], jnp.int32)), min_bytes)


def test_hybrid_cache_step_is_in_place():
    """A whole decode step of the hybrid cache (reserve in every group, then
    each layer's SWA, compressor and indexer writes; fp8 entries) on the
    V4-Flash-like schedule, each layer's window read before its SWA write:
    no array of the manager is copied or converted. (DeepSeek-V4's and
    Qwen3-Next's whole decode loops, release of finished rows included, pass
    the same check; compiling them costs CI ~20 s each, so they are not
    repeated here.)"""
    from jaxkv.bench.hybrid import hybrid_cache_step
    from jaxkv.manager.hybrid import KVCacheManager
    from jaxkv.manager.hybrid_schema import HybridConfig, deepseek_v4_schedule, v4_flash_like_ratios

    config = HybridConfig()
    manager = KVCacheManager.create(config, deepseek_v4_schedule(v4_flash_like_ratios(4)), 4,
                                    max_context_tokens=2048)
    manager, slots, _ = manager.admit(4, max_n=4)
    values = jnp.ones((4, 4 * config.head_dim), jnp.float32)
    # A model reads each layer's SWA window before writing it (DeepSeek-V4
    # does; ``write_swa(after=window)`` keeps the ring in place).
    parts = ("swa_read", "swa", "compressor", "indexer")
    hlo = _compiled(lambda m, v: hybrid_cache_step(m, slots, v, parts=parts), manager, values)
    arrays = [leaf for leaf in jax.tree.leaves(manager) if leaf.ndim >= 2]  # tables, rings, entries
    assert pool_sized_updates(hlo, min(leaf.nbytes for leaf in arrays))
    assert pool_sized_copies(hlo, shapes=[leaf.shape for leaf in arrays]) == []
