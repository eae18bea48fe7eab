"""The prefix cache's disk tier on a paged pool (``--kv-disk-dir``): pages
written through to a :class:`~jaxkv.prefix.disk.DiskStore`, read back into
the host tier when a prompt runs past what the tree holds.

**Write-through.** Every page the prefix cache takes (a prompt's pages at
the end of its prefill, a finished request's at retirement) is queued for
the disk unless its record is there already: one jitted gather of the new
pages per insert, fetched and written on the store's thread. So a server
that stops, or dies, leaves on disk every page it had cached, bar the last
writes in flight (LMCache's and SGLang HiCache's write-through policy; the
eviction-time write the issue sketched would lose every page still on the
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
import numpy as np
from flax import nnx

from jaxkv.pool import host as host_swap
from jaxkv.prefix.disk import DiskStore, model_identity

__all__ = ["PagedDiskTier", "identity_of"]

logger = logging.getLogger("jaxkv.serve")

_SAMPLE = 64  # values sampled from each parameter for the identity


def _config_dict(config) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def identity_of(model, pool, page_size: int, kind: str) -> str:
    """The identity digest of ``model``'s records of ``kind`` over ``pool``
    (module docstring)."""
    params = nnx.state(model, nnx.Param)
    samples = []
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda pl: jax.tree_util.keystr(pl[0])):
        flat = leaf.reshape(-1)
        step = max(1, flat.size // _SAMPLE)
        samples += [jax.tree_util.keystr(path), np.asarray(jax.device_get(flat[::step][:_SAMPLE]))]
    layout = [(str(leaf.dtype), leaf.shape[:2] + leaf.shape[3:]) for leaf in jax.tree.leaves(pool)]
    return model_identity(kind, type(model).__name__, _config_dict(model.config), str(jax.tree.structure(pool)),
                          layout, page_size, *samples)


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
        while records:
            host_pages, _ = tree.insert_host(tokens[: (start + len(records)) * page], namespace)
            if host_pages:
                break
            records = records[: min(tree.host_free_pages, len(records) - 1)]  # what the host tier can take
        if not records:
            return 0
        cache._clear_freed_host()  # scrub-on-free zeroes pages the tier let go: before they are written
        leaves = jax.tree.leaves(cache.prefix_host_pool)
        data = jax.tree.unflatten(jax.tree.structure(cache.prefix_host_pool),
                                  [np.stack([r[str(n)] for r in records], axis=2).astype(leaf.dtype)
                                   for n, leaf in enumerate(leaves)])
        cache.prefix_host_pool = host_swap.write_host_pages(cache.prefix_host_pool, host_pages, data)
        added = len(records) * page
        self.loaded_tokens += added
        return added
