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
import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P

from jaxkv.errors import InvalidArgument
from jaxkv.nn.scan import layer_paths

__all__ = ["ExpertPlacement", "Experts", "HeadPlacement", "Linear", "RMSNorm", "SwiGLU", "ZeroCenteredRMSNorm",
           "fuse_experts", "in_row_chunks", "load_state", "named_state", "on_local_experts", "param", "read_checkpoint",
           "rows_per_chunk", "save_checkpoint", "unit_rms"]

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
    (gate rows first), ``down_proj [E, D, I]``.

    ``placement``: ``None`` (one device, or experts not split), or the
    :class:`ExpertPlacement` :func:`jaxkv.nn.sharding.shard_model` sets when
    it splits the expert axis over mesh axes: the grouped matmuls then run
    under ``shard_map`` on each device's own experts (:func:`on_local_experts`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, rngs, param_dtype=_F32, precision=None,
                 limit: float | None = None):
        self.gate_up_proj = param((num_experts, 2 * intermediate, hidden), rngs, param_dtype, std=hidden ** -0.5)
        self.down_proj = param((num_experts, hidden, intermediate), rngs, param_dtype, std=intermediate ** -0.5)
        self.limit = limit
        self.precision = precision
        self.placement: ExpertPlacement | None = None

    def __call__(self, x, experts, weights):
        """``sum_k weights[:, k] * expert[experts[:, k]](x)`` (``x [N, D]``,
        ``experts``/``weights`` ``[N, k]``) as grouped matmuls: the token
        copies sorted by expert, one ``ragged_dot`` per projection."""
        params = (self.gate_up_proj[...], self.down_proj[...])
        if self.placement is None:
            return self._routed(x, experts, weights, *params)
        return on_local_experts(self._routed, self.placement, x, experts, weights, params)

    def _routed(self, x, experts, weights, gate_up_proj, down_proj, local=None):
        """The grouped matmuls over the experts of ``gate_up_proj`` /
        ``down_proj``; ``local`` (``[N, k]`` bool, under
        :func:`on_local_experts`): which copies go to these experts (the
        others, their ids out of range, add nothing)."""
        k = experts.shape[1]
        num_experts = gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # ids >= num_experts: not counted

        # The weights as ragged_dot takes them ([E, in, out]), made once per call, outside the row chunks' loop:
        # XLA:GPU materializes this transpose once a call carries 8 tokens or more, and inside the loop it did
        # so once per chunk (docs/gpu.md: storing them [E, in, out] would save the one that is left).
        gate_up_in_out = jnp.swapaxes(gate_up_proj, 1, 2).astype(x.dtype)
        down_in_out = jnp.swapaxes(down_proj, 1, 2).astype(x.dtype)

        def mlp(rows, sizes):
            gate_up = jax.lax.ragged_dot(rows, gate_up_in_out, sizes, precision=self.precision)
            gate, up = jnp.split(gate_up, 2, axis=-1)
            return jax.lax.ragged_dot(_swiglu(gate, up, self.limit), down_in_out, sizes, precision=self.precision)

        if local is None:
            out = mlp(x[token], sizes)
        else:  # bounded: XLA:GPU makes a ragged dot a masked dense one, [rows, experts, features]
            width = max(gate_up_proj.shape[2], down_proj.shape[2])
            out = in_row_chunks(mlp, x[token], sizes, rows_per_chunk(num_experts, width))
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        if local is not None:  # the copies of other devices' experts (sorted last: rows past the groups)
            out = jnp.where(local.reshape(-1)[order][:, None], out, jnp.zeros_like(out))
        return jnp.zeros_like(x).at[token].add(out)


#: Elements of the masked operand ``[rows, groups, features]`` XLA:GPU builds for one ragged dot of a chunk
#: (:func:`rows_per_chunk`): 2**28, 0.5 GB in bf16.
MASKED_ELEMENTS = 1 << 28


def rows_per_chunk(num_groups: int, features: int, budget: int | None = None) -> int:
    """The most rows (a power of two, at least 16) whose masked operand
    ``[rows, num_groups, features]`` stays within ``budget`` elements
    (default :data:`MASKED_ELEMENTS`)."""
    budget = MASKED_ELEMENTS if budget is None else budget
    rows = max(budget // max(num_groups * features, 1), 16)
    return 1 << (rows.bit_length() - 1)


def in_row_chunks(fn, rows, sizes, chunk: int):
    """``fn(rows, sizes)`` (grouped matmuls over rows sorted by group,
    ``sizes [G]`` the groups' row counts; rows past their sum belong to no
    group) computed ``chunk`` rows at a time under ``lax.map``, each chunk
    with the sizes of the groups' parts in it: the same rows, the same
    products. XLA:GPU lowers a ragged dot through a masked
    ``[rows, groups, features]`` operand (at 8,192 tokens x top-6 against 32
    local experts of 4,096 features: 12.9 GB); chunks bound it. Rows past
    ``sum(sizes)`` come back unspecified, as from ``ragged_dot``."""
    m = rows.shape[0]
    if m <= chunk:
        return fn(rows, sizes)
    n = -(-m // chunk)
    rows = jnp.pad(rows, ((0, n * chunk - m), (0, 0)))
    ends = jnp.cumsum(sizes)
    starts = ends - sizes

    def one(c):
        lo = c * chunk
        part = jnp.clip(jnp.minimum(ends, lo + chunk) - jnp.maximum(starts, lo), 0).astype(sizes.dtype)
        return fn(jax.lax.dynamic_slice_in_dim(rows, lo, chunk), part)

    out = jax.lax.map(one, jnp.arange(n, dtype=jnp.int32))
    return out.reshape(n * chunk, *out.shape[2:])[:m]


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Where a routed-experts module's weights live: their expert axis (axis
    0) split over ``axes`` of ``mesh`` (every device holds ``E / prod(axis
    sizes)`` whole experts, in device order along ``axes``). Static: part of
    the module's graph definition, so hashable."""

    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]

    @property
    def parts(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.axes]))


def on_local_experts(routed, placement: ExpertPlacement, x, experts, weights, params):
    """``routed(x, experts, weights, *params, local=...)`` (the grouped
    matmuls of one module over the experts in ``params``) run under
    ``jax.shard_map`` over ``placement.axes``: each device takes its own
    slice of every array of ``params`` (split on axis 0, as
    :func:`jaxkv.nn.sharding.param_spec` places them), all tokens (``x``,
    ``experts``, ``weights`` replicated over those axes, as activations are
    in tensor parallelism), its experts' ids made local (``experts - first``;
    the copies routed to other devices' experts get an id past its own, so
    they sort last and count in no group, and ``local`` marks them), and the
    partial outputs are summed with ``psum``. The partitioner cannot split a
    ragged dot by its groups: without this it gathers every expert's weights
    in every MoE layer. Mesh axes not in ``axes`` (``data``) stay automatic.

    Equal to the one-device result up to the order of the ``k`` additions
    per token (``psum`` adds the devices' partial sums)."""
    axes = placement.axes
    spec = axes if len(axes) > 1 else axes[0]

    def local_part(x, experts, weights, *params):
        per_device = params[0].shape[0]
        first = jax.lax.axis_index(spec) * per_device
        mine = (experts >= first) & (experts < first + per_device)
        ids = jnp.where(mine, experts - first, per_device).astype(experts.dtype)
        return jax.lax.psum(routed(x, ids, weights, *params, local=mine), spec)

    param_specs = tuple(P(spec, *([None] * (p.ndim - 1))) for p in params)
    return jax.shard_map(local_part, mesh=placement.mesh, in_specs=(P(), P(), P(), *param_specs), out_specs=P(),
                         axis_names=frozenset(axes))(x, experts, weights, *params)


@dataclasses.dataclass(frozen=True)
class HeadPlacement:
    """Where an attention layer's heads live on a mesh: the attention
    kernels run under ``jax.shard_map`` over ``axis`` (:meth:`run`). A
    static attribute of the attention modules (set by
    :func:`jaxkv.nn.sharding.place_heads`, which :func:`~jaxkv.nn.sharding.shard_model`
    calls), part of the module's graph definition, so hashable.

    Why: a Pallas kernel is a custom call XLA cannot partition. Called on
    arrays split over ``tp`` with no ``shard_map``, XLA gathers its operands
    whole on every device around each call: the KV pool of every layer,
    every step (Qwen3-Next on tp=8: 24 all-gathers of 6-13 GB per decode
    step, compiled for H100; docs/gpu.md)."""

    mesh: jax.sharding.Mesh
    axis: str

    @property
    def parts(self) -> int:
        return int(self.mesh.shape[self.axis])

    def place_kv(self, x):
        """This step's new K or V rows ``x [T, KVH, D]`` placed as the cache
        holds its heads (:func:`~jaxkv.nn.sharding.cache_sharding`: over
        ``axis`` when it divides them, else whole on every device), before
        they are written. Without it the write follows the projection's
        split (the KV-head features over ``axis``, a fraction of a head per
        device when the heads do not divide), XLA splits the pool's update
        the same way, and gathers the whole pool back for the kernel."""
        spec = P(None, self.axis) if x.shape[1] % self.parts == 0 else P()
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh, spec))

    def place_whole(self, x):
        """New rows ``x`` of a cache every device holds whole (a latent
        cache: DeepSeek-V4's window rings and entry pools) placed whole
        before they are written or pooled. Without it they follow the
        projection's split (features over ``axis``), XLA splits the
        replicated pool's update the same way and gathers the whole pool
        back: every layer, every step (DeepSeek-V4-Flash on tp=8, compiled
        for H100; docs/gpu.md)."""
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh, P()))

    def run(self, attend, q, pages, small=(), *, sinks=None):
        """``attend(q, k_pages, v_pages, k_scales, v_scales, sinks, *small)``
        (one kernel call over the stacked pool, ``pages = (k_pages, v_pages,
        k_scales, v_scales)`` with the KV heads on axis 1, ``None`` where
        absent; ``q [T, H, D]``; ``sinks [H]`` or None) under ``shard_map``
        over ``axis``:

        * KV heads divisible by ``parts`` (and so query heads): each device
          its own query heads and KV heads (the pool as
          :func:`~jaxkv.nn.sharding.cache_sharding` splits it), no
          communication;
        * one KV head (MLA's latent, MQA), query heads divisible: each
          device its own query heads against the whole (replicated) pool;
        * else (KV heads that do not divide, e.g. Qwen3-Next's 2 on tp=8,
          whose pool is replicated): every device attends every head, the
          same work on each (the output is replicated; the output
          projection takes its heads' share), instead of gathering the pool.

        ``small``: block tables, lengths, a traced layer index (replicated);
        a value that is not an array (a static layer) is passed as it is.
        The result is the one-device kernel's, head by head."""
        heads, kv_heads = q.shape[1], pages[0].shape[1]
        split_q = heads % self.parts == 0 and (kv_heads % self.parts == 0 or kv_heads == 1)
        split_kv = split_q and kv_heads > 1
        on = (None, self.axis)

        def spec(x, split):
            return None if x is None else P(*(on if split else ()))

        static = {i: x for i, x in enumerate(small) if not isinstance(x, (jax.Array, jax.core.Tracer))}
        traced = [x for i, x in enumerate(small) if i not in static]

        def local(q, k_pages, v_pages, k_scales, v_scales, sinks, *traced):
            rest, it = [], iter(traced)
            for i in range(len(small)):
                rest.append(static[i] if i in static else next(it))
            return attend(q, k_pages, v_pages, k_scales, v_scales, sinks, *rest)

        q_spec = P(*on) if split_q else P()
        sinks_spec = None if sinks is None else P(self.axis) if split_q else P()  # [H]: with the query heads
        in_specs = (q_spec, *(spec(x, split_kv) for x in pages), sinks_spec, *(P() for _ in traced))
        return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=q_spec,
                             axis_names=frozenset({self.axis}), check_vma=False)(q, *pages, sinks, *traced)


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
