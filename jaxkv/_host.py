"""Helpers shared by the host-facing ``*_or_raise`` paths.

The host paths call a jitted device op, read its ``ok`` flag (one device to
host transfer) and raise a typed error built from the state as it was before
the call; that is exact because a failed op leaves its state unchanged.
Argument arrays are padded to power-of-two lengths so that a host loop with
varying counts reuses a handful of compiled programs instead of one per count.
"""

from __future__ import annotations

import numpy as np


def pow2_at_least(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


_INT32_MAX = np.iinfo(np.int32).max


def padded_ids(ids) -> np.ndarray:
    """``ids`` flattened to int32 and padded with -1 to a power-of-two length.

    Values that int32 cannot hold are mapped to ids that are invalid for every
    structure (``INT32_MAX``, or -2 below -1) instead of wrapping around onto a
    real id: the device op then fails and the host path names the original id.
    """
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    flat = np.where(flat > _INT32_MAX, _INT32_MAX, np.where(flat < -1, -2, flat))
    out = np.full(pow2_at_least(flat.size), -1, dtype=np.int32)
    out[: flat.size] = flat
    return out


def count_or_raise(n, capacity: int, available, unit: str) -> int:
    """``n`` as an int, or the error a request for ``n`` units must raise
    before any device call: negative counts, and counts above the capacity
    (which would otherwise compile a program sized for ``n`` just to fail).
    ``available`` is a callable, read only on that failure path."""
    from jaxkv.errors import InvalidArgument, KVCacheOOM

    n = int(n)
    if n < 0:
        raise InvalidArgument(f"cannot allocate a negative number of {unit} ({n})")
    if n > capacity:
        raise KVCacheOOM(n, int(available()), capacity, unit=unit)
    return n


def given_ids(ids) -> np.ndarray:
    """The entries of ``ids`` that are not the -1 padding, as int64."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    return flat[flat != -1]


def preview(values, limit: int = 8) -> str:
    """A short printable list, so error messages stay readable for big inputs."""
    values = [int(v) for v in values]
    head = ", ".join(str(v) for v in values[:limit])
    more = f", ... ({len(values)} in all)" if len(values) > limit else ""
    return f"[{head}{more}]"
