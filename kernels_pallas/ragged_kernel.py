"""Ragged paged attention: the Pallas GPU (Triton) kernel.

:func:`ragged_paged_attention_pallas` computes what
:func:`kernels_pallas.ragged_attention.ragged_paged_attention_reference`
computes (same arguments, layout, masking rules and isolation guarantee; see
the module docstring of :mod:`kernels_pallas.ragged_attention`) in one kernel
launch. Call it through :func:`kernels_pallas.ragged_paged_attention`, whose
``implementation=`` / ``interpret=`` dispatch picks it (on a GPU by default).

Algorithm. The packed queries are cut into query blocks of ``block_q``
tokens of one sequence each (:func:`kernels_pallas.ragged_attention.ragged_query_blocks`,
computed in ``jnp`` before the launch; the count is static). A block and one
KV head make ``block_q * g`` query rows (token-major: row ``i`` is token
``i // g``, query head ``i % g`` of the KV head's GQA group of
``g = H // KVH``), padded to a power of two >= 16 (Triton's smallest dot) and
cut into row blocks of ``block_rows`` rows (one unless the float32
accumulator ``block_rows * Dv`` would pass 8192 elements, as with MLA's
512-wide values). The grid is one axis of ``row blocks x KV heads x query
blocks`` programs, row blocks fastest (the programs that read the same pages
run side by side), query blocks last to first (the heaviest block of a
sequence, its last, starts first). Each program gathers its rows of ``q``
in place from the flat ``[T * H, Dk]`` view (no copy of ``q``), and loops
with dynamic bounds over the compute blocks of ``pages_per_compute_block``
pages of its sequence's table that hold positions its rows attend, i.e. the
pages of ``[max(0, first_pos - W + 1), min(last_pos + 1, kv_len))`` for the
positions ``first_pos .. last_pos`` of its rows: pages before a sliding window
and past the block's last query cost nothing. Online softmax (running max,
sum and accumulator, float32) runs over the blocks; attention sinks join the
final denominator (``exp(sink - m)``), and each program normalises and stores
its rows straight into the ``[T, H, Dv]`` output (a masked scatter by row:
no split merge, no second pass). The padding tokens past ``cu_q_lens[S]``
are one more lane with nothing to attend, so their zeros are stored by the
kernel too and every output row is written exactly once (in interpret mode
the output starts NaN-poisoned, so a row left unwritten shows). XLA runs
3-7 tiny launches before the kernel (the query-block metadata).

Masking and isolation (as the decode kernel,
:mod:`kernels_pallas.paged_attention`). Row ``i`` at position ``pos``
attends key position ``t`` iff ``t <= pos``, ``pos - t < W`` and ``t <
kv_len``; every loaded K/V tile and scale is passed through
``jnp.where(valid, x, 0)`` (``valid``: the union of the program's rows'
ranges) before any arithmetic, masked logits are replaced before the max and
masked probabilities set to exactly 0 with ``jnp.where``, and query rows of
other blocks or padding are zeroed and never stored. So NaN/inf in the null
page 0, in unreferenced pages, in the tail of a last page, before a window
or in their scales cannot reach the output.

Numerics (flash convention, as the decode kernel): ``q @ K.T`` in
``q.dtype`` with float32 accumulation, scaled by ``sm_scale`` and the
per-token K scale in float32, soft cap on the scaled logits, ``p`` scaled by
the per-token V scale and cast to ``q.dtype`` for the PV dot. The reference
computes in float32 (exact bf16 products): bf16 results agree to bf16
precision, not bitwise.

When to use which. This kernel takes any mix of prefill pieces and decode
tokens in one launch, with each query block's K/V pages read once for all
its ``block_q`` tokens. For a batch of decode tokens only (one query per
sequence), :func:`kernels_pallas.paged_attention` is faster on long
contexts: it splits each sequence's pages over several programs (split-K)
to fill the GPU, while this kernel runs one program per (sequence, KV head,
row block), which leaves SMs idle when ``S * KVH`` is small and contexts are
long. A mixed step (decodes + a prefill piece) is one launch here instead of
a decode launch plus a padded prefill.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from kernels_pallas import _dispatch, _gpu
from kernels_pallas.errors import KernelArgumentError
from kernels_pallas.paged_attention import (
    ACC_BUDGET,
    MASK_VALUE,
    MIN_DOT,
    SharedMemoryExceeded,
    attend_block,
    default_num_warps,
    fit_block,
    is_pow2,
    measured_entry,
)
from kernels_pallas.paged_attention import kernel_key as _decode_kernel_key
from kernels_pallas.ragged_reference import (clean_cu_q_lens, max_query_blocks, ragged_paged_attention_reference,
                                             ragged_query_blocks)
from kernels_pallas.reference import attention_scalars, split_layer, traced_layer

__all__ = ["RaggedShape", "default_block_q", "kernel_key", "plan_ragged", "ragged_paged_attention_pallas"]

# Query rows of a program at most (tokens x GQA heads): 64 rows x 64 tokens
# of float32 logits stay in registers with 8 warps (measured by aot_check).
_MAX_ROWS = 64
# Metadata columns per query block (a power of two for Triton's block).
_META = 8


def _rows_target(dv: int) -> int:
    """Rows per program: 64 for Dv <= 128, fewer for wider values so the
    float32 accumulator stays within ``ACC_BUDGET`` elements."""
    return min(_MAX_ROWS, max(MIN_DOT, ACC_BUDGET // _dispatch.next_pow2(dv)))


def default_block_q(num_tokens: int, num_seqs: int, *, group: int, dv: int) -> int:
    """The kernel's default query tokens per block: as many as fill
    :func:`_rows_target` rows with the GQA group (``group = H // KVH``
    rows per token), but no more than the average query length
    ``ceil(T / S)`` rounded up to a power of two, so that a batch of decode
    tokens (``T == S``) gets blocks of one token and wastes no rows."""
    by_rows = max(1, _rows_target(dv) // _dispatch.next_pow2(group))
    average = _dispatch.next_pow2(_dispatch.ceil_div(max(1, num_tokens), max(1, num_seqs)))
    return max(1, min(by_rows, average))


@dataclasses.dataclass(frozen=True)
class RaggedShape:
    """How one ragged kernel call is cut into programs.

    ``block_q`` query tokens per query block (``num_query_blocks`` of them,
    a static bound), ``block_rows`` query rows per program (tokens x GQA
    heads, a power of two >= 16) and ``row_blocks`` programs per (query
    block, KV head); ``pages_per_compute_block`` pages (``block_tokens``
    tokens) per loop step; Triton's ``num_warps`` and ``num_stages``;
    ``smem_bytes`` the shared-memory bound of
    :func:`kernels_pallas.paged_attention.smem_bytes`; ``programs`` the grid;
    ``occupancy`` the programs per SM (measured: ``aot_check --record``'s
    entry for ``key`` in ``measured.json``, else a lower bound from
    ``smem_bytes`` and 255 registers); informative only, as the grid has no
    split to size.
    """

    block_q: int
    block_rows: int
    row_blocks: int
    num_query_blocks: int
    pages_per_compute_block: int
    block_tokens: int
    num_warps: int
    num_stages: int
    smem_bytes: int
    programs: int
    occupancy: int = 0
    key: str = ""  # the compiled kernel body, as recorded in measured.json
    occupancy_from: str = "estimate"  # or "measured" (aot_check's record of this key)


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static bound of the query blocks of ``T`` tokens over ``S`` sequences:
    ``sum ceil(q_len / block_q) <= (T + S * (block_q - 1)) // block_q``, and
    each block holds a token (see :func:`kernels_pallas.ragged_attention.ragged_query_blocks`)."""

    return max_query_blocks(num_tokens, num_seqs, block_q)


def kernel_key(*, group: int, sinks: bool, **decode_key) -> str:
    """Names one compiled ragged kernel body (``measured.json``): the decode
    kernel's key fields (:func:`kernels_pallas.paged_attention.kernel_key`,
    ``bh`` the rows per program) plus the GQA group and sinks."""
    return f"ragged g={group} sinks={int(bool(sinks))} " + _decode_kernel_key(**decode_key)


def plan_ragged(q, k_pages, v_pages, block_tables, kv_lens, *, mla_value_dim=None, layer=None, block_q=None,
                pages_per_compute_block=None, soft_cap=False, sinks=False,
                spec: _gpu.GpuSpec | None = None) -> RaggedShape:
    """The :class:`RaggedShape` :func:`ragged_paged_attention_pallas` uses
    for these arguments (arrays or ``jax.ShapeDtypeStruct``) on ``spec``
    (default :func:`kernels_pallas._gpu.target`).

    Defaults: ``block_q`` from :func:`default_block_q`; ``block_rows`` the
    padded ``block_q * g`` rows, at most 64 (fewer when ``Dv > 128``); a
    compute block of ~64 tokens when a program has 64 rows, else the decode
    kernel's ~128 (64 when ``Dk > 256``; float32: 1024 / rows), halved
    until two pipeline stages (else one) fit shared memory
    (:func:`kernels_pallas.paged_attention.fit_block`);
    8 warps when the rows x value width reach 8192 or the decode kernel
    would use 8.

    Raises:
      KernelArgumentError: a knob out of range, or a page size that is not
        a power of two; :class:`~kernels_pallas.paged_attention.SharedMemoryExceeded`
        when no block shape fits.
    """
    spec = spec or _gpu.target()
    lead = 0 if layer is None else 1
    t, h, dk = q.shape
    kvh, _, ps = k_pages.shape[lead:lead + 3]
    num_seqs, width = block_tables.shape
    mla = v_pages is None
    dv = int(mla_value_dim) if mla else v_pages.shape[-1]
    g = h // kvh
    if not is_pow2(ps):
        raise KernelArgumentError(f"the Pallas kernel needs a power-of-two page size, got {ps}")
    if block_q is None:
        block_q = default_block_q(t, num_seqs, group=g, dv=dv)
    elif int(block_q) < 1:
        raise KernelArgumentError(f"block_q must be >= 1, got {block_q}")
    block_q = int(block_q)
    rows_pad = max(MIN_DOT, _dispatch.next_pow2(block_q * g))
    block_rows = min(rows_pad, _rows_target(dv))
    # ~128 tokens per loop step for 16 rows (the decode kernel's), 64 at
    # Dk > 256 or 64 rows, and float32's FMA dots (which spill registers past
    # 16 rows x 64 tokens) rows x tokens <= 1024 (all measured by aot_check).
    if jnp.dtype(q.dtype) == jnp.float32:
        target_tokens = max(MIN_DOT, 1024 // block_rows)
    elif block_rows >= _MAX_ROWS or dk > 256:
        target_tokens = 64
    else:
        target_tokens = 128
    ppcb, stages, smem = fit_block(
        "ragged_paged_attention", q_dtype=q.dtype, k_dtype=k_pages.dtype, v_dtype=None if mla else v_pages.dtype,
        dk=dk, dv=dv, page_size=ps, width=width, block_h=block_rows, pages_per_compute_block=pages_per_compute_block,
        target_tokens=target_tokens, spec=spec)
    num_warps = default_num_warps(q.dtype, dk, dv)
    if block_rows * dv >= ACC_BUDGET:
        num_warps = 8
    nb = num_query_blocks(t, num_seqs + 1, block_q)  # + the lane of the padding tokens
    row_blocks = rows_pad // block_rows
    key = kernel_key(group=g, sinks=sinks, q_dtype=q.dtype, k_dtype=k_pages.dtype,
                     v_dtype=None if mla else v_pages.dtype, dk=dk, dv=dv, page_size=ps, block_tokens=ppcb * ps,
                     block_h=block_rows, num_stages=stages, num_warps=num_warps, soft_cap=soft_cap)
    measured = measured_entry(spec, key)
    if measured:
        occ = _gpu.occupancy(spec, smem_bytes=measured["smem_bytes"], num_warps=num_warps,
                             registers=measured["registers"])
    else:
        occ = _gpu.occupancy(spec, smem_bytes=smem, num_warps=num_warps)
    return RaggedShape(block_q=block_q, block_rows=block_rows, row_blocks=row_blocks, num_query_blocks=nb,
                       pages_per_compute_block=ppcb, block_tokens=ppcb * ps, num_warps=num_warps,
                       num_stages=stages, smem_bytes=smem, programs=nb * kvh * row_blocks, occupancy=max(1, occ),
                       key=key, occupancy_from="measured" if measured else "estimate")


# --------------------------------------------------------------------------
# The kernel.
# --------------------------------------------------------------------------


def _kernel(*refs, n_poisoned, page_size, ppcb, width, num_pages, group, heads, kv_heads, row_blocks, block_rows,
            k_chunks, v_chunks, mla, use_cap, use_sinks):
    # The first n_poisoned inputs are the NaN-filled outputs aliased in interpret mode.
    (meta_ref, params_ref, layer_ref, table_ref, q_ref, sinks_ref, k_ref, ks_ref, v_ref, vs_ref,
     o_ref) = refs[n_poisoned:]
    ps, f32, i32 = page_size, jnp.float32, jnp.int32
    block = ppcb * ps
    dtype = q_ref.dtype
    pid = pl.program_id(0)
    hb = lax.rem(pid, row_blocks)  # grid: ((query block reversed) * KVH + KV head) * row blocks + row block
    kh = lax.rem(lax.div(pid, row_blocks), kv_heads)
    seq, tok0, n_rows, pos0 = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    kv_end, window = meta_ref[4], meta_ref[5]
    sm_scale, cap = params_ref[0], params_ref[1]
    # A traced layer: the page refs keep the layer axis, indexed per load.
    layer = None if layer_ref is None else layer_ref[0]

    # This program's rows: token r = lr // g of the block, query head kh * g + lr % g.
    lr = hb * block_rows + lax.broadcasted_iota(i32, (block_rows,), 0)
    r = lax.div(lr, group)
    gi = lr - r * group
    row_ok = r < n_rows
    qpos = pos0 + r
    flat = (tok0 + r) * heads + kh * group + gi  # row of the [T * H, D] views
    num_flat = q_ref.shape[0]
    q_row = jnp.clip(flat, 0, num_flat - 1)
    # Rows of other blocks or padding: zeroed (they are never stored either).
    q_tiles = []
    for c0, n in k_chunks:
        x = q_ref[q_row, pl.ds(c0, n)]
        q_tiles.append(jnp.where(row_ok[:, None], x, jnp.zeros_like(x)))

    # Positions this program's rows attend: [lo, hi). Rows r_lo .. r_hi are
    # real; pos0 >= -block_q and pos0 <= 2**30 (clamped outside), so nothing
    # here overflows; the window is subtracted only where it leaves >= 0.
    r_lo = lax.div(hb * block_rows, group)
    r_hi = jnp.minimum(lax.div(hb * block_rows + block_rows - 1, group), n_rows - 1)
    top = pos0 + r_lo + 1
    lo = jnp.where(top > window, top - window, 0)
    hi = jnp.minimum(pos0 + r_hi + 1, kv_end)
    first_block = lax.div(lax.div(lo, ps), ppcb)
    end_block = lax.div(lax.div(jnp.maximum(hi, 0) + ps - 1, ps) + ppcb - 1, ppcb)
    n_blocks = jnp.where((r_hi >= r_lo) & (hi > lo), jnp.maximum(end_block - first_block, 0), 0)

    def body(i, carry):
        p0 = (first_block + i) * ppcb
        # Table entries past the width (a block's tail) and outside [0, P)
        # are clamped: their positions are masked, the loads stay in bounds.
        col = jnp.minimum(p0 + lax.broadcasted_iota(i32, (ppcb,), 0), max(width, 1) - 1)
        page_ids = jnp.clip(table_ref[seq, col], 0, num_pages - 1)
        pos = p0 * ps + lax.broadcasted_iota(i32, (block,), 0)
        valid = (pos >= lo) & (pos < hi)  # the union of the rows' ranges
        # Per row: causal and window. pos <= qpos first, so qpos - pos >= 0 cannot wrap.
        allowed = (row_ok[:, None] & valid[None, :] & (pos[None, :] <= qpos[:, None])
                   & (qpos[:, None] - pos[None, :] < window))

        return attend_block(carry, q_tiles, page_ids, valid, allowed, k_ref, v_ref, ks_ref, vs_ref,
                            k_chunks=k_chunks, v_chunks=v_chunks, block=block, dtype=dtype, sm_scale=sm_scale, cap=cap,
                            use_cap=use_cap, mla=mla, layer=layer)

    init = (jnp.full((block_rows,), MASK_VALUE, f32), jnp.zeros((block_rows,), f32),
            tuple(jnp.zeros((block_rows, n), f32) for _, n in v_chunks))
    m_run, l_run, accs = lax.fori_loop(0, n_blocks, body, init)

    if use_sinks:
        # The sink joins the denominator only: l + exp(sink - m), rescaled
        # to the larger of the running max and the sink.
        sink = sinks_ref[kh * group + gi]
        m_fin = jnp.maximum(m_run, sink)
        alpha = jnp.exp(m_run - m_fin)
        l_fin = l_run * alpha + jnp.exp(sink - m_fin)
    else:
        alpha, l_fin = None, l_run
    scale = 1.0 / jnp.where(l_fin > 0, l_fin, 1.0)  # nothing attended, no sink: 0 / 1
    if alpha is not None:
        scale = scale * alpha
    # Store by row into [T * H, Dv] (+ the interpreter's spare row); rows
    # that are not this block's are masked (and sent to the last row).
    o_row = jnp.where(row_ok, flat, o_ref.shape[0] - 1)
    for (c0, n), acc in zip(v_chunks, accs):
        cols = c0 + lax.broadcasted_iota(i32, (1, n), 1)
        plgpu.store(o_ref.at[o_row[:, None], cols], (acc * scale[:, None]).astype(o_ref.dtype),
                    mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("layer", "use_cap", "use_sinks", "mla_value_dim", "shape",
                                             "interpret"))
def _pallas_impl(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks, sm_scale,
                 window, cap, layer_index, *, layer, use_cap, use_sinks, mla_value_dim, shape, interpret):
    """The launch. Pages and scales carry a leading layer axis, so nothing is
    copied: the block specs pick the program's KV head and a static
    ``layer`` (``layer_index`` None); a traced one (``layer`` None,
    ``layer_index`` an int32 scalar) reaches the kernel as a 1-element input,
    the block specs keep the whole layer axis and every page and scale load
    indexes it. A traced layer outside ``[0, L)`` attends nothing (zero
    ``kv_lens``: zeros out, no page loaded) and is clamped."""

    t, h, dk = q.shape
    num_layers, kvh, num_pages, ps, _ = k_pages.shape
    num_seqs, width = block_tables.shape
    mla = v_pages is None
    dv = mla_value_dim if mla else v_pages.shape[-1]
    g = h // kvh
    bq, ppcb, rb = shape.block_q, shape.pages_per_compute_block, shape.row_blocks
    nb = shape.num_query_blocks
    i32, f32 = jnp.int32, jnp.float32
    layer_arg = None
    if layer is None:
        layer_index, kv_lens = traced_layer(layer_index, num_layers, kv_lens)
        layer_arg = layer_index.reshape(1)

    # Query blocks (jnp, before the launch): sequence, first token, real
    # rows, first position; the window rides along as data. The padding
    # tokens past cu[S] are one more lane (S) with nothing to attend, so
    # the kernel writes their zeros too and every output row is stored.
    cu = clean_cu_q_lens(cu_q_lens, t)
    cu_all = jnp.concatenate([cu, jnp.full((1,), t, i32)])
    kv_all = jnp.concatenate([jnp.clip(kv_lens.astype(i32), 0, 2**30), jnp.zeros((1,), i32)])
    seq, first = ragged_query_blocks(cu_all, kv_all, t, bq, num_blocks=nb)[:2]
    s = jnp.minimum(seq, num_seqs)
    q_len = cu_all[s + 1] - cu_all[s]
    n_rows = jnp.where(seq <= num_seqs, jnp.clip(q_len - first, 0, bq), 0)
    tok0 = jnp.clip(cu_all[s] + first, 0, t)
    kv_len = kv_all[s]
    # Rows below position 0 attend nothing; clamping pos0 at -block_q keeps
    # them below 0 and every difference in the kernel inside int32.
    pos0 = jnp.clip(kv_len - q_len + first, -bq, 2**30)
    kv_end = jnp.clip(kv_len, 0, width * ps)
    meta = jnp.stack([jnp.minimum(s, num_seqs - 1), tok0, n_rows, pos0, kv_end, jnp.broadcast_to(window, s.shape)]
                     + [jnp.zeros_like(s)] * (_META - 6), axis=1).astype(i32)
    params = jnp.stack([sm_scale, cap]).astype(f32)
    table = block_tables.astype(i32)  # clamped in the kernel, as it loads it
    q_flat = q.reshape(t * h, dk)  # free: the kernel gathers its rows in place
    sinks_f = (jnp.zeros((h,), f32) if sinks is None else sinks.astype(f32))

    if mla:
        k_chunks = _dispatch.pow2_chunks(dv) + [(dv + c, n) for c, n in _dispatch.pow2_chunks(dk - dv)]
    else:
        k_chunks = _dispatch.pow2_chunks(dk)
    v_chunks = _dispatch.pow2_chunks(dv)

    def full(x):
        return pl.BlockSpec(x.shape, lambda pid: (0,) * x.ndim)

    def per_head(x):  # [L, KVH, P, ...] -> this program's layer (static) or all layers, and KV head
        if x is None:
            return None
        if layer is None:  # traced: the kernel indexes the layer axis with layer_arg
            return pl.BlockSpec((x.shape[0], None, *x.shape[2:]),
                                lambda pid: (0, lax.rem(lax.div(pid, rb), kvh)) + (0,) * (x.ndim - 2))
        return pl.BlockSpec((None, None, *x.shape[2:]),
                            lambda pid: (layer, lax.rem(lax.div(pid, rb), kvh)) + (0,) * (x.ndim - 2))

    # Interpret mode: a spare last row for the rows a program does not own
    # (its masked store writes the old values back, and a clamped index
    # could hit one of its own rows). The GPU's masked stores write nothing.
    out_shape = jax.ShapeDtypeStruct((t * h + int(interpret), dv), q.dtype)
    out_specs = pl.BlockSpec(out_shape.shape, lambda pid: (0, 0))
    in_specs = [
        pl.BlockSpec((None, _META), lambda pid: (nb - 1 - lax.div(pid, rb * kvh), 0)),  # this block's metadata
        full(params), None if layer_arg is None else full(layer_arg), full(table), full(q_flat), full(sinks_f),
        per_head(k_pages), per_head(k_scales), per_head(v_pages), per_head(v_scales),
    ]
    args = [meta, params, layer_arg, table, q_flat, sinks_f, k_pages, k_scales, v_pages, v_scales]
    poisoned, aliases = [], {}
    if interpret:
        # The output starts as NaN so a row the kernel forgets to write shows up.
        poisoned = [_dispatch.poisoned(out_shape.shape, out_shape.dtype)]
        aliases = {0: 0}
        in_specs = [out_specs] + in_specs
    kernel = functools.partial(
        _kernel, n_poisoned=len(poisoned), page_size=ps, ppcb=ppcb, width=width, num_pages=num_pages, group=g,
        heads=h, kv_heads=kvh, row_blocks=rb, block_rows=shape.block_rows, k_chunks=tuple(k_chunks),
        v_chunks=tuple(v_chunks), mla=mla, use_cap=use_cap, use_sinks=use_sinks)
    out = pl.pallas_call(
        kernel,
        grid=(nb * kvh * rb,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=shape.num_warps, num_stages=shape.num_stages),
        name=f"jaxkv_ragged_paged_attention_bq{bq}_rows{shape.block_rows}_ppcb{ppcb}",
    )(*poisoned, *args)
    return out[:t * h].reshape(t, h, dv)


# --------------------------------------------------------------------------
# The entry point (called by kernels_pallas.ragged_attention.ragged_paged_attention).
# --------------------------------------------------------------------------


def ragged_paged_attention_pallas(
    q: Float[Array, "T H Dk"],
    k_pages: Float[Array, "KVH P ps Dk"],
    v_pages: Float[Array, "KVH P ps Dv"] | None,
    block_tables: Int[Array, "S M"],
    kv_lens: Int[Array, " S"],
    cu_q_lens: Int[Array, " S1"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    layer: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " H"] | None = None,
    mla_value_dim: int | None = None,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    implementation: str | None = "pallas",
    interpret: bool = False,
) -> Float[Array, "T H Dv"]:
    """The Pallas kernel of :func:`kernels_pallas.ragged_paged_attention`
    (module docstring; arguments, output and errors as
    :func:`~kernels_pallas.ragged_attention.ragged_paged_attention_reference`).

    Args (beyond the reference's):
      block_q: query tokens per block, >= 1; default :func:`default_block_q`.
      pages_per_compute_block: pages per loop step, a power of two with
        ``pages_per_compute_block * page_size >= 16``; default from
        :func:`plan_ragged`.
      implementation: ``None`` when the caller left the choice to the
        default dispatch: then inputs no block shape fits in shared memory
        run the reference (with a
        :class:`~kernels_pallas._dispatch.KernelFallbackWarning`) instead of
        raising.
      interpret: run through Pallas' interpreter (CPU); the output starts
        NaN-poisoned there.

    ``layer``, ``sliding_window``, ``sm_scale`` and ``logit_soft_cap`` may
    be traced (they reach the kernel as data; whether a cap or sinks are
    given, and whether the layer is a Python int, is static). A Python int
    layer is picked by the block specs; a traced one (e.g. a ``lax.scan``
    index) is loaded by the kernel and indexes the pages' layer axis, still
    in place; out of range it attends nothing (zeros).

    Raises:
      KernelArgumentError: as the reference (a Python int ``layer`` out of
        range, a ``layer`` that is not an integer scalar included), a page
        size that is not a power of two, knobs out of range, or
        :class:`~kernels_pallas.paged_attention.SharedMemoryExceeded`.
    """

    reference = functools.partial(
        ragged_paged_attention_reference, layer=layer, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap, sinks=sinks, mla_value_dim=mla_value_dim)
    args = (q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales)
    # The reference's argument checks, by tracing it (no compile, no run).
    jax.eval_shape(functools.partial(reference, block_q=block_q), *args)
    if layer is None:
        # A leading unit axis is a free reshape; one kernel handles both forms.
        k_pages, v_pages, k_scales, v_scales = (
            None if x is None else x[None] for x in (k_pages, v_pages, k_scales, v_scales))
        layer = 0
    static_layer, layer_index = split_layer(layer)
    sm, window, cap, use_cap = attention_scalars(q.shape[-1], sm_scale, sliding_window, logit_soft_cap)
    dv = int(mla_value_dim) if v_pages is None else v_pages.shape[-1]
    if q.shape[0] == 0:
        return jnp.zeros((0, q.shape[1], dv), q.dtype)
    knobs = dict(mla_value_dim=mla_value_dim, layer=0, block_q=block_q,
                 pages_per_compute_block=pages_per_compute_block, soft_cap=use_cap, sinks=sinks is not None)
    try:
        shape = plan_ragged(q, k_pages, v_pages, block_tables, kv_lens, **knobs)
    except SharedMemoryExceeded as e:
        if interpret:  # no shared memory in the interpreter: same shape rules, no limit
            shape = plan_ragged(q, k_pages, v_pages, block_tables, kv_lens, spec=_gpu.UNLIMITED, **knobs)
        elif implementation is None:
            warnings.warn(f"ragged_paged_attention runs its jnp reference: {e}", _dispatch.KernelFallbackWarning,
                          stacklevel=3)
            return reference(*args, block_q=block_q)
        else:
            raise
    return _pallas_impl(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, sinks, sm, window, cap, layer_index,
        layer=static_layer, use_cap=use_cap, use_sinks=sinks is not None,
        mla_value_dim=None if v_pages is not None else int(mla_value_dim), shape=shape, interpret=bool(interpret))
