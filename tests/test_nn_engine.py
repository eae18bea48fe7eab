"""``jaxkv.nn.engine.Engine``: continuous batching against the per-request
reference ``jaxkv.nn.generate`` (greedy), with arrivals over time, prefix-cache
hits, and preemption by swap and by recompute; block accounting after ``run``.

Compile budget: every engine here has the same pool / table shapes (only
``num_host_pages`` differs, which the engine's jitted steps do not see), and
every reference prompt has 9..12 tokens, so ``generate`` compiles once; the
reference is generated for ``REF_NEW`` tokens and truncated (greedy decoding
of fewer tokens is a prefix of it).
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import LlamaConfig, LlamaForCausalLM, generate
from jaxkv.nn.engine import Engine, EngineSummary, sample_rows

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
    check_blocks(engine)


def test_shared_prefixes_hit_the_cache(model, reference, capsys):
    rng = np.random.default_rng(2)
    system = tokens(rng, 8)  # two full pages
    engine = Engine(model, **ENGINE)
    requests = {}
    for arrival, (length, max_new) in enumerate([(2, 6), (4, 4), (1, 7), (3, 5)]):
        prompt = system + tokens(rng, length)
        requests[engine.add_request(prompt, max_new, arrival_step=arrival)] = (prompt, max_new)
    summary = engine.run(progress=True)
    check_outputs(engine, requests, reference)
    assert summary.prefix_hit_rate > 0 and summary.prefix_hit_tokens % PAGE == 0
    out = capsys.readouterr().out
    assert "\r" in out and "4/4 done" in out
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


def test_sample_rows_is_greedy_per_row():
    import jax
    import jax.numpy as jnp

    logits = jax.random.normal(jax.random.key(0), (3, 11))
    out = sample_rows(logits, jax.random.key(1), jnp.asarray([0.0, 1.0, 0.0]), jnp.asarray([0, 1, 0]),
                      jnp.asarray([1.0, 1.0, 1.0]))
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    assert np.asarray(out).tolist() == greedy.tolist()  # top_k=1 sampling is greedy too
