"""``python -m jaxkv.bench real_scale``: the tiny shape end to end on the CPU
(figures present and sane, decode tokens equal to ``generate``'s, every
served token counted), and the published shapes built abstractly (no
allocation) with their published parameter counts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.bench import real_scale
from jaxkv.bench.__main__ import main

REQUESTS, NEW_TOKENS = 6, 8


@pytest.fixture(scope="module")
def tiny_run():
    """One in-process run at ``--shapes tiny`` (small batches, context 64, few
    requests), as ``bench serve --shapes`` (which is ``bench real_scale``):
    ``(exit status, stdout, the JSON payload)``."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        # "serve --shapes" is the name for real_scale
        rc = main(["serve", "--shapes", "tiny", "--json", "--batches", "1,2", "--contiguous-batches", "1,2",
                   "--context", "64", "--steps", "8", "--repeats", "2", "--requests", str(REQUESTS),
                   "--prompt-len", "16,48", "--new-tokens", str(NEW_TOKENS), "--max-num-seqs", "4",
                   "--decode-chunk", "4"])
    out = buf.getvalue()
    return rc, out, json.loads(out.strip().splitlines()[-1])


def test_tiny_run_reports_every_section(tiny_run):
    rc, out, payload = tiny_run
    assert rc == 0, out
    assert payload["benchmark"] == "real_scale" and payload["errors"] == []
    (result,) = payload["results"]
    assert result["shape"] == "tiny" and result["errors"] == []
    assert result["bandwidth"]["measured_bytes_per_s"] > 0
    assert [r["batch"] for r in result["decode"]] == [1, 2]
    for row in result["decode"]:
        assert row["tok_s"] > 0 and row["step_ms"] > 0 and row["bytes_per_step"] > 0
        assert 0 < row["roofline_measured"] < 1.5, row
    assert [r["batch"] for r in result["paged_vs_contiguous"]] == [1, 2]
    for row in result["paged_vs_contiguous"]:
        assert row["paged_tok_s"] > 0 and row["contiguous_tok_s"] > 0 and row["paged_over_contiguous"] > 0
        assert row["first_chunk_tokens_agree"] == 1.0  # the same K/V, float32 softmax: the same greedy tokens
        assert row["rows_split_at_near_tie"] == 0 and row["split_defect"] is None
        # The timed contiguous program (K/V read in bf16) against the reference's tokens: no real difference.
        assert row["contiguous_attention"] == "cache_dtype" and row["timed_split_defect"] is None
    (serving,) = result["serving"]
    assert serving["max_num_seqs"] == 4 and serving["requests"] == REQUESTS
    assert serving["finished"] == REQUESTS and not serving["stopped_at_deadline"]
    # No EOS: every request makes exactly NEW_TOKENS tokens, and every one is counted and streamed.
    assert serving["generated_tokens"] == REQUESTS * NEW_TOKENS
    assert serving["streamed_tokens"] == REQUESTS * NEW_TOKENS
    assert serving["output_tok_s"] > 0 and serving["ttft_ms"]["p50"] > 0 and serving["itl_ms"]["p99"] > 0
    for table in ("decode (tiny, bf16)", "paged vs contiguous decode (tiny)", "serving (tiny)", "wall time per phase"):
        assert table in out
    assert {p["phase"] for p in payload["phases"]} >= {"tiny: build", "decode: prefill", "tiny: serve 4 rows"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_dtype_attention_is_the_reference_attention(dtype):
    """The contiguous baseline's timed attention (K/V read in the cache's
    dtype, float32 accumulation) against the reference core
    (``dense_decode_attention``: K/V converted to float32) on the same
    values: drawn shapes, grouped heads, both cache layouts, lengths from 1
    to the cache, with and without a sliding window, finite garbage past
    each length. Float32 caches agree to float32 rounding; bfloat16 ones to
    the rounding of the probabilities to bfloat16 before the weighted sum."""
    from jaxkv.bench.decode import cache_dtype_attention
    from kernels_pallas.reference import dense_decode_attention

    rng = np.random.default_rng()
    cache = jnp.dtype(dtype)
    for _ in range(12):
        b, s, kvh, g, d = (int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(1, 4)),
                           int(rng.integers(1, 4)), int(rng.choice([8, 16, 32])))
        q = jnp.asarray(rng.normal(size=(b, kvh * g, d)), cache)
        k = jnp.asarray(rng.normal(size=(b, s, kvh, d)) * 2, cache)
        v = jnp.asarray(rng.normal(size=(b, s, kvh, d)), cache)
        lengths = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32)
        window = None if rng.random() < 0.5 else int(rng.integers(1, s + 1))
        scale = float(d) ** -0.5
        heads_first = bool(rng.random() < 0.5)  # the [B, KVH, S, D] layout bench real_scale times
        kk, vv = (k.swapaxes(1, 2), v.swapaxes(1, 2)) if heads_first else (k, v)
        got = cache_dtype_attention(q, kk, vv, lengths, sm_scale=scale, sliding_window=window, heads_first=heads_first)
        want = dense_decode_attention(q, k, v, lengths, sm_scale=scale, sliding_window=window)
        assert got.shape == want.shape and got.dtype == q.dtype
        tol = 2e-5 if dtype == "float32" else 3e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_a_split_decode_is_reported_in_the_json(monkeypatch):
    """A split between the paged and contiguous tokens (here forced: every
    check raises) is an error of the run: exit status 1, the JSON line
    still printed, each error with where it happened and why, and the rows
    marked. (The decode section recorded them as bare strings, which the
    run's own summary could not read: it crashed before its JSON line.)"""
    import contextlib
    import io

    from jaxkv.bench import decode

    def split(*args, **kwargs):
        raise AssertionError("forced split")

    monkeypatch.setattr(decode, "check_same_greedy", split)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["real_scale", "--shapes", "tiny", "--json", "--sections", "decode", "--batches", "1",
                   "--contiguous-batches", "1", "--context", "32", "--steps", "4", "--repeats", "1"])
    out = buf.getvalue()
    assert rc == 1, out
    payload = json.loads(out.strip().splitlines()[-1])
    wheres = [e["where"] for e in payload["errors"]]
    assert wheres == ["decode batch 1: contiguous (cache_dtype)", "decode batch 1: paged vs contiguous"], wheres
    assert all(e["error"] == "forced split" for e in payload["errors"])
    (row,) = payload["results"][0]["paged_vs_contiguous"]
    assert row["split_defect"] == "forced split" and row["timed_split_defect"] == "forced split"


def test_packed_serving_at_the_engines_own_defaults_compiles_nothing_timed():
    """``--scheduler packed --max-num-seqs auto``: the engine derives its
    rows, token budget and chunks (on this CPU: the small defaults), the
    bench reports what it derived, and the warm-up has compiled every
    program the timed run uses: each packed stream length (lengths past
    ``max_model_len`` made by several requests at once) and the decode
    chunk (a request that decodes past two chunks)."""
    import contextlib
    import io

    from jaxkv.serve.options import SchedulerOptions

    assert real_scale._rows("auto, 64") == (real_scale.AUTO, 64)
    requests, new_tokens = 8, 12
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["real_scale", "--shapes", "tiny", "--json", "--sections", "serve", "--scheduler", "packed",
                   "--max-num-seqs", "auto", "--requests", str(requests), "--prompt-len", "40,120",
                   "--new-tokens", str(new_tokens)])
    out = buf.getvalue()
    assert rc == 0, out
    (serving,) = json.loads(out.strip().splitlines()[-1])["results"][0]["serving"]
    defaults = SchedulerOptions()
    assert serving["max_num_seqs"] == int(defaults.max_seqs)
    assert serving["engine_options"]["decode_chunk"] == int(defaults.decode_chunk)
    assert serving["finished"] == requests and serving["generated_tokens"] == requests * new_tokens
    assert serving["timed_compiles"] == 0, serving  # every program compiled by the warm-up


def test_tiny_decode_tokens_are_generate_greedy_tokens(tiny_run):
    """Row 0 of the first batch size, prefilled and decoded by the bench,
    gets exactly the greedy tokens ``jaxkv.nn.generate`` gives its prompt."""
    from jaxkv.nn import generate

    _, _, payload = tiny_run
    check = payload["results"][0]["decode_check"]
    assert check["first_batch"] == 1 and len(check["tokens"]) == 1 + 8 * (1 + 2)
    config = real_scale.config_for("tiny")
    model = real_scale.build_model(config, seed=check["prompt_seed"], std=real_scale.SHAPE_INIT_STD["tiny"])
    prompt = real_scale.decode_prompts(config.vocab_size, 1, check["context"], check["prompt_seed"])[0]
    expected = generate(model, [prompt.tolist()], len(check["tokens"])).tokens[0]
    assert check["tokens"] == expected


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "llama-3.2-1b"])
def test_published_shapes_build_abstractly_with_their_parameter_counts(shape):
    config = real_scale.config_for(shape)
    hf = real_scale.HF_CONFIGS[shape]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
        hf["hidden_size"], hf["num_hidden_layers"], 32, 8, hf["head_dim"], hf["intermediate_size"], 128256)
    assert config.rope_scaling.rope_type == "llama3" and config.rope_theta == 500000.0
    assert config.rope_scaling.factor == (8.0 if shape == "llama-3.1-8b" else 32.0)
    assert config.tie_word_embeddings == (shape == "llama-3.2-1b") and config.rms_norm_eps == 1e-5
    # jax.eval_shape: the whole model's parameters as shapes, nothing allocated.
    count = real_scale.param_count(config)
    assert abs(count - real_scale.PUBLISHED_PARAMS[shape]) / real_scale.PUBLISHED_PARAMS[shape] < 0.01, count
    graphdef, state, flat = real_scale._abstract(config)
    assert all(isinstance(v, jax.ShapeDtypeStruct) and v.dtype == "bfloat16" for v in flat.values())


def test_other_benchmarks_still_refuse_unknown_flags():
    with pytest.raises(SystemExit):
        main(["alloc", "--shapes", "tiny"])


def test_datasheet_bandwidth_names_the_gpus():
    assert real_scale.datasheet_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert real_scale.datasheet_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert real_scale.datasheet_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert real_scale.datasheet_bandwidth("cpu") is None
