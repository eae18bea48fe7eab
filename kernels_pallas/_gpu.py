"""The GPU a kernel is built for: its limits, and the occupancy they allow.

Kernel defaults (block shapes, split counts) and the dispatch (which GPUs can
run the fp8 kernels) depend on the target GPU. :func:`target` answers "which
GPU": the one JAX runs on when there is one, the spec set by
:func:`building_for` while compiling ahead of time for a GPU that is not
here (``python -m kernels_pallas.aot_check``), and the H100 otherwise (the
lowering for a GPU without one assumes compute capability 9.0 too).

Numbers are NVIDIA's published limits (CUDA programming guide, table of
technical specifications per compute capability) and the SM counts of the
SXM parts.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

from kernels_pallas._util import ceil_div

__all__ = ["A100", "H100", "GpuSpec", "building_ahead", "building_for", "cuda_plugin_available", "occupancy", "target"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Limits of one GPU model that decide kernel shapes."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # opt-in maximum dynamic shared memory per block, bytes
    smem_per_sm: int  # shared memory per SM, bytes
    registers_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32

    @property
    def sm(self) -> int:
        """Compute capability as one number: 90 for 9.0."""
        return 10 * self.compute_capability[0] + self.compute_capability[1]

    @property
    def has_fp8(self) -> bool:
        """Whether Triton can convert from float8 on this GPU (sm_89+)."""
        return self.sm >= 89


H100 = GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), sm_count=132, smem_per_block=232448, smem_per_sm=233472)
A100 = GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108, smem_per_block=166912, smem_per_sm=167936)

# Pallas' interpreter: the GPU's shape rules without its memory limits.
UNLIMITED = GpuSpec("interpreter", (9, 0), sm_count=132, smem_per_block=2**40, smem_per_sm=2**40)

_KNOWN = {H100.compute_capability: H100, A100.compute_capability: A100}
_override: contextvars.ContextVar[GpuSpec | None] = contextvars.ContextVar("jaxkv_gpu_target", default=None)


def cuda_plugin_available() -> bool:
    """Whether a CUDA PJRT plugin is importable: ``jax[cuda12]``, or the CUDA
    13 plugin a GPU machine's image may carry instead (no import, so no
    side effect on JAX's backends)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


@contextlib.contextmanager
def building_for(spec: GpuSpec):
    """Within this block, kernels are shaped for ``spec`` (ahead-of-time
    compilation for a GPU that is not attached)."""
    token = _override.set(spec)
    try:
        yield spec
    finally:
        _override.reset(token)


def building_ahead() -> bool:
    """True inside :func:`building_for`."""
    return _override.get() is not None


def target() -> GpuSpec:
    """The GPU kernels are being built for (see the module docstring)."""
    spec = _override.get()
    if spec is not None:
        return spec
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return H100
    major, minor = (int(x) for x in str(getattr(device, "compute_capability", "9.0")).split("."))
    base = _KNOWN.get((major, minor), H100 if major >= 9 else A100)
    sm_count = int(getattr(device, "core_count", base.sm_count))
    return dataclasses.replace(base, name=device.device_kind, compute_capability=(major, minor),
                               sm_count=sm_count)


def occupancy(spec: GpuSpec, *, smem_bytes: int, num_warps: int, registers: int = 255) -> int:
    """Programs resident per SM: the least of the shared-memory, register and
    thread limits. ``registers`` per thread defaults to the maximum (255), so
    the result is a lower bound until ``ptxas`` has said the real count.

    Shared memory: the driver reserves 1 KiB per block. Registers: allocated
    per warp in units of 256.
    """
    by_smem = spec.smem_per_sm // (smem_bytes + 1024)
    per_warp = ceil_div(registers * 32, 256) * 256
    by_regs = (spec.registers_per_sm // per_warp) // num_warps
    by_threads = spec.max_threads_per_sm // (32 * num_warps)
    return max(0, min(by_smem, by_regs, by_threads, spec.max_blocks_per_sm))
