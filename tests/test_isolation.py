"""No request reads another's K/V: poisoned free blocks and reused blocks leave
decode attention of live sequences unchanged; the manager's tables feed JAX's
Pallas kernel to the same result as our reference; host-path errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_paged_attention

import jaxkv
from kernels_pallas.reference import dense_decode_attention, paged_decode_attention
from jaxkv.manager import kernel_tables
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.pool import KVPool

BS, LAYERS, KVH, HEADS, DIM = 4, 2, 2, 4, 8
BLOCKS, SEQS, MAX_BLOCKS = 24, 6, 5
APPEND = jax.jit(BlockSpaceManager.append_slots)
ATTEND = jax.jit(paged_decode_attention)


class Scenario:
    """A manager, a pool, and a Python record of the K/V written per sequence
    (the no-cache truth every read is checked against)."""

    def __init__(self, dtype, rng):
        self.rng = rng
        self.manager = BlockSpaceManager.create(num_device_blocks=BLOCKS, num_host_blocks=4, block_size=BS,
                                                max_seqs=SEQS, max_blocks_per_seq=MAX_BLOCKS, watermark=0.0)
        self.pool = KVPool.create(num_pages=BLOCKS, page_size=BS, num_layers=LAYERS, k_heads=KVH, k_dim=DIM,
                                  dtype=dtype)
        self.written = {}  # seq -> per layer list of (k, v) rows, position order

    def _write(self, seq, slots):
        rows = []
        for layer in range(LAYERS):
            k = self.rng.normal(size=(len(slots), KVH, DIM)).astype(np.float32)
            v = self.rng.normal(size=(len(slots), KVH, DIM)).astype(np.float32)
            self.pool = self.pool.set_kv(layer, jnp.asarray(slots), k, v)
            # What the pool stores (bf16/fp8 rounding) is the truth to compare with.
            stored_k, stored_v = self.pool.get_kv(layer, jnp.asarray(slots))
            rows.append((np.asarray(stored_k), np.asarray(stored_v)))
        old = self.written.get(seq)
        self.written[seq] = rows if old is None else [
            (np.concatenate([ok, nk]), np.concatenate([ov, nv])) for (ok, ov), (nk, nv) in zip(old, rows)
        ]

    def admit(self, seq, length):
        self.manager = self.manager.allocate_or_raise([seq], length)
        slots = np.asarray(self.manager.token_slots(jnp.array([seq]), jnp.arange(length)[None])[0])
        self._write(seq, slots)

    def fork(self, src, dst):
        self.manager = self.manager.fork_or_raise([src], [dst])
        self.written[dst] = [(k.copy(), v.copy()) for k, v in self.written[src]]

    def step(self, seqs):
        self.manager, self.pool, slots, _, ok = APPEND(self.manager, self.pool, jnp.asarray(seqs, jnp.int32))
        assert bool(ok)
        for seq, slot in zip(seqs, np.asarray(slots)[:, 0]):
            self._write(seq, [slot])

    def finish(self, seq):
        self.manager = self.manager.free_or_raise([seq])
        del self.written[seq]

    def attend(self, q, seqs, pool=None):
        pool = self.pool if pool is None else pool
        tables, lengths = self.manager.batch_tables(jnp.asarray(seqs, jnp.int32))
        out = []
        for layer in range(LAYERS):
            k, v, k_scales, v_scales = pool.layer_arrays(layer)
            out.append(np.asarray(ATTEND(q, k, v, tables, lengths, k_scales, v_scales)))
        return out

    def truth(self, q, seqs):
        """Dense attention over the K/V recorded in Python: no pool involved."""
        out = []
        for layer in range(LAYERS):
            length = max(len(self.written[s][layer][0]) for s in seqs)
            k = np.zeros((len(seqs), length, KVH, DIM), np.float32)
            v = np.zeros_like(k)
            for b, s in enumerate(seqs):
                n = len(self.written[s][layer][0])
                k[b, :n], v[b, :n] = self.written[s][layer]
            lengths = jnp.asarray([len(self.written[s][layer][0]) for s in seqs], jnp.int32)
            out.append(np.asarray(dense_decode_attention(q, jnp.asarray(k), jnp.asarray(v), lengths)))
        return out


def _poison(scenario, value):
    """Fill every free block, the null page, and the unwritten tail of every
    live sequence's last block with ``value`` (pages and scales)."""
    manager = scenario.manager
    free = np.flatnonzero(np.asarray(manager.device.ref_counts) == 0)  # includes page 0
    pages = {name: np.array(getattr(scenario.pool, name).astype(jnp.float32)) for name in
             ("k_pages", "v_pages", "k_scales", "v_scales") if getattr(scenario.pool, name) is not None}
    lens, tables = np.asarray(manager.seq_lens), np.asarray(manager.block_tables)
    for name, array in pages.items():
        array[:, :, free] = value
        for seq in scenario.written:
            if lens[seq] % BS:
                array[:, :, tables[seq, (lens[seq] - 1) // BS], lens[seq] % BS:] = value
    dtype = scenario.pool.dtype
    typed = {name: jnp.asarray(a).astype(dtype if "pages" in name else jnp.float32) for name, a in pages.items()}
    return KVPool.from_arrays(typed["k_pages"], typed["v_pages"], typed.get("k_scales"), typed.get("v_scales"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn],
                         ids=lambda d: jnp.dtype(d).name)
def test_poisoned_and_reused_blocks_never_reach_a_live_sequence(dtype):
    rng = np.random.default_rng()
    s = Scenario(dtype, rng)
    for seq in range(3):
        s.admit(seq, int(rng.integers(1, 11)))
    s.fork(0, 3)
    for _ in range(int(rng.integers(1, 5))):
        s.step([0, 1, 2, 3])
    live = [0, 1, 2, 3]
    q = jnp.asarray(rng.normal(size=(len(live), HEADS, DIM)), jnp.float32)
    clean = s.attend(q, live)
    for got, want in zip(clean, s.truth(q, live)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    for value in (np.nan, 1e30, -1e30):
        poisoned = s.attend(q, live, pool=_poison(s, value))
        for got, want in zip(poisoned, clean):
            np.testing.assert_array_equal(got, want)

    # Finish two sequences, admit new ones into their freed blocks (written with
    # fresh values), poison what is free again: the survivors see exactly what
    # they saw, and the newcomers see only their own K/V.
    s.finish(1)
    s.finish(3)
    s.admit(4, int(rng.integers(5, 13)))
    s.admit(5, int(rng.integers(1, 9)))
    s.step([0, 2, 4, 5])
    survivors = [0, 2]
    q2 = jnp.asarray(rng.normal(size=(4, HEADS, DIM)), jnp.float32)
    everyone = [0, 2, 4, 5]
    for got, want in zip(s.attend(q2, everyone, pool=_poison(s, np.nan)), s.truth(q2, everyone)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert all(seq in s.written for seq in survivors)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn],
                         ids=lambda d: jnp.dtype(d).name)
def test_manager_tables_feed_jax_pallas_paged_attention(dtype):
    rng = np.random.default_rng()
    s = Scenario(dtype, rng)
    for seq in range(4):
        s.admit(seq, int(rng.integers(1, 4 * BS)))
    s.fork(2, 4)
    s.step([0, 1, 2, 3, 4])
    seqs = jnp.array([0, 1, 2, 3, 4, -1], jnp.int32)  # a padding row too
    q = jnp.asarray(rng.normal(size=(6, HEADS, DIM)), jnp.float32)
    tables, lengths = s.manager.batch_tables(seqs)
    pallas_tables, _ = kernel_tables.pallas_gpu_block_tables(tables, lengths, pages_per_compute_block=2, k_splits=2)
    for layer in range(LAYERS):
        k, v, ks, vs = s.pool.layer_arrays(layer)
        ours = np.asarray(ATTEND(q, k, v, tables, lengths, ks, vs))
        theirs = np.asarray(pallas_paged_attention(q / np.sqrt(DIM), k, v, pallas_tables, lengths, ks, vs,
                                                   pages_per_compute_block=2, k_splits=2,
                                                   interpret=True))
        np.testing.assert_allclose(ours[:5], theirs[:5], rtol=1e-4, atol=1e-4)
        assert not ours[5].any()  # the padding row reads nothing


def test_manager_host_paths_raise_typed_errors_with_numbers():
    m = BlockSpaceManager.create(num_device_blocks=8, num_host_blocks=4, block_size=4, max_seqs=3,
                                 max_blocks_per_seq=4, watermark=0.0)
    m = m.allocate_or_raise([0], 9)  # 3 of 7 blocks
    with pytest.raises(jaxkv.InvalidId, match="allocate: sequence 0 is ON_DEVICE, not FREE"):
        m.allocate_or_raise([0], 4)
    with pytest.raises(jaxkv.InvalidId, match=r"allocate: sequence 5 outside \[0, 3\)"):
        m.allocate_or_raise([5], 3)
    with pytest.raises(jaxkv.InvalidArgument, match="allocate: 17 tokens"):
        m.allocate_or_raise([1], 17)
    with pytest.raises(jaxkv.KVCacheOOM, match=r"requested 2 blocks, 1 available \(of 7 total\)"):
        m.allocate_or_raise([1], 12).allocate_or_raise([2], 5)
    with pytest.raises(jaxkv.InvalidId, match="fork source: sequence 1 is FREE, not ON_DEVICE"):
        m.fork_or_raise([1], [2])
    with pytest.raises(jaxkv.InvalidId, match="free: sequence 2 is FREE, not ON_DEVICE or SWAPPED"):
        m.free_or_raise([2])
    with pytest.raises(jaxkv.InvalidArgument, match="2 sources but 1 destinations"):
        m.fork([0, 0], [1])
