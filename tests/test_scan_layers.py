"""Decoder layers under one ``lax.scan`` (:mod:`jaxkv.nn.scan`, issue 41
item 1): the plan against a brute-force search over every (head, period)
split, and a scanned model against the same model unrolled (built from the
same seed: equal weights) on random token streams: the same greedy tokens,
logits equal to float32 summation order, checkpoints saved and loaded the
same; for a uniform Llama, Qwen2-style windows on some layers (a head or a
pattern outside one run) and DeepSeek-V3's dense head before its MoE layers."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.generate import generate
from jaxkv.nn.scan import DecoderStack, scan_plan

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def brute_force_plan(signatures, max_period=16):
    """Every (head, period, reps) that repeats, the fewest layers outside
    first, then the shortest period, then the shortest head."""
    n, found = len(signatures), []
    for head in range(n):
        for period in range(1, max_period + 1):
            for reps in range(2, (n - head) // period + 1):
                block = signatures[head: head + period]
                if all(signatures[head + r * period: head + (r + 1) * period] == block for r in range(reps)):
                    found.append((n - reps * period, period, head, reps))
    if not found:
        return (n, 0, 0)
    left, period, head, reps = min(found)
    return (head, period, reps)


@pytest.mark.parametrize("trial", range(30))
def test_the_plan_leaves_the_fewest_layers_out(trial):
    rng = np.random.default_rng()
    n = int(rng.integers(1, 40))
    kind = trial % 3
    if kind == 0:  # a random pattern repeated, with a random head and tail
        pattern = rng.integers(0, 3, int(rng.integers(1, 7))).tolist()
        head = rng.integers(3, 6, int(rng.integers(0, 4))).tolist()
        signatures = (head + pattern * n)[:n + len(head)]
    elif kind == 1:  # random signatures
        signatures = rng.integers(0, 2, n).tolist()
    else:  # windows on the first or last layers only (Qwen2's max_window_layers)
        k = int(rng.integers(0, n + 1))
        signatures = [None] * k + [4096] * (n - k)
    head, period, reps = scan_plan(signatures)
    expect = brute_force_plan(signatures)
    assert len(signatures) - period * reps == len(signatures) - expect[1] * expect[2], (signatures, expect)
    assert period <= expect[1] or period * reps > expect[1] * expect[2]
    if reps:
        block = signatures[head: head + period]
        assert all(signatures[head + r * period: head + (r + 1) * period] == block for r in range(reps))


def _llama(layers: int, windows=None, seed: int = 0, scan: bool = True) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                         max_position_embeddings=128, sliding_window=None if windows is None else 6,
                         sliding_window_layers=windows)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(seed), scan_layers=scan)


def _same_model(scanned, unrolled, rng, tmp_path):
    a, b = scanned.hf_state_dict(), unrolled.hf_state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    tokens = jnp.asarray(rng.integers(0, scanned.config.vocab_size, (2, 19)))
    np.testing.assert_allclose(scanned.forward_dense(tokens), unrolled.forward_dense(tokens), rtol=1e-4, atol=1e-4)
    prompts = [rng.integers(1, scanned.config.vocab_size, int(rng.integers(3, 30))).tolist() for _ in range(2)]
    assert generate(scanned, prompts, 6).tokens == generate(unrolled, prompts, 6).tokens
    scanned.save_pretrained(tmp_path)
    loaded = type(scanned).from_pretrained(tmp_path)
    assert loaded.layers.reps == scanned.layers.reps
    np.testing.assert_array_equal(loaded.forward_dense(tokens), scanned.forward_dense(tokens))


@pytest.mark.parametrize("layers,windows", [(5, None), (6, (0, 1)), (7, (1, 3, 5))])
def test_a_scanned_llama_is_the_unrolled_one(layers, windows, tmp_path):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 20))
    scanned, unrolled = _llama(layers, windows, seed), _llama(layers, windows, seed, scan=False)
    assert isinstance(scanned.layers, DecoderStack) and scanned.layers.reps >= 2
    assert unrolled.layers.reps == 0
    _same_model(scanned, unrolled, rng, tmp_path)


def test_a_scanned_deepseek_v3_keeps_its_dense_head(tmp_path):
    path = os.path.join(FIXTURES, "dsv3", "small")
    scanned = AutoModelForCausalLM.from_pretrained(path)
    unrolled = AutoModelForCausalLM.from_pretrained(path, scan_layers=False)
    c = scanned.config
    assert scanned.layers.head_len == c.first_k_dense_replace and scanned.layers.reps >= 2
    _same_model(scanned, unrolled, np.random.default_rng(), tmp_path)
