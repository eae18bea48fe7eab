"""The hybrid cache's host tier (jaxkv.manager.hybrid_host).

Expectations are built independently of the module: every per-request and
per-block array of the manager is named here field by field and indexed with
numpy, and the module's pytrees are compared with those, bit for bit, on
managers whose every array holds random bits (never zeros, so a row or block
that was not moved shows). The strongest check runs tiny random-weight
DeepSeek-V4 and Qwen3-Next models: a request swapped out mid-decode, other
requests churning through its freed blocks and rows, then swapped back into
another slot, continues with exactly the greedy tokens of an uninterrupted run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager.hybrid import KVCacheManager, v4_layout
from jaxkv.manager.hybrid_host import (
    HostStore,
    RequestImage,
    read_blocks,
    read_state_rows,
    swap_in_error,
    swap_in_request,
    swap_in_request_or_raise,
    swap_out_request,
    transfer_rate,
    tree_nbytes,
    write_blocks,
    write_state_rows,
)
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerSpec,
    deepseek_v4_schedule,
    qwen3_next_schedule,
)
from kernels_pallas import EntryFormat

TINY = EntryFormat("tiny", nope_dim=64, rope_dim=16, group_size=32, scale_kind="ue8m0")
K = AttentionKind
#: Every kind at once: SWA, two CSA layers sharing a group, HCA, full, MLA, linear.
MIXED = [LayerSpec(0, K.SWA), LayerSpec(1, K.CSA, 4), LayerSpec(2, K.HCA, 32), LayerSpec(3, K.FULL),
         LayerSpec(4, K.LINEAR), LayerSpec(5, K.MLA), LayerSpec(6, K.CSA, 4)]


def _config(**kw):
    base = {"entry_format": TINY, "window": 8, "index_head_dim": 16, "index_topk": 3, "num_kv_heads": 2,
            "kv_head_dim": 16, "mla_value_dim": 8, "page_size": 4, "linear_num_k_heads": 1, "linear_num_v_heads": 2,
            "linear_head_k_dim": 8, "linear_head_v_dim": 8, "linear_dtype": jnp.bfloat16}
    return HybridConfig(**{**base, **kw})


MANAGERS = {
    # DeepSeek-V4 style: SWA, CSA (ratio 4) and HCA (ratio 128) layers.
    "deepseek_v4": lambda: KVCacheManager.create(_config(), deepseek_v4_schedule([0, 4, 128, 4]), 3,
                                                 max_context_tokens=512, num_snapshots=2),
    # Qwen3-Next style: GDN layers and fp8 full attention (scales included).
    "qwen3_next": lambda: KVCacheManager.create(_config(kv_dtype=jnp.float8_e4m3fn), qwen3_next_schedule(4), 3,
                                                max_context_tokens=256, num_snapshots=2, max_track_slots=4),
    "mixed": lambda: KVCacheManager.create(_config(), MIXED, 3, max_context_tokens=512, num_snapshots=3,
                                           capture_every=16),
}


# ----------------------------------------------------------------------------- independent views


def _random_like(a, rng):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return a
    if jnp.issubdtype(a.dtype, jnp.floating):
        return np.asarray(jnp.asarray(rng.standard_normal(a.shape) + 3.0, a.dtype))  # no -inf, zeros unlikely
    info = np.iinfo(a.dtype)
    return rng.integers(info.min, info.max, a.shape, dtype=a.dtype, endpoint=True)


def _randomized(manager: KVCacheManager, seed: int) -> KVCacheManager:
    """The manager with every cache array (rings, entries, pools, GDN
    states) replaced by random bits; bookkeeping untouched."""
    rng = np.random.default_rng(seed)

    def fill(tree):
        return jax.tree.map(lambda a: jnp.asarray(_random_like(a, rng)), tree)

    gdn = manager.gdn
    if gdn is not None:
        gdn = gdn.replace(recurrent_state=fill(gdn.recurrent_state), conv_bits=fill(gdn.conv_bits))
    return manager.replace(v4_stores=fill(manager.v4_stores), full_pool=fill(manager.full_pool),
                           mla_pool=fill(manager.mla_pool), gdn=gdn)


def _entries_parts(prefix, entries):
    return {f"{prefix}.nope": entries.nope_bits, f"{prefix}.scales": entries.scales,
            f"{prefix}.rope": entries.rope_bits}


def _state_arrays(manager) -> dict[str, tuple[np.ndarray, int]]:
    """Every per-request array, named, with its row axis (written out field
    by field, not by tree_map)."""
    out = {}
    for i, c in enumerate(manager.v4_stores):  # stacked DeepSeek-V4 stores: [layers, rows, ...]
        for name, arr in _entries_parts(f"S{i}.swa", c.swa).items():
            out[name] = (np.array(arr), 1)
        for field in ("comp_kv", "comp_score", "index_kv", "index_score"):
            if getattr(c, field) is not None:
                out[f"S{i}.{field}"] = (np.array(getattr(c, field)), 1)
    if manager.gdn is not None:
        out["gdn.recurrent"] = (np.array(manager.gdn.recurrent_state), 1)
        out["gdn.conv"] = (np.array(manager.gdn.conv_bits), 1)
    if manager.window_pool is not None:
        for field in ("k_bits", "v_bits", "pos"):
            out[f"window.{field}"] = (np.array(getattr(manager.window_pool, field)), 1)
    return out


def _state_view(manager, rows) -> dict[str, tuple[object, int]]:
    """The same names for a StateRows pytree."""
    out = {}
    assert len(rows.v4_stores) == len(manager.v4_stores)
    for i, c in enumerate(rows.v4_stores):
        assert c.entries is None and c.index_keys is None
        for name, arr in _entries_parts(f"S{i}.swa", c.swa).items():
            out[name] = (arr, 1)
        for field in ("comp_kv", "comp_score", "index_kv", "index_score"):
            if getattr(c, field) is not None:
                out[f"S{i}.{field}"] = (getattr(c, field), 1)
    if rows.gdn_recurrent is not None:
        out["gdn.recurrent"] = (rows.gdn_recurrent, 1)
        out["gdn.conv"] = (rows.gdn_conv_bits, 1)
    if rows.window is not None:
        for field in ("k_bits", "v_bits", "pos"):
            out[f"window.{field}"] = (getattr(rows.window, field), 1)
    return out


def _block_arrays(manager) -> dict[str, dict[str, tuple[np.ndarray, int]]]:
    """Per group, every array indexed by its block ids, with the block axis."""
    out = {name: {} for name in manager.groups}
    for i, (s, c) in enumerate(zip(v4_layout(manager.schemas)[0], manager.v4_stores)):
        if c.entries is not None:
            parts = _entries_parts(f"S{i}.entries", c.entries)
            if c.index_keys is not None:
                parts.update(_entries_parts(f"S{i}.index", c.index_keys))
            out[s.group].update({n: (np.array(a), 1) for n, a in parts.items()})
    for group, pool in (("full", manager.full_pool), ("mla", manager.mla_pool)):
        if pool is not None:
            for field in ("k_bits", "v_bits", "k_scales", "v_scales"):
                if getattr(pool, field) is not None:
                    out[group][f"{group}.{field}"] = (np.array(getattr(pool, field)), 2)
    return out


def _block_view(manager, data) -> dict[str, dict[str, object]]:
    out = {}
    for group, g in data.groups.items():
        view = {}
        stores = manager.v4_group_stores(group)
        assert len(stores) == len(g.stores)
        for i, lb in zip(stores, g.stores):
            view.update(_entries_parts(f"S{i}.entries", lb.entries))
            if lb.index_keys is not None:
                view.update(_entries_parts(f"S{i}.index", lb.index_keys))
        if g.pages is not None:
            for field in ("k_bits", "v_bits", "k_scales", "v_scales"):
                if getattr(g.pages, field) is not None:
                    view[f"{group}.{field}"] = getattr(g.pages, field)
        out[group] = view
    return out


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))


def _host_copy(tree):
    """A numpy deep copy (the device buffers may be donated afterwards)."""
    return jax.tree.map(lambda a: np.array(a), tree)


def _assert_tree_equal(a, b, skip=()):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        if any(s in jax.tree_util.keystr(path) for s in skip):
            continue
        assert _same(x, y), jax.tree_util.keystr(path)


def _take(arr, ids, axis):
    return np.take(arr, np.where(np.asarray(ids) == -1, 0, ids), axis=axis)


# ----------------------------------------------------------------------------- rows and blocks


@pytest.mark.parametrize("kind", sorted(MANAGERS))
def test_state_rows_round_trip_bit_exact(kind):
    """Every per-request array is in the pytree (no more, no fewer leaves);
    a read gives exactly the rows asked (-1: row 0), a write puts them at
    other rows (a slot into a snapshot row and back) and changes nothing
    else but the write epochs."""
    manager = _randomized(MANAGERS[kind](), seed=1)
    total = manager.num_slots + manager.num_snapshots
    before = _state_arrays(manager)
    blocks_before = _host_copy((manager.groups, manager.full_pool, manager.mla_pool, manager.slots, manager.seq_lens))
    src = [2, total - 1, -1, 1]
    data = read_state_rows(manager, src)
    view = _state_view(manager, data)
    assert sorted(view) == sorted(before)
    assert len(jax.tree.leaves(data)) == len(before)
    for name, (arr, axis) in before.items():
        assert _same(view[name][0], _take(arr, src, axis)), name
    dst = [total - 2, 1, -1, 3]
    epochs = np.array(manager.write_epochs)
    manager = write_state_rows(manager, dst, data)
    after = _state_arrays(manager)
    for name, (arr, axis) in before.items():
        want = np.moveaxis(arr.copy(), axis, 0)
        moved = np.moveaxis(arr, axis, 0)
        for s, d in zip(src, dst):
            if d != -1:
                want[d] = moved[max(s, 0)]
        assert _same(np.moveaxis(after[name][0], axis, 0), want), name
    _assert_tree_equal(blocks_before, _host_copy((manager.groups, manager.full_pool, manager.mla_pool,
                                                 manager.slots, manager.seq_lens)))
    stores = list(range(len(manager.v4_stores)))
    stores += [len(manager.v4_stores) + 2] if manager.gdn is not None else []
    stores += [len(manager.v4_stores) + 3] if manager.window_pool is not None else []
    want_epochs = epochs.copy()
    want_epochs[stores] += 1
    assert np.array_equal(np.asarray(manager.write_epochs), want_epochs)


@pytest.mark.parametrize("kind", sorted(MANAGERS))
def test_blocks_round_trip_bit_exact(kind):
    """Every array indexed by a group's block ids is in the pytree; reads
    and writes move exactly the named blocks in every layer of the group."""
    manager = _randomized(MANAGERS[kind](), seed=2)
    before = _block_arrays(manager)
    state_before = _host_copy((_state_arrays(manager), manager.groups, manager.slots))
    src = {name: [3, 1, -1, g.allocator.num_blocks - 1] for name, g in manager.groups.items()}
    data = read_blocks(manager, src)
    view = _block_view(manager, data)
    assert sorted(view) == sorted(before)
    assert len(jax.tree.leaves(data)) == sum(len(v) for v in before.values())
    for group, arrays in before.items():
        assert sorted(view[group]) == sorted(arrays)
        for name, (arr, axis) in arrays.items():
            assert _same(view[group][name], _take(arr, src[group], axis)), name
    dst = {name: [2, 4, -1, 3] for name in manager.groups}
    manager = write_blocks(manager, dst, data)
    after = _block_arrays(manager)
    for group, arrays in before.items():
        for name, (arr, axis) in arrays.items():
            want = np.moveaxis(arr.copy(), axis, 0)
            moved = np.moveaxis(arr, axis, 0)
            for s, d in zip(src[group], dst[group]):
                if d != -1:
                    want[d] = moved[max(s, 0)]
            assert _same(np.moveaxis(after[group][name][0], axis, 0), want), name
    _assert_tree_equal(state_before, _host_copy((_state_arrays(manager), manager.groups, manager.slots)))
    # A subset of the groups: only those are read.
    first = next(iter(manager.groups))
    assert list(read_blocks(manager, {first: [1]}).groups) == [first]


def test_bad_ids_and_data_raise_before_anything_changes():
    manager = MANAGERS["mixed"]()
    total = manager.num_slots + manager.num_snapshots
    with pytest.raises(InvalidId, match=f"outside \\[1, {total}\\)"):
        read_state_rows(manager, [0])
    with pytest.raises(InvalidId):
        write_state_rows(manager, [total], read_state_rows(manager, [1]))
    with pytest.raises(InvalidArgument, match="more than once"):
        write_state_rows(manager, [2, 2], read_state_rows(manager, [1, 2]))
    with pytest.raises(InvalidArgument, match="expected"):
        write_state_rows(manager, [2], read_state_rows(manager, [1, 2]))
    with pytest.raises(InvalidArgument, match="not the manager's"):
        read_blocks(manager, {"nope": [1]})
    with pytest.raises(InvalidId, match="null block"):
        read_blocks(manager, {"csa4": [0]})
    with pytest.raises(InvalidArgument, match="more than once"):
        write_blocks(manager, {"full": [5, 5]}, read_blocks(manager, {"full": [1, 2]}))
    with pytest.raises(InvalidArgument, match="expected"):
        write_blocks(manager, {"full": [5]}, read_blocks(manager, {"csa4": [1]}))
    assert int(manager.slots.num_free) == manager.max_requests  # still usable: nothing was donated


# ----------------------------------------------------------------------------- host store


@pytest.mark.parametrize("memory_kind", ["auto", "numpy"])
def test_host_store_round_trip_and_capacity(memory_kind):
    manager = _randomized(MANAGERS["mixed"](), seed=3)
    rows = read_state_rows(manager, [1, 2])
    blocks = read_blocks(manager, {"csa4": [1, 2], "full": [3]})
    size_rows, size_blocks = tree_nbytes(rows), tree_nbytes(blocks)
    store = HostStore(size_rows + size_blocks, memory_kind=memory_kind)
    assert store.memory_kind == ("numpy" if memory_kind == "numpy" else "pinned_host")  # CPU has pinned_host
    store.put("rows", rows)
    store.put(("blocks", 7), blocks)
    assert store.nbytes == size_rows + size_blocks and store.free_bytes == 0 and len(store) == 2
    for leaf in jax.tree.leaves(store.get_host("rows")):
        if memory_kind == "numpy":
            assert isinstance(leaf, np.ndarray)
        else:
            assert leaf.sharding.memory_kind == "pinned_host"
    with pytest.raises(KVCacheOOM, match=f"requested {size_rows} bytes, 0 available \\(of {size_rows + size_blocks}"):
        store.put("more", rows)
    with pytest.raises(InvalidArgument, match="already stored"):
        store.put("rows", rows)
    back = store.get("rows")
    assert all(leaf.sharding.memory_kind == "device" for leaf in jax.tree.leaves(back))
    _assert_tree_equal(_host_copy(rows), _host_copy(back))
    assert "rows" in store and store.nbytes == size_rows + size_blocks  # get keeps it
    popped = store.pop(("blocks", 7))
    _assert_tree_equal(_host_copy(blocks), _host_copy(popped))
    assert store.nbytes == size_rows and ("blocks", 7) not in store
    with pytest.raises(InvalidArgument, match="no tree under key"):
        store.pop(("blocks", 7))
    store.discard("rows")
    assert store.nbytes == 0 and len(store) == 0
    with pytest.raises(InvalidArgument):
        HostStore(10, memory_kind="disk")


# ----------------------------------------------------------------------------- request images


def _table(manager, slot):
    return {n: np.asarray(g.tables[slot, : int(g.lens[slot])]) for n, g in manager.groups.items()}


def _request_view(manager, slot):
    """Independent copy of what a request in ``slot`` owns: its state rows
    (slot and staging snapshot), the contents of its blocks in table order,
    its seq_len and table lengths."""
    rows = [slot] + ([manager.num_slots + slot - 1] if manager.capture_every else [])
    state = {name: _take(arr, rows, axis) for name, (arr, axis) in _state_arrays(manager).items()}
    tables = _table(manager, slot)
    blocks = {name: _take(arr, tables[group], axis)
              for group, arrays in _block_arrays(manager).items() for name, (arr, axis) in arrays.items()}
    lens = {n: len(t) for n, t in tables.items()}
    return state, blocks, int(manager.seq_lens[slot]), lens


def _assert_views_equal(a, b):
    for part_a, part_b in zip(a[:2], b[:2]):
        assert sorted(part_a) == sorted(part_b)
        for name in part_a:
            assert _same(part_a[name], part_b[name]), name
    assert a[2:] == b[2:]


def _assert_bookkeeping(manager):
    """Every block named by a table is held, once per table entry at least,
    and no block is in two tables unless its count says so."""
    for name, g in manager.groups.items():
        counts = np.asarray(g.allocator.ref_counts)
        named = np.zeros_like(counts)
        tables, lens = np.asarray(g.tables), np.asarray(g.lens)
        for s in range(tables.shape[0]):
            assert (tables[s, lens[s]:] == -1).all()
            np.add.at(named, tables[s, : lens[s]], 1)
        assert (named <= counts).all(), name
        assert int(g.allocator.num_free) + int((counts[1:] > 0).sum()) == g.allocator.capacity


def test_swap_out_then_in_another_slot_restores_everything():
    manager = MANAGERS["mixed"]()
    manager, (a, b) = manager.admit_or_raise(2)
    manager, _ = manager.reserve_or_raise([a, b], [300, 40], max_new_tokens=512)
    manager = _randomized(manager, seed=4)
    # A prefix cache holds its own reference to the request's first csa4 block.
    shared = int(manager.groups["csa4"].tables[a, 0])
    refs = {n: np.full((1,), -1, np.int32) for n in manager.groups}
    manager, ok = manager.incref_blocks({**refs, "csa4": np.array([shared], np.int32)})
    assert bool(ok)
    expected = _request_view(manager, a)
    other = _request_view(manager, b)
    shared_data = {n: _take(arr, [shared], axis) for n, (arr, axis) in _block_arrays(manager)["csa4"].items()}
    free = {n: int(g.allocator.num_free) for n, g in manager.groups.items()}
    assert min(expected[3].values()) >= 3  # every group holds several blocks

    manager, image, ok = swap_out_request(manager, a)
    assert ok and isinstance(image, RequestImage) and image.seq_len == 300
    assert dict(image.num_blocks) == expected[3]
    assert all(leaf.sharding.memory_kind == "pinned_host" for leaf in jax.tree.leaves(image))
    assert int(manager.slots.ref_counts[a]) == 0 and int(manager.seq_lens[a]) == 0
    for n, g in manager.groups.items():  # every block back but the shared one
        assert int(g.allocator.num_free) == free[n] + expected[3][n] - (n == "csa4"), n
    assert int(manager.groups["csa4"].allocator.ref_counts[shared]) == 1
    for n, (arr, axis) in _block_arrays(manager)["csa4"].items():
        assert _same(_take(arr, [shared], axis), shared_data[n])
    _assert_views_equal(_request_view(manager, b), other)
    _assert_bookkeeping(manager)

    # Churn: another request takes slot a and the freed blocks, everything is rewritten.
    manager, (c,) = manager.admit_or_raise(1)
    assert c == a
    manager, _ = manager.reserve_or_raise([c], [200], max_new_tokens=512)
    manager = _randomized(manager, seed=5)
    manager, (d,) = manager.admit_or_raise(1)
    assert d not in (a, b)
    other = _request_view(manager, b)
    churn = _request_view(manager, c)

    manager, ok = swap_in_request(manager, image, b)  # not empty: refused
    assert not ok
    manager, ok = swap_in_request(manager, image, d)
    assert ok
    _assert_views_equal(_request_view(manager, d), expected)
    _assert_views_equal(_request_view(manager, b), other)
    _assert_views_equal(_request_view(manager, c), churn)
    _assert_bookkeeping(manager)
    assert shared not in _table(manager, d)["csa4"]  # a fresh copy, the cached block stays the cache's

    manager, ok = swap_in_request(manager, image, d)  # d holds blocks now: refused
    assert not ok
    manager, none, ok = swap_out_request(manager, manager.max_requests + 5)
    assert none is None and not ok


def test_swap_in_fails_unchanged_when_a_group_is_short():
    """csa4 has 3 blocks in all: the image needs all 3, a newcomer holds one."""
    manager = KVCacheManager.create(_config(), MIXED, 3, max_context_tokens=512, num_snapshots=3, capture_every=16,
                                    num_blocks={"csa4": 4, "hca32": 16, "full": 256, "mla": 256})
    manager, (a,) = manager.admit_or_raise(1)
    manager, _ = manager.reserve_or_raise([a], [300], max_new_tokens=512)
    manager = _randomized(manager, seed=6)
    expected = _request_view(manager, a)
    manager, image, ok = swap_out_request(manager, a, memory_kind="numpy")
    assert ok and all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(image))
    manager, (b,) = manager.admit_or_raise(1)
    manager, _ = manager.reserve_or_raise([b], [10], max_new_tokens=512)  # takes one csa4 block
    manager, (c,) = manager.admit_or_raise(1)
    assert int(manager.groups["csa4"].allocator.num_free) == 2
    before = _host_copy(manager)
    manager, ok = swap_in_request(manager, image, c)
    assert not ok
    _assert_tree_equal(before, _host_copy(manager))  # nothing at all changed, write epochs included
    with pytest.raises(KVCacheOOM, match="requested 3 csa4 blocks, 2 available \\(of 3 total\\)"):
        swap_in_request_or_raise(manager, image, c)
    with pytest.raises(InvalidId, match=f"slot {b} is not empty"):
        swap_in_request_or_raise(manager, image, b)
    _assert_tree_equal(before, _host_copy(manager))
    manager = manager.release_or_raise([b])
    assert swap_in_error(manager, image, c) is None
    manager = swap_in_request_or_raise(manager, image, c)
    _assert_views_equal(_request_view(manager, c), expected)


def test_transfer_rate_measures_and_leaves_data_unchanged():
    manager = _randomized(MANAGERS["mixed"](), seed=7)
    before = _host_copy((_block_arrays(manager), _state_arrays(manager)))
    manager, rate = transfer_rate(manager, 8, repeats=2)
    assert np.isfinite(rate) and rate > 0
    _assert_tree_equal(before, _host_copy((_block_arrays(manager), _state_arrays(manager))))
    with pytest.raises(InvalidArgument):
        transfer_rate(manager, 0)


# ----------------------------------------------------------------------------- models


@functools.lru_cache(maxsize=1)
def _models():
    from jaxkv.bench.prefix_families import family_models

    models = family_models()
    return {"deepseek_v4": models["deepseek-v4 (ring snapshots)"], "qwen3_next": models["qwen3-next (GDN snapshots)"]}


_reserve = jax.jit(lambda m, slots, n, width: m.reserve(slots, n, max_new_tokens=width), static_argnums=(3,))
_step = nnx.jit(lambda model, tokens, m, slots, starts, n: model(tokens, m, slots, starts, n))
_PREFILL = 32


def _feed(model, manager, slot, tokens):
    """``tokens`` through ``slot`` (chunks of _PREFILL, or one token);
    returns ``(manager, greedy next token, its logits)``."""
    width = 1 if len(tokens) == 1 else _PREFILL
    slots = jnp.asarray([slot], jnp.int32)
    for start in range(0, len(tokens), width):
        piece = tokens[start:start + width]
        n = jnp.asarray([len(piece)], jnp.int32)
        manager, starts, ok = _reserve(manager, slots, n, width)
        assert bool(ok)
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(piece)] = piece
        logits, manager = _step(model, jnp.asarray(padded), manager, slots, starts, n)
    last = np.asarray(logits[0, len(piece) - 1])
    return manager, int(np.argmax(last)), last


def _decode(model, manager, slot, token, steps):
    """``steps`` greedy tokens after ``token``: ``(manager, tokens, logits)``."""
    tokens, logits = [], []
    for _ in range(steps):
        manager, token, row = _feed(model, manager, slot, [token])
        tokens.append(token)
        logits.append(row)
    return manager, tokens, logits


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_swapped_request_decodes_as_if_never_swapped(family):
    """Prefill 150 tokens (past the SWA window, 2+ blocks per DeepSeek-V4
    group, 10 pages), decode 4 tokens, swap out; two other requests churn
    through the freed blocks and rows (prefill, decode); one leaves and the
    request comes back in its slot (not the original one), decoding
    alternately with the other. Its next 5 greedy tokens equal an
    uninterrupted run's, and so do their logits, bit for bit (the tiny
    random models' argmax barely depends on distant context, so the tokens
    alone would miss wrong block data; the logits do not)."""
    model = _models()[family]
    rng = np.random.default_rng(8)
    prompt = rng.integers(1, 512, 150).tolist()
    first, later = 4, 5

    reference = model.make_cache(3, 256)
    reference, (slot,) = reference.admit_or_raise(1)
    reference, token, _ = _feed(model, reference, slot, prompt)
    reference, want, want_logits = _decode(model, reference, slot, token, first + later)

    manager = model.make_cache(3, 256)
    manager, (slot,) = manager.admit_or_raise(1)
    manager, token, _ = _feed(model, manager, slot, prompt)
    manager, got, got_logits = _decode(model, manager, slot, token, first)
    assert got == want[:first]
    manager, image, ok = swap_out_request(manager, slot)
    assert ok and min(dict(image.num_blocks).values()) >= 2

    manager, churners = manager.admit_or_raise(2)
    assert slot in churners
    for i, c in enumerate(churners):
        manager, t, _ = _feed(model, manager, c, rng.integers(1, 512, 140 - 30 * i).tolist())
        manager, _, _ = _decode(model, manager, c, t, 2)
    manager = manager.release_or_raise([churners[1]])
    manager, (new_slot,) = manager.admit_or_raise(1)
    assert new_slot != slot
    manager, ok = swap_in_request(manager, image, new_slot)
    assert ok
    token, churn_token = got[-1], 7
    for _ in range(later):
        manager, token, row = _feed(model, manager, new_slot, [token])
        got.append(token)
        got_logits.append(row)
        manager, churn_token, _ = _feed(model, manager, churners[0], [churn_token])
    assert got == want
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        assert _same(a, b), f"logits of decode step {step} differ"
