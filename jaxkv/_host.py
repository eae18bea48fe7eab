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


def padded_ids(ids) -> np.ndarray:
    """``ids`` flattened to int32 and padded with -1 to a power-of-two length."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.full(pow2_at_least(flat.size), -1, dtype=np.int32)
    out[: flat.size] = flat
    return out


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
