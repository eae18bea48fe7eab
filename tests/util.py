"""Assertions shared by the tests."""

import chex
import numpy as np
import pytest


def assert_tree_equal(expected, actual):
    """Kept for the tests that still import it: ``chex.assert_trees_all_equal``
    with ``strict=True`` (same structure, static fields included, and
    bit-identical leaves of the same dtype and shape)."""
    chex.assert_trees_all_equal(expected, actual, strict=True)


def assert_all_or_nothing(before, after, ids, ok, expected, lanes):
    """Check an allocation's result against the model's prediction.

    ``expected`` is None when the model says the call must fail: then ``ok`` is
    False, the state is unchanged and every lane is -1. Otherwise ``ok`` is
    True, the first ``len(expected)`` lanes are exactly ``expected`` and the
    rest are -1.
    """
    ids = np.asarray(ids)
    assert ids.shape == (lanes,) and ids.dtype == np.int32, (ids.shape, ids.dtype)
    assert bool(ok) == (expected is not None), (bool(ok), expected)
    if expected is None:
        chex.assert_trees_all_equal(before, after, strict=True)
        assert (ids == -1).all(), ids
    else:
        n = len(expected)
        np.testing.assert_array_equal(ids[:n], expected)
        assert (ids[n:] == -1).all(), ids


#: Kernel tests run twice: in Pallas' interpreter (on any machine) and as the
#: compiled GPU kernel (marked ``gpu``; skipped with the reason where JAX
#: has no GPU, see conftest.py).
KERNEL_MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]


def lcp(a, b) -> int:
    """Length of the longest common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
