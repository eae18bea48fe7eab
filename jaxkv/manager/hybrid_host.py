"""Host tier of the hybrid cache: a request's whole state to host memory and back.

:class:`~jaxkv.manager.hybrid.KVCacheManager` keeps every request on the
device. This module moves one out and back, as pure functions over the
manager's fields (the manager gets no methods):

* :func:`read_state_rows` / :func:`write_state_rows`: the per-request
  state of some rows (request slots ``1 .. max_requests`` and snapshot rows
  ``num_slots + i``) in every layer: the SWA ring of every DeepSeek-V4
  layer, the compressor and indexer rings of CSA/HCA layers, the GDN conv
  and recurrent states; the same arrays as ``KVCacheManager.copy_state``
  copies and ``_reset`` clears. A :class:`StateRows` pytree;
* :func:`read_blocks` / :func:`write_blocks`: every layer's data of some
  block ids per group: the compressed entries (and CSA indexer keys) of the
  DeepSeek-V4 layers of a group, the ``full_pool`` / ``mla_pool`` pages of
  the ``"full"`` / ``"mla"`` group. A :class:`BlockData` pytree;
* :class:`HostStore`: such pytrees in host memory under keys, up to a byte
  capacity (``KVCacheOOM`` when full);
* :func:`swap_out_request` / :func:`swap_in_request`: a
  :class:`RequestImage` (state rows + the data of every block in the slot's
  tables + ``seq_len``) taken off the device, the slot released, and later
  restored into any admitted empty slot with fresh blocks, so that it
  decodes token for token as if it had never left;
* :func:`transfer_rate`: measured GB/s of a round trip of blocks.

Host memory is the ``pinned_host`` memory kind of the device where the
backend has it and a probe transfer succeeds, else numpy arrays. Unlike
:mod:`jaxkv.pool.host` (a preallocated host pool written in place inside
``jit``) nothing here updates a host array: each put stores new arrays, so
the probe needs only a round trip. One transfer path each way: device to
host is one ``jax.device_put`` to pinned memory (or one ``jax.device_get``),
host to device one ``jax.device_put`` of the whole tree.

Device work is module-level ``jax.jit`` functions shared by every call; the
ones that write donate the manager (the caller's manager is consumed: use
the returned one). Id lists are padded with -1 to powers of two inside the
swaps, so a serving loop compiles a handful of programs.

Invariants (checked by ``tests/test_hybrid_host.py``):

* ``write_state_rows(m, r2, read_state_rows(m, r1))`` makes rows ``r2``
  bit-equal to rows ``r1`` in every per-request array and changes nothing
  else but ``write_epochs``; likewise for blocks. -1 ids read row 0 / the
  null block and write nothing;
* ``swap_out_request`` changes the manager exactly as ``release`` of the
  slot does (blocks shared with a prefix cache or another slot keep their
  other owners); ``swap_in_request`` either restores the slot's table
  lengths, ``seq_len``, state rows and block contents, each block in fresh
  ids, or fails (``ok`` False) leaving the manager as it was;
* a write bumps ``write_epochs`` of every store it touches (only when it
  takes effect), so a handle acquired before it is refused as stale by
  ``KVCacheManager.update`` instead of undoing the write.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import SingleDeviceSharding
from jaxtyping import Array, Float, Int, Shaped

from jaxkv import _host
from jaxkv.errors import InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind
from jaxkv.pool.compressed import CompressedLayerCache
from jaxkv.pool.window import WindowLayerCache
from jaxkv.pool.kv_pool import KVPool
from jaxkv.types import Ids
from kernels_pallas.formats import CompressedEntries

__all__ = [
    "BlockData",
    "GroupBlocks",
    "HostStore",
    "LayerBlocks",
    "RequestImage",
    "StateRows",
    "read_blocks",
    "read_state_rows",
    "swap_in_error",
    "swap_in_request",
    "swap_in_request_or_raise",
    "swap_out_request",
    "transfer_rate",
    "tree_nbytes",
    "write_blocks",
    "write_state_rows",
]

#: Offsets of the shared stores in ``write_epochs`` after the DeepSeek-V4
#: store classes (``KVCacheManager``'s order: full pool, MLA pool, GDN pool,
#: window pool).
_FULL_STORE, _MLA_STORE, _GDN_STORE, _WINDOW_STORE = 0, 1, 2, 3
_PAGED_KINDS = {AttentionKind.FULL: "full_pool", AttentionKind.MLA: "mla_pool"}


# ----------------------------------------------------------------------------- pytrees


@struct.dataclass
class StateRows:
    """The per-request state of ``n`` rows in every layer.

    Fields:
      v4_stores: per DeepSeek-V4 store class of the manager
        (``KVCacheManager.v4_stores``), a stacked
        :class:`~jaxkv.pool.compressed.CompressedLayerCache` holding only
        the rows' per-request arrays in every layer of the class (``swa``
        ``[L, n, window, ...]``, ``comp_kv`` / ``comp_score`` ``[L, n,
        rows, width]``, ``index_kv`` / ``index_score``; its ``entries`` and
        ``index_keys`` are None); empty without such layers.
      window: a :class:`~jaxkv.pool.window.WindowLayerCache` of the rows'
        K/V rings in every window layer (``[window_layers, n, ...]``), or
        None without window layers.
      gdn_recurrent: float32 ``[gdn_layers, n, v_heads, v_dim, k_dim]``, or
        None without linear layers.
      gdn_conv_bits: ``[gdn_layers, n, conv_dim, kernel - 1]`` in the GDN
        pool's storage dtype, or None.
    """

    v4_stores: tuple[CompressedLayerCache, ...]
    window: WindowLayerCache | None
    gdn_recurrent: Float[Array, "gdn_layers n v_heads v_dim k_dim"] | None
    gdn_conv_bits: Shaped[Array, "gdn_layers n conv_dim conv_width"] | None


@struct.dataclass
class LayerBlocks:
    """The data of ``n`` blocks in every layer of one DeepSeek-V4 store class.

    Fields:
      entries: compressed entries ``[L, n, entries_per_block, ...]``.
      index_keys: CSA indexer keys, same layout, or None (HCA).
    """

    entries: CompressedEntries
    index_keys: CompressedEntries | None


@struct.dataclass
class GroupBlocks:
    """Every layer's data of ``n`` blocks of one group.

    Fields:
      stores: the group's DeepSeek-V4 store classes in the manager's order
        (:meth:`KVCacheManager.v4_group_stores`; empty for ``"full"`` /
        ``"mla"``), each stacked over its layers.
      pages: for ``"full"`` / ``"mla"``, the pool's pages as a
        :class:`~jaxkv.KVPool` of ``n`` pages (every layer, K, V, scales);
        else None.
    """

    stores: tuple[LayerBlocks, ...]
    pages: KVPool | None


@struct.dataclass
class BlockData:
    """Block data per group. Fields: groups: ``{group name: GroupBlocks}``,
    the groups that were read (a subset of the manager's)."""

    groups: dict[str, GroupBlocks]


@struct.dataclass
class RequestImage:
    """Everything of one request, to bring it back into any slot.

    Fields:
      state: its state rows: the slot's row, then (with ``capture_every``)
        its staging snapshot row ``num_slots + slot - 1``.
      blocks: per group, the data of the blocks of its table in table order;
        row ``i < num_blocks[g]`` is table entry ``i``, the rows after it
        are padding (a power-of-two width, so swaps of any length share a
        few compiled programs).
      seq_len: static; tokens the request had reserved.
      num_blocks: static; ``((group, blocks held), ...)`` in the manager's
        group order.
    """

    state: StateRows
    blocks: BlockData
    seq_len: int = struct.field(pytree_node=False)
    num_blocks: tuple[tuple[str, int], ...] = struct.field(pytree_node=False)

    @property
    def nbytes(self) -> int:
        return tree_nbytes(self)


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (from shapes and dtypes)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- device ops


def _num_rows(manager: KVCacheManager) -> int:
    """State rows of every per-request array: slots, then snapshots."""
    return manager.num_slots + manager.num_snapshots


def _gather_rows(manager: KVCacheManager, rows: Int[Array, " n"]) -> StateRows:
    """Rows ``rows`` of every per-request array; an id that is not a row
    (-1 padding, out of range) reads row 0, the padding slot."""
    safe = jnp.where((rows >= 0) & (rows < _num_rows(manager)), rows, 0)
    stores = tuple(jax.tree.map(lambda a: a[:, safe], c.row_state()) for c in manager.v4_stores)
    window = None if manager.window_pool is None else manager.window_pool.take_rows(safe)
    gdn = manager.gdn
    if gdn is None:
        return StateRows(v4_stores=stores, window=window, gdn_recurrent=None, gdn_conv_bits=None)
    return StateRows(v4_stores=stores, window=window, gdn_recurrent=gdn.recurrent_state[:, safe],
                     gdn_conv_bits=gdn.conv_bits[:, safe])


def _scatter_rows(manager: KVCacheManager, rows: Int[Array, " n"], data: StateRows) -> KVCacheManager:
    """Row ``rows[i] <- data row i`` in every per-request array; ids that are
    not rows ``1 .. num_slots + num_snapshots - 1`` are skipped. Repeated
    rows: one of the values wins, unspecified (host paths refuse them)."""
    total = _num_rows(manager)
    valid = (rows >= 1) & (rows < total)
    target = jnp.where(valid, rows, total)  # out of range: the scatter drops it
    v4 = []
    for cache, rows_data in zip(manager.v4_stores, data.v4_stores):
        written = jax.tree.map(lambda a, d: a.at[:, target].set(d, mode="drop"), cache.row_state(), rows_data)
        v4.append(cache.with_row_state(written))
    any_row = jnp.any(valid).astype(jnp.int32)
    shared = len(manager.v4_stores)
    stores = list(range(shared))
    out = manager.replace(v4_stores=tuple(v4))
    if manager.window_pool is not None:
        out = out.replace(window_pool=manager.window_pool.put_rows(target, data.window))
        stores.append(shared + _WINDOW_STORE)
    gdn = manager.gdn
    if gdn is not None:
        # The GDN pool may have more track slots than the manager has
        # snapshot rows: drop past *its* end, not at ``total``, which can be
        # one of its rows.
        gdn_target = jnp.where(valid, rows, gdn.pool_size)
        out = out.replace(gdn=gdn.replace(
            recurrent_state=gdn.recurrent_state.at[:, gdn_target].set(data.gdn_recurrent, mode="drop"),
            conv_bits=gdn.conv_bits.at[:, gdn_target].set(data.gdn_conv_bits, mode="drop")))
        stores.append(shared + _GDN_STORE)
    return _bump(out, stores, any_row)


def _bump(manager: KVCacheManager, stores: list[int], by: Int[Array, ""]) -> KVCacheManager:
    """Count a write-back of each store in ``stores`` (``by`` 0: none)."""
    if not stores:
        return manager
    return manager.replace(write_epochs=manager.write_epochs.at[jnp.asarray(stores, jnp.int32)].add(by))


def _group_pool(manager: KVCacheManager, group: str) -> str | None:
    """``"full_pool"`` / ``"mla_pool"`` when ``group``'s blocks are that
    pool's pages, else None."""
    kinds = {s.kind for s in manager.schemas if s.group == group}
    names = [_PAGED_KINDS[k] for k in kinds if k in _PAGED_KINDS]
    return names[0] if names else None


def _take(tree, ids: Int[Array, " n"], axis: int):
    """Every leaf of ``tree`` at ``ids`` along ``axis`` (the block axis)."""
    return jax.tree.map(lambda a: jnp.take(a, ids, axis=axis), tree)


def _put(tree, targets: Int[Array, " n"], axis: int, data):
    """Every leaf of ``tree`` with ``data`` scattered at ``targets`` along
    ``axis``; out-of-range targets are dropped."""
    index = (slice(None),) * axis + (targets,)
    return jax.tree.map(lambda a, d: a.at[index].set(d, mode="drop"), tree, data)


def _gather_blocks(manager: KVCacheManager, blocks: dict[str, Int[Array, " n"]]) -> BlockData:
    """Every layer's data of ``blocks[g]`` per group; an id outside ``[1,
    num_blocks)`` (-1 padding) reads the null block 0."""
    groups = {}
    for name, ids in blocks.items():
        limit = manager.groups[name].allocator.num_blocks
        safe = jnp.where((ids >= 1) & (ids < limit), ids, 0)
        stores = tuple(LayerBlocks(entries=_take(manager.v4_stores[c].entries, safe, 1),
                                   index_keys=_take(manager.v4_stores[c].index_keys, safe, 1))
                       for c in manager.v4_group_stores(name))
        pool_name = _group_pool(manager, name)
        pages = None if pool_name is None else _take(getattr(manager, pool_name), safe, 2)
        groups[name] = GroupBlocks(stores=stores, pages=pages)
    return BlockData(groups=groups)


def _scatter_blocks(manager: KVCacheManager, blocks: dict[str, Int[Array, " n"]], data: BlockData) -> KVCacheManager:
    """Block ``blocks[g][i] <- data.groups[g]`` row ``i`` in every layer of
    each group; ids outside ``[1, num_blocks)`` (-1 padding) are skipped."""
    v4 = list(manager.v4_stores)
    out = manager
    for name, ids in blocks.items():
        limit = manager.groups[name].allocator.num_blocks
        valid = (ids >= 1) & (ids < limit)
        target = jnp.where(valid, ids, limit)  # out of range: dropped
        any_block = jnp.any(valid).astype(jnp.int32)
        group_data = data.groups[name]
        stores = []
        for c, store_data in zip(manager.v4_group_stores(name), group_data.stores):
            cache = v4[c]
            v4[c] = cache.replace(entries=_put(cache.entries, target, 1, store_data.entries),
                                  index_keys=_put(cache.index_keys, target, 1, store_data.index_keys))
            stores.append(c)
        pool_name = _group_pool(manager, name)
        if pool_name is not None:
            out = out.replace(**{pool_name: _put(getattr(out, pool_name), target, 2, group_data.pages)})
            stores.append(len(manager.v4_stores) + (_FULL_STORE if pool_name == "full_pool" else _MLA_STORE))
        out = _bump(out, stores, any_block)
    return out.replace(v4_stores=tuple(v4))


def _swap_out(manager: KVCacheManager, slot: Int[Array, ""], rows: Int[Array, " r"],
              blocks: dict[str, Int[Array, " n"]], keep_slot: bool) -> tuple[KVCacheManager, StateRows, BlockData, Array]:
    """Read the request's rows and blocks, then release the slot (the reads
    see the manager before the release); with ``keep_slot`` the slot stays
    held, empty (its blocks released, its state reset, ``seq_len`` 0)."""
    state = _gather_rows(manager, rows)
    data = _gather_blocks(manager, blocks)
    released, ok = manager.release(slot.reshape(1))
    if keep_slot:  # the slot allocator as it was: the slot is still held
        released = released.replace(slots=manager.slots)
    return released, state, data, ok


def _width(group_data: GroupBlocks) -> int:
    """Block rows in ``group_data`` (static: its leading block axis)."""
    if group_data.stores:
        return group_data.stores[0].entries.nope_bits.shape[1]
    return group_data.pages.k_bits.shape[2]


def _swap_in(manager: KVCacheManager, slot: Int[Array, ""], seq_len: Int[Array, ""],
             counts: dict[str, Int[Array, ""]], state: StateRows, blocks: BlockData
             ) -> tuple[KVCacheManager, Array]:
    """Restore an image into the admitted, empty ``slot``: ``counts[g]``
    fresh blocks in every group (all or nothing), the table in the image's
    order, their data (``blocks``), ``seq_len`` and the state rows. Fails
    (unchanged) when the slot is not held or not empty, or a group has too
    few free blocks. Counts and ``seq_len`` are traced: one program per
    padded width, not per request."""
    num_slots = manager.num_slots
    in_range = (slot >= 1) & (slot < num_slots)
    row = jnp.where(in_range, slot, 0)
    ok = in_range & (manager.slots.ref_count(row) > 0) & (manager.seq_lens[row] == 0)
    for name, group in manager.groups.items():
        ok = ok & (group.lens[row] == 0) & (counts[name] <= group.allocator.num_free)
    groups, new_ids = {}, {}
    for name, group in manager.groups.items():
        width = _width(blocks.groups[name])
        # Nothing is taken when not ok (an acquisition of 0 blocks): the ids
        # are all -1 and every write below is dropped.
        allocator, ids, _ = group.allocator.acquire(jnp.where(ok, counts[name], 0), max_n=width)
        column = jnp.arange(width, dtype=jnp.int32)
        tables = group.tables.at[jnp.where(ids >= 0, row, num_slots), column].set(ids, mode="drop")
        lens = group.lens.at[jnp.where(ok, row, num_slots)].set(counts[name], mode="drop")
        groups[name] = group.replace(allocator=allocator, tables=tables, lens=lens)
        new_ids[name] = ids
    seq_lens = manager.seq_lens.at[jnp.where(ok, row, num_slots)].set(seq_len, mode="drop")
    out = manager.replace(groups=groups, seq_lens=seq_lens)
    out = _scatter_blocks(out, new_ids, blocks)
    out = _scatter_rows(out, jnp.where(ok, _image_rows(manager, row), -1), state)
    return out, ok


def _slot_facts(manager: KVCacheManager, slot: Int[Array, ""]):
    """What a swap-out reads on the host: whether ``slot`` is held, its
    ``seq_len``, and per group its table length and table row."""
    return (manager.slots.ref_count(slot) > 0, manager.seq_lens[slot],
            {n: g.lens[slot] for n, g in manager.groups.items()},
            {n: g.tables[slot] for n, g in manager.groups.items()})


def _image_rows(manager: KVCacheManager, slot):
    """The state rows a request in ``slot`` owns: the slot, and with
    ``capture_every`` its staging snapshot ``num_slots + slot - 1``."""
    slot = jnp.asarray(slot, jnp.int32)
    if not manager.capture_every:
        return slot.reshape(1)
    return jnp.stack([slot, manager.num_slots + slot - 1])


_read_rows_jit = jax.jit(_gather_rows)
_write_rows_jit = jax.jit(_scatter_rows, donate_argnums=0)
_read_blocks_jit = jax.jit(_gather_blocks)
_write_blocks_jit = jax.jit(_scatter_blocks, donate_argnums=0)
_swap_out_jit = jax.jit(_swap_out, donate_argnums=0, static_argnames=("keep_slot",))
_swap_in_jit = jax.jit(_swap_in, donate_argnums=0)
_slot_facts_jit = jax.jit(_slot_facts)


# ----------------------------------------------------------------------------- host checks


def _concrete(x) -> bool:
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def _check_rows(manager: KVCacheManager, rows, op: str, *, write: bool) -> np.ndarray | Array:
    """Concrete ``rows`` as int32 (``InvalidId`` for a row outside ``1 ..
    num_slots + num_snapshots - 1`` other than -1, ``InvalidArgument`` for a
    repeat in a write); traced rows as they are (the device op skips bad ids)."""
    total = _num_rows(manager)
    return _checked_ids(rows, "rows", total, op, write, f"(slots 1 .. {manager.max_requests}, snapshots "
                        f"{manager.num_slots} .. {total - 1}; -1 is padding)")


def _checked_ids(values, what: str, limit: int, op: str, write: bool, legend: str) -> np.ndarray | Array:
    """Concrete ``values`` as int32 ids: ``InvalidId`` for one outside
    ``[1, limit)`` other than -1 (the message names ``what`` and adds
    ``legend``), ``InvalidArgument`` for a repeat when ``write``; traced
    values as they are."""
    if not _concrete(values):
        return jnp.asarray(values, jnp.int32).reshape(-1)
    ids = _host.int_array(values, what).reshape(-1)
    bad = np.unique(ids[(ids != -1) & ((ids < 1) | (ids >= limit))])
    if bad.size:
        raise InvalidId(f"{op}: {what} {_host.preview(bad)} outside [1, {limit}) {legend}", bad)
    if write:
        _host.refuse_repeats(ids, f"{op}: {what}")
    return _host.as_int32_ids(ids)


def _check_blocks(manager: KVCacheManager, blocks, op: str, *, write: bool) -> dict:
    """``blocks`` as ``{group: int32 ids}``: ``InvalidArgument`` unless a
    dict naming groups of the manager (or, for a write, with a repeat);
    ``InvalidId`` for an id outside ``[1, num_blocks)`` other than -1."""
    if not isinstance(blocks, Mapping):
        raise InvalidArgument(f"{op}: blocks must be a dict of group name -> ids, got {type(blocks).__name__}")
    unknown = sorted(set(map(str, blocks)) - set(manager.groups))
    if unknown:
        raise InvalidArgument(f"{op}: groups {unknown} are not the manager's {list(manager.groups)}")
    out = {}
    for name in manager.groups:  # the manager's order: one treedef per set of groups
        if name not in blocks:
            continue
        out[name] = _checked_ids(blocks[name], f"{name} blocks", manager.groups[name].allocator.num_blocks, op,
                                 write, "(block 0 is the null block; -1 is padding)")
    return out


def _check_shapes(expected, given, op: str) -> None:
    """``InvalidArgument`` unless ``given`` has the pytree structure, shapes
    and dtypes of ``expected`` (abstract values)."""
    want, want_def = jax.tree.flatten(expected)
    got, got_def = jax.tree.flatten(given)
    if want_def != got_def:
        raise InvalidArgument(f"{op}: data has structure {got_def}, expected {want_def} (read from a manager "
                              "with another schedule or other ids?)")
    for i, (w, g) in enumerate(zip(want, got)):
        if tuple(w.shape) != tuple(g.shape) or np.dtype(w.dtype) != np.dtype(g.dtype):
            raise InvalidArgument(f"{op}: data leaf {i} is {np.dtype(g.dtype).name}{list(g.shape)}, expected "
                                  f"{np.dtype(w.dtype).name}{list(w.shape)}")


# ----------------------------------------------------------------------------- public: rows and blocks


def read_state_rows(manager: KVCacheManager, rows: Ids) -> StateRows:
    """Every per-request state array of every layer at ``rows`` ``[n]``
    (slots ``1 .. max_requests``, snapshot rows ``num_slots + i``; -1 reads
    the padding row 0), gathered on the device by one jitted call. The
    manager is not changed. Raises ``InvalidId`` for any other row (concrete
    ids; traced ones read row 0). Compiles once per ``n``: pad with -1."""
    return _read_rows_jit(manager, _check_rows(manager, rows, "read_state_rows", write=False))


def write_state_rows(manager: KVCacheManager, rows: Ids, data: StateRows) -> KVCacheManager:
    """Row ``rows[i] <- data`` row ``i`` in every per-request array (-1:
    skipped), one jitted scatter; ``manager`` is donated. Raises
    ``InvalidId`` for a row out of range, ``InvalidArgument`` for a repeated
    row or ``data`` not shaped as :func:`read_state_rows` of ``len(rows)``
    rows of this manager. Nothing changes when it raises."""
    ids = _check_rows(manager, rows, "write_state_rows", write=True)
    _check_shapes(jax.eval_shape(_gather_rows, manager, ids), data, "write_state_rows")
    return _write_rows_jit(manager, ids, data)


def read_blocks(manager: KVCacheManager, blocks: Mapping[str, Ids]) -> BlockData:
    """Every layer's data of block ids ``blocks[g]`` (``[n_g]``, -1 reads
    the null block) of each named group ``g`` (a subset of the manager's):
    compressed entries and CSA indexer keys of the group's DeepSeek-V4
    layers, pages of ``full_pool`` / ``mla_pool`` for ``"full"`` /
    ``"mla"``. One jitted gather; the manager is not changed. Whether the
    blocks are held is not checked (read what you own). Raises
    ``InvalidArgument`` for an unknown group, ``InvalidId`` for an id
    outside ``[1, num_blocks)``."""
    return _read_blocks_jit(manager, _check_blocks(manager, blocks, "read_blocks", write=False))


def write_blocks(manager: KVCacheManager, blocks: Mapping[str, Ids], data: BlockData) -> KVCacheManager:
    """Inverse of :func:`read_blocks`: block ``blocks[g][i] <- data`` row
    ``i`` in every layer of group ``g`` (-1 skipped), one jitted scatter;
    ``manager`` is donated. The caller owns the target blocks (nothing
    checks that they are held: writing another request's block corrupts
    it). Raises as :func:`read_blocks`, and ``InvalidArgument`` for a
    repeated id or ``data`` not shaped for these ids."""
    ids = _check_blocks(manager, blocks, "write_blocks", write=True)
    _check_shapes(jax.eval_shape(_gather_blocks, manager, ids), data, "write_blocks")
    return _write_blocks_jit(manager, ids, data)


# ----------------------------------------------------------------------------- host store


def _device_of(device) -> jax.Device:
    return device if device is not None else jax.devices()[0]


def _pinned_sharding(device: jax.Device) -> SingleDeviceSharding | None:
    """Pinned host memory of ``device`` when the backend has it and a round
    trip through it works (the probe), else None."""
    if "pinned_host" not in {memory.kind for memory in device.addressable_memories()}:
        return None
    sharding = SingleDeviceSharding(device, memory_kind="pinned_host")
    try:
        probe = jax.device_put(jnp.arange(4, dtype=jnp.int32), sharding)
        back = jax.device_put(probe, SingleDeviceSharding(device, memory_kind="device"))
        if not np.array_equal(np.asarray(back), np.arange(4)):
            return None
    except Exception:  # noqa: BLE001 - any backend refusal means "unsupported"
        return None
    return sharding


class _Transfers:
    """The one transfer path each way for a device: to pinned host memory
    (``jax.device_put``) or to numpy (``jax.device_get``), and back with one
    ``jax.device_put`` of the whole tree."""

    def __init__(self, memory_kind: str, device=None):
        if memory_kind not in ("auto", "pinned_host", "numpy"):
            raise InvalidArgument(f"memory_kind={memory_kind!r}: choose 'auto', 'pinned_host' or 'numpy'")
        self.device = _device_of(device)
        self.host_sharding = None if memory_kind == "numpy" else _pinned_sharding(self.device)
        if memory_kind == "pinned_host" and self.host_sharding is None:
            raise InvalidArgument(f"the {self.device.platform} backend has no usable pinned_host memory kind")
        self.device_sharding = SingleDeviceSharding(self.device, memory_kind=self.device.default_memory().kind)

    @property
    def memory_kind(self) -> str:
        return "numpy" if self.host_sharding is None else "pinned_host"

    def to_host(self, tree):
        if self.host_sharding is None:
            return jax.device_get(tree)
        return jax.device_put(tree, self.host_sharding)

    def to_device(self, tree):
        return jax.device_put(tree, self.device_sharding)


_TRANSFERS: dict[tuple, _Transfers] = {}


def _transfers(memory_kind: str, device=None) -> _Transfers:
    """One probe per (memory kind, device)."""
    key = (memory_kind, _device_of(device))
    if key not in _TRANSFERS:
        _TRANSFERS[key] = _Transfers(memory_kind, device)
    return _TRANSFERS[key]


def _key_repr(key, limit: int = 60) -> str:
    """``repr(key)`` cut to ``limit`` characters, for an error message."""
    text = repr(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HostStore:
    """Pytrees (:class:`StateRows`, :class:`BlockData`,
    :class:`RequestImage`, anything with array leaves) in host memory under
    hashable keys, up to ``capacity_bytes`` in all.

    ``memory_kind``: ``"auto"`` (the device's ``pinned_host`` memory where
    it works, else numpy), ``"pinned_host"`` (``InvalidArgument`` if the
    backend has none) or ``"numpy"``. Arrays come back to ``device``
    (default: the first device).

    ``scrub`` (scrub-on-free): :meth:`pop` and :meth:`discard` zero a numpy
    tree's arrays in place before letting them go (pinned-host arrays are
    immutable: they are released, not overwritten).

    Invariant: ``nbytes`` is the sum of :func:`tree_nbytes` of the stored
    trees and never exceeds ``capacity_bytes``. A full store refuses a put
    with ``KVCacheOOM`` (requested / available / total bytes): the caller
    is out of host memory it was given, exactly as an allocator is out of
    blocks; nothing is stored then. This is host state (a dict), not a pytree.
    """

    def __init__(self, capacity_bytes: int, *, memory_kind: str = "auto", device=None):
        capacity_bytes = _host.int_scalar(capacity_bytes, "capacity_bytes")
        if capacity_bytes < 0:
            raise InvalidArgument(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._transfers = _transfers(memory_kind, device)
        self._items: dict[Hashable, tuple[object, int]] = {}
        self._used = 0
        self.scrub = False

    @property
    def memory_kind(self) -> str:
        """``"pinned_host"`` or ``"numpy"``: where the stored arrays live."""
        return self._transfers.memory_kind

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._used

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key) -> bool:
        return key in self._items

    def keys(self) -> list:
        return list(self._items)

    def put(self, key: Hashable, tree) -> None:
        """Copy ``tree`` to host memory under ``key`` (one transfer). Raises
        ``InvalidArgument`` when ``key`` is already stored, ``KVCacheOOM``
        when it does not fit; nothing is stored then."""
        if key in self._items:
            raise InvalidArgument(f"HostStore.put: key {key!r} is already stored (pop it first)")
        size = tree_nbytes(tree)
        if size > self.free_bytes:
            raise KVCacheOOM(size, self.free_bytes, self.capacity_bytes, unit="bytes",
                             detail=f"HostStore.put({_key_repr(key)})")
        self._items[key] = (self._transfers.to_host(tree), size)
        self._used += size

    def get(self, key: Hashable):
        """The tree under ``key``, on the device (one transfer); it stays stored."""
        return self._transfers.to_device(self._entry(key, "get")[0])

    def get_host(self, key: Hashable):
        """The tree under ``key`` as stored (host arrays), no transfer."""
        return self._entry(key, "get_host")[0]

    def pop(self, key: Hashable):
        """The tree under ``key``, on the device, and remove it."""
        tree, size = self._entry(key, "pop")
        out = self._transfers.to_device(tree)
        del self._items[key]
        self._used -= size
        if self.scrub:
            jax.block_until_ready(out)  # the copy has read the host arrays before they are wiped
            wipe_host(tree)
        return out

    def discard(self, key: Hashable) -> None:
        """Remove ``key`` without a transfer (absent: nothing happens)."""
        if key in self._items:
            tree, size = self._items.pop(key)
            self._used -= size
            if self.scrub:
                wipe_host(tree)

    def _entry(self, key, op: str):
        if key not in self._items:
            raise InvalidArgument(f"HostStore.{op}: no tree under key {_key_repr(key)} "
                                  f"({len(self._items)} stored)")
        return self._items[key]


def wipe_host(tree) -> None:
    """Zero every writable numpy array of ``tree`` in place (scrub-on-free
    of host copies about to be dropped; other leaves are left alone)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, np.ndarray) and leaf.flags.writeable:
            leaf[...] = 0


# ----------------------------------------------------------------------------- request images


def _padded(ids: np.ndarray) -> np.ndarray:
    return _host.padded_ids(ids) if ids.size else np.full((1,), -1, np.int32)


def swap_out_request(manager: KVCacheManager, slot: int, *, memory_kind: str = "auto", keep_slot: bool = False
                     ) -> tuple[KVCacheManager, RequestImage | None, bool]:
    """Take request ``slot`` off the device: its state rows, the data of
    every block of its tables in every group and its ``seq_len`` as a
    :class:`RequestImage` in host memory (``memory_kind`` as
    :class:`HostStore`'s), then release the slot exactly as
    ``KVCacheManager.release`` does (its blocks lose this owner: a block
    shared with a prefix cache or another slot keeps the others); with
    ``keep_slot`` the slot stays held and empty, for the image to come back
    into (a scheduler that keeps the request's row). One jitted call (read + release, ``manager`` donated) and one transfer.

    Returns ``(manager, image, ok)``; when ``slot`` is not a held request
    slot: ``(manager, None, False)`` and nothing changed (nothing donated).
    Raises ``InvalidArgument`` for a slot that is not an integer."""
    slot = _host.int_scalar(slot, "slot")
    if not 1 <= slot < manager.num_slots:
        return manager, None, False
    held, seq_len, lens, tables = jax.device_get(_slot_facts_jit(manager, jnp.int32(slot)))
    if not held:
        return manager, None, False
    blocks = {name: _padded(np.asarray(tables[name][: int(lens[name])])) for name in manager.groups}
    rows = np.asarray(_image_rows(manager, slot), np.int32)
    manager, state, data, ok = _swap_out_jit(manager, jnp.int32(slot), rows, blocks, keep_slot=bool(keep_slot))
    if not bool(ok):  # the release refused (it cannot for a held slot): unchanged, as release leaves it
        return manager, None, False
    image = RequestImage(state=state, blocks=data, seq_len=int(seq_len),
                         num_blocks=tuple((name, int(lens[name])) for name in manager.groups))
    image = _transfers(memory_kind).to_host(image)
    return manager, image, True


def swap_in_request(manager: KVCacheManager, image: RequestImage, slot: int) -> tuple[KVCacheManager, bool]:
    """Bring ``image`` back into ``slot``, an admitted, empty slot (any id,
    not necessarily the one it left): in every group take fresh blocks for
    the image's table (as many as it held), write their data, set the
    table, ``seq_len`` and the state rows (with ``capture_every``, the
    staging snapshot too). The slot then decodes exactly as the request
    would have. One transfer of the image to the device and one jitted
    call (``manager`` donated).

    Returns ``(manager, ok)``. All or nothing: ``ok`` False and nothing
    changed when the slot is not held or not empty or a group has fewer
    free blocks than the image needs. Raises ``InvalidArgument`` for an
    image of another manager's layout or one holding more blocks than a
    table has room for, or a slot that is not an integer."""
    slot = _host.int_scalar(slot, "slot")
    if not isinstance(image, RequestImage):
        raise InvalidArgument(f"swap_in_request: image must be a RequestImage, got {type(image).__name__}")
    counts = dict(image.num_blocks)
    if sorted(counts) != sorted(manager.groups):
        raise InvalidArgument(f"swap_in_request: the image has groups {sorted(counts)}, the manager "
                              f"{sorted(manager.groups)}")
    for name, group in manager.groups.items():
        if not 0 <= counts[name] <= group.max_blocks:
            raise InvalidArgument(f"swap_in_request: the image holds {counts[name]} {name} blocks, a table holds "
                                  f"{group.max_blocks}")
    widths = {name: np.full((_padded(np.zeros(counts[name], np.int32)).size,), -1, np.int32) for name in counts}
    expected = jax.eval_shape(lambda m: (_gather_rows(m, _image_rows(m, 1)), _gather_blocks(m, widths)), manager)
    _check_shapes(expected, (image.state, image.blocks), "swap_in_request")
    in_range = 1 <= slot < manager.num_slots
    state, blocks = _transfers("auto").to_device((image.state, image.blocks))
    manager, ok = _swap_in_jit(manager, jnp.int32(slot if in_range else -1), jnp.int32(image.seq_len),
                               {name: jnp.int32(counts[name]) for name in manager.groups}, state, blocks)
    return manager, bool(ok)


def swap_in_error(manager: KVCacheManager, image: RequestImage, slot: int) -> KVCacheError | None:
    """Why :func:`swap_in_request` of these arguments fails on this manager
    (``InvalidId``: the slot is not a held request slot or is not empty;
    ``KVCacheOOM``: the first group with fewer free blocks than the image
    needs), or None when it succeeds (the explainer style of
    :mod:`jaxkv._host`; argument errors raise as in :func:`swap_in_request`)."""
    slot = _host.int_scalar(slot, "slot")
    if not isinstance(image, RequestImage):
        raise InvalidArgument(f"swap_in_request: image must be a RequestImage, got {type(image).__name__}")
    if not 1 <= slot < manager.num_slots or int(manager.slots.ref_counts[slot]) < 1:
        return InvalidId(f"swap_in_request: slot {slot} is not held (request slots are 1 .. "
                         f"{manager.max_requests}; admit one first)", [slot])
    lens = {n: int(g.lens[slot]) for n, g in manager.groups.items()}
    if int(manager.seq_lens[slot]) or any(lens.values()):
        return InvalidId(f"swap_in_request: slot {slot} is not empty ({int(manager.seq_lens[slot])} tokens, "
                         f"blocks {lens})", [slot])
    counts = dict(image.num_blocks)
    for name, group in manager.groups.items():
        free = int(group.allocator.num_free)
        if counts.get(name, 0) > free:
            return KVCacheOOM(counts[name], free, group.allocator.capacity, unit=f"{name} blocks",
                              detail=f"swap_in_request into slot {slot}")
    return None


def swap_in_request_or_raise(manager: KVCacheManager, image: RequestImage, slot: int) -> KVCacheManager:
    """Host path of :func:`swap_in_request`: the new manager, or the typed
    error of :func:`swap_in_error`, raised before anything is donated or
    changed."""
    error = swap_in_error(manager, image, slot)
    if error is not None:
        raise error
    manager, ok = swap_in_request(manager, image, slot)
    if not ok:
        raise _host.unexplained("swap_in_request", [slot])
    return manager


# ----------------------------------------------------------------------------- measurement


def transfer_rate(manager: KVCacheManager, num_blocks: int, *, repeats: int = 3, memory_kind: str = "auto"
                  ) -> tuple[KVCacheManager, float]:
    """Measured GB/s of a round trip of blocks ``1 .. num_blocks`` of every
    group (each group clipped to its blocks): jitted gather, transfer to
    host memory (``memory_kind`` as :class:`HostStore`'s), transfer back,
    jitted scatter into the same blocks (the data is unchanged; ``manager``
    is donated). Rate = ``2 * bytes / seconds``, the best of ``repeats``
    timed runs after one untimed (compiling) run. Returns ``(manager,
    GB/s)``. Raises ``InvalidArgument`` for ``num_blocks < 1`` or a manager
    without block groups."""
    num_blocks = _host.int_scalar(num_blocks, "num_blocks")
    repeats = _host.int_scalar(repeats, "repeats")
    if num_blocks < 1 or repeats < 1 or not manager.groups:
        raise InvalidArgument(f"transfer_rate: num_blocks={num_blocks} and repeats={repeats} must be >= 1, and the "
                              f"manager needs block groups (it has {list(manager.groups)})")
    transfers = _transfers(memory_kind)
    ids = {name: _host.as_int32_ids(np.arange(1, min(num_blocks, g.allocator.capacity) + 1))
           for name, g in manager.groups.items()}
    best, size = float("inf"), 0
    for run in range(repeats + 1):
        start = time.perf_counter()
        data = _read_blocks_jit(manager, ids)
        host = jax.block_until_ready(transfers.to_host(data))
        manager = _write_blocks_jit(manager, ids, transfers.to_device(host))
        jax.block_until_ready(manager)
        if run:
            best = min(best, time.perf_counter() - start)
        size = tree_nbytes(data)
    return manager, 2 * size / best / 1e9
