"""Tests of BlockAllocator (stack mode and ``lowest_first`` mode).

* a hypothesis state machine against a plain-Python model (a dict id -> owners),
  covering succeeding and failing device ops and the host ``*_or_raise`` paths;
* the host error paths: exception type, numbers in the message, attributes;
* 1,000 acquire / incref / release steps inside one ``lax.scan`` under ``jit``,
  replayed against the Python model;
* duplicate releases of a shared block and incref / release round trips.

Device ops go through the module-level jitted functions below, always with the
same shapes (``MAX_N`` lanes, id arrays padded with -1 to ``ARG_LEN``), so each
allocator configuration compiles once.
"""

from __future__ import annotations

import collections
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv import BlockAllocator, DoubleFree, InvalidArgument, InvalidId, KVCacheOOM

NUM_BLOCKS = 13  # capacity 12
MAX_N = 5  # static lane count of every device acquire in the state machine
ARG_LEN = 8  # every release / incref argument is padded with -1 to this length

ACQ = jax.jit(BlockAllocator.acquire, static_argnames=("max_n",))
REL = jax.jit(BlockAllocator.release)
INC = jax.jit(BlockAllocator.incref)
REL_DISTINCT = jax.jit(lambda state, ids: state.release(ids, distinct=True))
UPD = jax.jit(BlockAllocator.update, static_argnames=("max_n", "distinct"))


# ----------------------------------------------------------------- the model


class BlockModel:
    """Plain-Python reference: ``counts[id]`` owners of each id 1..num_blocks-1."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.counts = {i: 0 for i in range(1, num_blocks)}

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def free(self) -> list[int]:
        return sorted(i for i, c in self.counts.items() if c == 0)

    def held(self) -> list[int]:
        return sorted(i for i, c in self.counts.items() if c > 0)

    def in_range(self, i: int) -> bool:
        return 1 <= i < self.num_blocks

    def acquire_ok(self, n: int, max_n: int) -> bool:
        return 0 <= n <= max_n and n <= len(self.free())

    def release_error(self, ids) -> tuple[type, list[int]] | None:
        """None if ``release(ids)`` succeeds, else (exception type, sorted offending ids)."""
        given_ = [int(i) for i in ids if i != -1]
        bad = sorted({i for i in given_ if not self.in_range(i)})
        if bad:
            return InvalidId, bad
        times = collections.Counter(given_)
        over = sorted(i for i, t in times.items() if t > self.counts[i])
        if over:
            return DoubleFree, over
        return None

    def incref_error(self, ids) -> tuple[type, list[int]] | None:
        given_ = [int(i) for i in ids if i != -1]
        bad = sorted({i for i in given_ if not self.in_range(i)})
        if bad:
            return InvalidId, bad
        free = sorted({i for i in given_ if self.counts[i] == 0})
        if free:
            return InvalidId, free
        return None

    def apply_acquire(self, ids) -> None:
        for i in ids:
            assert self.counts[int(i)] == 0, f"acquire handed out held block {i}"
            self.counts[int(i)] = 1

    def apply_release(self, ids) -> list[int]:
        """Drop one owner per occurrence; returns the ids that became free."""
        freed = []
        for i in ids:
            if i == -1:
                continue
            self.counts[int(i)] -= 1
            assert self.counts[int(i)] >= 0
            if self.counts[int(i)] == 0:
                freed.append(int(i))
        return freed

    def apply_incref(self, ids) -> None:
        for i in ids:
            if i != -1:
                self.counts[int(i)] += 1


def check_state(state: BlockAllocator, model: BlockModel) -> None:
    """Every documented invariant of ``state``, and agreement with ``model``."""
    nb = model.num_blocks
    assert state.num_blocks == nb
    counts = np.asarray(state.ref_counts)
    free_ids = np.asarray(state.free_ids)
    num_free = int(state.num_free)
    assert counts.dtype == np.int32 and counts.shape == (nb,)
    assert free_ids.dtype == np.int32 and free_ids.shape == (nb - 1,)
    assert np.asarray(state.num_free).dtype == np.int32 and np.asarray(state.num_free).shape == ()
    assert counts[0] == 0, "the null block gained an owner"
    assert (counts >= 0).all(), counts
    expected = np.array([model.counts[i] for i in range(1, nb)], np.int32)
    np.testing.assert_array_equal(counts[1:], expected, err_msg="ref counts differ from the model")
    held = int((counts[1:] > 0).sum())
    assert num_free + held == nb - 1, (num_free, held)
    assert num_free == len(model.free())
    assert int(state.num_used) == held
    if not state.lowest_first:
        stack = free_ids[:num_free]
        assert len(set(stack.tolist())) == num_free, f"free stack holds an id twice: {stack}"
        assert 0 not in stack.tolist(), "the null block is on the free stack"
        assert sorted(stack.tolist()) == model.free(), (sorted(stack.tolist()), model.free())


def padded(data, values, length=ARG_LEN) -> np.ndarray:
    """``values`` with -1 padding to ``length``, in a drawn order (padding interleaved)."""
    assert len(values) <= length
    arr = list(values) + [-1] * (length - len(values))
    return np.asarray(data.draw(st.permutations(arr), label="arg"), np.int32)


def draw_valid_release(data, model: BlockModel, max_len=ARG_LEN, min_size=1) -> list[int]:
    """A multiset of held ids, each at most as often as it is held."""
    held = model.held()
    if not held:
        return []
    picks = data.draw(st.lists(st.sampled_from(held), min_size=min(min_size, max_len), max_size=max_len), label="picks")
    left = dict(model.counts)
    out = []
    for i in picks:
        if left[i] > 0:
            left[i] -= 1
            out.append(i)
    return out


def draw_invalid_release(data, model: BlockModel, max_len=ARG_LEN) -> list[int]:
    """A release that must fail: a valid part plus one poison entry (or two copies)."""
    base = draw_valid_release(data, model, max_len - 1, min_size=0)
    kinds = ["zero", "past_end", "negative"]
    if model.free():
        kinds.append("free")
    held = model.held()
    if held and min(model.counts[i] for i in held) + 1 <= max_len:
        kinds.append("beyond_count")
    kind = data.draw(st.sampled_from(kinds), label="poison")
    if kind == "zero":
        poison = [0]
    elif kind == "past_end":
        poison = [data.draw(st.integers(model.num_blocks, model.num_blocks + 50))]
    elif kind == "negative":
        poison = [data.draw(st.integers(-1000, -2))]
    elif kind == "free":
        poison = [data.draw(st.sampled_from(model.free()))]
    else:  # one more release of a held id than it has owners
        i = data.draw(st.sampled_from([i for i in held if model.counts[i] + 1 <= max_len]))
        base = [j for j in base if j != i]
        poison = [i] * (model.counts[i] + 1)
    room = max_len - len(poison)
    return base[:room] + poison


# ----------------------------------------------------------- state machine


class BlockMachine(RuleBasedStateMachine):
    LOWEST_FIRST = False

    def __init__(self):
        super().__init__()
        self.state = BlockAllocator.create(NUM_BLOCKS, lowest_first=self.LOWEST_FIRST)
        self.model = BlockModel(NUM_BLOCKS)

    # -- device acquire

    def _acquire(self, n: int) -> None:
        before = self.state
        free_before = self.model.free()
        expect_ok = self.model.acquire_ok(n, MAX_N)
        state, ids, ok = ACQ(before, jnp.int32(n), max_n=MAX_N)
        ids = np.asarray(ids)
        assert ids.shape == (MAX_N,) and ids.dtype == np.int32
        assert bool(ok) == expect_ok, (n, free_before)
        if not expect_ok:
            chex.assert_trees_all_equal(before, state, strict=True)
            assert (ids == -1).all(), ids
            return
        got = ids[:n].tolist()
        assert (ids[n:] == -1).all(), ids
        assert len(set(got)) == n, f"acquire returned an id twice: {got}"
        assert set(got) <= set(free_before), (got, free_before)
        if self.LOWEST_FIRST:
            assert got == free_before[:n], f"not the {n} lowest free ids: {got} vs {free_before}"
        self.model.apply_acquire(got)
        self.state = state

    @rule(n=st.integers(1, MAX_N))
    def acquire(self, n):
        self._acquire(n)  # fails only when fewer than n blocks are free (n=0: host_acquire)

    @rule(data=st.data())
    def acquire_failing(self, data):
        free = len(self.model.free())
        kinds = ["above_max_n", "negative"] + (["oom"] if free < MAX_N else [])
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "oom":
            n = data.draw(st.integers(free + 1, MAX_N), label="n")
        elif kind == "above_max_n":
            n = data.draw(st.integers(MAX_N + 1, MAX_N + 100), label="n")
        else:
            n = data.draw(st.integers(-100, -1), label="n")
        assert not self.model.acquire_ok(n, MAX_N)
        self._acquire(n)

    # -- device release

    def _release(self, ids: np.ndarray) -> None:
        before = self.state
        expect = self.model.release_error(ids)
        state, ok = REL(before, ids)
        assert bool(ok) == (expect is None), (ids.tolist(), expect)
        if expect is not None:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        nonzero_before = set(self.model.held())
        freed = self.model.apply_release(ids.tolist())
        assert set(freed) <= nonzero_before
        self.state = state
        if not self.LOWEST_FIRST:
            # each freed id pushed once, nothing else pushed
            grew = int(state.num_free) - int(before.num_free)
            assert grew == len(set(freed)), (grew, freed)

    @precondition(lambda self: self.model.held())
    @rule(data=st.data())
    def release_valid(self, data):
        self._release(padded(data, draw_valid_release(data, self.model)))

    @rule(data=st.data())
    def release_invalid(self, data):
        vals = draw_invalid_release(data, self.model)
        assert self.model.release_error(vals) is not None
        self._release(padded(data, vals))

    @rule(data=st.data())
    def release_any(self, data):
        vals = data.draw(st.lists(st.integers(-2, NUM_BLOCKS), max_size=ARG_LEN), label="ids")
        self._release(padded(data, vals))

    # -- device incref

    def _incref(self, ids: np.ndarray) -> None:
        before = self.state
        expect = self.model.incref_error(ids)
        state, ok = INC(before, ids)
        assert bool(ok) == (expect is None), (ids.tolist(), expect)
        if expect is not None:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        self.model.apply_incref(ids.tolist())
        # incref never touches the free stack
        np.testing.assert_array_equal(np.asarray(state.free_ids), np.asarray(before.free_ids))
        self.state = state

    @precondition(lambda self: self.model.held())
    @rule(data=st.data())
    def incref_valid(self, data):
        vals = data.draw(st.lists(st.sampled_from(self.model.held()), max_size=4), label="ids")
        self._incref(padded(data, vals))

    @rule(data=st.data())
    def incref_invalid(self, data):
        kinds = ["zero", "past_end", "negative"] + (["free"] if self.model.free() else [])
        kind = data.draw(st.sampled_from(kinds), label="poison")
        if kind == "zero":
            poison = 0
        elif kind == "past_end":
            poison = data.draw(st.integers(NUM_BLOCKS, NUM_BLOCKS + 5))
        elif kind == "negative":
            poison = -2
        else:
            poison = data.draw(st.sampled_from(self.model.free()))
        held = self.model.held()
        vals = data.draw(st.lists(st.sampled_from(held), max_size=3)) if held else []
        self._incref(padded(data, vals + [poison]))

    # -- release(distinct=True) and update (incref -> release -> acquire)

    @rule(data=st.data(), which=st.sampled_from(["valid", "invalid", "any"]))
    def release_distinct(self, data, which):
        if which == "valid":
            vals = sorted(set(draw_valid_release(data, self.model)))
        elif which == "invalid":
            vals = draw_invalid_release(data, self.model)
        else:
            vals = data.draw(st.lists(st.integers(-2, NUM_BLOCKS), max_size=ARG_LEN), label="ids")
        given_ = [v for v in vals if v != -1]
        expect_ok = self.model.release_error(vals) is None and len(set(given_)) == len(given_)
        before = self.state
        state, ok = REL_DISTINCT(before, padded(data, vals))
        assert bool(ok) == expect_ok, (vals, self.model.counts)
        if not expect_ok:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        freed = self.model.apply_release(vals)
        self.state = state
        if not self.LOWEST_FIRST:
            assert int(state.num_free) - int(before.num_free) == len(freed)

    @rule(data=st.data(), distinct=st.booleans())
    def update(self, data, distinct):
        held = self.model.held()
        inc = data.draw(st.lists(st.sampled_from(held), max_size=3), label="incref") if held else []
        if data.draw(st.booleans(), label="poison incref"):
            inc = inc + [data.draw(st.sampled_from([0, NUM_BLOCKS] + self.model.free()), label="bad")]
        after_incref = BlockModel(NUM_BLOCKS)
        after_incref.counts = dict(self.model.counts)
        incref_ok = self.model.incref_error(inc) is None
        if incref_ok:
            after_incref.apply_incref(inc)
        rel = draw_valid_release(data, after_incref) if data.draw(st.booleans()) else draw_invalid_release(data, after_incref)
        given_rel = [v for v in rel if v != -1]
        release_ok = after_incref.release_error(rel) is None and (not distinct or len(set(given_rel)) == len(given_rel))
        n = data.draw(st.integers(0, MAX_N), label="n")
        before = self.state
        state, ids, ok = UPD(before, padded(data, inc, 4), padded(data, rel), jnp.int32(n), max_n=MAX_N, distinct=distinct)
        ids = np.asarray(ids)
        if incref_ok and release_ok:
            after_incref.apply_release(rel)
        expect_ok = incref_ok and release_ok and n <= len(after_incref.free())
        assert bool(ok) == expect_ok, (inc, rel, n, self.model.counts)
        if not expect_ok:
            chex.assert_trees_all_equal(before, state, strict=True)
            assert (ids == -1).all()
            return
        got = ids[:n].tolist()
        assert (ids[n:] == -1).all() and len(set(got)) == n and set(got) <= set(after_incref.free())
        if self.LOWEST_FIRST:
            assert got == after_incref.free()[:n]
        after_incref.apply_acquire(got)
        self.model = after_incref
        self.state = state

    # -- host paths

    @rule(data=st.data())
    def host_acquire(self, data):
        n = data.draw(st.integers(-1, 8), label="n")
        before = self.state
        free = self.model.free()
        if n < 0:
            with pytest.raises(InvalidArgument, match=re.escape(str(n))):
                before.acquire_or_raise(n)
        elif n > len(free):
            with pytest.raises(KVCacheOOM) as exc:
                before.acquire_or_raise(n)
            e = exc.value
            assert (e.requested, e.available, e.total, e.unit) == (n, len(free), NUM_BLOCKS - 1, "blocks")
            assert str(e) == f"KV cache OOM: requested {n} blocks, {len(free)} available (of {NUM_BLOCKS - 1} total)"
        else:
            state, ids = before.acquire_or_raise(n)
            assert isinstance(ids, np.ndarray) and ids.shape == (n,)
            got = ids.tolist()
            assert len(set(got)) == n and set(got) <= set(free)
            if self.LOWEST_FIRST:
                assert got == free[:n]
            self.model.apply_acquire(got)
            self.state = state
            return
        chex.assert_trees_all_equal(before, self.state, strict=True)

    @rule(data=st.data(), which=st.sampled_from(["valid", "invalid", "any"]))
    def host_release(self, data, which):
        if which == "valid":
            vals = draw_valid_release(data, self.model)
        elif which == "invalid":
            vals = draw_invalid_release(data, self.model)
        else:
            vals = data.draw(st.lists(st.integers(-2, NUM_BLOCKS), max_size=ARG_LEN))
        before = self.state
        expect = self.model.release_error(vals)
        if expect is None:
            self.state = before.release_or_raise(vals)
            self.model.apply_release(vals)
            return
        etype, bad = expect
        with pytest.raises(etype) as exc:
            before.release_or_raise(vals)
        assert type(exc.value) is etype
        assert exc.value.ids == bad, (exc.value.ids, bad, vals)
        for i in bad[:8]:
            assert str(i) in str(exc.value)
        chex.assert_trees_all_equal(before, self.state, strict=True)

    @rule(data=st.data())
    def host_incref(self, data):
        vals = data.draw(st.lists(st.integers(-1, NUM_BLOCKS), max_size=4), label="ids")
        before = self.state
        expect = self.model.incref_error(vals)
        if expect is None:
            self.state = before.incref_or_raise(vals)
            self.model.apply_incref(vals)
            return
        with pytest.raises(InvalidId) as exc:
            before.incref_or_raise(vals)
        assert exc.value.ids == expect[1], (exc.value.ids, expect, vals)
        chex.assert_trees_all_equal(before, self.state, strict=True)

    # -- the rest

    @invariant()
    def invariants(self):
        note(f"counts={self.model.counts}")
        check_state(self.state, self.model)


class BlockLowestFirstMachine(BlockMachine):
    LOWEST_FIRST = True


TestBlockStackMachine = BlockMachine.TestCase
TestBlockLowestFirstMachine = BlockLowestFirstMachine.TestCase


# ------------------------------------------------------------- host errors


def test_create_rejects_fewer_than_one_block_and_one_block_hands_out_nothing():
    for nb in (0, -3):
        with pytest.raises(InvalidArgument, match=f"num_blocks={nb}"):
            BlockAllocator.create(nb)
    empty = BlockAllocator.create(1)  # only the null block: a manager with no host tier
    assert empty.capacity == 0
    with pytest.raises(KVCacheOOM, match=re.escape("requested 1 blocks, 0 available (of 0 total)")):
        empty.acquire_or_raise(1)
    assert empty.acquire_or_raise(0)[1].tolist() == []
    with pytest.raises(InvalidId):
        empty.release_or_raise([1])
    a = BlockAllocator.create(2)  # a single allocatable block
    a, ids = a.acquire_or_raise(1)
    assert ids.tolist() == [1]
    with pytest.raises(KVCacheOOM, match=re.escape("requested 1 blocks, 0 available (of 1 total)")):
        a.acquire_or_raise(1)


@pytest.mark.parametrize("lowest_first", [False, True])
def test_acquire_oom_message_and_attributes(lowest_first):
    a = BlockAllocator.create(8, lowest_first=lowest_first)  # 7 allocatable
    a, ids = a.acquire_or_raise(1)
    assert ids.tolist() == [1]
    with pytest.raises(KVCacheOOM) as exc:
        a.acquire_or_raise(10)
    e = exc.value
    assert str(e) == "KV cache OOM: requested 10 blocks, 6 available (of 7 total)"
    assert (e.requested, e.available, e.total, e.unit) == (10, 6, 7, "blocks")
    # the state we called it on is intact and still usable
    check_state(a, _model_from(a))
    a2, ids = a.acquire_or_raise(6)
    assert sorted(ids.tolist()) == [2, 3, 4, 5, 6, 7]
    with pytest.raises(KVCacheOOM, match=re.escape("requested 1 blocks, 0 available (of 7 total)")):
        a2.acquire_or_raise(1)
    with pytest.raises(InvalidArgument, match=re.escape("(-3)")):
        a.acquire_or_raise(-3)


def _model_from(state: BlockAllocator) -> BlockModel:
    m = BlockModel(state.num_blocks)
    counts = np.asarray(state.ref_counts)
    for i in range(1, state.num_blocks):
        m.counts[i] = int(counts[i])
    return m


@given(
    num_blocks=st.sampled_from([2, NUM_BLOCKS]),  # few shapes: each is a compile
    taken_frac=st.floats(0, 1),
    excess=st.integers(1, 4),
    lowest_first=st.booleans(),
)
def test_acquire_oom_numbers_random(num_blocks, taken_frac, excess, lowest_first):
    cap = num_blocks - 1
    taken = int(taken_frac * cap)
    a = BlockAllocator.create(num_blocks, lowest_first=lowest_first)
    a, _ = a.acquire_or_raise(taken)
    avail = cap - taken
    with pytest.raises(KVCacheOOM) as exc:
        a.acquire_or_raise(avail + excess)
    e = exc.value
    assert (e.requested, e.available, e.total) == (avail + excess, avail, cap)
    assert f"requested {avail + excess} blocks, {avail} available (of {cap} total)" in str(e)
    snap = jax.tree.map(np.array, a)
    chex.assert_trees_all_equal(snap, a, strict=True)
    a, ids = a.acquire_or_raise(avail)  # exactly what is left still succeeds
    assert int(a.num_free) == 0 and sorted(ids.tolist()) == list(range(taken + 1, num_blocks))


def assert_double_free_message(exc: DoubleFree, offenders) -> None:
    """For each (id, times released, owners): the three numbers appear, in that order."""
    msg = str(exc)
    assert msg.startswith("release: double free"), msg
    for i, times, owners in offenders:
        num = r"(?<![\d-]){}(?!\d)"
        pattern = ".*?".join(num.format(v) for v in (i, times, owners))
        assert re.search(pattern, msg, flags=re.S), (msg, i, times, owners)


@pytest.mark.parametrize("lowest_first", [False, True])
def test_release_error_paths(lowest_first):
    a = BlockAllocator.create(8, lowest_first=lowest_first)
    a, ids = a.acquire_or_raise(3)
    assert sorted(ids.tolist()) == [1, 2, 3]
    a = a.incref_or_raise([2])  # 2 has two owners
    snap = a

    # a free block
    with pytest.raises(DoubleFree) as exc:
        a.release_or_raise([1, 5])
    assert exc.value.ids == [5]
    assert_double_free_message(exc.value, [(5, 1, 0)])
    # a shared block once more than it is held, plus another over-release
    with pytest.raises(DoubleFree) as exc:
        a.release_or_raise([2, 3, 2, 2, 3])
    assert exc.value.ids == [2, 3]
    assert_double_free_message(exc.value, [(2, 3, 2), (3, 2, 1)])
    # the null block and ids past the end
    with pytest.raises(InvalidId) as exc:
        a.release_or_raise([1, 0])
    assert exc.value.ids == [0] and "ids [0] outside [1, 8)" in str(exc.value)
    with pytest.raises(InvalidId) as exc:
        a.release_or_raise([8, 1, 100, -7, 8])
    assert exc.value.ids == [-7, 8, 100] and "ids [-7, 8, 100] outside [1, 8)" in str(exc.value)
    assert isinstance(exc.value, IndexError)
    chex.assert_trees_all_equal(snap, a, strict=True)
    check_state(a, _model_from(a))

    # all of that left the state usable: the exact valid release succeeds
    a = a.release_or_raise([2, 2, 3, 1, -1])
    assert int(a.num_free) == 7 and not np.asarray(a.ref_counts).any()
    with pytest.raises(DoubleFree) as exc:
        a.release_or_raise([1])
    assert exc.value.ids == [1]
    assert_double_free_message(exc.value, [(1, 1, 0)])


@pytest.mark.parametrize("lowest_first", [False, True])
def test_incref_error_paths(lowest_first):
    a = BlockAllocator.create(6, lowest_first=lowest_first)
    a, _ = a.acquire_or_raise(2)  # 1, 2 held
    snap = a
    with pytest.raises(InvalidId) as exc:
        a.incref_or_raise([1, 4, 3, 4])
    assert exc.value.ids == [3, 4]
    assert "incref: free blocks [3, 4]" in str(exc.value)
    with pytest.raises(InvalidId) as exc:
        a.incref_or_raise([0, 1, 6])
    assert exc.value.ids == [0, 6] and "ids [0, 6] outside [1, 6)" in str(exc.value)
    chex.assert_trees_all_equal(snap, a, strict=True)
    a = a.incref_or_raise([1, 1, 2])
    assert np.asarray(a.ref_counts).tolist() == [0, 3, 2, 0, 0, 0]


def test_many_offending_ids_are_previewed():
    a = BlockAllocator.create(40)
    with pytest.raises(DoubleFree) as exc:
        a.release_or_raise(list(range(1, 21)))
    assert exc.value.ids == list(range(1, 21))
    msg = str(exc.value)
    assert "20" in msg and "in all" in msg, msg  # the count of offending ids
    assert not {"12", "19"} & set(re.findall(r"\d+", msg)), msg  # and only a preview of them


# --------------------------------------------------------------- lax.scan


def _scan_workload(seed: int, steps: int, batch: int, per_seq: int):
    rng = np.random.default_rng(seed)
    want = rng.random((steps, batch)) < rng.uniform(0.3, 0.6)
    finish = rng.random((steps, batch)) < rng.uniform(0.02, 0.05)
    finish |= (rng.random(steps) < 0.02)[:, None]  # sometimes the whole batch ends at once
    fork_src = np.where(rng.random((steps, batch)) < 0.5, rng.integers(0, batch, (steps, batch)), -1)
    return want, finish, fork_src.astype(np.int32)


def _make_scan(num_blocks: int, lowest_first: bool, batch: int, per_seq: int):
    def step(carry, xs):
        alloc, table, lens = carry
        want, finish, fork_src = xs
        # 1. finished sequences release all their blocks, in ONE call
        alloc, ok_rel = alloc.release(jnp.where(finish[:, None], table, -1))
        table = jnp.where(finish[:, None], -1, table)
        lens = jnp.where(finish, 0, lens)
        # 2. empty sequences fork a non-empty one: share its blocks (incref)
        src = jnp.clip(fork_src, 0, batch - 1)
        do_fork = (fork_src >= 0) & (lens == 0) & (lens[src] > 0)
        shared = jnp.where(do_fork[:, None], table[src], -1)
        alloc, ok_inc = alloc.incref(shared)
        table = jnp.where(do_fork[:, None], shared, table)
        lens = jnp.where(do_fork, lens[src], lens)
        # 3. sequences that want a block and have room get one, in ONE call
        need = want & (lens < per_seq)
        n = jnp.sum(need, dtype=jnp.int32)
        alloc, ids, ok_acq = alloc.acquire(n, max_n=batch)
        rank = jnp.cumsum(need) - 1
        new = jnp.where(need, ids[jnp.clip(rank, 0, batch - 1)], -1)
        rows = jnp.arange(batch)
        col = jnp.where(need, lens, per_seq)  # out of bounds -> dropped
        table = table.at[rows, col].set(new, mode="drop")
        lens = lens + need
        ys = (ids, n, ok_rel, ok_inc, ok_acq, alloc.num_free)
        return (alloc, table, lens), ys

    @jax.jit
    def run(alloc, want, finish, fork_src):
        table = jnp.full((batch, per_seq), -1, jnp.int32)
        lens = jnp.zeros((batch,), jnp.int32)
        return jax.lax.scan(step, (alloc, table, lens), (want, finish, fork_src))

    return run


@pytest.mark.parametrize("lowest_first,seed", [(False, 11), (True, 23)])
def test_scan_1000_steps_matches_python_replay(lowest_first, seed):
    batch, per_seq, steps = 8, 7, 1000
    num_blocks = batch * per_seq + 1  # exactly enough for every sequence to be full
    want, finish, fork_src = _scan_workload(seed, steps, batch, per_seq)
    run = _make_scan(num_blocks, lowest_first, batch, per_seq)
    alloc0 = BlockAllocator.create(num_blocks, lowest_first=lowest_first)
    (alloc, table, lens), (ids, ns, ok_rel, ok_inc, ok_acq, num_free) = run(alloc0, want, finish, fork_src)
    ids, ns, num_free = np.asarray(ids), np.asarray(ns), np.asarray(num_free)
    assert np.asarray(ok_rel).all() and np.asarray(ok_inc).all() and np.asarray(ok_acq).all()

    # replay in Python
    model = BlockModel(num_blocks)
    tab = [[] for _ in range(batch)]
    shared_releases = forks = 0
    for t in range(steps):
        fin = [b for b in range(batch) if finish[t, b]]
        released = [i for b in fin for i in tab[b]]
        shared_releases += len(released) - len(set(released))
        model.apply_release(released)
        for b in fin:
            tab[b] = []
        snapshot = [list(r) for r in tab]
        for b in range(batch):
            s = fork_src[t, b]
            if s >= 0 and not snapshot[b] and snapshot[s]:
                tab[b] = list(snapshot[s])
                model.apply_incref(snapshot[s])
                forks += 1
        need = [b for b in range(batch) if want[t, b] and len(tab[b]) < per_seq]
        assert ns[t] == len(need)
        got = ids[t, : len(need)].tolist()
        assert (ids[t, len(need):] == -1).all()
        free = model.free()
        assert len(set(got)) == len(got) and set(got) <= set(free), (t, got)
        if lowest_first:
            assert got == free[: len(need)], (t, got, free)
        model.apply_acquire(got)
        for b, i in zip(need, got):
            tab[b].append(i)
        assert num_free[t] == len(model.free()), t

    check_state(alloc, model)
    for b in range(batch):
        assert np.asarray(table)[b, : int(lens[b])].tolist() == tab[b]
    assert shared_releases > 10 and forks > 10, (shared_releases, forks)  # blocks were shared
    assert num_free.min() <= num_blocks // 4, num_free.min()  # and ran close to full


# ------------------------------------------------------- duplicates in release


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lowest_first", [False, True])
def test_release_shared_block_twice_in_one_call_frees_it_once(lowest_first, seed):
    rng = np.random.default_rng(seed)
    num_blocks = NUM_BLOCKS if seed % 2 else int(rng.integers(4, 30))
    a = BlockAllocator.create(num_blocks, lowest_first=lowest_first)
    a, held = a.acquire_or_raise(int(rng.integers(2, num_blocks)))
    # give back a random subset so the stack is not in creation order
    back = rng.permutation(held)[: int(rng.integers(0, len(held) - 1))]
    a = a.release_or_raise(back)
    held = np.setdiff1d(held, back)
    shared = int(rng.choice(held))
    a = a.incref_or_raise([shared])
    assert int(a.ref_count(shared)) == 2
    free_before = int(a.num_free)

    others = [int(i) for i in held if i != shared][: int(rng.integers(0, 3))]
    arg = [shared, shared] + others + [-1] * int(rng.integers(0, 4))
    arg = [int(x) for x in rng.permutation(arg)]
    arg += [-1] * (ARG_LEN - len(arg))  # fixed shape: REL compiles once
    a2, ok = REL(a, np.asarray(arg, np.int32))
    assert bool(ok)
    assert int(a2.num_free) == free_before + 1 + len(others)
    assert int(a2.ref_count(shared)) == 0
    if not lowest_first:
        stack = np.asarray(a2.free_ids)[: int(a2.num_free)].tolist()
        assert stack.count(shared) == 1, stack
        assert len(set(stack)) == len(stack)
    model = _model_from(a)
    model.apply_release(arg)
    check_state(a2, model)
    # the freed block is handed out again exactly once
    a3, ids = a2.acquire_or_raise(int(a2.num_free))
    assert sorted(ids.tolist()) == model.free()


@pytest.mark.parametrize("lowest_first", [False, True])
def test_incref_then_release_round_trips(lowest_first):
    rng = np.random.default_rng(7 + lowest_first)
    a = BlockAllocator.create(NUM_BLOCKS, lowest_first=lowest_first)
    a, held = a.acquire_or_raise(10)
    a = a.release_or_raise(held[::3])
    held = np.setdiff1d(held, held[::3])
    for _ in range(5):
        k = int(rng.integers(1, 8))
        ids = rng.choice(held, size=k, replace=True).astype(np.int32)
        pad = np.full(ARG_LEN, -1, np.int32)
        pad[:k] = ids
        b, ok = INC(a, pad)
        assert bool(ok)
        assert int(b.num_free) == int(a.num_free)
        c, ok = REL(b, rng.permutation(pad))
        assert bool(ok)
        chex.assert_trees_all_equal(a, c, strict=True)  # whole pytree, free stack included


def test_release_and_incref_ignore_padding_and_accept_any_shape():
    rc = jax.jit(BlockAllocator.ref_count)
    a = BlockAllocator.create(NUM_BLOCKS)
    a, ids = a.acquire_or_raise(4)
    b, ok = INC(a, np.asarray([[ids[0], -1], [-1, ids[1]]], np.int32))
    assert bool(ok)
    assert np.asarray(rc(b, ids)).tolist() == [2, 2, 1, 1]
    c, ok = REL(b, np.full((2, 2), -1, np.int32))
    assert bool(ok)
    chex.assert_trees_all_equal(b, c, strict=True)
    d, ok = REL(b, np.asarray([[ids[0], ids[0]], [ids[2], -1]], np.int32))
    assert bool(ok)
    assert np.asarray(rc(d, ids)).tolist() == [0, 2, 0, 1]
    assert int(d.num_free) == int(a.num_free) + 2
    assert np.asarray(rc(d, np.asarray([0, -1, NUM_BLOCKS, 99], np.int32))).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("lowest_first", [False, True])
def test_reset_and_stack_pop_order(lowest_first):
    a = BlockAllocator.create(NUM_BLOCKS, lowest_first=lowest_first)
    a, ids = a.acquire_or_raise(4)
    assert ids.tolist() == [1, 2, 3, 4]  # documented: the first pops return 1, 2, 3, ...
    a = a.incref_or_raise(ids[:2])
    r = a.reset()
    chex.assert_trees_all_equal(BlockAllocator.create(NUM_BLOCKS, lowest_first=lowest_first), r, strict=True)
    assert r.lowest_first == lowest_first and int(r.num_used) == 0


# ------------------------------------------------- regressions (bugs found and fixed)


# Regression (fixed): jaxkv._host.padded_ids casts int64 ids to int32 unchecked, so an
# id 2**32 + k wraps onto block k and the host path frees / shares a real block
@pytest.mark.parametrize("op", ["release", "incref"])
def test_host_paths_reject_ids_beyond_int32(op):
    a = BlockAllocator.create(9)
    a, _ = a.acquire_or_raise(3)
    with pytest.raises(InvalidId):
        if op == "release":
            a.release_or_raise([2**32 + 3])
        else:
            a.incref_or_raise([2**32 + 2])


# Regression (fixed): acquire_or_raise passed n to the device op before comparing it
# with the capacity, so n >= 2**31 raised OverflowError instead of KVCacheOOM (and a
# large n compiled a program with pow2(n) lanes just to fail).
def test_acquire_or_raise_huge_request_is_oom():
    a = BlockAllocator.create(9)
    with pytest.raises(KVCacheOOM, match=re.escape(f"requested {2**31} blocks, 8 available (of 8 total)")):
        a.acquire_or_raise(2**31)


# ---------------------------------------------------------------------- jit and eager agree


class BlockAllocatorVariantsTest(chex.TestCase):
    """The device ops give the same results traced under ``jax.jit`` and
    run eagerly (``chex.variants``), with the documented shapes."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_acquire_incref_release_round_trip(self):
        acquire = self.variant(lambda s, n: s.acquire(n, max_n=4))
        incref = self.variant(lambda s, ids: s.incref(ids))
        release = self.variant(lambda s, ids: s.release(ids))
        state = BlockAllocator.create(8, lowest_first=True)
        state, ids, ok = acquire(state, jnp.int32(3))
        chex.assert_shape(ids, (4,))
        chex.assert_shape(ok, ())
        assert bool(ok) and np.asarray(ids).tolist() == [1, 2, 3, -1]
        state, ok = incref(state, ids)
        assert bool(ok) and np.asarray(state.ref_count(ids[:3])).tolist() == [2, 2, 2]
        state, ok = release(state, jnp.concatenate([ids, ids]))
        assert bool(ok) and int(state.num_free) == 7
        before = state
        state, ids, ok = acquire(state, jnp.int32(8))  # more than free: nothing changes
        assert not bool(ok) and (np.asarray(ids) == -1).all()
        chex.assert_trees_all_equal(before, state, strict=True)
