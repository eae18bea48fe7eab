"""The engine serving every family: hybrid-cache models (DeepSeek-V4,
Qwen3-Next, gpt-oss, Gemma 3) over their ``KVCacheManager``, with transformers' greedy tokens
(the fixtures of ``test_nn_deepseek_v4`` / ``test_nn_qwen3_next_dsv3``)
under block pressure that forces recompute preemptions and every slot and
block back when the run ends; and a sliding-window model (Mistral) whose
requests outgrow the pool but not their window. (DeepSeek-V3 and the Llama
family: ``test_nn_qwen3_next_dsv3.test_dsv3_runs_on_the_engine``,
``test_nn_engine``.)
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import FREE
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# (fixture, blocks per group, decode chunk): tight enough that requests
# admitted together outgrow the free blocks and one is preempted. DeepSeek-V4
# meets transformers' tokens on the engine in the prefix test below (its
# recompute preemption is the same HybridCache code: CI time).
CASES = {  # fixture -> (blocks per group, decode chunk, whether the second pass must hit)
    # Qwen3-Next's second pass, prefilled in pieces of at most 24 // P tokens per lane (P prefill lanes: its
    # Gated DeltaNet view holds at most the budget), takes more steps, and under this block pressure the
    # first pass's snapshots can be evicted before a request that would hit them is admitted (as for the
    # window families below): its hits are checked, at token grain, in the prefix test.
    "qwen3_next/small": ({"full": 12}, 2, False),
    # Interleaved window families: only the full layers take blocks (prompts of up to 61 + 12 tokens hold 5
    # pages of 16; three admitted together outgrow 12); the window layers' rings go with the slot. Their
    # prompts' snapshots (5 .. 61 tokens) all end inside a page, so each holds a tail block, and this block
    # pressure evicts them before the second pass reaches them: their hits are checked in the prefix test.
    "gpt_oss/small": ({"full": 12}, 2, False),
    "gemma3/small": ({"full": 12}, 2, False),
}


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_tokens_equal_transformers_under_preemption(name):
    model, expected = _fixture(name)
    num_blocks, chunk, second_hits = CASES[name]
    engine = Engine(model, max_seqs=3, max_context_tokens=256, num_blocks=num_blocks, decode_chunk=chunk,
                    prefill_chunk=64)
    # Longest first, all at once: the first three are admitted together.
    order = np.argsort([-len(p) for p in expected["prompts"]])
    ids = {int(i): engine.add_request(expected["prompts"][i], expected["max_new_tokens"]) for i in order}
    summary = engine.run()
    for i, rid in ids.items():
        assert engine.outputs[rid] == expected["greedy"][i], f"prompt {i}"
    assert summary.recompute_preemptions > 0 and summary.swap_preemptions == 0
    # Again, prefilled in pieces of at most 24 tokens between decode chunks (a
    # token budget): the prompts long enough to hold a cached boundary hit,
    # under the same block pressure (cached pages evicted for running requests).
    engine.max_num_batched_tokens = 24
    again = {int(i): engine.add_request(expected["prompts"][i], expected["max_new_tokens"]) for i in order}
    second = engine.run()
    for i, rid in again.items():
        assert engine.outputs[rid] == expected["greedy"][i], f"prompt {i}, second time"
    # Every prompt is served again: each hits its first run's prompt-end snapshot (all but its last token)
    # unless block pressure evicted it.
    assert (0 < second.prefix_hit_tokens if second_hits else 0 <= second.prefix_hit_tokens) and \
        second.prefix_hit_tokens <= sum(len(p) - 1 for p in expected["prompts"])
    assert any(event[0] == "stored" for event in engine.cache.take_events())
    assert summary.generated_tokens == sum(map(len, expected["greedy"]))
    counts = engine.stats()  # packed steps: one model call in every iteration that ran the model
    assert counts.model_calls == counts.model_iterations > 0
    assert 0 < second.peak_kv_blocks <= summary.kv_blocks == int(engine.cache.capacity.sum())
    assert engine.cache.blocks_in_use() == _tree_blocks(engine) and (engine.cache.row_status() == FREE).all()
    assert int(engine.manager.slots.num_free) == engine.manager.max_requests


def test_hybrid_engine_preempts_by_swap_and_gives_transformers_tokens():
    """With host memory for request images, the hybrid engine preempts by
    swap (every group's blocks and the GDN states to host and back) and the
    tokens are still transformers' greedy ones; every slot, block and image
    comes back."""
    model, expected = _fixture("qwen3_next/small")
    engine = Engine(model, max_seqs=3, max_context_tokens=256, num_blocks={"full": 12}, decode_chunk=2,
                    prefill_chunk=64, host_kv_memory=1 << 26, prefix_cache=False)
    order = np.argsort([-len(p) for p in expected["prompts"]])
    ids = {int(i): engine.add_request(expected["prompts"][i], expected["max_new_tokens"]) for i in order}
    summary = engine.run()
    for i, rid in ids.items():
        assert engine.outputs[rid] == expected["greedy"][i], f"prompt {i}"
    assert summary.swap_preemptions > 0
    assert engine.cache.blocks_in_use() == 0 and (engine.cache.row_status() == FREE).all()
    assert engine.cache.host_used() == 0 and int(engine.manager.slots.num_free) == engine.manager.max_requests


def _tree_blocks(engine):
    """Distinct blocks the prefix cache holds (pages and snapshot tails), all groups."""
    return sum(len(held) for held in engine.cache.snapshots.held_blocks().values())


def test_hybrid_engine_refuses_what_it_cannot_do():
    model, _ = _fixture("qwen3_next/small")
    for bad, word in [(dict(num_pages=64, max_blocks_per_seq=8), "num_pages"), (dict(kv_dtype="bfloat16"), "kv_dtype"),
                      (dict(num_host_pages=8), "num_host_pages")]:
        with pytest.raises(InvalidArgument, match=word):
            Engine(model, max_context_tokens=64, **bad)
    with pytest.raises(InvalidArgument, match="max_context_tokens=64 and max_model_len=32|max_model_len=32 and "
                       "max_context_tokens=64"):
        Engine(model, max_context_tokens=64, max_model_len=32)
    engine = Engine(model, max_seqs=2, max_context_tokens=64)
    with pytest.raises(InvalidArgument, match="max_context_tokens=64"):
        engine.add_request([1] * 60, 5)
    engine.add_request([1] * 60, 4)  # exactly fits


def test_windowed_requests_longer_than_the_pool_run_in_window_memory():
    """Mistral with a 6-token window on every layer, pages of 4, 5 blocks:
    each request holds 36 tokens (9 blocks) by its end, which only fits
    because decode gives back the blocks that left the window. Tokens equal
    ``generate`` alone (itself checked against the no-cache windowed forward
    in ``test_nn_llama``)."""
    config = LlamaConfig.from_hf(dict(
        model_type="mistral", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=256, sliding_window=6, tie_word_embeddings=False))
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    engine = Engine(model, num_pages=6, page_size=4, max_seqs=2, max_blocks_per_seq=16, decode_chunk=4)
    rng = np.random.default_rng()
    prompts = [rng.integers(1, 97, 6).tolist() for _ in range(3)]
    ids = [engine.add_request(p, 30) for p in prompts]
    summary = engine.run()
    for rid, prompt in zip(ids, prompts):
        assert engine.outputs[rid] == generate(model, [prompt], 30, page_size=4).tokens[0]
    assert summary.peak_kv_blocks <= 5 and engine.cache.blocks_in_use() == 0
    assert engine.prefix_cache.device_blocks() == []  # trimmed rows have no prefix left to cache


# ------------------------------------------------------------------ prefix cache

PREFIX_CASES = {  # fixture -> (shared prompt length, new tokens, blocks per group: room for every cached page)
    "dsv4/small": (300, 6, {"csa4": 24, "hca16": 24}),  # 128-token blocks: the prompt's boundaries 128, 256
    "qwen3_next/small": (70, 12, None),  # 16-token pages; its decode crosses 80: the second turn hits there
    "gpt_oss/small": (70, 12, None),  # window 8: every hit restores rings that crossed the window many times
    "gemma3/small": (70, 12, None),
}


@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_hybrid_prefix_hits_give_the_cold_tokens(name):
    """Repeat a prompt, extend it inside its last block, diverge in the
    middle of a cached page, and a second turn appending to the first turn:
    every hit gives exactly the tokens of a cold run of the same prompt (the
    same engine, in a namespace of its own, so nothing is shared), and each
    hit is as long as the state kept, at token grain: a prompt's snapshot
    at its last token but one, a turn's at its end."""
    model, expected = _fixture(name)
    length, new, num_blocks = PREFIX_CASES[name]
    engine = Engine(model, max_seqs=2, max_context_tokens=512, decode_chunk=4, prefill_chunk=64, num_snapshots=16,
                    num_blocks=num_blocks)
    unit = engine.cache.unit
    # First the fixture's prompts, cold: transformers' greedy tokens.
    ids = [engine.add_request(p, expected["max_new_tokens"], namespace="fixture") for p in expected["prompts"]]
    engine.run()
    assert [engine.outputs[i] for i in ids] == expected["greedy"]
    rng = np.random.default_rng()
    base = rng.integers(1, model.config.vocab_size, length).tolist()
    fresh = itertools.count()

    def serve(prompts):
        ids = [engine.add_request(p, new, namespace="shared") for p in prompts]
        engine.run()
        hits = [engine.cached_tokens(rid) for rid in ids]
        cold = [engine.add_request(p, new, namespace=("cold", next(fresh))) for p in prompts]
        assert engine.run().prefix_hit_tokens == 0
        for rid, cold_id, p in zip(ids, cold, prompts):
            assert engine.outputs[rid] == engine.outputs[cold_id], f"{len(p)}-token prompt"
        return hits, [engine.outputs[rid] for rid in ids]

    first = unit * (length // unit // 2 or 1) + 3  # a shorter prompt, ending inside a page
    hits, _ = serve([base[:first]])
    assert hits == [0]
    hits, outputs = serve([base])  # the shorter prompt's snapshot (its last token but one), not rounded down
    assert hits[0] == first - 1 or first - 1 < hits[0] < first + new  # (its output may agree with base for a token)
    boundary = (length - 1) // unit * unit
    diverged = base[: boundary - 1] + rng.integers(1, model.config.vocab_size, 9).tolist()
    hits, _ = serve([base, base + base[:3], diverged])  # repeat, extend, diverge mid-page
    assert hits[:2] == [length - 1, length - 1]
    assert first - 1 <= hits[2] <= boundary - 1
    turn = base + outputs[0] + rng.integers(1, model.config.vocab_size, 5).tolist()
    hits, _ = serve([turn])  # the first turn's end: all of it but the last token drawn (never written)
    assert hits == [length + new - 1]
    stats = engine.cache.prefix_stats()
    assert stats["unit_tokens"] == unit and 0 < stats["snapshots"] <= 16
    counts = engine.stats()  # packed steps: one model call in every iteration that ran the model
    assert counts.model_calls == counts.model_iterations > 0 and 0 <= counts.padding_slots < counts.token_slots
    assert engine.cache.blocks_in_use() == _tree_blocks(engine) and (engine.cache.row_status() == FREE).all()


def test_gated_deltanet_prefill_lanes_hold_at_most_the_budget():
    """Gated DeltaNet views a packed step's prefill lanes as ``[P, width]``
    (``P`` a power of two): each lane's piece is capped at ``budget // P``
    (``HybridCache.prefill_lane_cap``), so the view holds at most the
    token budget (with a width of the whole budget, Qwen3-Next at the GPU
    default of 8,192 tokens needed 210 GB of temporaries; docs/gpu.md). The
    cut pieces run on in later steps: transformers' greedy tokens still."""
    model, expected = _fixture("qwen3_next/small")
    budget = 64
    engine = Engine(model, max_seqs=4, max_context_tokens=256, prefill_chunk=budget, max_num_batched_tokens=budget)
    cache = engine.cache
    assert [cache.prefill_lane_cap(n, budget) for n in (1, 2, 3, 4)] == [64, 32, 16, 16]
    calls, packed_call = [], cache._packed_call

    def spy(graphdef, params, prefill, decode, sampling, keys, num_tokens, **kwargs):
        calls.append((cache._prefill_rows(len(prefill)), min(num_tokens, kwargs["prefill_width"]),
                      max((len(lane.tokens) for lane in prefill), default=0)))
        return packed_call(graphdef, params, prefill, decode, sampling, keys, num_tokens, **kwargs)

    cache._packed_call = spy
    ids = {i: engine.add_request(p, expected["max_new_tokens"]) for i, p in enumerate(expected["prompts"])}
    engine.run()
    for i, rid in ids.items():
        assert engine.outputs[rid] == expected["greedy"][i], f"prompt {i}"
    assert calls and all(rows * width <= budget and longest <= width for rows, width, longest in calls), calls
    assert any(rows > 1 for rows, _, _ in calls)  # several prompts shared a step, each within its cap
