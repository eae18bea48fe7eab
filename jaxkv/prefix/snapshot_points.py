"""Where a hybrid row's state is snapshotted: the host-side rule the engine's
hybrid cache follows (:class:`~jaxkv.serve.hybrid_cache.HybridCache`).

A snapshot copies a request's state rows (rings, windows, Gated DeltaNet
states) exactly where the state is, so it can only be taken between device
calls, at the end of a prompt piece or when the request retires. This module
decides which piece ends are worth one; :class:`SnapshotCache` stores them.

A prompt piece's end is a snapshot point when it is

* a *cut*: the branch point where the prompt parts from everything cached
  (later requests sharing that prefix hit it), the prompt's last token but
  one (a repeat of the prompt hits all of it but the token that yields
  logits), or a point another request waits for (:meth:`SnapshotPoints.add_cut`);
  the engine cuts its pieces there so that one ends exactly on it;
* ``interval`` tokens or more past the row's last snapshot (a later request
  sharing a long prefix hits near where it parts).

Invariants, per row: ``length(row)`` is the tokens the row's state holds
(prefilled and decoded); ``last(row) <= length(row)`` is where its last
snapshot was taken; every pending cut is past ``length(row)`` when it was
added. Nothing here touches the device.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SnapshotPoints"]


class SnapshotPoints:
    """Per row: its length, its last snapshot and the cuts others wait for.
    ``enabled`` False (no snapshot rows): no point is ever chosen."""

    def __init__(self, num_rows: int, interval: int, *, enabled: bool):
        self.interval = int(interval)
        self.enabled = bool(enabled)
        self._length = np.zeros(num_rows, np.int64)  # an array: a decode chunk grows every row at once (grew_many)
        self._last = [0] * num_rows
        self._waited: list[set] = [set() for _ in range(num_rows)]

    def length(self, row: int) -> int:
        return int(self._length[row])

    def start(self, row: int, tokens: int) -> None:
        """Row ``row`` starts from a hit of ``tokens`` (its state is a
        snapshot there, or empty at 0). Cuts added before keep: a request
        admitted in the same iteration may wait for this row already."""
        self._length[row] = self._last[row] = tokens

    def clear(self, row: int) -> None:
        """The row was given back: nothing of it is kept."""
        self._length[row] = self._last[row] = 0
        self._waited[row].clear()

    def grew(self, row: int, tokens: int) -> None:
        """Decode steps appended ``tokens`` to the row."""
        self._length[row] += tokens

    def grew_many(self, rows, tokens) -> None:
        """:meth:`grew` of each ``rows[i]`` by ``tokens[i]`` (distinct rows)."""
        self._length[np.asarray(rows, np.int64)] += np.asarray(tokens, np.int64)

    def stored(self, row: int, length: int) -> None:
        """A snapshot of the row was taken at ``length``."""
        self._last[row] = length

    def add_cut(self, row: int, position: int) -> bool:
        """Another request waits for the row's state at ``position``.
        Returns whether the row's pieces must be cut there (False: nothing
        to wait for, the row is past it or snapshots are off)."""
        if not self.enabled or position <= self._length[row]:
            return False
        self._waited[row].add(position)
        return True

    def cuts(self, row: int, matched: int, prompt_len: int) -> list[int]:
        """The row's cuts (module docstring), sorted: ``matched`` is where its
        prompt of ``prompt_len`` tokens parts from the cache."""
        if not self.enabled:
            return []
        return sorted({matched, prompt_len - 1, *self._waited[row]})

    def piece_ran(self, row: int, end: int, matched: int, prompt_len: int) -> str | None:
        """A prompt piece of the row ended at ``end``: the kind of snapshot
        to take there (``"prompt_end"``, ``"branch"``, ``"interval"``), or
        None. The caller reports the snapshot it took with :meth:`stored`."""
        self._length[row] = end
        if not self.stores_at(row, end, matched, prompt_len):
            return None
        if end in self.cuts(row, matched, prompt_len):
            kind = "prompt_end" if end == prompt_len - 1 else "branch"
        else:  # (stores_at: an interval past its last snapshot)
            kind = "interval"
        self._waited[row].discard(end)
        return kind

    def stores_at(self, row: int, end: int, matched: int, prompt_len: int) -> bool:
        """Whether :meth:`piece_ran` of a piece ending at ``end`` would name a
        kind (changes nothing)."""
        if not self.enabled or end >= prompt_len:
            return False
        return end in self.cuts(row, matched, prompt_len) or end - self._last[row] >= self.interval
