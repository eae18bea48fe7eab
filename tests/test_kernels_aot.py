"""Every kernel compiled for H100 (and A100) without a GPU: ``aot`` tests.

They run ``kernels_pallas.aot_check``'s matrix through XLA's real GPU
pipeline (Triton passes, PTX, ``ptxas``) against a deviceless topology, and
need the CUDA plugin (``pip install 'jax[cuda12]>=0.10,<0.11'``); without it
they skip and say so. ``.ci/run`` installs it and runs them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest


@functools.cache
def _h100_results():
    from kernels_pallas import aot_check

    return {case.name: (case, aot_check.compile_case(case, "h100")) for case in aot_check.cases()}


def test_every_configuration_compiles_for_h100_without_spills():
    results = _h100_results()
    assert len(results) >= 40
    for name, (case, r) in results.items():
        if r.status == "reference":  # the 2.6 GB fp8 pool: refused, with the reason
            assert "32-bit offsets" in r.detail, name
            continue
        assert r.status == "ok", (name, r.detail)
        assert r.spill_bytes == 0 and r.registers is not None, (name, r.registers, r.spill_bytes)
        assert r.smem_bytes <= 232448 and r.occupancy >= 1, (name, r.smem_bytes)
        # Attention kernels stage tiles for their dots in shared memory; a
        # lossless gather is a plain load/store copy and may use none.
        lossless_gather = case.kernel.startswith("gather") and "lossless" in name
        assert r.smem_bytes > 0 or lossless_gather, (name, r.smem_bytes)
    assert sum(r.status == "reference" for _, r in results.values()) == 1


def test_planned_shapes_match_the_compiled_kernels():
    """Defects 1 and 7: the shared-memory estimate bounds what Triton
    allocated, and the occupancy the split count was sized with is the
    measured one (measured.json is current) or a lower bound of it."""
    from kernels_pallas.paged_attention import _measured  # noqa: PLC2701  the table under test

    table = _measured()["sm_90"]
    for name, (case, r) in _h100_results().items():
        if not case.kernel.startswith("paged_attention"):
            continue
        p = r.planned
        assert r.smem_bytes <= p["smem_bytes"], (name, r.smem_bytes, p["smem_bytes"])
        assert p["occupancy"] <= r.occupancy, (name, p, r.occupancy)
        if p["occupancy_from"] == "measured":
            # Same kernel body (the key); constants such as the split length
            # may move a register or two, never the occupancy.
            assert table[p["key"]]["smem_bytes"] == r.smem_bytes, name
            assert abs(table[p["key"]]["registers"] - r.registers) <= 8, (name, table[p["key"]], r.registers)
            assert p["occupancy"] == r.occupancy, name
        grid = r.grid
        assert grid[0] * grid[1] * grid[2] == p["programs"] and grid[2] == p["k_splits"], name
        assert p["programs"] <= 132 * r.occupancy or p["k_splits"] == 1, (name, p)  # one wave at most


def test_no_layer_of_a_stacked_pool_is_copied():
    """Defect 2: with ``layer=`` the compiled program has no buffer the size
    of a layer's pool; slicing ``pool[layer]`` first (the old call) has one."""
    from kernels_pallas import _gpu, aot_check
    from kernels_pallas.paged_attention import paged_attention

    for name, (case, r) in _h100_results().items():
        if case.kernel.startswith("paged_attention"):
            assert r.hlo_copies == [], (name, r.hlo_copies)

    device = aot_check.topology_device("h100")
    sharding = jax.sharding.SingleDeviceSharding(device)
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    pool = sds((4, 8, 2048, 16, 128), jnp.bfloat16)
    args = (sds((8, 32, 128), jnp.bfloat16), pool, pool, sds((8, 512), jnp.int32), sds((8,), jnp.int32))
    layer_bytes = 8 * 2048 * 16 * 128 * 2
    with _gpu.building_for(_gpu.H100):
        stacked = jax.jit(lambda q, k, v, t, n: paged_attention(q, k, v, t, n, layer=2))
        sliced = jax.jit(lambda q, k, v, t, n: paged_attention(q, k[2], v[2], t, n))
        compiled = [f.trace(*args).lower(lowering_platforms=("cuda",)).compile() for f in (stacked, sliced)]
    assert aot_check._big_copies(compiled[0].as_text(), layer_bytes) == []
    assert len(aot_check._big_copies(compiled[1].as_text(), layer_bytes)) >= 1


def test_gathers_issue_every_load_before_the_first_store():
    """Defect 6, in the PTX: 7 groups x (values, scale) + RoPE for DSV4."""
    for name, (case, r) in _h100_results().items():
        if case.kernel.startswith("gather") and r.status == "ok":
            before, after = r.ptx_loads
            assert after == 0 and before >= 15, (name, r.ptx_loads)


def test_mla_128_heads_runs_head_blocks_side_by_side():
    """Defect 8: 8 head blocks of 16 rows are grid axis x."""
    mla = [r for name, (case, r) in _h100_results().items() if "attn_mla" in name and "H=128" in name
           and "block_h" not in name]
    assert mla and all(r.grid[0] == 8 for r in mla)


def test_a100_runs_fp8_through_the_reference_and_compiles_the_rest():
    """Defect 5: float8 needs sm_89+; on A100 the default dispatch runs the
    reference and says why, everything else compiles for sm_80."""
    from kernels_pallas import aot_check

    picked = [c for c in aot_check.cases() if "gather_csa dsv4" in c.name or "ctx=1024" in c.name
              or ("attn_mla" in c.name and "H=16 " in c.name and "ps=16" in c.name)]
    results = [aot_check.compile_case(c, "a100") for c in picked]
    fp8 = [r for c, r in zip(picked, results) if "float8" in c.name or c.kernel.startswith("gather")]
    others = [r for c, r in zip(picked, results) if r not in fp8]
    assert fp8 and all(r.status == "reference" and "sm_89" in r.detail for r in fp8), [r.row() for r in fp8]
    assert others and all(r.status == "ok" and r.spill_bytes == 0 for r in others), [r.row() for r in others]
    assert all(r.smem_bytes <= 166912 for r in others)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_pools_stored_as_bits_reach_the_kernel_without_a_copy(dtype):
    """KVPool keeps bf16/fp8 pages as uint16/uint8 bits (in-place scatters on
    CPU); the model hands ``pool.k_pages``, a bitcast of the whole stacked
    pool, to the kernel. For H100 XLA must compile that bitcast to a no-op:
    no instruction may make a buffer of a layer's size."""
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas import _gpu, aot_check
    from kernels_pallas.bits import bits_dtype, from_bits
    from kernels_pallas.paged_attention import paged_attention

    sharding = SingleDeviceSharding(aot_check.topology_device("h100"))
    layers, kvh, pages, page, dim, batch = 4, 8, 4097, 16, 128, 8
    fp8 = dtype.startswith("float8")

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    def fn(q, k_bits, v_bits, tables, lengths, k_scales, v_scales):
        return paged_attention(q, from_bits(k_bits, dtype), from_bits(v_bits, dtype), tables, lengths, k_scales,
                               v_scales, layer=2)

    pool = (layers, kvh, pages, page, dim)
    scales = sds(pool[:-1], jnp.float32) if fp8 else None
    args = (sds((batch, 32, dim), jnp.bfloat16), sds(pool, bits_dtype(dtype)), sds(pool, bits_dtype(dtype)),
            sds((batch, 64), jnp.int32), sds((batch,), jnp.int32), scales, scales)
    with _gpu.building_for(_gpu.H100):
        compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
    layer_bytes = kvh * pages * page * dim * jnp.dtype(dtype).itemsize
    assert aot_check._big_copies(compiled.as_text(), layer_bytes) == []  # noqa: SLF001  the AOT report's own check
