"""In-batch prefix sharing (:mod:`jaxkv.serve.prefix_wait`): whom a waiting
request waits for, found by namespace and head instead of comparing every
pair.

* :class:`PrefixSharers` gives the rule's answer, written out here over
  every candidate in plain Python, on admission batches drawn fresh:
  prompts from a few shared bases cut at drawn lengths, two namespaces,
  drawn hits and grains, prefilling requests part way through their
  prompts;
* a burst of arrivals compares whole prompts only with the requests of
  its own head (none at all when every head differs): the host's work
  follows the requests that share, not the batch squared;
* through an engine, requests arriving together that share a long prefix
  hit it (the later ones waited for the first) and give the tokens of the
  same prompts run cold.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import jaxkv.serve.prefix_wait as prefix_wait
from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams
from jaxkv.serve import Engine
from jaxkv.serve.prefix_wait import WAIT_FOR_PREFIX_TOKENS, PrefixSharers
from jaxkv.serve.request import Request
from tests.test_nn_engine import CONFIG


def _request(rid: int, tokens: list, namespace, generated: int = 0) -> Request:
    """A request record whose context is ``tokens`` (the last ``generated``
    of them generated: a recomputed request)."""
    cut = len(tokens) - generated
    req = Request(rid, list(tokens[:cut]), 8, SamplingParams(), -1, 0, namespace, np.zeros(2, np.uint32))
    req.generated = list(tokens[cut:])
    return req


def _rule(req, hit_tokens, grain, admitted, prefilling):
    """The rule (module docstring of :mod:`jaxkv.serve.prefix_wait`),
    written out over every candidate."""
    tokens = req.prompt + req.generated
    mine = tokens[:len(tokens) - 1]
    for other, done in admitted + [(o, o.pieces[0][0]) for o in prefilling if o.pieces]:
        if other.namespace != req.namespace:
            continue
        theirs = other.prompt + other.generated
        shared = 0
        while shared < min(len(mine), len(theirs)) and mine[shared] == theirs[shared]:
            shared += 1
        shared -= shared % grain
        if shared - hit_tokens >= WAIT_FOR_PREFIX_TOKENS and done < shared:
            return other, shared
    return None


def _draw_prompt(rng, bases) -> list:
    base = bases[rng.integers(len(bases))]
    keep = int(rng.integers(0, len(base) + 1))
    return base[:keep] + rng.integers(1, 50, int(rng.integers(1, 40))).tolist()


@pytest.mark.parametrize("seed", [None] * 6)
def test_the_sharers_follow_the_rule(seed):
    """Admission batches drawn fresh: each arriving request asks the index
    and the rule written out; the answers (the request and the shared
    length) are the same. A request that does not wait is admitted (it
    becomes a candidate of the rest of the batch); one that waits may cut
    the other's pieces, as the scheduler does. Batches are drawn until both
    answers have been given (at least 20 batches): a fixed count of draws
    may, rarely, hold no request that waits."""
    rng = np.random.default_rng(seed)
    # A base shorter than the wait threshold could never be waited for.
    bases = [rng.integers(1, 50, int(rng.integers(WAIT_FOR_PREFIX_TOKENS + 8, 120))).tolist() for _ in range(3)]
    namespaces = [None, "tenant"]
    checked = waited = batches = 0
    while batches < 20 or not 0 < waited < checked:
        batches += 1
        assert batches <= 500, f"500 batches drawn, {waited} of {checked} requests waited"
        grain = int(rng.choice([1, 4, 16]))
        prefilling = []
        for rid in range(int(rng.integers(0, 6))):
            req = _request(1000 + rid, _draw_prompt(rng, bases), namespaces[rng.integers(2)])
            start = int(rng.integers(0, len(req.prompt)))
            req.pieces = [] if rng.random() < 0.2 else [(start, len(req.prompt))]
            prefilling.append(req)
        sharers, admitted = PrefixSharers(prefilling), []
        for rid in range(int(rng.integers(1, 12))):
            tokens = _draw_prompt(rng, bases)
            req = _request(rid, tokens, namespaces[rng.integers(2)],
                           generated=int(rng.integers(0, len(tokens))) if rng.random() < 0.2 else 0)
            hit = int(rng.integers(0, len(tokens))) // grain * grain if rng.random() < 0.5 else 0
            want = _rule(req, hit, grain, admitted, prefilling)
            got = sharers.first(req, hit, grain)
            assert (None if got is None else (got[0].id, got[1])) == (
                None if want is None else (want[0].id, want[1])), f"request {rid}, hit {hit}, grain {grain}"
            checked += 1
            if got is None:
                admitted.append((req, hit))
                sharers.admitted(req, hit)
            else:
                waited += 1
                other, shared = got
                if other.pieces and other.pieces[0][0] < shared < other.pieces[0][1]:
                    other.pieces = [(other.pieces[0][0], shared), (shared, other.pieces[0][1])] + other.pieces[1:]


def test_a_burst_compares_only_requests_of_one_head(monkeypatch):
    """300 arrivals with different heads: no whole-prompt comparison at all
    (the pairwise scan made 44,850). Then 20 arrivals sharing a head among
    100 others: only they are compared, each with those of its head
    admitted before it (each holds a 4-token hit, so sharing the head alone
    is not enough to wait and all are admitted)."""
    calls = []
    real = prefix_wait.common_prefix
    monkeypatch.setattr(prefix_wait, "common_prefix", lambda a, b: calls.append(1) or real(a, b))
    rng = np.random.default_rng()

    def burst(prompts, hit):
        sharers = PrefixSharers([])
        for rid, prompt in enumerate(prompts):
            req = _request(rid, prompt, None)
            assert sharers.first(req, hit, 4) is None
            sharers.admitted(req, hit)

    distinct = [[rid + 1] + rng.integers(1, 1000, 200).tolist() for rid in range(300)]  # the first token differs
    burst(distinct, 0)
    assert calls == []
    head = rng.integers(1, 1000, WAIT_FOR_PREFIX_TOKENS).tolist()
    same = [head + [2000 + rid] + rng.integers(1, 1000, 100).tolist() for rid in range(20)]  # diverging after it
    prompts = distinct[:100] + same
    rng.shuffle(prompts)
    burst(prompts, 4)
    assert len(calls) == 20 * 19 // 2


PAGE = 4


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


def test_requests_arriving_together_wait_for_their_shared_prefix(model):
    """Three groups of requests arrive in one step, each group sharing a
    drawn prefix of 36-48 tokens: the first of a group computes it, the
    others wait for it and hit it (page grain), and every request gives the
    tokens of its prompt run cold (a namespace of its own, nothing shared)."""
    rng = np.random.default_rng()
    engine = Engine(model, num_pages=200, page_size=PAGE, max_seqs=6, max_blocks_per_seq=20, decode_chunk=4,
                    max_num_batched_tokens=256)
    groups = []
    for _ in range(3):
        shared = rng.integers(1, CONFIG["vocab_size"], int(rng.integers(36, 49))).tolist()
        # Each prompt's own tokens start differently (1 and 2), so the group shares exactly ``shared``.
        own = [[first] + rng.integers(1, CONFIG["vocab_size"], int(rng.integers(0, 8))).tolist() for first in (1, 2)]
        groups.append((len(shared), [shared + tail for tail in own]))
    ids = [[engine.add_request(p, 5, namespace="shared") for p in prompts] for _, prompts in groups]
    engine.run()
    for (length, prompts), (first, second) in zip(groups, ids):
        assert engine.cached_tokens(first) == 0
        assert engine.cached_tokens(second) == length // PAGE * PAGE, f"a {length}-token shared prefix"
    for i, ((_, prompts), group) in enumerate(zip(groups, ids)):
        for rid, prompt in zip(group, prompts):
            cold = engine.add_request(prompt, 5, namespace=("cold", rid))
            engine.run()
            assert engine.cached_tokens(cold) == 0
            assert engine.outputs[cold] == engine.outputs[rid], f"group {i}"
