"""``python -m jaxkv.bench engine_aot``: the engine's own jitted programs
compiled for an H100 without a GPU, at real model sizes, and what XLA says
they hold in device memory.

Needs ``jax[cuda12]`` 0.10.x (the CUDA plugin and ``ptxas``; no GPU): the
programs are traced from shapes only (``nnx.eval_shape`` models in bf16,
``jax.eval_shape`` caches, ``jax.ShapeDtypeStruct`` inputs: nothing is
allocated), lowered for CUDA and compiled against a deviceless H100 topology
(:func:`kernels_pallas.aot_check.topology_device`'s target config; one
device, or ``1x1x8``: eight H100s of one host, compiled as ONE SPMD program
per device, so every figure below is one device's).

Programs, as the engine calls them (``scheduler="packed"``, its default):

* ``packed[N]``: ``_paged_packed`` / ``_hybrid_packed`` (:mod:`jaxkv.serve.
  paged_cache`, :mod:`jaxkv.serve.hybrid_cache`) for every stream length
  ``N`` of :func:`jaxkv.serve.scheduler.stream_lengths` of the token budget
  (the batch built as ``_packed_call`` packs it: ``max_seqs`` lanes; a model
  with Gated DeltaNet layers compiles one program per power-of-two count of
  prefill lanes, and the one compiled here is the largest a stream of ``N``
  tokens can take, ``min(pow2(N), max_seqs)``);
* ``decode chunk``: :func:`jaxkv.serve.caches.decode_chunk`, ``decode_chunk``
  steps in one ``lax.while_loop``;
* ``prefill`` (``--prefill``): the padded scheduler's ``[max_seqs,
  prefill_width]`` prefill call;
* ``spec`` and ``verify:N`` (``--speculative``; :func:`programs`): speculative
  decoding's decode chunk (:func:`jaxkv.serve.caches.speculative_chunk`,
  n-gram verify steps of :data:`SPEC_K` drafts) and the packed step with
  verify lanes (a paged pool's, or a hybrid cache's with its rollback).

Sizing, as the engine sizes itself on the GPU (nothing measured): the
weights one device holds (the shards of ``shard_model``'s specs),
``free = 80 GB - weights`` (:data:`jaxkv.bench.deployment.H100_BYTES`), the
engine's default KV budget (:func:`jaxkv.serve.sizing.default_budget`: 0.8
of it, unless the cache, the largest temporaries of the packed step at the
token budget and of the decode chunk, and
:data:`~jaxkv.serve.program_memory.PROGRAM_MARGIN` pass ``free``: then
what those leave, :func:`jaxkv.serve.build.room_for_programs`, the
engine's rule on an accelerator), ``max_seqs`` / ``max_num_batched_tokens`` / ``decode_chunk`` derived
as the engine derives them on a GPU (256 / 8192 / 16 where they fit),
``max_model_len`` the GPU default, pages of 16, and the blocks (and a hybrid
cache's snapshot rows) from the budget by :func:`jaxkv.serve.caches.
blocks_from_budget`, as ``build_paged_cache`` / ``build_hybrid_cache`` do.
On ``tp=8`` the parameters and the cache carry the shardings of
:mod:`jaxkv.nn.sharding` (``shard_model``'s specs, ``cache_sharding``), the
step's other inputs replicated, as ``Engine(model, mesh=...)`` places them.

Per program, from ``compiled.memory_analysis()`` (one device): argument,
output, alias (output bytes that reuse a donated argument: the cache
updated in place) and temporary bytes, against the cache's bytes (the
donated manager and pool); ``peak GB`` = argument + output - alias + temp,
what the program needs resident (an H100 has 80). Verdicts, each a defect
(exit status 1):

* ``POOL-SIZED TEMP``: the temporaries reach half the cache, and so do the
  buffers the compiled HLO makes from the cache's arrays (those with a
  dimension only the cache has: a pool's pages, a hybrid cache's blocks or
  state rows), summed: a copy of the KV pool, a gathered pool;
* ``LARGE TEMP``: the temporaries reach half the cache, the buffers made
  from it do not (the largest are listed: activations, gathered weights);
* ``NOT IN PLACE``: less than 90% of the cache is aliased to the outputs.

A defect row names the buffers (:func:`big_buffers`: the instruction, its
size, the operation that made it and its source lines under ``jaxkv/``).

The models: Llama-3.1-8B and gpt-oss-20b on one H100, Qwen3-Next-80B-A3B and
the DeepSeek-V4-Flash-like model on ``tp=8`` (configs of
:data:`jaxkv.bench.deployment.HF_CONFIGS`; bf16 weights, the engine's
default entry format). ``--quick``: Llama-3.1-8B's smallest and largest
packed buckets and its decode chunk, and gpt-oss-20b's decode chunk.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import time
from collections.abc import Callable

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU: skip the driver version probe

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxkv._ops import ceil_div, pow2_at_least  # noqa: E402
from jaxkv.errors import InvalidArgument  # noqa: E402
from jaxkv.bench._timing import print_json, print_table  # noqa: E402
from jaxkv.serve.program_memory import admission, as_shapes  # noqa: E402

__all__ = ["MODELS", "QUICK", "Buffer", "Result", "Setup", "big_buffers", "build", "compile_program",
           "cuda_available", "main", "programs", "run"]

GB = 10**9
PAGE_SIZE = 16
SPEC_K = 4  # drafts per verify step in the "spec" and "verify" programs (the bench's n-gram k)
#: The engine's GPU defaults (:mod:`jaxkv.serve.sizing`: vLLM's on an H100) when its derivation is not importable.
GPU_MAX_SEQS, GPU_MAX_NUM_BATCHED_TOKENS, GPU_DECODE_CHUNK = 256, 8192, 16
#: A temporary of at least this share of the cache's bytes is a copy of it (a defect).
POOL_SIZED = 0.5
#: Less than this share of the cache aliased to the outputs: not updated in place (a defect).
IN_PLACE = 0.9


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model of :data:`jaxkv.bench.deployment.HF_CONFIGS` on ``tp`` H100s."""

    name: str
    config: str
    tp: int


MODELS = (
    ModelSpec("Llama-3.1-8B", "Llama-3.1-8B", 1),
    ModelSpec("gpt-oss-20b", "gpt-oss-20b", 1),
    ModelSpec("Qwen3-Next-80B-A3B", "Qwen3-Next-80B-A3B", 8),
    ModelSpec("DeepSeek-V4-Flash-like", "DeepSeek-V4-Flash-like", 8),
)
#: ``--quick``: model -> programs.
QUICK = {"Llama-3.1-8B": ("packed:first", "packed:last", "decode"), "gpt-oss-20b": ("decode",)}


def cuda_available() -> bool:
    """Whether the CUDA plugin (``jax[cuda12]``) is importable."""
    from kernels_pallas import aot_check

    return aot_check.cuda_available()


# --------------------------------------------------------------------------
# The model, its engine sizing and its cache, as shapes.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """One model ready to compile: the abstract model split as the engine
    splits it, its placement, the engine's sizes and the cache's shapes."""

    spec: ModelSpec
    kind: str  # "paged" or "hybrid"
    graphdef: object
    params: object  # ShapeDtypeStructs with shardings
    cache: tuple  # (manager, pool) for a paged cache, (manager,) for a hybrid one
    replicated: object  # the sharding of the step's small inputs
    mesh_name: str
    weights_bytes: int  # one device's
    budget_bytes: int
    program_bytes: int  # the largest temporaries of the measured programs, kept free beside the cache
    budget_rule: str  # how the budget was found, in words
    max_seqs: int
    max_num_batched_tokens: int
    decode_chunk: int
    max_model_len: int
    prefill_width: int
    blocks: dict  # group -> allocatable blocks
    snapshots: int
    cache_bytes: int  # one device's: the donated manager (and pool)
    has_gdn: bool
    sizing_note: str = ""
    #: Dims only the cache's arrays have (its blocks, its state rows): a buffer with one is made from the cache.
    cache_dims: frozenset = frozenset()

    @property
    def buckets(self) -> list[int]:
        from jaxkv.serve.scheduler import stream_lengths

        return stream_lengths(self.max_num_batched_tokens)


def _devices(tp: int, local: bool = False) -> list:
    """``tp`` compile-only H100s of one host; ``local`` (``--local``, on a
    GPU machine): this process's first ``tp`` devices, compiled by the XLA
    of the JAX installed there, which may copy what another version does not."""
    from jax.experimental import topologies

    from kernels_pallas import aot_check

    if local:
        if len(jax.devices()) < tp:
            raise RuntimeError(f"--local: {tp} devices needed, {len(jax.devices())} here")
        return jax.devices()[:tp]
    if tp == 1:
        return [aot_check.topology_device("h100")]
    topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{tp}",
                                            target_config=aot_check.target_config(aot_check.TARGETS["h100"]))
    return list(topology.devices)


def _device_bytes(tree) -> int:
    """Bytes one device holds of ``tree`` (ShapeDtypeStructs with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return int(total)


def _scheduler_sizes(model, mesh, free: int, budget: int | None = None) -> tuple[int, int, int, str]:
    """``(max_seqs, max_num_batched_tokens, decode_chunk, note)`` as the
    engine derives them on a GPU (:func:`jaxkv.serve.build.derive_scheduler_defaults`;
    ``budget``: from that KV budget, else the default's); the GPU's fixed
    defaults where that derivation is not there."""
    try:
        from jaxkv.serve.build import derive_scheduler_defaults
        from jaxkv.serve.options import EngineOptions
    except ImportError:
        return GPU_MAX_SEQS, GPU_MAX_NUM_BATCHED_TOKENS, GPU_DECODE_CHUNK, "the GPU defaults (no derivation)"
    d = derive_scheduler_defaults(model, EngineOptions().replace(kv_cache_memory=budget), mesh=mesh, free_bytes=free,
                                  platform="gpu")
    values = d.values()
    return (int(values["max_seqs"]), int(values["max_num_batched_tokens"]), int(values["decode_chunk"]),
            "derived as on a GPU")


def _cache_dims(kind: str, cache, params) -> frozenset:
    """The dims that tell a buffer made from the cache: a paged pool's page
    count; a hybrid cache's blocks per group (null block included) and its
    state rows (request slots and snapshot rows). A dim some parameter also
    has is left out."""
    if kind == "paged":
        dims = {cache[1].k_bits.shape[2]}
    else:
        manager = cache[0]
        dims = {g.allocator.capacity + 1 for g in manager.groups.values()}
        dims.add(manager.num_slots + manager.num_snapshots)
    taken = {d for leaf in jax.tree.leaves(params) for d in (*leaf.shape, *leaf.sharding.shard_shape(leaf.shape))}
    return frozenset(d for d in dims if d not in taken)


def build(spec: ModelSpec, *, stacked: bool = False, local: bool = False, _again=None) -> Setup:
    """The model ``spec`` as shapes on its devices, sized as the engine on
    ``spec.tp`` 80 GB H100s (module docstring). ``_again``: ``(rows, token
    budget, the programs' measure, note)``, the engine's second sizing when
    the programs cut the budget its rows were derived from."""
    from jaxkv.bench.deployment import H100_BYTES, model_and_cache
    from jaxkv.manager.block_space import BlockSpaceManager
    from jaxkv.nn import sharding
    from jaxkv.nn.packed import cache_kind
    from jaxkv.nn.steps import paged_peak_blocks, paged_window
    from jaxkv.serve import sizing
    from jaxkv.serve import program_memory
    from jaxkv.serve.build import room_for_programs
    from jaxkv.serve.caches import blocks_from_budget
    from jaxkv.serve.options import CacheOptions

    model = model_and_cache(spec.config, scan_layers=stacked)[0]
    devices = _devices(spec.tp, local)
    if spec.tp == 1:
        mesh, one = None, SingleDeviceSharding(devices[0])
        params_sharding = one
        replicated = one
        mesh_name = "1 H100"
    else:
        mesh = Mesh(np.asarray(devices), ("tp",))
        replicated = NamedSharding(mesh, P())
        mesh_name = f"tp={spec.tp} H100"
    # The routed experts learn where shard_model's specs put them (their grouped matmuls run on each
    # device's own experts under shard_map): a static attribute, so before the graph definition is taken.
    sharding.place_experts(model, mesh, tp_axis="tp", expert_axis="expert")
    sharding.place_heads(model, mesh, tp_axis="tp")
    graphdef, state = nnx.split(model)
    if mesh is not None:
        def names(path):  # module names of a state path, as shard_model reads them
            keys = (str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            return tuple(n for n in keys if n != "value")

        specs = jax.tree_util.tree_map_with_path(
            lambda path, leaf: sharding.param_spec(names(path), tuple(leaf.shape), mesh, tp_axis="tp",
                                                   expert_axis="expert"), state)
        params_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    params = as_shapes(state, params_sharding)
    weights = _device_bytes(params)
    free = max(int(H100_BYTES) - weights, 1)
    max_seqs, batched, chunk, note = _scheduler_sizes(model, mesh, free)
    if _again is not None:
        max_seqs, batched, measured, note = _again
    length = sizing.default_max_model_len(model, "gpu")
    options = CacheOptions()
    prefill_width = min(pow2_at_least(256), pow2_at_least(length))  # the engine's prefill_chunk default: 256

    def placed_cache(tree):
        if mesh is None:
            return as_shapes(tree, replicated)
        return as_shapes(tree, sharding.cache_sharding(tree, mesh))

    kind = cache_kind(model)
    if kind == "paged":
        window = paged_window(model)

        def need(n):
            return max(paged_peak_blocks(max(n - 1, 1), n, PAGE_SIZE, window),
                       paged_peak_blocks(1, n, PAGE_SIZE, window))

        def make(counts):
            manager = BlockSpaceManager.create(num_device_blocks=counts[0], num_host_blocks=2, block_size=PAGE_SIZE,
                                               max_seqs=max_seqs, max_blocks_per_seq=ceil_div(length, PAGE_SIZE),
                                               watermark=0.0)
            return manager, model.make_pool(counts[0], PAGE_SIZE, dtype=options.kv_dtype)

        def measure(counts):
            manager, pool = jax.eval_shape(lambda: make(counts))
            return _device_bytes(as_shapes(manager, replicated)) + _device_bytes(placed_cache(pool))

        def solve(memory):
            return blocks_from_budget(measure, [PAGE_SIZE], [max_seqs * need(length)], memory, free)

        def shapes(blocks):
            manager, pool = jax.eval_shape(lambda: make([blocks[0] + 1]))
            # As the engine passes it: without its host allocator (BlockSpaceManager.in_step).
            return as_shapes(manager.replace(host=None), replicated), placed_cache(pool)

        def cache_bytes(blocks):
            return measure([blocks[0] + 1])

        has_gdn = False
    else:
        fmt = options.entry_format
        probe = jax.eval_shape(lambda: model.make_cache(1, length, entry_format=fmt))
        names = list(probe.groups)
        tokens_per_block = [g.tokens_per_block for g in probe.groups.values()]
        per_entry = [(g.tokens_per_entry, g.entries_per_block) for g in probe.groups.values()]
        has_gdn = probe.gdn is not None

        def make(counts, snapshots):
            return model.make_cache(max_seqs, length, entry_format=fmt, num_blocks=dict(zip(names, counts)),
                                    num_snapshots=snapshots)

        def measure(counts, snapshots):
            return _device_bytes(placed_cache(jax.eval_shape(lambda: make(counts, snapshots))))

        row = measure([2] * len(names), 2) - measure([2] * len(names), 1)  # build_hybrid_cache's snapshot rows

        def snapshots(memory):  # a quarter of the budget at most
            budget = memory if memory is not None else sizing.default_budget(free)[0]
            return max(int(min(2 * max_seqs, budget // 4 // row) if row > 0 else 2 * max_seqs), 0)

        cap = [max_seqs * ceil_div(length // tpe, epb) for tpe, epb in per_entry]

        def solve(memory):  # the snapshot rows follow the budget solved for
            solved["snapshots"] = snapshots(memory)
            return blocks_from_budget(lambda counts: measure(counts, solved["snapshots"]), tokens_per_block, cap,
                                      memory, free)

        def shapes(blocks):
            return (placed_cache(jax.eval_shape(lambda: make([b + 1 for b in blocks], solved["snapshots"]))),)

        def cache_bytes(blocks):
            return measure([b + 1 for b in blocks], solved["snapshots"])

    # The engine's rule (jaxkv.serve.build.room_for_programs): the default budget, unless the cache, the largest
    # programs' temporaries over it and the margin pass the free memory; then what they leave (the derived token
    # budget lowered first when they would leave the cache less than half).
    def measure_at(cache, tokens):
        return program_memory.measure(program_memory.engine_programs(
            graphdef, params, cache, kind=kind, max_seqs=max_seqs, decode_chunk=chunk, stream_length=tokens,
            prefill_chunk=prefill_width, has_gdn=has_gdn, sharding=replicated), compile_for_h100)

    solved = {"snapshots": 0}
    if _again is None:
        reserve = program_memory.MeasuredPrograms(measure_at, batched, lowerable=True, floor=max_seqs)
    else:  # as measured at more rows: the engine's second sizing compiles nothing
        reserve = lambda shapes: measured  # noqa: E731
    try:
        blocks, budget, source, reserved = room_for_programs(reserve, free, solve, cache_bytes, shapes)
    except InvalidArgument:  # the rows' own state past what the programs leave: the engine derives fewer rows
        if _again is not None or reserve.limited_to is None:
            raise
        blocks = None
    if _again is None and reserve.token_budget < batched:
        note += f"; max_num_batched_tokens lowered from {batched} to {reserve.token_budget}, as the engine does"
        batched = reserve.token_budget
    if _again is None and reserve.limited_to is not None:  # the engine's jaxkv.serve.engine._rows_for_room
        rows = _scheduler_sizes(model, mesh, free, reserve.limited_to)[0]
        if rows < max_seqs:
            note += f"; max_seqs {max_seqs} derived again from the budget the programs leave: {rows}"
            return build(spec, stacked=stacked, local=local, _again=(rows, batched, reserve.measured, note))
    if blocks is None:
        raise InvalidArgument(f"{spec.name}: the programs' temporaries leave no room for the cache's rows")
    jax.clear_caches()  # the table's compile seconds are each program's own compile, not a cache hit
    cache, cached = shapes(blocks), solved["snapshots"]
    groups = {"pages": blocks[0]} if kind == "paged" else dict(zip(names, blocks))
    rule = ("0.8 of the free memory" if budget is None or "less the programs' temporaries" not in source
            else f"the free memory less the programs' {reserved / GB:.2f} GB and the margin")
    budget = sizing.default_budget(free)[0] if budget is None else budget
    return Setup(spec=spec, kind=kind, graphdef=graphdef, params=params, cache=cache, replicated=replicated,
                 mesh_name=mesh_name, weights_bytes=weights, budget_bytes=budget, program_bytes=reserved,
                 budget_rule=rule,
                 max_seqs=max_seqs, max_num_batched_tokens=batched, decode_chunk=chunk, max_model_len=length,
                 prefill_width=prefill_width, blocks=groups, snapshots=cached, cache_bytes=_device_bytes(cache),
                 has_gdn=has_gdn, sizing_note=note, cache_dims=_cache_dims(kind, cache, params))


# --------------------------------------------------------------------------
# The programs and their arguments.
# --------------------------------------------------------------------------


def _inputs(setup: Setup):
    """The per-row inputs every program takes: a maker of ``[max_seqs]``
    vectors, the rows' sampling and PRNG keys
    (:func:`jaxkv.serve.program_memory.row_inputs`)."""
    from jaxkv.serve.program_memory import row_inputs

    return row_inputs(setup.max_seqs, setup.replicated)


def _packed_batch(setup: Setup, tokens: int):
    """The :class:`~jaxkv.nn.packed.PackedBatch` of a stream of ``tokens``
    as ``_packed_call`` packs it (:func:`jaxkv.serve.program_memory.packed_batch`)."""
    from jaxkv.serve.program_memory import packed_batch

    return packed_batch(setup.max_seqs, tokens, setup.max_num_batched_tokens, setup.has_gdn, setup.replicated)


def programs(setup: Setup, which=None, *, prefill: bool = False) -> list[tuple[str, Callable, tuple, dict]]:
    """``(label, jitted function, args, static kwargs)`` of the engine's
    programs for ``setup``: ``which`` None for every packed bucket and the
    decode chunk (and the padded prefill with ``prefill``), else names of
    ``"packed:N"``, ``"packed:first"``, ``"packed:last"``, ``"decode"``,
    ``"prefill"``, ``"spec"`` (the speculative decode chunk: n-gram verify
    steps of :data:`SPEC_K` drafts) and ``"verify:N"`` / ``"verify:first"``
    / ``"verify:last"`` (the packed step with verify lanes)."""
    from jaxkv.nn.speculative import SpeculativeConfig
    from jaxkv.serve.caches import decode_chunk, speculative_chunk
    from jaxkv.serve.hybrid_cache import (jitted_packed as _hybrid_packed,
                                          jitted_packed_verify as _hybrid_packed_verify,
                                          jitted_prefill as _hybrid_prefill)
    from jaxkv.serve.paged_cache import (jitted_packed as _paged_packed, jitted_packed_verify as _paged_packed_verify,
                                         jitted_prefill as _paged_prefill)

    buckets = setup.buckets
    if which is None:
        which = [f"packed:{n}" for n in buckets] + ["decode"] + (["prefill"] if prefill else [])
    vec, sampling, keys = _inputs(setup)
    g, p, rows = setup.graphdef, setup.params, setup.max_seqs
    out = []
    for name in which:
        if name.startswith("packed:"):
            arg = name.split(":", 1)[1]
            n = buckets[0] if arg == "first" else buckets[-1] if arg == "last" else int(arg)
            batch = _packed_batch(setup, n)
            label = f"packed[{n}]" + (f" P={batch.num_prefill_lanes}" if setup.has_gdn else "")
            if setup.kind == "paged":
                out.append((label, _paged_packed, (g, p, *setup.cache, admission(vec, setup.cache[0]), batch,
                                                   sampling, keys),
                            dict(window=None, scrub=False)))
            else:
                out.append((label, _hybrid_packed, (g, p, *setup.cache, batch, sampling, keys), {}))
        elif name == "decode":
            manager, pool = setup.cache if setup.kind == "paged" else (setup.cache[0], None)
            out.append((f"decode chunk x{setup.decode_chunk}", decode_chunk,
                        (g, p, manager, pool, vec(jnp.int32), vec(jnp.bool_), vec(jnp.int32), vec(jnp.int32),
                         vec(jnp.int32), sampling, keys), dict(num_steps=setup.decode_chunk, scrub=False)))
        elif name == "spec":  # n-gram verify steps of SPEC_K drafts: the engine's speculative decode chunk
            manager, pool = setup.cache if setup.kind == "paged" else (setup.cache[0], None)
            history = vec(jnp.int32, (rows, pow2_at_least(setup.max_model_len + 1)))
            out.append((f"spec chunk x{setup.decode_chunk} k{SPEC_K}", speculative_chunk,
                        (g, p, manager, pool, vec(jnp.int32), vec(jnp.bool_), vec(jnp.int32), vec(jnp.int32),
                         vec(jnp.int32), sampling, keys, history, vec(jnp.int32), vec(jnp.bool_),
                         jax.ShapeDtypeStruct((), jnp.int32, sharding=setup.replicated)),
                        dict(num_steps=setup.decode_chunk, config=SpeculativeConfig(num_speculative_tokens=SPEC_K),
                             scrub=False)))
        elif name.startswith("verify:"):  # a packed step whose decode lanes verify SPEC_K n-gram drafts
            arg = name.split(":", 1)[1]
            n = buckets[0] if arg == "first" else buckets[-1] if arg == "last" else int(arg)
            history = vec(jnp.int32, (rows, pow2_at_least(setup.max_model_len + 1)))
            args = (g, p, *setup.cache, _packed_batch(setup, n), sampling, keys, history, vec(jnp.int32),
                    vec(jnp.bool_))
            config = SpeculativeConfig(num_speculative_tokens=SPEC_K)
            if setup.kind == "paged":
                out.append((f"packed verify[{n}] k{SPEC_K}", _paged_packed_verify, args,
                            dict(config=config, window=None, scrub=False)))
            else:
                out.append((f"packed verify[{n}] k{SPEC_K}", _hybrid_packed_verify, args, dict(config=config)))
        elif name == "prefill":
            tokens = vec(jnp.int32, (rows, setup.prefill_width))
            label = f"prefill {rows}x{setup.prefill_width}"
            if setup.kind == "paged":
                out.append((label, _paged_prefill, (g, p, *setup.cache, vec(jnp.int32), vec(jnp.int32),
                                                    vec(jnp.int32), tokens, sampling, keys), {}))
            else:
                out.append((label, _hybrid_prefill, (g, p, *setup.cache, vec(jnp.int32), tokens, vec(jnp.int32),
                                                     sampling, keys), {}))
        else:
            raise ValueError(f"unknown program {name!r}")
    return out


# --------------------------------------------------------------------------
# Compiling and reading the memory analysis.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """One program compiled for H100 (bytes are one device's)."""

    model: str
    mesh: str
    program: str
    seconds: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    cache_bytes: int
    cache_buffers: list = dataclasses.field(default_factory=list)  # big buffers made from the cache, where from
    cache_made_bytes: int = 0  # their bytes, summed (buffers XLA may reuse count each time)
    largest: list = dataclasses.field(default_factory=list)  # the largest buffers made anew, where from
    #: Instructions XLA's rematerialization pass recomputed (``*.remat*`` in the compiled HLO): the engine's
    #: programs turn the pass off (:data:`jaxkv.nn.steps.PROGRAM_OPTIONS`), where it ran GEMMs twice.
    rematerialized: int = 0
    error: str = ""

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def verdict(self) -> str:
        if self.error:
            return "FAIL"
        if self.temp_bytes >= POOL_SIZED * self.cache_bytes:
            return "POOL-SIZED TEMP" if self.cache_made_bytes >= POOL_SIZED * self.cache_bytes else "LARGE TEMP"
        if self.alias_bytes < IN_PLACE * self.cache_bytes:
            return "NOT IN PLACE"
        return "ok"

    @property
    def defect(self) -> bool:
        return self.verdict != "ok"

    def row(self) -> list:
        return [self.model, self.mesh, self.program, self.seconds, self.argument_bytes / GB, self.output_bytes / GB,
                self.temp_bytes / GB, self.alias_bytes / GB, self.cache_bytes / GB, self.peak_bytes / GB,
                self.rematerialized, self.verdict]


_SIZES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1, "pred": 1}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\w+\[[\d,]*\]\S*) ([\w\-]+)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:true_computation|false_computation|body|condition|calls|to_apply)=%([\w.\-]+)"
                    r"|branch_computations=\{([^}]*)\}")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
#: An instruction the rematerialization pass made: a recomputation, named after its original with ``.remat``.
_REMATERIALIZED = re.compile(r"^\s*(?:ROOT )?%\S+\.remat\d* = ", re.M)
#: Instructions that make no buffer of their own (views, control flow, the second half of an async pair) or
#: update their operand in place.
_NO_NEW_BUFFER = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                            "constant", "after-all", "scatter", "dynamic-update-slice", "all-gather-done",
                            "all-reduce-done", "collective-permute-done", "copy-done", "async-done",
                            "all-to-all-done", "send-done", "recv-done"})


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer an instruction of the compiled HLO makes: its bytes, dtype
    and dims, the instruction (opcode, name), the computation it sits in and
    what made it (its ``op_name`` and source lines under ``jaxkv/``, or those
    of the operation that calls its computation)."""

    bytes: int
    dtype: str
    dims: tuple
    op: str
    name: str
    computation: str
    origin: str

    def describe(self) -> str:
        where = "the entry computation" if self.computation == "ENTRY" else self.computation
        return (f"{self.op} {self.dtype}[{','.join(map(str, self.dims))}] ({self.bytes / GB:.2f} GB) {self.name} "
                f"in {where}: {self.origin}")


def _source_tables(hlo: str) -> dict:
    """The compiled HLO's source tables (``FileNames``, ``FileLocations``,
    ``StackFrames``, ...): table name -> {id: text}."""
    tables, current = {}, None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := _TABLE_ROW.match(line)):
            current[int(m.group(1))] = m.group(2)
        elif current is not None and line.strip():
            current = None
    return tables


def _where(tables: dict, frame: int, depth: int = 3) -> str:
    """``file:line`` of stack frame ``frame`` and its callers, innermost
    first, of files under ``jaxkv/`` (at most ``depth``; empty without
    source tables)."""
    out, seen = [], set()
    frames, locations, files = (tables.get(k, {}) for k in ("StackFrames", "FileLocations", "FileNames"))
    while frame in frames and frame not in seen and len(out) < depth:
        seen.add(frame)
        fields = dict(re.findall(r"(\w+)=(\d+)", frames[frame]))
        location = dict(re.findall(r"(\w+)=(\d+)", locations.get(int(fields.get("file_location_id", 0)), "")))
        path = files.get(int(location.get("file_name_id", 0)), "").strip('"')
        if "jaxkv/" in path and "jaxkv/bench/" not in path:
            out.append(f"{path[path.rindex('jaxkv/'):]}:{location.get('line')}")
        frame = int(fields.get("parent_frame_id", 0)) - 1  # 1-based; 0: none
    return " < ".join(out)


def _origin(line: str, tables: dict) -> str:
    """``op_name`` and source lines of an instruction's metadata ('' without)."""
    op = re.search(r'op_name="([^"]*)"', line)
    frame = re.search(r"stack_frame_id=(\d+)", line)
    source = _where(tables, int(frame.group(1))) if frame else ""
    return " ".join(t for t in (op.group(1) if op else "", f"at {source}" if source else "") if t)


def big_buffers(hlo: str, min_bytes: int) -> list[Buffer]:
    """The buffers of at least ``min_bytes`` that the compiled ``hlo`` makes
    anew (not a view, not control flow, not an in-place scatter or
    dynamic-update-slice, nor a fusion ending in one; an async collective
    counted once, its result), largest first. Inside fused computations
    nothing makes a buffer. An instruction without metadata (a ``copy``
    that copy insertion added) is traced to the operation calling its
    computation (a conditional's branch, a loop's body)."""
    tables = _source_tables(hlo)
    fused, in_place, callers, computation, found = set(), set(), {}, "ENTRY", []
    roots = {}
    for line in hlo.splitlines():  # first pass: fused computations, their roots, who calls what
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            computation = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            continue
        if line.lstrip().startswith("ROOT "):
            m = _INSTRUCTION.match(line)
            roots[computation] = m.group(3) if m else ""
        for m in _CALLS.finditer(line):
            names = [m.group(1)] if m.group(1) else re.findall(r"%([\w.\-]+)", m.group(2))
            kind = re.search(r"\b(conditional|while|fusion|call)\(", line)
            for name in names:
                if kind and kind.group(1) == "fusion":
                    fused.add(name)
                callers[name] = " ".join(t for t in (kind.group(1) if kind else "", _origin(line, tables)) if t)
    in_place = {name for name in fused if roots.get(name) in ("scatter", "dynamic-update-slice")}
    computation = "ENTRY"
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            computation = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m or computation in fused or m.group(3) in _NO_NEW_BUFFER:
            continue
        if m.group(3) == "fusion" and (c := re.search(r"calls=%([\w.\-]+)", line)) and c.group(1) in in_place:
            continue
        arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(m.group(2))
                  if dtype in _SIZES]
        if not arrays:
            continue
        dtype, dims = max(arrays, key=lambda a: _SIZES[a[0]] * math.prod(a[1]))  # an async start: its result
        size = _SIZES[dtype] * math.prod(dims)
        if size < min_bytes:
            continue
        origin = _origin(line, tables) or (f"in a {callers[computation]}" if computation in callers else "")
        found.append(Buffer(size, dtype, dims, m.group(3), m.group(1), computation, origin))
    return sorted(found, key=lambda b: -b.bytes)


def compile_for_h100(fn, args: tuple, kwargs: dict):
    """Trace, lower and compile one program for H100 (:mod:`kernels_pallas`
    shaped for it: :func:`kernels_pallas.building_for`)."""
    from kernels_pallas import H100, building_for

    with building_for(H100):
        lowered = fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered.compile()


def compile_program(setup: Setup, label: str, fn, args: tuple, kwargs: dict) -> Result:
    """One program compiled for H100 (:func:`compile_for_h100`) and its
    memory analysis; a failure is reported in the result."""
    started = time.perf_counter()
    result = Result(setup.spec.name, setup.mesh_name, label, 0.0, 0, 0, 0, 0, setup.cache_bytes)
    try:
        compiled = compile_for_h100(fn, args, kwargs)
    except Exception as e:  # noqa: BLE001  the error is the report
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        result.seconds = time.perf_counter() - started
        return result
    result.seconds = time.perf_counter() - started
    stats = compiled.memory_analysis()
    result.argument_bytes = int(stats.argument_size_in_bytes)
    result.output_bytes = int(stats.output_size_in_bytes)
    result.temp_bytes = int(stats.temp_size_in_bytes)
    result.alias_bytes = int(stats.alias_size_in_bytes)
    hlo = compiled.as_text()
    result.rematerialized = len(_REMATERIALIZED.findall(hlo))
    if result.defect:  # what the temporaries are: the cache's arrays made anew, else the largest buffers
        largest = max(_device_bytes(leaf) for leaf in jax.tree.leaves(setup.cache))
        buffers = big_buffers(hlo, min(largest // 10, result.temp_bytes // 20))
        made = [b for b in buffers if setup.cache_dims.intersection(b.dims)]
        result.cache_buffers, result.cache_made_bytes = [b.describe() for b in made], sum(b.bytes for b in made)
        result.largest = [b.describe() for b in buffers[:5]]
    return result


def run(names=None, *, quick: bool = False, prefill: bool = False, buckets=None, on_result=None,
        stacked: bool = False, local: bool = False, speculative: bool = False) -> list[Result]:
    """Compile the programs of the models ``names`` (default all of
    :data:`MODELS`; ``quick``: :data:`QUICK`); ``buckets``: the packed
    buckets to compile (``"all"``, ``"ends"``: the smallest and the largest,
    or a list of ints; default all); ``speculative``: speculative
    decoding's programs too (``spec``, ``verify:first`` and
    ``verify:last``). ``on_result(setup, result)`` is called after each
    compile."""
    specs = {spec.name: spec for spec in MODELS}
    names = list(QUICK) if quick and names is None else list(names or specs)
    results = []
    for name in names:
        setup = build(specs[name], stacked=stacked, local=local)
        if quick:
            which = list(QUICK.get(name, ("decode",)))
        elif buckets in (None, "all"):
            which = None
        else:
            picks = ["first", "last"] if buckets == "ends" else [str(int(n)) for n in buckets]
            which = [f"packed:{b}" for b in picks] + ["decode"] + (["prefill"] if prefill else [])
        if speculative:  # speculative decoding's programs too (the packed verify step at both ends)
            which = list(which) if which is not None else [f"packed:{n}" for n in setup.buckets] + ["decode"] + (
                ["prefill"] if prefill else [])
            which += ["spec", "verify:first", "verify:last"]
        for label, fn, args, kwargs in programs(setup, which, prefill=prefill):
            result = compile_program(setup, label, fn, args, kwargs)
            results.append(result)
            if on_result is not None:
                on_result(setup, result)
        jax.clear_caches()
    return results


# --------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------

COLUMNS = ["model", "mesh", "program", "compile s", "argument GB", "output GB", "temp GB", "alias GB", "cache GB",
           "peak GB", "remat", "verdict"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench engine_aot")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated, of {', '.join(spec.name for spec in MODELS)} (default all)")
    parser.add_argument("--buckets", default="all",
                        help="packed buckets: all (default), ends (smallest and largest), or comma-separated lengths")
    parser.add_argument("--prefill", action="store_true", help="also the padded scheduler's prefill call")
    parser.add_argument("--speculative", action="store_true",
                        help="also speculative decoding's programs: the spec chunk, packed verify steps")
    parser.add_argument("--layers", choices=("stacked", "per-layer"), default="per-layer",
                        help="stacked under a scan, or a parameter per layer (default: what a GPU builds)")
    parser.add_argument("--local", action="store_true",
                        help="compile for this machine's own GPUs (their JAX's XLA) instead of a deviceless H100")
    return parser


def parse_extra(args, rest: list[str]):
    """This benchmark's flags (``python -m jaxkv.bench``'s hook)."""
    extra = _parser().parse_args(rest)
    for name, value in vars(extra).items():
        setattr(args, name, value)
    return args


def _describe(setup: Setup) -> str:
    groups = ", ".join(f"{name} {n}" for name, n in setup.blocks.items())
    return (f"{setup.spec.name} on {setup.mesh_name}: weights {setup.weights_bytes / GB:.1f} GB/device, KV budget "
            f"{setup.budget_bytes / GB:.1f} GB ({setup.budget_rule}, {80 - setup.weights_bytes / GB:.1f} GB left), "
            f"programs' temporaries {setup.program_bytes / GB:.2f} GB, cache "
            f"{setup.cache_bytes / GB:.1f} GB/device ({setup.kind}: blocks {groups}"
            + (f", {setup.snapshots} snapshot rows" if setup.kind == "hybrid" else "")
            + f"); max_seqs {setup.max_seqs}, max_num_batched_tokens {setup.max_num_batched_tokens}, decode_chunk "
            f"{setup.decode_chunk}, max_model_len {setup.max_model_len} ({setup.sizing_note})")


def _explained(result: Result, n: int = 3) -> list[str]:
    """What a defect row's temporaries are: the buffers made from the cache
    (their count and bytes, the first ``n``), then the largest buffers."""
    lines = []
    if result.cache_buffers:
        lines.append(f"{len(result.cache_buffers)} buffers made from the cache, {result.cache_made_bytes / GB:.1f} GB "
                     "summed:")
        lines += [f"  {line}" for line in result.cache_buffers[:n]]
    if result.largest and result.verdict != "POOL-SIZED TEMP":
        lines.append("largest buffers:")
        lines += [f"  {line}" for line in result.largest[:n]]
    return lines


def main(args=None) -> int:
    """Print the table (and with ``--json`` one JSON line); exit status 1
    on a defect (module docstring) or a program that failed to compile, 2
    without the CUDA plugin."""
    if args is None or isinstance(args, list):
        parser = _parser()
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--quick", action="store_true")
        args = parser.parse_args(args)
    stacked = getattr(args, "layers", "per-layer") == "stacked"
    local = bool(getattr(args, "local", False))
    if local and jax.default_backend() != "gpu":
        print(f"--local compiles for this machine's GPUs: the default backend is {jax.default_backend()}")
        return 2
    if not local and not cuda_available():
        print("engine_aot compiles for H100 without a GPU: it needs pip install 'jax[cuda12]>=0.10,<0.11' "
              "(and JAX_PLATFORMS=cpu on a machine without a GPU)")
        return 2
    models = getattr(args, "models", None)
    buckets = getattr(args, "buckets", "all")
    if buckets not in ("all", "ends"):
        buckets = [int(b) for b in buckets.split(",")]
    setups = {}

    def progress(setup, result):
        if setup.spec.name not in setups:
            setups[setup.spec.name] = _describe(setup)
            print(setups[setup.spec.name], flush=True)
        figures = ", ".join(f"{name} {value / GB:.3g}" for name, value in (
            ("argument", result.argument_bytes), ("output", result.output_bytes), ("temp", result.temp_bytes),
            ("alias", result.alias_bytes), ("cache", result.cache_bytes), ("peak", result.peak_bytes)))
        print(f"  {result.program}: {result.seconds:.1f} s; GB {figures}; {result.verdict}"
              + (f" ({result.error})" if result.error else ""), flush=True)
        for line in _explained(result):
            print(f"    {line}", flush=True)

    started = time.perf_counter()
    results = run(models.split(",") if models else None, quick=args.quick, prefill=getattr(args, "prefill", False),
                  buckets=buckets, on_result=progress, stacked=stacked, local=local,
                  speculative=getattr(args, "speculative", False))
    total = time.perf_counter() - started
    target = f"{jax.devices()[0].device_kind}, local" if local else "H100 (deviceless"
    layers = "stacked" if stacked else "per layer"
    print_table(f"The engine's programs compiled for {target}, jax {jax.__version__}, layers {layers}); bytes per "
                f"device from compiled.memory_analysis(); {total:.0f} s in all",
                COLUMNS, [r.row() for r in results])
    defects = [r for r in results if r.defect]
    if defects:
        print(f"\n{len(defects)} defect(s):")
        for r in defects:
            print(f"  {r.model} {r.program}: {r.verdict}" + (f": {r.error}" if r.error else ""))
            for line in _explained(r):
                print(f"    {line}")
    if args.json:
        print_json({"benchmark": "engine_aot", "jax": jax.__version__, "seconds": total, "setups": setups,
                    "results": [dict(dataclasses.asdict(r), verdict=r.verdict, peak_bytes=r.peak_bytes)
                                for r in results]})
    return 1 if defects else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
