"""The engine's fit rule and admission (issue 26, items 3, 4, 5, 9):

* a request ``add_request`` accepts is admitted on an empty engine: the
  growth admission reserves is capped by what the request can still
  generate (``max_new_tokens``) and, with a sliding window, by the window
  (item 3);
* with a window on every layer, a prompt that fills the pool to its last
  page runs: decode releases the block leaving the window before it appends
  (item 4), and ``generate`` runs what the engine accepts;
* a windowed request holding a prefix hit lets go of the hit (its pin) once
  the window trimmed it, and a windowed request is never preempted into a
  recomputation it could not come back from (item 5);
* ``num_blocks`` of a hybrid model that is not a dict of integers is an
  ``InvalidArgument`` naming it (item 9).

Every output is compared with ``generate`` of that request alone, and every
block is back after ``run`` (free, or held once by the prefix cache).

Compile budget: two tiny random models (test_nn_engine's Llama, the same
with a 6-token window on every layer), pages of 4 tokens, one engine shape
per pool size, the reference ``generate`` run once per prompt for
``REF_NEW`` tokens (greedy: fewer tokens are a prefix of it), prompts of
9..16 tokens where the case allows (two compiled shapes).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument, KVCacheError, KVCacheOOM
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.nn.steps import paged_decode_peak, paged_peak_blocks, paged_row_blocks
from jaxkv.serve import Engine
from tests.test_fuzz_engine import check_no_leak
from tests.test_nn_engine import CONFIG, PAGE

WINDOW = 6
WINDOWED = dict(CONFIG, model_type="mistral", sliding_window=WINDOW)
REF_NEW = 24
_COLD = {}


@pytest.fixture(scope="module")
def llama():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def mistral():
    """Every layer windowed: decode trims the blocks that left the window."""
    return LlamaForCausalLM(LlamaConfig.from_hf(WINDOWED), rngs=nnx.Rngs(1))


def engine(model, num_blocks, **kw):
    """An engine of ``num_blocks`` allocatable pages of ``PAGE`` tokens."""
    return Engine(model, num_pages=num_blocks + 1, page_size=PAGE, max_blocks_per_seq=16,
                  **{"max_seqs": 2, "decode_chunk": 4, **kw})


def prompt(seed, n):
    return np.random.default_rng(seed).integers(1, CONFIG["vocab_size"], n).tolist()


def cold(model, p, max_new):
    """``generate`` of ``p`` alone on an ample pool, first ``max_new`` tokens."""
    key = (id(model), tuple(p))
    if key not in _COLD:
        _COLD[key] = generate(model, [p], REF_NEW, page_size=PAGE).tokens[0]
    assert max_new <= REF_NEW
    return _COLD[key][:max_new]


# ------------------------------------------------------------- the arithmetic


def test_window_peak_is_the_most_blocks_a_decoding_row_holds():
    """``paged_decode_peak`` against a step-by-step count of what
    ``decode_logits`` holds: at the step appending ``p`` the row keeps the
    blocks of ``[p - window + 1, p]`` (trimmed first, then appended)."""
    for bs in (1, 3, 4):
        for window in (1, 2, 5, 6, 9, None):
            for first in range(1, 14):
                for last in range(first, 40):
                    held = [-(-(p + 1) // bs) - (0 if window is None else max(p - window + 1, 0) // bs)
                            for p in range(first, last)]
                    assert paged_decode_peak(first, last, bs, window) == max(held, default=0)
                    want = max([-(-first // bs)] + held)
                    assert paged_peak_blocks(first, last, bs, window) == want
                    if last > first:  # after the step that appended last - 1
                        assert paged_row_blocks(last, bs, window) == held[-1]


# -------------------------------------------------------------------- item 3


def test_a_request_that_fits_the_pool_exactly_runs(llama):
    """13 + 3 tokens need 4 blocks, all the pool has: accepted, and admitted
    (admission asked for a whole 4-step decode chunk of growth on top, 5
    blocks, and ``run`` raised ``KVCacheOOM: ... nothing can run``). One
    token more is refused at ``add_request`` with the numbers."""
    eng = engine(llama, 4)
    p = prompt(0, 13)
    rid = eng.add_request(p, 3)
    eng.run()
    assert eng.outputs[rid] == cold(llama, p, 3)
    check_no_leak(eng)
    with pytest.raises(InvalidArgument, match=r"13 \+ 4 tokens need blocks \[5\].*the pool has 4 blocks"):
        eng.add_request(p, 4)


def test_a_windowed_request_longer_than_the_pool_is_admitted(mistral):
    """A 13-token prompt (4 blocks, the whole pool) and 20 new tokens: the
    window keeps it within 4 blocks, so it is accepted; admission must not
    ask for the untrimmed growth of a decode chunk (a block more)."""
    eng = engine(mistral, 4)
    p = prompt(1, 13)
    rid = eng.add_request(p, 20)
    summary = eng.run()
    assert eng.outputs[rid] == cold(mistral, p, 20)
    assert summary.peak_kv_blocks <= 4 and summary.preemptions == 0
    check_no_leak(eng)


# -------------------------------------------------------------------- item 4


def test_a_windowed_prompt_that_fills_the_pool_decodes(mistral):
    """16 prompt tokens fill 4 blocks; the first decode token needs a fifth
    block unless the block leaving the window goes back first. The engine
    accepts it and runs it; so does ``generate`` on a pool of the same size,
    with the tokens of an ample pool."""
    p = prompt(2, 16)
    want = cold(mistral, p, REF_NEW)
    eng = engine(mistral, 4)
    rid = eng.add_request(p, REF_NEW)
    eng.run()
    assert eng.outputs[rid] == want
    check_no_leak(eng)
    assert generate(mistral, [p], REF_NEW, page_size=PAGE, num_pages=5).tokens[0] == want


@pytest.mark.parametrize("length, num_blocks, fits", [
    (12, 3, True),  # the step at 12 released block 0 first: 3 blocks at most
    (8, 2, False),  # the step at 8 holds blocks 0..2: nothing has left the window yet
])
def test_the_fit_rule_and_generate_agree(mistral, length, num_blocks, fits):
    """What the engine's fit rule accepts, ``generate`` runs on a pool of the
    same size; what it refuses (with the numbers), ``generate`` cannot run."""
    p = prompt(3, length)
    eng = engine(mistral, num_blocks)
    if fits:
        rid = eng.add_request(p, REF_NEW)
        eng.run()
        assert eng.outputs[rid] == cold(mistral, p, REF_NEW)
        assert generate(mistral, [p], REF_NEW, page_size=PAGE, num_pages=num_blocks + 1).tokens[0] == eng.outputs[rid]
        check_no_leak(eng)
    else:
        peak = paged_peak_blocks(length, length + REF_NEW, PAGE, WINDOW)
        assert peak == num_blocks + 1
        with pytest.raises(InvalidArgument, match=rf"need blocks \[{peak}\].*the pool has {num_blocks} blocks"):
            eng.add_request(p, REF_NEW)
        with pytest.raises(KVCacheOOM, match=f"of {num_blocks} total"):
            generate(mistral, [p], REF_NEW, page_size=PAGE, num_pages=num_blocks + 1)


# -------------------------------------------------------------------- item 5


def test_a_windowed_hit_is_let_go_once_trimmed(mistral):
    """A cached 12-token prefix (3 blocks), then a request extending it by
    one token that generates 24 more in a 5-block pool. Holding the hit
    pinned it held 3 blocks besides its window, ran out, was preempted and
    could never be re-admitted (13 + 20 tokens prefilled whole: 9 blocks).
    Now it is admitted (cold, when the window would not fit beside the
    pinned hit) and finishes without a preemption."""
    base = prompt(4, 12)
    eng = engine(mistral, 5)
    first = eng.add_request(base, 1)  # no decode step: its 3 full pages are cached
    eng.run()
    assert len(eng.prefix_cache.device_blocks()) == 3
    rid = eng.add_request(base + [7], REF_NEW)
    summary = eng.run()
    assert eng.outputs[first] == cold(mistral, base, 1)
    assert eng.outputs[rid] == cold(mistral, base + [7], REF_NEW)
    assert summary.preemptions == 0
    check_no_leak(eng)


def test_a_windowed_hit_is_unpinned_when_it_leaves_the_window(mistral):
    """A one-page hit fits beside the window: the request is admitted on it
    and the page stays pinned while it is in the window (the first decode
    chunk: positions 5..8); once decode trimmed it from the row's table
    (position 9 on), the prefix cache no longer protects it."""
    base = prompt(5, PAGE)
    eng = engine(mistral, 5)
    eng.add_request(base, 1)
    eng.run()
    rid = eng.add_request(base + [9], REF_NEW)
    protected = []
    summary = eng.run(on_progress=lambda p: protected.append((p.generated_tokens, eng.prefix_cache.protected_blocks)))
    assert summary.prefix_hit_tokens == PAGE
    assert eng.outputs[rid] == cold(mistral, base + [9], REF_NEW)
    # The packed step (the first token), then one chunk: the hit still in the window; then trimmed.
    assert protected[:2] == [(1, 1), (5, 1)], protected
    assert all(blocks == 0 for _, blocks in protected[2:]), protected
    check_no_leak(eng)


def test_windowed_requests_are_never_preempted_past_recovery(mistral):
    """Several windowed requests that each outgrow the pool but not their
    window, arriving over time and competing for 5 blocks: each admitted one
    reserves its whole window, so none is preempted into a recomputation
    (its prompt and output prefilled whole) that no pool this size holds.
    A guard of that rule: this mix also ran before the fix (the failing
    cases are the hit above and ``test_fuzz_engine_hybrid``'s acceptance
    fuzz)."""
    stem = prompt(6, 8)
    prompts = [stem + prompt(10 + i, 1 + i) for i in range(4)] + [prompt(20, 14)]
    eng = engine(mistral, 5)
    ids = [eng.add_request(p, 22, arrival_step=i) for i, p in enumerate(prompts)]
    summary = eng.run()
    for rid, p in zip(ids, prompts):
        assert eng.outputs[rid] == cold(mistral, p, 22), p
    assert summary.preemptions == 0 and summary.peak_kv_blocks <= 5
    check_no_leak(eng)


# -------------------------------------------------------------------- item 9


@pytest.fixture(scope="module")
def qwen3_next():
    return AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures/qwen3_next/small"))


@pytest.mark.parametrize("bad", [12, [12], "full", ("full", 12), {"full": 12.0}, {"full": "12"}, {"full": True},
                                 {"full": None}, {"full": 1}, {"full": -3}, {1: 12}, {"full": 2**70}],
                         ids=repr)
def test_hybrid_num_blocks_must_be_a_dict_of_integers(qwen3_next, bad):
    model = qwen3_next
    with pytest.raises(InvalidArgument, match="num_blocks") as raised:
        Engine(model, max_context_tokens=64, num_blocks=bad)
    assert isinstance(raised.value, KVCacheError)
    message = str(raised.value)
    assert "expected" in message and "dict" in message, message
    with pytest.raises(InvalidArgument, match=r"num_blocks names groups \['nope'\].*\['full'\]"):
        Engine(model, max_context_tokens=64, num_blocks={"nope": 12})


def test_a_hybrid_admission_without_a_hit_is_one_device_call(qwen3_next, monkeypatch):
    """Hybrid admission of prompts with no cached prefix takes their slots
    and every prompt's blocks in one device call (``_admit_grown``); a
    batch with a hit still admits, attaches and grows in three. The tokens
    are ``generate``'s either way (the second wave reuses the first's
    prefixes). A batch whose rows are not the lowest free ones is a
    ``BookkeepingError`` naming the slots, and no block is grown (not even
    for the request holding the slot the batch named)."""
    from jaxkv.errors import BookkeepingError
    from jaxkv.serve import hybrid_cache
    from jaxkv.serve.caches import PrefillLane
    from jaxkv.serve.reserve import no_hit

    calls = []

    def counted(name):
        real = getattr(hybrid_cache, name)

        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("_admit_grown", "_admit_hybrid", "_preallocate_hybrid"):
        monkeypatch.setattr(hybrid_cache, name, counted(name))
    model, rng = qwen3_next, np.random.default_rng()
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(9, 17, 3)]
    engine = Engine(model, max_context_tokens=64, max_seqs=3, decode_chunk=4)
    first = [engine.add_request(p, 6) for p in prompts]
    engine.run()
    assert calls.count("_admit_grown") >= 1 and "_admit_hybrid" not in calls, calls
    calls.clear()
    second = [engine.add_request(p + rng.integers(1, vocab, 3).tolist(), 6) for p in prompts]
    assert engine.run().prefix_hit_tokens > 0
    assert "_admit_hybrid" in calls and "_preallocate_hybrid" in calls, calls
    want = generate(model, [engine._requests[rid].prompt for rid in first + second], 6).tokens
    assert [engine.outputs[rid] for rid in first + second] == want
    held = engine.add_request(prompts[0], 6)
    engine.step()
    assert engine._requests[held].row == 0  # slot 1
    cache, free = engine.cache, engine.cache.free_blocks().copy()
    longer = rng.integers(1, vocab, 48).tolist()  # more blocks than row 0 holds
    lane = PrefillLane(0, no_hit(cache), longer, engine._requests[held].key, None)
    with pytest.raises(BookkeepingError, match=r"hybrid admission gave slots \[2\] .* rows \[0\], which need "
                                               r"slots \[1\]"):
        cache.begin_prefill([lane])
    assert (cache.free_blocks() == free).all()  # slot 1's request was not grown


def test_the_hybrid_host_tables_are_never_stale(qwen3_next, monkeypatch):
    """A hybrid cache's host copy of the block tables (read with a packed
    call's results where a snapshot follows, kept across snapshot stores,
    which change no table) is what the device holds whenever a snapshot
    store reads it, over traffic whose prompts share prefixes (stores at
    prompt ends, branches and turn ends); some stores read the copy, and
    the tokens are ``generate``'s. A store's increfs and state copy run as
    one call (``_incref_and_copy``), and where the increfs are refused the
    copy is not made: ``BookkeepingError``, every state row as it was."""
    import jax

    from jaxkv.errors import BookkeepingError
    from jaxkv.serve import hybrid_cache

    merged, real_merged = [], hybrid_cache._incref_and_copy
    monkeypatch.setattr(hybrid_cache, "_incref_and_copy", lambda *a: merged.append(1) or real_merged(*a))
    model, rng = qwen3_next, np.random.default_rng()
    vocab = model.config.vocab_size
    engine = Engine(model, max_context_tokens=64, max_seqs=3, decode_chunk=4)
    cache = engine.cache
    real, served = cache._block_tables, []

    def checked():
        kept = cache.__dict__.get("_host_tables") is not None
        tables = real()
        device = {name: np.asarray(g.tables) for name, g in cache.manager.groups.items()}
        assert tables.keys() == device.keys() and all((tables[n] == device[n]).all() for n in device)
        served.append(kept)
        return tables

    cache._block_tables = checked
    base = rng.integers(1, vocab, 24).tolist()
    rids = [engine.add_request(base[: int(rng.integers(6, 24))] + rng.integers(1, vocab, 4).tolist(),
                               int(rng.integers(2, 8)), arrival_step=i) for i in range(8)]
    engine.run()
    assert any(served) and len(served) > served.count(True), served
    want = generate(model, [engine._requests[rid].prompt for rid in rids], 8).tokens  # greedy: a prefix each
    assert [engine.outputs[rid] for rid in rids] == [w[: engine._requests[rid].max_new] for rid, w in zip(rids, want)]
    assert merged
    used = sorted({record.row for record in cache.snapshots.records.values()})
    assert len(used) >= 2
    ops = cache.snapshots.empty_ops()
    ops.incref[next(iter(ops.incref))] = [10**6]  # no such block: refused
    ops.copies = {used[-1]: cache.manager.num_slots + used[0]}  # one snapshot's state over another's
    before = [np.asarray(x).copy() for x in jax.tree.leaves(cache.manager)]
    with pytest.raises(BookkeepingError, match="reference to stored blocks"):
        cache._apply(ops)
    after = jax.tree.leaves(cache.manager)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))
