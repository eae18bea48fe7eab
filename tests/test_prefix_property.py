"""State machines: ``PrefixScheduler`` (``verify=True``) over a small
``BlockAllocator`` against a naive reference of the prefix cache.

The reference only knows what was inserted: per namespace, the page-aligned
token sequences of every ``prefill_done``, each with the step it happened at.
The cache may since have evicted some of them, so a hit must lie between

* the longest page-aligned common prefix with a sequence inserted after the
  last eviction (those are all still cached), and
* the longest one with any inserted sequence,

both capped as the scheduler caps (below the whole prompt, at ``len - 1``).

Rules: admit batches of prompts from a small alphabet with shared bases (so
hits, partial hits and in-batch duplicates happen) under two namespaces;
admit large fresh prompts (they force evictions); prefill some waiting
requests; finish some requests; pin and release prefixes with
``pin_prefix``.

Invariants after every step: the tree's own recount
(``check_invariants``), the scheduler's host mirror (``check_mirror``),
and ownership recomputed from scratch: every tree block and every block a
request owns exclusively has exactly one reference, every other block none,
``free + tree + exclusive == capacity``, no block is both the tree's and a
request's, a running request's borrowed prefix is exactly the tree's blocks
for its tokens (so it was not evicted), and pinned prefixes stay cached.

The device machine also checks block identity: a hit hands out the very
block that the last ``prefill_done`` of that page-prefix left in the tree.
The host-tier machine runs over a real ``KVPool`` whose pages hold a
function of the token prefix that produced them, so every hit, including
pages loaded back from host memory, must read back exactly that.
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jaxkv.alloc.block import BlockAllocator
from jaxkv.pool.host import create_host_pool
from jaxkv.pool.kv_pool import KVPool
from jaxkv.prefix.block_cache import BlockRemoved, BlockStored, PrefixCacheManager
from jaxkv.prefix.radix import DEVICE, token_bytes
from jaxkv.prefix.scheduler import PrefixScheduler

PS = 2
NUM_BLOCKS = 32  # the same allocator shape as test_prefix_cache.py: one compile of the scheduler step
CAPACITY = NUM_BLOCKS - 1
PAD = 32  # pages per K/V write/read call (one compile each)
NAMESPACES = (None, "b")
MAX_LIVE = 5

BASES = ((1, 2, 1, 3, 2, 2, 1, 3), (1, 2, 3, 3, 1, 1, 2, 2), (2, 2, 1, 1, 3, 3, 1, 2))
prompts = st.builds(
    lambda base, cut, tail: (BASES[base][:cut] + tuple(tail)) or (1,),
    st.integers(0, len(BASES) - 1),
    st.integers(0, len(BASES[0])),
    st.lists(st.integers(1, 3), max_size=5),
)
namespaces = st.sampled_from(NAMESPACES)


def pages(n_tokens: int) -> int:
    return -(-n_tokens // PS)


def common_pages(a: tuple, b: tuple) -> int:
    n = 0
    while (n + 1) * PS <= min(len(a), len(b)) and a[n * PS : (n + 1) * PS] == b[n * PS : (n + 1) * PS]:
        n += 1
    return n


def token_value(namespace, prefix: tuple) -> float:
    """The K value at the last position of ``prefix`` (V is its negation):
    a function of the whole prefix and the namespace, exact in float32."""
    return float(zlib.crc32(repr((namespace, prefix)).encode()) % 1_000_003 + 1)


def expected_pages(namespace, tokens: tuple, start: int, stop: int) -> np.ndarray:
    """K of pages ``[start, stop)`` of ``tokens`` ([pages, PS]; positions past the end 0)."""
    out = np.zeros((stop - start, PS), np.float32)
    for page in range(start, stop):
        for offset in range(PS):
            t = page * PS + offset
            if t < len(tokens):
                out[page - start, offset] = token_value(namespace, tokens[: t + 1])
    return out


def _write_k(pool: KVPool, targets, k):
    k = k[None, None, :, :, None]
    return pool.write_pages(targets, KVPool.from_arrays(k, -k))[0]


WRITE_K = jax.jit(_write_k, donate_argnums=0)
READ = jax.jit(lambda pool, pages: pool.read_pages(pages)[0])


def tree_blocks(cache: PrefixCacheManager, tokens: bytes, namespace) -> list:
    """The device blocks the tree holds for the cached page-aligned prefix of
    ``tokens`` (read-only walk: no split, no LRU update)."""
    path, matched = cache.tree.walk(tokens, namespace, split=False)
    blocks = []
    for node in path:
        blocks += node.value if node.tier == DEVICE else [None] * len(node.value)
    return blocks[: matched // (4 * PS)]


class PrefixMachine(RuleBasedStateMachine):
    HOST_PAGES = 0

    def __init__(self):
        super().__init__()
        self.cache = PrefixCacheManager(PS, host_pages=self.HOST_PAGES, enable_events=True)
        self.held = set()  # (namespace, device block) by replaying the events
        if self.HOST_PAGES:
            self.pool = KVPool.create(num_pages=NUM_BLOCKS, page_size=PS, num_layers=1, k_heads=1, k_dim=1,
                                      dtype=jnp.float32)
            host_pool = create_host_pool(self.pool, self.HOST_PAGES, memory_kind="numpy")
            self.sched = PrefixScheduler(self.cache, BlockAllocator.create(NUM_BLOCKS), pool=self.pool,
                                         host_pool=host_pool, verify=True)
        else:
            self.sched = PrefixScheduler(self.cache, BlockAllocator.create(NUM_BLOCKS), verify=True)
        self.step = 0
        self.last_eviction = -1  # step of the last eviction seen
        self.inserted: dict = {ns: [] for ns in NAMESPACES}  # ns -> [(page-aligned tokens, step)]
        self.page_block: dict = {}  # (ns, tokens through a page) -> block the last insert left there
        self.waiting: list = []  # admitted, not prefilled: (admission, tokens)
        self.running: list = []  # prefilled: (admission, tokens)
        self.pins: list = []  # (node, tokens, namespace, the tree's blocks when pinned; None: on host)
        self.fresh = 100  # next token id of a "big" prompt (never shared)

    # ------------------------------------------------------------ reference

    def bounds(self, tokens: tuple, namespace) -> tuple[int, int]:
        cap = (len(tokens) - 1) // PS
        low = high = 0
        for seq, step in self.inserted[namespace]:
            n = min(common_pages(tokens, seq), cap)
            high = max(high, n)
            if step > self.last_eviction:
                low = max(low, n)
        return low * PS, high * PS

    # ---------------------------------------------------------------- rules

    def _admit(self, batch: list, names: list) -> None:
        self.step += 1
        expected = [self.bounds(tokens, ns) for tokens, ns in zip(batch, names)]
        free_before = self.sched.num_free
        before = self.cache.stats()
        results = self.sched.admit([list(t) for t in batch], names)
        after = self.cache.stats()
        if after.evictions != before.evictions:
            self.last_eviction = self.step
            event("eviction")
        if after.offloaded_tokens != before.offloaded_tokens:
            event("offload to host")
        if after.host_hit_tokens != before.host_hit_tokens:
            event("host hit" + (" in a batch" if len(batch) > 1 else ""))
        assert len(results) == len(batch)
        admitted = [r for r in results if r is not None]
        assert results[: len(admitted)] == admitted, "refusals must follow arrival order"
        if sum(pages(len(t)) for t in batch) <= free_before:
            assert len(admitted) == len(batch), "refused although every page was free"
        if len(admitted) < len(batch):
            event("refused")
        for adm, tokens, ns, (low, high) in zip(admitted, batch, names, expected):
            assert adm.tokens == token_bytes(list(tokens)) and adm.namespace == ns
            assert low <= adm.num_cached_tokens <= high, (tokens, ns, adm.num_cached_tokens, low, high)
            assert adm.num_cached_tokens % PS == 0
            hit = adm.num_cached_tokens // PS
            assert len(adm.blocks) == pages(len(tokens)), (tokens, adm)
            assert adm.num_exclusive == len(adm.blocks) - hit
            if hit:
                event("hit")
            if not self.HOST_PAGES:  # a hit hands out the blocks that the tree got for those pages
                for page in range(hit):
                    assert adm.blocks[page] == self.page_block[(ns, tokens[: (page + 1) * PS])], (tokens, page)
            self.waiting.append((adm, tokens))
        if self.HOST_PAGES:
            self._prefill_data(admitted, batch[: len(admitted)], names[: len(admitted)])
        return results

    def _prefill_data(self, admitted, batch, names) -> None:
        """Check the K/V of every hit, then write the pages each request
        computes (its fresh ones)."""
        for adm, tokens, ns in zip(admitted, batch, names):
            hit = adm.num_cached_tokens // PS
            if hit:
                ids = np.zeros(PAD, np.int32)
                ids[:hit] = adm.blocks[:hit]
                k = np.asarray(READ(self.sched.pool, ids).k_pages)[0, 0, :hit, :, 0]
                np.testing.assert_array_equal(k, expected_pages(ns, tokens, 0, hit), err_msg=str((tokens, ns)))
            n = len(adm.blocks) - hit
            targets = np.full(PAD, -1, np.int32)
            targets[:n] = adm.blocks[hit:]
            k = np.zeros((PAD, PS), np.float32)
            k[:n] = expected_pages(ns, tokens, hit, len(adm.blocks))
            self.sched.pool = WRITE_K(self.sched.pool, targets, k)

    @initialize(batch=st.lists(st.tuples(prompts, namespaces), min_size=1, max_size=3))
    def first_batch(self, batch):
        self._admit([tokens for tokens, _ in batch], [ns for _, ns in batch])

    @precondition(lambda self: len(self.waiting) + len(self.running) < MAX_LIVE)
    @rule(batch=st.lists(st.tuples(prompts, namespaces), min_size=1, max_size=3))
    def admit(self, batch):
        self._admit([tokens for tokens, _ in batch], [ns for _, ns in batch])

    @precondition(lambda self: len(self.waiting) + len(self.running) < MAX_LIVE
                  and any(self.inserted.values()))
    @rule(data=st.data())
    def readmit(self, data):
        """A batch of prompts that cut and extend one sequence inserted
        earlier: hits of different lengths on the same path (unless it was
        evicted since), partial-page tails, in-batch duplicates."""
        ns = data.draw(st.sampled_from([ns for ns in NAMESPACES if self.inserted[ns]]))
        older = [item for item in self.inserted[ns] if item[1] < self.last_eviction]
        if older and data.draw(st.booleans()):  # maybe (partly) evicted: on host or gone
            seq, _ = data.draw(st.sampled_from(older))
        else:
            seq, _ = data.draw(st.sampled_from(self.inserted[ns]))
        batch = [
            seq[: data.draw(st.integers(1, len(seq)))] + tuple(data.draw(st.lists(st.integers(1, 3), max_size=3)))
            for _ in range(data.draw(st.integers(2, 3)))
        ]
        self._admit(batch, [ns] * len(batch))

    @precondition(lambda self: self.cache.evictable_blocks > 0)
    @rule(data=st.data(), namespace=namespaces)
    def pressure(self, data, namespace):
        """A prompt that needs every free block and some of the tree's (it is
        admitted and finished at once, never inserted): the tree evicts."""
        extra = data.draw(st.integers(1, min(4, self.cache.evictable_blocks)))
        num_pages = min(self.sched.num_free + extra, CAPACITY)
        tokens = tuple(range(self.fresh, self.fresh + num_pages * PS))
        self.fresh += num_pages * PS
        [adm] = self._admit([tokens], [namespace])
        assert adm is not None, "refused although the tree could make room"
        assert self.waiting[-1][0] is adm
        self.waiting.pop()
        self.sched.finish([adm])

    @precondition(lambda self: len(self.waiting) + len(self.running) < MAX_LIVE)
    @rule(num_pages=st.integers(4, 16), namespace=namespaces, shared=st.integers(0, len(BASES) - 1))
    def admit_big(self, num_pages, namespace, shared):
        """A long prompt (a shared base, then fresh tokens): it needs room."""
        tokens = BASES[shared][: 2 * PS] + tuple(range(self.fresh, self.fresh + num_pages * PS - 2 * PS + 1))
        self.fresh += num_pages * PS + 1
        self._admit([tokens], [namespace])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def prefill_done(self, data):
        self.step += 1
        chosen = data.draw(st.lists(st.sampled_from(range(len(self.waiting))), min_size=1, unique=True))
        batch = [self.waiting[i] for i in chosen]
        self.waiting = [item for i, item in enumerate(self.waiting) if i not in chosen]
        self.sched.prefill_done([adm for adm, _ in batch])
        for adm, tokens in batch:
            whole = len(tokens) // PS
            assert adm.num_exclusive == len(adm.blocks) - whole
            if whole:
                self.inserted[adm.namespace].append((tokens[: whole * PS], self.step))
            for page in range(whole):
                self.page_block[(adm.namespace, tokens[: (page + 1) * PS])] = adm.blocks[page]
            self.running.append((adm, tokens))

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.step += 1
        live = self.waiting + self.running
        chosen = data.draw(st.lists(st.sampled_from(range(len(live))), min_size=1, unique=True))
        self.sched.finish([live[i][0] for i in chosen])
        done = {id(live[i][0]) for i in chosen}
        self.waiting = [item for item in self.waiting if id(item[0]) not in done]
        self.running = [item for item in self.running if id(item[0]) not in done]

    @precondition(lambda self: len(self.pins) < 3 and any(self.inserted.values()))
    @rule(data=st.data())
    def pin(self, data):
        """Pin a cut of an inserted sequence (a system prompt); it may be
        partly evicted, partly on host, or gone."""
        self.step += 1
        namespace = data.draw(st.sampled_from([ns for ns in NAMESPACES if self.inserted[ns]]))
        seq, _ = data.draw(st.sampled_from(self.inserted[namespace]))
        tokens = seq[: data.draw(st.integers(1, len(seq)))]
        cached = self.cache.cached_length(list(tokens), namespace)
        node = self.cache.pin_prefix(list(tokens), namespace)
        assert (node is None) == (cached == 0)
        if node is not None:
            assert node.lock >= 1 and len(node.path_tokens()) == cached
            blocks = tree_blocks(self.cache, token_bytes(list(tokens)), namespace)
            self.pins.append((node, tokens, namespace, blocks))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def release(self, data):
        self.step += 1
        node, *_ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.cache.release(node)

    # ----------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        cache, sched = self.cache, self.sched
        cache.check_invariants()
        sched.check_mirror()
        counts = np.asarray(sched.allocator.ref_counts)
        tree = cache.device_blocks()
        assert len(tree) == len(set(tree)), "a block held twice by the tree"
        exclusive = []
        for adm, tokens in self.waiting + self.running:
            assert len(adm.blocks) == pages(len(tokens))
            split = len(adm.blocks) - adm.num_exclusive
            exclusive += adm.blocks[split:]
            # The borrowed prefix is the tree's, still on device, pinned.
            assert adm.blocks[:split] == tree_blocks(cache, adm.tokens, adm.namespace)[:split], (tokens, adm)
            if split:
                assert adm.node is not None and adm.node.lock >= 1 and adm.node.parent is not None
        assert len(exclusive) == len(set(exclusive)), "a block owned by two requests"
        assert not set(exclusive) & set(tree), "a block owned by a request and by the tree"
        expected = np.zeros(NUM_BLOCKS, np.int32)
        expected[tree] = 1
        expected[exclusive] = 1
        np.testing.assert_array_equal(counts, expected)
        assert int(sched.allocator.num_free) + len(tree) + len(exclusive) == CAPACITY
        for node, tokens, namespace, pinned in self.pins:
            assert node.lock >= 1
            now = tree_blocks(cache, token_bytes(list(tokens)), namespace)
            assert len(now) >= len(pinned), "a pinned prefix was evicted"
            # A pinned page stays where it was (a host page may have been loaded since).
            assert all(b is None or b == c for b, c in zip(pinned, now)), ("a pinned page moved", pinned, now)
        self.replay_events()

    def replay_events(self):
        """BlockStored/BlockRemoved of the device medium, replayed, give the
        device blocks of the tree (the host medium's events are checked by
        test_event_replay_matches_the_tree_with_a_host_tier)."""
        for item in self.cache.take_events():
            assert isinstance(item, (BlockStored, BlockRemoved)), item
            assert len(item.tokens) == PS * len(item.block_ids) and item.block_ids
            if item.medium != "device":
                continue
            ids = {(item.namespace, block) for block in item.block_ids}
            if isinstance(item, BlockStored):
                assert not ids & self.held, ("stored twice", item)
                self.held |= ids
            else:
                assert ids <= self.held, ("removed but not stored", item)
                self.held -= ids
        tree = {(node.namespace, block) for node in self.cache.tree.nodes() if node.tier == DEVICE
                for block in node.value}
        assert self.held == tree

    def teardown(self):
        live = [adm for adm, _ in self.waiting + self.running]
        if live:
            self.sched.finish(live)
        for node, *_ in self.pins:
            self.cache.release(node)
        self.waiting, self.running, self.pins = [], [], []
        self.consistent()
        stats = self.cache.stats()
        assert stats.protected_tokens == 0
        assert int(self.sched.allocator.num_free) == CAPACITY - len(self.cache.device_blocks())


class HostTierMachine(PrefixMachine):
    HOST_PAGES = 12


TestPrefixScheduler = PrefixMachine.TestCase
TestPrefixSchedulerHostTier = HostTierMachine.TestCase
# Shrinking a failing run of this machine replays thousands of step sequences
# with device calls and host copies (minutes on 2 cores): the ci profile
# reports the failing sequence unshrunk; the long profile shrinks it.
if os.environ.get("JAXKV_HYPOTHESIS", "ci") == "ci":
    TestPrefixSchedulerHostTier.settings = settings(
        TestPrefixSchedulerHostTier.settings,
        phases=[phase for phase in TestPrefixSchedulerHostTier.settings.phases if phase != Phase.shrink],
    )
