"""One sizing rule for every model family: from a byte budget and the
longest request to pages, blocks per group, snapshots and host pages.

The engine (:class:`jaxkv.serve.Engine`) sizes its cache from two numbers:

* ``max_model_len``: the longest request, prompt plus output. Default:
  ``min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)`` (4096), on
  a CPU backend ``min(config.max_position_embeddings,
  CPU_DEFAULT_MAX_MODEL_LEN)`` (1024). The positions a checkpoint supports
  are often far more than a default run needs, and the block tables are
  that wide: the pure-JAX reference attention the CPU runs reads a row's
  whole table for every decode step and, on a hybrid cache, for every
  prefill token (a Qwen3-Next prefill call at 4096 took 15 s and 4 GB on
  the CPU, at 256 well under one).
* ``kv_cache_memory``: the bytes the cache may take on the device, as an
  int, or a float in ``(0, 1]``: that fraction of the device's free memory
  (:func:`device_free_bytes`: ``bytes_limit - bytes_in_use`` of
  ``jax.devices()[0].memory_stats()``; on a device without memory
  statistics, the CPU, :data:`CPU_FREE_BYTES` = 1 GiB stands for it).
  Default: ``DEFAULT_MEMORY_FRACTION`` (0.8) of the free memory, but never
  more than every sequence row at ``max_model_len`` needs (``max_seqs *
  blocks_for(max_model_len)`` blocks per group: the old default of both
  caches), so a small model does not take the whole device unasked. An
  explicit ``kv_cache_memory`` is used whole. On an accelerator the default
  also leaves room for the engine's programs: their temporaries, read from
  XLA's compiled memory analysis before the cache is allocated, and a
  margin (:mod:`jaxkv.serve.program_memory`,
  :func:`jaxkv.serve.build.room_for_programs`; ``program_memory`` gives the
  bytes instead).

From the budget (:func:`solve`): the bytes the cache costs are an exact
affine function of its block counts, measured from the shapes and dtypes of
the arrays the model's ``make_pool`` / ``make_cache`` and the block manager
would allocate (``jax.eval_shape``; nothing is allocated): fixed bytes
(block tables, allocators, per-request state rows: SWA and compressor rings,
GDN states) plus, per group, the bytes one more block costs (its K/V or
compressed entries in every layer of the group, and its allocator entries).
Every group gets blocks for the same number of tokens ``T``, the largest
``T`` whose cost fits, so the cache's bytes are at most the budget and
less than one block per group below it. Before that:

* **snapshots** (hybrid caches with a prefix cache): ``min(2 * max_seqs,
  what fits in a quarter of the budget)`` cached snapshots, plus one
  staging snapshot per sequence row; none (prefix cache off) when not even
  one fits;
* **host pages** (paged pool): ``host_kv_memory`` bytes of host memory for
  swapped-out pages (default 0: preemption by recomputation).

The result is a :class:`CachePlan` (``engine.cache_plan``), logged at
start-up on the ``jaxkv.serve`` logger, one INFO line per group: the tokens
it holds, its bytes per token and the prefix-hit unit.

**On a mesh** every figure is one device's: the budget is one device's
(the least free memory of the mesh's devices), and the bytes a block costs
are what one device holds of it, each array divided as its sharding
divides it (:func:`device_bytes`, :func:`jaxkv.nn.sharding.cache_sharding`):
a KV pool whose heads split over ``tp`` costs each device ``1/tp`` of a
block, so the same per-device budget buys ``tp`` times the tokens; a
latent cache (MLA pages, DeepSeek-V4's entries), replicated, buys the same
tokens as on one device. The plan's bytes are then per device too.

**Scheduler defaults** (issue 41; :func:`scheduler_defaults`, a pure
function of the numbers so that a test can call it with a GPU's): the
platform decides. On a CPU the small defaults stay (``max_seqs`` 8, a
token budget of ``prefill_chunk`` (256) per iteration, ``decode_chunk``
8): a 2-core CPU gains nothing from wider batches and the pure-JAX
attention pays for every padded row. On an accelerator (any other
platform: ``gpu``, ``tpu``), with ``T`` the tokens the KV budget holds on
one device (the budget over one device's bytes per token: the model's
bytes per token over the ``split`` of a head-split cache):

* ``max_seqs = min(GPU_MAX_SEQS (256), floor(budget / (bytes_per_row +
  min(max_model_len, TYPICAL_CONTEXT (1024)) * bytes_per_token)))``,
  rounded down to a multiple of 8 from 8 up, at least 1: as many rows as
  the cache gives a typical chat context each (prompt plus answer), up to
  vLLM's 256. A row the cache cannot fill only pads: every decode call
  computes ``max_seqs`` lanes, and each row costs its per-request state
  (``bytes_per_row``: a block-table row; a hybrid cache's SWA rings and
  GDN states, large for Qwen3-Next). Multiples of 8 keep the decode
  matmuls' batch dimension tensor-core aligned (a single batch shape is
  compiled whatever the value, so nothing else needs rounding).
* ``max_num_batched_tokens = max(min(GPU_MAX_NUM_BATCHED_TOKENS (8192), T,
  max_seqs * max_model_len), max_seqs)``: vLLM's server default on an
  H100, but never more than the cache can hold in flight (a packed step's
  prompt tokens all need cache slots), and at least one token per row (a
  packed step carries every decoding row's token). The packed stream
  compiles one program per bucket up to it (16, 32, 48, ..., 6144, 8192:
  18 programs at 8192).
* ``decode_chunk = GPU_DECODE_CHUNK (16)``. A decode chunk is one jitted
  ``lax.while_loop`` of that many steps and one host round trip (the
  ``[max_seqs, decode_chunk]`` tokens come back, the host does its
  ``O(max_seqs)`` bookkeeping: a few ms at 256 rows). A decode step reads
  the weights and the rows' K/V once: on an H100 (3.35 TB/s) roughly 1-3
  ms for a 1B model and 10-30 ms for an 8B model at a full batch (an
  estimate from those bytes, not measured here), so 16 steps keep the
  host's share near 10% or below where 8 would not for small models. The
  price is latency: a request that arrives during a chunk waits for it (at
  most 16 steps: tens of ms on a small model, ~0.3 s on an 8B model at a
  full batch; while prompts are being prefilled the engine runs packed
  steps of one token per row instead), and a row that finishes mid-chunk
  idles to its end. The admission reserve (each running row's growth over
  one chunk) is 16 tokens a row, well under 1% of a GPU's cache.
* ``prefill_chunk = max_num_batched_tokens`` with the packed scheduler
  (the default): the most prompt tokens one row brings to one iteration,
  so a prompt that fits the token budget is prefilled in one step and its
  first token comes one iteration after admission (vLLM's chunked prefill
  gives one request the whole budget too); 256 would cut a 2k-token prompt
  into eight iterations. With the padded scheduler it stays 256: its
  prefill call is ``[max_seqs, prefill_chunk]`` tokens whatever the prompts.

Options the user gives always win (a plain int; the defaults are
:class:`~jaxkv.serve.options.Derived` markers); the derived values, with
the numbers behind them, are logged at start-up
(:meth:`SchedulerDefaults.lines`) and are the values of the engine's
``options``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid_schema import block_bytes
from jaxkv.serve.options import SchedulerOptions

__all__ = ["CPU_DEFAULT_MAX_MODEL_LEN", "CPU_FREE_BYTES", "DEFAULT_MAX_MODEL_LEN", "DEFAULT_MEMORY_FRACTION",
           "GPU_DECODE_CHUNK", "GPU_MAX_NUM_BATCHED_TOKENS", "GPU_MAX_SEQS", "TYPICAL_CONTEXT", "CachePlan",
           "GroupPlan", "SchedulerDefaults", "default_max_model_len", "device_bytes", "device_free_bytes",
           "free_memory", "mesh_free_bytes", "resolve_budget", "scheduler_defaults", "solve", "tree_bytes"]

#: ``max_model_len`` when none is given: ``min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)``.
DEFAULT_MAX_MODEL_LEN = 4096
#: The same on a CPU backend (see the module docstring).
CPU_DEFAULT_MAX_MODEL_LEN = 1024
#: The fraction of the device's free memory the cache takes by default (capped, see the module docstring).
DEFAULT_MEMORY_FRACTION = 0.8
#: What stands for "free memory" on a device whose ``memory_stats()`` says nothing (the CPU): 1 GiB.
CPU_FREE_BYTES = 1 << 30
#: An accelerator's most sequence rows by default (vLLM's ``--max-num-seqs`` on an H100).
GPU_MAX_SEQS = 256
#: An accelerator's token budget per scheduler iteration by default (vLLM's server on an H100).
GPU_MAX_NUM_BATCHED_TOKENS = 8192
#: An accelerator's decode steps per jitted call by default (see the module docstring).
GPU_DECODE_CHUNK = 16
#: The context each sequence row should have room for when ``max_seqs`` is derived (prompt plus answer
#: of a typical chat turn; ``max_model_len`` when that is shorter).
TYPICAL_CONTEXT = 1024


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return int(sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


def _parts(sharding) -> int:
    """Into how many pieces a ``NamedSharding`` (its ``spec`` over its
    mesh's axis sizes; a ``Mesh`` or an ``AbstractMesh``) cuts an array."""
    shape = dict(sharding.mesh.shape)
    parts = 1
    for entry in sharding.spec:
        for name in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
            parts *= int(shape[name])
    return parts


def device_bytes(tree, shardings=None) -> int:
    """Bytes ONE device holds of ``tree``'s arrays when placed by
    ``shardings`` (a ``NamedSharding`` per leaf, shaped like ``tree``; None:
    every array whole, :func:`tree_bytes`): each leaf's bytes over the
    pieces its sharding cuts it into (the rules of :mod:`jaxkv.nn.sharding`
    split a dimension only where the axis divides it, so this is exact)."""
    if shardings is None:
        return tree_bytes(tree)
    leaves = jax.tree.leaves(tree)
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(leaves) != len(specs):
        raise ValueError(f"device_bytes: {len(leaves)} arrays but {len(specs)} shardings")
    return int(sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // _parts(spec)
                   for leaf, spec in zip(leaves, specs)))


def device_free_bytes(device=None) -> int | None:
    """Free bytes of ``device`` (default ``jax.devices()[0]``) from its
    ``memory_stats()``: ``bytes_limit - bytes_in_use``; None when the device
    keeps no statistics (the CPU)."""
    device = jax.devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without statistics raise or return None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return max(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), 0)


def default_max_model_len(model, platform: str | None = None) -> int:
    """``min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)``, on a
    CPU backend (``platform``, default ``jax.devices()[0].platform``) with
    ``CPU_DEFAULT_MAX_MODEL_LEN``; the cap alone for a model without the
    field."""
    platform = jax.devices()[0].platform if platform is None else platform
    cap = CPU_DEFAULT_MAX_MODEL_LEN if platform == "cpu" else DEFAULT_MAX_MODEL_LEN
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return cap if not positions else min(int(positions), cap)


def mesh_free_bytes(mesh) -> int | None:
    """The least free bytes of ``mesh``'s devices of this process (the
    budget every device can afford); None when one keeps no statistics (the
    CPU) or the mesh has no devices (an ``AbstractMesh``)."""
    if not isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh has no devices
        return None
    free = []
    for device in mesh.devices.flat:
        if getattr(device, "process_index", 0) != jax.process_index():
            continue
        value = device_free_bytes(device)
        if value is None:
            return None
        free.append(value)
    return min(free) if free else None


def resolve_budget(kv_cache_memory, *, free_bytes: int | None = None) -> tuple[int, str]:
    """``kv_cache_memory`` (int bytes >= 1, or a float in ``(0, 1]``: a
    fraction of the free memory) as ``(bytes, description)``. ``free_bytes``
    overrides :func:`device_free_bytes` (tests). Raises ``InvalidArgument``
    for anything else."""
    value = kv_cache_memory
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgument(f"kv_cache_memory={value!r}: give bytes (an int >= 1) or a fraction of the device's "
                              "free memory (a float in (0, 1])")
    if isinstance(value, (int, np.integer)):
        if value < 1:
            raise InvalidArgument(f"kv_cache_memory={value}: bytes must be >= 1")
        return int(value), f"kv_cache_memory={int(value)} bytes"
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise InvalidArgument(f"kv_cache_memory={value}: a fraction of the device's free memory must be in (0, 1] "
                              "(give an int for bytes)")
    free, where = free_memory(free_bytes)
    return int(value * free), f"kv_cache_memory={value} of {free} free bytes ({where})"


def free_memory(free_bytes: int | None = None) -> tuple[int, str]:
    """The free device bytes the sizing rule reads and where they came
    from: ``free_bytes`` when given, else :func:`device_free_bytes`, else
    (no memory statistics: the CPU) :data:`CPU_FREE_BYTES`."""
    if free_bytes is not None:
        return int(free_bytes), "given"
    free = device_free_bytes()
    if free is None:
        return CPU_FREE_BYTES, f"{jax.devices()[0].platform}: no memory statistics, CPU_FREE_BYTES stands for it"
    return free, f"{jax.devices()[0].device_kind}: memory_stats"


def default_budget(free_bytes: int | None = None) -> tuple[int, str]:
    """The default budget (before the every-row cap): ``DEFAULT_MEMORY_FRACTION``
    of the free memory."""
    free, where = free_memory(free_bytes)
    return int(DEFAULT_MEMORY_FRACTION * free), f"default {DEFAULT_MEMORY_FRACTION} of {free} free bytes ({where})"


def solve(budget: int, fixed: int, per_block: Sequence[int], tokens_per_block: Sequence[int]) -> list[int] | None:
    """Allocatable blocks per group for the largest token count ``T`` that
    every group holds (``floor(T / tokens_per_block[g])`` blocks) with
    ``fixed + sum(per_block[g] * (blocks[g] + 1))`` (the ``+ 1``: each
    group's null block) at most ``budget``; None when not even one block per
    group fits. The bytes left over are less than ``sum(per_block)``: the
    next token count that adds a block costs more than the budget."""
    def cost(tokens: int) -> int:
        return fixed + sum(b * (tokens // t + 1) for b, t in zip(per_block, tokens_per_block))

    least = max(tokens_per_block)  # every group has a block
    if cost(least) > budget:
        return None
    rate = sum(b / t for b, t in zip(per_block, tokens_per_block))
    lo = least
    hi = int((budget - fixed) / rate) + max(tokens_per_block) + 2 if rate > 0 else least
    if cost(hi) <= budget:  # nothing grows with the tokens (no per-block bytes): one block each
        hi = lo
    while lo < hi:  # the largest token count that fits
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return [lo // t for t in tokens_per_block]


@dataclasses.dataclass(frozen=True)
class SchedulerDefaults:
    """The scheduler options a platform and a KV budget call for
    (:func:`scheduler_defaults`; the rule is in the module docstring).
    ``max_num_batched_tokens`` None: ``prefill_chunk`` (the CPU's);
    ``tokens``: the tokens the budget holds on one device (None on a CPU,
    where nothing is measured); ``reasons``: each value's derivation, in
    words with the numbers (:meth:`lines`)."""

    platform: str
    max_seqs: int
    max_num_batched_tokens: int | None
    decode_chunk: int
    tokens: int | None
    reasons: tuple[str, ...]
    prefill_chunk: int = 256

    def values(self) -> dict:
        """The derived options by name."""
        return dict(max_seqs=self.max_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    decode_chunk=self.decode_chunk, prefill_chunk=self.prefill_chunk)

    def lines(self, names=None) -> list[str]:
        """The start-up log: one line per derived option (of ``names``, when
        given: the options left to derive; a CPU's one line names them all)."""
        keep = [r for r in self.reasons if names is None or r.split("=", 1)[0] in names] or list(self.reasons[:1])
        return [f"scheduler default ({self.platform}): {reason}" for reason in keep]


def scheduler_defaults(platform: str, budget_bytes: int, bytes_per_token: float, max_model_len: int,
                       split: float = 1, *, bytes_per_row: float = 0,
                       max_seqs: int | None = None, packed: bool = True) -> SchedulerDefaults:
    """``max_seqs``, ``max_num_batched_tokens`` and ``decode_chunk`` for a
    device of ``platform`` (``jax.Device.platform``: ``"cpu"`` keeps the
    small defaults; any other gets the accelerator rule of the module
    docstring) whose KV budget is ``budget_bytes`` (one device's), for a
    model whose cache costs ``bytes_per_token`` per token on one device
    unsplit, split ``split`` ways on a mesh (``tp`` when the KV heads split
    over ``tp``, 1 when the cache is replicated; a fraction between for a
    cache split in part), ``bytes_per_row`` per sequence row on one device
    (per-request state, a block-table row), with requests of at most
    ``max_model_len`` tokens. ``max_seqs``: a value the user gave (it bounds
    the token budget; the returned ``max_seqs`` is then that value).
    ``packed``: the scheduler is the packed one (``prefill_chunk`` follows
    the token budget; the padded one keeps 256). Pure: nothing is measured
    or allocated."""
    defaults = SchedulerOptions()  # the CPU's values are the options' own defaults
    chunk = int(defaults.prefill_chunk)
    if platform == "cpu":
        rows = int(defaults.max_seqs) if max_seqs is None else int(max_seqs)
        return SchedulerDefaults(platform, rows, None, int(defaults.decode_chunk), None, (
            f"max_seqs={rows}, max_num_batched_tokens=None (prefill_chunk, {chunk}), "
            f"decode_chunk={int(defaults.decode_chunk)}, prefill_chunk={chunk}: a CPU keeps the small defaults",),
            chunk)
    if budget_bytes < 1 or bytes_per_token <= 0 or max_model_len < 1 or split < 1:
        raise InvalidArgument(f"scheduler_defaults: budget_bytes={budget_bytes}, bytes_per_token={bytes_per_token}, "
                              f"max_model_len={max_model_len}, split={split}: need a budget >= 1 byte, bytes per "
                              "token > 0, max_model_len >= 1 and split >= 1")
    per_token = bytes_per_token / split
    tokens = int(budget_bytes // per_token)
    typical = min(max_model_len, TYPICAL_CONTEXT)
    row = bytes_per_row + typical * per_token
    fit = int(budget_bytes // row)
    where = (f"{budget_bytes} budget bytes / {per_token:g} bytes per token"
             + (f" ({bytes_per_token:g} split {split:g} ways)" if split > 1 else "") + f" = {tokens} tokens")
    if max_seqs is None:
        rows = min(GPU_MAX_SEQS, fit)
        rows = max(rows - rows % 8 if rows >= 8 else rows, 1)
        why_rows = (f"max_seqs={rows}: min({GPU_MAX_SEQS}, {fit} rows of {typical} tokens"
                    + (f" and {bytes_per_row:g} bytes of per-row state" if bytes_per_row else "")
                    + f" in {where}), a multiple of 8, at least 1")
    else:
        rows = int(max_seqs)
        why_rows = f"max_seqs={rows}: given"
    batched = max(min(GPU_MAX_NUM_BATCHED_TOKENS, tokens, rows * max_model_len), rows)
    why_batched = (f"max_num_batched_tokens={batched}: max(min({GPU_MAX_NUM_BATCHED_TOKENS}, {tokens} tokens the "
                   f"cache holds, {rows} rows * max_model_len {max_model_len}), {rows} rows)")
    why_chunk = (f"decode_chunk={GPU_DECODE_CHUNK}: one jitted call and host round trip per {GPU_DECODE_CHUNK} "
                 "decode steps (dispatch and O(max_seqs) host work amortized; arrivals wait at most one chunk)")
    prefill = batched if packed else chunk
    why_prefill = (f"prefill_chunk={prefill}: " + ("the token budget: a prompt that fits it is prefilled in one "
                                                   "iteration" if packed else
                                                   "the padded scheduler's [max_seqs, prefill_chunk] call keeps 256"))
    return SchedulerDefaults(platform, rows, batched, GPU_DECODE_CHUNK, tokens,
                             (why_rows, why_batched, why_chunk, why_prefill), prefill)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One block group of the cache: ``blocks`` allocatable blocks (the null
    block apart) of ``tokens_per_block`` tokens, ``tokens`` = what they
    hold; ``bytes_per_token``: the K/V (or compressed-entry) bytes one token
    costs across the group's layers, from their shapes and dtypes;
    ``bytes_per_block``: the device bytes one more block costs (storage and
    allocator entries); ``bytes``: the device bytes of the group's blocks,
    the null block included."""

    name: str
    blocks: int
    tokens_per_block: int
    tokens: int
    bytes_per_token: float
    bytes_per_block: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """How the engine's cache was sized (``engine.cache_plan``).

    ``cache``: ``"paged"`` or ``"hybrid"``; ``max_model_len``: the longest
    request (prompt + output) it accepts; ``max_seqs``: sequence rows;
    ``groups``: a :class:`GroupPlan` per block group; ``prefix_unit_tokens``:
    the smallest prefix a hit serves (a page; the least common multiple of
    the groups' blocks for a hybrid cache); ``num_snapshots``: cached prefix
    snapshots (hybrid) and ``snapshot_bytes`` the per-request state one
    costs; ``host_pages`` / ``host_bytes``: the swap pool in host memory;
    ``device_bytes``: every device array of the cache (pools, tables,
    allocators, state rows), measured from the arrays; ``budget_bytes``: the
    budget it was sized from (None: block counts given as expert options,
    or the default cap of every row at ``max_model_len``); ``source``: where
    the sizes came from, in words; ``checkpoint_rows``: speculation's
    checkpoint state rows of a hybrid cache (one per sequence row, each of
    ``snapshot_bytes``; 0 without speculation), counted in ``device_bytes``;
    ``program_bytes``: device bytes the sizing kept free beside the cache for
    the engine's programs (their largest temporaries, measured or given as
    ``program_memory``; 0: none counted, the default fraction's headroom
    only), margin not included (:mod:`jaxkv.serve.program_memory`).
    """

    cache: str
    max_model_len: int
    max_seqs: int
    groups: tuple[GroupPlan, ...]
    prefix_unit_tokens: int
    num_snapshots: int
    snapshot_bytes: int
    host_pages: int
    host_bytes: int
    device_bytes: int
    budget_bytes: int | None
    source: str
    checkpoint_rows: int = 0
    program_bytes: int = 0

    def group(self, name: str) -> GroupPlan:
        return next(g for g in self.groups if g.name == name)

    def lines(self) -> list[str]:
        """The start-up log: a header, then one line per group."""
        head = (f"KV cache ({self.cache}): {self.device_bytes} device bytes"
                + (f" of a {self.budget_bytes}-byte budget" if self.budget_bytes is not None else "")
                + f" [{self.source}]; {self.max_seqs} sequence rows, max_model_len {self.max_model_len}")
        if self.cache == "hybrid":
            head += f", {self.num_snapshots} cached snapshots of {self.snapshot_bytes} bytes"
        if self.checkpoint_rows:
            head += (f", {self.checkpoint_rows} speculation checkpoint rows "
                     f"({self.checkpoint_rows * self.snapshot_bytes} bytes)")
        if self.host_pages:
            head += f", {self.host_pages} host pages ({self.host_bytes} bytes)"
        return [head] + [
            f"KV cache group {g.name!r}: {g.tokens} tokens ({g.blocks} blocks of {g.tokens_per_block}), "
            f"{g.bytes_per_token:g} bytes per token, prefix hit unit {self.prefix_unit_tokens} tokens"
            for g in self.groups]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def affine_bytes(measure: Callable[[list[int]], int], num_groups: int) -> tuple[int, list[int]]:
    """``(fixed, per_block)`` with ``measure(counts) == fixed + sum(per_block[g]
    * counts[g])`` for block counts (null block included), from ``1 +
    num_groups`` measurements (every group at 2 blocks, then one group at 3)."""
    base_counts = [2] * num_groups
    base = measure(base_counts)
    per_block = []
    for g in range(num_groups):
        counts = list(base_counts)
        counts[g] = 3
        per_block.append(measure(counts) - base)
    return base - 2 * sum(per_block), per_block


@dataclasses.dataclass(frozen=True)
class HybridBytes:
    """What a hybrid :class:`~jaxkv.KVCacheManager` costs, from its shapes:
    ``per_token`` K/V (or compressed-entry) bytes of one token across every
    group; ``per_block[g]`` the storage bytes of one block of group ``g``
    (all its layers); ``per_state_row`` what cannot be shared per token
    (rings, windows, recurrent state, tables) per state row (request
    slots, the null slot and snapshot rows alike)."""

    per_token: float
    per_block: tuple[int, ...]
    per_state_row: float


def hybrid_bytes(manager) -> HybridBytes:
    """The :class:`HybridBytes` of ``manager`` (static shapes only)."""
    config, schemas = manager.config, manager.schemas
    per_block = tuple(sum(block_bytes(s, config) for s in schemas if s.group == name) for name in manager.groups)
    capacity = {name: g.allocator.capacity for name, g in manager.groups.items()}
    blocks = sum(block_bytes(s, config) * (capacity[s.group] + 1) for s in schemas if s.group is not None)
    return HybridBytes(per_token=sum(block_bytes(s, config) / s.tokens_per_block for s in schemas if s.group is not None),
                       per_block=per_block,
                       per_state_row=(manager.memory_bytes() - blocks) / (manager.num_slots + manager.num_snapshots))


def hybrid_plan(manager, *, max_seqs: int, max_model_len: int, unit: int, num_snapshots: int, host_bytes: int,
                budget: int | None, source: str, per_block: Sequence[int] | None = None,
                checkpoint_rows: int = 0) -> CachePlan:
    """The :class:`CachePlan` of a hybrid cache over ``manager``; ``per_block``:
    the measured device bytes one more block of each group costs (default:
    its storage alone)."""
    costs = hybrid_bytes(manager)
    groups = []
    for g, (name, group) in enumerate(manager.groups.items()):
        cost = costs.per_block[g] if per_block is None else int(per_block[g])
        blocks = int(group.allocator.capacity)
        groups.append(GroupPlan(name, blocks, group.tokens_per_block, blocks * group.tokens_per_block,
                                costs.per_block[g] / group.tokens_per_block, cost, cost * (blocks + 1)))
    return CachePlan(cache="hybrid", max_model_len=max_model_len, max_seqs=max_seqs, groups=tuple(groups),
                     prefix_unit_tokens=unit, num_snapshots=num_snapshots, snapshot_bytes=int(costs.per_state_row),
                     host_pages=0, host_bytes=host_bytes, device_bytes=manager.memory_bytes(), budget_bytes=budget,
                     source=source, checkpoint_rows=checkpoint_rows)
