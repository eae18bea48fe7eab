"""Paged decode attention: a Pallas GPU (Triton) kernel and its dispatch.

:func:`paged_attention` computes what :func:`kernels_pallas.reference.paged_decode_attention`
computes (same arguments, masking rules and isolation guarantee; that function
is also the reference this one dispatches to, see
:mod:`kernels_pallas._dispatch`), with a split-K flash-decoding kernel.

Algorithm. The grid is ``(head_blocks, B * KVH, k_splits)`` (head blocks
fastest, so the programs that read the same pages run together; block sizes,
pipeline depth and ``k_splits`` come from :func:`plan`, sized to the target
GPU's shared memory and SMs). Pages and scales may be the whole stacked
``[L, ...]`` pool with a ``layer``, read in place: a static one is picked by
the block specs; a traced one (a ``lax.scan`` index) is a one-element input
the kernel loads and adds, times the layer stride, to its page and scale
loads (the blocks keep the whole layer axis). The block table
is padded to ``k_splits * pages_per_split`` columns (with page 0, and every
entry clamped into ``[0, P)``) and split into ``k_splits`` equal ranges of
pages. Each program takes ``block_h`` query rows of one KV head's GQA group
(``g = H // KVH`` rows, padded with zero rows to a power of two >= 16, the
smallest M of a Triton dot; ``head_blocks = g_pad / block_h`` is 1 unless the
float32 accumulator would not fit in registers, as with MLA's 512-wide values
and many heads) and loops, with dynamic bounds, over the compute blocks of
``pages_per_compute_block`` pages of its range that hold attended positions,
i.e. pages ``[max(0, len - W) // ps, ceil(len / ps))``: pages before a sliding
window and splits past a short sequence cost no loads. A block's pages are
gathered through the table with one vector-indexed load per head-dim chunk.
Online softmax (running max ``m``, sum ``l``, accumulator ``o``, all float32)
runs over the blocks; each program writes its unnormalised partial ``o``,
``m`` and ``l``, and the splits are merged outside the kernel with a
log-sum-exp in ``jnp``. A program with no attended position writes ``o = 0``,
``l = 0``, so a sequence with none gets exact zeros, never NaN.

Masking and isolation. Position ``t`` is attended iff
``max(0, len - W) <= t < min(len, M * ps)``. Every loaded K/V tile and scale is
passed through ``jnp.where(valid, x, 0)`` before any arithmetic, the masked
logits are replaced before the max, and the masked probabilities are set to
exactly 0 with ``jnp.where`` (not by underflow), so NaN/inf in the null page,
in unreferenced pages, in the tail of a last page, before the window or in
their scales cannot reach the output (the reference's guarantee).

Triton power-of-two rule. Triton tensors need power-of-two sizes, and its dot
needs M, N, K >= 16. So the head dims are cut into static power-of-two chunks
(:func:`kernels_pallas._dispatch.pow2_chunks`): logits are the sum over K chunks
of ``q_chunk @ k_chunk.T``, and the output is accumulated per V chunk. Chunks
narrower than 16 use a broadcast-multiply-reduce instead of a dot. Block
tokens (``pages_per_compute_block * page_size``) must be a power of two >= 16,
so the Pallas path needs a power-of-two page size (other page sizes run the
reference when ``implementation`` is left to the default). In MLA mode the K
chunks are those of ``[0, Dv)`` followed by those of ``[Dv, Dk)``, so the value
chunks are exactly the first K chunks and the loaded K tiles are reused as V.

Numerics (flash convention): ``q @ K.T`` takes K in ``q.dtype`` (fp8 pages are
cast after the load), accumulates in float32 and is then scaled by
``sm_scale`` and the per-token K scale (scaling the float32 logits instead of
pre-scaling a bf16 ``q`` keeps one rounding out); the soft cap applies to
those scaled logits; ``p`` is scaled by the per-token V scale, cast to
``q.dtype`` and multiplied into V in ``q.dtype`` with float32 accumulation.
The reference does everything in float32, so bf16 results agree to bf16
precision, not bitwise.

Differences from JAX's ``jax.experimental.pallas.ops.gpu.paged_attention``:
``sm_scale`` is an argument (JAX's expects a pre-scaled ``q``); the caller
needs no table padding or clamping (any table width, -1 or garbage past the
live pages); sliding windows (traced or static) with skipped pages; MLA mode
(no V pages; K and V head dims may differ and need not be powers of two);
full isolation of masked K/V and scales (JAX's multiplies its zero weights
into whatever V rows it loaded, so NaN there reaches the output); fp8 pages
take per-token-per-head scales; the split count defaults from the shapes to
fill the GPU instead of a fixed 16, and empty splits skip their work.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from kernels_pallas.reference import attention_scalars, paged_decode_attention, split_layer, traced_layer
from kernels_pallas.errors import KernelArgumentError
from kernels_pallas import _dispatch, _gpu

__all__ = ["KernelShape", "SharedMemoryExceeded", "paged_attention", "plan", "smem_bytes"]

# Finite stand-in for -inf on masked logits and the initial running max: with
# -inf, a block or split with nothing attended would compute exp(-inf + inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_DOT = 16  # Triton's tl.dot needs M, N, K >= 16
# Float32 accumulator elements per program (block_h * Dv): 32 KiB, so the
# accumulator stays in registers even for MLA's Dv = 512 (block_h 16).
ACC_BUDGET = 8192


# --------------------------------------------------------------------------
# The kernel. MASK_VALUE, MIN_DOT, ACC_BUDGET, dot_nt, dot_nn, is_pow2,
# fit_block and default_num_warps are shared with kernels_pallas.ragged_kernel.
# --------------------------------------------------------------------------


def dot_precision(dtype):
    # float32 operands: full float32 products (Triton "ieee"), as the
    # reference computes; the default would run them as TF32 (10-bit mantissa).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot_nt(a, b):
    """``a [M, K] @ b [N, K].T`` in float32 (Triton dot needs K >= 16)."""
    if a.shape[1] >= MIN_DOT:
        return jnp.dot(a, b.T, preferred_element_type=jnp.float32, precision=dot_precision(a.dtype))
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=2)


def dot_nn(a, b):
    """``a [M, K] @ b [K, N]`` in float32 (Triton dot needs N >= 16)."""
    if b.shape[1] >= MIN_DOT:
        return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=dot_precision(a.dtype))
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)


def attend_block(carry, q_tiles, page_ids, valid, allowed, k_ref, v_ref, ks_ref, vs_ref, *, k_chunks, v_chunks,
                 block, dtype, sm_scale, cap, use_cap, mla, layer=None):
    """One compute block of the online softmax both attention kernels run
    (this decode kernel and :mod:`kernels_pallas.ragged_kernel`): load the
    block's K tiles of ``page_ids`` (zeroed where not ``valid``: isolation
    before the dot), logits against ``q_tiles`` scaled by ``sm_scale`` and the
    per-token K scales, soft cap, mask by ``allowed`` (``[rows, block]``),
    update the running max ``m``, sum ``l`` and the float32 accumulators
    (one per V chunk; in MLA mode the value chunks are the first K tiles).
    ``layer``: None when the block specs picked the layer (a static one), or
    the traced layer index (an int32 scalar loaded in the kernel) when the
    refs keep the whole layer axis: then every page and scale load indexes
    it, i.e. adds ``layer * layer_stride`` to its pointers.
    Returns the new ``(m, l, accs)`` from ``carry``."""
    m_prev, l_prev, accs = carry
    f32 = jnp.float32
    lead = () if layer is None else (layer,)
    logits, k_tiles = None, []
    for q_tile, (c0, n) in zip(q_tiles, k_chunks):
        k = k_ref[(*lead, page_ids, slice(None), pl.ds(c0, n))].reshape(block, n).astype(dtype)
        k = jnp.where(valid[:, None], k, jnp.zeros_like(k))  # isolation: before the dot
        k_tiles.append(k)
        part = dot_nt(q_tile, k)
        logits = part if logits is None else logits + part
    k_scale = None
    if ks_ref is not None:
        k_scale = jnp.where(valid, ks_ref[(*lead, page_ids)].reshape(block).astype(f32), 0.0)
        logits = logits * (sm_scale * k_scale)[None, :]
    else:
        logits = logits * sm_scale
    if use_cap:
        logits = cap * jnp.tanh(logits / cap)
    logits = jnp.where(allowed, logits, MASK_VALUE)

    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
    correction = jnp.exp(m_prev - m_next)
    # Masked weights are exactly 0 by the where, not by exp underflow.
    p = jnp.where(allowed, jnp.exp(logits - m_next[:, None]), 0.0)
    l_next = correction * l_prev + jnp.sum(p, axis=1)

    # Per-token V scales act on the reduction axis, so they scale p.
    if mla:
        v_scale = k_scale
    elif vs_ref is not None:
        v_scale = jnp.where(valid, vs_ref[(*lead, page_ids)].reshape(block).astype(f32), 0.0)
    else:
        v_scale = None
    if v_scale is not None:
        p = p * v_scale[None, :]
    p = p.astype(dtype)

    new_accs = []
    for j, (c0, n) in enumerate(v_chunks):
        if mla:
            v = k_tiles[j]  # the value chunks are the first K chunks, already masked
        else:
            v = v_ref[(*lead, page_ids, slice(None), pl.ds(c0, n))].reshape(block, n).astype(dtype)
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        new_accs.append(correction[:, None] * accs[j] + dot_nn(p, v))
    return m_next, l_next, tuple(new_accs)


def _kernel(*refs, n_poisoned, page_size, ppcb, pages_per_split, k_chunks, v_chunks, mla, use_cap):
    # The first n_poisoned inputs are the NaN-filled outputs aliased in interpret mode.
    (bounds_ref, params_ref, layer_ref, table_ref, q_ref, k_ref, ks_ref, v_ref, vs_ref,
     o_ref, m_ref, l_ref) = refs[n_poisoned:]
    ps, f32 = page_size, jnp.float32
    block = ppcb * ps
    rows = q_ref.shape[0]  # block_h query rows of one KV head's group
    dtype = q_ref.dtype  # both dots take their operands in q.dtype
    start, end = bounds_ref[0], bounds_ref[1]  # attended positions [start, end)
    sm_scale, cap = params_ref[0], params_ref[1]
    # A traced layer: the page refs keep the layer axis, indexed per load.
    layer = None if layer_ref is None else layer_ref[0]
    q_tiles = [q_ref[:, pl.ds(c0, n)] for c0, n in k_chunks]

    # Pages of this split holding attended positions: [lo, hi). All values
    # are >= 0 where it matters, so truncating division is floor division.
    split_first = pl.program_id(2) * pages_per_split  # grid: (head block, row * KVH + head, split)
    lo = jnp.maximum(lax.div(start, ps), split_first)
    hi = jnp.minimum(lax.div(end + ps - 1, ps), split_first + pages_per_split)
    # Blocks stay aligned to the split's start so that a block never reads
    # past the padded table.
    first_block = lax.div(lo - split_first, ppcb)
    n_blocks = jnp.maximum(lax.div(hi - split_first + ppcb - 1, ppcb) - first_block, 0)

    def body(i, carry):
        p0 = split_first + (first_block + i) * ppcb
        page_ids = table_ref[pl.ds(p0, ppcb)]
        pos = p0 * ps + lax.broadcasted_iota(jnp.int32, (block,), 0)
        valid = (pos >= start) & (pos < end)
        return attend_block(carry, q_tiles, page_ids, valid, valid[None, :], k_ref, v_ref, ks_ref, vs_ref,
                            k_chunks=k_chunks, v_chunks=v_chunks, block=block, dtype=dtype, sm_scale=sm_scale, cap=cap,
                            use_cap=use_cap, mla=mla, layer=layer)

    init = (jnp.full((rows,), MASK_VALUE, f32), jnp.zeros((rows,), f32),
            tuple(jnp.zeros((rows, n), f32) for _, n in v_chunks))
    m_run, l_run, accs = lax.fori_loop(0, n_blocks, body, init)
    for (c0, n), acc in zip(v_chunks, accs):
        o_ref[:, pl.ds(c0, n)] = acc
    m_ref[...] = m_run
    l_ref[...] = l_run


@functools.partial(jax.jit, static_argnames=("layer", "use_cap", "mla_value_dim", "shape", "interpret"))
def _pallas_impl(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
                 sm_scale, window, cap, layer_index, *, layer, use_cap, mla_value_dim, shape, interpret):
    """The kernel launch and the split merge. Pages and scales carry a
    leading layer axis (``[L, KVH, P, ps, ...]``), so no layer is ever sliced
    out (copied) in XLA: a static ``layer`` (``layer_index`` None) is picked
    by the kernel's block specs; a traced one (``layer`` None, ``layer_index``
    an int32 scalar) reaches the kernel as a 1-element input, the block specs
    keep the whole layer axis and every page and scale load indexes it. A
    traced layer outside ``[0, L)`` attends nothing (zero lengths: the output
    is zeros, no page is loaded) and is clamped, so no load can leave the pool."""
    b, h, dk = q.shape
    num_layers, kvh, num_pages, ps, _ = k_pages.shape
    width = block_tables.shape[1]
    mla = v_pages is None
    dv = mla_value_dim if mla else v_pages.shape[-1]
    g = h // kvh
    g_pad = max(MIN_DOT, _dispatch.next_pow2(g))
    block_h, k_splits, ppcb = shape.block_h, shape.k_splits, shape.pages_per_compute_block
    n_hb = g_pad // block_h  # head blocks per KV head (both powers of two)
    pages_per_split = max(1, _dispatch.ceil_div(width, ppcb * k_splits)) * ppcb  # M = 0: one empty block
    i32, f32 = jnp.int32, jnp.float32

    # Pad the table to whole splits and clamp every entry into [0, P) here,
    # once, so the kernel's loads are always in bounds; masking by position
    # makes whatever those pages hold irrelevant.
    table = jnp.pad(block_tables.astype(i32), ((0, 0), (0, k_splits * pages_per_split - width)))
    table = jnp.clip(table, 0, num_pages - 1)
    length = jnp.maximum(lengths.astype(i32), 0)
    layer_arg = None
    if layer is None:
        layer_index, length = traced_layer(layer_index, num_layers, length)
        layer_arg = layer_index.reshape(1)
    # len >= 0 and 1 <= W <= INT32_MAX, so len - W cannot overflow.
    bounds = jnp.stack([jnp.maximum(length - window, 0), jnp.minimum(length, width * ps)], axis=1)
    params = jnp.stack([sm_scale, cap]).astype(f32)
    qg = q.reshape(b, kvh, g, dk)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))  # zero rows: harmless, sliced off

    if mla:
        # Value chunks first, so they are the first K chunks (reused as V).
        k_chunks = _dispatch.pow2_chunks(dv) + [(dv + s, n) for s, n in _dispatch.pow2_chunks(dk - dv)]
    else:
        k_chunks = _dispatch.pow2_chunks(dk)
    v_chunks = _dispatch.pow2_chunks(dv)

    # Grid (head block, row * KVH + KV head, split). Axis 0 is CUDA's x, the
    # fastest-varying in launch order, so the head blocks that read the same
    # pages (MLA's 128 heads: 8 blocks of 16) run side by side and share
    # those pages through L2 instead of re-reading them from HBM.
    def full(*shape):  # the whole array, same block for every program
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    def per_head(x):  # [L, KVH, P, ...] -> this program's layer (static) or all layers, and KV head
        if x is None:
            return None
        if layer is None:  # traced: the kernel indexes the layer axis with layer_arg
            return pl.BlockSpec((x.shape[0], None, *x.shape[2:]), lambda hb, r, si: (0, r % kvh) + (0,) * (x.ndim - 2))
        return pl.BlockSpec((None, None, *x.shape[2:]), lambda hb, r, si: (layer, r % kvh) + (0,) * (x.ndim - 2))

    out_shape = [jax.ShapeDtypeStruct((b, kvh, k_splits, g_pad, dv), f32),
                 jax.ShapeDtypeStruct((b, kvh, k_splits, g_pad), f32),
                 jax.ShapeDtypeStruct((b, kvh, k_splits, g_pad), f32)]
    out_specs = [
        pl.BlockSpec((None, None, None, block_h, dv), lambda hb, r, si: (r // kvh, r % kvh, si, hb, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda hb, r, si: (r // kvh, r % kvh, si, hb)),
        pl.BlockSpec((None, None, None, block_h), lambda hb, r, si: (r // kvh, r % kvh, si, hb)),
    ]
    in_specs = [
        pl.BlockSpec((None, 2), lambda hb, r, si: (r // kvh, 0)),  # bounds
        full(2),  # sm_scale, cap
        None if layer_arg is None else full(1),  # a traced layer
        pl.BlockSpec((None, table.shape[1]), lambda hb, r, si: (r // kvh, 0)),  # table row
        pl.BlockSpec((None, None, block_h, dk), lambda hb, r, si: (r // kvh, r % kvh, hb, 0)),  # q rows
        per_head(k_pages), per_head(k_scales), per_head(v_pages), per_head(v_scales),
    ]
    args = [bounds, params, layer_arg, table, qg, k_pages, k_scales, v_pages, v_scales]
    poisoned, aliases = [], {}
    if interpret:
        # Outputs start as NaN so an element the kernel forgets to write shows up.
        poisoned = [_dispatch.poisoned(s.shape, s.dtype) for s in out_shape]
        aliases = {i: i for i in range(len(poisoned))}
        in_specs = out_specs + in_specs
    kernel = functools.partial(
        _kernel, n_poisoned=len(poisoned), page_size=ps, ppcb=ppcb,
        pages_per_split=pages_per_split, k_chunks=tuple(k_chunks), v_chunks=tuple(v_chunks),
        mla=mla, use_cap=use_cap)
    o_part, m_part, l_part = pl.pallas_call(
        kernel,
        grid=(n_hb, b * kvh, k_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=shape.num_warps, num_stages=shape.num_stages),
        name=f"jaxkv_paged_attention_ppcb{ppcb}_bh{block_h}_splits{k_splits}",
    )(*poisoned, *args)

    # Merge the splits (log-sum-exp). Empty splits have l = 0, o = 0 and the
    # finite mask value as m, so they weigh nothing; nothing attended at all
    # gives l = 0 and an exact 0 output.
    m_max = jnp.max(m_part, axis=2, keepdims=True)
    w = jnp.exp(m_part - m_max)
    l_sum = jnp.sum(w * l_part, axis=2)
    o_sum = jnp.sum(w[..., None] * o_part, axis=2)
    out = jnp.where(l_sum[..., None] > 0, o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)
    return out[:, :, :g].reshape(b, h, dv).astype(q.dtype)


# --------------------------------------------------------------------------
# Kernel shape: chosen from the target GPU's shared memory, registers and SMs.
# --------------------------------------------------------------------------


class SharedMemoryExceeded(KernelArgumentError):
    """No block shape of these arguments fits the GPU's shared memory."""


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """How one ``paged_attention`` call is cut into programs.

    ``pages_per_compute_block`` pages (``block_tokens`` tokens) per loop
    step, ``block_h`` query rows per program, ``k_splits`` programs per
    (sequence, KV head, head block), Triton's ``num_warps`` and
    ``num_stages``; ``smem_bytes`` is the shared memory this module expects
    Triton to allocate (an upper bound, checked against the compiled kernels
    by ``python -m kernels_pallas.aot_check``); ``occupancy`` the programs
    per SM: measured (shared memory and ``ptxas`` registers of this kernel
    body compiled for this GPU, recorded in ``measured.json`` by
    ``aot_check --record``) where known, else a lower bound from
    ``smem_bytes`` and 255 registers; ``programs`` the grid size.
    """

    pages_per_compute_block: int
    block_tokens: int
    block_h: int
    k_splits: int
    num_warps: int
    num_stages: int
    smem_bytes: int
    occupancy: int
    programs: int
    key: str = ""  # the compiled kernel body, as recorded in measured.json
    occupancy_from: str = "estimate"  # or "measured" (aot_check's record of this key)


def smem_bytes(*, block_tokens, block_h, dk, dv, k_itemsize, v_itemsize, q_itemsize, mla, num_stages) -> int:
    """Upper bound of the shared memory Triton allocates for one program
    (checked against every compiled configuration of ``aot_check``).

    Triton stages the K/V tile loads through shared memory ``num_stages``
    deep; narrower-than-``q`` pages (fp8) are converted through it for the
    dot operands (half a converted tile at most, measured); and the ``q``
    rows, logits and accumulator rows pass through it for layout changes.
    """
    kv_tile = block_tokens * (dk * k_itemsize + (0 if mla else dv * v_itemsize))
    converted = 0
    if k_itemsize < q_itemsize:
        converted = block_tokens * (dk + (0 if mla else dv)) * q_itemsize // 2
    scratch = block_h * (dk * q_itemsize + (block_tokens + dv) * 4)
    return num_stages * kv_tile + converted + scratch


@functools.cache
def _measured() -> dict:
    path = os.path.join(os.path.dirname(__file__), "measured.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def measured_entry(spec: _gpu.GpuSpec, key: str) -> dict | None:
    """``measured.json``'s record (``smem_bytes``, ``registers``) of the
    kernel body ``key`` compiled for ``spec`` (``aot_check --record``), or None."""
    return _measured().get(f"sm_{spec.sm}", {}).get(key)


def kernel_key(*, q_dtype, k_dtype, v_dtype, dk, dv, page_size, block_tokens, block_h, num_stages, num_warps,
               soft_cap) -> str:
    """Names one compiled kernel body (everything that changes its code)."""
    v = "mla" if v_dtype is None else jnp.dtype(v_dtype).name
    return (f"q={jnp.dtype(q_dtype).name} k={jnp.dtype(k_dtype).name} v={v} dk={dk} dv={dv} ps={page_size} "
            f"tokens={block_tokens} bh={block_h} stages={num_stages} warps={num_warps} cap={int(bool(soft_cap))}")


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _target_block_tokens(head_dim: int, f32: bool) -> int:
    # ~128 tokens per loop step (64 for MLA-sized heads, whose K tiles are
    # large): long enough to hide the latency of the page loads. float32's
    # FMA dots spill registers past 64 tokens (measured by aot_check).
    return 128 if head_dim <= 256 and not f32 else 64


def _default_block_h(g_pad: int, dv: int) -> int:
    return min(g_pad, max(MIN_DOT, ACC_BUDGET // _dispatch.next_pow2(dv)))


def _default_k_splits(base_programs: int, blocks: int, slots: int) -> int:
    """The most splits ``s <= blocks`` with ``s * base_programs <= slots``
    (programs the GPU holds at once: SMs x occupancy), so the grid is one
    full wave or less and never spills a partial second wave; 1 if the
    batch alone fills the GPU. Then as few splits as give the same blocks
    per split."""
    splits = max(1, min(blocks, slots // max(1, base_programs)))
    return _dispatch.ceil_div(blocks, _dispatch.ceil_div(blocks, splits))


def default_num_warps(q_dtype, dk: int, dv: int) -> int:
    """Triton warps of an attention program: 8 when a head dim exceeds 128
    or the dots are float32 (FMA, more registers), else 4."""
    return 8 if max(dk, dv) > 128 or jnp.dtype(q_dtype) == jnp.float32 else 4


def fit_block(kernel: str, *, q_dtype, k_dtype, v_dtype, dk: int, dv: int, page_size: int, width: int,
              block_h: int, pages_per_compute_block: int | None, target_tokens: int,
              spec: _gpu.GpuSpec) -> tuple[int, int, int]:
    """``(pages_per_compute_block, num_stages, smem_bytes)`` of a paged
    attention program over ``block_h`` query rows (shared by
    :func:`plan` and the ragged kernel's planner; ``v_dtype`` None is MLA).

    Default: the largest power-of-two block of at most ``target_tokens``
    tokens (at least 16, no longer than a ``width``-page table needs) whose
    :func:`smem_bytes` with two pipeline stages fits ``spec``'s per-block
    shared memory, else one stage (float32 dots: one stage only). An
    explicit ``pages_per_compute_block`` is checked and kept.

    Raises:
      KernelArgumentError: ``pages_per_compute_block`` out of range.
      SharedMemoryExceeded: no block shape fits.
    """
    mla = v_dtype is None
    ps = page_size
    sizes = dict(block_h=block_h, dk=dk, dv=dv, k_itemsize=jnp.dtype(k_dtype).itemsize,
                 v_itemsize=0 if mla else jnp.dtype(v_dtype).itemsize,
                 q_itemsize=jnp.dtype(q_dtype).itemsize, mla=mla)
    f32 = jnp.dtype(q_dtype) == jnp.float32
    # float32 dots at full precision run on FMA units, not tensor cores, and
    # hold far more registers: one stage (no cp.async staging) keeps them
    # from spilling.
    stage_options = (1,) if f32 else (2, 1)
    min_ppcb = _dispatch.next_pow2(_dispatch.ceil_div(MIN_DOT, ps))
    if pages_per_compute_block is None:
        ppcb = min(max(1, target_tokens // ps), _dispatch.next_pow2(width))
        ppcb = max(ppcb, min_ppcb)
        candidates = [(p, st) for st in stage_options for p in halvings(ppcb, min_ppcb)]
    else:
        ppcb = int(pages_per_compute_block)
        if not (is_pow2(ppcb) and ppcb * ps >= MIN_DOT):
            raise KernelArgumentError(
                f"pages_per_compute_block must be a power of two with pages_per_compute_block * "
                f"page_size >= {MIN_DOT}, got {pages_per_compute_block} (page_size {ps})")
        candidates = [(ppcb, st) for st in stage_options]
    fits = [(p, st, smem_bytes(block_tokens=p * ps, num_stages=st, **sizes)) for p, st in candidates]
    fits = [f for f in fits if f[2] <= spec.smem_per_block]
    if not fits:
        need = smem_bytes(block_tokens=candidates[-1][0] * ps, num_stages=1, **sizes)
        raise SharedMemoryExceeded(
            f"{kernel}: no block shape fits {spec.name}'s {spec.smem_per_block} bytes of shared memory "
            f"per block (the smallest needs {need}: {candidates[-1][0] * ps} tokens x head dims {dk}/{dv}, "
            f"block_h {block_h}); pass a smaller block_h or pages_per_compute_block")
    return fits[0]


def plan(q, k_pages, v_pages, block_tables, *, mla_value_dim=None, layer=None, pages_per_compute_block=None,
         k_splits=None, block_h=None, soft_cap=False, spec: _gpu.GpuSpec | None = None) -> KernelShape:
    """The :class:`KernelShape` :func:`paged_attention` uses for these
    arguments (arrays or ``jax.ShapeDtypeStruct``; explicit knobs are
    checked and kept) on ``spec`` (default: :func:`kernels_pallas._gpu.target`).

    Defaults: the largest power-of-two block of at most ~128 tokens (64 when
    ``Dk > 256``; at least 16, no longer than the table needs) whose
    :func:`smem_bytes` with two pipeline stages fits the GPU's per-block
    shared memory, else one stage; ``block_h`` the whole padded group unless
    its float32 accumulator exceeds 8192 elements; 8 warps when a head dim
    exceeds 128; ``k_splits`` from :func:`_default_k_splits` with the SM
    count and the occupancy of this shape (see :class:`KernelShape`).

    Raises:
      KernelArgumentError: a knob out of range, or no block shape fits shared memory.
    """
    spec = spec or _gpu.target()
    lead = 0 if layer is None else 1
    b, h, dk = q.shape
    kvh, _, ps = k_pages.shape[lead:lead + 3]
    width = block_tables.shape[1]
    mla = v_pages is None
    dv = int(mla_value_dim) if mla else v_pages.shape[-1]
    g_pad = max(MIN_DOT, _dispatch.next_pow2(h // kvh))
    if not is_pow2(ps):
        raise KernelArgumentError(f"the Pallas kernel needs a power-of-two page size, got {ps}")
    if block_h is None:
        block_h = _default_block_h(g_pad, dv)
    elif not (is_pow2(int(block_h)) and int(block_h) >= MIN_DOT):
        raise KernelArgumentError(f"block_h must be a power of two >= {MIN_DOT}, got {block_h}")
    block_h = min(int(block_h), g_pad)
    num_warps = default_num_warps(q.dtype, dk, dv)
    ppcb, stages, smem = fit_block(
        "paged_attention", q_dtype=q.dtype, k_dtype=k_pages.dtype, v_dtype=None if mla else v_pages.dtype,
        dk=dk, dv=dv, page_size=ps, width=width, block_h=block_h, pages_per_compute_block=pages_per_compute_block,
        target_tokens=_target_block_tokens(dk, jnp.dtype(q.dtype) == jnp.float32), spec=spec)
    key = kernel_key(q_dtype=q.dtype, k_dtype=k_pages.dtype, v_dtype=None if mla else v_pages.dtype, dk=dk, dv=dv,
                     page_size=ps, block_tokens=ppcb * ps, block_h=block_h, num_stages=stages,
                     num_warps=num_warps, soft_cap=soft_cap)
    measured = measured_entry(spec, key)
    if measured:
        occ = _gpu.occupancy(spec, smem_bytes=measured["smem_bytes"], num_warps=num_warps,
                             registers=measured["registers"])
    else:
        occ = _gpu.occupancy(spec, smem_bytes=smem, num_warps=num_warps)
    occ = max(1, occ)
    base = b * kvh * (g_pad // block_h)
    blocks = max(1, _dispatch.ceil_div(width, ppcb))
    if k_splits is None:
        k_splits = _default_k_splits(base, blocks, spec.sm_count * occ)
    elif int(k_splits) < 1:
        raise KernelArgumentError(f"k_splits must be >= 1, got {k_splits}")
    return KernelShape(pages_per_compute_block=ppcb, block_tokens=ppcb * ps, block_h=block_h,
                       k_splits=int(k_splits), num_warps=num_warps, num_stages=stages, smem_bytes=smem,
                       occupancy=occ, programs=base * int(k_splits), key=key,
                       occupancy_from="measured" if measured else "estimate")


def halvings(start: int, smallest: int) -> list[int]:
    out = [start]
    while out[-1] // 2 >= smallest:
        out.append(out[-1] // 2)
    return out


# --------------------------------------------------------------------------
# The public entry point.
# --------------------------------------------------------------------------


def paged_attention(
    q: Float[Array, "B H Dk"],
    k_pages: Float[Array, "KVH P ps Dk"],
    v_pages: Float[Array, "KVH P ps Dv"] | None,
    block_tables: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    layer: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
    mla_value_dim: int | None = None,
    pages_per_compute_block: int | None = None,
    k_splits: int | None = None,
    block_h: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "B H Dv"]:
    """One decode step of attention over one layer of the paged KV pool.

    Arguments, masking rules, isolation guarantee, output and errors are
    those of :func:`kernels_pallas.reference.paged_decode_attention` (``layer``
    included: pass the whole stacked ``[L, KVH, P, ps, D]`` pool and a
    layer index, a Python int or a traced int32 scalar such as a
    ``lax.scan`` index, and the kernel reads that layer in place; slicing
    ``pool[layer]`` first would make XLA copy the layer before the call. A
    traced layer outside ``[0, L)`` gives zeros), plus:

    Args:
      pages_per_compute_block: pages per kernel loop step, a power of two with
        ``pages_per_compute_block * page_size >= 16``. Default: see :func:`plan`
        (~128 tokens, 64 when ``Dk > 256``, fewer if shared memory is short).
      k_splits: programs per (sequence, KV head, head block), each taking an
        equal share of the (padded) table; >= 1. Default: as many as fill
        the GPU's SMs at this shape's occupancy in one wave (:func:`plan`).
      block_h: query rows per program, a power of two >= 16; a KV head's
        group of ``H // KVH`` rows (padded to a power of two >= 16) is split
        into blocks of this many, each its own program (which reads the
        same K/V pages; the grid runs them side by side). Default: the
        whole group, unless its float32 accumulator (``block_h * Dv``)
        would exceed 8192 elements (MLA: 16 rows).
      implementation, interpret: see :mod:`kernels_pallas._dispatch`. The
        default runs the kernel on GPU and the reference elsewhere; on GPU a
        page size that is not a power of two, float8 pages before sm_89 and
        float8 pools of 2 to 4 GiB also run the reference (with a
        :class:`~kernels_pallas._dispatch.KernelFallbackWarning`).

    Works inside ``jax.jit`` and ``jax.lax.scan``; ``layer``,
    ``sliding_window``, ``sm_scale`` and ``logit_soft_cap`` may be traced
    scalars (they reach the kernel as data; only whether a soft cap is given
    and whether the layer is a Python int are static: a Python int compiles
    to the same kernel as before traced layers were accepted, a traced one
    to a kernel with one more scalar load).

    Raises:
      KernelArgumentError: as the reference (a Python int ``layer`` out of
        range, a ``layer`` that is not an integer scalar included), or
        kernel knobs out of range, or (on the Pallas path) a page size that
        is not a power of two, or inputs the target GPU cannot take
        (:class:`SharedMemoryExceeded` when no block fits its shared memory;
        the default dispatch runs the reference then, with a warning).
    """
    reference = functools.partial(
        paged_decode_attention, layer=layer, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap, mla_value_dim=mla_value_dim)
    args = (q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    pallas = _dispatch.choose("paged_attention", implementation, interpret, {"k_pages": k_pages, "v_pages": v_pages})
    lead = 0 if layer is None else 1
    ps = k_pages.shape[lead + 2] if k_pages.ndim == 4 + lead else 0
    if pallas and implementation is None and not interpret and not is_pow2(ps):
        pallas = False  # Triton needs power-of-two tiles; the reference does not
    if not pallas:
        return reference(*args)
    # The reference's argument checks, by tracing it (no compile, no run).
    jax.eval_shape(reference, *args)
    if layer is None:
        # A leading unit axis is a free reshape; one kernel handles both forms.
        k_pages, v_pages, k_scales, v_scales = (
            None if x is None else x[None] for x in (k_pages, v_pages, k_scales, v_scales))
        layer = 0
    static_layer, layer_index = split_layer(layer)
    knobs = dict(mla_value_dim=mla_value_dim, layer=0, pages_per_compute_block=pages_per_compute_block,
                 k_splits=k_splits, block_h=block_h, soft_cap=logit_soft_cap is not None)
    try:
        shape = plan(q, k_pages, v_pages, block_tables, **knobs)
    except SharedMemoryExceeded as e:
        if interpret:  # no shared memory in the interpreter: same shape rules, no limit
            shape = plan(q, k_pages, v_pages, block_tables, spec=_gpu.UNLIMITED, **knobs)
        elif implementation is None:
            warnings.warn(f"paged_attention runs its jnp reference: {e}", _dispatch.KernelFallbackWarning,
                          stacklevel=2)
            return reference(*args)
        else:
            raise
    sm, window, cap, use_cap = attention_scalars(q.shape[-1], sm_scale, sliding_window, logit_soft_cap)
    return _pallas_impl(
        q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sm, window, cap, layer_index,
        layer=static_layer, use_cap=use_cap, mla_value_dim=None if v_pages is not None else int(mla_value_dim),
        shape=shape, interpret=bool(interpret))
