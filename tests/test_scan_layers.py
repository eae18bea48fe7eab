"""Decoder layers under one ``lax.scan`` (:mod:`jaxkv.nn.scan`, issue 41
item 1): the plan against a brute-force search over every (head, period)
split, and a scanned model against the same model unrolled (built from the
same seed: equal weights) on random token streams: the same greedy tokens,
logits equal to float32 summation order, checkpoints saved and loaded the
same; for a uniform Llama, Qwen2-style windows on some layers (a head or a
pattern outside one run), DeepSeek-V3's dense head before its MoE layers
and Qwen3-Next's Gated DeltaNet / full-attention pattern over the hybrid
cache (a traced layer index acquiring its layer's handle)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from jaxkv.nn.generate import generate
from jaxkv.nn.layers import named_state
from jaxkv.nn.scan import DecoderStack, default_scan_layers, scan_plan
from jaxkv.serve import Engine

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


def _llama(layers: int, windows=None, seed: int = 0, scan: bool | None = True) -> LlamaForCausalLM:
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


def test_models_stack_their_layers_except_on_a_gpu(monkeypatch):
    """``scan_layers=None`` (every model's default): stacked under a scan on
    a CPU or TPU, a parameter per layer on a GPU, where XLA copies a stacked
    layer's weights before each matmul (jaxkv.nn.scan's docstring; the
    aot test below shows the copy)."""
    assert [default_scan_layers(b) for b in ("cpu", "tpu", "gpu", "cuda", "rocm")] == [True, True, False, False,
                                                                                        False]
    assert default_scan_layers() == (jax.default_backend() not in ("gpu", "cuda", "rocm"))
    seed = int(np.random.default_rng().integers(1 << 20))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert _llama(5, seed=seed, scan=None).layers.reps == 5
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    on_gpu = _llama(5, seed=seed, scan=None)
    assert on_gpu.layers.reps == 0 and len(on_gpu.layers.head) == 5
    monkeypatch.undo()
    # The same weights either way: the layout is all that differs.
    a, b = on_gpu.hf_state_dict(), _llama(5, seed=seed).hf_state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_aot_stacked_weights_are_copied_before_a_cublas_matmul():
    """Why a GPU model keeps a parameter per layer: compiled for H100 with
    cuBLAS matmuls (what XLA's autotuner picks for decode shapes on a real
    device), a matmul that reads row ``i`` of a stacked weight gets a copy
    of that row, whether a scan slices it (dynamic) or an unrolled loop
    does (static); per-layer weights are read in place. The copy is the
    temporaries' size of one row."""
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas.aot_check import topology_device

    sharding = SingleDeviceSharding(topology_device("h100"))
    # An MLP's up and down projections; big enough that the temporaries are not cuBLAS's 4 MB workspace.
    layers, d, f = 2, 2048, 8192
    row = d * f * 2  # one layer's bf16 weight

    def spec(shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)

    def scanned(w, x):
        return jax.lax.scan(lambda h, p: (jax.nn.silu(h @ p[0]) @ p[1], None), x, w)[0]

    def unrolled(w, x):
        for i in range(layers):
            x = jax.nn.silu(x @ w[0][i]) @ w[1][i]
        return x

    def per_layer(ws, x):
        for up, down in ws:
            x = jax.nn.silu(x @ up) @ down
        return x

    stacked = (spec((layers, d, f)), spec((layers, f, d)))
    temps = {}
    for name, fn, w in (("scan", scanned, stacked), ("unrolled", unrolled, stacked),
                        ("per layer", per_layer, [(spec((d, f)), spec((f, d))) for _ in range(layers)])):
        lowered = jax.jit(fn).trace(w, spec((1, d))).lower(lowering_platforms=("cuda",))
        compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["scan"] >= row and temps["unrolled"] >= row, temps
    assert temps["per layer"] < row // 4, temps


def test_a_scanned_deepseek_v3_keeps_its_dense_head(tmp_path):
    path = os.path.join(FIXTURES, "dsv3", "small")
    scanned = AutoModelForCausalLM.from_pretrained(path)
    unrolled = AutoModelForCausalLM.from_pretrained(path, scan_layers=False)
    c = scanned.config
    assert scanned.layers.head_len == c.first_k_dense_replace and scanned.layers.reps >= 2
    _same_model(scanned, unrolled, np.random.default_rng(), tmp_path)


def _qwen3_next(rng, seed: int, scan: bool = True) -> Qwen3NextForCausalLM:
    """A random small Qwen3-Next: the default pattern (three Gated DeltaNet
    layers, one full attention) ``reps`` times plus a tail of 1-3 layers,
    MoE every ``decoder_sparse_step`` layers, maybe a dense first layer
    (a head outside the scan)."""
    reps, tail = 2, int(rng.integers(1, 4))  # compile time follows the unrolled twin's depth
    config = Qwen3NextConfig(
        vocab_size=101, hidden_size=32, intermediate_size=24, num_hidden_layers=4 * reps + tail,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=int(rng.integers(1, 3)),
        mlp_only_layers=(0,) if rng.random() < 0.5 else ())
    return Qwen3NextForCausalLM(config, rngs=nnx.Rngs(seed), scan_layers=scan)


_reserve = jax.jit(lambda manager, slots, n, width: manager.reserve(slots, n, max_new_tokens=width),
                   static_argnums=(3,))
_step = nnx.jit(lambda m, tokens, manager, slots, starts, n: m(tokens, manager, slots, starts, n))
_dense = nnx.jit(lambda m, tokens: m.forward_dense(tokens))


def _cached_logits(model, tokens, chunk):
    """``tokens`` through a fresh cache: a prefill of ``chunk`` tokens, then
    one token per step (the recurrent form); the logits at every position."""
    manager, slots, _ = model.make_cache(1, 64).admit(1, max_n=1)
    out = []
    for start, width in [(0, chunk)] + [(t, 1) for t in range(chunk, len(tokens))]:
        manager, starts, ok = _reserve(manager, slots, jnp.asarray([width]), width)
        assert bool(ok)
        piece = jnp.asarray(np.asarray(tokens[start:start + width], np.int32)[None])
        logits, manager = _step(model, piece, manager, slots, starts, jnp.asarray([width]))
        out.append(np.asarray(logits[0]))
    return np.concatenate(out)


def test_a_scanned_qwen3_next_is_the_unrolled_one(tmp_path):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 20))
    scanned = _qwen3_next(np.random.default_rng(seed), seed)
    unrolled = _qwen3_next(np.random.default_rng(seed), seed, scan=False)
    c, stack = scanned.config, scanned.layers
    assert stack.reps >= 2 and stack.period == 4 and stack.head_len + len(stack.tail) > 0, (c, stack.head_len)
    assert unrolled.layers.reps == 0
    # Reading a stacked row gives the unrolled layer (its kind and its weights).
    i = stack.head_len + stack.period + 1
    assert scanned.layers[i].kind == unrolled.layers[i].kind == c.layer_types[i]
    a, b = named_state(scanned), named_state(unrolled)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # Through the hybrid cache (prefill: the chunked form; then decode steps) and with no cache.
    tokens = rng.integers(0, c.vocab_size, 40)
    # Jitted, the dense forwards are one program's arithmetic either way (measured: bit-equal); the cached
    # steps fuse the cache's reads and writes differently under the scan (measured: at most 1.5e-5 on
    # logits of magnitude ~4; a layer reading another layer's state moves them by O(1)).
    np.testing.assert_allclose(_cached_logits(scanned, tokens, 33), _cached_logits(unrolled, tokens, 33),
                               rtol=1e-5, atol=5e-5)
    np.testing.assert_allclose(_dense(scanned, tokens), _dense(unrolled, tokens), rtol=1e-6, atol=1e-6)
    prompts = [rng.integers(1, c.vocab_size, int(rng.integers(3, 30))).tolist() for _ in range(2)]
    assert generate(scanned, prompts, 6).tokens == generate(unrolled, prompts, 6).tokens
    # Checkpoints name layers one by one: the same file either way, loaded back scanned.
    scanned.save_pretrained(tmp_path / "scanned")
    unrolled.save_pretrained(tmp_path / "unrolled")
    saved = [_load_safetensors(tmp_path / name / "model.safetensors") for name in ("scanned", "unrolled")]
    assert saved[0].keys() == saved[1].keys() and all(np.array_equal(saved[0][k], saved[1][k]) for k in saved[0])
    loaded = Qwen3NextForCausalLM.from_pretrained(tmp_path / "scanned")
    assert (loaded.layers.head_len, loaded.layers.reps) == (stack.head_len, stack.reps)
    np.testing.assert_array_equal(_dense(loaded, tokens), _dense(scanned, tokens))


def test_a_scanned_qwen3_next_serves_as_the_unrolled_one():
    """The engine's packed step (``forward_packed``: the Gated DeltaNet on
    the batch's segments) over the stack: the unrolled model's tokens."""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 20))
    models = [_qwen3_next(np.random.default_rng(seed), seed, scan) for scan in (True, False)]
    prompts = [rng.integers(1, 101, int(rng.integers(3, 50))).tolist() for _ in range(3)]
    outputs = []
    for model in models:
        engine = Engine(model, max_seqs=2, page_size=16, max_model_len=64, prefill_chunk=32, decode_chunk=4)
        ids = [engine.add_request(p, max_new_tokens=5) for p in prompts]
        engine.run()
        outputs.append([list(engine.outputs[r]) for r in ids])
    assert outputs[0] == outputs[1] and all(len(o) == 5 for o in outputs[0])


def _load_safetensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))
