"""Assertions shared by the tests."""

import jax
import numpy as np
import pytest


def assert_tree_equal(expected, actual):
    """Two pytrees have the same structure (static fields included) and
    bit-identical leaves. Used to show that a failed op changed nothing."""
    exp_leaves, exp_def = jax.tree_util.tree_flatten(expected)
    act_leaves, act_def = jax.tree_util.tree_flatten(actual)
    assert exp_def == act_def, f"tree structure changed: {exp_def} -> {act_def}"
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        e, a = np.asarray(e), np.asarray(a)
        assert e.dtype == a.dtype and e.shape == a.shape, f"leaf {i}: {e.dtype}{e.shape} -> {a.dtype}{a.shape}"
        np.testing.assert_array_equal(a, e, err_msg=f"leaf {i} changed")


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
        assert_tree_equal(before, after)
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
