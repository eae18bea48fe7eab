"""Where a hybrid row is snapshotted (:class:`SnapshotPoints`), piece by
piece, against the rule written out over a random prompt split into random
pieces: a piece end is a point when it is the branch point, the prompt's
last token but one, a position another request waits for, or ``interval``
tokens past the last snapshot; the prompt's end never is (the retirement
snapshots it)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.prefix.snapshot_points import SnapshotPoints


def _pieces(rng, start: int, end: int) -> list[int]:
    """Random piece ends from ``start`` to ``end`` (inclusive of ``end``)."""
    ends, at = [], start
    while at < end:
        at = min(end, at + int(rng.integers(1, 40)))
        ends.append(at)
    return ends


@pytest.mark.parametrize("trial", range(20))
def test_points_follow_the_rule(trial):
    rng = np.random.default_rng()
    interval = int(rng.integers(8, 64))
    points = SnapshotPoints(2, interval, enabled=True)
    prompt_len = int(rng.integers(2, 300))
    hit = int(rng.integers(0, prompt_len))
    matched = int(rng.integers(hit, prompt_len))
    waited = sorted({int(p) for p in rng.integers(1, prompt_len + 5, 3)})
    # A waiter may ask before the row's prefill starts (admitted in the same
    # iteration): the cut must survive the start.
    asked = {p: points.add_cut(0, p) for p in waited}
    points.start(0, hit)
    assert asked == {p: p > 0 for p in waited}
    last, expected, got = hit, [], []
    for end in _pieces(rng, hit, prompt_len):
        if end < prompt_len and (end in (matched, prompt_len - 1) or end in waited):
            expected.append((end, "prompt_end" if end == prompt_len - 1 else "branch"))
        elif end < prompt_len and end - last >= interval:
            expected.append((end, "interval"))
        cuts = points.cuts(0, matched, prompt_len)
        asked = points.stores_at(0, end, matched, prompt_len)  # (what the packed call reads the tables for)
        assert points.cuts(0, matched, prompt_len) == cuts  # stores_at changes nothing
        kind = points.piece_ran(0, end, matched, prompt_len)
        assert asked == (kind is not None)
        assert points.length(0) == end
        if kind is not None:
            got.append((end, kind))
            points.stored(0, end)
        if expected and expected[-1][0] == end:
            last = end
    assert got == expected
    points.grew(0, 5)
    assert points.length(0) == prompt_len + 5
    points.clear(0)
    assert points.length(0) == 0 and points.cuts(0, 0, 10) == [0, 9]


def test_disabled_chooses_nothing():
    points = SnapshotPoints(1, 16, enabled=False)
    assert not points.stores_at(0, 5, 5, 10)
    assert not points.add_cut(0, 10)
    points.start(0, 0)
    assert points.cuts(0, 3, 100) == []
    assert all(points.piece_ran(0, end, 3, 100) is None for end in (3, 16, 50, 99))


def test_a_cut_behind_the_row_is_refused():
    points = SnapshotPoints(1, 16, enabled=True)
    points.start(0, 40)
    assert not points.add_cut(0, 40) and not points.add_cut(0, 12)
    assert points.add_cut(0, 41)


def test_grew_many_is_grew_of_each_row():
    one, many = SnapshotPoints(6, 8, enabled=True), SnapshotPoints(6, 8, enabled=True)
    for p in (one, many):
        p.start(1, 5)
        p.start(4, 2)
    for row, n in ((1, 3), (4, 1), (0, 2)):
        one.grew(row, n)
    many.grew_many([1, 4, 0], np.array([3, 1, 2]))
    assert [one.length(r) for r in range(6)] == [many.length(r) for r in range(6)] == [2, 8, 0, 0, 3, 0]
    assert all(type(many.length(r)) is int for r in range(6))
