"""Ragged paged attention: packed queries of many sequences over the paged pool.

One scheduler iteration of a packed engine (vLLM v1, SGLang, tpu-inference's
ragged paged attention) is a flat stream of ``T`` query tokens: the decode
token of each running sequence and the prefill pieces of others, end to end
with no padding between them. Sequence ``s`` owns the query tokens
``[cu_q_lens[s], cu_q_lens[s + 1])`` (``q_len = cu_q_lens[s + 1] -
cu_q_lens[s]``, possibly 0) and holds ``kv_lens[s]`` tokens in the pool
*including* those queries, whose K/V the caller wrote before the call. So
query ``i`` of sequence ``s`` sits at position ``kv_lens[s] - q_len + i`` and
attends, causally, every position ``p`` of its sequence with

    ``max(0, pos - sliding_window + 1) <= p <= pos``

read through ``block_tables[s]``: the tokens cached by earlier steps (a
prefix-cache hit, earlier prefill pieces, the decoded tokens) and its own
earlier queries of this step. Tokens ``>= cu_q_lens[S]`` (padding of the
flat stream) get zeros.

Options (those of :func:`kernels_pallas.paged_attention`, plus sinks): GQA
(query head ``h`` uses KV head ``h // (H // KVH)``), bf16/fp16/fp32/fp8 pages
with per-token-per-head scales, a sliding window, a logit soft cap
(``cap * tanh(l / cap)`` of the scaled logit), attention sinks (a learned
logit per query head that joins the softmax's denominator and adds nothing to
the numerator, gpt-oss style), and MLA mode (``v_pages`` None: the value is
the first ``mla_value_dim`` dims of the dequantized K row).

The reference (:func:`ragged_paged_attention_reference`) is pure ``jnp`` and
is the CPU path (the engine runs it every step there). It cuts each
sequence's queries into blocks of ``block_q`` tokens
(:func:`ragged_query_blocks`; at most ``(T + S * (block_q - 1)) // block_q``
blocks, a static bound, and at most ``T``) and runs a flash-style loop over
the context in chunks of ~128 tokens: each step gathers one chunk of every
block's pages (for all of the block's queries at once) and updates an online
softmax in float32. The loop's bounds are traced, from the first position
any query attends (the earliest window start) to the last, so the work is
``blocks x block_q x (attended context, in chunks)``: not the table width,
not ``T x context`` (a per-token gather) and never ``T x S x context``
(attending every sequence). ``block_q`` defaults to
:func:`reference_block_q` (one token per block for decode batches).

Numerics of the reference: ``q @ K.T`` runs in float32, except that bf16 or
fp8 pages with a bf16 ``q`` are multiplied in bf16 with float32 accumulation
(every bf16 x bf16 product is exact in float32, fp8 -> bf16 is exact, so
this is float32 math without a float32 copy of the pages); ``sm_scale`` and
the per-token K scales multiply the float32 logits; softmax, V (dequantized
to float32) and the weighted sum are float32.

Isolation, as in the decode reference: every logit of a position a query
does not attend is replaced with ``jnp.where`` before the max and the exp,
masked weights are exactly 0, and V (with its scale) is replaced by 0 outside
the union of the block's attended ranges before the weighted sum; so NaN or
garbage in the null page, unreferenced pages, the tail of a last page or
before a window cannot reach the output. The Pallas kernel
(:mod:`kernels_pallas.ragged_kernel`) computes the same on GPU.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from kernels_pallas import _dispatch
from kernels_pallas.paged_attention import is_pow2
from kernels_pallas.ragged_kernel import ragged_paged_attention_pallas
from kernels_pallas.ragged_reference import (clean_cu_q_lens, max_query_blocks, ragged_paged_attention_reference,
                                             ragged_query_blocks, reference_block_q)

__all__ = [
    "clean_cu_q_lens",
    "max_query_blocks",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_query_blocks",
    "reference_block_q",
]


def ragged_paged_attention(
    q: Float[Array, "T H Dk"],
    k_pages: Float[Array, "KVH P ps Dk"],
    v_pages: Float[Array, "KVH P ps Dv"] | None,
    block_tables: Int[Array, "S M"],
    kv_lens: Int[Array, " S"],
    cu_q_lens: Int[Array, " S1"],
    k_scales: Float[Array, "KVH P ps"] | None = None,
    v_scales: Float[Array, "KVH P ps"] | None = None,
    *,
    layer: int | Int[Array, ""] | None = None,
    sm_scale: float | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " H"] | None = None,
    mla_value_dim: int | None = None,
    block_q: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "T H Dv"]:
    """Causal attention of packed queries over the paged pool (module docstring).

    Args:
      q: ``[T, H, Dk]`` the packed queries (not pre-scaled), any float dtype.
      k_pages, v_pages: ``[KVH, P, ps, D]`` one layer's pages (or the stacked
        ``[L, ...]`` pool with ``layer``); ``v_pages`` None is MLA mode.
      block_tables: ``[S, M]`` int, sequence ``s``'s pages (entries past its
        pages may be -1 or anything: clamped for the gather, then masked).
      kv_lens: ``[S]`` int, tokens sequence ``s`` holds, this step's included
        (``q_len <= kv_lens[s] <= M * ps``).
      cu_q_lens: ``[S + 1]`` int, non-decreasing, ``cu_q_lens[0] = 0``,
        ``cu_q_lens[S] <= T``.
      k_scales, v_scales: ``[KVH, P, ps]`` float32 scales (fp8 pages).
      sm_scale: default ``1 / sqrt(Dk)``. sliding_window: ``W >= 1`` or None.
      logit_soft_cap: ``cap > 0`` or None. sinks: ``[H]`` float logits or None.
      mla_value_dim: the value width in MLA mode.
      layer: None, or the layer of the stacked pool (pages ``[L, KVH, P,
        ps, D]``, scales ``[L, KVH, P, ps]``) to attend, read in place (no
        copy of the layer): a Python int (outside ``[0, L)`` it raises) or
        an integer scalar array, e.g. traced (the loop index of a
        ``lax.scan`` over the layers), on both paths; a traced layer outside
        ``[0, L)`` attends nothing (zeros).
      block_q: query tokens per block (>= 1), the tiling of both the
        reference and the kernel; default: the average query length ``T /
        S`` rounded up to a power of two, at most 16 in the reference
        (:func:`reference_block_q`) and at most what fills one kernel
        program's 16-64 rows with the GQA group on the Pallas path
        (:func:`kernels_pallas.ragged_kernel.default_block_q`).
      implementation, interpret: see :mod:`kernels_pallas._dispatch`. The
        default runs the kernel on GPU and the reference elsewhere; on GPU
        a page size that is not a power of two, float8 pages before sm_89,
        float8 pools of 2 to 4 GiB and shapes no block fits in shared memory
        run the reference (with a
        :class:`~kernels_pallas._dispatch.KernelFallbackWarning` where it
        is not the page size).

    Returns ``[T, H, Dv]`` in ``q.dtype``; tokens past ``cu_q_lens[S]`` and
    queries with nothing to attend are zeros (a sink alone gives zeros too).

    For decode-only batches on GPU, :func:`kernels_pallas.paged_attention`
    (split-K) is faster on long contexts; this one takes decodes and prefill
    pieces in one launch (see :mod:`kernels_pallas.ragged_kernel`).

    Raises:
      KernelArgumentError: shapes or dtypes that cannot work (heads not a
        multiple of KV heads, head dims, ranks and lengths of the tables,
        lengths and ``cu_q_lens``, scales missing for fp8 or misshaped,
        sinks not float ``[H]``, MLA arguments inconsistent, ``block_q <
        1``, ``sliding_window < 1``, ``logit_soft_cap <= 0``, a Python int
        layer out of range, a layer that is not an integer scalar), and on
        the Pallas path a page size that is not a power of two or kernel
        knobs out of range.
    """
    pallas = _dispatch.choose("ragged_paged_attention", implementation, interpret,
                              {"k_pages": k_pages, "v_pages": v_pages})
    lead = 0 if layer is None else 1
    ps = k_pages.shape[lead + 2] if k_pages.ndim == 4 + lead else 0
    if pallas and implementation is None and not interpret and not is_pow2(ps):
        pallas = False  # Triton needs power-of-two tiles; the reference does not
    if pallas:
        return ragged_paged_attention_pallas(
            q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, layer=layer,
            sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, sinks=sinks,
            mla_value_dim=mla_value_dim, block_q=block_q, implementation=implementation, interpret=interpret)
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, layer=layer, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, sinks=sinks, mla_value_dim=mla_value_dim,
        block_q=block_q)
