"""A step costs what it touches: the compiled programs of the paged cache's
hot paths make no buffer the size of a pool layer (no whole-pool convert, no
copy of a donated pool, no layer materialised for a kernel). Read from the
compiled HLO (sizes, not timings; ``python -m jaxkv.bench scaling`` times it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn.config import LlamaConfig
from jaxkv.nn.generate import prefill
from jaxkv.nn.llama import LlamaForCausalLM
from jaxkv.nn.sampling import GREEDY, RowSampling
from jaxkv.nn.steps import decode_loop
from jaxkv.pool.kv_pool import KVPool
from jaxkv.serve.caches import decode_chunk
from tests.util import pool_sized_copies

PAGES, PAGE, LAYERS, HEADS, DIM = 512, 16, 2, 2, 32
DTYPES = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32]


def _pool(dtype) -> KVPool:
    return KVPool.create(num_pages=PAGES, page_size=PAGE, num_layers=LAYERS, k_heads=HEADS, k_dim=DIM, dtype=dtype)


def _layer_bytes(pool: KVPool) -> int:
    return pool.k_bits.nbytes // pool.num_layers


def _compiled(fn, donate, *args) -> str:
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def test_the_check_sees_a_whole_pool_convert():
    """The old storage (a typed bf16 array): XLA's CPU scatter converts the
    whole array; the check must report it, or the tests below prove nothing."""
    pages = jnp.zeros((LAYERS, HEADS, PAGES, PAGE, DIM), jnp.bfloat16)

    def write(pages, rows, values):
        return pages.at[0, :, rows // PAGE, rows % PAGE].set(values.astype(pages.dtype))

    text = _compiled(write, 0, pages, jnp.arange(4, dtype=jnp.int32), jnp.ones((4, HEADS, DIM)))
    assert pool_sized_copies(text, pages.nbytes // LAYERS)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_decode_write_is_in_place(dtype):
    pool = _pool(dtype)
    rows = jnp.asarray(np.random.default_rng().choice(pool.size, 8, replace=False) + PAGE, jnp.int32)
    values = jnp.ones((8, HEADS, DIM))
    text = _compiled(lambda p, r, v: p.set_kv(1, r, v, -v), 0, pool, rows, values)
    assert pool_sized_copies(text, _layer_bytes(pool)) == []


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_fork_append_copy_on_write_and_page_copies_are_in_place(dtype):
    """fork + append_slots (its copy-on-write copies a block in every layer)
    + a K/V write + free, and the swap-in path's ``write_pages``."""
    pool = _pool(dtype)
    manager = BlockSpaceManager.create(num_device_blocks=PAGES, num_host_blocks=1, block_size=PAGE, max_seqs=4,
                                       max_blocks_per_seq=8)
    manager = manager.allocate_or_raise([0], 20).allocate_or_raise([1], 37)
    rows = jnp.arange(2, dtype=jnp.int32)

    def step(manager, pool, values, pages):
        manager, _ = manager.fork(rows, rows + 2)
        manager, pool, slots, _, _ = manager.append_slots(pool, rows + 2)
        for layer in range(pool.num_layers):
            pool = pool.set_kv(layer, slots.reshape(-1), values, values)
        manager, _ = manager.free(rows + 2)
        data, _ = pool.read_pages(pages)
        pool, _ = pool.write_pages(pages[::-1], data)
        return manager, pool

    text = _compiled(step, (0, 1), manager, pool, jnp.ones((2, HEADS, DIM)), jnp.asarray([3, 4], jnp.int32))
    assert pool_sized_copies(text, _layer_bytes(pool)) == []


@pytest.mark.parametrize("dtype", [jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)  # fp8 writes: above (CI time)
def test_engine_decode_chunk_is_in_place(dtype):
    """The engine's whole decode chunk (allocation, the model's K/V writes,
    attention reading the pages through the block tables, sampling) in a
    ``lax.while_loop``: the pool is never copied or converted whole; nor,
    in ``generate``'s loop, any array of the manager."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=HEADS, head_dim=DIM // 2)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch, prompt = 2, 5
    # One row more than the batch: the tables' shape [3, 16] is no step temporary's.
    manager = BlockSpaceManager.create(num_device_blocks=PAGES, num_host_blocks=1, block_size=PAGE,
                                       max_seqs=batch + 1, max_blocks_per_seq=16)
    pool = model.make_pool(PAGES, PAGE, dtype=dtype)
    state = prefill(graphdef, params, manager, pool, jnp.ones((batch, prompt), jnp.int32),
                    jnp.full((batch,), prompt, jnp.int32), jax.random.key(0), np.int32(-1), GREEDY, max_new=8)
    args = (graphdef, params, state.manager, state.pool, state.last, jnp.ones((batch,), bool),
            state.num_generated, jnp.full((batch,), 8, jnp.int32), np.int32(-1), RowSampling.broadcast(GREEDY, batch),
            jax.random.split(jax.random.key(1), batch))
    text = decode_chunk.lower(*args, num_steps=4).compile().as_text()
    assert pool_sized_copies(text, _layer_bytes(state.pool)) == []
    # generate's loop also frees finished rows: no copy of any pool or
    # manager array (tables, free stack, ref counts) either.
    text = decode_loop.lower(graphdef, params, state, GREEDY, num_steps=4, free_finished=True).compile().as_text()
    arrays = [leaf for leaf in jax.tree.leaves((state.manager, state.pool)) if leaf.size >= 32]  # tables too
    assert pool_sized_copies(text, shapes=[leaf.shape for leaf in arrays]) == []
