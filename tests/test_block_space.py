"""Tests of BlockSpaceManager (seed 003: vLLM's block space manager, on device).

* a hypothesis state machine against a plain-Python model (seq -> block ids,
  block -> ref count, free set) covering allocate / append_slots (1 and 3
  tokens, copy-on-write) / fork / free / reset / can_allocate / token_slots,
  failing calls included; every invariant is checked after every step, and a
  one-value-per-token pool checks that each sequence reads back its own tokens;
* copy-on-write with a real two-layer KVPool (fp32 and fp8): parent and forked
  children read the shared prefix followed by their own writes, bit-identical;
* 1,000 decode steps (free / allocate / fork / append) inside one ``lax.scan``
  under ``jit``, replayed in the Python model;
* host-side argument errors.

The model's block ids mirror the ids the device hands out (the free stack's
order is an implementation detail); every new id is checked to come from the
model's free set. The model decides copy-on-write by replaying vLLM's
sequential appends in *reverse* batch order (copy while the block has another
owner), which is exactly "when all owners append, the first in batch order
keeps the block, the others copy; otherwise every appender copies".

Device ops go through module-level jitted functions with fixed argument widths
(padded with -1), so each configuration compiles once.
"""

from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jaxkv import BlockAllocator, InvalidArgument, KVPool
from jaxkv.manager.block_space import (
    ALLOC_LATER,
    ALLOC_NEVER,
    ALLOC_OK,
    FREE,
    ON_DEVICE,
    BlockSpaceManager,
)

BS = 4
NUM_BLOCKS = 14  # 13 usable
MAX_SEQS = 6
MAX_BLOCKS = 5
MAX_LEN = BS * MAX_BLOCKS  # 20 tokens per sequence at most
HOST_BLOCKS = 4
WATERMARK = 0.2  # int(0.2 * 14) = 2 blocks
WATERMARK_BLOCKS = 2
ALLOC_W = MAX_SEQS  # width of allocate / free arguments
APPEND_W = MAX_SEQS + 1  # width of append batches (room for one poison entry)
FORK_W = 3  # pairs per fork call
WRITE_W = 24  # token writes per call (>= APPEND_W * 3 and >= MAX_LEN)
BAD_ROWS = (MAX_SEQS, 99, -2)  # rows that are not rows


def make_manager() -> BlockSpaceManager:
    return BlockSpaceManager.create(
        num_device_blocks=NUM_BLOCKS, num_host_blocks=HOST_BLOCKS, block_size=BS,
        max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS, watermark=WATERMARK,
    )


def make_value_pool(num_pages: int = NUM_BLOCKS, page_size: int = BS) -> KVPool:
    """One float per token: enough to tell every written token apart."""
    return KVPool.create(num_pages=num_pages, page_size=page_size, num_layers=1, k_heads=1, k_dim=1,
                         dtype=jnp.float32)


ALLOCATE = jax.jit(BlockSpaceManager.allocate)
APPEND_1 = jax.jit(lambda m, pool, ids: m.append_slots(pool, ids, 1))
APPEND_3 = jax.jit(lambda m, pool, ids: m.append_slots(pool, ids, 3))
CAN_APPEND = {n: jax.jit(lambda m, ids, n=n: m.can_append(ids, n)) for n in (1, 3)}
APPEND = {1: APPEND_1, 3: APPEND_3}
FORK = jax.jit(BlockSpaceManager.fork)
FREE_SEQS = jax.jit(BlockSpaceManager.free)
CAN_ALLOCATE = jax.jit(BlockSpaceManager.can_allocate)
TOKEN_SLOTS = jax.jit(BlockSpaceManager.token_slots)


@jax.jit
def read_values(m: BlockSpaceManager, pool: KVPool):
    """``token_slots`` of every row at every position, and the value stored there."""
    rows = jnp.arange(m.max_seqs, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(m.max_blocks_per_seq * m.block_size, dtype=jnp.int32),
                           (m.max_seqs, m.max_blocks_per_seq * m.block_size))
    slots = m.token_slots(rows, pos)
    k, _ = pool.get_kv(0, slots)
    return slots, k.reshape(slots.shape)


@jax.jit
def write_values(pool: KVPool, slots, values):
    v = values.reshape(-1, 1, 1)
    return pool.set_kv(0, slots.reshape(-1), v, v)


def blocks_for(n: int, bs: int = BS) -> int:
    return -(-n // bs)


def pad(values, width: int) -> np.ndarray:
    values = list(values)
    assert len(values) <= width
    return np.asarray(values + [-1] * (width - len(values)), np.int32)


def padded(data, values, width: int) -> np.ndarray:
    """``values`` padded with -1 to ``width``, -1s interleaved in a drawn order."""
    arr = list(values) + [-1] * (width - len(values))
    assert len(arr) == width
    return np.asarray(data.draw(st.permutations(arr), label="arg"), np.int32)


# ----------------------------------------------------------------- the model


Plan = collections.namedtuple("Plan", "ok blocked cow fresh why")


class SpaceModel:
    """Plain-Python block space manager: ``tables[row]`` (ON_DEVICE rows only),
    ``lens[row]``, ``refs[block]`` and, per row, the value of every token."""

    def __init__(self, num_blocks=NUM_BLOCKS, bs=BS, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS,
                 watermark_blocks=WATERMARK_BLOCKS):
        self.num_blocks, self.bs, self.max_seqs, self.max_blocks = num_blocks, bs, max_seqs, max_blocks
        self.watermark_blocks = watermark_blocks
        self.reset()

    def reset(self):
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.vals: dict[int, list[float]] = {}
        self.refs = {i: 0 for i in range(1, self.num_blocks)}

    # -- queries
    def free_blocks(self) -> list[int]:
        return sorted(i for i, c in self.refs.items() if c == 0)

    def on_rows(self) -> list[int]:
        return sorted(self.tables)

    def free_rows(self) -> list[int]:
        return [r for r in range(self.max_seqs) if r not in self.tables]

    def in_range(self, r) -> bool:
        return 0 <= r < self.max_seqs

    def on_device(self, r) -> bool:
        return self.in_range(r) and r in self.tables

    def can_allocate(self, n: int) -> int:
        need = blocks_for(n, self.bs)
        if need > self.num_blocks - 1 - self.watermark_blocks or need > self.max_blocks:
            return ALLOC_NEVER
        if len(self.free_blocks()) - need < self.watermark_blocks:
            return ALLOC_LATER
        return ALLOC_OK

    # -- allocate
    def allocate_ok(self, ids, n: int) -> bool:
        given = [int(r) for r in ids if r != -1]
        return (
            len(given) >= 1
            and all(self.in_range(r) and r not in self.tables for r in given)
            and len(set(given)) == len(given)
            and n >= 1
            and blocks_for(n, self.bs) <= self.max_blocks
            and blocks_for(n, self.bs) <= len(self.free_blocks())
        )

    def apply_allocate(self, ids, n: int, new_tables: np.ndarray) -> list[int]:
        given = [int(r) for r in ids if r != -1]
        k = blocks_for(n, self.bs)
        got = new_tables[given[0], :k].tolist()
        assert len(set(got)) == k and set(got) <= set(self.free_blocks()), (got, self.free_blocks())
        for r in given:  # every sequence of the group names the same blocks
            assert new_tables[r, :k].tolist() == got, (r, new_tables[r], got)
            self.tables[r] = list(got)
            self.lens[r] = n
        for b in got:
            self.refs[b] = len(given)
        return given

    # -- append
    def append_plan(self, ids, n: int) -> Plan:
        lanes = [(b, int(r)) for b, r in enumerate(ids) if r != -1]
        times = collections.Counter(r for _, r in lanes)
        bad = {b: not self.on_device(r) or blocks_for(self.lens[r] + n, self.bs) > self.max_blocks
               for b, r in lanes}
        dup = {b: times[r] > 1 for b, r in lanes}
        if any(bad.values()) or any(dup.values()):
            blocked = [bool(bad.get(b) or dup.get(b)) for b in range(len(ids))]
            why = "too long" if any(bad.values()) and all(self.on_device(r) for _, r in lanes) else (
                "row not on device" if any(bad.values()) else "duplicate row")
            return Plan(False, blocked, None, None, why)
        refs = dict(self.refs)
        cow, fresh = {}, {}
        for b, r in reversed(lanes):  # vLLM's sequential rule, last lane first
            length = self.lens[r]
            last = self.tables[r][-1]
            cow[r] = length % self.bs != 0 and refs[last] > 1
            if cow[r]:
                refs[last] -= 1
            fresh[r] = blocks_for(length + n, self.bs) - blocks_for(length, self.bs)
        takes = {r: cow[r] + fresh[r] for r in cow}
        if sum(takes.values()) > len(self.free_blocks()):
            return Plan(False, [r != -1 and takes[int(r)] > 0 for r in ids], None, None, "oom")
        return Plan(True, [False] * len(ids), cow, fresh, "")

    def apply_append(self, ids, n: int, plan: Plan, new_tables: np.ndarray, slots: np.ndarray) -> dict:
        """Check the new tables and slots against the plan and adopt the new ids;
        returns {lane: row} of the lanes that appended."""
        free_before = set(self.free_blocks())
        new_ids = []
        lanes = {b: int(r) for b, r in enumerate(ids) if r != -1}
        for b, r in lanes.items():
            old, length = self.tables[r], self.lens[r]
            k = blocks_for(length + n, self.bs)
            row = new_tables[r].tolist()
            assert len(row) == self.max_blocks
            assert row[: len(old) - 1] == old[:-1], (r, old, row)  # full blocks never move
            if plan.cow[r]:
                assert row[len(old) - 1] != old[-1], ("no copy-on-write", r, old, row)
                new_ids.append(row[len(old) - 1])
                self.refs[old[-1]] -= 1
                assert self.refs[old[-1]] >= 1
            else:
                assert row[len(old) - 1] == old[-1], ("unexpected copy", r, old, row)
            new_ids += row[len(old):k]
            assert k - len(old) == plan.fresh[r]
            self.tables[r] = row[:k]
            self.lens[r] = length + n
            # slots: the new tokens' places through the new table
            for i in range(n):
                pos = length + i
                s = int(slots[b, i])
                assert s // self.bs == row[pos // self.bs] and s % self.bs == pos % self.bs, (r, pos, s, row)
        assert len(set(new_ids)) == len(new_ids) and set(new_ids) <= free_before, (new_ids, free_before)
        for i in new_ids:
            self.refs[i] = 1
        for b in range(len(ids)):
            if b not in lanes:
                assert (slots[b] == -1).all(), slots
        given_slots = [int(slots[b, i]) for b in lanes for i in range(n)]
        assert len(set(given_slots)) == len(given_slots), given_slots
        return lanes

    # -- fork / free
    def fork_ok(self, src, dst) -> bool:
        pairs = [(int(s), int(d)) for s, d in zip(src, dst) if s != -1 and d != -1]
        dsts = [d for _, d in pairs]
        return (all(self.on_device(s) for s, _ in pairs)
                and all(self.in_range(d) and d not in self.tables for d in dsts)
                and len(set(dsts)) == len(dsts))

    def apply_fork(self, src, dst) -> int:
        pairs = [(int(s), int(d)) for s, d in zip(src, dst) if s != -1 and d != -1]
        for s, d in pairs:
            self.tables[d] = list(self.tables[s])
            self.lens[d] = self.lens[s]
            self.vals[d] = list(self.vals[s])
            for b in self.tables[s]:
                self.refs[b] += 1
        return len(pairs)

    def free_ok(self, ids) -> bool:
        given = [int(r) for r in ids if r != -1]
        return all(self.on_device(r) for r in given) and len(set(given)) == len(given)

    def apply_free(self, ids) -> None:
        for r in (int(r) for r in ids if r != -1):
            for b in self.tables.pop(r):
                self.refs[b] -= 1
                assert self.refs[b] >= 0
            del self.lens[r]
            self.vals.pop(r, None)


# ------------------------------------------------------------- invariants


def check_space(state: BlockSpaceManager, model: SpaceModel, fresh_host: BlockAllocator) -> None:
    """Every documented invariant of ``state`` (numpy), and agreement with ``model``."""
    nb, bs, ms, mb = model.num_blocks, model.bs, model.max_seqs, model.max_blocks
    tables = np.asarray(state.block_tables)
    lens = np.asarray(state.seq_lens)
    status = np.asarray(state.status)
    refs = np.asarray(state.device.ref_counts)
    num_free = int(state.device.num_free)
    free_ids = np.asarray(state.device.free_ids)
    assert tables.shape == (ms, mb) and tables.dtype == np.int32
    assert lens.shape == (ms,) and lens.dtype == np.int32 and status.shape == (ms,) and status.dtype == np.int32
    assert state.block_size == bs and state.device.num_blocks == nb
    assert set(status.tolist()) <= {FREE, ON_DEVICE}, status  # swap is not implemented: nothing SWAPPED
    on = status == ON_DEVICE
    assert (tables != 0).all(), "block 0 (the null block) is named by a table"
    named = tables[on][tables[on] >= 0]
    assert (named < nb).all(), tables
    np.testing.assert_array_equal(refs, np.bincount(named, minlength=nb),
                                  err_msg="ref counts != table entries of ON_DEVICE rows")
    stack = free_ids[:num_free].tolist()
    assert len(set(stack)) == num_free and 0 not in stack, stack
    assert set(stack) == {i for i in range(1, nb) if refs[i] == 0}, ("free stack vs ref counts", stack, refs)
    assert not set(stack) & set(named.tolist()), "a block is both free and referenced"
    assert num_free + int((refs[1:] > 0).sum()) == nb - 1
    for r in range(ms):
        if on[r]:
            k = blocks_for(int(lens[r]), bs)
            assert 1 <= lens[r] <= mb * bs, (r, lens[r])
            assert (tables[r, :k] >= 1).all() and (tables[r, k:] == -1).all(), (r, lens[r], tables[r])
            assert len(set(tables[r, :k].tolist())) == k, tables[r]
        else:
            assert status[r] == FREE and lens[r] == 0 and (tables[r] == -1).all(), (r, status[r], lens[r], tables[r])
    chex.assert_trees_all_equal(fresh_host, state.host, strict=True)  # nothing touches host blocks yet
    # the model agrees
    assert sorted(np.flatnonzero(on).tolist()) == model.on_rows(), (on, model.on_rows())
    for r in model.on_rows():
        assert tables[r, : len(model.tables[r])].tolist() == model.tables[r], (r, tables[r], model.tables[r])
        assert int(lens[r]) == model.lens[r]
    np.testing.assert_array_equal(refs[1:], [model.refs[i] for i in range(1, nb)])


def check_values(state, pool, model: SpaceModel) -> None:
    """``token_slots`` follows the tables, and each row reads back its own tokens."""
    slots, vals = (np.asarray(x) for x in read_values(state, pool))
    tables = np.asarray(state.block_tables)
    pos = np.arange(model.max_blocks * model.bs)
    for r in range(model.max_seqs):
        page = tables[r, pos // model.bs]
        np.testing.assert_array_equal(slots[r], np.where(page >= 0, page * model.bs + pos % model.bs, -1))
    for r in model.on_rows():
        np.testing.assert_array_equal(vals[r, : model.lens[r]], np.asarray(model.vals[r], np.float32),
                                      err_msg=f"row {r} does not read back its tokens")


# ----------------------------------------------------------- state machine


class SpaceMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = make_manager()
        self.fresh_host = self.state.host
        self.pool = make_value_pool()
        self.model = SpaceModel()
        self.counter = 0

    def _values(self, k: int) -> list[float]:
        self.counter += k
        return [float(v) for v in range(self.counter - k + 1, self.counter + 1)]

    def _write(self, pool, slots, values):
        return write_values(pool, pad(slots, WRITE_W), np.asarray(values + [0.0] * (WRITE_W - len(values)), np.float32))

    # -- allocate

    @rule(data=st.data())
    def allocate(self, data):
        m = self.model
        free_rows = m.free_rows()
        group = data.draw(st.lists(st.sampled_from(free_rows), min_size=1, max_size=min(3, len(free_rows)),
                                   unique=True), label="group") if free_rows else []
        tokens = data.draw(st.integers(1, MAX_LEN), label="tokens")
        kinds = ["valid"] * 6 + ["empty", "too_long", "bad_tokens", "bad_row"]
        kinds += ["taken"] if m.on_rows() else []
        kinds += ["duplicate"] if group else []
        free_blocks = len(m.free_blocks())
        kinds += ["oom"] * 2 if free_blocks < MAX_BLOCKS else []
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "empty":
            group = []
        elif kind == "too_long":
            tokens = data.draw(st.sampled_from([MAX_LEN + 1, MAX_LEN + BS + 3, 2**31 - 1]), label="tokens")
        elif kind == "bad_tokens":
            tokens = data.draw(st.sampled_from([0, -1, -(2**31)]), label="tokens")
        elif kind == "bad_row":
            group = group[:2] + [data.draw(st.sampled_from(BAD_ROWS), label="row")]
        elif kind == "taken":
            group = group[:2] + [data.draw(st.sampled_from(m.on_rows()), label="row")]
        elif kind == "duplicate":
            group = group + [group[0]]
        elif kind == "oom":
            tokens = data.draw(st.integers(free_blocks * BS + 1, MAX_BLOCKS * BS), label="tokens")
        self._allocate(data, group, tokens, kind)

    @initialize(data=st.data())
    def shared_prompt(self, data):
        """Start with a group sharing a prompt, so copy-on-write is near."""
        group = data.draw(st.lists(st.sampled_from(range(MAX_SEQS)), min_size=2, max_size=3, unique=True))
        self._allocate(data, group, data.draw(st.integers(1, 10), label="tokens"), "initial")

    def _allocate(self, data, group, tokens, kind):
        m = self.model
        ids = padded(data, group, ALLOC_W)
        expect = m.allocate_ok(ids, tokens)
        note(f"allocate {ids.tolist()} tokens={tokens} kind={kind} -> expect ok={expect}")
        before = self.state
        state, ok = ALLOCATE(before, ids, np.int32(tokens))
        assert np.asarray(ok).shape == () and bool(ok) == expect, (kind, ids, tokens)
        event(f"allocate {kind}: {'ok' if expect else 'fails'}")
        if not expect:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        given = m.apply_allocate(ids, tokens, np.asarray(state.block_tables))
        self.state = state
        # write the prompt once, through the first sequence's table (they all share it)
        slots, _ = read_values(state, self.pool)
        values = self._values(tokens)
        self.pool = self._write(self.pool, np.asarray(slots)[given[0], :tokens].tolist(), values)
        for r in given:
            m.vals[r] = list(values)

    @rule(n=st.integers(1, MAX_LEN + 6))
    def can_allocate(self, n):
        got = int(CAN_ALLOCATE(self.state, np.int32(n)))
        assert got == self.model.can_allocate(n), (n, got, self.model.free_blocks())

    # -- append

    @rule(data=st.data(), n=st.sampled_from([1, 3]))
    def append_slots(self, data, n):
        m = self.model
        on = m.on_rows()
        if data.draw(st.booleans(), label="everyone"):
            batch = data.draw(st.permutations(on), label="batch")
        else:
            batch = data.draw(st.lists(st.sampled_from(on), unique=True), label="batch") if on else []
        kind = data.draw(st.sampled_from(["none"] * 5 + ["free_row", "bad_row", "duplicate"]), label="poison")
        if kind == "free_row" and m.free_rows():
            batch = batch + [data.draw(st.sampled_from(m.free_rows()), label="row")]
        elif kind == "bad_row":
            batch = batch + [data.draw(st.sampled_from(BAD_ROWS), label="row")]
        elif kind == "duplicate" and batch:
            batch = batch + [data.draw(st.sampled_from(batch), label="row")]
        ids = padded(data, batch, APPEND_W)
        plan = m.append_plan(ids, n)
        note(f"append n={n} {ids.tolist()} -> expect ok={plan.ok} blocked={plan.blocked} cow={plan.cow}")
        before, pool_before = self.state, self.pool
        assert bool(CAN_APPEND[n](before, ids)) == plan.ok, (ids, n)  # the same count, without the step
        state, pool, slots, blocked, ok = APPEND[n](before, pool_before, ids)
        slots, blocked = np.asarray(slots), np.asarray(blocked)
        assert slots.shape == (APPEND_W, n) and slots.dtype == np.int32
        assert blocked.shape == (APPEND_W,) and blocked.dtype == np.bool_
        assert bool(ok) == plan.ok, (ids, n)
        assert blocked.tolist() == plan.blocked, (ids, n, blocked, plan.blocked)
        if not plan.ok:
            event(f"append n={n}: fails ({plan.why})")
            chex.assert_trees_all_equal(before, state, strict=True)
            chex.assert_trees_all_equal(pool_before, pool, strict=True)
            assert (slots == -1).all(), slots
            return
        for r, copied in plan.cow.items():
            if copied:
                event("append: copy-on-write")
            elif m.lens[r] % BS and m.refs[m.tables[r][-1]] > 1:
                event("append: kept a shared block in place")
        lanes = m.apply_append(ids, n, plan, np.asarray(state.block_tables), slots)
        self.state = state
        # each appending sequence writes fresh values at its slots
        flat, values = [], []
        for b, r in lanes.items():
            vals = self._values(n)
            flat += slots[b].tolist()
            values += vals
            m.vals[r] += vals
        self.pool = self._write(pool, flat, values)

    # -- fork

    @rule(data=st.data())
    def fork(self, data):
        m = self.model
        on, free_rows = m.on_rows(), m.free_rows()
        k = data.draw(st.integers(0, min(FORK_W, len(free_rows))), label="pairs")
        dst = data.draw(st.lists(st.sampled_from(free_rows), min_size=k, max_size=k, unique=True),
                        label="dst") if k else []
        src = [data.draw(st.sampled_from(on), label="src") for _ in dst] if on else [-1] * k
        kind = data.draw(st.sampled_from(["none"] * 4 + ["src_free", "dst_taken", "dup_dst", "bad_row",
                                          "half_pair"]), label="poison")
        pairs = list(zip(src, dst))
        if len(pairs) < FORK_W:
            if kind == "src_free" and free_rows:
                pairs.append((data.draw(st.sampled_from(free_rows)), data.draw(st.sampled_from(free_rows))))
            elif kind == "dst_taken" and on:
                pairs.append((data.draw(st.sampled_from(on)), data.draw(st.sampled_from(on))))
            elif kind == "dup_dst" and pairs:
                pairs.append((pairs[0][0], pairs[0][1]))
            elif kind == "bad_row" and on:
                bad = data.draw(st.sampled_from(BAD_ROWS))
                pairs.append(data.draw(st.sampled_from([(bad, free_rows[0] if free_rows else bad),
                                                        (on[0], bad)])))
            elif kind == "half_pair":  # skipped, whatever the other side holds
                junk = data.draw(st.sampled_from(list(BAD_ROWS) + list(range(MAX_SEQS))))
                pairs.append(data.draw(st.sampled_from([(junk, -1), (-1, junk)])))
        pairs += [(-1, -1)] * (FORK_W - len(pairs))
        pairs = data.draw(st.permutations(pairs), label="order")
        src = np.asarray([s for s, _ in pairs], np.int32)
        dst = np.asarray([d for _, d in pairs], np.int32)
        expect = m.fork_ok(src, dst)
        note(f"fork {src.tolist()} -> {dst.tolist()} kind={kind} expect ok={expect}")
        before = self.state
        state, ok = FORK(before, src, dst)
        assert bool(ok) == expect, (src, dst)
        event(f"fork {kind}: {'ok' if expect else 'fails'}")
        if not expect:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        m.apply_fork(src, dst)
        assert int(state.device.num_free) == int(before.device.num_free)  # fork never allocates
        self.state = state

    # -- free

    @rule(data=st.data())
    def free(self, data):
        m = self.model
        on = m.on_rows()
        rows = data.draw(st.lists(st.sampled_from(on), unique=True, max_size=4), label="rows") if on else []
        kind = data.draw(st.sampled_from(["none", "none", "free_row", "bad_row", "duplicate"]), label="poison")
        if kind == "free_row" and m.free_rows():
            rows = rows + [data.draw(st.sampled_from(m.free_rows()))]
        elif kind == "bad_row":
            rows = rows + [data.draw(st.sampled_from(BAD_ROWS))]
        elif kind == "duplicate" and rows:
            rows = rows + [rows[-1]]
        ids = padded(data, rows, ALLOC_W)
        expect = m.free_ok(ids)
        note(f"free {ids.tolist()} expect ok={expect}")
        before = self.state
        state, ok = FREE_SEQS(before, ids)
        assert bool(ok) == expect, ids
        event(f"free {kind}: {'ok' if expect else 'fails'}")
        if not expect:
            chex.assert_trees_all_equal(before, state, strict=True)
            return
        m.apply_free(ids)
        self.state = state

    # -- reset, when the cache is nearly full

    @precondition(lambda self: len(self.model.free_blocks()) <= 2)
    @rule()
    def reset(self):
        event("reset")
        self.state = self.state.reset()
        chex.assert_trees_all_equal(make_manager(), self.state, strict=True)
        self.model.reset()

    @invariant()
    def invariants(self):
        check_space(self.state, self.model, self.fresh_host)
        check_values(self.state, self.pool, self.model)


TestBlockSpaceMachine = SpaceMachine.TestCase


# ---------------------------------------------------- copy-on-write with data

L_LAYERS, K_HEADS, K_DIM, V_HEADS, V_DIM = 2, 2, 8, 1, 4


@jax.jit
def write_kv(pool: KVPool, slots, k, v):
    """k: [layers, n, k_heads, k_dim], v: [layers, n, v_heads, v_dim] at ``slots`` [n]."""
    for layer in range(pool.num_layers):
        pool = pool.set_kv(layer, slots, k[layer], v[layer])
    return pool


@jax.jit
def read_kv(pool: KVPool, slots):
    ks, vs = zip(*(pool.get_kv(layer, slots) for layer in range(pool.num_layers)))
    return jnp.stack(ks), jnp.stack(vs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn], ids=["fp32", "fp8_e4m3"])
@settings(max_examples=10)
@given(data=st.data())
def test_copy_on_write_keeps_each_sequence_data(dtype, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    rows = data.draw(st.permutations(range(MAX_SEQS)), label="rows")
    n_children = data.draw(st.integers(1, 2), label="children")
    parent, children = rows[0], list(rows[1: 1 + n_children])
    family = [parent] + children
    prompt = data.draw(st.integers(1, 12), label="prompt")

    m = make_manager()
    pool = KVPool.create(num_pages=NUM_BLOCKS, page_size=BS, num_layers=L_LAYERS, k_heads=K_HEADS, k_dim=K_DIM,
                         v_heads=V_HEADS, v_dim=V_DIM, dtype=dtype)
    expected: dict[int, list] = {r: [] for r in family}  # row -> per token (k [L,kh,kd], v [L,vh,vd]) read back

    def write(pool, slots):
        """Random K/V at ``slots`` (padded to WRITE_W); returns the pool and what reads back."""
        n = len(slots)
        k = rng.standard_normal((L_LAYERS, WRITE_W, K_HEADS, K_DIM)).astype(np.float32)
        v = rng.standard_normal((L_LAYERS, WRITE_W, V_HEADS, V_DIM)).astype(np.float32)
        padded_slots = pad(slots, WRITE_W)
        pool = write_kv(pool, padded_slots, k, v)
        rk, rv = (np.asarray(x) for x in read_kv(pool, padded_slots))
        if dtype == jnp.float32:  # fp32 stores exactly what was written
            np.testing.assert_array_equal(rk[:, :n], k[:, :n])
            np.testing.assert_array_equal(rv[:, :n], v[:, :n])
        else:  # fp8: close to it; entries far below the row's max fall to e4m3's subnormals
            row_max = np.abs(k[:, :n]).max(axis=-1, keepdims=True)
            tolerance = 0.13 * np.abs(k[:, :n]) + row_max / 448 * 2.0**-9
            assert (np.abs(rk[:, :n] - k[:, :n]) <= tolerance).all()
        return pool, [(rk[:, i], rv[:, i]) for i in range(n)]

    m, ok = ALLOCATE(m, pad([parent], ALLOC_W), np.int32(prompt))
    assert bool(ok)
    slots = np.asarray(TOKEN_SLOTS(m, pad([parent], APPEND_W), np.tile(np.arange(MAX_LEN, dtype=np.int32), (APPEND_W, 1))))
    pool, tokens = write(pool, slots[0, :prompt].tolist())
    expected[parent] = list(tokens)
    m, ok = FORK(m, pad([parent] * n_children, FORK_W), pad(children, FORK_W))
    assert bool(ok)
    for c in children:
        expected[c] = list(tokens)
    shared_prefix = np.asarray(m.block_tables)[parent, : blocks_for(prompt)].tolist()

    lens = {r: prompt for r in family}
    copies = 0
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        batch = data.draw(st.lists(st.sampled_from(family), min_size=1, unique=True), label="batch")
        ids = pad(batch, APPEND_W)
        before = np.asarray(m.block_tables)
        m, pool, slots, blocked, ok = APPEND_1(m, pool, ids)
        assert bool(ok) and not np.asarray(blocked).any()
        after = np.asarray(m.block_tables)
        for r in batch:
            if lens[r] % BS and after[r, lens[r] // BS] != before[r, lens[r] // BS]:
                copies += 1
            lens[r] += 1
        slots = np.asarray(slots)
        pool, tokens = write(pool, slots[: len(batch), 0].tolist())
        for r, tok in zip(batch, tokens):
            expected[r].append(tok)

    # every sequence reads, through its own table, exactly its own tokens
    for r in family:
        s = np.asarray(TOKEN_SLOTS(m, pad([r], APPEND_W), np.tile(np.arange(MAX_LEN, dtype=np.int32), (APPEND_W, 1))))
        s = s[0, : lens[r]]
        assert (s >= 0).all()
        rk, rv = (np.asarray(x) for x in read_kv(pool, pad(s, WRITE_W)))
        want_k = np.stack([k for k, _ in expected[r]], axis=1)
        want_v = np.stack([v for _, v in expected[r]], axis=1)
        np.testing.assert_array_equal(rk[:, : lens[r]], want_k, err_msg=f"K of row {r} ({'parent' if r == parent else 'child'})")
        np.testing.assert_array_equal(rv[:, : lens[r]], want_v, err_msg=f"V of row {r}")
    # the full prompt blocks are still shared by the whole family, in place
    full = prompt // BS
    for r in family:
        assert np.asarray(m.block_tables)[r, :full].tolist() == shared_prefix[:full]
    note(f"copies={copies}")


# --------------------------------------------------------------- lax.scan

S_BS, S_NB, S_SEQS, S_MAXB = 4, 20, 8, 6
S_LEN = S_BS * S_MAXB  # 24
S_GROUP = 3
S_STEPS = 1000


def _scan_step(carry, xs):
    m, pool, preempt = carry
    t, finish, admit, tokens, fork_src, fork_dst, perm = xs
    rows = jnp.arange(S_SEQS, dtype=jnp.int32)
    # 1. finished, preempted and full sequences leave, in one call
    fin = (finish | preempt | (m.seq_lens >= S_LEN)) & (m.status == ON_DEVICE)
    m, ok_free = m.free(jnp.where(fin, rows, -1))
    # 2. admit a group into the rows of it that are free (may be empty, too long, OOM)
    is_free = m.status[jnp.clip(admit, 0, S_SEQS - 1)] == FREE
    group = jnp.where((admit >= 0) & is_free, admit, -1)
    m, ok_alloc = m.allocate(group, tokens)
    first = group[jnp.argmax(group >= 0)]
    pos = jnp.arange(S_LEN, dtype=jnp.int32)
    pslots = m.token_slots(first[None], pos[None])[0]
    pslots = jnp.where(ok_alloc & (pos < tokens), pslots, -1)
    pvals = -(t * S_LEN + pos + 1).astype(jnp.float32)
    pool = pool.set_kv(0, pslots, pvals[:, None, None], pvals[:, None, None])
    tables_alloc = m.block_tables
    # 3. maybe fork (either side may be wrong: the op must refuse)
    m, ok_fork = m.fork(fork_src[None], fork_dst[None])
    # 4. every sequence on the device appends one token, in a shuffled order
    ids = jnp.where(m.status[perm] == ON_DEVICE, perm, -1)
    m, pool, slots, blocked, ok_app = m.append_slots(pool, ids, 1)
    vals = (t * 16 + rows + 1).astype(jnp.float32)
    pool = pool.set_kv(0, slots[:, 0], vals[:, None, None], vals[:, None, None])
    preempt = jnp.zeros((S_SEQS,), bool).at[jnp.where(blocked, ids, S_SEQS)].set(True, mode="drop")
    every = m.token_slots(rows, jnp.broadcast_to(pos, (S_SEQS, S_LEN)))
    seen = pool.get_kv(0, every)[0].reshape(S_SEQS, S_LEN)  # what each row reads back now
    ys = (ok_free, ok_alloc, ok_fork, ok_app, blocked, tables_alloc, m.block_tables, slots, m.device.num_free, seen)
    return (m, pool, preempt), ys


@jax.jit
def _run_scan(m, pool, xs):
    return jax.lax.scan(_scan_step, (m, pool, jnp.zeros((S_SEQS,), bool)), xs)


def _schedule(rng):
    t = np.arange(S_STEPS, dtype=np.int32)
    finish = rng.random((S_STEPS, S_SEQS)) < 0.03
    admit = np.full((S_STEPS, S_GROUP), -1, np.int32)
    for i in np.flatnonzero(rng.random(S_STEPS) < 0.35):
        k = rng.integers(1, S_GROUP + 1)
        admit[i, :k] = rng.choice(S_SEQS, size=k, replace=False)
        admit[i] = rng.permutation(admit[i])
    tokens = np.where(rng.random(S_STEPS) < 0.05, rng.integers(-1, S_LEN + 6, S_STEPS),
                      rng.integers(1, 14, S_STEPS)).astype(np.int32)
    do_fork = rng.random(S_STEPS) < 0.15
    fork_src = np.where(do_fork, rng.integers(0, S_SEQS, S_STEPS), -1).astype(np.int32)
    fork_dst = np.where(do_fork, rng.integers(0, S_SEQS, S_STEPS), -1).astype(np.int32)
    perm = np.stack([rng.permutation(S_SEQS) for _ in range(S_STEPS)]).astype(np.int32)
    return t, finish, admit, tokens, fork_src, fork_dst, perm


def test_scan_1000_decode_steps_match_python_replay():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    xs = _schedule(rng)
    m0 = BlockSpaceManager.create(num_device_blocks=S_NB, num_host_blocks=2, block_size=S_BS, max_seqs=S_SEQS,
                                  max_blocks_per_seq=S_MAXB)
    pool0 = make_value_pool(S_NB, S_BS)
    (m, pool, _), ys = _run_scan(m0, pool0, xs)
    ok_free, ok_alloc, ok_fork, ok_app, blocked, tables_alloc, tables_app, slots, num_free, seen = (
        np.asarray(y) for y in ys)

    _, finish, admit, tokens, fork_src, fork_dst, perm = xs
    model = SpaceModel(S_NB, S_BS, S_SEQS, S_MAXB, watermark_blocks=0)
    preempt = set()
    stats = collections.Counter()
    for t in range(S_STEPS):
        ctx = f"seed={seed} step={t}"
        fin = [r for r in model.on_rows() if finish[t, r] or r in preempt or model.lens[r] >= S_LEN]
        fin_ids = [r if r in fin else -1 for r in range(S_SEQS)]
        assert model.free_ok(fin_ids) and ok_free[t], ctx
        model.apply_free(fin_ids)
        group = [int(a) if a >= 0 and a not in model.tables else -1 for a in admit[t]]
        expect = model.allocate_ok(group, int(tokens[t]))
        assert bool(ok_alloc[t]) == expect, (ctx, group, tokens[t])
        if expect:
            given = model.apply_allocate(group, int(tokens[t]), tables_alloc[t])
            for r in given:
                model.vals[r] = [-float(t * S_LEN + p + 1) for p in range(tokens[t])]
            stats["alloc"] += 1
        else:
            stats["alloc_fail"] += 1
        expect = model.fork_ok([fork_src[t]], [fork_dst[t]])
        assert bool(ok_fork[t]) == expect, (ctx, fork_src[t], fork_dst[t])
        if expect:
            stats["fork"] += model.apply_fork([fork_src[t]], [fork_dst[t]])
        ids = [int(r) if r in model.tables else -1 for r in perm[t]]
        plan = model.append_plan(ids, 1)
        assert bool(ok_app[t]) == plan.ok, ctx
        assert blocked[t].tolist() == plan.blocked, (ctx, blocked[t], plan.blocked)
        if plan.ok:
            stats["kept"] += sum(1 for r in plan.cow if not plan.cow[r] and model.lens[r] % S_BS
                                 and model.refs[model.tables[r][-1]] > 1)
            stats["cow"] += sum(plan.cow.values())
            model.apply_append(ids, 1, plan, tables_app[t], slots[t])
            for b, r in enumerate(ids):
                if r != -1:
                    model.vals[r].append(float(t * 16 + b + 1))
        else:
            stats["append_fail"] += 1
        preempt = {ids[b] for b in range(S_SEQS) if plan.blocked[b]}
        assert int(num_free[t]) == len(model.free_blocks()), ctx
        for r in model.on_rows():
            np.testing.assert_array_equal(seen[t, r, : model.lens[r]], np.asarray(model.vals[r], np.float32),
                                          err_msg=f"{ctx}: row {r} does not read back its tokens")

    check_space(m, model, BlockAllocator.create(2))
    check_values(m, pool, model)
    # the run exercised what it claims to
    assert stats["cow"] > 20 and stats["kept"] > 5 and stats["fork"] > 10 and stats["append_fail"] > 5, (seed, stats)
    assert stats["alloc"] > 50 and stats["alloc_fail"] > 20, (seed, stats)


# ------------------------------------------------------------- host errors


def test_fork_with_mismatched_lengths_raises():
    m = make_manager()
    m, ok = ALLOCATE(m, pad([0], ALLOC_W), np.int32(5))
    assert bool(ok)
    with pytest.raises(InvalidArgument, match="2 sources but 3 destinations"):
        m.fork(np.asarray([0, -1], np.int32), np.asarray([1, 2, -1], np.int32))
    with pytest.raises(InvalidArgument):
        jax.jit(BlockSpaceManager.fork)(m, np.asarray([0, 0, 0], np.int32), np.asarray([1], np.int32))


@pytest.mark.parametrize(
    "bad",
    [{"block_size": 0}, {"block_size": -4}, {"max_seqs": 0}, {"max_blocks_per_seq": 0},
     {"max_blocks_per_seq": -1}, {"watermark": 1.0}, {"watermark": -0.01}, {"num_device_blocks": 1},
     {"num_device_blocks": 0}],
)
def test_create_rejects_bad_sizes(bad):
    args = {"num_device_blocks": NUM_BLOCKS, "num_host_blocks": HOST_BLOCKS, "block_size": BS, "max_seqs": MAX_SEQS,
                "max_blocks_per_seq": MAX_BLOCKS, "watermark": WATERMARK}
    args.update(bad)
    with pytest.raises(InvalidArgument):
        BlockSpaceManager.create(**args)


def test_create_and_token_slots_padding():
    m = make_manager()
    assert m.watermark_blocks == WATERMARK_BLOCKS and m.max_seqs == MAX_SEQS and m.max_blocks_per_seq == MAX_BLOCKS
    check_space(m, SpaceModel(), m.host)
    m, ok = ALLOCATE(m, pad([2, 4], ALLOC_W), np.int32(6))
    assert bool(ok)
    s = np.asarray(TOKEN_SLOTS(m, pad([-1, 2, 4, 3], APPEND_W), np.tile(np.arange(MAX_LEN, dtype=np.int32), (APPEND_W, 1))))
    table = np.asarray(m.block_tables)[2]
    assert (s[0] == -1).all() and (s[3] == -1).all() and (s[4:] == -1).all()  # padding and a FREE row
    np.testing.assert_array_equal(s[1], s[2])  # the group shares its prompt
    np.testing.assert_array_equal(s[1, :8], table[np.arange(8) // BS] * BS + np.arange(8) % BS)
    assert (s[1, 8:] == -1).all()  # past the sequence's blocks
