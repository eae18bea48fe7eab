"""KVCacheManager (hybrid cache, seed 004): schemas, budgets, memory, the
request lifecycle against a plain-Python model, chunked compression, and a
200-step serving loop inside one jitted ``lax.scan`` with no host transfer.

Numerical equivalence of cached decoding with a no-cache recomputation is in
``test_hybrid_equivalence.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxkv.errors import InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerSpec,
    block_budget,
    build_schemas,
    deepseek_v4_schedule,
    qwen3_next_schedule,
    v4_flash_like_ratios,
)
from kernels_pallas import EntryFormat

TINY = EntryFormat("tiny", nope_dim=64, rope_dim=16, group_size=32, scale_kind="ue8m0")
TINY_CONFIG = HybridConfig(entry_format=TINY, window=8, index_head_dim=16, index_topk=3, num_kv_heads=2,
                           kv_head_dim=16, page_size=4, linear_num_k_heads=1, linear_num_v_heads=2,
                           linear_head_k_dim=8, linear_head_v_dim=8, linear_dtype=jnp.float32)
# SWA, CSA (ratio 4: 32 entries per block), HCA (ratio 32: 4 per block), full, linear.
MIXED = [LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.CSA, 4), LayerSpec(2, AttentionKind.HCA, 32),
         LayerSpec(3, AttentionKind.FULL), LayerSpec(4, AttentionKind.LINEAR)]


# --------------------------------------------------------------------------
# Schedules and schemas.
# --------------------------------------------------------------------------


def test_v4_schemas_have_the_reference_shapes():
    """DeepSeek-V4 defaults: CSA 32 entries per 128-token block with an
    8 x 1024 compressor ring and an 8 x 256 indexer ring; HCA 1 entry per
    block and a 128 x 512 ring; SWA-only layers page nothing."""
    schemas = build_schemas(deepseek_v4_schedule([0, 4, 128]), HybridConfig())
    swa, csa, hca = schemas
    assert (swa.group, swa.entries_per_block, swa.window, swa.compressor_rows) == (None, 0, 128, 0)
    assert (csa.group, csa.entries_per_block, csa.compressor_rows, csa.compressor_width) == ("csa4", 32, 8, 1024)
    assert (csa.index_compressor_width, csa.index_format.nope_dim, csa.index_topk) == (256, 128, 512)
    assert (hca.group, hca.entries_per_block, hca.compressor_rows, hca.compressor_width) == ("hca128", 1, 128, 512)
    assert csa.entry_format.bytes_per_entry == 584 and csa.index_format.bytes_per_entry == 132
    flash = v4_flash_like_ratios()
    assert len(flash) == 43 and flash[:4] == [0, 0, 4, 128] and set(flash) == {0, 4, 128}
    with pytest.raises(InvalidArgument, match="use 0, 4 or 128"):
        deepseek_v4_schedule([0, 8])
    with pytest.raises(InvalidArgument, match="must divide 128"):
        build_schemas([LayerSpec(0, AttentionKind.HCA, 48)], HybridConfig())
    kinds = [s.kind for s in qwen3_next_schedule(8)]
    assert kinds == [AttentionKind.LINEAR] * 3 + [AttentionKind.FULL] + [AttentionKind.LINEAR] * 3 + [AttentionKind.FULL]


def test_v4_flash_like_budget_and_memory_bytes_by_hand():
    """7 layers of the V4-Flash pattern (2 SWA, then CSA/HCA alternating) at
    the real entry format, 2 requests of up to 256 tokens."""
    config = HybridConfig()
    schedule = deepseek_v4_schedule(v4_flash_like_ratios(7))  # [0, 0, 4, 128, 4, 128, 4]
    manager = KVCacheManager.create(config, schedule, 2, max_context_tokens=256)
    blocks = 2 * (256 // 128) + 1  # per group: requests * blocks per request + the null block
    assert {n: g.allocator.num_blocks for n, g in manager.groups.items()} == {"csa4": blocks, "hca128": blocks}
    slots = 3
    entry = 448 + 7 + 2 * 64  # fp8 NoPE + ue8m0 exponents + bf16 RoPE, as stored (the packed 584 adds a pad byte)
    index_entry = 128 + 4
    swa_ring = slots * 128 * entry
    csa = swa_ring + blocks * 32 * entry + blocks * 32 * index_entry + 2 * slots * 8 * 1024 * 4 + 2 * slots * 8 * 256 * 4
    hca = swa_ring + blocks * 1 * entry + 2 * slots * 128 * 512 * 4
    group = (slots * 2 + slots) * 4 + ((blocks - 1) + 1 + blocks) * 4  # table, lens; allocator stack, top, counts
    slot_state = ((slots - 1) + 1 + slots) * 4 + slots * 4  # slot allocator + seq_lens
    epochs = (3 + 4) * 4  # write_epochs: one int32 per store (SWA, CSA, HCA classes; full, MLA, GDN, window pools)
    expected = 2 * swa_ring + 3 * csa + 2 * hca + 2 * group + slot_state + epochs
    assert manager.memory_bytes() == expected == 5_799_358


def test_qwen3_next_like_budget_and_memory_bytes_by_hand():
    """8 layers (6 Gated DeltaNet + 2 full attention) at Qwen3-Next's head
    shapes, 2 requests of up to 256 tokens, pages of 16."""
    config = HybridConfig(num_kv_heads=2, kv_head_dim=256, page_size=16, linear_num_k_heads=16,
                          linear_num_v_heads=32, linear_head_k_dim=128, linear_head_v_dim=128)
    manager = KVCacheManager.create(config, qwen3_next_schedule(8), 2, max_context_tokens=256)
    pages = 2 * 256 // 16 + 1
    slots = 3
    kv = 2 * (2 * 2 * pages * 16 * 256 * 2)  # K and V: [2 layers, 2 heads, pages, 16, 256] bf16
    conv_dim = 2 * 16 * 128 + 32 * 128
    gdn = 6 * slots * 32 * 128 * 128 * 4 + 6 * slots * conv_dim * 3 * 2
    group = slots * 16 * 4 + slots * 4 + ((pages - 1) + 1 + pages) * 4
    slot_state = ((slots - 1) + 1 + slots) * 4 + slots * 4
    assert manager.gdn.memory_bytes() == gdn
    epochs = (0 + 4) * 4  # write_epochs: one int32 per store (no DeepSeek-V4 class; full, MLA, GDN, window pools)
    assert manager.memory_bytes() == kv + gdn + group + slot_state + epochs


def test_budget_from_bytes_splits_tokens_evenly():
    config = HybridConfig()
    schemas = build_schemas(deepseek_v4_schedule([4, 128]), config)
    csa_block = 32 * (583 + 132)
    hca_block = 1 * 583
    per_token = csa_block / 128 + hca_block / 128
    budget = block_budget(schemas, config, kv_bytes=10_000_000)
    tokens = int(10_000_000 // per_token)
    assert budget == {"csa4": tokens // 128 + 1, "hca128": tokens // 128 + 1}
    with pytest.raises(InvalidArgument, match="give kv_bytes"):
        block_budget(schemas, config)


# --------------------------------------------------------------------------
# Lifecycle: a jitted step used by the state machine and the scan test.
# --------------------------------------------------------------------------


def _write_all_layers(manager, slots, starts, num_new, values):
    """Every layer writes ``values``-derived data for the step's tokens (one
    request per row, ``num_new`` tokens each, flattened to T = B * max_new)."""
    batch, max_new = num_new.shape[0], values.shape[1]
    request_ids = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), max_new)
    lane = jnp.tile(jnp.arange(max_new, dtype=jnp.int32), batch)
    real = lane < num_new[request_ids]
    positions = jnp.where(real, starts[request_ids] + lane, -1)
    token_slots_for_handle = jnp.where(jnp.any(real.reshape(batch, max_new), axis=1), slots, -1)
    x = values.reshape(batch * max_new, -1)
    for layer, schema in enumerate(manager.schemas):
        h = manager.acquire(layer, token_slots_for_handle, positions, request_ids)
        if schema.kind in (AttentionKind.SWA, AttentionKind.CSA, AttentionKind.HCA):
            h = h.write_swa(x[:, : schema.entry_format.head_dim])
            if schema.group is not None:
                w = schema.compressor_width
                h = h.compress(x[:, :w], x[:, :w] * 0.5)
                if schema.index_format is not None:
                    wi = schema.index_compressor_width
                    h = h.compress_index(x[:, :wi], x[:, :wi])
        elif schema.kind == AttentionKind.FULL:
            kvh, d = manager.config.num_kv_heads, manager.config.kv_head_dim
            h = h.write_kv(x[:, : kvh * d].reshape(-1, kvh, d), x[:, : kvh * d].reshape(-1, kvh, d))
        elif schema.kind == AttentionKind.LINEAR:
            rec, conv = h.gdn.get_states(h.gdn_layer, slots)
            gdn = h.gdn.set_layer_state(h.gdn_layer, slots, rec + 1.0, conv + 1.0)
            h = h.replace(gdn=gdn)
        manager = manager.update(h)
    return manager


@functools.partial(jax.jit, static_argnames=("max_new",))
def _step(manager, slots, num_new, values, *, max_new):
    manager, starts, ok = manager.reserve(slots, num_new, max_new_tokens=max_new)
    written = _write_all_layers(manager, jnp.where(ok, slots, -1), starts, jnp.where(ok, num_new, 0), values)
    return written, starts, ok


_admit = jax.jit(KVCacheManager.admit, static_argnames=("max_n",))
_release = jax.jit(KVCacheManager.release)


def _small_manager():
    return KVCacheManager.create(TINY_CONFIG, MIXED, 3, max_context_tokens=256,
                                 num_blocks={"csa4": 4, "hca32": 4, "full": 80})


def _check_free_slot_is_reset(manager, slot):
    for layer in range(len(manager.schemas)):
        cache = manager.layer_cache(layer)
        if cache is None:
            continue
        assert not np.asarray(cache.swa.nope[slot]).astype(np.float32).any(), (layer, slot)
        if cache.comp_score is not None:
            assert np.isneginf(np.asarray(cache.comp_score[slot])).all(), (layer, slot)
            assert not np.asarray(cache.comp_kv[slot]).any(), (layer, slot)
    if manager.gdn is not None:
        assert not np.asarray(manager.gdn.recurrent_state[:, slot]).any()
        assert not np.asarray(manager.gdn.conv_state[:, slot]).any()


class HybridLifecycle(RuleBasedStateMachine):
    """Random admit / step / release against a Python model of who holds
    what; after every operation each group's blocks are conserved and owned
    once, tables match the model, and free slots hold no state."""

    MAX_NEW = 40

    def __init__(self):
        super().__init__()
        self.manager = _small_manager()
        self.held = set()  # slots
        self.seq = {}  # slot -> tokens
        self.rng = np.random.default_rng()

    def _blocks(self, name, tokens):
        group = self.manager.groups[name]
        entries = tokens // group.tokens_per_entry
        return -(-entries // group.entries_per_block)

    @rule(n=st.integers(0, 3))
    def admit(self, n):
        manager, ids, ok = _admit(self.manager, n, max_n=3)
        free = sorted(set(range(1, 4)) - self.held)
        assert bool(ok) == (n <= len(free))
        if ok:
            assert list(np.asarray(ids[:n])) == free[:n]
            self.held |= set(free[:n])
            self.seq.update({s: 0 for s in free[:n]})
        else:
            assert np.asarray(ids).tolist() == [-1] * 3
        self.manager = manager

    @rule(data=st.data())
    def step(self, data):
        pool = sorted(self.held) + [data.draw(st.sampled_from([1, 2, 3]))]
        rows = data.draw(st.lists(st.sampled_from(pool), max_size=3))
        num_new = data.draw(st.lists(st.integers(0, self.MAX_NEW), min_size=len(rows), max_size=len(rows)))
        slots = np.full(3, -1, np.int32)
        counts = np.zeros(3, np.int32)
        slots[: len(rows)], counts[: len(rows)] = rows, num_new
        values = jnp.asarray(self.rng.normal(size=(3, self.MAX_NEW, 160)) + 2.0, jnp.float32)
        manager, starts, ok = _step(self.manager, jnp.asarray(slots), jnp.asarray(counts), values,
                                    max_new=self.MAX_NEW)
        expect = len(set(rows)) == len(rows) and set(rows) <= self.held
        if expect:
            for name, group in self.manager.groups.items():
                need = sum(max(0, self._blocks(name, self.seq[s] + n) - self._blocks(name, self.seq[s]))
                           for s, n in zip(rows, num_new))
                width = group.tables.shape[1]
                expect &= need <= int(group.allocator.num_free)
                expect &= all(self._blocks(name, self.seq[s] + n) <= width for s, n in zip(rows, num_new))
        assert bool(ok) == expect, (rows, num_new, self.seq)
        if ok:
            assert [int(x) for x in np.asarray(starts[: len(rows)])] == [self.seq[s] for s in rows]
            for s, n in zip(rows, num_new):
                self.seq[s] += n
            self.manager = manager
        else:
            # A failed step changes nothing (its writes are masked off; padding
            # K/V writes land in the full pool's null page 0, which is garbage;
            # the write-back counters count the step's updates all the same).
            def visible(m):
                pool = m.full_pool
                return jax.tree.leaves(m.replace(full_pool=None, write_epochs=None)) + [pool.k_pages[:, :, 1:], pool.v_pages[:, :, 1:]]

            for a, b in zip(visible(manager), visible(self.manager)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @rule(data=st.data())
    def release(self, data):
        rows = data.draw(st.lists(st.sampled_from([-1, 1, 2, 3]), max_size=3))
        manager, ok = _release(self.manager, jnp.asarray(rows + [-1] * (3 - len(rows)), jnp.int32))
        real = [s for s in rows if s >= 0]
        assert bool(ok) == (len(set(real)) == len(real) and set(real) <= self.held)
        if ok:
            self.held -= set(real)
            for s in real:
                self.seq.pop(s)
            self.manager = manager

    @invariant()
    def consistent(self):
        m = self.manager
        np.testing.assert_array_equal(np.asarray(m.seq_lens)[1:], [self.seq.get(s, 0) for s in (1, 2, 3)])
        for name, group in m.groups.items():
            tables, lens = np.asarray(group.tables), np.asarray(group.lens)
            counts = np.asarray(group.allocator.ref_counts)
            owned = []
            for s in range(4):
                assert lens[s] == (self._blocks(name, self.seq[s]) if s in self.held else 0), (name, s)
                owned += tables[s, : lens[s]].tolist()
                assert (tables[s, lens[s]:] == -1).all()
            assert len(owned) == len(set(owned)) and 0 not in owned
            assert sorted(np.nonzero(counts)[0].tolist()) == sorted(owned) and set(counts[owned]) <= {1}
            assert int(group.allocator.num_free) + len(owned) == group.allocator.num_blocks - 1
        for s in {1, 2, 3} - self.held:
            _check_free_slot_is_reset(m, s)


HybridLifecycle.TestCase.settings = __import__("hypothesis").settings(max_examples=8, stateful_step_count=12)
test_hybrid_lifecycle = HybridLifecycle.TestCase


def test_host_paths_raise_typed_errors():
    manager = _small_manager()
    manager, slots = manager.admit_or_raise(2)
    assert slots == [1, 2]
    with pytest.raises(KVCacheOOM, match=r"requested 2 request slots, 1 available \(of 3 total\)"):
        manager.admit_or_raise(2)
    manager, starts = manager.reserve_or_raise([1, 2], [100, 100])
    assert starts == [0, 0]
    # csa4 has 3 usable blocks of 128 tokens (32 entries): each slot holds one
    # (25 entries); 100 more tokens each need a second block apiece.
    with pytest.raises(KVCacheOOM, match=r"requested 2 csa4 blocks, 1 available \(of 3 total\)"):
        manager.reserve_or_raise([1, 2], [100, 100])
    with pytest.raises(InvalidId, match="not held"):
        manager.reserve_or_raise([3], [1])
    with pytest.raises(InvalidId, match=r"\[3\] not held"):
        manager.release_or_raise([1, 3])
    manager = manager.release_or_raise([1, 2])
    assert {n: int(g.allocator.num_free) for n, g in manager.groups.items()} == {"csa4": 3, "hca32": 3, "full": 79}
    with pytest.raises(InvalidArgument, match="layer 9 out of range"):
        manager.acquire(9, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    handle = manager.acquire(3, jnp.ones(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(InvalidArgument, match=r"layer 3 \(full\) has no SWA ring"):
        handle.write_swa(jnp.zeros((1, 80)))
    handle = manager.acquire(1, jnp.ones(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(InvalidArgument, match=r"layer 1: score must be \[1 tokens, 160\], got \[1, 80\]"):
        handle.compress(jnp.zeros((1, 160)), jnp.zeros((1, 80)))


def test_chunked_compression_equals_token_by_token():
    """Feeding a request's tokens in uneven chunks stores the same entries,
    rings and SWA window as feeding them one at a time."""
    rng = np.random.default_rng()
    tokens = 150  # crosses the csa4 and hca32 block boundaries (128 tokens)
    values = jnp.asarray(rng.normal(size=(tokens, 160)) * rng.uniform(0.5, 3.0, size=(tokens, 1)), jnp.float32)

    def run(chunks):
        manager, _ = _small_manager().admit_or_raise(1)
        start = 0
        for n in chunks:
            block = jnp.zeros((3, HybridLifecycle.MAX_NEW, 160), jnp.float32).at[0, :n].set(values[start: start + n])
            manager, _, ok = _step(manager, jnp.asarray([1, -1, -1], jnp.int32), jnp.asarray([n, 0, 0], jnp.int32),
                                   block, max_new=HybridLifecycle.MAX_NEW)
            assert bool(ok)
            start += n
        assert start == tokens
        return manager

    chunked = run([5, 1, 33, 40, 7, 40, 24])
    single = run([1] * tokens)
    for layer in (0, 1, 2):
        a, b = chunked.layer_cache(layer), single.layer_cache(layer)
        for name in ("swa", "entries", "index_keys"):
            if getattr(a, name) is not None:
                for part in ("nope", "scales", "rope"):
                    x, y = (np.asarray(getattr(getattr(c, name), part)).astype(np.float32) for c in (a, b))
                    np.testing.assert_allclose(x, y, rtol=1e-6, atol=0, err_msg=f"layer {layer} {name}.{part}")
        for name in ("comp_kv", "comp_score", "index_kv", "index_score"):
            if getattr(a, name) is not None:
                np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    # 150 tokens: 37 CSA entries (two blocks), 4 HCA entries of 32 tokens (one block of 4).
    assert np.asarray(chunked.groups["csa4"].lens)[1] == 2 and np.asarray(chunked.groups["hca32"].lens)[1] == 1


def test_two_hundred_step_serving_scan_has_no_host_transfer():
    """Admit, decode and release requests for 200 steps inside one jitted
    ``lax.scan`` (every 16th step the oldest request finishes and a new one is
    admitted); nothing crosses to the host inside the loop."""
    manager = _small_manager()
    rng = np.random.default_rng()
    noise = jnp.asarray(rng.normal(size=(200, 3, 1, 160)), jnp.float32)

    def body(carry, x):
        manager, slots, step = carry
        turn = step % 16 == 15
        victim = slots[(step // 16) % 3]
        manager, ok_release = manager.release(jnp.where(turn, victim, -1)[None])
        manager, new, ok_admit = manager.admit(jnp.where(turn, 1, 0), max_n=1)
        slots = jnp.where(turn & (slots == victim), new[0], slots)
        manager, _, ok_step = _step(manager, slots, jnp.ones(3, jnp.int32), x, max_new=1)
        return (manager, slots, step + 1), ok_release & ok_admit & ok_step

    @jax.jit
    def serve(manager, noise):
        manager, slots, _ = manager.admit(3, max_n=3)
        (manager, slots, _), oks = jax.lax.scan(body, (manager, slots, jnp.int32(0)), noise)
        return manager, slots, oks

    compiled = serve.lower(manager, noise).compile()
    with jax.transfer_guard("disallow"):
        final, slots, oks = compiled(manager, noise)
    assert np.asarray(oks).all()
    expected = [0, 0, 0]  # the same schedule in Python
    for step in range(200):
        if step % 16 == 15:
            expected[(step // 16) % 3] = 0
        expected = [n + 1 for n in expected]
    np.testing.assert_array_equal(np.asarray(final.seq_lens)[np.asarray(slots)], expected)
    free = {n: int(g.allocator.num_free) + int(np.asarray(g.lens).sum()) for n, g in final.groups.items()}
    assert free == {"csa4": 3, "hca32": 3, "full": 79}


def test_mla_layer_decodes_against_dense_attention():
    """An MLA layer through the manager: each step writes the token's latent
    (512-style latent + RoPE dims, here 24 + 8) and attends through the pages;
    the output equals dense attention over all latents so far (values = the
    latent's first 24 dims)."""
    config = HybridConfig(kv_head_dim=32, mla_value_dim=24, page_size=4, kv_dtype=jnp.float32)
    manager = KVCacheManager.create(config, [LayerSpec(0, AttentionKind.MLA)], 2, max_context_tokens=32)
    manager, slots = manager.admit_or_raise(2)
    slots = jnp.asarray(slots, jnp.int32)
    rng = np.random.default_rng()
    steps, heads = 11, 4
    latents = rng.normal(size=(steps, 2, 32)).astype(np.float32)
    queries = rng.normal(size=(steps, 2, heads, 32)).astype(np.float32)

    @jax.jit
    def step(manager, latent, q):
        manager, positions, ok = manager.reserve(slots, 1)
        handle = manager.acquire(0, slots, positions)
        handle = handle.write_kv(latent[:, None, :])
        return manager.update(handle), handle.attend(q), ok

    for t in range(steps):
        manager, out, ok = step(manager, jnp.asarray(latents[t]), jnp.asarray(queries[t]))
        assert bool(ok)
        for b in range(2):
            k = latents[: t + 1, b]  # [t + 1, 32]
            logits = queries[t, b] @ k.T / np.sqrt(32)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            expected = (w / w.sum(-1, keepdims=True)) @ k[:, :24]
            np.testing.assert_allclose(np.asarray(out[b]), expected, rtol=1e-4, atol=1e-5)
    assert np.asarray(manager.groups["mla"].lens)[np.asarray(slots)].tolist() == [3, 3]  # 11 tokens, pages of 4
