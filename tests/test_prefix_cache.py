"""Paged prefix cache (seed 001): ``PrefixCacheManager`` alone and driven by
``PrefixScheduler`` over a real ``BlockAllocator``.

The scenarios re-express the peers' own unit tests against this API
(SGLang ``test_radix_cache``, vLLM ``test_prefix_caching``), each checked
against expectations worked out by hand from the scenario, never copied
from a run:

* insert then match returns the inserted ids for every prefix (page sizes
  1, 2, 4, 16; non-aligned lengths round down; ``max_tokens`` caps); a
  second sequence sharing a prefix gets the first one's ids back as
  duplicates/replacements;
* partial pages are never stored; a disabled cache never hits; namespaces
  are disjoint;
* pin/release move exact sizes between evictable and protected; pinned
  nodes survive eviction; a release that is not backed by a pin raises and
  changes nothing;
* eviction: least-recently-used leaves first, a chain from its end, and the
  ids come back to the allocator (free count, tree size);
* scheduler lifecycles: a hit after finish reuses the tree's blocks (capped
  at ``len - 1``), duplicates in one batch, refusal in arrival order with
  nothing changed, reset, events and hit-rate metrics;
* host tier on a real ``KVPool`` (numpy and "auto" host pools): pages go to
  host on eviction and come back bit-exact into fresh blocks, the host tier
  drops its LRU leaves when full and keeps chains tail-first.

Every scheduler uses an allocator of ``NUM_BLOCKS`` blocks and prompts well
under 64 pages, so the scheduler's jitted step compiles once per process.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import InvalidArgument
from jaxkv.pool.host import create_host_pool
from jaxkv.pool.kv_pool import KVPool
from jaxkv.prefix.block_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheLocked,
    PrefixCacheManager,
)
from jaxkv.prefix.radix import HOST
from jaxkv.prefix.scheduler import PrefixScheduler
from jaxkv.prefix.slot_cache import SlotPrefixCacheManager

NUM_BLOCKS = 32  # one allocator shape for every scheduler test: 31 usable blocks
CAPACITY = NUM_BLOCKS - 1


# ---------------------------------------------------------------------- helpers


def make_scheduler(page_size: int, **cache_kwargs) -> tuple[PrefixCacheManager, PrefixScheduler]:
    cache = PrefixCacheManager(page_size, **cache_kwargs)
    return cache, PrefixScheduler(cache, BlockAllocator.create(NUM_BLOCKS), verify=True)


def check(cache: PrefixCacheManager, sched: PrefixScheduler | None = None) -> None:
    """The consistency checks run after every step."""
    cache.check_invariants()
    if sched is not None:
        sched.check_mirror()


def num_free(sched: PrefixScheduler) -> int:
    return int(sched.allocator.num_free)


def snapshot(allocator: BlockAllocator) -> BlockAllocator:
    """A host copy (the scheduler donates the device state to its next call)."""
    return jax.tree_util.tree_map(lambda a: np.array(a, copy=True), allocator)


def ref_counts(sched: PrefixScheduler) -> np.ndarray:
    return np.asarray(sched.allocator.ref_counts).copy()


def seq(start: int, n: int) -> list[int]:
    """``n`` distinct tokens from ``start``: sequences built from disjoint
    ranges share nothing."""
    return list(range(start, start + n))


def locks(cache: PrefixCacheManager) -> dict:
    """The lock count of every cached page, keyed by (namespace, tokens up to
    the end of that page): unchanged by a split, which only cuts a node in two."""
    ps = cache.page_size
    profile = {}
    for node in cache.tree.nodes():
        path = node.path_tokens()
        for end in range(len(path) - len(node.key) // 4 + ps, len(path) + 1, ps):
            profile[(node.namespace, path[:end].tobytes())] = node.lock
    return profile


def pages_of(tokens, page_size: int) -> int:
    return -(-len(tokens) // page_size)


# ------------------------------------------------------------- match / insert


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_insert_then_match_returns_inserted_ids_for_any_prefix(page_size):
    num_pages = 5
    rng = np.random.default_rng(page_size)
    tokens = rng.integers(0, 50, num_pages * page_size + page_size // 2).tolist()
    ids = [100 + 7 * i for i in range(num_pages + 1)]  # one id more than whole pages: ignored
    cache = PrefixCacheManager(page_size)
    result = cache.insert(tokens, ids)
    assert result.blocks == ids[:num_pages] and result.new_blocks == ids[:num_pages]
    assert result.duplicates == [] and result.replacements == []
    check(cache)
    for length in range(len(tokens) + 1):
        whole = min(length // page_size, num_pages)
        for query in (tokens[:length], tokens[:length] + [1000]):  # 1000 never appears in tokens
            assert cache.cached_length(query) == whole * page_size
            assert cache.cached_blocks(query) == ids[:whole]  # before match splits the node: changes nothing
            match = cache.match(query)
            assert match.num_tokens == whole * page_size, (length, query)
            assert match.blocks == ids[:whole]
            assert match.host_nodes == []
            check(cache)
        for cap in range(length + 1):  # max_tokens caps the hit, rounding down to a page
            assert cache.match(tokens[:length], max_tokens=cap).num_tokens == min(cap // page_size, whole) * page_size
    # Every match split a node at its end, but the tree still holds one chain of the same pages.
    stats = cache.stats()
    assert stats.evictable_tokens == num_pages * page_size and stats.protected_tokens == 0
    assert 1 <= stats.num_nodes <= num_pages
    assert sorted(cache.device_blocks()) == sorted(ids[:num_pages])
    check(cache)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_second_sequence_sharing_a_prefix_gets_the_cached_ids(page_size):
    shared, own_a, own_b = 2, 2, 3  # pages
    a = seq(1, (shared + own_a) * page_size)
    b = a[: shared * page_size] + seq(500, own_b * page_size)
    ids_a = [10 + i for i in range(shared + own_a)]
    ids_b = [40 + i for i in range(shared + own_b)]
    cache = PrefixCacheManager(page_size)
    cache.insert(a, ids_a)
    result = cache.insert(b, ids_b)
    assert result.blocks == ids_a[:shared] + ids_b[shared:]
    assert result.new_blocks == ids_b[shared:]
    assert result.duplicates == ids_b[:shared]
    assert result.replacements == ids_a[:shared]
    check(cache)
    assert cache.match(a).blocks == ids_a
    assert cache.match(b).blocks == ids_a[:shared] + ids_b[shared:]
    # Re-inserting a cached sequence with the tree's own ids changes nothing.
    again = cache.insert(a, ids_a)
    assert again.blocks == ids_a and again.new_blocks == [] and again.duplicates == []
    assert cache.stats().evictable_tokens == (shared + own_a + own_b) * page_size
    assert cache.stats().num_nodes == 3  # shared part, a's tail, b's tail
    check(cache)


def test_partial_page_is_never_stored_or_shared():
    ps = 4
    cache = PrefixCacheManager(ps)
    tokens = seq(1, 7)  # one whole page and 3 tokens
    result = cache.insert(tokens, [5, 6])
    assert result.blocks == [5] and result.new_blocks == [5]  # block 6 (the partial page) stays the caller's
    assert sorted(cache.device_blocks()) == [5]
    assert cache.stats().evictable_tokens == 4
    assert cache.match(tokens).num_tokens == 4
    assert cache.match(tokens[:7] + [99]).num_tokens == 4  # its second page was never stored
    # A sequence shorter than a page stores nothing.
    nodes = cache.stats().num_nodes
    short = cache.insert(seq(50, 3), [9])
    assert short.blocks == [] and short.new_blocks == [] and short.node is None
    assert cache.stats().num_nodes == nodes and cache.match(seq(50, 3)).num_tokens == 0
    # A sequence diverging inside the second page shares only the first.
    other = tokens[:6] + [77, 78]
    result = cache.insert(other, [7, 8])
    assert result.blocks == [5, 8] and result.duplicates == [7] and result.replacements == [5]
    with pytest.raises(InvalidArgument):  # two whole pages need two ids
        cache.insert(seq(200, 8), [11])
    with pytest.raises(InvalidArgument):  # 0 is the null block
        cache.insert(seq(200, 4), [0])
    check(cache)


def test_scheduler_partial_page_stays_with_the_request():
    ps = 4
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 10)  # 2 whole pages + 2 tokens
    [adm] = sched.admit([prompt])
    assert len(adm.blocks) == 3 and adm.num_exclusive == 3
    sched.prefill_done([adm])
    assert adm.num_exclusive == 1  # the partial page is the request's, not the tree's
    assert sorted(cache.device_blocks()) == sorted(adm.blocks[:2])
    check(cache, sched)
    tail = adm.blocks[2]
    sched.finish([adm])
    assert ref_counts(sched)[tail] == 0
    assert num_free(sched) == CAPACITY - 2
    check(cache, sched)


# ------------------------------------------------------------ disable / namespaces


def test_disabled_cache_never_hits_and_stores_nothing():
    cache = PrefixCacheManager(2, disable=True)
    tokens = seq(1, 8)
    result = cache.insert(tokens, [1, 2, 3, 4])
    assert result.blocks == [] and result.new_blocks == [] and result.node is None
    match = cache.match(tokens)
    assert match.num_tokens == 0 and match.blocks == [] and match.node is None
    assert cache.cached_length(tokens) == 0
    stats = cache.stats()
    assert stats.num_nodes == 0 and stats.evictable_tokens == 0 and stats.hit_tokens == 0
    assert cache.device_blocks() == []
    check(cache)


def test_disabled_cache_through_the_scheduler():
    cache, sched = make_scheduler(2, disable=True)
    prompt = seq(1, 9)  # 5 pages
    for _ in range(2):
        [adm] = sched.admit([prompt])
        assert adm.num_cached_tokens == 0 and adm.num_exclusive == 5
        sched.prefill_done([adm])
        assert adm.num_exclusive == 5  # nothing went to the tree
        assert num_free(sched) == CAPACITY - 5
        sched.finish([adm])
        assert num_free(sched) == CAPACITY
        check(cache, sched)
    assert cache.stats().hit_tokens == 0 and cache.stats().num_nodes == 0


def test_namespaces_are_disjoint():
    ps = 2
    cache = PrefixCacheManager(ps)
    tokens = seq(1, 6)
    cache.insert(tokens, [1, 2, 3], namespace="a")
    assert cache.match(tokens, namespace="b").num_tokens == 0
    assert cache.match(tokens).num_tokens == 0  # the default namespace is another one
    assert cache.cached_length(tokens, namespace="b") == 0
    result = cache.insert(tokens, [4, 5, 6], namespace="b")
    assert result.new_blocks == [4, 5, 6] and result.duplicates == []  # no sharing across namespaces
    assert cache.match(tokens, namespace="a").blocks == [1, 2, 3]
    assert cache.match(tokens, namespace="b").blocks == [4, 5, 6]
    stats = cache.stats()
    assert stats.evictable_tokens == 12 and stats.num_nodes == 2  # each namespace counts its own copy
    assert sorted(cache.device_blocks()) == [1, 2, 3, 4, 5, 6]
    check(cache)


def test_namespaces_through_the_scheduler():
    ps = 2
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 7)  # 3 whole pages + 1 token
    first = sched.admit([prompt, prompt], namespaces=["a", "b"])
    assert [adm.num_cached_tokens for adm in first] == [0, 0]
    sched.prefill_done(first)
    # Same tokens, different namespaces: no duplicates, each namespace keeps its pages.
    assert [adm.num_exclusive for adm in first] == [1, 1]
    assert num_free(sched) == CAPACITY - 8
    tree_a, tree_b = list(first[0].blocks[:3]), list(first[1].blocks[:3])
    assert not set(tree_a) & set(tree_b)
    sched.finish(first)
    check(cache, sched)
    second = sched.admit([prompt, prompt, prompt], namespaces=["b", "a", "c"])
    assert [adm.num_cached_tokens for adm in second] == [6, 6, 0]
    assert second[0].blocks[:3] == tree_b and second[1].blocks[:3] == tree_a
    assert not set(second[2].blocks) & set(tree_a + tree_b)
    assert cache.stats().evictable_tokens + cache.stats().protected_tokens == 12
    sched.finish(second)
    check(cache, sched)


# ------------------------------------------------------------------ pin / release


def _two_branches(ps: int):
    """A tree of three nodes: ``shared`` (1 page) -> ``a_tail`` (2 pages) and
    ``b_tail`` (2 pages)."""
    cache = PrefixCacheManager(ps)
    a = seq(1, 3 * ps)
    b = a[:ps] + seq(100, 2 * ps)
    cache.insert(a, [1, 2, 3])
    cache.insert(b, [1, 4, 5])
    return cache, a, b


def test_pin_and_release_move_exact_sizes():
    ps = 2
    cache, a, b = _two_branches(ps)
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (10, 0)
    node_a = cache.match(a).node
    node_b = cache.match(b).node
    shared = node_a.parent
    assert shared is node_b.parent and shared.parent is cache.tree.root(None)
    cache.pin(node_a)
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (4, 6)
    assert (shared.lock, node_a.lock, node_b.lock) == (1, 1, 0)
    cache.pin(node_a)  # a second holder: sizes unchanged, counts up
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (4, 6)
    assert (shared.lock, node_a.lock) == (2, 2)
    cache.pin(node_b)
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (0, 10)
    assert (shared.lock, node_a.lock, node_b.lock) == (3, 2, 1)
    check(cache)
    assert cache.evict(5).blocks == []  # everything is pinned
    cache.release(node_a)
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (0, 10)
    cache.release(node_a)
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (4, 6)
    assert (shared.lock, node_a.lock, node_b.lock) == (1, 0, 1)
    check(cache)
    evicted = cache.evict(100)  # only a's tail is unpinned
    assert sorted(evicted.blocks) == [2, 3]
    assert cache.cached_length(a) == ps and cache.cached_length(b) == 3 * ps
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (0, 6)
    cache.release(node_b)
    assert (cache.stats().evictable_tokens, cache.stats().protected_tokens) == (6, 0)
    check(cache)


def test_release_of_an_unpinned_node_raises_and_changes_nothing():
    ps = 2
    cache, a, _ = _two_branches(ps)
    node_a = cache.match(a).node
    before = (cache.stats(), locks(cache))
    with pytest.raises(InvalidArgument):
        cache.release(node_a)
    assert (cache.stats(), locks(cache)) == before
    cache.pin(node_a)
    cache.release(node_a)
    with pytest.raises(InvalidArgument):  # one pin, one release: a second release is not backed
        cache.release(node_a)
    assert (cache.stats(), locks(cache)) == before
    cache.release(None)  # a disabled cache's match: ignored
    check(cache)


def test_release_not_backed_by_a_pin_raises_while_a_descendant_is_pinned():
    """``release(node)`` must be backed by a ``pin(node)``, whatever is pinned
    below the node. Here the shared node is pinned once and released twice
    while ``a``'s tail (below it) is pinned by someone else: the second
    release is unbacked and must raise, changing nothing; likewise a release
    of the shared node that was never pinned at all. (Accepting it leaves the
    shared node with fewer holders than its pinned child, and the child's own,
    legitimate ``release`` then raises: its pin can never be undone.)"""
    ps = 2
    cache, a, _ = _two_branches(ps)
    node_a = cache.match(a).node
    shared = node_a.parent
    cache.pin(node_a)  # another request's pin
    cache.pin(shared)
    cache.release(shared)
    before = (cache.stats(), locks(cache))
    with pytest.raises(InvalidArgument):
        cache.release(shared)  # a double release
    assert (cache.stats(), locks(cache)) == before
    check(cache)
    cache.release(node_a)  # the other request's release still works
    assert cache.stats().protected_tokens == 0
    check(cache)


def test_pinned_prefix_is_never_evicted():
    ps = 2
    cache = PrefixCacheManager(ps)
    system = seq(1, 4 * ps)
    cache.insert(system, [1, 2, 3, 4])
    cache.insert(seq(100, 2 * ps), [5, 6])
    node = cache.pin_prefix(system[: 3 * ps] + [999])  # pins the 3 cached whole pages of the query
    assert cache.stats().protected_tokens == 3 * ps
    evicted = cache.evict(100)
    assert sorted(evicted.blocks) == [4, 5, 6]
    assert cache.cached_length(system) == 3 * ps and cache.match(system).blocks == [1, 2, 3]
    check(cache)
    cache.release(node)
    assert sorted(cache.evict(100).blocks) == [1, 2, 3]
    assert cache.stats().num_nodes == 0
    check(cache)


# ----------------------------------------------------------------------- eviction


def test_evict_takes_least_recently_used_leaves_first():
    ps = 2
    cache = PrefixCacheManager(ps)
    a, b, c = seq(1, 4), seq(100, 4), seq(200, 4)
    cache.insert(a, [1, 2])
    cache.insert(b, [3, 4])
    cache.insert(c, [5, 6])
    cache.match(a)  # recency, oldest first: b, c, a
    cache.match(c[:2])
    cache.match(a[:2])
    assert cache.evict(2).blocks == [3, 4]  # b, the least recently used leaf, all of it
    assert cache.evict(1).blocks == [6]  # then c, tail first
    assert cache.cached_length(c) == 2
    cache.match(c)  # c's head is now the most recent: a goes next
    evicted = cache.evict(2)
    assert evicted.blocks == [2, 1]  # a's whole chain, from its end
    assert cache.cached_length(a) == 0 and cache.cached_length(c) == 2
    assert cache.stats().evictions == 4 and cache.stats().evicted_tokens == 10
    check(cache)


def test_evict_cuts_a_chain_from_its_end():
    ps = 4
    ids = list(range(1, 7))
    tokens = seq(1, 6 * ps)
    cache = PrefixCacheManager(ps)
    cache.insert(tokens[: 3 * ps], ids[:3])
    cache.insert(tokens, ids)  # two nodes: pages 0-2 and 3-5
    for k in range(1, 7):
        assert cache.evict(1).blocks == [ids[6 - k]]
        assert cache.cached_length(tokens) == (6 - k) * ps
        assert cache.match(tokens).blocks == ids[: 6 - k]
        check(cache)
    assert cache.evict(1).blocks == [] and cache.stats().num_nodes == 0

    cache = PrefixCacheManager(ps)
    cache.insert(tokens[: 3 * ps], ids[:3])
    cache.insert(tokens, ids)
    evicted = cache.evict(4)  # the whole lower node, then the tail page of the upper one
    assert sorted(evicted.blocks) == [3, 4, 5, 6]
    assert cache.match(tokens).blocks == [1, 2]
    assert cache.stats().evictable_tokens == 2 * ps
    check(cache)


def test_evict_frees_through_the_allocator():
    ps = 2
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 4 * ps + 1)  # 4 whole pages + 1 token
    [adm] = sched.admit([prompt])
    sched.prefill_done([adm])
    tree_blocks = adm.blocks[:4]
    sched.finish([adm])
    assert num_free(sched) == CAPACITY - 4
    assert cache.stats().num_nodes == 1 and cache.stats().evictable_tokens == 4 * ps
    check(cache, sched)
    # A request that needs 2 blocks more than are free: the tree gives up
    # exactly the 2 tail pages of the chain, whose ids come back and are reused.
    big = seq(1000, (CAPACITY - 4 + 2) * ps)
    [other] = sched.admit([big])
    assert other is not None and other.num_cached_tokens == 0
    assert num_free(sched) == 0
    assert set(tree_blocks[2:]) <= set(other.blocks)
    assert cache.cached_length(prompt) == 2 * ps
    assert sorted(cache.device_blocks()) == sorted(tree_blocks[:2])
    stats = cache.stats()
    assert stats.evicted_tokens == 2 * ps and stats.evictable_tokens == 2 * ps and stats.num_nodes == 1
    check(cache, sched)
    sched.finish([other])
    assert num_free(sched) == CAPACITY - 2
    counts = ref_counts(sched)
    assert all(counts[b] == 1 for b in tree_blocks[:2]) and counts.sum() == 2
    check(cache, sched)


# ------------------------------------------------------------ scheduler lifecycles


def test_hit_after_finish_reuses_the_same_blocks():
    ps = 4
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 2 * ps + 2)  # 2 whole pages + 2 tokens
    [first] = sched.admit([prompt])
    assert first.num_cached_tokens == 0 and len(first.blocks) == 3
    sched.prefill_done([first])
    tree_blocks = list(first.blocks[:2])
    sched.finish([first])
    check(cache, sched)
    [second] = sched.admit([prompt])
    assert second.num_cached_tokens == 2 * ps
    assert second.blocks[:2] == tree_blocks
    assert second.num_exclusive == 1 and len(second.blocks) == 3
    assert num_free(sched) == CAPACITY - 3  # 2 tree blocks, 1 of the request
    counts = ref_counts(sched)
    assert [counts[b] for b in second.blocks] == [1, 1, 1]  # a hit borrows: no extra reference
    sched.prefill_done([second])
    assert second.blocks[:2] == tree_blocks and num_free(sched) == CAPACITY - 3
    sched.finish([second])
    assert num_free(sched) == CAPACITY - 2
    assert cache.stats().hit_tokens == 2 * ps
    check(cache, sched)


def test_hit_is_capped_below_a_whole_page_prompt():
    ps = 4
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 3 * ps)  # exactly 3 pages
    [first] = sched.admit([prompt])
    sched.prefill_done([first])
    tree_blocks = list(first.blocks)
    assert first.num_exclusive == 0  # every page is the tree's now
    sched.finish([first])
    assert num_free(sched) == CAPACITY - 3
    check(cache, sched)
    [second] = sched.admit([prompt])
    # Capped at len - 1 = 11 tokens: 2 whole pages; the last page is computed again.
    assert second.num_cached_tokens == 2 * ps
    assert second.blocks[:2] == tree_blocks[:2] and second.blocks[2] not in tree_blocks
    assert num_free(sched) == CAPACITY - 4
    recomputed = second.blocks[2]
    sched.prefill_done([second])  # the recomputed page is a duplicate: released, switched
    assert second.blocks == tree_blocks and second.num_exclusive == 0
    assert num_free(sched) == CAPACITY - 3
    assert ref_counts(sched)[recomputed] == 0
    check(cache, sched)
    sched.finish([second])
    assert num_free(sched) == CAPACITY - 3
    check(cache, sched)


def test_duplicates_in_one_batch():
    ps = 4
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 2 * ps + 1)  # 2 whole pages + 1 token
    a, b = sched.admit([prompt, prompt])
    assert a.num_cached_tokens == b.num_cached_tokens == 0  # neither is in the tree yet
    assert not set(a.blocks) & set(b.blocks)
    assert num_free(sched) == CAPACITY - 6
    b_own = list(b.blocks[:2])
    sched.prefill_done([a, b])
    assert b.blocks[:2] == a.blocks[:2]  # switched to the tree's copies
    assert (a.num_exclusive, b.num_exclusive) == (1, 1)
    assert sched.num_free == CAPACITY - 4
    check(cache, sched)  # the host mirror and the device agree
    assert num_free(sched) == CAPACITY - 4
    counts = ref_counts(sched)
    assert [counts[x] for x in b_own] == [0, 0]
    assert [counts[x] for x in a.blocks] == [1, 1, 1] and counts[b.blocks[2]] == 1
    node = cache.match(prompt[: 2 * ps]).node
    assert node.lock == 2  # both requests hold the shared prefix
    sched.finish([a, b])
    assert node.lock == 0 and num_free(sched) == CAPACITY - 2
    assert cache.stats().evictable_tokens == 2 * ps
    check(cache, sched)


def test_request_that_does_not_fit_is_refused_and_nothing_changes():
    ps = 2
    cache, sched = make_scheduler(ps)
    system = seq(1, 3 * ps)
    [running] = sched.admit([system + seq(100, 10 * ps)])  # 13 pages
    sched.prefill_done([running])
    check(cache, sched)
    # 13 pages in the tree (pinned by the running request), 18 free.
    assert (cache.stats().protected_tokens, num_free(sched)) == (13 * ps, CAPACITY - 13)
    cached = seq(500, 4 * ps)
    [done] = sched.admit([cached + [1]])
    sched.prefill_done([done])
    sched.finish([done])  # 4 evictable pages, 14 free
    assert (cache.stats().evictable_tokens, num_free(sched)) == (4 * ps, CAPACITY - 17)
    check(cache, sched)
    stats_before, locks_before = cache.stats(), locks(cache)
    allocator_before, free_before = snapshot(sched.allocator), num_free(sched)
    # 22 pages, a 3-page hit: needs 19, more than 14 free + 4 evictable.
    too_big = system + seq(2000, 18 * ps + 1)
    small = seq(3000, 3)
    assert sched.admit([too_big, small]) == [None, None]  # arrival order: small waits too
    stats_after = cache.stats()
    assert locks(cache) == locks_before
    assert stats_after.protected_tokens == stats_before.protected_tokens
    assert stats_after.evictable_tokens == stats_before.evictable_tokens
    assert stats_after.evictions == 0
    chex.assert_trees_all_equal(allocator_before, snapshot(sched.allocator), strict=True)  # free stack and counts
    assert num_free(sched) == free_before
    check(cache, sched)
    # The first fits, the second does not, the third would but comes after it.
    fits = seq(4000, 2 * ps)
    results = sched.admit([fits, too_big, small])
    assert results[0] is not None and results[1:] == [None, None]
    assert num_free(sched) == free_before - 2
    check(cache, sched)
    sched.finish([results[0], running])
    check(cache, sched)


def test_reset_refuses_while_pinned_and_returns_every_block():
    ps = 2
    cache = PrefixCacheManager(ps, enable_events=True)
    cache.insert(seq(1, 6), [1, 2, 3])
    cache.insert(seq(1, 2) + seq(50, 4), [1, 4, 5])
    cache.insert(seq(1, 6), [6, 7, 8], namespace="other")
    cache.take_events()
    node = cache.pin_prefix(seq(1, 4))
    before = (cache.stats(), sorted(cache.device_blocks()))
    with pytest.raises(CacheLocked) as info:
        cache.reset()
    assert info.value.protected_tokens == 2 * ps
    assert (cache.stats(), sorted(cache.device_blocks())) == before
    assert cache.take_events() == []
    cache.release(node)
    blocks = cache.reset()
    assert sorted(blocks) == [1, 2, 3, 4, 5, 6, 7, 8]  # every node's ids, once, both namespaces
    assert cache.take_events() == [AllBlocksCleared()]
    stats = cache.stats()
    assert (stats.num_nodes, stats.evictable_tokens, stats.protected_tokens) == (0, 0, 0)
    assert cache.match(seq(1, 6)).num_tokens == 0 and cache.device_blocks() == []
    check(cache)


def test_reset_through_a_scheduler_lifecycle():
    ps = 2
    cache, sched = make_scheduler(ps, enable_events=True)
    [adm] = sched.admit([seq(1, 7)])
    sched.prefill_done([adm])
    tree_blocks = sorted(adm.blocks[:3])
    with pytest.raises(CacheLocked):
        cache.reset()
    sched.finish([adm])
    assert sorted(cache.reset()) == tree_blocks
    assert isinstance(cache.take_events()[-1], AllBlocksCleared)
    check(cache)


# -------------------------------------------------------------- events / metrics


def _event(event, kind, tokens, blocks, medium="device", namespace=None):
    assert type(event) is kind, event
    assert event.namespace == namespace and event.medium == medium
    np.testing.assert_array_equal(event.tokens, np.asarray(tokens, np.int32))
    assert event.block_ids == tuple(blocks)


def test_events_stored_removed_and_drained():
    ps = 2
    cache = PrefixCacheManager(ps, enable_events=True)
    a = seq(1, 5)  # 2 whole pages + 1 token
    cache.insert(a, [7, 8, 9])
    [stored] = cache.take_events()
    _event(stored, BlockStored, a[:4], [7, 8])
    assert cache.take_events() == []  # drained
    b = a[:2] + [60, 61, 62, 63]
    cache.insert(b, [10, 11, 12], namespace="ns")  # another namespace: all new
    cache.insert(b, [13, 14, 15])  # default namespace: shares page 0 with a
    events = cache.take_events()
    assert len(events) == 2
    _event(events[0], BlockStored, b, [10, 11, 12], namespace="ns")
    _event(events[1], BlockStored, b[2:], [14, 15])  # only the new pages, with their tokens
    cache.insert(a, [20, 21])  # all duplicates: nothing stored
    assert cache.take_events() == []
    cache.match(a)
    cache.match(b, namespace="ns")
    evicted = cache.evict(1)  # LRU leaf: b's tail in the default namespace, its last page
    assert evicted.blocks == [15]
    [removed] = cache.take_events()
    _event(removed, BlockRemoved, b[4:], [15])
    quiet = PrefixCacheManager(ps)
    quiet.insert(a, [1, 2])
    quiet.evict(2)
    assert quiet.take_events() == []


def test_metrics_hit_rate_by_hand():
    ps = 2
    cache = PrefixCacheManager(ps)
    a = seq(1, 4)
    cache.insert(a, [1, 2])
    cache.match(a + [9])  # 5 queried, 4 hit
    cache.match(seq(100, 3))  # 3 queried, 0 hit
    cache.match(a[:3])  # 3 queried, 2 hit (a partial page is not a hit)
    cache.match(a, max_tokens=3)  # 4 queried, 2 hit (the cap rounds down)
    cache.cached_length(a)  # not counted
    cache.pin_prefix(a)  # not counted
    stats = cache.stats()
    assert (stats.query_tokens, stats.hit_tokens, stats.host_hit_tokens) == (15, 8, 0)
    assert stats.hit_rate == pytest.approx(8 / 15)
    assert PrefixCacheManager(ps).stats().hit_rate == 0.0


def test_scheduler_metrics_count_whole_prompts():
    ps = 4
    cache, sched = make_scheduler(ps)
    prompt = seq(1, 3 * ps)
    for tokens in (prompt, prompt, prompt + [5]):
        adm = sched.admit([tokens])
        sched.prefill_done(adm)
        sched.finish(adm)
    stats = cache.stats()
    # 12 + 12 + 13 tokens queried; hits 0, 8 (capped below the whole prompt), 12.
    assert (stats.query_tokens, stats.hit_tokens) == (37, 20)
    assert stats.hit_rate == pytest.approx(20 / 37)
    check(cache, sched)


# ---------------------------------------------------------------------- host tier

LAYERS, HEADS, DIM = 2, 2, 3


def make_host_scheduler(ps: int, host_pages: int, memory_kind: str, **cache_kwargs):
    pool = KVPool.create(num_pages=NUM_BLOCKS, page_size=ps, num_layers=LAYERS, k_heads=HEADS, k_dim=DIM,
                         dtype=jnp.float32)
    host_pool = create_host_pool(pool, host_pages, memory_kind=memory_kind)
    cache = PrefixCacheManager(ps, host_pages=host_pages, **cache_kwargs)
    sched = PrefixScheduler(cache, BlockAllocator.create(NUM_BLOCKS), pool=pool, host_pool=host_pool, verify=True)
    return cache, sched


def prefill(sched: PrefixScheduler, adm, rng) -> dict:
    """Write fresh random K/V (never zero) into the pages the request computes
    (past its cached prefix); returns ``{block: (k, v)}`` of those pages."""
    ps = sched.page_size
    start = adm.num_cached_tokens // ps
    blocks = adm.blocks[start:]
    shape = (LAYERS, HEADS, len(blocks), ps, DIM)
    k = rng.uniform(1.0, 2.0, shape).astype(np.float32) * rng.choice([-1, 1], shape)
    v = rng.uniform(3.0, 4.0, shape).astype(np.float32)
    data = KVPool.from_arrays(jnp.asarray(k), jnp.asarray(v))
    sched.pool, ok = sched.pool.write_pages(np.asarray(blocks, np.int32), data)
    assert ok
    return {block: (k[:, :, i], v[:, :, i]) for i, block in enumerate(blocks)}


def read(sched: PrefixScheduler, blocks) -> list:
    data, ok = sched.pool.read_pages(np.asarray(blocks, np.int32))
    assert ok
    k, v = np.asarray(data.k_pages), np.asarray(data.v_pages)
    return [(k[:, :, i], v[:, :, i]) for i in range(len(blocks))]


def assert_pages_equal(actual, expected):
    assert len(actual) == len(expected)
    for (k, v), (k0, v0) in zip(actual, expected):
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)


@pytest.mark.parametrize("memory_kind", ["numpy", "auto"])
def test_host_tier_round_trip_is_exact(memory_kind):
    ps, host_pages = 2, 8
    rng = np.random.default_rng(7)
    cache, sched = make_host_scheduler(ps, host_pages, memory_kind)
    prompt = seq(1, 4 * ps + 1)  # 4 whole pages + 1 token
    [adm] = sched.admit([prompt])
    written = prefill(sched, adm, rng)
    sched.prefill_done([adm])
    original = [written[b] for b in adm.blocks[:4]]
    tree_blocks = list(adm.blocks[:4])
    sched.finish([adm])
    check(cache, sched)
    # Fill the device: 27 free, the request needs 29 pages: the 2 tail pages go to host.
    [other] = sched.admit([seq(1000, 29 * ps)])
    stats = cache.stats()
    assert (stats.host_tokens, stats.offloaded_tokens, stats.evictable_tokens) == (2 * ps, 2 * ps, 2 * ps)
    assert set(tree_blocks[2:]) <= set(other.blocks)
    prefill(sched, other, rng)  # overwrites the freed blocks: what comes back must be the host's copy
    check(cache, sched)
    assert cache.cached_length(prompt) == 4 * ps  # host pages count as cached
    assert cache.cached_blocks(prompt) == tree_blocks[:2]  # ... but only the device's are blocks
    sched.finish([other])  # without prefill_done: its pages go back to the allocator
    assert num_free(sched) == CAPACITY - 2
    check(cache, sched)
    [again] = sched.admit([prompt])
    assert again.num_cached_tokens == 4 * ps
    assert again.blocks[:2] == tree_blocks[:2] and len(again.blocks) == 5
    assert cache.stats().host_tokens == 0 and cache.stats().host_hit_tokens == 2 * ps
    assert_pages_equal(read(sched, again.blocks[:4]), original)
    assert num_free(sched) == CAPACITY - 5
    check(cache, sched)
    sched.prefill_done([again])
    sched.finish([again])
    assert cache.host_free_pages == host_pages
    check(cache, sched)


def test_host_tier_drops_lru_leaves_when_full():
    ps = 2
    cache = PrefixCacheManager(ps, host_pages=2)
    a, b = seq(1, 4), seq(100, 4)
    cache.insert(a, [1, 2])
    cache.insert(b, [3, 4])
    cache.match(b)  # a is older
    first = cache.evict(2)
    assert first.blocks == [1, 2] and first.offload_from == [1, 2] and len(set(first.offload_to)) == 2
    assert cache.stats().host_tokens == 4 and cache.cached_length(a) == 4
    check(cache)
    second = cache.evict(2)  # no room on host: a (its LRU leaf) is dropped for b
    assert second.blocks == [3, 4] and sorted(second.offload_to) == sorted(first.offload_to)
    assert cache.cached_length(a) == 0 and cache.cached_length(b) == 4
    assert cache.stats().host_tokens == 4 and cache.stats().num_nodes == 1
    check(cache)


def test_host_tier_keeps_a_chain_tail_first():
    ps = 2
    cache = PrefixCacheManager(ps, host_pages=4)
    tokens = seq(1, 6 * ps)
    cache.insert(tokens, [1, 2, 3, 4, 5, 6])
    expected_host = []
    for k in range(1, 7):
        evicted = cache.evict(1)
        assert evicted.blocks == [7 - k]  # the device part shrinks from its end
        expected_host = ([7 - k] + expected_host)[:4]  # the host part keeps its head pages
        cached = 6 - k + len(expected_host)
        assert cache.cached_length(tokens) == cached * ps
        assert cache.stats().host_tokens == len(expected_host) * ps
        check(cache)
    # What is left is exactly the first 4 pages of the chain, all on host.
    match = cache.match(tokens)
    assert match.num_tokens == 4 * ps and match.blocks == [] and match.num_host_tokens == 4 * ps
    assert all(node.tier == HOST for node in match.host_nodes)


@pytest.mark.parametrize("memory_kind", ["numpy", "auto"])
def test_host_tier_capacity_through_the_scheduler(memory_kind):
    ps, host_pages = 2, 3
    rng = np.random.default_rng(11)
    cache, sched = make_host_scheduler(ps, host_pages, memory_kind)
    prompt = seq(1, 6 * ps + 1)  # 6 whole pages + 1 token
    [adm] = sched.admit([prompt])
    written = prefill(sched, adm, rng)
    original = [written[b] for b in adm.blocks[:6]]
    sched.prefill_done([adm])
    sched.finish([adm])
    assert num_free(sched) == CAPACITY - 6
    check(cache, sched)
    # 25 free, 27 needed: pages 4 and 5 go to host (2 of its 3 pages).
    [big] = sched.admit([seq(1000, 27 * ps)])
    prefill(sched, big, rng)
    assert (cache.stats().host_tokens, cache.stats().evictable_tokens) == (2 * ps, 4 * ps)
    assert cache.cached_length(prompt) == 6 * ps
    check(cache, sched)
    sched.finish([big])
    # 27 free, 29 needed: pages 2 and 3 need 2 host pages, 1 is free: the
    # host drops its LRU leaf (pages 4-5) and keeps the head of the chain.
    [big] = sched.admit([seq(2000, 29 * ps)])
    prefill(sched, big, rng)
    assert (cache.stats().host_tokens, cache.stats().evictable_tokens) == (2 * ps, 2 * ps)
    assert cache.cached_length(prompt) == 4 * ps
    assert cache.host_free_pages == 1
    check(cache, sched)
    sched.finish([big])
    [again] = sched.admit([prompt])
    assert again.num_cached_tokens == 4 * ps and len(again.blocks) == 7
    assert_pages_equal(read(sched, again.blocks[:4]), original[:4])
    assert cache.stats().host_tokens == 0 and cache.host_free_pages == host_pages
    check(cache, sched)
    sched.finish([again])
    check(cache, sched)


def test_host_hit_shared_by_a_batch_that_splits_it():
    """Two requests of one batch hit the same host-tier node, the second only
    its first half: its match splits the node. The first request must still
    get every page of its hit (one block per page of its prompt) with the
    original K/V."""
    ps, host_pages = 2, 8
    rng = np.random.default_rng(3)
    cache, sched = make_host_scheduler(ps, host_pages, "numpy")
    prompt = seq(1, 4 * ps)
    [adm] = sched.admit([prompt + [99]])
    written = prefill(sched, adm, rng)
    original = [written[b] for b in adm.blocks[:4]]
    sched.prefill_done([adm])
    sched.finish([adm])
    # Move the whole 4-page chain (one node) to host.
    [big] = sched.admit([seq(1000, (CAPACITY - 4 + 4) * ps)])
    assert cache.stats().host_tokens == 4 * ps
    sched.finish([big])
    check(cache, sched)
    full, half = prompt + [99], prompt[: 2 * ps] + [50, 51]
    first, second = sched.admit([full, half])
    check(cache, sched)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (4 * ps, 2 * ps)
    assert len(first.blocks) == pages_of(full, ps) and len(second.blocks) == pages_of(half, ps)
    assert first.blocks[:2] == second.blocks[:2]  # the shared half is loaded once
    assert_pages_equal(read(sched, first.blocks[:4]), original)
    sched.prefill_done([first, second])
    sched.finish([first, second])
    check(cache, sched)


def test_event_replay_matches_the_tree_with_a_host_tier():
    """Replaying BlockStored/BlockRemoved per medium gives exactly what the
    tree holds on each medium, through offload, load and host drops."""
    ps = 2
    cache = PrefixCacheManager(ps, host_pages=3, enable_events=True)
    held = {"device": set(), "host": set()}

    def replay():
        for event in cache.take_events():
            ids = {(event.namespace, b) for b in event.block_ids}
            if isinstance(event, BlockStored):
                assert not ids & held[event.medium], (event, held)
                held[event.medium] |= ids
            elif isinstance(event, BlockRemoved):
                assert ids <= held[event.medium], (event, held)
                held[event.medium] -= ids
        device = {(n.namespace, b) for n in cache.tree.nodes() if n.tier != HOST for b in n.value}
        host = {(n.namespace, b) for n in cache.tree.nodes() if n.tier == HOST for b in n.value}
        assert held == {"device": device, "host": host}

    a, b = seq(1, 4 * ps), seq(100, 2 * ps)
    cache.insert(a, [1, 2, 3, 4])
    cache.insert(b, [5, 6])
    replay()
    cache.evict(3)  # a (the LRU leaf) is split: its last 3 pages go to host, which is then full
    replay()
    match = cache.match(a)
    assert match.blocks == [1] and match.num_host_tokens == 3 * ps
    cache.loaded(match.host_nodes, [7, 8, 9])  # back on device; the host pages are free again
    replay()
    cache.evict(4)  # b to host, then a's last 2 pages: the host drops b (its LRU leaf) for them
    assert cache.cached_length(b) == 0 and cache.cached_length(a) == 4 * ps
    replay()
    check(cache)


# ---------------------------------------------------------------------- one pin contract, both caches


class _PagedPins:
    """``PrefixCacheManager``'s pins, named by token ids (``pin_prefix``)."""

    def __init__(self):
        self.cache = PrefixCacheManager(page_size=1)
        self.nodes: dict = {}

    def insert(self, tokens):
        self.cache.insert(tokens, list(range(1 + 10 * len(self.nodes), 1 + 10 * len(self.nodes) + len(tokens))))
        self.nodes[tuple(tokens)] = self.cache.match(tokens).node

    def pin(self, tokens):
        self.nodes[tuple(tokens)] = self.cache.pin_prefix(tokens)

    def release(self, tokens):
        self.cache.release(self.nodes[tuple(tokens)])

    def protected(self) -> int:
        return self.cache.stats().protected_tokens

    def reset(self):
        self.cache.reset()


class _SlotPins:
    def __init__(self):
        self.cache = SlotPrefixCacheManager()

    def insert(self, tokens):
        self.cache.insert(tokens, 1, 0)

    def pin(self, tokens):
        assert self.cache.pin(tokens) is True

    def release(self, tokens):
        assert self.cache.release(tokens) is True

    def protected(self) -> int:
        return sum(node.num_tokens for node in self.cache.tree.nodes() if node.lock)

    def reset(self):
        self.cache.reset()


@pytest.mark.parametrize("make", [_PagedPins, _SlotPins], ids=["paged", "slot"])
def test_pin_release_contract_is_the_same_on_both_caches(make):
    """What is pinned (the node where the prefix ends, split there, and its
    path), what ``release`` undoes (one pin of that node; pins are counted)
    and what a release with nothing to undo does (``InvalidArgument``,
    nothing changes) -- the contract in ``jaxkv.prefix.radix``."""
    pins = make()
    pins.insert([1, 2, 3, 4])
    pins.pin([1, 2])  # ends inside the inserted node: split at 2
    assert pins.protected() == 2  # the prefix's path, not the whole node
    pins.pin([1, 2])  # counted
    pins.release([1, 2])
    assert pins.protected() == 2
    with pytest.raises(CacheLocked):
        pins.reset()
    pins.release([1, 2])
    assert pins.protected() == 0
    pins.cache.check_invariants()
    with pytest.raises(InvalidArgument, match="not pinned"):
        pins.release([1, 2])  # double release
    pins.pin([1, 2, 3, 4])
    with pytest.raises(InvalidArgument, match="not pinned"):
        pins.release([1, 2])  # a pin held below does not count at the ancestor
    assert pins.protected() == 4
    pins.release([1, 2, 3, 4])
    assert pins.protected() == 0
    pins.cache.check_invariants()
    pins.reset()
