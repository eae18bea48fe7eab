"""Tests of jaxkv.manager.kernel_tables: block-table exports for the Pallas GPU,
FlashInfer and TPU ragged paged-attention kernels.

Inputs are fresh random tables each run (unseeded rng; the failing input is
printed by the assertion messages). Shapes come from a small fixed set so the
module-level jitted exports compile a handful of programs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ref_ragged_paged_attention,
)

import jaxkv
from jaxkv.errors import InvalidArgument, InvalidId
from jaxkv.manager.kernel_tables import (
    check_block_tables,
    check_query_lens,
    flashinfer_page_table,
    pallas_gpu_block_tables,
    pallas_gpu_pages_per_seq,
    tpu_ragged_tables,
)

_pallas = jax.jit(
    pallas_gpu_block_tables,
    static_argnames=("pages_per_compute_block", "k_splits", "page_size", "num_pages"),
)
_flashinfer = jax.jit(flashinfer_page_table, static_argnames=("page_size", "num_pages"))
_tpu = jax.jit(tpu_ragged_tables, static_argnames=("page_size", "num_pages"))

# (batch, max_pages, page_size, num_pages)
SHAPES = [(4, 5, 4, 16), (3, 1, 8, 4), (6, 12, 2, 40)]
# (pages_per_compute_block, k_splits)
PALLAS_CONFIGS = [(8, 16), (2, 2), (3, 2)]
ROUNDS = 12


def random_tables(rng, batch, max_pages, page_size, num_pages, *, min_length=0):
    """Random lengths in [min_length, max_pages*page_size] and, per sequence,
    distinct random pages in [1, num_pages) (sequences may share pages, as with
    prefix sharing); -1 past each sequence's pages."""
    lengths = rng.integers(min_length, max_pages * page_size + 1, size=batch)
    lengths[rng.random(batch) < 0.2] = max(min_length, 0)  # some empty rows
    lengths[rng.random(batch) < 0.2] = max_pages * page_size  # some full rows
    tables = np.full((batch, max_pages), -1, np.int64)
    for b in range(batch):
        n = -(-int(lengths[b]) // page_size)
        tables[b, :n] = rng.choice(np.arange(1, num_pages), size=n, replace=False)
    return tables.astype(np.int32), lengths.astype(np.int32)


def token_pages(tables, lengths, page_size):
    """Direct computation: per sequence, the (page, offset) of every token."""
    return [
        [(int(tables[b, t // page_size]), t % page_size) for t in range(int(lengths[b]))]
        for b in range(len(lengths))
    ]


def pallas_asserts_hold(width, ppcb, k_splits):
    """The asserts of jax's Pallas GPU paged_attention_unbatched."""
    if width == 0 or width % k_splits:
        return False
    ppp = width // k_splits
    return ppp % min(ppp, ppcb) == 0


# ------------------------------------------------------------ 1. round trips


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_all_exports(shape):
    batch, max_pages, ps, num_pages = shape
    rng = np.random.default_rng()
    for _ in range(ROUNDS):
        tables, lengths = random_tables(rng, batch, max_pages, ps, num_pages)
        check_block_tables(tables, lengths, ps, num_pages)
        expected = token_pages(tables, lengths, ps)
        msg = f"tables={tables.tolist()} lengths={lengths.tolist()} page_size={ps}"

        # Pallas GPU, with and without the optional page_size / num_pages.
        for ppcb, k_splits in PALLAS_CONFIGS:
            for kwargs in ({}, {"page_size": ps, "num_pages": num_pages}):
                pt, pl_lengths = map(np.asarray, _pallas(tables, lengths, pages_per_compute_block=ppcb,
                                                         k_splits=k_splits, **kwargs))
                width = pallas_gpu_pages_per_seq(max_pages, pages_per_compute_block=ppcb, k_splits=k_splits)
                assert pt.shape == (batch, width) and pt.dtype == np.int32, msg
                assert pallas_asserts_hold(width, ppcb, k_splits), (width, ppcb, k_splits)
                assert width >= max_pages
                np.testing.assert_array_equal(pl_lengths, lengths, err_msg=msg)
                assert ((pt >= 0) & (pt < num_pages)).all(), msg
                np.testing.assert_array_equal(pt[:, max_pages:], 0, err_msg=msg)
                got = [[(int(pt[b, t // ps]), t % ps) for t in range(int(lengths[b]))] for b in range(batch)]
                assert got == expected, msg
                if kwargs:  # canonical: everything but the live pages is the null page
                    live = np.arange(width)[None, :] < -(-lengths[:, None] // ps)
                    np.testing.assert_array_equal(pt[~live], 0, err_msg=msg)
                else:  # without page_size only -1 changes
                    np.testing.assert_array_equal(pt[:, :max_pages], np.where(tables < 0, 0, tables))

        # FlashInfer CSR.
        indptr, indices, last = map(np.asarray, _flashinfer(tables, lengths, page_size=ps))
        assert indptr.shape == (batch + 1,) and indices.shape == (batch * max_pages,) and last.shape == (batch,)
        assert ((indices >= 0) & (indices < num_pages)).all(), msg
        got = []
        for b in range(batch):
            n = int(indptr[b + 1] - indptr[b])
            length = (n - 1) * ps + int(last[b]) if n else 0
            got.append([(int(indices[indptr[b] + t // ps]), t % ps) for t in range(length)])
            if lengths[b] > 0:
                assert 1 <= last[b] <= ps, msg
        assert got == expected, msg

        # TPU ragged (decode: one query per non-empty sequence).
        qlens = (lengths > 0).astype(np.int32)
        kv_lens, page_indices, cu_q_lens, num_seqs = map(np.asarray, _tpu(tables, lengths, qlens, page_size=ps))
        np.testing.assert_array_equal(kv_lens, lengths)
        assert page_indices.shape == (batch, max_pages) and page_indices.dtype == np.int32
        assert ((page_indices >= 0) & (page_indices < num_pages)).all(), msg
        np.testing.assert_array_equal(cu_q_lens, np.concatenate([[0], np.cumsum(qlens)]))
        np.testing.assert_array_equal(num_seqs, [batch])
        got = [[(int(page_indices[b, t // ps]), t % ps) for t in range(int(kv_lens[b]))] for b in range(batch)]
        assert got == expected, msg


def test_pallas_width_is_smallest():
    for ppcb in range(1, 10):
        for k_splits in (1, 2, 3, 4, 16):
            for max_pages in range(60):
                width = pallas_gpu_pages_per_seq(max_pages, pages_per_compute_block=ppcb, k_splits=k_splits)
                assert width >= max(max_pages, 1) and pallas_asserts_hold(width, ppcb, k_splits)
                for smaller in range(max(max_pages, 1), width):
                    assert not pallas_asserts_hold(smaller, ppcb, k_splits), (max_pages, ppcb, k_splits, smaller)


def test_jittable_under_outer_jit_and_vmap_free_shapes():
    """The exports trace with abstract values only: shapes never depend on data."""
    tables = jax.ShapeDtypeStruct((4, 5), jnp.int32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    out = jax.eval_shape(lambda t, l: flashinfer_page_table(t, l, 4), tables, lengths)
    assert [o.shape for o in out] == [(5,), (20,), (4,)]
    out = jax.eval_shape(lambda t, l: tpu_ragged_tables(t, l, l, 4), tables, lengths)
    assert [o.shape for o in out] == [(4,), (4, 5), (5,), (1,)]
    out = jax.eval_shape(lambda t, l: pallas_gpu_block_tables(t, l, pages_per_compute_block=2, k_splits=2),
                         tables, lengths)
    assert [o.shape for o in out] == [(4, 8), (4,)]


# ------------------------------------------------------ 2. through the peers


def dense_attention(q, k_pages, v_pages, tables, lengths, page_size):
    """numpy reference: softmax(q k^T / sqrt(D)) v over each sequence's tokens,
    gathered straight from jaxkv's layout [KVH, P, ps, D] with block_tables."""
    batch, num_heads, dim = q.shape
    kvh = k_pages.shape[0]
    group = num_heads // kvh
    out = np.zeros((batch, num_heads, dim), np.float64)
    for b in range(batch):
        t = np.arange(int(lengths[b]))
        pages = tables[b, t // page_size]
        k = k_pages[:, pages, t % page_size].astype(np.float64)  # [KVH, L, D]
        v = v_pages[:, pages, t % page_size].astype(np.float64)
        for h in range(num_heads):
            logits = k[h // group] @ q[b, h].astype(np.float64) / math.sqrt(dim)
            w = np.exp(logits - logits.max())
            out[b, h] = (w / w.sum()) @ v[h // group]
    return out


def random_kv(rng, kvh, num_pages, ps, dim):
    k = rng.standard_normal((kvh, num_pages, ps, dim)).astype(np.float32)
    v = rng.standard_normal((kvh, num_pages, ps, dim)).astype(np.float32)
    # The null page holds large finite garbage: any read of it that is not
    # masked shows up in the output. (NaN would leak through the Pallas GPU
    # kernel even when masked: it multiplies weight-0 by the loaded V.)
    k[:, 0] = 1e4
    v[:, 0] = -1e4
    return k, v


def test_tpu_ragged_reference_decode():
    rng = np.random.default_rng()
    batch, max_pages, ps, num_pages, kvh, group, dim = 4, 5, 4, 16, 2, 2, 8
    for _ in range(3):
        tables, lengths = random_tables(rng, batch, max_pages, ps, num_pages, min_length=1)
        k, v = random_kv(rng, kvh, num_pages, ps, dim)
        q = rng.standard_normal((batch, kvh * group, dim)).astype(np.float32)
        kv_lens, page_indices, cu_q_lens, num_seqs = _tpu(tables, lengths, np.ones(batch, np.int32), page_size=ps)
        # jaxkv [KVH, P, ps, D] x2 -> TPU combined [P, ps, 2*KVH, D]: K of head h
        # at combined head 2h, V at 2h+1.
        kv_pages = np.stack([k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)], axis=3)
        kv_pages = kv_pages.reshape(num_pages, ps, 2 * kvh, dim)
        out = ref_ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(kv_pages), kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=1.0 / math.sqrt(dim),
        )
        expected = dense_attention(q, k, v, tables, lengths, ps)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-4,
                                   err_msg=f"tables={tables.tolist()} lengths={lengths.tolist()}")


def test_pallas_gpu_paged_attention_interpret():
    rng = np.random.default_rng()
    # max_pages 5 with k_splits 2, compute block 2 -> width 8: the kernel reads
    # padded columns (null page) inside its compute blocks.
    batch, max_pages, ps, num_pages, kvh, group, dim = 3, 5, 4, 12, 2, 2, 16
    ppcb, k_splits = 2, 2
    for _ in range(2):
        tables, lengths = random_tables(rng, batch, max_pages, ps, num_pages, min_length=1)
        k, v = random_kv(rng, kvh, num_pages, ps, dim)
        q = rng.standard_normal((batch, kvh * group, dim)).astype(np.float32)
        pt, pl_lengths = _pallas(tables, lengths, pages_per_compute_block=ppcb, k_splits=k_splits)
        assert pt.shape == (batch, 8)
        out = paged_attention(
            jnp.asarray(q / math.sqrt(dim)), jnp.asarray(k), jnp.asarray(v), pt, pl_lengths,
            pages_per_compute_block=ppcb, k_splits=k_splits, interpret=True,
        )
        expected = dense_attention(q, k, v, tables, lengths, ps)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-4,
                                   err_msg=f"tables={tables.tolist()} lengths={lengths.tolist()}")


# -------------------------------------------------------- 3. FlashInfer CSR


@pytest.mark.parametrize("shape", SHAPES)
def test_flashinfer_csr(shape):
    batch, max_pages, ps, num_pages = shape
    rng = np.random.default_rng()
    for _ in range(ROUNDS):
        tables, lengths = random_tables(rng, batch, max_pages, ps, num_pages)
        indptr, indices, last = map(np.asarray, _flashinfer(tables, lengths, page_size=ps))
        msg = f"tables={tables.tolist()} lengths={lengths.tolist()} page_size={ps}"
        assert indptr.dtype == indices.dtype == last.dtype == np.int32
        assert indptr[0] == 0 and (np.diff(indptr) >= 0).all(), msg
        num = np.diff(indptr)
        np.testing.assert_array_equal(num, -(-lengths // ps), err_msg=msg)
        # The identity holds for every row, empty ones too (last == page_size).
        np.testing.assert_array_equal((num - 1) * ps + last, lengths, err_msg=msg)
        assert ((last >= 1) & (last <= ps)).all(), msg
        np.testing.assert_array_equal(last[lengths == 0], ps, err_msg=msg)
        for b in range(batch):
            np.testing.assert_array_equal(indices[indptr[b]:indptr[b + 1]], tables[b, :num[b]], err_msg=msg)
        np.testing.assert_array_equal(indices[indptr[-1]:], 0, err_msg=msg)


def test_flashinfer_edge_rows():
    tables = np.array([[-1, -1], [3, -1], [5, 6], [-1, -1]], np.int32)
    lengths = np.array([0, 1, 8, 0], np.int32)
    indptr, indices, last = map(np.asarray, _flashinfer(tables, lengths, page_size=4))
    np.testing.assert_array_equal(indptr, [0, 0, 1, 3, 3])
    np.testing.assert_array_equal(indices, [3, 5, 6, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(last, [4, 1, 4, 4])


# ------------------------------------------- 4. validation and bad entries


def test_check_block_tables_errors():
    ok_tables = np.array([[1, 2, -1], [3, -1, -1]], np.int32)
    check_block_tables(ok_tables, [5, 4], 4, 8)
    check_block_tables(ok_tables, [0, 0], 4, 8)

    with pytest.raises(InvalidArgument, match=r"sequence 1 has length 13, needing 4 pages of 4 tokens, "
                                              r"but the block table has 3 columns"):
        check_block_tables(ok_tables, [5, 13], 4, 8)
    with pytest.raises(InvalidArgument, match=r"sequence 0 has negative length -2"):
        check_block_tables(ok_tables, [-2, 1], 4, 8)
    with pytest.raises(InvalidArgument, match=r"lengths \(3,\)"):
        check_block_tables(ok_tables, [1, 2, 3], 4, 8)
    with pytest.raises(InvalidArgument, match="page_size=0"):
        check_block_tables(ok_tables, [1, 1], 0, 8)

    # A live -1: sequence 0 holds 9 tokens -> 3 pages, column 2 is -1.
    with pytest.raises(InvalidId, match=r"block_tables\[0, 2\] = -1 .*length 9, 3 pages") as info:
        check_block_tables(ok_tables, [9, 4], 4, 8)
    assert info.value.ids == [-1]
    # The null page and ids beyond num_pages are not live pages.
    bad = np.array([[1, 0, -1], [8, 9, -1]], np.int32)
    with pytest.raises(InvalidId, match=r"block_tables\[0, 1\] = 0 .*\[1, 8\)") as info:
        check_block_tables(bad, [5, 8], 4, 8)
    assert info.value.ids == [0, 8, 9]
    # Entries past the live pages are not inspected.
    check_block_tables(bad, [4, 0], 4, 8)


def test_check_query_lens_errors():
    check_query_lens([1, 0, 3], [1, 0, 5])
    with pytest.raises(InvalidArgument, match=r"sequence 1 has query length 2 outside \[0, 1\]"):
        check_query_lens([1, 2, 1], [4, 1, 1])
    with pytest.raises(InvalidArgument, match=r"sequence 0 has query length -1"):
        check_query_lens([-1], [4])


def test_device_exports_never_read_out_of_range():
    """Device code does not raise: bad entries become the null page 0."""
    tables = np.array([[7, -1, 99], [-1, -1, -1]], np.int32)
    lengths = np.array([12, 3], np.int32)  # live: row 0 all three, row 1 column 0
    pt, _ = _pallas(tables, lengths, pages_per_compute_block=2, k_splits=2, page_size=4, num_pages=8)
    np.testing.assert_array_equal(pt, [[7, 0, 0, 0], [0, 0, 0, 0]])
    _, indices, _ = _flashinfer(tables, lengths, page_size=4, num_pages=8)
    np.testing.assert_array_equal(indices, [7, 0, 0, 0, 0, 0])
    _, page_indices, _, _ = _tpu(tables, lengths, np.ones(2, np.int32), page_size=4, num_pages=8)
    np.testing.assert_array_equal(page_indices, [[7, 0, 0], [0, 0, 0]])


def test_checked_mode_raises_typed_errors():
    tables = np.array([[7, -1, 2], [1, -1, -1]], np.int32)
    fi = jaxkv.checked(lambda t, l: flashinfer_page_table(t, l, 4, num_pages=8))
    fi(tables, np.array([4, 4], np.int32))
    with pytest.raises(InvalidId, match="page id -1") as info:
        fi(tables, np.array([12, 4], np.int32))
    assert info.value.ids == [-1]
    with pytest.raises(InvalidArgument, match=r"length 13 outside \[0, 12\]"):
        fi(tables, np.array([4, 13], np.int32))
    tpu = jaxkv.checked(lambda t, l, q: tpu_ragged_tables(t, l, q, 4))
    with pytest.raises(InvalidArgument, match="query length 5"):
        tpu(tables, np.array([4, 4], np.int32), np.array([5, 1], np.int32))


def test_static_argument_errors():
    tables = np.zeros((2, 3), np.int32)
    with pytest.raises(InvalidArgument, match="page_size=0"):
        flashinfer_page_table(tables, np.zeros(2, np.int32), 0)
    with pytest.raises(InvalidArgument, match="k_splits=0"):
        pallas_gpu_block_tables(tables, np.zeros(2, np.int32), k_splits=0)
    with pytest.raises(InvalidArgument, match=r"need int32 \[batch, max_pages\]"):
        tpu_ragged_tables(tables, np.zeros(3, np.int32), np.zeros(3, np.int32), 4)
