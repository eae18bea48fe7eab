"""Tests of jaxkv.attention: the pure-jnp paged decode attention reference.

Inputs are fresh random draws on every run (the seed is in every failure
message). Shapes are few and fixed so the jitted functions compile a handful
of times; sliding window, sm_scale and soft-cap values are traced, so varying
them costs no compile.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import (
    paged_attention,
    paged_attention_reference,
)

from kernels_pallas.reference import dense_decode_attention, paged_decode_attention
from kernels_pallas.errors import KernelArgumentError

F32, BF16, FP8 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)

B, PS, M, P = 4, 4, 7, 48  # batch, page size, table width, pages (page 0 = null)
S = M * PS
JAX_M = 8  # JAX's kernel with k_splits=2, pages_per_compute_block=2 needs M % 4 == 0

#: name -> (KVH, H, Dk, Dv or None for MLA)
CONFIGS = {
    "gqa": (2, 8, 16, 16),   # H = 4 * KVH; Dk = 16 -> default sm_scale 1/4 is exact in bf16
    "mqa": (1, 4, 16, 8),    # KVH = 1, Dv != Dk
    "mla": (1, 4, 24, None),  # v_pages None, value = latent[..., :16]
}
MLA_V = 16

_jit_jax_kernel = jax.jit(
    lambda q, k, v, t, l, ks, vs, cap: paged_attention(
        q, k, v, t, l, ks, vs, k_splits=2, pages_per_compute_block=2, interpret=True,
        attn_logits_soft_cap=cap),
    static_argnums=(7,),
)


def _new_rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return np.random.default_rng(seed), f"seed={seed}"


def _quantize(x, dtype, rng):
    """Random float32 x -> (pages in dtype, per-token scales or None)."""
    if jnp.dtype(dtype) == FP8:
        scale = np.abs(x).max(-1) / FP8_MAX * rng.uniform(1.0, 2.0, x.shape[:-1])  # |x / scale| <= max
        stored = (x / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
        return jnp.asarray(stored), jnp.asarray(scale, jnp.float32)
    return jnp.asarray(x, dtype), None


def _dequant(pages, scales):
    x = np.asarray(pages).astype(np.float64)
    return x if scales is None else x * np.asarray(scales, np.float64)[..., None]


def make_case(rng, config, dtype, lengths=None):
    """Random pages and tables. Each sequence gets distinct random pages from
    [1, P); page 0 is never referenced; table entries past the live pages are -1."""
    kvh, h, dk, dv = CONFIGS[config]
    qdt = BF16 if jnp.dtype(dtype) == FP8 else jnp.dtype(dtype)
    if lengths is None:
        lengths = rng.integers(1, S + 1, B)
        lengths[rng.integers(B)] = S  # one full table
        lengths[rng.integers(B)] = 4 * rng.integers(1, M) + 1 + rng.integers(3)  # partial last page
    lengths = np.asarray(lengths, np.int32)
    n_live = -(-lengths // PS)
    perm = rng.permutation(np.arange(1, P))
    table = np.full((B, M), -1, np.int32)
    live = np.zeros((B, M), bool)
    off = 0
    for b in range(B):
        table[b, : n_live[b]] = perm[off: off + n_live[b]]
        live[b, : n_live[b]] = True
        off += n_live[b]
    q = jnp.asarray(rng.standard_normal((B, h, dk)) * 2.0, qdt)
    k_pages, k_scales = _quantize(rng.standard_normal((kvh, P, PS, dk)).astype(np.float32), dtype, rng)
    if dv is None:
        v_pages = v_scales = None
    else:
        v_pages, v_scales = _quantize(rng.standard_normal((kvh, P, PS, dv)).astype(np.float32), dtype, rng)
    return {"q": q, "k_pages": k_pages, "v_pages": v_pages, "block_tables": jnp.asarray(table),
                "lengths": jnp.asarray(lengths), "k_scales": k_scales, "v_scales": v_scales,
                "live": live, "mla_value_dim": MLA_V if dv is None else None}


def run_paged(case, **kw):
    return paged_decode_attention(
        case["q"], case["k_pages"], case["v_pages"], case["block_tables"], case["lengths"],
        case["k_scales"], case["v_scales"], mla_value_dim=case["mla_value_dim"], **kw)


def contiguous(case):
    """Numpy gather of the live pages into float64 [B, S, KVH, D] K and V."""
    k_all = _dequant(case["k_pages"], case["k_scales"])
    v_all = k_all[..., :MLA_V] if case["v_pages"] is None else _dequant(case["v_pages"], case["v_scales"])
    table = np.asarray(case["block_tables"])
    kvh, dk, dv = k_all.shape[0], k_all.shape[-1], v_all.shape[-1]
    k = np.zeros((B, S, kvh, dk))
    v = np.zeros((B, S, kvh, dv))
    for b in range(B):
        for j in np.flatnonzero(case["live"][b]):
            k[b, j * PS:(j + 1) * PS] = k_all[:, table[b, j]].transpose(1, 0, 2)
            v[b, j * PS:(j + 1) * PS] = v_all[:, table[b, j]].transpose(1, 0, 2)
    return k, v


def np_attention(q, k, v, lengths, sm_scale, window=None, cap=None):
    """Float64 softmax attention of the last token over [max(0, L-W), L)."""
    q = np.asarray(q).astype(np.float64)
    bsz, h, _ = q.shape
    g = h // k.shape[2]
    out = np.zeros((bsz, h, v.shape[-1]))
    for b in range(bsz):
        L = int(lengths[b])
        lo = 0 if window is None else max(0, L - window)
        if L - lo <= 0:
            continue
        for i in range(h):
            s = k[b, lo:L, i // g] @ q[b, i] * sm_scale
            if cap is not None:
                s = cap * np.tanh(s / cap)
            w = np.exp(s - s.max())
            out[b, i] = (w / w.sum()) @ v[b, lo:L, i // g]
    return out


def tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if jnp.dtype(dtype) == F32 else {"rtol": 2e-2, "atol": 2e-2}


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---------------------------------------------------------------------------
# 1. Against JAX's Pallas paged_attention (interpret mode).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("dtype", [F32, BF16, FP8], ids=str)
def test_matches_jax_pallas_kernel(dtype, cap):
    rng, seed = _new_rng()
    case = make_case(rng, "gqa", dtype)
    lengths = np.asarray(case["lengths"]).copy()
    lengths[rng.integers(B)] = 0  # JAX's kernel also gives zeros for length 0
    case["lengths"] = jnp.asarray(lengths)
    ours = run_paged(case, logit_soft_cap=cap)

    dk = case["q"].shape[-1]
    sm = 1.0 / math.sqrt(dk)  # exact power of two: pre-scaling q loses nothing
    q_pre = (case["q"].astype(jnp.float32) * sm).astype(case["q"].dtype)
    # JAX needs every entry in [0, P) and M padded to its split sizes: pad with 0.
    jax_table = np.zeros((B, JAX_M), np.int32)
    jax_table[:, :M] = np.where(case["live"], np.asarray(case["block_tables"]), 0)
    theirs = _jit_jax_kernel(q_pre, case["k_pages"], case["v_pages"], jnp.asarray(jax_table),
                             case["lengths"], case["k_scales"], case["v_scales"], cap)
    assert ours.dtype == theirs.dtype == case["q"].dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                               err_msg=seed, **tol(dtype))
    assert not np.isnan(np.asarray(ours, np.float32)).any()

    # And against the float64 reference on the same (dequantized) inputs.
    k, v = contiguous(case)
    want = np_attention(case["q"], k, v, lengths, sm, cap=cap)
    np.testing.assert_allclose(np.asarray(ours, np.float64), want, err_msg=seed, **tol(dtype))
    if cap is not None:  # the cap must actually bite at these logit sizes
        uncapped = np_attention(case["q"], k, v, lengths, sm)
        assert np.abs(uncapped - want).max() > 0.05, seed


# ---------------------------------------------------------------------------
# 2. Against dense references: GQA, MQA, MLA, sliding window, soft cap.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, FP8], ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_dense_reference(config, dtype):
    rng, seed = _new_rng()
    for _ in range(4):
        case = make_case(rng, config, dtype)
        lengths = np.asarray(case["lengths"])
        k, v = contiguous(case)
        sm = float(rng.uniform(0.1, 0.5))
        window = [None, int(rng.integers(1, 6)), int(rng.integers(1, S + 3))][rng.integers(3)]
        cap = [None, float(rng.uniform(1.0, 5.0))][rng.integers(2)]
        msg = f"{seed} window={window} cap={cap} sm={sm} lengths={lengths}"
        ours = run_paged(case, sm_scale=sm, sliding_window=window, logit_soft_cap=cap)
        assert ours.dtype == case["q"].dtype
        want = np_attention(case["q"], k, v, lengths, sm, window, cap)
        np.testing.assert_allclose(np.asarray(ours, np.float64), want, err_msg=msg, **tol(dtype))

        # The dense baseline on the gathered K/V agrees with the paged version
        # to rounding: the paged core reads K/V heads-first, so its dots sum
        # in another order (float32: ~1e-6 apart; a bf16 output can then
        # round one ulp apart).
        dense = dense_decode_attention(case["q"], jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                                       case["lengths"], sm_scale=sm, sliding_window=window,
                                       logit_soft_cap=cap)
        rounding = max(2 * float(jnp.finfo(case["q"].dtype).eps), 1e-5)
        np.testing.assert_allclose(np.asarray(dense, np.float32), np.asarray(ours, np.float32),
                                   rtol=rounding, atol=rounding, err_msg=msg)

        # JAX's own dense reference (no window there; q pre-scaled; Dk == Dv only).
        if window is None and k.shape[-1] == v.shape[-1]:
            ref = paged_attention_reference(
                jnp.asarray(np.asarray(case["q"], np.float64) * sm, jnp.float32),
                jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), case["lengths"],
                attn_logits_soft_cap=cap)
            np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref), err_msg=msg, **tol(dtype))


def test_traced_window_and_scale_under_jit():
    rng, seed = _new_rng()
    case = make_case(rng, "gqa", F32)
    f = jax.jit(lambda c, w, sm: paged_decode_attention(
        c["q"], c["k_pages"], c["v_pages"], c["block_tables"], c["lengths"],
        sm_scale=sm, sliding_window=w))
    arrays = {k: case[k] for k in ("q", "k_pages", "v_pages", "block_tables", "lengths")}
    for w in (1, 5, S):
        got = f(arrays, jnp.int32(w), jnp.float32(0.3))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(run_paged(case, sm_scale=0.3, sliding_window=w)),
                                      err_msg=seed)


# ---------------------------------------------------------------------------
# 3. Isolation: poison everything that must not be read.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("config,dtype", [("gqa", F32), ("gqa", BF16), ("mqa", FP8), ("mla", FP8), ("mla", BF16)],
                         ids=lambda x: str(x))
def test_isolation_poison(config, dtype):
    rng, seed = _new_rng()
    lengths = rng.integers(1, S + 1, B)
    lengths[0] = 0
    lengths[1] = 4 * int(rng.integers(1, M)) + 1 + int(rng.integers(3))  # partial last page
    case = make_case(rng, config, dtype, lengths=lengths)
    window = int(rng.integers(2, 9))
    clean = {w: run_paged(case, sliding_window=w, logit_soft_cap=3.0) for w in (None, window)}
    for out in clean.values():
        assert not np.isnan(np.asarray(out, np.float32)).any()
        assert (np.asarray(out, np.float32)[0] == 0).all()

    table = np.asarray(case["block_tables"])
    used = np.zeros(P, bool)
    used[table[case["live"]]] = True

    def poisoned(fill_pages, fill_scales, new_table=None):
        """Copy of case with fill_pages(x_np, is_scale) applied to pages and scales."""
        out = dict(case)
        for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
            if case[name] is None:
                continue
            x = np.array(case[name])  # ml_dtypes keep NaN / fp8 semantics
            (fill_scales if name.endswith("scales") else fill_pages)(x)
            out[name] = jnp.asarray(x)
        if new_table is not None:
            out["block_tables"] = jnp.asarray(new_table)
        return out

    def check(p_case, windows, what):
        for w in windows:
            got = run_paged(p_case, sliding_window=w, logit_soft_cap=3.0)
            np.testing.assert_array_equal(bits(got), bits(clean[w]), err_msg=f"{seed} {what} window={w}")

    # (a) NaN in every page no live entry names (page 0 included) and in their
    # scales; garbage integers (negative, huge, other sequences' pages) in the
    # table entries past each length.
    def nan_unused(x):
        x[:, ~used] = np.nan

    garbage = table.copy()
    dead = ~case["live"]
    garbage[dead] = rng.choice(np.array([-1, -7, 0, P, P + 100, 2**31 - 1, -2**31, *range(P)], np.int64),
                               dead.sum()).astype(np.int32)
    check(poisoned(nan_unused, nan_unused, garbage), (None, window), "NaN in unreferenced pages")

    # (b) huge garbage (1e30 / fp8 max, scales 3e38 -> inf) and then NaN in the
    # masked tail of each partially used last page.
    def tail_fill(value, scale_value):
        def fill(x, v):
            for b in range(B):
                L = int(lengths[b])
                if L % PS:
                    x[:, table[b, L // PS], L % PS:] = v
        return (lambda x: fill(x, value)), (lambda x: fill(x, scale_value))

    big = FP8_MAX if jnp.dtype(dtype) == FP8 else 1e30
    check(poisoned(*tail_fill(big, 3e38)), (None, window), "huge garbage in page tails")
    check(poisoned(*tail_fill(np.nan, np.nan)), (None, window), "NaN in page tails")

    # (c) NaN before the sliding window of every sequence.
    def pre_window(x):
        for b in range(B):
            for t in range(max(0, int(lengths[b]) - window)):
                x[:, table[b, t // PS], t % PS] = np.nan

    check(poisoned(pre_window, pre_window), (window,), "NaN before the window")


# ---------------------------------------------------------------------------
# 4. Length 0 and bad shapes.
# ---------------------------------------------------------------------------


def test_length_zero_gives_zeros():
    rng, seed = _new_rng()
    case = make_case(rng, "gqa", BF16, lengths=np.zeros(B, np.int32))
    case["k_pages"] = jnp.full_like(case["k_pages"], jnp.nan)
    case["v_pages"] = jnp.full_like(case["v_pages"], jnp.nan)
    for cap in (None, 2.0):
        out = np.asarray(run_paged(case, logit_soft_cap=cap, sliding_window=3), np.float32)
        assert out.shape == (B, 8, 16)
        np.testing.assert_array_equal(out, 0.0, err_msg=seed)
    k = jnp.full((B, S, 2, 16), jnp.nan, jnp.float32)
    out = dense_decode_attention(case["q"], k, k, jnp.zeros(B, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def _args(h=8, kvh=2, dk=16, dkq=None, dv=16, m_shape=(B, M), fp8=False, scales_shape=None):
    q = jnp.ones((B, h, dkq or dk), jnp.float32)
    dt = FP8 if fp8 else F32
    k = jnp.ones((kvh, P, PS, dk), dt)
    v = None if dv is None else jnp.ones((kvh, P, PS, dv), dt)
    t = jnp.zeros(m_shape, jnp.int32)
    ks = None if scales_shape is None else jnp.ones(scales_shape, jnp.float32)
    return q, k, v, t, jnp.ones((B,), jnp.int32), ks


@pytest.mark.parametrize("kwargs,extra,match", [
    ({"h": 6, "kvh": 4}, {}, r"\(6\).*\(4\)"),
    ({"dkq": 12}, {}, r"12.*16"),
    ({"m_shape": (B * M,)}, {}, r"rank 1"),
    ({"m_shape": (B, M, 1)}, {}, r"rank 3"),
    ({"m_shape": (B + 1, M)}, {}, r"batch"),
    ({"fp8": True}, {}, r"k_scales is None"),
    ({"scales_shape": (2, P, PS + 1)}, {}, r"k_scales must have shape \(2, 48, 4\)"),
    ({"dv": None}, {}, r"mla_value_dim"),
    ({"dv": None}, {"mla_value_dim": 17}, r"\[1, 16\].*17"),
    ({}, {"mla_value_dim": 8}, r"only for MLA"),
    ({}, {"sliding_window": 0}, r"sliding_window"),
    ({}, {"logit_soft_cap": -1.0}, r"logit_soft_cap"),
])
def test_bad_arguments_raise(kwargs, extra, match):
    q, k, v, t, lengths, ks = _args(**kwargs)
    with pytest.raises(KernelArgumentError, match=match):
        paged_decode_attention(q, k, v, t, lengths, ks, **extra)


def test_bad_arguments_raise_other():
    q, k, v, t, lengths, _ = _args()
    with pytest.raises(KernelArgumentError, match=r"v_pages must be \[2, 48, 4"):
        paged_decode_attention(q, k, jnp.ones((1, P, PS, 16)), t, lengths)
    with pytest.raises(KernelArgumentError, match=r"lengths must have shape \(4,\)"):
        paged_decode_attention(q, k, v, t, jnp.ones((B + 1,), jnp.int32))
    kd = jnp.ones((B, S, 2, 16))
    with pytest.raises(KernelArgumentError, match=r"\(8\).*\(3\)"):
        dense_decode_attention(q, jnp.ones((B, S, 3, 16)), jnp.ones((B, S, 3, 16)), lengths)
    with pytest.raises(KernelArgumentError, match=r"v must be"):
        dense_decode_attention(q, kd, jnp.ones((B, S + 1, 2, 16)), lengths)
    with pytest.raises(KernelArgumentError, match=r"20"):
        dense_decode_attention(q, jnp.ones((B, S, 2, 20)), kd, lengths)
