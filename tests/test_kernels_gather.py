"""Gather kernels (kernels_pallas.gather) and the compressed entry formats.

Every Pallas kernel runs in interpret mode (outputs poisoned with NaN first)
and must equal its pure-jnp reference bit for bit; the reference must in turn
equal an independent NumPy model written from the format description (loops
over tokens, the ring simulated write by write). Inputs are fresh random
draws; the null page and unused ring slots hold NaN so any read that should
not happen shows up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest


from kernels_pallas.errors import KernelArgumentError
from kernels_pallas import (
    DSV4_FP8,
    DSV32_FP8,
    CompressedEntries,
    EntryFormat,
    gather_all_compressed_kv,
    gather_compressed_kv,
    gather_swa_kv,
)
from tests.util import KERNEL_MODES

FORMATS = [DSV4_FP8, DSV32_FP8]
NUM_PAGES, PER_PAGE = 6, 4  # real entry widths, small pools


def _random_entries(rng, fmt, shape):
    """Random values of very different magnitudes per entry, quantized."""
    x = rng.standard_normal(shape + (fmt.head_dim,)) * rng.uniform(1e-3, 30.0, shape + (1,))
    return CompressedEntries.quantize(jnp.asarray(x, jnp.float32), fmt)


def _poison_rows(entries, where):
    """Entries with NaN values (and a NaN scale) at the leading-index mask ``where``."""
    nan8 = np.full(entries.nope.shape, np.nan, ml_dtypes.float8_e4m3fn)
    nope = np.where(where[..., None], nan8, np.asarray(entries.nope))
    rope = np.where(where[..., None], np.float32(np.nan), np.asarray(entries.rope, np.float32))
    scales = np.asarray(entries.scales).copy()
    if entries.fmt.scale_kind == "fp32":
        scales[where] = np.nan
    else:
        scales[where] = 255  # exponent 255: inf/NaN scale
    return CompressedEntries.from_parts(jnp.asarray(nope), jnp.asarray(scales),
                                       jnp.asarray(rope, jnp.bfloat16), entries.fmt)


def _np_dequant(entries, index):
    """Independent dequantization of entry ``index`` (a tuple) with NumPy."""
    fmt = entries.fmt
    nope = np.asarray(entries.nope)[index].astype(np.float32).reshape(fmt.num_groups, fmt.group_size)
    raw = np.asarray(entries.scales)[index]
    scale = (2.0 ** (raw.astype(np.float64) - 127)).astype(np.float32) if fmt.scale_kind == "ue8m0" else raw
    values = (nope * scale[:, None]).reshape(-1).astype(ml_dtypes.bfloat16)
    return np.concatenate([values, np.asarray(entries.rope)[index]]).astype(np.float32)


def _bits(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _assert_same(got, expected):
    """Bitwise equality of two ``(kv, valid)`` results (NaN counts as different)."""
    kv, valid = got
    assert not np.isnan(_bits(kv)).any(), "unwritten or leaked NaN in the output"
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(expected[1]))
    np.testing.assert_array_equal(_bits(kv), _bits(expected[0]))


def _paged_pool(rng, fmt):
    """A pool whose null page 0 is NaN, and tables that never name page 0."""
    pages = _random_entries(rng, fmt, (NUM_PAGES, PER_PAGE))
    null = np.zeros((NUM_PAGES, PER_PAGE), bool)
    null[0] = True
    return _poison_rows(pages, null)


def _random_table(rng, rows, width):
    """Page ids 1..P-1, with -1 holes and out-of-range garbage."""
    table = rng.integers(1, NUM_PAGES, (rows, width))
    table[rng.random((rows, width)) < 0.2] = -1
    table[rng.random((rows, width)) < 0.1] = NUM_PAGES + 3
    return table.astype(np.int32)


def _np_entry(pages, table_row, entry, limit):
    """(dequantized row, valid) of one logical entry, straight from the rules."""
    page_index = entry // PER_PAGE if entry >= 0 else -1
    if entry < 0 or entry >= limit or page_index >= len(table_row):
        return None
    page = table_row[page_index]
    if not 0 <= page < NUM_PAGES:
        return None
    return _np_dequant(pages, (page, entry % PER_PAGE))


def _np_fill(out, valid, at, row):
    if row is not None:
        out[at], valid[at] = row, True


# --------------------------------------------------------------------------
# Formats.
# --------------------------------------------------------------------------


def test_formats_have_the_peer_byte_sizes():
    assert (DSV4_FP8.bytes_per_entry, DSV32_FP8.bytes_per_entry) == (584, 656)
    assert (DSV4_FP8.head_dim, DSV32_FP8.head_dim) == (512, 576)
    with pytest.raises(KernelArgumentError, match="multiple of group_size"):
        EntryFormat("bad", nope_dim=100, rope_dim=64, group_size=64, scale_kind="ue8m0")
    with pytest.raises(KernelArgumentError, match="scale_kind"):
        EntryFormat("bad", nope_dim=128, rope_dim=64, group_size=64, scale_kind="int8")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_follows_the_flashmla_rule(fmt):
    rng = np.random.default_rng()
    x = rng.standard_normal((9, fmt.head_dim)) * rng.uniform(1e-6, 100.0, (9, 1))
    x[0, : fmt.nope_dim] = 0.0  # an all-zero entry still gets a normal scale
    entries = CompressedEntries.quantize(jnp.asarray(x, jnp.float32), fmt)
    assert entries.nbytes() == 9 * fmt.bytes_per_entry
    groups = x[:, : fmt.nope_dim].astype(np.float32).reshape(9, fmt.num_groups, fmt.group_size)
    amax = np.maximum(np.abs(groups).max(-1), 1e-4)
    expected_scale = 2.0 ** np.ceil(np.log2(amax.astype(np.float64) / 448.0))
    got_scale = np.asarray(entries.scale_values(), np.float64)
    np.testing.assert_array_equal(got_scale, expected_scale)
    if fmt.scale_kind == "ue8m0":
        assert entries.scales.dtype == jnp.uint8
    # Dequantization error is within e4m3's half ulp (2**-4 relative) or its
    # subnormal step, and RoPE is bf16-exact.
    deq = np.asarray(entries.dequantize(), np.float32)
    nope = deq[:, : fmt.nope_dim].reshape(groups.shape)
    bound = np.maximum(np.abs(groups) * 2.0**-4, expected_scale[..., None] * 2.0**-9) * 1.01 + 1e-30
    assert (np.abs(nope - groups) <= bound).all()
    np.testing.assert_array_equal(deq[:, fmt.nope_dim:], x[:, fmt.nope_dim:].astype(ml_dtypes.bfloat16))
    # The NumPy dequantization of the test model agrees bit for bit.
    for i in range(9):
        np.testing.assert_array_equal(deq[i], _np_dequant(entries, (i,)))


def test_entries_check_names_the_bad_array():
    entries = CompressedEntries.zeros(DSV4_FP8, (2, 3))
    assert float(jnp.abs(entries.dequantize().astype(jnp.float32)).max()) == 0.0
    bad = entries.replace(scales=entries.scales.astype(jnp.float32))
    with pytest.raises(KernelArgumentError, match=r"pages.scales must be uint8\[2, 3, 7\]"):
        bad.check("pages")


# --------------------------------------------------------------------------
# The three gathers: Pallas (interpret) == reference == NumPy model.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_gather_compressed_kv(fmt, interpret):
    rng = np.random.default_rng()
    pages = _paged_pool(rng, fmt)
    requests, width, tokens, k = 3, 4, 5, 37  # k is not a multiple of the tile
    for _ in range(50):  # redraw until the draw has both gathered and masked entries (rarely needed)
        table = _random_table(rng, requests, width)
        indices = rng.integers(-1, width * PER_PAGE + 3, (tokens, k)).astype(np.int32)
        token_rows = rng.integers(0, requests, tokens).astype(np.int32)
        limits = rng.integers(0, width * PER_PAGE + 2, tokens).astype(np.int32)
        out = np.zeros((tokens, k, fmt.head_dim), np.float32)
        valid = np.zeros((tokens, k), bool)
        for t in range(tokens):
            for j in range(k):
                _np_fill(out, valid, (t, j), _np_entry(pages, table[token_rows[t]], indices[t, j], limits[t]))
        if valid.any() and not valid.all():
            break
    assert valid.any() and not valid.all()

    kernel = gather_compressed_kv(pages, table, indices, token_rows, num_entries=limits, interpret=interpret)
    reference = gather_compressed_kv(pages, table, indices, token_rows, num_entries=limits,
                                     implementation="reference")
    _assert_same(kernel, reference)
    _assert_same(reference, (out, valid))


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_gather_compressed_kv_decode_rows_and_jit(interpret):
    """token_rows=None maps token t to table row t; works inside a user's jit."""
    rng = np.random.default_rng()
    fmt = DSV4_FP8
    pages = _paged_pool(rng, fmt)
    table = _random_table(rng, 2, 3)
    indices = rng.integers(-1, 12, (2, 8)).astype(np.int32)
    got = jax.jit(lambda p, t, i: gather_compressed_kv(p, t, i, interpret=interpret))(pages, table, indices)
    expected = gather_compressed_kv(pages, table, indices, np.arange(2, dtype=np.int32))
    _assert_same(got, expected)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_gather_all_compressed_kv(fmt, interpret):
    rng = np.random.default_rng()
    pages = _paged_pool(rng, fmt)
    width, max_entries = 4, 19  # 19: not a tile multiple; capacity 16 < 19
    table = _random_table(rng, 4, width)
    table[0] = rng.permutation(np.arange(1, NUM_PAGES))[:width]  # one fully valid row
    num_entries = np.array([16, 0, rng.integers(1, 16), 25], np.int32)

    kernel = gather_all_compressed_kv(pages, table, num_entries, max_entries=max_entries, interpret=interpret)
    reference = gather_all_compressed_kv(pages, table, num_entries, max_entries=max_entries,
                                         implementation="reference")
    _assert_same(kernel, reference)

    out = np.zeros((4, max_entries, fmt.head_dim), np.float32)
    valid = np.zeros((4, max_entries), bool)
    for b in range(4):
        for j in range(max_entries):
            _np_fill(out, valid, (b, j), _np_entry(pages, table[b], j, num_entries[b]))
    _assert_same(reference, (out, valid))
    assert valid[0, :16].all() and not valid[1].any()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_gather_swa_kv_before_and_after_wraparound(fmt, interpret):
    """Each request's ring is written token by token; the gather must return
    exactly the last min(pos + 1, W) tokens written, oldest first."""
    rng = np.random.default_rng()
    num_slots, window = 5, 12  # W not a power of two nor a tile multiple
    # Positions: empty, first token, ring not yet full, exactly full, wrapped
    # several times, plus one padding row with an out-of-range slot.
    positions = np.array([-1, 0, window - 3, window - 1, 3 * window + 5, 7], np.int32)
    slots = np.array([0, 1, 2, 3, 4, num_slots + 1], np.int32)
    history = {}  # slot -> list of token vectors, in position order
    ring_x = np.full((num_slots, window, fmt.head_dim), np.nan, np.float32)  # unwritten: NaN
    for b in range(5):
        tokens = rng.standard_normal((positions[b] + 1, fmt.head_dim)) * rng.uniform(1e-2, 10, (positions[b] + 1, 1))
        history[slots[b]] = tokens
        for p, token in enumerate(tokens):
            ring_x[slots[b], p % window] = token
    written = ~np.isnan(ring_x[..., 0])
    ring = CompressedEntries.quantize(jnp.asarray(np.nan_to_num(ring_x)), fmt)
    ring = _poison_rows(ring, ~written)

    kernel = gather_swa_kv(ring, slots, positions, interpret=interpret)
    reference = gather_swa_kv(ring, slots, positions, implementation="reference")
    _assert_same(kernel, reference)

    # Independent expectation: quantize each request's last n tokens directly
    # (in one padded batch, so one compile).
    last = np.zeros((len(slots), window, fmt.head_dim), np.float32)
    valid = np.zeros((len(slots), window), bool)
    for b in range(5):
        tail = history[slots[b]][-window:] if positions[b] >= 0 else history[slots[b]][:0]
        last[b, : len(tail)] = tail
        valid[b, : len(tail)] = True
    direct = _bits(CompressedEntries.quantize(jnp.asarray(last), fmt).dequantize())
    out = np.where(valid[..., None], direct, 0.0)
    _assert_same(reference, (out, valid))
    assert valid.sum(1).tolist() == [0, 1, window - 2, window, window, 0]


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_gathers_read_a_stacked_pool_at_a_traced_layer(interpret):
    """``layer=``: a stacked ``[L, ...]`` pool read at a (traced) layer
    gives exactly what the gather of that layer's own pool gives, for the
    kernel and the reference; a traced layer outside ``[0, L)`` reads
    nothing (all invalid, zeros); a Python int out of range raises."""
    rng = np.random.default_rng()
    fmt = DSV4_FP8
    layers = 3
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[_paged_pool(rng, fmt) for _ in range(layers)])
    rings = _random_entries(rng, fmt, (layers, 5, 12))
    table = _random_table(rng, 3, 4)
    indices = rng.integers(-1, 16, (5, 9)).astype(np.int32)
    token_rows = rng.integers(0, 3, 5).astype(np.int32)
    limits = rng.integers(0, 18, 5).astype(np.int32)
    num_entries = rng.integers(0, 18, 3).astype(np.int32)
    slots, positions = np.array([0, 2, 4, 1], np.int32), np.array([3, 30, -1, 11], np.int32)

    def gathers(pages, ring, **kw):
        return (gather_compressed_kv(pages, table, indices, token_rows, num_entries=limits, **kw),
                gather_all_compressed_kv(pages, table, num_entries, max_entries=11, **kw),
                gather_swa_kv(ring, slots, positions, **kw))

    at = jax.jit(lambda p, r, layer: gathers(p, r, layer=layer, interpret=interpret))
    for layer in range(layers):
        one = [jax.tree.map(lambda a: a[layer], x) for x in (stacked, rings)]
        want = gathers(*one, implementation="reference")
        for got in (at(stacked, rings, jnp.int32(layer)), gathers(stacked, rings, layer=layer,
                                                                  implementation="reference")):
            for g, w in zip(got, want):
                _assert_same(g, w)
    for out, valid in at(stacked, rings, jnp.int32(layers)):
        assert not np.asarray(valid).any() and not _bits(out).any()
    with pytest.raises(KernelArgumentError, match="layer 3 out of range"):
        gather_swa_kv(rings, slots, positions, layer=layers)
    with pytest.raises(KernelArgumentError, match=r"leading shape \[layers, num_slots, window\]"):
        gather_swa_kv(jax.tree.map(lambda a: a[0], rings), slots, positions, layer=0)  # an unstacked ring


# --------------------------------------------------------------------------
# Dispatch and argument errors.
# --------------------------------------------------------------------------


def test_default_on_cpu_is_the_reference_and_errors_are_typed():
    rng = np.random.default_rng()
    pages = _paged_pool(rng, DSV32_FP8)
    table = _random_table(rng, 2, 3)
    n = np.array([5, 9], np.int32)
    default = gather_all_compressed_kv(pages, table, n, max_entries=8)
    _assert_same(default, gather_all_compressed_kv(pages, table, n, max_entries=8, implementation="reference"))

    with pytest.raises(KernelArgumentError, match="cannot be combined"):
        gather_all_compressed_kv(pages, table, n, max_entries=8, implementation="reference", interpret=True)
    with pytest.raises(KernelArgumentError, match="implementation must be"):
        gather_all_compressed_kv(pages, table, n, max_entries=8, implementation="triton")
    with pytest.raises(KernelArgumentError, match=r"num_entries must have shape \(2,\)"):
        gather_all_compressed_kv(pages, table, n[:1], max_entries=8)
    with pytest.raises(KernelArgumentError, match="max_entries must be >= 1"):
        gather_all_compressed_kv(pages, table, n, max_entries=0)
    with pytest.raises(KernelArgumentError, match="indices must be an integer array"):
        gather_compressed_kv(pages, table, np.zeros((2, 4), np.float32))
    with pytest.raises(KernelArgumentError, match="one row per block_table row"):
        gather_compressed_kv(pages, table, np.zeros((3, 4), np.int32))
    with pytest.raises(KernelArgumentError, match=r"leading shape \[num_slots, window\]"):
        gather_swa_kv(CompressedEntries.zeros(DSV4_FP8, (8,)), np.zeros(1, np.int32), np.zeros(1, np.int32))
    with pytest.raises(KernelArgumentError, match=r"ring.nope must be float8_e4m3fn\[2, 4, 448\]"):
        good = CompressedEntries.zeros(DSV4_FP8, (2, 4))
        gather_swa_kv(good.replace(nope_bits=good.nope.astype(jnp.bfloat16)), np.zeros(1, np.int32), np.zeros(1, np.int32))


def test_gathers_lower_to_triton():
    """Cross-lowering for CUDA runs Pallas' Triton lowering here on CPU, which
    enforces what the interpreter does not (power-of-two tiles, supported
    ops), at real shapes: 32-entry pages, top-512, a 128-token ring."""
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32

    def pool(fmt, shape):
        return CompressedEntries.from_parts(sds(shape + (fmt.nope_dim,), jnp.float8_e4m3fn),
                                            sds(shape + (fmt.num_groups,), fmt.scale_dtype),
                                            sds(shape + (fmt.rope_dim,), jnp.bfloat16), fmt)

    def lowered(fn, *args, **kw):
        jitted = jax.jit(lambda *a: fn(*a, implementation="pallas", **kw))
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for fmt in FORMATS:
        pages = pool(fmt, (100, 32))
        table = sds((4, 9), i32)
        assert "triton" in lowered(gather_compressed_kv, pages, table, sds((16, 512), i32), sds((16,), i32))
        assert "triton" in lowered(gather_all_compressed_kv, pages, table, sds((4,), i32), max_entries=77)
        assert "triton" in lowered(gather_swa_kv, pool(fmt, (10, 128)), sds((4,), i32), sds((4,), i32))
