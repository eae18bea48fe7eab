"""The paged engine's prefix cache with a host tier (``host_prefix_pages``):
a prefix evicted from a device pool too small to keep it is copied to host
pages, and a later request hits it there; the hit loads the pages back into
fresh device blocks and serves exactly what a cold run computes.

Compile budget: every engine here has ``test_nn_engine``'s pool and table
shapes (``host_prefix_pages`` and ``num_host_pages`` change no jitted step's
shapes), so the engine's steps compile once for both files; the host tier
adds its page copies (a few small programs).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.serve import Engine
from jaxkv.serve.paged_cache import HostTierRate, host_tier_rate

CONFIG = dict(
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=256, tie_word_embeddings=False,
)
PAGE = 4
# 9 allocatable blocks: one 30-token request (8 blocks) leaves no room for a cached prefix.
ENGINE = dict(num_pages=10, page_size=PAGE, max_seqs=4, max_blocks_per_seq=8, decode_chunk=4,
              host_memory_kind="numpy")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


def tokens(rng, n):
    return rng.integers(1, CONFIG["vocab_size"], size=n).tolist()


def check_blocks(engine):
    """No leak: every device block is free or held by the prefix cache alone
    (one reference), every row is free, every host page of the tier is free
    or held by exactly one cached page."""
    device = engine.manager.device
    cached = engine.prefix_cache.device_blocks()
    assert len(set(cached)) == len(cached)
    assert int(device.num_free) + len(cached) == device.capacity
    assert (np.asarray(device.ref_counts)[cached] == 1).all()
    assert (np.asarray(engine.manager.status) == 0).all()  # every row FREE
    engine.prefix_cache.check_invariants()  # host pages: none lost, none held twice
    stats = engine.cache.prefix_stats()
    assert stats.host_free_pages + stats.tree.host_tokens // PAGE == stats.host_pages


def serve(engine, requests, namespace=None):
    """Run ``requests`` (prompt, max_new) arriving together; their outputs and the summary."""
    ids = [engine.add_request(prompt, max_new, namespace=namespace) for prompt, max_new in requests]
    summary = engine.run()
    check_blocks(engine)
    return [engine.outputs[rid] for rid in ids], summary, ids


def scenario(engine, rng):
    """Prompt A; then two long requests, one at a time, that need (almost)
    every block, so A's cached pages are evicted; then two continuations of
    A (A + its output + a different suffix each) together, and the same
    two again, each in a fresh namespace (cold: nothing cached there)."""
    prompt_a = tokens(rng, 11)
    (out_a,), _, _ = serve(engine, [(prompt_a, 4)])  # caches 14 tokens: 3 full pages
    traffic = []
    for _ in range(2):
        outs, _, _ = serve(engine, [(tokens(rng, 16), 14)])  # 30 tokens: 8 of the 9 blocks
        traffic += outs
    follow = [(prompt_a + out_a + tokens(rng, 1 + i), 5) for i in range(2)]
    before = engine.cache.prefix_stats()
    warm, summary, ids = serve(engine, follow)
    after = engine.cache.prefix_stats()
    cold, cold_hits = [], 0
    for i, request in enumerate(follow):  # a namespace each: they share a prefix with each other too
        (out,), cold_summary, _ = serve(engine, [request], namespace=("cold", i))
        cold.append(out)
        cold_hits += cold_summary.prefix_hit_tokens
    return dict(out_a=out_a, traffic=traffic, warm=warm, cold=cold, summary=summary, cold_hits=cold_hits,
                before=before, after=after, cached=[engine.cached_tokens(rid) for rid in ids])


@pytest.fixture(scope="module")
def served(model):
    """The scenario on four engines: a host tier that holds everything (numpy
    host memory, and ``"auto"``: pinned host memory where the backend has
    it, the CPU's included), a host tier of 2 pages (drops what it cannot
    hold), and none."""
    out = {}
    for name, pages, kind in [("host", 32, "numpy"), ("pinned", 32, "auto"), ("small", 2, "numpy"),
                              ("off", None, "numpy")]:
        engine = Engine(model, host_prefix_pages=pages, **{**ENGINE, "host_memory_kind": kind})
        out[name] = engine, scenario(engine, np.random.default_rng(7))
    return out


@pytest.mark.parametrize("kind", ["host", "pinned"])
def test_evicted_prefix_is_loaded_back_from_host(served, kind):
    engine, run = served[kind]
    before, after = run["before"], run["after"]
    # A's pages left the device for the host tier, in transfer calls of their own.
    assert before.offloaded_tokens >= 3 * PAGE and before.offload_calls >= 1 and before.tree.host_tokens > 0
    # Both continuations hit A's 3 pages (12 tokens: A and the first output token) ...
    assert run["cached"] == [3 * PAGE, 3 * PAGE]
    assert run["summary"].prefix_hit_tokens == 6 * PAGE
    # ... some of them from the host tier, loaded once for the two (one call).
    loaded = after.loaded_tokens - before.loaded_tokens
    assert 0 < loaded <= 3 * PAGE and after.load_calls == before.load_calls + 1
    assert after.tree.host_hit_tokens - before.tree.host_hit_tokens == 2 * loaded
    assert run["cold_hits"] == 0
    # Exactly the tokens a cold run computes.
    assert run["warm"] == run["cold"]
    assert engine.cache.plan.host_pages == 0  # the swap pool is another pool (none here)


def test_host_tier_off_and_too_small_serve_the_same_tokens(served):
    host, off, small = served["host"][1], served["off"][1], served["small"][1]
    for other in (off, small, served["pinned"][1]):
        assert other["out_a"] == host["out_a"] and other["traffic"] == host["traffic"]
        assert other["warm"] == host["warm"] == other["cold"]
    stats = off["after"]
    assert stats.host_pages == 0 and stats.host_bytes == 0
    assert stats.loaded_tokens == stats.offloaded_tokens == stats.load_calls == stats.offload_calls == 0
    assert stats.tree.host_tokens == stats.tree.host_hit_tokens == 0
    # Without a host tier the evicted pages are gone: a smaller hit (or none).
    assert off["summary"].prefix_hit_tokens < host["summary"].prefix_hit_tokens
    assert served["off"][0].cache.prefix_host_pool is None
    # A 2-page tier keeps at most 2 pages (the least recently used go).
    assert small["after"].host_pages == 2 and small["after"].tree.host_tokens <= 2 * PAGE


def test_host_tier_rate(model, served):
    engine = Engine(model, host_prefix_pages=8, **ENGINE)
    rate = host_tier_rate(engine, 4, repeats=2)
    assert isinstance(rate, HostTierRate) and rate.num_pages == 4 and rate.memory_kind == "numpy"
    assert rate.bytes == 4 * engine.cache.bytes_per_block
    assert rate.offload_gbps > 0 and rate.load_gbps > 0
    check_blocks(engine)  # measured through a scratch pool and free blocks: the cache is untouched
    with pytest.raises(InvalidArgument, match="10 pages: 9 of 9 blocks are free"):
        host_tier_rate(engine.cache, 10)
    full, _ = served["host"]  # its prefix cache holds blocks: loads need free ones
    free = int(full.manager.device.num_free)
    with pytest.raises(InvalidArgument, match=f"{free + 1} pages: {free} of 9 blocks are free"):
        host_tier_rate(full, free + 1)


def test_host_prefix_pages_is_refused_where_it_cannot_apply(model):
    with pytest.raises(InvalidArgument, match="host_prefix_pages=4: .*needs prefix_cache=True"):
        Engine(model, host_prefix_pages=4, prefix_cache=False, **ENGINE)
    with pytest.raises(InvalidArgument, match="host_prefix_pages"):
        Engine(model, host_prefix_pages=-1, **ENGINE)
    qwen = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "qwen3_next", "small"))
    with pytest.raises(InvalidArgument, match="host_prefix_pages: options of the paged pool"):
        Engine(qwen, host_prefix_pages=8)
