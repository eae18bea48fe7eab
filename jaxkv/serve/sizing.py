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
  explicit ``kv_cache_memory`` is used whole.

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid_schema import block_bytes

__all__ = ["CPU_DEFAULT_MAX_MODEL_LEN", "CPU_FREE_BYTES", "DEFAULT_MAX_MODEL_LEN", "DEFAULT_MEMORY_FRACTION", "CachePlan", "GroupPlan",
           "default_max_model_len", "device_free_bytes", "resolve_budget", "solve", "tree_bytes"]

#: ``max_model_len`` when none is given: ``min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)``.
DEFAULT_MAX_MODEL_LEN = 4096
#: The same on a CPU backend (see the module docstring).
CPU_DEFAULT_MAX_MODEL_LEN = 1024
#: The fraction of the device's free memory the cache takes by default (capped, see the module docstring).
DEFAULT_MEMORY_FRACTION = 0.8
#: What stands for "free memory" on a device whose ``memory_stats()`` says nothing (the CPU): 1 GiB.
CPU_FREE_BYTES = 1 << 30


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return int(sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


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
    free, where = _free(free_bytes)
    return int(value * free), f"kv_cache_memory={value} of {free} free bytes ({where})"


def _free(free_bytes: int | None) -> tuple[int, str]:
    if free_bytes is not None:
        return int(free_bytes), "given"
    free = device_free_bytes()
    if free is None:
        return CPU_FREE_BYTES, f"{jax.devices()[0].platform}: no memory statistics, CPU_FREE_BYTES stands for it"
    return free, f"{jax.devices()[0].device_kind}: memory_stats"


def default_budget(free_bytes: int | None = None) -> tuple[int, str]:
    """The default budget (before the every-row cap): ``DEFAULT_MEMORY_FRACTION``
    of the free memory."""
    free, where = _free(free_bytes)
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
    the sizes came from, in words.
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

    def group(self, name: str) -> GroupPlan:
        return next(g for g in self.groups if g.name == name)

    def lines(self) -> list[str]:
        """The start-up log: a header, then one line per group."""
        head = (f"KV cache ({self.cache}): {self.device_bytes} device bytes"
                + (f" of a {self.budget_bytes}-byte budget" if self.budget_bytes is not None else "")
                + f" [{self.source}]; {self.max_seqs} sequence rows, max_model_len {self.max_model_len}")
        if self.cache == "hybrid":
            head += f", {self.num_snapshots} cached snapshots of {self.snapshot_bytes} bytes"
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
                budget: int | None, source: str, per_block: Sequence[int] | None = None) -> CachePlan:
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
                     source=source)
