"""The shared idioms of jaxkv._ops against numpy: first_true_indices,
ids_distinct (both its forms), ceil_div, pow2_at_least, where_ok."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxkv._ops import ceil_div, first_true_indices, ids_distinct, pow2_at_least, where_ok

_FIRST_TRUE = jax.jit(first_true_indices, static_argnames=("size",))


@given(
    mask=st.lists(st.booleans(), min_size=1, max_size=600),
    size=st.sampled_from([1, 7, 32]),
    count=st.integers(-2, 40),
)
def test_first_true_indices_matches_flatnonzero(mask, size, count):
    mask = np.asarray(mask)
    got = np.asarray(_FIRST_TRUE(jnp.asarray(mask), count, size=size))
    expected = np.full(size, -1)
    taken = np.flatnonzero(mask)[: max(0, min(count, size))]
    expected[: taken.size] = taken
    np.testing.assert_array_equal(got, expected)


def test_first_true_indices_dense_and_sparse_large_masks():
    rng = np.random.default_rng()
    for density in (0.002, 0.5, 0.999):
        mask = rng.random(70_000) < density
        got = np.asarray(_FIRST_TRUE(jnp.asarray(mask), 20, size=24))
        expected = np.full(24, -1)
        taken = np.flatnonzero(mask)[:20]
        expected[: taken.size] = taken
        np.testing.assert_array_equal(got, expected)


_DISTINCT = jax.jit(ids_distinct, static_argnames=("bound",))


@given(ids=st.lists(st.integers(0, 40), min_size=1, max_size=24), data=st.data())
def test_ids_distinct_matches_numpy_in_both_forms(ids, data):
    given_mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))))
    ids = np.asarray(ids, np.int32)
    expected = len(set(ids[given_mask].tolist())) == int(given_mask.sum())
    for bound in (None, 41, 100_000):  # sort; scatter over 41 ids; too large for a scatter: sort
        assert bool(_DISTINCT(jnp.asarray(ids), jnp.asarray(given_mask), bound=bound)) == expected


def test_scalar_idioms():
    rng = np.random.default_rng()
    a, b = rng.integers(0, 10**6, 50), rng.integers(1, 1000, 50)
    np.testing.assert_array_equal(np.asarray(ceil_div(jnp.asarray(a), jnp.asarray(b))), -(-a // b))
    assert [ceil_div(int(x), int(y)) for x, y in zip(a, b)] == [int(np.ceil(x / y)) for x, y in zip(a, b)]
    assert [pow2_at_least(n) for n in (-3, 0, 1, 2, 3, 4, 5, 1000, 1024)] == [1, 1, 1, 2, 4, 4, 8, 1024, 1024]
    new = {"x": jnp.asarray(rng.normal(size=3)), "y": jnp.arange(4)}
    old = {"x": jnp.asarray(rng.normal(size=3)), "y": jnp.arange(4) + 10}
    for ok, want in ((True, new), (False, old)):
        got = where_ok(jnp.asarray(ok), new, old)
        for key in new:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
