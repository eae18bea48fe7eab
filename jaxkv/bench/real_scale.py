"""``python -m jaxkv.bench real_scale --shapes llama-3.1-8b``: the decode
path and the online engine at a real checkpoint's size, with random weights.

The model is :class:`jaxkv.nn.LlamaForCausalLM` at a published
``config.json`` (hard-coded in :data:`HF_CONFIGS`; nothing is downloaded):

* ``llama-3.1-8b``: hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim
  128, MLP 14336, vocab 128256, RoPE theta 500000 with the ``llama3``
  scaling (factor 8, low / high frequency factors 1 / 4, original context
  8192), RMSNorm eps 1e-5, untied embeddings: 8.03e9 parameters;
* ``llama-3.2-1b``: hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim
  64, MLP 8192, the same vocabulary and RoPE with factor 32, tied
  embeddings: 1.24e9 parameters;
* ``tiny``: the same structure at toy size (2 layers, hidden 64), for tests
  and the CPU.

Weights are bfloat16 (storage and compute), drawn on the device by jitted
calls (:func:`build_model`: normal with std 0.02, as transformers
initialises Llama, 0.125 at ``tiny``'s width, norms 1; nothing passes
through the host). The
benchmark runs on whatever device JAX has (on a CPU only ``tiny`` is
practical) and prints one markdown table per section:

1. **bandwidth**: the device's memory bandwidth measured in the same run
   (a jitted ``x + 1`` over up to 4 GiB of uint32: bytes read + written, best
   of 5; on the CPU backend a numpy copy, XLA's elementwise loop being far
   below the memory's speed there), beside the datasheet figure for the
   device when it is known (:data:`DATASHEET_BANDWIDTH`: H100 SXM 3.35 TB/s,
   H200 4.8 TB/s, ...).
2. **decode**: tokens/s of the engine's multi-step decode chunk
   (:func:`jaxkv.serve.caches.decode_chunk`: ``--steps`` greedy steps in one
   jitted ``lax.while_loop``, block allocation on device, attention through
   the block tables) at each ``--batches`` size with ``--context``-token
   contexts. Every row's random prompt is prefilled once (jitted
   :func:`jaxkv.nn.steps.prefill_chunk` calls of a few thousand tokens each,
   untimed); the batch sizes then decode rows ``0 .. b - 1`` one after the
   other (a smaller batch's rows grow by its chunks, so their contexts are a
   few hundred tokens longer: counted in the bytes). Per batch: one chunk to
   compile (its wall time is reported as "first call"), then the best of
   ``--repeats`` chunks. **Roofline ratio**: the bytes one decode step must
   read (every weight once, except that an untied embedding table is only
   gathered, one row per sequence; plus the K and V of every sequence's
   context in every layer, at its mean length over the timed chunks) over
   the bandwidth, divided by the measured step time: 1.0 is the memory
   roofline. The measured bandwidth is the primary column, the datasheet
   the second.
3. **paged vs contiguous** at ``--contiguous-batches`` (default 1 and 64):
   :func:`jaxkv.bench.decode.contiguous_decode` (the model's own submodules
   over a ``[B, KVH, max_len, D]`` cache per layer, ``lax.scan`` over the
   steps) on caches gathered from the paged pool (the same K/V; no second
   prefill), timed interleaved with the paged chunks. ``max_len`` is the
   contexts plus the chunk, rounded up to a page. The timed contiguous
   program reads its cache in the cache's dtype with float32 accumulation
   (``attention="cache_dtype"``, as a contiguous-cache server would); its
   first chunk is checked against the reference attention's (float32 K/V),
   whose tokens are also checked against the paged chunk's: a split only
   where the reference nearly tied. Reported: tokens/s of each, their ratio
   (target >= 0.95 at 8B) and how many greedy tokens of the first chunk
   agree (bfloat16: a near-tie may flip; informational).
4. **serving**: ``--requests`` requests (random prompts of ``--prompt-len``
   tokens, drawn uniformly; ``--new-tokens`` new tokens each, greedy, no EOS)
   arriving all at once (``--rate 0``) or as a Poisson process of
   ``--rate`` requests per second of wall time, through the online
   :class:`jaxkv.serve.Engine` (public API only: ``add_request`` when a
   request's arrival time has passed, ``step`` back to back, ``stats``) at
   each ``--max-num-seqs``. The engine's programs are compiled by a warm-up
   first (reported apart: "warm-up s"); figures: output tokens/s (tokens
   streamed / first arrival to last token), TTFT (scheduled arrival to the
   step that gave the first token) and ITL (a step's gap spread over the
   tokens it gave a request) p50 / p99, the engine's generated-token count
   (``stats()``; equals requests x new tokens when every request finished),
   and compiles that happened inside the timed run (should be 0).
   ``--scheduler padded`` (default: two programs per engine, the fewest
   compiles of a 32-layer model; a ``[max_seqs, prefill_chunk]`` prefill
   call, ``--prefill-chunk`` default ``8192 / max_seqs`` tokens) or
   ``packed`` (one program per stream-length bucket up to
   ``--max-num-batched-tokens``, all compiled by the warm-up).

Each section runs in its own ``try``: an error is printed and recorded and
the next section runs; the tables printed so far stay printed and with
``--json`` the last line is one JSON object with every figure (``errors``
lists what failed; the exit status is 1 then). Wall time and XLA compile
time per phase are printed at the end (compile time from
``jax.monitoring``'s backend-compile events). ``--deadline S`` (``--quick``:
255 s) skips what would start after ``S`` seconds and stops a serving run
there (its figures are then partial and marked so), so the JSON line comes
out before an outer time limit. Nothing is written outside stdout.

``--quick`` (the GPU check, ``tools/device_check.sh``): batches 1 and 64,
paged vs contiguous at both, serving 128 requests at ``--max-num-seqs 64``;
made to finish within 5 minutes on one H100 / H200 at ``llama-3.1-8b``,
compiles included. Device memory is checked before each allocation where
the device reports it (``memory_stats``): a batch size (or a contiguous
baseline) that does not fit beside the weights is skipped and said so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import time
import traceback
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.bench._timing import machine_description, print_json, print_table
from jaxkv.bench.serve import record_arrival
from jaxkv.nn.config import LlamaConfig
from jaxkv.nn.llama import LlamaForCausalLM

__all__ = ["DATASHEET_BANDWIDTH", "HF_CONFIGS", "PUBLISHED_PARAMS", "build_model", "config_for", "datasheet_bandwidth",
           "decode_prompts", "main", "param_count", "parse_extra", "serving_workload"]

#: The published ``config.json`` of each shape (the fields jaxkv reads).
HF_CONFIGS = {
    "llama-3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    "tiny": dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024},
        tie_word_embeddings=False, torch_dtype="bfloat16"),
}

#: Parameter counts the model cards publish.
PUBLISHED_PARAMS = {"llama-3.1-8b": 8.03e9, "llama-3.2-1b": 1.24e9}

#: ``(substring of device_kind, lowercase; bytes/s; what it is)``, most specific first.
DATASHEET_BANDWIDTH = (
    ("gh200", 4.0e12, "GH200 HBM3 4.0 TB/s"),
    ("h200", 4.8e12, "H200 HBM3e 4.8 TB/s"),
    ("h100 nvl", 3.9e12, "H100 NVL 3.9 TB/s"),
    ("h100 pcie", 2.0e12, "H100 PCIe 2.0 TB/s"),
    ("h100", 3.35e12, "H100 SXM 3.35 TB/s"),
    ("h800", 3.35e12, "H800 SXM 3.35 TB/s"),
    ("b200", 8.0e12, "B200 8 TB/s"),
    ("a100-sxm4-80gb", 2.039e12, "A100 SXM 80GB 2.04 TB/s"),
    ("a100 80gb pcie", 1.935e12, "A100 PCIe 80GB 1.94 TB/s"),
    ("a100", 1.555e12, "A100 40GB 1.56 TB/s"),
    ("l40s", 0.864e12, "L40S 0.86 TB/s"),
    ("l4", 0.3e12, "L4 0.3 TB/s"),
)

PAGE_SIZE = 16
#: The contiguous baseline's timed attention (:data:`jaxkv.bench.decode.CONTIGUOUS_ATTENTION`): K/V read in the
#: cache's dtype with float32 accumulation. The reference (float32 K/V at the highest precision) is the
#: checked one; timed, it ran 3x slower than the paged step at batch 64 on the H200 (docs/gpu.md).
CONTIGUOUS_TIMED = "cache_dtype"
#: Token slots of one padded-scheduler prefill call (``max_seqs * prefill_chunk``) unless ``--prefill-chunk``.
PADDED_TOKENS = 8192
INIT_STD = 0.02  # transformers' initializer_range for Llama
#: The init std where 0.02 does not suit (tiny: logits of std ~1 at hidden 64, as 0.02 gives at 4096).
SHAPE_INIT_STD = {"tiny": 0.125}
GiB = 1 << 30

#: Per-shape defaults (a flag given on the command line wins). ``quick``: the
#: ``--quick`` profile's changes.
_FULL = dict(batches=(1, 16, 64, 256), contiguous_batches=(1, 64), context=2048, steps=32, repeats=5, requests=512,
             prompt_len=(512, 2048), new_tokens=256, rate=0.0, max_num_seqs=(64, 256), decode_chunk=16,
             prefill_tokens=4096, deadline=0.0)
_QUICK = dict(batches=(1, 64), contiguous_batches=(1, 64), repeats=3, requests=128, max_num_seqs=(64,),
              deadline=255.0)
_TINY = dict(batches=(1, 4, 16), contiguous_batches=(1, 16), context=256, steps=16, repeats=3, requests=32,
             prompt_len=(32, 128), new_tokens=32, max_num_seqs=(8, 16), decode_chunk=8, prefill_tokens=4096,
             deadline=0.0)
_TINY_QUICK = dict(batches=(1, 4), contiguous_batches=(1, 4), repeats=2, requests=12, max_num_seqs=(8,))


# --------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------


def config_for(shape: str) -> LlamaConfig:
    """The :class:`LlamaConfig` of ``shape`` (a key of :data:`HF_CONFIGS`),
    read with :meth:`LlamaConfig.from_hf` as a checkpoint's would be."""
    if shape not in HF_CONFIGS:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(HF_CONFIGS)}")
    return LlamaConfig.from_hf(HF_CONFIGS[shape])


def _abstract(config: LlamaConfig, dtype=jnp.bfloat16):
    """``(graphdef, {path: ShapeDtypeStruct})`` of the model: nothing allocated."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, traverse_util.flatten_dict(nnx.to_pure_dict(state))


def param_count(config: LlamaConfig) -> int:
    """Parameters of the model at ``config`` (``jax.eval_shape``: no allocation)."""
    _, _, flat = _abstract(config)
    return int(sum(math.prod(spec.shape) for spec in flat.values()))


@partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _random_normal(key, index, *, shape, dtype, std):
    return (jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32) * std).astype(dtype)


def build_model(config: LlamaConfig, *, seed: int = 0, dtype=jnp.bfloat16, std: float = INIT_STD) -> LlamaForCausalLM:
    """The model with random weights made on the default device, each
    parameter by a jitted call (one program per distinct shape; nothing
    passes through the host, and no call holds more than one parameter's
    float32 draw): every matrix (projections, embedding, LM head) normal
    with standard deviation ``std`` (parameter ``i`` from ``fold_in(key(seed),
    i)``), every norm weight 1, every bias 0; stored and computed in ``dtype``."""
    graphdef, state, flat = _abstract(config, dtype)
    key = jax.random.key(seed)
    values = {}
    for index, (path, spec) in enumerate(flat.items()):
        if len(spec.shape) >= 2:
            values[path] = _random_normal(key, index, shape=tuple(spec.shape), dtype=jnp.dtype(spec.dtype), std=std)
        elif path[-1] == "bias":
            values[path] = jnp.zeros(spec.shape, spec.dtype)
        else:
            values[path] = jnp.ones(spec.shape, spec.dtype)
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(values))
    return nnx.merge(graphdef, state)


def _kv_bytes_per_token(config: LlamaConfig, dtype=jnp.bfloat16) -> int:
    """K and V bytes one token takes in every layer."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize


def _weight_bytes(model) -> tuple[int, int]:
    """``(all parameter bytes, bytes of an untied embedding table or 0)``."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    total = sum(v.size * v.dtype.itemsize for v in flat.values())
    embed = 0 if model.config.tie_word_embeddings else (
        flat[("embed_tokens", "embedding")].size * flat[("embed_tokens", "embedding")].dtype.itemsize)
    return int(total), int(embed)


def decode_prompts(vocab: int, rows: int, context: int, seed: int = 0) -> np.ndarray:
    """The decode section's prompts: ``[rows, context]`` random token ids in
    ``[1, vocab)`` (row ``r`` of a larger draw is the same row)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(1, vocab, context, dtype=np.int64).astype(np.int32) for _ in range(rows)])


def serving_workload(vocab: int, requests: int, prompt_len: tuple[int, int], rate: float,
                     seed: int = 1) -> list[tuple[list[int], float]]:
    """``(prompt, arrival seconds)`` per request: prompt lengths uniform in
    ``prompt_len`` (inclusive), random tokens; arrivals all at 0
    (``rate`` 0) or a Poisson process of ``rate`` per second."""
    rng = np.random.default_rng(seed)
    lo, hi = prompt_len
    arrival, out = 0.0, []
    for _ in range(requests):
        prompt = rng.integers(1, vocab, int(rng.integers(lo, hi + 1))).tolist()
        out.append((prompt, arrival))
        if rate > 0:
            arrival += float(rng.exponential(1.0 / rate))
    return out


# --------------------------------------------------------------------------
# Device facts.
# --------------------------------------------------------------------------


def datasheet_bandwidth(kind: str) -> tuple[float, str] | None:
    """``(bytes/s, label)`` of the device named ``kind`` (``device_kind``), or None."""
    kind = kind.lower()
    for key, bandwidth, label in DATASHEET_BANDWIDTH:
        if key in kind:
            return bandwidth, label
    return None


def _free_bytes() -> int | None:
    """``bytes_limit - bytes_in_use`` of the default device (None: not reported)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def measure_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict:
    """Device memory bandwidth, bytes read + written over seconds, best of
    ``repeats`` after a warm-up: a jitted ``x + 1`` over ``nbytes`` of
    uint32 on an accelerator (default: 4 GiB, less when memory is short);
    on the CPU backend, where device memory is host memory and XLA's
    elementwise loop is far from the memory's speed, a numpy copy
    (``np.copyto``, default 128 MiB)."""
    cpu = jax.default_backend() == "cpu"
    if nbytes is None:
        free = _free_bytes()
        nbytes = 128 << 20 if cpu or free is None else int(min(4 * GiB, max(free // 8, 256 << 20)))
    n = nbytes // 4
    best = float("inf")
    if cpu:
        x, y = np.ones((n,), np.uint32), np.empty((n,), np.uint32)
        copy, method = (lambda: np.copyto(y, x)), "numpy copy (np.copyto)"
    else:
        x = jnp.zeros((n,), jnp.uint32)
        bump = jax.jit(lambda a: a + jnp.uint32(1))
        copy, method = (lambda: bump(x)), "jitted x + 1 (uint32)"
    jax.block_until_ready(copy())
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(copy())
        best = min(best, time.perf_counter() - start)
    kind = jax.devices()[0].device_kind
    sheet = datasheet_bandwidth(kind)
    return {"device_kind": kind, "method": method, "bytes": 2 * n * 4, "seconds": best,
            "measured_bytes_per_s": 2 * n * 4 / best, "datasheet_bytes_per_s": sheet[0] if sheet else None,
            "datasheet": sheet[1] if sheet else None}


# --------------------------------------------------------------------------
# Compile accounting (jax.monitoring).
# --------------------------------------------------------------------------

_COMPILES = {"seconds": 0.0, "count": 0}
_LISTENING = []


def _listen_compiles() -> None:
    if _LISTENING:
        return

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILES["seconds"] += duration
            _COMPILES["count"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    _LISTENING.append(listener)


def _compiles() -> tuple[float, int]:
    return _COMPILES["seconds"], _COMPILES["count"]


class _Clock:
    """Wall and compile time per phase, and the deadline."""

    def __init__(self, deadline: float):
        self.start = time.perf_counter()
        self.deadline = self.start + deadline if deadline and deadline > 0 else None
        self.phases: list[dict] = []

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def phase(self, name: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.t0, (self.c0, self.n0) = time.perf_counter(), _compiles()
                return self

            def __exit__(self, *exc):
                c1, n1 = _compiles()
                clock.phases.append({"phase": name, "wall_seconds": time.perf_counter() - self.t0,
                                     "compile_seconds": c1 - self.c0, "compiles": n1 - self.n0})
                return False

        return _Phase()


# --------------------------------------------------------------------------
# Decode: the engine's decode chunk, and the contiguous baseline.
# --------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,))
def _prefill_group(graphdef, params, manager, pool, rows, tokens, starts, num_new):
    """One :func:`~jaxkv.nn.steps.prefill_chunk` call (pool donated) and each
    lane's greedy next token after its last new token."""
    from jaxkv.nn.steps import prefill_chunk

    pool, last = prefill_chunk(graphdef, params, manager, pool, rows, tokens, starts, num_new)
    return pool, jnp.argmax(last, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("max_len",))
def _to_contiguous(pool, manager, rows, *, max_len: int):
    """The first ``max_len`` positions of the K/V of sequence ``rows``,
    gathered from the paged ``pool`` through the manager's block tables
    (unused entries read the null page) into ``((k, v), ...)`` per layer,
    ``[B, KVH, max_len, D]`` (:func:`~jaxkv.bench.decode.contiguous_decode`'s
    ``heads_first`` layout)."""
    from kernels_pallas.bits import from_bits

    tables, _ = manager.batch_tables(rows)
    tables = jnp.maximum(tables[:, : ceil_div(max_len, PAGE_SIZE)], 0)
    batch, width = tables.shape
    out = []
    for layer in range(pool.num_layers):
        pair = []
        for bits in (pool.k_bits[layer], pool.v_bits[layer]):  # [KVH, P, page, D]
            g = from_bits(bits, pool.dtype)[:, tables]  # [KVH, B, W, page, D]
            heads, _, _, page, dim = g.shape
            g = jnp.transpose(g, (1, 0, 2, 3, 4)).reshape(batch, heads, width * page, dim)
            pair.append(g[:, :, :max_len])
        out.append(tuple(pair))
    return tuple(out)


def _plan_decode(config, batches, contiguous, context, steps, repeats, prefill_tokens, weights_free):
    """Rows' pages and what fits: ``(batches, contiguous, pages per row,
    notes)`` with the batch sizes (and contiguous baselines) that do not fit
    in ``weights_free`` device bytes dropped (None: not checked)."""
    notes = []
    bpt = _kv_bytes_per_token(config)
    width = min(context, 2048)
    group = max(1, prefill_tokens // width)

    def pages(batches):
        growth = [steps * (1 + repeats) * sum(1 for b in batches if b > r) for r in range(max(batches))]
        return [ceil_div(context + g + 1, PAGE_SIZE) for g in growth]

    prefill_temp = group * width * (config.vocab_size * 6 + config.intermediate_size * 6 + config.hidden_size * 12) \
        + group * config.num_attention_heads * width * (context + 1) * 8
    batches = sorted(set(batches))
    if weights_free is not None:
        while batches:
            need = (sum(pages(batches)) + 2) * PAGE_SIZE * bpt + prefill_temp + 2 * GiB
            if need <= weights_free:
                break
            notes.append(f"batch {batches[-1]} skipped: the pool for {batches[-1]} rows of {context}+ tokens "
                         f"({need / GiB:.1f} GiB with temporaries) does not fit in {weights_free / GiB:.1f} GiB free")
            batches = batches[:-1]
    kept = []
    if batches:
        pool_bytes = (sum(pages(batches)) + 2) * PAGE_SIZE * bpt
        for b in sorted(set(contiguous)):
            if b not in batches:
                continue
            max_len = ceil_div(context + steps * (1 + repeats) * len(batches) + steps + 1, PAGE_SIZE) * PAGE_SIZE
            need = pool_bytes + b * max_len * bpt + 2 * GiB
            if weights_free is not None and need > weights_free:
                notes.append(f"contiguous at batch {b} skipped: its caches ({b * max_len * bpt / GiB:.1f} GiB) do "
                             f"not fit beside the pool in {weights_free / GiB:.1f} GiB free")
                continue
            kept.append(b)
    return batches, kept, (pages(batches) if batches else []), notes


def decode_section(model, o, clock: _Clock, bandwidth: dict | None, out: dict) -> None:
    """Sections 2 and 3 (module docstring); fills ``out["decode"]``,
    ``out["paged_vs_contiguous"]``, ``out["decode_check"]``, ``out["notes"]``."""
    from jaxkv.bench.decode import NEAR_TIE, NEAR_TIE_BF16, check_same_greedy, contiguous_decode
    from jaxkv.manager.block_space import BlockSpaceManager
    from jaxkv.nn.sampling import GREEDY
    from jaxkv.serve.caches import decode_chunk

    config = model.config
    graphdef, params = nnx.split(model)
    S, R, context = o.steps, o.repeats, o.context
    # A split between two paths is a rounding flip only where the reference's top two logits nearly tie, at the
    # model's own precision.
    low_precision = any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    near_tie = NEAR_TIE_BF16 if low_precision else NEAR_TIE
    batches, contiguous, row_pages, notes = _plan_decode(config, o.batches, o.contiguous_batches if o.contiguous else (),
                                                         context, S, R, o.prefill_tokens, _free_bytes())
    out["notes"] += notes
    for note in notes:
        print(f"note: {note}")
    if not batches:
        raise RuntimeError("no batch size fits on this device")
    rows = max(batches)
    max_blocks = max(row_pages)
    num_pages = sum(row_pages) + 2
    bpt = _kv_bytes_per_token(config)
    weight_total, embed = _weight_bytes(model)

    # Prefill every row's prompt once (untimed).
    with clock.phase("decode: prefill"):
        t0 = time.perf_counter()
        manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=PAGE_SIZE,
                                           max_seqs=rows, max_blocks_per_seq=max_blocks, watermark=0.0)
        pool = model.make_pool(num_pages, PAGE_SIZE)
        admit = jax.jit(BlockSpaceManager.admit_with_prefix)
        manager, ok = admit(manager, jnp.arange(rows, dtype=jnp.int32),
                            jnp.full((rows, max_blocks), -1, jnp.int32), jnp.full((rows,), context, jnp.int32))
        if not bool(ok):
            raise RuntimeError(f"admitting {rows} rows of {context} tokens failed ({num_pages} pages)")
        prompts = decode_prompts(config.vocab_size, rows, context, o.seed)
        width = min(context, 2048)
        group = max(1, min(rows, o.prefill_tokens // width))
        last = np.zeros((rows,), np.int32)
        for g0 in range(0, rows, group):
            lane_rows = np.full((group,), -1, np.int32)
            real = min(group, rows - g0)
            lane_rows[:real] = np.arange(g0, g0 + real)
            for start in range(0, context, width):
                n = min(width, context - start)
                tokens = np.zeros((group, width), np.int32)
                tokens[:real, :n] = prompts[g0:g0 + real, start:start + n]
                num_new = np.where(lane_rows >= 0, n, 0).astype(np.int32)
                pool, first = _prefill_group(graphdef, params, manager, pool, jnp.asarray(lane_rows),
                                             jnp.asarray(tokens), jnp.full((group,), start, jnp.int32),
                                             jnp.asarray(num_new))
            last[g0:g0 + real] = np.asarray(first)[:real]
        prefill_s = time.perf_counter() - t0
    print(f"\nprefilled {rows} rows of {context} tokens in {prefill_s:.1f} s ({group} rows x {width} tokens per call, "
          "compile included)")
    lengths = np.full((rows,), context, np.int64)  # tokens each row holds
    check_tokens = [int(last[0])]
    key = jax.random.key(0)
    state_box = {"manager": manager, "pool": pool}
    del manager, pool

    def paged(b):
        start = time.perf_counter()
        # Host arrays (numpy): no small program compiles for them.
        state = decode_chunk(graphdef, params, state_box["manager"], state_box["pool"], last[:b].copy(),
                             np.ones((b,), bool), np.zeros((b,), np.int32), np.full((b,), S + 1, np.int32),
                             np.full((b,), -1, np.int32), GREEDY, key, num_steps=S)
        state = jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        state_box["manager"], state_box["pool"] = state.manager, state.pool
        tokens, written, ok = jax.device_get((state.tokens, state.written, state.ok))
        if not bool(ok) or not np.all(written == S):
            raise RuntimeError(f"batch {b}: the decode chunk stopped early (ok={bool(ok)}, written "
                               f"{int(np.min(written))}..{int(np.max(written))} of {S})")
        last[:b] = tokens[:, S - 1]
        lengths[:b] += S
        return seconds, tokens

    decode_rows, contiguous_rows = [], []
    record = {"check": True}  # row 0's tokens are recorded during the first batch size that runs

    def one_batch(b: int) -> None:
        """Batch ``b``: contiguous caches (if asked), a chunk of each to
        compile, then ``R`` timed chunks of each, interleaved. Its locals
        (the contiguous caches) die with the call, also when it raises."""
        cont = None
        if b in contiguous:
            l0 = lengths[:b].copy()
            max_len = ceil_div(int(l0.max()) + S + 1, PAGE_SIZE) * PAGE_SIZE
            caches = _to_contiguous(state_box["pool"], state_box["manager"], np.arange(b, dtype=np.int32),
                                    max_len=max_len)
            cont = {"first": jnp.asarray(last[:b]), "lens": jnp.asarray(l0, jnp.int32), "best": float("inf"),
                    "max_len": max_len}
            t0 = time.perf_counter()
            # The untimed first call also returns each token's winning margin: a split from the paged
            # path is then told apart as a near-tie flip (bf16 rounding) or a real difference.
            caches, cont_tokens, margins = jax.block_until_ready(
                contiguous_decode(graphdef, params, caches, cont["first"], cont["lens"], steps=S, with_margins=True,
                                  heads_first=True))
            cont["first_call"] = time.perf_counter() - t0
            cont["tokens"], cont["margins"] = np.asarray(cont_tokens), np.asarray(margins)
            # The timed program reads the cache in its own dtype (the fair speed baseline); its untimed first call
            # compiles it, and its tokens are checked against the reference's above (the same chunk, recomputed
            # from the same start: a split only at a near-tie of the reference).
            caches, fast_tokens = jax.block_until_ready(
                contiguous_decode(graphdef, params, caches, cont["first"], cont["lens"], steps=S,
                                  attention=CONTIGUOUS_TIMED, heads_first=True))
            try:
                cont["timed_check"] = {"near_tie_rows": len(check_same_greedy(
                    np.asarray(fast_tokens), cont["tokens"], cont["margins"],
                    f"batch {b} contiguous ({CONTIGUOUS_TIMED}) vs contiguous (reference)", near_tie)), "defect": None}
            except AssertionError as err:
                cont["timed_check"] = {"near_tie_rows": None, "defect": str(err)}
                out["errors"].append({"where": f"decode batch {b}: contiguous ({CONTIGUOUS_TIMED})", "error": str(err)})
        kv_start = lengths[:b].copy()
        first_call, tokens = paged(b)
        check = record["check"]
        record["check"] = False
        if check:
            check_tokens.extend(tokens[0].tolist())
        agree = None if cont is None else float(np.mean(cont["tokens"] == tokens))
        split = None
        if cont is not None:
            try:
                split = {"near_tie_rows": len(check_same_greedy(np.asarray(tokens), cont["tokens"], cont["margins"],
                                                                f"batch {b} paged vs contiguous", near_tie)),
                         "defect": None}
            except AssertionError as err:  # a split where the reference did not nearly tie
                split = {"near_tie_rows": None, "defect": str(err)}
                out["errors"].append({"where": f"decode batch {b}: paged vs contiguous", "error": str(err)})
        kv_timed = lengths[:b].copy()
        best = float("inf")
        for _ in range(R):
            seconds, tokens = paged(b)
            best = min(best, seconds)
            if check:
                check_tokens.extend(tokens[0].tolist())
            if cont is not None:
                t0 = time.perf_counter()
                caches, _ = jax.block_until_ready(
                    contiguous_decode(graphdef, params, caches, cont["first"], cont["lens"], steps=S,
                                      attention=CONTIGUOUS_TIMED, heads_first=True))
                cont["best"] = min(cont["best"], time.perf_counter() - t0)
        step_s = best / S
        kv_bytes = float(np.sum(kv_timed + (R * S) / 2.0 + 0.5)) * bpt  # each row's mean length over the timed steps
        w_bytes = weight_total - embed + (b * config.hidden_size * 2 if embed else 0)
        step_bytes = w_bytes + kv_bytes
        row = {"batch": b, "context": int(kv_start.max()), "steps": S, "repeats": R, "tok_s": b * S / best,
               "step_ms": 1e3 * step_s, "chunk_ms": 1e3 * best, "first_call_s": first_call,
               "weight_bytes_per_step": w_bytes, "kv_bytes_per_step": kv_bytes,
               "bytes_per_step": step_bytes, "roofline_measured": None, "roofline_datasheet": None}
        if bandwidth:
            row["roofline_measured"] = step_bytes / bandwidth["measured_bytes_per_s"] / step_s
            if bandwidth.get("datasheet_bytes_per_s"):
                row["roofline_datasheet"] = step_bytes / bandwidth["datasheet_bytes_per_s"] / step_s
        decode_rows.append(row)
        line = f"decode batch {b}: {_rate(row['tok_s'])} tok/s, {row['step_ms']:.2f} ms/step"
        if cont is not None:
            cont_tok_s = b * S / cont["best"]
            contiguous_rows.append({
                "batch": b, "paged_tok_s": row["tok_s"], "contiguous_tok_s": cont_tok_s,
                "paged_over_contiguous": row["tok_s"] / cont_tok_s, "contiguous_max_len": cont["max_len"],
                "first_chunk_tokens_agree": agree, "contiguous_first_call_s": cont["first_call"],
                "rows_split_at_near_tie": split["near_tie_rows"], "split_defect": split["defect"],
                "contiguous_attention": CONTIGUOUS_TIMED,
                "timed_rows_split_at_near_tie": cont["timed_check"]["near_tie_rows"],
                "timed_split_defect": cont["timed_check"]["defect"]})
            line += f", paged/contiguous {row['tok_s'] / cont_tok_s:.3f} (first-chunk tokens agree {agree:.0%})"
        print(line, flush=True)

    for b in batches:
        if clock.left() < 20:
            note = f"decode at batch {b} and larger skipped: the deadline was near"
            out["notes"].append(note)
            print(f"note: {note}")
            break
        with clock.phase(f"decode: batch {b}"):
            gone = False
            try:
                one_batch(b)
            except Exception as err:  # noqa: BLE001 - one batch size failing must not end the section
                _record_error(out, f"decode batch {b}", err)
                gone = _deleted((state_box["manager"], state_box["pool"]))
            gc.collect()
            if gone:
                break  # the donated state is gone: nothing more can decode
    out["decode"] = decode_rows
    out["paged_vs_contiguous"] = contiguous_rows
    out["decode_check"] = {"prompt_seed": o.seed, "context": context, "row": 0, "tokens": check_tokens,
                           "first_batch": batches[0]}
    state_box.clear()
    gc.collect()


def _deleted(tree) -> bool:
    try:
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(tree) if hasattr(leaf, "is_deleted"))
    except Exception:  # noqa: BLE001
        return True


@contextlib.contextmanager
def _noting_warnings(out: dict):
    """Record the warnings raised inside (e.g. a ``KernelFallbackWarning``:
    a GPU kernel call ran the reference) in ``out["warnings"]``, each once,
    and print them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                text = f"{w.category.__name__}: {w.message}"[:600]
                if text not in out["warnings"]:
                    out["warnings"].append(text)
                    print(f"warning: {text}", flush=True)


def _record_error(out: dict, where: str, err: BaseException) -> None:
    text = f"{type(err).__name__}: {err}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    out["errors"].append({"where": where, "error": text})
    print(f"\nERROR in {where}: {text}")
    print("".join(traceback.format_exception(type(err), err, err.__traceback__)[-6:]), flush=True)


# --------------------------------------------------------------------------
# Serving.
# --------------------------------------------------------------------------


def _percentiles(values) -> tuple[float, float]:
    if not len(values):
        return (0.0, 0.0)
    arr = np.asarray(values, np.float64)
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def _engine_options(config, o, max_seqs: int) -> tuple[dict, dict]:
    """``Engine`` keyword arguments for ``max_seqs`` rows, and what they were
    sized from. ``max_seqs`` 0 (``--max-num-seqs auto``): only the
    scheduler and ``max_model_len`` are given; rows, token budget, chunks
    and the KV budget are the engine's own defaults for this device
    (:func:`jaxkv.serve.sizing.scheduler_defaults`), read back from
    ``engine.options`` once it is built."""
    lo, hi = o.prompt_len
    max_model_len = hi + o.new_tokens
    if max_seqs == AUTO:
        return dict(max_model_len=max_model_len, scheduler=o.scheduler), {
            "kv_bytes_wanted": None, "kv_bytes": None, "free_bytes": _free_bytes(), "temporaries_estimate": None}
    bpt = _kv_bytes_per_token(config)
    want = max_seqs * (ceil_div(max_model_len, PAGE_SIZE) + 1) * PAGE_SIZE * bpt + (4 << 20)
    options = dict(max_seqs=max_seqs, max_model_len=max_model_len, decode_chunk=o.decode_chunk, scheduler=o.scheduler)
    if o.scheduler == "padded":
        chunk = o.prefill_chunk or int(min(2048, max(16, 2 ** int(math.log2(max(PADDED_TOKENS // max_seqs, 1))))))
        chunk = min(chunk, pow2_at_least(hi))
        options["prefill_chunk"] = chunk
        # The call's float32 logits of every position, its activations, and the pure-jnp prefill attention's
        # scores and probabilities of every row over the whole table.
        temp = max_seqs * chunk * (config.vocab_size * 6 + config.intermediate_size * 6 + config.hidden_size * 12
                                   + config.num_attention_heads * max_model_len * 8)
    else:
        budget = o.max_num_batched_tokens or max(256, 2 * max_seqs)
        options["max_num_batched_tokens"] = budget
        options["prefill_chunk"] = o.prefill_chunk or budget
        temp = budget * (config.intermediate_size * 6 + config.hidden_size * 12) + \
            (max_seqs + 64) * config.vocab_size * 6
    free = _free_bytes()
    kv = want
    if free is not None:
        one_request = (ceil_div(max_model_len, PAGE_SIZE) + 2) * PAGE_SIZE * bpt  # the engine refuses less
        kv = int(min(want, max(0.9 * (free - temp - 2 * GiB), one_request)))
    options["kv_cache_memory"] = int(kv)
    return options, {"kv_bytes_wanted": int(want), "kv_bytes": int(kv), "free_bytes": free,
                     "temporaries_estimate": int(temp)}


def _bucket_count(budget: int) -> int:
    """Packed stream lengths up to ``budget`` (16, 32, 48, 64, 96, ...: the engine's buckets)."""
    count, n = 0, 16
    while True:
        for length in ((n, n * 3 // 2) if n >= 32 else (n,)):
            count += 1
            if length >= budget:
                return count
        n *= 2


def _warm_up(engine, vocab: int, prompt_len: int) -> int:
    """Compile the engine's programs: 2-token greedy requests that make each
    packed stream length (one request, or several at once where the length
    is more than one request may take; the padded scheduler: one request),
    then one that decodes past two decode chunks. Returns requests run."""
    lengths = list(engine.stream_lengths()) if getattr(engine, "scheduler", "padded") == "packed" and hasattr(
        engine, "stream_lengths") else []
    count = 0
    limit = getattr(engine, "max_model_len", None) or (prompt_len + 2)
    chunk = int(engine.options.scheduler.decode_chunk)
    # The last request decodes past two chunks: the decode chunk's program compiles here, not in the timed run.
    plan = [(length, 2) for length in lengths or [min(prompt_len, 64)]] + [(16, 2 * chunk + 2)]
    rows = int(engine.options.scheduler.max_seqs)
    for i, (length, new) in enumerate(plan):
        # A stream longer than one request may be (max_model_len) is filled by several at once.
        per = max(1, limit - new)
        pieces = [per] * (length // per) + ([length % per] if length % per else [])
        rids = []
        for j, piece in enumerate(pieces[:rows]):
            ids = [1 + (7 * k + 3 * i + 5 * j + 11) % max(vocab - 1, 1) for k in range(piece)]
            rids.append(engine.add_request(ids, new))
        while engine.has_unfinished():
            engine.step()
        for rid in rids:
            engine.forget(rid)
        count += len(rids)
    return count


def serve_one(model, o, max_seqs: int, clock: _Clock) -> dict:
    """The serving workload at ``max_seqs`` rows (module docstring, section 4)."""
    from jaxkv.serve import Engine

    config = model.config
    options, sizing_info = _engine_options(config, o, max_seqs)
    workload = serving_workload(config.vocab_size, o.requests, o.prompt_len, o.rate, seed=o.seed + 1)
    t0 = time.perf_counter()
    c0, n0 = _compiles()
    engine = Engine(model, **options)
    if max_seqs == AUTO:  # what the engine derived for this device
        sched = engine.options.scheduler
        options.update(max_seqs=int(sched.max_seqs), decode_chunk=int(sched.decode_chunk),
                       prefill_chunk=int(sched.prefill_chunk),
                       max_num_batched_tokens=None if sched.max_num_batched_tokens is None
                       else int(sched.max_num_batched_tokens))
        sizing_info["kv_bytes"] = int(engine.cache_plan.device_bytes)
        max_seqs = options["max_seqs"]
    warm = _warm_up(engine, config.vocab_size, o.prompt_len[0])
    warm_s = time.perf_counter() - t0
    warm_compile_s, warm_compiles = _compiles()[0] - c0, _compiles()[1] - n0
    base = engine.stats()  # drains the warm-up's latency samples
    c1, n1 = _compiles()
    order = sorted(range(len(workload)), key=lambda i: workload[i][1])
    owner, results = {}, {}
    start = time.perf_counter()
    end, nxt, stopped = start, 0, False
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter() - start
        if clock.left() <= 0:
            stopped = True
            break
        while nxt < len(order) and workload[order[nxt]][1] <= now:
            i = order[nxt]
            owner[engine.add_request(workload[i][0], o.new_tokens)] = i
            results[i] = {"tokens": 0, "first": None, "last": None, "gaps": []}
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(workload[order[nxt]][1] - (time.perf_counter() - start), 1.0)))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for output in outputs:
            r = results[owner[output.request_id]]
            count = len(output.new_token_ids)
            if count:
                record_arrival(r, count, t)
                end = t
            if output.finished:
                engine.forget(output.request_id)
    stats = engine.stats()
    wall = end - start
    streamed = sum(r["tokens"] for r in results.values())
    ttft = [r["first"] - (start + workload[i][1]) for i, r in results.items() if r["first"] is not None]
    itl = [g for r in results.values() for g in r["gaps"]]
    finished = sum(1 for i, r in results.items() if r["tokens"] == o.new_tokens)
    row = {
        "max_num_seqs": max_seqs, "scheduler": o.scheduler, "requests": len(workload), "finished": finished,
        "new_tokens": o.new_tokens, "prompt_len": list(o.prompt_len), "rate_per_s": o.rate,
        "wall_seconds": wall, "output_tok_s": streamed / wall if wall > 0 else 0.0,
        "streamed_tokens": streamed, "generated_tokens": int(stats.generated_tokens - base.generated_tokens),
        "prompt_tokens": int(sum(len(p) for p, _ in workload)),
        "ttft_ms": dict(zip(("p50", "p99"), (1e3 * x for x in _percentiles(ttft)))),
        "itl_ms": dict(zip(("p50", "p99"), (1e3 * x for x in _percentiles(itl)))),
        "engine_ttft_ms": dict(zip(("p50", "p99"), (1e3 * x for x in _percentiles(stats.ttft)))),
        "engine_itl_ms": dict(zip(("p50", "p99"), (1e3 * x for x in _percentiles(stats.itl)))),
        "preemptions": int(stats.preemptions - base.preemptions),
        "model_calls": int(stats.model_calls - base.model_calls),
        "warm_up_seconds": warm_s, "warm_up_requests": warm, "warm_up_compile_seconds": warm_compile_s,
        "warm_up_compiles": warm_compiles, "timed_compiles": _compiles()[1] - n1,
        "timed_compile_seconds": _compiles()[0] - c1, "stopped_at_deadline": stopped,
        "engine_options": options, **sizing_info,
    }
    del engine
    gc.collect()
    return row


# --------------------------------------------------------------------------
# The command.
# --------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)


#: ``--max-num-seqs auto``: the engine derives its scheduler options (GPU defaults on a GPU).
AUTO = 0


def _rows(text: str) -> tuple[int, ...]:
    """``--max-num-seqs``: a comma list of row counts, ``auto`` among them."""
    return tuple(AUTO if x == "auto" else int(x) for x in str(text).replace(" ", "").split(",") if x)


def _pair(text: str) -> tuple[int, int]:
    values = _ints(str(text).replace("-", ","))
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: give MIN,MAX with 1 <= MIN <= MAX")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxkv.bench real_scale", add_help=False)
    p.add_argument("--shapes", default="llama-3.1-8b", help=f"comma list of {', '.join(HF_CONFIGS)}")
    p.add_argument("--batches", type=_ints, help="decode batch sizes (default 1,16,64,256; --quick 1,64)")
    p.add_argument("--contiguous-batches", type=_ints, help="paged vs contiguous at these batches (default 1,64)")
    p.add_argument("--no-contiguous", dest="contiguous", action="store_false", help="skip the contiguous baseline")
    p.add_argument("--context", type=int, help="decode context tokens per row (default 2048)")
    p.add_argument("--steps", type=int, help="decode steps per chunk (default 32)")
    p.add_argument("--repeats", type=int, help="timed chunks per batch size (default 5; --quick 3)")
    p.add_argument("--requests", type=int, help="serving requests (default 512; --quick 128)")
    p.add_argument("--prompt-len", type=_pair, help="serving prompt lengths MIN,MAX (default 512,2048)")
    p.add_argument("--new-tokens", type=int, help="serving new tokens per request (default 256)")
    p.add_argument("--rate", type=float, help="serving Poisson arrivals per second (0: all at once; default 0)")
    p.add_argument("--max-num-seqs", type=_rows, help="serving engine rows (default 64,256; --quick 64); auto: "
                   "the engine's own defaults for the device (rows, token budget, chunks, KV budget)")
    p.add_argument("--scheduler", choices=("padded", "packed"), default="padded")
    p.add_argument("--prefill-chunk", type=int, help="serving prefill width (padded default 8192/max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, help="packed scheduler token budget (default 2*rows, >=256)")
    p.add_argument("--decode-chunk", type=int, help="serving decode steps per call (default 16)")
    p.add_argument("--prefill-tokens", type=int, help="decode section: prompt tokens per prefill call (4096)")
    p.add_argument("--sections", default="bandwidth,decode,serve", help="comma list of bandwidth,decode,serve")
    p.add_argument("--deadline", type=float, help="seconds after which nothing new starts (--quick 255; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_extra(args, rest: list[str]):
    """The options beyond the shared ones (``python -m jaxkv.bench``'s hook):
    ``args`` with this benchmark's flags added."""
    extra = _parser().parse_args(rest)
    for name, value in vars(extra).items():
        setattr(args, name, value)
    return args


def _options(args, shape: str):
    """The shape's defaults (``--quick`` profile applied), then the flags given."""
    extra = _parser().parse_args([])
    for name in vars(extra):
        if not hasattr(args, name):
            setattr(args, name, getattr(extra, name))
    tiny = shape == "tiny"
    defaults = dict(_FULL)
    if tiny:
        defaults.update(_TINY)
    if getattr(args, "quick", False):
        defaults.update(_TINY_QUICK if tiny else _QUICK)
    o = argparse.Namespace(**defaults)
    for name in ("batches", "contiguous_batches", "context", "steps", "repeats", "requests", "prompt_len",
                 "new_tokens", "rate", "max_num_seqs", "decode_chunk", "prefill_tokens", "deadline"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(o, name, value)
    for name in ("scheduler", "prefill_chunk", "max_num_batched_tokens", "seed", "contiguous"):
        setattr(o, name, getattr(args, name))
    o.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    return o


def run_shape(shape: str, o, clock: _Clock) -> dict:
    out = {"shape": shape, "errors": [], "notes": [], "warnings": [], "decode": [], "paged_vs_contiguous": [],
           "serving": []}
    config = config_for(shape)
    out["config"] = HF_CONFIGS[shape]
    try:
        with clock.phase(f"{shape}: build"):
            t0 = time.perf_counter()
            model = build_model(config, seed=o.seed, std=SHAPE_INIT_STD.get(shape, INIT_STD))
            jax.block_until_ready(nnx.state(model))
            out["build_seconds"] = time.perf_counter() - t0
        total, embed = _weight_bytes(model)
        out["params"] = param_count(config)
        out["published_params"] = PUBLISHED_PARAMS.get(shape)
        out["weight_bytes"] = total
        print(f"\n{shape}: {out['params']:,} parameters ({total / GiB:.2f} GiB bf16, random normal std "
              f"{SHAPE_INIT_STD.get(shape, INIT_STD)}), built on {jax.devices()[0].device_kind} in "
              f"{out['build_seconds']:.1f} s; K/V {_kv_bytes_per_token(config):,} bytes per token", flush=True)
    except Exception as err:  # noqa: BLE001
        _record_error(out, f"{shape}: build", err)
        return out

    bandwidth = None
    if "bandwidth" in o.sections or "decode" in o.sections:
        try:
            with clock.phase(f"{shape}: bandwidth"):
                bandwidth = measure_bandwidth()
            out["bandwidth"] = bandwidth
            sheet = bandwidth["datasheet_bytes_per_s"]
            print_table(f"memory bandwidth ({shape} run): {bandwidth['method']} over {bandwidth['bytes'] / 2 / GiB:.2f} "
                        "GiB, bytes read + written, best of 5",
                        ["device", "measured GB/s", "datasheet GB/s", "measured / datasheet"],
                        [[bandwidth["device_kind"], f"{bandwidth['measured_bytes_per_s'] / 1e9:.0f}",
                          f"{sheet / 1e9:.0f} ({bandwidth['datasheet']})" if sheet else "unknown",
                          f"{bandwidth['measured_bytes_per_s'] / sheet:.2f}" if sheet else "-"]])
        except Exception as err:  # noqa: BLE001
            _record_error(out, f"{shape}: bandwidth", err)

    if "decode" in o.sections:
        try:
            with _noting_warnings(out):
                decode_section(model, o, clock, bandwidth, out)
        except Exception as err:  # noqa: BLE001
            _record_error(out, f"{shape}: decode", err)
        gc.collect()
        _print_decode(shape, o, out, bandwidth)

    if "serve" in o.sections:
        # Time a serving run needs: its programs' compiles (as long as a decode chunk's first call) and a run.
        # Seconds per program: measured in this run's earlier phases where they compiled, else a guess.
        compiled = [p for p in clock.phases if p.get("compiles")]
        compile_est = (max(p["compile_seconds"] / p["compiles"] for p in compiled) * 1.5 if compiled else 10.0)
        for max_seqs in o.max_num_seqs:
            budget = o.max_num_batched_tokens or (8192 if max_seqs == AUTO else max(256, 2 * max_seqs))
            programs = 2 if o.scheduler == "padded" else 1 + _bucket_count(budget)
            need = 30.0 + programs * compile_est
            if clock.left() < need:
                note = (f"serving at max_num_seqs {max_seqs} skipped: {clock.left():.0f} s to the deadline, it needs "
                        f"about {need:.0f} s ({programs} programs to compile at ~{compile_est:.0f} s, and the run)")
                out["notes"].append(note)
                print(f"note: {note}")
                continue
            try:
                with clock.phase(f"{shape}: serve {'auto' if max_seqs == AUTO else max_seqs} rows"), _noting_warnings(out):
                    row = serve_one(model, o, max_seqs, clock)
                out["serving"].append(row)
                print(f"serving max_num_seqs {row['max_num_seqs']}: {_rate(row['output_tok_s'])} output tok/s, "
                      f"{row['finished']}/{row['requests']} finished", flush=True)
            except Exception as err:  # noqa: BLE001
                _record_error(out, f"{shape}: serve {max_seqs}", err)
            gc.collect()
        _print_serving(shape, o, out)
    del model
    gc.collect()
    return out


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _rate(x: float) -> str:
    """Tokens/s for a table: whole numbers, three significant digits below 100."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _print_decode(shape: str, o, out: dict, bandwidth) -> None:
    if out["decode"]:
        bw = (f"measured {bandwidth['measured_bytes_per_s'] / 1e9:.0f} GB/s"
              + (f", datasheet {bandwidth['datasheet_bytes_per_s'] / 1e9:.0f} GB/s"
                 if bandwidth and bandwidth.get("datasheet_bytes_per_s") else "")) if bandwidth else "no bandwidth"
        print_table(
            f"decode ({shape}, bf16): the engine's decode chunk (jaxkv.serve.caches.decode_chunk, {o.steps} greedy "
            f"steps per jitted call), {o.context}-token prompts prefilled once; best of {o.repeats} chunks. "
            f"Roofline = (weights + every row's K/V) / bandwidth / step time ({bw})",
            ["batch", "longest context", "tok/s", "ms/step", "GB read/step", "roofline (measured BW)",
             "roofline (datasheet)", "first call s"],
            [[r["batch"], r["context"], _rate(r["tok_s"]), f"{r['step_ms']:.2f}", f"{r['bytes_per_step'] / 1e9:.2f}",
              _fmt(r["roofline_measured"]), _fmt(r["roofline_datasheet"]), f"{r['first_call_s']:.1f}"]
             for r in out["decode"]])
    if out["paged_vs_contiguous"]:
        print_table(
            f"paged vs contiguous decode ({shape}): the same K/V (gathered from the pool), {o.steps} steps per "
            f"call, interleaved; the contiguous side timed with {CONTIGUOUS_TIMED} attention (K/V read in the "
            "cache's dtype, float32 accumulation); target paged/contiguous >= 0.95 at 8B",
            ["batch", "paged tok/s", "contiguous tok/s", "paged/contiguous", "first-chunk tokens agree",
             "rows split at a near-tie", "timed contiguous: rows split at a near-tie"],
            [[r["batch"], _rate(r["paged_tok_s"]), _rate(r["contiguous_tok_s"]),
              f"{r['paged_over_contiguous']:.3f}", _fmt(r["first_chunk_tokens_agree"], ".0%"),
              "DEFECT" if r.get("split_defect") else r.get("rows_split_at_near_tie"),
              "DEFECT" if r.get("timed_split_defect") else r.get("timed_rows_split_at_near_tie")]
             for r in out["paged_vs_contiguous"]])


def _print_serving(shape: str, o, out: dict) -> None:
    if not out["serving"]:
        return
    rate = "all at once" if not o.rate else f"Poisson {o.rate:g}/s"
    print_table(
        f"serving ({shape}): {o.requests} requests, prompts {o.prompt_len[0]}..{o.prompt_len[1]} tokens, "
        f"{o.new_tokens} new tokens each (greedy, no EOS), arrivals {rate}; jaxkv.serve.Engine "
        f"scheduler={o.scheduler}, decode_chunk {o.decode_chunk}; programs compiled by a warm-up first",
        ["max seqs", "finished", "output tok/s", "TTFT ms p50/p99", "ITL ms p50/p99", "generated", "preempted",
         "warm-up s (compile s)", "timed compiles", "wall s"],
        [[r["max_num_seqs"], f"{r['finished']}/{r['requests']}" + (" (deadline)" if r["stopped_at_deadline"] else ""),
          _rate(r["output_tok_s"]), f"{r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f}",
          f"{r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f}", r["generated_tokens"], r["preemptions"],
          f"{r['warm_up_seconds']:.1f} ({r['warm_up_compile_seconds']:.1f})", r["timed_compiles"],
          f"{r['wall_seconds']:.1f}"] for r in out["serving"]])


def main(args) -> int:
    _listen_compiles()
    shapes = [s.strip() for s in getattr(args, "shapes", "llama-3.1-8b").split(",") if s.strip()]
    bad = [s for s in shapes if s not in HF_CONFIGS]
    if bad:
        print(f"unknown shape(s) {bad}; choose from {', '.join(HF_CONFIGS)}")
        return 2
    first = _options(args, shapes[0])
    clock = _Clock(first.deadline)
    machine = machine_description()
    print(f"real_scale on {machine}, {os.cpu_count()} CPU cores; shapes {', '.join(shapes)}"
          + (" (--quick)" if getattr(args, "quick", False) else "")
          + (f"; deadline {first.deadline:.0f} s" if clock.deadline else ""), flush=True)
    results = []
    for shape in shapes:
        o = _options(args, shape)
        try:
            results.append(run_shape(shape, o, clock))
        except Exception as err:  # noqa: BLE001 - the JSON line must come out
            out = {"shape": shape, "errors": [], "notes": []}
            _record_error(out, shape, err)
            results.append(out)
        results[-1]["options"] = {k: (list(v) if isinstance(v, (tuple, set)) else v) for k, v in vars(o).items()}
    total = time.perf_counter() - clock.start
    print_table(f"wall time per phase (total {total:.1f} s); compile s from jax.monitoring backend-compile events",
                ["phase", "wall s", "compile s", "compiles"],
                [[p["phase"], f"{p['wall_seconds']:.1f}", f"{p['compile_seconds']:.1f}", p["compiles"]]
                 for p in clock.phases])
    errors = [e for r in results for e in r.get("errors", [])]
    if errors:
        print(f"\n{len(errors)} error(s): " + "; ".join(e["where"] for e in errors))
    if getattr(args, "json", False):
        print_json({"benchmark": "real_scale", "machine": machine, "backend": jax.default_backend(),
                    "results": results, "phases": clock.phases, "total_seconds": total, "errors": errors})
    return 1 if errors else 0
