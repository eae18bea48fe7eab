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


def _parse_hlo(hlo_text: str) -> dict:
    """``{computation: [(line, opcode, [array bytes], is_root, called, [array
    shapes])]}`` of
    compiled HLO text (an array-typed or tuple-typed result)."""
    import re

    header = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
    instruction = re.compile(r"^\s*(ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
    array = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
    computations, current = {}, None
    for line in hlo_text.splitlines():
        match = instruction.match(line)
        if match and current is not None:
            root, type_, opcode, rest = match.groups()
            sizes, shapes = [], []
            for dtype, dims in array.findall(type_):
                shape = tuple(int(dim) for dim in filter(None, dims.split(",")))
                size = _ITEM_BYTES.get(dtype, 4)
                for dim in shape:
                    size *= dim
                sizes.append(size)
                shapes.append(shape)
            called = re.search(r"calls=%([\w.\-]+)", rest)
            computations[current].append((line.strip()[:200], opcode, sizes, bool(root), called and called.group(1),
                                          shapes))
            continue
        head = header.match(line)
        if head:
            current = head.group(1)
            computations[current] = []
    return computations


def _updates_in_place(computations: dict, name: str | None) -> bool:
    """Whether fused computation ``name`` is an in-place update: its root a
    scatter / dynamic-update-slice, or a tuple of them."""
    insts = computations.get(name, [])
    roots = [inst for inst in insts if inst[3]]
    if not roots:
        return False
    updates = ("scatter", "dynamic-update-slice")
    if roots[0][1] in updates:
        return True
    return roots[0][1] == "tuple" and all(op in updates for _, op, *_ in insts if op not in ("parameter", "tuple"))


def pool_sized_copies(hlo_text: str, min_bytes: int = 1, shapes=None) -> list[str]:
    """Instructions of compiled HLO that make a new buffer of at least
    ``min_bytes`` (and, given ``shapes``, of one of those shapes: the state's
    arrays, whatever their dtype): anything but a view, control flow, or an
    in-place update (a scatter, a dynamic-update-slice, or a fusion of them).
    A whole-pool ``convert`` (XLA's CPU scatter into a bf16/fp8 array), a
    ``copy`` (a donated buffer XLA could not alias) or a fusion materialising
    a layer of the pool are all reported. Instructions inside fused
    computations make no buffer and are skipped. Returns the offending lines."""
    computations = _parse_hlo(hlo_text)
    fused = {inst[4] for insts in computations.values() for inst in insts if inst[1] == "fusion"}
    shapes = None if shapes is None else {tuple(shape) for shape in shapes}
    found = []
    for name, insts in computations.items():
        if name in fused:
            continue
        for line, op, sizes, _, called, array_shapes in insts:
            if not sizes or max(sizes) < min_bytes or op in _IN_PLACE_OPS:
                continue
            if shapes is not None and not shapes.intersection(array_shapes):
                continue
            if op == "fusion" and _updates_in_place(computations, called):
                continue
            found.append(line)
    return found


def pool_sized_updates(hlo_text: str, min_bytes: int) -> int:
    """In-place updates (scatters, dynamic-update-slices) of at least
    ``min_bytes``: a check that the parser saw the writes at all."""
    return sum(1 for insts in _parse_hlo(hlo_text).values() for _, op, sizes, *_ in insts
               if op in ("scatter", "dynamic-update-slice") and sizes and max(sizes) >= min_bytes)


def assert_scanned_is_unrolled(scanned, unrolled, signatures, rng, tmp_path, *, dense_tokens: int, prompts,
                               new_tokens: int, generate_kws=({},)):
    """A model with its layers under a scan (``jaxkv.nn.scan``) against the
    same model unrolled (built from the same seed): the plan of its
    ``signatures``, equal weights under equal names, dense logits to float32
    summation order on ``dense_tokens`` random tokens, the same greedy
    tokens from ``generate`` for ``prompts`` with each of ``generate_kws``,
    and a checkpoint saved and loaded back scanned (the same plan and
    logits) and unrolled."""
    import jax.numpy as jnp

    from jaxkv.nn.generate import generate
    from jaxkv.nn.layers import named_state
    from jaxkv.nn.scan import DecoderStack, scan_plan

    stack = scanned.layers
    assert isinstance(stack, DecoderStack)
    assert (stack.head_len, stack.period, stack.reps) == scan_plan(signatures)
    assert stack.reps >= 2 and unrolled.layers.reps == 0, signatures
    a, b = named_state(scanned), named_state(unrolled)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    tokens = jnp.asarray(rng.integers(0, scanned.config.vocab_size, dense_tokens))
    np.testing.assert_allclose(scanned.forward_dense(tokens), unrolled.forward_dense(tokens), rtol=1e-4, atol=1e-4)
    for kw in generate_kws:
        want = generate(unrolled, prompts, new_tokens, **kw).tokens
        assert generate(scanned, prompts, new_tokens, **kw).tokens == want, (signatures, kw)
    scanned.save_pretrained(tmp_path)
    cls = type(scanned)
    loaded = cls.from_pretrained(tmp_path)
    assert (loaded.layers.head_len, loaded.layers.period, loaded.layers.reps) == (stack.head_len, stack.period,
                                                                                   stack.reps)
    np.testing.assert_array_equal(loaded.forward_dense(tokens), scanned.forward_dense(tokens))
    assert cls.from_pretrained(tmp_path, scan_layers=False).layers.reps == 0
