"""Checked mode: invariant violations reported from inside ``jax.jit``.

Device ops report failure through their ``ok`` flag. That is the right tool
for conditions a scheduler handles (out of blocks: preempt and retry), but a
double free or an out-of-range id inside a long jitted loop is a bug, and the
flag alone does not say which id or where. Wrapping the function with
:func:`checked` turns such violations into the typed error, with the offending
id in the message, raised when the call returns::

    step = jaxkv.checked(my_decode_loop)      # jitted, with jaxkv's checks on
    state = step(state, inputs)               # raises DoubleFree(...) on a double free

Out-of-memory is not a check: it is ordinary control flow, reported by ``ok``.
Outside :func:`checked` the checks cost nothing (they are not traced).

A jitted function that ``checked`` calls into and that was already compiled
without checks keeps its cached, unchecked version; wrap the outermost function.
"""

from __future__ import annotations

import contextvars
import functools
import re

import jax
from jax.experimental import checkify

from jaxkv import errors

__all__ = ["checked", "first_where", "require"]

_CHECKS_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxkv_checks_on", default=False)


def require(ok, error: type[errors.KVCacheError], message: str, *values) -> None:
    """While tracing under :func:`checked`: fail with ``error`` unless ``ok``.

    ``message`` may hold ``{}`` placeholders filled with the traced ``values``.
    A no-op otherwise, so ops can call it unconditionally.
    """
    if _CHECKS_ON.get():
        checkify.check(ok, f"{error.__name__}: {message}", *values)


def first_where(values, mask):
    """The first of ``values`` (flattened) where ``mask``, or -1: the offending
    id to name in a check message. Safe on empty arrays."""
    values = jax.numpy.ravel(values)
    if values.shape[0] == 0:
        return jax.numpy.int32(-1)
    mask = jax.numpy.ravel(mask)
    return jax.numpy.where(jax.numpy.any(mask), values[jax.numpy.argmax(mask)], -1)


def checked(fn, **jit_kwargs):
    """``fn`` jitted with jaxkv's invariant checks; raises the typed
    ``KVCacheError`` subclass named by the first failed check."""

    def with_checks(*args, **kwargs):
        token = _CHECKS_ON.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _CHECKS_ON.reset(token)

    compiled = jax.jit(checkify.checkify(with_checks), **jit_kwargs)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        error, out = compiled(*args, **kwargs)
        message = error.get()
        if message is not None:
            raise _typed_error(message)
        return out

    return run


_ERROR_TYPES = {cls.__name__: cls for cls in (errors.DoubleFree, errors.InvalidId, errors.InvalidArgument)}


def _typed_error(message: str) -> errors.KVCacheError:
    message = message.replace(" (`check` failed)", "")
    match = re.match(r"(\w+): (.*)", message, flags=re.S)
    if match and match.group(1) in _ERROR_TYPES:
        cls = _ERROR_TYPES[match.group(1)]
        ids = [int(x) for x in re.findall(r"\bid (-?\d+)", match.group(2))]
        if cls is errors.InvalidArgument:
            return cls(match.group(2))
        return cls(match.group(2), ids)
    return errors.KVCacheError(message)
