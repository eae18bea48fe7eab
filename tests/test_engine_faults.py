"""A step is all or nothing (issue 39; the engine's "Failures"): faults
injected at random points of ``Engine.step`` over random traffic.

Where a fault is injected (:class:`Faults`, each point armed with a small
probability at every pass):

* **a request's own part** (attributed): its sampling row as the device
  takes it, or its detokenizer. That request alone finishes with
  ``"error"``; its tokens so far are a prefix of its cold run.
* **the engine's part** (contained): before or after a jitted call (packed
  step, prefill, decode chunk), before or after the cache's admission,
  retirement, swap out and swap in. The cache is rebuilt empty and the
  requests in flight are re-queued with their tokens.

Checked against a reference we did not write into the engine: each request
alone through ``jaxkv.nn.generate`` (greedy, cold). Every request that did
not fail finishes with exactly its cold tokens, whatever failed beside it;
a failed or aborted one got a prefix of them; what a request was streamed
(``RequestOutput.new_token_ids``) is what it finished with; and at the end
every block is free or held once by the prefix cache, no row held, nothing
pinned. The paged pool's unwritten pages are NaN (poisoned at start and
after every rebuild), so a cached prefix that served a token nobody
computed would turn that request's tokens to garbage, not to plausible
ones.

Default pass: the tiny Llama (paged pool, swap to host; 4 examples) and
Qwen3-Next (hybrid cache: Gated DeltaNet states and snapshots; one
scenario); ``long``: 30 Llama examples (200 with ``JAXKV_HYPOTHESIS=long``)
and three scenarios (six) of every hybrid family: Qwen3-Next, gpt-oss,
Gemma 3 and DeepSeek-V4 (window rings, compressors).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.nn import generate
from jaxkv.nn.sampling import SamplingParams
from jaxkv.serve import Engine, RequestState
from jaxkv.serve.engine import MAX_REQUEST_FAULTS
from tests.test_fuzz_engine import check_no_leak, expected_output
from tests.test_fuzz_engine_hybrid import _fixture, _reference, check_hybrid_no_leak
from tests.test_nn_engine import CONFIG, PAGE, REF_NEW

LONG = os.environ.get("JAXKV_HYPOTHESIS") == "long"


class InjectedFault(RuntimeError):
    """What :class:`Faults` raises."""


class Faults:
    """Raises :class:`InjectedFault` at the points it wraps, each with
    probability ``p`` per pass (``q`` for a request's own points: they pass
    once per request and token), drawn from a seeded numpy generator, and
    remembers which requests an attributed fault hit."""

    ENGINE_POINTS = ("packed_step", "prefill_step", "decode", "begin_prefill", "retire", "swap_out", "swap_in")

    def __init__(self, rng, p: float, q: float):
        self.rng, self.p, self.q = rng, p, q
        self.fired: list = []  # (point, when)
        self.attributed: set = set()  # request ids whose own part failed

    def maybe(self, point: str, when: str, request: int | None = None) -> None:
        if self.rng.random() < (self.p if request is None else self.q):
            self.fired.append((point, when))
            if request is not None:
                self.attributed.add(request)
            raise InjectedFault(f"injected at {point} ({when})")

    def wrap_cache(self, cache) -> None:
        """Faults before and after each of the cache's steps (on the
        instance: a rebuilt cache is wrapped again)."""
        for point in self.ENGINE_POINTS:
            real = getattr(cache, point)

            def wrapped(*args, _real=real, _point=point, **kwargs):
                self.maybe(_point, "before")
                out = _real(*args, **kwargs)
                self.maybe(_point, "after")
                return out

            setattr(cache, point, wrapped)
        cache._faults_wrapped = True

    def wrap_engine(self, engine) -> None:
        real = engine._sampling_row

        def sampling_row(req):
            self.maybe("sampling", "row", req.id)
            return real(req)

        engine._sampling_row = sampling_row


class Detokenizer:
    """The engine's ``detokenizer`` factory: one character per id, failing
    as :class:`Faults` says, charged to the request it was made for (the
    engine makes it in ``add_request``, before it hands out that id)."""

    def __init__(self, faults: Faults):
        self.faults, self.engine = faults, None

    def __call__(self, tokenizer, prompt_ids):
        faults, rid = self.faults, self.engine._next_id

        class Detok:
            def add(self, ids):
                faults.maybe("detokenize", "add", rid)
                return "".join(chr(0x4E00 + i) for i in ids)

        return Detok()


def poison_paged(engine) -> None:
    """NaN in every page but the null page: a cached prefix nobody computed
    would be read as NaN."""
    pool = engine.cache.pool
    if pool is None or pool.k_bits.dtype != jnp.float32:
        return
    engine.cache.pool = pool.replace(k_bits=pool.k_bits.at[:, :, 1:].set(jnp.nan),
                                     v_bits=pool.v_bits.at[:, :, 1:].set(jnp.nan))


def serve_with_faults(engine, reference, rng, faults: Faults, *, prompts, max_new, vocab, waves=3,
                      check_leak=None) -> dict:
    """Random traffic over ``waves`` waves (requests added between steps,
    some aborted) with ``faults`` armed; returns per-outcome counts. Every
    assertion of the module docstring is made here."""
    streams, want, aborted = {}, {}, set()
    poison_paged(engine)
    cache = engine.cache
    faults.wrap_cache(cache)
    faults.wrap_engine(engine)
    for _ in range(waves):
        for _ in range(int(rng.integers(2, 8))):
            prompt = prompts[int(rng.integers(len(prompts)))]
            cut = int(rng.integers(len(prompt) - 3, len(prompt) + 1))
            prompt = prompt[:cut]
            n = int(rng.integers(1, max_new + 1))
            ref = reference(prompt)
            eos = ref[int(rng.integers(len(ref)))] if rng.random() < 0.3 else None
            rid = engine.add_request(list(prompt), n, eos_token_id=eos)
            want[rid] = (ref, n, eos)
            streams[rid] = []
        for _ in range(400):
            if not engine.has_unfinished():
                break
            if rng.random() < 0.05:
                live = sorted(r for r in want if engine.finish_reason(r) is None)
                if live:
                    victim = live[int(rng.integers(len(live)))]
                    engine.abort(victim)
                    aborted.add(victim)
            for out in engine.step():
                streams[out.request_id] += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == engine.finish_reason(out.request_id)
                    assert (out.error is not None) == (out.finish_reason == "error"), out
            if engine.cache is not cache:  # rebuilt after a contained fault
                cache = engine.cache
                poison_paged(engine)
                faults.wrap_cache(cache)
        assert not engine.has_unfinished(), "the engine stalled"
    counts = {"ok": 0, "error": 0, "abort": 0}
    for rid, (ref, n, eos) in want.items():
        reason, got = engine.finish_reason(rid), engine.outputs[rid]
        assert streams[rid] == got, f"request {rid}: streamed {streams[rid]}, finished with {got}"
        full = expected_output(ref, n, eos)
        if reason == "error":
            assert rid in faults.attributed or engine._requests[rid].faults >= MAX_REQUEST_FAULTS, rid
            assert got == full[: len(got)], f"request {rid} ({reason}): {got} is not a prefix of {full}"
            counts["error"] += 1
        elif reason == "abort":
            assert rid in aborted
            assert got == full[: len(got)], f"request {rid} ({reason}): {got} is not a prefix of {full}"
            counts["abort"] += 1
        else:
            assert got == full, f"request {rid} ({reason}): {got} != cold {full}; faults {faults.fired}"
            counts["ok"] += 1
    assert engine.stats().step_failures == sum(1 for p, _ in faults.fired if p not in ("sampling", "detokenize"))
    (check_leak or check_no_leak)(engine)
    return counts


def faulty_engine(model, faults: Faults, **options) -> Engine:
    detok = Detokenizer(faults)
    engine = Engine(model, tokenizer=object(), detokenizer=detok, **options)
    detok.engine = engine
    return engine


# ------------------------------------------------------------------ paged: Llama


@pytest.fixture(scope="module")
def llama():
    from flax import nnx

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def llama_reference(llama):
    cache = {}

    def ref(prompt):
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = generate(llama, [list(prompt)], REF_NEW, page_size=PAGE).tokens[0]
        return cache[tuple(prompt)]

    return ref


# test_nn_engine's shapes (its compiled programs), a host pool for swaps.
LLAMA = dict(num_pages=10, page_size=PAGE, max_seqs=4, max_blocks_per_seq=8, decode_chunk=4, num_host_pages=6)


def llama_scenario(llama, llama_reference, seed, scheduler):
    rng = np.random.default_rng(seed)
    faults = Faults(rng, p=0.08, q=0.015)
    stems = [tuple(rng.integers(1, CONFIG["vocab_size"], 12).tolist()) for _ in range(2)]
    prompts = [stems[0], stems[0][:8] + stems[1][8:], stems[1]]  # shared pages: prefix hits
    engine = faulty_engine(llama, faults, **LLAMA, scheduler=scheduler,
                           max_num_batched_tokens=int(rng.choice([8, 16])))
    serve_with_faults(engine, llama_reference, rng, faults, prompts=prompts, max_new=REF_NEW,
                      vocab=CONFIG["vocab_size"])


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), scheduler=st.sampled_from(["packed", "padded"]))
def test_llama_faults_touch_no_other_request(llama, llama_reference, seed, scheduler):
    llama_scenario(llama, llama_reference, seed, scheduler)


@settings(max_examples=200 if LONG else 30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scheduler=st.sampled_from(["packed", "padded"]))
def test_llama_faults_touch_no_other_request_wide(llama, llama_reference, seed, scheduler):
    llama_scenario(llama, llama_reference, seed, scheduler)


def test_a_request_failing_alone_makes_room_for_the_one_waiting(llama, llama_reference):
    """Found by the wide run (seed 1446, padded): a request whose sampling
    row fails while it is the only one running, in an iteration that
    admitted nothing (the request waiting does not fit beside it), gives
    back its blocks and finishes with "error"; the engine must not say
    that nothing can run (``KVCacheOOM``) but admit the waiting request
    next, which gives its cold tokens."""
    engine = Engine(llama, **LLAMA, scheduler="padded", max_num_batched_tokens=8)
    rng = np.random.default_rng()
    a, b = (tuple(rng.integers(1, CONFIG["vocab_size"], 20).tolist()) for _ in range(2))
    first = engine.add_request(list(a), REF_NEW)  # admitted with 6 blocks: its prompt's 5 and a chunk's growth
    second = engine.add_request(list(b), REF_NEW)  # the same: 12 of 9 blocks, it waits beside the first
    real, screened = engine._sampling_row, []

    def sampling_row(req):
        if req.id == first:
            screened.append(engine._step)
            if len(screened) == 2:  # its second prompt piece, in an iteration that admits nothing
                raise InjectedFault("a sampling row that cannot be used")
        return real(req)

    engine._sampling_row = sampling_row
    engine.step()
    assert engine._requests[second].state is RequestState.WAITING, "the second fitted beside the first"
    engine.run()
    assert len(screened) == 2 and engine.finish_reason(first) == "error"
    assert engine.outputs[second] == llama_reference(b)
    check_no_leak(engine)


def one_decoding(llama, rng):
    """A poisoned Llama engine with one request (``first``, prompt ``a``)
    prefilled and decoding, and a second prompt ``b`` drawn beside it:
    ``(engine, a, b, first)``."""
    engine = Engine(llama, **LLAMA)
    poison_paged(engine)
    a, b = (tuple(rng.integers(1, CONFIG["vocab_size"], 9).tolist()) for _ in range(2))
    first = engine.add_request(list(a), REF_NEW)
    for _ in range(2):  # a prefilled and decoding
        engine.step()
    return engine, a, b, first


def test_a_failed_step_leaves_no_uncomputed_page_in_the_prefix_cache(llama, llama_reference):
    """The issue's case: a step fails once its prompt pieces were planned
    (here: the packed call raises before it runs). Nothing of that prompt
    was computed, so nothing of it may be cached: a later request with the
    same prompt gets its cold tokens (the pool's unwritten pages are NaN),
    and a request decoding beside the failure goes on to its cold tokens."""
    engine, a, b, first = one_decoding(llama, np.random.default_rng(5))
    real = engine.cache.packed_step
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise InjectedFault("the packed call failed")
        return real(*args, **kwargs)

    engine.cache.packed_step = failing
    second = engine.add_request(list(b), 2)  # fits beside the first: admitted at once
    out = engine.step()  # fails inside, contained
    assert calls and engine.stats().step_failures == 1 and isinstance(engine.last_failure, InjectedFault)
    assert out == [] and engine.finish_reason(first) is None
    poison_paged(engine)  # the rebuilt pool: unwritten pages NaN again
    while engine.has_unfinished():
        engine.step()
    assert engine.outputs[first] == llama_reference(a)
    assert engine.outputs[second] == llama_reference(b)[:2]
    third = engine.add_request(list(b), REF_NEW)  # hits what the second request computed, nothing else
    engine.run()
    assert engine.outputs[third] == llama_reference(b)
    check_no_leak(engine)


def test_an_admission_the_packed_call_refuses_gives_out_no_token(llama, llama_reference):
    """The paged cache folds an admission into the next packed step's call
    (``PagedCache._defer_admission``). When the device refuses it (here the
    host's plan is corrupted to give the new row no token: a bookkeeping
    bug only the device catches), the step raises
    ``BookkeepingError`` with the numbers, gives out no token (not even
    the decoding request's), and the containment rebuilds the cache: both
    requests finish with their cold tokens."""
    from jaxkv.errors import BookkeepingError

    engine, a, b, first = one_decoding(llama, np.random.default_rng())
    cache, deferred = engine.cache, []
    real = cache._defer_admission

    def corrupted(rows, prefix, lengths):
        deferred.append(int(lengths[0]))
        lengths = lengths.copy()
        lengths[0] = 0  # admit_with_prefix refuses a length < 1
        return real(rows, prefix, lengths)

    cache._defer_admission = corrupted
    before = list(engine._requests[first].generated)
    second = engine.add_request(list(b), 2)
    out = engine.step()  # the packed call refuses the admission: contained
    assert deferred, "the admission was not put off to the packed call"
    assert engine.stats().step_failures == 1 and isinstance(engine.last_failure, BookkeepingError)
    assert "engine admission failed" in str(engine.last_failure)
    assert out == [] and engine._requests[first].generated == before
    poison_paged(engine)  # the rebuilt pool: unwritten pages NaN again
    engine.run()
    assert engine.outputs[first] == llama_reference(a)
    assert engine.outputs[second] == llama_reference(b)[:2]
    check_no_leak(engine)


def test_a_request_whose_parameters_fail_finishes_alone(llama, llama_reference):
    """A request whose sampling parameters the device cannot take (a top_k
    past int32, slipped past SamplingParams' own check) finishes with
    ``"error"`` and a message; a greedy request streaming beside it gets
    every one of its cold tokens."""
    engine = Engine(llama, **LLAMA)
    rng = np.random.default_rng(6)
    a, b = (tuple(rng.integers(1, CONFIG["vocab_size"], 11).tolist()) for _ in range(2))
    bad = SamplingParams(temperature=1.0, top_k=5)
    object.__setattr__(bad, "top_k", 2**31)  # what a caller bypassing the check could hand over
    good = engine.add_request(list(a), REF_NEW)
    engine.step()
    broken = engine.add_request(list(b), REF_NEW, sampling=bad)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.finish_reason(broken) == "error"
    last = outputs[broken][-1]
    assert last.finished and last.finish_reason == "error" and "OverflowError" in last.error, last
    assert engine.outputs[good] == llama_reference(a)
    assert engine.stats().failed_requests == 1 and engine.stats().step_failures == 0
    check_no_leak(engine)


def test_a_fault_that_repeats_finishes_the_requests_in_flight(llama):
    """A fault every decode chunk: each failure re-queues the requests in
    flight, and at MAX_REQUEST_FAULTS of them they finish with ``"error"``
    instead of looping forever; a request added later is served once the
    fault is gone."""
    engine = Engine(llama, **LLAMA)
    rid = engine.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11], 8)

    def wrap(cache):
        def failing(*args, **kwargs):
            raise InjectedFault("the decode chunk always fails")
        cache.decode = failing

    wrap(engine.cache)
    for _ in range(50):
        if not engine.has_unfinished():
            break
        cache = engine.cache
        engine.step()
        if engine.cache is not cache:
            wrap(engine.cache)
    assert engine.finish_reason(rid) == "error"
    assert "3 times" in engine._requests[rid].error
    assert engine.stats().step_failures == MAX_REQUEST_FAULTS
    ok = engine.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11], 4)
    engine.run()
    assert engine.finish_reason(ok) == "length" and len(engine.outputs[ok]) == 4
    check_no_leak(engine)


# ------------------------------------------------------------------ hybrid families

HYBRID = {  # fixture -> (engine options, prompt lengths, reference tokens)
    "qwen3_next/small": (dict(max_seqs=3, max_context_tokens=64, num_blocks={"full": 8}, num_snapshots=2,
                              decode_chunk=4, prefill_chunk=16, host_kv_memory=2**22), (21, 32), 12),
    "gpt_oss/small": (dict(max_seqs=3, max_context_tokens=64, num_blocks={"full": 8}, decode_chunk=4,
                           prefill_chunk=16), (21, 32), 12),
    "gemma3/small": (dict(max_seqs=3, max_context_tokens=64, num_blocks={"full": 8}, decode_chunk=4,
                          prefill_chunk=16), (21, 32), 12),
    "dsv4/small": (dict(max_seqs=3, max_context_tokens=256, num_blocks={"csa4": 5, "hca16": 5}, num_snapshots=1,
                        decode_chunk=4, prefill_chunk=128), (129, 136), 4),
}


@pytest.fixture(scope="module")
def hybrid_subjects():
    loaded = {}

    def get(name):
        if name not in loaded:
            model, _ = _fixture(name)
            options, lengths, new = HYBRID[name]
            loaded[name] = (model, _reference(model, lengths, new))
        return loaded[name]

    return get


@pytest.mark.parametrize("name, seeds", [("qwen3_next/small", 1)] + [
    pytest.param(n, 6 if LONG else 3, id=f"{n}-wide") for n in HYBRID])
def test_hybrid_faults_touch_no_other_request(hybrid_subjects, name, seeds):
    model, reference = hybrid_subjects(name)
    options, (low, high), new = HYBRID[name]
    vocab = min(model.config.vocab_size, 256)
    for seed in range(seeds):
        rng = np.random.default_rng(1000 + seed)
        faults = Faults(rng, p=0.06, q=0.015)
        stems = [tuple(rng.integers(2, vocab, high).tolist()) for _ in range(2)]
        prompts = [stems[0], stems[0][:16] + stems[1][16:], stems[1]]
        engine = faulty_engine(model, faults, **options)
        serve_with_faults(engine, reference, rng, faults, prompts=prompts, max_new=new, vocab=vocab, waves=2,
                          check_leak=check_hybrid_no_leak)
