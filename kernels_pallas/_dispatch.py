"""How every public kernel entry point chooses between Pallas and its reference.

Each kernel in this package has one public function with two keyword
arguments, resolved here so all kernels behave the same:

``implementation``
    ``"pallas"``: run the Pallas kernel (Triton lowering on GPU).
    ``"reference"``: run the pure-``jnp`` reference beside it.
    ``None`` (default): ``"pallas"`` when JAX's default backend is a GPU,
    ``"reference"`` elsewhere (CPU, TPU): the Pallas kernels are written for
    GPUs and the references are the fast path on CPU.
``interpret``
    ``True`` runs the Pallas kernel through Pallas' interpreter instead of
    compiling it, so the kernel code itself runs on CPU (that is how the tests
    check it). Implies ``implementation="pallas"``; asking for it together with
    ``implementation="reference"`` is an error. In interpret mode the kernel's
    float outputs start filled with NaN (through ``input_output_aliases``), so
    an element the kernel forgets to write cannot pass a test by luck.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.errors import InvalidArgument

IMPLEMENTATIONS = ("pallas", "reference")


def use_pallas(implementation: str | None, interpret: bool) -> bool:
    """True to run the Pallas kernel, False to run the reference."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise InvalidArgument(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if interpret:
        if implementation == "reference":
            raise InvalidArgument("interpret=True runs the Pallas kernel; it cannot be combined "
                                  "with implementation='reference'")
        return True
    if implementation is None:
        return jax.default_backend() == "gpu"
    return implementation == "pallas"


def poisoned(shape, dtype):
    """The initial contents of a kernel output in interpret mode: NaN for
    floats, the dtype's minimum for integers, False for booleans."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.full(shape, jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.full(shape, jnp.iinfo(dtype).min, dtype)
    return jnp.zeros(shape, dtype)


def pow2_chunks(n: int, largest: int = 256) -> list[tuple[int, int]]:
    """Split ``[0, n)`` into static ``(start, size)`` pieces whose sizes are
    powers of two no larger than ``largest``, biggest first.

    Triton (Pallas' GPU lowering) only handles arrays whose dimensions are
    powers of two, while real head dims are not (448 NoPE values, 576 = 512 +
    64 MLA dims): kernels loop over these pieces statically instead.
    """
    chunks, start = [], 0
    while start < n:
        size = min(largest, 1 << ((n - start).bit_length() - 1))
        chunks.append((start, size))
        start += size
    return chunks


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
