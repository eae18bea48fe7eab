"""Prefill and decode on different processes: a prompt's KV computed by a
*prefill* server, moved to a *decode* server with
``jax.experimental.transfer`` (JAX's own transfer server, the one
tpu-inference uses for its disaggregated serving: installed with jaxlib,
device to device where the backend can, over TCP between hosts), and
adopted there into the prefix cache.

``python -m jaxkv.serve --role prefill`` answers ``POST
/v1/jaxkv/prefill`` (``{"prompt": [ids], "namespace": ...}``): its engine
computes the prompt (one token generated and dropped), the prefix cache
keeps it, and :func:`export_prefix` gathers what a later hit of the prompt
would use: a paged pool's whole pages, or a hybrid cache's snapshot record
(every group's blocks: pages, compressed entries; and the state row:
rings, Gated DeltaNet states). The arrays are offered on the transfer
server (:meth:`KVTransfer.offer`) and the answer says where and what:
``{"address", "uuid", "leaves": [[shape, dtype], ...], ...}``.

``python -m jaxkv.serve --role decode --prefill-url URL`` serves the API
(several ``--prefill-url``: :class:`PrefillRouter` picks one per prompt,
the others taking over when it fails). Before a request's prompt reaches
its engine it asks the prefill server for the prompt, pulls the arrays
(:meth:`KVTransfer.pull`) and hands them to its engine thread, which puts
them into the prefix cache's host tier (:func:`import_prefix`:
``PagedCache.import_prefix``, ``HybridCache.import_prefix``); the request
then hits them as any host-tier hit (the pages loaded into fresh device
blocks at admission) and computes
only what the hit leaves: the last token for a hybrid cache (its record
is at the prompt's last token but one), at most a page for a paged pool.
The tokens are those of one engine (a prefix hit is exact: the tests hold
every family to a cold run). A prompt the decode server holds already
(its cache's ``cached_length`` leaves less than a unit to compute) is not
asked for.

Figures: the decode server's ``/metrics`` counts
``jaxkv_kv_transfer_requests_total``, ``jaxkv_kv_transfer_bytes_total``,
``jaxkv_kv_transfer_seconds_total`` (the prefill call and the pull),
``jaxkv_kv_transfer_adopted_tokens_total`` and
``jaxkv_kv_transfer_held_total`` (prompts not asked for).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence

import jax
import numpy as np

from jaxkv.errors import InvalidArgument
from jaxkv.prefix.disk import dtype_named

__all__ = ["KVTransfer", "PrefillRouter", "export_prefix", "import_prefix", "namespace_from_json"]


class KVTransfer:
    """This process's ``jax.experimental.transfer`` server (one per
    process), listening on ``host`` (an ephemeral port)."""

    def __init__(self, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self._connections: dict = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(secrets.randbelow(2**40))  # distinct across restarts of a peer

    @property
    def address(self) -> str:
        return self.server.address()

    def offer(self, leaves: list) -> int:
        """Make ``leaves`` (device arrays) available to one :meth:`pull`;
        returns its id. Empty arrays are not sent (a pull of one never
        completes): :meth:`pull` makes them."""
        uuid = next(self._ids)
        self.server.await_pull(uuid, [leaf for leaf in leaves if leaf.size])
        return uuid

    def pull(self, address: str, uuid: int, specs: list) -> list:
        """The arrays offered as ``uuid`` at ``address`` (``specs``: their
        ``[shape, dtype]``), on this process's first device (empty ones
        made here)."""
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self.server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        like = [jax.ShapeDtypeStruct(tuple(shape), dtype_named(dtype), sharding=sharding) for shape, dtype in specs]
        sent = iter(connection.pull(uuid, [spec for spec in like if np.prod(spec.shape, dtype=np.int64)]))
        return [next(sent) if np.prod(spec.shape, dtype=np.int64) else np.zeros(spec.shape, spec.dtype)
                for spec in like]


class PrefillRouter:
    """A decode server's prefill servers, and the order to ask them for a
    prompt (:meth:`order`), cache-aware as SGLang's router is:

    * the server that was handed the longest prefix of the prompt (whole
      pages, per namespace: :meth:`record` remembers, for each page of each
      prompt handed over, which server computed it, the last
      :attr:`MAX_PAGES` pages) is asked first, its prefix cache likely
      holding it; with none known, the server a stable hash of the
      prompt's first page picks (:meth:`affinity`), so prompts sharing a
      system prompt meet there;
    * unless that server has more than :attr:`SLACK` prompts in flight
      beyond the least busy one's: then the least busy;
    * the others follow, least busy first, for failover.

    ``in_flight`` is kept by the caller (the event loop: no lock)."""

    #: Prompts in flight a server may have beyond the least busy one's before affinity gives way.
    SLACK = 4
    #: Pages remembered (least recently used forgotten first).
    MAX_PAGES = 1 << 16

    def __init__(self, urls: Sequence[str]):
        urls = [str(url).rstrip("/") for url in urls]
        if not urls or len(set(urls)) != len(urls) or not all(urls):
            raise InvalidArgument(f"the prefill servers must be distinct, non-empty URLs, got {urls}")
        self.urls = tuple(urls)
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._holder: OrderedDict[bytes, str] = OrderedDict()  # a page's chained key -> the server given it

    @staticmethod
    def _pages(prompt: Sequence[int], namespace, unit: int) -> list[bytes]:
        """The chained keys of ``prompt``'s whole pages in ``namespace``."""
        unit = max(int(unit), 1)
        key = hashlib.blake2b(json.dumps(namespace, default=str).encode(), digest_size=16).digest()
        keys = []
        for start in range(0, len(prompt) - unit + 1, unit):
            key = hashlib.blake2b(key + np.asarray(prompt[start:start + unit], np.int64).tobytes(),
                                  digest_size=16).digest()
            keys.append(key)
        return keys

    def affinity(self, prompt: Sequence[int], namespace, unit: int) -> str:
        """The server for prompts beginning with ``prompt``'s first ``unit``
        tokens in ``namespace`` (a stable hash: the same in every run)."""
        head = json.dumps([namespace, [int(t) for t in prompt[:max(int(unit), 1)]]], default=str)
        digest = hashlib.blake2b(head.encode(), digest_size=8).digest()
        return self.urls[int.from_bytes(digest, "little") % len(self.urls)]

    def holder(self, prompt: Sequence[int], namespace, unit: int) -> str | None:
        """The server handed the longest prefix of ``prompt`` (whole pages),
        or None."""
        for key in reversed(self._pages(prompt, namespace, unit)):
            url = self._holder.get(key)
            if url is not None:
                return url
        return None

    def record(self, prompt: Sequence[int], namespace, unit: int, url: str) -> None:
        """``url`` computed ``prompt``: its pages are that server's now."""
        for key in self._pages(prompt, namespace, unit):
            self._holder[key] = url
            self._holder.move_to_end(key)
        while len(self._holder) > self.MAX_PAGES:
            self._holder.popitem(last=False)

    def order(self, prompt: Sequence[int], namespace, unit: int) -> list[str]:
        """Every server once: the one to ask first, then the others in the
        order to fall back to (class docstring)."""
        def load(url):
            return self.in_flight[url], self.urls.index(url)

        first = self.holder(prompt, namespace, unit) or self.affinity(prompt, namespace, unit)
        least = min(self.urls, key=load)
        if self.in_flight[first] > self.in_flight[least] + self.SLACK:
            first = least
        return [first, *sorted((url for url in self.urls if url != first), key=load)]


def namespace_from_json(value):
    """A namespace sent as JSON (lists) as the server makes it (tuples)."""
    if isinstance(value, list):
        return tuple(namespace_from_json(v) for v in value)
    return value


def export_prefix(engine, tokens, namespace, transfer: KVTransfer) -> dict | None:
    """On the prefill engine's thread: offer what the prefix cache holds of
    ``tokens`` (module docstring) and say what it is; None when it holds
    nothing."""
    cache = engine.cache
    exported = cache.export_prefix(tokens, namespace)
    if exported is None:
        return None
    if hasattr(cache, "snapshots"):  # a hybrid cache's record
        prefix, kind, counts, data = exported
        meta = {"cache": "hybrid", "prefix": [int(t) for t in prefix], "kind": kind, "counts": counts}
    else:
        num_tokens, data = exported
        meta = {"cache": "paged", "num_tokens": int(num_tokens)}
    leaves = jax.tree.leaves(data)
    meta["leaves"] = [[list(leaf.shape), str(leaf.dtype)] for leaf in leaves]
    meta["bytes"] = int(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves))
    meta["uuid"] = transfer.offer(leaves)
    meta["address"] = transfer.address
    return meta


def import_prefix(engine, tokens, namespace, meta: dict, leaves: list) -> int:
    """On the decode engine's thread: put the pulled ``leaves`` (what
    ``meta`` says) into the prefix cache's host tier; returns the tokens
    taken in."""
    cache = engine.cache
    host = [np.asarray(leaf) for leaf in jax.device_get(leaves)]
    if meta["cache"] == "hybrid":
        return cache.import_prefix(meta["prefix"], namespace, meta["kind"], meta["counts"],
                                   cache.record_as(meta["counts"], host))
    structure = jax.tree.structure(cache.pool)
    for leaf, mine in zip(host, jax.tree.leaves(cache.pool)):
        if leaf.dtype != mine.dtype or leaf.shape[:2] + leaf.shape[3:] != mine.shape[:2] + mine.shape[3:]:
            raise InvalidArgument(f"the prefill server's pages are {leaf.shape} {leaf.dtype}; this pool's "
                                  f"{mine.shape} {mine.dtype} (another model or pool layout)")
    return cache.import_prefix(tokens, namespace, int(meta["num_tokens"]), jax.tree.unflatten(structure, host))

