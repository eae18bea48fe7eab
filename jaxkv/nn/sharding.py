"""Placing every family's model and cache on a ``jax.sharding.Mesh``, in one
process or across the processes of JAX's multi-controller runtime.

Axis names (a mesh may have any subset; a missing axis means "not split"):

* ``tp``: tensor parallelism in the Megatron layout. Column projections
  (attention ``q/k/v_proj``, MLA ``q_b_proj`` / ``kv_b_proj``, DeepSeek-V4's
  ``o_a_proj`` groups, Gated DeltaNet ``in_proj_qkvz`` / ``in_proj_ba``,
  SwiGLU ``gate/up_proj``, the LM head's vocabulary) split their output
  features; row projections (``o_proj``, ``o_b_proj``, ``out_proj``,
  ``down_proj``) their input features, so each device holds whole heads
  (attention, MLA, GDN, the indexer's) and the K/V heads they read. Per-head
  vectors (attention sinks, GDN ``A_log`` / ``dt_bias``, the GDN conv
  channels) follow their heads. A KV pool splits its KV-head axis, a GDN
  state its value heads, a window ring its KV heads.
* ``expert``: MoE experts (``Experts.gate_up_proj`` / ``down_proj`` ``[E,
  ...]``) split their expert axis over ``expert x tp`` (every device of the
  two axes holds ``E / (expert * tp)`` whole experts), or over whichever of
  the two divides ``E``; without an ``expert`` axis over ``tp`` (expert
  parallelism inside the tensor-parallel group). The partitioner cannot
  split a ragged dot by its groups (it would gather every expert's weights
  in every MoE layer), so :func:`shard_model` also tells each experts
  module its axes (:func:`place_experts`): its grouped matmuls then run
  under ``shard_map``, each device on its own experts for every token, and
  a ``psum`` adds the devices' parts.
* ``data``: batch rows (:func:`batch_spec`: prompts of :func:`generate`).

Replicated, by design: embeddings, norms, routers, DeepSeek-V4's
hyper-connection mixers and compressors (one latent head: nothing to split),
and every latent cache (MLA's ``kv_lora_rank`` pages, DeepSeek-V4's
compressed entries and rings), as vLLM and SGLang do for MLA under tensor
parallelism; allocator and manager bookkeeping. A dimension the axis does
not divide stays whole (:func:`placement_report` lists where).

The jitted steps need no change (the experts' placement aside): given
inputs placed this way, XLA's SPMD partitioner runs them across the mesh
(any placement gives the same numbers up to summation order; these choose
where the collectives go).

**Multi-process.** Under ``jax.distributed`` a process addresses only its
own devices, so :func:`put` builds every global array the multi-controller
way: each process holds the same host value (the host scheduler runs
identically everywhere, see ``docs/scale.md``) and provides the shards of
its own devices (``jax.make_array_from_callback``); no process places data
on another's device. :func:`fetch` brings a global array back to every
process's host (its own shard of a replicated array, an all-gather of a
split one).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.errors import InvalidArgument
from jaxkv.nn.scan import STACKED, is_stacked

__all__ = ["batch_spec", "cache_sharding", "fetch", "is_placed", "param_spec", "place_experts", "place_heads",
           "placement_report", "pool_sharding", "prepare", "put", "replicate", "shard_cache", "shard_model",
           "shard_pool"]

# Module names whose parameters split their output features (axis 0 of a
# transformers-layout ``weight [out, in]`` and of a bias, the last axis of a
# flax ``kernel [in, out]``) or their input features (row projections; their
# bias is added after the all-reduce, so it stays whole).
_COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "o_a_proj",
                     "in_proj_qkvz", "in_proj_ba", "lm_head"})
_ROW = frozenset({"o_proj", "o_b_proj", "out_proj", "down_proj"})
_PER_HEAD = frozenset({"sinks", "A_log", "dt_bias"})
# Modules kept whole: the MoE router (``gate`` / ``router``), DeepSeek-V4's
# hyper-connection mixers and its compressor (one latent head).
_REPLICATED_MODULES = frozenset({"gate", "router", "attn_hc", "ffn_hc", "hc_head", "compressor"})
_EXPERT_LEAVES = frozenset({"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"})


def _names(path) -> tuple[str, ...]:
    names = (str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)
    return tuple(n for n in names if n != "value")


def _divides(shape, axis: int, mesh_axis, mesh: Mesh) -> bool:
    """Whether ``mesh_axis`` (a name or a tuple of names) is on ``mesh`` and
    divides ``shape[axis]``."""
    names = (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis or ())
    if not names or not shape or any(n not in mesh.shape for n in names):
        return False
    return shape[axis] % int(np.prod([mesh.shape[n] for n in names])) == 0


def _split(shape, axis: int, mesh_axis, mesh: Mesh) -> P:
    """``P`` splitting ``axis`` over ``mesh_axis`` (a name or a tuple of
    names) when the mesh has it and it divides the dimension; replicated
    otherwise."""
    spec = [None] * len(shape)
    if _divides(shape, axis, mesh_axis, mesh):
        spec[axis] = mesh_axis
    return P(*spec)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, *, tp_axis: str = "tp",
               expert_axis: str | None = None) -> P:
    """The partition spec of the parameter at ``path`` (module names, then
    ``weight`` / ``kernel`` / ``bias`` / ...) of ``shape`` on ``mesh``. A
    parameter of stacked layers (:func:`jaxkv.nn.scan.is_stacked`) follows
    the rule of one layer's, its leading layer axis whole."""
    if is_stacked(path):
        inner = param_spec(tuple(p for p in path if p != STACKED), tuple(shape[1:]), mesh, tp_axis=tp_axis,
                           expert_axis=expert_axis)
        return P(None, *inner)
    names, leaf, ndim = set(path), (path[-1] if path else ""), len(shape)
    if "indexer" in names:  # DeepSeek-V4's indexer: its query heads and their weights over tp
        if names & {"q_b_proj", "weights_proj"} and leaf == "weight":
            return _split(shape, 0, tp_axis, mesh)
        return P(*([None] * ndim))
    if names & _REPLICATED_MODULES:
        return P(*([None] * ndim))
    if "experts" in names and leaf in _EXPERT_LEAVES:  # over expert x tp, else the one that divides
        choices = ((expert_axis, tp_axis), expert_axis, tp_axis) if expert_axis else (tp_axis,)
        return _split(shape, 0, next((c for c in choices if _divides(shape, 0, c, mesh)), None), mesh)
    if leaf in _PER_HEAD or "conv1d" in names:  # per-head vectors; GDN conv channels [channels, 1, width]
        return _split(shape, 0, tp_axis, mesh)
    if names & _COLUMN:  # weight [out, in] and bias [out]: axis 0; kernel [in, out]: the last
        return _split(shape, ndim - 1 if leaf == "kernel" else 0, tp_axis, mesh)
    if names & _ROW and leaf in ("weight", "kernel"):
        return _split(shape, 0 if leaf == "kernel" else ndim - 1, tp_axis, mesh)
    return P(*([None] * ndim))


def _param_specs(model, mesh: Mesh, tp_axis: str, expert_axis: str | None):
    state = nnx.state(model)
    return state, jax.tree_util.tree_map_with_path(
        lambda path, leaf: param_spec(_names(path), tuple(leaf.shape), mesh, tp_axis=tp_axis,
                                      expert_axis=expert_axis), state)


def _check_axes(mesh: Mesh, tp_axis: str) -> None:
    if not isinstance(mesh, Mesh):
        raise InvalidArgument(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if tp_axis not in mesh.shape and "data" not in mesh.shape:
        raise InvalidArgument(f"mesh axes {tuple(mesh.shape)} have neither a {tp_axis!r} nor a 'data' axis")


def shard_model(model, mesh: Mesh, *, tp_axis: str = "tp", expert_axis: str | None = "expert"):
    """Place ``model``'s parameters on ``mesh`` (module docstring: heads and
    MLP features over ``tp_axis``, experts over ``expert_axis`` or else
    ``tp_axis``), in place; returns the model. Works for every family and in
    every process of a multi-process run (each places its own shards). The
    routed-experts modules learn where their experts went
    (:func:`place_experts`)."""
    _check_axes(mesh, tp_axis)
    state, specs = _param_specs(model, mesh, tp_axis, expert_axis)
    nnx.update(model, put(state, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                                              is_leaf=lambda x: isinstance(x, P))))
    place_experts(model, mesh, tp_axis=tp_axis, expert_axis=expert_axis)
    place_heads(model, mesh, tp_axis=tp_axis)
    return model


def place_heads(model, mesh: Mesh | None, *, tp_axis: str = "tp") -> int:
    """Tell every attention module of ``model`` (a module with a
    ``heads_placement`` attribute) that its heads are split over ``tp_axis``
    of ``mesh`` (a :class:`~jaxkv.nn.layers.HeadPlacement`), so its paged
    attention kernels run under ``shard_map`` on each device's heads instead
    of on operands XLA gathers whole around the call; ``None`` on one device
    or a ``tp`` of 1. A static attribute: take the graph definition after
    this. :func:`shard_model` calls it; so does a caller that places
    parameters with :func:`param_spec` itself. Returns how many modules got
    a placement."""
    from jaxkv.nn.layers import HeadPlacement

    placement = None
    if mesh is not None and tp_axis in mesh.shape and mesh.shape[tp_axis] > 1:
        placement = HeadPlacement(mesh, tp_axis)
    placed = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "heads_placement"):
            node.heads_placement = placement
            placed += placement is not None
    return placed


def place_experts(model, mesh: Mesh | None, *, tp_axis: str = "tp", expert_axis: str | None = "expert") -> int:
    """Tell every routed-experts module of ``model`` (a module with a
    ``placement`` attribute and a ``gate_up_proj`` parameter:
    :class:`jaxkv.nn.layers.Experts`) the mesh axes :func:`param_spec` splits
    its expert axis over (an :class:`~jaxkv.nn.layers.ExpertPlacement`), so
    its grouped matmuls run on each device's own experts under ``shard_map``
    instead of gathering every expert; ``None`` where they stay whole (or
    ``mesh`` is None: one device). A static attribute: take the graph
    definition (``nnx.split``) after this. :func:`shard_model` calls it; a
    caller placing parameters with :func:`param_spec` itself calls it too.
    Returns how many modules got a placement."""
    from jaxkv.nn.layers import ExpertPlacement

    placed = 0
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or not hasattr(node, "placement") or not hasattr(node, "gate_up_proj"):
            continue
        placement = None
        if mesh is not None:
            names = _names(path) + ("gate_up_proj",)
            spec = param_spec(names, tuple(node.gate_up_proj.shape), mesh, tp_axis=tp_axis, expert_axis=expert_axis)
            entry = spec[1 if is_stacked(names) else 0]  # a stacked parameter's axis 0: its layers
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if axes and int(np.prod([mesh.shape[a] for a in axes])) > 1:
                placement = ExpertPlacement(mesh, axes)
        node.placement = placement
        placed += placement is not None
    return placed


def placement_report(model, mesh: Mesh, *, tp_axis: str = "tp", expert_axis: str | None = "expert") -> dict:
    """``{"split": {path: spec}, "replicated": [path, ...], "bytes_per_device":
    n}``: where :func:`shard_model` puts each parameter and the parameter
    bytes one device holds."""
    state, specs = _param_specs(model, mesh, tp_axis, expert_axis)
    split, replicated, per_device = {}, [], 0
    leaves = jax.tree_util.tree_leaves_with_path(state)
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        name = "/".join(_names(path))
        parts = _parts(spec, mesh)
        per_device += leaf.size * leaf.dtype.itemsize // parts
        if any(spec):
            split[name] = tuple(spec)
        else:
            replicated.append(name)
    return {"split": split, "replicated": replicated, "bytes_per_device": int(per_device)}


def _parts(spec: P, mesh: Mesh) -> int:
    """Into how many pieces ``spec`` cuts an array on ``mesh``."""
    names = [n for entry in spec if entry is not None for n in ((entry,) if isinstance(entry, str) else entry)]
    return int(np.prod([mesh.shape[n] for n in names])) if names else 1


def is_placed(model, mesh: Mesh) -> bool:
    """Whether ``model``'s parameters already live on ``mesh``."""
    leaf = jax.tree.leaves(nnx.state(model))[0]
    sharding = getattr(leaf, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


# ------------------------------------------------------------------ caches

def pool_sharding(pool, mesh: Mesh, *, tp_axis: str = "tp"):
    """A pytree of ``NamedSharding`` shaped like the :class:`~jaxkv.KVPool`
    ``pool``: the KV-head axis (axis 1 of ``[L, KVH, P, ps, D]`` pages and
    ``[L, KVH, P, ps]`` scales) over ``tp_axis`` when it divides the heads;
    an MLA latent pool (one head) replicated."""
    return jax.tree.map(lambda leaf: NamedSharding(mesh, _split(leaf.shape, 1, tp_axis, mesh)), pool)


def shard_pool(pool, mesh: Mesh, *, tp_axis: str = "tp"):
    """``pool`` placed with its KV heads over ``tp_axis``."""
    return put(pool, pool_sharding(pool, mesh, tp_axis=tp_axis))


def _cache_leaf_spec(names: tuple[str, ...], shape, mesh: Mesh, tp_axis: str) -> P:
    """Where a :class:`~jaxkv.KVCacheManager` leaf goes: the full-attention
    pool's KV heads, the GDN states' value heads and conv channels, window
    rings' KV heads over ``tp``; latent pools, DeepSeek-V4 entries and rings
    and every piece of bookkeeping replicated."""
    leaf = names[-1] if names else ""
    if "full_pool" in names and leaf in ("k_bits", "v_bits", "k_scales", "v_scales"):
        return _split(shape, 1, tp_axis, mesh)
    if "gdn" in names and leaf in ("recurrent_state", "conv_bits"):
        return _split(shape, 2, tp_axis, mesh)
    if "window_pool" in names and leaf in ("k_bits", "v_bits"):  # window rings [layers, rows, KVH, W, D]
        return _split(shape, 2, tp_axis, mesh)
    return P(*([None] * len(shape)))


def cache_sharding(cache, mesh: Mesh, *, tp_axis: str = "tp"):
    """A pytree of ``NamedSharding`` for a model's cache: a
    :class:`~jaxkv.KVPool` (:func:`pool_sharding`) or a
    :class:`~jaxkv.KVCacheManager` (:func:`_cache_leaf_spec`)."""
    from jaxkv.pool.kv_pool import KVPool

    if isinstance(cache, KVPool):
        return pool_sharding(cache, mesh, tp_axis=tp_axis)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, _cache_leaf_spec(_names(path), leaf.shape, mesh, tp_axis)), cache)


def shard_cache(cache, mesh: Mesh, *, tp_axis: str = "tp"):
    """``cache`` (pool or manager) placed by :func:`cache_sharding`."""
    return put(cache, cache_sharding(cache, mesh, tp_axis=tp_axis))


# ------------------------------------------------------- multi-process I/O

def replicate(tree, mesh: Mesh):
    """Every leaf of ``tree`` replicated on ``mesh`` (allocator and manager
    state, PRNG keys)."""
    return put(tree, NamedSharding(mesh, P()))


def batch_spec(batch: int, mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """Rows split over ``data_axis`` when it divides ``batch``, else
    replicated."""
    if data_axis in mesh.shape and batch % mesh.shape[data_axis] == 0:
        return NamedSharding(mesh, P(data_axis))
    return NamedSharding(mesh, P())


def _put_leaf(leaf, sharding: NamedSharding):
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
        return leaf
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_put_leaf(jax.random.key_data(leaf), sharding),
                                        impl=jax.random.key_impl(leaf))
    if sharding.is_fully_addressable:
        return jax.device_put(leaf, sharding)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        # already global (another placement): reshard on device
        return jax.jit(lambda x: x, out_shardings=sharding)(leaf)
    host = np.asarray(leaf)  # the same value in every process (SPMD host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put(tree, sharding):
    """``tree`` placed with ``sharding`` (one ``Sharding`` for every leaf, or
    a pytree of them shaped like ``tree``), safely in a multi-process run:
    each process gives the shards its own devices hold, from its own host
    copy of the value (which every process must hold alike). In one process
    this is ``jax.device_put``."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda leaf: _put_leaf(leaf, sharding), tree)
    return jax.tree.map(_put_leaf, tree, sharding)


def _fetch_leaf(leaf):
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return np.asarray(jax.device_get(leaf))
    if leaf.sharding.is_fully_replicated:
        return np.asarray(leaf.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def fetch(tree):
    """``tree``'s arrays as numpy on this process's host, whatever their
    placement (a split global array is gathered: a collective every process
    must join, as every process runs the same host code)."""
    return jax.tree.map(_fetch_leaf, tree)


def prepare(model, mesh: Mesh | None) -> None:
    """Check ``mesh`` and place ``model`` on it unless it is there already
    (``generate`` / ``Engine`` call this; nothing without a mesh)."""
    if mesh is None:
        return
    _check_axes(mesh, "tp")
    if not is_placed(model, mesh):
        shard_model(model, mesh)
