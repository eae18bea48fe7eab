"""Placing a model and its KV pool on a ``jax.sharding.Mesh``.

Tensor parallelism in the Megatron layout over the ``tp`` axis: the column
projections (``q/k/v_proj``, ``gate/up_proj``) split their output features,
the row projections (``o_proj``, ``down_proj``) their input features, so each
device holds whole attention heads and the KV heads they read; the KV pool
splits its KV-head axis the same way. Embeddings, norms and the LM head are
replicated. Sequences can be split over a ``data`` axis (``batch_spec``).

The jitted steps need no change: given inputs placed this way, XLA's SPMD
partitioner runs them across the mesh. ``generate(..., mesh=mesh)`` places
its pool, block tables and prompts; ``shard_model`` places the parameters.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.errors import InvalidArgument
from jaxkv.pool.kv_pool import KVPool

__all__ = ["batch_spec", "param_spec", "pool_sharding", "replicate", "shard_model", "shard_pool"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def param_spec(path: tuple[str, ...], ndim: int, tp_axis: str = "tp") -> P:
    """The partition spec of the parameter at ``path`` (module names, then
    ``kernel`` / ``bias`` / ...)."""
    names = set(path)
    if names & set(_COLUMN):
        return P(None, tp_axis) if path[-1] == "kernel" else P(tp_axis)
    if names & set(_ROW) and path[-1] == "kernel":
        return P(tp_axis, None)
    return P(*([None] * ndim))


def _check_divisible(model, mesh: Mesh, tp_axis: str) -> None:
    config = model.config
    tp = mesh.shape[tp_axis]
    for what, size in (("num_key_value_heads", config.num_key_value_heads),
                       ("num_attention_heads", config.num_attention_heads),
                       ("intermediate_size", config.intermediate_size)):
        if size % tp:
            raise InvalidArgument(f"{what}={size} is not divisible by the {tp_axis!r} axis of size {tp}")


def shard_model(model, mesh: Mesh, *, tp_axis: str = "tp"):
    """Place ``model``'s parameters on ``mesh`` (tensor-parallel over
    ``tp_axis``), in place; returns the model."""
    if tp_axis not in mesh.shape:
        raise InvalidArgument(f"mesh axes {tuple(mesh.shape)} have no {tp_axis!r} axis")
    _check_divisible(model, mesh, tp_axis)
    state = nnx.state(model)

    def place(path, leaf):
        names = tuple(str(getattr(key, "key", getattr(key, "name", key))) for key in path)
        names = tuple(n for n in names if n != "value")
        return jax.device_put(leaf, NamedSharding(mesh, param_spec(names, leaf.ndim, tp_axis)))

    nnx.update(model, jax.tree_util.tree_map_with_path(place, state))
    return model


def pool_sharding(pool: KVPool, mesh: Mesh, *, tp_axis: str = "tp") -> KVPool:
    """A pytree of ``NamedSharding`` shaped like ``pool``: the KV-head axis
    (axis 1 of ``[L, KVH, P, ps, D]`` pages and ``[L, KVH, P, ps]`` scales)
    over ``tp_axis``."""
    if pool.k_heads % mesh.shape[tp_axis]:
        raise InvalidArgument(f"{pool.k_heads} KV heads are not divisible by the {tp_axis!r} axis")
    return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P(None, tp_axis)), pool)


def shard_pool(pool: KVPool, mesh: Mesh, *, tp_axis: str = "tp") -> KVPool:
    """``pool`` placed with its KV heads over ``tp_axis``."""
    return jax.device_put(pool, pool_sharding(pool, mesh, tp_axis=tp_axis))


def replicate(tree, mesh: Mesh):
    """Every leaf of ``tree`` replicated on ``mesh`` (allocator and manager
    state, PRNG keys)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def batch_spec(batch: int, mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """Rows split over ``data_axis`` when it divides ``batch``, else
    replicated."""
    if data_axis in mesh.shape and batch % mesh.shape[data_axis] == 0:
        return NamedSharding(mesh, P(data_axis))
    return NamedSharding(mesh, P())
