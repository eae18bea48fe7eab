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

A hybrid cache's snapshot records: :class:`HybridDiskTier` (its pages
written once, each record's tail and state row apart).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._ops import pow2_at_least
from jaxkv.pool import host as host_swap
from jaxkv.errors import InvalidArgument
from jaxkv.prefix.disk import DiskStore, model_identity
from jaxkv.serve.caches import pow2_ids

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


def _fetcher(data):
    """A function giving ``data``'s leaves as host arrays, fetched once, on
    its first call (the store's writer thread: the step that dispatched the
    gather never waits for it)."""
    return functools.cache(lambda: [np.asarray(a) for a in jax.device_get(jax.tree.leaves(data))])


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
        fetch = _fetcher(data)
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
    the prefix unit, the shapes of one block of each group and of one state
    row, and the record layout (:data:`HybridDiskTier.layout`)."""
    from jaxkv.manager import hybrid_host

    one = jax.eval_shape(lambda m: (hybrid_host.read_blocks(m, {g: jnp.ones((1,), jnp.int32) for g in m.groups}),
                                    hybrid_host.read_state_rows(m, jnp.ones((1,), jnp.int32))), manager)
    layout = [(str(leaf.dtype), leaf.shape) for leaf in jax.tree.leaves(one)]
    groups = [(name, g.tokens_per_block) for name, g in manager.groups.items()]
    return identity_of(model, HybridDiskTier.kind, str(jax.tree.structure(one)), layout, groups, unit, entry_format,
                       HybridDiskTier.layout)


class HybridDiskTier:
    """The disk tier of one :class:`~jaxkv.serve.hybrid_cache.HybridCache`.

    **Records.** A snapshot record (its tokens, every group's blocks
    holding them, its state row) is written in two kinds of files, so that
    records sharing a prefix share its bytes on disk (a long prompt's
    interval records would otherwise each repeat every page before them:
    bytes quadratic in the prompt's length):

    * one ``"snapshot-page"`` record per whole page (``unit`` tokens) of
      the tree it lies on: every group's blocks of that page, under the
      page's chained key (namespace, the pages before it, its tokens; the
      chain starts from the key ``"snapshot-page"``, so a page's key is
      never a record's), written once whatever number of records pass
      through it;
    * one ``"snapshot"`` record under the key of its namespace and tokens:
      the blocks of its tail (its tokens past the whole pages), its state
      row, and how many pages it stands on.

    A prompt that runs past the cache's hits and the host tier's finds the
    longest snapshot record on disk that begins it whose pages are all
    there (a page dropped by the budget leaves its records unloadable: a
    shorter one is tried); its pages and tail are joined into the record
    the host tier keeps, which is loaded from there as a host hit."""

    kind = "snapshot"
    page_kind = "snapshot-page"
    layout = "pages+tails-v2"  # in the identity: files of the earlier whole-record layout are foreign

    def __init__(self, cache, store: DiskStore):
        self.cache = cache
        self.store = store
        self.loaded_tokens = 0
        self._seen: set = set()  # ids of the cache's records already queued or on disk

    def written(self) -> None:
        """Queue the cache's records not yet on disk and the pages they stand
        on not yet there (each: one gather of its new pages' blocks, one of
        its tail and state row, dispatched now, fetched on the writer
        thread)."""
        from jaxkv.manager import hybrid_host

        cache = self.cache
        snapshots = cache.snapshots
        groups = range(len(cache.groups))
        for rid, record in list(snapshots.records.items()):
            if rid in self._seen:
                continue
            self._seen.add(rid)
            key = self.store.key(None, record.prefix, record.namespace)
            if key in self.store:
                continue
            unit = snapshots.unit
            page_keys = self.store.chain(record.prefix[:len(record.path) * unit], unit, record.namespace,
                                         start_key=self.page_kind)
            new = [i for i, page_key in enumerate(page_keys) if page_key not in self.store]
            if new:
                blocks = [[list(snapshots.pages[record.path[i]][g]) for g in groups] for i in new]
                gathered = hybrid_host.read_blocks(cache.manager, {
                    name: pow2_ids([b for page in blocks for b in page[g]]) for g, name in enumerate(cache.groups)})
                fetched = _fetcher(gathered)
                starts = np.cumsum([[0] * len(groups)] + [[len(page[g]) for g in groups] for page in blocks], axis=0)
                for j, i in enumerate(new):
                    counts = [len(blocks[j][g]) for g in groups]
                    self.store.put(page_keys[i], page_keys[i - 1] if i else self.page_kind,
                                   record.prefix[i * unit:(i + 1) * unit], record.namespace, self.page_kind,
                                   meta={"counts": counts},
                                   arrays=lambda fetched=fetched, start=starts[j], counts=counts:
                                   self._page_arrays(fetched, start, counts))
            tail = [list(record.tail[g]) for g in groups]
            data = _fetcher((hybrid_host.read_blocks(cache.manager, {name: pow2_ids(tail[g])
                                                                     for g, name in enumerate(cache.groups)}),
                             hybrid_host.read_state_rows(cache.manager, [cache.manager.num_slots + record.row])))
            self.store.put(key, None, record.prefix, record.namespace, self.kind,
                           meta={"snapshot": record.kind, "pages": len(record.path),
                                 "tail": [len(t) for t in tail]},
                           arrays=lambda data=data, tail=tail: self._record_arrays(data, tail))
        self._seen.intersection_update(snapshots.records)

    def _page_arrays(self, fetched, start, counts) -> dict:
        """One page's blocks out of a gather of several pages' (on the writer thread)."""
        leaves = fetched()
        return {str(n): np.take(leaves[n], np.arange(start[g], start[g] + counts[g]), axis=axis)
                for n, (g, axis) in enumerate(self.cache.record_block_axes())}

    def _record_arrays(self, fetched, tail) -> dict:
        """A record's tail blocks (the padding cut off) and state row (on the writer thread)."""
        leaves = fetched()
        axes = self.cache.record_block_axes()
        out = {str(n): np.take(leaves[n], np.arange(len(tail[g])), axis=axis) for n, (g, axis) in enumerate(axes)}
        out.update((str(n), leaves[n]) for n in range(len(axes), len(leaves)))
        return out

    def extend(self, tokens, namespace, longer_than: int) -> None:
        """Put into the host tier the longest record on disk that begins
        ``tokens`` (at most ``len - 1`` of them), is longer than
        ``longer_than`` (what the device and host tiers hit) and has all
        its pages on disk, if any."""
        cache = self.cache
        limit, unit = len(tokens) - 1, cache.snapshots.unit
        while True:
            key = self.store.longest_prefix(tokens, namespace, limit=limit, longer_than=longer_than)
            if key is None:
                return
            record = self.store.get(key, self.kind)
            if record is None:
                continue  # dropped (damaged): a shorter one may do
            header, arrays = record
            prefix, meta = header["tokens"], header["meta"]
            pages = [self.store.get(k, self.page_kind)
                     for k in self.store.chain(prefix[:meta["pages"] * unit], unit, namespace,
                                               start_key=self.page_kind)]
            if any(page is None for page in pages):
                limit = len(prefix) - 1  # a page is gone (budget, damage): a shorter record may do
                continue
            try:
                counts, leaves = self._joined(pages, meta["tail"], arrays)
                data = cache.record_as(counts, leaves)
            except (InvalidArgument, KeyError, ValueError, IndexError) as error:
                logger.warning("kv disk: record %s not loaded: %s", key, error)
                return
            self.loaded_tokens += cache.import_prefix(prefix, namespace, meta["snapshot"], counts, data)
            return

    def _joined(self, pages: list, tail: list, arrays: dict) -> tuple[list, list]:
        """A record's ``(blocks per group, leaves)`` in the host tier's layout
        (:meth:`HybridCache.record_data`'s: every group's blocks, ids padded
        to a power of two, then the state row) from its pages' files and its
        own (tail blocks and state row)."""
        axes = self.cache.record_block_axes()
        groups = len(self.cache.groups)
        counts = [sum(int(page[0]["meta"]["counts"][g]) for page in pages) + int(tail[g]) for g in range(groups)]
        leaves = []
        for n, (g, axis) in enumerate(axes):
            parts = [page[1][str(n)] for page in pages]
            parts.append(arrays[str(n)])
            joined = np.concatenate(parts, axis=axis)
            pad = [(0, 0)] * joined.ndim
            pad[axis] = (0, pow2_at_least(max(counts[g], 1)) - joined.shape[axis])  # record_data's padding
            leaves.append(np.pad(joined, pad))
        state = len(arrays) - len(axes)
        leaves += [arrays[str(len(axes) + i)] for i in range(state)]
        return counts, leaves
