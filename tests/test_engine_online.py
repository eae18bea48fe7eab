"""The online engine (issue 27 item 1): ``Engine.step`` streams what each
request made in one scheduler iteration, ``add_request`` works while other
requests decode, ``abort`` gives back everything a request holds, stop
token ids and stop strings end a request where its tokens / text say.

Compile budget: the tiny Llama and the engine shapes of ``test_nn_engine``
(the same programs, compiled once per process), and Qwen3-Next's fixture
on two rows of 128 tokens.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import FREE
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, SamplingParams, generate
from jaxkv.serve import Engine, EngineStats, RequestOutput, RequestState

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CONFIG = dict(  # test_nn_engine's model and engine: the same compiled programs
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=256, tie_word_embeddings=False,
)
PAGE = 4
REF_NEW = 12
ENGINE = dict(num_pages=10, page_size=PAGE, max_seqs=4, max_blocks_per_seq=8, decode_chunk=4)
SAMPLED = SamplingParams(temperature=1.0, top_k=8)


@functools.lru_cache(maxsize=None)
def llama():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple, seed: int = 0, sampled: bool = False) -> list:
    """``generate`` of one prompt of 9..12 tokens, ``REF_NEW`` new tokens."""
    assert 9 <= len(prompt) <= 12
    return generate(llama(), [list(prompt)], REF_NEW, page_size=PAGE, seed=seed,
                    sampling=SAMPLED if sampled else SamplingParams()).tokens[0]


def tokens(rng, n):
    return rng.integers(1, CONFIG["vocab_size"], size=n).tolist()


def prefix_blocks(engine) -> int:
    """Device blocks the paged prefix cache holds (one reference each)."""
    return len(engine.prefix_cache.device_blocks())


def check_blocks(engine):
    """Every device block free or held by the prefix cache alone; every row
    and host block free."""
    device = engine.manager.device
    assert int(device.num_free) + prefix_blocks(engine) == device.capacity
    assert (np.asarray(engine.manager.status) == FREE).all()
    assert int(engine.manager.host.num_free) == engine.manager.host.capacity
    engine.check_bookkeeping()


def drain(engine, streams, limit=200):
    """``step`` until nothing is left; ``streams[rid]``: each request's
    outputs in order. Checks that a request's outputs end with the one
    output that says it finished."""
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        collect(engine.step(), streams)
    assert not engine.has_unfinished()
    assert engine.step() == []


def collect(outputs, streams):
    seen = set()
    for out in outputs:
        assert isinstance(out, RequestOutput) and out.request_id not in seen  # one per request per step
        seen.add(out.request_id)
        history = streams.setdefault(out.request_id, [])
        assert not (history and history[-1].finished), f"request {out.request_id} made output after finishing"
        assert out.new_token_ids or out.finished
        assert (out.finish_reason is None) == (not out.finished)
        history.append(out)


def streamed(history) -> list:
    return [t for out in history for t in out.new_token_ids]


# ------------------------------------------------------------------ streaming


def test_streamed_tokens_are_run_tokens_with_requests_added_while_others_decode():
    """The same requests, greedy and sampled with seeds, through ``run`` (all
    added first) and through ``step`` with most added while others decode,
    under block pressure (recompute preemptions): every request streams
    exactly ``run``'s tokens, which are ``generate``'s alone."""
    model = llama()
    rng = np.random.default_rng(11)
    specs = [(tokens(rng, n), int(rng.integers(2**31)), sampled) for n, sampled in
             [(9, False), (11, True), (12, False), (10, True), (9, True)]]

    def add(engine, spec):
        prompt, seed, sampled = spec
        return engine.add_request(prompt, REF_NEW, seed=seed, sampling=SAMPLED if sampled else SamplingParams())

    batch = Engine(model, **ENGINE)
    batch_ids = [add(batch, spec) for spec in specs]
    summary = batch.run()
    assert summary.recompute_preemptions > 0

    online = Engine(model, **ENGINE)
    streams, ids = {}, [add(online, specs[0]), add(online, specs[1])]
    collect(online.step(), streams)  # prefill and a first decode chunk
    assert all(online._requests[i].state is RequestState.RUNNING for i in ids)
    ids.append(add(online, specs[2]))  # added while the first two decode
    collect(online.step(), streams)
    ids += [add(online, specs[3]), add(online, specs[4])]
    drain(online, streams)
    for i, (batch_id, rid, (prompt, seed, sampled)) in enumerate(zip(batch_ids, ids, specs)):
        want = alone(tuple(prompt), seed, sampled)
        assert batch.outputs[batch_id] == want, f"request {i}: run"
        assert streamed(streams[rid]) == online.outputs[rid] == want, f"request {i}: streamed"
        assert streams[rid][-1].finish_reason == "length" and online.finish_reason(rid) == "length"
        # a decode chunk gives several tokens in one output: fewer outputs than tokens
        assert len(streams[rid]) < REF_NEW
    check_blocks(online)


def test_a_request_added_to_a_busy_engine_matches_generate():
    model = llama()
    rng = np.random.default_rng(12)
    engine = Engine(model, **ENGINE)
    first = engine.add_request(tokens(rng, 10), REF_NEW)
    streams = {}
    for _ in range(2):
        collect(engine.step(), streams)
    late = tokens(rng, 11)
    rid = engine.add_request(late, REF_NEW)
    drain(engine, streams)
    assert streamed(streams[rid]) == alone(tuple(late))
    assert len(streamed(streams[first])) == REF_NEW
    check_blocks(engine)


# ------------------------------------------------------------------ abort


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding", "swapped"])
def test_abort_gives_back_every_block_row_and_host_block(where):
    """Abort a request waiting, halfway through a prefill in pieces,
    decoding, or swapped out: after the next step the blocks in use are
    those before it was added (prefix-cache pages apart), its row is free
    (its host blocks too), the bookkeeping agrees, its last output says
    ``abort``, and the others still give ``generate``'s tokens."""
    model = llama()
    rng = np.random.default_rng(13)
    options = dict(ENGINE, num_host_pages=32, host_memory_kind="numpy")
    if where == "prefilling":
        options["max_num_batched_tokens"] = 4  # a 12-token prompt takes three iterations
    engine = Engine(model, **options)
    used_before = engine.cache.blocks_in_use() - prefix_blocks(engine)
    streams, others = {}, {}
    if where == "swapped":  # five requests outgrow nine blocks: the first one swapped out is the victim
        for n in (9, 10, 11, 12, 9):
            prompt = tokens(rng, n)
            others[engine.add_request(prompt, REF_NEW)] = prompt
        for _ in range(30):
            collect(engine.step(), streams)
            if engine._swapped:
                break
        victim = engine._swapped[0]
        del others[victim]
    else:
        victim = engine.add_request(tokens(rng, 12), REF_NEW, arrival_step=50 if where == "waiting" else 0)
        want = RequestState.WAITING if where == "waiting" else RequestState.RUNNING
        for _ in range(30):
            collect(engine.step(), streams)
            req = engine._requests[victim]
            if req.state is want and (where != "prefilling" or req.pieces) and (where != "decoding" or req.generated):
                break
    state = engine._requests[victim].state
    assert state is {"waiting": RequestState.WAITING, "swapped": RequestState.SWAPPED}.get(where, RequestState.RUNNING)
    host_used = int(engine.manager.host.num_used)
    engine.abort(victim)
    engine.abort(victim)  # twice: one abort
    collect(engine.step(), streams)
    last = streams[victim][-1]
    assert last.finished and last.finish_reason == "abort" and engine.finish_reason(victim) == "abort"
    assert engine._requests[victim].state is RequestState.FINISHED and victim not in engine._rows
    engine.check_bookkeeping()
    if where == "swapped":
        assert int(engine.manager.host.num_used) < host_used  # its host blocks are free
    else:
        assert engine.cache.blocks_in_use() - prefix_blocks(engine) == used_before
    drain(engine, streams)
    for rid, prompt in others.items():
        assert engine.outputs[rid] == alone(tuple(prompt))
    assert len(engine.outputs[victim]) < REF_NEW
    check_blocks(engine)
    engine.abort(victim)  # finished: nothing happens
    engine.abort(12345)  # unknown: nothing happens
    assert engine.step() == []


# ------------------------------------------------------------------ stop


class CharTokenizer:
    """A tokenizer of one character per id (enough for the detokenizer)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def detokenizer():
    try:
        from jaxkv.text import IncrementalDetokenizer
    except ImportError:  # jaxkv.text not there yet: a plain one of the same interface
        class IncrementalDetokenizer:
            def __init__(self, tokenizer, prompt_ids=()):
                self.tokenizer, self.ids, self.text = tokenizer, [], ""

            def add(self, ids):
                self.ids += list(ids)
                new = self.tokenizer.decode(self.ids)[len(self.text):]
                self.text += new
                return new
    return IncrementalDetokenizer


def text_of(ids):
    return CharTokenizer().decode(ids)


def test_stop_strings_and_stop_token_ids_end_a_request_where_they_occur():
    model = llama()
    rng = np.random.default_rng(14)
    prompt = tokens(rng, 10)
    ref = alone(tuple(prompt))
    engine = Engine(model, tokenizer=CharTokenizer(), detokenizer=detokenizer(), **ENGINE)
    full = text_of(ref)
    stop = full[5:8]  # ends inside the second decode chunk
    cut = full.index(stop)
    k = next(n for n in range(1, REF_NEW + 1) if stop in text_of(ref[:n]))  # tokens up to the one completing it
    by_string = engine.add_request(prompt, REF_NEW, stop=["zzzzzzzzzzzzzzzzz", stop])
    stop_id = ref[2]
    absent = next(t for t in range(CONFIG["vocab_size"]) if t not in ref)
    by_device_id = engine.add_request(prompt, REF_NEW, stop_token_ids=[stop_id])  # the device's stop id
    by_host_id = engine.add_request(prompt, REF_NEW, stop_token_ids=[absent, stop_id])  # checked on the host
    by_eos = engine.add_request(prompt, REF_NEW, eos_token_id=stop_id)
    plain = engine.add_request(prompt, REF_NEW)
    streams = {}
    drain(engine, streams)
    out = {rid: (streamed(streams[rid]), "".join(o.new_text for o in streams[rid]), streams[rid][-1].finish_reason)
           for rid in streams}
    assert out[by_string] == (ref[:k], full[:cut], "stop")
    end = ref.index(stop_id) + 1
    for rid in (by_device_id, by_host_id, by_eos):  # the stop token is the last token; its text is not given
        assert out[rid] == (ref[:end], text_of(ref[: end - 1]), "stop"), rid
    assert out[plain] == (ref, full, "length")
    # The stop string's first characters were held back while it could still begin one.
    shown = ""
    for o in streams[by_string]:
        shown += o.new_text
        assert stop not in shown and len(shown) <= cut
    check_blocks(engine)


def test_stop_strings_need_a_tokenizer_and_are_checked():
    engine = Engine(llama(), **ENGINE)
    with pytest.raises(InvalidArgument, match="tokenizer"):
        engine.add_request([1, 2, 3], 4, stop=["x"])
    with_tokenizer = Engine(llama(), tokenizer=CharTokenizer(), **ENGINE)
    for bad in ([""], [3], 7):
        with pytest.raises(InvalidArgument, match="stop"):
            with_tokenizer.add_request([1, 2, 3], 4, stop=bad)
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        engine.add_request([1, 2, 3], 4, stop_token_ids=[1000])
    assert not engine.has_unfinished() and not with_tokenizer.has_unfinished()


# ------------------------------------------------------------------ stats


def test_stats_count_requests_blocks_and_latency_samples():
    engine = Engine(llama(), **ENGINE)
    rng = np.random.default_rng(15)
    stats = engine.stats()
    assert isinstance(stats, EngineStats) and stats.running == stats.waiting == 0
    assert stats.blocks_total == {"pages": 9} and stats.tokens_total == {"pages": 36}
    assert stats.blocks_used == {"pages": 0} and stats.bytes_total["pages"] > 0
    first = engine.add_request(tokens(rng, 9), 6)
    engine.add_request(tokens(rng, 10), 6, arrival_step=30)
    engine.step()  # the packed step: the prompt and its first token
    engine.step()  # a decode chunk
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.swapped) == (1, 1, 0)
    used = engine.cache.blocks_in_use()
    assert stats.blocks_used["pages"] == used > 0 and stats.tokens_used["pages"] == used * PAGE
    assert stats.bytes_used["pages"] == used * engine.cache_plan.group("pages").bytes_per_block
    assert stats.prompt_tokens == 9 and stats.prefix_hit_tokens == 0 and stats.iterations == 2
    assert len(stats.ttft) == 1 and len(stats.itl) == stats.generated_tokens - 1 > 0
    assert stats.model_calls == 2 and stats.token_slots == 16 + ENGINE["max_seqs"] * ENGINE["decode_chunk"]
    assert stats.padding_slots == 16 - 9 + (ENGINE["max_seqs"] - 1) * ENGINE["decode_chunk"]
    again = engine.stats()
    assert again.ttft == () and again.itl == ()  # drained by the previous call
    engine.abort(first)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.finished_requests == 2 and stats.aborted_requests == 1 and stats.running == 0
    assert len(stats.ttft) == 1  # the second request's
    # A long-running server drops what it has delivered.
    delivered = list(engine.outputs[first])
    assert engine.forget(first) == delivered and first not in engine.outputs and first not in engine._requests
    with pytest.raises(InvalidArgument, match="finished"):
        engine.forget(first)


def test_a_request_added_late_queues_behind_those_that_arrived():
    """``arrival_step`` 0 on an engine past step 0 means now: FCFS behind
    the requests already waiting, never ahead of them."""
    engine = Engine(llama(), **{**ENGINE, "max_seqs": 1})
    rng = np.random.default_rng(16)
    running = engine.add_request(tokens(rng, 9), 8)
    engine.step()
    waiting = engine.add_request(tokens(rng, 9), 2, arrival_step=1)
    late = engine.add_request(tokens(rng, 9), 2)  # arrival_step 0, added at step 1
    assert list(engine._waiting) == [waiting, late]
    order = []
    while engine.has_unfinished():
        order += [out.request_id for out in engine.step() if out.finished]
    assert order == [running, waiting, late]


@pytest.mark.parametrize("seed", [None, None])
def test_the_queue_keeps_arrival_order_and_stamps_each_arrival_when_it_comes(seed):
    """Requests added in a drawn order with drawn arrival steps, between
    steps: after each add, the queue is the one before it with the new
    request placed after every request arriving no later (the rule written
    out, scanning from the front); after each step, exactly the queued
    requests whose arrival step has come carry an arrival time, and it
    never changes once set."""
    engine = Engine(llama(), **{**ENGINE, "max_seqs": 1})
    rng = np.random.default_rng(seed)
    stamps = {}
    for _ in range(12):
        for _ in range(int(rng.integers(0, 4))):
            expected = list(engine._waiting)
            arrival = max(int(rng.integers(0, 10)), engine._step)
            rid = engine.add_request(tokens(rng, 9), int(rng.integers(1, 4)), arrival_step=arrival)
            later = [i for i, other in enumerate(expected) if engine._requests[other].arrival > arrival]
            expected.insert(later[0] if later else len(expected), rid)
            assert list(engine._waiting) == expected
        if engine.has_unfinished():
            engine.step()
        for rid, req in engine._requests.items():
            if req.arrived_at is not None:
                assert stamps.setdefault(rid, req.arrived_at) == req.arrived_at  # set once
        for rid in engine._waiting:
            req = engine._requests[rid]
            assert (req.arrived_at is not None) == (req.arrival < engine._step), (rid, req.arrival, engine._step)
    while engine.has_unfinished():
        engine.step()
    assert all(req.arrived_at is not None for req in engine._requests.values())


@pytest.mark.parametrize("seed", [None, None])
def test_aborting_many_waiting_requests_keeps_the_rest_of_the_queue_in_order(seed):
    """A drawn subset of a queue of 300 is aborted at once, with a running
    request: after one step the queue is the old one without them, in
    order, each aborted one finished with "abort", nothing else finished,
    and the rest runs to the end with every block back."""
    engine = Engine(llama(), **{**ENGINE, "max_seqs": 2})
    rng = np.random.default_rng(seed)
    ids = [engine.add_request(tokens(rng, 9), 2) for _ in range(300)]
    engine.step()
    running = [rid for rid in ids if engine._requests[rid].state is RequestState.RUNNING]
    queue = list(engine._waiting)
    aborted = set(rng.choice(queue, int(rng.integers(1, 150)), replace=False).tolist()) | {running[0]}
    for rid in rng.permutation(sorted(aborted)).tolist():
        engine.abort(rid)
    finished = {out.request_id: out.finish_reason for out in engine.step() if out.finished}
    assert {rid: reason for rid, reason in finished.items() if reason == "abort"} == dict.fromkeys(aborted, "abort")
    left = [rid for rid in queue if rid not in aborted]
    assert list(engine._waiting) == left[len(left) - len(engine._waiting):]  # admissions take from the front
    assert set(left) - set(engine._waiting) <= {rid for rid in ids if engine._requests.get(rid) is not None
                                                and engine._requests[rid].state is not RequestState.WAITING}
    while engine.has_unfinished():
        engine.step()
    assert sum(engine._requests[rid].finish_reason == "abort" for rid in ids) == len(aborted)
    check_blocks(engine)


def test_each_request_samples_from_fold_in_of_the_engine_key():
    """A request without a seed samples from ``fold_in(key(engine seed),
    request id)`` (the options' documented stream), one with a seed from
    ``key(seed)``: the key data each record holds equals JAX's eager
    functions' on drawn seeds."""
    rng = np.random.default_rng()
    engine_seed = int(rng.integers(0, 2**31))
    engine = Engine(llama(), **ENGINE, seed=engine_seed)
    for _ in range(6):
        seed = int(rng.integers(0, 2**40)) if rng.random() < 0.5 else None
        rid = engine.add_request(tokens(rng, 9), 2, seed=seed)
        key = jax.random.fold_in(jax.random.key(engine_seed), rid) if seed is None else jax.random.key(seed)
        np.testing.assert_array_equal(engine._requests[rid].key, np.asarray(jax.random.key_data(key)))


# ------------------------------------------------------------------ hybrid


@functools.lru_cache(maxsize=None)
def qwen3_next():
    path = os.path.join(FIXTURES, "qwen3_next/small")
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


def test_hybrid_engine_streams_and_aborts_give_back_every_block_and_slot():
    """Qwen3-Next (sized by ``max_model_len`` alone): a request aborted
    while decoding, then one aborted halfway through a prefill in pieces,
    leave only prefix-cache pages behind (every slot free); then requests
    added while another decodes stream transformers' greedy tokens."""
    model, expected = qwen3_next()
    prompts, greedy, new = expected["prompts"], expected["greedy"], 8
    engine = Engine(model, max_model_len=128, max_seqs=2, decode_chunk=4)
    streams = {}

    def tree_blocks():  # distinct blocks the prefix cache holds (pages and snapshot tails)
        return sum(len(held) for held in engine.cache.snapshots.held_blocks().values())

    def check_free():
        engine.check_bookkeeping()
        assert engine.cache.blocks_in_use() == tree_blocks() and (engine.cache.row_status() == FREE).all()
        assert int(engine.manager.slots.num_free) == engine.manager.max_requests

    for budget, where in ((None, "decoding"), (16, "prefilling")):
        engine.max_num_batched_tokens = budget
        victim = engine.add_request(prompts[3], 16, namespace=where)  # 57 tokens: four pieces of 16, no hit
        collect(engine.step(), streams)
        req = engine._requests[victim]
        if where == "decoding":  # the budget (prefill_chunk) holds the prompt, cut at its last boundary (48)
            collect(engine.step(), streams)
        assert req.state is RequestState.RUNNING and bool(req.pieces) == (where == "prefilling"), where
        engine.abort(victim)
        collect(engine.step(), streams)
        assert streams[victim][-1].finish_reason == "abort"
        check_free()
    engine.max_num_batched_tokens = None
    first = engine.add_request(prompts[1], new)
    collect(engine.step(), streams)
    second = engine.add_request(prompts[2], new)  # while the first decodes
    drain(engine, streams)
    assert streamed(streams[first]) == greedy[1][:new] and streamed(streams[second]) == greedy[2][:new]
    check_free()


def test_request_output_fast_path_is_the_dataclass():
    """``RequestOutput._make`` (the engine's per-step outputs) builds what
    the constructor builds: equal, same hash and repr, still frozen, and
    through pickle and copies the same again."""
    import copy
    import dataclasses
    import pickle

    args = (7, (1, 2, 3), True, "stop", "abc", 4, None, 9, 5, ((-0.5, ((1, -0.5),)),),
            (None, (-1.25, 3, ((8, -0.5),))))
    made, built = RequestOutput._make(*args), RequestOutput(*args)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert dataclasses.astuple(made) == args
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.finished = False
    assert type(made) is RequestOutput and not hasattr(made, "__dict__")
    for again in (pickle.loads(pickle.dumps(made)), copy.copy(made), copy.deepcopy(made)):
        assert type(again) is RequestOutput and again == built
    assert dataclasses.replace(made, finished=False) == RequestOutput(*args[:2], False, *args[3:])
