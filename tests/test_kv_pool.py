"""KVPool: layout, dtypes, fp8 quantization, in-place writes, page copies, errors."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxkv
from jaxkv.pool import KVPool, make_full_attention_net_mem_pool

LAYERS, PAGES, PAGE_SIZE = 2, 9, 4
K_HEADS, K_DIM, V_HEADS, V_DIM = 2, 8, 3, 4
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2]

SET = jax.jit(KVPool.set_kv)
GET = jax.jit(KVPool.get_kv)


def _pool(dtype):
    return KVPool.create(num_pages=PAGES, page_size=PAGE_SIZE, num_layers=LAYERS, k_heads=K_HEADS,
                         k_dim=K_DIM, v_heads=V_HEADS, v_dim=V_DIM, dtype=dtype)


def _random_rows(rng, n, heads, dim):
    # Values spanning several orders of magnitude per row, never all zero.
    return (rng.normal(size=(n, heads, dim)) * rng.choice([1e-3, 1.0, 50.0], size=(n, heads, 1))).astype(np.float32)


def _expected_storage(x, dtype):
    """Independent numpy model of what the pool stores and returns."""
    if jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        np_dtype = {jnp.dtype(jnp.float8_e4m3fn): ml_dtypes.float8_e4m3fn,
                    jnp.dtype(jnp.float8_e5m2): ml_dtypes.float8_e5m2}[jnp.dtype(dtype)]
        fp8_max = float(ml_dtypes.finfo(np_dtype).max)
        amax = np.abs(x).max(axis=-1)
        scale = np.where(amax > 0, amax / fp8_max, 1.0).astype(np.float32)
        stored = np.clip(x / scale[..., None], -fp8_max, fp8_max).astype(np_dtype)
        return stored.astype(np.float32) * scale[..., None]
    return x.astype(jnp.dtype(dtype)).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_set_then_get_matches_numpy_model(dtype):
    rng = np.random.default_rng()
    pool = _pool(dtype)
    n = 6
    indices = rng.choice(np.arange(PAGE_SIZE, PAGES * PAGE_SIZE), size=n, replace=False).astype(np.int32)
    k, v = _random_rows(rng, n, K_HEADS, K_DIM), _random_rows(rng, n, V_HEADS, V_DIM)
    layer = int(rng.integers(LAYERS))
    pool = SET(pool, layer, indices, k, v)
    got_k, got_v = GET(pool, layer, indices)
    np.testing.assert_allclose(np.asarray(got_k), _expected_storage(k, dtype), rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.asarray(got_v), _expected_storage(v, dtype), rtol=1e-6, atol=0)
    if jnp.dtype(dtype).itemsize == 1:  # fp8 stays within its rounding bound of the input
        mantissa = 3 if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn) else 2
        bound = np.abs(k) * 2.0 ** -(mantissa + 1) + np.abs(k).max(-1, keepdims=True) * 2.0**-14
        assert (np.abs(np.asarray(got_k) - k) <= bound).all()
    # The other layer was not written.
    other_k, _ = GET(pool, 1 - layer, indices)
    assert not np.asarray(other_k).any()


def test_any_leading_shape_and_flat_heads():
    rng = np.random.default_rng()
    pool = _pool(jnp.float32)
    indices = np.arange(PAGE_SIZE, PAGE_SIZE + 6, dtype=np.int32).reshape(2, 3)
    k = rng.normal(size=(2, 3, K_HEADS * K_DIM)).astype(np.float32)
    v = rng.normal(size=(2, 3, V_HEADS, V_DIM)).astype(np.float32)
    pool = pool.set_kv(0, indices, k, v)
    got_k, got_v = pool.get_kv(0, indices)
    np.testing.assert_array_equal(np.asarray(got_k), k.reshape(6, K_HEADS, K_DIM))
    np.testing.assert_array_equal(np.asarray(got_v), v.reshape(6, V_HEADS, V_DIM))


def test_padded_and_invalid_traced_indices_only_touch_the_null_page():
    rng = np.random.default_rng()
    pool = _pool(jnp.bfloat16)
    before = np.asarray(pool.k_pages.astype(jnp.float32)).copy()
    # Traced indices cannot be checked on the host: -1 and out-of-range values
    # must land on page 0 and nowhere else.
    indices = jnp.array([-1, PAGES * PAGE_SIZE + 5, -7, 2**30], jnp.int32)
    pool = SET(pool, 0, indices, _random_rows(rng, 4, K_HEADS, K_DIM), _random_rows(rng, 4, V_HEADS, V_DIM))
    after = np.asarray(pool.k_pages.astype(jnp.float32))
    np.testing.assert_array_equal(after[:, :, 1:], before[:, :, 1:])
    assert after[0, :, 0].any()


def test_donated_write_reuses_the_buffer():
    rng = np.random.default_rng()
    pool = _pool(jnp.bfloat16)
    step = jax.jit(KVPool.set_kv, donate_argnums=0)
    pointer = pool.k_bits.unsafe_buffer_pointer()
    indices = np.array([5, 9], np.int32)
    new = step(pool, 1, indices, _random_rows(rng, 2, K_HEADS, K_DIM), _random_rows(rng, 2, V_HEADS, V_DIM))
    assert pool.k_bits.is_deleted()
    assert new.k_bits.unsafe_buffer_pointer() == pointer


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_mla_mode_stores_one_latent(dtype):
    rng = np.random.default_rng()
    lora, rope = 12, 4
    pool = KVPool.create_mla(num_pages=PAGES, page_size=PAGE_SIZE, num_layers=LAYERS, kv_lora_rank=lora,
                             rope_dim=rope, dtype=dtype)
    assert pool.is_mla and pool.v_pages is None and pool.k_heads == 1 and pool.k_dim == lora + rope
    indices = np.array([4, 11, 30], np.int32)
    latent = _random_rows(rng, 3, 1, lora + rope)
    pool = pool.set_kv(1, indices, latent)
    k, v = pool.get_kv(1, indices)
    np.testing.assert_allclose(np.asarray(k), _expected_storage(latent, dtype), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(k)[..., :lora])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_copy_pages_and_page_round_trip_are_bit_exact(dtype):
    rng = np.random.default_rng()
    pool = _pool(dtype)
    all_rows = np.arange(PAGE_SIZE, PAGES * PAGE_SIZE, dtype=np.int32)
    for layer in range(LAYERS):
        pool = pool.set_kv(layer, all_rows, _random_rows(rng, all_rows.size, K_HEADS, K_DIM),
                           _random_rows(rng, all_rows.size, V_HEADS, V_DIM))
    copied, ok = pool.copy_pages(jnp.array([3, -1, 5]), jnp.array([7, 2, 1]))
    assert ok
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
        a, b = getattr(pool, name), getattr(copied, name)
        if a is None:
            continue
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        np.testing.assert_array_equal(b[:, :, 7], a[:, :, 3])
        np.testing.assert_array_equal(b[:, :, 1], a[:, :, 5])
        untouched = [p for p in range(PAGES) if p not in (1, 7)]
        np.testing.assert_array_equal(b[:, :, untouched], a[:, :, untouched])
    # read_pages / write_pages: what a swap to host and back does.
    saved = jax.device_get(pool.read_pages(jnp.array([2, 6]))[0])
    wiped, _ = pool.write_pages(jnp.array([2, 6]), jax.tree_util.tree_map(np.zeros_like, saved))
    restored, ok = wiped.write_pages(jnp.array([2, 6]), saved)
    assert ok
    chex.assert_trees_all_equal(pool, restored, strict=True)


def test_mem_bytes_counts_every_array():
    for dtype in DTYPES:
        pool = _pool(dtype)
        itemsize = jnp.dtype(dtype).itemsize
        pages = LAYERS * PAGES * PAGE_SIZE * (K_HEADS * K_DIM + V_HEADS * V_DIM) * itemsize
        scales = LAYERS * PAGES * PAGE_SIZE * (K_HEADS + V_HEADS) * 4 if itemsize == 1 else 0
        assert pool.memory_bytes() == pages + scales
        assert pool.mem_bytes() == pool.memory_bytes()  # the deprecated alias


def test_factory_matches_allocator_index_space():
    rng = np.random.default_rng()
    pool, allocator = make_full_attention_net_mem_pool(32, 2, 2, 8, 1, 16, dtype=jnp.bfloat16, page_size=4)
    assert pool.buffer_size == allocator.buffer_size == 36 and pool.size == allocator.size == 32
    assert (pool.k_heads, pool.k_dim, pool.v_heads, pool.v_dim) == (2, 8, 1, 16)
    allocator, indices = allocator.alloc_or_raise(32)  # every usable row
    k, v = _random_rows(rng, 32, 2, 8), _random_rows(rng, 32, 1, 16)
    pool = pool.set_kv(0, indices, k, v)
    got_k, _ = pool.get_kv(0, indices)
    np.testing.assert_array_equal(np.asarray(got_k), _expected_storage(k, jnp.bfloat16))
    assert not np.asarray(pool.k_pages[:, :, 0].astype(jnp.float32)).any()  # null page untouched


def test_host_errors_name_the_problem():
    pool = _pool(jnp.bfloat16)
    rows = lambda n, h, d: np.ones((n, h, d), np.float32)  # noqa: E731
    with pytest.raises(jaxkv.InvalidArgument, match="cannot store int8"):
        KVPool.create(num_pages=4, page_size=2, num_layers=1, k_heads=1, k_dim=2, dtype=jnp.int8)
    with pytest.raises(jaxkv.InvalidArgument, match="num_pages"):
        KVPool.create(num_pages=1, page_size=2, num_layers=1, k_heads=1, k_dim=2)
    with pytest.raises(jaxkv.InvalidId, match=r"layer 2 outside \[0, 2\)"):
        pool.set_kv(2, np.array([4]), rows(1, K_HEADS, K_DIM), rows(1, V_HEADS, V_DIM))
    with pytest.raises(jaxkv.InvalidId, match=r"token indices \[36\] outside \[0, 36\)"):
        pool.set_kv(0, np.array([4, 36]), rows(2, K_HEADS, K_DIM), rows(2, V_HEADS, V_DIM))
    with pytest.raises(jaxkv.InvalidArgument, match=r"k has shape \(3, 2, 8\) \(48 values\) but 2 indices need"):
        pool.set_kv(0, np.array([4, 5]), rows(3, K_HEADS, K_DIM), rows(2, V_HEADS, V_DIM))
    with pytest.raises(jaxkv.InvalidArgument, match="needs v"):
        pool.set_kv(0, np.array([4]), rows(1, K_HEADS, K_DIM))
    mla = KVPool.create_mla(num_pages=4, page_size=2, num_layers=1, kv_lora_rank=4, rope_dim=2)
    with pytest.raises(jaxkv.InvalidArgument, match="MLA"):
        mla.set_kv(0, np.array([2]), rows(1, 1, 6), rows(1, 1, 6))
    with pytest.raises(jaxkv.InvalidArgument, match="2 sources but 1 destinations"):
        pool.copy_pages(jnp.array([1, 2]), jnp.array([3]))
