"""Pallas GPU kernels of jaxkv, each with a pure-jnp reference beside it.

Gather kernels (DeepSeek-V4-style compressed caches: fp8 NoPE with block
scales + bf16 RoPE in, dense bf16 out, one launch):
:func:`gather_compressed_kv` (CSA top-k), :func:`gather_all_compressed_kv`
(HCA), :func:`gather_swa_kv` (sliding-window ring). Entry formats:
:data:`DSV4_FP8` (584 B, ue8m0 scale per 64) and :data:`DSV32_FP8` (656 B,
fp32 scale per 128), stored as :class:`CompressedEntries`.

Paged decode attention over the :class:`jaxkv.KVPool` layout:
:func:`paged_attention` (GQA, bf16/fp8 pages, sliding window, soft cap, MLA,
split-K). Ragged paged attention of a packed step (decode tokens and
prefill pieces of many sequences in one flat stream, causal):
:func:`ragged_paged_attention` (the same options plus attention sinks) and
its reference :func:`ragged_paged_attention_reference`.

Every entry point takes ``implementation=None | "pallas" | "reference"`` and
``interpret=False``: by default the Pallas kernel runs on GPU and the
reference elsewhere; ``interpret=True`` runs the kernel code on CPU.

This package is a leaf: it imports only JAX and numpy, never ``jaxkv``.
Its one error type is :class:`KernelArgumentError`; the pure-jnp decode
reference the kernels are checked against is :mod:`kernels_pallas.reference`.
"""

from kernels_pallas.formats import DSV4_FP8, DSV32_FP8, CompressedEntries, EntryFormat, ue8m0_to_float32
from kernels_pallas.gather import (
    gather_all_compressed_kv,
    gather_all_compressed_kv_reference,
    gather_compressed_kv,
    gather_compressed_kv_reference,
    gather_swa_kv,
    gather_swa_kv_reference,
)
from kernels_pallas._gpu import H100, building_for  # the H100 target, for compiling without a GPU
from kernels_pallas.errors import KernelArgumentError
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.ragged_attention import ragged_paged_attention, ragged_paged_attention_reference
from kernels_pallas.reference import dense_decode_attention, paged_decode_attention

__all__ = [
    "H100",
    "building_for",
    "DSV32_FP8",
    "DSV4_FP8",
    "CompressedEntries",
    "EntryFormat",
    "KernelArgumentError",
    "gather_all_compressed_kv",
    "gather_all_compressed_kv_reference",
    "gather_compressed_kv",
    "gather_compressed_kv_reference",
    "gather_swa_kv",
    "gather_swa_kv_reference",
    "dense_decode_attention",
    "paged_attention",
    "paged_decode_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ue8m0_to_float32",
]
