"""Compressed KV entry formats: fp8 NoPE values with block scales + bf16 RoPE.

DeepSeek-V3.2 and DeepSeek-V4 store each cache entry (one compressed token of
the single shared KV head, K == V) as

* ``nope_dim`` NoPE values in ``float8_e4m3fn``, quantized in groups of
  ``group_size`` consecutive values with one scale per group;
* ``rope_dim`` RoPE values in ``bfloat16``, never quantized (RoPE is last in
  the dequantized vector).

Two scale encodings exist (facts from FlashMLA's ``quant.py``):

================  =========  ====  =====  =========================  =======
format            nope+rope  group scale  scale storage              bytes
================  =========  ====  =====  =========================  =======
``DSV4_FP8``      448 + 64   64    ue8m0  uint8 exponent ``e``:      584
                                          scale = ``2 ** (e - 127)``
``DSV32_FP8``     512 + 64   128   fp32   float32 value              656
================  =========  ====  =====  =========================  =======

(584 = 448 fp8 + 128 RoPE bytes + 7 exponents + 1 pad byte; 656 = 512 + 16 +
128.)

Both quantize with a power-of-two scale ``2 ** ceil(log2(max(amax,
1e-4) / 448))`` per group, so ``value / scale`` fits e4m3's range (448) and
dequantization ``fp8 * scale`` is exact. The fp32 encoding dequantizes any
float32 scale, not only powers of two.

jaxkv keeps the three parts in three arrays (structure of arrays) rather than
FlashMLA's packed bytes: the same information and bytes per entry, but every
part is aligned for JAX and for the Pallas kernels (and typed, through the
views below), and :meth:`CompressedEntries.nbytes` counts the packed size so
memory budgets match the peers'.

The 8- and 16-bit parts (fp8 / bf16 NoPE, bf16 RoPE) are stored as raw
integer bits of the same width (``nope_bits``, ``rope_bits``; see
:mod:`kernels_pallas.bits`): XLA's CPU backend converts a whole bf16/fp8
array to a wider float and back for every scatter into it, while it updates
an integer array in place, so a cache write would otherwise cost a pass over
the whole pool. Writers scatter bits (:func:`~kernels_pallas.bits.to_bits` of
the new rows only); readers use the typed views ``nope`` / ``rope`` (a
bitcast: fused into the gather on CPU, a no-op on GPU).

A *lossless* format (:meth:`EntryFormat.lossless`) stores both parts in a
float dtype (float32 or bfloat16) with unit scales: nothing is rounded
beyond that dtype, so a model whose cache uses it computes what the same
model computes without a cache, bit for bit (the parity format). It keeps
the three-array layout, so every gather kernel reads it unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from kernels_pallas._util import ceil_div
from kernels_pallas.bits import bits_dtype, from_bits, to_bits
from kernels_pallas.errors import KernelArgumentError

__all__ = ["DSV32_FP8", "DSV4_FP8", "CompressedEntries", "EntryFormat", "ue8m0_to_float32"]

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_AMAX_FLOOR = 1e-4  # an all-zero group still gets a finite, normal scale


@dataclasses.dataclass(frozen=True)
class EntryFormat:
    """The layout of one compressed entry.

    ``scale_kind`` is ``"ue8m0"`` (one uint8 biased exponent per group) or
    ``"fp32"`` (one float32 per group). ``nope_dim`` must be a multiple of
    ``group_size``. ``storage`` is the dtype of the stored NoPE values:
    ``"float8_e4m3fn"`` (quantized; RoPE in bfloat16, dequantized rows in
    bfloat16) or, for a lossless format, ``"float32"`` / ``"bfloat16"``
    (both parts and the dequantized rows in that dtype, scales always 1).
    """

    name: str
    nope_dim: int
    rope_dim: int
    group_size: int
    scale_kind: str
    storage: str = "float8_e4m3fn"

    def __post_init__(self):
        if self.scale_kind not in ("ue8m0", "fp32"):
            raise KernelArgumentError(f"scale_kind must be 'ue8m0' or 'fp32', got {self.scale_kind!r}")
        if self.group_size < 1 or self.nope_dim < self.group_size or self.nope_dim % self.group_size:
            raise KernelArgumentError(
                f"nope_dim ({self.nope_dim}) must be a positive multiple of group_size ({self.group_size})")
        if self.rope_dim < 0:
            raise KernelArgumentError(f"rope_dim must be >= 0, got {self.rope_dim}")
        if self.storage not in _STORAGES:
            raise KernelArgumentError(f"storage must be one of {_STORAGES}, got {self.storage!r}")

    @classmethod
    def lossless(cls, nope_dim: int, rope_dim: int, dtype="float32") -> "EntryFormat":
        """Entries stored unrounded in ``dtype`` (float32 or bfloat16), with
        unit fp32 scales. The groups are the largest power of two (at most
        128) dividing ``nope_dim``: the scales mean nothing, but the GPU
        kernels move one group per load and Triton loads power-of-two widths."""
        name = jnp.dtype(dtype).name
        group = math.gcd(nope_dim, 128)
        return cls(f"lossless_{name}", nope_dim=nope_dim, rope_dim=rope_dim, group_size=group,
                   scale_kind="fp32", storage=name)

    @property
    def is_lossless(self) -> bool:
        return self.storage != "float8_e4m3fn"

    @property
    def nope_dtype(self):
        return jnp.dtype(self.storage)

    @property
    def out_dtype(self):
        """Dtype of stored RoPE values and of dequantized rows."""
        return jnp.dtype(self.storage) if self.is_lossless else jnp.dtype(jnp.bfloat16)

    @property
    def num_groups(self) -> int:
        return self.nope_dim // self.group_size

    @property
    def head_dim(self) -> int:
        """Width of a dequantized entry: NoPE then RoPE."""
        return self.nope_dim + self.rope_dim

    @property
    def scale_dtype(self):
        return jnp.dtype(jnp.uint8 if self.scale_kind == "ue8m0" else jnp.float32)

    @property
    def unit_scale(self):
        """The stored scale that means 1.0 (exponent 127, or 1.0)."""
        return 127 if self.scale_kind == "ue8m0" else 1.0

    @property
    def bytes_per_entry(self) -> int:
        """Packed size of one entry, as the peers count it (ue8m0 exponents are
        padded to a multiple of 8 bytes: 7 exponents + 1 pad in DSV4)."""
        if self.scale_kind == "ue8m0":
            scale_bytes = ceil_div(self.num_groups, 8) * 8
        else:
            scale_bytes = 4 * self.num_groups
        return self.nope_dim * self.nope_dtype.itemsize + self.rope_dim * self.out_dtype.itemsize + scale_bytes


_STORAGES = ("float8_e4m3fn", "float32", "bfloat16")
DSV4_FP8 = EntryFormat("dsv4_fp8", nope_dim=448, rope_dim=64, group_size=64, scale_kind="ue8m0")
DSV32_FP8 = EntryFormat("dsv32_fp8", nope_dim=512, rope_dim=64, group_size=128, scale_kind="fp32")


def ue8m0_to_float32(exponents: Array) -> Float[Array, "..."]:
    """``2 ** (e - 127)`` for uint8 exponents, exactly, by building the float's
    bits (``e << 23``). ``e = 0`` gives 0.0 (2**-127 is subnormal; quantization
    never produces it: the smallest scale is about 2**-22)."""
    bits = exponents.astype(jnp.int32) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _pow2_scale(amax):
    """``2 ** ceil(log2(max(amax, 1e-4) / 448))`` exactly, with its exponent."""
    raw = jnp.maximum(amax, _AMAX_FLOOR) / FP8_MAX
    mantissa, exponent = jnp.frexp(raw)  # raw = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two stay
    return jnp.ldexp(jnp.float32(1.0), exponent), exponent


def _describe(dtype, shape) -> str:
    return f"{jnp.dtype(dtype).name}{list(shape)}"


@flax.struct.dataclass
class CompressedEntries:
    """Compressed KV entries in a format (a pytree; any leading shape).

    Stored fields (``...`` is any leading shape, e.g. ``[num_pages,
    entries_per_page]`` for a paged pool or ``[num_slots, window]`` for a
    ring buffer):
      nope_bits: ``[..., nope_dim]`` float8_e4m3fn values (lossless formats:
        their dtype) as raw bits, ``bits_dtype(fmt.nope_dtype)`` (uint8 for
        fp8, uint16 for bf16, float32 as is).
      scales: ``[..., num_groups]`` uint8 exponents (ue8m0) or float32 (fp32).
      rope_bits: ``[..., rope_dim]`` bfloat16 values (lossless formats: their
        dtype) as raw bits, ``bits_dtype(fmt.out_dtype)``.
      fmt: the :class:`EntryFormat` (static).

    ``nope`` and ``rope`` are the typed views. Build entries with
    :meth:`quantize`, :meth:`zeros` or, from typed parts, :meth:`from_parts`;
    a writer scatters into the ``*_bits`` fields with
    :func:`~kernels_pallas.bits.to_bits` values.

    Dequantized entry = ``concat(nope * scale per group, rope)`` in
    ``fmt.out_dtype`` (bfloat16 for the fp8 formats).
    """

    nope_bits: Array
    scales: Array
    rope_bits: Array
    fmt: EntryFormat = flax.struct.field(pytree_node=False)

    @classmethod
    def from_parts(cls, nope: Array, scales: Array, rope: Array, fmt: EntryFormat) -> "CompressedEntries":
        """Entries holding typed parts: ``nope`` in ``fmt.nope_dtype``,
        ``scales`` in ``fmt.scale_dtype``, ``rope`` in ``fmt.out_dtype``
        (arrays or ``jax.ShapeDtypeStruct``). Parts of another dtype raise
        :class:`KernelArgumentError` (nothing is rounded silently); shapes
        are checked as by :meth:`check`."""
        parts = {"nope": (nope, fmt.nope_dtype), "rope": (rope, fmt.out_dtype)}
        for name, (arr, dtype) in parts.items():
            if jnp.dtype(arr.dtype) != dtype:
                raise KernelArgumentError(f"{name} must be {dtype.name} for {fmt.name}, "
                                          f"got {_describe(arr.dtype, arr.shape)}")
        if not isinstance(scales, jax.ShapeDtypeStruct):
            scales = jnp.asarray(scales)
        out = cls(nope_bits=to_bits(nope, fmt.nope_dtype), scales=scales,
                  rope_bits=to_bits(rope, fmt.out_dtype), fmt=fmt)
        out.check()
        return out

    @classmethod
    def zeros(cls, fmt: EntryFormat, shape: tuple[int, ...]) -> "CompressedEntries":
        """Entries that all dequantize to 0.0 (scale 1.0), with leading ``shape``
        (all-zero bits are 0.0 in every float format)."""
        shape = tuple(int(s) for s in shape)
        return cls(nope_bits=jnp.zeros(shape + (fmt.nope_dim,), bits_dtype(fmt.nope_dtype)),
                   scales=jnp.full(shape + (fmt.num_groups,), fmt.unit_scale, fmt.scale_dtype),
                   rope_bits=jnp.zeros(shape + (fmt.rope_dim,), bits_dtype(fmt.out_dtype)), fmt=fmt)

    @classmethod
    def quantize(cls, x: Float[Array, "... D"], fmt: EntryFormat) -> "CompressedEntries":
        """Quantize ``x`` (``[..., nope_dim + rope_dim]``, any float dtype) the
        way DeepSeek/FlashMLA do: per group, scale = ``2 ** ceil(log2(max(amax,
        1e-4) / 448))``, value = ``x / scale`` cast to e4m3; RoPE cast to bf16.
        A lossless format only casts both parts to its dtype (scales 1)."""
        if x.shape[-1] != fmt.head_dim:
            raise KernelArgumentError(
                f"{fmt.name} entries have {fmt.nope_dim} + {fmt.rope_dim} = {fmt.head_dim} dims, "
                f"got last dim {x.shape[-1]}")
        lead = x.shape[:-1]
        if fmt.is_lossless:
            return cls.from_parts(x[..., : fmt.nope_dim].astype(fmt.nope_dtype),
                                  jnp.ones(lead + (fmt.num_groups,), jnp.float32),
                                  x[..., fmt.nope_dim:].astype(fmt.out_dtype), fmt)
        groups = x[..., : fmt.nope_dim].astype(jnp.float32).reshape(*lead, fmt.num_groups, fmt.group_size)
        scale, exponent = _pow2_scale(jnp.max(jnp.abs(groups), axis=-1))
        values = jnp.clip(groups / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
        if fmt.scale_kind == "ue8m0":
            scales = (exponent + 127).astype(jnp.uint8)
        else:
            scales = scale
        return cls.from_parts(values.reshape(*lead, fmt.nope_dim), scales,
                              x[..., fmt.nope_dim:].astype(jnp.bfloat16), fmt)

    @property
    def nope(self) -> Array:
        """The NoPE values as ``fmt.nope_dtype`` (a bitcast view of
        :attr:`nope_bits`; read rows of :attr:`nope_bits` and
        :func:`~kernels_pallas.bits.from_bits` them to convert only those)."""
        return from_bits(self.nope_bits, self.fmt.nope_dtype)

    @property
    def rope(self) -> Array:
        """The RoPE values as ``fmt.out_dtype`` (a bitcast view of :attr:`rope_bits`)."""
        return from_bits(self.rope_bits, self.fmt.out_dtype)

    def scale_values(self) -> Float[Array, "... G"]:
        """The per-group scales as float32."""
        if self.fmt.scale_kind == "ue8m0":
            return ue8m0_to_float32(self.scales)
        return self.scales.astype(jnp.float32)

    def dequantize(self) -> Float[Array, "... D"]:
        """``fmt.out_dtype`` ``[..., nope_dim + rope_dim]``: NoPE values times
        their group's scale (in float32, then rounded once to bf16), then
        RoPE. A lossless format returns its stored values."""
        fmt = self.fmt
        lead = self.shape
        if fmt.is_lossless:
            return jnp.concatenate([self.nope, self.rope], axis=-1).astype(fmt.out_dtype)
        groups = self.nope.astype(jnp.float32).reshape(*lead, fmt.num_groups, fmt.group_size)
        nope = (groups * self.scale_values()[..., None]).reshape(*lead, fmt.nope_dim)
        return jnp.concatenate([nope.astype(jnp.bfloat16), self.rope.astype(jnp.bfloat16)], axis=-1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The leading shape (entries)."""
        return tuple(self.nope_bits.shape[:-1])

    def nbytes(self) -> int:
        """Packed bytes of these entries (``bytes_per_entry`` each)."""
        return math.prod(self.shape) * self.fmt.bytes_per_entry

    def check(self, what: str = "entries") -> None:
        """Raise :class:`KernelArgumentError` unless the three stored arrays
        agree with the format and with each other (static shapes and dtypes
        only; messages name the logical dtypes, e.g. ``float8_e4m3fn[...]``)."""
        fmt, lead = self.fmt, self.shape
        expected = {"nope": (self.nope_bits, lead + (fmt.nope_dim,), fmt.nope_dtype),
                    "scales": (self.scales, lead + (fmt.num_groups,), fmt.scale_dtype),
                    "rope": (self.rope_bits, lead + (fmt.rope_dim,), fmt.out_dtype)}
        for name, (arr, shape, dtype) in expected.items():
            storage = bits_dtype(dtype)
            if tuple(arr.shape) != shape or jnp.dtype(arr.dtype) != storage:
                stored = "" if storage == dtype else f" (stored as {storage.name} bits)"
                raise KernelArgumentError(
                    f"{what}.{name} must be {_describe(dtype, shape)}{stored} for {fmt.name}, "
                    f"got {_describe(arr.dtype, arr.shape)}")
