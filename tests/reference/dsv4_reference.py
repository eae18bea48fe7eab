"""A small DeepSeek-V4-style attention layer in plain ``jnp``, over the hybrid cache.

One layer of one of DeepSeek-V4's three kinds (see
:mod:`jaxkv.manager.hybrid_schema`): ``swa`` (sliding window only), ``csa``
(window + the top-k compressed entries an indexer picks) or ``hca`` (window
+ every compressed entry). Tiny and float32, for tests: the cached decode
(:func:`decode_step`, through a :class:`~jaxkv.manager.layer_handle.LayerCacheHandle`)
is checked against the recomputation of the whole sequence from scratch
(:func:`forward_full`, no cache).

For a token ``x`` at position ``p`` (``D = entry_format.head_dim``, NoPE
dims then RoPE dims; one shared KV head, K == V):

1. ``q = rope(x @ wq)`` (``H`` heads of ``D``), ``kv = rope(x @ wkv)``
   (``D``), RoPE = GPT-J interleaved pairs on the last ``rope_dim`` dims,
   at position ``p``. ``kv`` goes to the SWA ring.
2. CSA/HCA: the compressor's per-token ``kv_c = rope(x @ w_ckv)`` (each of
   the ``overlap`` channel blocks of ``D`` roped on its last ``rope_dim``)
   and ``score_c = x @ w_cscore + c_ape[p % r]`` (a learned bias per
   position inside the ``r``-token window, V4's ``ape``), both
   ``overlap * D`` wide. Entry ``i`` pools positions ``[(i + 1) r -
   overlap r, (i + 1) r)``: the row of window ``k`` uses channel block
   ``k``; per channel, softmax over rows of the score, weighted sum of the
   kv; positions < 0 excluded (the rule of :func:`jaxkv.manager.dsv4_compressor.compress_step`). A token
   at ``t`` sees entries ``i < (t + 1) // r``.
3. CSA: the indexer, the same with ``index_dim`` (keys ``x @ w_ikv`` pooled
   with ``x @ w_iscore + i_ape[p % r]``, RoPE on the last
   ``min(rope_dim, index_dim // 2)`` dims) and one query head
   ``iq = rope(x @ w_iq)``; index score ``iq . key``; the ``index_topk``
   best visible entries are attended (-1 where fewer are visible).
4. Attention: every query head attends the window rows ``(p - W, p]`` and
   the chosen compressed rows, softmax scale ``1 / sqrt(D)``, values = the
   same rows; then ``y = o @ wo``.

The cache stores SWA tokens and entries in the schema's fp8 format and the
indexer keys in its fp8 indexer format. ``forward_full(quantize=True)``
applies the same round trip (:meth:`CompressedEntries.quantize` then
``dequantize``) to those three; ``quantize=False`` rounds nothing.

Exact arithmetic, so that both paths store the same bits. Rounding to fp8
(or bf16) amplifies a last-bit difference of its float32 input into a whole
fp8 step, and XLA does not compute the same float32 bits for the same
expression in every program (it contracts ``a * b - c * d`` into an FMA in
some fusions and not in others, and sums in shape-dependent orders). So the
projections and RoPE are made exact, whatever the program:

* weights and inputs (:func:`to_grid`) are multiples of ``2**-8`` in
  ``(-2, 2)``; with ``hidden <= 32`` every product is a multiple of
  ``2**-16`` and every projection (scores with their APE too) fits
  float32's 24 bits: exact in any summation order;
* the weight columns that feed RoPE dims are coarser, multiples of
  ``2**-4`` in ``(-1, 1)`` (values: multiples of ``2**-12`` below 64), and
  the RoPE table is rounded to multiples of ``2**-5``: ``x0 * cos - x1 *
  sin`` is then a multiple of ``2**-17`` below 128, exact with or without
  FMA (a slightly non-orthogonal rotation, which changes nothing here).

What stays inexact is the compressor's softmax pooling (computed by the
cache in :func:`jaxkv.manager.dsv4_compressor.compress_step`, by :func:`forward_full` here), so a pooled
entry value can still differ in its last bit between the two and, rarely,
round to the neighbouring fp8 or bf16 value (see the tolerance of
``tests/test_hybrid_equivalence.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid_schema import AttentionKind, LayerCacheSchema
from kernels_pallas.formats import CompressedEntries

__all__ = ["DSV4Params", "decode_step", "forward_full", "forward_step", "init_params", "prefill", "to_grid"]

_GRID = 2.0**-8
_F32 = jnp.float32


def to_grid(x) -> np.ndarray:
    """``x`` rounded to float32 multiples of ``2**-8`` in ``(-2, 2)``, zeros
    moved to ``2**-8`` (see the module docstring)."""
    g = np.clip(np.round(np.asarray(x, np.float64) / _GRID), -511, 511)
    g = np.where(g == 0, 1, g)
    return (g * _GRID).astype(np.float32)


@struct.dataclass
class DSV4Params:
    """Weights of one layer (float32; None where the kind has no such part).

    Fields:
      wq: ``[hidden, H * D]``; wkv: ``[hidden, D]``; wo: ``[H * D, hidden]``.
      w_ckv, w_cscore: ``[hidden, overlap * D]``; c_ape: ``[r, overlap * D]``.
      w_ikv, w_iscore: ``[hidden, overlap * Di]``; i_ape: ``[r, overlap * Di]``;
        w_iq: ``[hidden, Di]`` (CSA).
      rope_cos, rope_sin: ``[max_len, rope_dim // 2]``; irope_cos, irope_sin:
        the indexer's (CSA).
      schema, num_heads, max_len: static.
    """

    wq: Array
    wkv: Array
    wo: Array
    rope_cos: Array
    rope_sin: Array
    w_ckv: Array | None = None
    w_cscore: Array | None = None
    c_ape: Array | None = None
    w_ikv: Array | None = None
    w_iscore: Array | None = None
    i_ape: Array | None = None
    w_iq: Array | None = None
    irope_cos: Array | None = None
    irope_sin: Array | None = None
    schema: LayerCacheSchema = struct.field(pytree_node=False, default=None)
    num_heads: int = struct.field(pytree_node=False, default=1)
    max_len: int = struct.field(pytree_node=False, default=0)

    @property
    def head_dim(self) -> int:
        return self.schema.entry_format.head_dim

    @property
    def kind(self) -> AttentionKind:
        return self.schema.kind

    @property
    def max_entries(self) -> int:
        """Compressed entries a sequence of ``max_len`` tokens completes."""
        return self.max_len // self.schema.compress_ratio if self.schema.compress_ratio else 0


def _coarse(x, step) -> np.ndarray:
    """``x`` rounded to float32 multiples of ``step`` in ``(-1, 1)``."""
    limit = 1.0 / step - 1
    return (np.clip(np.round(np.asarray(x, np.float64) / step), -limit, limit) * step).astype(np.float32)


def _rope_table(rope_dim: int, max_len: int, theta: float):
    """GPT-J RoPE ``(cos, sin)`` ``[max_len, rope_dim // 2]``, rounded to
    multiples of ``2**-5`` (host float64 angles; see the module docstring)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (jnp.asarray(np.round(np.cos(angles) * 32) / 32, _F32),
            jnp.asarray(np.round(np.sin(angles) * 32) / 32, _F32))


def _rope_columns(width: int, block: int, rope_dim: int) -> np.ndarray:
    """Which of ``width`` columns (blocks of ``block``) are RoPE dims (the
    last ``rope_dim`` of each block)."""
    return (np.arange(width) % block) >= block - rope_dim


def init_params(key, hidden: int, num_heads: int, schema: LayerCacheSchema, *, max_len: int,
                rope_theta: float = 10000.0) -> DSV4Params:
    """Random weights for one ``swa``/``csa``/``hca`` layer of ``schema``
    (from :func:`~jaxkv.manager.hybrid_schema.build_schemas` or
    ``KVCacheManager.schemas``). ``max_len``: longest sequence (RoPE table;
    ``max_len // ratio`` entries are gathered per step). Projections ~
    N(0, 1/fan_in), APE ~ N(0, 1), rounded to the ``2**-8`` grid (columns
    that feed RoPE dims: ``2**-4``); drawn on the host by a numpy generator
    seeded with ``key``'s data. ``hidden <= 32`` (exact arithmetic, see the
    module docstring)."""
    kind = AttentionKind(schema.kind)
    if kind not in (AttentionKind.SWA, AttentionKind.CSA, AttentionKind.HCA):
        raise InvalidArgument(f"dsv4_reference handles swa/csa/hca layers, got {kind.value}")
    if hidden > 32:
        raise InvalidArgument(f"hidden={hidden}: exact projections need hidden <= 32")
    d = schema.entry_format.head_dim
    rope_dim = schema.entry_format.rope_dim
    if rope_dim % 2:
        raise InvalidArgument(f"rope_dim must be even, got {rope_dim}")
    shapes = {"wq": (hidden, num_heads * d), "wkv": (hidden, d), "wo": (num_heads * d, hidden)}
    if kind != AttentionKind.SWA:
        r, width = schema.compress_ratio, schema.compressor_width
        shapes.update(w_ckv=(hidden, width), w_cscore=(hidden, width), c_ape=(r, width))
    if kind == AttentionKind.CSA:
        di, iwidth = schema.index_format.head_dim, schema.index_compressor_width
        shapes.update(w_ikv=(hidden, iwidth), w_iscore=(hidden, iwidth), i_ape=(schema.compress_ratio, iwidth),
                      w_iq=(hidden, di))
    total = sum(math.prod(s) for s in shapes.values())
    # Host draws seeded by the key: no device program to compile per layer shape.
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    flat = np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist()).standard_normal(total)
    fan_in = {"wo": num_heads * d}
    rope_cols = {"wq": (d, rope_dim), "wkv": (d, rope_dim), "w_ckv": (d, rope_dim)}
    if kind == AttentionKind.CSA:
        rope_cols.update(w_iq=(di, _index_rope_dim(schema)), w_ikv=(di, _index_rope_dim(schema)))
    weights, offset = {}, 0
    for name, shape in shapes.items():
        draw = flat[offset:offset + math.prod(shape)].reshape(shape)
        offset += math.prod(shape)
        draw = draw * (1.0 if name.endswith("ape") else 1.0 / math.sqrt(fan_in.get(name, hidden)))
        w = to_grid(draw)
        if name in rope_cols:
            cols = _rope_columns(shape[1], *rope_cols[name])
            w[:, cols] = _coarse(draw[:, cols], 2.0**-4)
        weights[name] = jnp.asarray(w)
    cos, sin = _rope_table(rope_dim, max_len, rope_theta)
    extra = {}
    if kind == AttentionKind.CSA:
        extra["irope_cos"], extra["irope_sin"] = _rope_table(_index_rope_dim(schema), max_len, rope_theta)
    return DSV4Params(rope_cos=cos, rope_sin=sin, schema=schema, num_heads=num_heads, max_len=max_len,
                      **weights, **extra)


def _index_rope_dim(schema: LayerCacheSchema) -> int:
    di = schema.index_format.head_dim
    return min(schema.entry_format.rope_dim, di // 2) // 2 * 2


# --------------------------------------------------------------------------
# Pieces shared by both paths (the model, not the cache).
# --------------------------------------------------------------------------


def _rope(x, cos, sin):
    """GPT-J interleaved RoPE on the last ``2 * cos.shape[-1]`` dims of ``x``;
    ``cos``/``sin`` broadcast against ``x[..., :half]``."""
    rd = 2 * cos.shape[-1]
    if rd == 0:
        return x
    n = x.shape[-1]
    head, tail = x[..., : n - rd], x[..., n - rd:]
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    tail = jnp.stack([r0, r1], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, tail], axis=-1)


def _project(p: DSV4Params, x, positions):
    """Per-token projections at ``positions`` (``[T]``; negative = padding)."""
    x = x.astype(_F32)
    t = x.shape[0]
    pos = jnp.clip(positions, 0, p.max_len - 1)
    cos, sin = p.rope_cos[pos], p.rope_sin[pos]  # [T, rope/2]
    d, h = p.head_dim, p.num_heads
    out = {"q": _rope((x @ p.wq).reshape(t, h, d), cos[:, None], sin[:, None]),
           "kv": _rope(x @ p.wkv, cos, sin)}
    s = p.schema
    if p.kind != AttentionKind.SWA:
        o, r = s.overlap, s.compress_ratio
        out["ckv"] = _rope((x @ p.w_ckv).reshape(t, o, d), cos[:, None], sin[:, None]).reshape(t, o * d)
        out["cscore"] = x @ p.w_cscore + p.c_ape[pos % r]
    if p.kind == AttentionKind.CSA:
        o, r, di = s.overlap, s.compress_ratio, s.index_format.head_dim
        icos, isin = p.irope_cos[pos], p.irope_sin[pos]
        out["iq"] = _rope(x @ p.w_iq, icos, isin)
        out["ikv"] = _rope((x @ p.w_ikv).reshape(t, o, di), icos[:, None], isin[:, None]).reshape(t, o * di)
        out["iscore"] = x @ p.w_iscore + p.i_ape[pos % r]
    return out


def _topk(scores, valid, k: int):
    """The ``k`` best valid entries per row, -1 where fewer are valid."""
    masked = jnp.where(valid, scores, -jnp.inf)
    values, idx = jax.lax.top_k(masked, k)
    return jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)


def _masked_softmax(logits, mask):
    """Softmax over the last axis restricted to ``mask``; all-masked rows give zeros."""
    logits = jnp.where(mask, logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(mask, jnp.exp(logits - top), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def _round_trip(x, fmt, quantize: bool):
    """``x`` as the cache stores and returns it (fp8 NoPE, bf16 RoPE) if ``quantize``."""
    if not quantize:
        return x
    return CompressedEntries.quantize(x, fmt).dequantize().astype(_F32)


def _output(p: DSV4Params, o):
    return o.reshape(o.shape[0], -1) @ p.wo


# --------------------------------------------------------------------------
# Cached decode.
# --------------------------------------------------------------------------


def forward_step(p: DSV4Params, handle, x: Array, *, return_aux: bool = False):
    """This step's tokens (``handle.positions``, ``handle.request_ids``),
    through the cache: one token per request (decode) or a chunk of
    consecutive positions per request (prefill).

    Reads each token's window (``gather_swa(kv)``: earlier steps from the
    ring, this step's tokens from their own values rounded through the entry
    format), writes the tokens' SWA entries (and compressor rows, CSA indexer
    rows), reads the compressed entries back from the cache, attends.

    Returns ``(handle, y [T, hidden])``, plus ``aux`` (``{"topk": [T, k]}``
    for CSA, else ``{}``) when ``return_aux``. Padding tokens (slot -1)
    write nothing and output garbage (finite).
    """
    s = p.schema
    if handle.schema.kind != s.kind or handle.schema.compress_ratio != s.compress_ratio:
        raise InvalidArgument(f"params are for a {s.kind.value}{s.compress_ratio or ''} layer, the handle's "
                              f"layer is {handle.schema.kind.value}{handle.schema.compress_ratio or ''}")
    if x.shape[0] != handle.positions.shape[0]:
        raise InvalidArgument(f"{x.shape[0]} rows of x but {handle.positions.shape[0]} positions")
    proj = _project(p, x, handle.positions)
    # The window before writing: earlier steps' rows from the ring, this
    # step's rows from its own values (exact for chunks longer than W too).
    keys, valid = handle.gather_swa(proj["kv"])
    handle = handle.write_swa(proj["kv"])
    rows, masks, aux = [keys.astype(_F32)], [valid], {}
    if p.kind != AttentionKind.SWA:
        handle = handle.compress(proj["ckv"], proj["cscore"])
    if p.kind == AttentionKind.CSA:
        handle = handle.compress_index(proj["ikv"], proj["iscore"])
        ikeys, ivalid = handle.index_keys(p.max_entries)
        scores = jnp.einsum("td,tnd->tn", proj["iq"], ikeys.astype(_F32))
        idx = _topk(scores, ivalid, s.index_topk)
        comp, cvalid = handle.gather_compressed(idx)
        rows.append(comp.astype(_F32))
        masks.append(cvalid)
        aux["topk"] = idx
    elif p.kind == AttentionKind.HCA:
        comp, cvalid = handle.gather_all_compressed(p.max_entries)
        rows.append(comp.astype(_F32))
        masks.append(cvalid)
    keys, mask = jnp.concatenate(rows, axis=1), jnp.concatenate(masks, axis=1)
    logits = jnp.einsum("thd,tnd->thn", proj["q"], keys) / math.sqrt(p.head_dim)
    weights = _masked_softmax(logits, mask[:, None, :])
    y = _output(p, jnp.einsum("thn,tnd->thd", weights, keys))
    return (handle, y, aux) if return_aux else (handle, y)


def decode_step(p: DSV4Params, handle, x: Array, *, return_aux: bool = False):
    """One token per request at ``handle.positions`` (:func:`forward_step`)."""
    if handle.positions.shape != handle.request_slots.shape:
        raise InvalidArgument("decode_step takes one token per request; use prefill for chunks")
    return forward_step(p, handle, x, return_aux=return_aux)


def prefill(p: DSV4Params, handle, x: Array, *, return_aux: bool = False):
    """A chunk of consecutive positions per request (:func:`forward_step`;
    the handle's ``request_ids`` say which request each token is)."""
    return forward_step(p, handle, x, return_aux=return_aux)


# --------------------------------------------------------------------------
# No-cache recomputation.
# --------------------------------------------------------------------------


def _pool(kv, score, ratio: int, overlap: int, num_entries: int):
    """Entries ``0 .. num_entries - 1`` from per-token compressor rows
    ``[T, overlap * d]`` (the rule of :func:`jaxkv.manager.dsv4_compressor.compress_step`)."""
    t, width = kv.shape
    d, rows = width // overlap, overlap * ratio
    i = jnp.arange(num_entries, dtype=jnp.int32)[:, None]
    j = jnp.arange(rows, dtype=jnp.int32)[None, :]
    q = (i + 1) * ratio - rows + j  # [E, rows] source positions
    block = jnp.broadcast_to(j // ratio, q.shape)  # window k of the overlap -> channel block k
    qc = jnp.clip(q, 0, t - 1)
    kv_rows = kv.reshape(t, overlap, d)[qc, block]  # [E, rows, d]
    score_rows = jnp.where((q >= 0)[..., None], score.reshape(t, overlap, d)[qc, block], -jnp.inf)
    weights = jax.nn.softmax(score_rows, axis=1)
    return jnp.sum(weights * kv_rows, axis=1)


def forward_full(p: DSV4Params, x: Array, *, quantize: bool, return_aux: bool = False):
    """The whole sequence ``x`` (positions ``0 .. T-1``) from scratch, no cache.

    Token ``t`` attends tokens ``(t - W, t]`` and its compressed entries
    (``i < (t + 1) // r``: all of them for HCA, the indexer's top-k for CSA).
    ``quantize``: round SWA tokens, entries and indexer keys through the
    cache's fp8 formats. Returns ``y [T, hidden]``, plus ``aux``
    (``{"topk": [T, k]}`` for CSA) when ``return_aux``. Jittable
    (``quantize`` and ``return_aux`` static).
    """
    s = p.schema
    t = x.shape[0]
    if t > p.max_len:
        raise InvalidArgument(f"{t} tokens but max_len={p.max_len}")
    positions = jnp.arange(t, dtype=jnp.int32)
    proj = _project(p, x, positions)
    keys = [_round_trip(proj["kv"], s.entry_format, quantize)]
    masks = [(positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - s.window)]
    aux = {}
    if p.kind != AttentionKind.SWA:
        r, o = s.compress_ratio, s.overlap
        num = t // r
        entries = _round_trip(_pool(proj["ckv"], proj["cscore"], r, o, num), s.entry_format, quantize)
        visible = jnp.arange(num, dtype=jnp.int32)[None, :] < ((positions + 1) // r)[:, None]  # [T, E]
        if p.kind == AttentionKind.CSA:
            ikeys = _round_trip(_pool(proj["ikv"], proj["iscore"], r, o, num), s.index_format, quantize)
            scores = jnp.einsum("td,nd->tn", proj["iq"], ikeys)
            k = min(s.index_topk, num) if num else 0
            idx = _topk(scores, visible, k) if k else jnp.zeros((t, 0), jnp.int32)
            chosen = jnp.any(idx[:, :, None] == jnp.arange(num)[None, None, :], axis=1)
            visible = visible & chosen
            pad = s.index_topk - idx.shape[1]
            aux["topk"] = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        keys.append(entries)
        masks.append(visible)
    keys, mask = jnp.concatenate(keys, axis=0), jnp.concatenate(masks, axis=1)
    logits = jnp.einsum("thd,nd->thn", proj["q"], keys) / math.sqrt(p.head_dim)
    weights = _masked_softmax(logits, mask[:, None, :])
    y = _output(p, jnp.einsum("thn,nd->thd", weights, keys))
    return (y, aux) if return_aux else y
