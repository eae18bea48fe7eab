"""Ragged paged attention: the reference and the Pallas kernel.

``kernels_pallas.ragged_attention.ragged_paged_attention_reference`` is checked
against two independent computations on fresh random inputs: the decode
reference ``kernels_pallas.reference.paged_decode_attention`` called once per
query token (lengths = position + 1, the token's own table row) and a float64
NumPy softmax over the gathered pages (for sinks, which the decode reference
does not have). The Pallas kernel (``ragged_kernel``) runs in Pallas'
interpreter (output NaN-poisoned first) and must match the reference.

Every draw has sequences with 0 and 1 queries, a prefill piece with cached
tokens before it, ``kv_len >= q_len``, permuted page tables with -1, garbage
and other sequences' pages past each sequence's pages, padding tokens past
``cu_q_lens[S]``, and NaN in the null page, in every page no live entry
names, in the tail of each last page and (window cases) before every
sequence's first window, so any read of those shows up. Isolation: finite
garbage there instead gives the bit-identical output.

Shapes are tiny and shared: each interpreted kernel configuration costs a
compile of a few seconds on CPU. Wider sweeps are ``long``; the compiled
kernel runs under ``gpu`` (skipped without one), H100 compiles under ``aot``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import KernelArgumentError, ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas import _gpu, ragged_reference
from kernels_pallas._dispatch import KernelFallbackWarning
from kernels_pallas.paged_attention import SharedMemoryExceeded, measured_entry
from kernels_pallas.ragged_attention import max_query_blocks, ragged_query_blocks, reference_block_q
from kernels_pallas.reference import paged_decode_attention
from tests.util import KERNEL_MODES

F32, BF16, FP8 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)
PS, M, P = 4, 6, 40  # page size, table width, pages (page 0 = null)
# The kernel multiplies q and K in q.dtype and casts p to q.dtype for the PV
# dot (flash convention); the reference is float32 throughout.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
F32_TOL = dict(atol=2e-5, rtol=2e-5)


def _new_rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return np.random.default_rng(seed), f"seed={seed}"


def _f32(x):
    return np.asarray(jnp.asarray(x, F32))


# --------------------------------------------------------------------------
# Random packed batches.
# --------------------------------------------------------------------------


def _lanes(rng, num_seqs):
    """(q_lens, kv_lens): a sequence with no query, a decode (1 query), a
    prefill piece after cached tokens, a whole-prompt prefill, then random."""
    q_lens = [0, 1, int(rng.integers(2, 9)), int(rng.integers(2, 7))]
    kv_lens = [int(rng.integers(0, M * PS + 1)), int(rng.integers(1, M * PS + 1))]
    kv_lens.append(int(rng.integers(q_lens[2] + 1, M * PS + 1)))
    kv_lens.append(q_lens[3])
    while len(q_lens) < num_seqs:
        q = int(rng.integers(0, 6))
        q_lens.append(q)
        kv_lens.append(int(rng.integers(q, M * PS + 1)))
    order = rng.permutation(num_seqs)
    return np.array(q_lens)[order], np.array(kv_lens)[order]


def make_case(rng, *, kvh=2, h=4, dk=32, dv=32, kv_dtype=BF16, q_dtype=BF16, scales=False, sinks=False,
              num_seqs=5, pad=3, tokens=None, window=None):
    """Random ragged inputs (``dv=None``: MLA). Returns ``(args, clean, info)``:
    ``args`` the keyword inputs with NaN wherever nothing may be read (see the
    module docstring), ``clean`` the same with finite garbage there, ``info``
    the per-token sequence and position of the real tokens. ``tokens``: a
    fixed stream length (else ``pad`` padding tokens after the real ones)."""
    q_lens, kv_lens = _lanes(rng, num_seqs)
    while (-(-kv_lens // PS)).sum() > P - 1:  # every sequence's live pages distinct (many sequences: redraw)
        q_lens, kv_lens = _lanes(rng, num_seqs)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + pad if tokens is None else tokens
    pad = t - int(cu[-1])
    assert pad >= 0, (t, cu)
    n_live = -(-kv_lens // PS)
    perm = rng.permutation(np.arange(1, P))
    table = np.empty((num_seqs, M), np.int64)
    junk = np.array([-1, -(10 ** 6), 10 ** 6, P, 0])
    readable = np.zeros((P, PS), bool)  # (page, slot) some query may attend
    off = 0
    seq_of, pos_of = [], []
    for s in range(num_seqs):
        n = n_live[s]
        table[s, :n] = perm[off:off + n]
        off += n
        table[s, n:] = np.where(rng.random(M - n) < 0.5, rng.choice(junk, M - n), rng.integers(0, P, M - n))
        first_pos = kv_lens[s] - q_lens[s]
        lowest = 0 if window is None else max(0, first_pos - window + 1)
        for p in range(lowest, kv_lens[s]):
            readable[table[s, p // PS], p % PS] = True
        seq_of += [s] * q_lens[s]
        pos_of += list(range(first_pos, kv_lens[s]))
    amp = 4.0 if kv_dtype == FP8 else 1.0
    k = rng.standard_normal((kvh, P, PS, dk)) * amp
    v = None if dv is None else rng.standard_normal((kvh, P, PS, dv)) * amp
    ks = rng.uniform(0.05, 0.5, (kvh, P, PS)) if scales else None
    vs = rng.uniform(0.05, 0.5, (kvh, P, PS)) if scales and dv is not None else None
    q = rng.standard_normal((t, h, dk))
    q[cu[-1]:] = rng.standard_normal((pad, h, dk)) * 1e3  # padding tokens: must not matter
    sink = jnp.asarray(rng.normal(0.0, 2.0, h), F32) if sinks else None

    def finish(fill):
        def put(x):
            if x is None:
                return None
            x = x.copy()
            x[:, ~readable] = fill(x[:, ~readable].shape)
            return x
        return dict(q=jnp.asarray(q, q_dtype), k_pages=jnp.asarray(put(k), kv_dtype),
                    v_pages=None if v is None else jnp.asarray(put(v), kv_dtype),
                    block_tables=jnp.asarray(table, jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                    cu_q_lens=jnp.asarray(cu), k_scales=None if ks is None else jnp.asarray(put(ks), F32),
                    v_scales=None if vs is None else jnp.asarray(put(vs), F32), sinks=sink)

    info = dict(seq=np.array(seq_of, np.int64), pos=np.array(pos_of, np.int64), num_real=int(cu[-1]))
    return finish(lambda s: np.full(s, np.nan)), finish(lambda s: rng.standard_normal(s)), info


def _check(actual, expected, tol, msg):
    actual, expected = _f32(actual), _f32(expected)
    assert not np.isnan(actual).any(), f"NaN in the output ({msg})"
    np.testing.assert_allclose(actual, expected, **tol, err_msg=msg)


# --------------------------------------------------------------------------
# Independent computations.
# --------------------------------------------------------------------------


def _per_token_decode(args, info, *, window=None, cap=None, mla_value_dim=None, sm_scale=None):
    """The decode reference once per real query token: its sequence's table,
    lengths = position + 1."""
    seq, pos = info["seq"], info["pos"]
    n = info["num_real"]
    return paged_decode_attention(
        args["q"][:n], args["k_pages"], args["v_pages"], args["block_tables"][seq],
        jnp.asarray(pos + 1, jnp.int32), args["k_scales"], args["v_scales"], sm_scale=sm_scale,
        sliding_window=window, logit_soft_cap=cap, mla_value_dim=mla_value_dim)


def _numpy_attention(args, info, *, window=None, cap=None, mla_value_dim=None, sm_scale=None):
    """Float64 softmax over each token's attended positions, sinks joining
    the denominator: ``exp(sink) / (sum exp(l) + exp(sink))`` is the weight
    of nothing."""
    q = _f32(args["q"]).astype(np.float64)
    k = _f32(args["k_pages"]).astype(np.float64)
    if args["k_scales"] is not None:
        k = k * _f32(args["k_scales"])[..., None]
    if args["v_pages"] is None:
        v = k[..., :mla_value_dim]
    else:
        v = _f32(args["v_pages"]).astype(np.float64)
        if args["v_scales"] is not None:
            v = v * _f32(args["v_scales"])[..., None]
    kvh = k.shape[0]
    t, h, dk = q.shape
    g = h // kvh
    sm = 1.0 / np.sqrt(dk) if sm_scale is None else sm_scale
    table = np.asarray(args["block_tables"])
    sinks = None if args["sinks"] is None else _f32(args["sinks"]).astype(np.float64)
    out = np.zeros((t, h, v.shape[-1]))
    for i, (s, p) in enumerate(zip(info["seq"], info["pos"])):
        lo = 0 if window is None else max(0, p - window + 1)
        keys = np.arange(lo, p + 1)
        pages, slots = table[s, keys // PS], keys % PS
        for head in range(h):
            kh = head // g
            logits = sm * (k[kh, pages, slots] @ q[i, head])
            if cap is not None:
                logits = cap * np.tanh(logits / cap)
            top = logits.max() if sinks is None else max(logits.max(), sinks[head])
            w = np.exp(logits - top)
            denom = w.sum() + (0.0 if sinks is None else np.exp(sinks[head] - top))
            out[i, head] = (w @ v[kh, pages, slots]) / denom
    return out


# --------------------------------------------------------------------------
# The reference against the independent computations.
# --------------------------------------------------------------------------

REFERENCE_CASES = {
    "gqa_bf16": dict(case=dict(kvh=2, h=4, dk=32, dv=32), kw=dict(), tol=BF16_TOL),
    "f32_window": dict(case=dict(kvh=2, h=6, dk=16, dv=24, kv_dtype=F32, q_dtype=F32, window=5),
                       kw=dict(sliding_window=5), tol=F32_TOL),
    "fp8_cap": dict(case=dict(kvh=1, h=3, dk=32, dv=32, kv_dtype=FP8, scales=True), kw=dict(logit_soft_cap=1.5),
                    tol=BF16_TOL),
    "mla_fp8": dict(case=dict(kvh=1, h=5, dk=48, dv=None, kv_dtype=FP8, scales=True), kw=dict(mla_value_dim=40),
                    tol=BF16_TOL),
}


@pytest.mark.parametrize("name,block_q,chunk", [(name, None, None) for name in REFERENCE_CASES]
                         + [("f32_window", 3, 8), ("mla_fp8", 3, 8)])
def test_reference_matches_per_token_decode(name, block_q, chunk, monkeypatch):
    """``chunk=8``: the reference's context loop takes 2 pages a step (3
    steps over the 6-page table; windows start past the first)."""
    if chunk is not None:
        monkeypatch.setattr(ragged_reference, "_CHUNK_TOKENS", chunk)
    rng, seed = _new_rng()
    spec = REFERENCE_CASES[name]
    window = spec["case"].get("window")
    args, clean, info = make_case(rng, **spec["case"])
    kw = spec["kw"]
    out = ragged_paged_attention_reference(**args, **kw, block_q=block_q)
    n = info["num_real"]
    assert out.shape[:2] == args["q"].shape[:2] and out.dtype == args["q"].dtype
    expected = _per_token_decode(args, info, window=window, cap=kw.get("logit_soft_cap"),
                                 mla_value_dim=kw.get("mla_value_dim"))
    _check(out[:n], expected, spec["tol"], f"{seed} {name}")
    np.testing.assert_array_equal(_f32(out[n:]), 0.0, err_msg=f"{seed}: padding tokens are zeros")
    # Isolation: what nothing may read changes no bit of the output.
    np.testing.assert_array_equal(_f32(ragged_paged_attention_reference(**clean, **kw, block_q=block_q)), _f32(out),
                                  err_msg=seed)


@pytest.mark.parametrize("window", [None, 3])
def test_reference_sinks_match_numpy(window):
    rng, seed = _new_rng()
    args, _, info = make_case(rng, kvh=2, h=4, dk=16, dv=16, kv_dtype=F32, q_dtype=F32, sinks=True, window=window)
    out = ragged_paged_attention_reference(**args, sliding_window=window, sm_scale=0.3)
    expected = _numpy_attention(args, info, window=window, sm_scale=0.3)
    _check(out, expected, dict(atol=1e-5, rtol=1e-5), seed)
    # Without sinks the same NumPy model is the per-token decode reference.
    args["sinks"] = None
    _check(ragged_paged_attention_reference(**args, sliding_window=window, sm_scale=0.3),
           _numpy_attention(args, info, window=window, sm_scale=0.3), dict(atol=1e-5, rtol=1e-5), seed)


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_reference_reads_the_pool_in_place(dtype):
    """The CPU path runs every step: compiled for CPU, the reference makes no
    buffer the size of a layer's pages (no whole-pool float32 convert hoisted
    out of its context loop, no layer sliced out of the stacked pool), with
    the layer static, traced, or a single-layer pool."""
    from tests.util import pool_sized_copies

    sds = jax.ShapeDtypeStruct
    layers, kvh, pages, page, dim = 3, 2, 2049, 16, 64
    fp8 = dtype == FP8
    layer_bytes = kvh * pages * page * dim * dtype.itemsize
    for layer in (None, 1, "traced"):
        lead = () if layer is None else (layers,)
        pool = sds(lead + (kvh, pages, page, dim), dtype)
        scales = sds(lead + (kvh, pages, page), F32) if fp8 else None
        args = (sds((40, 4, dim), BF16), pool, pool, sds((8, 64), jnp.int32), sds((8,), jnp.int32),
                sds((9,), jnp.int32), scales, scales)
        if layer == "traced":
            fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a[:-1], layer=a[-1]))
            args += (sds((), jnp.int32),)
        else:
            fn = jax.jit(functools.partial(ragged_paged_attention_reference, layer=layer))
        copies = pool_sized_copies(fn.trace(*args).lower().compile().as_text(), layer_bytes)
        assert copies == [], (layer, copies)


def test_query_blocks_cover_every_token_once():
    """``ragged_query_blocks`` with the static bound of ``max_query_blocks``:
    every real token in exactly one block, blocks of one sequence each,
    positions ``kv_len - q_len + offset``; also for cu_q_lens out of
    contract (decreasing, past T), which are clipped, not trusted."""
    rng, seed = _new_rng()
    num_seqs, t = 6, 50  # fixed shapes: one compile per block_q
    blocks = {bq: jax.jit(functools.partial(ragged_query_blocks, num_tokens=t, block_q=bq)) for bq in (1, 3, 8)}
    for _ in range(10):
        q_lens = rng.integers(0, 9, num_seqs) * (rng.random(num_seqs) < 0.8)
        kv_lens = q_lens + rng.integers(0, 5, num_seqs)
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        for bq, fn in blocks.items():
            seq, first, rows_ok, tokens, pos = (np.asarray(x) for x in fn(jnp.asarray(cu, jnp.int32),
                                                                           jnp.asarray(kv_lens, jnp.int32)))
            assert len(seq) == max_query_blocks(t, num_seqs, bq)
            covered = np.sort(tokens[rows_ok])
            np.testing.assert_array_equal(covered, np.arange(cu[-1]), err_msg=seed)
            lane = np.searchsorted(cu[1:], tokens[rows_ok], side="right")
            np.testing.assert_array_equal(np.broadcast_to(seq[:, None], rows_ok.shape)[rows_ok], lane)
            np.testing.assert_array_equal(pos[rows_ok], kv_lens[lane] - q_lens[lane] + tokens[rows_ok] - cu[lane])
    bad = jnp.asarray([0, 5, 2, 9], jnp.int32)  # decreasing, and past T = 6
    _, _, rows_ok, tokens, _ = ragged_query_blocks(bad, jnp.asarray([5, 5, 5], jnp.int32), 6, 2)
    np.testing.assert_array_equal(np.sort(np.asarray(tokens)[np.asarray(rows_ok)]), np.arange(6))
    assert reference_block_q(64, 64) == 1 and reference_block_q(100, 4) == 16 and reference_block_q(9, 4) == 4


# --------------------------------------------------------------------------
# The Pallas kernel (interpreted; compiled under ``gpu``) against the reference.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gqa_bf16():
    rng, seed = _new_rng()
    return make_case(rng, kvh=2, h=4, dk=32, dv=32), seed


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_kernel_bf16_gqa_matches_reference(gqa_bf16, interpret):
    (args, clean, info), seed = gqa_bf16
    out = ragged_paged_attention(**args, block_q=2, interpret=interpret)
    assert out.shape == (args["q"].shape[0], 4, 32) and out.dtype == BF16
    ref = ragged_paged_attention(**args, implementation="reference")
    _check(out, ref, BF16_TOL, seed)
    np.testing.assert_array_equal(_f32(out[info["num_real"]:]), 0.0, err_msg=f"{seed}: padding tokens")
    np.testing.assert_array_equal(_f32(ragged_paged_attention(**clean, block_q=2, interpret=interpret)), _f32(out),
                                  err_msg=f"{seed}: isolation")


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_kernel_fp8_scales_cap_sinks(interpret):
    """fp8 e4m3 pages with per-token scales, a soft cap that bites (scaled
    logits are O(1-5) here), sinks; 3 query heads per KV head (12 rows of a
    16-row program: rows of the next block are loaded and never stored)."""
    rng, seed = _new_rng()
    args, clean, _ = make_case(rng, kvh=2, h=6, dk=32, dv=32, kv_dtype=FP8, scales=True, sinks=True)
    kw = dict(logit_soft_cap=1.5)
    out = ragged_paged_attention(**args, **kw, block_q=4, interpret=interpret)
    _check(out, ragged_paged_attention_reference(**args, **kw), BF16_TOL, seed)
    np.testing.assert_array_equal(_f32(ragged_paged_attention(**clean, **kw, block_q=4, interpret=interpret)),
                                  _f32(out), err_msg=f"{seed}: isolation")


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_kernel_traced_window_float32(interpret):
    """A traced window inside the caller's jit (one compile for every
    value), float32 end to end so the tolerance is tight; compute blocks of 4
    pages over a 6-page table (the last block reads past the width: clamped
    and masked); NaN before each sequence's first window."""
    rng, seed = _new_rng()

    @jax.jit
    def run(a, window):
        return (ragged_paged_attention(**a, sliding_window=window, block_q=3, interpret=interpret),
                ragged_paged_attention(**a, sliding_window=window, implementation="reference"))

    for w in (1, PS + 1, 9, 100):
        args, _, _ = make_case(rng, kvh=2, h=4, dk=32, dv=16, kv_dtype=F32, q_dtype=F32, window=w, tokens=24)
        ours, ref = run(args, jnp.int32(w))
        _check(ours, ref, F32_TOL, f"{seed} window={w}")


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_kernel_mla_fp8_row_blocks(interpret):
    """MLA: value = the first 40 of 64 latent dims (K chunks 32, 8 | 16, 8;
    the value chunks reused as V; 8 < 16 takes the non-dot path). Value
    width 512 would give 16-row programs; here ``block_q=4`` x 20 heads = 80
    rows pad to 128 and run as 2 row blocks of 64."""
    rng, seed = _new_rng()
    args, _, _ = make_case(rng, kvh=1, h=20, dk=64, dv=None, kv_dtype=FP8, scales=True)
    kw = dict(mla_value_dim=40)
    out = ragged_paged_attention(**args, **kw, block_q=4, interpret=interpret)
    assert out.shape == (args["q"].shape[0], 20, 40)
    _check(out, ragged_paged_attention_reference(**args, **kw), BF16_TOL, seed)


def test_kernel_stacked_pool_by_layer(gqa_bf16):
    """A layer of the stacked ``[L, ...]`` pool, as the models pass it, and
    the default block_q."""
    (args, _, _), seed = gqa_bf16
    other = jnp.full_like(args["k_pages"], jnp.nan)
    stacked = dict(args, k_pages=jnp.stack([other, args["k_pages"]]), v_pages=jnp.stack([other, args["v_pages"]]))
    out = ragged_paged_attention(**stacked, layer=1, interpret=True)
    _check(out, ragged_paged_attention(**args, implementation="reference"), BF16_TOL, seed)
    _check(ragged_paged_attention(**stacked, layer=1), out, BF16_TOL, seed)  # the reference by layer


def test_kernel_lowers_to_triton():
    """Cross-lowering for CUDA runs the Triton lowering on CPU, which
    enforces what the interpreter does not (power-of-two tensors, supported
    ops), at realistic shapes: GQA fp8 with window, cap and sinks; MLA
    576/512 with 128 heads (8 row blocks); odd head dims and a page of one
    token; float32, whose dots must be IEEE (not TF32: the reference is
    float32). One launch per call, its grid the planned programs."""
    from kernels_pallas.lowered import triton_calls
    from kernels_pallas.ragged_kernel import plan_ragged

    sds = jax.ShapeDtypeStruct

    def lower(t, s, h, kvh, ps, dk, dv, kv_dtype, mla, q_dtype=BF16, **kw):
        k = sds((kvh, 300, ps, dk), kv_dtype)
        v = None if mla else sds((kvh, 300, ps, dv), kv_dtype)
        sc = sds((kvh, 300, ps), F32) if kv_dtype == FP8 else None
        fn = jax.jit(functools.partial(ragged_paged_attention, implementation="pallas",
                                       mla_value_dim=dv if mla else None, **kw))
        args = (sds((t, h, dk), q_dtype), k, v, sds((s, 37), jnp.int32), sds((s,), jnp.int32),
                sds((s + 1,), jnp.int32), sc, None if mla else sc)
        (call,) = triton_calls(fn.trace(*args).lower(lowering_platforms=("cuda",)))
        assert call.name.startswith("jaxkv_ragged_paged_attention"), call.name
        shape = plan_ragged(*args[:5], mla_value_dim=dv if mla else None)
        assert call.grid == (shape.programs, 1, 1), (call.grid, shape)
        return call, shape

    lower(96, 8, 32, 8, 16, 128, 128, FP8, False, logit_soft_cap=30.0, sliding_window=100, sinks=jnp.zeros(32))
    _, mla = lower(40, 8, 128, 1, 64, 576, 512, FP8, True)
    assert mla.row_blocks == 8 and mla.block_rows == 16
    lower(33, 5, 12, 4, 1, 80, 72, BF16, False)
    call, _ = lower(24, 3, 8, 2, 16, 64, 64, F32, False, q_dtype=F32)
    dots = [line for line in call.ttir.splitlines() if "tt.dot" in line]
    assert len(dots) == 2 and all("f32>" in d for d in dots) and not any("inputPrecision" in d for d in dots), dots


def test_dispatch_and_errors(gqa_bf16):
    (args, _, _), seed = gqa_bf16
    # Default on CPU: the reference, bit for bit.
    np.testing.assert_array_equal(_f32(ragged_paged_attention(**args)), _f32(ragged_paged_attention_reference(**args)))
    with pytest.raises(KernelArgumentError, match="interpret=True"):
        ragged_paged_attention(**args, implementation="reference", interpret=True)
    with pytest.raises(KernelArgumentError, match="implementation"):
        ragged_paged_attention(**args, implementation="triton")
    bad = [
        (dict(q=args["q"][:, :3]), "multiple of KV heads"),
        (dict(q=args["q"][..., :16]), "head dim"),
        (dict(q=args["q"].astype(jnp.int32)), "float"),
        (dict(block_tables=args["block_tables"][0]), "block_tables"),
        (dict(block_tables=args["block_tables"].astype(F32)), "block_tables"),
        (dict(kv_lens=args["kv_lens"][:3]), "kv_lens"),
        (dict(cu_q_lens=args["cu_q_lens"][:-1]), "cu_q_lens"),
        (dict(v_pages=None), "mla_value_dim"),
        (dict(v_pages=args["v_pages"][:, :3]), "v_pages"),
        (dict(k_scales=jnp.ones((2, P), F32)), "k_scales"),
        (dict(k_pages=args["k_pages"].astype(FP8), v_pages=args["v_pages"].astype(FP8)), "scales is None"),
        (dict(sinks=jnp.zeros(3, F32)), "sinks"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), "sinks"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(logit_soft_cap=-1.0), "logit_soft_cap"),
        (dict(block_q=0), "block_q"),
    ]
    for change, words in bad:
        for mode in (dict(interpret=True), dict(implementation="reference")):
            with pytest.raises(KernelArgumentError, match=words):
                ragged_paged_attention(**{**args, **change}, **mode)
    with pytest.raises(KernelArgumentError, match="pages_per_compute_block"):
        ragged_paged_attention_pallas_direct(args, pages_per_compute_block=3)
    with pytest.raises(KernelArgumentError, match="layer"):
        ragged_paged_attention(**args, layer=0, interpret=True)  # pages are not stacked
    stacked = dict(args, k_pages=args["k_pages"][None], v_pages=args["v_pages"][None])
    with pytest.raises(KernelArgumentError, match="out of range"):
        ragged_paged_attention(**stacked, layer=1, interpret=True)
    with pytest.raises(KernelArgumentError, match="integer scalar"):
        jax.jit(lambda a, i: ragged_paged_attention(**a, layer=i, interpret=True))(stacked, 0.0)
    # A page size that is not a power of two: an error on the Pallas path,
    # the reference when the implementation is left to the default.
    odd = {**args, "k_pages": args["k_pages"][:, :, :3], "v_pages": args["v_pages"][:, :, :3]}
    with pytest.raises(KernelArgumentError, match="power-of-two page size"):
        ragged_paged_attention(**odd, interpret=True)
    np.testing.assert_array_equal(_f32(ragged_paged_attention(**odd)),
                                  _f32(ragged_paged_attention_reference(**odd)))
    # No block shape fits shared memory: the default dispatch runs the
    # reference with a warning that says why; asking for the kernel raises.
    tiny = dataclasses.replace(_gpu.H100, smem_per_block=4096, smem_per_sm=8192)
    with _gpu.building_for(tiny):
        with pytest.warns(KernelFallbackWarning, match="shared memory"):
            jax.eval_shape(lambda a: ragged_paged_attention(**a), args)
        with pytest.raises(SharedMemoryExceeded, match="ragged_paged_attention"):
            jax.eval_shape(lambda a: ragged_paged_attention(**a, implementation="pallas"), args)


def ragged_paged_attention_pallas_direct(args, **knobs):
    from kernels_pallas.ragged_kernel import ragged_paged_attention_pallas

    return ragged_paged_attention_pallas(**args, interpret=True, **knobs)


def test_no_tokens_and_all_padding():
    """T = 0 returns an empty output; a stream of padding only is zeros."""
    rng, _ = _new_rng()
    args, _, _ = make_case(rng, kvh=2, h=4, dk=16, dv=16, kv_dtype=F32, q_dtype=F32)
    empty = dict(args, q=args["q"][:0], cu_q_lens=jnp.zeros_like(args["cu_q_lens"]))
    for mode in (dict(interpret=True), dict(implementation="reference")):
        assert ragged_paged_attention(**empty, **mode).shape == (0, 4, 16)
        idle = dict(args, cu_q_lens=jnp.zeros_like(args["cu_q_lens"]))
        np.testing.assert_array_equal(_f32(ragged_paged_attention(**idle, **mode)), 0.0)


# --------------------------------------------------------------------------
# Wider sweeps (pytest -m long).
# --------------------------------------------------------------------------


@pytest.mark.parametrize("draw", range(12))
def test_long_kernel_sweep(draw):
    """More sequences and draws through every option at once: GQA groups of
    1-8, block_q 1-8, windows, caps, sinks, fp8/bf16/float32 pages, MLA."""
    rng, seed = _new_rng()
    options = [
        dict(case=dict(kvh=4, h=4, dk=16, dv=16, kv_dtype=F32, q_dtype=F32), kw=dict(), tol=F32_TOL, bq=8),
        dict(case=dict(kvh=1, h=8, dk=32, dv=32, sinks=True, window=6), kw=dict(sliding_window=6), tol=BF16_TOL,
             bq=1),
        dict(case=dict(kvh=2, h=10, dk=48, dv=24, kv_dtype=FP8, scales=True, sinks=True),
             kw=dict(logit_soft_cap=2.0), tol=BF16_TOL, bq=5),
        dict(case=dict(kvh=1, h=16, dk=80, dv=None, kv_dtype=BF16), kw=dict(mla_value_dim=64), tol=BF16_TOL, bq=2),
    ]
    spec = options[draw % len(options)]
    args, clean, info = make_case(rng, num_seqs=9, pad=5, **spec["case"])
    out = ragged_paged_attention(**args, **spec["kw"], block_q=spec["bq"], interpret=True)
    ref = ragged_paged_attention_reference(**args, **spec["kw"])
    _check(out, ref, spec["tol"], f"{seed} draw={draw}")
    np.testing.assert_array_equal(
        _f32(ragged_paged_attention(**clean, **spec["kw"], block_q=spec["bq"], interpret=True)), _f32(out),
        err_msg=f"{seed}: isolation")
    expected = _numpy_attention(args, info, window=spec["kw"].get("sliding_window"),
                                cap=spec["kw"].get("logit_soft_cap"), mla_value_dim=spec["kw"].get("mla_value_dim"))
    _check(ref, expected, spec["tol"], f"{seed} draw={draw} reference vs numpy")


# --------------------------------------------------------------------------
# Compiled for H100 without a GPU (needs jax[cuda12]).
# --------------------------------------------------------------------------


def test_aot_ragged_layer_read_in_place_and_mla_row_blocks():
    """The stacked-pool cases (a static layer, a traced one, a ``lax.scan``
    over the layers) compile with no copy of a layer's pool and no spill;
    MLA with 128 heads runs 8 row blocks of 16 side by side (the fastest
    grid index); the registers and shared memory recorded in measured.json
    are those of the compiled kernels (a traced layer's kernel shares the
    static one's key). (The whole ragged matrix compiles in
    ``test_kernels_aot.py``, through ``aot_check.cases``.)"""
    from kernels_pallas import aot_check

    picked = [c for c in aot_check.ragged_cases() if "layer=" in c.name or ("mla" in c.name and "H=128" in c.name
                                                                          and "bfloat16" in c.name)]
    assert len(picked) == 5
    for case in picked:
        r = aot_check.compile_case(case, "h100")
        assert r.status == "ok" and r.spill_bytes == 0 and r.hlo_copies == [], r.row()
        assert r.smem_bytes <= r.planned["smem_bytes"], r.row()
        assert r.grid[0] == r.planned["programs"], r.row()
        if "mla" in case.name and "H=128" in case.name:
            assert r.planned["row_blocks"] == 8 and r.planned["block_rows"] == 16, r.row()
        # measured.json is current for this kernel body (aot_check --only ragged --record).
        entry = measured_entry(_gpu.H100, r.planned["key"])
        assert entry and entry["smem_bytes"] == r.smem_bytes and abs(entry["registers"] - r.registers) <= 8, r.row()
        assert r.planned["occupancy_from"] == "measured" and r.planned["occupancy"] == r.occupancy, r.row()
