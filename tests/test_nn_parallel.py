"""``jaxkv.nn.parallel``: parallel sampling and beam search through fork +
copy-on-write, against no-cache references (``forward_dense`` recomputed
over the whole sequence at every step), with the KV pages and block
accounting checked directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.nn.generate import generate
from jaxkv.nn.parallel import (
    beam_search,
    beam_search_output,
    parallel_sample,
    prefill_fork,
    sample_n,
    sequence_keys,
    setup_prompt,
)
from jaxkv.nn.sampling import SamplingParams, sample

CONFIG = dict(
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=256, tie_word_embeddings=False,
)
PROMPT = [5, 17, 33, 2, 41, 9]  # 6 tokens on 4-token pages: one full page, one half-filled (shared, then CoW)
PAGE = 4
N = 3
STEPS = 6
WIDTH = 16  # every no-cache forward runs at this padded width: one compile
SAMPLING = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def dense(model):
    """``dense(sequence) -> logits [len, V]`` of a full no-cache forward."""
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda params, tokens: nnx.merge(graphdef, params).forward_dense(tokens))

    def run(sequence):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(sequence)] = sequence
        return np.asarray(fn(params, jnp.asarray(padded)))[0, : len(sequence)]

    return run


@pytest.fixture(scope="module")
def dense_kv(model):
    """``dense_kv(sequence) -> [(k, v)] per layer`` ([T, KVH, D], after RoPE):
    what each layer's projections give on a no-cache forward."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def fn(params, tokens):
        m = nnx.merge(graphdef, params)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        x = m.embed_tokens(tokens)
        out = []
        for layer in m.layers:
            _, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions)
            out.append((k[0], v[0]))
            x = layer.forward_dense(x, positions)
        return out

    def run(sequence):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(sequence)] = sequence
        return [(np.asarray(k)[: len(sequence)], np.asarray(v)[: len(sequence)]) for k, v in fn(params, padded)]

    return run


@pytest.fixture(scope="module")
def sampled(model):
    """One parallel-sampling run with temperature, shared by several tests."""
    return parallel_sample(model, PROMPT, N, STEPS, sampling=SAMPLING, seed=11, page_size=PAGE)


# ------------------------------------------------------------ parallel sampling


def test_greedy_samples_are_identical_and_equal_generate(model):
    samples = sample_n(model, PROMPT, N, STEPS, page_size=PAGE)
    expected = generate(model, [PROMPT], STEPS, page_size=PAGE).tokens[0]
    assert samples == [expected] * N


def test_each_sample_replays_an_unshared_no_cache_run(dense, sampled):
    """Row ``i`` equals the same sampling procedure run alone without any
    cache: its own PRNG stream, logits recomputed by ``forward_dense`` over
    prompt + prefix at each step. A CoW bug (a row reading another row's
    K/V, or a stale page) changes the logits and with them the tokens."""
    keys = sequence_keys(11, N)
    assert len({tuple(t) for t in sampled.tokens}) > 1  # the rows really differ
    for row, tokens in enumerate(sampled.tokens):
        key = keys[row]
        sequence = list(PROMPT)
        for _ in range(STEPS):
            logits = dense(sequence)[-1]
            key, sub = jax.random.split(key)
            token = int(sample(jnp.asarray(logits)[None], sub, SAMPLING)[0])
            # the token lies in the top-k set of the no-cache distribution
            assert logits[token] >= np.sort(logits)[-SAMPLING.top_k]
            sequence.append(token)
        assert tokens == sequence[len(PROMPT):], row


def test_each_sample_pages_hold_its_own_kv(dense_kv, sampled):
    """Read every row's K/V back through the block table it had when it
    finished: it equals the projections of a no-cache forward over that
    row's own prompt + tokens (the last token's K/V is never written)."""
    state = sampled.state
    tables, lens = np.asarray(state.final_tables), np.asarray(state.final_lens)
    for row, tokens in enumerate(sampled.tokens):
        sequence = PROMPT + tokens[:-1]
        assert lens[row] == len(sequence)
        positions = np.arange(len(sequence))
        slots = tables[row, positions // PAGE] * PAGE + positions % PAGE
        for layer, (k_ref, v_ref) in enumerate(dense_kv(sequence)):
            k, v = state.pool.get_kv(layer, jnp.asarray(slots))
            np.testing.assert_allclose(np.asarray(k), k_ref, atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(v), v_ref, atol=1e-5, rtol=1e-5)
    # full prompt page shared by all rows to the end; the half-filled one copied on write
    assert len(set(tables[:, 0])) == 1
    assert len(set(tables[:, 1])) == N


def test_fork_shares_prompt_blocks_then_copy_on_write(model, sampled):
    # the same arguments as parallel_sample's, so prefill_fork is not compiled again
    setup = setup_prompt(model, PROMPT, N, STEPS, PAGE)
    graphdef, params = nnx.split(model)
    state = prefill_fork(graphdef, params, setup.manager, setup.pool, setup.padded, setup.length,
                         sequence_keys(11, N), np.int32(-1), SAMPLING, max_new=STEPS)
    assert bool(state.ok)
    manager = state.manager
    tables = np.asarray(manager.block_tables)
    full, partial = int(tables[0, 0]), int(tables[0, 1])
    assert (tables[:, :2] == [full, partial]).all() and (tables[:, 2] == -1).all()
    assert np.asarray(manager.device.ref_count(jnp.asarray([full, partial]))).tolist() == [N, N]
    assert int(manager.device.num_free) == manager.device.capacity - 2  # the prompt's two blocks, once
    # the sampled first tokens are those of the loop run
    assert np.asarray(state.last).tolist() == [t[0] for t in sampled.tokens]

    # First append: the half-filled shared page is copied for all rows but one.
    before = state.pool
    manager, pool, slots, _, ok = jax.jit(BlockSpaceManager.append_slots, static_argnums=3)(
        manager, state.pool, jnp.arange(N), 1)
    assert bool(ok)
    tables = np.asarray(manager.block_tables)
    assert (tables[:, 0] == full).all() and tables[0, 1] == partial
    copies = tables[1:, 1]
    assert len(set(copies.tolist()) | {partial}) == N
    assert np.asarray(manager.device.ref_count(jnp.asarray([full, partial, *copies]))).tolist() == [N] + [1] * N
    assert (np.asarray(slots)[:, 0] == tables[:, 1] * PAGE + len(PROMPT) % PAGE).all()
    for layer in range(CONFIG["num_hidden_layers"]):
        old = np.asarray(before.layer_arrays(layer)[0])[:, partial]
        for page in copies:
            np.testing.assert_array_equal(np.asarray(pool.layer_arrays(layer)[0])[:, page], old)


def test_finished_samples_free_every_block(sampled):
    manager = sampled.state.manager
    assert int(manager.device.num_free) == manager.device.capacity
    assert (np.asarray(manager.status) == 0).all()


def test_eos_stops_a_sample_early(model, sampled):
    eos = sampled.tokens[1][2]
    out = parallel_sample(model, PROMPT, N, STEPS, sampling=SAMPLING, seed=11, page_size=PAGE, eos_token_id=eos)
    for tokens, free_run in zip(out.tokens, sampled.tokens):
        expected = free_run[: free_run.index(eos) + 1] if eos in free_run else free_run
        assert tokens == expected
    assert int(out.state.manager.device.num_free) == out.state.manager.device.capacity


# ------------------------------------------------------------------ beam search


def reference_beam_search(dense, prompt, num_beams, steps, length_penalty=1.0, eos=None):
    """Brute-force beam search over no-cache logits, Hugging Face's rules:
    the top 2*num_beams candidates in order, EOS ranked < num_beams becomes a
    finished hypothesis (score / gen_len ** lp, EOS counted), the first
    num_beams non-EOS continue; after the last step the running beams join
    the hypotheses; the best num_beams are returned."""
    beams = [([], 0.0)]
    finished = []
    for _ in range(steps):
        candidates = []
        for tokens, score in beams:
            logits = dense(list(prompt) + tokens)[-1].astype(np.float64)
            logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            candidates += [(score + logp[v], tokens + [v]) for v in range(len(logp))]
        candidates.sort(key=lambda c: -c[0])
        beams = []
        for rank, (score, tokens) in enumerate(candidates[: 2 * num_beams]):
            if eos is not None and tokens[-1] == eos:
                if rank < num_beams:
                    finished.append((tokens, score / len(tokens) ** length_penalty))
            elif len(beams) < num_beams:
                beams.append((tokens, score))
        finished = sorted(finished, key=lambda h: -h[1])[:num_beams]
    final = finished + [(tokens, score / steps ** length_penalty) for tokens, score in beams]
    return sorted(final, key=lambda h: -h[1])[:num_beams]


def assert_same_beams(got, expected):
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], atol=1e-4, rtol=0)


def test_beam_search_matches_brute_force(model, dense):
    out = beam_search_output(model, PROMPT, 3, 5, page_size=PAGE)
    assert_same_beams(out.beams, reference_beam_search(dense, PROMPT, 3, 5))
    assert len({tuple(t) for t, _ in out.beams}) == 3
    manager = out.state.manager
    assert int(manager.device.num_free) == manager.device.capacity  # every block freed


def test_beam_search_with_eos_and_length_penalty(model, dense):
    plain = reference_beam_search(dense, PROMPT, 3, 5)
    eos = plain[0][0][2]  # the best beam's third token: an early EOS candidate
    expected = reference_beam_search(dense, PROMPT, 3, 5, length_penalty=0.5, eos=eos)
    assert any(len(t) < 5 and t[-1] == eos for t, _ in expected)  # a finished hypothesis is returned
    got = beam_search(model, PROMPT, 3, 5, page_size=PAGE, length_penalty=0.5, eos_token_id=eos)  # same compile
    assert_same_beams(got, expected)
