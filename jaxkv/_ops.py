"""Small array routines shared by the allocators, chosen for what XLA does
well: elementwise work, reductions, short prefix sums and small gathers."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.types import Array, Bool, Count, Int

#: Row length of the two-level search in :func:`first_true_indices`.
_ROW = 128


def first_true_indices(mask: Bool[Array, "n"], count: Count, size: int) -> Int[Array, "size"]:
    """Indices of the first ``count`` True entries of ``mask``, ascending, padded
    with -1 to ``size`` (lanes past ``min(count, number of True)`` are -1).

    Two levels, so no prefix sum runs over all of ``mask`` (on XLA CPU a
    prefix sum costs a few ns per element, and ``jnp.nonzero(size=...)``
    scatters once per element): count the True entries of each row of
    ``_ROW`` by a reduction, prefix-sum the row counts, binary-search the row
    holding each wanted rank, then prefix-sum only that row. Cost: O(n)
    reduction + O(n / _ROW) + O(size * _ROW).
    """
    n = mask.shape[0]
    rows = -(-n // _ROW)
    grid = jnp.pad(mask, (0, rows * _ROW - n)).reshape(rows, _ROW)
    per_row = jnp.sum(grid, axis=1, dtype=jnp.int32)
    upto_row = jnp.cumsum(per_row, dtype=jnp.int32)  # True entries in rows 0..r
    lane = jnp.arange(size, dtype=jnp.int32)
    wanted = lane + 1  # 1-based rank of the entry this lane returns
    row = jnp.searchsorted(upto_row, wanted, side="left", method="scan_unrolled")
    row = jnp.minimum(row, rows - 1).astype(jnp.int32)
    rank_in_row = wanted - (upto_row[row] - per_row[row])
    within = jnp.cumsum(grid[row], axis=1, dtype=jnp.int32)  # [size, _ROW]
    column = jnp.argmax(within >= rank_in_row[:, None], axis=1).astype(jnp.int32)
    return jnp.where((lane < count) & (lane < upto_row[-1]), row * _ROW + column, -1)
