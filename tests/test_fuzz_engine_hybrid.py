"""Fuzz of the serving ``Engine`` over the hybrid families and over
sliding-window models near the pool's edge, against the per-request
reference: that request alone through ``jaxkv.nn.generate`` (greedy, cold),
truncated at its ``max_new_tokens`` and at its first EOS.

* **Hybrid caches** (Qwen3-Next ``tests/fixtures/qwen3_next/small``;
  gpt-oss ``tests/fixtures/gpt_oss/small``, window rings; DeepSeek-V4
  ``tests/fixtures/dsv4/small``): several rows admitted, cut at
  prefix-cache boundaries and retiring in the same iteration, shared prompt
  prefixes (prefix hits restore cached Gated DeltaNet / ring snapshots),
  two cached snapshots for three rows (Qwen3-Next) or one (DeepSeek-V4),
  a pool that forces prefix eviction and recompute preemption, token
  budgets (``max_num_batched_tokens``). Every output equals its cold
  reference, every snapshot copy of one call has its own destination
  (``copy_state`` spied on), and after ``run`` every block of every group
  is free or held once by the prefix cache.
* **Window models** (a tiny random Mistral: a 6-token window on every
  layer, pages of 4, a 4-block pool): prompts up to the whole pool, outputs
  longer than the pool, prefix hits, token budgets, arrivals over time.
* **Acceptance**: random requests near the pool's size, with and without
  a window: each one ``add_request`` accepts finishes (no ``KVCacheOOM:
  nothing can run``, no stall), each one it refuses is an
  ``InvalidArgument`` whose message carries its peak blocks and the pool's,
  and no block leaks.

Compile budget: one engine shape per model (engines are re-created per
example; the jitted steps are shared), prompt lengths chosen so that the
reference ``generate`` compiles for one or two shapes, and each prompt's
reference computed once. ``JAXKV_HYPOTHESIS=long`` runs many more examples;
the DeepSeek-V4 fuzz (compiles dominate) is marked ``long``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import numpy as np
import pytest
from flax import nnx
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import jaxkv.serve.hybrid_cache as hybrid_cache
from jaxkv.errors import InvalidArgument, KVCacheError
from jaxkv.manager.block_space import FREE
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.nn.steps import paged_peak_blocks
from jaxkv.serve import Engine
from tests.test_fuzz_engine import check_no_leak, expected_output
from tests.test_nn_engine import CONFIG

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LONG = os.environ.get("JAXKV_HYPOTHESIS") == "long"


# ------------------------------------------------------------------ helpers


@contextlib.contextmanager
def distinct_snapshot_copies():
    """Spy on the hybrid cache's snapshot copies: within one ``copy_state``
    call no destination may repeat (two states copied into one snapshot:
    which lands is unspecified, and a later hit could restore the other
    request's state). Yields the list of destinations per call."""
    real = hybrid_cache._copy_state
    calls = []

    def spy(manager, src, dst):
        given = [int(d) for d in np.asarray(dst) if d >= 0]
        calls.append(given)
        assert len(given) == len(set(given)), f"one call copies two states into a snapshot: destinations {given}"
        return real(manager, src, dst)

    hybrid_cache._copy_state = spy
    try:
        yield calls
    finally:
        hybrid_cache._copy_state = real


def check_hybrid_no_leak(engine):
    """Every block of every group is free or held exactly as often as the
    prefix cache references it (its pages and its snapshot records' tails);
    rows and slots free; nothing pinned; the snapshot cache's invariants."""
    cache = engine.cache
    held = cache.snapshots.held_blocks()
    for g, (name, group) in enumerate(cache.manager.groups.items()):
        counts = np.asarray(group.allocator.ref_counts)
        expected = np.zeros_like(counts)
        for block, n in held[name].items():
            expected[block] = n
        leaked = {b: int(counts[b]) for b in np.flatnonzero(counts != expected)}
        assert not leaked, f"group {name}: ref counts {leaked} (block: count) where the cache holds {dict(held[name])}"
    assert (cache.row_status() == FREE).all()
    assert int(cache.manager.slots.num_free) == cache.manager.max_requests
    assert cache.prefix_cache.protected_blocks == 0, "a prefix is still pinned"
    assert all(record.pins == 0 for record in cache.snapshots.records.values()), "a snapshot is still pinned"
    cache.prefix_cache.check_invariants()
    cache.snapshots.check_invariants()
    assert cache.host_used() == 0, "a swapped-out image is left on host"


def no_stall(limit=2000):
    """An ``on_progress`` that fails a run going on for ``limit`` iterations."""
    def progress(p):
        assert p.iteration < limit, f"no end after {p.iteration} iterations: {p}"
    return progress


class Subject:
    """A model and its cold reference (``reference(prompt)``), shown by name
    in hypothesis' reports."""

    def __init__(self, name, model, reference):
        self.name, self.model, self.reference = name, model, reference

    def __iter__(self):
        return iter((self.model, self.reference))

    def __repr__(self):
        return self.name


@dataclasses.dataclass(frozen=True)
class Req:
    prompt: tuple
    max_new: int
    eos: int | None  # index into the reference output whose token is the EOS, or None
    arrival: int
    namespace: str | None


def requests(stems, lengths, max_new, page, vocab):
    """Requests whose prompts share page-aligned prefixes of ``stems`` (cache
    hits), or any prefix, or none."""
    @st.composite
    def one(draw):
        stem = draw(st.sampled_from(stems))
        length = draw(st.integers(*lengths))
        shared = min(draw(st.sampled_from([0, page, page, 2 * page, length]) | st.integers(0, length)), len(stem),
                     length)
        tail = draw(st.lists(st.integers(2, vocab - 1), min_size=length - shared, max_size=length - shared))
        eos = draw(st.none() | st.none() | st.integers(0, max_new - 1))
        # max_new 1: done at its prefill, so even a windowed row leaves its
        # whole prompt's pages to the prefix cache (decode trims them).
        return Req(tuple(stem[:shared]) + tuple(tail), draw(st.integers(1, max_new) | st.sampled_from([1, max_new])),
                   eos,
                   draw(st.just(0) | st.integers(0, 4)), draw(st.sampled_from([None, None, "tenant"])))
    return one()


def serve(engine, reference, waves, budget=None, check=None) -> list:
    """Add each wave, run it, compare every output with its reference;
    returns the runs' summaries."""
    engine.max_num_batched_tokens = budget
    summaries = []
    for wave in waves:
        expected = {}
        for req in wave:
            ref = reference(req.prompt)
            eos = None if req.eos is None else ref[req.eos]
            rid = engine.add_request(list(req.prompt), req.max_new, eos_token_id=eos,
                                     arrival_step=engine._step + req.arrival, namespace=req.namespace)
            expected[rid] = (req, expected_output(ref, req.max_new, eos))
        summary = engine.run(on_progress=no_stall())
        summaries.append(summary)
        for rid, (req, want) in expected.items():
            assert engine.outputs[rid] == want, f"request {rid}: {req}"
        assert summary.generated_tokens == sum(len(want) for _, want in expected.values())
        if check is not None:
            check(engine)
        for what, happened in [("recompute preemption", summary.recompute_preemptions),
                               ("prefix hit", summary.prefix_hit_tokens),
                               ("snapshot stored", engine.cache.snapshots.stored
                                if hasattr(engine.cache, "snapshots") else 0)]:
            if happened and currently_in_test_context():
                event(what)
    return summaries


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


def _reference(model, length_range, ref_new):
    """``ref(prompt)``: ``generate(model, [prompt], ref_new)`` alone, cold,
    once per prompt (greedy decoding of fewer tokens, or up to an EOS, is a
    prefix of it)."""
    cache = {}

    def ref(prompt):
        assert length_range[0] <= len(prompt) <= length_range[1]  # the compiled generate shapes
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = generate(model, [list(prompt)], ref_new).tokens[0]
        return cache[tuple(prompt)]

    return ref


# ------------------------------------------------------------ hybrid: Qwen3-Next

# 16-token pages; prompts of 21..32 tokens and 12 reference tokens: generate
# compiles one shape (prefill width 32, context 64). Seven blocks for three
# rows of up to 3 blocks each, beside the prefix cache: eviction and
# preemption. Two cached snapshots for three rows; prefill in 16-token
# pieces, so admitted rows stop together at the 16-token boundary and cache
# their prefixes in one call.
QWEN = dict(max_seqs=3, max_context_tokens=64, num_blocks={"full": 8}, num_snapshots=2, decode_chunk=4,
            prefill_chunk=16)
QWEN_LENGTHS, QWEN_NEW = (21, 32), 12


@pytest.fixture(scope="module")
def qwen():
    model, _ = _fixture("qwen3_next/small")
    return Subject("qwen3_next/small", model, _reference(model, QWEN_LENGTHS, QWEN_NEW))


def _prompts(seed, count, length, vocab):
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(2, vocab, length).tolist()) for _ in range(count)]


def test_qwen3_next_rows_retiring_together_never_share_a_snapshot(qwen):
    """Three rows whose prefill pieces end on their cut (the prompt's last
    token but one) in one packed step, and which retire together, with two
    snapshot rows: a later store in one batch takes the row an earlier
    store of the same batch was just given, before its copy ran. One copy
    per row (the GDN copy refuses a repeated destination: it kept a stale
    state once), and a later hit restores its own prompt's state: probes
    continuing two turns hit their whole turn and give ``generate``'s
    tokens."""
    model, reference = qwen
    vocab = model.config.vocab_size
    a, b, c = _prompts(7, 3, 22, vocab)
    with distinct_snapshot_copies() as calls:
        engine = Engine(model, **QWEN)
        first = [Req(p, 4, None, 0, None) for p in (a, b, c)]
        turns = [p + tuple(reference(p)[:3]) for p in (c, b)]  # each turn's end: prompt + 4 drawn - 1
        probes = [Req(turns[0] + (5, 6, 7, 8, 9), QWEN_NEW, None, 0, None),
                  Req(turns[1] + (9, 8, 7, 6, 5), QWEN_NEW, None, 0, None)]
        # A budget of 64: the three rows' 21-token pieces end in one packed step.
        summaries = serve(engine, reference, [first, probes], budget=64, check=check_hybrid_no_leak)
    assert [s.prefix_hit_tokens for s in summaries] == [0, 2 * 25]  # both probes hit their whole turn
    assert any(len(dst) > 1 for dst in calls), calls  # several rows cached in one call
    assert _reassigned_in_one_call(engine.cache.take_events(), calls), "the scenario did not happen"


@st.composite
def qwen_scenarios(draw):
    vocab = 256
    stems = draw(st.lists(st.lists(st.integers(2, vocab - 1), min_size=32, max_size=32), min_size=1, max_size=2))
    waves = draw(st.lists(st.lists(requests(stems, QWEN_LENGTHS, QWEN_NEW, 16, vocab), min_size=1, max_size=5)
                          .map(tuple), min_size=1, max_size=3))
    return tuple(waves), draw(st.sampled_from([None, None, 20]))


def _qwen_pressure():
    """Three 32-token prompts sharing a page, all at once, with 12 new
    tokens each: 3 blocks each in 7 beside the cache: a preemption; then the
    same prompts again (hits)."""
    rng = np.random.default_rng(3)
    stem = rng.integers(2, 256, 16).tolist()
    prompts = [tuple(stem + rng.integers(2, 256, 16).tolist()) for _ in range(3)]
    wave = tuple(Req(p, QWEN_NEW, None, 0, None) for p in prompts)
    return (wave, wave), None


# "host tiers": the same traffic with one snapshot row, a host tier for the
# prefix cache and host memory for swapped requests: records go to host and
# come back, rows are preempted by swap.
QWEN_HOST = dict(QWEN, num_snapshots=1, host_prefix_memory=1 << 24, host_kv_memory=1 << 24)
# "speculative": the same traffic decoded by n-gram verify steps that never turn off (θ 0): every rejected
# draft is rolled back (GDN states and window rings from the checkpoint rows, blocks truncated).
SPECULATIVE = {"num_speculative_tokens": 3, "min_accepted_per_step": 0.0}
QWEN_SPEC = dict(QWEN, speculative=SPECULATIVE)


def serve_checked(model, options, reference, waves, budget) -> None:
    """:func:`serve` on a fresh engine of ``options``, snapshot copies spied
    on, no block leaked (hypothesis' statistics count the runs whose verify
    steps rejected drafts)."""
    with distinct_snapshot_copies():
        engine = Engine(model, **options)
        serve(engine, reference, waves, budget=budget, check=check_hybrid_no_leak)
    stats = engine.stats()
    if stats.spec_accepted_tokens < stats.spec_draft_tokens and currently_in_test_context():
        event("draft rejected")


@pytest.mark.parametrize("options", [QWEN, QWEN_HOST, QWEN_SPEC], ids=["device", "host tiers", "speculative"])
@settings(max_examples=200 if LONG else 2)
@given(scenario=qwen_scenarios())
@example(scenario=_qwen_pressure())
def test_qwen3_next_engine_matches_generate(qwen, options, scenario):
    model, reference = qwen
    waves, budget = scenario
    serve_checked(model, options, reference, waves, budget)


# ------------------------------------------------------------ hybrid: gpt-oss

# The same traffic on an interleaved window family: gpt-oss's window layers
# (8 tokens: every prompt crosses it three times or more) keep per-request
# rings that hits restore from snapshots, swaps and the host tier carry, and
# sinks on every layer; its full layers take the 16-token pages.
@pytest.fixture(scope="module")
def gptoss():
    model, _ = _fixture("gpt_oss/small")
    return Subject("gpt_oss/small", model, _reference(model, QWEN_LENGTHS, QWEN_NEW))


@pytest.mark.parametrize("options", [QWEN, QWEN_HOST, QWEN_SPEC], ids=["device", "host tiers", "speculative"])
@settings(max_examples=200 if LONG else 2)
@given(scenario=qwen_scenarios())
@example(scenario=_qwen_pressure())
def test_gpt_oss_engine_matches_generate(gptoss, options, scenario):
    model, reference = gptoss
    waves, budget = scenario
    serve_checked(model, options, reference, waves, budget)


# ------------------------------------------------------------ hybrid: DeepSeek-V4

# 128-token prefix unit (one compression block). Prompts of 129..136 tokens,
# 4 reference tokens: one generate shape. One cached snapshot for three rows.
DSV4 = dict(max_seqs=3, max_context_tokens=256, num_blocks={"csa4": 5, "hca16": 5}, num_snapshots=1, decode_chunk=4, prefill_chunk=128)
DSV4_LENGTHS, DSV4_NEW = (129, 136), 4


@pytest.fixture(scope="module")
def dsv4():
    model, _ = _fixture("dsv4/small")
    return Subject("dsv4/small", model, _reference(model, DSV4_LENGTHS, DSV4_NEW))


def test_dsv4_rows_retiring_together_never_share_a_snapshot(dsv4):
    """DeepSeek-V4's rings and windows: three rows retiring together with
    one snapshot row (each later turn end of the batch takes the row the
    previous one was just given). Every hit restores its own prompt's
    state: a probe continuing the last turn hits all of it and gives the
    tokens of ``generate`` alone."""
    model, reference = dsv4
    a, b, c = _prompts(11, 3, 130, model.config.vocab_size)
    with distinct_snapshot_copies() as calls:
        engine = Engine(model, **DSV4)
        first = [Req(p, DSV4_NEW, None, 0, None) for p in (a, b, c)]
        probe = [Req(c + tuple(reference(c)[:3]) + (5, 6, 7), DSV4_NEW, None, 0, None)]
        summaries = serve(engine, reference, [first, probe], check=check_hybrid_no_leak)
        assert [s.prefix_hit_tokens for s in summaries] == [0, 133]  # the turn: 130 + 4 drawn - 1
        # A token budget on the same engine: the three again, in pieces of at
        # most 64 tokens (each evicts the previous one's snapshot again).
        serve(engine, reference, [[Req(p, DSV4_NEW, None, 0, None) for p in (a, b, c)]], budget=64,
              check=check_hybrid_no_leak)
    assert calls
    assert _reassigned_in_one_call(engine.cache.take_events(), calls), "the scenario did not happen"


def _reassigned_in_one_call(events, calls) -> bool:
    """Whether some snapshot record was stored and dropped again before its
    state was copied: more records stored than state copies made (the
    copies of one call have distinct rows; a row given twice in a batch
    gets one copy, the later record's)."""
    stored = sum(1 for e in events if e[0] == "stored")
    return stored > sum(len(dst) for dst in calls)


@settings(max_examples=100 if LONG else 4)
@given(data=st.data())
def test_dsv4_engine_matches_generate(dsv4, data):
    model, reference = dsv4
    vocab = model.config.vocab_size
    stems = data.draw(st.lists(st.lists(st.integers(2, vocab - 1), min_size=136, max_size=136), min_size=1,
                               max_size=2))
    waves = data.draw(st.lists(st.lists(requests(stems, DSV4_LENGTHS, DSV4_NEW, 128, vocab), min_size=1, max_size=4)
                               .map(tuple), min_size=1, max_size=2))
    options = data.draw(st.sampled_from([DSV4, dict(DSV4, speculative=SPECULATIVE)]))
    serve_checked(model, options, reference, waves, data.draw(st.sampled_from([None, 64])))


# ------------------------------------------------------------ window models

PAGE = 4
WINDOW = 6
WINDOWED = dict(CONFIG, model_type="mistral", sliding_window=WINDOW)
# A 4-block pool: a 16-token prompt fills it, and outputs of up to 24 tokens
# run in the window's blocks. Prompts of 9..16 tokens and 24 reference
# tokens: generate compiles two shapes (9 and 10 table blocks).
WIN = dict(num_pages=5, page_size=PAGE, max_seqs=3, max_blocks_per_seq=10, decode_chunk=4, prefill_chunk=8)
WIN_LENGTHS, WIN_NEW = (9, 16), 24


@pytest.fixture(scope="module")
def mistral():
    model = LlamaForCausalLM(LlamaConfig.from_hf(WINDOWED), rngs=nnx.Rngs(1))
    cache = {}

    def ref(prompt):
        assert WIN_LENGTHS[0] <= len(prompt) <= WIN_LENGTHS[1]
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = generate(model, [list(prompt)], WIN_NEW, page_size=PAGE).tokens[0]
        return cache[tuple(prompt)]

    return Subject("mistral (window 6)", model, ref)


@st.composite
def window_scenarios(draw):
    vocab = CONFIG["vocab_size"]
    stems = draw(st.lists(st.lists(st.integers(2, vocab - 1), min_size=16, max_size=16), min_size=1, max_size=2))
    waves = draw(st.lists(st.lists(requests(stems, WIN_LENGTHS, WIN_NEW, PAGE, vocab), min_size=1, max_size=5)
                          .map(tuple), min_size=1, max_size=3))
    return tuple(waves), draw(st.sampled_from([None, None, 6]))


def _window_edge():
    """A pool-filling prompt, its page-aligned prefixes as hits, outputs of
    twice the pool, all at once."""
    stem = tuple(np.random.default_rng(4).integers(2, CONFIG["vocab_size"], 16).tolist())
    first = (Req(stem, 1, None, 0, None),)  # cached whole (no decode step trims it)
    # A one-page hit leaves room for the window (admitted on it); longer
    # hits do not (admitted without them, as the fit rule counted).
    second = tuple(Req(stem[:n] + (3,) * (16 - n), WIN_NEW, None, 0, None) for n in (4, 16, 12, 8))
    return (first, second), None


@settings(max_examples=200 if LONG else 4)
@given(scenario=window_scenarios())
@example(scenario=_window_edge())
def test_window_engine_matches_generate(mistral, scenario):
    model, reference = mistral
    waves, budget = scenario
    engine = Engine(model, **WIN)

    serve(engine, reference, waves, budget=budget, check=check_no_leak)


# ------------------------------------------------------------ acceptance

ACCEPT = dict(num_pages=5, page_size=PAGE, max_seqs=3, max_blocks_per_seq=8, decode_chunk=4, prefill_chunk=8)


class _Models(dict):
    def __repr__(self):
        return "paged_models"


@pytest.fixture(scope="module")
def paged_models(mistral):
    return _Models(window=mistral.model, full=LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0)))


@settings(max_examples=300 if LONG else 12)
@given(kind=st.sampled_from(["window", "full"]),
       sizes=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 24), st.integers(0, 3)), min_size=1, max_size=6),
       shared=st.booleans(), budget=st.sampled_from([None, 5]), seed=st.integers(0, 2**16))
def test_an_accepted_request_finishes(paged_models, kind, sizes, shared, budget, seed):
    """Requests near a 4-block pool (8 blocks per row), random lengths and
    outputs, some sharing a prefix: ``add_request`` refuses exactly those
    whose peak exceeds the pool or whose tokens exceed a row, with an
    ``InvalidArgument`` carrying both numbers; every request it accepts
    finishes with its whole output; no block leaks."""
    model = paged_models[kind]
    window = WINDOW if kind == "window" else None
    engine = Engine(model, max_num_batched_tokens=budget, **ACCEPT)
    rng = np.random.default_rng(seed)
    stem = rng.integers(2, CONFIG["vocab_size"], 24).tolist()
    accepted = {}
    for length, max_new, arrival in sizes:
        prompt = stem[:length] if shared else rng.integers(2, CONFIG["vocab_size"], length).tolist()
        peak = paged_peak_blocks(length, length + max_new, PAGE, window)
        fits = peak <= 4 and length + max_new <= 8 * PAGE
        try:
            rid = engine.add_request(prompt, max_new, arrival_step=arrival)
        except InvalidArgument as err:
            assert not fits, f"{length} + {max_new} tokens (peak {peak} blocks) refused: {err}"
            assert isinstance(err, KVCacheError)
            assert f"{length} + {max_new} tokens need blocks [{peak}]" in str(err) and "4 blocks" in str(err), err
            event("refused")
            continue
        assert fits, f"{length} + {max_new} tokens (peak {peak} blocks of 4) accepted"
        accepted[rid] = max_new
    engine.run(on_progress=no_stall())
    for rid, max_new in accepted.items():
        assert len(engine.outputs[rid]) == max_new, (rid, engine.outputs[rid])
    check_no_leak(engine)


@settings(max_examples=100 if LONG else 4)
@given(sizes=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 24), st.integers(0, 3)), min_size=1, max_size=5),
       shared=st.booleans(), budget=st.sampled_from([None, 20]), seed=st.integers(0, 2**16))
def test_an_accepted_request_finishes_on_a_hybrid_cache(qwen, sizes, shared, budget, seed):
    """The same on Qwen3-Next's cache (7 blocks of 16 tokens, rows of 64
    tokens, three rows): accepted requests finish, refused ones are an
    ``InvalidArgument`` with the numbers, nothing leaks."""
    model, _ = qwen
    engine = Engine(model, max_num_batched_tokens=budget, **QWEN)
    rng = np.random.default_rng(seed)
    stem = rng.integers(2, model.config.vocab_size, 60).tolist()
    accepted = {}
    for length, max_new, arrival in sizes:
        prompt = stem[:length] if shared else rng.integers(2, model.config.vocab_size, length).tolist()
        fits = length + max_new <= QWEN["max_context_tokens"]
        try:
            rid = engine.add_request(prompt, max_new, arrival_step=arrival)
        except InvalidArgument as err:
            assert not fits, f"{length} + {max_new} tokens refused: {err}"
            blocks = -(-(length + max_new) // 16)
            assert f"{length} + {max_new} tokens need blocks [{blocks}]" in str(err), err
            assert "max_context_tokens=64" in str(err), err
            continue
        assert fits, f"{length} + {max_new} tokens accepted"
        accepted[rid] = max_new
    engine.run(on_progress=no_stall())
    for rid, max_new in accepted.items():
        assert len(engine.outputs[rid]) == max_new, (rid, engine.outputs[rid])
    check_hybrid_no_leak(engine)
