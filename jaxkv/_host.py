"""Helpers shared by the host-facing ``*_or_raise`` paths.

Error explainers follow one style across jaxkv: a public method
``<op>_error(args) -> KVCacheError | None`` on the state, None when ``op``
would succeed on it, else the typed error with the message shaped
``"<op>: <what> (<numbers>)"``. A host path raises
``state.<op>_error(args) or unexplained(op, args)``: the second only when
the device refused what the host check accepts, a jaxkv bug.

The host paths call a jitted device op, read its ``ok`` flag (one device to
host transfer) and raise a typed error built from the state as it was before
the call; that is exact because a failed op leaves its state unchanged.
Argument arrays are padded to power-of-two lengths so that a host loop with
varying counts reuses a handful of compiled programs instead of one per count.
"""

from __future__ import annotations

import numbers

import numpy as np


from jaxkv._ops import INT32_MAX as _INT32_MAX, pow2_at_least  # noqa: F401 - pow2_at_least re-exported
from jaxkv.errors import BookkeepingError, InvalidArgument, KVCacheOOM

__all__ = [
    "as_int32_ids",
    "count_or_raise",
    "given_ids",
    "int_array",
    "int_scalar",
    "padded_ids",
    "plain_ints",
    "pow2_at_least",
    "preview",
    "refuse_repeats",
    "unexplained",
]


def padded_ids(ids, name: str = "ids") -> np.ndarray:
    """``ids`` flattened to int32 and padded with -1 to a power-of-two length.

    Values that int32 cannot hold are mapped to ids that are invalid for every
    structure (``INT32_MAX``, or -2 below -1) instead of wrapping around onto a
    real id: the device op then fails and the host path names the original id.
    """
    flat = as_int32_ids(int_array(ids, name).reshape(-1))
    out = np.full(pow2_at_least(flat.size), -1, dtype=np.int32)
    out[: flat.size] = flat
    return out


def as_int32_ids(ids: np.ndarray) -> np.ndarray:
    """Checked integer ids as int32 for a device op: values int32 cannot
    hold become ``INT32_MAX`` (or -2 below -1), ids no structure has, never
    a real id they would wrap onto."""
    return np.clip(ids, -2, _INT32_MAX).astype(np.int32)


_INT64_MAX = np.iinfo(np.int64).max


def int_array(values, name: str, *, ndim: int | None = None) -> np.ndarray:
    """``values`` as an int64 numpy array, or ``InvalidArgument`` naming ``name``.

    The one gate of every host path for ids, positions and counts. Accepted:
    Python ints, numpy and JAX integer scalars and arrays, and (nested) lists
    or tuples of them; an empty list is an empty id list. Refused, with the
    offending value in the message: bools (``True`` is not block 1), floats
    (even ``2.0``: a float id is a bug upstream, not a rounding question),
    numeric strings, ``None``, NaN, and integers int64 cannot hold.
    ``ndim`` (when given) is the number of dimensions the argument must have.
    """
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, huge ints
        raise InvalidArgument(f"{name} must be integers; got {short_repr(values)} ({exc})") from None
    if isinstance(values, (list, tuple)) and arr.dtype.kind in "iu" and _holds_bool(values):
        raise InvalidArgument(f"{name} must be integers, not bools: {short_repr(values)}")
    if arr.dtype == object:  # Python ints past int64, None, mixed objects
        if all(_is_int(v) for v in arr.reshape(-1)):
            raise InvalidArgument(f"{name} holds integers outside int64: {short_repr(values)}")
        raise InvalidArgument(f"{name} must be integers; got {short_repr(values)}")
    if arr.size == 0 and arr.dtype.kind == "f":  # [] and np.array([]) default to float
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(
            f"{name} must be integers, got dtype {arr.dtype}: {short_repr(values)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise InvalidArgument(f"{name} holds integers outside int64: {short_repr(values)}")
    if ndim is not None and arr.ndim != ndim:
        raise InvalidArgument(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    return arr.astype(np.int64)


def int_scalar(value, name: str) -> int:
    """``value`` as a Python int, refusing what :func:`int_array` refuses and
    anything that is not a single value."""
    arr = int_array(value, name)
    if arr.ndim != 0:
        raise InvalidArgument(f"{name} must be one integer, got shape {arr.shape}")
    return int(arr)


def plain_ints(values) -> bool:
    """Whether ``values`` is a list or tuple of Python ints only (no bool,
    numpy scalar or other object): the host paths' common case, which they
    check without a numpy conversion (one pass over the element types)."""
    return isinstance(values, (list, tuple)) and set(map(type, values)) <= {int}


def _holds_bool(values) -> bool:
    """Whether a (nested) list mixes bools into integers (numpy casts
    ``[True, 1]`` to ``[1, 1]`` without a word). One pass over the element
    types, so a long token list costs microseconds."""
    types = set(map(type, values))
    if types <= {int}:
        return False
    if types & {bool, np.bool_}:
        return True
    return any(_holds_bool(v) for v in values if isinstance(v, (list, tuple)))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error message
    (an integer too long for ``repr``, past Python's 4,300-digit limit, is
    named by its size; an object whose ``repr`` fails, by its type)."""
    try:
        text = repr(value)
    except ValueError:  # int too long to print: the message must not fail in its turn
        text = (f"<an integer of {value.bit_length()} bits>" if isinstance(value, int)
                else f"<{type(value).__name__} too long to print>")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def count_or_raise(n, capacity: int, available, unit: str) -> int:
    """``n`` as an int, or the error a request for ``n`` units must raise
    before any device call: negative counts, and counts above the capacity
    (which would otherwise compile a program sized for ``n`` just to fail).
    ``available`` is a callable, read only on that failure path."""
    n = int_scalar(n, f"number of {unit}")
    if n < 0:
        raise InvalidArgument(f"cannot allocate a negative number of {unit} ({n})")
    if n > capacity:
        raise KVCacheOOM(n, int(available()), capacity, unit=unit)
    return n


def refuse_repeats(ids: np.ndarray, name: str) -> None:
    """``InvalidArgument`` when an id other than -1 appears twice in ``ids``
    (targets of one write: which value would win is unspecified)."""
    unique, counts = np.unique(ids[ids != -1], return_counts=True)
    if (counts > 1).any():
        raise InvalidArgument(f"{name} names {preview(unique[counts > 1])} more than once in one write "
                              "(which value would win is unspecified)")


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


def unexplained(op: str, ids) -> Exception:
    """The ``BookkeepingError`` of a host path whose device op failed while
    the host explainer found nothing wrong (the two disagree: a jaxkv bug)."""
    return BookkeepingError(f"{op}: the device op refused {preview(given_ids(ids))} "
                            "but the host check finds nothing wrong")


def int_at_least(value, name: str, minimum: int) -> int:
    """``value`` as an int, or ``InvalidArgument`` naming ``name`` when it is
    not an integer (see :func:`int_scalar`) or is below ``minimum``."""
    value = int_scalar(value, name)
    if value < minimum:
        raise InvalidArgument(f"{name}={value}: must be >= {minimum}")
    return value
