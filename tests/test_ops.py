"""first_true_indices against numpy's flatnonzero."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxkv._ops import first_true_indices

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
