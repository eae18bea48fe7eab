"""Tenants cannot see, starve or read each other (issue 32): scrub-on-free
leaves no byte of a finished request in any pool, per-namespace prefix
quotas keep one tenant's prefixes cached while another floods the cache,
and namespaces scope every prefix structure and event.

Every token is checked against an independent run: ``generate`` (a
no-prefix-cache, one-request run of the same model) or transformers' tokens
(the hybrid fixtures); every "no byte remains" check compares the whole
pool with a freshly built one, and a control run without the option shows
the same check failing.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.prefix import BlockRemoved, BlockStored
from jaxkv.serve import Engine

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
VOCAB = 97


def _llama(**extra):
    config = LlamaConfig.from_hf(dict(
        model_type="mistral" if extra else "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=False, **extra))
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _nonzero_pages(pool) -> list:
    leaves = [np.asarray(x) for x in (pool.k_bits, pool.v_bits)]
    return [b for b in range(leaves[0].shape[2]) if any(np.any(x[:, :, b]) for x in leaves)]


def _expected(model, prompt, new, page_size=4):
    return generate(model, [prompt], new, page_size=page_size).tokens[0]


# ------------------------------------------------------------------ scrub-on-free


@pytest.mark.parametrize("method", ["loop", "switch"])
def test_zero_blocks_resets_exactly_the_freed_blocks(method):
    """Both scrub methods (CPU's loop, GPU's one switched scatter) against
    numpy: random arrays (never zeros), random freed sets of every size
    class (none, one, a chunk and past it, half, all), blocks on different
    axes with different fill values; nothing else changes."""
    from jaxkv.pool.scrub import zero_blocks

    rng = np.random.default_rng()
    run = jax.jit(lambda a, b, f: zero_blocks([a, b], [1, 0], f, [0, 1.0], method=method))
    for n in (5, 100, 700):
        a = rng.standard_normal((2, n, 3)).astype(np.float32) + 3
        b = rng.standard_normal((n, 4)).astype(np.float32) + 3
        for k in sorted({0, 1, 8, 9, 70, n // 2, n}):
            freed = np.zeros(n, bool)
            freed[rng.choice(n, min(k, n), replace=False)] = True
            got_a, got_b = run(a, b, freed)
            np.testing.assert_array_equal(got_a, np.where(freed[None, :, None], 0, a))
            np.testing.assert_array_equal(got_b, np.where(freed[:, None], 1.0, b))


@pytest.mark.parametrize("scrub", [True, False])
def test_paged_scrub_leaves_no_byte_of_finished_requests(llama, scrub):
    """Requests sharing prefixes run under block pressure (evictions,
    preemption by recompute), with the prefix cache on. Once they finish
    and the cache is emptied, scrub-on-free leaves every page of the pool
    zero (the null page included); without it the pages keep their K/V
    (the control: the check can fail). Tokens equal ``generate`` either
    way."""
    rng = np.random.default_rng()
    engine = Engine(llama, num_pages=14, page_size=4, max_seqs=3, max_blocks_per_seq=12, decode_chunk=4,
                    scrub_on_free=scrub)
    shared = rng.integers(1, VOCAB, 12).tolist()
    prompts = [shared + rng.integers(1, VOCAB, int(n)).tolist() for n in rng.integers(1, 9, 5)]
    ids = [engine.add_request(p, 8) for p in prompts]
    engine.run()
    for rid, prompt in zip(ids, prompts):
        assert engine.outputs[rid] == _expected(llama, prompt, 8)
    # While cached prefixes are held, every FREE page is already zero.
    counts = np.asarray(jax.device_get(engine.cache.manager.device.ref_counts))
    free = {int(b) for b in np.flatnonzero(counts == 0)}
    dirty_free = sorted(free & set(_nonzero_pages(engine.cache.pool)) - {0})
    # (No control here: whether some page was freed while the cache held others depends on the drawn
    # prompts; the control is after the eviction below, where every page has been freed.)
    assert not scrub or dirty_free == []
    engine.cache.evict(engine.cache.capacity)  # the tree lets every page go
    assert engine.cache.blocks_in_use() == 0
    left = _nonzero_pages(engine.cache.pool)
    assert left == [] if scrub else len(left) > 3


def test_scrub_reaches_the_host_tiers(llama):
    """Swap preemption (a host swap pool) and a prefix cache with a host
    tier, scrub-on-free on: once the requests are done and
    ``reset_prefix_cache`` drops every cached prefix, the device pool, the
    swap pool and the host tier's pool are all zero; tokens equal
    ``generate``. ``reset_prefix_cache`` refuses while a request holds a
    cached prefix."""
    rng = np.random.default_rng()
    engine = Engine(llama, num_pages=12, page_size=4, max_seqs=3, max_blocks_per_seq=12, decode_chunk=4,
                    num_host_pages=24, host_prefix_pages=8, scrub_on_free=True)
    shared = rng.integers(1, VOCAB, 8).tolist()
    prompts = [shared + rng.integers(1, VOCAB, int(n)).tolist() for n in rng.integers(2, 8, 6)]
    ids = [engine.add_request(p, 10) for p in prompts]
    summary = engine.run()
    assert summary.swap_preemptions > 0
    for rid, prompt in zip(ids, prompts):
        assert engine.outputs[rid] == _expected(llama, prompt, 10)
    engine.cache.evict(engine.cache.capacity)  # cached pages move to the host tier
    assert engine.cache.prefix_stats().host_free_pages < 8
    held = engine.add_request(shared + [1, 2, 3], 20)
    engine.step()
    assert engine.reset_prefix_cache() is False  # the running request pins its hit
    engine.abort(held)
    engine.run()
    assert engine.reset_prefix_cache() is True
    cache = engine.cache
    assert cache.blocks_in_use() == 0 and cache.prefix_stats().host_free_pages == 8
    assert _nonzero_pages(cache.pool) == []
    assert _nonzero_pages(cache.host_pool) == [] and _nonzero_pages(cache.prefix_host_pool) == []


def test_scrub_zeroes_blocks_a_sliding_window_trims():
    """Mistral, a 6-token window on every layer: decode gives back the
    blocks that left the window (and the next append may take one back in
    the same step). With scrub-on-free every page a row no longer holds is
    zero after each run, and tokens equal ``generate``."""
    model = _llama(sliding_window=6)
    engine = Engine(model, num_pages=6, page_size=4, max_seqs=2, max_blocks_per_seq=16, decode_chunk=4,
                    scrub_on_free=True, prefix_cache=False)
    rng = np.random.default_rng()
    prompts = [rng.integers(1, VOCAB, 6).tolist() for _ in range(3)]
    ids = [engine.add_request(p, 30) for p in prompts]
    summary = engine.run()
    for rid, prompt in zip(ids, prompts):
        assert engine.outputs[rid] == generate(model, [prompt], 30, page_size=4).tokens[0]
    assert summary.peak_kv_blocks <= 5
    assert _nonzero_pages(engine.cache.pool) == []


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


def _differs_from_fresh(model, cache) -> list[str]:
    """The arrays of ``cache``'s manager that hold KV data or state (pools,
    compressed entries, rings, GDN states) and differ from a freshly built
    manager's: none when no byte of any request remains."""
    fresh = model.make_cache(cache.max_seqs, cache.max_context_tokens, num_snapshots=cache.num_cached_snapshots,
                             num_blocks={name: int(n) + 1 for name, n in zip(cache.groups, cache.capacity)})
    out = []
    for part in ("full_pool", "mla_pool", "gdn", "v4_stores", "window_pool"):
        for (path, mine), (_, new) in zip(jax.tree_util.tree_leaves_with_path(getattr(cache.manager, part)),
                                          jax.tree_util.tree_leaves_with_path(getattr(fresh, part))):
            name = part + jax.tree_util.keystr(path)
            if not name.endswith("track_held") and not np.array_equal(np.asarray(mine), np.asarray(new)):
                out.append(name)
    return out


# Qwen3-Next (GDN states + full-attention pages) by default; DeepSeek-V4's compressed entries,
# indexer keys and rings, and gpt-oss's window rings, in the long pass (tests/conftest.py).
@pytest.mark.parametrize("name", ["qwen3_next/small", "dsv4/small", "gpt_oss/small"])
def test_hybrid_scrub_leaves_no_byte_of_finished_requests(name):
    """A hybrid cache with few snapshot rows (records dropped and their rows
    reused while requests run), scrub-on-free on: transformers' tokens, and
    once ``reset_prefix_cache`` drops every cached prefix, every pool, compressed entry,
    ring and GDN state equals a freshly built cache's."""
    model, expected = _fixture(name)
    blocks = {"csa4": 24, "hca16": 24} if name.startswith("dsv4") else None
    engine = Engine(model, max_seqs=2, max_context_tokens=256, decode_chunk=4, prefill_chunk=64, num_snapshots=3,
                    num_blocks=blocks, scrub_on_free=True)
    chosen = np.argsort([len(p) for p in expected["prompts"]])[:4]  # the shortest: CI time
    ids = {int(i): engine.add_request(expected["prompts"][i], expected["max_new_tokens"]) for i in chosen}
    engine.run()
    for i, rid in ids.items():
        assert engine.outputs[rid] == expected["greedy"][i], f"prompt {i}"
    assert engine.cache.snapshots.evicted > 0  # rows were let go and taken again
    assert engine.reset_prefix_cache()
    assert engine.cache.free_blocks().tolist() == engine.cache.capacity.tolist()
    assert not engine.cache.snapshots.records
    assert _differs_from_fresh(model, engine.cache) == []


# ------------------------------------------------------------------ quotas


def _flood(model, quota, rng, *, rounds=3):
    """Tenant B asks about its document (a 32-token prefix, a new question
    each time) between bursts of tenant A's distinct prompts that alone
    need more pages than the pool has. Returns B's cached tokens per
    request after its first, and checks every request's tokens."""
    engine = Engine(model, num_pages=40, page_size=4, max_seqs=2, max_blocks_per_seq=12, decode_chunk=4,
                    prefix_quota=quota)
    document = rng.integers(1, VOCAB, 32).tolist()
    hits, checked = [], []
    for turn in range(rounds + 1):
        prompt = document + rng.integers(1, VOCAB, 3).tolist()
        rid = engine.add_request(prompt, 4, namespace="tenant-b")
        engine.run()
        checked.append((prompt, engine.outputs[rid]))
        if turn:
            hits.append(engine.cached_tokens(rid))
        flood = [rng.integers(1, VOCAB, 32).tolist() for _ in range(6)]  # 48 pages of A's
        for prompt in flood:
            checked.append((prompt, None))
            checked[-1] = (prompt, engine.add_request(prompt, 4, namespace="tenant-a"))
        engine.run()
        checked[-6:] = [(p, engine.outputs[r]) for p, r in checked[-6:]]
        engine.cache.prefix_cache.check_invariants()
        assert engine.cache.prefix_cache.namespace_pages("tenant-a") <= (20 if quota else 40)
    for prompt, tokens in checked:
        assert tokens == _expected(model, prompt, 4)
    return hits


def test_prefix_quota_keeps_a_tenant_hitting_while_another_floods(llama):
    """With ``prefix_quota=0.5`` tenant A's cached pages never exceed half
    the pool and eviction takes A's first (over its fair share): B's
    document is served from the cache after every flood (its 32 tokens
    minus nothing: all 8 pages). Without a quota, plain LRU flushes it
    (the control). Tokens equal ``generate`` in both runs (running requests
    are never affected)."""
    rng = np.random.default_rng()
    assert _flood(llama, 0.5, rng) == [32, 32, 32]
    assert _flood(llama, None, rng) == [0, 0, 0]


def test_snapshot_quota_keeps_a_tenant_hitting_while_another_floods():
    """The hybrid cache (Qwen3-Next, GDN snapshots): tenant A's records are
    capped at half the snapshot rows and its pages at half the pool; B's
    document keeps hitting through A's floods (at token 40, where B's
    questions part: the branch snapshot its second question took), and
    tokens equal a cold engine's. Without a quota the floods evict it (the
    control)."""
    model, expected = _fixture("qwen3_next/small")
    rng = np.random.default_rng()
    vocab = model.config.vocab_size
    results = {}
    for quota in (0.5, None):
        engine = Engine(model, max_seqs=2, max_context_tokens=128, decode_chunk=4, prefill_chunk=64,
                        num_snapshots=4, num_blocks={"full": 24}, prefix_quota=quota)
        cold = Engine(model, max_seqs=2, max_context_tokens=128, decode_chunk=4, prefill_chunk=64,
                      prefix_cache=False)
        document = rng.integers(1, vocab, 40).tolist()
        hits = []
        for turn in range(4):
            prompt = document + rng.integers(1, vocab, 3).tolist()
            rid = engine.add_request(prompt, 3, namespace="b")
            engine.run()
            ref = cold.add_request(prompt, 3)
            cold.run()
            assert engine.outputs[rid] == cold.outputs[ref]
            if turn >= 2:
                hits.append(engine.cached_tokens(rid))
            if turn == 0:  # B's second question keeps a snapshot where its questions part (token 40)
                continue
            flood = [rng.integers(1, vocab, 40).tolist() for _ in range(5)]
            for prompt in flood:
                engine.add_request(prompt, 3, namespace="a")
            engine.run()
            engine.cache.snapshots.check_invariants()
            if quota:
                assert engine.cache.snapshots.namespace_records("a") <= 2
        results[quota] = hits
    assert results[0.5] == [40, 40], results
    assert min(results[None]) < 40, results


def test_prefix_quota_is_a_fraction(llama):
    from jaxkv.errors import InvalidArgument
    for bad in (0, 1.5, -0.1):
        with pytest.raises(InvalidArgument, match="prefix_quota"):
            Engine(llama, num_pages=8, page_size=4, max_seqs=1, max_blocks_per_seq=4, prefix_quota=bad)


# ------------------------------------------------------------------ namespaces end to end


def test_namespaces_scope_the_tree_the_host_tier_and_the_events(llama):
    """Tenant A's prompt is cached, then evicted to the host tier: tenant B
    sending the same prompt hits neither tier (0 cached tokens) while A's
    repeat hits its host pages; every event names the namespace of the
    pages it reports, and none of B's events reports A's pages."""
    rng = np.random.default_rng()
    engine = Engine(llama, num_pages=16, page_size=4, max_seqs=1, max_blocks_per_seq=12, decode_chunk=4,
                    host_prefix_pages=16, enable_kv_events=True)
    prompt = rng.integers(1, VOCAB, 21).tolist()
    first = engine.add_request(prompt, 4, namespace=("tenant", "a"))
    engine.run()
    engine.cache.evict(engine.cache.capacity)  # A's pages move to the host tier
    assert engine.cache.prefix_stats().host_free_pages < 16
    other = engine.add_request(prompt, 4, namespace=("tenant", "b"))
    engine.run()
    assert engine.cached_tokens(other) == 0
    again = engine.add_request(prompt, 4, namespace=("tenant", "a"))
    engine.run()
    assert engine.cached_tokens(again) == 20
    for rid in (first, other, again):
        assert engine.outputs[rid] == _expected(llama, prompt, 4)
    events = engine.take_kv_events()
    kinds = {(type(e).__name__, e.medium, e.namespace) for e in events}
    assert ("BlockStored", "host", ("tenant", "a")) in kinds and ("BlockStored", "device", ("tenant", "b")) in kinds
    assert not any(e.namespace == ("tenant", "b") and e.medium == "host" for e in events)
    for event in events:
        assert isinstance(event, (BlockStored, BlockRemoved))
        assert event.namespace in (("tenant", "a"), ("tenant", "b"))


def test_a_tenant_cannot_multiply_its_quota_with_salts():
    """The radix cache alone (host only): a server tenant's namespaces
    ``("tenant", name, salt)`` share one quota whatever the salts, and
    eviction under pressure takes from the owner over its fair share
    first, least recently used first among its pages; another tenant
    under its share keeps every page."""
    from jaxkv.prefix import PrefixCacheManager

    rng = np.random.default_rng()
    cache = PrefixCacheManager(4)
    cache.set_quota(6)
    next_block = iter(range(1, 1000))
    b_doc = rng.integers(0, 50, 16).tolist()  # 4 pages of tenant b
    cache.insert(b_doc, [next(next_block) for _ in range(4)], ("tenant", "b", None))
    released = []
    for salt in range(5):  # tenant a: 5 salts x 3 pages, capped at 6 pages in all
        tokens = rng.integers(0, 50, 12).tolist()
        cache.insert(tokens, [next(next_block) for _ in range(3)], ("tenant", "a", f"salt-{salt}"))
        released += cache.trim(("tenant", "a", f"salt-{salt}")).blocks
        cache.check_invariants()
        assert cache.namespace_pages(("tenant", "a", "anything")) <= 6
    assert len(released) == 15 - 6
    evicted = cache.evict(3).blocks  # a holds 6 > fair share 5: its pages go first
    assert len(evicted) == 3 and cache.namespace_pages(("tenant", "b", None)) == 4
    assert cache.match(b_doc, ("tenant", "b", None)).num_tokens == 16
    assert cache.match(b_doc, ("tenant", "b", "other salt")).num_tokens == 0  # salts still scope hits
