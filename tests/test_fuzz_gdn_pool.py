"""Fuzzing the track-slot path of ``GDNPool`` with real state data, against NumPy.

``GDNPoolMachine`` in ``tests/test_gdn_pool.py`` drives the device ops one at
a time. This machine drives what track slots are for (seed 002, prefix
caching of linear-attention layers): requests are admitted into request slots
(``reset_states``: the zero state), decode steps write **fresh random** conv
and recurrent states into them (with padding rows landing on slot 0), a
request's state is *snapshotted* into a track slot (``alloc_track_slot`` +
``copy_states``), later *restored* into the same or another request's slot,
and the track slot is freed. Host paths (``*_or_raise``) are used throughout,
as a scheduler would.

The model: both state arrays in NumPy (the conv state in bf16, written with
values bf16 holds exactly), the free request slots, the held track slots and,
for each held track slot, an independent copy of the state it snapshotted.

Bad inputs, each of which must raise its typed error (with the numbers) and
change nothing, checked on the device op too (``ok`` False, the pool returned
unchanged): double free of a track slot (after a free, or named twice in one
call), freeing request slots, the null slot and out-of-range ids, reset and
copy of the null slot and out-of-range ids, a repeated copy destination,
mismatched shapes, float / bool / str / None / NaN ids, alloc when no track
slot is free.

After every step: the arrays equal the model; each track slot is free or held
by exactly one snapshot (the device flags, the free count and the model
agree); each request slot is free or running, never both; and every held
track slot still holds exactly the state it snapshotted.

All device calls have fixed shapes (ids padded with -1), so each op compiles
once for the whole run.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.pool.gdn_pool import GDNPool
from kernels_pallas.bits import to_bits

LAYERS, MAX_REQS, TRACK = 2, 3, 3  # slots: 0 padding, 1..3 requests, 4..6 track
HK, HV, DK, DV, KERNEL = 1, 2, 3, 2, 3  # Dk != Dv: a transposed state would show
CONV_DIM = 2 * HK * DK + HV * DV  # 10
POOL_SIZE = MAX_REQS + 1 + TRACK
REQUEST_SLOTS = frozenset(range(1, MAX_REQS + 1))
TRACK_SLOTS = tuple(range(MAX_REQS + 1, POOL_SIZE))
CONV_DTYPE = jnp.bfloat16
LANES = 3  # decode batch
IDS = 2  # device-op id arrays, padded with -1

SET = jax.jit(GDNPool.set_layer_state)
RESET = jax.jit(GDNPool.reset_states)
COPY = jax.jit(GDNPool.copy_states)
FREE = jax.jit(GDNPool.free_track_slot)
ALLOC = jax.jit(GDNPool.alloc_track_slot)

SEEDS = st.integers(0, 2**32 - 1)
NOT_INTEGERS = [1.0, 4.5, True, False, np.bool_(True), np.float32(4), "4", None, float("nan")]


def padded(ids) -> np.ndarray:
    out = np.full(IDS, -1, np.int32)
    out[: len(ids)] = ids
    return out


def random_states(rng, n: int):
    """``n`` fresh random (recurrent, conv) states; conv values are bf16-exact."""
    recurrent = rng.standard_normal((n, HV, DV, DK)).astype(np.float32)
    conv = rng.standard_normal((n, CONV_DIM, KERNEL - 1)).astype(CONV_DTYPE)
    return recurrent, conv


def random_pool(rng) -> GDNPool:
    """Every slot (padding and track slots too) random: a missed write shows."""
    pool = GDNPool.create(MAX_REQS, LAYERS, HV, DK, DV, conv_kernel_size=KERNEL, num_k_heads=HK,
                          dtype=CONV_DTYPE, max_track_slots=TRACK)
    return pool.replace(
        recurrent_state=jnp.asarray(rng.standard_normal(pool.recurrent_state.shape).astype(np.float32)),
        conv_bits=to_bits(rng.standard_normal(pool.conv_state.shape).astype(CONV_DTYPE), CONV_DTYPE),
    )


# ---------------------------------------------------------------------- regression


def test_copy_states_or_raise_refuses_ids_that_are_not_integers():
    """Found by the machine below: ``copy_states_or_raise`` read its ids with
    ``np.asarray(ids, np.int64)``, so ``[4.5]``, ``[True]`` and ``["4"]`` were
    taken as slots 4, 1 and 4 (the copy happened), and NaN, None, a ragged
    list or an int past int64 raised untyped ``ValueError`` / ``TypeError`` /
    ``OverflowError``."""
    pool = random_pool(np.random.default_rng(7))
    for bad in ([4.5], [True], ["4"], [np.float32(4)], [float("nan")], [None], [1, [2]], [2**64]):
        for src, dst in ((bad, [2] * len(bad)), ([2] * len(bad), bad)):
            with pytest.raises(InvalidArgument, match="src|dst"):
                pool.copy_states_or_raise(src, dst)
    with pytest.raises(InvalidArgument, match=re.escape("src has shape (1,) but dst has shape (1, 1)")):
        pool.copy_states_or_raise([1], [[2]])
    copied = pool.copy_states_or_raise(np.array([4]), [np.int64(2)])  # numpy integers are fine
    np.testing.assert_array_equal(np.asarray(copied.recurrent_state)[:, 2], np.asarray(pool.recurrent_state)[:, 4])


# ---------------------------------------------------------------------- machine


class Snapshot:
    """What a track slot was filled with: an independent copy, all layers."""

    def __init__(self, source: int, recurrent: np.ndarray, conv: np.ndarray):
        self.source = source
        self.recurrent = recurrent.copy()
        self.conv = conv.copy()


class GDNTrackMachine(RuleBasedStateMachine):
    @initialize(seed=SEEDS)
    def start(self, seed):
        self.rng = np.random.default_rng(seed)
        self.pool = random_pool(self.rng)
        self.recurrent = np.array(self.pool.recurrent_state)
        self.conv = np.array(self.pool.conv_state)
        self.free_reqs = set(REQUEST_SLOTS)
        self.running: set[int] = set()
        self.snapshots: dict[int, Snapshot] = {}  # held track slot -> what it holds
        # One request from the start (``finish`` keeps one running), so that
        # the track-slot rules are enabled whichever rules an example draws.
        self._admit(min(self.free_reqs))

    # -------------------------------------------------------------- helpers

    def _copy_model(self, src, dst):
        old_r, old_c = self.recurrent.copy(), self.conv.copy()  # all sources read first
        for s, d in zip(src, dst):
            self.recurrent[:, d], self.conv[:, d] = old_r[:, s], old_c[:, s]

    def _state(self, slot):
        return np.asarray(self.pool.recurrent_state)[:, slot], np.asarray(self.pool.conv_state)[:, slot]

    def _refused(self, error, pattern, host_call, device_call=None):
        """``host_call`` raises ``error`` (message matching ``pattern``); the
        device op on the same ids says ``ok`` False and returns the pool unchanged."""
        before = self.pool
        with pytest.raises(error, match=pattern):
            host_call()
        if device_call is not None:
            after, ok = device_call()
            assert not bool(ok)
            chex.assert_trees_all_equal(before, after, strict=True)

    # -------------------------------------------------------------- requests

    @precondition(lambda self: self.free_reqs)
    @rule(data=st.data())
    def admit(self, data):
        """A new request starts from the zero state in every layer."""
        self._admit(data.draw(st.sampled_from(sorted(self.free_reqs))))

    def _admit(self, slot):
        self.pool = self.pool.reset_states_or_raise([slot])
        self.recurrent[:, slot] = 0
        self.conv[:, slot] = 0
        self.free_reqs.remove(slot)
        self.running.add(slot)

    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), pad_to_null=st.booleans())
    def decode(self, data, layer, pad_to_null):
        """One decode step of some running requests in shuffled lanes; padding
        lanes are -1, or slot 0 (whose garbage may be overwritten)."""
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=1, max_size=LANES, unique=True))
        lanes = chosen + [0 if pad_to_null else -1] * (LANES - len(chosen))
        if pad_to_null and len(chosen) < LANES - 1:
            lanes[-1] = -1  # slot 0 at most once: ids must be distinct
        lanes = data.draw(st.permutations(lanes))
        recurrent, conv = random_states(self.rng, LANES)
        self.pool = SET(self.pool, layer, np.asarray(lanes, np.int32), recurrent, conv.astype(np.float32))
        for lane, slot in enumerate(lanes):
            if slot != -1:
                self.recurrent[layer, slot] = recurrent[lane]
                self.conv[layer, slot] = conv[lane]

    @precondition(lambda self: len(self.running) > 1)  # keep one running: snapshots need a source
    @rule(data=st.data())
    def finish(self, data):
        slot = data.draw(st.sampled_from(sorted(self.running)))
        self.running.remove(slot)
        self.free_reqs.add(slot)

    # -------------------------------------------------------------- track slots

    @rule(data=st.data(), two=st.booleans())
    def snapshot(self, data, two):
        """Save the state of one or two running requests into fresh track slots."""
        self._snapshot(data, two)

    def _snapshot(self, data, two):
        sources = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=1,
                                     max_size=2 if two else 1, unique=True))
        tracks = []
        for _ in sources:
            free = [t for t in TRACK_SLOTS if t not in self.snapshots and t not in tracks]
            if not free:
                before = self.pool
                with pytest.raises(KVCacheOOM, match=re.escape(
                        f"requested 1 track slots, 0 available (of {TRACK} total)")):
                    self.pool.alloc_track_slot_or_raise()
                chex.assert_trees_all_equal(before, self.pool, strict=True)
                after, slot, ok = ALLOC(self.pool)
                assert not bool(ok) and int(slot) == -1
                chex.assert_trees_all_equal(before, after, strict=True)
                event("snapshot: no track slot")
                break
            self.pool, track = self.pool.alloc_track_slot_or_raise()
            assert track == free[0], (track, free)  # the lowest free one
            tracks.append(track)
        sources = sources[: len(tracks)]
        if not tracks:
            return
        self.pool = self.pool.copy_states_or_raise(sources, tracks)
        for src, track in zip(sources, tracks):
            self.snapshots[track] = Snapshot(src, self.recurrent[:, src], self.conv[:, src])
        self._copy_model(sources, tracks)
        for src, track in zip(sources, tracks):  # the track slot holds the request's state, every layer
            got_r, got_c = self._state(track)
            np.testing.assert_array_equal(got_r, self.snapshots[track].recurrent)
            np.testing.assert_array_equal(got_c, self.snapshots[track].conv)

    @rule(data=st.data())
    def restore(self, data):
        """Restore a snapshot into a running request (its own slot or another's)."""
        if not self.snapshots:
            self._snapshot(data, False)
            if not self.snapshots:
                return
        track = data.draw(st.sampled_from(sorted(self.snapshots)))
        dst = data.draw(st.sampled_from(sorted(self.running)))
        self.pool = self.pool.copy_states_or_raise([track], [dst])
        self._copy_model([track], [dst])
        got_r, got_c = self._state(dst)
        np.testing.assert_array_equal(got_r, self.snapshots[track].recurrent)
        np.testing.assert_array_equal(got_c, self.snapshots[track].conv)
        event("restore: " + ("own slot" if dst == self.snapshots[track].source else "another slot"))

    @rule(data=st.data(), batch=st.booleans())
    def free_track(self, data, batch):
        if not self.snapshots:
            self._bad(data, "double free")
            return
        tracks = data.draw(st.lists(st.sampled_from(sorted(self.snapshots)), min_size=1,
                                    max_size=2 if batch else 1, unique=True))
        self.pool = self.pool.free_track_slot_or_raise(tracks)
        for track in tracks:
            del self.snapshots[track]

    # -------------------------------------------------------------- bad inputs

    @rule(data=st.data(), kind=st.sampled_from([
        "double free", "free twice in one call", "free not a track slot", "free not an integer",
        "reset bad slot", "reset not an integer", "copy bad slot", "copy not an integer",
        "copy repeated destination", "copy shapes differ"]))
    def bad_input(self, data, kind):
        self._bad(data, kind)

    def _bad(self, data, kind):
        pool = self.pool
        if kind == "double free":
            held = set(self.snapshots)
            slot = data.draw(st.sampled_from([t for t in TRACK_SLOTS if t not in held] or [None]))
            if slot is None:
                return
            self._refused(DoubleFree, re.escape(f"double free: track slot {slot} freed 1x while held 0x"),
                          lambda: pool.free_track_slot_or_raise(slot), lambda: FREE(pool, padded([slot])))
        elif kind == "free twice in one call":
            if not self.snapshots:
                return
            slot = data.draw(st.sampled_from(sorted(self.snapshots)))
            self._refused(DoubleFree, re.escape(f"track slot {slot} freed 2x while held 1x"),
                          lambda: pool.free_track_slot_or_raise([slot, slot]), lambda: FREE(pool, padded([slot, slot])))
        elif kind == "free not a track slot":
            slot = data.draw(st.sampled_from([0, -2, POOL_SIZE, POOL_SIZE + 1, 2**31 - 1, *sorted(REQUEST_SLOTS)])
                             | st.just(2**40))
            good = sorted(self.snapshots)[:1]  # a valid id beside it must not be freed either
            ids = data.draw(st.permutations(good + [slot]))
            self._refused(InvalidId, re.escape(f"free of track slot ids [{slot}]: track slots are "
                                               f"{TRACK_SLOTS[0]}..{TRACK_SLOTS[-1]}"),
                          lambda: pool.free_track_slot_or_raise(ids),
                          None if slot > 2**31 else lambda: FREE(pool, padded(ids)))
        elif kind == "free not an integer":
            bad = data.draw(st.sampled_from(NOT_INTEGERS))
            self._refused(InvalidArgument, "must be", lambda: pool.free_track_slot_or_raise(bad))
        elif kind == "reset bad slot":
            slot = data.draw(st.sampled_from([0, -2, POOL_SIZE, 2**31 - 1]) | st.just(2**40))
            ids = data.draw(st.permutations([slot, data.draw(st.sampled_from(sorted(REQUEST_SLOTS)))]))
            self._refused(InvalidId, re.escape(f"reset slot ids [{slot}] outside [1, {POOL_SIZE})"),
                          lambda: pool.reset_states_or_raise(ids),
                          None if slot > 2**31 else lambda: RESET(pool, padded(ids)))
        elif kind == "reset not an integer":
            bad = data.draw(st.sampled_from(NOT_INTEGERS))
            self._refused(InvalidArgument, "must be", lambda: pool.reset_states_or_raise([bad]))
        elif kind == "copy bad slot":
            slot = data.draw(st.sampled_from([0, -2, POOL_SIZE, 2**31 - 1]) | st.just(2**33 + 1))
            good = data.draw(st.sampled_from(sorted(REQUEST_SLOTS) + list(TRACK_SLOTS)))
            side = data.draw(st.sampled_from(["from", "to"]))
            src, dst = ([slot], [good]) if side == "from" else ([good], [slot])
            self._refused(InvalidId, re.escape(f"copy {side} slot ids [{slot}] outside [1, {POOL_SIZE})"),
                          lambda: pool.copy_states_or_raise(src, dst),
                          None if slot > 2**31 else lambda: COPY(pool, padded(src), padded(dst)))
        elif kind == "copy not an integer":
            bad = data.draw(st.sampled_from(NOT_INTEGERS + [[1, [2]]]))
            good = data.draw(st.sampled_from(sorted(REQUEST_SLOTS)))
            if data.draw(st.booleans()):
                src, dst = [bad], [good]
            else:
                src, dst = [good], [bad]
            self._refused(InvalidArgument, "must be", lambda: pool.copy_states_or_raise(src, dst))
        elif kind == "copy repeated destination":
            a, b = data.draw(st.lists(st.sampled_from(sorted(REQUEST_SLOTS)), min_size=2, max_size=2, unique=True))
            dst = data.draw(st.sampled_from(list(TRACK_SLOTS) + sorted(REQUEST_SLOTS)))
            self._refused(InvalidArgument, re.escape(f"copy_states to repeated destination slots [{dst}]"),
                          lambda: pool.copy_states_or_raise([a, b], [dst, dst]),
                          lambda: COPY(pool, padded([a, b]), padded([dst, dst])))
        else:
            self._refused(InvalidArgument, re.escape("src has shape (2,) but dst has shape (1,)"),
                          lambda: pool.copy_states_or_raise([1, 2], [3]))
        assert self.pool is pool
        event("bad input: " + kind)

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        np.testing.assert_array_equal(np.asarray(self.pool.recurrent_state), self.recurrent)
        np.testing.assert_array_equal(np.asarray(self.pool.conv_state).astype(np.float32),
                                      self.conv.astype(np.float32))
        # each track slot is free or held by exactly one snapshot
        held = np.asarray(self.pool.track_held)
        assert held.shape == (TRACK,)
        assert {TRACK_SLOTS[i] for i in np.flatnonzero(held)} == set(self.snapshots)
        assert int(self.pool.num_free_track_slots()) == TRACK - len(self.snapshots)
        # each request slot is free or running
        assert not self.free_reqs & self.running and self.free_reqs | self.running == REQUEST_SLOTS
        # a held track slot still holds what it snapshotted
        for track, snap in self.snapshots.items():
            np.testing.assert_array_equal(self.recurrent[:, track], snap.recurrent)
            np.testing.assert_array_equal(self.conv[:, track].astype(np.float32), snap.conv.astype(np.float32))


# The profile's settings (ci: 30 x 60 steps, about 5 s here; long: 400 x 100).
TestGDNTrackMachine = pytest.mark.slow(GDNTrackMachine.TestCase)
