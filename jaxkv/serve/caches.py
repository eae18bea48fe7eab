"""The cache interface the engine schedules over, and its two implementations.

The engine (:mod:`jaxkv.serve.engine`) decides who runs; a cache owns every
device array of the model's KV state and the jitted steps that touch it. The
engine asks a cache only these questions, all on the host, in units the cache
defines:

* ``groups`` / ``capacity`` / :meth:`free_blocks`: the block groups (one for
  a paged pool; one per kind and ratio for a hybrid cache), how many blocks
  each can hand out and how many are free now (numpy ``[G]`` vectors: the
  engine adds and compares them group by group);
* :meth:`blocks_for` ``(num_tokens)``: the blocks a request holding that
  many tokens needs in each group; :meth:`peak_blocks` (the fit rule of
  ``add_request``) and :meth:`growth` (what admission and the running
  requests reserve), which count the same decode steps, a sliding window's
  trimming included (``window``, :meth:`decode_peak`, :meth:`held_blocks`);
  and :meth:`oom` to turn a shortfall into a ``KVCacheOOM`` naming the
  short group;
* :meth:`match` / :meth:`unpin` / :meth:`evict` / :meth:`can_evict`: what a
  cached prefix is made of (a :class:`PrefixHit`: tokens, blocks per group,
  the pinned node) and giving its blocks back under pressure (a cache
  without a prefix cache matches nothing and evicts nothing);
* :meth:`prefill` (admit rows and run their uncached tails, sampling each
  row's first token), :meth:`packed_step` (ONE jitted call over a packed
  stream of prompt pieces and decode tokens, :mod:`jaxkv.nn.packed`),
  :meth:`decode` (``decode_chunk`` steps in one jitted loop), :meth:`retire` (insert finished pages into the prefix cache, free
  rows), :meth:`swap_out` / :meth:`swap_in` (``can_swap`` False: the engine
  preempts by recomputation), :meth:`row_status` (FREE / ON_DEVICE /
  SWAPPED per row, for the engine's bookkeeping check);
* ``bytes_per_token``: KV bytes one token costs (per-request state apart);
  ``plan``: the :class:`~jaxkv.serve.sizing.CachePlan` the cache was built
  from (:meth:`PagedCache.build` / :meth:`HybridCache.build` apply the one
  sizing rule of :mod:`jaxkv.serve.sizing`), ``device_bytes()``: the bytes
  of every device array it holds now.

Sequence row ``r`` of the engine is row ``r`` of a :class:`PagedCache`'s
:class:`~jaxkv.BlockSpaceManager` and request slot ``r + 1`` of a
:class:`HybridCache`'s :class:`~jaxkv.KVCacheManager` (the manager admits
the lowest free slot and the engine the lowest free row; :meth:`prefill`
checks that they agree).

Sampling is per row: every jitted step takes one PRNG key per row and
returns it advanced only for the rows that ran, so a request's draws depend
on its own key alone (see :meth:`jaxkv.serve.Engine.add_request`'s ``seed``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _host
from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import BookkeepingError, InvalidArgument, KVCacheOOM
from jaxkv.manager.block_space import FREE, ON_DEVICE, BlockSpaceManager
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import block_bytes
from jaxkv.nn.sampling import RowSampling, sample, split_keys
from jaxkv.nn.packed import PackedBatch, PackedLane, pack
from jaxkv.nn.steps import (DecodeState, hybrid_packed_step, hybrid_prefill_chunk, paged_decode_peak,
                            paged_packed_step, paged_peak_blocks, paged_row_blocks, paged_window, prefill_chunk,
                            run_decode)
from jaxkv.pool import host as host_swap
from jaxkv.pool.kv_pool import KVPool
from jaxkv.prefix import PrefixCacheManager
from jaxkv.serve import sizing
from jaxkv.serve.sizing import CachePlan, GroupPlan

__all__ = ["DecodeResult", "HybridCache", "PackedResult", "PagedCache", "PrefixHit", "PrefillLane", "decode_chunk"]

logger = logging.getLogger("jaxkv.serve")


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """What a cached prefix is made of: ``tokens`` served from the cache,
    ``blocks`` (one list per group) that go at the start of the request's
    tables, the pinned tree ``node`` (None: no prefix cache) and, for a
    hybrid cache, the ``snapshot`` of the per-request state at ``tokens``."""

    tokens: int
    blocks: tuple[list, ...]
    node: object = None
    snapshot: int = -1  # hybrid cache: the cached snapshot holding the state at ``tokens``
    matched: int = 0  # hybrid cache: tokens the tree matched before rounding down to a snapshot

    def block_counts(self) -> np.ndarray:
        return np.asarray([len(b) for b in self.blocks], np.int64)


@dataclasses.dataclass(frozen=True)
class PrefillLane:
    """One admitted request in a prefill batch: its sequence ``row``, its
    prefix ``hit``, every token it holds (``tokens``: prompt, plus the tokens
    generated before a recompute preemption), its PRNG key data and its
    prefix-cache namespace."""

    row: int
    hit: PrefixHit
    tokens: list
    key: np.ndarray
    namespace: object = None


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """A decode chunk's outcome on the host, per row: ``tokens[r, :count[r]]``
    generated, ``finished``, the rows' advanced key data ``keys``, whether
    every allocation succeeded (``ok``; else ``blocked`` marks the rows that
    needed blocks) and the most blocks in use at once (``peak``)."""

    tokens: np.ndarray
    count: np.ndarray
    finished: np.ndarray
    keys: np.ndarray
    ok: bool
    blocked: np.ndarray
    peak: int


@dataclasses.dataclass(frozen=True)
class PackedResult:
    """A packed step's outcome on the host, per lane (prefill lanes first,
    then decode lanes, in the order given): the ``tokens`` drawn (meaningful
    for the lanes that sample), the lanes' advanced key data ``keys``,
    whether the decode lanes grew (``decode_ok``; else they did not run and
    ``blocked`` marks those that needed blocks) and the blocks in use after
    it (``peak``)."""

    tokens: np.ndarray
    keys: np.ndarray
    decode_ok: bool
    blocked: np.ndarray
    peak: int


def _fixed(ids, size: int) -> np.ndarray:
    """``ids`` padded with -1 to ``size`` (one compiled shape per call site)."""
    out = np.full((size,), -1, np.int32)
    out[: len(ids)] = ids
    return out


# ------------------------------------------------------------ jitted steps


def _sample_first(last_logits, keys, sampling: RowSampling):
    """The first token of each lane, drawn as ``start_decoding`` draws it
    (one split of the lane's key), and the advanced keys."""
    keys, subs = split_keys(keys)
    return sample(last_logits, subs, sampling), keys


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,))
def _paged_prefill(graphdef, params, manager: BlockSpaceManager, pool: KVPool, rows, starts, num_new, tokens,
                   sampling: RowSampling, keys):
    """Prefill one chunk of admitted rows and sample from each lane's last
    chunk position. Returns ``(pool, sampled, keys)``."""
    pool, last_logits = prefill_chunk(graphdef, params, manager, pool, rows, tokens, starts, num_new)
    sampled, keys = _sample_first(last_logits, keys, sampling)
    return pool, sampled, keys


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,))
def _hybrid_prefill(graphdef, params, manager: KVCacheManager, slots, tokens, num_new, sampling: RowSampling, keys):
    """Reserve and prefill one chunk of the slots' tokens, sample each lane's
    first token. Returns ``(manager, sampled, keys, ok, used)``."""
    manager, last_logits, ok = hybrid_prefill_chunk(graphdef, params, manager, slots, tokens, num_new)
    sampled, keys = _sample_first(last_logits, keys, sampling)
    return manager, sampled, keys, ok, manager.blocks_in_use


@partial(jax.jit, static_argnames=("graphdef", "num_steps"), donate_argnums=(2, 3))
def decode_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                 sampling: RowSampling, keys, *, num_steps: int) -> DecodeState:
    """The engine's decode chunk (a paged cache's; the benchmarks time it).
    Up to ``num_steps`` decode steps of the rows ``active`` in one
    ``lax.while_loop`` (:func:`jaxkv.nn.steps.run_decode`); rows stay
    allocated when they finish (the engine retires them). Stops early when
    no row runs or an allocation fails (``ok`` False; ``blocked`` marks the
    rows that needed blocks)."""
    state = DecodeState.create(manager, pool, last=last, finished=~active, num_generated=num_generated,
                               max_new=max_new, eos_id=eos_id, keys=keys, width=num_steps)
    return run_decode(graphdef, params, state, sampling, num_steps=num_steps, free_finished=False)


@partial(jax.jit, static_argnames=("graphdef", "window"), donate_argnums=(2, 3))
def _paged_packed(graphdef, params, manager: BlockSpaceManager, pool: KVPool, batch: PackedBatch,
                  sampling: RowSampling, keys, *, window):
    """:func:`jaxkv.nn.steps.paged_packed_step` jitted (manager and pool donated)."""
    return paged_packed_step(graphdef, params, manager, pool, batch, sampling, keys, window=window)


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,))
def _hybrid_packed(graphdef, params, manager: KVCacheManager, batch: PackedBatch, sampling: RowSampling, keys):
    """:func:`jaxkv.nn.steps.hybrid_packed_step` jitted (manager donated)."""
    return hybrid_packed_step(graphdef, params, manager, batch, sampling, keys)


_retire_paged = jax.jit(BlockSpaceManager.retire)
_admit_paged = jax.jit(BlockSpaceManager.admit_with_prefix, donate_argnums=(0,))
_preallocate_hybrid = jax.jit(KVCacheManager.preallocate, donate_argnums=(0,))
_admit_hybrid = jax.jit(lambda manager, n, max_n: manager.admit(n, max_n=max_n), static_argnums=(2,),
                        donate_argnums=(0,))
_release_hybrid = jax.jit(KVCacheManager.release, donate_argnums=(0,))
_attach_prefix = jax.jit(KVCacheManager.attach_prefix, donate_argnums=(0,))
_copy_state = jax.jit(KVCacheManager.copy_state, donate_argnums=(0,))
_incref_blocks = jax.jit(KVCacheManager.incref_blocks, donate_argnums=(0,))
_release_blocks = jax.jit(KVCacheManager.release_blocks, donate_argnums=(0,))


# The jitted steps never touch host blocks (they free only ON_DEVICE rows; swaps
# go through the manager's swap_*_or_raise). They get the manager with this
# placeholder host allocator, so engines that differ only in ``num_host_pages``
# share compiled programs; the real host allocator is put back afterwards. A
# fresh placeholder each call: the manager is donated.
def _device_view(manager: BlockSpaceManager) -> BlockSpaceManager:
    return manager.replace(host=BlockAllocator.create(2))


# ------------------------------------------------------------ shared prefill loop


class _Cache:
    """What both caches share: the fixed-width chunked prefill loop and the
    decode chunk; subclasses supply the per-chunk jitted call."""

    max_seqs: int
    prefill_width: int
    groups: tuple[str, ...]
    capacity: np.ndarray
    window: int | None = None  # every layer's sliding window, when decode trims blocks out of it

    # ------------------------------------------------------- block arithmetic
    # What a request costs, per group. The engine's fit rule (add_request) is
    # ``peak_blocks``; admission and the running requests' reserve are
    # ``growth``; both count the same steps, so a request the rule accepts is
    # admitted on an empty engine.

    def decode_peak(self, first: int, last: int) -> np.ndarray:
        """The most blocks a row holds at once while decode steps append
        positions ``first .. last - 1`` (zeros when ``last <= first``)."""
        return self.blocks_for(last) if last > first else np.zeros(len(self.groups), np.int64)

    def held_blocks(self, num_tokens: int) -> np.ndarray:
        """The fewest blocks a decoding row of ``num_tokens`` tokens holds."""
        return self.blocks_for(num_tokens)

    def peak_blocks(self, prompt_len: int, total: int) -> np.ndarray:
        """The most blocks a request of ``prompt_len`` prompt tokens holds at
        once on its way to ``total`` tokens (the prompt's, prefilled whole,
        or a decode step's); ``add_request`` refuses a request whose peak
        exceeds a group's capacity."""
        return np.maximum(self.blocks_for(prompt_len), self.decode_peak(prompt_len, total))

    def can_evict(self) -> bool:
        """Whether the prefix cache holds a page it could evict now."""
        return self.prefix_cache.evictable_blocks > 0

    def growth(self, num_tokens: int, steps: int, held: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """Free blocks a row may still take over its next ``steps`` decode
        steps: it holds ``num_tokens`` tokens in ``held`` blocks, ``shared``
        of them a prefix hit's (the prefix cache holds those blocks too).
        Without trimming the hit's blocks stay in the table, so this is
        ``blocks_for(num_tokens + steps) - held``."""
        return np.maximum(self.blocks_for(num_tokens + steps) - held, 0)

    def _keys(self, key_data: list) -> jax.Array:
        """Typed keys ``[max_seqs]`` from per-lane key data (idle lanes: zeros)."""
        data = np.zeros((self.max_seqs, *self._key_shape), np.uint32)
        for lane, k in enumerate(key_data):
            if k is not None:
                data[lane] = k
        return jax.random.wrap_key_data(jnp.asarray(data))

    _key_shape = jax.random.key_data(jax.random.key(0)).shape

    def begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """Admit ``lanes``: take their rows, start hits from their cached
        prefixes and give every row the blocks its whole prompt needs, so
        no prefill step can run out of blocks (all or nothing; the engine
        checked the blocks: ``BookkeepingError`` otherwise)."""
        self._begin_prefill(lanes)

    def pieces(self, lane: PrefillLane, width: int | None = None) -> list[tuple[int, int]]:
        """``(start, end)`` token ranges that prefill ``lane`` in order: from
        its hit to its end on a grid of ``width`` tokens (at most
        ``prefill_width``), also cut at :meth:`_cuts`."""
        width = min(width or self.prefill_width, self.prefill_width)
        ends = sorted({*range(lane.hit.tokens + width, len(lane.tokens), width),
                       *(c for c in self._cuts(lane) if lane.hit.tokens < c < len(lane.tokens)), len(lane.tokens)})
        return list(zip([lane.hit.tokens, *ends[:-1]], ends))

    def prefill_step(self, graphdef, params, batch: list[tuple[PrefillLane, tuple[int, int]]],
                     sampling: RowSampling):
        """ONE jitted call prefilling lane ``i``'s piece ``batch[i][1]``
        (pieces of one lane in order, after :meth:`begin_prefill`) and
        sampling a token from its last position. Returns ``(sampled [n],
        key data [n, ...] advanced by that draw, blocks in use)``: a lane's
        first token and key are those of the call with its last piece."""
        width = self.prefill_width
        starts = np.zeros((self.max_seqs,), np.int32)
        num_new = np.zeros((self.max_seqs,), np.int32)
        tokens = np.zeros((self.max_seqs, width), np.int32)
        for i, (lane, (start, end)) in enumerate(batch):
            starts[i], num_new[i] = start, end - start
            tokens[i, : end - start] = lane.tokens[start:end]
        lanes = [lane for lane, _ in batch]
        sampled, keys, used = self._prefill_call(graphdef, params, lanes, starts, num_new, tokens, sampling,
                                                 self._keys([lane.key for lane in lanes]))
        return sampled[: len(batch)], keys[: len(batch)], used

    def _cuts(self, lane: PrefillLane) -> list[int]:
        return []

    def packed_step(self, graphdef, params, prefill: list[tuple[PrefillLane, tuple[int, int]]],
                    decode: list[tuple[int, int, int]], sampling: RowSampling, key_data: list,
                    num_tokens: int) -> PackedResult:
        """ONE jitted call for a scheduler iteration: the prefill pieces
        ``prefill`` (lane, ``(start, end)``; pieces of one lane in order,
        after :meth:`begin_prefill`; a piece that ends the lane's tokens
        samples its first token) and the decode tokens ``decode`` (``(row,
        token, position)``: each row grows by one token, all or nothing),
        packed end to end into a stream of ``num_tokens`` (a bucket). Lane
        ``i`` of ``sampling`` / ``key_data`` is ``prefill[i]``, then the
        decode rows in order."""
        lanes = [PackedLane(self._seq_id(lane.row), lane.tokens[start:end], start, end == len(lane.tokens))
                 for lane, (start, end) in prefill]
        lanes += [PackedLane(self._seq_id(row), [token], position) for row, token, position in decode]
        result = self._packed_call(graphdef, params, lanes, len(prefill), sampling, self._keys(key_data), num_tokens)
        self._after_prefill([lane for lane, _ in prefill], [start for _, (start, _) in prefill],
                            [end - start for _, (start, end) in prefill])
        return result

    def _after_prefill(self, lanes: list[PrefillLane], starts, num_new) -> None:
        """Host bookkeeping after prefill pieces ran (a hybrid cache's snapshots)."""

    def _seq_id(self, row: int) -> int:
        return row

    def decode(self, graphdef, params, last, active, num_generated, max_new, eos_id, sampling: RowSampling,
               key_data: list, num_steps: int) -> DecodeResult:
        """``num_steps`` decode steps of the rows ``active`` in one jitted
        loop; finished rows stay allocated until :meth:`retire`."""
        manager, pool = self._decode_view()
        state = decode_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                             sampling, self._keys(key_data), num_steps=num_steps)
        self._decode_done(state.manager, state.pool)
        out, count, finished, ok, blocked, peak, keys = jax.device_get(
            (state.tokens, state.written, state.finished, state.ok, state.blocked, state.peak_used,
             jax.random.key_data(state.keys)))
        return DecodeResult(out, count, finished, np.asarray(keys), bool(ok), blocked, int(peak))

    def oom(self, need: np.ndarray, detail: str) -> KVCacheOOM:
        """``KVCacheOOM`` for the group with the largest shortfall of ``need``."""
        free = self.free_blocks()
        g = int(np.argmax(need - free))
        unit = "blocks" if len(self.groups) == 1 else f"{self.groups[g]} blocks"
        return KVCacheOOM(int(need[g]), int(free[g]), int(self.capacity[g]), unit=unit, detail=detail)


# ------------------------------------------------------------ sizing


def _blocks_from_budget(measure, tokens_per_block: list[int], cap: list[int], kv_cache_memory,
                        free_bytes: int | None) -> tuple[list[int], int | None, str]:
    """Allocatable blocks per group from the budget (:mod:`jaxkv.serve.sizing`):
    ``kv_cache_memory`` solved whole; the default budget capped at ``cap``
    (every row at ``max_model_len``), which is used as it is when it fits.
    ``measure(counts)``: device bytes of the cache with ``counts`` blocks per
    group (null block included). Returns ``(blocks, budget or None, source)``;
    ``InvalidArgument`` with the numbers when not one block per group fits."""
    fixed, per_block = sizing.affine_bytes(measure, len(tokens_per_block))
    if kv_cache_memory is not None:
        budget, source = sizing.resolve_budget(kv_cache_memory, free_bytes=free_bytes)
    else:
        budget, source = sizing.default_budget(free_bytes)
        if fixed + sum(b * (n + 1) for b, n in zip(per_block, cap)) <= budget:
            return list(cap), None, f"default: every sequence row at max_model_len, within {source}"
    blocks = sizing.solve(budget, fixed, per_block, tokens_per_block)
    if blocks is None:
        raise InvalidArgument(
            f"{source}: {budget} bytes do not hold the cache's fixed {fixed} bytes (tables, allocators, "
            f"per-request state) plus one block per group ({per_block} bytes each, and a null block each)")
    return blocks, budget, source


# ------------------------------------------------------------ paged pool


class PagedCache(_Cache):
    """A paged :class:`~jaxkv.KVPool` under a :class:`~jaxkv.BlockSpaceManager`
    (Llama family, DeepSeek-V3's MLA pool), with the radix prefix cache and
    swapping to a host pool. One group, ``"pages"``."""

    can_swap = True

    def __init__(self, model, *, num_pages: int, page_size: int, max_seqs: int, max_blocks_per_seq: int,
                 num_host_pages: int, prefix_cache: bool, kv_dtype, prefill_chunk: int, host_memory_kind: str,
                 max_model_len: int | None = None):
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # The longest request (prompt + output); the tables hold at least that.
        self.max_context_tokens = max_blocks_per_seq * page_size if max_model_len is None else max_model_len
        self.prefill_width = min(pow2_at_least(prefill_chunk), pow2_at_least(self.max_context_tokens))
        self.manager = BlockSpaceManager.create(
            num_device_blocks=num_pages, num_host_blocks=max(num_host_pages, 2), block_size=page_size,
            max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq, watermark=0.0)
        self.pool = model.make_pool(num_pages, page_size, dtype=kv_dtype)
        self.host_pool = (host_swap.create_host_pool(self.pool, max(num_host_pages, 2), memory_kind=host_memory_kind)
                          if num_host_pages else None)
        self.can_swap = self.host_pool is not None
        self.prefix_cache = PrefixCacheManager(page_size, disable=not prefix_cache)
        self.unit = page_size
        self.window = paged_window(model)  # every layer windowed: decode trims blocks out of it
        self.groups = ("pages",)
        self.capacity = np.asarray([self.manager.device.capacity], np.int64)
        leaves = jax.tree.leaves(self.pool)
        self.bytes_per_token = sum(x.size * x.dtype.itemsize for x in leaves) / (num_pages * page_size)
        self.bytes_per_block = self.bytes_per_token * page_size  # storage; the plan's figure adds the allocator's
        self.plan = self._plan(budget=None, source="num_pages (expert option)")

    def _plan(self, *, budget, source, per_block: int | None = None) -> CachePlan:
        blocks = int(self.capacity[0])
        per_block = int(self.bytes_per_block) if per_block is None else per_block
        host_pages = self.host_pool and int(jax.tree.leaves(self.host_pool)[0].shape[2])
        return CachePlan(
            cache="paged", max_model_len=self.max_context_tokens, max_seqs=self.max_seqs,
            groups=(GroupPlan("pages", blocks, self.page_size, blocks * self.page_size, self.bytes_per_token,
                              per_block, per_block * (blocks + 1)),),
            prefix_unit_tokens=self.unit, num_snapshots=0, snapshot_bytes=0, host_pages=host_pages or 0,
            host_bytes=sizing.tree_bytes(self.host_pool) if self.host_pool is not None else 0,
            device_bytes=self.device_bytes(), budget_bytes=budget, source=source)

    def device_bytes(self) -> int:
        """Bytes of every device array of the cache: the pool and the block
        manager (tables and allocators)."""
        return sizing.tree_bytes((self.manager, self.pool))

    @classmethod
    def build(cls, model, *, max_seqs: int, page_size: int, max_model_len: int | None, num_pages: int | None,
              max_blocks_per_seq: int | None, kv_cache_memory, num_host_pages: int | None, host_kv_memory,
              kv_dtype, prefix_cache: bool, prefill_chunk: int, host_memory_kind: str,
              free_bytes: int | None = None) -> "PagedCache":
        """The one sizing rule (:mod:`jaxkv.serve.sizing`) for a paged pool.

        ``max_model_len`` (None: from ``max_blocks_per_seq * page_size`` when
        that is given, else :func:`~jaxkv.serve.sizing.default_max_model_len`)
        sets the table width ``ceil(max_model_len / page_size)``; giving
        both with another width is refused. Pages: ``num_pages`` as given
        (an expert option; ``kv_cache_memory`` beside it is refused), else
        from the budget. Host pages: ``num_host_pages``, or
        ``host_kv_memory`` bytes of host memory (not both; default none).
        A ``max_model_len`` given here that the pool cannot hold is refused;
        the default one is lowered to what the pool holds (logged)."""
        window = paged_window(model)
        len_given = explicit = max_model_len is not None
        if max_blocks_per_seq is not None:
            if len_given and ceil_div(max_model_len, page_size) != max_blocks_per_seq:
                raise InvalidArgument(
                    f"max_model_len={max_model_len} and max_blocks_per_seq={max_blocks_per_seq} disagree: "
                    f"{max_model_len} tokens need {ceil_div(max_model_len, page_size)} pages of {page_size} per row "
                    "(give one of them)")
            if not len_given:
                max_model_len = max_blocks_per_seq * page_size
                len_given = True  # the table width is a limit of its own: never lowered
        elif max_model_len is None:
            max_model_len = sizing.default_max_model_len(model)
        if num_pages is not None and kv_cache_memory is not None:
            raise InvalidArgument(f"num_pages={num_pages} and kv_cache_memory={kv_cache_memory!r} both size the pool: "
                                  "give one of them")
        if num_host_pages is not None and host_kv_memory is not None:
            raise InvalidArgument(f"num_host_pages={num_host_pages} and host_kv_memory={host_kv_memory!r} both size "
                                  "the host pool: give one of them")
        page_bytes = (sizing.tree_bytes(jax.eval_shape(lambda: model.make_pool(3, page_size, dtype=kv_dtype)))
                      - sizing.tree_bytes(jax.eval_shape(lambda: model.make_pool(2, page_size, dtype=kv_dtype))))
        if host_kv_memory is not None:
            host_bytes = _host.int_scalar(host_kv_memory, "host_kv_memory")
            if host_bytes < 0:
                raise InvalidArgument(f"host_kv_memory={host_bytes}: bytes must be >= 0")
            num_host_pages = host_bytes // page_bytes
            if num_host_pages == 1:  # page 0 is the null page: one page holds nothing
                num_host_pages = 0
        num_host_pages = num_host_pages or 0

        def need(length: int) -> int:  # blocks a request of ``length`` tokens holds at its peak
            return max(paged_peak_blocks(max(length - 1, 1), length, page_size, window),
                       paged_peak_blocks(1, length, page_size, window))

        def measure(counts, length):
            def make():
                manager = BlockSpaceManager.create(
                    num_device_blocks=counts[0], num_host_blocks=max(num_host_pages, 2), block_size=page_size,
                    max_seqs=max_seqs, max_blocks_per_seq=ceil_div(length, page_size), watermark=0.0)
                return manager, model.make_pool(counts[0], page_size, dtype=kv_dtype)
            return sizing.tree_bytes(jax.eval_shape(make))

        budget, source = None, f"num_pages={num_pages} (expert option)"
        if num_pages is None:
            blocks, budget, source = _blocks_from_budget(
                lambda counts: measure(counts, max_model_len), [page_size], [max_seqs * need(max_model_len)],
                kv_cache_memory, free_bytes)
            held = blocks[0] * page_size
            if need(max_model_len) > blocks[0] and not len_given and held >= 2:
                logger.info("KV cache: the default max_model_len %d does not fit %d pages of %d; lowered to %d",
                            max_model_len, blocks[0], page_size, held)
                max_model_len = held
                while need(max_model_len) > blocks[0]:  # a window's peak may be a block over the tokens
                    max_model_len -= 1
            num_pages = blocks[0] + 1
        if explicit and need(max_model_len) > num_pages - 1 and window is None:
            raise InvalidArgument(
                f"max_model_len={max_model_len}: a request of {max_model_len} tokens holds {need(max_model_len)} "
                f"pages of {page_size} at its peak; the pool has {num_pages - 1} ({source}); give a smaller "
                "max_model_len or more memory")
        cache = cls(model, num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                    max_blocks_per_seq=ceil_div(max_model_len, page_size), num_host_pages=num_host_pages,
                    prefix_cache=prefix_cache, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                    host_memory_kind=host_memory_kind, max_model_len=max_model_len)
        _, per_block = sizing.affine_bytes(lambda counts: measure(counts, max_model_len), 1)
        cache.plan = cache._plan(budget=budget, source=source, per_block=per_block[0])
        return cache

    # ---------------------------------------------------------------- blocks

    def free_blocks(self) -> np.ndarray:
        return np.asarray([int(self.manager.device.num_free)], np.int64)

    def blocks_for(self, num_tokens: int) -> np.ndarray:
        return np.asarray([ceil_div(num_tokens, self.page_size)], np.int64)

    def decode_peak(self, first: int, last: int) -> np.ndarray:
        """With a window on every layer a step holds only the blocks of the
        window and the position it appends (:func:`jaxkv.nn.steps.paged_decode_peak`)."""
        return np.asarray([paged_decode_peak(first, last, self.page_size, self.window)], np.int64)

    def held_blocks(self, num_tokens: int) -> np.ndarray:
        return np.asarray([paged_row_blocks(num_tokens, self.page_size, self.window)], np.int64)

    def growth(self, num_tokens: int, steps: int, held: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """With a window, decode trims the hit's blocks out of the table
        too, while the prefix cache may still hold them: any block of the
        row's future window may have to come from the free blocks, and of
        the blocks it holds now only those that are not the hit's give room
        back when trimmed."""
        if self.window is None:
            return super().growth(num_tokens, steps, held, shared)
        peak = self.decode_peak(num_tokens, num_tokens + steps)
        return np.maximum(peak - np.maximum(held - shared, 0), 0)

    def first_blocks(self) -> np.ndarray:
        """Each row's first table entry (-1: none, or trimmed out of the window)."""
        return np.asarray(jax.device_get(self.manager.block_tables[:, 0]))

    def blocks_in_use(self) -> int:
        return int(self.manager.device.num_used)

    def limits(self) -> str:
        return (f"max_model_len={self.max_context_tokens} tokens per request (max_blocks_per_seq="
                f"{self.max_blocks_per_seq} pages of {self.page_size}); the pool has {int(self.capacity[0])} blocks")

    # ---------------------------------------------------------------- prefix

    def match(self, tokens: list, namespace) -> PrefixHit:
        """The cached prefix of ``tokens`` (capped at ``len - 1`` tokens, page
        aligned), its node pinned until :meth:`unpin`."""
        match = self.prefix_cache.match(tokens, namespace, max_tokens=len(tokens) - 1)
        self.prefix_cache.pin(match.node)
        blocks = list(match.blocks)  # no host tier: every matched page is on the device
        return PrefixHit(len(blocks) * self.page_size, (blocks,), match.node)

    def unpin(self, hit: PrefixHit | None) -> None:
        if hit is not None:
            self.prefix_cache.release(hit.node)

    def evict(self, shortfall: np.ndarray) -> None:
        """Evict at least ``shortfall`` blocks from the prefix cache (fewer if
        not enough are evictable) and drop the tree's references to them."""
        num_blocks = int(shortfall[0])
        if num_blocks <= 0 or self.prefix_cache.evictable_blocks == 0:
            return
        evicted = self.prefix_cache.evict(num_blocks)
        if evicted.blocks:
            self.update(release=evicted.blocks)

    # ---------------------------------------------------------------- steps

    def _begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """``admit_with_prefix``: each row's cached blocks (one more owner
        each) then fresh blocks for the rest of its prompt."""
        batch = self.max_seqs
        rows = _fixed([lane.row for lane in lanes], batch)
        prefix = np.full((batch, self.max_blocks_per_seq), -1, np.int32)
        lengths = np.zeros((batch,), np.int32)
        for i, lane in enumerate(lanes):
            prefix[i, : len(lane.hit.blocks[0])] = lane.hit.blocks[0]
            lengths[i] = len(lane.tokens)
        host = self.manager.host
        manager, ok = _admit_paged(_device_view(self.manager), rows, prefix, lengths)
        self.manager = manager.replace(host=host)
        if not bool(ok):  # the engine checked rows and blocks: this is a bug, not memory pressure
            raise BookkeepingError(
                f"engine admission failed: rows {[lane.row for lane in lanes]} with "
                f"{int(sum(ceil_div(int(n), self.page_size) for n in lengths))} blocks "
                f"({int((prefix >= 0).sum())} cached), {int(self.free_blocks()[0])} of {int(self.capacity[0])} "
                "blocks free")

    def _prefill_call(self, graphdef, params, lanes, starts, num_new, tokens, sampling, keys):
        rows = np.where(num_new > 0, _fixed([lane.row for lane in lanes], self.max_seqs), -1).astype(np.int32)
        self.pool, sampled, new_keys = _paged_prefill(graphdef, params, _device_view(self.manager), self.pool, rows,
                                                      starts, num_new, tokens, sampling, keys)
        sampled, new_keys = jax.device_get((sampled, jax.random.key_data(new_keys)))
        return sampled, np.asarray(new_keys), self.blocks_in_use()

    def _packed_call(self, graphdef, params, lanes, num_prefill, sampling, keys, num_tokens):
        batch = pack(lanes, num_lanes=self.max_seqs, num_tokens=num_tokens, num_prefill_lanes=self.max_seqs,
                     max_prefill_len=num_tokens, num_prefill=num_prefill)  # fixed classes: one program per bucket
        host = self.manager.host
        manager, self.pool, tokens, keys, ok, blocked, used = _paged_packed(
            graphdef, params, _device_view(self.manager), self.pool, batch, sampling, keys, window=self.window)
        self.manager = manager.replace(host=host)
        tokens, keys, ok, blocked, used = jax.device_get((tokens, jax.random.key_data(keys), ok, blocked, used))
        return PackedResult(tokens, np.asarray(keys), bool(ok), blocked, int(used))

    def _decode_view(self):
        self._host_allocator = self.manager.host
        return _device_view(self.manager), self.pool

    def _decode_done(self, manager, pool) -> None:
        self.manager, self.pool = manager.replace(host=self._host_allocator), pool

    def retire(self, finished: list) -> None:
        """``finished``: ``(row, tokens whose K/V are cached, namespace,
        hit)`` per request. Insert their full pages into the prefix cache
        (the tree increfs the pages it keeps), free the rows, unpin."""
        if not finished:
            return
        tables = np.asarray(jax.device_get(self.manager.block_tables))
        incref = []
        for row, tokens, namespace, _ in finished:
            full_pages = len(tokens) // self.page_size
            # A windowed row's leading pages may be gone (-1): a prefix starts at page 0.
            if full_pages and (tables[row, :full_pages] >= 0).all():
                result = self.prefix_cache.insert(tokens, tables[row, :full_pages].tolist(), namespace)
                incref += result.new_blocks
        self.update(incref=incref, rows=[row for row, *_ in finished])
        for *_, hit in finished:
            self.unpin(hit)

    def update(self, *, incref=(), rows=(), release=()) -> None:
        """One jitted call: incref ``incref``, free sequence ``rows``, release
        ``release``; fixed-size id arrays so it compiles once."""
        host = self.manager.host
        manager, ok = _retire_paged(
            _device_view(self.manager), _fixed(incref, self.max_seqs * self.max_blocks_per_seq),
            _fixed(rows, self.max_seqs), _fixed(release, int(self.capacity[0]) + 1))
        self.manager = manager.replace(host=host)
        if not bool(ok):
            raise BookkeepingError(
                f"engine bookkeeping failed: incref {len(incref)} blocks {list(incref)[:8]}, "
                f"free {len(rows)} rows {list(rows)}, release {len(release)} blocks {list(release)[:8]} "
                f"({int(self.free_blocks()[0])} of {int(self.capacity[0])} blocks free)")

    def swap_out(self, row: int) -> bool:
        try:
            self.manager, self.host_pool = self.manager.swap_out_or_raise(self.pool, self.host_pool, [row])
        except KVCacheOOM:
            return False
        return True

    def free_swapped(self, row: int) -> None:
        """Free a swapped-out row and its host blocks (an aborted request)."""
        self.manager = self.manager.free_or_raise([row])

    def swap_in(self, row: int) -> bool:
        try:
            self.manager, self.pool = self.manager.swap_in_or_raise(self.pool, self.host_pool, [row])
        except KVCacheOOM:
            return False
        return True

    def row_status(self) -> np.ndarray:
        return np.asarray(jax.device_get(self.manager.status))


# ------------------------------------------------------------ hybrid cache


class HybridCache(_Cache):
    """A hybrid model's :class:`~jaxkv.KVCacheManager` (DeepSeek-V4's
    SWA/CSA/HCA layers, Qwen3-Next's full-attention group and Gated DeltaNet
    state): one group per block group of the manager. Preemption is by
    recomputation (``can_swap`` False: the per-request rings and recurrent
    state have no host copy yet).

    **Prefix cache.** A cached prefix ends on a boundary where every layer's
    state is known: a multiple of ``unit`` tokens (the least common multiple
    of the groups' block sizes: one 128-token compression block for
    DeepSeek-V4, one page for Qwen3-Next), where every group's blocks before
    it are complete and shareable by reference. What cannot be shared by
    reference (SWA window, compressor and indexer rings, GDN states) is a
    *snapshot*: a copy of the request's state rows taken at that boundary.

    * Capture: every step that leaves a row on a multiple of ``unit`` copies
      its state into the row's staging snapshot (on device, inside the
      jitted prefill and decode; ``KVCacheManager.capture``); the host knows
      which boundary that was (``_staged[row]``).
    * Insert: a request's pages up to the staged boundary go into a radix
      tree of ``unit``-token pages (:class:`~jaxkv.prefix.PrefixCacheManager`;
      a tree page is a handle naming each group's blocks for those tokens,
      which the tree holds one reference to), and the staging snapshot is
      copied into a free cached snapshot keyed by the handle of the
      boundary's page. This happens as a prefill chunk ends on a cut (the
      prompt's last boundary, and where the prompt leaves the cached tree:
      :meth:`_cuts`) and when a request retires, finished or preempted (the
      last boundary its decode crossed: multi-turn conversations).
    * Hit: the longest cached prefix (at most ``len - 1`` tokens) rounded
      down to the last page that has a snapshot; its blocks go at the start
      of the new request's tables by reference, the snapshot is copied into
      its slot, and prefill starts there.
    * Eviction: least recently used tree pages first (pins respected); a
      page's blocks lose the tree's reference and its snapshot is freed with
      it. Cached snapshots are a pool of their own (``num_snapshots``),
      so snapshot retention is separate from block allocation: a request's
      state never takes blocks, tree pages give their blocks back only when
      the engine is short of blocks, and when a new snapshot is to be
      cached and none is free, the least recently used cached pages are
      evicted until one holding a snapshot has gone.
    """

    can_swap = False

    def __init__(self, model, *, max_seqs: int, max_context_tokens: int, num_blocks: dict | None,
                 entry_format: str, prefill_chunk: int, prefix_cache: bool = True, num_snapshots: int | None = None):
        self.max_seqs = max_seqs
        self.max_context_tokens = max_context_tokens
        self.prefill_width = min(pow2_at_least(prefill_chunk), pow2_at_least(max_context_tokens))
        probe = jax.eval_shape(lambda: model.make_cache(1, max_context_tokens, entry_format=entry_format,
                                                        num_blocks=num_blocks))  # static sizes only
        block_sizes = [g.tokens_per_block for g in probe.groups.values()]
        self.unit = math.lcm(*block_sizes) if block_sizes else 1
        cached = (2 * max_seqs if num_snapshots is None else num_snapshots) if prefix_cache else 0
        self.num_cached_snapshots = cached
        self.manager = model.make_cache(max_seqs, max_context_tokens, entry_format=entry_format,
                                        num_blocks=num_blocks, num_snapshots=max_seqs + cached if cached else 0,
                                        capture_every=self.unit if cached else 0)
        self.pool = None
        groups = self.manager.groups
        self.groups = tuple(groups)
        self.capacity = np.asarray([g.allocator.capacity for g in groups.values()], np.int64)
        self._per_block = [(g.tokens_per_entry, g.entries_per_block) for g in groups.values()]
        self._blocks_per_page = [self.unit // g.tokens_per_block for g in groups.values()]
        config = self.manager.config
        self.bytes_per_token = sum(block_bytes(s, config) / s.tokens_per_block
                                   for s in self.manager.schemas if s.group is not None)
        # What cannot be shared per token: rings, windows, recurrent state (and tables), per state row.
        self.state_bytes_per_request = (self.manager.memory_bytes() - sum(
            block_bytes(s, config) * int(self.capacity[self.groups.index(s.group)] + 1)
            for s in self.manager.schemas if s.group is not None)) / (max_seqs + 1 + self.manager.num_snapshots)
        self.prefix_cache = PrefixCacheManager(self.unit, disable=not cached)
        self._pages: dict[int, tuple] = {}  # tree page handle -> (blocks of each group)
        self._snapshot_of: dict[int, int] = {}  # tree page handle -> cached snapshot index
        self._free_snapshots = list(range(max_seqs, max_seqs + cached))
        self._next_handle = 1
        self._staged = [0] * max_seqs  # per row: the boundary its staging snapshot holds (0: none)
        self._lens = [0] * max_seqs  # per row: tokens in the cache (for the host's capture bookkeeping)
        self.snapshots_taken = self.snapshots_evicted = 0
        #: ``("snapshot_stored", snapshot, page, tokens)``, ``("snapshot_evicted", snapshot, page)``,
        #: ``("snapshot_dropped", -1, page, tokens)`` (no snapshot could be freed), in order.
        self.events: list = []
        self.plan = self._plan(budget=None, source="num_blocks (expert option)" if num_blocks else
                               "every sequence row at max_context_tokens")

    def device_bytes(self) -> int:
        """Bytes of every device array of the cache (the manager's pools,
        state rows, tables and allocators)."""
        return self.manager.memory_bytes()

    def _plan(self, *, budget, source, per_block: list[int] | None = None) -> CachePlan:
        config = self.manager.config
        groups = []
        for g, (name, group) in enumerate(self.manager.groups.items()):
            storage = sum(block_bytes(s, config) for s in self.manager.schemas if s.group == name)
            cost = storage if per_block is None else int(per_block[g])
            blocks = int(self.capacity[g])
            groups.append(GroupPlan(name, blocks, group.tokens_per_block, blocks * group.tokens_per_block,
                                    storage / group.tokens_per_block, cost, cost * (blocks + 1)))
        return CachePlan(
            cache="hybrid", max_model_len=self.max_context_tokens, max_seqs=self.max_seqs, groups=tuple(groups),
            prefix_unit_tokens=self.unit, num_snapshots=self.num_cached_snapshots,
            snapshot_bytes=int(self.state_bytes_per_request), host_pages=0, host_bytes=0,
            device_bytes=self.device_bytes(), budget_bytes=budget, source=source)

    @classmethod
    def build(cls, model, *, max_seqs: int, max_model_len: int | None, max_context_tokens: int | None,
              num_blocks: dict | None, kv_cache_memory, num_snapshots: int | None, entry_format: str,
              prefill_chunk: int, prefix_cache: bool, free_bytes: int | None = None) -> "HybridCache":
        """The one sizing rule (:mod:`jaxkv.serve.sizing`) for a hybrid cache.

        ``max_model_len`` and ``max_context_tokens`` name the same limit
        (giving both with different values is refused; default
        :func:`~jaxkv.serve.sizing.default_max_model_len`). Blocks per group:
        ``num_blocks`` as given (an expert option; groups it leaves out get
        every row at full length, as ``KVCacheManager.create`` does;
        ``kv_cache_memory`` beside it is refused), else from the budget, all
        groups holding the same tokens. Cached snapshots: ``num_snapshots``,
        else with a budget ``min(2 * max_seqs, what a quarter of it holds
        beside one staging snapshot per row)`` (0: no prefix cache), else
        ``2 * max_seqs``. A ``max_model_len`` given that a group cannot hold
        is refused; the default one is lowered to what every group holds."""
        if max_model_len is not None and max_context_tokens is not None and max_model_len != max_context_tokens:
            raise InvalidArgument(f"max_model_len={max_model_len} and max_context_tokens={max_context_tokens} "
                                  "disagree (the same limit: give one of them)")
        length = max_model_len if max_model_len is not None else max_context_tokens
        len_given = length is not None
        if length is None:
            length = sizing.default_max_model_len(model)
        if num_blocks is not None and kv_cache_memory is not None:
            raise InvalidArgument(f"num_blocks={num_blocks} and kv_cache_memory={kv_cache_memory!r} both size the "
                                  "cache's groups: give one of them")
        if num_blocks is not None:
            cache = cls(model, max_seqs=max_seqs, max_context_tokens=length, num_blocks=num_blocks,
                        entry_format=entry_format, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                        num_snapshots=num_snapshots)
            cache.plan = cache._plan(budget=None, source=f"num_blocks={num_blocks} (expert option)")
            return cache
        probe = jax.eval_shape(lambda: model.make_cache(1, length, entry_format=entry_format))
        names = list(probe.groups)
        per_entry = [(g.tokens_per_entry, g.entries_per_block) for g in probe.groups.values()]
        tokens_per_block = [g.tokens_per_block for g in probe.groups.values()]
        unit = math.lcm(*tokens_per_block) if tokens_per_block else 1

        def blocks_for(n: int) -> list[int]:
            return [ceil_div(n // tpe, epb) for tpe, epb in per_entry]

        def measure(counts, cached, n):
            return sizing.tree_bytes(jax.eval_shape(lambda: model.make_cache(
                max_seqs, n, entry_format=entry_format, num_blocks=dict(zip(names, counts)),
                num_snapshots=max_seqs + cached if cached else 0, capture_every=unit if cached else 0)))

        budget_hint = (sizing.resolve_budget(kv_cache_memory, free_bytes=free_bytes)[0] if kv_cache_memory is not None
                       else sizing.default_budget(free_bytes)[0])
        if not prefix_cache:
            cached = 0
        elif num_snapshots is not None:
            cached = num_snapshots
        else:  # a quarter of the budget at most, with a staging snapshot per row
            row = measure([2] * len(names), 2, length) - measure([2] * len(names), 1, length)
            cached = min(2 * max_seqs, budget_hint // 4 // row - max_seqs) if row > 0 else 2 * max_seqs
            cached = max(int(cached), 0)
        blocks, budget, source = _blocks_from_budget(
            lambda counts: measure(counts, cached, length), tokens_per_block,
            [max_seqs * b for b in blocks_for(length)], kv_cache_memory, free_bytes)
        held = min(b * t for b, t in zip(blocks, tokens_per_block))  # tokens every group holds
        fits = all(need <= have for need, have in zip(blocks_for(length), blocks))
        if not fits and len_given:
            raise InvalidArgument(
                f"max_model_len={length}: a request of {length} tokens holds {blocks_for(length)} blocks of groups "
                f"{names}; the groups have {blocks} ({source}); give a smaller max_model_len or more memory")
        if not fits:
            logger.info("KV cache: the default max_model_len %d does not fit blocks %s of groups %s; lowered to %d",
                        length, blocks, names, held)
            length = held
        cache = cls(model, max_seqs=max_seqs, max_context_tokens=length, num_blocks=dict(
            zip(names, (b + 1 for b in blocks))), entry_format=entry_format, prefill_chunk=prefill_chunk,
            prefix_cache=prefix_cache and cached > 0, num_snapshots=cached if cached else None)
        _, per_block = sizing.affine_bytes(lambda counts: measure(counts, cached, length), len(names))
        cache.plan = cache._plan(budget=budget, source=source, per_block=per_block)
        return cache

    # ---------------------------------------------------------------- blocks

    def free_blocks(self) -> np.ndarray:
        return np.asarray(jax.device_get([g.allocator.num_free for g in self.manager.groups.values()]), np.int64)

    def blocks_for(self, num_tokens: int) -> np.ndarray:
        """Blocks a request of ``num_tokens`` holds per group (a compressed
        group's blocks hold only completed entries)."""
        return np.asarray([ceil_div(num_tokens // per_entry, per_block) for per_entry, per_block in self._per_block],
                          np.int64)

    def blocks_in_use(self) -> int:
        return int(self.manager.blocks_in_use)

    def limits(self) -> str:
        return (f"max_model_len={self.max_context_tokens} tokens per request (max_context_tokens="
                f"{self.max_context_tokens}); the groups have "
                f"{self.capacity.tolist()} blocks")

    # ---------------------------------------------------------------- prefix

    def prefix_stats(self) -> dict:
        """Metrics of the prefix cache: the hit unit (tokens), pages and
        snapshots held, snapshots taken / evicted, the tree's counters."""
        return dict(unit_tokens=self.unit, cached_pages=len(self._pages), cached_snapshots=len(self._snapshot_of),
                    snapshot_capacity=self.num_cached_snapshots, snapshot_bytes=self.state_bytes_per_request,
                    snapshots_taken=self.snapshots_taken, snapshots_evicted=self.snapshots_evicted,
                    tree=self.prefix_cache.stats())

    def take_events(self) -> list:
        """The snapshot events since the last call (see ``events``)."""
        events, self.events = self.events, []
        return events

    def match(self, tokens: list, namespace) -> PrefixHit:
        """The cached prefix of ``tokens`` (at most ``len - 1`` tokens) rounded
        down to its last page with a snapshot; its node pinned until
        :meth:`unpin`. ``blocks[g]``: group ``g``'s blocks of the hit."""
        if self.prefix_cache.disable:
            return PrefixHit(0, tuple([] for _ in self.groups))
        match = self.prefix_cache.match(tokens, namespace, max_tokens=len(tokens) - 1)
        handles = list(match.blocks)
        while handles and handles[-1] not in self._snapshot_of:
            handles.pop()
        if not handles:
            return PrefixHit(0, tuple([] for _ in self.groups), matched=len(match.blocks) * self.unit)
        self.prefix_cache.pin(match.node)
        blocks = tuple([b for h in handles for b in self._pages[h][g]] for g in range(len(self.groups)))
        return PrefixHit(len(handles) * self.unit, blocks, match.node, snapshot=self._snapshot_of[handles[-1]],
                         matched=len(match.blocks) * self.unit)

    def unpin(self, hit) -> None:
        if hit is not None and hit.node is not None:
            self.prefix_cache.release(hit.node)

    def evict(self, shortfall: np.ndarray) -> None:
        """Evict least recently used tree pages until each group has gained
        ``shortfall`` blocks of references back (or nothing is evictable)."""
        pages = max((ceil_div(int(n), per) for n, per in zip(shortfall, self._blocks_per_page) if n > 0), default=0)
        if pages and self.prefix_cache.evictable_blocks:
            self._drop_pages(self.prefix_cache.evict(pages).blocks)

    def _drop_pages(self, handles: list) -> None:
        """Release the tree's reference to the blocks of ``handles`` and free
        their snapshots (one device call)."""
        if not handles:
            return
        release = {name: [] for name in self.groups}
        for h in handles:
            for name, ids in zip(self.groups, self._pages.pop(h)):
                release[name] += ids
            if h in self._snapshot_of:
                snapshot = self._snapshot_of.pop(h)
                self._free_snapshots.append(snapshot)
                self.snapshots_evicted += 1
                self.events.append(("snapshot_evicted", snapshot, h))
                logger.debug("prefix cache: snapshot %d of page %d evicted", snapshot, h)
        self._block_call(_release_blocks, release, "releasing evicted prefix blocks")

    def _block_call(self, fn, blocks: dict, what: str) -> None:
        width = pow2_at_least(max(len(ids) for ids in blocks.values()))
        padded = {name: _fixed(ids, width) for name, ids in blocks.items()}
        self.manager, ok = fn(self.manager, padded)
        if not bool(ok):
            raise BookkeepingError(f"{what} was refused: {blocks}")

    def _snapshot_for(self) -> int | None:
        """A free cached snapshot, evicting the least recently used cached
        pages until one frees (None: every snapshot is pinned)."""
        while not self._free_snapshots and self.prefix_cache.evictable_blocks:
            self._drop_pages(self.prefix_cache.evict(1).blocks)
        return self._free_snapshots.pop() if self._free_snapshots else None

    # ---------------------------------------------------------------- steps

    def _begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """Take the lanes' request slots (the lowest free ones, which must be
        their rows + 1: the engine gives out the lowest free rows) and start
        the hits from their cached prefixes."""
        self.manager, slots, ok = _admit_hybrid(self.manager, len(lanes), self.max_seqs)
        slots, ok = jax.device_get((slots, ok))
        want = [lane.row + 1 for lane in lanes]
        if not ok or slots[: len(lanes)].tolist() != want:
            raise BookkeepingError(f"hybrid admission gave slots {slots[: len(lanes)].tolist()} (ok={bool(ok)}) "
                                   f"for rows {[lane.row for lane in lanes]}, which need slots {want}")
        for lane in lanes:
            self._lens[lane.row] = lane.hit.tokens
            self._staged[lane.row] = 0
        self._attach_hits([lane for lane in lanes if lane.hit.tokens])
        lengths = np.zeros((self.max_seqs,), np.int32)
        lengths[: len(lanes)] = [len(lane.tokens) for lane in lanes]
        self.manager, ok = _preallocate_hybrid(self.manager, _fixed(want, self.max_seqs), lengths)
        if not bool(ok):
            need = sum(self.blocks_for(len(lane.tokens)) for lane in lanes)
            raise BookkeepingError(f"engine admission failed: rows {[lane.row for lane in lanes]} need "
                                   f"{need.tolist()} blocks of groups {list(self.groups)}, "
                                   f"{self.free_blocks().tolist()} free")

    def _attach_hits(self, hits: list[PrefillLane]) -> None:
        """Start the rows of ``hits`` from their cached prefixes."""
        if not hits:
            return
        batch = self.max_seqs
        width = max(1, max(len(lane.hit.blocks[g]) for lane in hits for g in range(len(self.groups))))
        blocks = {name: np.full((batch, width), -1, np.int32) for name in self.groups}
        slots, tokens, snapshots = np.full(batch, -1, np.int32), np.zeros(batch, np.int32), np.full(batch, -1, np.int32)
        for i, lane in enumerate(hits):
            slots[i], tokens[i], snapshots[i] = lane.row + 1, lane.hit.tokens, lane.hit.snapshot
            for g, name in enumerate(self.groups):
                blocks[name][i, : len(lane.hit.blocks[g])] = lane.hit.blocks[g]
        self.manager, ok = _attach_prefix(self.manager, slots, blocks, tokens, snapshots)
        if not bool(ok):
            raise BookkeepingError(f"attaching cached prefixes to rows {[lane.row for lane in hits]} was refused")

    def _cuts(self, lane: PrefillLane) -> list[int]:
        """Where a prefill chunk must end so that the state there is
        snapshotted and cached: the last boundary before the prompt's last
        token (a repeat of the prompt hits it) and the boundary where the
        prompt leaves the cached tree (the branch point: later requests
        sharing the same prefix, e.g. a system prompt, hit it)."""
        if not self.num_cached_snapshots:
            return []
        return [(len(lane.tokens) - 1) // self.unit * self.unit, lane.hit.matched]

    def _prefill_call(self, graphdef, params, lanes, starts, num_new, tokens, sampling, keys):
        slots = _fixed([lane.row + 1 for lane in lanes], self.max_seqs)
        slots = np.where(num_new > 0, slots, -1).astype(np.int32)
        self.manager, sampled, new_keys, ok, used = _hybrid_prefill(graphdef, params, self.manager, slots, tokens,
                                                                    num_new, sampling, keys)
        sampled, ok, used, new_keys = jax.device_get((sampled, ok, used, jax.random.key_data(new_keys)))
        if not ok:  # every prompt's blocks were taken at admission
            raise BookkeepingError(f"engine prefill refused rows {[lane.row for lane in lanes]} (pieces "
                                   f"{list(zip(starts[: len(lanes)].tolist(), num_new[: len(lanes)].tolist()))})")
        self._after_prefill(lanes, starts, num_new)
        return sampled, np.asarray(new_keys), int(used)

    def _after_prefill(self, lanes, starts, num_new) -> None:
        for i, lane in enumerate(lanes):  # the chunk's end: a capture when it is on a boundary
            self._advance(lane.row, self._lens[lane.row], self._lens[lane.row] + int(num_new[i]), every_step=False)
        # A chunk that ended on a cut: cache that prefix now, before a later chunk overwrites the staged state.
        self._insert([(lane.row, lane.tokens, lane.namespace, None) for i, lane in enumerate(lanes)
                      if num_new[i] and self._staged[lane.row] == starts[i] + num_new[i]
                      and self._staged[lane.row] in self._cuts(lane)])

    def _seq_id(self, row: int) -> int:
        return row + 1  # request slot

    def _packed_call(self, graphdef, params, lanes, num_prefill, sampling, keys, num_tokens):
        # Gated DeltaNet views the prefill lanes as [P, width] (width: the stream's bucket), so P is a power of
        # two; a model without such layers never looks at P, which then stays fixed (one program per bucket).
        rows = (min(pow2_at_least(max(num_prefill, 1)), self.max_seqs) if self.manager.gdn is not None
                else self.max_seqs)
        batch = pack(lanes, num_lanes=self.max_seqs, num_tokens=num_tokens, num_prefill_lanes=rows,
                     max_prefill_len=num_tokens, num_prefill=num_prefill)
        self.manager, tokens, keys, prefill_ok, ok, used = _hybrid_packed(graphdef, params, self.manager, batch,
                                                                          sampling, keys)
        tokens, keys, prefill_ok, ok, used = jax.device_get((tokens, jax.random.key_data(keys), prefill_ok, ok,
                                                             used))
        if not prefill_ok:  # every prompt's blocks were taken at admission
            raise BookkeepingError(f"engine packed prefill refused slots {[lane.seq_id for lane in lanes[:num_prefill]]}"
                                   f" (pieces {[(lane.start, len(lane.tokens)) for lane in lanes[:num_prefill]]})")
        if ok:
            for lane in lanes[num_prefill:]:  # each decode lane grew by its token
                row = lane.seq_id - 1
                self._advance(row, self._lens[row], self._lens[row] + 1, every_step=True)
        # The reserve is all or nothing and does not say which row was short.
        blocked = np.zeros((self.max_seqs,), bool)
        if not ok:
            blocked[num_prefill:len(lanes)] = True
        return PackedResult(tokens, np.asarray(keys), bool(ok), blocked, int(used))

    def _advance(self, row: int, start: int, end: int, *, every_step: bool) -> None:
        """Host mirror of ``KVCacheManager.capture``: row ``row`` went from
        ``start`` to ``end`` tokens, in one step or (``every_step``) one
        token per step; the last boundary a step ended on is staged."""
        if end > start and self.num_cached_snapshots:
            last = end // self.unit * self.unit if every_step else (end if end % self.unit == 0 else 0)
            if last > start:
                self._staged[row] = last
        self._lens[row] = end

    def _decode_view(self):
        return self.manager, None

    def _decode_done(self, manager, pool) -> None:
        self.manager = manager

    def decode(self, graphdef, params, last, active, num_generated, max_new, eos_id, sampling, key_data,
               num_steps) -> DecodeResult:
        result = super().decode(graphdef, params, last, active, num_generated, max_new, eos_id, sampling, key_data,
                                num_steps)
        for row in np.flatnonzero(active):  # each token written is one step
            self._advance(int(row), self._lens[row], self._lens[row] + int(result.count[row]), every_step=True)
        return result

    def retire(self, finished: list) -> None:
        """``finished``: ``(row, tokens whose K/V are cached, namespace, hit)``
        per request. Cache each row's prefix up to its staged boundary, then
        release the rows' slots and blocks and unpin their hits."""
        if not finished:
            return
        self._insert(finished)
        rows = [row for row, *_ in finished]
        self.manager, ok = _release_hybrid(self.manager, _fixed([r + 1 for r in rows], self.max_seqs))
        if not bool(ok):
            raise BookkeepingError(f"engine bookkeeping failed: releasing rows {rows} (slots "
                                   f"{[r + 1 for r in rows]}) was refused")
        for row, *_, hit in finished:
            self.unpin(hit)
            self._staged[row] = self._lens[row] = 0

    def _insert(self, finished: list) -> None:
        """Cache ``(row, tokens, namespace, _)``'s prefix up to the row's
        staged boundary: its pages into the tree (new ones with the tree's
        reference to their blocks) and the staged snapshot into a cached
        one keyed by the boundary page (unless that page has one). One
        device copy for all rows, with distinct destinations: a snapshot
        handed out twice in one call (the second search evicted the first
        row's page) receives only the later row's state."""
        if not finished or not self.num_cached_snapshots:
            return
        tables = {name: np.asarray(t) for name, t in
                  jax.device_get({name: g.tables for name, g in self.manager.groups.items()}).items()}
        # cached snapshot -> staging row it takes. Keyed by the snapshot: when
        # finding one for a later row evicts the page an earlier row's snapshot
        # was just given to (its copy still pending), that snapshot comes back
        # free and is handed out again; the later row's copy must replace the
        # earlier one, not sit beside it (two copies into one snapshot: which
        # lands is unspecified, and the surviving page could restore another
        # request's state).
        copies: dict[int, int] = {}
        for row, tokens, namespace, _ in finished:
            boundary = self._staged[row]
            if boundary < self.unit or boundary > len(tokens):
                continue
            pages = boundary // self.unit
            handles = []
            for p in range(pages):
                handles.append(self._next_handle + p)
                self._pages[handles[-1]] = tuple(
                    tables[name][row + 1, p * per: (p + 1) * per].tolist()
                    for name, per in zip(self.groups, self._blocks_per_page))
            self._next_handle += pages
            result = self.prefix_cache.insert(tokens[:boundary], handles, namespace)
            adopted = set(result.new_blocks)
            incref = {name: [] for name in self.groups}
            for h in handles:
                if h in adopted:  # the tree's own reference to the page's blocks
                    for name, ids in zip(self.groups, self._pages[h]):
                        incref[name] += ids
                else:
                    del self._pages[h]  # the tree already had this page
            if any(incref.values()):  # before any eviction below can release them
                self._block_call(_incref_blocks, incref, "the prefix cache's reference to inserted blocks")
            last = result.blocks[pages - 1]  # the tree's handle of the boundary page
            if last not in self._snapshot_of:
                self.prefix_cache.pin(result.node)  # making room must not evict the page being keyed
                snapshot = self._snapshot_for()
                self.prefix_cache.release(result.node)
                if snapshot is not None:
                    self._snapshot_of[last] = snapshot
                    copies[self.manager.num_slots + snapshot] = self.manager.num_slots + row
                    self.snapshots_taken += 1
                    self.events.append(("snapshot_stored", snapshot, last, boundary))
                    logger.debug("prefix cache: snapshot %d holds the state at %d tokens (page %d)", snapshot,
                                 boundary, last)
                else:
                    self.events.append(("snapshot_dropped", -1, last, boundary))
            self._staged[row] = 0  # cached (or already there): nothing new staged
        if copies:
            dst, src = zip(*copies.items())
            self.manager = _copy_state(self.manager, _fixed(src, self.max_seqs), _fixed(dst, self.max_seqs))

    def swap_out(self, row: int) -> bool:
        return False

    def swap_in(self, row: int) -> bool:
        return False

    def free_swapped(self, row: int) -> None:
        raise BookkeepingError(f"row {row}: a hybrid cache never swaps a row out")

    def row_status(self) -> np.ndarray:
        held = np.asarray(jax.device_get(self.manager.slots.ref_count(jnp.arange(1, self.max_seqs + 1)))) > 0
        return np.where(held, ON_DEVICE, FREE)
