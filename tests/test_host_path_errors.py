"""Regressions of issue 26 (items 6-9): host-facing paths that lost blocks,
copied the wrong state or raised untyped errors. Each test failed before
its fix.

* ``BlockSpaceManager.trim_window``: a row named twice cleared its table
  entries while the release of their blocks failed (the blocks leaked); a
  window <= 0 (or a float) released every block of the row, the one the
  next token goes into included.
* ``KVCacheManager.capture``: an id past the slot range (a snapshot row)
  copied one cached snapshot over another.
* Untyped errors: ``attach_prefix`` / ``incref_blocks`` / ``release_blocks``
  with a blocks dict that lacks a group or names an unknown one; a
  checkpoint with one per-expert tensor of the wrong shape (numpy's
  ``ValueError`` from the expert fusion); a prefix-cache miss pinned the
  namespace root, ``reset`` went ahead and the later ``release`` raised.

The tiny hybrid model here (SWA, HCA ratio 128, full attention, Gated
DeltaNet; groups ``hca128`` and ``full``) and its helpers are shared with
``tests/test_fuzz_host_paths.py``.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KVPool
from jaxkv.errors import CacheLocked, InvalidArgument
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind, HybridConfig, LayerSpec
from jaxkv.prefix.block_cache import PrefixCacheManager
from kernels_pallas.formats import EntryFormat
from tests.util import assert_tree_equal

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# --------------------------------------------------------------------------
# A tiny hybrid model with snapshots (shared with test_fuzz_host_paths.py).
# --------------------------------------------------------------------------

FMT = EntryFormat("host-paths", nope_dim=16, rope_dim=8, group_size=16, scale_kind="ue8m0")
CONFIG = HybridConfig(entry_format=FMT, window=4, index_head_dim=16, index_topk=2, num_kv_heads=1, kv_head_dim=8,
                      kv_dtype=jnp.float32, page_size=32, linear_num_k_heads=1, linear_num_v_heads=1,
                      linear_head_k_dim=4, linear_head_v_dim=4, linear_conv_kernel=2, linear_dtype=jnp.float32)
SCHEDULE = [LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.HCA, 128), LayerSpec(2, AttentionKind.FULL),
            LayerSpec(3, AttentionKind.LINEAR)]
MAX_REQS = 3
NUM_SLOTS = MAX_REQS + 1
CONTEXT = 256  # hca128: 2 blocks of 128 tokens per slot; full: 8 pages of 32
UNIT = 128  # the prefix unit (lcm of the groups' block tokens) and capture_every
NUM_SNAPSHOTS = MAX_REQS + 2  # staging snapshots 0..2 for slots 1..3, cached ones 3, 4
STATE_ROWS = NUM_SLOTS + NUM_SNAPSHOTS
NUM_BLOCKS = {"hca128": 6, "full": 20}  # 5 and 19 usable
GROUPS = ("full", "hca128")
GROUP_TOKENS = {"hca128": 128, "full": 32}  # tokens per block
GROUP_WIDTH = {"hca128": 2, "full": 8}  # table columns
ROWS = MAX_REQS  # batch of every slot argument (padded with -1)


@functools.cache
def new_hybrid() -> KVCacheManager:
    """A fresh manager (made once: a pytree is never changed in place)."""
    return KVCacheManager.create(CONFIG, SCHEDULE, MAX_REQS, max_context_tokens=CONTEXT, num_blocks=NUM_BLOCKS,
                                 num_snapshots=NUM_SNAPSHOTS, capture_every=UNIT)


def state_leaves(manager: KVCacheManager) -> list:
    """Every per-request state array of ``manager`` with its state-row axis
    first (SWA and compressor rings of each layer, GDN recurrent and conv
    states), cut to the manager's state rows."""
    out = []
    for cache in manager.v4_stores:  # stacked [layers, rows, ...]: rows first
        out += [jnp.moveaxis(x, 1, 0) for x in (cache.swa.nope_bits, cache.swa.scales, cache.swa.rope_bits)]
        out += [jnp.moveaxis(getattr(cache, n), 1, 0) for n in ("comp_kv", "comp_score", "index_kv", "index_score")
                if getattr(cache, n) is not None]
    rows = manager.num_slots + manager.num_snapshots
    out = [leaf[:rows] for leaf in out]
    if manager.gdn is not None:
        out += [jnp.moveaxis(manager.gdn.recurrent_state, 1, 0)[:rows], jnp.moveaxis(manager.gdn.conv_bits, 1, 0)[:rows]]
    return out


def _random_like(key, shape, dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(key, shape, dtype)
    return jax.random.bits(key, shape, dtype)


@jax.jit
def stamp(manager: KVCacheManager, rows, key) -> KVCacheManager:
    """Fresh random data (never the initial state) in state rows ``rows``
    (-1 skipped) of every per-request array: so that a copy of one row over
    another shows."""
    rows = jnp.asarray(rows, jnp.int32)
    target = jnp.where(rows >= 0, rows, manager.num_slots + manager.num_snapshots + 10**6)  # dropped
    keys = iter(jax.random.split(key, 64))

    def fill(arr, axis=0):
        shape = list(arr.shape)
        shape[axis] = rows.shape[0]
        new = _random_like(next(keys), tuple(shape), arr.dtype)
        return arr.at[target].set(new, mode="drop") if axis == 0 else arr.at[:, target].set(new, mode="drop")

    stores = []
    for cache in manager.v4_stores:  # stacked [layers, rows, ...]
        swa = cache.swa.replace(nope_bits=fill(cache.swa.nope_bits, 1), scales=fill(cache.swa.scales, 1),
                                rope_bits=fill(cache.swa.rope_bits, 1))
        rings = {n: fill(getattr(cache, n), 1) for n in ("comp_kv", "comp_score", "index_kv", "index_score")
                 if getattr(cache, n) is not None}
        stores.append(cache.replace(swa=swa, **rings))
    gdn = manager.gdn
    if gdn is not None:
        gdn = gdn.replace(recurrent_state=fill(gdn.recurrent_state, 1), conv_bits=fill(gdn.conv_bits, 1))
    return manager.replace(v4_stores=tuple(stores), gdn=gdn)


hybrid_admit = jax.jit(lambda m, n: m.admit(n, max_n=ROWS))
hybrid_reserve = jax.jit(lambda m, slots, num_new: m.reserve(slots, num_new, max_new_tokens=CONTEXT))
hybrid_release = jax.jit(KVCacheManager.release)
hybrid_capture = jax.jit(KVCacheManager.capture)
hybrid_copy_state = jax.jit(KVCacheManager.copy_state)
hybrid_attach = jax.jit(KVCacheManager.attach_prefix)
hybrid_incref = jax.jit(KVCacheManager.incref_blocks)
hybrid_release_blocks = jax.jit(KVCacheManager.release_blocks)


def pad(ids, width: int = ROWS) -> jnp.ndarray:
    ids = list(ids)
    return jnp.asarray(ids + [-1] * (width - len(ids)), jnp.int32)


def all_held(tokens: int = UNIT) -> KVCacheManager:
    """Every slot held with ``tokens`` tokens reserved, every state row stamped."""
    manager, _, ok = hybrid_admit(new_hybrid(), MAX_REQS)
    manager, _, ok2 = hybrid_reserve(manager, pad(range(1, NUM_SLOTS)), pad([tokens] * MAX_REQS))
    assert bool(ok) and bool(ok2)
    return stamp(manager, jnp.arange(1, STATE_ROWS, dtype=jnp.int32), jax.random.key(0))


def empty_blocks(width: dict | None = None, groups=GROUPS) -> dict:
    width = width or GROUP_WIDTH
    return {g: jnp.full((ROWS, width[g]), -1, jnp.int32) for g in groups}


# --------------------------------------------------------------------------
# 6, 7: BlockSpaceManager.trim_window
# --------------------------------------------------------------------------

BS = 4


def _space(tokens: int = 18) -> BlockSpaceManager:
    """Row 0 holding ``tokens`` tokens (5 blocks of 4 for 18)."""
    m = BlockSpaceManager.create(num_device_blocks=12, num_host_blocks=0, block_size=BS, max_seqs=3,
                                 max_blocks_per_seq=6, watermark=0)
    return m.allocate_or_raise([0], tokens)


trim = jax.jit(BlockSpaceManager.trim_window, static_argnames="window")


def _assert_owned_once(m: BlockSpaceManager):
    """Ref counts equal table entries; the free stack holds exactly the rest."""
    tables = np.asarray(m.block_tables)
    named = tables[tables >= 0]
    refs = np.asarray(m.device.ref_counts)
    np.testing.assert_array_equal(refs, np.bincount(named, minlength=refs.size))
    free = np.asarray(m.device.free_ids)[: int(m.device.num_free)].tolist()
    assert sorted(free) == [b for b in range(1, refs.size) if refs[b] == 0], (free, refs)


@pytest.mark.parametrize("rows", [[0, 0], [0, -1, 0, 0]])
def test_trim_window_counts_a_repeated_row_once(rows):
    """Row 0 named twice: its table entries became -1 but the release of
    their blocks (each named twice, held once) failed as a double free, so
    three blocks were held by nobody and never freed. A repeated row is
    trimmed once (trimming is idempotent), as if named once."""
    m = _space()
    once, released_once = trim(m, jnp.asarray([0], jnp.int32), window=4)
    twice, released = trim(m, jnp.asarray(rows, jnp.int32), window=4)
    assert int(released_once) == int(released) == 3
    assert_tree_equal(once, twice)
    _assert_owned_once(twice)
    assert np.asarray(twice.block_tables)[0].tolist() == [-1, -1, -1, 4, 5, -1]
    assert int(twice.device.num_free) == 11 - 2


@pytest.mark.parametrize("window", [-5, 0, 2.5, 4.0, True, "4", None, np.float32(3)])
def test_trim_window_refuses_windows_that_are_not_positive_ints(window):
    """``trim_window(rows, -5)`` released every block of the row, the one
    the next token goes into included, and the next ``append_slots``
    reported ok with slot -2. The window is static: anything but a positive
    integer is an ``InvalidArgument`` naming it, at call time."""
    m = _space()
    with pytest.raises(InvalidArgument, match="window"):
        m.trim_window(jnp.asarray([0], jnp.int32), window)
    with pytest.raises(InvalidArgument, match="window"):
        trim(m, jnp.asarray([0], jnp.int32), window=window)
    # the row still grows into its own block
    pool = KVPool.create(num_pages=12, page_size=BS, num_layers=1, k_heads=1, k_dim=1, dtype=jnp.float32)
    _, _, slots, _, ok = m.append_slots(pool, jnp.asarray([0], jnp.int32), 1)
    assert bool(ok) and int(slots[0, 0]) == 5 * BS + 2


def test_trim_window_accepts_integer_windows_of_any_integer_type():
    m = _space()
    for window in (4, np.int64(4), np.int32(4)):
        out, released = m.trim_window(jnp.asarray([0], jnp.int32), window)
        assert int(released) == 3
        _assert_owned_once(out)
    out, released = m.trim_window(jnp.asarray([0], jnp.int32), 2**40)  # past int32: nothing is outside it
    assert int(released) == 0
    assert_tree_equal(m, out)


# --------------------------------------------------------------------------
# 8: KVCacheManager.capture
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NUM_SLOTS, NUM_SLOTS + 1, STATE_ROWS - 1, 2**31 - 1, -2, 0])
def test_capture_ignores_ids_outside_the_slot_range(bad):
    """``capture([NUM_SLOTS], [True])`` read the length of the last slot (the
    id was clipped), found it on a boundary and copied state row
    ``NUM_SLOTS`` (cached snapshot 0) over row ``2 * NUM_SLOTS - 1`` (cached
    snapshot ``NUM_SLOTS - 1``). Ids outside ``1 .. max_requests`` are
    ignored, like the -1 padding."""
    manager = all_held()
    after = hybrid_capture(manager, pad([bad]), jnp.ones((ROWS,), bool))
    assert_tree_equal(manager, after)


def test_capture_of_a_repeated_slot_copies_it_once():
    """A slot named twice captures once (the copies agree), and its staging
    snapshot holds its state in every layer, GDN included."""
    manager = all_held()
    after = hybrid_capture(manager, pad([2, 2]), jnp.ones((ROWS,), bool))
    for leaf_before, leaf_after in zip(state_leaves(manager), state_leaves(after)):
        want = np.asarray(leaf_before).copy()
        want[NUM_SLOTS + 1] = want[2]
        np.testing.assert_array_equal(np.asarray(leaf_after), want)


# --------------------------------------------------------------------------
# 9: untyped errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [("full",), ("hca128",), (), ("full", "hca128", "csa4"), ("full", "nope")])
def test_block_dicts_must_name_exactly_the_groups(groups):
    """A blocks dict that lacked a group raised ``KeyError`` in
    ``attach_prefix``; an unknown group raised ``KeyError`` in
    ``incref_blocks`` / ``release_blocks`` and was silently ignored by
    ``attach_prefix``. All three raise ``InvalidArgument`` naming the groups
    expected and given."""
    manager = all_held()
    blocks = empty_blocks({**GROUP_WIDTH, "csa4": 2, "nope": 2}, groups)
    calls = {"attach_prefix": lambda: manager.attach_prefix(pad([]), blocks, pad([]), pad([])),
             "incref_blocks": lambda: manager.incref_blocks(blocks),
             "release_blocks": lambda: manager.release_blocks(blocks)}
    for op, call in calls.items():
        with pytest.raises(InvalidArgument) as info:
            call()
        message = str(info.value)
        assert op in message and "['full', 'hca128']" in message and str(sorted(groups)) in message, message


def _rewrite(src: str, dst, name: str, shape) -> tuple:
    """Copy checkpoint ``src`` to ``dst`` with tensor ``name`` replaced by
    zeros of ``shape``; returns its old shape."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for file in os.listdir(src):
        if file == "config.json":
            with open(os.path.join(src, file)) as f, open(os.path.join(dst, file), "w") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    old = tensors[name].shape
    tensors[name] = np.zeros(shape, tensors[name].dtype)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return old


def _tiny_llama(path):
    from flax import nnx

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    LlamaForCausalLM(config, rngs=nnx.Rngs(0)).save_pretrained(path)
    return str(path)


# (checkpoint, tensor to break, how): one per-expert tensor per MoE family
# (the fusion raised numpy's ValueError) and one plain tensor per family.
CHECKPOINTS = [
    ("llama", "model.layers.0.mlp.up_proj.weight", "grow"),
    ("dsv3/small", "model.layers.1.mlp.experts.3.gate_proj.weight", "grow"),
    ("dsv3/small", "model.layers.1.mlp.experts.0.down_proj.weight", "rows"),
    ("dsv3/small", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "rows"),
    ("dsv4/small", "model.layers.0.ffn.experts.1.w3.weight", "grow"),
    ("dsv4/small", "model.layers.1.ffn.experts.0.w2.weight", "drop"),
    ("dsv4/small", "model.layers.0.attn.wq_a.weight", "grow"),
    ("qwen3_next/small", "model.layers.0.mlp.experts.2.up_proj.weight", "rows"),
    ("qwen3_next/small", "model.layers.1.mlp.experts.5.down_proj.weight", "grow"),
    ("qwen3_next/small", "model.layers.0.linear_attn.A_log", "grow"),
]


@pytest.mark.parametrize("fixture,name,how", CHECKPOINTS, ids=[f"{c[0]}:{c[1]}" for c in CHECKPOINTS])
def test_from_pretrained_names_a_misshapen_tensor_and_both_shapes(tmp_path, fixture, name, how):
    """One tensor of the wrong shape: a per-expert tensor raised numpy's
    ``ValueError`` (from ``np.stack`` / ``np.concatenate`` while fusing the
    experts); every family raises ``InvalidArgument`` naming the tensor, the
    shape it has and the shape the model needs."""
    from jaxkv.nn import AutoModelForCausalLM

    src = _tiny_llama(tmp_path / "src") if fixture == "llama" else os.path.join(FIXTURES, fixture)
    from safetensors import safe_open

    with safe_open(os.path.join(src, "model.safetensors"), "np") as f:
        shape = tuple(f.get_slice(name).get_shape())
    bad = {"grow": shape[:-1] + (shape[-1] + 1,), "rows": (shape[0] + 2,) + shape[1:], "drop": shape[:-1]}[how]
    _rewrite(src, tmp_path / "bad", name, bad)
    with pytest.raises(InvalidArgument) as info:
        AutoModelForCausalLM.from_pretrained(tmp_path / "bad")
    message = str(info.value)
    assert repr(name) in message and str(bad) in message and str(shape) in message, message


def test_prefix_miss_pin_is_counted_and_blocks_reset():
    """A miss returns the namespace root; ``pin`` of it did nothing, so
    ``reset`` went ahead and the later ``release`` raised InvalidArgument
    (the root was gone). Root pins are counted: ``reset`` refuses
    (``CacheLocked``) while one is held, its release then succeeds, and a
    release with no pin left raises like any other node's."""
    cache = PrefixCacheManager(2)
    cache.insert([1, 2, 3, 4], [1, 2])
    miss = cache.match([7, 8, 9])
    assert miss.num_tokens == 0 and miss.node is cache.tree.root(None)
    cache.pin(miss.node)
    with pytest.raises(CacheLocked, match="1 pin") as info:
        cache.reset()
    assert info.value.protected_tokens == 0
    assert cache.cached_length([1, 2, 3, 4]) == 4  # nothing changed
    cache.tree.check_invariants()
    cache.release(miss.node)
    with pytest.raises(InvalidArgument, match="not pinned"):
        cache.release(miss.node)
    assert sorted(cache.reset()) == [1, 2]
    cache.check_invariants()


def test_prefix_miss_without_a_root_pins_nothing():
    """With nothing cached in the namespace a miss returns no node: pinning
    and releasing it are no-ops, and ``reset`` goes ahead."""
    cache = PrefixCacheManager(2)
    miss = cache.match([7, 8, 9], namespace="fresh")
    assert miss.node is None
    cache.pin(miss.node)
    assert cache.reset() == []
    cache.release(miss.node)


# --------------------------------------------------------------------------
# Found by tests/test_fuzz_host_paths.py (SnapshotMachine)
# --------------------------------------------------------------------------


def test_copy_state_with_a_repeated_destination_copies_nothing_in_any_layer():
    """Two pairs into one row: the SWA and compressor rings took one of the
    copies while the GDN pool refused the call (its rule: a repeated
    destination fails), so the row held half of one state. Now nothing is
    copied anywhere (the GDN pool's all-or-nothing rule for every layer)."""
    manager = all_held()
    after = hybrid_copy_state(manager, pad([1, 2, 3], 4), pad([NUM_SLOTS, NUM_SLOTS, NUM_SLOTS + 1], 4))
    assert_tree_equal(manager, after)
    # distinct destinations still copy, in every layer
    after = hybrid_copy_state(manager, pad([1, 2], 4), pad([NUM_SLOTS, NUM_SLOTS + 1], 4))
    for before_leaf, after_leaf in zip(state_leaves(manager), state_leaves(after)):
        want = np.asarray(before_leaf).copy()
        want[[NUM_SLOTS, NUM_SLOTS + 1]] = want[[1, 2]]
        np.testing.assert_array_equal(np.asarray(after_leaf), want)


def _with_cached_prefix():
    """Slot 1 holds one unit (1 hca128 block, 4 full pages), taken as a
    cached prefix (one more owner) and then released; slot 2 is admitted
    and empty. Returns ``(manager, {group: blocks})``."""
    manager, _, _ = hybrid_admit(new_hybrid(), 2)
    manager, _, ok = hybrid_reserve(manager, pad([1]), pad([UNIT]))
    blocks = {g: np.asarray(manager.groups[g].tables)[1, : int(manager.groups[g].lens[1])].tolist() for g in GROUPS}
    manager, ok2 = hybrid_incref(manager, {g: pad(blocks[g], ROWS * GROUP_WIDTH[g]).reshape(ROWS, -1)
                                           for g in GROUPS})
    manager, ok3 = hybrid_release(manager, pad([1]))
    assert bool(ok) and bool(ok2) and bool(ok3)
    return stamp(manager, jnp.arange(1, STATE_ROWS, dtype=jnp.int32), jax.random.key(1)), blocks


def _attach_rows(blocks: dict) -> dict:
    out = {}
    for g in GROUPS:
        arr = np.full((ROWS, GROUP_WIDTH[g]), -1, np.int32)
        arr[0, : len(blocks[g])] = blocks[g]
        out[g] = jnp.asarray(arr)
    return out


@pytest.mark.parametrize("case", ["hole", "repeat", "short", "long", "negative", "snapshot", "slot0", "slot-2",
                                  "snapshot_row"])
def test_attach_prefix_refuses_rows_that_do_not_match_their_tokens(case):
    """``attach_prefix`` adopted a row with a -1 among its blocks (the table
    then had a hole inside ``lens``), a block twice (named twice by one
    table), fewer blocks than its tokens need (the slot then read positions
    no block of its own held: another request's leftovers once the next
    reserve appended a block), a negative length, a snapshot past the
    snapshot rows (silently not copied), and treated slot 0 and -2 as
    padding. Each is refused now: ``ok`` False, nothing changed."""
    manager, blocks = _with_cached_prefix()
    slot, tokens, snapshot = 2, UNIT, 3
    rows = {g: list(b) for g, b in blocks.items()}
    if case == "hole":
        rows["full"][1] = -1
    elif case == "repeat":
        rows["full"][2] = rows["full"][1]
    elif case == "short":
        tokens = UNIT + 32
    elif case == "long":
        tokens = UNIT - 1
    elif case == "negative":
        tokens, rows = -UNIT, {g: [] for g in GROUPS}
    elif case == "snapshot":
        snapshot = NUM_SNAPSHOTS
    elif case == "slot0":
        slot = 0
    elif case == "slot-2":
        slot = -2
    elif case == "snapshot_row":
        slot = NUM_SLOTS
    good, ok = hybrid_attach(manager, pad([2]), _attach_rows(blocks), pad([UNIT]), pad([3]))
    assert bool(ok)  # the same call, well formed, succeeds
    after, ok = hybrid_attach(manager, pad([slot]), _attach_rows(rows), pad([tokens]), pad([snapshot]))
    assert not bool(ok)
    assert_tree_equal(manager, after)


def test_release_blocks_never_frees_a_block_a_table_names():
    """``release_blocks`` of a block only a slot's table holds dropped the
    table's owner: the block went back to the free stack while the slot
    still read and wrote it. Only references held outside the tables (a
    prefix cache's) may be released."""
    manager, _, _ = hybrid_admit(new_hybrid(), 1)
    manager, _, _ = hybrid_reserve(manager, pad([1]), pad([40]))
    page = int(manager.groups["full"].tables[1, 0])
    ids = {"full": pad([page], ROWS * GROUP_WIDTH["full"]).reshape(ROWS, -1),
           "hca128": jnp.full((ROWS, GROUP_WIDTH["hca128"]), -1, jnp.int32)}
    after, ok = hybrid_release_blocks(manager, ids)
    assert not bool(ok)
    assert_tree_equal(manager, after)
    increfed, ok = hybrid_incref(manager, ids)  # a cache's own reference: that one may go
    released, ok2 = hybrid_release_blocks(increfed, ids)
    assert bool(ok) and bool(ok2)
    assert_tree_equal(manager, released)
