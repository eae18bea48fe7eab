"""BlockAllocator: a ref-counted free stack of block ids, on device (seed 000).

The seed keeps a GPU stack of free ids with its top in pinned host memory and
may only be called between graph captures. Here the whole allocator is a
pytree and every operation is a pure jittable function, so a decode loop can
acquire and release blocks inside one ``lax.scan``.

Each block has a reference count (vLLM's ``PhysicalTokenBlock.ref_count``):
``acquire`` hands out blocks with count 1, ``incref`` adds an owner (a forked
sequence, a prefix-cache hit), ``release`` drops one owner per occurrence and
a block returns to the free stack when its count reaches zero.

Invariants (checked by the property tests after every operation):

* block 0 is the null block: never free, never handed out, count 0;
* ``free_ids[:num_free]`` are exactly the ids with count 0 (other than 0),
  each once (stack mode; in lowest-first mode the stack is not used and the
  free set is ``ref_counts == 0``);
* ``num_free + #{id >= 1 : ref_counts[id] > 0} == num_blocks - 1``;
* a failed operation returns the state it was given, unchanged.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import _host
from jaxkv._ops import INT32_MAX, first_true_indices
from jaxkv.checks import first_where, require
from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.types import Array, Bool, Count, Ids, Int, Ok

__all__ = ["BlockAllocator"]


@struct.dataclass
class BlockAllocator:
    """Ref-counted allocator of block ids ``1 .. num_blocks-1``.

    Fields:
        free_ids: int32 ``[num_blocks - 1]``. A stack: ``free_ids[:num_free]``
            are the free ids, ``free_ids[num_free - 1]`` is popped first. Entries
            past ``num_free`` are stale and never read.
        num_free: int32 scalar, the number of free blocks.
        ref_counts: int32 ``[num_blocks]``, owners of each block (0 = free).
        num_blocks: static; ids are ``0 .. num_blocks-1`` and 0 is the null block.
        lowest_first: static; when True ``acquire`` returns the lowest free ids
            (memory locality, seed 002's ``need_sort``) found by a prefix sum
            over ``ref_counts``, O(num_blocks) per call, instead of popping the
            stack, O(n).
    """

    free_ids: Int[Array, "capacity"]
    num_free: Int[Array, ""]
    ref_counts: Int[Array, "num_blocks"]
    num_blocks: int = struct.field(pytree_node=False)
    lowest_first: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, num_blocks: int, *, lowest_first: bool = False) -> "BlockAllocator":
        """All of ``1 .. num_blocks-1`` free; block 0 reserved as the null block.

        The stack is ordered so that the first pops return 1, 2, 3, ...
        ``num_blocks=1`` is an allocator with nothing to hand out (every
        acquisition of one block or more fails): a manager with no host tier.
        """
        num_blocks = _host.int_scalar(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise InvalidArgument(
                f"num_blocks={num_blocks}: need at least 1 (block 0 is the null block)"
            )
        return cls(
            free_ids=jnp.arange(num_blocks - 1, 0, -1, dtype=jnp.int32),
            num_free=jnp.asarray(num_blocks - 1, jnp.int32),
            ref_counts=jnp.zeros((num_blocks,), jnp.int32),
            num_blocks=num_blocks,
            lowest_first=lowest_first,
        )

    @property
    def capacity(self) -> int:
        """Number of allocatable blocks (``num_blocks - 1``)."""
        return self.num_blocks - 1

    @property
    def num_used(self) -> Int[Array, ""]:
        """Number of blocks with at least one owner."""
        return self.capacity - self.num_free

    def reset(self) -> "BlockAllocator":
        """Every block free again, counts zero (same configuration)."""
        return BlockAllocator.create(self.num_blocks, lowest_first=self.lowest_first)

    # ------------------------------------------------------------------ device ops

    def acquire(
        self, n: Count, *, max_n: int, owners: Count = 1
    ) -> tuple["BlockAllocator", Int[Array, "max_n"], Ok]:
        """Take ``n`` free blocks (traced ``n``, static ``max_n``), each with
        ``owners`` owners (default 1; a prompt shared by a group of sequences
        starts with one owner per sequence).

        Returns ``(state, ids, ok)``: ``ids[:n]`` are the blocks taken and
        ``ids[n:]`` are -1. Fails (``ok`` False, state unchanged, ids all -1)
        when ``n < 0``, ``n > max_n``, ``n > num_free`` or ``owners < 1``.
        """
        n = jnp.asarray(n, jnp.int32)
        owners = jnp.asarray(owners, jnp.int32)
        require((n >= 0) & (n <= max_n), InvalidArgument, f"acquire of {{}} blocks with max_n={max_n}", n)
        require(owners >= 1, InvalidArgument, "acquire with {} owners per block", owners)
        ok = (n >= 0) & (n <= max_n) & (n <= self.num_free) & (owners >= 1)
        lane = jnp.arange(max_n, dtype=jnp.int32)
        if self.lowest_first:
            # Comparing with an iota (not ``.at[0].set``) keeps the mask fusible.
            is_free = (self.ref_counts == 0) & (jnp.arange(self.num_blocks) != 0)
            ids = first_true_indices(is_free, jnp.where(ok, n, 0), max_n)
        else:  # pop: the popped entries stay in the array, past the new top
            top = self.num_free - 1 - lane
            popped = (self.free_ids[jnp.clip(top, 0, self.capacity - 1)] if self.capacity
                      else jnp.full((max_n,), -1, jnp.int32))  # nothing to pop (and ok is False for n > 0)
            ids = jnp.where(ok & (lane < n), popped, -1)
        ref_counts = self.ref_counts.at[self._or_drop(ids >= 0, ids)].set(owners, mode="drop")
        num_free = self.num_free - jnp.where(ok, n, 0)
        return self.replace(num_free=num_free, ref_counts=ref_counts), ids, ok

    def release(self, ids: Ids, *, what: str = "block", distinct: bool = False) -> tuple["BlockAllocator", Ok]:
        """Drop one owner per occurrence of each id; -1 entries are ignored.

        A block whose count reaches zero goes back on the free stack (once,
        however many times it appears). ``ids`` may have any shape, and an id
        may appear several times if it has that many owners (freeing two
        sequences that share a block in one call).

        Fails (``ok`` False, state unchanged) if any id is out of
        ``[1, num_blocks)`` (``InvalidId`` on the host path) or would drop
        below zero owners (``DoubleFree``).

        ``distinct=True`` (static) is a faster path for callers whose ids are
        all different (a scheduler handing back blocks it owns once): it
        also fails, changing nothing, when an id repeats, instead of counting
        the repeats.
        """
        ids = jnp.asarray(ids, jnp.int32).reshape(-1)
        counts, freed, _, ok = self._drop_owners(ids, what, distinct)
        return self.replace(ref_counts=counts)._put_back(ids, freed), ok

    def _drop_owners(self, ids: Int[Array, "m"], what: str, distinct: bool):
        """The count half of ``release``: ``(counts, freed, dropped, ok)``.

        ``counts`` are the new counts (the old ones when not ``ok``);
        ``freed`` marks one position per id whose count reached zero;
        ``dropped`` are the indices decremented once per position (out of
        range where nothing was dropped), for an exact undo by ``+1``.
        """
        given = ids != -1
        in_range = (ids >= 1) & (ids < self.num_blocks)
        target = self._or_drop(given & in_range, ids)
        self._require_in_range(ids, given & ~in_range, "release", what)
        if distinct:
            before = self.ref_counts.at[target].get(mode="fill", fill_value=1)
            # Scatter through indices derived from that read (always
            # ``target``): it orders the read first, so XLA updates the counts
            # in place instead of copying the array to keep the old values.
            target = jnp.where(before > jnp.iinfo(jnp.int32).min, target, self.num_blocks)
            counts = self.ref_counts.at[target].add(-1, mode="drop")
            after = counts.at[target].get(mode="fill", fill_value=0)
            repeated = given & (after != before - 1)  # decremented more than once
            require(~jnp.any(before < 1), DoubleFree,
                    f"double free: {what} id {{}} released more times than it has owners",
                    first_where(ids, before < 1))
            require(~jnp.any(repeated), InvalidArgument,
                    f"release(distinct=True) of repeated {what} id {{}}", first_where(ids, repeated))
            ok = jnp.all(~given | (in_range & (before >= 1))) & ~jnp.any(repeated)
        else:
            # Decrement tentatively, then undo if any count went negative: a
            # scatter-add is exactly undone by the opposite add, so the failure
            # path costs O(len(ids)) rather than a select over the whole count
            # array. (Sorting the ids to count repeats is slower on XLA CPU.)
            counts = self.ref_counts.at[target].add(-1, mode="drop")
            after = counts.at[target].get(mode="fill", fill_value=0)
            require(jnp.all(after >= 0), DoubleFree,
                    f"double free: {what} id {{}} released more times than it has owners",
                    first_where(ids, after < 0))
            ok = jnp.all(~given | in_range) & jnp.all(after >= 0)
        counts = counts.at[jnp.where(ok, self.num_blocks, target)].add(1, mode="drop")
        reached_zero = ok & given & in_range & (after == 0)
        if distinct:
            freed = reached_zero
        else:  # an id repeated k times reaches zero at all k positions: keep one
            counts, freed = self._first_occurrence(counts, ids, reached_zero)
        return counts, freed, jnp.where(ok, target, self.num_blocks), ok

    def _put_back(self, ids: Int[Array, "m"], freed: Bool[Array, "m"]) -> "BlockAllocator":
        """Return ``ids[freed]`` (count now zero) to the free set."""
        if self.lowest_first:  # the free set is ref_counts == 0; no stack to push
            return self.replace(num_free=self.num_free + jnp.sum(freed, dtype=jnp.int32))
        return self._push(ids, freed)

    def incref(self, ids: Ids, *, what: str = "block") -> tuple["BlockAllocator", Ok]:
        """Add one owner per occurrence of each held id; -1 entries are ignored.

        Fails (``ok`` False, state unchanged) if any id is out of range or is
        free: sharing a block nobody holds would resurrect freed memory
        (``InvalidId`` on the host path); or if a count would pass INT32_MAX
        (``InvalidArgument``), which would wrap it negative.
        """
        ids = jnp.asarray(ids, jnp.int32).reshape(-1)
        given = ids != -1
        in_range = (ids >= 1) & (ids < self.num_blocks)
        held = self.ref_count(ids) > 0
        self._require_in_range(ids, given & ~in_range, "incref", what)
        require(jnp.all(~given | ~in_range | held), InvalidId,
                f"incref of free {what} id {{}}: only a held {what} can be shared", first_where(ids, given & ~held))
        valid = jnp.all(~given | (in_range & held))
        # Add tentatively; a count that wrapped (held counts are >= 1, so a
        # sum <= 0 wrapped) fails the call, and the same scatter of -1 undoes
        # it exactly (two's complement addition is invertible).
        target = self._or_drop(valid & given, ids)
        counts = self.ref_counts.at[target].add(1, mode="drop")
        wrapped = given & (counts.at[target].get(mode="fill", fill_value=1) <= 0)
        require(~jnp.any(wrapped), InvalidArgument,
                f"incref of {what} id {{}} past INT32_MAX owners", first_where(ids, wrapped))
        ok = valid & ~jnp.any(wrapped)
        counts = counts.at[jnp.where(ok, self.num_blocks, target)].add(-1, mode="drop")
        return self.replace(ref_counts=counts), ok

    def update(
        self, incref_ids: Ids | None, release_ids: Ids, n: Count, *, max_n: int, distinct: bool = False
    ) -> tuple["BlockAllocator", Int[Array, "max_n"], Ok]:
        """``incref(incref_ids)``, then ``release(release_ids)``, then
        ``acquire(n)``, all or nothing: what a scheduler step applies in one
        device call (sequences sharing cached blocks, blocks handed back,
        blocks for new work).

        Returns ``(state, ids, ok)`` as ``acquire`` does. When any part would
        fail nothing changes. The rollback undoes the earlier parts with
        scatters over the given ids, O(len(ids)), instead of selecting between
        the old and new state, which would copy the whole allocator.
        ``incref_ids=None`` skips that part; ``distinct`` is passed to
        ``release``.
        """
        release_ids = jnp.asarray(release_ids, jnp.int32).reshape(-1)
        n = jnp.asarray(n, jnp.int32)
        if incref_ids is None:
            incref_ids = jnp.full((0,), -1, jnp.int32)
            state, ok_incref = self, jnp.asarray(True)
        else:
            incref_ids = jnp.asarray(incref_ids, jnp.int32).reshape(-1)
            state, ok_incref = self.incref(incref_ids)
            release_ids = jnp.where(ok_incref, release_ids, -1)
        counts, freed, dropped, ok_release = state._drop_owners(release_ids, "block", distinct)
        num_free = state.num_free + jnp.sum(freed, dtype=jnp.int32)
        ok = ok_incref & ok_release & (n >= 0) & (n <= max_n) & (n <= num_free)
        # Undo when the acquisition cannot happen: the released ids get their
        # owners back and the increfs are dropped again, by scatters over the
        # given ids only; the free stack is pushed only on success.
        counts = counts.at[jnp.where(ok, self.num_blocks, dropped)].add(1, mode="drop")
        if incref_ids.size:
            undo_incref = jnp.where(ok_incref & ~ok & (incref_ids != -1), incref_ids, self.num_blocks)
            counts = counts.at[undo_incref].add(-1, mode="drop")
        state = state.replace(ref_counts=counts)._put_back(release_ids, freed & ok)
        state, ids, _ = state.acquire(jnp.where(ok, n, 0), max_n=max_n)
        return state, jnp.where(ok, ids, -1), ok

    def ref_count(self, ids: Ids) -> Int[Array, "..."]:
        """Owners of each id (0 for -1 and out-of-range ids)."""
        ids = jnp.asarray(ids, jnp.int32)
        in_range = (ids >= 0) & (ids < self.num_blocks)
        return self.ref_counts.at[self._or_drop(in_range, ids)].get(mode="fill", fill_value=0)

    # --------------------------------------------------------------- internals

    def _or_drop(self, keep: Bool[Array, "..."], ids: Int[Array, "..."]) -> Int[Array, "..."]:
        """``ids`` where ``keep``, else an out-of-bounds index that scatters drop."""
        return jnp.where(keep, ids, self.num_blocks)

    def _require_in_range(self, ids, bad, op: str, what: str) -> None:
        require(~jnp.any(bad), InvalidId,
                f"{op} of {what} id {{}} outside [1, {self.num_blocks}) ({what} 0 is the null {what})",
                first_where(ids, bad))

    def _first_occurrence(
        self, counts: Int[Array, "num_blocks"], ids: Int[Array, "m"], mask: Bool[Array, "m"]
    ) -> tuple[Int[Array, "num_blocks"], Bool[Array, "m"]]:
        """True at exactly one position per distinct id among ``ids[mask]``.

        Each masked position writes a distinct tag to its id; repeats race and
        exactly one tag survives, whichever the backend picks: its position is
        the chosen one. ``counts`` serves as the scratch (the masked ids have
        count 0) and is returned restored, so no O(num_blocks) scratch array is
        made.
        """
        target = self._or_drop(mask, ids)
        tags = -1 - jnp.arange(ids.shape[0], dtype=jnp.int32)
        tagged = counts.at[target].set(tags, mode="drop")
        seen = tagged.at[target].get(mode="fill", fill_value=0)
        # Every masked id holds some tag (< 0), so the restore indices below equal
        # ``target``; deriving them from ``seen`` orders the read before the
        # write, which lets XLA restore in place instead of copying ``counts``.
        restore = jnp.where(seen < 0, target, self.num_blocks)
        return tagged.at[restore].set(0, mode="drop"), mask & (seen == tags)

    def _push(self, ids: Int[Array, "m"], push: Bool[Array, "m"]) -> "BlockAllocator":
        """Push ``ids[push]`` onto the free stack, in order."""
        slot = self.num_free + jnp.cumsum(push, dtype=jnp.int32) - 1
        free_ids = self.free_ids.at[jnp.where(push, slot, self.capacity)].set(ids, mode="drop")
        return self.replace(free_ids=free_ids, num_free=self.num_free + jnp.sum(push, dtype=jnp.int32))

    # -------------------------------------------------------------- host paths

    def acquire_or_raise(self, n: int) -> tuple["BlockAllocator", np.ndarray]:
        """Host path of :meth:`acquire`: returns the ``n`` ids as numpy, or raises
        ``KVCacheOOM`` (with requested / available / total) or ``InvalidArgument``."""
        n = _host.count_or_raise(n, self.capacity, lambda: self.num_free, "blocks")
        state, ids, ok = _acquire(self, n, max_n=_host.pow2_at_least(n))
        if not bool(ok):
            raise KVCacheOOM(n, int(self.num_free), self.capacity, unit="blocks")
        return state, np.asarray(ids)[:n]

    def release_or_raise(self, ids) -> "BlockAllocator":
        """Host path of :meth:`release`; raises ``InvalidId`` or ``DoubleFree``."""
        state, ok = _release(self, _host.padded_ids(ids))
        if not bool(ok):
            raise self.release_error(ids) or _host.unexplained("release", ids)
        return state

    def incref_or_raise(self, ids) -> "BlockAllocator":
        """Host path of :meth:`incref`; raises ``InvalidId``."""
        state, ok = _incref(self, _host.padded_ids(ids))
        if not bool(ok):
            raise self.incref_error(ids) or _host.unexplained("incref", ids)
        return state

    def release_error(self, ids, unit: str = "block") -> KVCacheError | None:
        """Why ``release(ids)`` fails on this state (``InvalidId``,
        ``DoubleFree``), or None when it succeeds (the explainer style of
        ``jaxkv._host``). ``unit`` names the ids in the message."""
        given = _host.given_ids(ids)
        bad = np.unique(given[(given < 1) | (given >= self.num_blocks)])
        if bad.size:
            return InvalidId(
                f"release: {unit} ids {_host.preview(bad)} outside [1, {self.num_blocks}) "
                f"({unit} 0 is the null {unit}, never held)", bad)
        unique, times = np.unique(given, return_counts=True)
        owners = np.asarray(self.ref_counts)[unique]
        over = times > owners
        if not over.any():
            return None
        details = "; ".join(
            f"{unit} {i} released {t}x with {o} owner(s)"
            for i, t, o in list(zip(unique[over], times[over], owners[over]))[:8]
        )
        more = f"; ... ({int(over.sum())} {unit}s in all)" if over.sum() > 8 else ""
        return DoubleFree(f"release: double free: {details}{more}", unique[over])

    def incref_error(self, ids, unit: str = "block") -> KVCacheError | None:
        """Why ``incref(ids)`` fails on this state (``InvalidId``,
        ``InvalidArgument`` past INT32_MAX owners), or None when it succeeds."""
        given = _host.given_ids(ids)
        bad = np.unique(given[(given < 1) | (given >= self.num_blocks)])
        if bad.size:
            return InvalidId(f"incref: {unit} ids {_host.preview(bad)} outside [1, {self.num_blocks})", bad)
        unique, times = np.unique(given, return_counts=True)
        owners = np.asarray(self.ref_counts)[unique].astype(np.int64)
        full = unique[(owners > 0) & (owners + times > INT32_MAX)]
        if full.size:
            return InvalidArgument(f"incref: {unit}s {_host.preview(full)} past INT32_MAX owners")
        free = unique[owners == 0]
        if not free.size:
            return None
        return InvalidId(f"incref: free {unit}s {_host.preview(free)} (only a held {unit} can be shared)", free)


_acquire = jax.jit(BlockAllocator.acquire, static_argnames=("max_n",))
_release = jax.jit(BlockAllocator.release)
_incref = jax.jit(BlockAllocator.incref)
