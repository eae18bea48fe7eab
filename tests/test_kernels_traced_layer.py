"""A traced ``layer=`` on the Pallas path: both attention kernels under
``jax.jit`` and ``jax.lax.scan`` over a stacked ``[L, ...]`` pool.

A decoder run as ``lax.scan`` over stacked layer parameters passes the loop
index as ``layer``; the kernels read that layer of the whole pool in place
(the index reaches the kernel as data and indexes the pages' layer axis),
as they do for a static layer through their block specs. Checked here, in
Pallas' interpreter on fresh random inputs (bf16 pools, fp8 pools with
scales, MLA; the ragged kernel also with a window, a soft cap and sinks):

* a traced layer gives the static layer's output;
* a ``lax.scan`` over the layer axis (carrying a sum) gives the per-layer
  static outputs, and the references agree under the same scan.
  "Gives" is up to one bf16 rounding at the output's scale: XLA may fuse the
  interpreted kernel (and the reference) differently inside a loop body,
  and the layers' outputs differ by far more than that, so a wrong layer
  shows;
* a traced layer outside ``[0, L)`` attends nothing: zeros, kernel and
  reference alike; a Python int out of range, or a layer that is not an
  integer scalar, raises ``KernelArgumentError``.

Every layer holds its own random values with NaN wherever nothing may be read
(the null page, unreferenced pages, tails: the generators of the kernels'
own test modules), so a load of a wrong position or layer shows. Three
layers; every static layer and each configuration is one interpreted
compile of a few seconds.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import KernelArgumentError, ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas.lowered import triton_calls
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.reference import paged_decode_attention
from tests import test_kernels_paged_attention as paged_tests
from tests import test_kernels_ragged_attention as ragged_tests
from tests.util import KERNEL_MODES

F32, BF16, FP8 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)
I32 = jnp.dtype(jnp.int32)
LAYERS = 3
POOL = ("k_pages", "v_pages", "k_scales", "v_scales")
BF16_TOL = dict(atol=2e-2, rtol=2e-2)

# (name, generator keywords, call keywords)
PAGED = [
    ("bf16", dict(kvh=2, h=4, dk=32, dv=32, kv_dtype=BF16), dict(sliding_window=13, logit_soft_cap=20.0)),
    ("fp8", dict(kvh=2, h=4, dk=32, dv=32, kv_dtype=FP8, scales=True), {}),
    ("mla_fp8", dict(kvh=1, h=4, dk=48, dv=None, kv_dtype=FP8, scales=True), dict(mla_value_dim=32)),
]
RAGGED = [
    ("bf16_window_cap_sinks", dict(kvh=2, h=4, dk=32, dv=32, kv_dtype=BF16, sinks=True, window=7),
     dict(sliding_window=7, logit_soft_cap=20.0)),
    ("fp8", dict(kvh=2, h=4, dk=32, dv=32, kv_dtype=FP8, scales=True), {}),
    ("mla_fp8", dict(kvh=1, h=4, dk=48, dv=None, kv_dtype=FP8, scales=True), dict(mla_value_dim=32)),
]


def _stack(rng, args):
    """``args`` (one layer) -> ``LAYERS`` layers of fresh random values with
    NaN where ``args`` has NaN (same tables, so the same unreadable places)."""
    out = dict(args)
    for name in POOL:
        x = args.get(name)
        if x is None:
            continue
        base = np.asarray(x, np.float32)
        nan = np.isnan(base)
        layers = []
        for _ in range(LAYERS):
            if name.endswith("scales"):
                fresh = rng.uniform(0.05, 0.5, base.shape)
            else:
                fresh = rng.standard_normal(base.shape) * (4.0 if x.dtype == FP8 else 1.0)
            layers.append(np.where(nan, np.nan, fresh))
        out[name] = jnp.asarray(np.stack(layers), x.dtype)
    return out


def _f32(x):
    return np.asarray(jnp.asarray(x, F32))


def _same(actual, expected, msg):
    """Equal up to one bf16 rounding at the scale of each output row (one
    token's head: 2**-7 of the value, plus 2**-8 of the row's largest
    absolute value), no NaN. A small element of a row is the sum of terms
    of the row's scale: their rounding, not its own, bounds its error (a
    fixed 1e-5 failed by chance at 3e-5 on an element of 0.0014 in a row of
    0.10, seed 8759832091281005489)."""
    actual, expected = _f32(actual), _f32(expected)
    assert not np.isnan(actual).any(), msg
    scale = np.abs(expected).max(axis=-1, keepdims=True)
    bad = np.abs(actual - expected) > 2**-7 * np.abs(expected) + 2**-8 * scale + 1e-6
    if bad.any():
        at = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{msg}: {int(bad.sum())} of {bad.size} elements differ by more than one bf16 rounding "
                             f"at their row's scale; first at {list(map(int, at))}: {actual[at]} vs {expected[at]} "
                             f"(row scale {float(scale[at[:-1]][0]):.3g})")


def _paged_case(gen):
    rng, seed = paged_tests._new_rng()
    args, _ = paged_tests.make_case(rng, **gen)
    return _stack(rng, args), seed


def _ragged_case(gen):
    rng, seed = ragged_tests._new_rng()
    args, _, _ = ragged_tests.make_case(rng, **gen)
    return _stack(rng, args), seed


def _check_traced_layer(fn, reference, stacked, seed, rng_layer):
    """(a) jit with a traced layer == the static layer, for a random layer;
    (b) a scan over the layers == the static layers (and the references
    agree under the same scan); (c) out of range: zeros."""
    static = [fn(stacked, layer=layer) for layer in range(LAYERS)]
    for out in static:
        assert not np.isnan(_f32(out)).any(), seed
    # The layers differ, so picking a wrong one cannot pass.
    assert not np.array_equal(_f32(static[0]), _f32(static[1])), seed

    traced = jax.jit(lambda a, layer: fn(a, layer=layer))
    _same(traced(stacked, jnp.int32(rng_layer)), static[rng_layer], f"layer {rng_layer} {seed}")

    def scanned(f, a):
        def step(acc, layer):
            out = f(a, layer=layer)
            return acc + out.astype(F32), out
        return jax.lax.scan(step, jnp.zeros(static[0].shape, F32), jnp.arange(LAYERS, dtype=jnp.int32))

    total, outs = jax.jit(functools.partial(scanned, fn))(stacked)
    for layer in range(LAYERS):
        _same(outs[layer], static[layer], f"scan, layer {layer} {seed}")
    np.testing.assert_allclose(_f32(total), sum(_f32(s) for s in outs), rtol=1e-6, atol=1e-6, err_msg=seed)
    _, ref_outs = jax.jit(functools.partial(scanned, reference))(stacked)
    for layer in range(LAYERS):
        _same(ref_outs[layer], reference(stacked, layer=layer), f"reference scan, layer {layer} {seed}")
        np.testing.assert_allclose(_f32(outs[layer]), _f32(ref_outs[layer]), **BF16_TOL,
                                   err_msg=f"kernel vs reference, layer {layer} {seed}")

    # (c) A traced layer out of range attends nothing: zeros (no NaN, no other layer).
    for bad in (-1, LAYERS, 2**31 - 1):
        for f in (traced, jax.jit(lambda a, layer: reference(a, layer=layer))):
            out = _f32(f(stacked, jnp.int32(bad)))
            np.testing.assert_array_equal(out, np.zeros_like(out), err_msg=f"layer {bad} {seed}")
    for f in (fn, reference):
        for bad in (-1, LAYERS):
            with pytest.raises(KernelArgumentError, match="out of range"):
                f(stacked, layer=bad)
        with pytest.raises(KernelArgumentError, match="integer scalar"):
            jax.jit(lambda a, layer: f(a, layer=layer))(stacked, jnp.float32(1))
        with pytest.raises(KernelArgumentError, match="integer scalar"):
            jax.jit(lambda a, layer: f(a, layer=layer))(stacked, jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("interpret", KERNEL_MODES)
@pytest.mark.parametrize("name, gen, kw", PAGED, ids=[c[0] for c in PAGED])
def test_paged_attention_traced_layer(name, gen, kw, interpret):
    stacked, seed = _paged_case(gen)

    def fn(a, *, layer):
        return paged_attention(**a, **kw, layer=layer, implementation="pallas", interpret=interpret)

    def reference(a, *, layer):
        return paged_decode_attention(**a, **kw, layer=layer)

    _check_traced_layer(fn, reference, stacked, seed, int(np.random.default_rng().integers(LAYERS)))


@pytest.mark.parametrize("interpret", KERNEL_MODES)
@pytest.mark.parametrize("name, gen, kw", RAGGED, ids=[c[0] for c in RAGGED])
def test_ragged_attention_traced_layer(name, gen, kw, interpret):
    stacked, seed = _ragged_case(gen)

    def fn(a, *, layer):
        return ragged_paged_attention(**a, **kw, layer=layer, implementation="pallas", interpret=interpret)

    def reference(a, *, layer):
        return ragged_paged_attention_reference(**a, **kw, layer=layer)

    _check_traced_layer(fn, reference, stacked, seed, int(np.random.default_rng().integers(LAYERS)))


def _layer_sized_slices(stablehlo: str, layer_elements: int) -> list[str]:
    """The (dynamic) slices and gathers of a StableHLO text whose result
    holds at least a layer's pages: a layer copied out of the pool."""
    found = []
    for line in stablehlo.splitlines():
        if not re.search(r"stablehlo\.(dynamic_slice|slice|gather|\"stablehlo\.gather\")", line) or "->" not in line:
            continue
        dims = re.match(r"\s*tensor<([\dx]*)x\w+>", line.rsplit("->", 1)[1])
        if dims and math.prod(int(x) for x in dims.group(1).split("x")) >= layer_elements:
            found.append(line.strip()[:200])
    return found


def _int_pointers(call) -> int:
    """The kernel's int32 pointer operands (metadata, tables, a traced layer)."""
    (signature,) = [line for line in call.ttir.splitlines() if "tt.func public" in line]
    return signature.count("!tt.ptr<i32>")


def test_traced_layer_lowers_to_triton_without_a_layer_copy():
    """Cross-lowered for CUDA (the Triton lowering runs on CPU): under a
    ``lax.scan`` over the layers, the kernels take the whole stacked pool
    (no slice or dynamic slice of a layer anywhere in the program), the
    traced layer is one more int32 operand of the kernel, and the static
    layer's kernel is unchanged by it (no such operand)."""
    sds = jax.ShapeDtypeStruct
    layers, kvh, pages, ps, d, b = 4, 2, 64, 16, 64, 2
    pool = sds((layers, kvh, pages, ps, d), FP8)
    scales = sds((layers, kvh, pages, ps), F32)
    layer_elements = kvh * pages * ps * d
    q, table, lengths, cu = sds((b, 8, d), BF16), sds((b, 8), jnp.int32), sds((b,), jnp.int32), sds((b + 1,), I32)

    def scan_of(kernel):
        def run(q, k, v, t, n, cu, ks, vs):
            def step(acc, layer):
                return acc + kernel(q, k, v, t, n, cu, ks, vs, layer).astype(F32), None
            return jax.lax.scan(step, jnp.zeros((b, 8, d), F32), jnp.arange(layers))[0]
        return run

    kernels = {
        "paged": lambda q, k, v, t, n, cu, ks, vs, layer: paged_attention(
            q, k, v, t, n, ks, vs, layer=layer, implementation="pallas"),
        "ragged": lambda q, k, v, t, n, cu, ks, vs, layer: ragged_paged_attention(
            q, k, v, t, n, cu, ks, vs, layer=layer, implementation="pallas"),
    }
    for name, kernel in kernels.items():
        args = (q, pool, pool, table, lengths, cu, scales, scales)
        lowered = jax.jit(scan_of(kernel)).trace(*args).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert not _layer_sized_slices(text, layer_elements), name
        (traced_call,) = triton_calls(lowered)
        static = jax.jit(lambda *a: kernel(*a, 2)).trace(*args).lower(lowering_platforms=("cuda",))
        (static_call,) = triton_calls(static)
        assert _int_pointers(traced_call) == _int_pointers(static_call) + 1, name
        assert traced_call.grid == static_call.grid, name
