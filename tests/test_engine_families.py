"""The engine serving every family: hybrid-cache models (DeepSeek-V4,
Qwen3-Next) over their ``KVCacheManager``, with transformers' greedy tokens
(the fixtures of ``test_nn_deepseek_v4`` / ``test_nn_qwen3_next_dsv3``)
under block pressure that forces recompute preemptions and every slot and
block back when the run ends; and a sliding-window model (Mistral) whose
requests outgrow the pool but not their window. (DeepSeek-V3 and the Llama
family: ``test_nn_qwen3_next_dsv3.test_dsv3_runs_on_the_engine``,
``test_nn_engine``.)
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import FREE
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# (fixture, blocks per group, decode chunk): tight enough that requests
# admitted together outgrow the free blocks and one is preempted.
CASES = {
    "dsv4/small": ({"csa4": 3, "hca16": 3}, 8),
    "qwen3_next/small": ({"full": 12}, 2),
}


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_tokens_equal_transformers_under_preemption(name):
    model, expected = _fixture(name)
    num_blocks, chunk = CASES[name]
    engine = Engine(model, max_seqs=3, max_context_tokens=256, num_blocks=num_blocks, decode_chunk=chunk,
                    prefill_chunk=64)
    # Longest first, all at once: the first three are admitted together.
    order = np.argsort([-len(p) for p in expected["prompts"]])
    ids = {int(i): engine.add_request(expected["prompts"][i], expected["max_new_tokens"]) for i in order}
    summary = engine.run()
    for i, rid in ids.items():
        assert engine.outputs[rid] == expected["greedy"][i], f"prompt {i}"
    assert summary.recompute_preemptions > 0 and summary.swap_preemptions == 0
    assert summary.generated_tokens == sum(map(len, expected["greedy"]))
    assert 0 < summary.peak_kv_blocks <= summary.kv_blocks == int(engine.cache.capacity.sum())
    assert engine.cache.blocks_in_use() == 0 and (engine.cache.row_status() == FREE).all()
    assert int(engine.manager.slots.num_free) == engine.manager.max_requests


def test_hybrid_engine_refuses_what_it_cannot_do():
    model, _ = _fixture("qwen3_next/small")
    for bad, word in [(dict(num_pages=64, max_blocks_per_seq=8), "num_pages"), (dict(kv_dtype="bfloat16"), "kv_dtype"),
                      (dict(num_host_pages=8), "num_host_pages"), (dict(prefix_cache=True), "prefix_cache")]:
        with pytest.raises(InvalidArgument, match=word):
            Engine(model, max_context_tokens=64, **bad)
    with pytest.raises(InvalidArgument, match="max_context_tokens"):
        Engine(model)
    engine = Engine(model, max_seqs=2, max_context_tokens=64)
    with pytest.raises(InvalidArgument, match="max_context_tokens=64"):
        engine.add_request([1] * 60, 5)
    engine.add_request([1] * 60, 4)  # exactly fits


def test_windowed_requests_longer_than_the_pool_run_in_window_memory():
    """Mistral with a 6-token window on every layer, pages of 4, 5 blocks:
    each request holds 36 tokens (9 blocks) by its end, which only fits
    because decode gives back the blocks that left the window. Tokens equal
    ``generate`` alone (itself checked against the no-cache windowed forward
    in ``test_nn_llama``)."""
    config = LlamaConfig.from_hf(dict(
        model_type="mistral", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=256, sliding_window=6, tie_word_embeddings=False))
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    engine = Engine(model, num_pages=6, page_size=4, max_seqs=2, max_blocks_per_seq=16, decode_chunk=4)
    rng = np.random.default_rng()
    prompts = [rng.integers(1, 97, 6).tolist() for _ in range(3)]
    ids = [engine.add_request(p, 30) for p in prompts]
    summary = engine.run()
    for rid, prompt in zip(ids, prompts):
        assert engine.outputs[rid] == generate(model, [prompt], 30, page_size=4).tokens[0]
    assert summary.peak_kv_blocks <= 5 and engine.cache.blocks_in_use() == 0
    assert engine.prefix_cache.device_blocks() == []  # trimmed rows have no prefix left to cache


def test_demo_serves_a_hybrid_checkpoint_on_the_engine(capsys):
    from jaxkv import demo

    demo.main(["--model", os.path.join(FIXTURES, "qwen3_next/small"), "--prompt", "3,17,42", "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert "Qwen3NextForCausalLM on the engine: ['full'] block groups" in out
    assert "requests 1 | generated tokens 2" in out
