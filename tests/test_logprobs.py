"""Log-probabilities of sampled tokens (``Engine.add_request(...,
logprobs=N)``), against an independent no-cache forward.

Every family's engine (paged pools and hybrid caches, the packed and the
padded scheduler) serves greedy and sampled requests asking for the top
``N``; each token's log-probability and its top ``N`` must equal
``log_softmax`` of ``forward_dense`` over the same tokens, read as the
engine's ``logprobs_mode`` says: ``processed``, the distribution the token
was drawn from (temperature, top-k and top-p applied, a filtered token at
-inf; a greedy request's is the model's softmax), or ``raw``, the model's
softmax. A request that asks for none gets None, and the tokens are those
of an engine where no request asks (computing them changes no draw).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.sampling import SamplingParams, filtered_logits, token_logprobs

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
FAMILIES = ["llama", "dsv3/small", "dsv4/small", "qwen3_next/small", "gpt_oss/small", "gemma3/small"]
TOP = 4


def _model(family: str):
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    return AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, family))


def _serve(model, prompts, samplings, asks, **options):
    """Every request to its end; ``(tokens, logprob entries or None)`` per request."""
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=len(prompts), max_model_len=64, decode_chunk=4, prefill_chunk=8, **options)
    ids = [engine.add_request(p, 10, sampling=s, logprobs=a, seed=i)
           for i, (p, s, a) in enumerate(zip(prompts, samplings, asks))]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.check_bookkeeping()
    result = []
    for rid in ids:
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        if all(o.new_logprobs is None for o in outputs[rid]):
            result.append((tokens, None))
        else:
            result.append((tokens, [e for o in outputs[rid] for e in o.new_logprobs]))
    return result


def _expected(model, prompt, tokens, sampling, mode):
    """log_softmax of the no-cache forward's logits before each token, read as ``mode`` says."""
    vocab = model.config.vocab_size
    logits = model.forward_dense(jnp.asarray([prompt + tokens])).reshape(-1, vocab)[len(prompt) - 1:-1]
    if mode == "raw" or sampling.is_greedy:
        return np.asarray(jax.nn.log_softmax(logits, axis=-1))
    scaled, _ = filtered_logits(logits, sampling)
    return np.asarray(jax.nn.log_softmax(scaled, axis=-1))


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_a_no_cache_forward(family, mode):
    model = _model(family)
    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(3, 14, 4)]
    samplings = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5),
                 SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9)]
    asks = [TOP, TOP, 0, None]  # the last asks for none
    served = _serve(model, prompts, samplings, asks, logprobs_mode=mode)
    for i, ((tokens, entries), prompt, sampling, ask) in enumerate(zip(served, prompts, samplings, asks)):
        assert len(tokens) == 10
        if ask is None:
            assert entries is None
            continue
        want = _expected(model, prompt, tokens, sampling, mode)
        assert len(entries) == len(tokens)
        got = np.asarray([logprob for logprob, _ in entries])
        np.testing.assert_allclose(got, want[np.arange(len(tokens)), tokens], rtol=1e-4, atol=2e-4, err_msg=f"{i}")
        for step, (_, top) in enumerate(entries):
            assert len(top) == ask
            if not ask:
                continue
            ids, values = zip(*top)
            assert list(values) == sorted(values, reverse=True)  # most likely first
            np.testing.assert_allclose(values, want[step, list(ids)], rtol=1e-4, atol=2e-4)
            # No token outside the list is more likely than its last (ties at the float tolerance).
            rest = np.delete(want[step], list(ids))
            assert rest.max() <= values[-1] + 2e-4
        if sampling.is_greedy:  # the token is the top one
            assert all(top[0][0] == token for (_, top), token in zip(entries, tokens))
    # Asking changes no token: the same seeds without any logprobs give the same tokens.
    plain = _serve(model, prompts, samplings, [None] * 4)
    assert [t for t, _ in plain] == [t for t, _ in served]


def test_padded_scheduler_and_speculation_pause():
    """The padded scheduler's prefill and decode calls, and a speculating
    engine (which runs plain chunks while a request asks), give the
    no-cache forward's log-probabilities too."""
    model = _model("llama")
    rng = np.random.default_rng()
    base = rng.integers(1, LLAMA["vocab_size"], 6).tolist()
    prompts = [base * 3, rng.integers(1, LLAMA["vocab_size"], 9).tolist()]
    samplings = [SamplingParams(), SamplingParams(temperature=0.8)]
    for options in ({"scheduler": "padded"}, {"speculative": {"num_speculative_tokens": 3}}):
        served = _serve(model, prompts, samplings, [TOP, TOP], **options)
        for (tokens, entries), prompt, sampling in zip(served, prompts, samplings):
            want = _expected(model, prompt, tokens, sampling, "processed")
            np.testing.assert_allclose([x for x, _ in entries], want[np.arange(len(tokens)), tokens], rtol=1e-4,
                                       atol=2e-4, err_msg=str(options))
    # While the greedy request (its prompt repeats: drafts would be found) asks for them, no draft is verified.
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=2, max_model_len=64, decode_chunk=4, speculative={"num_speculative_tokens": 3})
    engine.add_request(prompts[0], 10, logprobs=TOP)
    engine.run()
    assert engine.stats().spec_draft_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_equal_a_no_cache_forward(family):
    """``prompt_logprobs``: every prompt token's log-probability (after the
    first), rank and top ``N`` equal ``log_softmax`` of a no-cache forward
    of the prompt, for prompts prefilled in several pieces of a small token
    budget beside decoding requests, for a prompt whose twin is in the
    prefix cache (it is computed, not hit) and after a recompute
    preemption; a request asking none gets None."""
    from jaxkv.serve import Engine

    model = _model(family)
    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(5, 30, 3)]
    prompts.append(list(prompts[0]))  # the same prompt again: its pages are in the prefix cache by then
    engine = Engine(model, max_seqs=3, max_model_len=64, decode_chunk=4, max_num_batched_tokens=16)
    asks = [TOP, None, 0, TOP]
    ids = [engine.add_request(p, 6, prompt_logprobs=a, arrival_step=3 * i) for i, (p, a) in enumerate(zip(prompts,
                                                                                                          asks))]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.check_bookkeeping()
    for rid, prompt, ask in zip(ids, prompts, asks):
        given = [o.prompt_logprobs for o in outputs[rid] if o.prompt_logprobs is not None]
        if ask is None:
            assert not given
            continue
        [scores] = given  # once, with the first token
        assert outputs[rid][0].prompt_logprobs is scores and len(scores) == len(prompt) and scores[0] is None
        logits = model.forward_dense(jnp.asarray([prompt])).reshape(-1, vocab)  # some families drop the batch axis
        want = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        for i, (logprob, rank, top) in enumerate(scores[1:], start=1):
            row = want[i - 1]
            np.testing.assert_allclose(logprob, row[prompt[i]], rtol=1e-4, atol=2e-4, err_msg=f"{family} {i}")
            assert abs(rank - (1 + int((row > row[prompt[i]] + 2e-4).sum()))) <= int(
                (np.abs(row - row[prompt[i]]) <= 2e-4).sum()), (family, i, rank)
            assert len(top) == ask
            if ask:
                ids_, values = zip(*top)
                assert list(values) == sorted(values, reverse=True)
                np.testing.assert_allclose(values, row[list(ids_)], rtol=1e-4, atol=2e-4)
    with pytest.raises(InvalidArgument, match="packed"):
        Engine(model, max_seqs=2, max_model_len=64, scheduler="padded").add_request(prompts[0], 2, prompt_logprobs=1)


def test_logprob_refusals():
    from jaxkv.serve import Engine

    engine = Engine(_model("llama"), max_seqs=2, max_model_len=32)
    for bad in (-1, 21, 2.5, True, "3"):
        with pytest.raises(InvalidArgument, match="logprobs"):
            engine.add_request([1, 2, 3], 4, logprobs=bad)
    with pytest.raises(InvalidArgument, match="logprobs_mode"):
        Engine(_model("llama"), max_seqs=2, max_model_len=32, logprobs_mode="logits")
    with pytest.raises(InvalidArgument, match="logprobs mode"):
        token_logprobs(jnp.zeros((1, 4)), jnp.zeros((1,), jnp.int32), SamplingParams(), 2, "logits")


def test_token_logprobs_of_filtered_tokens_are_minus_infinity():
    """Random logits, top-k 3 at temperature 0.5: the processed mode gives
    the sampled distribution's log-probabilities (-inf outside the three),
    the raw mode the model's, both against a numpy computation."""
    rng = np.random.default_rng()
    logits = rng.normal(size=(3, 11)).astype(np.float32) * 3
    tokens = np.asarray([int(np.argsort(-row)[1]) for row in logits], np.int32)  # each row's second best
    sampling = SamplingParams(temperature=0.5, top_k=3)
    processed = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), sampling, 5)
    raw = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), sampling, 5, "raw")
    # float32 log-softmax of logits up to ~12 carries ~1e-6 of absolute error: a log-probability near 0 (a
    # dominant token) cannot meet a relative tolerance alone (a drawn row failed CI's rtol 1e-5 at -0.0025).
    tol = dict(rtol=1e-5, atol=2e-6)
    for row, token in enumerate(tokens):
        x = logits[row].astype(np.float64)
        keep = np.argsort(-x)[:3]
        scaled = np.full_like(x, -np.inf)
        scaled[keep] = x[keep] / 0.5
        want = scaled - np.log(np.exp(scaled[keep] - scaled[keep].max()).sum()) - scaled[keep].max()
        np.testing.assert_allclose(float(processed.token[row]), want[token], **tol)
        assert np.isneginf(np.asarray(processed.top[row])[3:]).all()
        assert np.asarray(processed.top_ids[row])[:3].tolist() == keep.tolist()
        model = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        np.testing.assert_allclose(float(raw.token[row]), model[token], **tol)
        np.testing.assert_allclose(np.asarray(raw.top[row]), np.sort(model)[::-1][:5], **tol)


def test_smollm2_logprobs_and_penalties_equal_a_no_cache_forward():
    """The real SmolLM2 (Q4_1 GGUF): a chat request's log-probabilities
    (greedy and sampled at temperature 0.7) equal ``log_softmax`` of a
    no-cache forward over its tokens, and a penalized greedy request's
    tokens are the argmax of the penalized logits."""
    from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_smollm2
    from jaxkv.nn.penalties import Penalties
    from jaxkv.serve import Engine
    from jaxkv.text import Tokenizer

    path = find_smollm2()
    if path is None:
        pytest.skip(SMOLLM2_INSTALL)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), Tokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=True)
    samplings = [SamplingParams(), SamplingParams(temperature=0.7, top_k=40)]
    penalties = Penalties(presence=0.8, frequency=0.6, repetition=1.3)
    engine = Engine(model, max_seqs=3, max_model_len=256, decode_chunk=4)
    ids = [engine.add_request(prompt, 12, sampling=s, logprobs=TOP, seed=i) for i, s in enumerate(samplings)]
    ids.append(engine.add_request(prompt, 12, logprobs=0, penalties=penalties))
    engine.run()
    for rid, sampling in zip(ids, samplings + [None]):
        tokens = engine.outputs[rid]
        logits = np.asarray(model.forward_dense(jnp.asarray([prompt + tokens]))[0, len(prompt) - 1:-1], np.float64)
        if sampling is None:  # penalized: each greedy token the argmax of the penalized logits
            from tests.test_penalties import numpy_penalized

            logits = np.stack([numpy_penalized(row, prompt, tokens[:i], penalties, [])
                               for i, row in enumerate(logits)])
            assert tokens == np.argmax(logits, axis=-1).tolist()
            want = logits - logits.max(-1, keepdims=True)
            want = want - np.log(np.exp(want).sum(-1, keepdims=True))
        else:
            want = _expected(model, prompt, tokens, sampling, "processed")
        got = [logprob for logprob, _ in engine._requests[rid].token_logprobs]
        np.testing.assert_allclose(got, want[np.arange(len(tokens)), tokens], rtol=1e-3, atol=2e-3)
