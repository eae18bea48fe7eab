"""Rows of ``python -m jaxkv.bench hybrid`` for the interleaved sliding-window
families (gpt-oss, Gemma 3): KV memory per request at real sizes, window
rings against one table for all layers, from ``jax.eval_shape`` of the
caches :func:`jaxkv.nn.window_cache.interleaved_cache` builds (nothing is
allocated).

Shapes are the published configurations (``config.json`` of each
checkpoint): gpt-oss-20b 24 layers and gpt-oss-120b 36 layers, both 64 query
/ 8 KV heads of 64 dims, every other layer a window of 128; Gemma 3 4B 34
layers of 8 / 4 heads of 256 dims and Gemma 3 27B 62 layers of 32 / 16 heads
of 128 dims, five window layers of 1024 to one global. bf16 K/V.

A request's bytes are ``bytes(cache of 2 requests) - bytes(cache of 1)`` at
the same context (its blocks, table rows and rings); ``ratio`` is ring /
paged (target for gpt-oss at 32k: <= 0.55).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.nn.window_cache import interleaved_cache

__all__ = ["FAMILIES", "Family", "memory_rows"]

CONTEXTS = (8192, 32768, 131072)
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    sliding: tuple[bool, ...]
    heads: int
    kv_heads: int
    head_dim: int
    window: int


def _every_other(layers: int) -> tuple[bool, ...]:
    return tuple(i % 2 == 0 for i in range(layers))  # gpt-oss: layer 0 is a window layer


def _five_to_one(layers: int) -> tuple[bool, ...]:
    return tuple((i + 1) % 6 != 0 for i in range(layers))  # Gemma 3: every sixth layer is global


FAMILIES = (
    Family("gpt-oss-20b", _every_other(24), 64, 8, 64, 128),
    Family("gpt-oss-120b", _every_other(36), 64, 8, 64, 128),
    Family("Gemma 3 4B", _five_to_one(34), 8, 4, 256, 1024),
    Family("Gemma 3 27B", _five_to_one(62), 32, 16, 128, 1024),
)


def _bytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def request_bytes(family: Family, context: int, window_cache: str) -> int:
    """Bytes one more request of ``context`` tokens adds to the cache."""
    def build(n):
        return jax.eval_shape(lambda: interleaved_cache(
            family.sliding, n, context, num_kv_heads=family.kv_heads, head_dim=family.head_dim,
            num_query_heads=family.heads, window=family.window, dtype=jnp.bfloat16, window_cache=window_cache))
    return _bytes(build(2)) - _bytes(build(1))


def freed_window_bytes(family: Family, context: int, ring: int, page_size: int = 16) -> int:
    """Computed, not built: bytes of the request if the window layers kept
    paged blocks and gave back those wholly outside the window (vLLM's
    sliding-window group): at worst ``ceil(W / ps) + 1`` pages per window
    layer (the window straddles one more page than it fills) instead of the
    ring's ``W`` tokens."""
    token = 2 * family.kv_heads * family.head_dim * jnp.dtype(jnp.bfloat16).itemsize
    pages = -(-family.window // page_size) + 1
    return ring + sum(family.sliding) * (pages * page_size - family.window) * token


def memory_rows(budget_gib: float = 64.0) -> list[dict]:
    """Per family and context: bytes per request with window rings and with
    one table for all layers, their ratio, and requests per budget; beside
    them the computed bytes of window layers on pages freed outside the
    window (:func:`freed_window_bytes`)."""
    rows = []
    for family in FAMILIES:
        for context in CONTEXTS:
            ring, paged = (request_bytes(family, context, w) for w in ("ring", "paged"))
            freed = freed_window_bytes(family, context, ring)
            rows.append({"model": family.name, "context": context,
                         "window_layers": f"{sum(family.sliding)}/{len(family.sliding)}",
                         "ring_bytes_per_request": ring, "paged_bytes_per_request": paged,
                         "ring_bytes_per_token": ring / context, "paged_bytes_per_token": paged / context,
                         "ratio": ring / paged, "freed_pages_bytes_per_request": freed,
                         "ring_requests": int(budget_gib * GIB // ring), "paged_requests": int(budget_gib * GIB // paged)})
    return rows
