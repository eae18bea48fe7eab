"""ReqToTokenPool: a stateful property test against a plain-Python model (a
dict row -> list of token indices), the host error paths, and a ``lax.scan``
of continuous-batching decode steps.

Device ops are called through the module-level jitted functions below with
fixed argument shapes, so each op compiles once per pool shape.
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

from jaxkv import DoubleFree, InvalidArgument, InvalidId, KVCacheOOM, ReqToTokenPool, make_req_to_token_pool
from tests.util import assert_all_or_nothing

CONFIGS = ((5, 12), (7, 33), (1, 3))  # (max_reqs, max_context_len)
MAX_N = 8  # static max_n of every alloc call (> every max_reqs above)
IDS_LEN = 8  # free id arrays are padded with -1 to this length
B, W = 4, 4  # write batch: rows/starts/lengths [B], values [B, W]

ALLOC = jax.jit(ReqToTokenPool.alloc, static_argnames=("max_n",))
FREE = jax.jit(ReqToTokenPool.free)
WRITE = jax.jit(ReqToTokenPool.write)
AVAILABLE = jax.jit(ReqToTokenPool.available_size)

INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------- model


class ReqModel:
    """Seed 002 in plain Python: held rows map to their positions' token indices."""

    def __init__(self, max_reqs: int, max_context_len: int):
        self.max_reqs = max_reqs
        self.ctx = max_context_len
        self.rows: dict[int, list[int]] = {}

    @property
    def free(self) -> list[int]:
        return [r for r in range(1, self.max_reqs + 1) if r not in self.rows]

    def alloc(self, n: int, max_n: int) -> list[int] | None:
        if n < 0 or n > max_n or n > len(self.free):
            return None
        got = self.free[:n]
        for r in got:
            self.rows[r] = [0] * self.ctx
        return got

    def free_rows(self, ids) -> bool:
        given = [int(i) for i in ids if i != -1]
        if len(set(given)) != len(given) or not all(r in self.rows for r in given):
            return False
        for r in given:
            del self.rows[r]
        return True

    def write(self, rows, starts, values, lengths) -> bool:
        width = len(values[0])
        for r, s, n in zip(rows, starts, lengths):
            if r == -1:
                continue
            if r not in self.rows or s < 0 or not 0 <= n <= width or s + n > self.ctx:
                return False
        for r, s, v, n in zip(rows, starts, values, lengths):
            if r != -1:
                self.rows[r][s : s + n] = [int(x) for x in v[:n]]
        return True

    def table(self) -> np.ndarray:
        t = np.zeros((self.max_reqs + 1, self.ctx), np.int32)
        for r, vals in self.rows.items():
            t[r] = vals
        return t


def check_pool(pool: ReqToTokenPool, model: ReqModel) -> None:
    table = np.asarray(pool.req_to_token)
    assert table.dtype == np.int32 and table.shape == (model.max_reqs + 1, model.ctx)
    assert pool.size == model.max_reqs and pool.max_context_len == model.ctx
    np.testing.assert_array_equal(table, model.table())
    assert not table[0].any(), "null row 0 was written"
    free = model.free
    assert not table[free].any(), "a free row is not all zeros"
    counts = np.asarray(pool.rows.ref_counts)
    expected = np.zeros(model.max_reqs + 1, np.int32)
    expected[sorted(model.rows)] = 1
    np.testing.assert_array_equal(counts, expected)
    assert pool.rows.lowest_first and pool.rows.num_blocks == model.max_reqs + 1
    assert int(pool.rows.num_free) == int(AVAILABLE(pool)) == len(free)
    assert len(free) + len(model.rows) == pool.size


def snapshot(tree):
    """A host copy of a pytree (same treedef), to show nothing changed later."""
    return jax.tree_util.tree_map(np.array, tree)


# ---------------------------------------------------------- stateful machine

token = st.integers(-(2**31), INT32_MAX)


class ReqToTokenMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config):
        self.pool = make_req_to_token_pool(*config)
        self.model = ReqModel(*config)

    # -- helpers

    def _distinct(self, data, pool, max_n, label):
        pool = sorted(pool)
        return data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=max_n), label=label) if pool else []

    def _bad_row(self, data) -> int:
        n = self.model.max_reqs
        return data.draw(st.sampled_from([0, -2, n + 1, n + 2, 2**20, INT32_MAX, -(2**31)]), label="bad row")

    def _lanes(self, data, k, length) -> np.ndarray:
        return np.asarray(data.draw(st.permutations(range(length)), label="lanes")[:k], int)

    def _free(self, ids):
        before = self.pool
        expected = self.model.free_rows(ids)
        after, ok = FREE(before, ids)
        assert bool(ok) == expected, f"free {ids.tolist()}: ok={bool(ok)} model={expected}"
        if not expected:
            chex.assert_trees_all_equal(before, after, strict=True)
        self.pool = after

    def _valid_write(self, data, min_rows: int = 0):
        """A valid batched write of distinct held rows; padding lanes carry
        garbage starts / lengths that must be ignored."""
        ctx = self.model.ctx
        rows = np.full(B, -1, np.int32)
        starts = np.asarray(data.draw(st.lists(st.integers(-(2**31), INT32_MAX), min_size=B, max_size=B), label="pad starts"), np.int32)
        lengths = np.asarray(data.draw(st.lists(st.integers(-(2**31), INT32_MAX), min_size=B, max_size=B), label="pad lengths"), np.int32)
        active = data.draw(st.lists(st.sampled_from(sorted(self.model.rows)), unique=True, min_size=min_rows, max_size=B), label="rows") if self.model.rows else []
        lanes = self._lanes(data, len(active), B)
        for lane, r in zip(lanes, active):
            n = data.draw(st.integers(0, min(W, ctx)), label="length")
            rows[lane], lengths[lane] = r, n
            starts[lane] = data.draw(st.integers(0, ctx - n), label="start")
        values = np.asarray(data.draw(st.lists(token, min_size=B * W, max_size=B * W), label="values"), np.int32).reshape(B, W)
        return rows, starts, values, lengths, lanes

    def _write(self, rows, starts, values, lengths):
        before = self.pool
        expected = self.model.write(rows.tolist(), starts.tolist(), values.tolist(), lengths.tolist())
        after, ok = WRITE(before, rows, starts, values, lengths)
        assert bool(ok) == expected, (
            f"write rows={rows.tolist()} starts={starts.tolist()} lengths={lengths.tolist()}: "
            f"ok={bool(ok)} model={expected}"
        )
        if not expected:
            chex.assert_trees_all_equal(before, after, strict=True)
        self.pool = after

    # -- alloc

    @rule(n=st.one_of(st.integers(0, 3), st.integers(-3, MAX_N + 3)))
    def alloc(self, n):
        before = self.pool
        expected = self.model.alloc(n, MAX_N)
        after, ids, ok = ALLOC(before, n, max_n=MAX_N)
        assert_all_or_nothing(before, after, ids, ok, expected, MAX_N)
        self.pool = after

    @precondition(lambda self: self.model.free)
    @rule(n=st.integers(1, 3))
    def alloc_some(self, n):
        """A few rows, clamped to what is free: always succeeds."""
        self.alloc(min(n, len(self.model.free)))

    @rule(extra=st.integers(0, 2))
    def alloc_all_free_plus(self, extra):
        """Exactly the free count succeeds (and fills the pool); more fails."""
        n = len(self.model.free) + extra
        before = self.pool
        expected = self.model.alloc(n, MAX_N)
        assert (expected is None) == (extra > 0)
        after, ids, ok = ALLOC(before, n, max_n=MAX_N)
        assert bool(ok) == (extra == 0)
        if extra:
            chex.assert_trees_all_equal(before, after, strict=True)
        else:
            np.testing.assert_array_equal(np.asarray(ids)[:n], expected)
        self.pool = after

    # -- free

    @rule(data=st.data(), kind=st.sampled_from(["held", "with a free row", "a row twice", "a bad row"]))
    def free(self, data, kind):
        """Free distinct held rows (-1 padded at random lanes), or that plus one
        corruption, which must make the whole free fail."""
        ids = self._distinct(data, self.model.rows, IDS_LEN - 2, "held rows")
        if kind == "with a free row" and self.model.free:
            ids.append(data.draw(st.sampled_from(self.model.free), label="free row"))
        elif kind == "a row twice" and self.model.rows:
            dup = data.draw(st.sampled_from(sorted(self.model.rows)), label="dup")
            ids = [r for r in ids if r != dup] + [dup, dup]
        elif kind == "a bad row":
            ids.append(self._bad_row(data))
        out = np.full(IDS_LEN, -1, np.int32)
        out[self._lanes(data, len(ids), IDS_LEN)] = ids
        self._free(out)

    # -- write

    @rule(data=st.data())
    def write_valid(self, data):
        rows, starts, values, lengths, _ = self._valid_write(data)
        self._write(rows, starts, values, lengths)

    @rule(data=st.data(), kind=st.sampled_from(["free row", "bad row"]))
    def write_to_row_not_held(self, data, kind):
        """A valid write plus one lane naming a free / out-of-range row: the
        whole write must fail."""
        rows, starts, values, lengths, _ = self._valid_write(data)
        lane = data.draw(st.sampled_from([i for i in range(B) if rows[i] == -1] or list(range(B))), label="lane")
        if kind == "free row" and self.model.free:
            rows[lane] = data.draw(st.sampled_from(self.model.free), label="free row")
        else:
            rows[lane] = self._bad_row(data)
        starts[lane], lengths[lane] = 0, data.draw(st.integers(0, min(W, self.model.ctx)), label="length")
        self._write(rows, starts, values, lengths)

    @precondition(lambda self: self.model.rows)
    @rule(
        data=st.data(),
        kind=st.sampled_from(["negative start", "past end", "length > width", "negative length", "start overflow"]),
    )
    def write_out_of_bounds(self, data, kind):
        """A valid write with one active lane's start / length corrupted: the
        whole write must fail."""
        rows, starts, values, lengths, lanes = self._valid_write(data, min_rows=1)
        ctx = self.model.ctx
        lane = data.draw(st.sampled_from(list(lanes)), label="lane")
        if kind == "negative start":
            starts[lane] = data.draw(st.sampled_from([-1, -2, -(2**31)]), label="start")
        elif kind == "past end":
            lengths[lane] = data.draw(st.integers(1, min(W, ctx)), label="length")
            starts[lane] = data.draw(st.integers(ctx - int(lengths[lane]) + 1, ctx + 3), label="start")
        elif kind == "length > width":
            lengths[lane] = data.draw(st.sampled_from([W + 1, W + 5, INT32_MAX]), label="length")
            starts[lane] = 0
        elif kind == "negative length":
            lengths[lane] = data.draw(st.sampled_from([-1, -3, -(2**31)]), label="length")
        else:  # start + length wraps around int32
            lengths[lane] = data.draw(st.integers(1, min(W, ctx)), label="length")
            starts[lane] = data.draw(st.integers(2**31 - int(lengths[lane]), INT32_MAX), label="start")
        self._write(rows, starts, values, lengths)

    @rule(data=st.data())
    def write_default_lengths(self, data):
        """``lengths=None`` writes all ``W`` values (fails if they don't fit)."""
        rows, starts, values, _, lanes = self._valid_write(data)
        ctx = self.model.ctx
        for lane in lanes:
            starts[lane] = data.draw(st.integers(0, max(ctx - W, 0) + 1), label="start")
        before = self.pool
        expected = self.model.write(rows.tolist(), starts.tolist(), values.tolist(), [W] * B)
        after, ok = WRITE(before, rows, starts, values)
        assert bool(ok) == expected
        if not expected:
            chex.assert_trees_all_equal(before, after, strict=True)
        self.pool = after

    @rule()
    def clear(self):
        self.pool = self.pool.clear()
        self.model = ReqModel(self.model.max_reqs, self.model.ctx)

    @invariant()
    def matches_model(self):
        if hasattr(self, "pool"):
            check_pool(self.pool, self.model)


TestReqToTokenMachine = ReqToTokenMachine.TestCase


def test_machine_uses_loaded_profile():
    from hypothesis import settings

    assert TestReqToTokenMachine.settings.max_examples == settings.default.max_examples
    assert TestReqToTokenMachine.settings.stateful_step_count == settings.default.stateful_step_count


# ------------------------------------------------------------ basic behaviour


def test_create_and_factory():
    pool = make_req_to_token_pool(4, 10)
    chex.assert_trees_all_equal(ReqToTokenPool.create(4, 10), pool, strict=True)
    check_pool(pool, ReqModel(4, 10))
    assert pool.size == 4 and pool.max_context_len == 10
    for bad in ((0, 5), (3, 0), (-1, 4)):
        with pytest.raises(InvalidArgument, match=re.escape(f"max_reqs={bad[0]} and max_context_len={bad[1]}")):
            make_req_to_token_pool(*bad)


def test_clear_frees_and_zeroes_every_row():
    pool = ReqToTokenPool.create(3, 6)
    pool, rows = pool.alloc_or_raise(3)
    pool = pool.write_or_raise(2, 1, [5, 6, 7])
    cleared = pool.clear()
    chex.assert_trees_all_equal(ReqToTokenPool.create(3, 6), cleared, strict=True)


def test_write_scalar_row_and_1d_values():
    pool = ReqToTokenPool.create(3, 6)
    pool, rows = pool.alloc_or_raise(2)
    np.testing.assert_array_equal(rows, [1, 2])
    pool, ok = WRITE(pool, 2, 3, jnp.array([11, 12, 13], jnp.int32))
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(pool.req_to_token)[2], [0, 0, 0, 11, 12, 13])
    pool = pool.write_or_raise(1, 0, [])  # empty write at a valid start: a no-op
    pool = pool.write_or_raise(1, 6, [])  # ... also at the end of the row
    pool = pool.write_or_raise(1, 4, [8, 9])  # exactly up to max_context_len
    np.testing.assert_array_equal(np.asarray(pool.req_to_token)[1], [0, 0, 0, 0, 8, 9])
    # A row freed and handed out again comes back all zeros.
    pool = pool.free_or_raise([2])
    pool, rows = pool.alloc_or_raise(1)
    assert rows.tolist() == [2]
    assert not np.asarray(pool.req_to_token)[2].any()


# ---------------------------------------------------------------- host errors


def test_alloc_or_raise_oom_numbers():
    pool = ReqToTokenPool.create(3, 8)
    pool, rows = pool.alloc_or_raise(1)
    before = snapshot(pool)
    with pytest.raises(KVCacheOOM) as info:
        pool.alloc_or_raise(4)
    e = info.value
    assert str(e) == "KV cache OOM: requested 4 rows, 2 available (of 3 total)"
    assert (e.requested, e.available, e.total, e.unit) == (4, 2, 3, "rows")
    chex.assert_trees_all_equal(before, pool, strict=True)
    with pytest.raises(KVCacheOOM, match=re.escape("requested 3 rows, 2 available (of 3 total)")):
        pool.alloc_or_raise(3)
    pool2, rows = pool.alloc_or_raise(2)  # exactly the free count
    np.testing.assert_array_equal(rows, [2, 3])
    with pytest.raises(KVCacheOOM, match=re.escape("requested 1 rows, 0 available (of 3 total)")):
        pool2.alloc_or_raise()
    with pytest.raises(InvalidArgument, match=r"\(-2\)"):
        pool.alloc_or_raise(-2)
    pool3, rows = pool.alloc_or_raise(0)
    assert rows.shape == (0,)
    chex.assert_trees_all_equal(before, pool3, strict=True)


def test_alloc_or_raise_far_above_capacity_is_cheap():
    """A request far above capacity is refused on the host without building a
    program whose static max_n is that large."""
    pool = ReqToTokenPool.create(3, 8)
    with pytest.raises(KVCacheOOM) as info:
        pool.alloc_or_raise(10**12)
    assert (info.value.requested, info.value.available, info.value.total) == (10**12, 3, 3)


def _pool_with_row_2_free():
    pool = ReqToTokenPool.create(5, 8)
    pool, rows = pool.alloc_or_raise(5)
    pool = pool.write_or_raise(3, 2, [30, 31])
    return pool.free_or_raise([2])


@pytest.mark.parametrize("ids, bad", [([0], [0]), ([1, 6], [6]), ([-3, 5, 2**20], [-3, 2**20])])
def test_free_or_raise_invalid_id(ids, bad):
    pool = _pool_with_row_2_free()
    before = snapshot(pool)
    with pytest.raises(InvalidId) as info:
        pool.free_or_raise(ids)
    assert info.value.ids == bad
    msg = str(info.value)
    assert "release: row ids" in msg and "outside [1, 6)" in msg and f"[{', '.join(map(str, bad))}]" in msg
    chex.assert_trees_all_equal(before, pool, strict=True)


def _ints(e: Exception) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", str(e))]


def test_free_or_raise_double_free():
    pool = _pool_with_row_2_free()
    before = snapshot(pool)
    with pytest.raises(DoubleFree) as info:
        pool.free_or_raise([3, 2, -1])  # row 2 is free
    assert info.value.ids == [2]
    # The message names the row, how often it was released and its owners.
    assert str(info.value).startswith("release: double free") and _ints(info.value) == [2, 1, 0]
    with pytest.raises(DoubleFree) as info:
        pool.free_or_raise([3, 1, 3])  # row 3 named twice
    assert info.value.ids == [3]
    assert str(info.value).startswith("release: double free") and _ints(info.value) == [3, 2, 1]
    chex.assert_trees_all_equal(before, pool, strict=True)
    # Row 3's contents survived the failed frees; a good free zeroes them.
    np.testing.assert_array_equal(np.asarray(pool.req_to_token)[3, 2:4], [30, 31])
    pool = pool.free_or_raise(np.array([[3], [-1]]))
    assert not np.asarray(pool.req_to_token)[3].any()


@pytest.mark.parametrize("row", [0, 2, 6, -2, 2**20])
def test_write_or_raise_row_not_held(row):
    pool = _pool_with_row_2_free()
    before = snapshot(pool)
    with pytest.raises(InvalidId) as info:
        pool.write_or_raise(row, 0, [1, 2])
    assert info.value.ids == [row]
    assert str(info.value) == f"write to row {row}, which is not held (rows 1..5)"
    chex.assert_trees_all_equal(before, pool, strict=True)


@pytest.mark.parametrize(
    "start, n",
    [(6, 3), (8, 1), (-1, 2), (0, 9), (7, 2), (INT32_MAX, 1), (INT32_MAX - 2, 5)],
)
def test_write_or_raise_out_of_bounds(start, n):
    pool = _pool_with_row_2_free()
    before = snapshot(pool)
    with pytest.raises(InvalidArgument) as info:
        pool.write_or_raise(5, start, list(range(100, 100 + n)))  # 5: the last row
    assert str(info.value) == (
        f"write of {n} positions at start {start} to row 5: positions must lie in [0, 8)"
    )
    chex.assert_trees_all_equal(before, pool, strict=True)


# ------------------------------------------------------------- lax.scan run

SCAN_REQS, SCAN_CTX, SCAN_STEPS, SCAN_NEW = 8, 48, 400, 2


def _decode_schedule(seed: int):
    """Continuous batching in the model: each step admits up to 2 requests
    (lowest free rows), writes one token index per live request at its current
    length, then frees up to 2 requests that reached their target length."""
    rng = np.random.default_rng(seed)
    model = ReqModel(SCAN_REQS, SCAN_CTX)
    ns = np.zeros(SCAN_STEPS, np.int32)
    admitted = np.full((SCAN_STEPS, SCAN_NEW), -1, np.int32)
    rows = np.full((SCAN_STEPS, SCAN_REQS), -1, np.int32)
    starts = np.full((SCAN_STEPS, SCAN_REQS), -1, np.int32)
    values = np.zeros((SCAN_STEPS, SCAN_REQS, 1), np.int32)
    frees = np.full((SCAN_STEPS, SCAN_NEW), -1, np.int32)
    tables = np.zeros((SCAN_STEPS, SCAN_REQS + 1, SCAN_CTX), np.int32)
    length, target = {}, {}
    for t in range(SCAN_STEPS):
        n = int(min(rng.integers(0, SCAN_NEW + 1), len(model.free)))
        got = model.alloc(n, SCAN_NEW)
        ns[t], admitted[t, :n] = n, got
        for r in got:
            length[r], target[r] = 0, int(rng.integers(1, SCAN_CTX + 1))
        live = [r for r in length if length[r] < target[r]]
        lanes = rng.permutation(SCAN_REQS)[: len(live)]
        rows[t, lanes] = live
        starts[t, lanes] = [length[r] for r in live]
        values[t, lanes, 0] = rng.integers(1, 2**31 - 1, len(live))
        assert model.write(rows[t].tolist(), starts[t].tolist(), values[t].tolist(), [1] * SCAN_REQS)
        for r in live:
            length[r] += 1
        done = [r for r in length if length[r] == target[r]][:SCAN_NEW]
        frees[t, rng.permutation(SCAN_NEW)[: len(done)]] = done
        assert model.free_rows(frees[t])
        for r in done:
            del length[r], target[r]
        tables[t] = model.table()
    return (ns, rows, starts, values, frees), admitted, tables, model


@jax.jit
def _run_decode(pool, xs):
    def step(p, x):
        n, rows, starts, values, frees = x
        p, got, ok_a = p.alloc(n, max_n=SCAN_NEW)
        p, ok_w = p.write(rows, starts, values, jnp.ones_like(rows))
        p, ok_f = p.free(frees)
        return p, (got, ok_a & ok_w & ok_f, p.req_to_token)

    return jax.lax.scan(step, pool, xs)


def test_decode_steps_in_one_scan():
    seed = np.random.SeedSequence().entropy % 2**32  # fresh each run, reported on failure
    xs, admitted, tables, model = _decode_schedule(seed)
    ns, rows, _, _, frees = xs
    assert ns.sum() > 40 and (frees != -1).sum() > 30 and (rows != -1).sum() > 1000, seed
    final, (got, ok, history) = _run_decode(ReqToTokenPool.create(SCAN_REQS, SCAN_CTX), xs)
    assert np.asarray(ok).all(), f"seed={seed}: first failing step {np.flatnonzero(~np.asarray(ok))[:1]}"
    np.testing.assert_array_equal(np.asarray(got), admitted, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(history), tables, err_msg=f"seed={seed}")
    check_pool(final, model)


# ------------------------------------------- ids that int32 cannot hold


def test_free_or_raise_id_beyond_int32_is_rejected():
    """Regression: the host path used to wrap 2**32 + 1 to row 1 and free it."""
    pool = ReqToTokenPool.create(3, 8)
    pool, _ = pool.alloc_or_raise(1)
    before = snapshot(pool)
    for row in (2**32 + 1, -(2**32) + 1):
        with pytest.raises(InvalidId) as info:
            pool.free_or_raise([row])
        assert info.value.ids == [row] and str(row) in str(info.value)
    chex.assert_trees_all_equal(before, pool, strict=True)


@pytest.mark.parametrize("row, start, error", [(2**32 + 1, 0, InvalidId), (1, 2**40, InvalidArgument), (1, -(2**40), InvalidArgument)])
def test_write_or_raise_beyond_int32(row, start, error):
    """Regression: these used to raise OverflowError from jit argument parsing."""
    pool = ReqToTokenPool.create(3, 8)
    pool, _ = pool.alloc_or_raise(1)
    before = snapshot(pool)
    with pytest.raises(error) as info:
        pool.write_or_raise(row, start, [7])
    assert str(row if error is InvalidId else start) in str(info.value)
    chex.assert_trees_all_equal(before, pool, strict=True)


def test_write_or_raise_rejects_token_index_outside_int32():
    pool = ReqToTokenPool.create(3, 8)
    pool, _ = pool.alloc_or_raise(1)
    before = snapshot(pool)
    for values in ([3, -5], [2**31]):
        with pytest.raises(InvalidArgument) as info:
            pool.write_or_raise(1, 0, values)
        assert str(values[-1]) in str(info.value)
    chex.assert_trees_all_equal(before, pool, strict=True)
