"""SlotAllocator: a bitmask of free slots with version counters (seed 001).

The seed keeps one Python int as the mask; here the mask is ``uint32`` words
on device, so ``max_slots`` is unbounded and every operation is a pure jittable
function. Versions let a prefix cache tell whether a slot it remembers still
holds the same K/V: ``alloc`` bumps the version (new owner, new contents),
``occupy`` takes a free slot back *without* bumping it (the cached contents
are reused as they are).

Invariants (checked by the property tests after every operation):

* slot 0 is the null slot (padding writes land there): never free, never
  handed out; its version stays 0;
* bit ``s % 32`` of ``free_mask[s // 32]`` is set iff slot ``s`` is free, and
  no bit at or past ``max_slots`` is ever set;
* a slot's version changes only when ``alloc``/``alloc_many`` hands it out;
* a failed operation returns the state it was given, unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import _host
from jaxkv._ops import ceil_div, first_true_indices
from jaxkv.checks import first_where, require
from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.types import Array, Bool, Count, Ids, Int, Ok, UInt32

__all__ = ["SlotAllocator"]

_WORD_BITS = 32


@struct.dataclass
class SlotAllocator:
    """Bitmask allocator of slots ``1 .. max_slots-1`` (slot 0 is the null slot).

    Fields:
        free_mask: uint32 ``[ceil(max_slots / 32)]``, bit set = slot free.
        versions: int32 ``[max_slots]``, times each slot was handed out by alloc.
        max_slots: static, total slots including the null slot 0.
    """

    free_mask: UInt32[Array, "num_words"]
    versions: Int[Array, "max_slots"]
    max_slots: int = struct.field(pytree_node=False)

    @classmethod
    def create(cls, max_slots: int) -> "SlotAllocator":
        """All of ``1 .. max_slots-1`` free, every version 0."""
        if max_slots < 2:
            raise InvalidArgument(f"max_slots={max_slots}: need at least 2 (slot 0 is the null slot)")
        free = np.ones(_num_words(max_slots) * _WORD_BITS, bool)
        free[0] = False
        free[max_slots:] = False
        return cls(
            free_mask=jnp.asarray(_pack(free)),
            versions=jnp.zeros((max_slots,), jnp.int32),
            max_slots=max_slots,
        )

    @property
    def capacity(self) -> int:
        """Number of allocatable slots (``max_slots - 1``)."""
        return self.max_slots - 1

    @property
    def free_count(self) -> Int[Array, ""]:
        """Number of free slots."""
        return jnp.sum(jax.lax.population_count(self.free_mask), dtype=jnp.int32)

    def is_free(self, slots: Ids) -> Bool[Array, "..."]:
        """Whether each slot is free (False for 0, -1 and out-of-range slots)."""
        slots = jnp.asarray(slots, jnp.int32)
        in_range = (slots >= 0) & (slots < self.max_slots)
        safe = jnp.where(in_range, slots, 0)
        word = self.free_mask[safe // _WORD_BITS]
        return in_range & (((word >> (safe % _WORD_BITS).astype(jnp.uint32)) & 1) == 1)

    def version(self, slots: Ids) -> Int[Array, "..."]:
        """Version counter of each slot (0 for -1 and out-of-range slots)."""
        slots = jnp.asarray(slots, jnp.int32)
        in_range = (slots >= 0) & (slots < self.max_slots)
        return jnp.where(in_range, self.versions[jnp.where(in_range, slots, 0)], 0)

    # ------------------------------------------------------------------ device ops

    def alloc(self) -> tuple["SlotAllocator", Int[Array, ""], Ok]:
        """Take the lowest free slot and bump its version.

        Returns ``(state, slot, ok)``; when no slot is free: ``slot == -1``,
        ``ok`` False, state unchanged. O(number of words).
        """
        nonempty = self.free_mask != 0
        ok = jnp.any(nonempty)
        word_index = jnp.argmax(nonempty)
        word = self.free_mask[word_index]
        lowest_bit = word & (~word + jnp.uint32(1))
        bit_index = (_WORD_BITS - 1) - jax.lax.clz(lowest_bit).astype(jnp.int32)
        slot = jnp.where(ok, word_index.astype(jnp.int32) * _WORD_BITS + bit_index, -1)
        free_mask = self.free_mask.at[jnp.where(ok, word_index, self.free_mask.shape[0])].set(
            word & ~lowest_bit, mode="drop"
        )
        versions = self.versions.at[jnp.where(ok, slot, self.max_slots)].add(1, mode="drop")
        return self.replace(free_mask=free_mask, versions=versions), slot, ok

    def alloc_many(self, k: Count, *, max_k: int) -> tuple["SlotAllocator", Int[Array, "max_k"], Ok]:
        """Take the ``k`` lowest free slots in one call (traced ``k``, static
        ``max_k``) and bump their versions; all or nothing.

        Returns ``(state, slots, ok)`` with ``slots[:k]`` ascending and
        ``slots[k:] == -1``. Fails when ``k < 0``, ``k > max_k`` or fewer than
        ``k`` slots are free. O(max_slots).
        """
        k = jnp.asarray(k, jnp.int32)
        require((k >= 0) & (k <= max_k), InvalidArgument, f"alloc_many of {{}} slots with max_k={max_k}", k)
        free = self._free_bits()
        ok = (k >= 0) & (k <= max_k) & (k <= jnp.sum(free, dtype=jnp.int32))
        slots = first_true_indices(free, jnp.where(ok, k, 0), max_k)
        taken = slots >= 0
        return self._toggle(slots, taken), slots, ok

    def free(self, slots: Ids) -> tuple["SlotAllocator", Ok]:
        """Return slots to the free set (any shape; -1 ignored); versions kept.

        Fails (state unchanged) if a slot is out of ``[1, max_slots)``
        (``InvalidId``), already free, or named twice (``DoubleFree``).
        """
        return self._flip(slots, want_free=False)

    def occupy(self, slots: Ids) -> tuple["SlotAllocator", Ok]:
        """Take specific free slots without bumping their versions (direct reuse
        of a prefix-cached slot whose contents are still valid); -1 ignored.

        Fails (state unchanged) if a slot is out of range, taken, or named
        twice (``InvalidId``).
        """
        return self._flip(slots, want_free=True)

    # --------------------------------------------------------------- internals

    def _free_bits(self) -> Bool[Array, "max_slots"]:
        """The mask unpacked to one bool per slot."""
        shifts = jnp.arange(_WORD_BITS, dtype=jnp.uint32)
        bits = (self.free_mask[:, None] >> shifts[None, :]) & 1
        return bits.reshape(-1)[: self.max_slots] == 1

    def _bit_sum(self, slots: Int[Array, "m"], mask: Bool[Array, "m"]) -> UInt32[Array, "num_words"]:
        """The bits of ``slots[mask]`` summed per word. For distinct slots this is
        their OR (distinct bits add without carries); a repeated slot carries
        and so lowers the popcount, which is how duplicates are detected."""
        words = self.free_mask.shape[0]
        safe = jnp.where(mask, slots, 0)
        bit = jnp.left_shift(jnp.uint32(1), (safe % _WORD_BITS).astype(jnp.uint32))
        target = jnp.where(mask, safe // _WORD_BITS, words)
        return jnp.zeros((words,), jnp.uint32).at[target].add(bit, mode="drop")

    def _toggle(self, slots: Int[Array, "m"], mask: Bool[Array, "m"]) -> "SlotAllocator":
        """Hand out the distinct free slots ``slots[mask]``: clear their bits and
        bump their versions."""
        versions = self.versions.at[jnp.where(mask, slots, self.max_slots)].add(1, mode="drop")
        return self.replace(free_mask=self.free_mask ^ self._bit_sum(slots, mask), versions=versions)

    def _flip(self, slots: Ids, *, want_free: bool) -> tuple["SlotAllocator", Ok]:
        """Shared body of ``free`` (slots must be taken) and ``occupy`` (slots
        must be free): validate every given slot, then flip them all or none.
        Versions are not touched."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        given = slots != -1
        in_range = (slots >= 1) & (slots < self.max_slots)
        right_state = self.is_free(slots) == want_free
        delta = self._bit_sum(slots, given & in_range)
        distinct = jnp.sum(jax.lax.population_count(delta), dtype=jnp.int32) == jnp.sum(
            given & in_range, dtype=jnp.int32
        )
        op = "occupy" if want_free else "free"
        bad = given & ~in_range
        require(~jnp.any(bad), InvalidId, f"{op} of slot id {{}} outside [1, {self.max_slots})", first_where(slots, bad))
        wrong = given & in_range & ~right_state
        if want_free:
            require(~jnp.any(wrong), InvalidId, "occupy of taken slot id {}", first_where(slots, wrong))
            require(distinct, InvalidId, "occupy names a slot more than once")
        else:
            require(~jnp.any(wrong), DoubleFree, "double free: slot id {} is already free", first_where(slots, wrong))
            require(distinct, DoubleFree, "double free: a slot is named more than once in one free")
        ok = jnp.all(~given | (in_range & right_state)) & distinct
        return self.replace(free_mask=self.free_mask ^ jnp.where(ok, delta, jnp.uint32(0))), ok

    # -------------------------------------------------------------- host paths

    def alloc_or_raise(self) -> tuple["SlotAllocator", int]:
        """Host path of :meth:`alloc`; raises ``KVCacheOOM`` when full."""
        state, slot, ok = _alloc(self)
        if not bool(ok):
            raise KVCacheOOM(1, 0, self.capacity, unit="slots")
        return state, int(slot)

    def alloc_many_or_raise(self, k: int) -> tuple["SlotAllocator", np.ndarray]:
        """Host path of :meth:`alloc_many`; raises ``KVCacheOOM`` or ``InvalidArgument``."""
        k = _host.count_or_raise(k, self.capacity, lambda: self.free_count, "slots")
        state, slots, ok = _alloc_many(self, k, max_k=_host.pow2_at_least(k))
        if not bool(ok):
            raise KVCacheOOM(k, int(self.free_count), self.capacity, unit="slots")
        return state, np.asarray(slots)[:k]

    def free_or_raise(self, slots) -> "SlotAllocator":
        """Host path of :meth:`free`; raises ``InvalidId`` or ``DoubleFree``."""
        state, ok = _free(self, _host.padded_ids(slots))
        if not bool(ok):
            raise self.free_error(slots) or _host.unexplained("free", slots)
        return state

    def occupy_or_raise(self, slots) -> "SlotAllocator":
        """Host path of :meth:`occupy`; raises ``InvalidId``."""
        state, ok = _occupy(self, _host.padded_ids(slots))
        if not bool(ok):
            raise self.occupy_error(slots) or _host.unexplained("occupy", slots)
        return state

    def free_error(self, slots) -> KVCacheError | None:
        """Why ``free(slots)`` fails on this state (``InvalidId``,
        ``DoubleFree``), or None when it succeeds (the explainer style of
        ``jaxkv._host``)."""
        return self._flip_error(slots, want_free=False)

    def occupy_error(self, slots) -> KVCacheError | None:
        """Why ``occupy(slots)`` fails on this state (``InvalidId``), or None
        when it succeeds."""
        return self._flip_error(slots, want_free=True)

    def _flip_error(self, slots, *, want_free: bool) -> KVCacheError | None:
        op = "occupy" if want_free else "free"
        given = _host.given_ids(slots)
        bad = np.unique(given[(given < 1) | (given >= self.max_slots)])
        if bad.size:
            return InvalidId(
                f"{op}: slots {_host.preview(bad)} outside [1, {self.max_slots}) (slot 0 is the null slot)", bad)
        unique, times = np.unique(given, return_counts=True)
        repeated = unique[times > 1]
        free = np.asarray(self.is_free(unique))
        if want_free:
            taken = unique[~free]
            if taken.size:
                return InvalidId(f"occupy: taken slots {_host.preview(taken)} (occupy needs free slots)", taken)
            if repeated.size:
                return InvalidId(f"occupy: slots {_host.preview(repeated)} named more than once", repeated)
            return None
        already = unique[free]
        if already.size:
            return DoubleFree(f"free: double free: slots {_host.preview(already)} are already free", already)
        if repeated.size:
            return DoubleFree(
                f"free: double free: slots {_host.preview(repeated)} named more than once in one free", repeated)
        return None


def _num_words(max_slots: int) -> int:
    return ceil_div(max_slots, _WORD_BITS)


def _pack(free: np.ndarray) -> np.ndarray:
    """bool per slot (length a multiple of 32) -> uint32 words, bit i = slot 32w+i."""
    bits = free.reshape(-1, _WORD_BITS).astype(np.uint64)
    return (bits << np.arange(_WORD_BITS, dtype=np.uint64)).sum(axis=1).astype(np.uint32)


_alloc = jax.jit(SlotAllocator.alloc)
_alloc_many = jax.jit(SlotAllocator.alloc_many, static_argnames=("max_k",))
_free = jax.jit(SlotAllocator.free)
_occupy = jax.jit(SlotAllocator.occupy)
