"""Packed (ragged) steps of the paged-pool families against a no-cache recomputation.

Several requests run through :func:`jaxkv.nn.steps.paged_packed_step`: each
step packs prefill pieces of some requests (random lengths, cut anywhere)
with the decode token of others, in random rows. Every token a lane samples
must be the argmax of the model's no-cache ``forward_dense`` over that
request's tokens so far (the independent expectation), its logits equal to
float32 rounding; the pool's pages outside what the requests hold are NaN
(poisoned), so a read outside a request's blocks shows. Llama with GQA, a
sliding window on every layer (decode lanes trim their tables) and an fp8
pool; DeepSeek-V3 (MLA rows) from its fixture.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import BlockSpaceManager
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.packed import PackedLane, pack
from jaxkv.nn.sampling import GREEDY, RowSampling
from jaxkv.nn.steps import paged_packed_step, paged_window

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
PAGE = 4
LANES = 4
TOKENS = 32


def _llama(window=None):
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         sliding_window=window)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))


@partial(jax.jit, static_argnames=("graphdef", "window"), donate_argnums=(2, 3))
def _step(graphdef, params, manager, pool, batch, sampling, keys, window):
    return paged_packed_step(graphdef, params, manager, pool, batch, sampling, keys, window=window)


_admit = jax.jit(BlockSpaceManager.admit_with_prefix)
DENSE_LEN = 48


@partial(jax.jit, static_argnames=("graphdef", "kv_dtype"))
def _dense(graphdef, params, tokens, kv_dtype):
    """No-cache causal forward (tokens past a request's end change nothing before it)."""
    return nnx.merge(graphdef, params).forward_dense(tokens, kv_dtype=kv_dtype)


def _padded(tokens):
    out = np.zeros((1, DENSE_LEN), np.int32)
    out[0, : len(tokens)] = tokens
    return jnp.asarray(out)


def _poison(pool):
    """Every page NaN (and every fp8 scale): a page the run did not write
    must never reach an output."""
    def nan_bits(bits):
        if bits is None:
            return None
        if jnp.issubdtype(bits.dtype, jnp.floating):
            return jnp.full_like(bits, jnp.nan)
        return jnp.full_like(bits, -1)  # all ones: a NaN in every float format it stores (fp8 e4m3fn/e5m2, bf16)

    def nan(x):
        return None if x is None else jnp.full_like(x, jnp.nan)

    return pool.replace(k_bits=nan_bits(pool.k_bits), v_bits=nan_bits(pool.v_bits), k_scales=nan(pool.k_scales),
                        v_scales=nan(pool.v_scales))


def _run(model, kv_dtype=None, *, tol=2e-4, steps=14, rng=None):
    rng = rng or np.random.default_rng()
    graphdef, params = nnx.split(model)
    window = paged_window(model)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(3, 21, size=LANES + 1)]
    rows = rng.permutation(LANES)
    manager = BlockSpaceManager.create(num_device_blocks=64, num_host_blocks=2, block_size=PAGE, max_seqs=LANES,
                                       max_blocks_per_seq=16)
    pool = _poison(model.make_pool(64, PAGE, dtype=kv_dtype))
    # Requests: [row, tokens so far, prompt length, prefilled, logits expected]
    waiting = list(range(len(prompts)))
    running = {}
    sampled = taken = 0
    # At least `steps` steps, then more until 2 * LANES tokens were checked (admissions and prefill pieces are
    # drawn: 10 steps sampled fewer in about 1 run of 500). A request never holds more than 20 + steps tokens.
    while taken < steps or sampled < 2 * LANES:
        taken += 1
        assert taken <= 40, f"40 steps sampled only {sampled} tokens"
        free = [r for r in rows if r not in {req["row"] for req in running.values()}]
        while waiting and free and rng.random() < 0.7:
            i = waiting.pop(0)
            row = int(free.pop(0))
            manager, ok = _admit(manager, jnp.asarray([row]), jnp.full((1, 16), -1, jnp.int32),
                                 jnp.asarray([len(prompts[i])]))
            assert bool(ok)
            running[i] = {"row": row, "tokens": list(prompts[i]), "done": 0}
        prefill, decode, budget = [], [], TOKENS - LANES
        for i, req in running.items():
            if req["done"] < len(prompts[i]):
                n = int(min(rng.integers(1, 9), len(prompts[i]) - req["done"], budget))
                if n <= 0:
                    continue
                budget -= n
                end = req["done"] + n
                prefill.append((i, True, PackedLane(req["row"], req["tokens"][req["done"]:end], req["done"],
                                              end == len(prompts[i]))))
            else:
                decode.append((i, False, PackedLane(req["row"], req["tokens"][-1:], len(req["tokens"]) - 1)))
        if not prefill and not decode:
            continue
        order = prefill + decode
        batch = pack([lane for *_, lane in order], num_lanes=LANES, num_tokens=TOKENS, num_prefill_lanes=LANES,
                     max_prefill_len=TOKENS, num_prefill=len(prefill))
        keys = jax.random.split(jax.random.key(0), LANES)
        manager, pool, tokens, _, ok, _, _, _, _ = _step(graphdef, params, manager, pool, batch,
                                                   RowSampling.broadcast(GREEDY, LANES), keys, window)
        assert bool(ok)
        tokens = np.asarray(tokens)
        for lane, (i, is_prefill, packed) in enumerate(order):
            req = running[i]
            if is_prefill:
                req["done"] += len(packed.tokens)
            if not packed.sample:
                continue
            dense = _dense(graphdef, params, _padded(req["tokens"]), kv_dtype)[0, len(req["tokens"]) - 1]
            top = np.sort(np.asarray(dense))[-2:]
            if top[1] - top[0] > 10 * tol:  # not a near tie: the token is determined
                assert tokens[lane] == int(jnp.argmax(dense)), (i, len(req["tokens"]))
            req["tokens"].append(int(tokens[lane]))
            sampled += 1
    return manager


@pytest.mark.parametrize("case", ["gqa", "window", "fp8"])
def test_llama_packed_steps_equal_no_cache_recompute(case):
    model = _llama(window=6 if case == "window" else None)
    _run(model, jnp.float8_e4m3fn if case == "fp8" else None)


def test_dsv3_packed_steps_equal_no_cache_recompute():
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "dsv3", "small"))
    _run(model, steps=10)
