"""Checked mode: violations inside jit surface as typed errors naming the id."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv


def _double_free_loop(bad_step):
    """Each step acquires one block and releases it; at ``bad_step`` it names
    the block twice, one release more than its single owner."""

    def loop(blocks):
        def step(blocks, i):
            blocks, ids, acquired = blocks.acquire(1, max_n=1)
            twice = jnp.concatenate([ids, jnp.where(i == bad_step, ids, -1)])
            blocks, released = blocks.release(twice)
            # On the failed step the block stays held; free it so later steps run.
            blocks, _ = blocks.release(jnp.where(released, -1, ids))
            return blocks, acquired & released

        return jax.lax.scan(step, blocks, jnp.arange(12))

    return loop


def test_double_free_inside_scan_raises_with_the_block_id():
    blocks = jaxkv.BlockAllocator.create(8)
    bad_step = int(np.random.default_rng().integers(0, 12))
    with pytest.raises(jaxkv.DoubleFree, match="released more times than it has owners") as info:
        jaxkv.checked(_double_free_loop(bad_step))(blocks)
    # Unchecked, the same loop reports the failure only through its flags.
    final, oks = jax.jit(_double_free_loop(bad_step))(blocks)
    expected = np.ones(12, bool)
    expected[bad_step] = False
    np.testing.assert_array_equal(np.asarray(oks), expected)
    assert int(final.num_free) == 7
    # The stack pops the lowest free id first and each step gives it back, so
    # the block released twice is the one every step uses.
    assert info.value.ids == [1]


def test_valid_program_runs_the_same_checked_and_unchecked():
    blocks = jaxkv.BlockAllocator.create(16)
    n = int(np.random.default_rng().integers(1, 9))

    def program(blocks):
        blocks, ids, ok = blocks.acquire(n, max_n=8)
        blocks, ok2 = blocks.incref(ids)
        blocks, ok3 = blocks.release(jnp.concatenate([ids, ids]))
        return blocks, ok & ok2 & ok3

    checked_state, checked_ok = jaxkv.checked(program)(blocks)
    plain_state, plain_ok = jax.jit(program)(blocks)
    assert bool(checked_ok) and bool(plain_ok)
    chex.assert_trees_all_equal(plain_state, checked_state, strict=True)


@pytest.mark.parametrize(
    "program, error, text",
    [
        (lambda b: b.release(jnp.array([0, -1])), jaxkv.InvalidId, "release of block id 0 outside [1, 8)"),
        (lambda b: b.release(jnp.array([3, 9])), jaxkv.InvalidId, "release of block id 9 outside [1, 8)"),
        (lambda b: b.incref(jnp.array([5])), jaxkv.InvalidId, "incref of free block id 5"),
        (lambda b: b.acquire(5, max_n=4), jaxkv.InvalidArgument, "acquire of 5 blocks with max_n=4"),
    ],
)
def test_block_allocator_checks(program, error, text):
    blocks = jaxkv.BlockAllocator.create(8)
    blocks, _ = blocks.acquire_or_raise(3)
    with pytest.raises(error) as info:
        jaxkv.checked(program)(blocks)
    assert text in str(info.value)


def test_empty_release_is_fine_when_checked():
    blocks = jaxkv.BlockAllocator.create(8)
    state, ok = jaxkv.checked(lambda b: b.release(jnp.zeros((0,), jnp.int32)))(blocks)
    assert bool(ok)
    chex.assert_trees_all_equal(blocks, state, strict=True)


def test_slot_checks():
    slots = jaxkv.SlotAllocator.create(40)
    slots, taken = slots.alloc_many_or_raise(2)
    with pytest.raises(jaxkv.DoubleFree, match="slot id 7 is already free"):
        jaxkv.checked(lambda s: s.free(jnp.array([int(taken[0]), 7])))(slots)
    with pytest.raises(jaxkv.InvalidId, match=f"occupy of taken slot id {taken[1]}"):
        jaxkv.checked(lambda s: s.occupy(jnp.array([9, int(taken[1])])))(slots)
    with pytest.raises(jaxkv.InvalidId, match=r"free of slot id 40 outside \[1, 40\)"):
        jaxkv.checked(lambda s: s.free(jnp.array([40])))(slots)


def test_token_and_row_checks():
    tokens = jaxkv.TokenToKVPoolAllocator.create(16, page_size=4)
    with pytest.raises(jaxkv.InvalidArgument, match=r"alloc of 9 tokens: need 0 <= n <= max_n=8"):
        jaxkv.checked(lambda t: t.alloc(9, max_n=8))(tokens)
    _, indices, ok = jaxkv.checked(lambda t: t.alloc(6, max_n=8))(tokens)  # a partial last page is fine
    assert bool(ok) and np.asarray(indices).tolist() == [4, 5, 6, 7, 8, 9, -1, -1]
    with pytest.raises(jaxkv.InvalidId, match=r"free of token index id 2 outside \[4, 20\)"):
        jaxkv.checked(lambda t: t.free(jnp.array([2])))(tokens)
    table = jaxkv.make_req_to_token_pool(3, 8)
    with pytest.raises(jaxkv.InvalidId, match="write to row id 2 which is not held"):
        jaxkv.checked(lambda r: r.write(2, 0, jnp.arange(3)))(table)
    table, rows = table.alloc_or_raise(1)
    with pytest.raises(jaxkv.InvalidArgument, match="write of 3 positions at start 6 passes max_context_len=8"):
        jaxkv.checked(lambda r: r.write(int(rows[0]), 6, jnp.arange(3)))(table)
