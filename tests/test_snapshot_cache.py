"""SnapshotCache (jaxkv/prefix/snapshot_cache.py): the hybrid prefix cache on
the host, against a plain model.

The model gives every block an id that names its content: block ``i`` of
group ``g`` of a request whose tokens are ``S`` is
``ids[(g, tuple(S[:min((i + 1) * tokens_per_block, len(S))]))]``. So a hit
is right exactly when every block it hands out agrees with the query on the
tokens the hit covers, and the snapshot row it names was last written
with the state of the query's first ``hit.tokens`` tokens. References are
counted the way the device allocator counts them (increfs minus releases,
per group) and must equal what the cache says it holds.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.errors import BookkeepingError, InvalidArgument
from jaxkv.prefix.snapshot_cache import SNAPSHOT_KINDS, SnapshotCache

UNIT = 4
GROUPS = ("pages2", "pages4")  # 2 and 4 tokens per block: a page (4 tokens) is 2 blocks and 1 block
TOKENS_PER_BLOCK = (2, 4)


def blocks_for(n: int) -> list[int]:
    return [-(-n // t) for t in TOKENS_PER_BLOCK]


class Blocks:
    """Content-named block ids (module docstring)."""

    def __init__(self):
        self.ids: dict = {}
        self.fresh: dict = {}  # id -> (group, tokens) of blocks a host tier wrote

    def row(self, tokens: list) -> list[list[int]]:
        out = []
        for g, per in enumerate(TOKENS_PER_BLOCK):
            out.append([self.ids.setdefault((g, tuple(tokens[: min((i + 1) * per, len(tokens))])), len(self.ids) + 1)
                        for i in range(blocks_for(len(tokens))[g])])
        return out

    def content(self) -> dict:
        return {**{v: k for k, v in self.ids.items()}, **self.fresh}


def _check_hit(cache, hit, query, blocks: Blocks, rows: dict) -> None:
    assert hit.tokens <= len(query) - 1
    assert hit.branch >= hit.tokens
    if not hit.tokens:
        assert hit.record is None and all(not b for b in hit.blocks)
        return
    content = blocks.content()
    for g, per in enumerate(TOKENS_PER_BLOCK):
        assert len(hit.blocks[g]) == blocks_for(hit.tokens)[g]
        for i, block in enumerate(hit.blocks[g]):
            group, held = content[block]
            covered = min((i + 1) * per, hit.tokens)
            assert group == g and list(held[:covered]) == query[:covered], (g, i, held, query[:covered])
    assert rows[hit.row] == tuple(query[: hit.tokens])  # the state the snapshot row was given


def test_a_hit_is_exactly_as_long_as_the_state_kept():
    blocks = Blocks()
    cache = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots=4)
    system = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # two pages and 2 tokens
    first = system + [11, 12, 13]
    ops = cache.store(system, blocks.row(first), source=3, kind="branch")
    # The pages' blocks and the tail's (tokens 8..9: group 0 one block, group 1 one partly filled block).
    assert sorted(ops.incref["pages2"]) == sorted(blocks.row(first)[0][:5])
    assert sorted(ops.incref["pages4"]) == sorted(blocks.row(first)[1][:3])
    assert ops.copies == {0: 3}
    rows = {0: tuple(system)}
    query = system + [99, 98]
    hit = cache.match(query)
    assert hit.tokens == 10 and hit.branch == 10
    _check_hit(cache, hit, query, blocks, rows)
    assert cache.match(system[:9] + [50, 51]).tokens == 0  # parts before the record's end: no state there
    assert cache.match(system[:9] + [50, 51]).branch == 9  # ... but a branch point is reported at token grain
    cache.release(hit)
    cache.check_invariants()


def test_the_longest_record_wins_and_repeats_refresh():
    blocks = Blocks()
    cache = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots=4)
    seq = list(range(1, 20))
    for p, row in ((5, 1), (9, 2), (13, 3)):
        cache.store(seq[:p], blocks.row(seq), source=row, kind="interval")
    assert cache.store(seq[:9], blocks.row(seq), source=7, kind="branch").copies == {}  # cached already
    assert cache.match(seq[:12]).tokens == 9
    assert cache.match(seq[:14]).tokens == 13
    assert cache.match(seq[:6]).tokens == 5
    assert len(cache.records) == 3


def test_value_retention_drops_superseded_turns_and_unhit_prompt_ends_first():
    blocks = Blocks()
    cache = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots=2)
    conversation = list(range(1, 30))
    cache.store(conversation[:6], blocks.row(conversation), source=1, kind="turn_end")
    hit = cache.match(conversation[:10])  # the next turn starts from it ...
    cache.release(hit)
    cache.store(conversation[:12], blocks.row(conversation), source=1, kind="turn_end", supersedes=hit.record)
    other = [40, 41, 42, 43, 44, 45, 46]
    cache.store(other, blocks.row(other + [47]), source=2, kind="branch")  # ... so the first turn goes
    assert sorted(r.tokens for r in cache.records.values()) == [7, 12]
    lru = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots=2, retention="lru")
    lru.store(other, blocks.row(other + [47]), source=2, kind="branch")
    lru.store(conversation[:5], blocks.row(conversation), source=1, kind="prompt_end")
    lru.store(conversation[:9], blocks.row(conversation), source=1, kind="prompt_end")
    assert sorted(r.tokens for r in lru.records.values()) == [5, 9]  # LRU drops the branch point


def test_refusals():
    with pytest.raises(InvalidArgument):
        SnapshotCache(UNIT, GROUPS, blocks_for, 2, retention="fifo")
    cache = SnapshotCache(UNIT, GROUPS, blocks_for, 2)
    with pytest.raises(InvalidArgument):
        cache.store([1, 2, 3], Blocks().row([1, 2, 3]), 1, kind="whenever")
    with pytest.raises(BookkeepingError, match="needs 2 blocks"):
        cache.store([1, 2, 3], [[5], [6]], 1, kind="branch")
    hit = cache.match([1, 2, 3])
    assert hit.tokens == 0
    cache.release(hit)  # a miss pins nothing and releases nothing


class SnapshotCacheMachine(RuleBasedStateMachine):
    """Random stores, matches, releases and evictions against the model."""

    @initialize(num_snapshots=st.integers(1, 4), retention=st.sampled_from(["value", "lru"]), spill=st.booleans())
    def start(self, num_snapshots, retention, spill):
        self.cache = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots, retention=retention, spill=spill)
        self.host: list = []  # spilled records, as a host tier keeps them: (tokens, namespace, kind)
        self.blocks = Blocks()
        self.refs = {name: collections.Counter() for name in GROUPS}
        self.rows: dict = {}  # snapshot row -> tokens whose state it holds
        self.pinned: list = []
        self.seen: list = []  # sequences stored, to query their prefixes and extensions

    def _apply(self, ops, tokens=None):
        content = self.blocks.content()
        for spill in ops.spills:  # a record leaving: every block of its tokens, read before any release
            assert self.cache.spill
            assert self.rows[spill.row] == spill.tokens  # its row still holds its state
            for g, per in enumerate(TOKENS_PER_BLOCK):
                assert len(spill.blocks[g]) == blocks_for(len(spill.tokens))[g]
                for i, block in enumerate(spill.blocks[g]):
                    covered = min((i + 1) * per, len(spill.tokens))
                    assert content[block][1][:covered] == spill.tokens[:covered]
                    assert self.refs[GROUPS[g]][block] > 0  # still held when it is read
            self.host.append((spill.tokens, spill.namespace, spill.kind))
        for name in GROUPS:
            self.refs[name].update(ops.incref[name])
            self.refs[name].subtract(ops.release[name])
            assert all(v >= 0 for v in self.refs[name].values()), "released more than taken"
        for row in ops.copies:
            self.rows[row] = tuple(tokens)

    sequences = st.lists(st.integers(1, 3), min_size=2, max_size=14)

    @rule(seq=sequences, cut=st.integers(1, 14), kind=st.sampled_from(SNAPSHOT_KINDS), namespace=st.sampled_from([None, "b"]))
    def store(self, seq, cut, kind, namespace):
        p = min(cut, len(seq))
        self.seen.append((seq, namespace))
        supersedes = self.pinned[-1][0].record if self.pinned else None
        self._apply(self.cache.store(seq[:p], self.blocks.row(seq), source=1, kind=kind, namespace=namespace,
                                     supersedes=supersedes), seq[:p])

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def match_a_known_prefix(self, data, extra):
        seq, namespace = self.seen[data.draw(st.integers(0, len(self.seen) - 1))]
        self.match(seq[: data.draw(st.integers(0, len(seq)))] + extra, namespace)

    @rule(query=sequences, namespace=st.sampled_from([None, "b"]))
    def match(self, query, namespace):
        held = self.cache.cached_length(query, namespace)  # asked first, changing nothing (the next hit's)
        hit = self.cache.match(query, namespace)
        assert hit.tokens == held
        if hit.record is not None:
            _check_hit(self.cache, hit, query, self.blocks, self.rows)
            assert self.cache.records[hit.record].namespace == namespace
            self.pinned.append((hit, query))
        else:
            self.cache.release(hit)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def release(self, data):
        hit, _ = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.cache.release(hit)

    @precondition(lambda self: getattr(self, "host", None))
    @rule(data=st.data())
    def restore(self, data):
        """A host tier brings a spilled record back: fresh blocks (one
        reference each, given), its state written into a row it takes."""
        tokens, namespace, kind = self.host.pop(data.draw(st.integers(0, len(self.host) - 1)))
        row, ops = self.cache.take_row()
        self._apply(ops)
        if row is None:
            return
        fresh = [[100_000 + len(self.blocks.fresh) + 1000 * g + i for i in range(n)]  # ids never used before
                 for g, n in enumerate(blocks_for(len(tokens)))]
        self.blocks.fresh.update({b: (g, tuple(tokens[: min((i + 1) * per, len(tokens))]))
                                  for g, per in enumerate(TOKENS_PER_BLOCK) for i, b in enumerate(fresh[g])})
        for g, name in enumerate(GROUPS):  # the references handed over
            self.refs[name].update(fresh[g])
        self.rows[row] = tuple(tokens)
        self._apply(self.cache.store(list(tokens), fresh, row, kind=kind, namespace=namespace, given=True))
        for g, name in enumerate(GROUPS):  # each given reference is kept once or released
            assert all(self.refs[name][b] <= 1 for b in fresh[g])

    @rule(shortfall=st.lists(st.integers(0, 6), min_size=2, max_size=2))
    def evict(self, shortfall):
        self._apply(self.cache.evict_blocks(shortfall))

    @invariant()
    def references_match_what_is_held(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        held = self.cache.held_blocks()
        for name in GROUPS:
            assert +self.refs[name] == held[name], name

    @invariant()
    def pinned_hits_stay_valid(self):
        for hit, query in getattr(self, "pinned", []):
            assert hit.record in self.cache.records  # a pinned record is never dropped
            _check_hit(self.cache, hit, query, self.blocks, self.rows)


TestSnapshotCacheMachine = SnapshotCacheMachine.TestCase
TestSnapshotCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])


def test_records_without_a_page_give_their_tail_blocks_back_under_pressure():
    """A record shorter than a page is keyed at its namespace root: no page
    eviction takes it, so block pressure drops it (its tail blocks are
    released) and, once only pinned ones are left, nothing more."""
    blocks = Blocks()
    cache = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots=2)
    short, other = [1, 2, 3], [7, 8]
    stored = cache.store(short, blocks.row(short), source=1, kind="branch")
    cache.store(other, blocks.row(other), source=2, kind="branch")
    assert cache.evictable and not cache.tree.evictable_blocks
    hit = cache.match(short + [4])  # pins the 3-token record
    ops = cache.evict_blocks([1, 1])
    assert ops.release == {"pages2": blocks.row(other)[0], "pages4": blocks.row(other)[1]}
    assert [r.tokens for r in cache.records.values()] == [3] and not cache.evictable
    cache.release(hit)
    assert sorted(cache.evict_blocks([2, 1]).release["pages2"]) == sorted(stored.incref["pages2"])
    assert not cache.records


def test_match_finds_by_first_token_what_a_scan_of_every_record_finds():
    """A root holds one child page per distinct first page and one record
    per prompt shorter than a page: ``match`` reads only those that begin
    with the query's next token (an index), and its hit and branch point
    are those of a scan over every stored sequence."""
    import random

    rng = random.Random(0)
    blocks = Blocks()
    cache = SnapshotCache(UNIT, GROUPS, blocks_for, num_snapshots=64)
    stored = set()
    for i in range(48):
        seq = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 11))]
        cache.store(seq, blocks.row(seq + [99]), source=i, kind="branch")
        stored.add(tuple(seq))
    cache.check_invariants()
    for _ in range(200):
        query = [rng.randrange(1, 5) for _ in range(rng.randrange(2, 12))]
        limit = len(query) - 1

        def common(seq):
            n = 0
            while n < min(len(seq), limit) and seq[n] == query[n]:
                n += 1
            return n

        hit = cache.match(query)
        assert hit.tokens == max((len(s) for s in stored if len(s) <= limit and common(s) == len(s)), default=0)
        assert hit.branch == max(common(s) for s in stored), query
        cache.release(hit)
    cache.check_invariants()
