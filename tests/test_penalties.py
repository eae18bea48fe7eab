"""Penalties, logit bias and ``min_tokens`` (:mod:`jaxkv.nn.penalties`)
against a numpy reimplementation of each rule.

The rule on random logits and histories; then the engine: greedy tokens of
penalized requests must be the argmax of the numpy-penalized logits of a
no-cache forward over the same tokens, and their processed log-probabilities
its ``log_softmax``, at every step (the decode loop updates the counts on
the device; the packed step and the prefill call build them from the
histories the host sends).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.penalties import MAX_LOGIT_BIAS, Penalties, RowPenalties, apply_penalties, seen_tokens
from jaxkv.nn.sampling import SamplingParams

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def numpy_penalized(logits: np.ndarray, prompt: list, output: list, pen: Penalties, stops) -> np.ndarray:
    """One row's logits after ``pen``, written from the rules' statements
    (vLLM's order: repetition, frequency and presence, bias, min_tokens)."""
    x = np.asarray(logits, np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / pen.repetition if x[t] > 0 else x[t] * pen.repetition
    for t in set(output):
        x[t] -= pen.frequency * output.count(t) + pen.presence
    for t, b in pen.logit_bias:
        x[t] += b
    if len(output) < pen.min_tokens:
        x[list(stops)] = -np.inf
    return x


def _random_penalties(rng, vocab: int, max_new: int) -> Penalties:
    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, int(rng.integers(0, 6)))}
    return Penalties(presence=float(rng.uniform(-2, 2)), frequency=float(rng.uniform(-2, 2)),
                     repetition=float(rng.uniform(0.5, 2)), logit_bias=bias,
                     min_tokens=int(rng.integers(0, max_new + 1)))


def test_the_rule_equals_numpy_on_random_rows():
    rng = np.random.default_rng()
    vocab, batch, width = 37, 6, 32
    rows, expected, logits = [], [], rng.normal(size=(batch, vocab)).astype(np.float32) * 3
    for b in range(batch):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        output = rng.integers(0, vocab, int(rng.integers(0, 12))).tolist()
        stops = sorted(set(rng.integers(0, vocab, 3).tolist()))
        pen = _random_penalties(rng, vocab, 12)
        rows.append((pen, prompt, output, stops))
        expected.append(numpy_penalized(logits[b], prompt, output, pen, stops))
    rows[2] = None  # a row without penalties is left as it is
    expected[2] = logits[2]
    stacked = RowPenalties.stack(rows, width)
    got = np.asarray(apply_penalties(jnp.asarray(logits), stacked, seen_tokens(stacked, vocab)))
    np.testing.assert_allclose(got, np.asarray(expected, np.float32), rtol=1e-6, atol=1e-5)


def _serve(model, prompts, penalties, samplings, new, **options):
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=len(prompts), max_model_len=64, decode_chunk=4, prefill_chunk=8, **options)
    ids = [engine.add_request(p, new, penalties=pen, sampling=s, logprobs=0, eos_token_id=1, seed=i)
           for i, (p, pen, s) in enumerate(zip(prompts, penalties, samplings))]
    engine.run()
    engine.check_bookkeeping()
    outputs = [engine.outputs[i] for i in ids]
    logprobs = [[lp for lp, _ in engine._requests[i].token_logprobs] for i in ids]
    return outputs, logprobs


@pytest.mark.parametrize("family", ["llama", "qwen3_next/small", "gemma3/small"])
def test_engine_penalties_equal_numpy_over_a_no_cache_forward(family):
    """Random penalties per request (one request without): each greedy
    token is the argmax of the numpy-penalized logits of a no-cache forward
    over the tokens before it, its logprob their log_softmax; a sampled
    request keeps its length and never emits a token biased by -100, nor
    its stop token before ``min_tokens``."""
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(int(np.random.default_rng().integers(99))))
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, family))
    vocab, new = model.config.vocab_size, 12
    rng = np.random.default_rng()
    prompts = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(3, 14, 4)]
    penalties = [_random_penalties(rng, vocab, new) for _ in range(3)] + [None]
    banned = int(rng.integers(2, vocab))
    penalties[2] = Penalties(frequency=1.0, logit_bias={banned: -100.0}, min_tokens=new)
    samplings = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()]
    outputs, logprobs = _serve(model, prompts, penalties, samplings, new)
    for i, (prompt, pen, out) in enumerate(zip(prompts, penalties, outputs)):
        if samplings[i].is_greedy:
            stop = out[-1] == 1
            assert len(out) == new or stop
            # One causal forward: the logits before token `step` see only the tokens before it.
            forward = np.asarray(model.forward_dense(jnp.asarray([prompt + out])).reshape(-1, vocab))
            for step, token in enumerate(out):
                raw = forward[len(prompt) + step - 1]
                x = raw if pen is None else numpy_penalized(raw, prompt, out[:step], pen, [1])
                finite = x[np.isfinite(x)]
                want = x - finite.max() - np.log(np.exp(finite - finite.max()).sum())
                top = np.sort(x)[::-1]
                if top[0] - top[1] > 1e-4:  # not a float tie: the argmax is the token
                    assert token == int(np.argmax(x)), (i, step)
                np.testing.assert_allclose(logprobs[i][step], want[token], rtol=1e-4, atol=2e-4, err_msg=f"{i}")
        else:
            assert len(out) == new and banned not in out and 1 not in out


def test_refusals():
    for bad in (dict(presence=2.5), dict(frequency=-3), dict(repetition=0), dict(repetition=11),
                dict(logit_bias={-1: 1}), dict(logit_bias={1: 101}), dict(logit_bias={1: float("nan")}),
                dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), dict(min_tokens=-1),
                dict(min_tokens=1.5), dict(presence="1"), dict(logit_bias=[1, 2])):
        with pytest.raises(InvalidArgument, match="Penalties"):
            Penalties(**bad)
    from jaxkv.serve import Engine

    engine = Engine(LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(0)), max_seqs=2, max_model_len=32)
    with pytest.raises(InvalidArgument, match="logit_bias holds token ids outside the vocabulary"):
        engine.add_request([1, 2], 4, penalties={"logit_bias": {61: 1.0}})
    with pytest.raises(InvalidArgument, match="min_tokens=5 is more than max_new_tokens=4"):
        engine.add_request([1, 2], 4, penalties={"min_tokens": 5})
    with pytest.raises(InvalidArgument, match="unknown keys"):
        engine.add_request([1, 2], 4, penalties={"presence_penalty": 1.0})
    assert Penalties(logit_bias={5: 1, 2: -1}).logit_bias == ((2, -1.0), (5, 1.0))
    assert Penalties().is_off and not Penalties(min_tokens=1).is_off
