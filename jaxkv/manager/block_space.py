"""BlockSpaceManager: per-sequence block tables on device (seed 003).

vLLM's original block space manager kept Python lists of block objects and
ran on the host every step. Here the whole state is a pytree and every
operation is jittable, so ``append_slots`` (grow each running sequence by one
token, taking a block when it crosses a block boundary, copy-on-write when its
last block is shared) can run inside the ``lax.scan`` of a decode loop.

State:

* ``block_tables[s, j]``: the block holding tokens ``[j*bs, (j+1)*bs)`` of
  sequence row ``s``; -1 past the sequence's blocks. A row whose sequence is
  swapped out holds host block ids.
* ``seq_lens[s]``: tokens the sequence holds; ``status[s]``: FREE, ON_DEVICE
  or SWAPPED.
* ``device`` / ``host``: ref-counted allocators of device and host blocks.

Invariants (checked by the property tests after every operation):

* a device block's ref count equals the number of table entries of ON_DEVICE
  rows that name it (likewise for host blocks and SWAPPED rows), plus any
  references held outside the manager (none unless the caller adds them);
* no block is both free and named by a table; block 0 is never named;
* a row names exactly ``ceil(seq_lens / bs)`` blocks, FREE rows none,
  except that :meth:`BlockSpaceManager.trim_window` turns the leading
  entries no later query can see into -1 (released): a windowed row names
  its blocks from the first one still in the window;
* every operation is all-or-nothing: when it cannot complete it returns the
  state unchanged, ``ok`` False, and marks which sequences could not proceed.

Sequence rows are chosen by the caller (``0 .. max_seqs-1``, e.g. a request
slot); -1 entries in any id argument are padding and ignored.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import _host
from jaxkv._ops import INT32_MAX, ceil_div, ids_distinct, where_ok
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.pool.host import swap_in_pages, swap_out_pages
from jaxkv.pool.kv_pool import KVPool
from jaxkv.types import Array, Bool, Count, Ids, Int, Ok

__all__ = [
    "ALLOC_LATER",
    "ALLOC_NEVER",
    "ALLOC_OK",
    "FREE",
    "ON_DEVICE",
    "STATUS_NAMES",
    "SWAPPED",
    "BlockSpaceManager",
]

FREE, ON_DEVICE, SWAPPED = 0, 1, 2
STATUS_NAMES = {FREE: "FREE", ON_DEVICE: "ON_DEVICE", SWAPPED: "SWAPPED"}
#: ``can_allocate`` answers (vLLM's AllocStatus).
ALLOC_OK, ALLOC_LATER, ALLOC_NEVER = 0, 1, 2


@struct.dataclass
class BlockSpaceManager:
    """Block tables, lengths and device/host block allocators of up to
    ``max_seqs`` sequences; see the module docstring for the invariants."""

    block_tables: Int[Array, "max_seqs max_blocks"]
    seq_lens: Int[Array, "max_seqs"]
    status: Int[Array, "max_seqs"]
    device: BlockAllocator
    host: BlockAllocator
    block_size: int = struct.field(pytree_node=False)
    watermark_blocks: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(
        cls,
        *,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        watermark: float = 0.01,
    ) -> "BlockSpaceManager":
        """Every row free. Block counts include the null block 0 (they equal the
        ``num_pages`` of the matching :class:`KVPool` and host pool; the swap
        host paths check that). ``num_host_blocks`` 0 or 1 means no host
        tier: every swap-out fails with ``KVCacheOOM``. ``watermark`` is the
        fraction of device blocks ``can_allocate`` keeps free for running
        sequences to grow into (vLLM's default 1%)."""
        sizes = dict(num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks, block_size=block_size,
                     max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
        num_device_blocks, num_host_blocks, block_size, max_seqs, max_blocks_per_seq = (
            _host.int_scalar(value, name) for name, value in sizes.items())
        if num_device_blocks < 2 or num_host_blocks < 0:
            raise InvalidArgument(
                f"num_device_blocks={num_device_blocks} must be >= 2 (block 0 is the null block) and "
                f"num_host_blocks={num_host_blocks} >= 0 (0 or 1: no host tier)")
        if block_size < 1 or max_seqs < 1 or max_blocks_per_seq < 1:
            raise InvalidArgument(
                f"block_size={block_size}, max_seqs={max_seqs} and max_blocks_per_seq={max_blocks_per_seq} "
                "must all be >= 1"
            )
        if not 0 <= watermark < 1:
            raise InvalidArgument(f"watermark={watermark} must be in [0, 1)")
        return cls(
            block_tables=jnp.full((max_seqs, max_blocks_per_seq), -1, jnp.int32),
            seq_lens=jnp.zeros((max_seqs,), jnp.int32),
            status=jnp.zeros((max_seqs,), jnp.int32),
            device=BlockAllocator.create(num_device_blocks),
            host=BlockAllocator.create(max(num_host_blocks, 1)),  # 0 or 1: no host tier
            block_size=block_size,
            watermark_blocks=int(watermark * num_device_blocks),
        )

    #: One block table per row (:class:`~jaxkv.manager.rows.RowCache`).
    ROW_TABLES = True

    def in_step(self) -> "BlockSpaceManager":
        """:meth:`~jaxkv.manager.rows.RowCache.in_step`: passed without its
        host allocator (``host`` None), a two-block placeholder in its place
        (the steps never touch host blocks: they free only ON_DEVICE rows)."""
        return self if self.host is not None else self.replace(host=BlockAllocator.create(2))

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    # ------------------------------------------------ rows (RowCache)

    @property
    def blocks_in_use(self) -> Int[Array, ""]:
        """Device blocks with at least one owner."""
        return self.device.num_used

    def free_rows(self, rows: Ids, *, keep: bool = False) -> tuple["BlockSpaceManager", Ok]:
        """:meth:`free` (a row is held by its blocks alone, so ``keep`` frees
        it too: a free row is what :meth:`fork` forks into)."""
        del keep
        return self.free(rows)

    def fork_rows(self, src: Ids, dst: Ids) -> tuple["BlockSpaceManager", Ok]:
        """:meth:`fork` (rows are this manager's own ids)."""
        return self.fork(src, dst)

    def block_totals(self) -> tuple[int, int]:
        """``(free, total)`` device blocks, read to the host."""
        return int(self.device.num_free), self.device.capacity

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def blocks_for(self, num_tokens: Count) -> Int[Array, "..."]:
        """Blocks needed to hold ``num_tokens`` tokens (0 for a count <= 0;
        no int32 overflow near 2**31)."""
        num_tokens = jnp.maximum(jnp.asarray(num_tokens, jnp.int32), 0)
        return num_tokens // self.block_size + (num_tokens % self.block_size != 0)

    def reset(self) -> "BlockSpaceManager":
        """Every sequence and block free (same configuration)."""
        return self.replace(
            block_tables=jnp.full_like(self.block_tables, -1),
            seq_lens=jnp.zeros_like(self.seq_lens),
            status=jnp.zeros_like(self.status),
            device=self.device.reset(),
            host=self.host.reset(),
        )

    # --------------------------------------------------------------- admission

    def can_allocate(self, num_tokens: Count) -> Int[Array, ""]:
        """``ALLOC_OK`` if a prompt of ``num_tokens`` fits now while leaving the
        watermark free, ``ALLOC_LATER`` if it will once blocks are freed,
        ``ALLOC_NEVER`` if it cannot fit even in an empty cache (including a
        count below 1, and any count int32 cannot hold)."""
        if not isinstance(num_tokens, jax.core.Tracer):
            num_tokens = _host.int_scalar(num_tokens, "num_tokens")
            if num_tokens > INT32_MAX:
                return jnp.asarray(ALLOC_NEVER, jnp.int32)
        num_tokens = jnp.asarray(num_tokens, jnp.int32)
        needed = self.blocks_for(num_tokens)
        return self._admission(needed, too_long=(needed > self.max_blocks_per_seq) | (num_tokens < 1))

    def _admission(self, needed: Int[Array, ""], too_long: Bool[Array, ""] = False) -> Int[Array, ""]:
        """vLLM's rule: NEVER if ``needed`` blocks exceed the device minus the
        watermark, LATER if taking them now would dip into the watermark."""
        never = (needed > self.device.capacity - self.watermark_blocks) | too_long
        later = self.device.num_free - needed < self.watermark_blocks
        return jnp.where(never, ALLOC_NEVER, jnp.where(later, ALLOC_LATER, ALLOC_OK)).astype(jnp.int32)

    def allocate(self, seq_ids: Ids, num_tokens: Count) -> tuple["BlockSpaceManager", Ok]:
        """Give the sequence group ``seq_ids`` (free rows; -1 padding) one shared
        prompt of ``num_tokens`` tokens: ``ceil(num_tokens / bs)`` new blocks,
        each with one owner per sequence of the group (seed 003).

        Fails (state unchanged) when a row is out of range, not free or named
        twice, the group is empty, ``num_tokens < 1``, the prompt needs more
        than ``max_blocks_per_seq`` blocks, or too few blocks are free.
        """
        seqs, given = _ids(seq_ids)
        group = jnp.sum(given, dtype=jnp.int32)
        num_tokens = jnp.asarray(num_tokens, jnp.int32)
        blocks = self.blocks_for(num_tokens)
        valid = (
            self._rows_in_state(seqs, given, FREE)
            & ids_distinct(seqs, given, self.max_seqs)
            & (group >= 1)
            & (num_tokens >= 1)
            & (blocks <= self.max_blocks_per_seq)
        )
        impossible = self.max_blocks_per_seq + 1  # makes acquire fail, state unchanged
        device, ids, acquired = self.device.acquire(
            jnp.where(valid, blocks, impossible), max_n=self.max_blocks_per_seq, owners=jnp.maximum(group, 1)
        )
        ok = valid & acquired
        rows = jnp.where(ok & given, seqs, self.max_seqs)
        return (
            self.replace(
                block_tables=self.block_tables.at[rows].set(ids, mode="drop"),
                seq_lens=self.seq_lens.at[rows].set(num_tokens, mode="drop"),
                status=self.status.at[rows].set(ON_DEVICE, mode="drop"),
                device=device,
            ),
            ok,
        )

    # ------------------------------------------------------------------ decode

    def can_append(self, seq_ids: Ids, num_new_tokens: int = 1) -> Bool[Array, ""]:
        """Whether ``append_slots(pool, seq_ids, num_new_tokens)`` would succeed
        now: every given row ON_DEVICE, distinct, within ``max_blocks_per_seq``
        and enough free blocks for the step, copy-on-write copies included
        (the same count ``append_slots`` acquires). Jittable;
        ``num_new_tokens`` is a static non-negative Python integer."""
        n = _host.int_scalar(num_new_tokens, "num_new_tokens")
        if n < 0:
            raise InvalidArgument(f"can_append of num_new_tokens={n}: a sequence cannot shrink")
        plan = self._append_plan(seq_ids, n)
        return plan.valid & (plan.total <= self.device.num_free)

    def _append_plan(self, seq_ids: Ids, n: int, counts=None) -> "_AppendPlan":
        """What appending ``n`` tokens (or ``counts[i]`` of them) to each of
        ``seq_ids`` needs: shared by :meth:`append_slots` and
        :meth:`can_append` so both count alike."""
        bs = self.block_size
        seqs, given = _ids(seq_ids)
        rows = jnp.where(given, seqs, 0)
        lens = jnp.where(given, self.seq_lens.at[rows].get(mode="fill", fill_value=0), 0)
        grow = n if counts is None else jnp.clip(jnp.asarray(counts, jnp.int32).reshape(seqs.shape), 0, n)
        have = self.blocks_for(lens)
        needed = self.blocks_for(lens + grow)
        last_block = _table_at(self.block_tables, rows, have - 1)
        # The first new token lands in the partly filled last block, if any; a
        # shared one is copied, except that when every owner of a block appends
        # in this step the first of them keeps it (as vLLM's sequential appends
        # would): the others copy away and leave it to that one.
        owners = self.device.ref_count(last_block)
        shared = given & (lens % bs != 0) & (owners > 1) & (grow > 0)
        same_block = (last_block[:, None] == last_block[None, :]) & shared[:, None] & shared[None, :]
        batch_lane = jnp.arange(seqs.shape[0])
        earlier_sharers = jnp.sum(same_block & (batch_lane[None, :] < batch_lane[:, None]), axis=1)
        keeps = shared & (earlier_sharers == 0) & (jnp.sum(same_block, axis=1) == owners)
        cow = shared & ~keeps
        fresh = jnp.where(given, needed - have, 0)
        takes = fresh + cow
        on_device = self._rows_in_state(seqs, given, ON_DEVICE, per_row=True)
        fits = needed <= self.max_blocks_per_seq
        bad_row = given & ~(on_device & fits)
        # Which lanes repeat a sequence (per lane, for ``blocked``): a scatter
        # over ``max_seqs`` rows, small next to the block tables beside it.
        in_range = (seqs >= 0) & (seqs < self.max_seqs)
        times = jnp.zeros((self.max_seqs,), jnp.int32).at[jnp.where(given & in_range, seqs, self.max_seqs)].add(
            1, mode="drop")
        repeated = given & in_range & (times.at[rows].get(mode="fill", fill_value=0) > 1)
        valid = ~jnp.any(bad_row | repeated)
        total = jnp.sum(jnp.where(given, takes, 0), dtype=jnp.int32)
        return _AppendPlan(seqs, given, rows, lens, have, last_block, cow, fresh, takes, bad_row, repeated, valid,
                           total, jnp.broadcast_to(jnp.asarray(grow, jnp.int32), seqs.shape))

    def append_slots(
        self, pool: KVPool, seq_ids: Ids, num_new_tokens: int = 1, counts: Count | None = None
    ) -> tuple["BlockSpaceManager", KVPool, Int[Array, "batch num_new_tokens"], Bool[Array, "batch"], Ok]:
        """Grow each sequence of ``seq_ids`` (ON_DEVICE rows, -1 padding) by
        ``num_new_tokens`` (static) tokens, or with ``counts`` (``[batch]``,
        traced; clipped to ``[0, num_new_tokens]``) by ``counts[i]`` tokens
        each (a ragged append: slots past a row's count are -1).

        A sequence takes a new block for each block boundary it crosses. If the
        block its new tokens land in first is shared (ref count > 1, e.g. after
        ``fork``), copy-on-write: a fresh block replaces it in this sequence's
        table, the old block's K/V of every layer are copied into it in
        ``pool``, and the old block loses this owner. If all owners of a shared
        block append in the same step, the first (in batch order) keeps it and
        only the others copy. All blocks of the step come from one acquire.

        Returns ``(state, pool, slots, blocked, ok)``: ``slots[b, i]`` is the
        token index in the pool where new token ``i`` of sequence ``b`` must be
        written (-1 for padding). When the step cannot complete (too few free
        blocks, a sequence not on the device, past ``max_blocks_per_seq``, a row
        named twice) nothing changes, ``ok`` is False and ``blocked`` marks the
        sequences that could not proceed, so a scheduler can preempt.
        ``num_new_tokens`` must be a non-negative Python integer
        (``InvalidArgument`` at trace time otherwise).
        """
        n = _host.int_scalar(num_new_tokens, "num_new_tokens")
        if n < 0:
            raise InvalidArgument(f"append_slots of num_new_tokens={n}: a sequence cannot shrink")
        bs = self.block_size
        plan = self._append_plan(seq_ids, n, counts)
        seqs, given, rows, lens, have = plan.seqs, plan.given, plan.rows, plan.lens, plan.have
        last_block, cow, fresh, takes = plan.last_block, plan.cow, plan.fresh, plan.takes
        bad_row, valid, total = plan.bad_row, plan.valid, plan.total
        lanes = ceil_div(n, bs) + 1  # most blocks one sequence can take in a step

        def take_blocks(device, tables, pool):
            device, ids, acquired = device.acquire(
                jnp.where(valid, total, seqs.shape[0] * lanes + 1), max_n=seqs.shape[0] * lanes
            )
            ok = valid & acquired
            first = jnp.cumsum(takes) - takes  # this sequence's first id in ``ids``

            # Table writes: lane 0 replaces the last block (copy-on-write),
            # lanes 1.. append fresh blocks.
            lane = jnp.arange(lanes, dtype=jnp.int32)
            column = jnp.where(lane == 0, have[:, None] - 1, have[:, None] + lane - 1)
            use = jnp.where(lane == 0, cow[:, None], (lane - 1) < fresh[:, None]) & (ok & given)[:, None]
            id_index = first[:, None] + jnp.where(lane == 0, 0, cow[:, None] + lane - 1)
            new_ids = ids.at[id_index].get(mode="fill", fill_value=-1)
            tables = tables.at[jnp.where(use, rows[:, None], self.max_seqs), column].set(new_ids, mode="drop")

            copy_src = jnp.where(cow & ok, last_block, -1)
            copy_dst = jnp.where(cow & ok, new_ids[:, 0], -1)
            # Only steps with a copy-on-write touch the pool: the copy reads a
            # page of every layer per batch lane, far too much for every step.
            # An index switch, not a predicated cond: XLA:GPU copies the operand of a predicated conditional
            # that a branch updates in place (the whole pool, every step; a switch's it updates in place).
            pool = jax.lax.switch(
                jnp.any(cow & ok).astype(jnp.int32), [lambda p: p, lambda p: p.copy_pages(copy_src, copy_dst)[0]], pool
            )
            device, _ = device.release(copy_src)  # drops this sequence's share; never frees
            return device, tables, pool, ok

        # Most steps take no block (page_size - 1 of every page_size decode
        # steps): they skip the acquire, the table scatter and the release.
        device, tables, pool, ok = jax.lax.switch(
            (valid & (total > 0)).astype(jnp.int32), [lambda d, t, p: (d, t, p, valid), take_blocks], self.device,
            self.block_tables, pool)
        seq_lens = self.seq_lens.at[jnp.where(ok & given, rows, self.max_seqs)].add(plan.grow, mode="drop")

        lane = jnp.arange(n, dtype=jnp.int32)
        position = lens[:, None] + lane
        page = _table_at(tables, rows[:, None], position // bs)
        slots = jnp.where((ok & given)[:, None] & (lane < plan.grow[:, None]), page * bs + position % bs, -1)
        blocked = jnp.where(valid, given & (takes > 0), bad_row | plan.repeated) & ~ok
        state = self.replace(block_tables=tables, seq_lens=seq_lens, device=device)
        return state, pool, slots, blocked, ok

    def fork(self, src_ids: Ids, dst_ids: Ids) -> tuple["BlockSpaceManager", Ok]:
        """``dst[i]`` becomes a copy of sequence ``src[i]`` sharing all its
        blocks (one more owner each; no allocation, so it cannot run out of
        memory). For parallel sampling and beam search; later appends
        copy-on-write. Pairs with -1 are skipped.

        Fails (state unchanged) when a source is not ON_DEVICE, a destination
        is not FREE, or a destination repeats or is also a source.
        """
        src, src_given = _ids(src_ids)
        dst, dst_given = _ids(dst_ids)
        if src.shape != dst.shape:
            raise InvalidArgument(f"fork: {src.shape[0]} sources but {dst.shape[0]} destinations")
        pair = src_given & dst_given
        src = jnp.where(pair, src, -1)
        dst = jnp.where(pair, dst, -1)
        valid = (
            self._rows_in_state(src, pair, ON_DEVICE)
            & self._rows_in_state(dst, pair, FREE)
            & ids_distinct(dst, pair, self.max_seqs)
        )
        src_rows = jnp.where(pair, src, 0)
        shared = jnp.where(pair[:, None], self.block_tables[src_rows], -1)
        device, increfed = self.device.incref(jnp.where(valid, shared, -1))
        ok = valid & increfed
        target = jnp.where(ok & pair, dst, self.max_seqs)
        return (
            self.replace(
                block_tables=self.block_tables.at[target].set(shared, mode="drop"),
                seq_lens=self.seq_lens.at[target].set(self.seq_lens[src_rows], mode="drop"),
                status=self.status.at[target].set(ON_DEVICE, mode="drop"),
                device=device,
            ),
            ok,
        )

    def free(self, seq_ids: Ids) -> tuple["BlockSpaceManager", Ok]:
        """Finish sequences (ON_DEVICE or SWAPPED rows; -1 padding): drop their
        owner of every block (blocks return to their free stack at zero) and
        free the rows. Fails (state unchanged) on a FREE or out-of-range row or
        a row named twice."""
        seqs, given = _ids(seq_ids)
        rows = jnp.where(given, seqs, 0)
        status = jnp.where(given, self.status.at[rows].get(mode="fill", fill_value=FREE), FREE)
        in_range = (seqs >= 0) & (seqs < self.max_seqs)
        valid = jnp.all(~given | (in_range & (status != FREE))) & ids_distinct(seqs, given, self.max_seqs)
        tables = jnp.where(given[:, None], self.block_tables.at[rows].get(mode="fill", fill_value=-1), -1)
        # Host first, then the device only if the host succeeded: each release
        # is all or nothing, so only the host allocator needs undoing when the
        # device fails (a select over the host's arrays; none over the
        # device's, which a decode loop frees into on every step).
        host, host_ok = self.host.release(jnp.where(valid & (status == SWAPPED)[:, None], tables, -1))
        device, device_ok = self.device.release(
            jnp.where(valid & host_ok & (status == ON_DEVICE)[:, None], tables, -1))
        ok = valid & device_ok & host_ok
        target = jnp.where(ok & given, rows, self.max_seqs)
        # Dropped rows write what was read: the write then depends on the read
        # of the tables above, so XLA clears the rows in place instead of
        # copying the tables to keep them for that read.
        return (
            self.replace(
                block_tables=self.block_tables.at[target].set(jnp.where(given[:, None], -1, tables), mode="drop"),
                seq_lens=self.seq_lens.at[target].set(0, mode="drop"),
                status=self.status.at[target].set(FREE, mode="drop"),
                device=device,
                host=where_ok(ok, host, self.host),
            ),
            ok,
        )

    def trim_window(self, seq_ids: Ids, window: int) -> tuple["BlockSpaceManager", Int[Array, ""]]:
        """Release the blocks of ON_DEVICE ``seq_ids`` that no later query can
        see under a sliding window of ``window`` tokens (a query at ``p``
        attends ``[p - window + 1, p]``; the next one is at ``seq_lens``),
        turning their table entries into -1, so that a long sequence holds
        ``O(window / bs)`` blocks. Shared blocks lose one owner (a block
        returns to the free stack at zero). Attention reads the -1 entries as
        the null block and masks them by position. Returns ``(manager,
        blocks released)``; other rows and -1 padding are left alone.

        A row named more than once is trimmed once. Trimming is idempotent
        (what a row releases depends only on its length and ``window``), so
        a repeat means the same as one mention, and this op has no ``ok`` to
        refuse with; the ops that would act twice (``free``, ``fork``,
        ``append_slots``, ``allocate``, swaps) refuse repeated rows instead.

        ``window`` is static: a positive Python (or numpy) integer, else
        ``InvalidArgument`` at call time. A window of 0 or less would
        release the block the next token goes into.
        """
        window = _window(window)
        seqs, given = _ids(seq_ids)
        rows = jnp.where(given, seqs, 0)
        # Only the first lane naming a row acts: a second one would release
        # the same blocks again, and that all-or-nothing release would then
        # fail as a double free while the table entries were cleared anyway.
        in_range = (seqs >= 0) & (seqs < self.max_seqs)
        lane = jnp.arange(seqs.shape[0], dtype=jnp.int32)
        first_lane = jnp.full((self.max_seqs,), seqs.shape[0], jnp.int32).at[
            jnp.where(given & in_range, seqs, self.max_seqs)].min(lane, mode="drop")
        given = given & (first_lane.at[rows].get(mode="fill", fill_value=-1) == lane)
        on_device = self._rows_in_state(seqs, given, ON_DEVICE, per_row=True) & given
        dead = jnp.maximum(self.seq_lens[rows] - window + 1, 0) // self.block_size
        column = jnp.arange(self.max_blocks_per_seq, dtype=jnp.int32)[None, :]
        trim = on_device[:, None] & (column < dead[:, None]) & (self.block_tables[rows] >= 0)
        device, _ = self.device.release(jnp.where(trim, self.block_tables[rows], -1))  # held by these rows
        target = jnp.where(trim, rows[:, None], self.max_seqs)  # out of range: dropped
        tables = self.block_tables.at[target, column].set(-1, mode="drop")
        return self.replace(block_tables=tables, device=device), jnp.sum(trim).astype(jnp.int32)

    def truncate(self, seq_ids: Ids, lengths: Count) -> tuple["BlockSpaceManager", Ok]:
        """Shorten each ON_DEVICE sequence of ``seq_ids`` (-1 padding) to
        ``lengths[i]`` tokens: the undo of an ``append_slots`` whose last
        tokens were rejected (speculative decoding's rollback). The row's
        length goes back and the blocks past ``ceil(lengths[i] / bs)`` lose
        this row as an owner (a block returns to the free stack at zero, so
        a block the prefix cache or a fork also holds stays with them). A
        block kept as the row's last one keeps its slots past the new
        length: attention masks them by length and the next append writes
        over them (a copy-on-write that ``append_slots`` made stays the
        row's own copy).

        All or nothing: fails (state unchanged, ``ok`` False) when a row is
        out of range, not ON_DEVICE or named twice, or a length is negative
        or longer than the row."""
        seqs, given = _ids(seq_ids)
        lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), seqs.shape)
        rows = jnp.where(given, seqs, 0)
        current = self.seq_lens.at[rows].get(mode="fill", fill_value=0)
        valid = (self._rows_in_state(seqs, given, ON_DEVICE) & ids_distinct(seqs, given, self.max_seqs)
                 & jnp.all(~given | ((lengths >= 0) & (lengths <= current))))
        keep = ceil_div(lengths, self.block_size)
        column = jnp.arange(self.max_blocks_per_seq, dtype=jnp.int32)[None, :]
        tables = self.block_tables.at[rows].get(mode="fill", fill_value=-1)
        drop = (valid & given)[:, None] & (column >= keep[:, None]) & (tables >= 0)
        device, ok = self.device.release(jnp.where(drop, tables, -1))  # held by these rows: cannot fail
        ok = valid & ok
        target = jnp.where(drop & ok, rows[:, None], self.max_seqs)  # out of range: dropped
        return (
            self.replace(
                block_tables=self.block_tables.at[target, column].set(-1, mode="drop"),
                seq_lens=self.seq_lens.at[jnp.where(ok & given, rows, self.max_seqs)].set(lengths, mode="drop"),
                device=where_ok(ok, device, self.device),
            ),
            ok,
        )

    # ------------------------------------------------------------ prefix cache

    def admit_with_prefix(
        self,
        rows: Int[Array, " batch"],
        prefix_blocks: Int[Array, "batch max_blocks"],
        num_tokens: Int[Array, " batch"],
    ) -> tuple["BlockSpaceManager", Ok]:
        """Start sequence ``rows[b]`` (a FREE row; -1 padding) holding
        ``num_tokens[b]`` tokens whose first pages are the cached blocks
        ``prefix_blocks[b]`` (leading ids, then -1), e.g. a prefix-cache hit.

        Each cached block gets one more owner (this sequence: the table
        invariant holds, and :meth:`free` later drops exactly this
        sequence's references), and ``ceil(num_tokens / bs) - num_cached``
        fresh blocks are acquired for the rest, in one allocator update.

        Fails (state unchanged, ``ok`` False) when a row is not FREE, is out of
        range or repeats, a length is < 1 or needs more than
        ``max_blocks_per_seq`` blocks, a row has more cached blocks than its
        length needs, a cached block is free, or too few blocks are free.
        """
        rows = jnp.asarray(rows, jnp.int32).reshape(-1)
        given = rows != -1
        batch = rows.shape[0]
        width = self.max_blocks_per_seq
        prefix_blocks = jnp.asarray(prefix_blocks, jnp.int32).reshape(batch, width)
        num_tokens = jnp.asarray(num_tokens, jnp.int32).reshape(-1)
        num_prefix = jnp.sum(prefix_blocks != -1, axis=1, dtype=jnp.int32)
        blocks = self.blocks_for(num_tokens)
        row_ok = (num_tokens >= 1) & (blocks <= width) & (num_prefix <= blocks)
        valid = (self._rows_in_state(rows, given, FREE) & ids_distinct(rows, given, self.max_seqs)
                 & jnp.all(~given | row_ok))
        rest = jnp.where(given, blocks - num_prefix, 0)
        total = jnp.sum(rest, dtype=jnp.int32)
        max_n = batch * width
        empty = jnp.full((0,), -1, jnp.int32)
        device, ids, ok = self.device.update(
            jnp.where(valid & given[:, None], prefix_blocks, -1), empty, jnp.where(valid, total, max_n + 1), max_n=max_n
        )
        ok = ok & valid
        first = jnp.cumsum(rest) - rest  # this row's first id in ``ids``
        column = jnp.arange(width, dtype=jnp.int32)[None, :]
        fresh = ids.at[first[:, None] + column - num_prefix[:, None]].get(mode="fill", fill_value=-1)
        table = jnp.where(
            column < num_prefix[:, None], prefix_blocks, jnp.where(column < blocks[:, None], fresh, -1)
        )
        target = jnp.where(ok & given, rows, self.max_seqs)
        state = self.replace(
            block_tables=self.block_tables.at[target].set(table, mode="drop"),
            seq_lens=self.seq_lens.at[target].set(num_tokens, mode="drop"),
            status=self.status.at[target].set(ON_DEVICE, mode="drop"),
            device=where_ok(ok, device, self.device),
        )
        return state, ok

    def retire(
        self, incref_ids: Int[Array, " m"], rows: Int[Array, " batch"], release_ids: Int[Array, " k"] | None = None,
    ) -> tuple["BlockSpaceManager", Ok]:
        """``incref(incref_ids)`` (the blocks a prefix-cache ``insert`` reported
        as new: the tree takes its own reference), then ``free(rows)`` (the
        sequences drop theirs), then one device release per ``release_ids``
        entry (e.g. blocks the tree evicted). All or nothing; -1 entries are
        padding."""
        device, increfed = self.device.incref(incref_ids)
        freed_state, freed = self.replace(device=device).free(rows)
        ok = increfed & freed
        if release_ids is not None:
            device, released = freed_state.device.release(release_ids)
            freed_state = freed_state.replace(device=device)
            ok = ok & released
        return where_ok(ok, freed_state, self), ok

    # -------------------------------------------------------------------- swap

    def can_swap_out(self, seq_ids: Ids) -> Bool[Array, ""]:
        """Whether the host has a free block for every distinct block of the
        ON_DEVICE rows ``seq_ids``."""
        needed = self._distinct_blocks(seq_ids)
        return needed <= self.host.num_free

    def can_swap_in(self, seq_ids: Ids) -> Int[Array, ""]:
        """``ALLOC_OK`` / ``ALLOC_LATER`` / ``ALLOC_NEVER`` for bringing the
        SWAPPED rows ``seq_ids`` back, keeping the watermark free (as
        :meth:`can_allocate`)."""
        return self._admission(self._distinct_blocks(seq_ids))

    def swap_out(self, seq_ids: Ids) -> tuple["BlockSpaceManager", Int[Array, "m"], Int[Array, "m"], Ok]:
        """Move the sequence group ``seq_ids`` (ON_DEVICE rows; -1 padding) to
        host blocks: one host block per distinct device block, holding one
        owner per reference from the group; the device blocks lose those
        owners (and are freed unless someone outside the group holds them).

        Returns ``(state, device_pages, host_pages, ok)``: page
        ``device_pages[i]`` must be copied to host page ``host_pages[i]``
        (-1 pairs are padding) before the freed device blocks are written
        again; :func:`jaxkv.pool.host.swap_out_pages` does it
        (:meth:`swap_out_or_raise` does both on the host path). Fails (state
        unchanged) when a row is not ON_DEVICE or named twice, or the host has
        too few free blocks.
        """
        return self._move_group(seq_ids, ON_DEVICE, SWAPPED)

    def swap_in(self, seq_ids: Ids) -> tuple["BlockSpaceManager", Int[Array, "m"], Int[Array, "m"], Ok]:
        """Inverse of :meth:`swap_out` for SWAPPED rows: returns
        ``(state, host_pages, device_pages, ok)``, the copies to make
        (:func:`jaxkv.pool.host.swap_in_pages`) before the rows are used."""
        return self._move_group(seq_ids, SWAPPED, ON_DEVICE)

    def _move_group(self, seq_ids, from_status: int, to_status: int):
        seqs, given = _ids(seq_ids)
        source, target = (self.device, self.host) if from_status == ON_DEVICE else (self.host, self.device)
        valid = self._rows_in_state(seqs, given, from_status) & ids_distinct(seqs, given, self.max_seqs)
        rows = jnp.where(given, seqs, 0)
        tables = jnp.where((given & valid)[:, None], self.block_tables[rows], -1)
        flat = tables.reshape(-1)
        runs = _block_runs(flat)
        width = flat.shape[0]
        target, new_ids, acquired = target.acquire(jnp.where(valid, runs.count, width + 1), max_n=width)
        ok = valid & acquired
        new_sorted = jnp.where(runs.present & ok, new_ids.at[runs.run].get(mode="fill", fill_value=-1), -1)
        # One owner per reference: acquire gave one, the repeats add the rest.
        target, _ = target.incref(jnp.where(runs.is_first, -1, new_sorted))
        source, _ = source.release(jnp.where(ok, flat, -1))
        new_flat = jnp.zeros_like(flat).at[runs.order].set(new_sorted)
        target_rows = jnp.where(ok & given, rows, self.max_seqs)
        allocators = (source, target) if from_status == ON_DEVICE else (target, source)
        state = self.replace(
            block_tables=self.block_tables.at[target_rows].set(new_flat.reshape(tables.shape), mode="drop"),
            status=self.status.at[target_rows].set(to_status, mode="drop"),
            device=allocators[0],
            host=allocators[1],
        )
        from_pages = jnp.where(runs.is_first & ok, runs.ordered, -1)
        to_pages = jnp.where(runs.is_first & ok, new_sorted, -1)
        return state, from_pages, to_pages, ok

    def _distinct_blocks(self, seq_ids: Ids) -> Int[Array, ""]:
        seqs, given = _ids(seq_ids)
        rows = jnp.where(given, seqs, 0)
        return _block_runs(jnp.where(given[:, None], self.block_tables[rows], -1).reshape(-1)).count

    # --------------------------------------------------------------- queries

    def token_slots(self, seq_ids: Ids, positions: Int[Array, "batch n"]) -> Int[Array, "batch n"]:
        """Pool token index of ``positions`` of each sequence (-1 for padding
        rows and positions past the sequence's blocks)."""
        seqs, given = _ids(seq_ids)
        rows = jnp.where(given, seqs, 0)
        positions = jnp.asarray(positions, jnp.int32)
        page = _table_at(self.block_tables, rows[:, None], positions // self.block_size)
        return jnp.where(given[:, None] & (page >= 0), page * self.block_size + positions % self.block_size, -1)

    def batch_tables(self, seq_ids: Ids) -> tuple[Int[Array, "batch max_blocks"], Int[Array, "batch"]]:
        """``(block_tables, lengths)`` of a batch of ON_DEVICE sequences, in the
        convention of :mod:`jaxkv.manager.kernel_tables` (which turns them into
        each kernel's format): padding rows (-1) and rows not on the device get
        an all -1 row and length 0, so they read nothing."""
        seqs, given = _ids(seq_ids)
        on_device = self._rows_in_state(seqs, given, ON_DEVICE, per_row=True) & given
        rows = jnp.where(on_device, seqs, 0)
        return (
            jnp.where(on_device[:, None], self.block_tables[rows], -1),
            jnp.where(on_device, self.seq_lens[rows], 0),
        )

    # -------------------------------------------------------------- host paths

    def allocate_or_raise(self, seq_ids, num_tokens: int) -> "BlockSpaceManager":
        """Host path of :meth:`allocate`; raises ``InvalidId`` (a row out of range,
        not free or repeated), ``InvalidArgument`` (empty group, bad length) or
        ``KVCacheOOM`` (blocks requested / free / total)."""
        num_tokens = _host.int_scalar(num_tokens, "num_tokens")
        # Past int32 the device op sees INT32_MAX, which fails as too many blocks.
        state, ok = _allocate(self, _host.padded_ids(seq_ids, "seq_ids"),
                              min(max(num_tokens, -1), INT32_MAX))
        if bool(ok):
            return state
        raise self.allocate_error(seq_ids, num_tokens) or _host.unexplained("allocate", seq_ids)

    def allocate_error(self, seq_ids, num_tokens: int) -> KVCacheError | None:
        """Why ``allocate(seq_ids, num_tokens)`` fails on this state
        (``InvalidId``, ``InvalidArgument``, ``KVCacheOOM``), or None when it
        succeeds (the explainer style of ``jaxkv._host``)."""
        error = self.row_error("allocate", seq_ids, FREE)
        num_tokens = _host.int_scalar(num_tokens, "num_tokens")
        blocks = ceil_div(num_tokens, self.block_size)
        count = _host.given_ids(seq_ids).size
        if error is None and (num_tokens < 1 or blocks > self.max_blocks_per_seq or not count):
            error = InvalidArgument(
                f"allocate: {num_tokens} tokens ({blocks} blocks of {self.block_size}) for "
                f"{count} sequences (need >= 1 token, >= 1 sequence and at most "
                f"{self.max_blocks_per_seq} blocks per sequence)"
            )
        if error is None and blocks > int(self.device.num_free):  # one shared block per group
            error = KVCacheOOM(blocks, int(self.device.num_free), self.device.capacity, unit="blocks")
        return error

    def fork_or_raise(self, src_ids, dst_ids) -> "BlockSpaceManager":
        """Host path of :meth:`fork`; raises ``InvalidId`` naming the bad row,
        or ``InvalidArgument`` when the lists differ in length."""
        src, dst = _host.int_array(src_ids, "src_ids").reshape(-1), _host.int_array(dst_ids, "dst_ids").reshape(-1)
        if src.size != dst.size:
            raise InvalidArgument(f"fork: {src.size} sources but {dst.size} destinations (one source per destination)")
        state, ok = _fork(self, _host.padded_ids(src), _host.padded_ids(dst))
        if bool(ok):
            return state
        raise self.fork_error(src_ids, dst_ids) or _host.unexplained("fork", dst_ids)

    def fork_error(self, src_ids, dst_ids) -> KVCacheError | None:
        """Why ``fork(src_ids, dst_ids)`` fails on this state (``InvalidId``),
        or None when it succeeds."""
        error = self.row_error("fork source", src_ids, ON_DEVICE) or self.row_error("fork destination", dst_ids, FREE)
        overlap = np.intersect1d(_host.given_ids(src_ids), _host.given_ids(dst_ids))
        if error is None and overlap.size:
            error = InvalidId(f"fork: destinations {overlap.tolist()} are also sources", overlap)
        return error

    def free_or_raise(self, seq_ids) -> "BlockSpaceManager":
        """Host path of :meth:`free`; raises ``InvalidId`` for a free,
        out-of-range or repeated row."""
        state, ok = _free(self, _host.padded_ids(seq_ids))
        if bool(ok):
            return state
        raise self.free_error(seq_ids) or _host.unexplained("free", seq_ids)

    def free_error(self, seq_ids) -> KVCacheError | None:
        """Why ``free(seq_ids)`` fails on this state (``InvalidId``), or None
        when it succeeds."""
        return self.row_error("free", seq_ids, (ON_DEVICE, SWAPPED))

    def swap_out_or_raise(self, pool: KVPool, host_pool: KVPool, seq_ids) -> tuple["BlockSpaceManager", KVPool]:
        """Host path: move the sequence group ``seq_ids`` to host memory (tables
        by :meth:`swap_out`, data by :func:`jaxkv.pool.host.swap_out_pages`).
        Raises ``InvalidId`` for a row that is not on the device,
        ``KVCacheOOM`` when the host has too few free blocks and
        ``InvalidArgument`` when a pool is smaller than this manager's block
        count; nothing changes then. Returns ``(manager, host_pool)``."""
        self._check_pool_sizes(pool, host_pool)
        new, device_pages, host_ids, ok = _swap_out(self, _host.padded_ids(seq_ids, "seq_ids"))
        if not bool(ok):
            raise self.swap_out_error(seq_ids) or _host.unexplained("swap out", seq_ids)
        return new, swap_out_pages(pool, host_pool, device_pages, host_ids)

    def swap_in_or_raise(self, pool: KVPool, host_pool: KVPool, seq_ids) -> tuple["BlockSpaceManager", KVPool]:
        """Host path: bring the swapped group ``seq_ids`` back to the device.
        Raises ``InvalidId`` for a row that is not swapped out, ``KVCacheOOM``
        when the device has too few free blocks and ``InvalidArgument`` for a
        pool smaller than this manager's block count. Returns
        ``(manager, pool)``; ``pool`` is donated."""
        self._check_pool_sizes(pool, host_pool)
        new, host_ids, device_pages, ok = _swap_in(self, _host.padded_ids(seq_ids, "seq_ids"))
        if not bool(ok):
            raise self.swap_in_error(seq_ids) or _host.unexplained("swap in", seq_ids)
        return new, swap_in_pages(pool, host_pool, host_ids, device_pages)

    def _check_pool_sizes(self, pool: KVPool, host_pool: KVPool) -> None:
        """The pools must hold every block id this manager can hand out."""
        for name, have, allocator in (("pool", pool.num_pages, self.device), ("host_pool", host_pool.num_pages, self.host)):
            if have < allocator.num_blocks:
                raise InvalidArgument(
                    f"{name} has {have} pages but the manager hands out block ids up to {allocator.num_blocks - 1}: "
                    f"make it with num_pages >= {allocator.num_blocks} (the manager's block count)")

    def swap_out_error(self, seq_ids) -> KVCacheError | None:
        """Why ``swap_out(seq_ids)`` fails on this state (``InvalidId``,
        ``KVCacheOOM`` in host blocks), or None when it succeeds."""
        return self._swap_error(seq_ids, ON_DEVICE, "swap out", self.host, "host blocks")

    def swap_in_error(self, seq_ids) -> KVCacheError | None:
        """Why ``swap_in(seq_ids)`` fails on this state (``InvalidId``,
        ``KVCacheOOM`` in device blocks), or None when it succeeds."""
        return self._swap_error(seq_ids, SWAPPED, "swap in", self.device, "device blocks")

    def _swap_error(self, seq_ids, wanted: int, op: str, allocator: BlockAllocator, unit: str) -> KVCacheError | None:
        error = self.row_error(op, seq_ids, wanted)
        if error is not None:
            return error
        needed = int(self._distinct_blocks(_host.padded_ids(seq_ids)))
        if needed <= int(allocator.num_free):
            return None
        return KVCacheOOM(needed, int(allocator.num_free), allocator.capacity, unit=unit)

    def row_error(self, op: str, seq_ids, wanted) -> KVCacheError | None:
        """``InvalidId`` for the first row of ``seq_ids`` that is out of range,
        repeated or not in the ``wanted`` status (one or a tuple); None if all
        rows are fine."""
        wanted = wanted if isinstance(wanted, tuple) else (wanted,)
        given = _host.given_ids(seq_ids)
        status = np.asarray(self.status)
        for seq in given:
            if not 0 <= seq < self.max_seqs:
                return InvalidId(f"{op}: sequence {seq} outside [0, {self.max_seqs})", [seq])
            if status[seq] not in wanted:
                names = " or ".join(STATUS_NAMES[w] for w in wanted)
                return InvalidId(f"{op}: sequence {seq} is {STATUS_NAMES[int(status[seq])]}, not {names}", [seq])
        unique, times = np.unique(given, return_counts=True)
        if (times > 1).any():
            return InvalidId(f"{op}: sequences {unique[times > 1].tolist()} named twice", unique[times > 1])
        return None

    # --------------------------------------------------------------- internals

    def _rows_in_state(self, seqs, given, state: int, per_row: bool = False):
        """Whether every given row is in range and in ``state`` (or, with
        ``per_row``, that test for each row)."""
        in_range = (seqs >= 0) & (seqs < self.max_seqs)
        status = self.status.at[jnp.where(in_range, seqs, 0)].get(mode="fill", fill_value=FREE)
        good = in_range & (status == state)
        return good if per_row else jnp.all(~given | good)


def _window(window) -> int:
    """``trim_window``'s static window as a Python int (``InvalidArgument``
    unless a positive integer); a window past int32 is clipped to INT32_MAX,
    which trims nothing a sequence can hold."""
    if isinstance(window, jax.core.Tracer):
        raise InvalidArgument("trim_window: window must be a static Python integer (a traced value cannot size "
                              "what is released: mark it static)")
    window = _host.int_scalar(window, "window")
    if window < 1:
        raise InvalidArgument(f"trim_window: window={window} must be >= 1 (a query always sees itself; a window "
                              f"of {window} would release the block the next token is written to)")
    return min(window, INT32_MAX)


def _ids(ids: Ids) -> tuple[Int[Array, "m"], Bool[Array, "m"]]:
    ids = jnp.asarray(ids, jnp.int32).reshape(-1)
    return ids, ids != -1


class _AppendPlan(NamedTuple):
    """The per-sequence needs of one ``append_slots`` step (see ``_append_plan``)."""

    seqs: Int[Array, "batch"]
    given: Bool[Array, "batch"]
    rows: Int[Array, "batch"]
    lens: Int[Array, "batch"]
    have: Int[Array, "batch"]  # blocks held now
    last_block: Int[Array, "batch"]
    cow: Bool[Array, "batch"]  # copies its shared last block
    fresh: Int[Array, "batch"]  # new blocks past the last one
    takes: Int[Array, "batch"]  # fresh + cow
    bad_row: Bool[Array, "batch"]
    repeated: Bool[Array, "batch"]  # names a sequence another lane names too
    valid: Bool[Array, ""]
    total: Int[Array, ""]  # blocks the step acquires
    grow: Int[Array, "batch"]  # tokens each sequence grows by


@struct.dataclass
class _Runs:
    """``ids`` sorted, with the runs of equal ids described (see _block_runs)."""

    order: Int[Array, "m"]  # ordered = ids[order]
    ordered: Int[Array, "m"]
    present: Bool[Array, "m"]  # not padding
    is_first: Bool[Array, "m"]  # first of its run
    run: Int[Array, "m"]  # index of the run (distinct id) of each position
    count: Int[Array, ""]  # number of distinct ids


def _block_runs(ids: Int[Array, "m"]) -> _Runs:
    """Sort block ids (-1 = padding, sorted last) and number the distinct ones.
    Used by swaps, which are rare and small: a sort of the group's table
    entries is cheaper than any scratch array sized by the pool."""
    big = INT32_MAX
    order = jnp.argsort(jnp.where(ids == -1, big, ids), stable=True)
    ordered = ids[order]
    present = ordered != -1
    previous = jnp.concatenate([jnp.full((1,), -1, ordered.dtype), ordered[:-1]])
    is_first = present & (ordered != previous)
    run = jnp.cumsum(is_first, dtype=jnp.int32) - 1
    return _Runs(order, ordered, present, is_first, run, jnp.sum(is_first, dtype=jnp.int32))


def _table_at(tables: Int[Array, "s c"], rows: Int[Array, "..."], columns: Int[Array, "..."]) -> Int[Array, "..."]:
    """``tables[rows, columns]``, -1 where the column is out of range."""
    inside = (columns >= 0) & (columns < tables.shape[1])
    return jnp.where(inside, tables[rows, jnp.clip(columns, 0, tables.shape[1] - 1)], -1)


_allocate = jax.jit(BlockSpaceManager.allocate)
_fork = jax.jit(BlockSpaceManager.fork)
_free = jax.jit(BlockSpaceManager.free)
_swap_out = jax.jit(BlockSpaceManager.swap_out)
_swap_in = jax.jit(BlockSpaceManager.swap_in)
