"""The typed errors of jaxkv.

Device-side operations never raise: they return an ``ok`` flag and leave their
state unchanged when they fail. The host-facing ``*_or_raise`` methods read
that flag and raise one of these, with the numbers a user needs in the message
(``KV cache OOM: requested 5 blocks, 3 available (of 1023 total)``) and as
attributes, so a scheduler can act on them without parsing text.
"""

from __future__ import annotations

from kernels_pallas.errors import KernelArgumentError

__all__ = [
    "BookkeepingError",
    "CacheLocked",
    "DoubleFree",
    "InvalidArgument",
    "InvalidId",
    "KVCacheError",
    "KVCacheOOM",
    "KernelArgumentError",
]


class KVCacheError(RuntimeError):
    """Base class of every error jaxkv raises on purpose."""


class KVCacheOOM(KVCacheError):
    """An allocation asked for more units (blocks, pages, tokens, slots, rows)
    than are free. Nothing was allocated.

    Attributes: ``requested``, ``available``, ``total``, ``unit`` and
    ``detail`` (what was being done, or "").
    """

    def __init__(self, requested: int, available: int, total: int, unit: str = "blocks", detail: str = ""):
        self.requested = int(requested)
        self.available = int(available)
        self.total = int(total)
        self.unit = unit
        self.detail = detail
        super().__init__(
            f"KV cache OOM: requested {self.requested} {unit}, {self.available} available "
            f"(of {self.total} total)" + (f": {detail}" if detail else "")
        )


class DoubleFree(KVCacheError):
    """A release named an id that is not held (already free), or released one
    id more times than it is held. Nothing was released.

    Attributes: ``ids`` (the offending ids, as a sorted list).
    """

    def __init__(self, message: str, ids=()):
        self.ids = sorted(int(i) for i in ids)
        super().__init__(message)


class InvalidId(KVCacheError, IndexError):
    """An id outside the valid range (including the reserved null entry 0), or
    an id that is not in the state the operation needs (e.g. ``occupy`` of a
    slot that is taken). Nothing changed.

    Attributes: ``ids`` (the offending ids, as a sorted list).
    """

    def __init__(self, message: str, ids=()):
        self.ids = sorted(int(i) for i in ids)
        super().__init__(message)


class InvalidArgument(KVCacheError, KernelArgumentError):
    """A count or shape argument that can never succeed (negative count, a
    count above the static maximum, a token count that is not a whole number of
    pages, a write past the end of a row). Nothing changed.

    Subclasses the kernels' :class:`KernelArgumentError` (itself a
    ``ValueError``), so one ``except`` catches bad arguments of both."""


class CacheLocked(KVCacheError):
    """``reset`` refused because some prefix is still pinned, or (for
    ``PrefixScheduler.reset``) requests are still running.

    Attributes: ``protected_tokens`` (tokens of locked nodes) and
    ``running_requests``.
    """

    def __init__(self, protected_tokens: int, running_requests: int = 0):
        self.protected_tokens = int(protected_tokens)
        self.running_requests = int(running_requests)
        running = f" and {self.running_requests} requests are running" if running_requests else ""
        super().__init__(
            f"reset refused: {self.protected_tokens} cached tokens are pinned by running "
            f"requests or by pin(){running}; finish or release them first"
        )


class BookkeepingError(KVCacheError):
    """jaxkv's own bookkeeping disagrees with itself (e.g. the engine's view of
    a request and the block manager's): a bug in jaxkv, not in the caller's
    input. The message says which record disagreed, with the numbers; please
    report it."""
