"""The cache of interleaved sliding-window models (gpt-oss, Gemma 3).

Such a model mixes full-attention layers with layers that see only the last
``window`` tokens. :func:`interleaved_cache` builds its
:class:`~jaxkv.KVCacheManager`:

* ``window_cache="ring"`` (the default): full layers on a paged ``full``
  group (blocks as the request grows, shared by prefix hits), window layers
  on a per-request ring of their last ``window`` tokens
  (:class:`~jaxkv.pool.window.WindowLayerCache`). A request holds
  ``window`` tokens per window layer however long it grows, and a prefix
  hit restores the rings from a snapshot (state rows, as Qwen3-Next's Gated
  DeltaNet states).
* ``window_cache="paged"``: every layer on the paged group, window layers
  masking by ``sliding_window`` (one table for all layers: a window layer
  keeps every block). The baseline the ring is measured against
  (``python -m jaxkv.bench hybrid``).

Why a ring and not paged blocks freed outside the window (vLLM's choice):
the ring is exactly ``window`` tokens (a paged window holds up to ``window +
page_size - 1`` plus the page being filled), needs no block table, no
allocation per page and no rule to give blocks back mid-request, and its
state is one row that every existing state path (admission reset, snapshots,
host store, swap) already moves. What it costs: a prefix hit copies the
rings (``window`` tokens per window layer) instead of sharing blocks, and
window attention runs as XLA (a gather of each token's ring), not as the
paged Pallas kernel.

:func:`attend_through_cache` is one attention layer's step through either
layout, so a model's code does not depend on the choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind, HybridConfig, LayerSpec

__all__ = ["WINDOW_CACHES", "attend_through_cache", "interleaved_cache"]

WINDOW_CACHES = ("ring", "paged")


def interleaved_cache(sliding: Sequence[bool], max_requests: int, max_context_tokens: int, *, num_kv_heads: int,
                      head_dim: int, num_query_heads: int, window: int, dtype, entry_format: str = "lossless",
                      num_blocks: dict[str, int] | None = None, kv_bytes: int | None = None, page_size: int = 16,
                      num_snapshots: int = 0, capture_every: int = 0, window_cache: str = "ring"
                      ) -> KVCacheManager:
    """The manager of a model whose layer ``i`` is a sliding-window layer
    where ``sliding[i]`` (see the module docstring for ``window_cache``).

    ``entry_format``: ``"lossless"`` (paged K/V in ``dtype``) or ``"fp8"``
    (float8_e4m3fn pages with per-token scales); window rings are always in
    ``dtype``. ``num_blocks`` / ``kv_bytes`` size the ``full`` group (the
    rings take no blocks), ``num_snapshots`` / ``capture_every`` as in
    :meth:`KVCacheManager.create`."""
    if window_cache not in WINDOW_CACHES:
        raise InvalidArgument(f"window_cache {window_cache!r} is not one of {WINDOW_CACHES}")
    if entry_format not in ("lossless", "fp8"):
        raise InvalidArgument(f"entry format {entry_format!r} is not one of ('lossless', 'fp8')")
    if window < 1:
        raise InvalidArgument(f"sliding window must be >= 1, got {window}")
    if all(sliding) and window_cache == "ring":
        raise InvalidArgument("every layer is a window layer: there is no full-attention layer to page; serve "
                              "such a model with window_cache='paged'")
    ring = AttentionKind.WINDOW if window_cache == "ring" else AttentionKind.FULL
    schedule = [LayerSpec(i, ring if s else AttentionKind.FULL) for i, s in enumerate(sliding)]
    config = HybridConfig(num_kv_heads=num_kv_heads, kv_head_dim=head_dim, page_size=page_size, window=window,
                          kv_dtype=dtype if entry_format == "lossless" else jnp.float8_e4m3fn, window_dtype=dtype,
                          num_query_heads=num_query_heads)
    return KVCacheManager.create(config, schedule, max_requests, max_context_tokens=max_context_tokens,
                                 num_blocks=num_blocks, kv_bytes=kv_bytes, num_snapshots=num_snapshots,
                                 capture_every=capture_every)


def attend_through_cache(handle, q, k, v, *, sm_scale: float, sliding_window: int | None, sinks=None,
                         logit_soft_cap: float | None = None):
    """One attention layer's step: store this step's ``k``/``v`` ``[T, KVH,
    D]`` and attend ``q [T, H, D]`` (each token its request's keys at
    positions ``(p - sliding_window, p]``, or ``[0, p]`` when None), with
    optional per-head ``sinks`` and soft cap. A window layer's ring
    (``AttentionKind.WINDOW``) or the paged pool, whichever the cache gave
    the layer. Returns ``(out [T, H, D], handle)``; put the handle back with
    ``manager.update``."""
    if handle.schema.kind == AttentionKind.WINDOW:
        if sliding_window != handle.schema.window:
            raise InvalidArgument(f"layer {handle.schema.layer_idx}: the cache's ring holds "
                                  f"{handle.schema.window} tokens but the layer attends a window of {sliding_window}")
        return handle.attend_window(q, k, v, sm_scale=sm_scale, sinks=sinks, logit_soft_cap=logit_soft_cap)
    handle = handle.write_kv(k, v)
    out = handle.attend(q, sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                        sinks=sinks)
    return out, handle
