"""jaxkv.nn: Llama-family models over the paged pool.

Checks, on tiny models (hidden 64, 2 layers, 4 heads, 2 KV heads):

* ``forward_dense`` against an independent float64 numpy implementation of
  the Llama / Mistral / Qwen2 / Qwen3 forward written here from the math
  (weights under transformers' names, so the name mapping is checked too);
* paged prefill + decode (through a ``BlockSpaceManager`` and through
  shuffled hand-made block tables, pages poisoned with NaN first) against
  ``forward_dense`` over the whole sequence, at every position, plus greedy
  tokens; a prefix-cache hit (second prefill with ``starts > 0``); bf16;
  an fp8 KV pool;
* loading Hugging Face checkpoints written by the tests (single file,
  sharded, tied, bf16) and the errors for bad ones;
* ``paged_prefill_attention`` against dense causal attention in numpy.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxkv import BlockSpaceManager, InvalidArgument, KVPool
from jaxkv.nn import (
    LlamaConfig,
    LlamaForCausalLM,
    PagedAttention,
    generate,
    paged_prefill_attention,
)

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 64, 96, 2, 4, 2, 16
PAGE = 4
FP32_TOL = 1e-4

# ----------------------------------------------------------------------------
# HF-style configs and weights, written here without the library.
# ----------------------------------------------------------------------------

_BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, hidden_act="silu",
             max_position_embeddings=256)

CONFIGS = {
    "llama": dict(_BASE, model_type="llama", rope_theta=10000.0, tie_word_embeddings=False),
    # original_max_position_embeddings 64 puts this head_dim's wavelengths in
    # all three llama3 bands (kept, smoothed, divided by factor).
    "llama3": dict(_BASE, model_type="llama", rope_theta=10000.0, tie_word_embeddings=False,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64)),
    "mistral": dict(_BASE, model_type="mistral", rope_theta=1e6, sliding_window=5, tie_word_embeddings=False),
    "qwen2": dict(_BASE, model_type="qwen2", rope_theta=1e6, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096),
    # head_dim 32 != hidden / heads, as in real Qwen3 checkpoints.
    "qwen3": dict(_BASE, model_type="qwen3", rope_theta=1e6, head_dim=32, tie_word_embeddings=True,
                  attention_bias=False),
}


def _head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _biases(cfg):
    """(q/k/v bias, o bias) as transformers builds each family."""
    t = cfg["model_type"]
    if t == "qwen2":
        return cfg.get("attention_bias", True), False
    if t == "mistral":
        return False, False
    b = cfg.get("attention_bias", False)
    return b, b


def random_hf_weights(cfg, rng, dtype=np.float32):
    """Random weights under transformers' names and ``[out, in]`` layouts;
    norms near 1 and biases non-zero so every parameter matters."""
    e, v, i_, h, kvh, d = (cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"],
                           cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg))

    def lin(out, inp):
        return rng.normal(0.0, 1.0 / math.sqrt(inp), (out, inp))

    def norm(n):
        return 1.0 + 0.2 * rng.normal(size=n)

    qkv_bias, o_bias = _biases(cfg)
    w = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, (v, e)), "model.norm.weight": norm(e)}
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = lin(v, e)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(e)
        w[p + "post_attention_layernorm.weight"] = norm(e)
        for name, out in (("q", h * d), ("k", kvh * d), ("v", kvh * d)):
            w[p + f"self_attn.{name}_proj.weight"] = lin(out, e)
            if qkv_bias:
                w[p + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, 0.5, out)
        w[p + "self_attn.o_proj.weight"] = lin(e, h * d)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = rng.normal(0.0, 0.5, e)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = lin(i_, e)
        w[p + "mlp.up_proj.weight"] = lin(i_, e)
        w[p + "mlp.down_proj.weight"] = lin(e, i_)
    return {k: np.asarray(a, dtype=dtype) for k, a in w.items()}


# ----------------------------------------------------------------------------
# The independent numpy reference (float64), from the math.
# ----------------------------------------------------------------------------


def np_inv_freq(cfg):
    d = _head_dim(cfg)
    inv = [1.0 / cfg.get("rope_theta", 10000.0) ** (2 * i / d) for i in range(d // 2)]
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, lo, hi, old = (rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                               rs["original_max_position_embeddings"])
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:  # high frequency: unchanged
                out.append(f)
            elif wavelen > old / lo:  # low frequency: interpolated by factor
                out.append(f / factor)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        inv = out
    return np.array(inv, dtype=np.float64)


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope(x, positions, inv):
    """x [T, H, D]: pair (i, i + D/2) rotated by position * inv[i]."""
    half = x.shape[-1] // 2
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # [T, D/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def np_window(cfg, layer):
    t = cfg["model_type"]
    if t == "mistral":
        return cfg.get("sliding_window")
    if t in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        types = cfg.get("layer_types")
        return cfg["sliding_window"] if types and types[layer] == "sliding_attention" else None
    return None


def np_forward(cfg, w, tokens):
    """Logits [T, V] of one sequence, float64."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps = cfg["rms_norm_eps"]
    h, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg)
    t = len(tokens)
    pos = np.arange(t)
    inv = np_inv_freq(cfg)
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."

        def proj(name, inp, p=p):
            y = inp @ w[p + f"{name}.weight"].T
            return y + w[p + f"{name}.bias"] if p + f"{name}.bias" in w else y

        a = np_rms(x, w[p + "input_layernorm.weight"], eps)
        q = proj("self_attn.q_proj", a).reshape(t, h, d)
        k = proj("self_attn.k_proj", a).reshape(t, kvh, d)
        v = proj("self_attn.v_proj", a).reshape(t, kvh, d)
        if cfg["model_type"] == "qwen3":
            q = np_rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = np_rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = np_rope(q, pos, inv), np_rope(k, pos, inv)
        window = np_window(cfg, layer)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[:, None] - pos[None, :] < window
        heads = []
        for i in range(h):
            j = i // (h // kvh)
            s = q[:, i] @ k[:, j].T / math.sqrt(d)
            s = np.where(allowed, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            heads.append((s / s.sum(axis=-1, keepdims=True)) @ v[:, j])
        x = x + proj("self_attn.o_proj", np.concatenate(heads, axis=-1))
        a = np_rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = proj("mlp.gate_proj", a)
        x = x + proj("mlp.down_proj", g / (1 + np.exp(-g)) * proj("mlp.up_proj", a))
    x = np_rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


# ----------------------------------------------------------------------------
# Shared jitted functions and fixtures.
# ----------------------------------------------------------------------------

_dense = nnx.jit(lambda model, tokens, kv_dtype=None: model.forward_dense(tokens, kv_dtype=kv_dtype),
                 static_argnames="kv_dtype")
_step = nnx.jit(lambda model, tokens, positions, pool, slots, tables, starts, num_new, mode:
                model(tokens, positions, pool, slots, tables, starts, num_new, mode=mode),
                static_argnames="mode")


@jax.jit
def _append(manager, pool, seqs):
    """One decode token per sequence: (manager, pool, slots, ok, (tables, lengths))."""
    manager, pool, slots, _, ok = manager.append_slots(pool, seqs)
    return manager, pool, slots, ok, manager.batch_tables(seqs)


_prefill_slots = jax.jit(lambda manager, seqs, positions: (manager.token_slots(seqs, positions),
                                                          *manager.batch_tables(seqs)))


@pytest.fixture(scope="module")
def models():
    """name -> (hf config dict, hf weights, fp32 model) for every family."""
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        w = random_hf_weights(cfg, np.random.default_rng(100 + i))
        out[name] = (cfg, w, LlamaForCausalLM.from_hf_state_dict(LlamaConfig.from_hf(cfg), w))
    return out


def _tokens(rng, b, t):
    return rng.integers(1, VOCAB, size=(b, t)).astype(np.int32)


@jax.jit
def _poison(pool: KVPool) -> KVPool:
    """NaN in every page and scale: any read of a slot not written this test
    (or of the null page) reaches the logits as NaN."""
    return jax.tree_util.tree_map(lambda a: jnp.full_like(a, jnp.nan), pool)


def _check_close(actual, expected, tol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite values"
    err = np.max(np.abs(actual - expected))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"
    return err


# ----------------------------------------------------------------------------
# Config.
# ----------------------------------------------------------------------------


def test_config_families():
    c = LlamaConfig.from_hf(CONFIGS["llama3"])
    assert c.head_dim == 16 and c.num_key_value_heads == 2 and not c.attention_bias and not c.qk_norm
    assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.original_max_position_embeddings == 64
    assert LlamaConfig.from_hf(dict(CONFIGS["llama"], rope_scaling={"rope_type": "default"})).rope_scaling is None
    q2 = LlamaConfig.from_hf(CONFIGS["qwen2"])
    assert q2.attention_bias and not q2.attention_out_bias and q2.sliding_window is None
    # transformers' defaults where a config.json leaves a field out: Qwen2's q/k/v bias whatever
    # attention_bias says, Qwen3's head_dim 128 (not hidden / heads).
    assert LlamaConfig.from_hf(dict(CONFIGS["qwen2"], attention_bias=False)).attention_bias
    assert LlamaConfig.from_hf({k: v for k, v in CONFIGS["qwen3"].items() if k != "head_dim"}).head_dim == 128
    q3 = LlamaConfig.from_hf(CONFIGS["qwen3"])
    assert q3.qk_norm and q3.head_dim == 32 and q3.tie_word_embeddings and not q3.attention_bias
    m = LlamaConfig.from_hf(CONFIGS["mistral"])
    assert m.sliding_window == 5 and all(m.layer_sliding_window(i) == 5 for i in range(LAYERS))
    assert LlamaConfig.from_hf({k: v for k, v in CONFIGS["mistral"].items() if k != "sliding_window"}).sliding_window == 4096
    # Qwen2's per-layer window: layers at and after max_window_layers.
    qw = LlamaConfig.from_hf(dict(CONFIGS["qwen2"], use_sliding_window=True, sliding_window=3, max_window_layers=1))
    assert [qw.layer_sliding_window(i) for i in range(LAYERS)] == [None, 3]
    for name, cfg in CONFIGS.items():
        c = LlamaConfig.from_hf(cfg)
        assert LlamaConfig.from_hf(c.to_hf()) == c, name
    assert LlamaConfig.from_hf(qw.to_hf()) == qw
    # transformers >= 5 spelling of the rope parameters.
    v5 = {k: v for k, v in CONFIGS["llama3"].items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(CONFIGS["llama3"]["rope_scaling"], rope_theta=10000.0)
    assert LlamaConfig.from_hf(v5) == LlamaConfig.from_hf(CONFIGS["llama3"])


def test_config_errors():
    with pytest.raises(InvalidArgument, match="gpt2"):
        LlamaConfig.from_hf(dict(CONFIGS["llama"], model_type="gpt2"))
    with pytest.raises(InvalidArgument, match="gelu"):
        LlamaConfig.from_hf(dict(CONFIGS["llama"], hidden_act="gelu"))
    with pytest.raises(InvalidArgument, match="yarn"):
        LlamaConfig.from_hf(dict(CONFIGS["llama"], rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(InvalidArgument, match="multiple"):
        LlamaConfig.from_hf(dict(CONFIGS["llama"], num_key_value_heads=3))
    with pytest.raises(InvalidArgument, match="vocab_size"):
        LlamaConfig.from_hf({k: v for k, v in CONFIGS["llama"].items() if k != "vocab_size"})


# ----------------------------------------------------------------------------
# forward_dense against the numpy reference.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_dense_matches_numpy(models, name):
    cfg, w, model = models[name]
    tokens = _tokens(np.random.default_rng(1), 2, 12)
    got = np.asarray(_dense(model, jnp.asarray(tokens)))
    assert got.dtype == np.float32 and got.shape == (2, 12, VOCAB)
    for b in range(2):
        _check_close(got[b], np_forward(cfg, w, tokens[b]), FP32_TOL, f"{name} row {b}")


def test_llama3_scaling_changes_logits(models):
    """The llama3 scaling is live at these positions (else the test above
    would not check it)."""
    tokens = _tokens(np.random.default_rng(2), 1, 12)
    w = models["llama3"][1]
    plain = np_forward(CONFIGS["llama"], w, tokens[0])
    scaled = np_forward(CONFIGS["llama3"], w, tokens[0])
    assert np.max(np.abs(plain - scaled)) > 1e-2


# ----------------------------------------------------------------------------
# Paged prefill + decode against forward_dense.
# ----------------------------------------------------------------------------


def _paged_run_manager(model, prompts, num_decode, *, pool_dtype=None, num_pages=32):
    """Prefill ``prompts`` in one padded call, then ``num_decode`` greedy
    decode steps, with tables and slots from a BlockSpaceManager. Returns
    (per-row logits [len + num_decode, V] for positions 0.., generated
    tokens [B, num_decode + 1])."""
    b = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    t = int(lens.max())
    max_blocks = -(-(t + num_decode) // PAGE)
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=2, block_size=PAGE, max_seqs=b,
                                       max_blocks_per_seq=max_blocks, watermark=0.0)
    for row, n in enumerate(lens):
        manager = manager.allocate_or_raise([row], num_tokens=int(n))
    pool = _poison(model.make_pool(num_pages, PAGE, dtype=pool_dtype))
    seqs = jnp.arange(b, dtype=jnp.int32)
    tokens = np.ones((b, t), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    slots, tables, lengths = _prefill_slots(manager, seqs, positions)
    np.testing.assert_array_equal(lengths, lens)
    logits, pool = _step(model, tokens, positions, pool, slots, tables, np.zeros(b, np.int32), lens, "prefill")
    logits = np.asarray(logits)
    rows = [[logits[r, i] for i in range(lens[r])] for r in range(b)]
    nxt = logits[np.arange(b), lens - 1].argmax(-1).astype(np.int32)
    generated = [nxt]
    for _ in range(num_decode):
        manager, pool, slots, ok, (tables, lengths) = _append(manager, pool, seqs)
        assert bool(ok)
        starts = np.asarray(lengths) - 1
        logits, pool = _step(model, nxt[:, None], starts[:, None], pool, slots, tables, starts,
                             np.ones(b, np.int32), "decode")
        logits = np.asarray(logits)[:, 0]
        for r in range(b):
            rows[r].append(logits[r])
        nxt = logits.argmax(-1).astype(np.int32)
        generated.append(nxt)
    return [np.stack(r) for r in rows], np.stack(generated, axis=1)


def _dense_over(model, prompts, generated, kv_dtype=None):
    """forward_dense logits [B, T, V] over prompt + generated tokens."""
    seqs = [np.concatenate([p, g[:-1]]) for p, g in zip(prompts, generated)]
    t = max(len(s) for s in seqs)
    tokens = np.ones((len(seqs), t), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s  # the tail is padding: causal, so it changes nothing before it
    return np.asarray(_dense(model, jnp.asarray(tokens), kv_dtype))


# Lengths 5, 11 and 2 with pages of 4: the first two cross page boundaries in
# the prompt and again while decoding.
PROMPT_LENS = (5, 11, 2)
NUM_DECODE = 5


@pytest.mark.parametrize("name", ["llama3", "qwen3"])  # mistral (window): prefix test
def test_paged_prefill_decode_matches_dense(models, name):
    _, _, model = models[name]
    rng = np.random.default_rng(3)
    prompts = [_tokens(rng, 1, n)[0] for n in PROMPT_LENS]
    rows, generated = _paged_run_manager(model, prompts, NUM_DECODE)
    dense = _dense_over(model, prompts, generated)
    for r, (p, got) in enumerate(zip(prompts, rows)):
        _check_close(got, dense[r, : len(got)], FP32_TOL, f"{name} row {r}")
        # greedy: the token chosen after each position is the dense argmax there
        np.testing.assert_array_equal(generated[r], dense[r, len(p) - 1: len(p) + NUM_DECODE].argmax(-1))


def _hand_tables(rng, num_rows, max_blocks, num_pages):
    """Disjoint shuffled pages (never 0) per row: tables [B, max_blocks]."""
    pages = rng.permutation(np.arange(1, num_pages))[: num_rows * max_blocks]
    return pages.reshape(num_rows, max_blocks).astype(np.int32)


def _slots(tables, starts, count, t):
    """[B, t] pool rows of positions starts .. starts + count, -1 after."""
    pos = starts[:, None] + np.arange(t)[None, :]
    page = np.take_along_axis(tables, np.minimum(pos // PAGE, tables.shape[1] - 1), axis=1)
    return np.where(np.arange(t)[None, :] < count[:, None], page * PAGE + pos % PAGE, -1).astype(np.int32)


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_paged_prefix_hit_matches_dense(models, name):
    """First prefill writes each prompt's prefix (starts = 0); a second call
    prefills the rest from ``starts = prefix`` (a prefix-cache hit: the
    prefix is only read from the pages); then two one-token steps, each run
    in decode mode (paged_decode_attention) and as a T = 1 prefill
    (paged_prefill_attention), which must agree. Shuffled, non-contiguous
    pages."""
    _, _, model = models[name]
    rng = np.random.default_rng(4)
    lens = np.array([9, 14, 7], np.int32)
    prefix = np.array([4, 6, 1], np.int32)  # page-aligned, mid-page, one token
    extra = 2
    b, num_pages = len(lens), 32
    max_blocks = -(-(int(lens.max()) + extra) // PAGE)
    tables = _hand_tables(rng, b, max_blocks, num_pages)
    seqs = _tokens(rng, b, int(lens.max()) + extra)
    pool = _poison(model.make_pool(num_pages, PAGE))

    def call(starts, count, t, pool, mode="prefill"):
        tok = np.ones((b, t), np.int32)
        for r in range(b):
            tok[r, : count[r]] = seqs[r, starts[r]: starts[r] + count[r]]
        pos = starts[:, None] + np.arange(t)[None, :]
        return _step(model, jnp.asarray(tok), jnp.asarray(pos, jnp.int32), pool,
                     jnp.asarray(_slots(tables, starts, count, t)), jnp.asarray(tables), jnp.asarray(starts),
                     jnp.asarray(count), mode)

    first, pool = call(np.zeros(b, np.int32), prefix, int(prefix.max()), pool)
    second, pool = call(prefix, lens - prefix, int((lens - prefix).max()), pool)
    steps = []
    for j in range(extra):
        one = np.ones(b, np.int32)
        as_prefill, _ = call(lens + j, one, 1, pool)
        out, pool = call(lens + j, one, 1, pool, mode="decode")
        _check_close(out, as_prefill, 1e-5, f"{name} decode vs T=1 prefill, step {j}")
        steps.append(np.asarray(out)[:, 0])
    dense = np.asarray(_dense(model, jnp.asarray(seqs)))
    first, second = np.asarray(first), np.asarray(second)
    for r in range(b):
        got = np.concatenate([first[r, : prefix[r]], second[r, : lens[r] - prefix[r]],
                              np.stack([s[r] for s in steps])])
        _check_close(got, dense[r, : lens[r] + extra], FP32_TOL, f"{name} row {r}")


# bf16 (8-bit significand, unit roundoff 2^-8 ~ 0.4%), bounds relative to the
# largest |logit|: against the bf16 model's own forward_dense the paths differ
# only in accumulation order and the T=1 matmuls, so 2 bf16 ulps (measured:
# bit-identical on CPU); against the fp32 model every activation is rounded,
# so 5% (measured: about 1.3%).
BF16_TOL_SAME = 2 * 2.0 ** -8
BF16_TOL_FP32 = 0.05


def test_paged_bf16(models):
    cfg, w, model32 = models["llama3"]
    model = LlamaForCausalLM.from_hf_state_dict(LlamaConfig.from_hf(cfg), w, dtype=jnp.bfloat16,
                                                param_dtype=jnp.bfloat16)
    rng = np.random.default_rng(6)
    prompts = [_tokens(rng, 1, n)[0] for n in PROMPT_LENS]
    rows, generated = _paged_run_manager(model, prompts, NUM_DECODE)
    dense16 = _dense_over(model, prompts, generated)
    dense32 = _dense_over(model32, prompts, generated)
    scale = max(float(np.abs(dense32).max()), 1.0)
    for r, got in enumerate(rows):
        n = len(got)
        _check_close(got, dense16[r, :n], BF16_TOL_SAME * scale, f"bf16 paged vs bf16 dense row {r}")
        _check_close(got, dense32[r, :n], BF16_TOL_FP32 * scale, f"bf16 paged vs fp32 dense row {r}")


# fp8 KV (e4m3fn: 3 mantissa bits, per-token-per-head scales): each stored
# K/V element is within 2^-4 (6.25%) relative of its head's largest value.
# Against forward_dense with the same quantization applied to its K/V the two
# differ only by fp32 rounding (plus a rare fp8 rounding flip where inputs
# differ in the last fp32 bit): 1e-4 of the largest |logit| (measured ~4e-7).
# Against the unquantized model the logits move by the fp8 error: bound 10%
# of the largest |logit| (measured about 3.5%).
FP8_TOL_SAME = 1e-4
FP8_TOL_FP32 = 0.10


def test_paged_fp8_pool(models):
    _, _, model = models["llama3"]
    rng = np.random.default_rng(7)
    prompts = [_tokens(rng, 1, n)[0] for n in PROMPT_LENS]
    rows, generated = _paged_run_manager(model, prompts, NUM_DECODE, pool_dtype=jnp.float8_e4m3fn)
    dense_q = _dense_over(model, prompts, generated, kv_dtype=jnp.float8_e4m3fn)
    dense = _dense_over(model, prompts, generated)
    scale = max(float(np.abs(dense).max()), 1.0)
    for r, got in enumerate(rows):
        n = len(got)
        _check_close(got, dense_q[r, :n], FP8_TOL_SAME * scale, f"fp8 paged vs fp8-rounded dense row {r}")
        _check_close(got, dense[r, :n], FP8_TOL_FP32 * scale, f"fp8 paged vs fp32 dense row {r}")


# ----------------------------------------------------------------------------
# Loading Hugging Face checkpoints.
# ----------------------------------------------------------------------------


def _write_checkpoint(path, cfg, w, *, shards=1, dtype_name="float32"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(cfg, torch_dtype=dtype_name, architectures=["X"]), f)
    names = sorted(w)
    if shards == 1:
        save_file(dict(w), os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: w[n] for n in part}, os.path.join(path, fname))
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _assert_params_equal(model, w):
    got = model.hf_state_dict()
    assert sorted(got) == sorted(w)
    for name, arr in w.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


@pytest.mark.parametrize("name,shards", [("llama", 1), ("qwen2", 2), ("qwen3", 1)])
def test_from_pretrained_roundtrip(models, tmp_path, name, shards):
    cfg, _, _ = models[name]
    w = random_hf_weights(cfg, np.random.default_rng(8))
    _write_checkpoint(tmp_path, cfg, w, shards=shards)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    assert model.config == LlamaConfig.from_hf(dict(cfg, torch_dtype="float32")) and model.param_dtype == jnp.float32
    _assert_params_equal(model, w)
    # and the parameters sit where the forward uses them: HF Linear weights are [out, in]
    np.testing.assert_array_equal(model.layers[1].self_attn.k_proj.kernel[...],
                                  w["model.layers.1.self_attn.k_proj.weight"].T)
    if cfg.get("tie_word_embeddings"):
        assert not hasattr(model, "lm_head")
    tokens = _tokens(np.random.default_rng(9), 1, 10)
    _check_close(_dense(model, jnp.asarray(tokens))[0], np_forward(cfg, w, tokens[0]), FP32_TOL, name)


def test_save_pretrained_roundtrip(models, tmp_path):
    _, w, model = models["qwen3"]
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "two", num_shards=2)
    assert len(list((tmp_path / "two").glob("*.safetensors"))) == 2
    for sub in ("one", "two"):
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / sub)
        assert loaded.config == model.config
        _assert_params_equal(loaded, w)


def test_from_pretrained_bf16(tmp_path):
    import ml_dtypes

    cfg = CONFIGS["llama"]
    w = random_hf_weights(cfg, np.random.default_rng(10), dtype=ml_dtypes.bfloat16)
    _write_checkpoint(tmp_path, cfg, w, dtype_name="bfloat16")
    model = LlamaForCausalLM.from_pretrained(tmp_path)  # dtypes from torch_dtype
    assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.bfloat16
    _assert_params_equal(model, w)
    as32 = LlamaForCausalLM.from_pretrained(tmp_path, param_dtype=jnp.float32)
    np.testing.assert_array_equal(as32.hf_state_dict()["lm_head.weight"], w["lm_head.weight"].astype(np.float32))


def test_from_pretrained_errors(tmp_path):
    cfg = CONFIGS["qwen2"]
    w = random_hf_weights(cfg, np.random.default_rng(11))
    gone = "model.layers.1.self_attn.v_proj.bias"
    _write_checkpoint(tmp_path / "missing", cfg, {k: v for k, v in w.items() if k != gone})
    with pytest.raises(InvalidArgument, match=gone.replace(".", r"\.")):
        LlamaForCausalLM.from_pretrained(tmp_path / "missing")
    bad = "model.layers.0.mlp.up_proj.weight"
    _write_checkpoint(tmp_path / "shape", cfg, dict(w, **{bad: w[bad].T.copy()}))
    with pytest.raises(InvalidArgument, match=bad.replace(".", r"\.") + r".*\(64, 96\).*\(96, 64\)"):
        LlamaForCausalLM.from_pretrained(tmp_path / "shape")
    _write_checkpoint(tmp_path / "extra", cfg, dict(w, **{"model.layers.0.mlp.extra.weight": w[bad]}))
    with pytest.raises(InvalidArgument, match="extra"):
        LlamaForCausalLM.from_pretrained(tmp_path / "extra")
    _write_checkpoint(tmp_path / "type", dict(cfg, model_type="phi3"), w)
    with pytest.raises(InvalidArgument, match="phi3"):
        LlamaForCausalLM.from_pretrained(tmp_path / "type")
    os.makedirs(tmp_path / "empty")
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(InvalidArgument, match="safetensors"):
        LlamaForCausalLM.from_pretrained(tmp_path / "empty")


def test_pool_shape_checked(models):
    _, _, model = models["llama"]
    pool = KVPool.create(num_pages=4, page_size=PAGE, num_layers=LAYERS, k_heads=KV_HEADS, k_dim=8,
                         dtype=jnp.float32)
    z = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(InvalidArgument, match="make_pool"):
        model(z, z, pool, z, z, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), mode="decode")


# ----------------------------------------------------------------------------
# paged_prefill_attention against dense causal attention.
# ----------------------------------------------------------------------------


def np_causal(q, k, v, q_pos, window):
    """One row: q [T, H, D] at positions q_pos, k/v [S, KVH, D] at 0..S-1."""
    t, h, d = q.shape
    kvh = k.shape[1]
    out = np.zeros((t, h, v.shape[-1]))
    for i in range(t):
        keys = np.arange(q_pos[i] + 1)
        if window is not None:
            keys = keys[keys > q_pos[i] - window]
        for hh in range(h):
            kk = hh // (h // kvh)
            s = k[keys, kk] @ q[i, hh] / math.sqrt(d)
            p = np.exp(s - s.max())
            out[i, hh] = (p / p.sum()) @ v[keys, kk]
    return out


@pytest.mark.parametrize("window,pool_dtype", [(None, jnp.float32), (3, jnp.float32), (None, jnp.float8_e4m3fn)])
def test_paged_prefill_attention_vs_dense(window, pool_dtype):
    rng = np.random.default_rng(12)
    b, t, h, kvh, d, num_pages = 5, 6, 4, 2, 16, 24
    starts = np.array([0, 5, 3, 2, 0], np.int32)
    num_new = np.array([6, 3, 0, 1, 0], np.int32)  # rows 2 and 4: all padding
    total = starts + num_new
    max_blocks = 4
    tables = _hand_tables(rng, b, max_blocks, num_pages)
    tables[4] = -1  # an idle row may have no pages at all
    k = rng.normal(size=(b, max_blocks * PAGE, kvh, d)).astype(np.float32)
    v = rng.normal(size=(b, max_blocks * PAGE, kvh, d)).astype(np.float32)
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    pool = _poison(KVPool.create(num_pages=num_pages, page_size=PAGE, num_layers=1, k_heads=kvh, k_dim=d,
                                 dtype=pool_dtype))
    width = max_blocks * PAGE
    slots = _slots(tables, np.zeros(b, np.int32), total, width)  # -1 past each row's tokens
    pool = pool.set_kv(0, slots.reshape(-1), k.reshape(b * width, kvh, d), v.reshape(b * width, kvh, d))
    kp, vp, ks, vs = pool.layer_arrays(0)
    out = np.asarray(paged_prefill_attention(jnp.asarray(q), kp, vp, jnp.asarray(tables), jnp.asarray(starts),
                                             jnp.asarray(num_new), ks, vs, sliding_window=window))
    assert out.shape == (b, t, h, d) and np.isfinite(out).all()
    if pool_dtype != jnp.float32:  # compare with what the pool holds (fp8-rounded)
        kr, vr = pool.get_kv(0, slots.reshape(-1))
        k, v = np.asarray(kr).reshape(k.shape), np.asarray(vr).reshape(v.shape)
    for r in range(b):
        n = num_new[r]
        assert (out[r, n:] == 0).all(), f"padding queries of row {r} are not zero"
        if n:
            ref = np_causal(q[r, :n], k[r], v[r], starts[r] + np.arange(n), window)
            _check_close(out[r, :n], ref, 1e-5, f"row {r}")


def test_attention_function_override_replaces_decode():
    """A layer's ``decode_attention_fn`` is what decode mode calls (with the
    layer's window), in place of the ``implementation`` choice."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["sliding_window"])
        from jaxkv import paged_decode_attention

        return paged_decode_attention(*args, **kwargs)

    layer = PagedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, sliding_window=7, decode_attention_fn=spy,
                           rngs=nnx.Rngs(0))
    pool = KVPool.create(num_pages=4, page_size=PAGE, num_layers=1, k_heads=KV_HEADS, k_dim=HEAD_DIM,
                         dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(13).normal(size=(1, 1, HIDDEN)), jnp.float32)
    one = jnp.ones((1, 1), jnp.int32)
    out, _ = nnx.jit(lambda m, *a: m(*a, mode="decode"), static_argnums=4)(
        layer, x, 0 * one, pool, 0, PAGE * one, one, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    assert calls == [7] and np.isfinite(np.asarray(out)).all()


def test_sliding_window_decode_holds_window_blocks_and_matches_dense(models):
    """Mistral (window 5 on every layer, pages of 4): blocks that fall out of
    the window go back during decode, so 2 prompts of 7 tokens generating 30
    each run in a 7-block pool (20 blocks without trimming), the tokens are
    the no-cache windowed forward's argmax at every step, and no more than
    a window's worth of blocks is ever held per row."""
    _, _, model = models["mistral"]
    prompts = [_tokens(np.random.default_rng(), 1, 7)[0] for _ in range(2)]
    out = generate(model, [p.tolist() for p in prompts], 30, page_size=PAGE, num_pages=8)
    generated = [np.asarray(t) for t in out.tokens]
    assert [len(g) for g in generated] == [30, 30]
    dense = _dense_over(model, prompts, generated)
    for r, (p, g) in enumerate(zip(prompts, generated)):
        np.testing.assert_array_equal(g, dense[r, len(p) - 1: len(p) + 30].argmax(-1), err_msg=f"row {r}")
    # per row: the prompt's 2 blocks, then at most ceil((5 - 1) / 4) + 2 = 3 during a step
    assert int(out.state.peak_used) <= 6 and int(out.state.manager.device.num_used) == 0
