"""``jaxkv.serve.Engine``: continuous batching against the per-request
reference ``jaxkv.nn.generate`` (greedy), with arrivals over time, prefix-cache
hits, and preemption by swap and by recompute; block accounting after ``run``.

Compile budget: every engine here has the same pool / table shapes (only
``num_host_pages`` differs, which the engine's jitted steps do not see), and
every reference prompt has 9..12 tokens, so ``generate`` compiles once; the
reference is generated for ``REF_NEW`` tokens and truncated (greedy decoding
of fewer tokens is a prefix of it).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from flax import nnx

import jaxkv.nn
import jaxkv.serve
from jaxkv.errors import BookkeepingError, InvalidArgument
from jaxkv.nn import LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine, EngineProgress, EngineSummary, RequestState
from jaxkv.serve.output import latency_stats

CONFIG = dict(
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=256, tie_word_embeddings=False,
)
PAGE = 4
REF_NEW = 12
ENGINE = dict(num_pages=10, page_size=PAGE, max_seqs=4, max_blocks_per_seq=8, decode_chunk=4)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(model):
    """``reference(prompt, n)``: ``generate(model, [prompt], n)`` alone, cached."""
    cache = {}

    def ref(prompt, max_new):
        assert 9 <= len(prompt) <= 12 and max_new <= REF_NEW  # one compiled generate
        key = tuple(prompt)
        if key not in cache:
            cache[key] = generate(model, [list(prompt)], REF_NEW, page_size=PAGE).tokens[0]
        return cache[key][:max_new]

    return ref


def tokens(rng, n):
    return rng.integers(1, CONFIG["vocab_size"], size=n).tolist()


def check_outputs(engine, requests, reference):
    for rid, (prompt, max_new) in requests.items():
        assert engine.outputs[rid] == reference(prompt, max_new), f"request {rid}"


def check_blocks(engine):
    """Every device block is free or held by the prefix cache alone."""
    device = engine.manager.device
    cached = engine.prefix_cache.device_blocks()
    assert len(set(cached)) == len(cached)
    assert int(device.num_free) + len(cached) == device.capacity
    counts = np.asarray(device.ref_counts)
    assert (counts[cached] == 1).all()
    assert (np.asarray(engine.manager.status) == 0).all()  # every row FREE


def test_arrivals_over_time(model, reference):
    rng = np.random.default_rng(1)
    engine = Engine(model, **ENGINE)
    requests = {}
    for arrival, (length, max_new) in enumerate([(9, 5), (12, 3), (10, 8), (11, 1), (9, 12)]):
        prompt = tokens(rng, length)
        requests[engine.add_request(prompt, max_new, arrival_step=2 * arrival)] = (prompt, max_new)
    summary = engine.run()
    assert isinstance(summary, EngineSummary)
    check_outputs(engine, requests, reference)
    assert summary.requests == 5
    assert summary.generated_tokens == sum(m for _, m in requests.values())
    assert 0 < summary.peak_kv_blocks <= summary.kv_blocks
    assert summary.iterations >= 8  # the last request arrives at step 8
    for mean, p50, p99 in (summary.ttft, summary.itl):  # latencies: measured, ordered, in the printout
        assert 0 < p50 <= p99 and 0 < mean <= p99
    # The run's ITL is every gap since it began: on a fresh engine, the samples stats() drains (a gap per token
    # after each request's first), collected while it ran and only then.
    stats = engine.stats()
    assert len(stats.itl) == summary.generated_tokens - summary.requests
    assert summary.itl == latency_stats(list(stats.itl)) and engine.output.run_itl is None
    assert "TTFT mean/p50/p99" in str(summary) and "ITL" in str(summary)
    check_blocks(engine)


def test_shared_prefixes_hit_the_cache(model, reference, capsys):
    rng = np.random.default_rng(2)
    system = tokens(rng, 8)  # two full pages
    engine = Engine(model, **ENGINE)
    requests = {}
    for arrival, (length, max_new) in enumerate([(2, 6), (4, 4), (1, 7), (3, 5)]):
        prompt = system + tokens(rng, length)
        requests[engine.add_request(prompt, max_new, arrival_step=arrival)] = (prompt, max_new)
    seen = []
    summary = engine.run(on_progress=seen.append)
    check_outputs(engine, requests, reference)
    assert summary.prefix_hit_rate > 0 and summary.prefix_hit_tokens % PAGE == 0
    # progress reaches the callback, never stdout/stderr
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert seen and all(isinstance(p, EngineProgress) for p in seen)
    for field in ("finished", "generated_tokens", "iteration", "preemptions"):
        values = [getattr(p, field) for p in seen]
        assert values == sorted(values), field
    assert all(p.total == 4 and p.finished + p.running + p.waiting + p.swapped == 4 for p in seen)
    assert seen[-1].finished == 4 and seen[-1].generated_tokens == summary.generated_tokens
    assert seen[-1].iteration == summary.iterations
    check_blocks(engine)


@pytest.mark.parametrize("num_host_pages", [32, 0], ids=["swap", "recompute"])
def test_seeded_requests_sample_what_generate_samples(model, num_host_pages):
    """A seeded request draws from its own key stream, split as ``generate``
    splits its key for one prompt: the same tokens whatever runs beside it,
    through swap or recompute preemption (nine blocks for five requests that
    grow to six blocks each), with unseeded and greedy requests mixed in."""
    rng = np.random.default_rng()
    sampling = jaxkv.nn.SamplingParams(temperature=1.0, top_k=8)
    engine = Engine(model, num_host_pages=num_host_pages, host_memory_kind="numpy", **ENGINE)
    seeded = {}
    for i, length in enumerate((9, 10, 11, 12, 9)):
        prompt, seed = tokens(rng, length), int(rng.integers(2**31))
        if i == 2:  # unseeded: the engine's stream; greedy: no draw at all
            engine.add_request(prompt, REF_NEW, sampling=sampling)
        else:
            rid = engine.add_request(prompt, REF_NEW, sampling=sampling if i != 4 else jaxkv.nn.SamplingParams(), seed=seed)
            seeded[rid] = (prompt, seed, sampling if i != 4 else jaxkv.nn.SamplingParams())
    summary = engine.run()
    assert summary.preemptions > 0
    for rid, (prompt, seed, params) in seeded.items():
        alone = generate(model, [prompt], REF_NEW, page_size=PAGE, seed=seed, sampling=params).tokens[0]
        assert engine.outputs[rid] == alone, f"request {rid}"
    check_blocks(engine)


@pytest.mark.parametrize("num_host_pages", [32, 0], ids=["swap", "recompute"])
def test_preemption_under_memory_pressure(model, reference, num_host_pages):
    rng = np.random.default_rng(3)
    # numpy host pages: the same swap bookkeeping with fewer programs to compile
    engine = Engine(model, num_host_pages=num_host_pages, host_memory_kind="numpy", **ENGINE)
    requests = {}
    for length in (9, 10, 11, 12, 9):  # 3 blocks each at admission, 6 at the end: 9 blocks cannot hold them
        prompt = tokens(rng, length)
        requests[engine.add_request(prompt, REF_NEW)] = (prompt, REF_NEW)
    summary = engine.run()
    check_outputs(engine, requests, reference)
    assert summary.preemptions > 0
    if num_host_pages:
        assert summary.swap_preemptions > 0
    else:
        assert summary.swap_preemptions == 0 and summary.recompute_preemptions > 0
    assert summary.peak_kv_blocks == summary.kv_blocks
    check_blocks(engine)


def test_eos_stops_each_request_where_the_reference_emits_it(model, reference):
    rng = np.random.default_rng(4)
    prompts = [tokens(rng, n) for n in (9, 11, 10, 12)]
    free_run = [reference(p, REF_NEW) for p in prompts]
    eos = free_run[0][3]  # request 0 emits it at its fourth step; others may too, or never
    engine = Engine(model, **ENGINE)
    ids = [engine.add_request(p, REF_NEW, eos_token_id=eos, arrival_step=i) for i, p in enumerate(prompts)]
    summary = engine.run()
    for rid, expected in zip(ids, free_run):
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert engine.outputs[rid] == expected, f"request {rid}"
    assert engine.outputs[ids[0]][-1] == eos and len(engine.outputs[ids[0]]) <= 4
    assert summary.generated_tokens == sum(len(engine.outputs[rid]) for rid in ids)
    check_blocks(engine)


def test_rejects_requests_that_never_fit(model):
    engine = Engine(model, **ENGINE)
    with pytest.raises(InvalidArgument):
        engine.add_request([1] * 30, 8)  # 10 blocks > max_blocks_per_seq
    with pytest.raises(InvalidArgument):
        engine.add_request([], 4)


def test_engine_is_importable_from_nn_and_serve():
    assert jaxkv.nn.Engine is jaxkv.serve.Engine and jaxkv.nn.EngineSummary is jaxkv.serve.EngineSummary
    from jaxkv.nn import Engine as from_nn

    assert from_nn is Engine and "Engine" in dir(jaxkv.nn)


def test_request_states_follow_the_life_cycle(model):
    engine = Engine(model, **ENGINE)
    rid = engine.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11], 3)
    assert engine._requests[rid].state is RequestState.WAITING
    engine.run()
    assert engine._requests[rid].state is RequestState.FINISHED and len(engine.outputs[rid]) == 3
    assert {s.name for s in RequestState} == {"WAITING", "RUNNING", "SWAPPED", "FINISHED"}


def test_corrupted_bookkeeping_raises_bookkeeping_error(model):
    """A running request whose row was tampered with is caught before the
    next decode, with the numbers, as a BookkeepingError (not an assert, not
    an OOM)."""
    engine = Engine(model, **ENGINE)
    rid = engine.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11], 8)
    engine._admit()
    engine._prefill()
    req = engine._requests[rid]
    assert req.state is RequestState.RUNNING
    engine.check_bookkeeping()  # consistent so far
    real = req.row
    req.row = (real + 1) % ENGINE["max_seqs"]
    with pytest.raises(BookkeepingError, match=f"request {rid} is RUNNING on row {req.row}"):
        engine._decode()
    req.row = real
    engine._rows[real] = None
    with pytest.raises(BookkeepingError, match=f"row {real}"):
        engine.check_bookkeeping()
    engine._rows[real] = rid
    # a device-side failure of the engine's own retire call is a bookkeeping bug too
    with pytest.raises(BookkeepingError, match="free 1 rows"):
        engine.cache.update(rows=[(real + 1) % ENGINE["max_seqs"]])  # a FREE row: free fails


@pytest.mark.parametrize("trial", range(6))
def test_decoding_rows_are_the_checked_rows_that_decode(trial):
    """``decoding_rows`` (the check of the records against the row status,
    and the decoding requests read in the same pass) against the rule
    written out, on drawn row maps; a disagreement drawn into them is
    ``check_rows``' BookkeepingError."""
    from types import SimpleNamespace

    from jaxkv.manager.block_space import FREE, ON_DEVICE, SWAPPED
    from jaxkv.serve.scheduler import check_rows, decoding_rows

    rng = np.random.default_rng()
    rows, requests, swapped, status = [], {}, [], []
    for row in range(int(rng.integers(1, 40))):
        kind = rng.choice(["free", "decoding", "prefilling", "swapped"])
        if kind == "free":
            rows.append(None)
            status.append(FREE)
            continue
        rid = int(rng.integers(1000)) * 100 + row
        state = RequestState.SWAPPED if kind == "swapped" else RequestState.RUNNING
        requests[rid] = SimpleNamespace(id=rid, row=row, state=state, pieces=[(0, 4)] if kind == "prefilling" else [])
        rows.append(rid)
        status.append(SWAPPED if kind == "swapped" else ON_DEVICE)
        if kind == "swapped":
            swapped.append(rid)
    status = np.asarray(status)
    want = [(row, requests[rid]) for row, rid in enumerate(rows) if rid is not None
            and requests[rid].state is RequestState.RUNNING and not requests[rid].pieces]
    assert decoding_rows(requests, rows, swapped, status) == want
    bad = status.copy()
    row = int(rng.integers(len(rows)))
    bad[row] = {FREE: ON_DEVICE, ON_DEVICE: SWAPPED, SWAPPED: FREE}[int(bad[row])]
    with pytest.raises(BookkeepingError) as raised:
        decoding_rows(requests, rows, swapped, bad)
    with pytest.raises(BookkeepingError, match=re.escape(str(raised.value))):
        check_rows(requests, rows, swapped, bad)
    held = [rid for rid in rows if rid is not None]
    if held:  # a request holding a row in a state that holds none (or the other holding state) disagrees too
        req = requests[held[int(rng.integers(len(held)))]]
        req.state = rng.choice([RequestState.WAITING, RequestState.FINISHED,
                                RequestState.SWAPPED if req.state is RequestState.RUNNING else RequestState.RUNNING])
        with pytest.raises(BookkeepingError):
            decoding_rows(requests, rows, swapped, status)


def test_logging_not_printing(model, capsys, caplog):
    import logging

    engine = Engine(model, **ENGINE)
    engine.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11], 2)
    with caplog.at_level(logging.DEBUG, logger="jaxkv.serve"):
        summary = engine.run()
    assert capsys.readouterr().out == ""
    messages = [r.getMessage() for r in caplog.records if r.name == "jaxkv.serve"]
    assert any("iteration 1" in m for m in messages) and any(str(summary) in m for m in messages)


@pytest.mark.parametrize("budget", [None, 6])
def test_token_budget_prefills_in_pieces_between_decode_chunks(model, reference, budget):
    """Padded scheduler: with ``max_num_batched_tokens`` a long prompt is
    prefilled a piece per iteration while the running request keeps
    decoding (it finishes before the long prompt's first token); without,
    the long prompt is prefilled whole at admission (its first token comes
    before the short request is done). Either way the tokens are
    ``generate``'s."""
    rng = np.random.default_rng()
    engine = Engine(model, **{**ENGINE, "num_pages": 16}, max_num_batched_tokens=budget, scheduler="padded")
    short, long_ = tokens(rng, 9), tokens(rng, 12) + tokens(rng, 12)
    a = engine.add_request(short, REF_NEW)
    b = engine.add_request(long_, 4, arrival_step=1)
    engine.run()
    assert engine.outputs[a] == reference(short, REF_NEW)
    assert engine.outputs[b] == generate(model, [long_], 4, page_size=PAGE).tokens[0]
    short_done, long_first = engine._requests[a].last_token_at, engine._requests[b].first_token_at
    assert (short_done < long_first) == (budget is not None)
    check_blocks(engine)


@pytest.mark.parametrize("budget", [None, 6])
def test_packed_steps_decode_while_a_long_prompt_is_prefilled(model, reference, budget):
    """Packed scheduler: while the long prompt is prefilled (in pieces that
    fill what the budget leaves after the decode token), every iteration is
    ONE model call that also gives the running request its next token; with
    nothing left to prefill the multi-step decode chunk takes over. Tokens
    are ``generate``'s."""
    rng = np.random.default_rng()
    engine = Engine(model, **{**ENGINE, "num_pages": 16}, max_num_batched_tokens=budget)
    short, long_ = tokens(rng, 9), tokens(rng, 12) + tokens(rng, 12)
    a = engine.add_request(short, REF_NEW)
    b = engine.add_request(long_, 4, arrival_step=1)
    per_step = []
    while engine.has_unfinished():
        before = engine.stats().model_calls
        out = {o.request_id: len(o.new_token_ids) for o in engine.step()}
        per_step.append((engine.stats().model_calls - before, out.get(a, 0), out.get(b, 0)))
    assert engine.outputs[a] == reference(short, REF_NEW)
    assert engine.outputs[b] == generate(model, [long_], 4, page_size=PAGE).tokens[0]
    assert all(calls == 1 for calls, *_ in per_step)
    prefilling = per_step[1:next(i for i, step in enumerate(per_step) if step[2])]  # b arrives at step 1
    # None: the budget is prefill_chunk; b's prompt is one piece, done in the step that admits it. A budget of 6
    # leaves 5 prompt tokens per step beside a's decode token: b takes 5 steps or more (a's own prompt,
    # 9 tokens, is still in pieces when b arrives), each giving a its next token.
    assert len(prefilling) == 0 if budget is None else len(prefilling) >= -(-len(long_) // (budget - 1)) - 1
    assert all(got_a == 1 for _, got_a, _ in prefilling)
    stats = engine.stats()
    assert stats.model_calls == len(per_step) and 0 <= stats.padding_slots < stats.token_slots
    check_blocks(engine)
