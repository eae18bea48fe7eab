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

from jaxkv._ops import place_kv
from jaxkv.errors import InvalidArgument
from jaxkv.nn.packed import lane_logits
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind, HybridConfig, LayerSpec

__all__ = ["WINDOW_CACHES", "InterleavedWindowModel", "attend_through_cache", "config_cache", "interleaved_cache"]

WINDOW_CACHES = ("ring", "paged")


def interleaved_cache(sliding: Sequence[bool], max_requests: int, max_context_tokens: int, *, num_kv_heads: int,
                      head_dim: int, num_query_heads: int, window: int, dtype, entry_format: str = "lossless",
                      num_blocks: dict[str, int] | None = None, kv_bytes: int | None = None, page_size: int = 16,
                      num_snapshots: int = 0, capture_every: int = 0, window_cache: str = "ring",
                      ring_slack: int = 0) -> KVCacheManager:
    """The manager of a model whose layer ``i`` is a sliding-window layer
    where ``sliding[i]`` (see the module docstring for ``window_cache``).

    ``entry_format``: ``"lossless"`` (paged K/V in ``dtype``) or ``"fp8"``
    (float8_e4m3fn pages with per-token scales); window rings are always in
    ``dtype``. ``num_blocks`` / ``kv_bytes`` size the ``full`` group (the
    rings take no blocks), ``num_snapshots`` / ``capture_every`` as in
    :meth:`KVCacheManager.create`; ``ring_slack``: slots past the window in
    each ring (speculative decoding: :class:`~jaxkv.pool.window.WindowLayerCache`)."""
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
                          num_query_heads=num_query_heads, ring_slack=ring_slack)
    return KVCacheManager.create(config, schedule, max_requests, max_context_tokens=max_context_tokens,
                                 num_blocks=num_blocks, kv_bytes=kv_bytes, num_snapshots=num_snapshots,
                                 capture_every=capture_every)


def attend_through_cache(handle, q, k, v, *, sm_scale: float, sliding_window: int | None, sinks=None,
                         logit_soft_cap: float | None = None, heads=None):
    """One attention layer's step: store this step's ``k``/``v`` ``[T, KVH,
    D]`` and attend ``q [T, H, D]`` (each token its request's keys at
    positions ``(p - sliding_window, p]``, or ``[0, p]`` when None), with
    optional per-head ``sinks`` and soft cap. A window layer's ring
    (``AttentionKind.WINDOW``) or the paged pool, whichever the cache gave
    the layer. Returns ``(out [T, H, D], handle)``; put the handle back with
    ``manager.update``. ``heads``: the layer's head placement on a mesh
    (:meth:`~jaxkv.manager.layer_handle.LayerCacheHandle.attend`)."""
    k, v = place_kv(heads, k, v)
    if handle.schema.kind == AttentionKind.WINDOW:
        if sliding_window != handle.schema.window:
            raise InvalidArgument(f"layer {handle.schema.layer_idx}: the cache's ring holds "
                                  f"{handle.schema.window} tokens but the layer attends a window of {sliding_window}")
        return handle.attend_window(q, k, v, sm_scale=sm_scale, sinks=sinks, logit_soft_cap=logit_soft_cap)
    handle = handle.write_kv(k, v)
    out = handle.attend(q, sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                        sinks=sinks, heads=heads)
    return out, handle


def config_cache(config, max_requests: int, max_context_tokens: int, *, dtype=jnp.float32,
                 entry_format: str = "lossless", num_blocks: dict[str, int] | None = None,
                 kv_bytes: int | None = None, page_size: int = 16, num_snapshots: int = 0, capture_every: int = 0,
                 window_cache: str = "ring", ring_slack: int = 0) -> KVCacheManager:
    """:func:`interleaved_cache` of a model config with ``num_hidden_layers``,
    ``is_sliding(i)``, ``sliding_window``, ``num_key_value_heads``,
    ``head_dim`` and ``num_attention_heads`` (gpt-oss, Gemma 3): the cache
    from the config alone, so sizing a real model builds no weights."""
    c = config
    sliding = [c.is_sliding(i) for i in range(c.num_hidden_layers)]
    window = c.sliding_window if c.sliding_window is not None else max_context_tokens
    return interleaved_cache(sliding, max_requests, max_context_tokens, num_kv_heads=c.num_key_value_heads,
                             head_dim=c.head_dim, num_query_heads=c.num_attention_heads, window=window, dtype=dtype,
                             entry_format=entry_format, num_blocks=num_blocks, kv_bytes=kv_bytes, page_size=page_size,
                             num_snapshots=num_snapshots, capture_every=capture_every, window_cache=window_cache,
                             ring_slack=ring_slack)


class InterleavedWindowModel:
    """The cache side shared by the interleaved window models
    (:class:`~jaxkv.nn.GptOssForCausalLM`, :class:`~jaxkv.nn.Gemma3ForCausalLM`):
    ``make_cache``, the cache check, the cached step ``model(tokens, manager,
    slots, starts, num_new)`` and the packed step. A model provides
    ``config`` (as :func:`config_cache` reads it), ``dtype``,
    ``implementation``, ``layers`` (a :class:`~jaxkv.nn.scan.DecoderStack`
    of layers with ``input_layernorm``, ``self_attn.through_cache(h,
    positions, handle) -> (y, handle)`` and ``finish(x, y)``),
    ``_embed(tokens)`` and ``_logits(x)``."""

    #: The cache contract (:func:`jaxkv.nn.packed.cache_kind`): a hybrid ``KVCacheManager`` (``make_cache``).
    cache_kind = "hybrid"

    def make_cache(self, max_requests: int, max_context_tokens: int, *, entry_format: str = "lossless",
                   num_blocks: dict[str, int] | None = None, kv_bytes: int | None = None, page_size: int = 16,
                   num_snapshots: int = 0, capture_every: int = 0, window_cache: str = "ring",
                   ring_slack: int = 0) -> KVCacheManager:
        """A :class:`~jaxkv.KVCacheManager` for this model: full layers'
        K/V in pages of ``page_size`` (``entry_format`` ``"lossless"``: the
        compute dtype; ``"fp8"``: float8_e4m3fn with per-token scales); the
        sliding layers' K/V in per-request rings of ``sliding_window``
        tokens (``window_cache="ring"``) or paged (``"paged"``);
        ``num_snapshots`` and ``capture_every`` as in ``KVCacheManager.create``;
        ``ring_slack`` slots past the window per ring (speculative decoding
        of that many drafts then rolls the rings back by length alone)."""
        return config_cache(self.config, max_requests, max_context_tokens, dtype=self.dtype,
                            entry_format=entry_format, num_blocks=num_blocks, kv_bytes=kv_bytes, page_size=page_size,
                            num_snapshots=num_snapshots, capture_every=capture_every, window_cache=window_cache,
                            ring_slack=ring_slack)

    def _check_cache(self, manager) -> None:
        """``InvalidArgument`` unless ``manager`` is a cache of this model's
        schedule, heads and window (``model.make_cache`` builds one)."""
        c = self.config
        if not isinstance(manager, KVCacheManager):
            raise InvalidArgument(f"the cache must be a KVCacheManager from model.make_cache, got "
                                  f"{type(manager).__name__}")
        kinds = tuple(s.kind for s in manager.schemas)
        hc = manager.config
        dims, want = (hc.num_kv_heads, hc.kv_head_dim), (c.num_key_value_heads, c.head_dim)
        ok = len(kinds) == c.num_hidden_layers and dims == want and all(
            kind == AttentionKind.FULL or (c.is_sliding(i) and kind == AttentionKind.WINDOW)
            for i, kind in enumerate(kinds))
        if not ok:
            raise InvalidArgument(f"the cache's schedule {[k.value for k in kinds]} / (num_kv_heads, kv_head_dim) "
                                  f"{dims} are not this model's ({c.num_hidden_layers} layers {list(c.layer_types)} / "
                                  f"{want}); build it with model.make_cache")
        if AttentionKind.WINDOW in kinds and hc.window != c.sliding_window:
            raise InvalidArgument(f"the cache's window rings hold {hc.window} tokens but this model's sliding_window "
                                  f"is {c.sliding_window}; build it with model.make_cache")

    def __call__(self, tokens, manager, slots, starts, num_new):
        """One step through the cache: row ``b`` (request slot ``slots[b]``,
        -1 = idle) brings ``tokens[b, :num_new[b]]`` at positions
        ``starts[b] + t``, which ``manager.reserve`` must have reserved.
        Returns ``(logits [B, W, vocab] float32, manager)``."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, w = tokens.shape
        lane = jnp.arange(w, dtype=jnp.int32)[None, :]
        positions = jnp.where(lane < jnp.asarray(num_new)[:, None], jnp.asarray(starts)[:, None] + lane, -1)
        request_ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), w)
        x, manager = self._through_cache(self._embed(tokens), manager, slots, positions, request_ids)
        return self._logits(x), manager

    def forward_packed(self, batch, manager, verify=None, width: int = 1):
        """One packed step (:class:`~jaxkv.nn.packed.PackedBatch`) through the
        cache, lane ``s`` as request slot ``seq_ids[s]`` at its positions,
        which ``manager.reserve(batch.seq_ids, batch.q_lens, ...)`` must have
        reserved; every layer runs over the flat stream of ``T`` tokens.
        Returns ``(logits [S, vocab] float32, manager)``: each lane's last
        token's (finite garbage for a lane with none); with ``verify``
        (speculative verify lanes) ``[S, width, vocab]``
        (:func:`~jaxkv.nn.packed.lane_logits`)."""
        x, manager = self._through_cache(self._embed(batch.token_ids)[None], manager, batch.seq_ids,
                                         batch.positions[None], batch.token_lanes)
        return lane_logits(self._logits, x[0], batch, verify, width), manager

    def _through_cache(self, x, manager, slots, positions, request_ids):
        """Every layer from the embeddings ``x [B, W, hidden]`` at
        ``positions [B, W]`` (-1: padding; flat token ``t`` belongs to
        request row ``request_ids[t]`` of ``slots``). Returns ``(x before
        the final norm, manager)``."""
        self._check_cache(manager)

        def step(layer, i, like, carry):  # i: traced under the layer scan; like: a static layer of its kind
            x, manager = carry
            handle = manager.acquire(i, slots, positions.reshape(-1), request_ids, implementation=self.implementation,
                                     like=like)
            mixed, handle = layer.self_attn.through_cache(layer.input_layernorm(x), positions, handle)
            return layer.finish(x, mixed), manager.update(handle)

        return self.layers.run(step, (x, manager), with_like=True)
