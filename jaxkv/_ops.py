"""Small routines shared across jaxkv, named once.

Array routines are chosen for what XLA does well: elementwise work,
reductions, short prefix sums and small gathers. The scalar helpers are the
idioms every module needs (ceiling division, int32 limits, the fp8 dtypes,
"new state where ok, else old").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.types import Array, Bool, Count, Int

__all__ = [
    "FP8_DTYPES",
    "INT32_MAX",
    "ceil_div",
    "first_true_indices",
    "ids_distinct",
    "is_fp8",
    "on_local_heads",
    "place_kv",
    "pow2_at_least",
    "where_ok",
]

#: Largest int32: block ids, counts and lengths are int32 on device.
INT32_MAX = int(np.iinfo(np.int32).max)

#: The float8 storage dtypes jaxkv's pools and kernels accept.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

#: Largest id range :func:`ids_distinct` counts in a scratch array.
_SCATTER_BOUND = 4096

#: Row length of the two-level search in :func:`first_true_indices`.
_ROW = 128


def on_local_heads(placement, attend, q, pages, small=(), sinks=None):
    """One attention kernel call, ``attend(q, *pages, sinks, *small)``: on a
    mesh under ``placement.run`` (a :class:`jaxkv.nn.layers.HeadPlacement`:
    each device on its own heads under ``shard_map``), else (``placement``
    None, or one device) as it is. Shared by the models' attention and the
    hybrid cache's layer handles."""
    if placement is None or placement.parts == 1:
        return attend(q, *pages, sinks, *small)
    return placement.run(attend, q, pages, small, sinks=sinks)


def place_kv(placement, *rows) -> tuple:
    """New K/V rows ``[T, KVH, D]`` placed as the cache holds its heads on a
    mesh (:meth:`jaxkv.nn.layers.HeadPlacement.place_kv`); as they are with
    no placement (one device). Returns a tuple, one entry per row."""
    if placement is None or placement.parts == 1:
        return rows
    return tuple(placement.place_kv(x) for x in rows)


def place_whole(placement, *rows) -> tuple:
    """New rows a latent cache keeps whole on every device (DeepSeek-V4's
    window rows and compressor inputs) placed whole before they are
    written (:meth:`jaxkv.nn.layers.HeadPlacement.place_whole`); as they
    are with no placement (one device). Returns a tuple, one entry per row."""
    if placement is None or placement.parts == 1:
        return rows
    return tuple(placement.place_whole(x) for x in rows)


def ceil_div(a, b):
    """``ceil(a / b)`` for positive ``b``; works on Python ints and int arrays."""
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """Smallest power of two >= max(n, 1) (host ints: bucket sizes that keep
    the number of compiled shapes small)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is one of :data:`FP8_DTYPES`."""
    return jnp.dtype(dtype) in FP8_DTYPES


def where_ok(ok: Bool[Array, ""], new, old):
    """``new`` where ``ok`` else ``old``, leaf by leaf over two pytrees of the
    same structure: the all-or-nothing commit of every device op."""
    return jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)


def ids_distinct(ids: Int[Array, "m"], given: Bool[Array, "m"], bound: int | None = None) -> Bool[Array, ""]:
    """No given id appears twice among ``ids`` (entries where ``given`` is
    False are ignored).

    With a small static ``bound`` (ids known to lie in ``[0, bound)``, e.g.
    sequence rows) the ids are counted in a scratch array of ``bound``
    entries: one scatter, the cheapest form on XLA CPU. Otherwise (no bound,
    or one too large to pay for, such as a pool's block count) a sort:
    O(m log m), nothing sized by the id range.
    """
    if bound is not None and bound <= _SCATTER_BOUND:
        counts = jnp.zeros((bound,), jnp.int32).at[jnp.where(given, ids, bound)].add(1, mode="drop")
        return jnp.all(counts <= 1)
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(given, ids, big))
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] != big)
    return ~jnp.any(repeated)


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
    rows = ceil_div(n, _ROW)
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
