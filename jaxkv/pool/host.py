"""Host-memory pages for swapping (seed 003's CPU blocks).

A host pool is a :class:`~jaxkv.pool.kv_pool.KVPool` whose leaves are numpy
arrays in host RAM, with the same layout and dtypes as the device pool (so a
swap round trip is bit-exact, fp8 scales included). Numpy keeps this portable:
a swap is one jitted gather of the pages on the device plus one transfer each
way, on every backend. (Pinned-host device arrays would let XLA overlap the
copy with compute on GPU; that is an optimisation for later.)

The block bookkeeping is done on device by
:meth:`~jaxkv.manager.block_space.BlockSpaceManager.swap_out` /
``swap_in``, which return the page pairs to copy; the functions here copy
them. :func:`swap_out` and :func:`swap_in` do both, on the host path, and
raise typed errors.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv import _host
from jaxkv.errors import KVCacheOOM
from jaxkv.manager.block_space import ON_DEVICE, SWAPPED, BlockSpaceManager
from jaxkv.pool.kv_pool import KVPool

_read_pages = jax.jit(KVPool.read_pages)
_write_pages = jax.jit(KVPool.write_pages, donate_argnums=0)
_swap_out = jax.jit(BlockSpaceManager.swap_out)
_swap_in = jax.jit(BlockSpaceManager.swap_in)


def create_host_pool(pool: KVPool, num_pages: int) -> KVPool:
    """A zero-filled host pool of ``num_pages`` pages shaped like ``pool``."""
    return jax.tree_util.tree_map(
        lambda a: np.zeros(a.shape[:2] + (num_pages,) + a.shape[3:], a.dtype), pool
    )


def _pairs(src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray]:
    src, dst = np.asarray(src_pages).reshape(-1), np.asarray(dst_pages).reshape(-1)
    keep = (src >= 0) & (dst >= 0)
    return src[keep], dst[keep]


def swap_out_pages(pool: KVPool, host_pool: KVPool, device_pages, host_pages) -> KVPool:
    """Copy ``pool`` page ``device_pages[i]`` to host page ``host_pages[i]``
    (every layer, K, V, scales; -1 pairs skipped). Writes ``host_pool`` in
    place and returns it."""
    src, dst = _pairs(device_pages, host_pages)
    if src.size:
        data = jax.device_get(_read_pages(pool, _host.padded_ids(src)))
        for host_leaf, leaf in zip(jax.tree_util.tree_leaves(host_pool), jax.tree_util.tree_leaves(data)):
            host_leaf[:, :, dst] = leaf[:, :, : src.size]
    return host_pool


def swap_in_pages(pool: KVPool, host_pool: KVPool, host_pages, device_pages) -> KVPool:
    """Copy host page ``host_pages[i]`` into ``pool`` page ``device_pages[i]``
    (-1 pairs skipped); returns the new device pool (``pool`` is donated)."""
    src, dst = _pairs(host_pages, device_pages)
    if not src.size:
        return pool
    targets = _host.padded_ids(dst)  # -1 padding: write_pages skips it
    gather = np.zeros(targets.shape, np.int64)
    gather[: src.size] = src
    data = jax.tree_util.tree_map(lambda leaf: leaf[:, :, gather], host_pool)
    return _write_pages(pool, targets, jax.device_put(data))


def swap_out(
    manager: BlockSpaceManager, pool: KVPool, host_pool: KVPool, seq_ids
) -> tuple[BlockSpaceManager, KVPool]:
    """Host path: move the sequence group ``seq_ids`` to host memory (tables
    and data). Raises ``InvalidId`` for a row that is not on the device and
    ``KVCacheOOM`` when the host has too few free blocks; nothing changes then.
    Returns ``(manager, host_pool)``."""
    ids = _host.padded_ids(seq_ids)
    new, device_pages, host_pages, ok = _swap_out(manager, ids)
    if not bool(ok):
        raise _swap_error(manager, seq_ids, ON_DEVICE, "swap out", manager.host, "host blocks")
    return new, swap_out_pages(pool, host_pool, device_pages, host_pages)


def swap_in(
    manager: BlockSpaceManager, pool: KVPool, host_pool: KVPool, seq_ids
) -> tuple[BlockSpaceManager, KVPool]:
    """Host path: bring the swapped group ``seq_ids`` back to the device.
    Raises ``InvalidId`` for a row that is not swapped out and ``KVCacheOOM``
    when the device has too few free blocks. Returns ``(manager, pool)``;
    ``pool`` is donated."""
    ids = _host.padded_ids(seq_ids)
    new, host_pages, device_pages, ok = _swap_in(manager, ids)
    if not bool(ok):
        raise _swap_error(manager, seq_ids, SWAPPED, "swap in", manager.device, "device blocks")
    return new, swap_in_pages(pool, host_pool, host_pages, device_pages)


def _swap_error(manager, seq_ids, wanted: int, op: str, allocator, unit: str) -> Exception:
    error = manager.row_error(op, seq_ids, wanted)
    if error is not None:
        return error
    needed = int(manager._distinct_blocks(_host.padded_ids(seq_ids)))
    return KVCacheOOM(needed, int(allocator.num_free), allocator.capacity, unit=unit)
