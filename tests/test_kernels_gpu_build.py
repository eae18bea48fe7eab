"""What the kernels become on a GPU, checked on any machine.

Cross-lowering for CUDA (``lower(lowering_platforms=("cuda",))``) yields each
kernel's Triton module (:mod:`kernels_pallas.lowered`); these tests read it
for the properties the H100 compile found wrong (float32 dot precision, load
and store order, grid order, whole-layer copies), and check the shape plan
and the GPU dispatch rules against independent expectations. Compiling for
H100 itself is in ``test_kernels_aot.py``.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.reference import paged_decode_attention
from kernels_pallas.errors import KernelArgumentError
from kernels_pallas import DSV4_FP8, DSV32_FP8, CompressedEntries, _gpu, gather_all_compressed_kv
from kernels_pallas import gather_compressed_kv, gather_swa_kv
from kernels_pallas._dispatch import KernelFallbackWarning, gpu_obstacle
from kernels_pallas.lowered import triton_calls
from kernels_pallas.paged_attention import SharedMemoryExceeded, paged_attention, plan, smem_bytes

sds = jax.ShapeDtypeStruct
I32, BF16, F32, FP8 = jnp.int32, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn


def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _attention_args(b=2, h=4, kvh=2, d=64, ps=16, pages=64, width=8, dtype=BF16, q_dtype=BF16, layers=None):
    lead = () if layers is None else (layers,)
    return (sds((b, h, d), q_dtype), sds(lead + (kvh, pages, ps, d), dtype), sds(lead + (kvh, pages, ps, d), dtype),
            sds((b, width), I32), sds((b,), I32))


def _entries(fmt, lead):
    return CompressedEntries.from_parts(sds(lead + (fmt.nope_dim,), FP8), sds(lead + (fmt.num_groups,),
                                       fmt.scale_dtype), sds(lead + (fmt.rope_dim,), BF16), fmt)


# --------------------------------------------------------------------------
# Defect 4: float32 dots at full precision.
# --------------------------------------------------------------------------


def test_float32_dots_are_ieee_not_tf32():
    """Triton prints a dot's input precision unless it is IEEE: float32 pages
    must not run as TF32 (the reference computes at HIGHEST)."""
    (call,) = triton_calls(_lower(lambda *a: paged_attention(*a, implementation="pallas"),
                                  *_attention_args(dtype=F32, q_dtype=F32)))
    dots = [line for line in call.ttir.splitlines() if "tt.dot" in line]
    assert len(dots) == 2 and all("f32>" in d for d in dots)
    assert not any("inputPrecision" in d for d in dots), dots
    # bf16 operands are unaffected (tensor-core dots either way).
    (call,) = triton_calls(_lower(lambda *a: paged_attention(*a, implementation="pallas"), *_attention_args()))
    assert all("bf16>" in d for d in call.ttir.splitlines() if "tt.dot" in d)


# --------------------------------------------------------------------------
# Defect 6: every gather load before the first store.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layered", [False, True], ids=["pool", "stacked"])
@pytest.mark.parametrize("fmt", [DSV4_FP8, DSV32_FP8], ids=lambda f: f.name)
def test_gathers_issue_all_loads_before_any_store(fmt, layered):
    """Also for a stacked pool read at a traced layer (``layer=``: the
    kernels index the layer axis in every load, a hybrid cache's layers
    under a scan)."""
    table = sds((4, 9), I32)
    lead = (3,) if layered else ()
    layer = {"layer": sds((), I32)} if layered else {}

    def lower(fn, *args):
        return _lower(lambda *a: fn(*a[:len(args)], **dict(zip(layer, a[len(args):]))), *args, *layer.values())

    lowered = [
        lower(lambda p, t, i, r, **kw: gather_compressed_kv(p, t, i, r, implementation="pallas", **kw),
              _entries(fmt, lead + (100, 32)), table, sds((16, 64), I32), sds((16,), I32)),
        lower(lambda p, t, n, **kw: gather_all_compressed_kv(p, t, n, max_entries=64, implementation="pallas", **kw),
              _entries(fmt, lead + (100, 32)), table, sds((4,), I32)),
        lower(lambda r, s, p, **kw: gather_swa_kv(r, s, p, implementation="pallas", **kw),
              _entries(fmt, lead + (10, 128)), sds((4,), I32), sds((4,), I32)),
    ]
    for low in lowered:
        (call,) = triton_calls(low)
        # Pallas lowers every ref store as a swap that also loads the old
        # value; nothing uses it and Triton deletes it (the PTX check in
        # test_kernels_aot.py sees no load after the first store), so only
        # loads whose value is used count here.
        ops = []
        for line in call.ttir.splitlines():
            load = re.match(r"\s*(%\w+) = tt\.load", line)
            if load and re.search(re.escape(load.group(1)) + r"\b(?!\s*=)", call.ttir[call.ttir.index(line) + len(line):]):
                ops.append("load")
            elif re.match(r"\s*tt\.store", line):
                ops.append("store")
        first_store = ops.index("store")
        data_loads = fmt.num_groups * 2 + 1  # values and scale per group, RoPE
        assert "load" not in ops[first_store:], (call.name, ops)
        assert ops[:first_store].count("load") >= data_loads, (call.name, ops)


# --------------------------------------------------------------------------
# Defect 2: a stacked pool is read in place, by layer.
# --------------------------------------------------------------------------


def test_stacked_pool_reaches_the_kernel_unsliced():
    """With ``layer=``, the kernel's K and V operands are the caller's whole
    stacked arrays (function arguments), not a per-layer slice XLA would
    have to materialise."""
    args = _attention_args(layers=3)
    low = _lower(lambda *a: paged_attention(*a, layer=1, implementation="pallas"), *args)
    (call,) = triton_calls(low)
    text = low.as_text()
    stacked = "tensor<3x2x64x16x64xbf16>"
    assert not [line for line in text.splitlines() if "slice" in line and stacked in line]
    body = text[text.index("func.func private @_pallas_impl"):]
    signature = body[:body.index("{")]
    k_arg, v_arg = re.findall(r"(%arg\d+): " + re.escape(stacked), signature)
    assert {k_arg, v_arg} <= set(call.operands)


def test_layer_of_a_stacked_pool_matches_the_layer_alone():
    """Interpreted kernel and reference, static and traced layer, against the
    reference on the one layer passed alone (NaN in the other layers).
    More on traced layers (scan, fp8, MLA): test_kernels_traced_layer.py."""
    rng = np.random.default_rng()
    layers, kvh, pages, ps, d, b, h = 3, 2, 6, 4, 16, 2, 4
    k = rng.standard_normal((layers, kvh, pages, ps, d)).astype(np.float32)
    v = rng.standard_normal((layers, kvh, pages, ps, d)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((b, h, d)), F32)
    table = jnp.asarray([[1, 2, 3], [4, 5, -1]], I32)
    lengths = jnp.asarray([10, 6], I32)
    for layer in range(layers):
        kl, vl = k.copy(), v.copy()
        others = [i for i in range(layers) if i != layer]
        kl[others], vl[others] = np.nan, np.nan
        alone = paged_decode_attention(q, jnp.asarray(k[layer]), jnp.asarray(v[layer]), table, lengths)
        stacked = (q, jnp.asarray(kl), jnp.asarray(vl), table, lengths)
        kernel = paged_attention(*stacked, layer=layer, interpret=True)
        reference = paged_decode_attention(*stacked, layer=layer)
        traced = jax.jit(lambda l, *a: paged_decode_attention(*a, layer=l))(jnp.int32(layer), *stacked)
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(alone), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(reference), np.asarray(alone))
        np.testing.assert_array_equal(np.asarray(traced), np.asarray(alone))
    with pytest.raises(KernelArgumentError, match="out of range"):
        paged_decode_attention(*stacked, layer=3)
    with pytest.raises(KernelArgumentError, match="stacked pool"):
        paged_decode_attention(q, jnp.asarray(k[0]), jnp.asarray(v[0]), table, lengths, layer=0)
    # A traced layer on the Pallas path: that layer too, in place; out of range it attends nothing.
    traced_kernel = jax.jit(lambda l, *a: paged_attention(*a, layer=l, interpret=True))
    np.testing.assert_allclose(np.asarray(traced_kernel(jnp.int32(layer), *stacked)), np.asarray(alone),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(traced_kernel(jnp.int32(layers), *stacked)), 0.0)
    with pytest.raises(KernelArgumentError, match="out of range"):
        paged_attention(*stacked, layer=3, interpret=True)


# --------------------------------------------------------------------------
# Defects 1, 7, 8: shapes planned from the GPU's limits.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [_gpu.H100, _gpu.A100], ids=lambda s: s.name)
def test_default_shapes_fit_shared_memory_for_every_dtype_and_head_dim(spec):
    """float32 at head dim 256 asked for 417792 bytes before: every default
    now fits the GPU's per-block shared memory (the estimate is an upper
    bound of what Triton allocates; aot tests hold it to that)."""
    for dtype in (F32, BF16, FP8):
        q_dtype = F32 if dtype == F32 else BF16
        for d, mla_dv in ((64, None), (96, None), (128, None), (256, None), (512, None), (576, 512)):
            for ps in (1, 16, 64):
                args = _attention_args(d=d, ps=ps, dtype=dtype, q_dtype=q_dtype, width=2048, h=128 if mla_dv else 32,
                                       kvh=1 if mla_dv else 8)
                v = None if mla_dv else args[2]
                item = jnp.dtype(dtype).itemsize
                smallest = smem_bytes(block_tokens=max(16, ps), block_h=16, dk=d, dv=mla_dv or d, k_itemsize=item,
                                      v_itemsize=0 if mla_dv else item, q_itemsize=jnp.dtype(q_dtype).itemsize,
                                      mla=bool(mla_dv), num_stages=1)
                if smallest > spec.smem_per_block:  # one page alone is too big: refused, never a failed compile
                    with pytest.raises(SharedMemoryExceeded):
                        plan(args[0], args[1], v, args[3], mla_value_dim=mla_dv, spec=spec)
                    continue
                shape = plan(args[0], args[1], v, args[3], mla_value_dim=mla_dv, spec=spec)
                assert shape.smem_bytes <= spec.smem_per_block, (dtype, d, ps, shape)
                assert shape.block_tokens >= 16 and shape.block_tokens % ps == 0
    # A 256-token page is the smallest block: float32 at head dim 128 cannot
    # fit; the default dispatch says so and runs the reference.
    args = _attention_args(d=128, ps=256, dtype=F32, q_dtype=F32)
    with _gpu.building_for(spec):
        with pytest.warns(KernelFallbackWarning, match="shared memory"):
            jax.eval_shape(lambda *a: paged_attention(*a), *args)
        with pytest.raises(KernelArgumentError, match="shared memory"):
            jax.eval_shape(lambda *a: paged_attention(*a, implementation="pallas"), *args)


def test_split_count_fills_one_whole_wave():
    """Independent check of the split rule: the grid never exceeds the
    programs the GPU holds at once (SMs x occupancy), and one more split
    would either exceed it or outnumber the compute blocks."""
    spec = _gpu.H100
    for b, kvh, h, width in ((1, 8, 32, 8192), (4, 8, 32, 2048), (8, 8, 64, 512), (64, 8, 32, 64),
                             (8, 1, 128, 512), (3, 2, 6, 7)):
        args = _attention_args(b=b, h=h, kvh=kvh, d=128, width=width)
        shape = plan(*args[:4], spec=spec)
        slots = spec.sm_count * shape.occupancy
        base = shape.programs // shape.k_splits
        blocks = -(-width // shape.pages_per_compute_block)
        assert shape.k_splits >= 1
        if base <= slots:
            assert shape.programs <= slots, (b, shape)
            best = max(s for s in range(1, blocks + 1) if s * base <= slots)
            # Same blocks per split as the best count, with no more splits.
            assert -(-blocks // shape.k_splits) == -(-blocks // best), (b, shape, best)
        else:
            assert shape.k_splits == 1


def test_mla_head_blocks_that_share_pages_are_adjacent():
    """MLA, 128 heads: 8 head blocks of 16 rows read the same pages; the
    head block is grid axis x (CUDA's fastest), so they launch together."""
    args = (sds((8, 128, 576), BF16), sds((1, 512, 16, 576), BF16), None, sds((8, 64), I32), sds((8,), I32))
    low = _lower(lambda q, k, t, n: paged_attention(q, k, None, t, n, mla_value_dim=512, implementation="pallas"),
                 args[0], args[1], args[3], args[4])
    (call,) = triton_calls(low)
    shape = plan(args[0], args[1], None, args[3], mla_value_dim=512)
    assert shape.block_h == 16 and call.grid[0] == 128 // 16 and call.grid[1] == 8  # (head block, row)
    assert call.grid[2] == shape.k_splits


# --------------------------------------------------------------------------
# Defects 3 and 5: what the GPU cannot take goes to the reference, visibly.
# --------------------------------------------------------------------------


def test_fp8_needs_sm89_and_the_reason_is_visible():
    args = _attention_args(dtype=FP8)
    scales = sds((2, 64, 16), F32)
    with _gpu.building_for(_gpu.A100):
        assert "sm_80" in gpu_obstacle({"k_pages": args[1]})
        with pytest.warns(KernelFallbackWarning, match="sm_89"):
            jax.eval_shape(paged_attention, *args, scales, scales)
        with pytest.raises(KernelArgumentError, match="sm_89"):
            jax.eval_shape(lambda *a: paged_attention(*a, implementation="pallas"), *args, scales, scales)
        with pytest.warns(KernelFallbackWarning, match="float8"):
            jax.eval_shape(lambda p, t, n: gather_all_compressed_kv(p, t, n, max_entries=64),
                           _entries(DSV4_FP8, (100, 32)), sds((4, 9), I32), sds((4,), I32))
        # bfloat16 pages still take the kernel on A100.
        assert gpu_obstacle({"k_pages": sds(args[1].shape, BF16)}) is None
    with _gpu.building_for(_gpu.H100), warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        jax.eval_shape(paged_attention, *args, scales, scales)


def test_one_byte_pools_of_2_to_4_gib_are_refused_not_misread():
    """32-bit offsets wrap past 2**31 elements of a 1-byte array of at most
    2**32 bytes: such pools must never reach the kernel."""
    fmt = DSV4_FP8
    per_page = 32 * fmt.nope_dim
    for pages, refused in ((140_000, False), (150_000, True), (290_000, True), (300_000, False)):
        entries = _entries(fmt, (pages, 32))
        reason = gpu_obstacle({"nope": entries.nope})
        assert (reason is not None) == refused, (pages, pages * per_page)
        if refused:
            assert str(pages * per_page) in reason
            with pytest.raises(KernelArgumentError, match="32-bit offsets"):
                jax.eval_shape(lambda p, t, n: gather_all_compressed_kv(p, t, n, max_entries=64,
                                                                        implementation="pallas"),
                               entries, sds((4, 9), I32), sds((4,), I32))
