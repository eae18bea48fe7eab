"""Read what a Pallas GPU kernel was lowered to, without a GPU.

``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` lowers every
``pallas_call`` to a ``__gpu$xla.gpu.triton`` custom call whose
``mhlo.backend_config`` holds the Triton module (MLIR bytecode) and the
launch grid. :func:`triton_calls` returns them as text, so tests can check
properties of the kernels themselves on any machine: the dot precision, the
order of loads and stores, which operands a kernel reads.
"""

from __future__ import annotations

import dataclasses

from jax._src.lib import triton as _triton
from jax._src.lib.mlir import ir

__all__ = ["TritonCall", "triton_calls"]

_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One lowered ``pallas_call``: its Triton module as text, its launch
    grid (CUDA x, y, z) and the textual names of its operands in the
    enclosing StableHLO function (``%arg3`` for a function argument)."""

    name: str
    ttir: str
    grid: tuple[int, int, int]
    operands: tuple[str, ...]


def _walk(op, found):
    op = op.operation if hasattr(op, "operation") else op
    if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == _TARGET:
        found.append(op)
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                _walk(child, found)


def triton_calls(lowered) -> list[TritonCall]:
    """The Triton kernels of a ``jax.stages.Lowered`` (lowered for "cuda")."""
    found: list = []
    _walk(lowered.compiler_ir("stablehlo").operation, found)
    calls = []
    for op in found:
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        context = ir.Context()
        _triton.dialect.register_dialect(context)
        with context:
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
        grid = tuple(ir.IntegerAttr(config[f"grid_{axis}"]).value for axis in "xyz")
        name = str(module.operation.attributes["sym_name"]).strip('"')
        operands = tuple(v.get_name() for v in op.operands)
        calls.append(TritonCall(name=name, ttir=str(module), grid=grid, operands=operands))
    return calls
