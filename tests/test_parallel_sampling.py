"""``n`` samples of one prompt (the OpenAI server's ``n`` / ``best_of``:
seeded requests on the same prompt added together) share one prefill.

The first sibling is admitted and prefills the prompt; the others wait for
it (the scheduler's in-batch prefix rule) and then take its pages from the
prefix cache, so each computes only what the cache's hit grain leaves: the
partial last page and the last token on a paged pool, the last token alone
on a hybrid cache (token-grain snapshots). Expectation we did not write:
each sibling's tokens equal the same seeded request served alone, on an
engine of its own (no sharing there).
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


def _serve(model, prompt, seeds, sampling):
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=4, max_model_len=160, decode_chunk=4)
    ids = [engine.add_request(prompt, 8, sampling=sampling, seed=s) for s in seeds]
    outputs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.check_bookkeeping()
    return ([[t for o in outputs[i] for t in o.new_token_ids] for i in ids], [outputs[i][0].cached_tokens for i in ids],
            engine.cache.hit_grain)


@pytest.mark.parametrize("family", ["llama", "qwen3_next/small"])
def test_n_siblings_share_one_prefill(family):
    model = _model(family)
    rng = np.random.default_rng()
    prompt = rng.integers(1, model.config.vocab_size, int(rng.integers(60, 120))).tolist()
    seeds = rng.integers(0, 1 << 30, 4).tolist()
    sampling = SamplingParams(temperature=1.0)
    tokens, cached, grain = _serve(model, prompt, seeds, sampling)
    assert cached[0] == 0
    computable = len(prompt) - 1  # the last prompt token is always computed (its logits give the first token)
    assert cached[1:] == [computable - computable % grain] * 3, (cached, grain)
    for seed, got in zip(seeds, tokens):
        assert _serve(model, prompt, [seed], sampling)[0] == [got]
