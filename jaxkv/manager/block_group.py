"""BlockGroup: the blocks and block table shared by a group of hybrid layers.

Layers of the same kind and compression ratio allocate at exactly the same
times (a CSA layer with ratio 4 gets a block every 128 original tokens, a
full-attention layer every ``page_size`` tokens), so they share one
allocator and one block table, each layer with its own pool arrays indexed
by the shared block ids (vLLM's KV cache groups). The
:class:`~jaxkv.manager.hybrid.KVCacheManager` holds one group per
``LayerCacheSchema.group`` name.

Invariants (checked by the hybrid manager's tests after every operation):

* ``tables[s, :lens[s]]`` are the blocks slot ``s`` holds, in order, each
  once; ``tables[s, lens[s]:]`` are -1;
* a held block's ref count is the number of tables naming it plus the
  references a prefix cache holds (:meth:`BlockGroup.adopt` shares a cached
  prefix by reference; :meth:`BlockGroup.adopt_prefix` shares its full
  blocks and gives the slot a fresh copy of a partly filled last one, which
  only the slot owns); allocated + free = ``num_blocks - 1`` (block 0 is
  the null block, never handed out);
* a failed operation returns the group it was given, unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int

from jaxkv._ops import ceil_div
from jaxkv.alloc.block import BlockAllocator
from jaxkv.types import Ids, Ok

__all__ = ["BlockGroup"]


@struct.dataclass
class BlockGroup:
    """Blocks of one group of layers (same kind and ratio) and their table.

    Fields:
      allocator: the group's blocks, ``1 .. num_blocks - 1`` (0 = null).
      tables: int32 ``[num_slots, max_blocks]``; ``tables[s, :lens[s]]`` are
        slot ``s``'s blocks in order, -1 after.
      lens: int32 ``[num_slots]``, blocks held per slot.
      tokens_per_entry, entries_per_block: static (compressed: ratio and
        128 / ratio; full/MLA: 1 and page_size).
    """

    allocator: BlockAllocator
    tables: Int[Array, "slots max_blocks"]
    lens: Int[Array, " slots"]
    tokens_per_entry: int = struct.field(pytree_node=False)
    entries_per_block: int = struct.field(pytree_node=False)

    @classmethod
    def create(cls, num_blocks: int, num_slots: int, max_blocks: int, tokens_per_entry: int,
               entries_per_block: int) -> "BlockGroup":
        """Every block free (``num_blocks`` with the null block), every table empty."""
        return cls(allocator=BlockAllocator.create(num_blocks),
                   tables=jnp.full((num_slots, max_blocks), -1, jnp.int32),
                   lens=jnp.zeros((num_slots,), jnp.int32),
                   tokens_per_entry=tokens_per_entry, entries_per_block=entries_per_block)

    @property
    def tokens_per_block(self) -> int:
        return self.tokens_per_entry * self.entries_per_block

    @property
    def max_blocks(self) -> int:
        """Blocks a slot's table holds (static)."""
        return self.tables.shape[1]

    def blocks_for(self, seq_lens: Int[Array, "..."]) -> Int[Array, "..."]:
        """Blocks needed once ``seq_lens`` tokens are processed: enough for
        every *completed* entry (``seq_len // tokens_per_entry``)."""
        return ceil_div(seq_lens // self.tokens_per_entry, self.entries_per_block)

    def grow(self, slots: Int[Array, " B"], new_lens: Int[Array, " B"], max_new: int) -> tuple["BlockGroup", Ok]:
        """Give each row of ``slots`` (-1 = padding) the blocks ``new_lens``
        needs. Returns ``(group, ok)``; fails (unchanged) when a row needs more
        than ``max_new`` blocks, more than the table holds, or more than are free."""
        num_slots = self.lens.shape[0]
        rows = jnp.clip(slots, 0, num_slots - 1)
        active = slots >= 0
        have = self.lens[rows]
        need, fits = self._growth(slots, new_lens, max_new)
        total = jnp.sum(need)
        batch = slots.shape[0]
        allocator, ids, ok = self.allocator.acquire(jnp.where(fits, total, 0), max_n=batch * max_new)
        ok = ok & fits
        # Row b takes ids[offset_b : offset_b + need_b] into columns have_b + j.
        offset = jnp.cumsum(need) - need
        j = jnp.arange(max_new, dtype=jnp.int32)[None, :]
        take = ok & (j < need[:, None])
        new_ids = ids[jnp.clip(offset[:, None] + j, 0, batch * max_new - 1)]
        # Row index num_slots is out of range: the scatters drop those writes.
        # (No lax.cond skips the steps that take no block: inside a decode
        # loop XLA copied the tables and ref counts through its branches.)
        target_rows = jnp.where(take, rows[:, None], num_slots)
        tables = self.tables.at[target_rows, have[:, None] + j].set(new_ids, mode="drop")
        lens = self.lens.at[jnp.where(ok & active, rows, num_slots)].add(need, mode="drop")
        return self.replace(allocator=allocator, tables=tables, lens=lens), ok

    def can_grow(self, slots: Int[Array, " B"], new_lens: Int[Array, " B"], max_new: int) -> Ok:
        """Whether :meth:`grow` of the same arguments succeeds (changes nothing)."""
        need, fits = self._growth(slots, new_lens, max_new)
        return fits & (jnp.sum(need) <= self.allocator.num_free)

    def _growth(self, slots, new_lens, max_new: int) -> tuple[Int[Array, " B"], Ok]:
        """Blocks each row of ``slots`` takes to hold ``new_lens`` tokens, and
        whether every row stays within ``max_new`` and its table."""
        rows = jnp.clip(slots, 0, self.lens.shape[0] - 1)
        have = self.lens[rows]
        need = jnp.where(slots >= 0, jnp.maximum(self.blocks_for(new_lens) - have, 0), 0)
        return need, jnp.all((need <= max_new) & (have + need <= self.max_blocks))

    def append_block(self, slot: Int[Array, ""]) -> tuple["BlockGroup", Int[Array, ""], Ok]:
        """One more block at the end of ``slot``'s table (seed 004's
        ``allocate_block``). Returns ``(group, block_id, ok)``; fails
        (unchanged, -1) when the slot is out of range, its table is full or
        no block is free. The caller checks that the slot is held."""
        num_slots = self.lens.shape[0]
        slot = jnp.asarray(slot, jnp.int32)
        row = jnp.clip(slot, 0, num_slots - 1)
        have = self.lens[row]
        fits = (slot >= 0) & (slot < num_slots) & (have < self.max_blocks)
        allocator, ids, ok = self.allocator.acquire(jnp.where(fits, 1, 0), max_n=1)
        ok = ok & fits
        block = jnp.where(ok, ids[0], -1)
        target = jnp.where(ok, row, num_slots)  # out of range: dropped
        tables = self.tables.at[target, have].set(block, mode="drop")
        lens = self.lens.at[target].add(1, mode="drop")
        return self.replace(allocator=allocator, tables=tables, lens=lens), block, ok

    def partly_filled(self, num_tokens: Int[Array, "..."]) -> Array:
        """Whether the last block a prefix of ``num_tokens`` tokens needs is
        only partly filled (its completed entries, ``num_tokens //
        tokens_per_entry``, stop inside it): a slot continuing that prefix
        appends entries into that block, so it cannot share it."""
        return (num_tokens // self.tokens_per_entry) % self.entries_per_block != 0

    def adopt(self, slots: Ids, blocks: Int[Array, "B M"]) -> tuple["BlockGroup", Ok]:
        """Put ``blocks[b]`` (-1 padded, leading) at the start of the empty
        table of ``slots[b]`` (-1: skipped), one more owner each (a cached
        prefix shared by reference). Fails (unchanged) when a block is not
        held or the caller's slot is not empty."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        group, _, _, ok = self._adopt(slots, blocks, jnp.zeros(slots.shape, bool))
        return group, ok

    def adopt_prefix(self, slots: Ids, blocks: Int[Array, "B M"], num_tokens: Int[Array, " B"]
                     ) -> tuple["BlockGroup", Int[Array, " B"], Int[Array, " B"], Ok]:
        """:meth:`adopt` of a cached prefix of ``num_tokens[b]`` tokens, with
        copy-on-write of a partly filled last block: where
        :meth:`partly_filled` holds for a row, its last given block is not
        shared; the row gets a fresh block (one owner: the slot) in that
        column instead, and the caller copies the data. Every other block
        is shared by reference, as by :meth:`adopt`.

        Returns ``(group, src, dst, ok)``: ``dst[b]`` is row ``b``'s fresh
        block and ``src[b]`` the cached block to copy into it (both -1 for a
        row with no copy, and everywhere on failure). The cached block
        gains no owner. Costs at most one free block per row. Fails
        (unchanged) as :meth:`adopt` does, and when a block to copy is not
        held or fewer blocks are free than rows that copy. ``blocks`` rows
        are assumed to be the ``blocks_for(num_tokens)`` leading ids the
        prefix needs (the caller's check)."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        num_tokens = jnp.asarray(num_tokens, jnp.int32).reshape(-1)
        return self._adopt(slots, blocks, self.partly_filled(jnp.maximum(num_tokens, 0)))

    def _adopt(self, slots: Int[Array, " B"], blocks: Int[Array, "B M"], copy_last: Array
               ) -> tuple["BlockGroup", Int[Array, " B"], Int[Array, " B"], Ok]:
        """:meth:`adopt_prefix` with the rows whose last given block is copied
        rather than shared (``copy_last``) given."""
        num_slots = self.lens.shape[0]
        active = slots >= 0
        rows = jnp.clip(slots, 0, num_slots - 1)
        batch, width = blocks.shape
        given = active[:, None] & (blocks >= 0)
        count = jnp.sum(given, axis=1, dtype=jnp.int32)
        column = jnp.arange(width, dtype=jnp.int32)[None, :]
        copied = (copy_last & active)[:, None] & given & (column == count[:, None] - 1)
        copies = jnp.any(copied, axis=1)
        src = jnp.max(jnp.where(copied, blocks, -1), axis=1)
        # The copied block keeps its owners (the cache, another slot): it is
        # read once here, so it only has to be held, not shared.
        held = jnp.all(~copies | (self.allocator.ref_count(src) > 0))
        fits = jnp.all(~active | (self.lens[rows] == 0)) & (width <= self.max_blocks) & held
        # Shared blocks gain an owner and the fresh ones are taken in one
        # all-or-nothing allocator step (nothing is released).
        allocator, fresh, ok = self.allocator.update(
            jnp.where(given & ~copied, blocks, -1), jnp.full((0,), -1, jnp.int32),
            jnp.where(fits, jnp.sum(copies, dtype=jnp.int32), 0), max_n=max(batch, 1))
        ok = ok & fits
        # Row b takes fresh[offset_b] (rows that copy, in order).
        offset = jnp.cumsum(copies) - copies
        dst = jnp.where(ok & copies, fresh[jnp.clip(offset, 0, max(batch, 1) - 1)], -1)
        src = jnp.where(ok & copies, src, -1)
        row_blocks = jnp.where(copied, dst[:, None], blocks)
        target = jnp.where(ok & given, rows[:, None], num_slots)  # out of range: dropped
        tables = self.tables.at[target, column].set(row_blocks, mode="drop")
        lens = self.lens.at[jnp.where(ok & active, rows, num_slots)].set(count, mode="drop")
        new = self.replace(allocator=allocator, tables=tables, lens=lens)
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, self), src, dst, ok

    def shrink(self, slots: Ids, new_lens: Int[Array, " B"]) -> tuple["BlockGroup", Ok]:
        """Keep the first ``blocks_for(new_lens[b])`` blocks of each row of
        ``slots`` (-1 = padding) and drop this row's owner of the rest (the
        undo of a :meth:`grow` whose last tokens were rejected: speculative
        decoding's rollback); a row that holds fewer keeps what it has.
        Fails (unchanged) when a release fails (a slot named twice)."""
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
        num_slots = self.lens.shape[0]
        rows = jnp.clip(slots, 0, num_slots - 1)
        have = self.lens[rows]
        keep = jnp.where(slots >= 0, jnp.minimum(self.blocks_for(jnp.maximum(new_lens, 0)), have), have)
        col = jnp.arange(self.max_blocks, dtype=jnp.int32)[None, :]
        drop = (slots[:, None] >= 0) & (col >= keep[:, None]) & (col < have[:, None])
        allocator, ok = self.allocator.release(jnp.where(drop, self.tables[rows], -1))
        target = jnp.where(drop & ok, rows[:, None], num_slots)  # out of range: dropped
        lens = self.lens.at[jnp.where(ok & (slots >= 0), rows, num_slots)].set(keep, mode="drop")
        return self.replace(allocator=allocator, tables=self.tables.at[target, col].set(-1, mode="drop"),
                            lens=lens), ok

    def release_rows(self, slots: Ids) -> tuple["BlockGroup", Ok]:
        """Drop the owner of every block of ``slots`` (-1 ignored; distinct,
        held slots) and empty their tables; a block shared with a prefix
        cache or another slot keeps its other owners."""
        num_slots = self.lens.shape[0]
        rows = jnp.clip(slots, 0, num_slots - 1)
        col = jnp.arange(self.max_blocks, dtype=jnp.int32)[None, :]
        held = (slots[:, None] >= 0) & (col < self.lens[rows][:, None])
        blocks = jnp.where(held, self.tables[rows], -1)
        allocator, ok = self.allocator.release(blocks)  # repeats: blocks shared by two released slots
        cleared = jnp.where(slots >= 0, rows, num_slots)  # out of range: dropped
        # Dropped rows write what was read: the write then depends on the read
        # of the tables above, and XLA clears the rows in place instead of
        # copying the tables to keep them for that read.
        empty = jnp.where((slots >= 0)[:, None], -1, blocks)
        return self.replace(allocator=allocator, tables=self.tables.at[cleared].set(empty, mode="drop"),
                            lens=self.lens.at[cleared].set(0, mode="drop")), ok
