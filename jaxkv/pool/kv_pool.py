"""KVPool: paged per-layer K/V storage (seed 002's KVPool, paged).

Layout, per layer, is that of JAX's Pallas GPU paged attention, so one
layer's pages go to a kernel with no transpose or copy::

    k_pages  [num_layers, k_heads, num_pages, page_size, k_dim]
    v_pages  [num_layers, v_heads, num_pages, page_size, v_dim]   (None in MLA mode)
    k_scales [num_layers, k_heads, num_pages, page_size] float32  (fp8 storage only)
    v_scales [num_layers, v_heads, num_pages, page_size] float32  (fp8 storage only)

Token index ``t`` lives at page ``t // page_size``, offset ``t % page_size``
(the index space of :class:`~jaxkv.alloc.token.TokenToKVPoolAllocator`).

Invariants:

* page 0 is the null page: never allocated; every padded or invalid write
  lands there (-1 and any index outside the buffer are redirected to it), so a
  write can never touch another request's page; its contents are garbage that
  readers must mask;
* K and V may have different head counts and head dims (MHA, GQA, MQA);
  MLA mode stores one latent of ``kv_lora_rank + rope_dim`` per token in K
  (one head) and no V: the value is the first ``kv_lora_rank`` dims;
* fp8 storage (float8_e4m3fn, float8_e5m2) keeps one float32 scale per token
  per head: ``stored = x / scale`` rounded to fp8 with
  ``scale = max(|x|) / fp8_max`` over the finite entries of the head dim, and
  ``x ~= stored.astype(float32) * scale``. Non-finite entries never cost the
  row its finite values: ``±inf`` saturates to ``±fp8_max`` (it reads back
  as ± the row's largest finite magnitude, ``±fp8_max`` if it has none) and
  NaN stays NaN, for e4m3 and e5m2 alike;
* page ids (``copy_pages``/``read_pages``/``write_pages``) are -1 (skip) or
  in ``[0, num_pages)``; host (concrete) ids outside that raise ``InvalidId``
  and repeated targets raise ``InvalidArgument``; traced ids outside it skip
  their pair (read: the null page) and the call returns ``ok=False``.
  Repeated traced targets of one write keep one of the values, which one
  is unspecified (XLA scatter order);
* writes are in place when the pool is donated into the jitted step
  (``jax.jit(step, donate_argnums=...)``); no method copies a whole pool.
  For that, bfloat16 / float16 / fp8 pages are stored as raw integer bits
  of the same width (``k_bits``, ``v_bits``; :mod:`kernels_pallas.bits`):
  XLA's CPU backend converts a whole bf16/fp8 array for every scatter into
  it, an integer one it updates in place. ``k_pages`` / ``v_pages`` are the
  typed views (a bitcast: fused into the gather that reads them on CPU, a
  no-op on GPU; outside ``jit`` they make a typed copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import _host
from jaxkv._ops import FP8_DTYPES, is_fp8  # noqa: F401 - is_fp8 re-exported (jaxkv.pool.kv_pool.is_fp8)
from jaxkv.alloc.token import TokenToKVPoolAllocator
from jaxkv.errors import InvalidArgument, InvalidId
from jaxkv.types import Array, Float32, Ids, Int, Ok, Shaped
from kernels_pallas.bits import bits_dtype, from_bits, to_bits

#: Storage dtypes a pool can hold.
STORAGE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)) + FP8_DTYPES


def quantize_fp8(x: Array, dtype) -> tuple[Array, Array]:
    """Per-row fp8 quantization over the last axis: ``(stored, scale)`` with
    ``x ~= stored.astype(float32) * scale[..., None]``; an all-zero row gets
    scale 1 (stored zeros). The scale comes from the row's finite entries;
    ``±inf`` saturates to ``±fp8_max`` and NaN stays NaN (module docstring)."""
    x = x.astype(jnp.float32)
    fp8_max = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=-1)
    scale = jnp.where(amax > 0, amax / fp8_max, 1.0).astype(jnp.float32)
    stored = jnp.clip(x / scale[..., None], -fp8_max, fp8_max).astype(dtype)
    return stored, scale


def dequantize(stored: Array, scale: Array | None, dtype=jnp.float32) -> Array:
    """Inverse of :func:`quantize_fp8` (or a plain cast when ``scale`` is None)."""
    if scale is None:
        return stored.astype(dtype)
    return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)


@struct.dataclass
class KVPool:
    """Paged K/V pages of every layer; see the module docstring for layout.

    Fields:
        k_bits: ``[num_layers, k_heads, num_pages, page_size, k_dim]``, the
            K pages in ``dtype``'s storage (``bits_dtype(dtype)``: uint16 for
            bf16/f16, uint8 for fp8, float32 as is); read them as
            :attr:`k_pages`.
        v_bits: ``[num_layers, v_heads, num_pages, page_size, v_dim]``,
            likewise (:attr:`v_pages`); None in MLA mode.
        k_scales / v_scales: float32 ``[num_layers, heads, num_pages,
            page_size]``, one scale per token per head; None unless ``dtype``
            is fp8.
        kv_lora_rank: static; MLA latent width (0: not MLA).
        storage: static; the name of the logical ``dtype`` of the pages.

    Build pools with :meth:`create`, :meth:`create_mla` or, from typed
    arrays, :meth:`from_arrays`.
    """

    k_bits: Shaped[Array, "layers k_heads pages page_size k_dim"]
    v_bits: Shaped[Array, "layers v_heads pages page_size v_dim"] | None
    k_scales: Float32[Array, "layers k_heads pages page_size"] | None
    v_scales: Float32[Array, "layers v_heads pages page_size"] | None
    kv_lora_rank: int = struct.field(pytree_node=False, default=0)
    storage: str = struct.field(pytree_node=False, default="float32")

    # ------------------------------------------------------------------ creation

    @classmethod
    def create(
        cls,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        k_heads: int,
        k_dim: int,
        v_heads: int | None = None,
        v_dim: int | None = None,
        dtype=jnp.bfloat16,
    ) -> "KVPool":
        """A zero-filled pool of ``num_pages`` pages (page 0 the null page, so
        ``num_pages - 1`` are usable). ``v_heads``/``v_dim`` default to K's."""
        v_heads = k_heads if v_heads is None else v_heads
        v_dim = k_dim if v_dim is None else v_dim
        dtype = _storage_dtype(dtype)
        _require_positive(num_pages=num_pages - 1, page_size=page_size, num_layers=num_layers,
                          k_heads=k_heads, k_dim=k_dim, v_heads=v_heads, v_dim=v_dim)
        k_bits, k_scales = _zeros(num_layers, k_heads, num_pages, page_size, k_dim, dtype)
        v_bits, v_scales = _zeros(num_layers, v_heads, num_pages, page_size, v_dim, dtype)
        return cls(k_bits=k_bits, v_bits=v_bits, k_scales=k_scales, v_scales=v_scales, storage=dtype.name)

    @classmethod
    def create_mla(
        cls, *, num_pages: int, page_size: int, num_layers: int, kv_lora_rank: int, rope_dim: int,
        dtype=jnp.bfloat16,
    ) -> "KVPool":
        """MLA mode: one latent of ``kv_lora_rank + rope_dim`` per token, no V."""
        dtype = _storage_dtype(dtype)
        _require_positive(num_pages=num_pages - 1, page_size=page_size, num_layers=num_layers,
                          kv_lora_rank=kv_lora_rank)
        if rope_dim < 0:
            raise InvalidArgument(f"rope_dim={rope_dim} must be >= 0")
        k_bits, k_scales = _zeros(num_layers, 1, num_pages, page_size, kv_lora_rank + rope_dim, dtype)
        return cls(k_bits=k_bits, v_bits=None, k_scales=k_scales, v_scales=None, kv_lora_rank=kv_lora_rank,
                   storage=dtype.name)

    @classmethod
    def from_arrays(cls, k_pages: Array, v_pages: Array | None, k_scales: Array | None = None,
                    v_scales: Array | None = None, *, kv_lora_rank: int = 0) -> "KVPool":
        """A pool holding typed ``k_pages`` / ``v_pages`` (``[layers, heads,
        pages, page_size, dim]``, one storage dtype; ``v_pages`` None in MLA
        mode) and their scales (fp8 only), stored as bits."""
        k_pages = jnp.asarray(k_pages)
        dtype = _storage_dtype(k_pages.dtype)
        if v_pages is not None and jnp.dtype(v_pages.dtype) != dtype:
            raise InvalidArgument(f"k_pages are {dtype.name} but v_pages {jnp.dtype(v_pages.dtype).name}: "
                                  "a pool has one storage dtype")
        if is_fp8(dtype) != (k_scales is not None) or (v_pages is not None and is_fp8(dtype) != (v_scales is not None)):
            raise InvalidArgument(f"{dtype.name} pages {'need' if is_fp8(dtype) else 'take no'} scales")
        return cls(k_bits=to_bits(k_pages, dtype), v_bits=None if v_pages is None else to_bits(v_pages, dtype),
                   k_scales=k_scales, v_scales=v_scales, kv_lora_rank=kv_lora_rank, storage=dtype.name)

    # ---------------------------------------------------------------- properties

    @property
    def k_pages(self) -> Shaped[Array, "layers k_heads pages page_size k_dim"]:
        """The K pages as ``dtype`` (a bitcast view of :attr:`k_bits`)."""
        return from_bits(self.k_bits, self.dtype)

    @property
    def v_pages(self) -> Shaped[Array, "layers v_heads pages page_size v_dim"] | None:
        """The V pages as ``dtype``; None in MLA mode."""
        return None if self.v_bits is None else from_bits(self.v_bits, self.dtype)

    @property
    def num_layers(self) -> int:
        return self.k_bits.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k_bits.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_bits.shape[3]

    @property
    def k_heads(self) -> int:
        return self.k_bits.shape[1]

    @property
    def k_dim(self) -> int:
        return self.k_bits.shape[4]

    @property
    def is_mla(self) -> bool:
        return self.v_bits is None

    @property
    def v_heads(self) -> int:
        return self.k_heads if self.is_mla else self.v_bits.shape[1]

    @property
    def v_dim(self) -> int:
        return self.kv_lora_rank if self.is_mla else self.v_bits.shape[4]

    @property
    def dtype(self) -> jnp.dtype:
        """The storage dtype the pages hold (bf16, f16, f32 or fp8)."""
        return jnp.dtype(self.storage)

    @property
    def buffer_size(self) -> int:
        """Token rows including the null page (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    @property
    def size(self) -> int:
        """Usable token rows (``buffer_size`` minus the null page)."""
        return (self.num_pages - 1) * self.page_size

    def memory_bytes(self) -> int:
        """Bytes of every array the pool owns (pages and scales)."""
        return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(self))

    def mem_bytes(self) -> int:
        """Deprecated alias of :meth:`memory_bytes` (the library's one name for sizes)."""
        return self.memory_bytes()

    # ------------------------------------------------------------------ writes

    def set_kv(self, layer: int | Int[Array, ""], indices: Ids, k: Array, v: Array | None = None) -> "KVPool":
        """Write K (and V) of the tokens at ``indices`` into ``layer``.

        ``k`` may have any leading shape whose size equals ``indices.size``,
        followed by ``[k_heads, k_dim]`` or ``[k_heads * k_dim]`` (seed 002's
        rule); likewise ``v``. In MLA mode pass the latent as ``k`` and no
        ``v``. fp8 pools quantize here. Index -1 (padding) and any index
        outside the buffer write to the null page, never to another page.
        Concrete (host) indices outside ``[-1, buffer_size)`` or a concrete
        ``layer`` outside ``[0, num_layers)`` raise ``InvalidId``; a repeated
        concrete index, or a shape mismatch, raises ``InvalidArgument``. A
        traced layer out of range writes nothing, and traced repeated indices
        keep one of their rows (which one is unspecified).
        """
        layer = self._check_layer(layer)
        flat = self._check_indices(indices, distinct=True)
        k = self._rows(k, flat.shape[0], self.k_heads, self.k_dim, "k")
        if self.is_mla:
            if v is not None:
                raise InvalidArgument("an MLA pool stores one latent per token: pass it as k and no v")
            k_bits, k_scales = _write(self.k_bits, self.k_scales, self.dtype, layer, flat, k, self.page_size)
            return self.replace(k_bits=k_bits, k_scales=k_scales)
        if v is None:
            raise InvalidArgument("set_kv needs v (only an MLA pool takes k alone)")
        v = self._rows(v, flat.shape[0], self.v_heads, self.v_dim, "v")
        k_bits, k_scales = _write(self.k_bits, self.k_scales, self.dtype, layer, flat, k, self.page_size)
        v_bits, v_scales = _write(self.v_bits, self.v_scales, self.dtype, layer, flat, v, self.page_size)
        return self.replace(k_bits=k_bits, k_scales=k_scales, v_bits=v_bits, v_scales=v_scales)

    # ------------------------------------------------------------------- reads

    def get_kv(
        self, layer: int | Int[Array, ""], indices: Ids, dtype=jnp.float32
    ) -> tuple[Array, Array]:
        """Dequantized ``(k [n, k_heads, k_dim], v [n, v_heads, v_dim])`` of the
        tokens at ``indices`` (flattened); in MLA mode ``v`` is the first
        ``kv_lora_rank`` dims of the latent. -1 reads the null page (garbage:
        mask it). A traced ``layer`` out of range reads NaN (never another
        layer's data)."""
        layer = self._check_layer(layer)
        flat = self._check_indices(indices)
        k = _read(self.k_bits, self.k_scales, self.dtype, layer, flat, self.page_size, dtype)
        if self.is_mla:
            return k, k[..., : self.kv_lora_rank]
        return k, _read(self.v_bits, self.v_scales, self.dtype, layer, flat, self.page_size, dtype)

    def layer_arrays(self, layer: int | Int[Array, ""]) -> tuple[Array, Array | None, Array | None, Array | None]:
        """``(k_pages, v_pages, k_scales, v_scales)`` of one layer, each
        ``[heads, num_pages, page_size, ...]``: the arguments of a paged
        attention kernel. A traced ``layer`` (a model's layer scan) is
        clamped into range (a slice of the stacked arrays; kernels that can
        should take the whole pool and the layer instead, which reads it in
        place)."""
        layer = self._check_layer(layer)
        pick = lambda a: None if a is None else a[layer]  # noqa: E731
        typed = lambda a: None if a is None else from_bits(a[layer], self.dtype)  # noqa: E731
        return typed(self.k_bits), typed(self.v_bits), pick(self.k_scales), pick(self.v_scales)

    # ------------------------------------------------------------ page copies

    def copy_pages(self, src_pages: Ids, dst_pages: Ids) -> tuple["KVPool", Ok]:
        """``page dst[i] <- page src[i]`` in every layer, K, V and scales
        (copy-on-write, defragmentation). Pairs with a -1 on either side are
        skipped; all sources are read before any destination is written.
        Returns ``(pool, ok)``; see the module docstring for invalid ids."""
        src, src_ok = self._check_pages(src_pages, "src_pages")
        dst, dst_ok = self._check_pages(dst_pages, "dst_pages", distinct=True)
        if src.shape != dst.shape:
            raise InvalidArgument(f"copy_pages: {src.shape[0]} sources but {dst.shape[0]} destinations")
        skip = (src == -1) | (dst == -1) | ~src_ok | ~dst_ok
        src = jnp.where(skip, 0, src)
        dst = jnp.where(skip, self.num_pages, dst)  # out of bounds: dropped
        pool = jax.tree_util.tree_map(lambda a: a.at[:, :, dst].set(a[:, :, src], mode="drop"), self)
        return pool, jnp.all(src_ok & dst_ok)

    def read_pages(self, pages: Ids) -> tuple["KVPool", Ok]:
        """A small pool-shaped pytree holding just ``pages`` (every layer, K, V
        and scales), e.g. to swap them to host memory, and ``ok``. -1 (and a
        traced invalid id) reads the null page."""
        pages, ok = self._check_pages(pages, "pages")
        pages = jnp.where((pages == -1) | ~ok, 0, pages)
        return jax.tree_util.tree_map(lambda a: a[:, :, pages], self), jnp.all(ok)

    def write_pages(self, pages: Ids, data: "KVPool") -> tuple["KVPool", Ok]:
        """Inverse of :meth:`read_pages`: ``page pages[i] <- data page i``;
        -1 entries (and traced invalid ids) are skipped. Returns ``(pool, ok)``."""
        pages, ok = self._check_pages(pages, "pages", distinct=True)
        if data.num_pages != pages.shape[0]:
            raise InvalidArgument(f"write_pages: {pages.shape[0]} pages but data holds {data.num_pages}")
        target = jnp.where((pages == -1) | ~ok, self.num_pages, pages)
        pool = jax.tree_util.tree_map(lambda a, d: a.at[:, :, target].set(d, mode="drop"), self, data)
        return pool, jnp.all(ok)

    # --------------------------------------------------------------- internals

    def _check_layer(self, layer):
        """A concrete layer as a checked Python int; a traced one as is."""
        if isinstance(layer, jax.core.Tracer):
            return layer
        layer = _host.int_scalar(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise InvalidId(f"layer {layer} outside [0, {self.num_layers})", [layer])
        return layer

    def _check_pages(self, pages, name: str, *, distinct: bool = False) -> tuple[Array, Array]:
        """Flat int32 page ids and, per id, whether it is -1 or a page."""
        flat = _flat_ids(pages, name, self.num_pages, "(-1 skips a pair)", distinct)
        return flat, (flat >= -1) & (flat < self.num_pages)

    def _check_indices(self, indices, *, distinct: bool = False) -> Array:
        flat = _flat_ids(indices, "token indices", self.buffer_size,
                         f"({self.num_pages} pages of {self.page_size}; -1 is padding)", distinct)
        # Anything that is not a real row goes to the null page, never elsewhere.
        return jnp.where((flat >= 0) & (flat < self.buffer_size), flat, 0)

    def _rows(self, x: Array, n: int, heads: int, dim: int, name: str) -> Array:
        x = jnp.asarray(x)
        if x.size != n * heads * dim:
            raise InvalidArgument(
                f"{name} has shape {tuple(x.shape)} ({x.size} values) but {n} indices need "
                f"{n} x {heads} heads x {dim} dims = {n * heads * dim}"
            )
        return x.reshape(n, heads, dim)


def _flat_ids(ids, name: str, upper: int, note: str, distinct: bool) -> Array:
    """``ids`` flattened to int32. Concrete ids are checked on the host first:
    ``InvalidId`` outside ``[-1, upper)``, and with ``distinct``
    ``InvalidArgument`` for a target named twice (which write would win is
    unspecified). Traced ids pass as they are; the callers mask them."""
    if not isinstance(ids, jax.core.Tracer):
        host = _host.int_array(ids, name).reshape(-1)
        bad = np.unique(host[(host < -1) | (host >= upper)])
        if bad.size:
            raise InvalidId(f"{name} {_host.preview(bad)} outside [0, {upper}) {note}", bad)
        if distinct:
            _host.refuse_repeats(host, name)
        ids = host.astype(np.int32)
    return jnp.asarray(ids, jnp.int32).reshape(-1)


def _storage_dtype(dtype) -> jnp.dtype:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:  # a name numpy does not know ("bogus"): the same answer as a dtype the pool cannot store
        names = ", ".join(d.name for d in STORAGE_DTYPES)
        raise InvalidArgument(f"a KV pool cannot store {dtype!r}: not a dtype; choose one of {names}") from None
    if dtype not in STORAGE_DTYPES:
        names = ", ".join(d.name for d in STORAGE_DTYPES)
        raise InvalidArgument(f"a KV pool cannot store {dtype.name}; choose one of {names}")
    return dtype


def _require_positive(**sizes: int) -> None:
    bad = {name: value for name, value in sizes.items() if value < 1}
    if bad:
        raise InvalidArgument(f"sizes must be >= 1 (num_pages counts the null page too): {bad}")


def _zeros(layers, heads, pages, page_size, dim, dtype):
    shape = (layers, heads, pages, page_size, dim)
    scales = jnp.ones(shape[:-1], jnp.float32) if is_fp8(dtype) else None
    return jnp.zeros(shape, bits_dtype(dtype)), scales  # 0.0 is all-zero bits in every storage dtype


def _write(bits, scales, storage, layer, flat, rows, page_size):
    """Store ``rows [n, heads, dim]`` at token rows ``flat`` of ``layer`` of
    pages ``bits`` holding ``storage`` values (an integer scatter when
    ``storage`` is narrower than 32 bits: in place on every backend)."""
    page, offset = flat // page_size, flat % page_size
    if scales is None:
        return bits.at[layer, :, page, offset].set(to_bits(rows, storage)), None
    stored, scale = quantize_fp8(rows, storage)
    return (bits.at[layer, :, page, offset].set(to_bits(stored, storage)),
            scales.at[layer, :, page, offset].set(scale))


def _read(bits, scales, storage, layer, flat, page_size, dtype):
    page, offset = flat // page_size, flat % page_size
    if isinstance(layer, int):  # checked on the host
        stored = from_bits(bits[layer, :, page, offset], storage)  # [n, heads, dim]
        return dequantize(stored, None if scales is None else scales[layer, :, page, offset], dtype)
    # A traced layer out of range reads NaN, not the clamped last layer: the
    # gather fills the layer's rows with NaN's bits, so it reads them as the
    # storage dtype.
    nan_bits = np.asarray(np.nan, storage).view(bits_dtype(storage)).item()
    stored = from_bits(bits.at[layer, :, page, offset].get(mode="fill", fill_value=nan_bits), storage)
    stored_scales = None if scales is None else scales.at[layer, :, page, offset].get(mode="fill",
                                                                                      fill_value=jnp.nan)
    return dequantize(stored, stored_scales, dtype)


def make_full_attention_net_mem_pool(
    size: int,
    layer_num: int,
    k_head_num: int,
    k_head_dim: int,
    v_head_num: int | None = None,
    v_head_dim: int | None = None,
    dtype=jnp.bfloat16,
    page_size: int = 1,
    need_sort: bool = True,
) -> tuple[KVPool, TokenToKVPoolAllocator]:
    """Seed 002's factory: a :class:`KVPool` of ``size`` usable tokens (plus the
    null page) and the :class:`TokenToKVPoolAllocator` handing out its rows."""
    allocator = TokenToKVPoolAllocator.create(size, page_size=page_size, need_sort=need_sort)
    pool = KVPool.create(
        num_pages=allocator.pages.num_blocks,
        page_size=page_size,
        num_layers=layer_num,
        k_heads=k_head_num,
        k_dim=k_head_dim,
        v_heads=v_head_num,
        v_dim=v_head_dim,
        dtype=dtype,
    )
    assert pool.buffer_size == allocator.buffer_size
    return pool, allocator


__all__ = ["KVPool", "make_full_attention_net_mem_pool", "quantize_fp8", "dequantize", "is_fp8"]
