"""A prompt prefilled by one engine, its KV moved with
``jax.experimental.transfer`` and adopted by another engine
(:mod:`jaxkv.serve.disaggregated`), which decodes it.

Expectations we did not write: a cold engine's tokens (itself checked
against transformers in test_engine_families). Prompts drawn fresh. Here
both engines live in this process, each with its own transfer server (a
pull goes through the transfer server's TCP path on loopback); the two
processes of ``--role prefill`` / ``--role decode`` are tested in
test_server_disaggregated.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.serve import Engine
from jaxkv.serve.disaggregated import KVTransfer, PrefillRouter, export_prefix, import_prefix
from tests.test_disk_tier import CONFIG, ENGINE, FAMILIES, PAGE


@pytest.fixture(scope="module")
def transfers():
    return KVTransfer(), KVTransfer()


def hand_over(prefill, decode, prompt, namespace, transfers):
    """The prompt on ``prefill`` (one token), its KV to ``decode``: the
    tokens ``decode`` took in and the bytes moved."""
    rid = prefill.add_request(prompt, 1, namespace=namespace)
    prefill.run()
    prefill.forget(rid)
    sender, receiver = transfers
    meta = export_prefix(prefill, prompt, namespace, sender)
    leaves = receiver.pull(meta["address"], meta["uuid"], meta["leaves"])
    return import_prefix(decode, prompt, namespace, meta, leaves), meta["bytes"]


def test_a_decode_engine_serves_a_prompt_another_engine_prefilled(transfers):
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))
    prompts = [rng.integers(1, CONFIG["vocab_size"], int(rng.integers(6, 26))).tolist() for _ in range(3)]
    cold = Engine(model, **ENGINE)
    want = []
    for prompt in prompts:
        rid = cold.add_request(prompt, 5)
        cold.run()
        want.append(cold.outputs[rid])
    prefill, decode = Engine(model, **ENGINE), Engine(model, **ENGINE)
    per_page = decode.cache.bytes_per_block
    for prompt, tokens in zip(prompts, want):
        assert decode.cache.cached_length(prompt, "t") == 0
        adopted, moved = hand_over(prefill, decode, prompt, "t", transfers)
        pages = (len(prompt) - 1) // PAGE
        assert adopted == pages * PAGE, (seed, adopted, len(prompt))
        assert moved >= pages * per_page
        before = decode.cache.prefix_stats()
        assert decode.cache.cached_length(prompt, "t") == pages * PAGE  # what the decode server asks first
        assert decode.cache.cached_length(prompt, "u") == 0
        assert decode.cache.prefix_stats() == before, seed  # and it changed nothing
        rid = decode.add_request(prompt, 5, namespace="t")
        decode.run()
        assert decode.outputs[rid] == tokens, seed
        assert decode.cached_tokens(rid) == pages * PAGE
        decode.check_bookkeeping()
    other = LlamaForCausalLM(LlamaConfig.from_hf({**CONFIG, "num_key_value_heads": 4}), rngs=nnx.Rngs(0))
    with pytest.raises(InvalidArgument, match="another model or pool layout"):
        hand_over(prefill, Engine(other, **ENGINE), prompts[0], "t", transfers)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_decodes_what_another_engine_prefilled(name, transfers):
    from jaxkv.nn import AutoModelForCausalLM

    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures", name))
    options = dict(max_seqs=2, decode_chunk=4, prefill_chunk=64, **FAMILIES[name])
    prompt = rng.integers(1, model.config.vocab_size, int(rng.integers(100, 200))).tolist()
    cold = Engine(model, **options)
    rid = cold.add_request(prompt, 6)
    cold.run()
    decode = Engine(model, **options)
    adopted, _ = hand_over(Engine(model, **options), decode, prompt, None, transfers)
    unit = getattr(decode.cache, "page_size", 1)
    assert adopted == (len(prompt) - 1) // unit * unit, (seed, adopted)  # a hybrid record: the last token but one
    assert decode.cache.cached_length(prompt, None) == adopted  # the host tier's, as the hit will be
    mine = decode.add_request(prompt, 6)
    decode.run()
    assert decode.outputs[mine] == cold.outputs[rid], seed
    assert decode.cached_tokens(mine) == adopted
    # Again, from what the device holds now: the length asked first is the hit's.
    held = decode.cache.cached_length(prompt, None)
    again = decode.add_request(prompt, 6)
    decode.run()
    assert (decode.outputs[again], decode.cached_tokens(again)) == (cold.outputs[rid], held), seed


def test_the_prefill_router_keeps_a_prefix_on_one_server_until_it_is_busy():
    """:class:`PrefillRouter`: every server once per order; prompts sharing
    their first unit (and namespace) go to one server, the same from a new
    router (a restart); drawn prompts spread over every server; a server
    more than SLACK prompts busier than the least busy gives way; the rest
    of the order is least busy first; a prompt whose longest known prefix
    went to a server goes there (per namespace, the last MAX_PAGES pages)."""
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    urls = [f"http://10.0.0.{i}:8100" for i in range(1, 4)]
    router, unit = PrefillRouter([u + "/" for u in urls]), int(rng.integers(4, 32))
    assert router.urls == tuple(urls)
    prompts = [rng.integers(0, 1000, int(rng.integers(1, 3 * unit))).tolist() for _ in range(300)]
    firsts = []
    for prompt in prompts:
        order = router.order(prompt, None, unit)
        assert sorted(order) == urls, (seed, order)
        tail = rng.integers(0, 1000, int(rng.integers(0, 50))).tolist()
        assert router.order(prompt[:unit] + tail, None, unit)[0] == order[0] or len(prompt) < unit, seed
        assert PrefillRouter(urls).affinity(prompt, None, unit) == order[0], seed
        firsts.append(order[0])
    assert all(firsts.count(u) > 50 for u in urls), (seed, [firsts.count(u) for u in urls])
    assert {router.affinity(prompts[0], ("cache_salt", str(s)), unit) for s in range(30)} == set(urls), seed

    prompt = prompts[0]
    mine = router.affinity(prompt, None, unit)
    others = [u for u in urls if u != mine]
    router.in_flight.update({mine: PrefillRouter.SLACK, others[0]: 1, others[1]: 0})
    assert router.order(prompt, None, unit) == [mine, others[1], others[0]]  # within the slack: affinity
    router.in_flight[mine] += 1
    assert router.order(prompt, None, unit) == [others[1], others[0], mine]  # past it: the least busy first

    router.in_flight.update(dict.fromkeys(urls, 0))
    # Cache-aware: a conversation whose turn went elsewhere (its affinity server busy) goes back there.
    system = rng.integers(0, 1000, 2 * unit).tolist()
    mine = router.affinity(system, None, unit)
    turn = system + rng.integers(0, 1000, int(rng.integers(unit, 3 * unit))).tolist()
    router.in_flight[mine] = PrefillRouter.SLACK + 1
    [elsewhere, *_] = router.order(turn, None, unit)
    assert elsewhere != mine, seed
    router.record(turn, None, unit, elsewhere)
    router.in_flight[mine] = 0
    next_turn = turn + rng.integers(0, 1000, int(rng.integers(1, 3 * unit))).tolist()
    assert router.order(next_turn, None, unit)[0] == elsewhere, seed  # its longest prefix's server
    other = system + rng.integers(0, 1000, 2 * unit).tolist()  # the system prompt, another conversation
    assert router.holder(other, None, unit) == elsewhere  # (the system prompt's pages went there too)
    assert router.holder(other, "elsewhere", unit) is None and router.order(other, "elsewhere", unit)[0] == \
        router.affinity(other, "elsewhere", unit)
    small = PrefillRouter(urls)
    small.MAX_PAGES = 2  # (turn has 3 or more pages)
    small.record(turn, None, unit, urls[0])  # more pages than it keeps: the first ones forgotten
    assert small.holder(turn[:unit], None, unit) is None and small.holder(turn, None, unit) == urls[0], seed

    for bad in ([], ["http://a", "http://a/"], [""]):
        with pytest.raises(InvalidArgument, match="distinct, non-empty"):
            PrefillRouter(bad)
