"""Sequence rows: the one row-indexed view of a cache that both managers give.

A decode loop, a fork for parallel sampling and a beam step speak of *rows*
``0 .. B-1`` of their batch. A :class:`~jaxkv.BlockSpaceManager` indexes its
block tables by the same rows; a :class:`~jaxkv.manager.hybrid.KVCacheManager`
indexes request *slots*, whose slot 0 is its null slot. The rule between the
two is written here once (:func:`slot_of`, :func:`row_of`) and both managers
implement :class:`RowCache` with it, so code over rows (``jaxkv.nn.steps``,
``jaxkv.nn.parallel``, the engine's caches) never asks which manager it holds.

Invariant: for a ``KVCacheManager``, row ``r`` is slot ``r + 1``; for a
``BlockSpaceManager`` row ``r`` is row ``r``. Row -1 is padding everywhere and
maps to -1 (skipped by every operation).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax.numpy as jnp

from jaxkv.types import Array, Int, Ok

__all__ = ["RowCache", "row_of", "slot_of"]


def slot_of(row):
    """The hybrid manager's request slot of row ``row`` (a Python int, or an
    int array whose -1 entries stay -1): ``row + 1``."""
    if isinstance(row, int):
        return row + 1 if row >= 0 else -1
    row = jnp.asarray(row, jnp.int32)
    return jnp.where(row >= 0, row + 1, -1)


def row_of(slot: int) -> int:
    """The row of the hybrid manager's request slot ``slot`` (a Python int >= 1)."""
    return slot - 1


@runtime_checkable
class RowCache(Protocol):
    """What code over batch rows asks of a cache manager. Every operation is
    jittable and all or nothing (unchanged state and ``ok`` False on
    failure); -1 rows are skipped."""

    #: True when the manager keeps one block table per row (``block_tables[row]``,
    #: ``seq_lens[row]``): a finished row's table can be kept for the caller.
    ROW_TABLES: bool

    @property
    def blocks_in_use(self) -> Int[Array, ""]:
        """Blocks held, summed over every group (device blocks only)."""

    def free_rows(self, rows, *, keep: bool = False) -> tuple[RowCache, Ok]:
        """Give back every block rows ``rows`` hold. ``keep``: the rows stay
        held, empty (a beam row about to be forked into); a manager whose
        rows are not held apart from their blocks frees them either way."""

    def fork_rows(self, src, dst) -> tuple[RowCache, Ok]:
        """Rows ``dst[i]`` (free, or held empty) start as copies of rows
        ``src[i]``, sharing their full blocks."""

    def block_totals(self) -> tuple[int, int]:
        """``(free, total)`` device blocks on the host, summed over groups
        (for an error message; reads the device)."""

    def in_step(self) -> RowCache:
        """Inside a jitted step: the manager the step works on. A manager
        may be passed without what no step touches (a
        ``BlockSpaceManager``'s host allocator, ``host`` None: the engine's
        paged cache keeps it out of its steps, so engines that differ only
        in their host tier share compiled programs); this puts a placeholder
        there, made inside the program. Otherwise the manager itself."""
