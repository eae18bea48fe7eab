"""One sizing rule for every family (issue 27 item 2): ``Engine(model)``
with no sizing argument, ``max_model_len=`` and ``kv_cache_memory=`` (bytes,
or a fraction of the free memory) for the Llama family and DeepSeek-V3 (a
paged pool) and DeepSeek-V4 and Qwen3-Next (a hybrid cache), on the
committed fixtures and a tiny random Llama.

Compile budget: one served engine per family (default sizing; Qwen3-Next's
shapes are ``test_engine_online``'s); every other engine here is only built
(the sizing arithmetic and the arrays), never run.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine, sizing

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = ["llama", "dsv3/small", "dsv4/small", "qwen3_next/small"]
MiB = 1 << 20


@functools.lru_cache(maxsize=None)
def model(name):
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig.from_hf(LLAMA), rngs=nnx.Rngs(0))
    return AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))


@functools.lru_cache(maxsize=None)
def expected(name):
    """``(prompt, greedy tokens)``: transformers' for a fixture, ``generate``'s for the tiny Llama."""
    if name == "llama":
        prompt = np.random.default_rng(0).integers(1, LLAMA["vocab_size"], 11).tolist()
        return prompt, generate(model(name), [prompt], 8).tokens[0]
    with open(os.path.join(FIXTURES, name, "expected.json"), encoding="utf-8") as f:
        data = json.load(f)
    return data["prompts"][1], data["greedy"][1]


def slack(engine) -> int:
    """Bytes one more block of every group costs: the rule leaves less than this of a budget unused."""
    return sum(g.bytes_per_block for g in engine.cache_plan.groups)


# DeepSeek-V4 in the long pass (tests/conftest.py; Qwen3-Next covers the hybrid cache's rule here).
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_with_no_sizing_argument_serves_every_family(name, caplog):
    """``Engine(model)``: ``max_model_len`` = min(max_position_embeddings,
    1024 on the CPU, 4096 elsewhere), every sequence row at that length (the
    default budget's cap on the CPU's stand-in free memory), the plan logged
    per group, and the request gets the reference tokens."""
    m = model(name)
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        engine = Engine(m)
    plan = engine.cache_plan
    assert plan.max_model_len == engine.max_model_len == min(m.config.max_position_embeddings, 1024)
    assert sizing.default_max_model_len(m, "gpu") == min(m.config.max_position_embeddings, 4096)
    assert plan.budget_bytes is None and "every sequence row" in plan.source
    assert plan.device_bytes == engine.cache.device_bytes()
    for group, capacity, need in zip(plan.groups, engine.cache.capacity, engine.cache.blocks_for(plan.max_model_len)):
        assert group.blocks == capacity == plan.max_seqs * need
        assert group.tokens == group.blocks * group.tokens_per_block and group.bytes_per_token > 0
    logged = [r.getMessage() for r in caplog.records if r.name == "jaxkv.serve"]
    for group in plan.groups:
        assert any(f"group {group.name!r}: {group.tokens} tokens" in line and "bytes per token" in line
                   and f"prefix hit unit {plan.prefix_unit_tokens} tokens" in line for line in logged), logged
    prompt, want = expected(name)
    new = min(len(want), 8)
    rid = engine.add_request(prompt, new)
    engine.run()
    assert engine.outputs[rid] == want[:new]


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_memory_bytes_bound_the_cache(name):
    """``kv_cache_memory=N``: the cache's device arrays take at most N bytes
    and less than one more block per group below it; every group holds
    about the same tokens (within a block)."""
    m = model(name)
    for budget in (3 * MiB, 5 * MiB + 12345):
        engine = Engine(m, kv_cache_memory=budget, max_model_len=128)
        plan = engine.cache_plan
        used = engine.cache.device_bytes()
        assert plan.device_bytes == used and plan.budget_bytes == budget
        assert used <= budget < used + slack(engine), (used, budget, slack(engine))
        most = max(g.tokens for g in plan.groups)
        assert all(most - g.tokens < g.tokens_per_block for g in plan.groups)
        if plan.cache == "hybrid" and plan.num_snapshots:  # snapshots take at most a quarter of the budget
            assert plan.num_snapshots <= 2 * plan.max_seqs
            assert plan.num_snapshots * plan.snapshot_bytes <= budget // 4


@pytest.mark.parametrize("name", FAMILIES)
def test_max_model_len_refuses_a_longer_request_with_the_numbers(name):
    engine = Engine(model(name), max_model_len=64)
    assert engine.cache_plan.max_model_len == 64
    with pytest.raises(InvalidArgument, match=r"60 \+ 5 tokens need blocks .* max_model_len=64"):
        engine.add_request([1] * 60, 5)
    engine.add_request([1] * 60, 4)  # exactly fits
    assert len(engine._waiting) == 1  # the refused one was never queued


def test_a_fraction_of_the_free_memory():
    m = model("llama")
    engine = Engine(m, kv_cache_memory=0.25, free_bytes=8 * MiB)
    assert engine.cache_plan.budget_bytes == 2 * MiB
    assert engine.cache.device_bytes() <= 2 * MiB < engine.cache.device_bytes() + slack(engine)
    # On the CPU there are no memory statistics: CPU_FREE_BYTES stands for the free memory.
    assert sizing.device_free_bytes() is None
    assert sizing.resolve_budget(0.5) == (sizing.CPU_FREE_BYTES // 2, sizing.resolve_budget(0.5)[1])


    class Device:  # what a GPU's memory_stats says
        def memory_stats(self):
            return {"bytes_limit": 80 * MiB, "bytes_in_use": 16 * MiB, "peak_bytes_in_use": 20 * MiB}

    assert sizing.device_free_bytes(Device()) == 64 * MiB
    for bad in (0.0, 1.5, -2, 0, True, "1GB", None):
        with pytest.raises(InvalidArgument, match="kv_cache_memory"):
            sizing.resolve_budget(bad)


def test_default_max_model_len_shrinks_to_the_budget_an_explicit_one_is_refused(caplog):
    m = model("llama")  # 256 bytes per token
    budget = 40_000  # about 100 tokens beside the tables
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        engine = Engine(m, kv_cache_memory=budget)
    plan = engine.cache_plan
    assert plan.max_model_len <= plan.groups[0].tokens < 256
    assert any("lowered to" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidArgument, match=r"max_model_len=256: .* pages of 16 at its peak; the pool has \d+"):
        Engine(m, kv_cache_memory=budget, max_model_len=256)
    with pytest.raises(InvalidArgument, match=r"kv_cache_memory=1000 bytes: 1000 bytes do not hold"):
        Engine(m, kv_cache_memory=1000)


def test_contradictory_sizing_options_are_refused():
    llama, qwen = model("llama"), model("qwen3_next/small")
    for kw, words in [(dict(num_pages=64, kv_cache_memory=MiB), "num_pages=64 and kv_cache_memory"),
                      (dict(max_blocks_per_seq=8, max_model_len=100), "max_model_len=100 and max_blocks_per_seq=8"),
                      (dict(num_host_pages=8, host_kv_memory=MiB), "num_host_pages=8 and host_kv_memory"),
                      (dict(num_pages=9, max_model_len=256), r"max_model_len=256: .* the pool has 8")]:
        with pytest.raises(InvalidArgument, match=words):
            Engine(llama, **kw)
    for kw, words in [(dict(num_blocks={"full": 9}, kv_cache_memory=MiB), "num_blocks=.* and kv_cache_memory"),
                      (dict(max_context_tokens=64, max_model_len=32), "disagree"),
                      (dict(kv_dtype="bfloat16"), "kv_dtype: options of the paged pool"),
                      (dict(snapshot_retention="fifo"), "snapshot_retention='fifo'")]:
        with pytest.raises(InvalidArgument, match=words):
            Engine(qwen, **kw)
    with pytest.raises(InvalidArgument, match="snapshot_retention: options of a hybrid cache"):
        Engine(llama, snapshot_retention="lru")
    # The expert options still size the cache as they did.
    engine = Engine(llama, num_pages=10, page_size=4, max_blocks_per_seq=8)
    assert engine.cache_plan.groups[0].blocks == 9 and engine.max_model_len == 32
    assert engine.cache_plan.budget_bytes is None and "num_pages=10" in engine.cache_plan.source
    engine = Engine(qwen, max_context_tokens=64, num_blocks={"full": 9})
    assert engine.cache_plan.group("full").blocks == 8 and engine.max_model_len == 64


def test_host_kv_memory_gives_host_pages():
    m = model("llama")
    page = Engine(m, max_model_len=64).cache_plan.groups[0].bytes_per_token * 16
    engine = Engine(m, max_model_len=64, host_kv_memory=int(20 * page), host_memory_kind="numpy")
    assert engine.cache_plan.host_pages == 20 and engine.cache.can_swap
    assert engine.cache_plan.host_bytes == 20 * page


def test_options_are_checked_not_coerced():
    """Issue 39 item 7: a yes/no option takes a bool (``"no"`` would be
    true), a quota a number (not ``"0.5"``), ``kv_dtype`` a storage dtype
    (``"bogus"`` raised ``TypeError``), the hybrid length ``max_context_tokens``
    what ``max_model_len`` takes (at least 2: one engine that could serve
    nothing), each refused with ``InvalidArgument`` naming it."""
    llama = model("llama")
    for options, name in [(dict(scrub_on_free="no"), "scrub_on_free"), (dict(enable_kv_events=1), "enable_kv_events"),
                          (dict(prefix_cache="off"), "prefix_cache"), (dict(prefix_quota="0.5"), "prefix_quota"),
                          (dict(prefix_quota=True), "prefix_quota"), (dict(kv_dtype="bogus"), "bogus"),
                          (dict(seed=2**64), "seed")]:
        with pytest.raises(InvalidArgument, match=name):
            Engine(llama, num_pages=8, **options)
    with pytest.raises(InvalidArgument, match="max_context_tokens=1: must be >= 2"):
        Engine(model("qwen3_next/small"), max_context_tokens=1)
    with pytest.raises(InvalidArgument, match="max_model_len=1: must be >= 2"):
        Engine(model("qwen3_next/small"), max_model_len=1)
    engine = Engine(llama, num_pages=8, scrub_on_free=np.bool_(False), prefix_quota=0.5)  # numpy bools and floats
    assert engine.cache.scrub is False


def test_an_expert_pool_smaller_than_the_default_length_advertises_what_it_holds():
    """``Engine(model, num_pages=2)`` said ``max_model_len`` 256 over a
    one-page pool (16 tokens): the default is lowered to what the pool
    holds, as it is for a memory budget; an explicit one is refused."""
    llama = model("llama")
    engine = Engine(llama, num_pages=2)
    assert engine.max_model_len == 16 == engine.cache_plan.max_model_len
    rid = engine.add_request(list(range(1, 9)), 8)  # 16 tokens: the whole pool
    engine.run()
    assert len(engine.outputs[rid]) == 8
    with pytest.raises(InvalidArgument, match="can never fit"):
        engine.add_request(list(range(1, 9)), 9)
    with pytest.raises(InvalidArgument, match="max_model_len=64"):
        Engine(llama, num_pages=2, max_model_len=64)
