"""Tests of TokenToKVPoolAllocator (token mode and page mode, ``need_sort`` on and
off) and of its host-side FreeGroup.

* a hypothesis state machine per configuration against a plain-Python model
  (the set of held pages), covering succeeding and failing device ops (OOM,
  non-multiple of page_size, above max_n, repeated index, null page, past the
  buffer, free page, partial-page frees) and the host paths;
* the host error paths: exception type, numbers in the message, attributes;
* alloc / free steps inside one ``lax.scan`` under ``jit`` in page mode,
  replayed against the Python model.

Device ops go through the module-level jitted functions, always with the same
shapes per configuration, so each configuration compiles once.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv import DoubleFree, FreeGroup, InvalidArgument, InvalidId, KVCacheOOM, TokenToKVPoolAllocator

ALLOC = jax.jit(TokenToKVPoolAllocator.alloc, static_argnames=("max_n",))
FREE = jax.jit(TokenToKVPoolAllocator.free)


# ----------------------------------------------------------------- the model


class TokenModel:
    """Plain-Python reference: the set of held pages (page p = indices p*ps .. p*ps+ps-1)."""

    def __init__(self, size: int, page_size: int):
        self.ps = page_size
        self.num_pages = size // page_size
        self.buffer_size = (self.num_pages + 1) * page_size
        self.held: set[int] = set()

    def free_pages(self) -> list[int]:
        return [p for p in range(1, self.num_pages + 1) if p not in self.held]

    def held_pages(self) -> list[int]:
        return sorted(self.held)

    def page_indices(self, p: int) -> list[int]:
        return list(range(p * self.ps, (p + 1) * self.ps))

    def alloc_ok(self, n: int, max_n: int) -> bool:
        # A partial last page is taken whole (pymllm): ceil(n / ps) pages.
        return 0 <= n <= max_n and -(-n // self.ps) <= len(self.free_pages())

    def free_error(self, indices) -> tuple[type, list[int]] | None:
        """None if ``free(indices)`` succeeds, else (type, sorted ``ids`` attribute)."""
        given = [int(i) for i in indices if i != -1]
        bad = sorted({i for i in given if not self.ps <= i < self.buffer_size})
        if bad:
            return InvalidId, bad
        dup = sorted({i for i in given if given.count(i) > 1})
        if dup:
            return DoubleFree, dup
        free = sorted({i // self.ps for i in given} - self.held)
        if free:
            return DoubleFree, free
        return None

    def apply_alloc(self, pages) -> None:
        for p in pages:
            assert p not in self.held, f"alloc handed out held page {p}"
            self.held.add(p)

    def apply_free(self, indices) -> None:
        for i in indices:
            if i != -1:
                self.held.discard(int(i) // self.ps)


def check_state(state: TokenToKVPoolAllocator, model: TokenModel, need_sort: bool) -> None:
    ps = model.ps
    assert state.page_size == ps and state.need_sort == need_sort
    assert state.size == model.num_pages * ps and state.buffer_size == model.buffer_size
    pages = state.pages
    counts = np.asarray(pages.ref_counts)
    assert counts.dtype == np.int32 and counts.shape == (model.num_pages + 1,)
    assert counts[0] == 0, "the null page gained an owner"
    expected = [1 if p in model.held else 0 for p in range(1, model.num_pages + 1)]
    assert counts[1:].tolist() == expected, (counts.tolist(), model.held_pages())
    num_free = int(pages.num_free)
    assert num_free == len(model.free_pages()) and num_free + len(model.held) == model.num_pages
    assert int(state.available_size()) == num_free * ps
    if not need_sort:
        stack = np.asarray(pages.free_ids)[:num_free].tolist()
        assert len(set(stack)) == len(stack), f"free stack holds a page twice: {stack}"
        assert sorted(stack) == model.free_pages()


def check_alloc_result(indices: np.ndarray, n: int, model: TokenModel, need_sort: bool) -> list[int]:
    """Checks the indices of a successful ``alloc(n)``; returns the pages taken,
    in order (the last one possibly named only in part: its first indices)."""
    ps = model.ps
    assert (indices[n:] == -1).all(), indices
    num_pages = -(-n // ps)
    got = np.full((num_pages * ps,), -1, np.int64)
    got[:n] = indices[:n]
    got = got.reshape(-1, ps)
    pages = (got[:, 0] // ps).tolist()
    for row, p in zip(got.tolist(), pages):
        expect = model.page_indices(p)
        assert row[: len([i for i in row if i != -1])] == expect[: len([i for i in row if i != -1])] and (
            row == expect or p == pages[-1]), f"page {p} handed out as {row}"
    assert len(set(pages)) == len(pages), f"a page handed out twice: {pages}"
    free = model.free_pages()
    assert set(pages) <= set(free), (pages, free)
    if need_sort:
        assert pages == free[: len(pages)], f"not the lowest free pages: {pages} vs {free}"
    return pages


def padded(data, values, length) -> np.ndarray:
    assert len(values) <= length
    arr = list(values) + [-1] * (length - len(values))
    return np.asarray(data.draw(st.permutations(arr), label="indices"), np.int32)


def draw_valid_free(data, model: TokenModel, max_len: int, min_pages: int = 1) -> list[int]:
    """Held pages, each named by a non-empty subset of its indices (partial-page frees)."""
    held = model.held_pages()
    if not held:
        return []
    pages = data.draw(
        st.lists(st.sampled_from(held), unique=True, min_size=min(min_pages, len(held)), max_size=len(held)),
        label="pages",
    )
    out: list[int] = []
    for p in pages:
        offs = data.draw(st.sets(st.integers(0, model.ps - 1), min_size=1), label="offsets")
        if len(out) + len(offs) > max_len:
            break
        out += [p * model.ps + o for o in sorted(offs)]
    return out


def draw_invalid_free(data, model: TokenModel, max_len: int) -> list[int]:
    """A valid free plus one poison entry, so that the whole call must fail."""
    base = draw_valid_free(data, model, max_len - 1)
    kinds = ["null_page", "past_end", "negative"]
    if base:
        kinds.append("repeat")
    if model.free_pages():
        kinds.append("free_page")
    kind = data.draw(st.sampled_from(kinds), label="poison")
    if kind == "null_page":
        poison = data.draw(st.integers(0, model.ps - 1))
    elif kind == "past_end":
        poison = data.draw(st.integers(model.buffer_size, model.buffer_size + 3 * model.ps))
    elif kind == "negative":
        poison = data.draw(st.integers(-50, -2))
    elif kind == "repeat":
        poison = data.draw(st.sampled_from(base))
    else:
        page = data.draw(st.sampled_from(model.free_pages()))
        poison = page * model.ps + data.draw(st.integers(0, model.ps - 1))
    return base + [poison]


# ----------------------------------------------------------- state machine


class TokenMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    NEED_SORT = True
    SIZE = 16
    MAX_N = 6  # static lanes of every device alloc
    ARG_LEN = 10  # every device free argument is padded with -1 to this length

    def __init__(self):
        super().__init__()
        self.state = TokenToKVPoolAllocator.create(self.SIZE, page_size=self.PAGE_SIZE, need_sort=self.NEED_SORT)
        self.model = TokenModel(self.SIZE, self.PAGE_SIZE)

    # -- device alloc

    def _alloc(self, n: int) -> None:
        before = self.state
        expect_ok = self.model.alloc_ok(n, self.MAX_N)
        state, indices, ok = ALLOC(before, jnp.int32(n), max_n=self.MAX_N)
        indices = np.asarray(indices)
        assert indices.shape == (self.MAX_N,) and indices.dtype == np.int32
        assert bool(ok) == expect_ok, (n, self.model.free_pages())
        if not expect_ok:
            chex.assert_trees_all_equal(before, state, strict=True)
            assert (indices == -1).all(), indices
            return
        pages = check_alloc_result(indices, n, self.model, self.NEED_SORT)
        self.model.apply_alloc(pages)
        self.state = state

    @rule(data=st.data())
    def alloc(self, data):
        k = data.draw(st.integers(1, self.MAX_N // self.PAGE_SIZE), label="pages")  # 0: host_alloc
        self._alloc(k * self.PAGE_SIZE)  # fails only when fewer than k pages are free

    @rule(data=st.data())
    def alloc_failing(self, data):
        ps, free = self.PAGE_SIZE, len(self.model.free_pages())
        max_pages = self.MAX_N // ps
        kinds = ["above_max_n", "negative"]
        if free < max_pages:
            kinds.append("oom")
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "oom":  # a partial last page counts as a page
            n = data.draw(st.integers(free + 1, max_pages), label="pages") * ps - data.draw(st.integers(0, ps - 1))
        elif kind == "above_max_n":
            n = data.draw(st.integers(self.MAX_N + 1, self.MAX_N + 64), label="n")
        elif kind == "negative":
            n = data.draw(st.integers(-64, -1), label="n")
        assert not self.model.alloc_ok(n, self.MAX_N)
        self._alloc(n)

    # -- device free

    def _free(self, indices: np.ndarray) -> None:
        before = self.state
        expect = self.model.free_error(indices.tolist())
        state, ok = FREE(before, indices)
        assert bool(ok) == (expect is None), (indices.tolist(), expect)
        if expect is not None:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        self.model.apply_free(indices.tolist())
        self.state = state

    @precondition(lambda self: self.model.held)
    @rule(data=st.data())
    def free_valid(self, data):
        self._free(padded(data, draw_valid_free(data, self.model, self.ARG_LEN), self.ARG_LEN))

    @rule(data=st.data())
    def free_invalid(self, data):
        vals = draw_invalid_free(data, self.model, self.ARG_LEN)
        assert self.model.free_error(vals) is not None
        self._free(padded(data, vals, self.ARG_LEN))

    @rule(data=st.data())
    def free_any(self, data):
        top = self.model.buffer_size + 1
        vals = data.draw(st.lists(st.integers(-2, top), max_size=self.ARG_LEN), label="indices")
        self._free(padded(data, vals, self.ARG_LEN))

    # -- host paths

    @rule(data=st.data())
    def host_alloc(self, data):
        ps = self.PAGE_SIZE
        n = data.draw(st.integers(-1, self.MAX_N + 2 * ps), label="n")
        before = self.state
        free = self.model.free_pages()
        if n < 0:
            with pytest.raises(InvalidArgument, match=re.escape(f"alloc({n})")):
                before.alloc_or_raise(n)
        elif -(-n // ps) > len(free):
            with pytest.raises(KVCacheOOM) as exc:
                before.alloc_or_raise(n)
            e = exc.value
            assert (e.requested, e.available, e.total, e.unit) == (n, len(free) * ps, self.SIZE, "tokens")
            assert str(e) == f"KV cache OOM: requested {n} tokens, {len(free) * ps} available (of {self.SIZE} total)"
        else:
            state, indices = before.alloc_or_raise(n)
            assert isinstance(indices, np.ndarray) and indices.shape == (n,)
            self.model.apply_alloc(check_alloc_result(indices, n, self.model, self.NEED_SORT))
            self.state = state
            return
        chex.assert_trees_all_equal(before, self.state, strict=True)

    @rule(data=st.data(), parts=st.lists(st.sampled_from(["valid", "invalid", "any"]), max_size=3))
    def host_free_group(self, data, parts):
        """Collect 0-3 frees in a FreeGroup (or pass them to free_or_raise at once)."""
        chunks, taken = [], set()
        for kind in parts:
            if kind == "valid":  # pages no earlier chunk named
                sub = TokenModel(self.SIZE, self.PAGE_SIZE)
                sub.held = self.model.held - taken
                c = draw_valid_free(data, sub, self.ARG_LEN // 2, min_pages=0)
            elif kind == "invalid":
                c = draw_invalid_free(data, self.model, self.ARG_LEN // 2)
            else:
                top = self.model.buffer_size + 1
                c = data.draw(st.lists(st.integers(-2, top), max_size=4))
            taken |= {i // self.PAGE_SIZE for i in c}
            chunks.append(c)
        flat = [i for c in chunks for i in c]
        before = self.state
        expect = self.model.free_error(flat)
        use_group = data.draw(st.booleans(), label="use_group")

        def call():
            if not use_group:
                return before.free_or_raise(flat)
            group = before.free_group_begin()
            assert isinstance(group, FreeGroup)
            for c in chunks:
                group.free(np.asarray(c, np.int64).reshape(-1))
            return before.free_group_end(group)

        if expect is None:
            self.state = call()
            self.model.apply_free(flat)
            return
        etype, ids = expect
        with pytest.raises(etype) as exc:
            call()
        assert type(exc.value) is etype
        assert exc.value.ids == ids, (exc.value.ids, ids, flat)
        for i in ids[:8]:
            assert str(i) in str(exc.value)
        chex.assert_trees_all_equal(before, self.state, strict=True)

    @invariant()
    def invariants(self):
        note(f"held pages={self.model.held_pages()}")
        check_state(self.state, self.model, self.NEED_SORT)


class TokenStackMachine(TokenMachine):
    NEED_SORT = False


class PageMachine(TokenMachine):
    PAGE_SIZE = 4
    SIZE = 40  # 10 pages
    MAX_N = 16  # 4 pages
    ARG_LEN = 24


class PageStackMachine(PageMachine):
    NEED_SORT = False


TestTokenSortedMachine = TokenMachine.TestCase
TestTokenStackMachine = TokenStackMachine.TestCase
TestPageSortedMachine = PageMachine.TestCase
TestPageStackMachine = PageStackMachine.TestCase


# ------------------------------------------------------------- host errors


def test_create_rejects_bad_sizes():
    with pytest.raises(InvalidArgument, match=re.escape("page_size=0")):
        TokenToKVPoolAllocator.create(8, page_size=0)
    with pytest.raises(InvalidArgument, match=re.escape("size=10 must be a positive multiple of page_size=4")):
        TokenToKVPoolAllocator.create(10, page_size=4)
    with pytest.raises(InvalidArgument, match=re.escape("size=2")):
        TokenToKVPoolAllocator.create(2, page_size=4)
    a = TokenToKVPoolAllocator.create(32, page_size=4)
    assert (a.size, a.buffer_size, int(a.available_size()), a.need_sort) == (32, 36, 32, True)


@pytest.mark.parametrize("need_sort", [True, False])
def test_alloc_errors_page_mode(need_sort):
    a = TokenToKVPoolAllocator.create(32, page_size=4, need_sort=need_sort)
    a, idx = a.alloc_or_raise(8)
    assert idx.tolist() == list(range(4, 12))  # pages 1 and 2, each page's indices in order
    with pytest.raises(KVCacheOOM) as exc:
        a.alloc_or_raise(28)
    e = exc.value
    assert str(e) == "KV cache OOM: requested 28 tokens, 24 available (of 32 total)"
    assert (e.requested, e.available, e.total, e.unit) == (28, 24, 32, "tokens")
    with pytest.raises(InvalidArgument, match=re.escape("alloc(-4)")):
        a.alloc_or_raise(-4)
    # A partial last page (pymllm): 6 tokens take pages 3 and 4, the first 6 indices returned.
    c, part = a.alloc_or_raise(6)
    assert part.tolist() == list(range(12, 18)) and int(c.available_size()) == 16
    c = c.free_or_raise(part)  # frees both pages, the unreturned rest of page 4 with it
    assert int(c.available_size()) == 24
    assert int(a.available_size()) == 24
    check_state(a, _model_from(a), need_sort)
    b, idx = a.alloc_or_raise(24)  # exactly what is left
    assert sorted(idx.tolist()) == list(range(12, 36)) and int(b.available_size()) == 0
    with pytest.raises(KVCacheOOM, match=re.escape("requested 4 tokens, 0 available (of 32 total)")):
        b.alloc_or_raise(4)


def test_alloc_errors_token_mode():
    a = TokenToKVPoolAllocator.create(10)
    a, idx = a.alloc_or_raise(3)
    assert idx.tolist() == [1, 2, 3]
    with pytest.raises(KVCacheOOM) as exc:
        a.alloc_or_raise(8)
    assert str(exc.value) == "KV cache OOM: requested 8 tokens, 7 available (of 10 total)"
    assert (exc.value.requested, exc.value.available, exc.value.total) == (8, 7, 10)
    a2, idx = a.alloc_or_raise(7)
    assert sorted(idx.tolist()) == list(range(4, 11))


def _model_from(state: TokenToKVPoolAllocator) -> TokenModel:
    m = TokenModel(state.size, state.page_size)
    counts = np.asarray(state.pages.ref_counts)
    m.held = {p for p in range(1, m.num_pages + 1) if counts[p] > 0}
    return m


@pytest.mark.parametrize("need_sort", [True, False])
def test_free_errors_page_mode(need_sort):
    a = TokenToKVPoolAllocator.create(32, page_size=4, need_sort=need_sort)  # buffer 36
    a, idx = a.alloc_or_raise(12)  # pages 1, 2, 3 = indices 4 .. 15
    snap = a
    with pytest.raises(InvalidId) as exc:
        a.free_or_raise([5, 0, 3, 3])
    assert exc.value.ids == [0, 3]
    assert "[4, 36)" in str(exc.value) and "[0, 3]" in str(exc.value) and "null page" in str(exc.value)
    with pytest.raises(InvalidId) as exc:
        a.free_or_raise([36, 4, 99, -2])
    assert exc.value.ids == [-2, 36, 99] and "[-2, 36, 99]" in str(exc.value)
    with pytest.raises(DoubleFree) as exc:
        a.free_or_raise([4, 5, 9, 4, 9])
    assert exc.value.ids == [4, 9] and "[4, 9]" in str(exc.value) and "more than once" in str(exc.value)
    with pytest.raises(DoubleFree) as exc:
        a.free_or_raise([4, 16, 33])  # pages 4 and 8 are free
    assert exc.value.ids == [4, 8]
    assert "free pages [4, 8]" in str(exc.value) and "page_size=4" in str(exc.value)
    chex.assert_trees_all_equal(snap, a, strict=True)

    # partial-page frees: any index of a page frees the whole page
    b = a.free_or_raise([6, 10, 11])
    assert np.asarray(b.pages.ref_counts).tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert int(b.available_size()) == 28
    with pytest.raises(DoubleFree) as exc:
        b.free_or_raise([4])  # page 1 went back whole
    assert exc.value.ids == [1]
    b, idx = b.alloc_or_raise(8)
    assert sorted(idx.tolist()) == list(range(4, 12))  # the same two pages, whole


def test_free_errors_token_mode():
    a = TokenToKVPoolAllocator.create(10, need_sort=False)  # buffer 11
    a, idx = a.alloc_or_raise(4)
    snap = a
    with pytest.raises(InvalidId) as exc:
        a.free_or_raise([1, 0, 11])
    assert exc.value.ids == [0, 11] and "[1, 11)" in str(exc.value) and "[0, 11]" in str(exc.value)
    with pytest.raises(DoubleFree) as exc:
        a.free_or_raise([2, 1, 2])
    assert exc.value.ids == [2] and "named more than once" in str(exc.value)
    with pytest.raises(DoubleFree) as exc:
        a.free_or_raise([1, 7, 5])
    assert exc.value.ids == [5, 7] and "free pages [5, 7] (page_size=1)" in str(exc.value)
    chex.assert_trees_all_equal(snap, a, strict=True)
    b = a.free_or_raise(np.asarray([[1, -1], [3, 4]]))
    assert np.asarray(b.pages.ref_counts)[1:5].tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_group(page_size):
    rng = np.random.default_rng(page_size)
    a = TokenToKVPoolAllocator.create(16 * page_size, page_size=page_size)
    reqs = []
    for _ in range(5):
        a, idx = a.alloc_or_raise(int(rng.integers(1, 3)) * page_size)
        reqs.append(idx)
    # an empty group changes nothing
    chex.assert_trees_all_equal(a, a.free_group_end(a.free_group_begin()), strict=True)
    # a group that names an index twice across two frees fails whole
    g = a.free_group_begin()
    g.free(reqs[0])
    g.free(reqs[1])
    g.free(reqs[0][-1:])
    with pytest.raises(DoubleFree) as exc:
        a.free_group_end(g)
    assert exc.value.ids == [int(reqs[0][-1])]
    # a group naming a free page fails whole, naming the page
    g = a.free_group_begin()
    g.free(reqs[2])
    g.free([14 * page_size])
    with pytest.raises(DoubleFree) as exc:
        a.free_group_end(g)
    assert exc.value.ids == [14]
    # a group with an index in the null page fails whole
    g = a.free_group_begin()
    g.free(reqs[3].reshape(-1, 1))
    g.free([page_size - 1])
    with pytest.raises(InvalidId) as exc:
        a.free_group_end(g)
    assert exc.value.ids == [page_size - 1]
    check_state(a, _model_from(a), True)
    # finished requests 0, 2, 4 freed in one call (page mode: one index per page is enough)
    g = a.free_group_begin()
    for r in (0, 2, 4):
        g.free(reqs[r][::page_size] if r == 2 else reqs[r])
    b = a.free_group_end(g)
    model = _model_from(a)
    model.apply_free(np.concatenate([reqs[0], reqs[2], reqs[4]]).tolist())
    check_state(b, model, True)
    assert int(b.available_size()) == int(a.available_size()) + sum(len(reqs[r]) for r in (0, 2, 4))


def test_clear():
    a = TokenToKVPoolAllocator.create(16, page_size=4, need_sort=False)
    a, _ = a.alloc_or_raise(12)
    chex.assert_trees_all_equal(TokenToKVPoolAllocator.create(16, page_size=4, need_sort=False), a.clear(), strict=True)


# --------------------------------------------------------------- lax.scan


@pytest.mark.parametrize("need_sort,seed", [(True, 5), (False, 6)])
def test_scan_page_mode_matches_python_replay(need_sort, seed):
    ps, batch, per_req, steps = 4, 4, 6, 300
    width = per_req * ps
    size = batch * per_req * ps  # room for every request at full length
    rng = np.random.default_rng(seed)
    want = rng.random((steps, batch)) < rng.uniform(0.4, 0.7)
    finish = rng.random((steps, batch)) < rng.uniform(0.03, 0.08)
    finish |= (rng.random(steps) < 0.03)[:, None]
    # partial frees: each page is named by a random non-empty subset of its indices
    keep = rng.random((steps, batch, per_req, ps)) < 0.5
    forced = rng.integers(0, ps, (steps, batch, per_req))
    np.put_along_axis(keep, forced[..., None], True, axis=-1)
    keep = keep.reshape(steps, batch, width)

    def step(carry, xs):
        alloc, table, lens = carry
        want_t, finish_t, keep_t = xs
        alloc, ok_free = alloc.free(jnp.where(finish_t[:, None] & keep_t, table, -1))
        table = jnp.where(finish_t[:, None], -1, table)
        lens = jnp.where(finish_t, 0, lens)
        need = want_t & (lens < per_req)
        n = jnp.sum(need, dtype=jnp.int32)
        alloc, idx, ok_alloc = alloc.alloc(n * ps, max_n=batch * ps)
        chunk = idx.reshape(batch, ps)[jnp.clip(jnp.cumsum(need) - 1, 0, batch - 1)]
        cols = jnp.where(need[:, None], lens[:, None] * ps + jnp.arange(ps), width)
        table = table.at[jnp.arange(batch)[:, None], cols].set(chunk, mode="drop")
        lens = lens + need
        return (alloc, table, lens), (idx, n, ok_free, ok_alloc, alloc.available_size())

    @jax.jit
    def run(alloc, want, finish, keep):
        init = (alloc, jnp.full((batch, width), -1, jnp.int32), jnp.zeros((batch,), jnp.int32))
        return jax.lax.scan(step, init, (want, finish, keep))

    alloc0 = TokenToKVPoolAllocator.create(size, page_size=ps, need_sort=need_sort)
    (alloc, table, lens), (idx, ns, ok_free, ok_alloc, avail) = run(alloc0, want, finish, keep)
    idx, ns, avail = np.asarray(idx), np.asarray(ns), np.asarray(avail)
    assert np.asarray(ok_free).all() and np.asarray(ok_alloc).all()

    model = TokenModel(size, ps)
    tab = [[] for _ in range(batch)]
    partial = 0
    for t in range(steps):
        for b in range(batch):
            if finish[t, b]:
                named = [i for i, k in zip(tab[b], keep[t, b]) if k]
                partial += len(named) < len(tab[b])
                model.apply_free(named)
                assert not {i // ps for i in tab[b]} & model.held  # every page went back whole
                tab[b] = []
        need = [b for b in range(batch) if want[t, b] and len(tab[b]) < width]
        assert ns[t] == len(need)
        n = len(need) * ps
        pages = check_alloc_result(idx[t], n, model, need_sort)
        model.apply_alloc(pages)
        for b, p in zip(need, pages):
            tab[b] += model.page_indices(p)
        assert avail[t] == len(model.free_pages()) * ps, t

    check_state(alloc, model, need_sort)
    for b in range(batch):
        assert np.asarray(table)[b, : int(lens[b]) * ps].tolist() == tab[b]
    assert partial > 10  # partial-page frees did happen
    assert avail.min() <= size // 4  # and the pool ran close to full


# ------------------------------------------------- regressions (bugs found and fixed)


# Regression (fixed): jaxkv._host.padded_ids casts int64 indices to int32 unchecked, so
# index 2**32 + k wraps onto index k and free_or_raise frees a real page
def test_free_or_raise_rejects_indices_beyond_int32():
    a = TokenToKVPoolAllocator.create(32, page_size=4)
    a, _ = a.alloc_or_raise(8)
    with pytest.raises(InvalidId):
        a.free_or_raise([2**32 + 5])


# Regression (fixed): alloc_or_raise passes n to the device op before comparing it with
# the available size, so n >= 2**31 raises a raw OverflowError instead of KVCacheOOM
def test_alloc_or_raise_huge_request_is_oom():
    a = TokenToKVPoolAllocator.create(8)
    with pytest.raises(KVCacheOOM):
        a.alloc_or_raise(2**31)


# ---------------------------------------------------------------------- jit and eager agree


class TokenAllocatorVariantsTest(chex.TestCase):
    """Page-mode ``alloc`` (a partial last page included) and ``free`` agree
    under ``jax.jit`` and eagerly (``chex.variants``)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_partial_page_alloc_and_free(self):
        alloc = self.variant(lambda s, n: s.alloc(n, max_n=12))
        free = self.variant(lambda s, idx: s.free(idx))
        state = TokenToKVPoolAllocator.create(16, page_size=4)
        state, idx, ok = alloc(state, jnp.int32(6))
        chex.assert_shape(idx, (12,))
        assert bool(ok) and np.asarray(idx).tolist() == list(range(4, 10)) + [-1] * 6
        assert int(state.available_size()) == 8  # two whole pages taken
        state, ok = free(state, idx)
        assert bool(ok) and int(state.available_size()) == 16
        before = state
        state, idx, ok = alloc(state, jnp.int32(13))  # above max_n
        assert not bool(ok)
        chex.assert_trees_all_equal(before, state, strict=True)
