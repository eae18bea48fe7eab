"""The one error type of the kernels package.

``kernels_pallas`` is a leaf: it imports nothing from ``jaxkv``. jaxkv's
:class:`jaxkv.errors.InvalidArgument` subclasses :class:`KernelArgumentError`,
so ``except KernelArgumentError`` (or ``except ValueError``) catches a bad
argument from a kernel and from jaxkv alike.
"""

from __future__ import annotations

__all__ = ["KernelArgumentError"]


class KernelArgumentError(ValueError):
    """A kernel argument that can never run: a shape, dtype, format or option
    the kernel does not support. The message names the argument and what was
    expected."""
