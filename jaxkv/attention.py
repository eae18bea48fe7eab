"""Decode attention over the paged KV pool (the pure-``jnp`` reference).

The implementation lives beside the kernels it specifies, in
:mod:`kernels_pallas.reference`; this module keeps the old import path.
"""

from kernels_pallas.reference import dense_decode_attention, gather_pages, paged_decode_attention

__all__ = ["dense_decode_attention", "gather_pages", "paged_decode_attention"]
