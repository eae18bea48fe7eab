"""DeepSeek-V4 (jaxkv.nn.DeepseekV4ForCausalLM) against transformers, through the hybrid cache.

The fixtures in ``tests/fixtures/dsv4/`` were made by transformers 5.23 with
``tests/fixtures/make_dsv4_fixtures.py`` (torch is not needed here): tiny
random checkpoints and, per prompt, transformers' greedy tokens, each the
argmax of the last position of a full no-cache forward over the sequence so
far. Schedules: ``small`` (rates 4/16, window 16, index_topk 4),
``real_rates`` (4/128, window 128, prompts past 256 tokens), ``defaults_yarn``
(transformers' defaults with YaRN, legacy config fields, sharded),
``small_bf16`` (bf16 weights), ``small_fp8`` (FP8 block-quantized weights
with ``weight_scale_inv``).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument, KVCacheOOM
from jaxkv.nn import AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM, LlamaForCausalLM, generate
from jaxkv.nn.checkpoint import load_tensors, read_config
from kernels_pallas import gather_all_compressed_kv
from kernels_pallas.formats import CompressedEntries, EntryFormat

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "dsv4")
SCHEDULES = ("small", "real_rates", "defaults_yarn", "small_bf16", "small_fp8")
#: Measured on these fixtures (see test_fp8_entries_bound): the fp8 cache
#: against the lossless one, teacher-forced along transformers' greedy path.
FP8_MIN_TOP1_AGREEMENT = 0.90
FP8_MAX_LOGIT_ERROR = 16.0


def _expected(name):
    with open(os.path.join(FIXTURES, name, "expected.json"), encoding="utf-8") as f:
        return json.load(f)


_MODELS = {}


def _model(name):
    if name not in _MODELS:
        _MODELS[name] = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))
    return _MODELS[name]


_step = nnx.jit(lambda m, tokens, manager, slots, starts, n: m(tokens, manager, slots, starts, n))
_reserve = jax.jit(lambda manager, slots, n, width: manager.reserve(slots, n, max_new_tokens=width),
                   static_argnums=(3,))
_dense = nnx.jit(lambda m, tokens, fmt: m.forward_dense(tokens, entry_format=fmt), static_argnames="fmt")


def _bucket(n):
    """A fixed width per fixture family, so each (model, format) compiles once."""
    return 256 if n <= 256 else 512


def _cached_logits(model, tokens, entry_format, chunk=None):
    """Logits at every position of one sequence run through a fresh cache
    (in chunks of ``chunk`` tokens; default one call)."""
    tokens = np.asarray(tokens, np.int32)
    width = chunk or _bucket(len(tokens))
    manager = model.make_cache(1, 512, entry_format=entry_format)
    manager, slots, ok = manager.admit(1, max_n=1)
    out = []
    for start in range(0, len(tokens), width):
        piece = tokens[start:start + width]
        manager, starts, ok = _reserve(manager, slots, jnp.asarray([len(piece)]), width)
        assert bool(ok)
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(piece)] = piece
        logits, manager = _step(model, jnp.asarray(padded), manager, slots, starts, jnp.asarray([len(piece)]))
        out.append(np.asarray(logits[0, :len(piece)]))
    return np.concatenate(out)


def _dense_logits(model, tokens, entry_format):
    """The no-cache forward of ``tokens``; padded at the end to a fixed
    width (the forward is causal at every position, so padding after the
    sequence changes none of its logits) so it compiles once."""
    padded = np.zeros(_bucket(len(tokens)), np.int32)
    padded[:len(tokens)] = tokens
    return np.asarray(_dense(model, jnp.asarray(padded), entry_format))[:len(tokens)]


# ----------------------------------------------------------------------------- parity


# ``small`` is left out here: test_chunked_prefill_crosses_ring_compression_and_block_boundaries
# runs it through generate and test_engine_families through the engine (CI time).
# ``small_bf16`` (the same schedule as ``small``, in bf16 weights), ``real_rates``,
# ``defaults_yarn`` and ``small_fp8``: the long pass (tests/conftest.py).
@pytest.mark.parametrize("name", [name for name in SCHEDULES if name != "small"])
def test_greedy_tokens_equal_transformers(name):
    """Every prompt of the schedule in ONE batch (mixed lengths), prefill
    then the jitted decode loop through the lossless cache: transformers'
    greedy tokens exactly."""
    expected = _expected(name)
    out = generate(_model(name), expected["prompts"], expected["max_new_tokens"])
    assert out.tokens == expected["greedy"]
    assert int(out.state.manager.blocks_in_use) == 0  # every finished row released its blocks


def test_chunked_prefill_crosses_ring_compression_and_block_boundaries():
    """Prompts prefilled 5 tokens per request per call (window 16, rates 4
    and 16, 128-token blocks: chunks straddle all three) give the same tokens."""
    expected = _expected("small")
    out = generate(_model("small"), expected["prompts"], expected["max_new_tokens"], prefill_chunk_size=5)
    assert out.tokens == expected["greedy"]
    assert int(out.state.manager.blocks_in_use) == 0  # every finished row released its blocks


def test_cached_equals_no_cache_recompute_lossless_chunks():
    """Cached prefill in 7-token chunks equals the no-cache forward at every
    position (this forward is causal everywhere). Tolerance: float32 sums in
    different orders, on logits up to ~20 (a 1.8e-4 difference was seen)."""
    model = _model("small")
    tokens = np.random.default_rng().integers(0, model.config.vocab_size, 61)
    np.testing.assert_allclose(_cached_logits(model, tokens, "lossless", chunk=7),
                               _dense_logits(model, tokens, "lossless"), rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- fp8 entries


def test_fp8_cache_decode_equals_fp8_recompute():
    """Greedy decoding through the fp8 cache picks, at every step, the
    argmax of the no-cache forward that rounds through the same fp8 format."""
    expected = _expected("small")
    model = _model("small")
    prompts = expected["prompts"][:2]
    out = generate(model, prompts, 12, entry_format="fp8")
    for prompt, tokens in zip(prompts, out.tokens):
        logits = _dense_logits(model, prompt + tokens[:-1], "fp8")[len(prompt) - 1:]
        assert logits.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("name", ("small",))  # real_rates measured too (below); not run in CI, for time
def test_fp8_entries_bound(name):
    """The fp8 format's cost, teacher-forced through the cache along
    transformers' greedy path: top-1 agreement with the lossless cache
    >= FP8_MIN_TOP1_AGREEMENT and max logit error <= FP8_MAX_LOGIT_ERROR.
    Measured (2026-11-23, CPU): small 134/144 = 93.1% / 13.5 (logits up to
    47), real_rates 56/60 = 93.3% / 6.2 (up to 39), defaults_yarn 40/40 /
    1.4. These tiny models have widened random weights, so fp8's 3-bit
    mantissa moves them far more than trained weights would; bf16 entries
    move them ~40x less."""
    expected = _expected(name)
    model = _model(name)
    agree = total = 0
    worst = 0.0
    for prompt, tokens, first in zip(expected["prompts"], expected["greedy"], expected["prompt_last_logits"]):
        seq = prompt + tokens[:-1]
        exact = _cached_logits(model, seq, "lossless")[len(prompt) - 1:]
        # The prompt's last logits themselves equal transformers', not only their argmax.
        np.testing.assert_allclose(exact[0], np.asarray(first, np.float32), rtol=1e-4, atol=1e-3)
        fp8 = _cached_logits(model, seq, "fp8")[len(prompt) - 1:]
        assert exact.argmax(-1).tolist() == tokens
        agree += int((exact.argmax(-1) == fp8.argmax(-1)).sum())
        total += len(tokens)
        worst = max(worst, float(np.max(np.abs(exact - fp8))))
    assert agree / total >= FP8_MIN_TOP1_AGREEMENT, (agree, total)
    assert 0 < worst <= FP8_MAX_LOGIT_ERROR


def test_lossless_format_round_trips_and_gathers_exactly():
    fmt = EntryFormat.lossless(64, 64, "float32")
    values = np.random.default_rng().standard_normal((3, 4, 128)).astype(np.float32)
    entries = CompressedEntries.quantize(jnp.asarray(values), fmt)
    np.testing.assert_array_equal(np.asarray(entries.dequantize()), values)
    table = jnp.asarray([[2, 0, -1], [1, -1, -1]], jnp.int32)
    counts = jnp.asarray([6, 3], jnp.int32)
    ref, ok = gather_all_compressed_kv(entries, table, counts, max_entries=8, implementation="reference")
    pal, pal_ok = gather_all_compressed_kv(entries, table, counts, max_entries=8, interpret=True)
    assert ref.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(pal))
    np.testing.assert_array_equal(np.asarray(ok), np.asarray(pal_ok))
    np.testing.assert_array_equal(np.asarray(ref[0, :4]), values[2])
    np.testing.assert_array_equal(np.asarray(ref[0, 4:6]), values[0, :2])


# ----------------------------------------------------------------------------- generate behaviour


def test_eos_stops_a_row_and_frees_its_blocks():
    expected = _expected("small")
    prompts, greedy = expected["prompts"], expected["greedy"]  # the parity test's shapes: no new compile
    eos = greedy[3][5]
    out = generate(_model("small"), prompts, expected["max_new_tokens"], eos_token_id=eos)
    for tokens, full in zip(out.tokens, greedy):
        stop = full.index(eos) + 1 if eos in full else len(full)
        assert tokens == full[:stop]
    assert int(out.state.manager.blocks_in_use) == 0


def test_too_few_blocks_raise_oom_naming_the_group():
    prompt = np.random.default_rng().integers(0, 200, 200).tolist()  # 200 tokens: 2 blocks of csa4
    with pytest.raises(KVCacheOOM, match="csa4"):
        generate(_model("small"), [prompt], 4, num_blocks={"csa4": 1 + 1, "hca16": 8})


def test_cache_of_another_schedule_is_refused():
    small, other = _model("small"), _model("real_rates")
    manager = other.make_cache(1, 256)
    with pytest.raises(InvalidArgument, match="make_cache"):
        small(jnp.zeros((1, 1), jnp.int32), manager, jnp.asarray([1]), jnp.asarray([0]), jnp.asarray([1]))


def test_paged_pool_options_are_refused_for_a_hybrid_model():
    with pytest.raises(InvalidArgument, match="entry_format"):
        generate(_model("small"), [[1, 2, 3]], 2, kv_dtype=jnp.bfloat16)
    with pytest.raises(InvalidArgument, match="entry format"):
        generate(_model("small"), [[1, 2, 3]], 2, entry_format="int4")


# ----------------------------------------------------------------------------- config and loading


def test_legacy_config_fields_fold_like_transformers():
    """defaults_yarn's config.json ships compress_ratios, num_hash_layers and
    qk_rope_head_dim (no layer_types / mlp_layer_types / partial_rotary_factor)."""
    raw = read_config(os.path.join(FIXTURES, "defaults_yarn"))
    assert "compress_ratios" in raw and "layer_types" not in raw
    config = DeepseekV4Config.from_hf(raw)
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    # compress_ratios may carry a trailing entry for the MTP layer (as V4-Flash's does): ignored.
    assert config.layer_types == tuple(kinds[r] for r in raw["compress_ratios"][:config.num_hidden_layers])
    assert config.mlp_layer_types == tuple(["hash_moe"] * raw["num_hash_layers"]
                                           + ["moe"] * (config.num_hidden_layers - raw["num_hash_layers"]))
    assert config.qk_rope_head_dim == raw["qk_rope_head_dim"]
    assert config.rope_compress.rope_type == "yarn" and config.rope_compress.attention_factor == 1.0
    assert config.rope_main.rope_type == "default"
    assert DeepseekV4Config.from_hf(config.to_hf()) == config


def test_auto_model_picks_the_family(tmp_path):
    assert isinstance(_model("small"), DeepseekV4ForCausalLM)
    assert AutoModelForCausalLM.model_class(os.path.join(FIXTURES, "small")) is DeepseekV4ForCausalLM
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert AutoModelForCausalLM.model_class(tmp_path) is LlamaForCausalLM
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InvalidArgument, match="gpt2"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_save_then_load_round_trips(tmp_path):
    model = _model("small")
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokens = _expected("small")["prompts"][2]
    np.testing.assert_array_equal(_dense_logits(again, tokens, "lossless"), _dense_logits(model, tokens, "lossless"))


def _copy_fixture(tmp_path, name="small"):
    shutil.copytree(os.path.join(FIXTURES, name), tmp_path / name)
    return tmp_path / name


def _rewrite(path, change):
    from safetensors.numpy import save_file

    tensors = change(load_tensors(path))
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    save_file(tensors, os.path.join(path, "model.safetensors"))


def test_loading_errors_name_the_tensor(tmp_path):
    path = _copy_fixture(tmp_path)
    names = sorted(load_tensors(path))
    victim = next(n for n in names if n.endswith("attn.wkv.weight") or n.endswith("self_attn.kv_proj.weight"))
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != victim})
    with pytest.raises(InvalidArgument, match="kv_proj"):
        DeepseekV4ForCausalLM.from_pretrained(path)

    path = _copy_fixture(tmp_path / "b")
    _rewrite(path, lambda t: {**t, victim: np.zeros((3, 5), np.float32)})
    with pytest.raises(InvalidArgument, match=r"kv_proj.*\(3, 5\)"):
        DeepseekV4ForCausalLM.from_pretrained(path)

    path = _copy_fixture(tmp_path / "c")
    _rewrite(path, lambda t: {**t, "model.layers.0.attn.mystery.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(InvalidArgument, match="mystery"):
        DeepseekV4ForCausalLM.from_pretrained(path)

    path = _copy_fixture(tmp_path / "d")
    expert = next(n for n in names if ".experts.1.w3." in n)
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != expert})
    with pytest.raises(InvalidArgument, match=r"w3 missing for experts \[1\]"):
        DeepseekV4ForCausalLM.from_pretrained(path)


def test_indexer_top_k_breaks_ties_by_the_lower_entry_at_every_row_length():
    """Exact ties in the lightning indexer (ReLU scores of 0.0) go to the
    lower entry index whatever the row's length, so the cached path (rows
    as wide as the cache) and a recompute (rows as wide as the sequence)
    choose the same entries; invalid entries are never chosen."""
    from jaxkv.nn.deepseek_v4 import _top_k_valid

    rng = np.random.default_rng()
    for width in (6, 11, 32):
        scores = np.where(rng.random(width) < 0.5, 0.0, rng.random(width) + 0.5).astype(np.float32)
        valid = np.arange(width) < rng.integers(1, width + 1)
        for k in (1, 3, 5):
            got = np.asarray(_top_k_valid(jnp.asarray(scores)[None], jnp.asarray(valid)[None], k))[0]
            order = sorted(np.flatnonzero(valid), key=lambda e: (-scores[e], e))[:k]
            assert got.tolist() == order + [-1] * (k - len(order)), (width, k, scores, valid)
