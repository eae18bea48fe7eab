"""Decode through the hybrid KVCacheManager (seed 004), on CPU.

1. A small DeepSeek-V4-style schedule (SWA-only, CSA and HCA layers, tiny
   dims, random weights): two requests decode token by token; every step is
   one jitted call that reserves blocks (allocated as compressed entries cross
   128-token blocks) and runs each layer through its LayerCacheHandle.
2. A Qwen3-Next-style schedule (3 Gated DeltaNet layers : 1 full-attention
   layer) through the same manager.
3. Memory per token at real sizes against a full-attention cache, computed
   from the arrays the managers would own (``jax.eval_shape``, nothing
   allocated).

Run: ``python examples/hybrid_cache.py``
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import AttentionKind, HybridConfig, KVCacheManager, LayerSpec, deepseek_v4_schedule, qwen3_next_schedule
from jaxkv.manager.hybrid_schema import v4_flash_like_ratios
from jaxkv.pool.kv_pool import KVPool
from kernels_pallas import EntryFormat

# The DeepSeek-V4 and Gated DeltaNet layers here are the test-only reference
# implementations (no real model in jaxkv.nn uses them); they live beside the
# tests, so this script puts the repository root on the path to import them.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests.reference import dsv4_reference, gated_delta_net  # noqa: E402

HIDDEN, HEADS, STEPS = 32, 2, 136  # 136 > 128: an HCA entry and a second CSA block
TINY = HybridConfig(entry_format=EntryFormat("tiny", nope_dim=64, rope_dim=16, group_size=32, scale_kind="ue8m0"),
                    window=16, index_head_dim=16, index_topk=4, num_kv_heads=2, kv_head_dim=16, page_size=16,
                    linear_num_k_heads=2, linear_num_v_heads=2, linear_head_k_dim=8, linear_head_v_dim=8,
                    linear_dtype=jnp.float32)


def deepseek_v4_style():
    schedule = [LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.CSA, 4),
                LayerSpec(2, AttentionKind.HCA, 128)]
    manager = KVCacheManager.create(TINY, schedule, max_concurrent_requests=2, max_context_tokens=256)
    params = [dsv4_reference.init_params(jax.random.key(i), HIDDEN, HEADS, s, max_len=256)
              for i, s in enumerate(manager.schemas)]
    manager, slots = manager.admit_or_raise(2)
    slots = jnp.asarray(slots, jnp.int32)

    @jax.jit
    def step(manager, x):
        manager, positions, ok = manager.reserve(slots, 1)
        for layer, p in enumerate(params):
            handle = manager.acquire(layer, slots, positions)
            handle, x = dsv4_reference.decode_step(p, handle, x)
            manager = manager.update(handle)
        return manager, x, ok

    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = jnp.asarray(dsv4_reference.to_grid(rng.normal(size=(2, HIDDEN)) * 0.5))
        manager, y, ok = step(manager, x)
        assert bool(ok)
    blocks = {name: int(np.asarray(g.lens)[np.asarray(slots)].sum()) for name, g in manager.groups.items()}
    print(f"DeepSeek-V4-style: 2 requests x {STEPS} tokens decoded through SWA, CSA and HCA layers; "
          f"blocks held per group {blocks}; output norm {float(jnp.linalg.norm(y)):.3f}")
    manager = manager.release_or_raise(slots)
    print(f"  released: free blocks {({n: int(g.allocator.num_free) for n, g in manager.groups.items()})}")


def qwen3_next_style():
    schedule = qwen3_next_schedule(4)
    manager = KVCacheManager.create(TINY, schedule, max_concurrent_requests=2, max_context_tokens=256)
    keys = jax.random.split(jax.random.key(7), 8)
    gdn = [gated_delta_net.init_params(keys[i], HIDDEN, 2, 2, 8, 8, 4) for i in range(3)]
    kvh, d = TINY.num_kv_heads, TINY.kv_head_dim
    w_q, w_k, w_v = (jax.random.normal(keys[3 + i], (HIDDEN, n)) / HIDDEN**0.5
                     for i, n in enumerate((2 * kvh * d, kvh * d, kvh * d)))
    w_o = jax.random.normal(keys[6], (2 * kvh * d, HIDDEN)) / (2 * kvh * d) ** 0.5
    manager, slots = manager.admit_or_raise(2)
    slots = jnp.asarray(slots, jnp.int32)

    @jax.jit
    def step(manager, x):
        manager, positions, ok = manager.reserve(slots, 1)
        for layer, schema in enumerate(manager.schemas):
            handle = manager.acquire(layer, slots, positions)
            if schema.kind == AttentionKind.LINEAR:
                pool, y = gated_delta_net.decode_step(gdn[handle.gdn_layer], handle.gdn, handle.gdn_layer, slots, x)
                handle = handle.replace(gdn=pool)
            else:
                handle = handle.write_kv((x @ w_k).reshape(-1, kvh, d), (x @ w_v).reshape(-1, kvh, d))
                y = handle.attend((x @ w_q).reshape(-1, 2 * kvh, d)).reshape(x.shape[0], -1) @ w_o
            x = x + y
            manager = manager.update(handle)
        return manager, x, ok

    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        manager, y, ok = step(manager, jnp.asarray(rng.normal(size=(2, HIDDEN)), jnp.float32))
        assert bool(ok)
    print(f"Qwen3-Next-style: 2 requests x {STEPS} tokens through 3 Gated DeltaNet layers + 1 full layer; "
          f"pages held {int(np.asarray(manager.groups['full'].lens).sum())}; output norm {float(jnp.linalg.norm(y)):.3f}")


def _bytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def memory_per_token():
    context = 131072

    def marginal(config, schedule):
        sizes = [_bytes(jax.eval_shape(lambda n=n: KVCacheManager.create(config, schedule, n,
                                                                         max_context_tokens=context)))
                 for n in (1, 2)]
        return (sizes[1] - sizes[0]) / context  # one more 128k request, per token (state included)

    v4 = marginal(HybridConfig(), deepseek_v4_schedule(v4_flash_like_ratios()))
    v4_full = 43 * 512 * 2  # the same 43 layers keeping a bf16 512-dim K (= V) per token
    qwen = HybridConfig(num_kv_heads=2, kv_head_dim=256, linear_num_k_heads=16, linear_num_v_heads=32,
                        linear_head_k_dim=128, linear_head_v_dim=128)
    q3 = marginal(qwen, qwen3_next_schedule(48))
    q3_full = _bytes(jax.eval_shape(lambda: KVPool.create(num_pages=2, page_size=1, num_layers=48, k_heads=2,
                                                          k_dim=256))) / 2
    print("KV bytes per token of a 128k-token request (per-request state spread over its tokens):")
    print(f"  V4-Flash-like, 43 layers:     {v4:8.0f} B vs full attention {v4_full:6d} B ({v4_full / v4:.1f}x less)")
    print(f"  Qwen3-Next-like, 48 layers:   {q3:8.0f} B vs full attention {q3_full:6.0f} B ({q3_full / q3:.1f}x less)")


if __name__ == "__main__":
    deepseek_v4_style()
    qwen3_next_style()
    memory_per_token()
