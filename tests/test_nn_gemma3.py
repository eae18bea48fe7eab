"""Gemma 3 text (``Gemma3ForCausalLM``, ``gemma3_text``) against transformers, and its cache paths.

Fixtures in ``tests/fixtures/gemma3/`` (made by transformers 5.24 with
``tests/fixtures/make_gptoss_gemma3_fixtures.py``; torch is not needed here):
``small`` (6 layers, 5 sliding + 1 global, window 8, linear rope factor 8 on
the global layer, final logit soft cap 30) and ``nocap`` (7 layers ending in
a sliding one, window 16, no caps). ``expected.json`` holds transformers'
last-position logits of each prompt and its greedy tokens (each the argmax
of a no-cache forward over the sequence so far).

The cache paths (``model(tokens, manager, ...)`` over ``make_cache`` with
window rings or paged window layers, chunked prefill then token-by-token
decode of two requests at once; ``forward_packed``) are checked against
``forward_dense`` of the same sequences, on fresh random tokens, prompts
several windows long.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn.checkpoint import load_tensors
from jaxkv.nn.config import RopeScaling
from jaxkv.nn.gemma3 import Gemma3ForCausalLM, cache_for
from jaxkv.nn.gemma3_config import Gemma3Config
from jaxkv.nn.generate import generate
from jaxkv.nn.layers import named_state
from jaxkv.nn.packed import PackedLane, pack

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gemma3")
_MODELS = {}


def _dir(name):
    return os.path.join(FIXTURES, name)


def _expected(name):
    with open(os.path.join(_dir(name), "expected.json"), encoding="utf-8") as f:
        return json.load(f)


def _model(name, dtype=None):
    if (name, dtype) not in _MODELS:
        _MODELS[name, dtype] = Gemma3ForCausalLM.from_pretrained(_dir(name), dtype=dtype, param_dtype=dtype)
    return _MODELS[name, dtype]


_dense = nnx.jit(lambda m, t: m.forward_dense(t))
_reserve = jax.jit(lambda manager, slots, n, width: manager.reserve(slots, n, max_new_tokens=width),
                   static_argnums=(3,))
_step = nnx.jit(lambda m, tokens, manager, slots, starts, n: m(tokens, manager, slots, starts, n))


def _dense_padded(model, tokens, length):
    """``forward_dense`` of ``tokens`` padded to ``length`` (causal: the
    padding changes no earlier position; one program per length)."""
    padded = np.zeros((length,), np.int32)
    padded[:len(tokens)] = tokens
    return np.asarray(_dense(model, jnp.asarray(padded)))[:len(tokens)]


# ----------------------------------------------------------------------------- config


HF_524 = {  # what transformers 5.24's save_pretrained writes (fixture small, trimmed)
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "_sliding_window_pattern": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "attn_logit_softcapping": None,
    "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "rope_parameters": {"full_attention": {"factor": 8.0, "rope_theta": 1e6, "rope_type": "linear"},
                        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
    "tie_word_embeddings": True, "use_bidirectional_attention": False, "dtype": "float32", "eos_token_id": [1, 106],
}


def test_config_reads_transformers_5_spelling():
    c = Gemma3Config.from_hf(HF_524)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (c.rope_theta, c.rope_scaling) == (1e6, RopeScaling("linear", factor=8.0))
    assert (c.rope_local_base_freq, c.rope_local_scaling) == (1e4, None)
    assert c.rope_of(0) == (1e4, None) and c.rope_of(5) == (1e6, RopeScaling("linear", factor=8.0))
    assert c.attention_scale == 24 ** -0.5 and c.sliding_window == 8 and c.final_logit_softcapping == 30.0
    assert c.eos_token_id == (1, 106) and c.torch_dtype == "float32"
    assert Gemma3Config.from_hf(c.to_hf()) == c


def test_config_reads_the_older_spelling():
    """rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern (Hub configs of Gemma 3)."""
    old = {k: v for k, v in HF_524.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=5e5, rope_local_base_freq=2e3, rope_scaling={"rope_type": "linear", "factor": 4.0},
               sliding_window_pattern=3, num_hidden_layers=7)
    c = Gemma3Config.from_hf(old)
    assert c.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2 + ("sliding_attention",)
    assert (c.rope_theta, c.rope_scaling, c.rope_local_base_freq) == (5e5, RopeScaling("linear", factor=4.0), 2e3)
    # Nothing about rope at all: transformers' defaults, pattern 6.
    bare = {k: v for k, v in old.items() if not k.startswith("rope") and k != "sliding_window_pattern"}
    c = Gemma3Config.from_hf(bare)
    assert (c.rope_theta, c.rope_scaling, c.rope_local_base_freq, c.rope_local_scaling) == (1e6, None, 1e4, None)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")


@pytest.mark.parametrize("change,field", [
    ({"model_type": "gemma3"}, "model_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                             "partial_rotary_factor": 0.5}}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"sliding_window": None}, "sliding_window"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: .*set it to null"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]}, "layer_types"),
    ({"head_dim": 0}, "head_dim"),
])
def test_config_refuses_naming_the_field(change, field):
    with pytest.raises(InvalidArgument, match=field):
        Gemma3Config.from_hf({**HF_524, **change})


# ----------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", ["small", "nocap"])
def test_prompt_logits_and_greedy_equal_transformers(name):
    """Last-position logits of every prompt, then the greedy tokens by
    no-cache recompute (one padded program per fixture)."""
    expected, model = _expected(name), _model(name)
    length = max(len(p) for p in expected["prompts"]) + expected["max_new_tokens"]
    for prompt, greedy, last in zip(expected["prompts"], expected["greedy"], expected["prompt_last_logits"]):
        np.testing.assert_allclose(_dense_padded(model, prompt, length)[-1], last, rtol=1e-4, atol=2e-4)
        seq = list(prompt)
        for _ in range(expected["max_new_tokens"]):
            seq.append(int(np.argmax(_dense_padded(model, seq, length)[-1])))
        assert seq[len(prompt):] == greedy


def test_fp8_pages_and_exact_rings_keep_transformers_tokens():
    """``entry_format="fp8"``: the global layers' pages in float8_e4m3fn with
    per-token scales, the window rings in the compute dtype, prompts
    prefilled in 8-token pieces (later pieces read the stored fp8 pages).
    Every fixture prompt keeps transformers' greedy tokens (its margins are
    0.056 .. 0.57; the fp8 rounding moved no argmax here: on the gpt-oss
    fixture, whose logits are twice as large, it does, so no such test)."""
    expected = _expected("small")
    model = _model("small")
    out = generate(model, expected["prompts"], expected["max_new_tokens"], entry_format="fp8",
                   prefill_chunk_size=8)
    assert out.tokens == expected["greedy"]
    manager = out.state.manager
    assert manager.full_pool.k_pages.dtype == jnp.float8_e4m3fn and manager.window_pool.dtype == jnp.float32


def test_generate_through_the_ring_cache_equals_transformers():
    """Every prompt of the fixture in ONE mixed-length batch through
    :func:`jaxkv.nn.generate` (prefill, then the jitted decode loop over
    window rings)."""
    expected = _expected("small")
    out = generate(_model("small"), expected["prompts"], expected["max_new_tokens"])
    assert out.tokens == expected["greedy"]


def test_bfloat16_stays_near_float32():
    """The bf16 model (params and compute) follows the float32 one."""
    tokens = jnp.asarray(np.random.default_rng().integers(0, 256, 24), jnp.int32)
    f32 = np.asarray(_model("small").forward_dense(tokens))
    bf16 = _model("small", jnp.bfloat16).forward_dense(tokens)
    assert bf16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(bf16), f32, atol=0.05 * np.abs(f32).max())


# ----------------------------------------------------------------------------- the cache paths


def _sequences(rng, model, lengths):
    return [rng.integers(0, model.config.vocab_size, n).tolist() for n in lengths]


# The paged layout in the long pass (tests/conftest.py): gpt-oss checks it by default.
@pytest.mark.parametrize("window_cache", ["ring", "paged"])
def test_cached_steps_equal_no_cache_recompute(window_cache):
    """Two requests at once: prompts of 37 and 23 tokens (4.6 and 2.9
    windows) prefilled 6 tokens per step (the shorter one idles once its
    prompt is in), then 6 tokens each decoded one per step; every logit
    equals ``forward_dense`` of the request's whole sequence."""
    model = _model("small")
    rng = np.random.default_rng()
    prompt_lens, decode = (37, 23), 6
    seqs = _sequences(rng, model, [n + decode for n in prompt_lens])
    dense = [_dense_padded(model, s, 48) for s in seqs]
    manager = model.make_cache(3, 64, page_size=4, window_cache=window_cache)
    manager, slots, ok = manager.admit(2, max_n=2)
    assert bool(ok)
    fed = [0, 0]

    def step(width, counts):
        nonlocal manager
        rows = np.zeros((2, width), np.int32)
        for r, n in enumerate(counts):
            rows[r, :n] = seqs[r][fed[r]:fed[r] + n]
        n = jnp.asarray(counts, jnp.int32)
        manager, starts, ok = _reserve(manager, slots, n, width)
        assert bool(ok)
        np.testing.assert_array_equal(np.asarray(starts), fed)
        logits, manager = _step(model, jnp.asarray(rows), manager, slots, starts, n)
        logits = np.asarray(logits)
        for r, c in enumerate(counts):
            np.testing.assert_allclose(logits[r, :c], dense[r][fed[r]:fed[r] + c], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{window_cache}: request {r} from position {fed[r]}")
            fed[r] += c

    while fed[0] < prompt_lens[0]:
        step(6, [min(6, p - f) for p, f in zip(prompt_lens, fed)])
    for _ in range(decode):
        step(1, [1, 1])


def test_forward_packed_equals_no_cache_recompute():
    """A packed stream: request A's 29-token prompt in pieces of up to 8 on
    the prefill lane while request B (its prompt packed first) decodes
    token by token on the decode lane; each lane's logits equal
    ``forward_dense``'s at its last token."""
    model = _model("small")
    rng = np.random.default_rng()
    a, b = _sequences(rng, model, (29, 27))
    dense = [_dense_padded(model, s, 48) for s in (a, b)]
    manager = model.make_cache(3, 64, page_size=4)
    manager, slots, ok = manager.admit(2, max_n=2)
    assert bool(ok)
    slot_a, slot_b = (int(s) for s in np.asarray(slots))

    @nnx.jit
    def packed(m, manager, batch):
        manager, _, ok = manager.reserve(batch.seq_ids, batch.q_lens, max_new_tokens=batch.max_prefill_len)
        logits, manager = m.forward_packed(batch, manager)
        return logits, manager, ok

    def run(lanes, want):
        nonlocal manager
        batch = pack(lanes, num_lanes=2, num_tokens=11, num_prefill_lanes=1, max_prefill_len=8)
        logits, manager, ok = packed(model, manager, batch)
        assert bool(ok)
        for i, expected in want:
            np.testing.assert_allclose(np.asarray(logits)[i], expected, rtol=1e-4, atol=1e-4)

    run([PackedLane(slot_b, b[:8], 0)], [(0, dense[1][7])])  # B's prompt on the prefill lane
    fed_a, fed_b = 0, 8
    while fed_b < len(b):
        n = min(int(rng.integers(3, 9)), len(a) - fed_a)
        lanes = [PackedLane(slot_a, a[fed_a:fed_a + n], fed_a) if n else PackedLane(-1, [], 0),
                 PackedLane(slot_b, b[fed_b:fed_b + 1], fed_b)]
        want = ([(0, dense[0][fed_a + n - 1])] if n else []) + [(1, dense[1][fed_b])]
        run(lanes, want)
        fed_a, fed_b = fed_a + n, fed_b + 1
    assert fed_a == len(a)


def test_cache_of_another_shape_is_refused():
    model = _model("small")
    c = model.config
    slots = jnp.asarray([1], jnp.int32)
    for other in (c.replace(num_key_value_heads=4), c.replace(num_hidden_layers=7, layer_types=()),
                  c.replace(sliding_window=5)):
        manager = cache_for(other, 2, 32)
        with pytest.raises(InvalidArgument, match="make_cache"):
            model(jnp.zeros((1, 1), jnp.int32), manager, slots, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(InvalidArgument, match="window_cache"):
        model.make_cache(2, 32, window_cache="sliding")


# ----------------------------------------------------------------------------- checkpoints


def test_save_then_load_round_trips(tmp_path):
    model = _model("nocap")
    model.save_pretrained(tmp_path)
    again = Gemma3ForCausalLM.from_pretrained(tmp_path)
    assert again.config == model.config
    saved = load_tensors(tmp_path)  # transformers' names; the tied lm_head is not written
    assert "model.embed_tokens.weight" in saved and "model.layers.6.self_attn.q_norm.weight" in saved
    assert "lm_head.weight" not in saved
    before, after = named_state(model), named_state(again)
    assert before.keys() == after.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_load_names_a_missing_or_unexpected_tensor():
    config = _model("small").config
    tensors = named_state(_model("small"), lambda p: "model." + p)
    missing = dict(tensors)
    del missing["model.layers.5.self_attn.k_norm.weight"]
    with pytest.raises(InvalidArgument, match="model.layers.5.self_attn.k_norm.weight"):
        Gemma3ForCausalLM.from_hf_state_dict(config, missing)
    with pytest.raises(InvalidArgument, match="model.layers.6.mlp.up_proj.weight"):
        Gemma3ForCausalLM.from_hf_state_dict(config, {**tensors, "model.layers.6.mlp.up_proj.weight": np.zeros(3)})
    # The tied lm_head a checkpoint may carry anyway is ignored.
    Gemma3ForCausalLM.from_hf_state_dict(config, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
