"""``python -m jaxkv.bench pool``: the paged pool against a contiguous cache.

Same data, same jitted work, two layouts, in one run:

* ``decode write``: one new token per sequence per step, 64 steps in one
  ``lax.scan`` with the cache carried (in place): paged ``KVPool.set_kv`` at
  the slots of a block table vs ``cache.at[batch, position].set`` on a
  contiguous ``[B, max_len, KVH, D]`` cache;
* ``prefill write``: a whole ``[B, prompt]`` chunk written at once;
* ``decode attention``: the pure-jnp reference (``paged_decode_attention``,
  which gathers pages through the block table) vs ``dense_decode_attention``
  on the contiguous cache, every sequence at the full context.

Blocks of a sequence are scattered over the pool in random order (as after a
long serving run), so the paged side pays for its indirection. The ratio
column is paged time / contiguous time (1.0 = no cost for paging; lower is
better). Bandwidth counts the K and V bytes the operation must touch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.reference import dense_decode_attention, paged_decode_attention
from jaxkv.bench._timing import best_seconds_interleaved, machine_description, print_json, print_table
from jaxkv.pool import KVPool
from jaxkv.pool.kv_pool import dequantize, is_fp8, quantize_fp8

__all__ = ["main", "measure"]

PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM = 16, 8, 32, 128
DECODE_STEPS = 64


def _setup(batch: int, context: int, dtype, rng):
    pages_per_seq = context // PAGE_SIZE
    num_pages = batch * pages_per_seq + 1
    pool = KVPool.create(num_pages=num_pages, page_size=PAGE_SIZE, num_layers=1, k_heads=KV_HEADS,
                         k_dim=HEAD_DIM, dtype=dtype)
    tables = (rng.permutation(num_pages - 1) + 1).reshape(batch, pages_per_seq).astype(np.int32)
    return pool, jnp.asarray(tables)


def _contiguous(batch, context, dtype):
    shape = (batch, context, KV_HEADS, HEAD_DIM)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def measure(batch: int, context: int, dtype, repeats: int, rng) -> list[dict]:
    pool, tables = _setup(batch, context, dtype, rng)
    k_cache, v_cache = _contiguous(batch, context, dtype)
    rows = jnp.arange(batch)
    new_k = jnp.asarray(rng.normal(size=(DECODE_STEPS, batch, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    new_v = jnp.asarray(rng.normal(size=(DECODE_STEPS, batch, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    start = context - DECODE_STEPS

    @jax.jit
    def paged_decode_writes(pool, new_k, new_v):
        def step(pool, x):
            t, k, v = x
            position = start + t
            slots = tables[:, position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
            return pool.set_kv(0, slots, k, v), None
        return jax.lax.scan(step, pool, (jnp.arange(DECODE_STEPS), new_k, new_v))[0]

    @jax.jit
    def dense_decode_writes(caches, new_k, new_v):
        def step(caches, x):
            t, k, v = x
            kc, vc = caches
            return (kc.at[rows, start + t].set(k.astype(kc.dtype)), vc.at[rows, start + t].set(v.astype(vc.dtype))), None
        return jax.lax.scan(step, caches, (jnp.arange(DECODE_STEPS), new_k, new_v))[0]

    prompt_k = jnp.asarray(rng.normal(size=(batch, context, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    prompt_v = jnp.asarray(rng.normal(size=(batch, context, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    positions = jnp.arange(context)
    all_slots = tables[:, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE

    paged_prefill = jax.jit(lambda pool, k, v: pool.set_kv(0, all_slots, k, v))

    @jax.jit
    def dense_prefill(caches, k, v):
        """The contiguous cache stores what the pool stores (fp8: values and
        per-token-per-head scales)."""
        if is_fp8(dtype):
            (k, k_scale), (v, v_scale) = quantize_fp8(k, dtype), quantize_fp8(v, dtype)
        else:
            k, k_scale, v, v_scale = k.astype(dtype), None, v.astype(dtype), None
        origin = (0, 0, 0, 0)
        k = jax.lax.dynamic_update_slice(caches[0], k, origin)  # into the existing cache
        v = jax.lax.dynamic_update_slice(caches[1], v, origin)
        return (k, k_scale), (v, v_scale)

    filled = paged_prefill(pool, prompt_k, prompt_v)
    (dense_k, dense_k_scale), (dense_v, dense_v_scale) = dense_prefill((k_cache, v_cache), prompt_k, prompt_v)
    q = jnp.asarray(rng.normal(size=(batch, HEADS, HEAD_DIM)), jnp.bfloat16)
    lengths = jnp.full((batch,), context, jnp.int32)
    # Caches go in as arguments: closed-over arrays would be constants that XLA
    # may fold (gathering the pages at compile time).
    paged_args = (*filled.layer_arrays(0), tables, lengths)
    dense_args = (dense_k, dense_k_scale, dense_v, dense_v_scale, lengths)
    paged_attend_fn = jax.jit(lambda q, k, v, ks, vs, t, n: paged_decode_attention(q, k, v, t, n, ks, vs))
    dense_attend_fn = jax.jit(lambda q, k, ks, v, vs, n: dense_decode_attention(
        q, dequantize(k, ks), dequantize(v, vs), n))
    paged_attend = lambda q: paged_attend_fn(q, *paged_args)  # noqa: E731
    dense_attend = lambda q: dense_attend_fn(q, *dense_args)  # noqa: E731

    # Same answer from both layouts (up to the pool's rounding, identical here).
    np.testing.assert_allclose(np.asarray(paged_attend(q), np.float32), np.asarray(dense_attend(q), np.float32),
                               rtol=2e-2, atol=2e-2)

    cases = {
        "decode write": (lambda: paged_decode_writes(pool, new_k, new_v),
                         lambda: dense_decode_writes((k_cache, v_cache), new_k, new_v),
                         DECODE_STEPS * batch),
        "prefill write": (lambda: paged_prefill(pool, prompt_k, prompt_v),
                          lambda: dense_prefill((k_cache, v_cache), prompt_k, prompt_v),
                          batch * context),
        "decode attention": (lambda: paged_attend(q), lambda: dense_attend(q), batch * context),
    }
    token_bytes = 2 * KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize
    results = []
    for name, (paged, contiguous, tokens) in cases.items():
        paged(), contiguous()  # compile
        best = best_seconds_interleaved({"paged": paged, "contiguous": contiguous}, repeats)
        results.append({
            "op": name, "batch": batch, "context": context, "dtype": jnp.dtype(dtype).name,
            "paged_ms": best["paged"] * 1e3, "contiguous_ms": best["contiguous"] * 1e3,
            "paged_over_contiguous": best["paged"] / best["contiguous"],
            "paged_GBps": tokens * token_bytes / best["paged"] / 1e9,
        })
    return results


def main(args) -> int:
    rng = np.random.default_rng(0)
    configs = [(4, 256)] if args.quick else [(8, 512), (32, 512)]
    dtypes = [jnp.bfloat16] if args.quick else [jnp.bfloat16, jnp.float8_e4m3fn]
    repeats = 2 if args.quick else 5
    results = [r for b, c in configs for d in dtypes for r in measure(b, c, d, repeats, rng)]
    print(f"pool benchmark on {machine_description()}; page size {PAGE_SIZE}, {KV_HEADS} KV heads x {HEAD_DIM}, "
          f"{HEADS} query heads; best of {repeats}")
    print_table(
        "Paged KVPool vs contiguous [B, max_len, KVH, D] cache (ratio = paged / contiguous; lower is better)",
        ["op", "batch", "context", "dtype", "paged ms", "contiguous ms", "ratio", "paged GB/s"],
        [[r["op"], r["batch"], r["context"], r["dtype"], r["paged_ms"], r["contiguous_ms"],
          r["paged_over_contiguous"], r["paged_GBps"]] for r in results],
    )
    if args.json:
        print_json({"benchmark": "pool", "machine": machine_description(), "results": results})
    return 0
