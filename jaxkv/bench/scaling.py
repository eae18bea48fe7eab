"""``python -m jaxkv.bench scaling``: a step costs what it touches, not the pool.

(``python -m jaxkv.bench scaling --mesh`` is the other scaling: every family
on 1..8 devices and across two processes, :mod:`jaxkv.bench.mesh`.)

Each subject runs the same batch and context at pool sizes P, 4P and 16P
(blocks or pages; P is what the batch needs) and reports microseconds per
step and the ratios 4P/P and 16P/P (target: 16P/P <= 1.2). A step's work
should grow with the tokens it touches; a ratio well above 1 means some
operation reads, writes or copies the whole pool (on XLA's CPU backend, a
scatter into a bf16 or fp8 array converts the whole array: jaxkv therefore
stores sub-32-bit pools as raw integer bits, see :mod:`jaxkv._ops`).

Subjects (batch 8, 256 tokens already cached per row, page 16, 4 layers of
2 KV heads x 64, bf16 unless named):

* **decode write**: ``KVPool.set_kv`` of one token per row in every layer
  (bf16 and fp8 pools);
* **append_slots**: ``BlockSpaceManager.append_slots`` of one token per row
  plus the K/V write of every layer (no sharing);
* **append_slots + CoW**: each step forks every row into a spare row,
  appends to the child (its last block is shared: copy-on-write copies the
  block in every layer), writes, and frees the child;
* **hybrid step**: the V4-Flash-like schedule's cache step (``reserve`` in
  every group, then each layer's SWA / compressor / indexer writes; fp8
  entries), at P, 4P, 16P blocks per group;
* **paged decode attention**: ``kernels_pallas.paged_attention`` (the CPU
  reference here) over the 256 cached tokens, reading layer 1 of the
  stacked pool;
* **engine decode chunk**: the engine's jitted decode chunk
  (``jaxkv.serve.caches``) of 8 steps on the decode benchmark's small Llama
  with a bf16 pool, per step.

Every subject runs ``steps`` steps inside one jitted ``lax.scan`` (or the
chunk's own loop) with its state donated and threaded from run to run, so
no run copies a pool; figures are minima over repeats, the three pool sizes
interleaved.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.bench._timing import best_seconds_threaded, machine_description, print_json, print_table
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import HybridConfig, deepseek_v4_schedule, v4_flash_like_ratios
from jaxkv.pool.kv_pool import KVPool

__all__ = ["main", "measure", "SCALES"]

SCALES = (1, 4, 16)
BATCH, CONTEXT, PAGE, LAYERS, KV_HEADS, HEAD_DIM = 8, 256, 16, 4, 2, 64


@partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _scan(step, state, xs):
    return jax.lax.scan(step, state, xs)


def _pages_needed(extra_tokens: int) -> int:
    return BATCH * -(-(CONTEXT + extra_tokens) // PAGE) + 1


def _paged_state(num_pages: int, extra_tokens: int, dtype, rows: int = BATCH):
    max_blocks = -(-(CONTEXT + extra_tokens) // PAGE)
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=PAGE,
                                       max_seqs=rows, max_blocks_per_seq=max_blocks)
    for row in range(BATCH):  # one sequence per row (a list would be one group sharing its prompt)
        manager = manager.allocate_or_raise([row], num_tokens=CONTEXT)
    pool = KVPool.create(num_pages=num_pages, page_size=PAGE, num_layers=LAYERS, k_heads=KV_HEADS, k_dim=HEAD_DIM,
                         dtype=dtype)
    return manager, pool


def _write_all_layers(pool, slots, kv):
    for layer in range(pool.num_layers):
        pool = pool.set_kv(layer, slots, kv, -kv)
    return pool


def _write_rows(num_pages, steps, rng, dtype):
    manager, pool = _paged_state(num_pages, 0, dtype)
    slots = manager.token_slots(jnp.arange(BATCH, dtype=jnp.int32),
                                jnp.full((BATCH, 1), CONTEXT - 1, jnp.int32)).reshape(-1)
    kv = jnp.asarray(rng.normal(size=(steps, BATCH, KV_HEADS, HEAD_DIM)), jnp.float32)

    def step(pool, kv_t):
        return _write_all_layers(pool, slots, kv_t), jnp.bool_(True)

    return lambda state: _scan(step, state, kv), pool


def _append_rows(num_pages, steps, repeats, rng, dtype, cow: bool):
    extra = steps * (repeats + 2) + 1
    manager, pool = _paged_state(num_pages, extra, dtype, rows=2 * BATCH)
    rows = jnp.arange(BATCH, dtype=jnp.int32)
    kv = jnp.asarray(rng.normal(size=(steps, BATCH, KV_HEADS, HEAD_DIM)), jnp.float32)

    def step(state, kv_t):
        manager, pool = state
        if not cow:
            manager, pool, slots, _, ok = manager.append_slots(pool, rows)
            return (manager, _write_all_layers(pool, slots.reshape(-1), kv_t)), ok
        children = rows + BATCH
        manager, ok_fork = manager.fork(rows, children)
        manager, pool, slots, _, ok = manager.append_slots(pool, children)
        pool = _write_all_layers(pool, slots.reshape(-1), kv_t)
        manager, ok_free = manager.free(children)
        return (manager, pool), ok_fork & ok & ok_free

    return lambda state: _scan(step, state, kv), (manager, pool)


def _hybrid_rows(scale, steps, repeats, rng):
    from jaxkv.bench.hybrid import hybrid_cache_step

    schedule = deepseek_v4_schedule(v4_flash_like_ratios(LAYERS))
    config = HybridConfig()
    context = CONTEXT + steps * (repeats + 2) + 1
    probe = KVCacheManager.create(config, schedule, BATCH, max_context_tokens=context)
    blocks = {name: (g.allocator.num_blocks - 1) * scale + 1 for name, g in probe.groups.items()}
    manager = KVCacheManager.create(config, schedule, BATCH, max_context_tokens=context, num_blocks=blocks)
    manager, slots, _ = manager.admit(BATCH, max_n=BATCH)
    values = jnp.asarray(rng.normal(size=(steps, BATCH, 4 * config.head_dim)), jnp.float32)

    def step(manager, x):
        return hybrid_cache_step(manager, slots, x)

    return lambda state: _scan(step, state, values), manager


def _attention_rows(num_pages, steps, rng, dtype):
    from kernels_pallas.paged_attention import paged_attention

    manager, pool = _paged_state(num_pages, 0, dtype)
    rows = jnp.arange(BATCH, dtype=jnp.int32)
    k = jnp.asarray(rng.normal(size=(BATCH * CONTEXT, KV_HEADS, HEAD_DIM)), jnp.float32)
    slots = manager.token_slots(rows, jnp.broadcast_to(jnp.arange(CONTEXT, dtype=jnp.int32), (BATCH, CONTEXT)))
    for layer in range(LAYERS):
        pool = pool.set_kv(layer, slots.reshape(-1), k, -k)
    tables, lengths = manager.batch_tables(rows)
    tables = jnp.clip(tables, 0, None)
    q = jnp.asarray(rng.normal(size=(steps, BATCH, 4 * KV_HEADS, HEAD_DIM)), jnp.float32)

    def step(pool, q_t):
        out = paged_attention(q_t, pool.k_pages, pool.v_pages, tables, lengths, pool.k_scales, pool.v_scales,
                              layer=1)
        return pool, jnp.all(jnp.isfinite(out))

    return lambda state: _scan(step, state, q), pool


def _engine_rows(num_pages, steps, repeats, rng):
    from flax import nnx

    from jaxkv.bench.decode import CONFIG
    from jaxkv.nn.generate import prefill
    from jaxkv.nn.llama import LlamaForCausalLM
    from jaxkv.nn.sampling import GREEDY, RowSampling
    from jaxkv.serve.caches import decode_chunk

    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    max_new = steps * (repeats + 2) + 2
    max_blocks = -(-(CONTEXT + max_new) // PAGE)
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=PAGE,
                                       max_seqs=BATCH, max_blocks_per_seq=max_blocks)
    pool = model.make_pool(num_pages, PAGE, dtype=jnp.bfloat16)
    prompts = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (BATCH, CONTEXT)), jnp.int32)
    state = prefill(graphdef, params, manager, pool, prompts, jnp.full((BATCH,), CONTEXT, jnp.int32),
                    jax.random.key(0), np.int32(-1), GREEDY, max_new=max_new)
    sampling = RowSampling.broadcast(GREEDY, BATCH)
    active = jnp.ones((BATCH,), bool)
    keys = jax.random.split(jax.random.key(1), BATCH)
    carry = (state.manager, state.pool, state.tokens[:, 0], jnp.ones((BATCH,), jnp.int32))

    def run(carry):
        manager, pool, last, generated = carry
        out = decode_chunk(graphdef, params, manager, pool, last, active, generated,
                           jnp.full((BATCH,), max_new, jnp.int32), np.int32(-1), sampling, keys, num_steps=steps)
        return (out.manager, out.pool, out.last, out.num_generated), out.ok & jnp.all(out.written == steps)

    return run, carry


def measure(steps: int = 16, repeats: int = 5, subjects: tuple[str, ...] | None = None,
            scales: tuple[int, ...] = SCALES) -> list[dict]:
    """Rows of microseconds per step at each pool scale (the first is P),
    with ratios to P; ``subjects``: substrings of the subjects to run."""
    rng = np.random.default_rng(0)
    builders = {
        "decode write (bf16)": lambda n, s: _write_rows(n, steps, rng, jnp.bfloat16),
        "decode write (fp8 e4m3)": lambda n, s: _write_rows(n, steps, rng, jnp.float8_e4m3fn),
        "append_slots + write": lambda n, s: _append_rows(n, steps, repeats, rng, jnp.bfloat16, cow=False),
        "append_slots + CoW + write": lambda n, s: _append_rows(n, steps, repeats, rng, jnp.bfloat16, cow=True),
        "hybrid step (V4-Flash-like, fp8)": lambda n, s: _hybrid_rows(s, steps, repeats, rng),
        "paged decode attention": lambda n, s: _attention_rows(n, steps, rng, jnp.bfloat16),
        "engine decode chunk": lambda n, s: _engine_rows(n, steps, repeats, rng),
    }
    rows = []
    for name, build in builders.items():
        if subjects and not any(s in name for s in subjects):
            continue
        base = _pages_needed(steps * (repeats + 2) + 2) - 1
        runs = {scale: build(base * scale + 1, scale) for scale in scales}
        best = best_seconds_threaded(runs, repeats)
        per_step = {scale: best[scale] / steps * 1e6 for scale in scales}
        rows.append({"subject": name, "base_blocks": base, **{f"us_{s}P": per_step[s] for s in scales},
                     **{f"ratio_{s}P": per_step[s] / per_step[scales[0]] for s in scales[1:]}})
        del runs
    return rows


def main(args) -> int:
    if getattr(args, "mesh", False):  # every family on 1..8 devices and two processes: jaxkv.bench.mesh
        from jaxkv.bench import mesh

        return mesh.main(args)
    print(machine_description())
    if args.quick:  # CI's smoke run: each subject compiles once per pool size
        scales, subjects = (1, 16), ("decode write (bf16)", "CoW")
        rows = measure(steps=4, repeats=2, subjects=subjects, scales=scales)
        print("--quick: P and 16P only, and only " + ", ".join(subjects) + "; run without it for the table")
    else:
        scales = SCALES
        rows = measure(steps=64, repeats=7)
    print_table(f"per-step time at pool sizes {', '.join(f'{s}P' for s in scales)} ({jax.default_backend()}; "
                f"batch {BATCH}, {CONTEXT} cached tokens per row, page {PAGE}, {LAYERS} layers; "
                f"target 16P/P <= 1.2)",
                ["subject", "P (blocks)", *(f"us/step {s}P" for s in scales), *(f"{s}P / P" for s in scales[1:])],
                [[r["subject"], r["base_blocks"], *(r[f"us_{s}P"] for s in scales),
                  *(r[f"ratio_{s}P"] for s in scales[1:])] for r in rows])
    if args.json:
        print_json({"benchmark": "scaling", "machine": machine_description(), "results": rows})
    return 0
