"""``jaxkv.nn.generate``: the jitted decode loop against a no-cache greedy
recomputation, the per-step host loop, EOS stops and block accounting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument, KVCacheOOM
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.nn.generate import generate
from jaxkv.nn.sampling import RowSampling, SamplingParams, sample

CONFIG = dict(
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=256, tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(1, CONFIG["vocab_size"], size=n).tolist() for n in (3, 9, 6)]  # cross 4-token pages


WIDTH = 16  # every no-cache forward runs at this padded width: one compile


def greedy_without_cache(model, prompt, steps):
    """Append the argmax of a full causal forward over the whole sequence
    (padding after the sequence cannot change causal logits before it)."""
    graphdef, params = nnx.split(model)
    dense = jax.jit(lambda params, tokens: nnx.merge(graphdef, params).forward_dense(tokens))
    sequence = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(sequence)] = sequence
        logits = dense(params, jnp.asarray(padded))
        sequence.append(int(jnp.argmax(logits[0, len(sequence) - 1])))
    return sequence[len(prompt):]


def test_greedy_loop_matches_no_cache_recomputation(model, prompts):
    out = generate(model, prompts, 6, page_size=4)
    for prompt, tokens in zip(prompts, out.tokens):
        assert tokens == greedy_without_cache(model, prompt, 6)
    manager = out.state.manager
    assert int(manager.device.num_free) == manager.device.capacity  # every block freed in the loop


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)])
def test_multi_step_loop_equals_per_step_host_loop(model, prompts, sampling):
    loop = generate(model, prompts, 6, page_size=4, sampling=sampling, seed=3)
    host = generate(model, prompts, 6, page_size=4, sampling=sampling, seed=3, per_step=True)
    assert loop.tokens == host.tokens
    assert all(len(t) == 6 for t in loop.tokens)
    assert all(0 <= tok < CONFIG["vocab_size"] for t in loop.tokens for tok in t)


def test_eos_stops_a_row_and_frees_its_blocks(model, prompts):
    free_run = generate(model, prompts, 6, page_size=4).tokens
    eos = free_run[1][2]  # row 1 emits this at its third step
    out = generate(model, prompts, 6, page_size=4, eos_token_id=eos)
    for row, tokens in enumerate(out.tokens):
        expected = free_run[row]
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert tokens == expected
    assert out.tokens[1][-1] == eos and len(out.tokens[1]) <= 3
    manager = out.state.manager
    assert int(manager.device.num_free) == manager.device.capacity


def test_pool_too_small_raises_oom(model, prompts):
    with pytest.raises(KVCacheOOM):
        generate(model, prompts, 6, page_size=4, num_pages=3)


def test_decode_out_of_blocks_names_the_rows_waiting(model):
    # The 4-token prompt fills its one block; the first decode token needs a
    # second block and the pool (null block + 1) has none.
    with pytest.raises(KVCacheOOM, match=r"requested 1 blocks, 0 available \(of 1 total\): decode ran out") as info:
        generate(model, [[5, 6, 7, 8]], 4, page_size=4, num_pages=2)
    assert (info.value.requested, info.value.available) == (1, 0)
    # ... and says why with the numbers: the row's peak and the pool.
    assert info.value.detail == ("decode ran out of KV blocks (the rows hold at most [2] blocks each, 2 together; "
                                 "the pool has 1)")


def test_bad_arguments(model):
    with pytest.raises(InvalidArgument):
        generate(model, [[]], 4)
    with pytest.raises(InvalidArgument):
        generate(model, [[1, 2]], 0)
    with pytest.raises(InvalidArgument):
        SamplingParams(top_p=0.0)


def test_sampling_filters():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
    key = jax.random.key(0)
    np.testing.assert_array_equal(sample(logits, key, SamplingParams()), np.argmax(np.asarray(logits), -1))
    np.testing.assert_array_equal(sample(logits, key, SamplingParams(temperature=1.0, top_k=1)),
                                  np.argmax(np.asarray(logits), -1))
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    for seed in range(20):
        drawn = np.asarray(sample(logits, jax.random.key(seed), SamplingParams(temperature=2.0, top_k=3)))
        assert all(drawn[b] in top3[b] for b in range(4))
    # top_p: keep the smallest set of most likely tokens whose mass reaches p
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    order = np.argsort(-probs, axis=-1)
    for seed in range(20):
        drawn = np.asarray(sample(logits, jax.random.key(seed), SamplingParams(temperature=1.0, top_p=0.5)))
        for b in range(4):
            mass_before = probs[b, order[b]][: list(order[b]).index(drawn[b])].sum()
            assert mass_before < 0.5


@pytest.mark.gpu
def test_pallas_attention_gives_the_reference_greedy_tokens(model, prompts):
    """The compiled Pallas kernel as every layer's decode attention
    (``implementation="pallas"`` on the model) yields the reference path's
    greedy tokens."""
    reference = generate(model, prompts, 6, page_size=16).tokens
    kernel_model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0), implementation="pallas")
    assert generate(kernel_model, prompts, 6, page_size=16).tokens == reference


# ------------------------------------------------------------ the one sampler


def test_sampler_greedy_rows_are_argmax_and_top_k_keeps_exactly_k():
    """Per-row parameters: greedy rows give the argmax (ties: lowest id);
    a top-k row only ever draws among its k most likely tokens, and over
    many keys draws every one of them."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 30)), jnp.float32)
    params = RowSampling.stack([None, SamplingParams(temperature=5.0, top_k=3), SamplingParams(temperature=1.0, top_k=1),
                                SamplingParams(temperature=5.0, top_k=7)])
    jitted = jax.jit(sample)
    greedy = np.argmax(np.asarray(logits), -1)
    seen = [set() for _ in range(4)]
    for seed in range(200):
        drawn = np.asarray(jitted(logits, jax.random.key(seed), params))
        for row in range(4):
            seen[row].add(int(drawn[row]))
    top = np.argsort(-np.asarray(logits), axis=-1)
    assert seen[0] == {int(greedy[0])} and seen[2] == {int(greedy[2])}  # top_k=1 is greedy
    assert seen[1] == set(top[1, :3].tolist())
    assert seen[3] == set(top[3, :7].tolist())


def test_sampler_scalar_params_broadcast_and_row_keys_are_independent():
    """A SamplingParams equals the same RowSampling on every row (same key);
    with per-row keys, row b's token depends on keys[b] alone."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(3, 40)), jnp.float32)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    key = jax.random.key(5)
    np.testing.assert_array_equal(sample(logits, key, params), sample(logits, key, RowSampling.broadcast(params, 3)))
    keys = jax.random.split(jax.random.key(6), 3)
    together = np.asarray(sample(logits, keys, params))
    alone = [int(sample(logits[b:b + 1], keys[b:b + 1], params)[0]) for b in range(3)]
    assert together.tolist() == alone
    # the nucleus rule: every draw's more likely tokens hold less than top_p of the (top-k) mass
    probs = np.asarray(jax.nn.softmax(logits / 0.8, axis=-1))
    for seed in range(30):
        drawn = np.asarray(sample(logits, jax.random.key(seed), params))
        for b in range(3):
            kept = np.sort(probs[b])[::-1][:10]
            kept = kept / kept.sum()
            rank = int(np.sum(probs[b] > probs[b, drawn[b]]))
            assert rank < 10 and kept[:rank].sum() < 0.9


def test_sampler_refuses_raw_keys_and_bad_params():
    with pytest.raises(InvalidArgument):
        sample(jnp.zeros((2, 5)), jax.random.PRNGKey(0), SamplingParams(temperature=1.0))
    with pytest.raises(InvalidArgument):
        SamplingParams(temperature=-0.5)
    with pytest.raises(InvalidArgument):
        generate(LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0)), [[1]], 2, sampling={"top_k": 2})


def test_implementation_choice(model, prompts):
    """``implementation=`` picks the decode kernel: the Pallas kernel run by
    its interpreter gives the reference path's greedy tokens; a bad choice
    is refused when the model is built."""
    reference = generate(model, prompts[:1], 3, page_size=16).tokens
    graphdef, params = nnx.split(model)
    interpreted = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0), implementation="pallas",
                                   interpret=True)
    nnx.update(interpreted, params)
    assert interpreted.layers[0].self_attn.implementation == "pallas"
    assert generate(interpreted, prompts[:1], 3, page_size=16).tokens == reference
    with pytest.raises(InvalidArgument):
        LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0), implementation="triton")
    with pytest.raises(InvalidArgument):
        LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0), implementation="reference", interpret=True)
