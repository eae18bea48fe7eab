"""Fuzz of the serving ``Engine`` as a whole, against the per-request
reference of ``tests/test_nn_engine.py``: that request alone through
``jaxkv.nn.generate`` (greedy), truncated at its ``max_new_tokens`` and at
its first EOS.

A scenario is one engine (fixed shapes; preemption by recompute only, or by
swap to a 6-page host pool, with a fallback to recompute when a swap-out
does not fit there; prefix cache on or off) and a few waves of requests,
each wave added and then served by one ``run()``, so requests also arrive
between runs. Within a wave requests arrive at random scheduler steps;
prompts share random prefixes of a few stems (whole pages, partial pages,
identical prompts) under two namespaces; EOS tokens are often picked from
the request's own reference output, so some requests stop early; a few
requests are sampled (temperature 1) beside the greedy ones, and only the
shape of their output is checked. The pool holds 9 blocks and a request may
need 7, so prefix-cache eviction and preemption are common (two explicit
examples force both, one per preemption mode).

After every ``run()``: every greedy output equals its reference, and every
device block is free or held exactly once, by the prefix cache (the
manager's allocator ref counts against the tree's owned blocks), with every
row free, the host pool empty and nothing left pinned.

The bad-input tests check that ``add_request`` and the constructor refuse
what can never be served with an ``InvalidArgument`` naming the argument,
and that the engine still serves its queue correctly afterwards.

Compile budget: one engine shape for the whole file and one host-pool size;
prompts of 9..16 tokens (1..20 under ``JAXKV_HYPOTHESIS=long``), so the
reference ``generate`` compiles for two (width, blocks) buckets; each
prompt's reference is computed once.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from flax import nnx
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from jaxkv.errors import InvalidArgument, KVCacheError
from jaxkv.manager.block_space import FREE
from jaxkv.nn import LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine
from jaxkv.nn.sampling import SamplingParams
from tests.test_nn_engine import CONFIG, PAGE, REF_NEW

VOCAB = CONFIG["vocab_size"]
LONG = os.environ.get("JAXKV_HYPOTHESIS") == "long"
# One shape for every engine of this file (test_nn_engine's, whose decode
# program it shares when both run): 9 allocatable blocks of 4 tokens, while
# one request may need 7 (16 prompt + 12 new tokens); prefill in chunks of 8,
# so long uncached tails (re-admissions after recompute included) take
# several prefill calls.
ENGINE = dict(num_pages=10, page_size=PAGE, max_seqs=4, max_blocks_per_seq=8, decode_chunk=4, prefill_chunk=8)
# Prompt lengths: generate compiles once per (pow2 width, blocks) bucket:
# two for 9..16 tokens, seven for 1..20 (where one request may need all 8
# blocks of a table).
LEN_MIN, LEN_MAX = (1, 20) if LONG else (9, 16)
# 0: recompute only; 6: swap, except that a swap-out the host pool cannot
# hold (a 7-block request, or swapped requests filling it) falls back to
# recompute.
HOST_PAGES = (0, 6)


@pytest.fixture(scope="module")
def model():
    """test_nn_engine's tiny random Llama (same config and seed)."""
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(model):
    """``reference(prompt)``: the first ``REF_NEW`` greedy tokens of
    ``generate(model, [prompt])``, computed once per prompt (greedy decoding
    of fewer tokens, or up to an EOS, is a prefix of it)."""
    cache = {}

    def ref(prompt):
        assert LEN_MIN <= len(prompt) <= LEN_MAX  # a few compiled generate buckets
        key = tuple(prompt)
        if key not in cache:
            cache[key] = generate(model, [list(prompt)], REF_NEW, page_size=PAGE).tokens[0]
        return cache[key]

    return ref


def expected_output(free_run, max_new, eos):
    out = free_run[:max_new]
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out


def check_no_leak(engine):
    """Every device block is free or owned once, by the prefix cache alone;
    every row free, the host pool empty, no prefix pinned."""
    manager = engine.manager
    device = manager.device
    counts = np.asarray(device.ref_counts)
    owned = engine.prefix_cache.device_blocks()
    assert len(owned) == len(set(owned)), f"the tree holds a block twice: {sorted(owned)}"
    assert all(1 <= b < device.num_blocks for b in owned), sorted(owned)
    expected = np.zeros_like(counts)
    expected[owned] = 1
    leaked = {b: int(counts[b]) for b in np.flatnonzero(counts != expected)}
    assert not leaked, f"ref counts {leaked} (block: count) where the tree owns {sorted(owned)}"
    free = np.asarray(device.free_ids)[: int(device.num_free)].tolist()
    assert sorted(free) == np.flatnonzero(counts == 0)[1:].tolist(), "free stack differs from the zero counts"
    assert (np.asarray(manager.status) == FREE).all() and (np.asarray(manager.seq_lens) == 0).all()
    assert (np.asarray(manager.block_tables) == -1).all()
    assert int(manager.host.num_free) == manager.host.capacity and not np.asarray(manager.host.ref_counts).any()
    assert engine.prefix_cache.protected_blocks == 0, "a prefix is still pinned"
    engine.prefix_cache.check_invariants()


# ------------------------------------------------------------------ scenarios


@dataclasses.dataclass(frozen=True)
class Req:
    prompt: tuple
    max_new: int
    eos: tuple | None  # ("ref", i): the reference's i-th token; ("token", t)
    arrival: int  # scheduler steps after the wave is added
    namespace: str | None
    temperature: float  # > 0: sampled, so only its shape is checked


@dataclasses.dataclass(frozen=True)
class Scenario:
    num_host_pages: int
    prefix_cache: bool
    waves: tuple  # of tuples of Req


tokens = st.integers(0, VOCAB - 1)


@st.composite
def request(draw, stems):
    stem = draw(st.sampled_from(stems))
    # Shared prefixes: whole pages (cache hits), any length (partial pages),
    # the whole stem (identical prompts when nothing is appended).
    shared = draw(st.one_of(st.sampled_from([PAGE, 2 * PAGE, 3 * PAGE, len(stem)]), st.integers(0, len(stem))))
    shared = min(shared, len(stem))
    length = draw(st.integers(max(LEN_MIN, shared), LEN_MAX))
    prompt = tuple(stem[:shared]) + tuple(draw(st.lists(tokens, min_size=length - shared, max_size=length - shared)))
    eos = draw(st.one_of(st.none(), st.tuples(st.just("ref"), st.integers(0, REF_NEW - 1)),
                         st.tuples(st.just("token"), tokens)))
    max_new = draw(st.integers(1, REF_NEW) | st.just(REF_NEW))  # long outputs: memory pressure
    arrival = draw(st.just(0) | st.integers(0, 6))
    namespace = draw(st.sampled_from([None, None, "tenant"]))
    return Req(prompt, max_new, eos, arrival, namespace, draw(st.sampled_from([0.0, 0.0, 0.0, 1.0])))


@st.composite
def scenarios(draw):
    stems = draw(st.lists(st.lists(tokens, min_size=LEN_MIN, max_size=LEN_MAX), min_size=1, max_size=3))
    waves = draw(st.lists(st.lists(request(stems), min_size=1, max_size=7).map(tuple), min_size=1, max_size=3))
    return Scenario(draw(st.sampled_from(HOST_PAGES)), draw(st.booleans() | st.just(True)), tuple(waves))


def pressure(num_host_pages):
    """Four 9-token prompts (3 blocks) that grow to 6 blocks each, the first
    two sharing a two-page prefix, then a wave that shares it too:
    preemption and prefix-cache eviction for sure."""
    rng = np.random.default_rng(5)
    stem = rng.integers(0, VOCAB, 2 * PAGE).tolist()
    prompts = [tuple(stem + rng.integers(0, VOCAB, 1).tolist()) for _ in range(2)]
    prompts += [tuple(rng.integers(0, VOCAB, 9).tolist()) for _ in range(2)]
    first = tuple(Req(p, REF_NEW, None, 0, None, 0.0) for p in prompts)
    second = (Req(tuple(stem) + (1, 2, 3), 6, None, 0, None, 0.0),)
    return Scenario(num_host_pages, True, (first, second))


@pytest.mark.slow
@settings(max_examples=300 if LONG else 20)
@given(scenario=scenarios())
@example(scenario=pressure(0))
@example(scenario=pressure(HOST_PAGES[-1]))
def test_engine_matches_generate_per_request(model, reference, scenario):
    # numpy host pages: the same swap bookkeeping with fewer programs to compile
    engine = Engine(model, num_host_pages=scenario.num_host_pages, host_memory_kind="numpy",
                    prefix_cache=scenario.prefix_cache, **ENGINE)
    for wave in scenario.waves:
        expected = {}
        for req in wave:
            free_run = reference(req.prompt)
            eos = None if req.eos is None else free_run[req.eos[1]] if req.eos[0] == "ref" else req.eos[1]
            # arrival steps count from the engine's current step (waves after the first)
            rid = engine.add_request(list(req.prompt), req.max_new, eos_token_id=eos,
                                     arrival_step=engine._step + req.arrival, namespace=req.namespace,
                                     sampling=SamplingParams(temperature=req.temperature, top_k=5))
            expected[rid] = (req, eos, expected_output(free_run, req.max_new, eos))
            if len(expected[rid][2]) < req.max_new:
                event("a request stopped at EOS")
        summary = engine.run()
        for rid, (req, eos, want) in expected.items():
            out = engine.outputs[rid]
            if req.temperature == 0:
                assert out == want, f"request {rid}: {req}"
            else:  # sampled beside greedy rows: a whole output, stopped where it should
                assert 1 <= len(out) <= req.max_new and all(0 <= t < VOCAB for t in out), (req, out)
                assert eos not in out[:-1] and (len(out) == req.max_new or out[-1] == eos), (req, out)
        assert summary.requests == len(wave)
        assert summary.generated_tokens == sum(len(engine.outputs[rid]) for rid in expected)
        assert 0 < summary.peak_kv_blocks <= summary.kv_blocks
        assert summary.prefix_hit_tokens % PAGE == 0
        check_no_leak(engine)
        for what, happened in [("swap preemption", summary.swap_preemptions),
                               ("recompute preemption", summary.recompute_preemptions),
                               ("prefix hit", summary.prefix_hit_tokens),
                               ("prefix eviction", engine.prefix_cache.stats().evictions)]:
            if happened:
                event(what)


# ---------------------------------------------------------------- bad inputs

GOOD = dict(prompt_tokens=[5, 6, 7, 8, 9], max_new_tokens=3)
BAD_REQUESTS = [
    ("max_new_tokens", dict(max_new_tokens=-1)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=2.0)),
    ("max_new_tokens", dict(max_new_tokens=2.5)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("max_new_tokens", dict(max_new_tokens="3")),
    ("max_new_tokens", dict(max_new_tokens=None)),
    ("max_new_tokens", dict(max_new_tokens=float("nan"))),
    ("max_new_tokens", dict(max_new_tokens=[3])),
    ("prompt_tokens", dict(prompt_tokens=[])),
    ("prompt_tokens", dict(prompt_tokens=np.zeros((0,), np.int32))),
    ("prompt_tokens", dict(prompt_tokens=[5, 6.0, 7])),
    ("prompt_tokens", dict(prompt_tokens=np.array([5.0, 6.0]))),
    ("prompt_tokens", dict(prompt_tokens=[5, True, 7])),
    ("prompt_tokens", dict(prompt_tokens=[5, "6", 7])),
    ("prompt_tokens", dict(prompt_tokens=[5, None, 7])),
    ("prompt_tokens", dict(prompt_tokens=[5, float("nan")])),
    ("prompt_tokens", dict(prompt_tokens=None)),
    ("prompt_tokens", dict(prompt_tokens="567")),
    ("prompt_tokens", dict(prompt_tokens=5)),
    ("prompt_tokens", dict(prompt_tokens=[[5, 6], [7, 8]])),
    ("prompt_tokens", dict(prompt_tokens=[5, VOCAB, 7])),
    ("prompt_tokens", dict(prompt_tokens=[5, -1, 7])),
    ("prompt_tokens", dict(prompt_tokens=[5, 2**31])),
    ("prompt_tokens", dict(prompt_tokens=[5, 2**70])),
    # 30 + 3 tokens: 9 blocks of 4 > max_blocks_per_seq=8
    ("max_blocks_per_seq", dict(prompt_tokens=[5] * 30, max_new_tokens=3)),
    # the prompt alone fits; with its new tokens it does not
    ("max_blocks_per_seq", dict(prompt_tokens=[5] * 20, max_new_tokens=13)),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed="7")),
    ("eos_token_id", dict(eos_token_id=2.0)),
    ("eos_token_id", dict(eos_token_id=True)),
    ("eos_token_id", dict(eos_token_id="6")),
    ("eos_token_id", dict(eos_token_id=VOCAB)),
    ("eos_token_id", dict(eos_token_id=-5)),
    ("arrival_step", dict(arrival_step=-1)),
    ("arrival_step", dict(arrival_step=1.5)),
    ("arrival_step", dict(arrival_step=None)),
    ("sampling", dict(sampling={"temperature": 0.0})),
    ("sampling", dict(sampling=None)),
    ("namespace", dict(namespace=["tenant"])),
]


@pytest.mark.parametrize("name, bad", BAD_REQUESTS, ids=[f"{n}={b}"[:60] for n, b in BAD_REQUESTS])
def test_add_request_refuses_bad_input_and_stays_usable(model, reference, name, bad):
    engine = Engine(model, **ENGINE)
    before = list(range(11, 21))
    first = engine.add_request(before, 4)
    with pytest.raises(InvalidArgument, match=name) as raised:
        engine.add_request(**{**GOOD, **bad})
    assert isinstance(raised.value, KVCacheError)
    after = list(range(21, 32))
    second = engine.add_request(after, 5, eos_token_id=0, arrival_step=1)
    assert second == first + 1  # the refused request took no id and queued nothing
    summary = engine.run()
    assert summary.requests == 2
    assert engine.outputs == {first: reference(before)[:4],
                              second: expected_output(reference(after), 5, 0)}
    check_no_leak(engine)


def test_add_request_accepts_integer_arrays(model, reference):
    engine = Engine(model, **ENGINE)
    prompt = list(range(31, 40))
    rids = [engine.add_request(np.asarray(prompt, dtype), np.int64(3), eos_token_id=np.int32(0),
                               arrival_step=np.uint8(0), sampling=SamplingParams(), namespace=("a", 1))
            for dtype in (np.int32, np.int64, np.uint16)]
    engine.run()
    assert [engine.outputs[rid] for rid in rids] == [expected_output(reference(prompt), 3, 0)] * 3
    check_no_leak(engine)


BAD_ENGINES = [
    ("num_pages", dict(num_pages=1)),
    ("num_pages", dict(num_pages=-3)),
    ("num_pages", dict(num_pages=10.0)),
    ("num_pages", dict(num_pages=True)),
    ("num_pages", dict(num_pages="10")),
    ("kv_cache_memory", dict(num_pages=None, kv_cache_memory=0)),
    ("kv_cache_memory", dict(num_pages=None, kv_cache_memory=1.5)),
    ("kv_cache_memory", dict(num_pages=None, kv_cache_memory="1GB")),
    ("kv_cache_memory", dict(num_pages=None, kv_cache_memory=True)),
    ("kv_cache_memory", dict(num_pages=None, kv_cache_memory=100)),  # less than the tables and one block
    ("kv_cache_memory", dict(kv_cache_memory=1 << 20)),  # beside num_pages
    ("max_model_len", dict(max_model_len=1)),
    ("max_model_len", dict(max_model_len=2.5)),
    ("max_model_len", dict(max_model_len=100)),  # beside max_blocks_per_seq of another width
    ("host_kv_memory", dict(host_kv_memory=-1)),
    ("host_kv_memory", dict(num_host_pages=4, host_kv_memory=1 << 20)),
    ("page_size", dict(page_size=0)),
    ("page_size", dict(page_size=4.0)),
    ("max_seqs", dict(max_seqs=0)),
    ("max_seqs", dict(max_seqs=None)),
    ("max_blocks_per_seq", dict(max_blocks_per_seq=0)),
    ("max_blocks_per_seq", dict(max_blocks_per_seq=8.5)),
    ("num_host_pages", dict(num_host_pages=-1)),
    ("num_host_pages", dict(num_host_pages=2.5)),
    ("decode_chunk", dict(decode_chunk=0)),
    ("decode_chunk", dict(decode_chunk=3.0)),
    ("prefill_chunk", dict(prefill_chunk=0)),
    ("prefill_chunk", dict(prefill_chunk=-8)),
    ("prefill_chunk", dict(prefill_chunk="8")),
    ("host_memory_kind", dict(host_memory_kind="gpu")),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=None)),
]


@pytest.mark.parametrize("name, bad", BAD_ENGINES, ids=[f"{n}={b}"[:60] for n, b in BAD_ENGINES])
def test_engine_refuses_bad_configuration(model, name, bad):
    with pytest.raises(InvalidArgument, match=name) as raised:
        Engine(model, **{**ENGINE, **bad})
    assert isinstance(raised.value, KVCacheError)


# ------------------------------------------------------- defects the fuzz found


def test_a_later_arrival_added_first_does_not_block_an_earlier_one(model, reference):
    """Requests need not be added in arrival order: the one that has arrived
    is served while the other has not (this raised ``KVCacheOOM: ... nothing
    can run`` when the queue head had not arrived yet)."""
    engine = Engine(model, **ENGINE)
    late, early = list(range(41, 50)), list(range(51, 63))
    late_id = engine.add_request(late, 3, arrival_step=2)
    early_id = engine.add_request(early, 4, arrival_step=0)
    engine.run()
    assert engine.outputs == {late_id: reference(late)[:3], early_id: reference(early)[:4]}
    check_no_leak(engine)
