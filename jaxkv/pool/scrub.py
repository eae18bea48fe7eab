"""Scrub-on-free: zero the bytes of every block whose last owner let go,
inside the jitted step that freed it (the engine's ``scrub_on_free``).

Without it a freed block keeps its K/V until a later owner overwrites the
positions it writes: no request ever *reads* them (attention masks past a
row's length, and the poison tests show it), but the bytes of a finished
request stay in device memory, where a memory dump, a debugging read or a
bug elsewhere could reach them. With it, the invariant is:

* every block whose reference count is 0 after a scrubbed step holds what
  a freshly built pool holds there (zero K and V bits and compressed
  entries, fp8 scales of 1, DeepSeek-V4 entry scales at their unit), in
  every array that stores its data, whatever freed it (a finished or
  aborted request, a prefix-cache eviction, a swap-out, a sliding window
  trimming a row's oldest blocks);
* per-request state rows (SWA, window and compressor rings, Gated DeltaNet
  conv and recurrent states) are reset to their initial values when their
  request slot or snapshot row is let go (``KVCacheManager.release`` always
  does this for slots; the hybrid cache resets dropped snapshot rows when
  scrubbing is on).

The null block (0) is scrubbed with them: padding lanes and finished rows
still running in a decode chunk write their K/V there (never read: attention
masks it), so a finished request's last token could otherwise stay in it.

A block is *freed by a step* when its count was positive before the step
and is 0 after it (``freed_blocks``). A step that frees and hands the same
block out again (a sliding window trimming a block that the next append
takes) must scrub between the two: ``decode_logits`` and the packed step
scrub right after ``trim_window``.

Cost: the freed ids are found with one pass over the reference counts
(``num_blocks`` int32s); a call that frees ``n`` blocks then writes exactly
``n`` blocks of data, by one of two methods that differ only in how the
backend pays for control flow (``zero_blocks``; both tested on CPU):

* on a GPU, ONE scatter whose width (8, 64, 512, ... or the pool) is the
  narrowest that holds the freed ids, picked at run time by ``lax.switch``:
  one launch whatever ``n`` (H100: +73 us to free 256 pages of a 268 MB
  pool, where 32 launches of a loop of 8-page scatters cost +776 us);
* on the CPU, 8 ids per scatter in a ``while_loop`` of ``ceil(n / 8)``
  steps: XLA's CPU backend copies a conditional's operands (the whole pool,
  ~0.1 s for 268 MB), and a wider scatter materializes its zeros first.
  (It also rewrites a whole bfloat16 / float8 array per scatter.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from jaxkv.alloc.block import BlockAllocator
from jaxkv.pool.kv_pool import KVPool

__all__ = ["CHUNK", "freed_blocks", "scrub_hybrid", "scrub_kv_pool", "zero_blocks"]

#: The narrowest scatter: most calls free none or one block.
CHUNK = 8


def freed_blocks(before: BlockAllocator, after: BlockAllocator, *, null: bool = True) -> Bool[Array, " num_blocks"]:
    """Blocks held before (count > 0) and free after (count 0), and with
    ``null`` the null block 0 (module docstring)."""
    freed = (before.ref_counts > 0) & (after.ref_counts == 0)
    return freed.at[0].set(True) if null else freed


def zero_blocks(arrays: list, axes: list[int], freed: Bool[Array, " num_blocks"], fills: list | None = None, *,
                method: str | None = None) -> list:
    """``arrays[i]`` with index ``b`` of axis ``axes[i]`` set to ``fills[i]``
    (default 0) for every ``freed[b]`` (every array's axis has
    ``num_blocks`` entries). ``method`` (static; default by backend, module
    docstring): ``"switch"``, one scatter of the narrowest width of
    ``CHUNK, CHUNK * 8, ...`` (and ``num_blocks``) that holds the freed ids,
    picked at run time; ``"loop"``, ``CHUNK`` ids per scatter in a loop of
    ``ceil(freed / CHUNK)`` steps."""
    if not arrays:
        return arrays
    fills = fills or [0] * len(arrays)
    method = method or ("loop" if jax.default_backend() == "cpu" else "switch")
    size = freed.shape[0]
    count = jnp.sum(freed, dtype=jnp.int32)
    # Freed ids first, then ``size`` (out of range: the scatter drops it); CHUNK more so no slice is clamped.
    ids = jnp.nonzero(freed, size=size + CHUNK, fill_value=size)[0].astype(jnp.int32)

    def scatter(arrs, chunk):
        return [a.at[(slice(None),) * axis + (chunk,)].set(fill, mode="drop")
                for a, axis, fill in zip(arrs, axes, fills)]

    if method == "loop":
        return jax.lax.fori_loop(0, (count + CHUNK - 1) // CHUNK, lambda i, arrs: scatter(
            arrs, jax.lax.dynamic_slice(ids, (i * CHUNK,), (CHUNK,))), list(arrays))
    widths = [CHUNK * 8 ** k for k in range(8) if CHUNK * 8 ** k < size] + [size]
    branch = sum((count > w).astype(jnp.int32) for w in widths[:-1]) if len(widths) > 1 else 0
    return jax.lax.switch(branch, [lambda arrs, w=w: scatter(arrs, ids[:w]) for w in widths], list(arrays))


def scrub_kv_pool(pool: KVPool, freed: Bool[Array, " num_blocks"]) -> KVPool:
    """The pages ``freed`` marks as a fresh pool has them, in every array of
    a paged pool: zero K and V bits, fp8 scales of 1 (pages are axis 2)."""
    names = [n for n in ("k_bits", "v_bits", "k_scales", "v_scales") if getattr(pool, n) is not None]
    zeroed = zero_blocks([getattr(pool, n) for n in names], [2] * len(names), freed,
                         [1.0 if n.endswith("scales") else 0 for n in names])
    return pool.replace(**dict(zip(names, zeroed)))


def scrub_hybrid(before, after):
    """``after`` (a :class:`~jaxkv.KVCacheManager`) with every block freed
    since ``before`` (the manager before the step, or its ``{group:
    allocator}``) zeroed, in every group: the full-attention and MLA
    pools' pages and DeepSeek-V4 layers' compressed entries and indexer
    keys (state rows are reset by the operations that let them go)."""
    if not isinstance(before, dict):
        before = {name: group.allocator for name, group in before.groups.items()}
    stores = list(after.v4_stores)
    pools = {"full": after.full_pool, "mla": after.mla_pool}
    for name, group in after.groups.items():
        freed = freed_blocks(before[name], group.allocator)
        if pools.get(name) is not None:
            pools[name] = scrub_kv_pool(pools[name], freed)
        for i in after.v4_group_stores(name):  # stacked [L, num_blocks, ...]: blocks are axis 1
            cache = stores[i]
            if cache.entries is None:
                continue
            parts = [cache.entries] + ([cache.index_keys] if cache.index_keys is not None else [])
            leaves = [x for p in parts for x in (p.nope_bits, p.scales, p.rope_bits)]
            fills = [f for p in parts for f in (0, p.fmt.unit_scale, 0)]
            zeroed = zero_blocks(leaves, [1] * len(leaves), freed, fills)
            entries = cache.entries.replace(nope_bits=zeroed[0], scales=zeroed[1], rope_bits=zeroed[2])
            index_keys = (cache.index_keys.replace(nope_bits=zeroed[3], scales=zeroed[4], rope_bits=zeroed[5])
                          if cache.index_keys is not None else None)
            stores[i] = cache.replace(entries=entries, index_keys=index_keys)
    return after.replace(v4_stores=tuple(stores), full_pool=pools["full"], mla_pool=pools["mla"])
