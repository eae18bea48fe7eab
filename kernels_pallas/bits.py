"""Cache arrays of 8- and 16-bit floats are stored as raw integer bits.

XLA's CPU backend cannot scatter into a bfloat16, float16 or float8 array
in place: it converts the whole operand to a wider float, scatters, and
converts back, so writing one token's row costs two passes over the pool
(measured: 13x slower per decode write at 16x the pool). A scatter into an
unsigned integer array of the same width is updated in place. So every cache
array of those dtypes (``KVPool`` pages, ``CompressedEntries`` parts, the
Gated DeltaNet conv state) keeps its values as ``uint8`` / ``uint16`` bits
and names its logical dtype; values are bitcast

* on write: only the new rows (:func:`to_bits`), then an integer scatter;
* on read: after the rows are gathered (:func:`from_bits`), so only the rows
  read are converted. A bitcast of a whole pool that feeds a gather is
  fused into it on CPU; on GPU XLA compiles a same-width bitcast-convert to
  a no-op ``bitcast``, so a kernel given ``from_bits(pool)`` reads the
  pool's own buffer (``tests/test_kernels_aot.py`` checks the compiled HLO).

32-bit (and wider) dtypes are stored as they are: their scatters are in
place already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["bits_dtype", "from_bits", "to_bits"]

_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}


def bits_dtype(dtype) -> np.dtype:
    """The storage dtype of logical ``dtype``: the unsigned integer of the same
    width for 8- and 16-bit floats, ``dtype`` itself otherwise."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _UNSIGNED:
        return _UNSIGNED[dtype.itemsize]
    return dtype


def to_bits(x, dtype):
    """``x`` rounded to ``dtype``, as that dtype's storage (:func:`bits_dtype`).
    A ``jax.ShapeDtypeStruct`` (lowering, ``jax.eval_shape``) gives the
    storage's."""
    storage = bits_dtype(dtype)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, storage, sharding=x.sharding)
    x = jnp.asarray(x).astype(dtype)
    return x if storage == x.dtype else lax.bitcast_convert_type(x, storage)


def from_bits(raw, dtype):
    """Stored ``raw`` read as logical ``dtype`` (the inverse of :func:`to_bits`;
    a ``jax.ShapeDtypeStruct`` gives one of ``dtype``)."""
    dtype = jnp.dtype(dtype)
    if isinstance(raw, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(raw.shape, dtype, sharding=raw.sharding)
    return raw if raw.dtype == dtype else lax.bitcast_convert_type(raw, dtype)
