"""Fuzzing the hybrid KVCacheManager with real entry data.

A hypothesis state machine (:class:`HybridFuzz`) drives admit / reserve /
write / gather / release, through the device ops and the ``*_or_raise`` host
paths, on a tiny six-layer model (SWA, CSA ratio 4, HCA ratio 32 and 128,
full attention, Gated DeltaNet), with good and bad inputs, and checks
everything against a plain-Python model:

* which slots are held, how many tokens each request reserved and wrote,
  how many blocks each group must hold for it;
* the fresh random data written at every position of every request, read
  back through the handle: its SWA window (``gather_swa`` with this step's
  entries before the write and without them after, each entry rounded by a
  numpy quantizer written here and compared exactly), its CSA/HCA compressed
  entries and CSA indexer keys (``gather_all_compressed``,
  ``gather_compressed``, ``index_keys``; each entry the score-softmax-weighted
  sum of the ``overlap * ratio`` tokens ``hybrid_schema`` documents, computed
  in float64 here and compared within the fp8 rounding bound), its
  full-attention K/V (``attend`` against dense attention in numpy) and its
  GDN states.

Bad inputs: slots that are free, out of range, negative (other than the -1
padding) or the null slot 0, repeated slots, counts that are negative or
above the static maximum, ids and counts that are not integers, reserves
past the block pools and past the block tables, and handle rows at positions
a request has not reserved (the next tokens, far past the table, negative).

Sequences run past the SWA ring (6 rows), the CSA compressor and indexer
rings (8 rows), the HCA rings (32 and 128 rows) and the 128-token block
boundary of the compressed groups (32 CSA entries, 4 or 1 HCA entries).

After every step: seq_lens and block tables match the model, every block is
owned once or free (owned + free = total), free slots and slots with nothing
written hold initial state; a released request's blocks are free; a failed op
(``ok`` False, or a ``KVCacheError`` from a host path) left the manager
bit-identical, and a write of bad rows only changed nothing.

Compile cost: every jitted program has fixed static shapes (rows and tokens
padded), so every example reuses the same few compiled programs. The ci
profile runs a bounded number of steps; ``JAXKV_HYPOTHESIS=long`` many more.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxkv.errors import InvalidArgument, InvalidId, KVCacheOOM
from jaxkv.manager import hybrid
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind, HybridConfig, LayerSpec, build_schemas
from kernels_pallas.formats import EntryFormat
from tests.util import assert_tree_equal

# --------------------------------------------------------------------------
# The tiny model and its static shapes.
# --------------------------------------------------------------------------

FMT = EntryFormat("fuzz", nope_dim=32, rope_dim=8, group_size=16, scale_kind="ue8m0")
HD = FMT.head_dim  # 40
INDEX_DIM = 16
WINDOW = 6  # does not divide 128: the ring and the blocks wrap at different tokens
KV_DIM = 8
HEADS = 2  # query heads of the full-attention layer (one KV head)
CONFIG = HybridConfig(entry_format=FMT, window=WINDOW, index_head_dim=INDEX_DIM, index_topk=2, num_kv_heads=1,
                      kv_head_dim=KV_DIM, kv_dtype=jnp.float32, page_size=4, linear_num_k_heads=1,
                      linear_num_v_heads=1, linear_head_k_dim=4, linear_head_v_dim=4, linear_conv_kernel=2,
                      linear_dtype=jnp.float32)
SWA, CSA, HCA, FULL, LINEAR, HCA128 = range(6)  # layer indices
V4_LAYERS = (SWA, CSA, HCA, HCA128)  # the layers with an SWA ring
CSA_RATIO, HCA_RATIO = 4, 32
SCHEDULE = [LayerSpec(SWA, AttentionKind.SWA), LayerSpec(CSA, AttentionKind.CSA, CSA_RATIO),
            LayerSpec(HCA, AttentionKind.HCA, HCA_RATIO), LayerSpec(FULL, AttentionKind.FULL),
            LayerSpec(LINEAR, AttentionKind.LINEAR), LayerSpec(HCA128, AttentionKind.HCA, 128)]
MAX_REQS = 3
NUM_SLOTS = MAX_REQS + 1
CONTEXT = 256  # block tables: 2 compressed blocks (128 tokens each), 64 pages of 4 per request
# Usable blocks (the null block aside) for 3 requests of up to 2 blocks each:
# 4 CSA, 2 HCA32 (it runs out while other groups grow), 3 HCA128; 80 pages.
NUM_BLOCKS = {"csa4": 5, "hca32": 3, "hca128": 4, "full": 81}
GROUP_RATIO = {"csa4": CSA_RATIO, "hca32": HCA_RATIO, "hca128": 128, "full": 1}
GROUP_ENTRIES = {"csa4": 32, "hca32": 4, "hca128": 1, "full": 4}  # entries per block
GROUP_WIDTH = {"csa4": 2, "hca32": 2, "hca128": 2, "full": 64}  # block table columns

ROWS = 3  # reserve / release batch (padded with -1)
MAX_NEW = 64  # reserve's static max_new_tokens
REQ_ROWS = 4  # handle rows: up to 3 requests + 1 bad row; row REQ_ROWS is padding
CHUNK = 64  # most tokens of one row in a write
WRITE_T = 128  # token lanes of a write, packed row after row
PAD_LANES = 2  # padding lanes after each row, when they belong to the row
GATHER_PER_ROW = 4
GATHER_T = REQ_ROWS * GATHER_PER_ROW
TOPK = 4
CSA_MAX = CONTEXT // CSA_RATIO
GDN_REC = (1, 4, 4)  # [v_heads, v_dim, k_dim]
GDN_CONV = (12, 1)  # [2 * 1 * 4 + 1 * 4, kernel - 1]
BAD_SLOTS = [0, NUM_SLOTS, 9, -2]  # the null slot, out of range, negative (not the -1 padding)
NOT_INTS = [1.0, 1.5, True, "1", None, float("nan")]  # ids and counts the host paths must refuse

# Each token's data per write, [T, width] float32.
TOKEN_FIELDS = {**{f"swa{layer}": HD for layer in V4_LAYERS}, "csa_kv": 2 * HD, "csa_score": 2 * HD,
                "idx_kv": 2 * INDEX_DIM, "idx_score": 2 * INDEX_DIM, "hca_kv": HD, "hca_score": HD,
                "hca128_kv": HD, "hca128_score": HD, "full_k": KV_DIM, "full_v": KV_DIM}
# Compressed entries by kind: (layer, kv field, score field, ratio, overlap, format).
POOLED = {"csa": (CSA, "csa_kv", "csa_score", CSA_RATIO, 2, FMT),
          "index": (CSA, "idx_kv", "idx_score", CSA_RATIO, 2, build_schemas(SCHEDULE, CONFIG)[CSA].index_format),
          "hca": (HCA, "hca_kv", "hca_score", HCA_RATIO, 1, FMT),
          "hca128": (HCA128, "hca128_kv", "hca128_score", 128, 1, FMT)}
MAX_ENTRIES = {kind: CONTEXT // spec[3] for kind, spec in POOLED.items()}  # gather_all widths
READS = ["swa%d" % layer for layer in V4_LAYERS] + ["topk", *POOLED]  # the gathers of _gather_step


@functools.cache
def _new_manager() -> KVCacheManager:
    """A fresh manager (made once: a pytree is never changed in place)."""
    return KVCacheManager.create(CONFIG, SCHEDULE, MAX_REQS, max_context_tokens=CONTEXT, num_blocks=NUM_BLOCKS)


# --------------------------------------------------------------------------
# Jitted programs (compiled once for the whole module).
# --------------------------------------------------------------------------

# The manager's own jits of admit / reserve / release: the host paths call
# them too, so the device rules and the host rules share compiled programs.
_admit = hybrid._admit_jit
_reserve = hybrid._reserve_jit
_release = hybrid._release_jit


# -O1 (the suite's default is -O0, see conftest.py): this program runs at
# every write, ~2.5x faster for 0.1 s more compile.
@functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 1})
def _write_step(manager, slots, positions, request_ids, data):
    """Every layer writes the step's data through its handle. Also returns
    each V4 layer's SWA windows before (``gather_swa(kv)``) and after
    (``gather_swa()``) its write."""
    out = {}
    for layer, schema in enumerate(manager.schemas):
        h = manager.acquire(layer, slots, positions, request_ids)
        if layer in V4_LAYERS:
            kv = data[f"swa{layer}"]
            out[f"pre{layer}"] = h.gather_swa(kv)
            h = h.write_swa(kv)
            out[f"post{layer}"] = h.gather_swa()
            for kind, (pooled_layer, kv_field, score_field, *_) in POOLED.items():
                if pooled_layer == layer:
                    write = h.compress_index if kind == "index" else h.compress
                    h = write(data[kv_field], data[score_field])
        elif schema.kind == AttentionKind.FULL:
            h = h.write_kv(data["full_k"][:, None, :], data["full_v"][:, None, :])
        else:  # the GDN states of the handle's requests (rows marked in gdn_rows)
            ids = jnp.where(data["gdn_rows"], h.request_slots, -1)
            h = h.replace(gdn=h.gdn.set_layer_state(h.gdn_layer, ids, data["gdn_rec"], data["gdn_conv"]))
        manager = manager.update(h)
    return manager, out


@jax.jit
def _gather_step(manager, slots, positions, request_ids, indices, q):
    """Every read path of every layer, for the step's tokens."""
    out = {}
    for layer in V4_LAYERS:
        out[f"swa{layer}"] = manager.acquire(layer, slots, positions, request_ids).gather_swa()
    out["topk"] = manager.acquire(CSA, slots, positions, request_ids).gather_compressed(indices)
    for kind, (layer, *_) in POOLED.items():
        h = manager.acquire(layer, slots, positions, request_ids)
        read = h.index_keys if kind == "index" else h.gather_all_compressed
        out[kind] = read(MAX_ENTRIES[kind])
    out["attend"] = manager.acquire(FULL, slots, positions, request_ids).attend(q)
    h = manager.acquire(LINEAR, slots, positions, request_ids)
    out["gdn"] = h.gdn.get_states(h.gdn_layer, h.request_slots)
    return out


def _fresh(rng, shape, spread=2.0):
    """Fresh random float32 data, never zero: normal values at a random
    scale per row (e**-2 .. e**2), shifted by a random offset per row."""
    scale = np.exp(rng.uniform(-spread, spread, size=shape[:-1] + (1,)))
    return (rng.normal(size=shape) * scale + rng.uniform(-1, 1, size=shape[:-1] + (1,))).astype(np.float32)


def _lanes_free(rows, pad_in_row):
    """Token lanes a write of ``rows`` leaves free."""
    return WRITE_T - sum(n for _, _, n, *_ in rows) - (PAD_LANES * len(rows) if pad_in_row else 0)


def _write_rows(manager, rows, rng, pad_in_row=False):
    """Run :func:`_write_step` for ``rows`` = ``[(slot, start, n, gdn)]``: row
    ``b`` brings ``n`` tokens at positions ``start ..`` and, if ``gdn``, new
    GDN states. The rows' tokens are packed in lanes, row after row; padding
    tokens (position -1) belong to the padding row ``REQ_ROWS``, and with
    ``pad_in_row`` ``PAD_LANES`` of them follow each row, in that row.
    Returns ``(manager, out, lanes, data)``: each row's token lanes, and the
    fresh random data written, as numpy."""
    assert _lanes_free(rows, pad_in_row) >= 0, rows
    slots = np.full(REQ_ROWS + 1, -1, np.int32)
    positions = np.full(WRITE_T, -1, np.int32)
    request_ids = np.full(WRITE_T, REQ_ROWS, np.int32)
    gdn_rows = np.zeros(REQ_ROWS + 1, bool)
    lanes, cursor = [], 0
    for b, (slot, start, n, gdn) in enumerate(rows):
        slots[b], gdn_rows[b] = slot, gdn
        lanes.append(np.arange(cursor, cursor + n))
        positions[cursor: cursor + n] = start + np.arange(n)
        cursor += n + (PAD_LANES if pad_in_row else 0)
        request_ids[lanes[-1][0]: cursor] = b
    fields = np.split(_fresh(rng, (WRITE_T, sum(TOKEN_FIELDS.values()))),
                      np.cumsum(list(TOKEN_FIELDS.values()))[:-1], axis=1)
    data = dict(zip(TOKEN_FIELDS, fields))
    data["gdn_rec"] = _fresh(rng, (REQ_ROWS + 1,) + GDN_REC)
    data["gdn_conv"] = _fresh(rng, (REQ_ROWS + 1,) + GDN_CONV)
    data["gdn_rows"] = gdn_rows
    manager, out = _write_step(manager, jnp.asarray(slots), jnp.asarray(positions), jnp.asarray(request_ids),
                               {k: jnp.asarray(v) for k, v in data.items()})
    return manager, jax.tree.map(np.asarray, out), lanes, data


def _gather_rows(manager, rows, rng):
    """Run :func:`_gather_step` for ``rows`` = ``[(slot, positions)]``
    (``GATHER_PER_ROW`` positions each) with random top-k indices (some
    out of range) and queries. Returns ``(out, indices, q)`` as numpy."""
    slots = np.full(REQ_ROWS + 1, -1, np.int32)
    positions = np.full(GATHER_T, -1, np.int32)
    request_ids = np.full(GATHER_T, REQ_ROWS, np.int32)
    for b, (slot, pos) in enumerate(rows):
        slots[b] = slot
        positions[b * GATHER_PER_ROW:(b + 1) * GATHER_PER_ROW] = pos
        request_ids[b * GATHER_PER_ROW:(b + 1) * GATHER_PER_ROW] = b
    indices = rng.integers(-2, CSA_MAX + 4, size=(GATHER_T, TOPK)).astype(np.int32)
    q = _fresh(rng, (GATHER_T, HEADS, KV_DIM))
    out = _gather_step(manager, jnp.asarray(slots), jnp.asarray(positions), jnp.asarray(request_ids),
                       jnp.asarray(indices), jnp.asarray(q))
    return jax.tree.map(np.asarray, out), indices, q


# --------------------------------------------------------------------------
# The independent model of the stored data (numpy).
# --------------------------------------------------------------------------


def _quantize(x: np.ndarray, fmt: EntryFormat) -> np.ndarray:
    """What an entry format stores for float32 ``x [..., D]``, read back as
    float32: per group of NoPE values a power-of-two scale ``2**ceil(log2(
    max(amax, 1e-4) / 448))`` and the values rounded to float8_e4m3fn; the
    RoPE values rounded to bfloat16."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    groups = x[..., : fmt.nope_dim].reshape(*lead, fmt.num_groups, fmt.group_size)
    raw = np.maximum(np.abs(groups).max(-1), np.float32(1e-4)) / np.float32(448.0)
    scale = np.ldexp(np.float32(1.0), np.ceil(np.log2(raw.astype(np.float64))).astype(np.int32))
    values = np.clip(groups / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nope = (values * scale[..., None]).reshape(*lead, fmt.nope_dim)
    rope = x[..., fmt.nope_dim:].astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.concatenate([nope, rope], axis=-1)


def _pooled(kv: np.ndarray, score: np.ndarray, entry: int, ratio: int, overlap: int) -> np.ndarray:
    """Compressed entry ``entry`` (float64 ``[d]``) of a request whose tokens
    brought ``kv, score [positions, overlap * d]``: it pools the tokens ``q``
    in ``[(entry + 1) * ratio - overlap * ratio, (entry + 1) * ratio)`` that
    exist (``q >= 0``); token ``q`` of window ``k = (q - start) // ratio``
    brings channel block ``k`` of its kv and score; per channel, the entry
    is ``sum_q softmax_q(score) * kv``."""
    d = kv.shape[1] // overlap
    start = (entry + 1) * ratio - overlap * ratio
    rows_kv, rows_score = [], []
    for q in range(max(start, 0), (entry + 1) * ratio):
        k = (q - start) // ratio
        rows_kv.append(kv[q, k * d:(k + 1) * d])
        rows_score.append(score[q, k * d:(k + 1) * d])
    s = np.asarray(rows_score, np.float64)
    w = np.exp(s - s.max(0))
    return (w / w.sum(0) * np.asarray(rows_kv, np.float64)).sum(0)


def _assert_fp8_close(got, exact, fmt: EntryFormat, what: str):
    """``got`` (entries stored in ``fmt``, read back) equals ``exact``
    (float64, unrounded) within the format's rounding: e4m3 keeps 3 mantissa
    bits (error <= 2**-4 of the value) down to its subnormals (<= 2**-10 of
    the group's scale; 2**-9 allowed, as float32 pooling may land in the next
    scale); bf16 RoPE <= 2**-9 (2**-8 allowed). A wrong or stale entry is off
    by about its own size."""
    got = np.asarray(got, np.float64)
    exact = np.asarray(exact, np.float64)
    lead = exact.shape[:-1]
    groups = exact[..., : fmt.nope_dim].reshape(*lead, fmt.num_groups, fmt.group_size)
    amax = np.maximum(np.abs(groups).max(-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    nope_bound = (2.0**-4 * np.abs(groups) + 2.0**-9 * scale + 1e-6 * amax).reshape(*lead, fmt.nope_dim)
    rope_bound = 2.0**-8 * np.abs(exact[..., fmt.nope_dim:]) + 1e-6
    bound = np.concatenate([nope_bound, rope_bound], axis=-1)
    bad = np.argwhere(np.abs(got - exact) > bound)
    if bad.size:
        first = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} values off by more than the fp8 rounding bound, first at "
                             f"{first}: got {got[first]}, exact {exact[first]}")


def _blocks(group: str, tokens: int) -> int:
    """Blocks a group holds for ``tokens`` reserved tokens: enough for the
    completed entries."""
    entries = tokens // GROUP_RATIO[group]
    return -(-entries // GROUP_ENTRIES[group])


class Request:
    """The model of one held slot: tokens reserved and written, and the data
    written at every position (raw, and as the SWA ring stores it)."""

    def __init__(self):
        self.reserved = 0
        self.written = 0
        self.data = {name: np.zeros((CONTEXT, width), np.float32) for name, width in TOKEN_FIELDS.items()}
        self.swa_stored = {layer: np.zeros((CONTEXT, HD), np.float32) for layer in V4_LAYERS}
        self.gdn_rec = np.zeros(GDN_REC, np.float32)
        self.gdn_conv = np.zeros(GDN_CONV, np.float32)
        self._entries = {}  # memo: (kind, entry) -> exact pooled entry

    def write(self, start, end, data, lanes):
        """Tokens ``start .. end - 1`` bring ``data[name][lanes]``."""
        for name in TOKEN_FIELDS:
            self.data[name][start:end] = data[name][lanes]
        for layer in self.swa_stored:
            self.swa_stored[layer][start:end] = _quantize(data[f"swa{layer}"][lanes], FMT)
        self._entries = {(kind, e): v for (kind, e), v in self._entries.items()
                         if (e + 1) * POOLED[kind][3] <= start}  # entries of earlier tokens only
        self.written = end

    def entries(self, kind: str, n: int) -> np.ndarray:
        """The exact entries ``0 .. n - 1`` of ``kind`` (a key of ``POOLED``)."""
        _, kv, score, ratio, overlap, _ = POOLED[kind]
        for e in range(n):
            if (kind, e) not in self._entries:
                self._entries[kind, e] = _pooled(self.data[kv], self.data[score], e, ratio, overlap)
        width = TOKEN_FIELDS[kv] // overlap
        return np.asarray([self._entries[kind, e] for e in range(n)]).reshape(n, width)


def _host(manager):
    """A numpy copy of the manager (the same pytree structure)."""
    return jax.tree.map(np.array, manager)


def _visible(manager):
    """The manager's leaves, without the full-attention pool's null page 0
    (padding K/V writes land there; it is garbage by design) and the
    write-back counters (a step of padding still counts its updates)."""
    pool = manager.full_pool
    return [jax.tree.leaves(manager.replace(full_pool=None, write_epochs=None)),
            pool.k_pages[:, :, 1:], pool.v_pages[:, :, 1:]]


def _window(stored, positions, newest, kv, valid, where):
    """``kv [k, W, D], valid [k, W]``: the SWA windows of tokens at
    ``positions [k]`` of one request whose ring entries are ``stored``
    (oldest first; rows before position 0 invalid). With ``newest``, the
    newest position written to the ring, rows at or before ``newest -
    WINDOW`` (overwritten) must be invalid too. Invalid rows are zeros."""
    positions = np.asarray(positions)[:, None]
    count = np.minimum(positions + 1, WINDOW)
    i = np.arange(WINDOW)[None, :]
    q = positions - count + 1 + i
    expect = i < count
    if newest is not None:
        expect &= q > newest - WINDOW
    np.testing.assert_array_equal(valid, expect, err_msg=f"{where}: valid rows")
    want = np.where(expect[..., None], stored[np.clip(q, 0, CONTEXT - 1)], 0.0)
    np.testing.assert_array_equal(kv.astype(np.float32), want, err_msg=f"{where}: values")


# --------------------------------------------------------------------------
# The state machine.
# --------------------------------------------------------------------------


class HybridFuzz(RuleBasedStateMachine):
    """admit / reserve / write / gather / release with real K/V data, good
    and bad inputs, device ops and host paths."""

    @initialize(seed=st.integers(0, 2**32 - 1), n=st.integers(1, MAX_REQS))
    def start(self, seed, n):
        self.rng = np.random.default_rng(seed)  # the K/V data: fresh draws at every step
        self.manager = _new_manager()
        self.reqs: dict[int, Request] = {}
        self._admit_device(n)

    # ---------------------------------------------------------------- model

    def _free_slots(self):
        return sorted(set(range(1, NUM_SLOTS)) - set(self.reqs))

    def _group_free(self, group):
        return NUM_BLOCKS[group] - 1 - sum(_blocks(group, r.reserved) for r in self.reqs.values())

    def _slot_choices(self):
        return sorted(self.reqs) + self._free_slots() + BAD_SLOTS + [-1]

    def _reserve_verdict(self, slots, counts):
        """None if ``reserve(slots, counts)`` must succeed; else the error the
        host path must raise: ``(type, ids)``, or ``(KVCacheOOM, [(requested,
        available, total, unit) of each group that is short])``."""
        active = [(s, n) for s, n in zip(slots, counts) if s != -1]
        ids = [s for s, _ in active]
        not_held = sorted({s for s in ids if s not in self.reqs})
        if not_held:
            return (InvalidId, not_held)
        repeated = sorted({s for s in ids if ids.count(s) > 1})
        if repeated:
            return (InvalidId, repeated)
        if any(not 0 <= n <= MAX_NEW for _, n in active):
            return (InvalidArgument, None)
        short = []
        for group in NUM_BLOCKS:
            need = sum(max(0, _blocks(group, self.reqs[s].reserved + n) - _blocks(group, self.reqs[s].reserved))
                       for s, n in active)
            if need > self._group_free(group):
                short.append((need, self._group_free(group), NUM_BLOCKS[group] - 1, f"{group} blocks"))
        if short:
            return (KVCacheOOM, short)  # the error names one of the groups that are short
        if any(_blocks(g, self.reqs[s].reserved + n) > GROUP_WIDTH[g] for g in NUM_BLOCKS for s, n in active):
            return (InvalidArgument, None)  # past the block tables (the context limit)
        return None

    def _state(self):
        return {s: (r.reserved, r.written) for s, r in self.reqs.items()}

    # ---------------------------------------------------------------- admit

    def _admit_device(self, n):
        before = self.manager
        manager, ids, ok = _admit(before, n, max_n=MAX_REQS)
        free = self._free_slots()
        ids = np.asarray(ids).tolist()
        assert bool(ok) == (0 <= n <= len(free)), (n, free, bool(ok))
        if not ok:
            assert ids == [-1] * MAX_REQS, ids
            assert_tree_equal(before, manager)
            return
        assert ids == free[:n] + [-1] * (MAX_REQS - n), (ids, free)  # lowest first
        self.manager = manager
        for s in free[:n]:
            self.reqs[s] = Request()

    def _admit_host(self, n):
        before = _host(self.manager)
        free = self._free_slots()
        is_int = isinstance(n, (int, np.integer)) and not isinstance(n, bool)
        if is_int and 0 <= n <= len(free):
            self.manager, ids = self.manager.admit_or_raise(n)
            assert ids == free[:n], (ids, free)
            for s in ids:
                self.reqs[s] = Request()
            return
        expected = KVCacheOOM if is_int and n > 0 else InvalidArgument
        with pytest.raises(expected) as info:
            self.manager.admit_or_raise(n)
        if expected is KVCacheOOM:
            err = info.value
            assert (err.requested, err.available, err.total) == (n, len(free), MAX_REQS), str(err)
        assert_tree_equal(before, self.manager)

    @rule(data=st.data())
    def admit(self, data):
        """Admit -1 .. 4 requests (3 slots), through the device op or the host
        path (also with counts that are not integers)."""
        if data.draw(st.booleans(), label="host"):
            self._admit_host(data.draw(st.sampled_from([0, 1, 2, 3, MAX_REQS + 1, -1, np.int64(1)] + NOT_INTS),
                                       label="n"))
        else:
            self._admit_device(data.draw(st.integers(-1, MAX_REQS + 1), label="n"))

    # ---------------------------------------------------------------- reserve

    def _reserve_device(self, slots, counts):
        before = self.manager
        manager, starts, ok = _reserve(before, jnp.asarray(slots, jnp.int32), jnp.asarray(counts, jnp.int32),
                                       max_new_tokens=MAX_NEW)
        verdict = self._reserve_verdict(slots, counts)
        event(f"reserve: {'ok' if verdict is None else verdict[0].__name__}")
        assert bool(ok) == (verdict is None), (slots, counts, verdict, self._state())
        if not ok:
            assert_tree_equal(before, manager)
            return
        self._apply_reserve(slots, counts, np.asarray(starts).tolist())
        self.manager = manager

    def _reserve_host(self, slots, counts):
        verdict = self._reserve_verdict(slots, counts)
        before = _host(self.manager)
        if verdict is None:
            self.manager, starts = self.manager.reserve_or_raise(slots, counts, max_new_tokens=MAX_NEW)
            self._apply_reserve(slots, counts, starts)
            return
        with pytest.raises(verdict[0]) as info:
            self.manager.reserve_or_raise(slots, counts, max_new_tokens=MAX_NEW)
        err = info.value
        if verdict[0] is KVCacheOOM:
            assert (err.requested, err.available, err.total, err.unit) in verdict[1], (str(err), verdict)
        elif verdict[0] is InvalidId:
            assert err.ids == verdict[1], (str(err), verdict)
        assert_tree_equal(before, self.manager)

    def _apply_reserve(self, slots, counts, starts):
        for b, (s, n) in enumerate(zip(slots, counts)):
            if s == -1:
                assert starts[b] == -1, starts
                continue
            assert starts[b] == self.reqs[s].reserved, (s, starts, self.reqs[s].reserved)
            self.reqs[s].reserved += n

    @rule(data=st.data())
    def reserve(self, data):
        """Reserve for up to three rows of any slots (held, free, bad, -1,
        repeated) and any counts (up to the static maximum, past it,
        negative), through the device op or the host path."""
        k = data.draw(st.integers(0, ROWS), label="rows")
        slots = data.draw(st.lists(st.sampled_from(self._slot_choices()), min_size=k, max_size=k), label="slots")
        counts = data.draw(st.lists(st.one_of(st.integers(0, MAX_NEW), st.sampled_from([MAX_NEW, -1, MAX_NEW + 1])),
                                    min_size=k, max_size=k), label="counts")
        slots, counts = slots + [-1] * (ROWS - k), counts + [0] * (ROWS - k)
        how = data.draw(st.sampled_from(["device", "host", "host, not integers"]), label="how")
        if how == "device":
            self._reserve_device(slots, counts)
        elif how == "host":
            self._reserve_host(slots, counts)
        else:
            held = sorted(self.reqs) or [1]
            bad = data.draw(st.sampled_from(NOT_INTS), label="bad")
            which = data.draw(st.sampled_from(["slots", "counts", "scalar slots", "lengths differ"]), label="which")
            slots, counts = [held[0], -1, -1], [1, 0, 0]
            if which == "slots":
                slots[1] = bad
            elif which == "counts":
                counts[0] = bad
            elif which == "scalar slots":
                slots = held[0]
            else:
                counts = [1, 0]
            before = _host(self.manager)
            with pytest.raises(InvalidArgument):
                self.manager.reserve_or_raise(slots, counts, max_new_tokens=MAX_NEW)
            assert_tree_equal(before, self.manager)

    # ---------------------------------------------------------------- release

    @rule(data=st.data())
    def release(self, data):
        """Release up to three rows of any slots, through the device op or the
        host path (also with ids that are not integers)."""
        k = data.draw(st.integers(0, ROWS), label="rows")
        slots = data.draw(st.lists(st.sampled_from(self._slot_choices()), min_size=k, max_size=k), label="slots")
        slots += [-1] * (ROWS - k)
        ids = [s for s in slots if s != -1]
        not_held = sorted({s for s in ids if s not in self.reqs})
        repeated = sorted({s for s in ids if ids.count(s) > 1})
        ok = not not_held and not repeated
        before = self.manager
        how = data.draw(st.sampled_from(["device", "host", "host, not integers"]), label="how")
        if how == "device":
            manager, done = _release(before, jnp.asarray(slots, jnp.int32))
            assert bool(done) == ok, (slots, sorted(self.reqs))
            if not done:
                assert_tree_equal(before, manager)
                return
        elif how == "host" and ok:
            manager = before.release_or_raise(slots)
        else:
            snapshot = _host(before)
            if how == "host":
                with pytest.raises(InvalidId) as info:
                    before.release_or_raise(slots)
                assert info.value.ids == (not_held or repeated), (str(info.value), not_held, repeated)
            else:
                bad = data.draw(st.sampled_from(NOT_INTS), label="bad")
                with pytest.raises(InvalidArgument):
                    before.release_or_raise(bad if data.draw(st.booleans(), label="scalar") else [*slots[:2], bad])
            assert_tree_equal(snapshot, self.manager)
            return
        self.manager = manager
        for s in ids:
            del self.reqs[s]
            for name, group in before.groups.items():
                blocks = np.asarray(group.tables)[s, : int(group.lens[s])]
                counts = np.asarray(manager.groups[name].allocator.ref_counts)
                assert (counts[blocks] == 0).all(), f"{name} blocks {blocks} of released slot {s} not free"

    # ---------------------------------------------------------------- write

    def _write(self, rows, pad_in_row):
        """One write step of ``rows`` = ``[(slot, start, n, good)]``; a good
        row writes a held request's next tokens (those past what it reserved
        are ignored), a bad row must change nothing."""
        before = self.manager
        # GDN states: the good rows, and the rows of slots that are not held (which must write nothing).
        manager, out, row_lanes, data = _write_rows(
            before, [(slot, start, n, good or slot not in self.reqs) for slot, start, n, good in rows], self.rng,
            pad_in_row)
        if not any(good for *_, good in rows):
            assert_tree_equal(_visible(before), _visible(manager))
        self.manager = manager
        for b, (slot, start, n, good) in enumerate(rows):
            lanes = row_lanes[b]
            if good:
                r = self.reqs[slot]
                end = min(start + n, r.reserved)
                if start < 128 <= end - 1:
                    event("write: crosses the 128-token block boundary")
                r.write(start, end, data, lanes[: end - start])
                r.gdn_rec, r.gdn_conv = data["gdn_rec"][b], data["gdn_conv"][b]
                mine = lanes[: end - start]
                # The SWA windows the step read before and after its writes.
                for layer in V4_LAYERS:
                    for when, newest in (("pre", None), ("post", end - 1)):
                        kv, valid = out[f"{when}{layer}"]
                        _window(r.swa_stored[layer], np.arange(start, end), newest, kv[mine], valid[mine],
                                f"write: {when}-write gather_swa, layer {layer}, slot {slot}")
                lanes = lanes[end - start:]  # the tokens past the reservation
            for layer in V4_LAYERS:
                for when in ("pre", "post"):
                    kv, valid = out[f"{when}{layer}"]
                    assert not valid[lanes].any() and not kv[lanes].astype(np.float32).any(), \
                        f"write: {when}-write gather_swa of a bad token, layer {layer}, slot {slot}"
        if any(not good for *_, good in rows):  # bad rows must not have touched the good data
            self._read_back()

    @rule(data=st.data())
    def write(self, data):
        """Held requests write some of their reserved tokens (some rows run
        past the reservation), beside bad rows: slots that are not held, and
        held slots at positions not reserved (the next tokens, past the
        table, far out, negative)."""
        pad_in_row = data.draw(st.booleans(), label="padding in the rows")
        pad = PAD_LANES if pad_in_row else 0
        pending = [s for s, r in sorted(self.reqs.items()) if r.reserved > r.written]
        good = data.draw(st.lists(st.sampled_from(pending), unique=True, max_size=len(pending)),
                         label="good") if pending else []
        rows, free = [], WRITE_T
        for s in good:
            r = self.reqs[s]
            n = min(data.draw(st.integers(1, CHUNK), label="n"), r.reserved - r.written, free - pad)
            n += data.draw(st.sampled_from([0, 0, 1, 5]), label="past the reservation")
            n = min(n, CHUNK, free - pad)
            if n >= 1:
                rows.append((s, r.written, n, True))
                free -= n + pad
        while len(rows) < REQ_ROWS and free - pad >= 1 and data.draw(st.booleans(), label="bad row?"):
            others = [s for s in sorted(self.reqs) if s not in [row[0] for row in rows]]
            n = min(data.draw(st.integers(1, CHUNK), label="bad n"), free - pad)
            if others and data.draw(st.booleans(), label="bad position?"):
                slot = data.draw(st.sampled_from(others), label="held slot")
                r = self.reqs[slot]
                start = data.draw(st.sampled_from([r.reserved, r.reserved + 5, CONTEXT, 10**6, -n - 2]),
                                  label="bad start")
            else:
                slot = data.draw(st.sampled_from(BAD_SLOTS + self._free_slots()), label="bad slot")
                start = data.draw(st.integers(0, 40), label="bad start")
            rows.append((slot, start, n, False))
            free -= n + pad
        if rows:
            order = data.draw(st.permutations(range(len(rows))), label="order")
            self._write([rows[i] for i in order], pad_in_row)

    @rule(data=st.data())
    def advance(self, data):
        """Reserve many tokens for held requests and write what they have
        pending (as much as a write holds): the fast way past the rings and
        the block boundaries."""
        if not self.reqs:
            return
        slots = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=len(self.reqs),
                                   unique=True), label="slots")
        counts = data.draw(st.lists(st.integers(1, MAX_NEW), min_size=len(slots), max_size=len(slots)),
                           label="counts")
        self._reserve_device(slots + [-1] * (ROWS - len(slots)), counts + [0] * (ROWS - len(slots)))
        pad_in_row = data.draw(st.booleans(), label="padding in the rows")
        pad = PAD_LANES if pad_in_row else 0
        rows, free = [], WRITE_T
        for s in slots:
            r = self.reqs[s]
            n = min(CHUNK, r.reserved - r.written, free - pad)
            if n >= 1:
                rows.append((s, r.written, n, True))
                free -= n + pad
        if rows:
            self._write(rows, pad_in_row)

    # ---------------------------------------------------------------- gather

    def _read_back(self, bad_row=None):
        """Read every written request back through every gather at random
        positions (its newest among them), and ``bad_row`` = ``(slot,
        positions)``, which must read nothing."""
        rows = []
        for s, r in sorted(self.reqs.items()):
            if r.written:
                rows.append((s, [r.written - 1] + self.rng.integers(0, r.written, size=GATHER_PER_ROW - 1).tolist()))
        if bad_row is not None:
            rows.append(bad_row)
        if not rows:
            return
        out, indices, q = _gather_rows(self.manager, rows, self.rng)
        event(f"gather: newest position read {max(self.reqs[s].written for s, _ in rows if s in self.reqs) // 32 * 32}+"
              if any(s in self.reqs and self.reqs[s].written for s, _ in rows) else "gather: nothing written")
        rec, conv = out["gdn"]
        for b, (slot, pos) in enumerate(rows):
            tokens = slice(b * GATHER_PER_ROW, (b + 1) * GATHER_PER_ROW)
            if bad_row is not None and b == len(rows) - 1:
                for name in READS:
                    kv, valid = out[name]
                    assert not valid[tokens].any() and not kv[tokens].astype(np.float32).any(), \
                        f"gather: {name} read something for bad row {bad_row}"
                assert not out["attend"][tokens].any(), f"gather: attend read something for bad row {bad_row}"
                if slot not in self.reqs:
                    assert not rec[b].any() and not conv[b].any(), f"GDN state read for slot {slot}, not held"
                continue
            self._check_request(out, tokens, slot, np.asarray(pos), indices[tokens], q[tokens], rec[b], conv[b])

    def _check_request(self, out, tokens, slot, pos, indices, q, rec, conv):
        r = self.reqs[slot]
        where = f"gather: slot {slot} at positions {pos.tolist()}"
        np.testing.assert_array_equal(rec, r.gdn_rec, err_msg=f"{where}: GDN recurrent state")
        np.testing.assert_array_equal(conv, r.gdn_conv, err_msg=f"{where}: GDN conv state")
        for layer in V4_LAYERS:
            kv, valid = out[f"swa{layer}"]
            _window(r.swa_stored[layer], pos, r.written - 1, kv[tokens], valid[tokens], f"{where}: layer {layer}")
        for kind, (*_, ratio, _, fmt) in POOLED.items():
            kv, valid = out[kind]
            counts = (pos + 1) // ratio
            np.testing.assert_array_equal(valid[tokens], np.arange(MAX_ENTRIES[kind])[None, :] < counts[:, None],
                                          err_msg=f"{where}: {kind} entries valid")
            exact = r.entries(kind, int(counts.max()))
            for j, n in enumerate(counts):
                assert not kv[tokens][j, n:].astype(np.float32).any(), f"{where}: {kind} rows past {n} not zero"
                _assert_fp8_close(kv[tokens][j, :n].astype(np.float32), exact[:n], fmt, f"{where}, token {j}: {kind}")
        kv, valid = out["topk"]
        counts = (pos + 1) // CSA_RATIO
        chosen = (indices >= 0) & (indices < counts[:, None])
        np.testing.assert_array_equal(valid[tokens], chosen, err_msg=f"{where}: top-k valid ({indices.tolist()})")
        assert not kv[tokens][~chosen].astype(np.float32).any(), f"{where}: top-k rows not chosen are not zero"
        exact = r.entries("csa", int(counts.max()))
        _assert_fp8_close(kv[tokens][chosen].astype(np.float32), exact[indices[chosen]], FMT, f"{where}: top-k")
        # Full attention over positions 0 .. p, dense, in float64. The kernel
        # works in float32: its logits are off by ~2**-23 of their size, which
        # moves the weights by that much (absolute), and the output by that
        # times the values' size; a wrong or missing K/V row costs ~the values' size.
        for j, p in enumerate(pos):
            keys, values = (r.data[name][: p + 1].astype(np.float64) for name in ("full_k", "full_v"))
            logits = q[j].astype(np.float64) @ keys.T / np.sqrt(KV_DIM)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            tol = 1e-5 * (1 + np.abs(logits).max()) * np.abs(values).max()
            np.testing.assert_allclose(out["attend"][tokens][j], (w / w.sum(-1, keepdims=True)) @ values,
                                       rtol=1e-4, atol=tol, err_msg=f"{where}: attend at position {p}")

    @rule(data=st.data())
    def gather(self, data):
        """Read back every written request, beside a bad row (a slot that is
        not held, or a held slot at negative or unreserved positions)."""
        bad_row = None
        if data.draw(st.booleans(), label="bad row?"):
            if self.reqs and data.draw(st.booleans(), label="bad positions?"):
                slot = data.draw(st.sampled_from(sorted(self.reqs)), label="held slot")
                r = self.reqs[slot]
                bad_row = (slot, [r.reserved, r.reserved + 3, -2, 10**6])
            else:
                slot = data.draw(st.sampled_from(BAD_SLOTS + self._free_slots()), label="bad slot")
                bad_row = (slot, self.rng.integers(0, 200, size=GATHER_PER_ROW).tolist())
        self._read_back(bad_row)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        """Slots, lengths and blocks match the model; every block is owned
        once or free; slots that are free or have nothing written hold
        initial state."""
        m = jax.tree.map(np.asarray, self.manager)  # one transfer per leaf, then numpy indexing
        held = m.slots.ref_counts
        assert sorted(np.nonzero(held)[0].tolist()) == sorted(self.reqs), (held, self._state())
        np.testing.assert_array_equal(np.asarray(m.seq_lens),
                                      [self.reqs[s].reserved if s in self.reqs else 0 for s in range(NUM_SLOTS)])
        for name, group in m.groups.items():
            tables, lens = np.asarray(group.tables), np.asarray(group.lens)
            counts = np.asarray(group.allocator.ref_counts)
            owned = []
            for s in range(NUM_SLOTS):
                want = _blocks(name, self.reqs[s].reserved) if s in self.reqs else 0
                assert lens[s] == want, (name, s, lens[s], want)
                owned += tables[s, : lens[s]].tolist()
                assert (tables[s, lens[s]:] == -1).all(), (name, s, tables[s])
            assert len(owned) == len(set(owned)) and not {0, -1} & set(owned), (name, owned)
            assert sorted(np.nonzero(counts)[0].tolist()) == sorted(owned), (name, counts, owned)
            assert (counts[owned] == 1).all(), (name, counts)
            assert int(group.allocator.num_free) == NUM_BLOCKS[name] - 1 - len(owned) == self._group_free(name), name
        blank = [s for s in range(1, NUM_SLOTS) if s not in self.reqs or not self.reqs[s].written]
        for s in blank:
            for layer in range(len(m.schemas)):
                cache = m.layer_cache(layer)
                if cache is None:
                    continue
                assert not np.asarray(cache.swa.nope[s]).astype(np.float32).any(), f"slot {s}: SWA ring, layer {layer}"
                assert not np.asarray(cache.swa.rope[s]).astype(np.float32).any(), f"slot {s}: SWA ring, layer {layer}"
                assert (np.asarray(cache.swa.scales[s]) == FMT.unit_scale).all(), f"slot {s}: SWA scales, layer {layer}"
                for kv, score in (("comp_kv", "comp_score"), ("index_kv", "index_score")):
                    if getattr(cache, kv) is not None:
                        assert not np.asarray(getattr(cache, kv)[s]).any(), f"slot {s}: {kv}, layer {layer}"
                        assert np.isneginf(np.asarray(getattr(cache, score)[s])).all(), f"slot {s}: {score}"
            if s not in self.reqs:
                assert not np.asarray(m.gdn.recurrent_state[:, s]).any(), f"free slot {s}: GDN state"
                assert not np.asarray(m.gdn.conv_state[:, s]).any(), f"free slot {s}: GDN conv state"


# ci: 15 x 40 steps (about 12 s here, a third of it compiling: CI time);
# long (JAXKV_HYPOTHESIS=long): the profile's 400 x 100.
if os.environ.get("JAXKV_HYPOTHESIS") != "long":
    HybridFuzz.TestCase.settings = settings(max_examples=15, stateful_step_count=40, deadline=None,
                                            suppress_health_check=list(HealthCheck))
test_hybrid_fuzz = pytest.mark.slow(HybridFuzz.TestCase)


# --------------------------------------------------------------------------
# Regressions: defects the fuzzer found, each pinned by a focused test.
# --------------------------------------------------------------------------


def _two_held():
    """Slots 1 and 2 held with 5 and 9 tokens reserved (the fuzzer's shapes:
    three rows, ``MAX_NEW``, so no new compiles)."""
    manager, _, ok = _admit(_new_manager(), 2, max_n=MAX_REQS)
    manager, _, ok2 = _reserve(manager, jnp.asarray([1, 2, -1], jnp.int32), jnp.asarray([5, 9, 0], jnp.int32),
                               max_new_tokens=MAX_NEW)
    assert bool(ok) and bool(ok2)
    return manager


def test_host_paths_refuse_ids_and_counts_that_are_not_integers():
    """``release_or_raise([True])`` released slot 1 and ``reserve_or_raise([1.7],
    ...)`` reserved for slot 1 (``int()`` truncated); ``admit_or_raise(True)``
    admitted a request and ``admit_or_raise(-1)`` raised KVCacheOOM for -1
    slots. Every one must raise InvalidArgument and change nothing."""
    manager = _two_held()
    before = _host(manager)
    calls = [lambda bad=bad: manager.admit_or_raise(bad) for bad in (-1, *NOT_INTS)]
    calls += [lambda bad=bad: manager.release_or_raise([bad]) for bad in NOT_INTS]
    calls += [lambda: manager.release_or_raise(None), lambda: manager.reserve_or_raise(1, 2)]
    calls += [lambda bad=bad: manager.reserve_or_raise([bad, -1, -1], [1, 0, 0], max_new_tokens=MAX_NEW)
              for bad in NOT_INTS]
    calls += [lambda bad=bad: manager.reserve_or_raise([1, -1, -1], [bad, 0, 0], max_new_tokens=MAX_NEW)
              for bad in NOT_INTS]
    calls += [lambda: manager.reserve_or_raise([1, 2, -1], [1, 1], max_new_tokens=MAX_NEW)]  # lengths differ
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
        assert_tree_equal(before, manager)


def test_host_paths_name_ids_outside_int32_instead_of_wrapping():
    """Slot ids int32 cannot hold raised OverflowError (not a KVCacheError);
    they are invalid slots: InvalidId naming them, nothing changed."""
    manager = _two_held()
    before = _host(manager)
    huge = 2**32 + 1  # wraps to slot 1 in int32
    with pytest.raises(InvalidId, match=str(huge)) as info:
        manager.reserve_or_raise([huge, -1, -1], [1, 0, 0], max_new_tokens=MAX_NEW)
    assert info.value.ids == [huge]
    with pytest.raises(InvalidId, match=str(huge)) as info:
        manager.release_or_raise([huge, -1, -1])
    assert info.value.ids == [huge]
    with pytest.raises(InvalidId, match=r"\[-2\]") as info:
        manager.release_or_raise([-2, -1, -1])
    assert info.value.ids == [-2]
    assert_tree_equal(before, manager)


def test_reserve_refuses_negative_slots_other_than_padding():
    """Only -1 is padding: ``reserve([-2], [1])`` succeeded as a no-op; it must
    fail (ok False, nothing changed) on device and raise InvalidId on the host."""
    manager = _two_held()
    after, starts, ok = _reserve(manager, jnp.asarray([-2, 1, -1], jnp.int32), jnp.asarray([1, 1, 0], jnp.int32),
                                 max_new_tokens=MAX_NEW)
    assert not bool(ok)
    assert_tree_equal(manager, after)
    with pytest.raises(InvalidId) as info:
        manager.reserve_or_raise([-2, -1, -1], [1, 0, 0], max_new_tokens=MAX_NEW)
    assert info.value.ids == [-2]


def _changed(before, after):
    """Names of the manager leaves that differ (the full pool's null page and
    the write-back counters aside)."""
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(before)[0]]
    pairs = zip(paths, jax.tree.leaves(before), jax.tree.leaves(after))
    changed = [p for p, a, b in pairs if not np.array_equal(np.asarray(a), np.asarray(b))]
    pool_a, pool_b = before.full_pool, after.full_pool
    if all(np.array_equal(np.asarray(getattr(pool_a, n))[:, :, 1:], np.asarray(getattr(pool_b, n))[:, :, 1:])
           for n in ("k_pages", "v_pages")):
        changed = [p for p in changed if not p.startswith(".full_pool")]
    return [p for p in changed if p != ".write_epochs"]


def test_handle_ignores_slots_that_are_not_held():
    """A handle row naming slot ``NUM_SLOTS`` or 9 (out of range) wrote its
    compressed entries, indexer keys and K/V into the blocks of the last slot
    (another request: the table lookup clipped the slot) and read them back
    as its own; the null slot 0 and a free slot had their rings written (a
    free slot must hold initial state) and read back as valid. Such rows are
    padding: they write nothing and read nothing."""
    rng = np.random.default_rng()
    manager, _, _ = _admit(_new_manager(), 3, max_n=MAX_REQS)
    manager, _, ok = _reserve(manager, jnp.asarray([1, 2, 3], jnp.int32), jnp.asarray([12, 12, 12], jnp.int32),
                              max_new_tokens=MAX_NEW)
    manager, *_ = _write_rows(manager, [(1, 0, 12, True), (2, 0, 12, True), (3, 0, 12, True)], rng)
    manager, ok = _release(manager, jnp.asarray([2, -1, -1], jnp.int32))  # slot 2 is free now
    assert bool(ok)
    bad = [(NUM_SLOTS, 0, 12, True), (9, 0, 12, True), (0, 0, 12, True), (2, 0, 12, True)]
    after, out, _, _ = _write_rows(manager, bad, rng)
    assert _changed(manager, after) == []
    for name in ("pre0", "post0", "pre1", "post2"):
        assert not out[name][1].any(), name
    out, _, _ = _gather_rows(manager, [(slot, [11, 7, 3, 0]) for slot, *_ in bad], rng)
    for name in READS:
        assert not out[name][1].any(), f"{name} read a slot that is not held"


def test_handle_ignores_unreserved_positions_and_reads_no_stale_entries():
    """Tokens at positions a request has not reserved wrote its SWA and
    compressor rings (overwriting rows of its window) and, inside an
    allocated block, stored entries; reads at such positions returned the
    entries a previous owner of the block left there (a cross-request leak).
    Such tokens are padding."""
    rng = np.random.default_rng()
    manager, _, _ = _admit(_new_manager(), 1, max_n=MAX_REQS)
    manager, _, _ = _reserve(manager, jnp.asarray([1, -1, -1], jnp.int32), jnp.asarray([16, 0, 0], jnp.int32),
                             max_new_tokens=MAX_NEW)
    manager, *_ = _write_rows(manager, [(1, 0, 16, True)], rng)  # CSA entries 0..3 in the block
    manager, ok = _release(manager, jnp.asarray([1, -1, -1], jnp.int32))
    manager, ids, _ = _admit(manager, 1, max_n=MAX_REQS)
    manager, _, ok = _reserve(manager, jnp.asarray([1, -1, -1], jnp.int32), jnp.asarray([4, 0, 0], jnp.int32),
                              max_new_tokens=MAX_NEW)  # the new request takes the same CSA block back
    assert bool(ok) and int(ids[0]) == 1
    manager, *_ = _write_rows(manager, [(1, 0, 4, True)], rng)  # entry 0 is its own
    out, _, _ = _gather_rows(manager, [(1, [15, 11, 4, 3])], rng)
    valid = out["csa"][1]
    assert valid[3].tolist() == [True] + [False] * (CSA_MAX - 1), "position 3 sees exactly entry 0"
    assert not valid[:3].any(), "positions 15, 11 and 4 are not reserved: they read nothing"
    for name in ("swa0", "topk", "index", "hca"):
        assert not out[name][1][:3].any(), name
    for start in (4, 31, 10**6):  # the next tokens (not reserved yet), inside the block, past the table
        after, *_ = _write_rows(manager, [(1, start, CHUNK, False)], rng)
        assert _changed(manager, after) == [], start


def test_gather_swa_with_step_entries_ignores_padding_tokens_in_the_row():
    """``gather_swa(kv)`` took the first position of a request's tokens in the
    step as the minimum over its tokens, padding (-1) included: one padding
    token in the request's row (or a token past its reservation) made every
    row of its window come from this step's entries (the wrong lanes)
    instead of the ring."""
    rng = np.random.default_rng()
    manager, _, _ = _admit(_new_manager(), 1, max_n=MAX_REQS)
    manager, _, _ = _reserve(manager, jnp.asarray([1, -1, -1], jnp.int32), jnp.asarray([8, 0, 0], jnp.int32),
                             max_new_tokens=MAX_NEW)
    manager, _, _, first = _write_rows(manager, [(1, 0, 6, True)], rng)  # positions 0..5 in the ring
    # Positions 6 and 7, then a padding lane of the same row.
    slots = jnp.asarray([1] + [-1] * REQ_ROWS, jnp.int32)
    positions = np.full(WRITE_T, -1, np.int32)
    request_ids = np.full(WRITE_T, REQ_ROWS, np.int32)
    positions[:2], request_ids[:3] = [6, 7], 0
    _, _, _, data = _write_rows(manager, [], rng)  # fresh data of the right shapes
    _, out = _write_step(manager, slots, jnp.asarray(positions), jnp.asarray(request_ids),
                         {k: jnp.asarray(v) for k, v in data.items()})
    stored = np.concatenate([_quantize(first["swa0"][:6], FMT), _quantize(data["swa0"][:2], FMT)])
    kv, valid = (np.asarray(x) for x in out["pre0"])
    _window(stored, [6, 7], None, kv[:2], valid[:2], "gather_swa(kv) beside a padding token")
