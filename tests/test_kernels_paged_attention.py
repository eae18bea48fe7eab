"""Tests of kernels_pallas.paged_attention, the Pallas paged decode kernel.

The kernel runs in Pallas' interpreter (``interpret=True``) on CPU and is
checked against the pure-jnp reference ``jaxkv.attention.paged_decode_attention``
and against JAX's own ``paged_attention`` kernel and reference. Inputs are fresh
random draws on every run (the seed is in every failure message). Shapes are
tiny and few, and one case is shared per dtype, because every interpreted
kernel costs a compile of a few seconds; window values are traced so varying
them costs nothing. Every case has lengths 0, 1, a partial last page and the
full table, tables with -1 and garbage past each length (the table width 5 is a
multiple of nothing the kernel uses), and NaN in the null page, the unused
pages and the tail of each last page (and scales), to check isolation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

from kernels_pallas.reference import paged_decode_attention
from kernels_pallas.errors import KernelArgumentError
from jaxkv.manager.kernel_tables import pallas_gpu_block_tables
from kernels_pallas.paged_attention import paged_attention
from tests.util import KERNEL_MODES

F32, BF16, FP8 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)
B, PS, M, P = 4, 4, 5, 24  # batch, page size, table width, pages (page 0 = null)
S = M * PS
# bf16 tolerance: the kernel multiplies bf16 q into K cast to bf16 and, like
# flash attention, casts the probabilities to bf16 for the PV dot, while the
# reference is float32 throughout; the bf16 rounding of p (2^-9 relative) and
# of the bf16 output itself sum to well under 2e-2 for these O(1) values.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
F32_TOL = dict(atol=1e-5, rtol=1e-5)


def _new_rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return np.random.default_rng(seed), f"seed={seed}"


def _lengths(rng):
    """0, 1, a partial last page and the full table, in random order."""
    partial = PS * rng.integers(1, M - 1) + rng.integers(1, PS)
    return rng.permutation(np.array([0, 1, partial, S], np.int32))


def make_case(rng, *, kvh, h, dk, dv, kv_dtype, q_dtype=BF16, scales=False):
    """Random paged inputs; ``dv=None`` is MLA mode (no V pages).

    Returns ``(args, clean)``: ``args`` the keyword inputs with NaN at every
    position no live table entry reaches (null page 0, unused pages, tail of
    each last page, and the same entries of the scales); ``clean`` the same
    inputs with finite garbage there instead.
    """
    lengths = _lengths(rng)
    n_live = -(-lengths // PS)
    perm = rng.permutation(np.arange(1, P))
    table = np.empty((B, M), np.int64)
    junk = np.array([-1, -(10 ** 6), 10 ** 6, P, 0])
    live = np.zeros((P, PS), bool)  # (page, slot) holds an attended-able token
    off = 0
    for b in range(B):
        n = n_live[b]
        table[b, :n] = perm[off:off + n]
        off += n
        table[b, n:] = np.where(rng.random(M - n) < 0.5, rng.choice(junk, M - n),
                                rng.integers(0, P, M - n))  # -1, garbage, or other pages
        for t in range(lengths[b]):
            live[table[b, t // PS], t % PS] = True

    def pages(d):
        x = rng.standard_normal((kvh, P, PS, d)) * (4.0 if kv_dtype == FP8 else 1.0)
        return x

    def scale():
        return rng.uniform(0.05, 0.5, (kvh, P, PS))

    k = pages(dk)
    v = None if dv is None else pages(dv)
    ks = scale() if scales else None
    vs = scale() if scales and dv is not None else None
    q = rng.standard_normal((B, h, dk))

    def finish(fill):
        def put(x):
            if x is None:
                return None
            x = x.copy()
            x[:, ~live] = fill(x[:, ~live].shape)
            return x
        return dict(
            q=jnp.asarray(q, q_dtype),
            k_pages=jnp.asarray(put(k), kv_dtype),
            v_pages=None if v is None else jnp.asarray(put(v), kv_dtype),
            block_tables=jnp.asarray(table, jnp.int32),
            lengths=jnp.asarray(lengths),
            k_scales=None if ks is None else jnp.asarray(put(ks), F32),
            v_scales=None if vs is None else jnp.asarray(put(vs), F32),
        )

    return finish(lambda s: np.full(s, np.nan)), finish(lambda s: rng.standard_normal(s))


def _f32(x):
    return np.asarray(jnp.asarray(x, F32))


def _check(actual, expected, tol, msg):
    actual, expected = _f32(actual), _f32(expected)
    assert not np.isnan(actual).any(), f"NaN in kernel output ({msg})"
    np.testing.assert_allclose(actual, expected, **tol, err_msg=msg)


def _dense(pages, scales, table):
    """[KVH, P, ps, D] pages -> float32 [B, S, KVH, D], JAX reference layout."""
    x = _f32(pages)[:, np.clip(np.asarray(table), 0, P - 1)]  # [KVH, B, M, ps, D]
    if scales is not None:
        x = x * _f32(scales)[:, np.clip(np.asarray(table), 0, P - 1)][..., None]
    return jnp.asarray(np.moveaxis(x, 0, 3).reshape(x.shape[1], S, x.shape[0], -1))


# --------------------------------------------------------------------------
# Shared cases: one per dtype, drawn once per module.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gqa_bf16():
    rng, seed = _new_rng()
    return make_case(rng, kvh=2, h=4, dk=32, dv=32, kv_dtype=BF16), seed


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_bf16_gqa_matches_reference_and_jax(gqa_bf16, interpret):
    (args, clean), seed = gqa_bf16
    sm = 0.25  # a power of two, so pre-scaling q for JAX's functions is exact in bf16
    out = paged_attention(**args, sm_scale=sm, interpret=interpret)
    assert out.shape == (B, 4, 32) and out.dtype == BF16
    _check(out, paged_attention(**args, sm_scale=sm, implementation="reference"), BF16_TOL, seed)

    # Isolation: what masked positions hold changes no bit of the output.
    np.testing.assert_array_equal(_f32(paged_attention(**clean, sm_scale=sm, interpret=interpret)),
                                  _f32(out), err_msg=seed)

    # JAX's reference on the gathered dense K/V (it has no sm_scale, and no
    # NaN isolation, hence the clean inputs). For length 0 it averages all
    # positions instead of returning zeros, so those rows are left out.
    q_scaled = jnp.asarray(clean["q"], F32) * sm
    theirs = jax_pa.paged_attention_reference(
        q_scaled, _dense(clean["k_pages"], None, clean["block_tables"]),
        _dense(clean["v_pages"], None, clean["block_tables"]), clean["lengths"])
    rows = np.asarray(clean["lengths"]) > 0
    _check(_f32(out)[rows], _f32(theirs)[rows], BF16_TOL, seed)

    # A static window reuses the compiled kernel (the window is data).
    w = 3
    _check(paged_attention(**args, sm_scale=sm, sliding_window=w, interpret=interpret),
           paged_attention(**args, sm_scale=sm, sliding_window=w, implementation="reference"),
           BF16_TOL, f"{seed} window={w}")


def test_bf16_matches_jax_kernel(gqa_bf16):
    """JAX's own Pallas kernel, interpreted, with the tables it needs (every
    entry a valid page, width a multiple of k_splits * pages_per_compute_block)."""
    (_, clean), seed = gqa_bf16
    sm = 0.25
    tables, lengths = pallas_gpu_block_tables(
        clean["block_tables"], clean["lengths"], pages_per_compute_block=2, k_splits=2,
        page_size=PS, num_pages=P)
    theirs = jax_pa.paged_attention(
        (jnp.asarray(clean["q"], F32) * sm).astype(BF16), clean["k_pages"], clean["v_pages"],
        tables, lengths, pages_per_compute_block=2, k_splits=2, interpret=True)
    ours = paged_attention(**clean, sm_scale=sm, interpret=True)
    _check(ours, theirs, BF16_TOL, seed)


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_fp8_scales_soft_cap(interpret):
    rng, seed = _new_rng()
    args, _ = make_case(rng, kvh=2, h=4, dk=32, dv=32, kv_dtype=FP8, scales=True)
    kw = dict(logit_soft_cap=1.5)  # scaled logits here are O(1-5): the cap bites
    _check(paged_attention(**args, **kw, interpret=interpret),
           paged_attention(**args, **kw, implementation="reference"), BF16_TOL, seed)


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_sliding_window_traced_and_splits(interpret):
    """A traced window inside the caller's jit, with 3 splits of 4 pages over a
    5-page table: split 2 never has pages, split 1 only for the full row.
    float32 end to end, so the tolerance is tight. NaN is also written before
    the window (each window value gets its own poisoning)."""
    rng, seed = _new_rng()
    args, _ = make_case(rng, kvh=2, h=4, dk=32, dv=16, kv_dtype=F32, q_dtype=F32)

    @jax.jit
    def run(a, window):
        return (paged_attention(**a, sliding_window=window, k_splits=3, pages_per_compute_block=4,
                                interpret=interpret),
                paged_attention(**a, sliding_window=window, implementation="reference"))

    table, lengths = np.asarray(args["block_tables"]), np.asarray(args["lengths"])
    for w in (1, PS + 1, 9, 100):
        a = dict(args)
        k, v = np.array(a["k_pages"]), np.array(a["v_pages"])
        for b in range(B):
            for t in range(max(0, lengths[b] - w)):  # before the window: NaN
                k[:, table[b, t // PS], t % PS] = np.nan
                v[:, table[b, t // PS], t % PS] = np.nan
        a["k_pages"], a["v_pages"] = jnp.asarray(k), jnp.asarray(v)
        ours, ref = run(a, jnp.int32(w))
        _check(ours, ref, F32_TOL, f"{seed} window={w}")


@pytest.mark.parametrize("interpret", KERNEL_MODES)
def test_mla_fp8_chunks_and_head_blocks(interpret):
    """MLA: value = first 40 dims of a 64-dim latent, so K chunks are 32, 8
    (the value chunks, reused as V; 8 < 16 takes the non-dot path) then 16, 8.
    20 query heads pad to 32 rows, run as two 16-row head blocks."""
    rng, seed = _new_rng()
    args, _ = make_case(rng, kvh=1, h=20, dk=64, dv=None, kv_dtype=FP8, scales=True)
    kw = dict(mla_value_dim=40)
    out = paged_attention(**args, **kw, block_h=16, interpret=interpret)
    assert out.shape == (B, 20, 40)
    _check(out, paged_attention(**args, **kw, implementation="reference"), BF16_TOL, seed)


def test_lowers_to_triton():
    """Cross-lowering for CUDA runs the Triton lowering on CPU, which enforces
    what the interpreter does not (power-of-two tensor sizes, supported ops),
    at realistic shapes: GQA with fp8 and a cap, MLA 576/512 with 128 heads."""
    sds = jax.ShapeDtypeStruct

    def lower(h, kvh, ps, dk, dv, kv_dtype, mla, **kw):
        q = sds((8, h, dk), BF16)
        k = sds((kvh, 600, ps, dk), kv_dtype)
        v = None if mla else sds((kvh, 600, ps, dv), kv_dtype)
        sc = sds((kvh, 600, ps), F32) if kv_dtype == FP8 else None
        fn = jax.jit(functools.partial(paged_attention, implementation="pallas",
                                       mla_value_dim=dv if mla else None, **kw))
        text = fn.trace(q, k, v, sds((8, 37), jnp.int32), sds((8,), jnp.int32), sc,
                        None if mla else sc).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text

    lower(32, 8, 16, 128, 128, FP8, False, logit_soft_cap=30.0, sliding_window=100)
    lower(128, 1, 64, 576, 512, FP8, True)
    lower(12, 4, 1, 80, 72, BF16, False)


def test_dispatch_and_errors(gqa_bf16):
    (args, _), seed = gqa_bf16
    # Default on CPU: the reference, bit for bit.
    np.testing.assert_array_equal(_f32(paged_attention(**args)), _f32(paged_decode_attention(**args)))
    with pytest.raises(KernelArgumentError):
        paged_attention(**args, implementation="reference", interpret=True)
    with pytest.raises(KernelArgumentError):
        paged_attention(**args, implementation="triton")
    bad = [
        dict(q=args["q"][:, :3]),                   # 3 query heads, 2 KV heads
        dict(q=args["q"][..., :16]),                # q head dim != K head dim
        dict(block_tables=args["block_tables"][0]),  # rank 1 table
        dict(v_pages=None),                          # MLA without mla_value_dim
        dict(sliding_window=0),
    ]
    for change in bad:
        with pytest.raises(KernelArgumentError):
            paged_attention(**{**args, **change}, interpret=True)
    for knobs in (dict(pages_per_compute_block=3), dict(pages_per_compute_block=2),  # 8 tokens
                  dict(k_splits=0), dict(block_h=8)):
        with pytest.raises(KernelArgumentError):
            paged_attention(**args, **knobs, interpret=True)
    # A page size that is not a power of two: an error on the Pallas path,
    # the reference when the implementation is left to the default.
    odd = {**args, "k_pages": args["k_pages"][:, :, :3], "v_pages": args["v_pages"][:, :, :3]}
    with pytest.raises(KernelArgumentError):
        paged_attention(**odd, interpret=True)
    np.testing.assert_array_equal(_f32(paged_attention(**odd)), _f32(paged_decode_attention(**odd)))


def test_model_layer_decodes_through_the_kernel():
    """``jaxkv.nn`` swaps the kernel in through its decode hook: a
    ``PagedAttention`` layer decoding over a 9-token history gives the same
    output with the interpreted kernel as with the reference."""
    from flax import nnx

    from jaxkv import KVPool
    from jaxkv.nn import PagedAttention

    rng, seed = _new_rng()
    hidden, heads, kv_heads, head_dim, page = 32, 4, 2, 16, 4
    kernel = functools.partial(paged_attention, interpret=True)
    x = jnp.asarray(rng.normal(size=(1, 10, hidden)), jnp.float32)
    outs = []
    for decode_fn in (None, kernel):
        layer = PagedAttention(hidden, heads, kv_heads, head_dim, decode_attention_fn=decode_fn,
                               rngs=nnx.Rngs(0))
        pool = KVPool.create(num_pages=5, page_size=page, num_layers=1, k_heads=kv_heads, k_dim=head_dim,
                             dtype=jnp.float32)
        table = jnp.asarray([[3, 1, 4]], jnp.int32)
        slots = (table[0, np.arange(10) // page] * page + np.arange(10) % page)[None].astype(jnp.int32)
        positions = jnp.arange(10, dtype=jnp.int32)[None]
        run = nnx.jit(lambda m, *a, mode: m(*a, mode=mode), static_argnums=4, static_argnames="mode")
        _, pool = run(layer, x[:, :9], positions[:, :9], pool, 0, slots[:, :9], table,
                      jnp.zeros(1, jnp.int32), jnp.full(1, 9, jnp.int32), mode="prefill")
        out, _ = run(layer, x[:, 9:], positions[:, 9:], pool, 0, slots[:, 9:], table,
                     jnp.full(1, 9, jnp.int32), jnp.ones(1, jnp.int32), mode="decode")
        outs.append(np.asarray(out))
    np.testing.assert_allclose(outs[1], outs[0], **F32_TOL, err_msg=seed)
