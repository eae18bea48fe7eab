"""SlotAllocator: a stateful property test against a plain-Python model of the
seed's semantics, the host error paths, and a 1,000-step ``lax.scan``.

Device ops are called through the module-level jitted functions below with
fixed argument shapes, so each op compiles once per ``max_slots``.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv import DoubleFree, InvalidArgument, InvalidId, KVCacheError, KVCacheOOM, SlotAllocator
from tests.util import assert_all_or_nothing

SIZES = (5, 70, 100)  # tiny; > 64 and not a multiple of 32 (3 and 4 words)
IDS_LEN = 16  # every free / occupy id array is padded with -1 to this length
QUERY_LEN = 8  # is_free / version query length
MAX_K = 128  # static max_k of every alloc_many call (> every capacity above)

ALLOC = jax.jit(SlotAllocator.alloc)
ALLOC_MANY = jax.jit(SlotAllocator.alloc_many, static_argnames=("max_k",))
FREE = jax.jit(SlotAllocator.free)
OCCUPY = jax.jit(SlotAllocator.occupy)
IS_FREE = jax.jit(SlotAllocator.is_free)
VERSION = jax.jit(SlotAllocator.version)
FREE_COUNT = jax.jit(lambda s: s.free_count)


# ---------------------------------------------------------------------- model


class SlotModel:
    """The seed's semantics in plain Python: a set of free slots plus versions."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.free = set(range(1, max_slots))
        self.versions = [0] * max_slots

    @property
    def taken(self) -> set[int]:
        return set(range(1, self.max_slots)) - self.free

    def alloc(self) -> int:
        if not self.free:
            return -1
        slot = min(self.free)
        self.free.remove(slot)
        self.versions[slot] += 1
        return slot

    def alloc_many(self, k: int, max_k: int) -> list[int] | None:
        if k < 0 or k > max_k or k > len(self.free):
            return None
        slots = sorted(self.free)[:k]
        for s in slots:
            self.free.remove(s)
            self.versions[s] += 1
        return slots

    def _flip_ok(self, ids, want_free: bool) -> bool:
        given = [int(i) for i in ids if i != -1]
        if len(set(given)) != len(given):
            return False
        return all(1 <= s < self.max_slots and ((s in self.free) == want_free) for s in given)

    def free_slots(self, ids) -> bool:
        if not self._flip_ok(ids, want_free=False):
            return False
        self.free.update(int(i) for i in ids if i != -1)
        return True

    def occupy(self, ids) -> bool:
        if not self._flip_ok(ids, want_free=True):
            return False
        self.free.difference_update(int(i) for i in ids if i != -1)
        return True

    def is_free(self, s: int) -> bool:
        return s in self.free

    def version(self, s: int) -> int:
        return self.versions[s] if 0 <= s < self.max_slots else 0


def unpack_bits(free_mask) -> np.ndarray:
    """uint32 words -> one bool per bit, bit i of word w = slot 32 w + i."""
    words = np.asarray(free_mask)
    assert words.dtype == np.uint32
    return (((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1) == 1).reshape(-1)


def check_state(state: SlotAllocator, model: SlotModel) -> None:
    n = model.max_slots
    assert state.max_slots == n
    assert state.free_mask.shape == (-(-n // 32),)
    bits = unpack_bits(state.free_mask)
    expected = np.zeros(n, bool)
    expected[sorted(model.free)] = True
    np.testing.assert_array_equal(bits[:n], expected)
    assert not bits[0], "null slot 0 is marked free"
    assert not bits[n:].any(), f"bits past max_slots={n} set: {np.flatnonzero(bits[n:]) + n}"
    versions = np.asarray(state.versions)
    assert versions.dtype == np.int32 and versions.shape == (n,)
    np.testing.assert_array_equal(versions, np.asarray(model.versions, np.int32))
    assert versions[0] == 0
    free_count = int(FREE_COUNT(state))
    assert free_count == len(model.free)
    assert free_count + int((~bits[1:n]).sum()) == state.capacity == n - 1


def snapshot(tree):
    """A host copy of a pytree (same treedef), to show nothing changed later."""
    return jax.tree_util.tree_map(np.array, tree)


# ---------------------------------------------------------- stateful machine


class SlotMachine(RuleBasedStateMachine):
    @initialize(max_slots=st.sampled_from(SIZES))
    def setup(self, max_slots):
        self.state = SlotAllocator.create(max_slots)
        self.model = SlotModel(max_slots)

    # -- helpers

    def _ids(self, data, pool, max_n, label):
        """A list of distinct members of ``pool`` (at most ``max_n``)."""
        pool = sorted(pool)
        chosen = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=max_n), label=label) if pool else []
        return chosen

    def _layout(self, data, ids) -> np.ndarray:
        """Place ``ids`` at random positions of a -1-padded fixed-length array."""
        assert len(ids) <= IDS_LEN
        perm = data.draw(st.permutations(range(IDS_LEN)), label="positions")
        out = np.full(IDS_LEN, -1, np.int32)
        out[np.asarray(perm[: len(ids)], int)] = ids
        return out

    def _bad_id(self, data) -> int:
        n = self.model.max_slots
        return data.draw(st.sampled_from([0, -2, -7, n, n + 1, 32 * (-(-n // 32)), 2**20, 2**31 - 1, -(2**31)]), label="bad id")

    def _apply_flip(self, fn, model_fn, ids):
        before = self.state
        expected = model_fn(ids)
        after, ok = fn(before, ids)
        assert bool(ok) == expected, f"ids={ids.tolist()} ok={bool(ok)} model={expected}"
        if expected:
            np.testing.assert_array_equal(np.asarray(after.versions), np.asarray(before.versions))
        else:
            chex.assert_trees_all_equal(before, after, strict=True)
        self.state = after

    # -- alloc

    @rule()
    def alloc(self):
        before = self.state
        expected = self.model.alloc()
        after, slot, ok = ALLOC(before)
        assert int(slot) == expected
        assert bool(ok) == (expected != -1)
        if expected == -1:
            chex.assert_trees_all_equal(before, after, strict=True)
        self.state = after

    @rule(k=st.one_of(st.integers(0, 6), st.integers(-3, MAX_K + 3)))
    def alloc_many(self, k):
        before = self.state
        expected = self.model.alloc_many(k, MAX_K)
        after, slots, ok = ALLOC_MANY(before, k, max_k=MAX_K)
        assert_all_or_nothing(before, after, slots, ok, expected, MAX_K)
        self.state = after

    @rule()
    def alloc_many_all_free(self):
        """Take exactly every free slot: the allocator is full afterwards."""
        k = len(self.model.free)
        expected = self.model.alloc_many(k, MAX_K)
        self.state, slots, ok = ALLOC_MANY(self.state, k, max_k=MAX_K)
        assert bool(ok)
        np.testing.assert_array_equal(np.asarray(slots)[:k], expected)

    @rule(extra=st.integers(1, 3))
    def alloc_many_more_than_free(self, extra):
        k = len(self.model.free) + extra
        before = self.state
        assert self.model.alloc_many(k, MAX_K) is None
        after, slots, ok = ALLOC_MANY(before, k, max_k=MAX_K)
        assert not bool(ok)
        assert (np.asarray(slots) == -1).all()
        chex.assert_trees_all_equal(before, after, strict=True)

    # -- free

    @rule(data=st.data())
    def free_taken(self, data):
        ids = self._ids(data, self.model.taken, IDS_LEN, "taken ids")
        self._apply_flip(FREE, self.model.free_slots, self._layout(data, ids))

    @precondition(lambda self: self.model.free)
    @rule(data=st.data())
    def free_including_free_slot(self, data):
        ids = self._ids(data, self.model.taken, IDS_LEN - 1, "taken ids")
        ids = ids + [data.draw(st.sampled_from(sorted(self.model.free)), label="free id")]
        self._apply_flip(FREE, self.model.free_slots, self._layout(data, ids))

    @precondition(lambda self: self.model.taken)
    @rule(data=st.data())
    def free_naming_slot_twice(self, data):
        ids = self._ids(data, self.model.taken, IDS_LEN - 2, "taken ids")
        dup = data.draw(st.sampled_from(sorted(self.model.taken)), label="dup")
        ids = [i for i in ids if i != dup] + [dup, dup]
        self._apply_flip(FREE, self.model.free_slots, self._layout(data, ids))

    @rule(data=st.data())
    def free_bad_id(self, data):
        ids = self._ids(data, self.model.taken, IDS_LEN - 1, "taken ids") + [self._bad_id(data)]
        self._apply_flip(FREE, self.model.free_slots, self._layout(data, ids))

    # -- occupy

    @rule(data=st.data())
    def occupy_free(self, data):
        ids = self._ids(data, self.model.free, 6, "free ids")
        self._apply_flip(OCCUPY, self.model.occupy, self._layout(data, ids))

    @precondition(lambda self: self.model.taken)
    @rule(data=st.data())
    def occupy_including_taken(self, data):
        ids = self._ids(data, self.model.free, 5, "free ids")
        ids = ids + [data.draw(st.sampled_from(sorted(self.model.taken)), label="taken id")]
        self._apply_flip(OCCUPY, self.model.occupy, self._layout(data, ids))

    @precondition(lambda self: self.model.free)
    @rule(data=st.data())
    def occupy_naming_slot_twice(self, data):
        dup = data.draw(st.sampled_from(sorted(self.model.free)), label="dup")
        self._apply_flip(OCCUPY, self.model.occupy, self._layout(data, [dup, dup]))

    @rule(data=st.data())
    def occupy_bad_id(self, data):
        ids = self._ids(data, self.model.free, 3, "free ids") + [self._bad_id(data)]
        self._apply_flip(OCCUPY, self.model.occupy, self._layout(data, ids))

    # -- queries

    @rule(data=st.data())
    def query(self, data):
        n = self.model.max_slots
        ids = data.draw(
            st.lists(st.one_of(st.integers(-3, n + 3), st.sampled_from([2**20, -(2**31)])), min_size=QUERY_LEN, max_size=QUERY_LEN),
            label="query",
        )
        ids = np.asarray(ids, np.int32)
        np.testing.assert_array_equal(np.asarray(IS_FREE(self.state, ids)), [self.model.is_free(int(s)) for s in ids])
        np.testing.assert_array_equal(np.asarray(VERSION(self.state, ids)), [self.model.version(int(s)) for s in ids])

    @invariant()
    def matches_model(self):
        if hasattr(self, "state"):
            check_state(self.state, self.model)


TestSlotMachine = SlotMachine.TestCase


# ------------------------------------------------------------ basic behaviour


def test_create_and_properties():
    for n in (2, 5, 32, 33, 64, 65, 70, 100):
        s = SlotAllocator.create(n)
        check_state(s, SlotModel(n))
        assert s.capacity == n - 1
        # Ids at and past max_slots, and negatives, are never free and have version 0.
        q = np.array([n, n + 1, -1, 0, 1, n - 1, 32 * (-(-n // 32)), -33], np.int32)
        np.testing.assert_array_equal(np.asarray(IS_FREE(s, q)), [False, False, False, False, True, True, False, False])
        np.testing.assert_array_equal(np.asarray(VERSION(s, q)), np.zeros(8, np.int32))
    for bad in (1, 0, -3):
        with pytest.raises(InvalidArgument, match=re.escape(f"max_slots={bad}")):
            SlotAllocator.create(bad)


@pytest.mark.parametrize("n", [2, 33, 70])
def test_alloc_order_fills_every_slot_then_fails(n):
    """Successive allocs hand out 1, 2, ..., n-1 across word boundaries, each
    version 1; then the allocator is full."""
    s = SlotAllocator.create(n)
    got = []
    for _ in range(n - 1):
        s, slot, ok = ALLOC(s)
        assert bool(ok)
        got.append(int(slot))
    assert got == list(range(1, n))
    np.testing.assert_array_equal(np.asarray(s.versions), [0] + [1] * (n - 1))
    before = snapshot(s)
    s2, slot, ok = ALLOC(s)
    assert not bool(ok) and int(slot) == -1
    chex.assert_trees_all_equal(before, s2, strict=True)
    assert int(FREE_COUNT(s2)) == 0


def test_occupy_keeps_version_and_realloc_bumps_it():
    s = SlotAllocator.create(70)
    s, slots = s.alloc_many_or_raise(40)
    s = s.free_or_raise([33, 5])
    np.testing.assert_array_equal(np.asarray(s.version(np.array([5, 33]))), [1, 1])
    s = s.occupy_or_raise([33])  # cached contents reused: version unchanged
    assert int(s.version(33)) == 1 and not bool(s.is_free(33))
    s, slot = s.alloc_or_raise()  # 5 is the lowest free slot: new owner
    assert slot == 5 and int(s.version(5)) == 2


def test_free_accepts_any_shape_and_padding():
    s = SlotAllocator.create(100)
    s, slots = s.alloc_many_or_raise(10)
    s = s.free_or_raise(np.array([[3, -1], [-1, 7], [9, -1]]))
    np.testing.assert_array_equal(np.asarray(s.is_free(np.array([3, 7, 9, 4]))), [True, True, True, False])
    s = s.free_or_raise([])  # nothing given: a no-op that succeeds
    s = s.free_or_raise([-1, -1])
    assert int(s.free_count) == 99 - 10 + 3


# ---------------------------------------------------------------- host errors


def _full_but(n: int, free: int) -> SlotAllocator:
    s = SlotAllocator.create(n)
    s, _ = s.alloc_many_or_raise(n - 1 - free)
    assert int(s.free_count) == free
    return s


def test_alloc_many_or_raise_oom_numbers():
    s = _full_but(70, 3)
    before = snapshot(s)
    with pytest.raises(KVCacheOOM) as info:
        s.alloc_many_or_raise(5)
    e = info.value
    assert str(e) == "KV cache OOM: requested 5 slots, 3 available (of 69 total)"
    assert (e.requested, e.available, e.total, e.unit) == (5, 3, 69, "slots")
    assert isinstance(e, KVCacheError)
    chex.assert_trees_all_equal(before, s, strict=True)
    # Three is exactly enough, and leaves the allocator full.
    s2, slots = s.alloc_many_or_raise(3)
    np.testing.assert_array_equal(slots, [67, 68, 69])
    assert int(s2.free_count) == 0


def test_alloc_many_or_raise_above_capacity_and_zero():
    s = SlotAllocator.create(100)
    with pytest.raises(KVCacheOOM, match=re.escape("requested 200 slots, 99 available (of 99 total)")):
        s.alloc_many_or_raise(200)
    s2, slots = s.alloc_many_or_raise(0)
    assert slots.shape == (0,)
    chex.assert_trees_all_equal(s, s2, strict=True)
    s3, slots = s.alloc_many_or_raise(99)
    np.testing.assert_array_equal(slots, np.arange(1, 100))


def test_alloc_many_or_raise_far_above_capacity_is_cheap():
    """Refused on the host: no program with a static max_k of 2**40 is built
    (before the fix, 10**8 took 11 s and 2.9 GB, and >= 2**30 + 1 raised
    OverflowError instead of KVCacheOOM)."""
    s = _full_but(70, 3)
    for k in (70, 2**30 + 1, 10**12):
        with pytest.raises(KVCacheOOM) as info:
            s.alloc_many_or_raise(k)
        assert (info.value.requested, info.value.available, info.value.total) == (k, 3, 69)


def test_alloc_many_or_raise_negative():
    s = SlotAllocator.create(5)
    with pytest.raises(InvalidArgument, match=r"\(-1\)"):
        s.alloc_many_or_raise(-1)


def test_alloc_or_raise_when_full():
    s = _full_but(5, 0)
    before = snapshot(s)
    with pytest.raises(KVCacheOOM) as info:
        s.alloc_or_raise()
    assert str(info.value) == "KV cache OOM: requested 1 slots, 0 available (of 4 total)"
    assert (info.value.requested, info.value.available, info.value.total) == (1, 0, 4)
    chex.assert_trees_all_equal(before, s, strict=True)


@pytest.mark.parametrize(
    "ids, bad",
    [([0], [0]), ([3, 70], [70]), ([-5, 4, 71, 2**20], [-5, 71, 2**20]), ([70, 70, 0], [0, 70])],
)
def test_free_or_raise_invalid_id(ids, bad):
    s = _full_but(70, 0)
    before = snapshot(s)
    with pytest.raises(InvalidId) as info:
        s.free_or_raise(ids)
    assert info.value.ids == sorted(bad)
    msg = str(info.value)
    assert "free: slots" in msg and "outside [1, 70)" in msg
    assert f"[{', '.join(map(str, sorted(bad)))}]" in msg
    assert isinstance(info.value, IndexError)
    chex.assert_trees_all_equal(before, s, strict=True)


def test_free_or_raise_double_free():
    s = SlotAllocator.create(70)
    s, _ = s.alloc_many_or_raise(50)
    s = s.free_or_raise([10, 45])
    before = snapshot(s)
    with pytest.raises(DoubleFree) as info:
        s.free_or_raise([3, 45, 10, -1])  # 10 and 45 are already free
    assert info.value.ids == [10, 45]
    assert "[10, 45]" in str(info.value) and "already free" in str(info.value)
    chex.assert_trees_all_equal(before, s, strict=True)
    with pytest.raises(DoubleFree) as info:
        s.free_or_raise([60])  # never allocated
    assert info.value.ids == [60]
    with pytest.raises(DoubleFree) as info:
        s.free_or_raise([33, 7, 33])  # both held, 33 named twice
    assert info.value.ids == [33]
    assert "[33]" in str(info.value) and "more than once" in str(info.value)
    chex.assert_trees_all_equal(before, s, strict=True)
    # Bit 31 + bit 31 overflows the word in the device duplicate check.
    with pytest.raises(DoubleFree) as info:
        s.free_or_raise([31, 31])
    assert info.value.ids == [31]
    chex.assert_trees_all_equal(before, s, strict=True)


def test_occupy_or_raise_errors():
    s = SlotAllocator.create(100)
    s, _ = s.alloc_many_or_raise(20)
    before = snapshot(s)
    with pytest.raises(InvalidId) as info:
        s.occupy_or_raise([50, 12, 7])  # 12 and 7 are taken
    assert info.value.ids == [7, 12]
    assert "occupy: taken slots [7, 12]" in str(info.value)
    with pytest.raises(InvalidId) as info:
        s.occupy_or_raise([64, 64])
    assert info.value.ids == [64]
    assert "[64]" in str(info.value) and "more than once" in str(info.value)
    with pytest.raises(InvalidId) as info:
        s.occupy_or_raise([0, 100, 50])
    assert info.value.ids == [0, 100]
    assert "outside [1, 100)" in str(info.value) and str(info.value).startswith("occupy: slots")
    chex.assert_trees_all_equal(before, s, strict=True)


def test_error_preview_is_truncated():
    s = SlotAllocator.create(100)
    with pytest.raises(DoubleFree) as info:
        s.free_or_raise(list(range(1, 21)))
    assert info.value.ids == list(range(1, 21))
    assert "[1, 2, 3, 4, 5, 6, 7, 8, ... (20 in all)]" in str(info.value)


# ------------------------------------------------------------- lax.scan run

SCAN_STEPS = 1000
SCAN_IDS = 2  # per step: alloc_many(k <= 2), free(2 ids), occupy(2 ids)


def _schedule(n: int, seed: int):
    """A random valid schedule and its replay in the model.

    Step t: ``alloc_many(k[t], max_k=2)``, then ``free(frees[t])``, then
    ``occupy(occupies[t])``; the ids are drawn from the model's state at that
    point, so every op is valid and every ``ok`` must be True.
    """
    rng = np.random.default_rng(seed)
    model = SlotModel(n)
    ks = np.zeros(SCAN_STEPS, np.int32)
    frees = np.full((SCAN_STEPS, SCAN_IDS), -1, np.int32)
    occupies = np.full((SCAN_STEPS, SCAN_IDS), -1, np.int32)
    allocated = np.full((SCAN_STEPS, SCAN_IDS), -1, np.int32)
    target = rng.integers(1, n)  # drift the occupancy around a moving target
    for t in range(SCAN_STEPS):
        if t % 100 == 0:
            target = rng.integers(0, n)
        k = int(min(rng.integers(0, SCAN_IDS + 1), len(model.free)))
        got = model.alloc_many(k, SCAN_IDS)
        ks[t] = k
        allocated[t, :k] = got
        taken = sorted(model.taken)
        nf = int(min(rng.integers(0, SCAN_IDS + 1) + (len(taken) > target), SCAN_IDS, len(taken)))
        f = rng.choice(taken, nf, replace=False) if nf else []
        frees[t, rng.permutation(SCAN_IDS)[:nf]] = f
        assert model.free_slots(frees[t])
        free = sorted(model.free)
        no = int(min(rng.choice([0, 0, 0, 1, 2]), len(free)))
        o = rng.choice(free, no, replace=False) if no else []
        occupies[t, rng.permutation(SCAN_IDS)[:no]] = o
        assert model.occupy(occupies[t])
    return ks, frees, occupies, allocated, model


@jax.jit
def _run_scan(state, ks, frees, occupies):
    def step(s, xs):
        k, f, o = xs
        s, got, ok_a = s.alloc_many(k, max_k=SCAN_IDS)
        s, ok_f = s.free(f)
        s, ok_o = s.occupy(o)
        return s, (got, ok_a, ok_f, ok_o)

    return jax.lax.scan(step, state, (ks, frees, occupies))


@pytest.mark.parametrize("n", [70, 100])
def test_thousand_steps_in_one_scan(n):
    seed = np.random.SeedSequence().entropy % 2**32  # fresh each run, reported on failure
    ks, frees, occupies, allocated, model = _schedule(n, seed)
    assert ks.sum() > 300 and (frees != -1).sum() > 300 and (occupies != -1).sum() > 100, seed
    final, (got, ok_a, ok_f, ok_o) = _run_scan(SlotAllocator.create(n), ks, frees, occupies)
    assert np.asarray(ok_a).all() and np.asarray(ok_f).all() and np.asarray(ok_o).all(), f"seed={seed}"
    np.testing.assert_array_equal(np.asarray(got), allocated, err_msg=f"seed={seed}")
    check_state(final, model)
    assert max(model.versions) > 1, seed  # slots were reused through alloc


def test_machine_uses_loaded_profile():
    from hypothesis import settings

    assert TestSlotMachine.settings.max_examples == settings.default.max_examples
    assert TestSlotMachine.settings.stateful_step_count == settings.default.stateful_step_count


# ------------------------------------------- ids that int32 cannot hold


@pytest.mark.parametrize("op", ["free", "occupy"])
def test_or_raise_id_beyond_int32_is_rejected(op):
    """Regression: the host path used to wrap 2**32 + 5 to slot 5 (freeing it)."""
    s = SlotAllocator.create(70)
    s, _ = s.alloc_many_or_raise(10)
    before = snapshot(s)
    for bad in (2**32 + 5, 2**32 + 40, -(2**32) + 5):
        with pytest.raises(InvalidId) as info:
            getattr(s, f"{op}_or_raise")([bad])
        assert info.value.ids == [bad] and str(bad) in str(info.value)
    chex.assert_trees_all_equal(before, s, strict=True)


# ---------------------------------------------------------------------- jit and eager agree


class SlotAllocatorVariantsTest(chex.TestCase):
    """``alloc`` / ``alloc_many`` / ``free`` give the same results under
    ``jax.jit`` and eagerly (``chex.variants``), with the documented shapes."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_alloc_free_versions(self):
        alloc = self.variant(lambda s: s.alloc())
        alloc_many = self.variant(lambda s, k: s.alloc_many(k, max_k=4))
        free = self.variant(lambda s, slots: s.free(slots))
        state = SlotAllocator.create(8)
        state, slot, ok = alloc(state)
        chex.assert_shape((slot, ok), ())
        assert bool(ok) and int(slot) == 1
        state, slots, ok = alloc_many(state, jnp.int32(2))
        chex.assert_shape(slots, (4,))
        assert bool(ok) and np.asarray(slots).tolist() == [2, 3, -1, -1]
        state, ok = free(state, jnp.array([1, 3, -1], jnp.int32))
        assert bool(ok) and np.asarray(state.is_free(jnp.array([1, 2, 3]))).tolist() == [True, False, True]
        state, slot, ok = alloc(state)
        assert bool(ok) and int(slot) == 1 and int(state.version(1)) == 2  # handed out again: version bumped
        before = state
        state, ok = free(state, jnp.array([3, 3], jnp.int32))  # double free: nothing changes
        assert not bool(ok)
        chex.assert_trees_all_equal(before, state, strict=True)
