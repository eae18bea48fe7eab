"""Jittable operations that put prefix-cache blocks into a
:class:`~jaxkv.manager.block_space.BlockSpaceManager`'s block tables.

A sequence that hits the prefix cache starts with the cached blocks at the
front of its block table. It takes its *own* reference to each of them
(``incref``), so the table invariant of ``BlockSpaceManager`` holds (a
block's ref count = the table entries naming it + the references held
outside, here one for the radix tree) and ``BlockSpaceManager.free`` later
drops exactly the sequence's references.

* :func:`admit_with_prefix`: set the rows' tables (cached prefix + fresh
  blocks), incref the prefix, acquire the rest; all or nothing.
* :func:`retire`: incref the blocks a finished sequence handed to the tree,
  then free the sequences; all or nothing.
* :func:`release_blocks`: drop one reference per id (blocks the tree evicted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.manager.block_space import FREE, ON_DEVICE, BlockSpaceManager, _distinct
from jaxkv.types import Array, Int, Ok

__all__ = ["admit_with_prefix", "release_blocks", "retire"]


def admit_with_prefix(
    manager: BlockSpaceManager,
    rows: Int[Array, " batch"],
    prefix_blocks: Int[Array, "batch max_blocks"],
    num_tokens: Int[Array, " batch"],
) -> tuple[BlockSpaceManager, Ok]:
    """Start sequence ``rows[b]`` (a FREE row; -1 padding) holding
    ``num_tokens[b]`` tokens whose first pages are the cached blocks
    ``prefix_blocks[b]`` (leading ids, then -1): each cached block gets one
    more owner (this sequence), and ``ceil(num_tokens / bs) - num_cached``
    fresh blocks are acquired for the rest, in one allocator update.

    Fails (state unchanged, ``ok`` False) when a row is not FREE, is out of
    range or repeats, a length is < 1 or needs more than
    ``max_blocks_per_seq`` blocks, a row has more cached blocks than its
    length needs, a cached block is free, or too few blocks are free.
    """
    rows = jnp.asarray(rows, jnp.int32).reshape(-1)
    given = rows != -1
    batch = rows.shape[0]
    width = manager.max_blocks_per_seq
    prefix_blocks = jnp.asarray(prefix_blocks, jnp.int32).reshape(batch, width)
    num_tokens = jnp.asarray(num_tokens, jnp.int32).reshape(-1)
    num_prefix = jnp.sum(prefix_blocks != -1, axis=1, dtype=jnp.int32)
    blocks = manager.blocks_for(num_tokens)
    row_ok = (num_tokens >= 1) & (blocks <= width) & (num_prefix <= blocks)
    valid = (
        manager._rows_in_state(rows, given, FREE)
        & _distinct(rows, given, manager.max_seqs)
        & jnp.all(~given | row_ok)
    )
    rest = jnp.where(given, blocks - num_prefix, 0)
    total = jnp.sum(rest, dtype=jnp.int32)
    max_n = batch * width
    empty = jnp.full((0,), -1, jnp.int32)
    device, ids, ok = manager.device.update(
        jnp.where(valid & given[:, None], prefix_blocks, -1), empty, jnp.where(valid, total, max_n + 1), max_n=max_n
    )
    ok = ok & valid
    first = jnp.cumsum(rest) - rest  # this row's first id in ``ids``
    column = jnp.arange(width, dtype=jnp.int32)[None, :]
    fresh = ids.at[first[:, None] + column - num_prefix[:, None]].get(mode="fill", fill_value=-1)
    table = jnp.where(
        column < num_prefix[:, None], prefix_blocks, jnp.where(column < blocks[:, None], fresh, -1)
    )
    target = jnp.where(ok & given, rows, manager.max_seqs)
    state = manager.replace(
        block_tables=manager.block_tables.at[target].set(table, mode="drop"),
        seq_lens=manager.seq_lens.at[target].set(num_tokens, mode="drop"),
        status=manager.status.at[target].set(ON_DEVICE, mode="drop"),
        device=jax.tree_util.tree_map(lambda new, old: jnp.where(ok, new, old), device, manager.device),
    )
    return state, ok


def retire(
    manager: BlockSpaceManager, incref_ids: Int[Array, " m"], rows: Int[Array, " batch"],
    release_ids: Int[Array, " k"] | None = None,
) -> tuple[BlockSpaceManager, Ok]:
    """``incref(incref_ids)`` (the blocks a prefix-cache ``insert`` reported
    as new: the tree takes its own reference), then ``free(rows)`` (the
    sequences drop theirs), then ``release(release_ids)`` (e.g. blocks the
    tree evicted). All or nothing; -1 entries are padding."""
    device, increfed = manager.device.incref(incref_ids)
    freed_state, freed = manager.replace(device=device).free(rows)
    ok = increfed & freed
    if release_ids is not None:
        device, released = freed_state.device.release(release_ids)
        freed_state = freed_state.replace(device=device)
        ok = ok & released
    state = jax.tree_util.tree_map(lambda new, old: jnp.where(ok, new, old), freed_state, manager)
    return state, ok


def release_blocks(manager: BlockSpaceManager, ids: Int[Array, " m"]) -> tuple[BlockSpaceManager, Ok]:
    """Drop one device reference per id (-1 padding), e.g. the blocks
    ``PrefixCacheManager.evict`` returned; blocks reaching zero are free."""
    device, ok = manager.device.release(ids)
    return manager.replace(device=device), ok
