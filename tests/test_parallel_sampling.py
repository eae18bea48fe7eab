"""``n`` samples of one prompt (the OpenAI server's ``n`` / ``best_of``:
seeded requests on the same prompt, the others added with ``fork_of`` the
first) share one prefill.

The first sibling is admitted and prefills the prompt; the others wait for
it and fork its cache, so each computes only the last prompt token (whose
logits give its first token): on a paged pool the first one's full pages
come straight from its block table and its partly filled page is copied
(no prefix cache needed: also with it off, and for prompts of any
length); on a hybrid cache the state snapshotted for them at the last
token but one. Expectation we did not write: each sibling's tokens
equal the same seeded request served alone, on an engine of its own (no
sharing there).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.sampling import SamplingParams

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _model(family: str):
    if family == "llama":
        config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        return LlamaForCausalLM(config, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    return AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, family))


def _serve(model, prompt, seeds, sampling, *, fork=True, abort_first=False, **options):
    """Each seed's tokens, cached tokens at admission, the cache's hit
    grain and the engine's stats; siblings forking the first request
    (``fork``), the first aborted at once (``abort_first``)."""
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=4, max_model_len=160, decode_chunk=4, **options)
    ids = [engine.add_request(prompt, 8, sampling=sampling, seed=seeds[0])]
    ids += [engine.add_request(prompt, 8, sampling=sampling, seed=s, fork_of=ids[0] if fork else None)
            for s in seeds[1:]]
    if abort_first:
        engine.abort(ids[0])
    outputs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.check_bookkeeping()
    tokens = [[t for o in outputs[i] for t in o.new_token_ids] for i in ids]
    cached = [next((o.cached_tokens for o in outputs[i] if o.new_token_ids), None) for i in ids]
    return tokens, cached, engine.cache.hit_grain, engine.stats()


def _alone(model, prompt, seed, sampling):
    return _serve(model, prompt, [seed], sampling)[0][0]


@pytest.mark.parametrize("family", ["llama", "dsv3/small", "qwen3_next/small"])
def test_n_siblings_share_one_prefill(family):
    model = _model(family)
    rng = np.random.default_rng()
    prompt = rng.integers(1, model.config.vocab_size, int(rng.integers(60, 120))).tolist()
    seeds = rng.integers(0, 1 << 30, 4).tolist()
    sampling = SamplingParams(temperature=1.0)
    tokens, cached, grain, stats = _serve(model, prompt, seeds, sampling)
    assert cached[0] == 0
    computable = len(prompt) - 1  # the last prompt token is always computed (its logits give the first token)
    assert cached[1:] == [computable] * 3, (cached, grain)  # token grain: a paged fork copies the partial page
    # A paged pool (the Llama, DeepSeek-V3's MLA pool) forks pages; a hybrid cache takes a snapshot.
    assert stats.forked_requests == (0 if family == "qwen3_next/small" else 3)
    for seed, got in zip(seeds, tokens):
        assert _alone(model, prompt, seed, sampling) == got


def test_a_paged_fork_needs_no_prefix_cache_and_takes_short_prompts():
    """On a paged pool the siblings fork the first one's own pages (the
    partly filled one copied: a wrong copy would change the tokens): with
    the prefix cache off, and for a prompt shorter than the in-batch
    prefix rule's minimum (which requests that are not siblings need)."""
    from jaxkv.serve.scheduler import WAIT_FOR_PREFIX_TOKENS

    model = _model("llama")
    rng = np.random.default_rng()
    sampling = SamplingParams(temperature=1.0)
    seeds = rng.integers(0, 1 << 30, 4).tolist()
    for length, options in ((int(rng.integers(40, 100)), dict(prefix_cache=False)),
                            (int(rng.integers(17, WAIT_FOR_PREFIX_TOKENS)), {})):
        prompt = rng.integers(1, model.config.vocab_size, length).tolist()
        tokens, cached, grain, stats = _serve(model, prompt, seeds, sampling, **options)
        assert cached == [0] + [length - 1] * 3 and stats.forked_requests == 3, (cached, length, options)
        for seed, got in zip(seeds, tokens):
            assert _alone(model, prompt, seed, sampling) == got
        # Without fork_of, a short prompt is prefilled by each request (the in-batch rule's minimum).
        if not options:
            assert _serve(model, prompt, seeds, sampling, fork=False)[1] == [0] * 4


def test_siblings_of_an_aborted_request_run_alone():
    """The first request aborted before it ran: its siblings are admitted
    as any other request (nothing to fork) and give their own tokens."""
    model = _model("llama")
    rng = np.random.default_rng()
    prompt = rng.integers(1, model.config.vocab_size, 70).tolist()
    seeds = rng.integers(0, 1 << 30, 3).tolist()
    sampling = SamplingParams(temperature=1.0)
    tokens, cached, _, stats = _serve(model, prompt, seeds, sampling, abort_first=True)
    assert tokens[0] == [] and stats.forked_requests == 0
    for seed, got in zip(seeds[1:], tokens[1:]):
        assert _alone(model, prompt, seed, sampling) == got


def test_fork_of_is_checked():
    from jaxkv.errors import InvalidArgument
    from jaxkv.serve import Engine

    engine = Engine(_model("llama"), max_seqs=2, max_model_len=64)
    first = engine.add_request([1, 2, 3], 4)
    with pytest.raises(InvalidArgument, match="no request"):
        engine.add_request([1, 2, 3], 4, fork_of=first + 7)
    with pytest.raises(InvalidArgument, match="another prompt"):
        engine.add_request([1, 2, 4], 4, fork_of=first)
    with pytest.raises(InvalidArgument, match="another prompt or namespace"):
        engine.add_request([1, 2, 3], 4, fork_of=first, namespace="other")


@pytest.mark.parametrize("family", ["gemma3/small", "qwen3_next/small"])
def test_hybrid_siblings_share_a_short_prompt_and_run_without_the_prefix_cache(family):
    """A hybrid cache's siblings of a prompt shorter than the in-batch
    rule's minimum take the state snapshotted for them at its last token
    but one; with the prefix cache off (no snapshot rows to take it from)
    each prefills its own. Tokens: those served alone, both ways."""
    model = _model(family)
    rng = np.random.default_rng()
    sampling = SamplingParams(temperature=1.0)
    seeds = rng.integers(0, 1 << 30, 3).tolist()
    for length, options, shared in ((int(rng.integers(8, 20)), {}, True),
                                    (int(rng.integers(30, 60)), dict(prefix_cache=False), False)):
        prompt = rng.integers(1, model.config.vocab_size, length).tolist()
        tokens, cached, _, _ = _serve(model, prompt, seeds, sampling, **options)
        assert cached == [0] + [length - 1 if shared else 0] * 2, (cached, options)
        for seed, got in zip(seeds, tokens):
            assert _alone(model, prompt, seed, sampling) == got
