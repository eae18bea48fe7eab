"""Assertions shared by the tests."""

import jax
import numpy as np


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
