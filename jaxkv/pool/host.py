"""Host-memory pages for swapping (seed 003's CPU blocks).

A host pool is a :class:`~jaxkv.pool.kv_pool.KVPool` with the same layout and
dtypes as the device pool (so a swap round trip is bit-exact, fp8 scales
included), kept in host memory:

* as arrays in the device's ``pinned_host`` memory kind where the backend has
  it and can update such arrays inside ``jax.jit`` (checked once, when the host
  pool is made, by running the very functions swaps use): a swap is then one
  jitted call each way, and the transfer is a DMA from pinned memory;
* otherwise as numpy arrays in host RAM: a jitted gather on the device plus
  one transfer each way, which works on every backend.

The block bookkeeping is done on device by
:meth:`~jaxkv.manager.block_space.BlockSpaceManager.swap_out` /
``swap_in``, which return the page pairs to copy; the functions here copy
them. ``BlockSpaceManager.swap_out_or_raise`` / ``swap_in_or_raise`` do
both, on the host path, and raise typed errors (this module does not import
the manager: the pool layer sits below it).

No copy here ever drops a page silently: page ids are checked against both
pools before anything moves (``InvalidId``), and the manager's host paths
check that the pools are at least as large as its allocators say
(``InvalidArgument``, with both sizes).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import SingleDeviceSharding

from jaxkv import _host
from jaxkv.errors import InvalidArgument, InvalidId
from jaxkv.pool.kv_pool import KVPool

__all__ = ["clear_host_pages", "create_host_pool", "is_pinned", "read_pages", "swap_in_pages", "swap_out_pages",
           "write_host_pages"]

# Page ids are checked on the host before these run: drop their ``ok``.
_read_pages = jax.jit(lambda pool, pages: pool.read_pages(pages)[0])
_write_pages = jax.jit(lambda pool, pages, data: pool.write_pages(pages, data)[0], donate_argnums=0)


def _pinned_sharding(pool: KVPool) -> SingleDeviceSharding | None:
    device = next(iter(pool.k_bits.devices()))
    kinds = {memory.kind for memory in device.addressable_memories()}
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


def _on_host(fn):
    """``fn`` jitted to run on the host (``compute_on("device_host")``, the
    signature of the jax 0.10 this project pins). A JAX whose ``compute_on``
    takes other arguments (0.11 wants ``compute_type=`` and
    ``out_memory_spaces=``) gets a function that raises instead, so
    :func:`create_host_pool`'s probe falls back to numpy pages rather than the
    import failing."""
    try:
        return compute_on("device_host")(jax.jit(fn))
    except TypeError as error:
        reason = f"pinned_host swap pages need jax 0.10's compute_on; jax {jax.__version__} says: {error}"

        def unsupported(*args, **kwargs):
            raise InvalidArgument(reason)

        return unsupported


@_on_host
def _host_write_pages(host_pool: KVPool, targets, data: KVPool) -> KVPool:
    # A bare scatter: every operand of a host computation must be in host memory,
    # so indices are prepared on the device (padding -> one past the end).
    return jax.tree_util.tree_map(lambda a, d: a.at[:, :, targets].set(d, mode="drop"), host_pool, data)


@_on_host
def _host_read_pages(host_pool: KVPool, pages) -> KVPool:
    return jax.tree_util.tree_map(lambda a: a[:, :, pages], host_pool)


def _store_pinned(host_pool: KVPool, host_pages, data: KVPool, *, sharding) -> KVPool:
    """Inside jit: move ``data`` (device pages) to pinned host memory
    (``sharding``) and write it into ``host_pool`` there, computing on the
    host (JAX requires every operand of a host computation in host memory)."""
    targets = jax.numpy.where(host_pages == -1, host_pool.num_pages, host_pages)
    return _host_write_pages(host_pool, jax.device_put(targets, sharding), jax.device_put(data, sharding))


def _load_pinned(pool: KVPool, host_pool: KVPool, host_pages, device_pages, *, sharding, host_sharding) -> KVPool:
    """Inside jit: gather pinned host pages on the host, move them to the
    device (``sharding``) and write them into the device pool."""
    data = _host_read_pages(host_pool, jax.device_put(host_pages, host_sharding))
    return pool.write_pages(device_pages, jax.device_put(data, sharding))[0]


_store_pinned_jit = jax.jit(_store_pinned, donate_argnums=0, static_argnames=("sharding",))
_load_pinned_jit = jax.jit(_load_pinned, donate_argnums=0, static_argnames=("sharding", "host_sharding"))


def _placement(tree: KVPool):
    return tree.k_bits.sharding


def create_host_pool(pool: KVPool, num_pages: int, *, memory_kind: str = "auto") -> KVPool:
    """A zero-filled host pool of ``num_pages`` pages shaped like ``pool``.

    ``memory_kind``: ``"auto"`` (pinned host memory if the backend supports it
    for swaps, else numpy), ``"pinned_host"`` (raise if unsupported) or
    ``"numpy"``.
    """
    if memory_kind not in ("auto", "pinned_host", "numpy"):
        raise InvalidArgument(f"memory_kind={memory_kind!r}: choose 'auto', 'pinned_host' or 'numpy'")
    template = jax.tree_util.tree_map(lambda a: np.zeros(a.shape[:2] + (num_pages,) + a.shape[3:], a.dtype), pool)
    sharding = None if memory_kind == "numpy" else _pinned_sharding(pool)
    if sharding is None:
        if memory_kind == "pinned_host":
            raise InvalidArgument("this backend has no pinned_host memory kind")
        return template
    try:  # the probe: one round trip of page 0 through the functions swaps use
        host_pool = jax.device_put(template, sharding)
        probe = _host.padded_ids([0])
        host_pool = _store_pinned_jit(host_pool, probe, _read_pages(pool, probe), sharding=sharding)
        scratch = jax.tree_util.tree_map(lambda a: a.copy(), pool)
        _load_pinned_jit(scratch, host_pool, probe, probe, sharding=_placement(pool), host_sharding=sharding)
        return host_pool
    except Exception as error:  # noqa: BLE001 - any backend refusal means "unsupported"
        if memory_kind == "pinned_host":
            raise InvalidArgument(f"pinned_host swap pages are not supported here: {error}") from error
        return template


def is_pinned(host_pool: KVPool) -> bool:
    """Whether ``host_pool`` lives in pinned host memory (else numpy)."""
    return isinstance(host_pool.k_bits, jax.Array)


def _pairs(src_pages, src_pool: KVPool, dst_pages, dst_pool: KVPool, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The (source, target) page pairs to copy, -1 pairs skipped; raises
    ``InvalidId``/``InvalidArgument`` before anything moves for a page
    outside its pool, a target named twice, or lists of different lengths."""
    src = _host.int_array(src_pages, "source pages").reshape(-1)
    dst = _host.int_array(dst_pages, "target pages").reshape(-1)
    if src.shape != dst.shape:
        raise InvalidArgument(f"{what}: {src.size} source pages but {dst.size} target pages")
    keep = (src != -1) & (dst != -1)
    src, dst = src[keep], dst[keep]
    for pages, pool, side in ((src, src_pool, "source"), (dst, dst_pool, "target")):
        bad = pages[(pages < 0) | (pages >= pool.num_pages)]
        if bad.size:
            raise InvalidId(f"{what}: {side} pages {_host.preview(np.unique(bad))} outside that pool's "
                            f"[0, {pool.num_pages})", np.unique(bad))
    _host.refuse_repeats(dst, f"{what}: target pages")
    return src, dst


def swap_out_pages(pool: KVPool, host_pool: KVPool, device_pages, host_pages) -> KVPool:
    """Copy ``pool`` page ``device_pages[i]`` to host page ``host_pages[i]``
    (every layer, K, V, scales; -1 pairs skipped) and return the host pool
    (a pinned one is donated; a numpy one is written in place)."""
    src, dst = _pairs(device_pages, pool, host_pages, host_pool, "swap_out_pages")
    if not src.size:
        return host_pool
    data = _read_pages(pool, _host.padded_ids(src))
    if is_pinned(host_pool):
        return _store_pinned_jit(host_pool, _host.padded_ids(dst), data, sharding=_placement(host_pool))
    data = jax.device_get(data)
    for host_leaf, leaf in zip(jax.tree_util.tree_leaves(host_pool), jax.tree_util.tree_leaves(data)):
        host_leaf[:, :, dst] = leaf[:, :, : src.size]
    return host_pool


def read_pages(pool: KVPool, device_pages) -> KVPool:
    """Pages ``device_pages`` of ``pool`` gathered into new device arrays (one
    jitted call, not waited for; the page axis is padded to a power of two:
    page ``i`` is index ``i`` of axis 2). A snapshot: later writes to the
    pool do not change it. ``InvalidId`` for a page outside the pool."""
    src, _ = _pairs(device_pages, pool, device_pages, pool, "read_pages")
    return _read_pages(pool, _host.padded_ids(src))


def write_host_pages(host_pool: KVPool, host_pages, data: KVPool) -> KVPool:
    """Write ``data`` (host arrays shaped like the pool's leaves with
    ``len(host_pages)`` pages on axis 2, e.g. a disk record's) into host
    pages ``host_pages``; returns the host pool (a pinned one is donated; a
    numpy one is written in place)."""
    dst = _host.int_array(host_pages, "host pages").reshape(-1)
    _pairs(dst, host_pool, dst, host_pool, "write_host_pages")
    if not dst.size:
        return host_pool
    if is_pinned(host_pool):
        targets = _host.padded_ids(dst)
        padded = jax.tree_util.tree_map(
            lambda a: np.concatenate([a, np.zeros(a.shape[:2] + (targets.size - dst.size,) + a.shape[3:], a.dtype)],
                                     axis=2), data)
        device = next(iter(host_pool.k_bits.devices()))
        return _store_pinned_jit(host_pool, targets, jax.device_put(padded, device),
                                 sharding=_placement(host_pool))
    for host_leaf, leaf in zip(jax.tree_util.tree_leaves(host_pool), jax.tree_util.tree_leaves(data)):
        host_leaf[:, :, dst] = leaf
    return host_pool


def swap_in_pages(pool: KVPool, host_pool: KVPool, host_pages, device_pages) -> KVPool:
    """Copy host page ``host_pages[i]`` into ``pool`` page ``device_pages[i]``
    (-1 pairs skipped); returns the new device pool (``pool`` is donated)."""
    src, dst = _pairs(host_pages, host_pool, device_pages, pool, "swap_in_pages")
    if not src.size:
        return pool
    targets = _host.padded_ids(dst)  # -1 padding: write_pages skips it
    gather = np.zeros(targets.shape, np.int32)
    gather[: src.size] = src
    if is_pinned(host_pool):
        return _load_pinned_jit(pool, host_pool, gather, targets, sharding=_placement(pool),
                                host_sharding=_placement(host_pool))
    data = jax.tree_util.tree_map(lambda leaf: leaf[:, :, gather], host_pool)
    return _write_pages(pool, targets, jax.device_put(data))


def clear_host_pages(host_pool: KVPool, pages) -> KVPool:
    """Host pages ``pages`` zeroed as :func:`create_host_pool` made them
    (every layer, K, V, scales; -1 skipped; repeats allowed): scrub-on-free
    of pages the host side let go. Returns the host pool (a pinned one is
    donated; a numpy one is written in place). ``InvalidId`` for a page
    outside the pool, before anything changes."""
    ids = _host.int_array(pages, "pages").reshape(-1)
    ids = np.unique(ids[ids != -1])
    bad = ids[(ids < 0) | (ids >= host_pool.num_pages)]
    if bad.size:
        raise InvalidId(f"clear_host_pages: pages {_host.preview(bad)} outside the pool's [0, {host_pool.num_pages})",
                        bad)
    if not ids.size:
        return host_pool
    if not is_pinned(host_pool):
        for leaf in jax.tree_util.tree_leaves(host_pool):
            leaf[:, :, ids] = 0
        return host_pool
    targets = _host.padded_ids(ids)
    zeros = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape[:2] + targets.shape + a.shape[3:], a.dtype),
                                   host_pool)
    return _store_pinned_jit(host_pool, targets, zeros, sharding=_placement(host_pool))
