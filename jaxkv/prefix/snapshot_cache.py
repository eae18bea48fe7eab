"""SnapshotCache: the prefix cache of a hybrid model, on the host.

A hybrid model (DeepSeek-V4's SWA/CSA/HCA layers, Qwen3-Next's Gated
DeltaNet beside full attention) keeps two kinds of KV state per request:

* **blocks** of each block group (compressed entries, full-attention pages),
  append-only, which a prefix can share by reference;
* **state rows** (SWA and compressor rings, GDN conv and recurrent states),
  overwritten every step, which only a copy taken at an exact position
  (a *snapshot*) can restore.

A cached prefix of ``p`` tokens is therefore a path of tree pages (``unit``
tokens each: the least common multiple of the groups' block sizes, so a page
names whole blocks of every group) plus a **snapshot record** at ``p``: the
state copied into one of ``num_snapshots`` snapshot rows, the tokens past
the last whole page (``tail_tokens``) and the blocks of each group that hold
them (``tail``; the last one may be partly filled, and a hit gets a private
copy of it: copy-on-write, :meth:`~jaxkv.KVCacheManager.attach_prefix`).
Any ``p`` works: a hit is exactly as long as the state that was kept.

Like :class:`~jaxkv.prefix.PrefixCacheManager` (which holds the pages), this
class makes no device call. Its methods return what the caller must do on
the device (:class:`BlockOps`: ids to incref and release per group, a state
row to copy into a snapshot row) and the caller batches them into its own
jitted calls (:class:`jaxkv.serve.hybrid_cache.HybridCache` does).

Retention is apart from allocation. Snapshot rows are a pool of their own;
when :meth:`store` needs a row and none is free, a record is dropped by the
retention policy:

* ``"lru"``: the least recently used record;
* ``"value"`` (default): the record of the lowest class, least recently used
  within it: 0 a superseded turn end (its conversation went on and was
  stored further) or a prompt end never hit; 1 an interval point (taken
  every ``interval`` tokens of a prefill); 2 a branch point (where prompts
  part) or a turn end; 3 any record that served a hit and is not
  superseded.

Tree pages give their blocks back only under block pressure
(:meth:`evict_blocks`, least recently used pages first; the records keyed at
an evicted page go with it).

Quotas (tenants, :meth:`set_quota`): an owner's tree pages and snapshot
records are capped (``pages``, ``rows``; the owner of a namespace is
:func:`~jaxkv.prefix.radix.owner_key`'s: a server tenant's salts count as
one). Storing past the page cap evicts the owner's own least recently used
unpinned pages; a record past the row cap takes the row of the owner's own
victim (or is not kept when all of its records are pinned); and under
pressure (``evict_blocks``, a row needed while none is free) owners over
their fair share give first. Pinned records and pages (running requests' hits) are never taken.

Host tier (``spill``): every record that leaves the device is reported
whole (:class:`Spill`: its tokens, every block holding them, its row) for
the caller to copy to host memory before the blocks are released; one that
comes back is given to :meth:`store` with ``given`` (blocks the caller
filled, one reference each handed over) in a row from :meth:`take_row`,
or its pages alone to :meth:`adopt_pages`.

Invariants (checked by :meth:`check_invariants`, and by a hypothesis state
machine against a plain model in ``tests/test_snapshot_cache.py``):

* every page handle the tree holds on the device tier is a key of
  ``pages`` and every key of ``pages`` is in the tree (one page per handle);
* the snapshot rows of the records and the free rows partition
  ``range(num_snapshots)``;
* every record is keyed at a live page (or a namespace root) and its
  ``tokens`` equal ``depth * unit + len(tail_tokens)``, with
  ``len(tail_tokens) < unit``; its tail holds ``blocks_for(tokens) -
  depth * blocks_per_page`` blocks per group;
* per group, the references this cache asked for (increfs) minus those it
  gave back (releases) are exactly the blocks its live pages and records
  name (``held_blocks``);
* pins are never negative, and a pinned record is never dropped.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxkv.errors import BookkeepingError, CacheLocked, InvalidArgument
from jaxkv.prefix.block_cache import PrefixCacheManager
from jaxkv.prefix.radix import DEVICE, namespace_key, owner_key

__all__ = ["BlockOps", "RETENTION_POLICIES", "SNAPSHOT_KINDS", "SnapshotCache", "SnapshotHit", "SnapshotRecord", "Spill"]

#: Why a snapshot was taken (the retention policy's input).
SNAPSHOT_KINDS = ("prompt_end", "interval", "branch", "turn_end")
RETENTION_POLICIES = ("value", "lru")


@dataclasses.dataclass
class SnapshotRecord:
    """A cached state at exactly ``tokens`` tokens.

    Fields: ``id`` (unique), ``row`` (snapshot row ``0 .. num_snapshots-1``
    holding the state), ``tokens``, ``key`` (the handle of the last whole
    page, or ``("root", namespace)``), ``depth`` (whole pages before it),
    ``tail_tokens`` (the tokens past them), ``tail`` (per group, the blocks
    holding those tokens: this record holds one reference to each),
    ``kind`` (one of :data:`SNAPSHOT_KINDS`), ``namespace``, ``path``
    (the handles of its pages), ``prefix`` (its tokens), ``pins``,
    ``hits``, ``last_used`` (a clock), ``superseded``."""

    id: int
    row: int
    tokens: int
    key: Hashable
    depth: int
    tail_tokens: tuple
    tail: tuple
    kind: str
    namespace: Hashable = None
    path: tuple = ()  # the handles of its whole pages, in order
    prefix: tuple = ()  # all its tokens
    pins: int = 0
    hits: int = 0
    last_used: int = 0
    superseded: bool = False


@dataclasses.dataclass(frozen=True)
class SnapshotHit:
    """A prefix served from the cache: ``tokens`` tokens, ``blocks`` per
    group (pages, then the record's tail) for the new request's tables, the
    state in snapshot row ``row``; ``record`` (its id) and ``node`` (the
    pinned tree node) stay pinned until :meth:`SnapshotCache.release`.
    ``branch``: how far ``tokens`` agree with anything cached (token grain),
    at least ``tokens``: where a snapshot would serve the next request
    with the same prefix."""

    tokens: int
    blocks: tuple
    row: int
    record: int
    node: object
    branch: int


@dataclasses.dataclass(frozen=True)
class Spill:
    """A record leaving the device (with ``spill`` on): its ``tokens``,
    ``namespace``, ``kind``, the ``blocks`` of each group that hold them
    (pages then tail) and its snapshot ``row``, for the caller to copy to
    host memory before the blocks are released and the row reused."""

    tokens: tuple
    namespace: Hashable
    kind: str
    blocks: tuple
    row: int


@dataclasses.dataclass
class BlockOps:
    """Device work an operation asks of the caller, in this order: incref
    ``incref[g]`` (ids of group ``g``), copy the ``spills`` to host, release
    ``release[g]``, then copy state rows ``copies`` (``snapshot row ->
    source``: the caller's request slot whose state the snapshot takes).
    ``cleared``: snapshot rows let go (their record dropped); a caller that
    scrubs resets them with the release, before the copies."""

    incref: dict
    release: dict
    copies: dict = dataclasses.field(default_factory=dict)
    spills: list = dataclasses.field(default_factory=list)
    cleared: list = dataclasses.field(default_factory=list)

    def extend(self, other: "BlockOps") -> None:
        for name in self.incref:
            self.incref[name] += other.incref[name]
            self.release[name] += other.release[name]
        self.copies.update(other.copies)
        self.spills += other.spills
        self.cleared += other.cleared

    def __bool__(self) -> bool:
        return any(self.incref.values()) or any(self.release.values()) or bool(self.copies) or bool(self.spills)


class SnapshotCache:
    """The hybrid prefix cache (module docstring).

    Args:
        unit: tokens per tree page (every group's block size divides it).
        groups: block group names, in the caller's order.
        blocks_for: ``blocks_for(num_tokens) -> [blocks per group]`` that a
            request of that many tokens holds (the manager's rule).
        num_snapshots: snapshot rows (0: the cache stores nothing).
        retention: ``"value"`` or ``"lru"`` (module docstring).
        row_bytes: bytes of one snapshot row (state of every layer), and
            ``block_bytes``: bytes of one block per group; for :meth:`usage`.
        spill: every record that leaves (dropped for its row, or with its
            page) is reported in ``BlockOps.spills`` for a host tier.
    """

    def __init__(self, unit: int, groups: Sequence[str], blocks_for: Callable[[int], Sequence[int]],
                 num_snapshots: int, *, retention: str = "value", row_bytes: int = 0,
                 block_bytes: Sequence[int] | None = None, spill: bool = False):
        if retention not in RETENTION_POLICIES:
            raise InvalidArgument(f"retention={retention!r}: choose one of {RETENTION_POLICIES}")
        if num_snapshots < 0:
            raise InvalidArgument(f"num_snapshots={num_snapshots}: must be >= 0")
        self.unit = unit
        self.groups = tuple(groups)
        self._blocks_for = blocks_for
        self.blocks_per_page = [int(n) for n in blocks_for(unit)]
        self.num_snapshots = num_snapshots
        self.retention = retention
        self.spill = spill
        self.row_bytes = row_bytes
        self.block_bytes = list(block_bytes) if block_bytes is not None else [0] * len(self.groups)
        self.tree = PrefixCacheManager(unit, disable=num_snapshots == 0)
        self.pages: dict[int, tuple] = {}  # page handle -> (block ids of each group)
        self.records: dict[int, SnapshotRecord] = {}
        self._at: dict[Hashable, list[int]] = collections.defaultdict(list)  # key -> record ids
        # (key, first tail token or None) -> record ids, in the order of ``_at``: a lookup finds the records
        # whose tail can match a query without scanning every record at its key (a root holds one per prompt).
        self._at_first: dict[tuple, list[int]] = collections.defaultdict(list)
        self._free_rows = list(range(num_snapshots - 1, -1, -1))
        self._next_handle = 1
        self._next_record = 1
        self._clock = 0
        #: ``(kind, record id, tokens, namespace)`` with kind "stored", "evicted", "dropped" (no row could be freed).
        self.events: list = []
        self.stored = self.evicted = self.dropped = self.hits = self.hit_tokens = 0
        self.row_quota: int | None = None  # snapshot records one namespace may hold

    def set_quota(self, pages: int | None, rows: int | None) -> None:
        """Cap every owner at ``pages`` tree pages and ``rows`` snapshot
        records (None: no cap, plain eviction order)."""
        self.tree.set_quota(pages)
        self.row_quota = None if rows is None else max(int(rows), 1)

    def namespace_records(self, namespace: Hashable = None) -> int:
        """Snapshot records cached under ``namespace``'s owner
        (:func:`~jaxkv.prefix.radix.owner_key`)."""
        key = owner_key(namespace)
        return sum(owner_key(r.namespace) == key for r in self.records.values())

    # ----------------------------------------------------------------- lookup

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _key(self, depth: int, handles: Sequence[int], namespace: Hashable) -> Hashable:
        return handles[depth - 1] if depth else ("root", namespace_key(namespace))

    def match(self, tokens: Sequence[int], namespace: Hashable = None) -> SnapshotHit:
        """The longest cached prefix of ``tokens`` (at most ``len - 1``
        tokens: one is left to compute) that has a record, pinned until
        :meth:`release` (a miss: ``tokens`` 0, ``record`` None, nothing
        pinned). ``branch`` is computed either way. Marks what it uses
        recently used."""
        tokens = list(tokens)
        if not self.num_snapshots or len(tokens) < 2:
            return SnapshotHit(0, tuple([] for _ in self.groups), -1, None, None, 0)
        limit = len(tokens) - 1
        found = self.tree.match(tokens, namespace, max_tokens=limit)
        handles = list(found.blocks)
        best = self._longest_record(tokens, namespace, handles)
        # Token grain: past the whole pages, the longest run shared with a child page or a record's tail there.
        # Only a tail or child page that begins with the query's next token shares any (found by key, not a scan).
        start = len(handles) * self.unit
        rest = tokens[start:limit]
        shared = []
        if rest:
            key = self._key(len(handles), handles, namespace)
            shared = [self.records[rid].tail_tokens for rid in self._at_first.get((key, rest[0]), ())]
            if found.node is not None:
                shared += [child.tokens()[: self.unit].tolist()
                           for child in self.tree.tree.children_from(found.node, rest[0]) if child.tier == DEVICE]
        branch = start + max((_common(rest, other) for other in shared), default=0)
        if best is None:
            return SnapshotHit(0, tuple([] for _ in self.groups), -1, None, None, branch)
        depth = best.depth
        node = self.tree.pin_prefix(tokens[:depth * self.unit], namespace) if depth else None
        best.pins += 1
        best.hits += 1
        best.last_used = self._tick()
        self.hits += 1
        self.hit_tokens += best.tokens
        blocks = tuple([b for h in handles[:depth] for b in self.pages[h][g]] + list(best.tail[g])
                       for g in range(len(self.groups)))
        return SnapshotHit(best.tokens, blocks, best.row, best.id, node, max(branch, best.tokens))

    def cached_length(self, tokens: Sequence[int], namespace: Hashable = None) -> int:
        """The tokens :meth:`match` would hit now, but changes nothing (no
        pin, no split, no metrics, no LRU update)."""
        tokens = list(tokens)
        if not self.num_snapshots or len(tokens) < 2:
            return 0
        best = self._longest_record(tokens, namespace, self.tree.cached_blocks(tokens[:len(tokens) - 1], namespace))
        return 0 if best is None else best.tokens

    def _longest_record(self, tokens: list, namespace: Hashable, handles: list):
        """The longest record that is a prefix of ``tokens`` (at most ``len
        - 1``), its whole pages among ``handles`` (the tree's match of
        ``tokens``), or None."""
        limit = len(tokens) - 1
        best = None
        for depth in range(len(handles), -1, -1):
            if best is not None and best.tokens >= depth * self.unit + self.unit - 1:
                break  # no record at this depth or above can be longer
            for rid in self._candidates(self._key(depth, handles, namespace), tokens, depth * self.unit):
                record = self.records[rid]
                if record.tokens <= limit and (best is None or record.tokens > best.tokens) and \
                        tuple(tokens[depth * self.unit:record.tokens]) == record.tail_tokens:
                    best = record
        return best

    def _candidates(self, key: Hashable, tokens: list, start: int) -> list[int]:
        """The ids of the records at ``key`` whose tail may be
        ``tokens[start:...]``: an empty tail, or one beginning with
        ``tokens[start]`` (in ``_at``'s order: ids ascend)."""
        empty = self._at_first.get((key, None), [])
        if start >= len(tokens):
            return empty
        first = self._at_first.get((key, tokens[start]), [])
        return sorted(empty + first) if empty and first else empty or first

    def release(self, hit: SnapshotHit | None) -> None:
        """Undo the pins of :meth:`match`'s ``hit`` (None: nothing)."""
        if hit is None or hit.record is None:
            return
        record = self.records.get(hit.record)
        if record is None or record.pins <= 0:
            raise BookkeepingError(f"release of snapshot hit {hit.record} ({hit.tokens} tokens): not pinned")
        record.pins -= 1
        self.tree.release(hit.node)

    # ----------------------------------------------------------------- store

    def empty_ops(self) -> BlockOps:
        """No device work (a :class:`BlockOps` to ``extend``)."""
        return BlockOps({name: [] for name in self.groups}, {name: [] for name in self.groups})

    def store(self, tokens: Sequence[int], row_blocks: Sequence[Sequence[int]], source: int | None, *, kind: str,
              namespace: Hashable = None, supersedes: int | None = None, given: bool = False) -> BlockOps:
        """Cache the state of a request at exactly ``len(tokens)`` tokens:
        its whole pages go into the tree (new ones with this cache's
        reference to their blocks), and unless a record with the same
        tokens exists, a record whose snapshot row takes a copy of state row
        ``source`` (the caller's request slot) and whose tail holds one more
        reference to the request's blocks past the pages. ``row_blocks[g]``:
        the request's table in group ``g`` (at least ``blocks_for(len)``
        blocks). ``supersedes``: the record the request started from (a
        turn end it continued: dropped first from now on). Returns the
        device work, increfs before releases (a row freed for this record
        may release blocks of the record it drops).

        ``given`` (a host tier bringing a record back): the caller hands
        over one reference to each of ``row_blocks[g][:blocks_for(len)]``
        and has written the state into ``source``, a free snapshot row
        (:meth:`take_row`): the references the cache keeps are not
        increfed, the others (pages it had already) come back in
        ``release``, and no copy is asked for."""
        if kind not in SNAPSHOT_KINDS:
            raise InvalidArgument(f"kind={kind!r}: one of {SNAPSHOT_KINDS}")
        ops = self.empty_ops()
        tokens = list(tokens)
        if not self.num_snapshots or not tokens:
            return ops
        need = [int(n) for n in self._blocks_for(len(tokens))]
        for g, name in enumerate(self.groups):
            if len(row_blocks[g]) < need[g] or any(int(b) < 0 for b in row_blocks[g][: need[g]]):
                raise BookkeepingError(f"store of {len(tokens)} tokens: group {name!r} needs {need[g]} blocks, the "
                                       f"request's table holds {list(row_blocks[g])[: need[g] + 2]}")
        depth = len(tokens) // self.unit
        handles = self._insert_pages(tokens[: depth * self.unit], row_blocks, namespace, ops) if depth else []
        self._trim(namespace, tokens[: depth * self.unit], ops)
        if given:
            return self._adopt_given(tokens, row_blocks, need, depth, handles, source, kind, namespace, ops)
        key = self._key(depth, handles, namespace)
        tail_tokens = tuple(tokens[depth * self.unit:])
        if supersedes is not None and supersedes in self.records:
            earlier = self.records[supersedes]
            if earlier.kind == "turn_end" and earlier.tokens < len(tokens):
                earlier.superseded = True
        for rid in self._at.get(key, ()):
            record = self.records[rid]
            if record.tail_tokens == tail_tokens:  # the same state is cached: refresh it
                record.last_used = self._tick()
                if _rank(kind) > _rank(record.kind):
                    record.kind = kind
                return ops
        row = self._free_row(ops, namespace)  # (dropping a record for its row never evicts a page)
        if row is None:
            self.dropped += 1
            self.events.append(("dropped", -1, len(tokens), namespace))
            return ops
        tail = tuple(tuple(int(b) for b in row_blocks[g][depth * self.blocks_per_page[g]: need[g]])
                     for g in range(len(self.groups)))
        for g, name in enumerate(self.groups):
            ops.incref[name] += list(tail[g])
        self._add_record(row, tokens, depth, handles, tail, kind, namespace)
        ops.copies[row] = source
        return ops

    def _add_record(self, row: int, tokens: list, depth: int, handles: list, tail: tuple, kind: str,
                    namespace: Hashable) -> SnapshotRecord:
        key = self._key(depth, handles, namespace)
        record = SnapshotRecord(self._next_record, row, len(tokens), key, depth, tuple(tokens[depth * self.unit:]),
                                tail, kind, namespace, path=tuple(handles[:depth]), prefix=tuple(tokens),
                                last_used=self._tick())
        self._next_record += 1
        self.records[record.id] = record
        self._at[key].append(record.id)
        self._at_first[key, _first(record.tail_tokens)].append(record.id)
        self.stored += 1
        self.events.append(("stored", record.id, record.tokens, record.namespace))
        return record

    def take_row(self) -> tuple[int | None, BlockOps]:
        """A free snapshot row for a record coming back from host memory
        (the retention policy drops one when none is free; None: every
        record is pinned), and the device work that dropping asks for. The
        row stays taken: give it to :meth:`store` with ``given``."""
        ops = self.empty_ops()
        return self._free_row(ops), ops

    def give_row(self, row: int) -> None:
        """Return a row :meth:`take_row` gave and the caller did not use."""
        if row in self._free_rows or any(r.row == row for r in self.records.values()):
            raise BookkeepingError(f"snapshot row {row} is not taken")
        self._free_rows.append(row)

    def adopt_pages(self, tokens: Sequence[int], row_blocks: Sequence[Sequence[int]],
                    namespace: Hashable = None) -> tuple[list, BlockOps]:
        """Put the whole pages of ``tokens`` into the tree with the caller's
        references to their blocks (``row_blocks[g]``, given as in
        :meth:`store`); no record. Returns the tree's page handles and the
        device work: the given blocks of pages the tree had come back in
        ``release``; references to the blocks past the pages stay the
        caller's."""
        ops = self.empty_ops()
        tokens = list(tokens)
        depth = len(tokens) // self.unit
        handles = self._insert_pages(tokens[: depth * self.unit], row_blocks, namespace, ops) if depth else []
        self._hand_over(row_blocks, depth, ops)
        self._trim(namespace, tokens[: depth * self.unit], ops)
        return handles, ops

    def _trim(self, namespace: Hashable, pages: list, ops: BlockOps) -> None:
        """With a page quota: evict the least recently used unpinned pages of
        ``namespace``'s owner down to it (the records keyed at them go too). The
        pages just stored (``pages``: their tokens) are pinned meanwhile: a
        store never evicts its own prefix."""
        if self.tree.quota is None or self.tree.namespace_pages(namespace) <= self.tree.quota:
            return
        node = self.tree.pin_prefix(pages, namespace) if pages else None
        try:
            self._drop_pages(self.tree.trim(namespace).blocks, ops)
        finally:
            self.tree.release(node)

    def _hand_over(self, row_blocks, depth: int, ops: BlockOps) -> None:
        """The pages' references were given: the increfs ``_insert_pages``
        asked for are dropped, and the given blocks of pages the tree
        already had are released."""
        kept = {name: collections.Counter(ops.incref[name]) for name in self.groups}
        for g, name in enumerate(self.groups):
            ops.incref[name] = []
            for block in (int(b) for b in row_blocks[g][: depth * self.blocks_per_page[g]]):
                if kept[name][block]:
                    kept[name][block] -= 1  # a new page: the given reference is the tree's
                else:
                    ops.release[name].append(block)  # the tree had the page: the given copy goes

    def _adopt_given(self, tokens, row_blocks, need, depth, handles, row, kind, namespace, ops) -> BlockOps:
        """:meth:`store` with ``given`` (after the pages went in)."""
        self._hand_over(row_blocks, depth, ops)
        key = self._key(depth, handles, namespace)
        tail_tokens = tuple(tokens[depth * self.unit:])
        tail = tuple(tuple(int(b) for b in row_blocks[g][depth * self.blocks_per_page[g]: need[g]])
                     for g in range(len(self.groups)))
        if any(self.records[rid].tail_tokens == tail_tokens for rid in self._at.get(key, ())):
            for g, name in enumerate(self.groups):  # cached meanwhile: the given tail and row go back
                ops.release[name] += list(tail[g])
            self._free_rows.append(row)
            ops.cleared.append(row)
            return ops
        self._add_record(row, tokens, depth, handles, tail, kind, namespace)
        return ops

    def _insert_pages(self, tokens: list, row_blocks, namespace: Hashable, ops: BlockOps) -> list:
        """Put ``tokens`` (whole pages) into the tree; returns the tree's
        handle of each page. New pages take a reference to their blocks."""
        pages = len(tokens) // self.unit
        handles = list(range(self._next_handle, self._next_handle + pages))
        self._next_handle += pages
        for p, h in enumerate(handles):
            self.pages[h] = tuple(tuple(int(b) for b in row_blocks[g][p * per:(p + 1) * per])
                                  for g, per in enumerate(self.blocks_per_page))
        result = self.tree.insert(tokens, handles, namespace)
        adopted = set(result.new_blocks)
        for h in handles:
            if h in adopted:
                for name, ids in zip(self.groups, self.pages[h]):
                    ops.incref[name] += list(ids)
            else:
                del self.pages[h]  # the tree had this page already
        return list(result.blocks)

    def _free_row(self, ops: BlockOps, namespace: Hashable = None) -> int | None:
        """A row for a record of ``namespace``: a free one, else a victim's.
        At its row quota the namespace's owner gives up one of its own
        records (None when all of them are pinned)."""
        if self.row_quota is not None and self.namespace_records(namespace) >= self.row_quota:
            key = owner_key(namespace)
            victim = self._victim(lambda r: owner_key(r.namespace) == key)
            if victim is None:
                return None
            self._drop_record(victim, ops)
        elif not self._free_rows:
            victim = self._victim()
            if victim is None:
                return None
            self._drop_record(victim, ops)
        return self._free_rows.pop()

    def _victim(self, among=None) -> SnapshotRecord | None:
        """The retention policy's choice among the unpinned records (of
        ``among(record)`` when given); with a quota, from the owners holding
        more records than their fair share first."""
        candidates = [r for r in self.records.values() if r.pins == 0 and (among is None or among(r))]
        if not candidates:
            return None
        if self.row_quota is not None and among is None:
            held = collections.Counter(owner_key(r.namespace) for r in self.records.values())
            share = len(self.records) / len(held)
            over = [r for r in candidates if held[owner_key(r.namespace)] > share]
            candidates = over or candidates
        if self.retention == "lru":
            return min(candidates, key=lambda r: r.last_used)
        return min(candidates, key=lambda r: (_class(r), r.last_used))

    def _drop_record(self, record: SnapshotRecord, ops: BlockOps) -> None:
        if self.spill:  # the pages are still here (an evicted page is dropped after its records)
            blocks = tuple([b for h in record.path for b in self.pages[h][g]] + list(record.tail[g])
                           for g in range(len(self.groups)))
            ops.spills.append(Spill(record.prefix, record.namespace, record.kind, blocks, record.row))
        for g, name in enumerate(self.groups):
            ops.release[name] += list(record.tail[g])
        del self.records[record.id]
        self._at[record.key].remove(record.id)
        if not self._at[record.key]:
            del self._at[record.key]
        first = (record.key, _first(record.tail_tokens))
        self._at_first[first].remove(record.id)
        if not self._at_first[first]:
            del self._at_first[first]
        self._free_rows.append(record.row)
        ops.cleared.append(record.row)
        self.evicted += 1
        self.events.append(("evicted", record.id, record.tokens, record.namespace))

    def clear(self) -> BlockOps:
        """Drop every record and page (nothing spilled), for
        ``Engine.reset_prefix_cache``; returns the device work. Raises
        ``CacheLocked`` (nothing changed) while a hit is pinned."""
        if any(r.pins for r in self.records.values()):
            raise CacheLocked(sum(r.tokens for r in self.records.values() if r.pins))
        handles = self.tree.reset()  # CacheLocked, unchanged, while a page is pinned
        ops = self.empty_ops()
        spill, self.spill = self.spill, False
        for record in list(self.records.values()):
            self._drop_record(record, ops)
        self.spill = spill
        for h in handles:
            for name, ids in zip(self.groups, self.pages.pop(h)):
                ops.release[name] += list(ids)
        return ops

    # ----------------------------------------------------------------- pressure

    @property
    def evictable(self) -> bool:
        """Whether :meth:`evict_blocks` can give anything back: an unpinned
        tree page, or an unpinned record holding tail blocks."""
        return self.tree.evictable_blocks > 0 or any(r.pins == 0 and any(r.tail) for r in self.records.values())

    def evict_blocks(self, shortfall: Sequence[int]) -> BlockOps:
        """Give back least recently used tree pages until each group has
        released ``shortfall`` references (the records keyed at an evicted
        page go with it), then, while a group is still short, records
        holding tail blocks of it (in the retention policy's order; a
        record keyed at a namespace root has no page to go with). Fewer
        when nothing more is evictable."""
        ops = self.empty_ops()
        pages = max((-(-int(n) // per) for n, per in zip(shortfall, self.blocks_per_page) if n > 0 and per),
                    default=0)
        if pages and self.tree.evictable_blocks:
            self._drop_pages(self.tree.evict(pages).blocks, ops)

        def short() -> list[int]:
            return [g for g, name in enumerate(self.groups) if len(ops.release[name]) < int(shortfall[g])]

        while short():
            groups = short()
            candidates = [r for r in self.records.values() if r.pins == 0 and any(r.tail[g] for g in groups)]
            if not candidates:
                break
            key = (lambda r: r.last_used) if self.retention == "lru" else (lambda r: (_class(r), r.last_used))
            self._drop_record(min(candidates, key=key), ops)
        return ops

    def _drop_pages(self, handles: list, ops: BlockOps) -> None:
        for h in handles:
            for rid in list(self._at.get(h, ())):
                record = self.records[rid]
                if record.pins:
                    raise BookkeepingError(f"page {h} was evicted under pinned snapshot record {rid}")
                self._drop_record(record, ops)
        for h in handles:
            for name, ids in zip(self.groups, self.pages.pop(h)):
                ops.release[name] += list(ids)

    # ----------------------------------------------------------------- reading

    def held_blocks(self) -> dict:
        """Per group, how many references the cache holds on each block id
        (pages and record tails): what the device allocator must count."""
        held = {name: collections.Counter() for name in self.groups}
        for ids in self.pages.values():
            for name, group_ids in zip(self.groups, ids):
                held[name].update(group_ids)
        for record in self.records.values():
            for name, group_ids in zip(self.groups, record.tail):
                held[name].update(group_ids)
        return held

    def usage(self) -> dict:
        """What the cache holds: ``snapshots`` (cached, free, bytes),
        per group ``blocks`` (distinct blocks referenced), ``bytes``, the
        ``tokens`` of cached pages; counters ``stored``, ``hits``,
        ``hit_tokens``, ``evicted``, ``dropped``."""
        held = self.held_blocks()
        groups = {}
        for g, name in enumerate(self.groups):
            blocks = len(held[name])
            groups[name] = {"blocks": blocks, "bytes": blocks * self.block_bytes[g]}
        return {
            "snapshots": len(self.records), "free_snapshots": len(self._free_rows),
            "snapshot_bytes": len(self.records) * self.row_bytes,
            "page_tokens": len(self.pages) * self.unit, "groups": groups,
            "kinds": dict(collections.Counter(r.kind for r in self.records.values())),
            "stored": self.stored, "hits": self.hits, "hit_tokens": self.hit_tokens, "evicted": self.evicted,
            "dropped": self.dropped,
        }

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        """Raise ``BookkeepingError`` naming the first invariant (module
        docstring) that does not hold."""
        tree_handles = set(self.tree.device_blocks())
        if tree_handles != set(self.pages):
            raise BookkeepingError(f"tree pages {sorted(tree_handles)[:8]} != page records {sorted(self.pages)[:8]}")
        rows = sorted([r.row for r in self.records.values()] + self._free_rows)
        if rows != list(range(self.num_snapshots)):
            raise BookkeepingError(f"snapshot rows of records and free rows do not partition "
                                   f"{self.num_snapshots} rows: {rows}")
        keyed = sorted(rid for ids in self._at.values() for rid in ids)
        if keyed != sorted(self.records):
            raise BookkeepingError(f"records keyed {keyed} != records {sorted(self.records)}")
        by_first = {first: ids for first, ids in self._at_first.items()}
        want = collections.defaultdict(list)
        for key, ids in self._at.items():
            for rid in ids:
                want[key, _first(self.records[rid].tail_tokens)].append(rid)
        if by_first != dict(want):
            raise BookkeepingError("the records' index by first tail token disagrees with their keys")
        for record in self.records.values():
            if not isinstance(record.key, tuple) and record.key not in self.pages:
                raise BookkeepingError(f"record {record.id} is keyed at page {record.key}, which is gone")
            if record.tokens != record.depth * self.unit + len(record.tail_tokens) or \
                    len(record.tail_tokens) >= self.unit:
                raise BookkeepingError(f"record {record.id}: {record.tokens} tokens != {record.depth} pages of "
                                       f"{self.unit} + {len(record.tail_tokens)} tail tokens")
            need = self._blocks_for(record.tokens)
            for g, name in enumerate(self.groups):
                if len(record.tail[g]) != int(need[g]) - record.depth * self.blocks_per_page[g]:
                    raise BookkeepingError(f"record {record.id}: group {name!r} tail holds {len(record.tail[g])} "
                                           f"blocks, {int(need[g])} - {record.depth} pages expected")
            if record.pins < 0:
                raise BookkeepingError(f"record {record.id} has {record.pins} pins")


def _first(tail: tuple):
    """A record's index entry: its first tail token (None: no tail)."""
    return tail[0] if tail else None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


_KIND_RANK = {"prompt_end": 0, "interval": 1, "branch": 2, "turn_end": 2}


def _rank(kind: str) -> int:
    return _KIND_RANK[kind]


def _class(record: SnapshotRecord) -> int:
    """The value policy's class (module docstring): lower goes first."""
    if record.superseded or (record.kind == "prompt_end" and not record.hits):
        return 0
    if record.hits:
        return 3
    return _rank(record.kind) if record.kind != "prompt_end" else 0
