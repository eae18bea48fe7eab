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


# Ops that may produce a buffer as large as a pool without copying it: views,
# control flow threading the buffer through, and in-place updates.
_IN_PLACE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "conditional", "while", "call",
                 "scatter", "dynamic-update-slice"}
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2,
               "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def pool_sized_copies(hlo_text: str, min_bytes: int) -> list[str]:
    """Instructions of compiled HLO that make a new buffer of at least
    ``min_bytes``: anything but a view, control flow, or an in-place update
    (a scatter, a dynamic-update-slice, or a fusion whose root is one).
    A whole-pool ``convert`` (XLA's CPU scatter into a bf16/fp8 array), a
    ``copy`` (a donated buffer XLA could not alias) or a fusion materialising
    a layer of the pool are all reported. Returns the offending lines."""
    import re

    instruction = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (\w+)\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(")
    roots, owner, current = {}, [], None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%(\S+) .*\{$", line)
        if head:
            current = head.group(1)
        elif current and line.strip().startswith("ROOT"):
            match = instruction.match(line)
            roots[current] = match.group(4) if match else "tuple"
        owner.append(current)
    # Instructions inside a fused computation make no buffer of their own.
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.-]+)", hlo_text))
    found = []
    for line, computation in zip(hlo_text.splitlines(), owner):
        match = instruction.match(line)
        if not match or match.group(2) not in _ITEM_BYTES or computation in fused:
            continue
        size = _ITEM_BYTES[match.group(2)]
        for dim in filter(None, match.group(3).split(",")):
            size *= int(dim)
        op = match.group(4)
        if size < min_bytes or op in _IN_PLACE_OPS:
            continue
        if op == "fusion":
            called = re.search(r"calls=%([\w.-]+)", line)
            if called and roots.get(called.group(1)) in ("scatter", "dynamic-update-slice"):
                continue
        found.append(line.strip()[:200])
    return found
