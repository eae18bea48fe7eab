"""Fuzzing the host-facing paths no state machine drove before (issue 26).

Three hypothesis state machines, each against a plain-Python model of who
holds which block, with bad ids (the -1 padding, other negatives, the null
row 0, ids past the range, snapshot rows where a slot is expected, ids past
int32), repeated ids, unknown or missing groups and bad windows:

* :class:`WindowMachine`: ``BlockSpaceManager.trim_window`` beside
  ``allocate`` / ``append_slots`` / ``fork`` / ``free`` (the rules, model
  and one-value-per-token pool of ``tests/test_block_space.py``'s
  ``SpaceMachine``, extended to trimmed rows) and their ``*_or_raise`` host
  paths. After every step: ref counts equal the table entries of
  ON_DEVICE rows, the free stack holds exactly the blocks nobody names (no
  leak, nothing free in a table), trimmed entries are a leading run of -1,
  every row reads back its own tokens at the positions it still holds,
  and each new token's slot lies in a block of its own row.
* :class:`SnapshotMachine`: ``KVCacheManager.capture`` / ``copy_state`` /
  ``attach_prefix`` / ``incref_blocks`` / ``release_blocks`` (with
  ``admit`` / ``reserve`` / ``release`` to make held slots and blocks) on a
  tiny hybrid model (SWA, HCA 128, full attention, Gated DeltaNet; groups
  ``full`` and ``hca128``; 5 snapshot rows). The model keeps each group's
  tables and the references a prefix cache holds outside them, and a numpy
  mirror of every per-request state row (SWA and compressor rings, GDN
  states), filled with fresh random data so that any wrong copy shows.
  After every step: tables, lengths and ref counts (tables + cache
  references) match, the free stack holds exactly the unreferenced blocks,
  and every state row equals the mirror bit for bit.
* :class:`PrefixPinMachine`: ``PrefixCacheManager`` used as the engine uses
  it (``pin`` whatever ``match`` returned, misses included) with inserts,
  evictions, ``reset`` and releases of nodes that hold no pin: ``reset``
  refuses exactly while a pin is held, every held pin's release succeeds,
  pinned prefixes survive eviction, protected tokens match the pinned
  paths.

Every failed operation (``ok`` False, or a typed ``KVCacheError`` from a
host path or a trace-time check) must leave the state unchanged, compared
leaf by leaf.

Compile cost dominates: every jitted program has fixed shapes (arguments
padded with -1), so a run compiles each once; the ``ci`` profile runs a
bounded number of steps, ``JAXKV_HYPOTHESIS=long`` the ``long`` profile.
"""

from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxkv.errors import CacheLocked, InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager.block_space import FREE, ON_DEVICE, BlockSpaceManager
from jaxkv.prefix.block_cache import PrefixCacheManager
from tests.test_block_space import (
    BAD_ROWS,
    BS,
    MAX_SEQS,
    SpaceMachine,
    SpaceModel,
    blocks_for,
    read_values,
)
from tests.test_host_path_errors import (
    CONTEXT,
    GROUP_TOKENS,
    GROUP_WIDTH,
    GROUPS,
    MAX_REQS,
    NUM_BLOCKS,
    NUM_SLOTS,
    NUM_SNAPSHOTS,
    ROWS,
    STATE_ROWS,
    UNIT,
    hybrid_admit,
    hybrid_attach,
    hybrid_capture,
    hybrid_copy_state,
    hybrid_incref,
    hybrid_release,
    hybrid_release_blocks,
    hybrid_reserve,
    new_hybrid,
    stamp,
    state_leaves,
)

def _unchanged(before, after):
    chex.assert_trees_all_equal(before, after, strict=True)


# ==========================================================================
# BlockSpaceManager.trim_window with append_slots / fork / free
# ==========================================================================

WINDOWS = (1, 2, 5, 9)  # static: one compile each
BAD_WINDOWS = (0, -1, -5, 2.5, 4.0, True, None, "4", np.float64(3), [4])
TRIM_W = MAX_SEQS + 2  # room for repeats and bad rows
HOST_W = 8  # the host paths pad to a power of two: one compile
TRIM = {w: jax.jit(lambda m, rows, w=w: m.trim_window(rows, w)) for w in WINDOWS}


class WindowModel(SpaceModel):
    """``SpaceModel`` whose tables may hold -1 where ``trim_window`` released
    a block (a leading run: the blocks no later query can see)."""

    def apply_fork(self, src, dst) -> int:
        pairs = [(int(s), int(d)) for s, d in zip(src, dst) if s != -1 and d != -1]
        for s, d in pairs:
            self.tables[d] = list(self.tables[s])
            self.lens[d] = self.lens[s]
            self.vals[d] = list(self.vals[s])
            for b in self.tables[s]:
                if b != -1:
                    self.refs[b] += 1
        return len(pairs)

    def apply_free(self, ids) -> None:
        for r in (int(r) for r in ids if r != -1):
            for b in self.tables.pop(r):
                if b != -1:
                    self.refs[b] -= 1
                    assert self.refs[b] >= 0
            del self.lens[r]
            self.vals.pop(r, None)

    def apply_trim(self, ids, window: int) -> int:
        """Each ON_DEVICE row named (once, however often named) drops the
        blocks wholly before position ``len - window + 1``; returns how
        many table entries were released."""
        released = 0
        for r in dict.fromkeys(int(r) for r in ids if r != -1):
            if not self.on_device(r):
                continue
            dead = max(self.lens[r] - window + 1, 0) // self.bs
            for j in range(min(dead, len(self.tables[r]))):
                if self.tables[r][j] != -1:
                    self.refs[self.tables[r][j]] -= 1
                    assert self.refs[self.tables[r][j]] >= 0
                    self.tables[r][j] = -1
                    released += 1
        return released


def check_window_space(state: BlockSpaceManager, model: WindowModel) -> None:
    """Ownership of every block, against the model (trimmed rows allowed)."""
    nb, bs, mb = model.num_blocks, model.bs, model.max_blocks
    tables, lens, status = (np.asarray(x) for x in (state.block_tables, state.seq_lens, state.status))
    refs = np.asarray(state.device.ref_counts)
    num_free = int(state.device.num_free)
    on = status == ON_DEVICE
    named = tables[on][tables[on] >= 0]
    assert (tables != 0).all() and (named < nb).all(), tables
    np.testing.assert_array_equal(refs, np.bincount(named, minlength=nb),
                                  err_msg="ref counts != table entries of ON_DEVICE rows (a leak or a lost owner)")
    stack = np.asarray(state.device.free_ids)[:num_free].tolist()
    assert len(set(stack)) == num_free and 0 not in stack, stack
    assert set(stack) == {i for i in range(1, nb) if refs[i] == 0}, ("free stack vs ref counts", stack, refs)
    for r in range(model.max_seqs):
        if on[r]:
            k = blocks_for(int(lens[r]), bs)
            live = tables[r, :k] >= 1
            dead = int(np.argmax(live)) if live.any() else k
            assert live[dead:].all() and (tables[r, :dead] == -1).all(), ("trimmed entries not leading", r, tables[r])
            assert (tables[r, k:] == -1).all() and 1 <= lens[r] <= mb * bs, (r, lens[r], tables[r])
            # the block the next token goes into (when partly filled) is never trimmed
            assert lens[r] % bs == 0 or live[-1], ("the partly filled last block was released", r, tables[r])
        else:
            assert status[r] == FREE and lens[r] == 0 and (tables[r] == -1).all(), (r, status[r], tables[r])
    assert sorted(np.flatnonzero(on).tolist()) == model.on_rows()
    for r in model.on_rows():
        assert tables[r, : len(model.tables[r])].tolist() == model.tables[r], (r, tables[r], model.tables[r])
        assert int(lens[r]) == model.lens[r]
    np.testing.assert_array_equal(refs[1:], [model.refs[i] for i in range(1, nb)])


class WindowMachine(SpaceMachine):
    """``SpaceMachine``'s rules (allocate, append 1 or 3 tokens with
    copy-on-write, fork, free, reset) plus ``trim_window`` with good and bad
    rows and windows, and the ``*_or_raise`` host paths with bad input."""

    def __init__(self):
        super().__init__()
        self.model = WindowModel()

    def _rows(self, data, label: str) -> list:
        m = self.model
        pool = m.on_rows() * 3 + m.free_rows() + list(BAD_ROWS) + [2**31 - 1, -(2**31)]
        rows = data.draw(st.lists(st.sampled_from(pool), max_size=5), label=label)
        if rows and data.draw(st.booleans(), label="repeat a row?"):
            rows = rows + [data.draw(st.sampled_from(rows), label="repeated")]
        return rows

    @rule(data=st.data(), window=st.sampled_from(WINDOWS))
    def trim(self, data, window):
        rows = self._rows(data, "trim rows")
        ids = np.asarray(data.draw(st.permutations(rows + [-1] * (TRIM_W - len(rows))), label="order"), np.int32)
        note(f"trim_window {ids.tolist()} window={window}")
        state, released = TRIM[window](self.state, ids)
        want = self.model.apply_trim(ids, window)
        assert int(released) == want, (ids, window, int(released), want)
        event(f"trim: released {'some' if want else 'none'}")
        if not want:
            _unchanged(self.state, state)
        self.state = state

    @rule(data=st.data())
    def trim_bad_window(self, data):
        window = data.draw(st.sampled_from(BAD_WINDOWS), label="window")
        rows = np.asarray(self.model.on_rows()[:1] + [-1] * (TRIM_W - 1), np.int32)
        before = self.state
        with pytest.raises(InvalidArgument, match="window"):
            before.trim_window(rows, window)
        _unchanged(before, self.state)
        event("trim: bad window refused")

    @rule(data=st.data())
    def host_path(self, data):
        """``allocate_or_raise`` / ``fork_or_raise`` / ``free_or_raise`` with
        rows from everywhere: success exactly when the model says so, else a
        typed error and nothing changed."""
        m = self.model
        op = data.draw(st.sampled_from(["allocate", "fork", "free"]), label="host op")
        rows = self._rows(data, "rows")[:HOST_W]
        before = self.state
        if op == "allocate":
            tokens = data.draw(st.sampled_from([1, 3, 4, 7, 20, 21, 0, -1, 2**40]), label="tokens")
            ids = np.asarray(rows + [-1] * (HOST_W - len(rows)), np.int64)
            expect = m.allocate_ok(ids, tokens) if abs(tokens) < 2**31 else False
            call = lambda: before.allocate_or_raise(ids, tokens)  # noqa: E731
        elif op == "fork":
            dst = self._rows(data, "dst")[: len(rows)]
            dst += [-1] * (len(rows) - len(dst))
            src_ids = np.asarray(rows + [-1] * (HOST_W - len(rows)), np.int64)
            dst_ids = np.asarray(dst + [-1] * (HOST_W - len(dst)), np.int64)
            expect = m.fork_ok(src_ids, dst_ids)
            call = lambda: before.fork_or_raise(src_ids, dst_ids)  # noqa: E731
        else:
            ids = np.asarray(rows + [-1] * (HOST_W - len(rows)), np.int64)
            expect = m.free_ok(ids)
            call = lambda: before.free_or_raise(ids)  # noqa: E731
        note(f"{op}_or_raise rows={rows} expect ok={expect}")
        if not expect:
            with pytest.raises((InvalidId, InvalidArgument, KVCacheOOM)):
                call()
            event(f"{op}_or_raise: typed error")
            return
        state = call()
        if op == "allocate":
            given = m.apply_allocate(ids, tokens, np.asarray(state.block_tables))
            slots, _ = read_values(state, self.pool)  # write the prompt, as SpaceMachine's allocate does
            values = self._values(tokens)
            self.pool = self._write(self.pool, np.asarray(slots)[given[0], :tokens].tolist(), values)
            for r in given:
                m.vals[r] = list(values)
        elif op == "fork":
            m.apply_fork(src_ids, dst_ids)
        else:
            m.apply_free(ids)
        self.state = state
        event(f"{op}_or_raise: ok")

    @invariant()
    def invariants(self):  # replaces SpaceMachine's: trimmed rows read only what they still hold
        check_window_space(self.state, self.model)
        slots, vals = (np.asarray(x) for x in read_values(self.state, self.pool))
        tables = np.asarray(self.state.block_tables)
        m = self.model
        for r in m.on_rows():
            pos = np.arange(m.lens[r])
            page = tables[r, pos // BS]
            np.testing.assert_array_equal(slots[r, pos], np.where(page >= 0, page * BS + pos % BS, -1))
            held = page >= 0
            np.testing.assert_array_equal(vals[r, pos[held]], np.asarray(m.vals[r], np.float32)[held],
                                          err_msg=f"row {r} does not read back its tokens")


# Sizes from the hypothesis profile (tests/conftest.py): ci 30 x 60, long 400 x 100.
TestWindowMachine = pytest.mark.slow(WindowMachine.TestCase)  # the long pass (tests/conftest.py)


# ==========================================================================
# KVCacheManager snapshots and prefix blocks
# ==========================================================================

BAD_IDS = [-1, 0, -2, STATE_ROWS, STATE_ROWS + 3, 2**31 - 1, -(2**31)]  # never a row, or padding
SLOT_LIKE = list(range(1, NUM_SLOTS)) * 3 + list(range(NUM_SLOTS, STATE_ROWS)) + BAD_IDS  # snapshot rows too
COPY_W = 4
RESERVE_TOKENS = [0, 1, 31, 32, 33, 64, 96, 127, 128, 129, 160, 255, 256, 257, -1]


def _group_blocks(name: str, tokens: int) -> int:
    """Blocks of ``name`` that ``tokens`` reserved tokens need."""
    tpb = GROUP_TOKENS[name]
    return tokens // tpb if name == "hca128" else -(-tokens // tpb)


def _initial_rows() -> list:
    """Row 1 of every state leaf of a fresh manager: a reset row."""
    return [np.asarray(leaf)[1].copy() for leaf in state_leaves(new_hybrid())]


class SnapshotModel:
    """Who holds what in the hybrid manager: ``held`` (slot -> reserved
    tokens), ``tables[g][slot]`` (block ids in order), ``cache[g]`` (the
    references a prefix cache holds outside the tables), ``prefixes``
    (cached prefixes a new slot can attach: ``(units, {g: blocks})``), and
    ``rows``: a mirror of every per-request state leaf, state row first."""

    def __init__(self):
        self.held: dict[int, int] = {}
        self.tables = {g: {} for g in GROUPS}
        self.cache = {g: collections.Counter() for g in GROUPS}
        self.prefixes: list = []
        self.rows = [np.asarray(leaf).copy() for leaf in state_leaves(new_hybrid())]
        self.initial = _initial_rows()

    def refs(self, g: str) -> collections.Counter:
        out = collections.Counter(self.cache[g])
        for blocks in self.tables[g].values():
            out.update(blocks)
        return out

    def free(self, g: str) -> set:
        refs = self.refs(g)
        return {b for b in range(1, NUM_BLOCKS[g]) if refs[b] == 0}

    def reset_row(self, row: int) -> None:
        for mirror, init in zip(self.rows, self.initial):
            mirror[row] = init

    def copy(self, src: list, dst: list) -> None:
        """``copy_state``'s rule: pairs with both rows in range; none at all
        when a destination repeats; all sources read first."""
        pairs = [(s, d) for s, d in zip(src, dst) if 1 <= s < STATE_ROWS and 1 <= d < STATE_ROWS]
        if len({d for _, d in pairs}) < len(pairs):
            return
        for mirror in self.rows:
            values = [mirror[s].copy() for s, _ in pairs]
            for (_, d), value in zip(pairs, values):
                mirror[d] = value


class SnapshotMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = new_hybrid()
        self.model = SnapshotModel()
        self.key = 0

    # ---------------------------------------------------------------- helpers

    def _rows_pool(self) -> list:
        return SLOT_LIKE + sorted(self.model.held) * 2

    def _ids(self, data, width: int, label: str, pool=None) -> list:
        ids = data.draw(st.lists(st.sampled_from(pool or self._rows_pool()), max_size=width), label=label)
        return ids + [-1] * (width - len(ids))

    def _slots(self, data, label: str, good: list) -> list:
        """``ROWS`` slot ids: mostly distinct ``good`` ones, sometimes with a
        poison (a bad id, a snapshot row, a repeat), -1 padded, shuffled."""
        slots = data.draw(st.lists(st.sampled_from(good), unique=True, max_size=ROWS), label=label) if good else []
        poison = data.draw(st.sampled_from(["none"] * 3 + ["bad", "repeat"]), label=f"{label} poison")
        if poison == "bad" or (poison == "repeat" and not slots):
            slots = slots[: ROWS - 1] + [data.draw(st.sampled_from(SLOT_LIKE), label="bad id")]
        elif poison == "repeat":
            slots = slots[: ROWS - 1] + [slots[0]]
        return data.draw(st.permutations(slots + [-1] * (ROWS - len(slots))), label=f"{label} order")

    def _stamp(self, rows: list) -> None:
        self.key += 1
        self.manager = stamp(self.manager, jnp.asarray(rows, jnp.int32), jax.random.key(self.key))
        actual = [np.asarray(leaf) for leaf in state_leaves(self.manager)]
        for mirror, leaf in zip(self.model.rows, actual):
            for r in rows:
                if r != -1:
                    mirror[r] = leaf[r]

    def _failed(self, before, after, what: str) -> None:
        _unchanged(before, after)
        event(f"{what}: refused, unchanged")

    def _blocks_arg(self, rows: dict) -> dict:
        """``{g: [ROWS, width]}`` from ``{g: [list per row]}`` (-1 padded):
        one argument shape for every call (one compile each)."""
        out = {}
        for g in GROUPS:
            arr = np.full((ROWS, GROUP_WIDTH[g]), -1, np.int32)
            for b, ids in enumerate(rows[g]):
                arr[b, : len(ids)] = ids
            out[g] = jnp.asarray(arr)
        return out

    def _ids_arg(self, ids: dict) -> dict:
        """``{g: [ROWS, width]}`` holding ``ids[g]`` row after row (the
        shape of :meth:`_blocks_arg`; incref/release take any shape)."""
        out = {}
        for g in GROUPS:
            arr = np.full((ROWS * GROUP_WIDTH[g],), -1, np.int32)
            arr[: len(ids[g])] = ids[g]
            out[g] = jnp.asarray(arr.reshape(ROWS, GROUP_WIDTH[g]))
        return out

    # ---------------------------------------------------------------- slots

    @initialize(data=st.data())
    def start(self, data):
        """Every slot admitted; slots 1 and 2 hold one and two units, both
        cached as prefixes (one more owner of their blocks), slot 3 is
        empty; sometimes slot 1 is released again (its prefix then lives
        only in the cache). Every state row holds data of its own."""
        m = self.model
        manager, _, ok = hybrid_admit(self.manager, MAX_REQS)
        manager, _, ok2 = hybrid_reserve(manager, jnp.asarray([1, 2, -1], jnp.int32),
                                         jnp.asarray([UNIT, 2 * UNIT, 0], jnp.int32))
        assert bool(ok) and bool(ok2)
        for s, n in ((1, UNIT), (2, 2 * UNIT), (3, 0)):
            m.held[s] = n
            for g in GROUPS:
                group = manager.groups[g]
                m.tables[g][s] = np.asarray(group.tables)[s, : int(group.lens[s])].tolist()
        prefixes = [{g: m.tables[g][s] for g in GROUPS} for s in (1, 2)]
        manager, ok = hybrid_incref(manager, self._ids_arg({g: prefixes[0][g] + prefixes[1][g] for g in GROUPS}))
        assert bool(ok)
        for k, blocks in zip((1, 2), prefixes):
            for g in GROUPS:
                m.cache[g].update(blocks[g])
            m.prefixes.append((k, blocks))
        self.manager = manager
        self._stamp(list(range(1, STATE_ROWS)))
        if data.draw(st.booleans(), label="release slot 1?"):
            self.manager, ok = hybrid_release(self.manager, jnp.asarray([1, -1, -1], jnp.int32))
            assert bool(ok)
            del m.held[1]
            for g in GROUPS:
                del m.tables[g][1]
            m.reset_row(1)

    @rule(n=st.integers(0, MAX_REQS + 1))
    def admit(self, n):
        m = self.model
        free = [s for s in range(1, NUM_SLOTS) if s not in m.held]
        before = self.manager
        manager, ids, ok = hybrid_admit(before, n)
        expect = n <= min(len(free), ROWS)
        assert bool(ok) == expect, (n, free)
        if not expect:
            return self._failed(before, manager, "admit")
        assert np.asarray(ids)[:n].tolist() == free[:n]
        for s in free[:n]:
            m.held[s] = 0
            for g in GROUPS:
                m.tables[g][s] = []
            m.reset_row(s)
        self.manager = manager

    @rule(data=st.data())
    def reserve(self, data):
        m = self.model
        slots = self._slots(data, "reserve slots", sorted(m.held))
        counts = []
        for s in slots:  # often exactly to the next unit boundary: capture and take_prefix need one
            n = data.draw(st.sampled_from(RESERVE_TOKENS + ["boundary"] * 6), label="tokens") if s != -1 else 0
            counts.append(UNIT - m.held.get(s, 0) % UNIT if n == "boundary" else n)
        given = [(s, n) for s, n in zip(slots, counts) if s != -1]
        new_lens = {s: m.held.get(s, 0) + n for s, n in given}
        expect = (all(s in m.held and 0 <= n <= CONTEXT for s, n in given)
                  and len({s for s, _ in given}) == len(given))
        need = {}
        if expect:
            for g in GROUPS:
                need[g] = {s: max(_group_blocks(g, new_lens[s]) - len(m.tables[g].get(s, [])), 0) for s, _ in given}
                expect &= all(len(m.tables[g].get(s, [])) + k <= GROUP_WIDTH[g] for s, k in need[g].items())
                expect &= sum(need[g].values()) <= len(m.free(g))
        before = self.manager
        manager, starts, ok = hybrid_reserve(before, jnp.asarray(slots, jnp.int32), jnp.asarray(counts, jnp.int32))
        note(f"reserve {slots} {counts} -> expect {expect}")
        assert bool(ok) == expect, (slots, counts, m.held)
        if not expect:
            return self._failed(before, manager, "reserve")
        for g in GROUPS:
            free = m.free(g)
            tables, lens = np.asarray(manager.groups[g].tables), np.asarray(manager.groups[g].lens)
            taken = []
            for s, k in need[g].items():
                old = m.tables[g].get(s, [])
                row = tables[s, : lens[s]].tolist()
                assert row[: len(old)] == old and len(row) == len(old) + k, (g, s, old, row, k)
                taken += row[len(old):]
                m.tables[g][s] = row
            assert len(set(taken)) == len(taken) and set(taken) <= free, (g, taken, free)
        for s, _ in given:
            m.held[s] = new_lens[s]
        self.manager = manager
        event("reserve: ok")

    @rule(data=st.data())
    def release(self, data):
        m = self.model
        if len(m.held) < 2 and data.draw(st.booleans(), label="keep the last requests?"):
            return
        slots = self._slots(data, "release slots", sorted(m.held))
        given = [s for s in slots if s != -1]
        expect = all(s in m.held for s in given) and len(set(given)) == len(given)
        before = self.manager
        manager, ok = hybrid_release(before, jnp.asarray(slots, jnp.int32))
        assert bool(ok) == expect, (slots, m.held)
        if not expect:
            return self._failed(before, manager, "release")
        for s in given:
            del m.held[s]
            for g in GROUPS:
                m.tables[g].pop(s, None)
            m.reset_row(s)
        self.manager = manager

    @rule(data=st.data())
    def restamp(self, data):
        """Fresh data in held slots and snapshot rows (what prefill and
        decode would write): a copy that goes wrong then shows."""
        rows = data.draw(st.lists(st.sampled_from(sorted(self.model.held) + list(range(NUM_SLOTS, STATE_ROWS))),
                                  unique=True, max_size=3), label="rows")
        self._stamp(rows + [-1] * (3 - len(rows)))

    # ---------------------------------------------------------------- state rows

    @rule(data=st.data())
    def copy_state(self, data):
        m = self.model
        src = self._ids(data, COPY_W, "src")
        dst = self._ids(data, COPY_W, "dst")
        if data.draw(st.booleans(), label="repeat a destination?"):
            valid = [d for d in dst if 1 <= d < STATE_ROWS]
            if valid:
                dst[data.draw(st.integers(0, COPY_W - 1), label="lane")] = valid[0]
        before = self.manager
        note(f"copy_state {src} -> {dst}")
        self.manager = hybrid_copy_state(before, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
        m.copy(src, dst)
        pairs = [(s, d) for s, d in zip(src, dst) if 1 <= s < STATE_ROWS and 1 <= d < STATE_ROWS]
        event("copy_state: " + ("repeated destination, none copied" if len({d for _, d in pairs}) < len(pairs)
                                else f"{min(len(pairs), 2)}+ pairs"))
        # Blocks, lengths and slots are not state rows.
        for name in ("slots", "seq_lens", "groups", "full_pool"):
            _unchanged(getattr(before, name), getattr(self.manager, name))

    @rule(data=st.data())
    def capture(self, data):
        m = self.model
        on_boundary = [s for s, n in m.held.items() if n and n % UNIT == 0]
        slots = self._slots(data, "capture slots", sorted(m.held) + on_boundary * 3)
        advanced = data.draw(st.lists(st.booleans(), min_size=ROWS, max_size=ROWS), label="advanced")
        src, dst, seen = [], [], set()
        for s, adv in zip(slots, advanced):
            if 1 <= s < NUM_SLOTS and s not in seen:
                seen.add(s)
                lens = m.held.get(s, 0)
                if adv and lens > 0 and lens % UNIT == 0:
                    src.append(s)
                    dst.append(NUM_SLOTS + s - 1)
        before = self.manager
        note(f"capture {slots} advanced={advanced} -> copies {list(zip(src, dst))}")
        self.manager = hybrid_capture(before, jnp.asarray(slots, jnp.int32), jnp.asarray(advanced))
        m.copy(src, dst)
        event(f"capture: {'copied' if src else 'nothing on a boundary'}")
        for name in ("slots", "seq_lens", "groups"):
            _unchanged(getattr(before, name), getattr(self.manager, name))

    # ---------------------------------------------------------------- prefix blocks

    @rule(data=st.data())
    def take_prefix(self, data):
        """A prefix cache keeps the first ``k`` units of a held slot: one
        more owner of those blocks in each group (``incref_blocks``)."""
        m = self.model
        long_enough = [s for s, n in m.held.items() if n >= UNIT]
        if not long_enough:
            return
        s = data.draw(st.sampled_from(sorted(long_enough)), label="slot")
        k = data.draw(st.integers(1, m.held[s] // UNIT), label="units")
        rows = {g: [m.tables[g][s][: k * UNIT // GROUP_TOKENS[g]]] for g in GROUPS}
        before = self.manager
        manager, ok = hybrid_incref(before, self._ids_arg({g: rows[g][0] for g in GROUPS}))
        assert bool(ok)
        for g in GROUPS:
            m.cache[g].update(rows[g][0])
        m.prefixes.append((k, {g: rows[g][0] for g in GROUPS}))
        self.manager = manager
        event("take_prefix")

    @rule(data=st.data())
    def drop_prefix(self, data):
        """The cache evicts a prefix it took: ``release_blocks`` of it."""
        m = self.model
        if not m.prefixes:
            return
        i = data.draw(st.integers(0, len(m.prefixes) - 1), label="prefix")
        k, blocks = m.prefixes[i]
        expect = all(m.cache[g][b] >= collections.Counter(blocks[g])[b] for g in GROUPS for b in blocks[g])
        before = self.manager
        manager, ok = hybrid_release_blocks(before, self._ids_arg(blocks))
        assert bool(ok) == expect  # False when random releases below dropped its references already
        if not expect:
            return self._failed(before, manager, "drop_prefix")
        for g in GROUPS:
            m.cache[g].subtract(blocks[g])
        m.prefixes.pop(i)
        self.manager = manager
        event("drop_prefix")

    def _block_pool(self, g: str) -> list:
        m = self.model
        held = sorted(b for b, c in m.refs(g).items() if c > 0)
        return held * 3 + sorted(m.free(g))[:3] + [0, -1, -1, -2, NUM_BLOCKS[g], 2**31 - 1]

    @rule(data=st.data(), op=st.sampled_from(["incref", "release"]))
    def owners(self, data, op):
        """``incref_blocks`` / ``release_blocks`` of random ids: a release
        may drop only references held outside the tables."""
        m = self.model
        ids = {g: data.draw(st.lists(st.sampled_from(self._block_pool(g)), max_size=4), label=f"{g} ids")
               for g in GROUPS}
        refs = {g: m.refs(g) for g in GROUPS}
        given = {g: [b for b in ids[g] if b != -1] for g in GROUPS}
        in_range = all(1 <= b < NUM_BLOCKS[g] for g in GROUPS for b in given[g])
        if op == "incref":
            expect = in_range and all(refs[g][b] > 0 for g in GROUPS for b in given[g])
        else:
            expect = in_range and all(m.cache[g][b] >= n for g in GROUPS for b, n in
                                      collections.Counter(given[g]).items())
        fn = hybrid_incref if op == "incref" else hybrid_release_blocks
        before = self.manager
        manager, ok = fn(before, self._ids_arg(ids))
        note(f"{op}_blocks {ids} -> expect {expect}")
        assert bool(ok) == expect, (op, ids, {g: dict(m.cache[g]) for g in GROUPS})
        if not expect:
            return self._failed(before, manager, f"{op}_blocks")
        for g in GROUPS:
            if op == "incref":
                m.cache[g].update(given[g])
            else:
                m.cache[g].subtract(given[g])
        m.prefixes = [p for p in m.prefixes if all(m.cache[g][b] > 0 for g in GROUPS for b in p[1][g])]
        self.manager = manager
        event(f"{op}_blocks: ok")

    @rule(data=st.data())
    def attach(self, data):
        """``attach_prefix`` of cached prefixes (or junk) to slots (empty
        admitted ones, or anything else), with good and bad lengths,
        snapshots and block rows."""
        m = self.model
        empty = [s for s, n in m.held.items() if n == 0]
        slots = self._slots(data, "attach slots", sorted(empty))
        rows = {g: [] for g in GROUPS}
        tokens, snapshots, kinds = [], [], []
        for s in slots:
            kind = data.draw(st.sampled_from(["cached"] * 5 + ["nothing", "short", "long", "hole", "repeat",
                                                               "junk", "bad_snapshot", "negative"]), label="kind")
            if kind in ("cached", "short", "long", "hole", "repeat", "bad_snapshot") and not m.prefixes:
                kind = "nothing"
            if kind == "nothing":
                k, blocks = 0, {g: [] for g in GROUPS}
            elif kind == "junk":
                k = data.draw(st.integers(0, 2), label="units")
                blocks = {g: data.draw(st.lists(st.sampled_from(self._block_pool(g)), min_size=k * UNIT //
                                                GROUP_TOKENS[g], max_size=k * UNIT // GROUP_TOKENS[g]), label=g)
                          for g in GROUPS}
            elif kind == "negative":
                k, blocks = -1, {g: [] for g in GROUPS}
            else:
                k, blocks = data.draw(st.sampled_from(m.prefixes), label="prefix")
                blocks = {g: list(v) for g, v in blocks.items()}
                g = data.draw(st.sampled_from(GROUPS), label="group")
                if kind == "hole" and len(blocks[g]) > 1:
                    blocks[g][0] = -1
                elif kind == "repeat" and len(blocks[g]) > 1:
                    blocks[g][-1] = blocks[g][0]
            n = k * UNIT
            if kind == "short":
                n -= data.draw(st.sampled_from([1, 32, UNIT]), label="less")
            elif kind == "long":
                n += data.draw(st.sampled_from([1, 32, UNIT]), label="more")
            snapshot = data.draw(st.integers(-1, NUM_SNAPSHOTS - 1), label="snapshot")
            if kind == "bad_snapshot":
                snapshot = data.draw(st.sampled_from([NUM_SNAPSHOTS, -2, 99, 2**31 - 1]), label="bad snapshot")
            for g in GROUPS:
                rows[g].append(blocks[g])
            tokens.append(n)
            snapshots.append(snapshot)
            kinds.append(kind)
        # What the manager must decide.
        refs = {g: m.refs(g) for g in GROUPS}
        active = [b for b, s in enumerate(slots) if s != -1]
        expect = len({slots[b] for b in active}) == len(active)
        for b in active:
            s, n = slots[b], tokens[b]
            expect &= s in m.held and m.held[s] == 0 and n >= 0 and -1 <= snapshots[b] < NUM_SNAPSHOTS
            for g in GROUPS:
                ids = rows[g][b]
                expect &= (-1 not in ids and len(set(ids)) == len(ids) and all(1 <= i < NUM_BLOCKS[g] for i in ids)
                           and all(refs[g][i] > 0 for i in ids) and len(ids) == _group_blocks(g, max(n, 0)))
        before = self.manager
        manager, ok = hybrid_attach(before, jnp.asarray(slots, jnp.int32), self._blocks_arg(rows),
                                    jnp.asarray(tokens, jnp.int32), jnp.asarray(snapshots, jnp.int32))
        note(f"attach {slots} tokens={tokens} snapshots={snapshots} kinds={kinds} -> expect {expect}")
        assert bool(ok) == expect, (slots, tokens, snapshots, kinds, rows)
        if not expect:
            return self._failed(before, manager, "attach_prefix")
        src, dst = [], []
        for b in active:
            s = slots[b]
            m.held[s] = tokens[b]
            for g in GROUPS:
                m.tables[g][s] = list(rows[g][b])
            if snapshots[b] >= 0:
                src.append(NUM_SLOTS + snapshots[b])
                dst.append(s)
        m.copy(src, dst)
        self.manager = manager
        attached = any(rows[GROUPS[0]][b] for b in active)
        event(f"attach_prefix: ok ({'a cached prefix attached' if attached else 'nothing attached'})")

    @rule(data=st.data())
    def bad_groups(self, data):
        """A blocks dict that lacks a group or names an unknown one:
        ``InvalidArgument`` naming both lists, before anything happens."""
        groups = data.draw(st.sampled_from([("full",), ("hca128",), (), ("full", "hca128", "csa4"),
                                            ("full", "nope")]), label="groups")
        blocks = {g: jnp.full((ROWS, GROUP_WIDTH.get(g, 2)), -1, jnp.int32) for g in groups}
        none = jnp.full((ROWS,), -1, jnp.int32)
        before = self.manager
        op = data.draw(st.sampled_from(["attach_prefix", "incref_blocks", "release_blocks"]), label="op")
        call = {"attach_prefix": lambda: hybrid_attach(before, none, blocks, jnp.zeros((ROWS,), jnp.int32), none),
                "incref_blocks": lambda: hybrid_incref(before, blocks),
                "release_blocks": lambda: hybrid_release_blocks(before, blocks)}[op]
        with pytest.raises(InvalidArgument, match=r"\['full', 'hca128'\]"):
            call()
        _unchanged(before, self.manager)
        event(f"{op}: bad groups refused")

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        m = self.model
        manager = jax.device_get(self.manager)
        held = np.asarray(manager.slots.ref_counts)
        assert sorted(np.nonzero(held)[0].tolist()) == sorted(m.held), (held, m.held)
        np.testing.assert_array_equal(manager.seq_lens, [m.held.get(s, 0) for s in range(NUM_SLOTS)])
        for g in GROUPS:
            group = manager.groups[g]
            tables, lens, counts = np.asarray(group.tables), np.asarray(group.lens), np.asarray(group.allocator.ref_counts)
            for s in range(NUM_SLOTS):
                want = m.tables[g].get(s, []) if s in m.held else []
                assert tables[s, : lens[s]].tolist() == want and (tables[s, lens[s]:] == -1).all(), (g, s, tables[s])
            refs = m.refs(g)
            np.testing.assert_array_equal(counts, [refs[b] for b in range(NUM_BLOCKS[g])],
                                          err_msg=f"{g}: ref counts != table entries + cache references")
            free = np.asarray(group.allocator.free_ids)[: int(group.allocator.num_free)].tolist()
            assert len(set(free)) == len(free) and set(free) == m.free(g), (g, sorted(free), sorted(m.free(g)))
            in_tables = {b for t in m.tables[g].values() for b in t}
            assert not in_tables & set(free), (g, "a block is free while a table names it")
        for i, (mirror, leaf) in enumerate(zip(m.rows, state_leaves(manager))):
            np.testing.assert_array_equal(np.asarray(leaf), mirror, err_msg=f"state leaf {i} differs from the model")


TestSnapshotMachine = pytest.mark.slow(SnapshotMachine.TestCase)  # the long pass (tests/conftest.py)


# ==========================================================================
# PrefixCacheManager pins, misses included, against reset and eviction
# ==========================================================================

PREFIX_BASES = ((1, 2, 1, 3, 2, 2, 1, 3), (1, 2, 3, 3, 1, 1, 2, 2))
PREFIX_TOKENS = st.builds(lambda base, cut, tail: list(PREFIX_BASES[base][:cut]) + tail,  # shared stems: hits
                          st.integers(0, 1), st.integers(0, 8), st.lists(st.integers(1, 3), max_size=3))
PREFIX_NAMESPACES = (None, "a")


class PrefixPinMachine(RuleBasedStateMachine):
    """The engine's use of ``PrefixCacheManager``: ``match`` then ``pin``
    whatever it returned (a miss returns the namespace root, or None when
    the namespace has nothing cached), later ``release``; with inserts,
    evictions and ``reset`` in between. The model is the list of pins held:
    ``reset`` must refuse (``CacheLocked``, nothing changed) exactly while
    one is held, each held pin's ``release`` must succeed, and a release
    with no pin left must raise ``InvalidArgument``, changing nothing."""

    def __init__(self):
        super().__init__()
        self.cache = PrefixCacheManager(2)
        self.held: list = []  # one entry per pin held (nodes may repeat)
        self.next_block = 1

    def _stats(self):
        return (self.cache.stats(), sorted(self.cache.device_blocks()),
                sum(root.pins for root in self.cache.tree.roots.values()))

    @rule(tokens=PREFIX_TOKENS, namespace=st.sampled_from(PREFIX_NAMESPACES))
    def insert(self, tokens, namespace):
        blocks = list(range(self.next_block, self.next_block + len(tokens) // 2))
        self.next_block += len(blocks)
        self.cache.insert(tokens, blocks, namespace)

    @rule(tokens=PREFIX_TOKENS, namespace=st.sampled_from(PREFIX_NAMESPACES + ("fresh",)))
    def match_and_pin(self, tokens, namespace):
        result = self.cache.match(tokens, namespace, max_tokens=max(len(tokens) - 1, 0))
        self.cache.pin(result.node)
        if result.node is not None:
            self.held.append(result.node)
        event("pin: " + ("nothing (no root)" if result.node is None else
                         "a miss (the root)" if result.node.parent is None else "a hit"))

    @rule(data=st.data())
    def release(self, data):
        if not self.held:
            return
        node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="pin"))
        self.cache.release(node)

    @rule(data=st.data())
    def release_unpinned(self, data):
        """A node (or root) with no pin of ours left: ``InvalidArgument``."""
        candidates = [n for n in [*self.cache.tree.nodes(), *self.cache.tree.roots.values()]
                      if sum(h is n for h in self.held) == 0]
        if not candidates:
            return
        node = data.draw(st.sampled_from(candidates), label="node")
        before = self._stats()
        with pytest.raises(InvalidArgument):
            self.cache.release(node)
        assert self._stats() == before
        event("release without a pin: refused")

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        self.cache.evict(n)
        for node in self.held:
            assert self.cache.tree.owns(node), "a pinned prefix was evicted"

    @rule()
    def reset(self):
        if self.held:
            before = self._stats()
            with pytest.raises(CacheLocked):
                self.cache.reset()
            assert self._stats() == before
            event("reset: refused while pinned")
        else:
            self.cache.reset()
            assert self.cache.stats().num_nodes == 0
            event("reset: done")

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        path_nodes = {}
        for node in self.held:
            while node.parent is not None:
                path_nodes[id(node)] = node
                node = node.parent
        assert self.cache.stats().protected_tokens == sum(n.num_tokens for n in path_nodes.values())
        assert sum(root.pins for root in self.cache.tree.roots.values()) == sum(n.parent is None for n in self.held)


TestPrefixPinMachine = PrefixPinMachine.TestCase
