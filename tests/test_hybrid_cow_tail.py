"""Token-grain prefix hits on the hybrid cache: ``KVCacheManager.attach_prefix``
with copy-on-write of a partly filled last block, and
``KVCacheManager.copy_blocks``.

Three small managers: DeepSeek-V4-style (SWA, CSA 4 twice, HCA 128),
Qwen3-Next-style (Gated DeltaNet and full attention, 16-token pages) and a
mixed one that has every paged store (CSA 4, HCA 32 with 4 entries per
block, full attention and MLA in fp8 with scales, SWA, linear). Every
block-indexed array is filled with fresh random bits (never zeros) before
a check, and the expectations are computed here, in numpy, from the layout
the manager documents: a leaf's group and block axis come from its path
(``v4_stores[c].entries`` / ``index_keys``: the store class's group, axis 1;
``full_pool`` / ``mla_pool``: the ``full`` / ``mla`` group, axis 2), a
group's block count and partly filled last block from ``tokens_per_entry``
and ``entries_per_block`` as written below, not from ``BlockGroup``.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid import KVCacheManager, v4_layout
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerSpec,
    deepseek_v4_schedule,
    qwen3_next_schedule,
)
from jaxkv.pool.compressed import store_entries
from kernels_pallas.formats import EntryFormat
from tests.util import pool_sized_copies, pool_sized_updates

FMT = EntryFormat("cow-tail", nope_dim=16, rope_dim=8, group_size=16, scale_kind="ue8m0")
MAX_REQS = 3
CONTEXT = 512
ROWS = 2  # rows of every attach call (padded with -1)

SPECS = {
    "dsv4": dict(
        config=HybridConfig(entry_format=FMT, window=4, index_head_dim=16, index_topk=2, num_kv_heads=1,
                            kv_head_dim=8, page_size=16),
        schedule=deepseek_v4_schedule([0, 4, 128, 4, 128]),
        num_blocks={"csa4": 14, "hca128": 14},
        # group: (tokens per entry, entries per block)
        shape={"csa4": (4, 32), "hca128": (128, 1)}),
    "qwen3_next": dict(
        config=HybridConfig(num_kv_heads=2, kv_head_dim=8, kv_dtype=jnp.bfloat16, page_size=16,
                            linear_num_k_heads=1, linear_num_v_heads=1, linear_head_k_dim=4, linear_head_v_dim=4,
                            linear_conv_kernel=2, linear_dtype=jnp.float32),
        schedule=qwen3_next_schedule(4, 2),
        num_blocks={"full": 100},
        shape={"full": (1, 16)}),
    "mixed": dict(
        config=HybridConfig(entry_format=FMT, window=4, index_head_dim=16, index_topk=2, num_kv_heads=1,
                            kv_head_dim=16, mla_value_dim=8, kv_dtype=jnp.float8_e4m3fn, page_size=16,
                            linear_num_k_heads=1, linear_num_v_heads=1, linear_head_k_dim=4, linear_head_v_dim=4,
                            linear_conv_kernel=2, linear_dtype=jnp.float32),
        schedule=[LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.CSA, 4),
                  LayerSpec(2, AttentionKind.HCA, 32), LayerSpec(3, AttentionKind.FULL),
                  LayerSpec(4, AttentionKind.MLA), LayerSpec(5, AttentionKind.LINEAR),
                  LayerSpec(6, AttentionKind.FULL), LayerSpec(7, AttentionKind.CSA, 4)],
        num_blocks={"csa4": 14, "hca32": 14, "full": 100, "mla": 100},
        shape={"csa4": (4, 32), "hca32": (32, 4), "full": (1, 16), "mla": (1, 16)}),
}

attach = jax.jit(KVCacheManager.attach_prefix)
copy_blocks = jax.jit(KVCacheManager.copy_blocks)
admit = jax.jit(KVCacheManager.admit, static_argnames=("max_n",))
reserve = jax.jit(lambda m, slots, num_new: m.reserve(slots, num_new, max_new_tokens=CONTEXT))


def blocks_for(name: str, group: str, num_tokens: int) -> int:
    tokens_per_entry, entries_per_block = SPECS[name]["shape"][group]
    return math.ceil((num_tokens // tokens_per_entry) / entries_per_block)


def partly_filled(name: str, group: str, num_tokens: int) -> bool:
    tokens_per_entry, entries_per_block = SPECS[name]["shape"][group]
    return (num_tokens // tokens_per_entry) % entries_per_block != 0


@functools.cache
def new_manager(name: str) -> KVCacheManager:
    spec = SPECS[name]
    manager = KVCacheManager.create(spec["config"], spec["schedule"], MAX_REQS, max_context_tokens=CONTEXT,
                                    num_blocks=spec["num_blocks"])
    assert set(manager.groups) == set(spec["shape"])
    return manager


# ---------------------------------------------------------------- block arrays


def block_leaf(manager: KVCacheManager, path) -> tuple[str, int] | None:
    """``(group, block axis)`` of a leaf indexed by block id, else None."""
    keys = [getattr(k, "name", getattr(k, "idx", getattr(k, "key", None))) for k in path]
    if keys[0] == "v4_stores" and keys[2] in ("entries", "index_keys"):  # stacked: [layers, blocks, ...]
        return v4_layout(manager.schemas)[0][keys[1]].group, 1
    if keys[0] in ("full_pool", "mla_pool"):
        return keys[0].split("_")[0], 2
    return None


def bits(x) -> np.ndarray:
    """Raw bits of an array (bitwise comparison, NaN and -0.0 included)."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind in "fV" or x.dtype.itemsize < 4 else x


def randomize(manager: KVCacheManager, seed: int) -> KVCacheManager:
    """Fresh random bits in every block of every block-indexed array."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if block_leaf(manager, path) is None:
            return leaf
        dtype = np.dtype(leaf.dtype)
        if dtype == np.float32:
            return jnp.asarray(rng.standard_normal(leaf.shape, np.float32) + 2.0)
        raw = rng.integers(1, 2 ** (8 * dtype.itemsize - 2), leaf.shape, dtype=np.uint32).astype(f"u{dtype.itemsize}")
        return jnp.asarray(raw.view(dtype))  # below the top bits: finite in every float format

    return jax.tree_util.tree_map_with_path(fill, manager)


def expected_copy(manager: KVCacheManager, pairs: dict) -> KVCacheManager:
    """``manager`` with block ``d <- s`` of each ``(s, d)`` of ``pairs[g]`` in
    every array of group ``g``, all reads first (numpy)."""
    def copy(path, leaf):
        where = block_leaf(manager, path)
        if where is None or not pairs.get(where[0]):
            return leaf
        group, axis = where
        old = np.asarray(leaf)
        new = old.copy()
        for s, d in pairs[group]:
            np.put_along_axis(new, np.full([1 if a == axis else n for a, n in enumerate(old.shape)], d),
                              np.take(old, [s], axis=axis), axis)
        return jnp.asarray(new)

    return jax.tree_util.tree_map_with_path(copy, manager)


def group_blocks(manager: KVCacheManager, group: str, block: int) -> list[np.ndarray]:
    """Block ``block``'s data in every array of ``group`` (bits)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(manager)[0]:
        where = block_leaf(manager, path)
        if where is not None and where[0] == group:
            out.append(bits(np.take(np.asarray(leaf), block, axis=where[1])))
    assert out, group
    return out


def assert_same(expected, actual):
    chex.assert_trees_all_equal(jax.device_get(expected), jax.device_get(actual), strict=True)


def pad_rows(rows: list[list[int]], width: int) -> jnp.ndarray:
    return jnp.asarray([r + [-1] * (width - len(r)) for r in rows] + [[-1] * width] * (ROWS - len(rows)), jnp.int32)


# ---------------------------------------------------------------- scenario


def source_state(name: str, num_tokens: int, seed: int) -> KVCacheManager:
    """Slots 1..3 admitted; slot 1 holds ``num_tokens`` tokens and a prefix
    cache holds its own reference to each of its blocks; every block holds
    random data."""
    manager, ids, ok = admit(new_manager(name), MAX_REQS, max_n=MAX_REQS)
    assert bool(ok) and ids.tolist() == [1, 2, 3]
    manager, _, ok = reserve(manager, jnp.asarray([1], jnp.int32), jnp.asarray([num_tokens], jnp.int32))
    assert bool(ok)
    manager, ok = manager.incref_blocks({g: manager.groups[g].tables[1] for g in manager.groups})
    assert bool(ok)
    return randomize(manager, seed)


def prefix_rows(manager: KVCacheManager, name: str, num_tokens: int, slots: list[int]) -> dict:
    """The blocks argument attaching slot 1's prefix to each of ``slots``."""
    out = {}
    for g, group in manager.groups.items():
        ids = np.asarray(group.tables[1])[: blocks_for(name, g, num_tokens)].tolist()
        out[g] = pad_rows([ids] * len(slots), group.max_blocks)
    return out


def attach_rows(manager, slots: list[int], blocks: dict, num_tokens: int):
    slot_arg = jnp.asarray(slots + [-1] * (ROWS - len(slots)), jnp.int32)
    return attach(manager, slot_arg, blocks, jnp.full((ROWS,), num_tokens, jnp.int32), jnp.full((ROWS,), -1, jnp.int32))


def check_attached(name: str, before: KVCacheManager, after: KVCacheManager, slots: list[int], num_tokens: int):
    """Full blocks shared (same ids, one more owner per slot); a partly
    filled last block copied into a fresh block per slot, bit for bit in
    every array of its group, the cached block's owners unchanged; nothing
    else changes but the tables, lens, allocators, seq_lens and the fresh
    blocks' data."""
    pairs = {}
    for g, group in after.groups.items():
        old = before.groups[g]
        nb = blocks_for(name, g, num_tokens)
        source = np.asarray(old.tables[1])[:nb].tolist()
        partial = partly_filled(name, g, num_tokens)
        free_before = set(np.asarray(old.allocator.free_ids)[: int(old.allocator.num_free)].tolist())
        counts_before = np.asarray(old.allocator.ref_counts)
        want = counts_before.copy()
        fresh = []
        for s in slots:
            row = np.asarray(group.tables[s]).tolist()
            assert int(group.lens[s]) == nb and all(b == -1 for b in row[nb:]), (g, s, row)
            shared = nb - 1 if partial else nb
            assert row[:shared] == source[:shared], (g, s, row, source)  # shared by reference
            for b in source[:shared]:
                want[b] += 1
            if partial:
                new = row[nb - 1]
                assert new != source[-1] and new in free_before and new not in fresh, (g, new, source)
                fresh.append(new)
                want[new] = 1
                pairs.setdefault(g, []).append((source[-1], new))
        np.testing.assert_array_equal(np.asarray(group.allocator.ref_counts), want, err_msg=g)
        others = [s for s in range(after.num_slots) if s not in slots]
        np.testing.assert_array_equal(np.asarray(group.tables)[others], np.asarray(old.tables)[others])
        np.testing.assert_array_equal(np.asarray(group.lens)[others], np.asarray(old.lens)[others])
        assert int(group.allocator.num_free) == int(old.allocator.num_free) - len(fresh), g
        free_after = set(np.asarray(group.allocator.free_ids)[: int(group.allocator.num_free)].tolist())
        assert free_after == free_before - set(fresh), g
        for new in fresh:  # the copy, bit for bit, in every layer of the group
            for a, b in zip(group_blocks(after, g, new), group_blocks(before, g, pairs[g][0][0])):
                np.testing.assert_array_equal(a, b)
    want_lens = np.asarray(before.seq_lens).copy()
    want_lens[slots] = num_tokens
    np.testing.assert_array_equal(np.asarray(after.seq_lens), want_lens)
    # Everything else: the expected pool copies; tables, lens, allocators and
    # seq_lens checked above are taken from ``after``.
    want = expected_copy(before, pairs).replace(groups=after.groups, seq_lens=after.seq_lens)
    assert_same(want, after)
    return {g: [d for _, d in p] for g, p in pairs.items()}


@functools.cache
def write_next_jit(name: str):
    """A jitted step writing fresh random data for slot ``slot`` at position
    ``pos`` in every paged layer: full/MLA layers through the manager's
    handle (``acquire`` / ``write_kv`` / ``update``), compressed layers at
    the entry ``pos // ratio`` located through the slot's block table."""
    def step(m: KVCacheManager, slot, pos, key):
        keys = iter(jax.random.split(key, 4 * len(m.schemas)))
        for schema in m.schemas:
            i = schema.layer_idx
            if schema.kind in (AttentionKind.FULL, AttentionKind.MLA):
                handle = m.acquire(i, jnp.reshape(slot, (1,)), jnp.reshape(pos, (1,)))
                pool = handle.kv_pool
                k = 3.0 + jax.random.normal(next(keys), (1, pool.k_heads, pool.k_dim))
                v = None if pool.is_mla else 3.0 + jax.random.normal(next(keys), (1, pool.v_heads, pool.v_dim))
                m = m.update(handle.write_kv(k, v))
            elif schema.group is not None:
                e = pos // schema.tokens_per_entry
                block = m.groups[schema.group].tables[slot, e // schema.entries_per_block]
                row = block * schema.entries_per_block + e % schema.entries_per_block
                # No block there (a group whose blocks are all full): past the pool, dropped.
                store, layer = m.v4_store_of(i)
                cache = m.v4_stores[store]
                row = jnp.reshape(jnp.where(block >= 0, row, cache.entries.nope_bits.shape[1]
                                            * schema.entries_per_block), (1,))
                new = {"entries": store_entries(cache.entries, row, 3.0 + jax.random.normal(
                    next(keys), (1, cache.entries.fmt.head_dim)), layer=layer)}
                if cache.index_keys is not None:
                    new["index_keys"] = store_entries(cache.index_keys, row, 3.0 + jax.random.normal(
                        next(keys), (1, cache.index_keys.fmt.head_dim)), layer=layer)
                m = m.replace(v4_stores=m.v4_stores[:store] + (cache.replace(**new),) + m.v4_stores[store + 1:])
        return m

    return jax.jit(step)


# ---------------------------------------------------------------- attach tests


def non_aligned_lengths(name: str, rng, count: int) -> list[int]:
    """Random lengths that leave at least one group's last block partly
    filled (and room for one more token and a copy per group)."""
    out = []
    while len(out) < count:
        n = int(rng.integers(1, CONTEXT - 64))
        if any(partly_filled(name, g, n) for g in SPECS[name]["shape"]):
            out.append(n)
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_attach_non_aligned_prefix_copies_the_partial_block(name):
    """Attach a random non-aligned prefix of slot 1 to slot 2: full blocks
    shared, the partial block copied into a fresh one, ref counts and free
    counts as expected; a write into the slot's copy leaves the cached
    block as it was; ``reserve`` then grows the table as for any slot of
    that length."""
    rng = np.random.default_rng(sum(map(ord, name)))
    for n in non_aligned_lengths(name, rng, 2) + [256]:  # 256: every group aligned, nothing copied
        before = source_state(name, n, int(rng.integers(1 << 30)))
        after, ok = attach_rows(before, [2], prefix_rows(before, name, n, [2]), n)
        assert bool(ok), (name, n)
        fresh = check_attached(name, before, after, [2], n)
        assert bool(fresh) == any(partly_filled(name, g, n) for g in after.groups), (n, fresh)

        # One more token for slot 2, written into its own (copied) last block.
        grown, _, ok = reserve(after, jnp.asarray([2], jnp.int32), jnp.asarray([1], jnp.int32))
        assert bool(ok)
        for g, group in grown.groups.items():
            want = blocks_for(name, g, n + 1)
            assert int(group.lens[2]) == want, (g, n)
            added = want - blocks_for(name, g, n)
            assert int(group.allocator.num_free) == int(after.groups[g].allocator.num_free) - added, (g, n)
        written = write_next_jit(name)(grown, jnp.int32(2), jnp.int32(n), jax.random.key(n))
        for g, ids in fresh.items():
            cached = int(before.groups[g].tables[1, blocks_for(name, g, n) - 1])
            for a, b in zip(group_blocks(written, g, cached), group_blocks(before, g, cached)):
                np.testing.assert_array_equal(a, b, err_msg=f"{g}: the cached block changed")
            changed = [not np.array_equal(a, b) for a, b in
                       zip(group_blocks(written, g, ids[0]), group_blocks(grown, g, ids[0]))]
            assert any(changed), (g, "the write did not land in the slot's copy")


@pytest.mark.parametrize("name", ["dsv4", "mixed"])
def test_attach_to_two_slots_gives_each_its_copy(name):
    """Two slots attach the same non-aligned prefix in one call: each gets
    its own fresh copy (one block per group per row)."""
    rng = np.random.default_rng(7)
    n = non_aligned_lengths(name, rng, 1)[0]
    before = source_state(name, n, 11)
    after, ok = attach_rows(before, [2, 3], prefix_rows(before, name, n, [2, 3]), n)
    assert bool(ok)
    check_attached(name, before, after, [2, 3], n)


def exhaust(manager: KVCacheManager, group: str, leave: int) -> KVCacheManager:
    """Hold all but ``leave`` of ``group``'s free blocks outside the tables
    (as a prefix cache's references would)."""
    g = manager.groups[group]
    take = int(g.allocator.num_free) - leave
    allocator, _, ok = g.allocator.acquire(take, max_n=g.allocator.capacity)
    assert bool(ok)
    return manager.replace(groups={**manager.groups, group: g.replace(allocator=allocator)})


@pytest.mark.parametrize("name", list(SPECS))
def test_attach_fails_unchanged_when_a_group_has_no_block_for_the_copy(name):
    """For each group that must copy: with no free block (one row) or one
    free block (two rows) the attach fails and every leaf is unchanged,
    whichever group is short (earlier groups in the dict included)."""
    rng = np.random.default_rng(3)
    n = next(n for n in non_aligned_lengths(name, rng, 50) if all(
        partly_filled(name, g, n) for g in SPECS[name]["shape"] if SPECS[name]["shape"][g][1] > 1))
    base = source_state(name, n, 5)
    for g in base.groups:
        if not partly_filled(name, g, n):
            continue
        for slots, leave in (([2], 0), ([2, 3], 1)):
            before = exhaust(base, g, leave)
            after, ok = attach_rows(before, slots, prefix_rows(before, name, n, slots), n)
            assert not bool(ok), (g, slots)
            assert_same(before, after)
        # One free block is enough for one row.
        before = exhaust(base, g, 1)
        after, ok = attach_rows(before, [2], prefix_rows(before, name, n, [2]), n)
        assert bool(ok), g
        assert int(after.groups[g].allocator.num_free) == 0


def test_attach_refuses_a_partial_block_no_one_holds():
    """The copied block is not adopted, but it must still be held: a row
    naming a free block there fails, unchanged."""
    name = "dsv4"
    n = 300  # csa4: 75 entries, 3 blocks, the last holds 11
    before = source_state(name, n, 9)
    blocks = prefix_rows(before, name, n, [2])
    free = int(before.groups["csa4"].allocator.free_ids[0])
    assert int(before.groups["csa4"].allocator.ref_counts[free]) == 0
    blocks["csa4"] = blocks["csa4"].at[0, 2].set(free)
    after, ok = attach_rows(before, [2], blocks, n)
    assert not bool(ok)
    assert_same(before, after)


# ---------------------------------------------------------------- copy_blocks


def test_copy_blocks_matches_a_numpy_copy():
    """Random pairs per group (swaps and chains included: every source is
    read before any destination is written), -1 pairs, block 0 and ids past
    the group skipped; the result equals a numpy copy leaf by leaf. A
    repeated destination copies nothing at all; bad arguments raise."""
    name = "mixed"
    manager = randomize(new_manager(name), 21)
    rng = np.random.default_rng(21)
    width = 8
    src, dst, pairs = {}, {}, {}
    for g, group in manager.groups.items():
        nb = group.allocator.num_blocks
        i0, i1, i2, i3, i4 = rng.permutation(np.arange(1, nb))[:5].tolist()
        # A swap, a chain (i3 is read before i2 overwrites it), then pairs
        # that are skipped: source 0, -1 on either side, a target past the
        # blocks, a negative target.
        s = [i0, i1, i2, i3, 0, -1, i4, i4]
        d = [i1, i0, i3, i4, i2, i2, nb, -7]
        src[g], dst[g] = jnp.asarray(s, jnp.int32), jnp.asarray(d, jnp.int32)
        pairs[g] = [(a, b) for a, b in zip(s, d) if 1 <= a < nb and 1 <= b < nb]
        assert len(pairs[g]) == 4
    out = copy_blocks(manager, src, dst)
    assert_same(expected_copy(manager, pairs), out)

    # A repeated destination in one group: no copy anywhere.
    bad = dict(dst, csa4=dst["csa4"].at[1].set(dst["csa4"][0]))
    assert_same(manager, copy_blocks(manager, src, bad))

    with pytest.raises(InvalidArgument, match="sources but"):
        manager.copy_blocks(src, dict(dst, full=jnp.full((width + 1,), -1, jnp.int32)))
    with pytest.raises(InvalidArgument, match="expected exactly"):
        manager.copy_blocks({g: v for g, v in src.items() if g != "mla"}, dst)


def test_donated_attach_updates_the_pools_in_place():
    """``attach_prefix`` donated (as the engine calls it) copies no
    block-indexed array: the partial-block copies are in-place scatters."""
    manager = new_manager("mixed")
    blocks = {g: jnp.full((ROWS, group.max_blocks), -1, jnp.int32) for g, group in manager.groups.items()}
    none = jnp.full((ROWS,), -1, jnp.int32)
    hlo = jax.jit(KVCacheManager.attach_prefix, donate_argnums=0).lower(
        manager, none, blocks, jnp.zeros((ROWS,), jnp.int32), none).compile().as_text()
    assert "input_output_alias" in hlo.splitlines()[0]
    leaves = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(manager)[0] if block_leaf(manager, path)]
    assert pool_sized_updates(hlo, min(leaf.nbytes for leaf in leaves))
    assert pool_sized_copies(hlo, shapes=[leaf.shape for leaf in leaves]) == []
