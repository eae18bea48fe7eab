"""The host tier of the hybrid snapshot prefix cache: records that left the
device, whole, kept in host memory (beside
:class:`~jaxkv.prefix.snapshot_cache.SnapshotCache`, as the paged cache's
host tier sits beside its radix tree in :mod:`jaxkv.prefix.block_cache`).

A record is the data a snapshot record and its pages held on the device
(every group's blocks and the state row, read by the cache adapter) under
a host key, with its index entry ``(namespace, tokens, kind, blocks per
group)``. This module keeps the index, the store and the pins; the device
work of storing and loading is the adapter's
(:class:`~jaxkv.serve.hybrid_cache.HybridCache`).

Invariants: every key in the index is in the store and the other way
round; the index is in insertion order (oldest first, the order room is
made in); a pinned key (a hit waiting to be loaded) is never dropped;
``stored_tokens`` / ``loaded_tokens`` only grow.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

from jaxkv.prefix.radix import namespace_key

__all__ = ["SnapshotHostTier"]


class SnapshotHostTier:
    """Host records of a hybrid prefix cache (module docstring), kept in
    ``store``: a :class:`~jaxkv.manager.hybrid_host.HostStore` (the adapter
    makes it: the manager's host code is a layer beside this one)."""

    def __init__(self, store):
        self.store = store
        self._index: dict = {}  # key -> (namespace, tokens, kind, blocks per group), oldest first
        self._pins: collections.Counter = collections.Counter()  # key -> hits waiting to load it
        self._next_key = 0
        self.stored_tokens = 0  # tokens of every record kept here
        self.loaded_tokens = 0  # tokens of every record loaded back to the device

    @property
    def scrub(self) -> bool:
        """Zero a record's host memory when it is dropped (scrub-on-free)."""
        return self.store.scrub

    @scrub.setter
    def scrub(self, value: bool) -> None:
        self.store.scrub = bool(value)

    @property
    def pinned(self) -> bool:
        """Whether a hit waits to load a record."""
        return bool(self._pins)

    def __contains__(self, key) -> bool:
        return key in self._index

    def entry(self, key) -> tuple:
        """``(namespace, tokens, kind, blocks per group)`` of record ``key``."""
        return self._index[key]

    def put(self, namespace: Hashable, tokens: tuple, kind: str, counts: list, data, nbytes: int) -> bool:
        """Keep ``data`` (arrays, ``nbytes`` of them) as a record of
        ``tokens``, dropping the oldest unpinned records until it fits;
        False (nothing kept) when it cannot fit."""
        need = nbytes
        for oldest in [key for key in self._index if not self._pins[key]]:
            if self.store.free_bytes >= need:
                break
            self.discard(oldest)
        if self.store.free_bytes < need:
            return False
        key = self._next_key
        self._next_key += 1
        self.store.put(key, data)
        self._index[key] = (namespace, tuple(tokens), kind, list(counts))
        self.stored_tokens += len(tokens)
        return True

    def candidate(self, tokens: list, namespace, longer_than: int):
        """The key of the longest record that is a prefix of ``tokens`` (at
        most ``len - 1`` of them) longer than ``longer_than`` in
        ``namespace`` (compared as the trees compare namespaces), or None."""
        limit = len(tokens) - 1
        best, best_len = None, longer_than
        wanted = namespace_key(namespace)
        for key, (ns, prefix, _, _) in self._index.items():
            if namespace_key(ns) == wanted and best_len < len(prefix) <= limit and tuple(tokens[: len(prefix)]) == prefix:
                best, best_len = key, len(prefix)
        return best

    def pin(self, key) -> None:
        self._pins[key] += 1

    def unpin(self, key) -> None:
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]

    def is_pinned(self, key) -> bool:
        return bool(self._pins[key])

    def get(self, key):
        """Record ``key``'s data (host arrays, as put)."""
        return self.store.get_host(key)

    def discard(self, key) -> None:
        """Drop record ``key`` (its memory zeroed with ``scrub``)."""
        self.store.discard(key)
        del self._index[key]

    def clear(self) -> None:
        """Drop every record (none may be pinned)."""
        for key in list(self._index):
            self.discard(key)
