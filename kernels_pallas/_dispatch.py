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

What the GPU cannot run. Some inputs cannot take the compiled kernel on the
target GPU (:func:`kernels_pallas._gpu.target`): float8 pools on GPUs before
sm_89 (Triton cannot convert from float8 there), and 1-byte arrays of 2 to 4
GiB (Pallas' Triton lowering indexes arrays up to 4 GiB with 32-bit offsets,
which wrap past 2**31 elements). :func:`choose` sends those to the
reference when ``implementation`` is None, with a
:class:`KernelFallbackWarning` that says why, and raises
:class:`~kernels_pallas.errors.KernelArgumentError` when ``"pallas"`` was asked for.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from kernels_pallas.errors import KernelArgumentError
from kernels_pallas import _gpu
from kernels_pallas._util import ceil_div  # noqa: F401 - the kernels call it as _dispatch.ceil_div

IMPLEMENTATIONS = ("pallas", "reference")
#: The float8 storage dtypes (jaxkv keeps its own copy: this package imports nothing from it).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# Pallas' Triton lowering switches to 64-bit offsets only above 2**32 bytes.
_WRAP_LO, _WRAP_HI = 2**31, 2**32


class KernelFallbackWarning(UserWarning):
    """A GPU kernel call ran the reference instead, and why."""


def use_pallas(implementation: str | None, interpret: bool) -> bool:
    """True to run the Pallas kernel, False to run the reference (the
    implementation/interpret rules only; see :func:`choose`)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise KernelArgumentError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if interpret:
        if implementation == "reference":
            raise KernelArgumentError("interpret=True runs the Pallas kernel; it cannot be combined "
                                  "with implementation='reference'")
        return True
    if implementation is None:
        return _gpu.building_ahead() or jax.default_backend() == "gpu"
    return implementation == "pallas"


def gpu_obstacle(arrays: dict) -> str | None:
    """Why the compiled kernel cannot take these ``{name: array}`` on the
    target GPU, or None."""
    spec = _gpu.target()
    for name, x in arrays.items():
        if x is None:
            continue
        dtype = jnp.dtype(x.dtype)
        if dtype in FP8_DTYPES and not spec.has_fp8:
            return (f"{name} is {dtype.name}, and {spec.name} (sm_{spec.sm}) cannot convert from "
                    f"float8 in Triton: the fp8 kernels need sm_89 or newer")
        nbytes = math.prod(x.shape) * dtype.itemsize
        if dtype.itemsize == 1 and _WRAP_LO <= nbytes <= _WRAP_HI:
            return (f"{name} ({dtype.name}, shape {tuple(x.shape)}) holds {nbytes} bytes: Pallas' Triton "
                    f"lowering indexes arrays of at most 2**32 bytes with 32-bit offsets, which wrap past "
                    f"2**31 = {_WRAP_LO} elements of a 1-byte array; size this pool below 2 GiB or above 4 GiB")
    return None


def choose(kernel: str, implementation: str | None, interpret: bool, arrays: dict) -> bool:
    """True to run the Pallas kernel ``kernel`` on ``arrays`` ({name: array}),
    False to run its reference. Falls back to the reference (with a
    :class:`KernelFallbackWarning`) when the default would be the compiled
    kernel but :func:`gpu_obstacle` names a reason; raises
    :class:`KernelArgumentError` when ``implementation="pallas"`` was asked for."""
    pallas = use_pallas(implementation, interpret)
    if not pallas or interpret:
        return pallas
    reason = gpu_obstacle(arrays)
    if reason is None:
        return True
    if implementation == "pallas":
        raise KernelArgumentError(f"{kernel}: the Pallas kernel cannot run here: {reason}")
    warnings.warn(f"{kernel} runs its jnp reference: {reason}", KernelFallbackWarning, stacklevel=3)
    return False


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
