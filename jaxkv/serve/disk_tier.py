"""The prefix cache's disk tier on a paged pool (``--kv-disk-dir``): pages
written through to a :class:`~jaxkv.prefix.disk.DiskStore`, read back into
the host tier when a prompt runs past what the tree holds.

**Write-through.** Every page the prefix cache takes (a prompt's pages at
the end of its prefill, a finished request's at retirement) is queued for
the disk unless its record is there already: one jitted gather of the new
pages per insert, fetched and written on the store's thread. So a server
that stops, or dies, leaves on disk every page it had cached, bar the last
writes in flight (LMCache's and SGLang HiCache's write-through policy;
writing only what the host tier evicts would lose every page still on the
device or the host at a crash, which is the case a disk tier exists for).

**Read-back.** :meth:`PagedDiskTier.extend` runs before the tree's
``match``: the prompt's pages past the cached prefix are hashed into their
chained keys; the records found in a row (each verified against its
checksum) become host-tier pages of the tree
(:meth:`~jaxkv.prefix.PrefixCacheManager.insert_host`), and the engine's
existing host-tier path loads them into device blocks with the hit (one
transfer call per admission). A hit is capped at what the host tier can
take; a record that fails its checksum ends the hit before it.

**Identity.** Records carry a digest of the model's class and config, a
sample of every parameter (shapes, dtypes and a strided sample of values,
so another checkpoint of the same architecture is another identity), the
pool's layout and dtypes and the page size: a folder shared by two models,
or left by an older checkpoint, never feeds one the other's pages.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.pool import host as host_swap
from jaxkv.errors import InvalidArgument
from jaxkv.prefix.disk import DiskStore, model_identity

__all__ = ["HybridDiskTier", "PagedDiskTier", "hybrid_identity", "identity_of", "paged_identity"]

logger = logging.getLogger("jaxkv.serve")

_SAMPLE = 64  # values sampled from each parameter for the identity


def _config_dict(config) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def identity_of(model, kind: str, *layout) -> str:
    """The identity digest of ``model``'s records of ``kind`` in a cache of
    ``layout`` (JSON-able facts: shapes, dtypes, sizes; module docstring)."""
    params = nnx.state(model, nnx.Param)
    samples = []
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda pl: jax.tree_util.keystr(pl[0])):
        flat = leaf.reshape(-1)
        step = max(1, flat.size // _SAMPLE)
        samples += [jax.tree_util.keystr(path), np.asarray(jax.device_get(flat[::step][:_SAMPLE]))]
    return model_identity(kind, type(model).__name__, _config_dict(model.config), *layout, *samples)


def paged_identity(model, pool, page_size: int) -> str:
    """A paged pool's: its leaves' dtypes and shapes but the page axis."""
    layout = [(str(leaf.dtype), leaf.shape[:2] + leaf.shape[3:]) for leaf in jax.tree.leaves(pool)]
    return identity_of(model, PagedDiskTier.kind, str(jax.tree.structure(pool)), layout, page_size)


class PagedDiskTier:
    """The disk tier of one :class:`~jaxkv.serve.paged_cache.PagedCache`
    (module docstring). ``store``: its records; the cache keeps the pool,
    the tree and the host tier."""

    kind = "page"

    def __init__(self, cache, store: DiskStore):
        self.cache = cache
        self.store = store
        self.loaded_tokens = 0

    def written(self, tokens, blocks, namespace) -> None:
        """The tree now holds ``blocks[i]`` for page ``i`` of ``tokens``:
        queue the pages whose records are not on disk (one gather)."""
        page = self.cache.page_size
        keys = self.store.chain(np.asarray(tokens)[: len(blocks) * page], page, namespace)
        todo = [i for i, key in enumerate(keys) if key not in self.store]
        if not todo:
            return
        data = host_swap.read_pages(self.cache.pool, [blocks[i] for i in todo])
        fetch = functools.cache(lambda: [np.asarray(a) for a in jax.device_get(jax.tree.leaves(data))])
        for j, i in enumerate(todo):
            self.store.put(keys[i], keys[i - 1] if i else None, tokens[i * page:(i + 1) * page], namespace, self.kind,
                           lambda j=j: {str(n): leaf[:, :, j] for n, leaf in enumerate(fetch())})

    def extend(self, tokens, namespace, max_tokens: int) -> int:
        """Load into the host tier the records of the pages of
        ``tokens[:max_tokens]`` past the tree's cached prefix (module
        docstring); returns the tokens added."""
        cache = self.cache
        tree, page = cache.prefix_cache, cache.page_size
        if cache.prefix_host_pool is None or tree.disable:
            return 0
        pages = max_tokens // page
        start = tree.cached_length(tokens[: pages * page], namespace) // page
        if start >= pages:
            return 0
        keys = self.store.chain(np.asarray(tokens)[: pages * page], page, namespace)
        found = 0
        while start + found < pages and self.store.has(keys[start + found]) and found < tree.host_capacity:
            found += 1
        records = []
        for key in keys[start:start + found]:
            record = self.store.get(key, self.kind)
            if record is None:
                break
            records.append(record[1])
        leaves = jax.tree.leaves(cache.prefix_host_pool)
        added = 0
        while records and not added:
            # The pages before ``start`` are the tree's: only the records' rows are read.
            data = jax.tree.unflatten(jax.tree.structure(cache.prefix_host_pool), [
                np.concatenate([np.zeros(leaf.shape[:2] + (start,) + leaf.shape[3:], leaf.dtype),
                                np.stack([r[str(n)] for r in records], axis=2).astype(leaf.dtype)], axis=2)
                for n, leaf in enumerate(leaves)])
            added = cache.import_prefix(tokens, namespace, (start + len(records)) * page, data)
            records = records[: min(tree.host_free_pages, len(records) - 1)]  # what the host tier can take
        self.loaded_tokens += added
        return added


def hybrid_identity(model, manager, unit: int, entry_format: str) -> str:
    """A hybrid cache's: its groups, their block sizes, the entry format,
    the prefix unit and the shapes of one block of each group and of one
    state row (what a record holds)."""
    from jaxkv.manager import hybrid_host

    one = jax.eval_shape(lambda m: (hybrid_host.read_blocks(m, {g: jnp.ones((1,), jnp.int32) for g in m.groups}),
                                    hybrid_host.read_state_rows(m, jnp.ones((1,), jnp.int32))), manager)
    layout = [(str(leaf.dtype), leaf.shape) for leaf in jax.tree.leaves(one)]
    groups = [(name, g.tokens_per_block) for name, g in manager.groups.items()]
    return identity_of(model, HybridDiskTier.kind, str(jax.tree.structure(one)), layout, groups, unit, entry_format)


class HybridDiskTier:
    """The disk tier of one :class:`~jaxkv.serve.hybrid_cache.HybridCache`:
    every snapshot record the cache keeps (its tokens, the data of every
    group's blocks holding them and its state row: what its host tier keeps
    of a record leaving the device) written whole under the key of its
    namespace and tokens; a prompt that runs past the cache's hits and the
    host tier's finds the longest record on disk that begins it, which goes
    into the host tier and is loaded from there as a host hit."""

    kind = "snapshot"

    def __init__(self, cache, store: DiskStore):
        self.cache = cache
        self.store = store
        self.loaded_tokens = 0
        self._seen: set = set()  # ids of the cache's records already queued or on disk

    def written(self) -> None:
        """Queue the cache's records not yet on disk (each: one gather of its
        blocks and state row, dispatched now, fetched on the writer thread)."""
        cache = self.cache
        snapshots = cache.snapshots
        for rid, record in list(snapshots.records.items()):
            if rid in self._seen:
                continue
            self._seen.add(rid)
            key = self.store.key(None, record.prefix, record.namespace)
            if key in self.store:
                continue
            counts, data = cache.record_data(record)
            self.store.put(key, None, record.prefix, record.namespace, self.kind, meta={"snapshot": record.kind},
                           arrays=lambda data=data, counts=counts: {
                               "counts": np.asarray(counts, np.int64),
                               **{str(n): np.asarray(a) for n, a in enumerate(jax.device_get(jax.tree.leaves(data)))}})
        self._seen.intersection_update(snapshots.records)

    def extend(self, tokens, namespace, longer_than: int) -> None:
        """Put into the host tier the longest record on disk that begins
        ``tokens`` (at most ``len - 1`` of them) and is longer than
        ``longer_than`` (what the device and host tiers hit), if any."""
        cache = self.cache
        while True:
            key = self.store.longest_prefix(tokens, namespace, limit=len(tokens) - 1, longer_than=longer_than)
            if key is None:
                return
            record = self.store.get(key, self.kind)
            if record is None:
                continue  # dropped (damaged): a shorter one may do
            header, arrays = record
            counts = [int(n) for n in arrays["counts"]]
            try:
                data = cache.record_as(counts, [arrays.get(str(n)) for n in range(len(arrays) - 1)])
            except InvalidArgument as error:
                logger.warning("kv disk: record %s not loaded: %s", key, error)
                return
            self.loaded_tokens += cache.import_prefix(header["tokens"], namespace, header["meta"]["snapshot"],
                                                      counts, data)
            return
