"""Building blocks in transformers' parameter layout, shared by the MoE models.

Every weight is stored exactly as the checkpoint stores it (``Linear.weight``
``[out, in]``, fused experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E,
D, I]``), so loading a checkpoint is a name-for-name copy
(:func:`load_state`). Norms and routing run in float32.

* :class:`Linear`, :class:`RMSNorm`, :class:`ZeroCenteredRMSNorm`, :func:`unit_rms`;
* :class:`SwiGLU` (``down(silu(gate(x)) * up(x))``, optionally with
  DeepSeek-V4's clamped pre-activations) and :class:`Experts` (the routed
  experts as grouped matmuls, ``lax.ragged_dot``);
* :func:`fuse_experts`: per-expert checkpoint tensors
  (``experts.{e}.gate_proj.weight``, ...) into the fused tensors, as
  transformers' loader does;
* :func:`load_state`: fill an abstract model from named arrays, with errors
  that name the tensor.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxkv.errors import InvalidArgument
from jaxkv.nn.scan import layer_paths

__all__ = ["Experts", "Linear", "RMSNorm", "SwiGLU", "ZeroCenteredRMSNorm", "fuse_experts", "load_state", "named_state", "param",
           "read_checkpoint", "save_checkpoint", "unit_rms"]

_F32 = jnp.float32


def param(shape, rngs: nnx.Rngs | None, dtype, std=None, fill=0.0) -> nnx.Param:
    """A parameter: normal(0, ``std``) from ``rngs``, or filled with ``fill``."""
    if std is None:
        return nnx.Param(jnp.full(shape, fill, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, _F32) * std).astype(dtype))


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight`` ``[out, in]`` (transformers' layout)."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, param_dtype=_F32, precision=None,
                 bias: bool = False):
        self.weight = param((out_features, in_features), rngs, param_dtype, std=in_features ** -0.5)
        self.bias = param((out_features,), rngs, param_dtype, fill=0.0) if bias else None
        self.precision = precision

    def __call__(self, x):
        y = jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype), precision=self.precision)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def unit_rms(x, eps):
    """``x / rms(x)`` over the last axis (transformers' unweighted RMSNorm)."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(_F32)), axis=-1, keepdims=True) + eps).astype(x.dtype)


class RMSNorm(nnx.Module):
    """``weight * x / rms(x)`` in float32, cast back to ``x.dtype``."""

    def __init__(self, dim: int, eps: float, *, param_dtype=_F32):
        self.weight = param((dim,), None, param_dtype, fill=1.0)
        self.eps = eps

    def __call__(self, x):
        return (self.weight[...].astype(_F32) * unit_rms(x.astype(_F32), self.eps)).astype(x.dtype)


class ZeroCenteredRMSNorm(nnx.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back to ``x.dtype``
    (weight initialized to 0): Qwen3-Next's and Gemma's norms."""

    def __init__(self, dim: int, eps: float, *, param_dtype=_F32):
        self.weight = param((dim,), None, param_dtype, fill=0.0)
        self.eps = eps

    def __call__(self, x):
        return (unit_rms(x.astype(_F32), self.eps) * (1.0 + self.weight[...].astype(_F32))).astype(x.dtype)


def _swiglu(gate, up, limit):
    if limit is not None:  # DeepSeek-V4 clamps the pre-activations
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` (``limit``: clamp gate above and up
    both ways first)."""

    def __init__(self, hidden: int, intermediate: int, *, rngs, param_dtype=_F32, precision=None,
                 limit: float | None = None):
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.gate_proj, self.up_proj, self.down_proj = lin(hidden, intermediate), lin(hidden, intermediate), \
            lin(intermediate, hidden)
        self.limit = limit

    def __call__(self, x):
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nnx.Module):
    """Routed SwiGLU experts as fused tensors: ``gate_up_proj [E, 2I, D]``
    (gate rows first), ``down_proj [E, D, I]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, rngs, param_dtype=_F32, precision=None,
                 limit: float | None = None):
        self.gate_up_proj = param((num_experts, 2 * intermediate, hidden), rngs, param_dtype, std=hidden ** -0.5)
        self.down_proj = param((num_experts, hidden, intermediate), rngs, param_dtype, std=intermediate ** -0.5)
        self.limit = limit
        self.precision = precision

    def __call__(self, x, experts, weights):
        """``sum_k weights[:, k] * expert[experts[:, k]](x)`` (``x [N, D]``,
        ``experts``/``weights`` ``[N, k]``) as grouped matmuls: the token
        copies sorted by expert, one ``ragged_dot`` per projection."""
        k = experts.shape[1]
        num_experts = self.gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        gate_up = jax.lax.ragged_dot(x[token], jnp.swapaxes(self.gate_up_proj[...], 1, 2).astype(x.dtype), sizes,
                                     precision=self.precision)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        out = jax.lax.ragged_dot(_swiglu(gate, up, self.limit), jnp.swapaxes(self.down_proj[...], 1, 2).astype(x.dtype),
                                 sizes, precision=self.precision)
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        return jnp.zeros_like(x).at[token].add(out)


def fuse_experts(tensors: dict[str, np.ndarray], num_experts: int, names=("gate_proj", "up_proj", "down_proj"),
                 source: str = "state dict", origin: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Per-expert tensors ``<prefix>.experts.{e}.{gate,up,down}.weight`` (the
    three ``names``) fused into ``<prefix>.experts.gate_up_proj [E, 2I, D]``
    (gate rows, then up rows) and ``<prefix>.experts.down_proj [E, D, I]``;
    other tensors pass through. ``origin`` maps a name of ``tensors`` to the
    checkpoint's own name where a loader renamed it (for the messages).

    Raises ``InvalidArgument`` naming an incomplete expert set, or one
    expert's tensor whose shape differs from the other experts' (naming
    the tensor, its shape and theirs), or gate and up tensors of different
    shapes: numpy's stacking would raise a bare ``ValueError``. Whether the
    common shape is the one the model needs is :func:`load_state`'s check."""
    origin = origin or {}
    gate, up, down = names
    pattern = re.compile(rf"^(.*\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for name, arr in tensors.items():
        match = pattern.match(name)
        if match:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = arr
        else:
            out[name] = arr
    for prefix, parts in experts.items():
        def label(e: int, part: str) -> str:
            name = f"{prefix}.{e}.{part}.weight"
            return repr(origin.get(name, name))

        common = {}
        for part in names:
            got = sorted(parts.get(part, {}))
            if got != list(range(num_experts)):
                missing = sorted(set(range(num_experts)) - set(got))
                raise InvalidArgument(f"checkpoint ({source}) has an incomplete expert set under {prefix!r}: "
                                      f"{part} missing for experts {missing[:8]} of {num_experts}")
            # The shape most experts have (ties: the lowest expert's) is the
            # reference: one misshapen expert is named, not the other E - 1.
            shapes = collections.Counter(tuple(np.shape(parts[part][e])) for e in range(num_experts))
            common[part], count = shapes.most_common(1)[0]
            for e in range(num_experts):
                shape = tuple(np.shape(parts[part][e]))
                if shape != common[part]:
                    raise InvalidArgument(
                        f"checkpoint tensor {label(e, part)} has shape {shape}, expected {common[part]} (the shape "
                        f"of {count} of the {num_experts} experts' {part}) ({source})")
        if common[gate] != common[up]:
            raise InvalidArgument(
                f"checkpoint tensors {label(0, gate)} and {label(0, up)} (and every expert's) have shapes "
                f"{common[gate]} and {common[up]}: an expert's {gate} and {up} must have the same shape ({source})")
        out[prefix + ".gate_up_proj"] = np.stack([np.concatenate([parts[gate][e], parts[up][e]], axis=0)
                                                  for e in range(num_experts)])
        out[prefix + ".down_proj"] = np.stack([parts[down][e] for e in range(num_experts)])
    return out


_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def load_state(abstract: nnx.Module, tensors: dict[str, np.ndarray], name_of, *, family: str,
               source: str = "state dict", ignored=lambda name: False, check=None,
               origin: dict[str, str] | None = None) -> nnx.Module:
    """``abstract`` (from ``nnx.eval_shape``) with every variable taken from
    ``tensors[name_of(path)]`` (``path``: the dotted module path), cast to
    the variable's dtype. ``check(name, array)`` may refuse a value. Raises
    ``InvalidArgument`` naming a missing or misshapen tensor (its shape and
    the model's), or tensors nothing uses (other than those ``ignored``
    says). ``origin`` maps a name of ``tensors`` to the checkpoint's name
    where a loader renamed it, so messages name what is in the file."""
    origin = origin or {}

    def label(name: str) -> str:
        if name in origin and origin[name] != name:
            return f"{origin[name]!r} (the model's {name!r})"
        fused = _FUSED.match(name)
        if fused and name not in origin:
            return f"{name!r} (fused from the checkpoint's per-expert tensors {fused[1]}.<e>.*.weight)"
        return repr(name)

    graphdef, state = nnx.split(abstract)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    per_layer = layer_paths(abstract)
    loaded, used = {}, set()

    def tensor(path, shape):
        name = name_of(".".join(str(p) for p in path))
        if name not in tensors:
            raise InvalidArgument(f"checkpoint ({source}) is missing tensor {label(name)} (shape {tuple(shape)})")
        arr = np.asarray(tensors[name])
        if tuple(arr.shape) != tuple(shape):
            raise InvalidArgument(f"checkpoint tensor {label(name)} has shape {tuple(arr.shape)}, expected "
                                  f"{tuple(shape)} ({source})")
        if check is not None:
            check(name, arr)
        used.add(name)
        return arr.astype(np.float32) if arr.dtype.kind == "f" else arr

    for path, spec in flat.items():
        paths = per_layer(path)
        if isinstance(paths, list):  # stacked layers (jaxkv.nn.scan): one checkpoint tensor per row
            arr = np.stack([tensor(one, spec.shape[1:]) for one in paths])
        else:
            arr = tensor(paths, spec.shape)
        loaded[path] = jnp.asarray(arr, dtype=spec.dtype)
    extra = sorted(origin.get(n, n) for n in tensors if n not in used and not ignored(n))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise InvalidArgument(f"checkpoint ({source}) has tensors this {family} config does not use: "
                              f"{', '.join(map(repr, extra[:5]))}{more}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(loaded))
    return nnx.merge(graphdef, state)


def named_state(model: nnx.Module, name_of=lambda path: path) -> dict[str, np.ndarray]:
    """Every variable of ``model`` as numpy, under ``name_of(dotted path)``
    (the path with its layers unrolled: a stacked variable gives one entry
    per layer, :mod:`jaxkv.nn.scan`)."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))
    per_layer = layer_paths(model)
    out = {}
    for path, value in flat.items():
        value, paths = np.asarray(jax.device_get(value)), per_layer(path)
        for one, row in zip(paths, value) if isinstance(paths, list) else [(paths, value)]:
            out[name_of(".".join(str(p) for p in one))] = row
    return out


def save_checkpoint(path, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """``config.json`` + ``model.safetensors`` (integer tensors as int64, as
    torch writes them) in directory ``path``."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    tensors = {k: (v.astype(np.int64) if v.dtype.kind == "i" else v) for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def read_checkpoint(path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config dict, tensors)`` of a checkpoint directory, FP8
    block-quantized weights dequantized (:mod:`jaxkv.nn.checkpoint`)."""
    from jaxkv.nn.checkpoint import dequantize_checkpoint, load_tensors, read_config

    raw = read_config(path)
    return raw, dequantize_checkpoint(load_tensors(path), raw.get("quantization_config"))
