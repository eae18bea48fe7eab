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
  many tokens needs in each group (what "admit" and "reserve for n new
  tokens" cost), and :meth:`oom` to turn a shortfall into a ``KVCacheOOM``
  naming the short group;
* :meth:`match` / :meth:`unpin` / :meth:`evict`: what a cached prefix is made
  of (a :class:`PrefixHit`: tokens, blocks per group, the pinned node) and
  giving its blocks back under pressure (a cache without a prefix cache
  matches nothing and evicts nothing);
* :meth:`prefill` (admit rows and run their uncached tails, sampling each
  row's first token), :meth:`decode` (``decode_chunk`` steps in one jitted
  loop), :meth:`retire` (insert finished pages into the prefix cache, free
  rows), :meth:`swap_out` / :meth:`swap_in` (``can_swap`` False: the engine
  preempts by recomputation), :meth:`row_status` (FREE / ON_DEVICE /
  SWAPPED per row, for the engine's bookkeeping check);
* ``bytes_per_token``: KV bytes one token costs (per-request state apart).

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
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import BookkeepingError, KVCacheOOM
from jaxkv.manager.block_space import FREE, ON_DEVICE, BlockSpaceManager
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import block_bytes
from jaxkv.nn.sampling import RowSampling, sample, split_keys
from jaxkv.nn.steps import DecodeState, hybrid_prefill_chunk, paged_window, prefill_chunk, run_decode
from jaxkv.pool import host as host_swap
from jaxkv.pool.kv_pool import KVPool
from jaxkv.prefix import PrefixCacheManager

__all__ = ["DecodeResult", "HybridCache", "PagedCache", "PrefixHit", "PrefillLane"]


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """What a cached prefix is made of: ``tokens`` served from the cache,
    ``blocks`` (one list per group) that go at the start of the request's
    tables, and the pinned tree ``node`` (None: no prefix cache)."""

    tokens: int
    blocks: tuple[list, ...]
    node: object = None

    def block_counts(self) -> np.ndarray:
        return np.asarray([len(b) for b in self.blocks], np.int64)


@dataclasses.dataclass(frozen=True)
class PrefillLane:
    """One admitted request in a prefill batch: its sequence ``row``, its
    prefix ``hit``, every token it holds (``tokens``: prompt, plus the tokens
    generated before a recompute preemption) and its PRNG key data."""

    row: int
    hit: PrefixHit
    tokens: list
    key: np.ndarray


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


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2, 3))
def _paged_prefill(graphdef, params, manager: BlockSpaceManager, pool: KVPool, admit_rows, prefix_blocks,
                   lengths, rows, starts, num_new, tokens, sampling: RowSampling, keys):
    """Admit ``admit_rows`` (-1: nothing to admit) with their cached prefixes,
    prefill one chunk and sample from each lane's last chunk position.
    Returns ``(manager, pool, sampled, keys, ok, used)``."""
    manager, ok = manager.admit_with_prefix(admit_rows, prefix_blocks, lengths)
    pool, last_logits = prefill_chunk(graphdef, params, manager, pool, rows, tokens, starts, num_new)
    sampled, keys = _sample_first(last_logits, keys, sampling)
    return manager, pool, sampled, keys, ok, manager.device.num_used


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,))
def _hybrid_prefill(graphdef, params, manager: KVCacheManager, slots, tokens, num_new, sampling: RowSampling, keys):
    """Reserve and prefill one chunk of the slots' tokens, sample each lane's
    first token. Returns ``(manager, sampled, keys, ok, used)``."""
    manager, last_logits, ok = hybrid_prefill_chunk(graphdef, params, manager, slots, tokens, num_new)
    sampled, keys = _sample_first(last_logits, keys, sampling)
    return manager, sampled, keys, ok, manager.blocks_in_use


@partial(jax.jit, static_argnames=("graphdef", "num_steps"), donate_argnums=(2, 3))
def _decode_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                  sampling: RowSampling, keys, *, num_steps: int) -> DecodeState:
    """Up to ``num_steps`` decode steps of the rows ``active`` in one
    ``lax.while_loop`` (:func:`jaxkv.nn.steps.run_decode`); rows stay
    allocated when they finish (the engine retires them). Stops early when
    no row runs or an allocation fails (``ok`` False; ``blocked`` marks the
    rows that needed blocks)."""
    state = DecodeState.create(manager, pool, last=last, finished=~active, num_generated=num_generated,
                               max_new=max_new, eos_id=eos_id, keys=keys, width=num_steps)
    return run_decode(graphdef, params, state, sampling, num_steps=num_steps, free_finished=False)


_retire_paged = jax.jit(BlockSpaceManager.retire)
_admit_hybrid = jax.jit(lambda manager, n, max_n: manager.admit(n, max_n=max_n), static_argnums=(2,),
                        donate_argnums=(0,))
_release_hybrid = jax.jit(KVCacheManager.release, donate_argnums=(0,))


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

    def _keys(self, key_data: list) -> jax.Array:
        """Typed keys ``[max_seqs]`` from per-lane key data (idle lanes: zeros)."""
        data = np.zeros((self.max_seqs, *self._key_shape), np.uint32)
        for lane, k in enumerate(key_data):
            if k is not None:
                data[lane] = k
        return jax.random.wrap_key_data(jnp.asarray(data))

    _key_shape = jax.random.key_data(jax.random.key(0)).shape

    def prefill(self, graphdef, params, lanes: list[PrefillLane], sampling: RowSampling):
        """Admit ``lanes`` (lane ``i`` of the batch) and prefill their
        uncached tails in fixed-width chunks (one compiled program per
        width). Returns ``(first tokens [n], key data [n, ...], peak blocks
        in use)``; raises ``BookkeepingError`` when the device refuses what
        the engine checked (a bug, not memory pressure)."""
        batch, width = self.max_seqs, self.prefill_width
        lengths = np.asarray([len(lane.tokens) for lane in lanes] + [0] * (batch - len(lanes)), np.int32)
        cached = np.asarray([lane.hit.tokens for lane in lanes] + [0] * (batch - len(lanes)), np.int32)
        tails = lengths - cached
        keys = self._keys([lane.key for lane in lanes])
        first = np.zeros((batch,), np.int32)
        new_keys = np.asarray(jax.random.key_data(keys))
        peak = 0
        self._begin_prefill(lanes)
        for offset in range(0, int(tails.max()), width):
            num_new = np.clip(tails - offset, 0, width).astype(np.int32)
            tokens = np.zeros((batch, width), np.int32)
            for i, lane in enumerate(lanes):
                piece = lane.tokens[cached[i] + offset: cached[i] + offset + num_new[i]]
                tokens[i, : len(piece)] = piece
            sampled, chunk_keys, used = self._prefill_call(graphdef, params, lanes, offset == 0, cached + offset,
                                                           num_new, tokens, sampling, keys)
            peak = max(peak, used)
            ends_here = (num_new > 0) & (offset + num_new == tails)
            first = np.where(ends_here, sampled, first)
            new_keys = np.where(ends_here.reshape(-1, *([1] * len(self._key_shape))), chunk_keys, new_keys)
        return first[: len(lanes)], new_keys[: len(lanes)], peak

    def decode(self, graphdef, params, last, active, num_generated, max_new, eos_id, sampling: RowSampling,
               key_data: list, num_steps: int) -> DecodeResult:
        """``num_steps`` decode steps of the rows ``active`` in one jitted
        loop; finished rows stay allocated until :meth:`retire`."""
        manager, pool = self._decode_view()
        state = _decode_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
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


# ------------------------------------------------------------ paged pool


class PagedCache(_Cache):
    """A paged :class:`~jaxkv.KVPool` under a :class:`~jaxkv.BlockSpaceManager`
    (Llama family, DeepSeek-V3's MLA pool), with the radix prefix cache and
    swapping to a host pool. One group, ``"pages"``."""

    can_swap = True

    def __init__(self, model, *, num_pages: int, page_size: int, max_seqs: int, max_blocks_per_seq: int,
                 num_host_pages: int, prefix_cache: bool, kv_dtype, prefill_chunk: int, host_memory_kind: str):
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_context_tokens = max_blocks_per_seq * page_size
        self.prefill_width = min(pow2_at_least(prefill_chunk), pow2_at_least(self.max_context_tokens))
        self.manager = BlockSpaceManager.create(
            num_device_blocks=num_pages, num_host_blocks=max(num_host_pages, 2), block_size=page_size,
            max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq, watermark=0.0)
        self.pool = model.make_pool(num_pages, page_size, dtype=kv_dtype)
        self.host_pool = (host_swap.create_host_pool(self.pool, max(num_host_pages, 2), memory_kind=host_memory_kind)
                          if num_host_pages else None)
        self.can_swap = self.host_pool is not None
        self.prefix_cache = PrefixCacheManager(page_size, disable=not prefix_cache)
        self.window = paged_window(model)  # every layer windowed: decode trims blocks out of it
        self.groups = ("pages",)
        self.capacity = np.asarray([self.manager.device.capacity], np.int64)
        leaves = jax.tree.leaves(self.pool)
        self.bytes_per_token = sum(x.size * x.dtype.itemsize for x in leaves) / (num_pages * page_size)

    # ---------------------------------------------------------------- blocks

    def free_blocks(self) -> np.ndarray:
        return np.asarray([int(self.manager.device.num_free)], np.int64)

    def blocks_for(self, num_tokens: int) -> np.ndarray:
        return np.asarray([ceil_div(num_tokens, self.page_size)], np.int64)

    def peak_blocks(self, prompt_len: int, total: int) -> np.ndarray:
        """Most blocks a request of ``prompt_len`` + new tokens up to
        ``total`` holds at once: all of them, or with a window on every layer
        its prompt's (prefilled whole) or a window's worth plus the block
        being written (decode trims the rest)."""
        if self.window is None:
            return self.blocks_for(total)
        live = ceil_div(self.window - 1, self.page_size) + 2
        return np.maximum(self.blocks_for(prompt_len), np.minimum(self.blocks_for(total), live))

    def blocks_in_use(self) -> int:
        return int(self.manager.device.num_used)

    def limits(self) -> str:
        return (f"max_blocks_per_seq={self.max_blocks_per_seq} pages of {self.page_size} hold "
                f"{self.max_context_tokens} tokens per row; the pool has {int(self.capacity[0])} blocks")

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
        pass

    def _prefill_call(self, graphdef, params, lanes, first_call, starts, num_new, tokens, sampling, keys):
        batch = self.max_seqs
        rows = _fixed([lane.row for lane in lanes], batch)
        chunk_rows = np.where(num_new > 0, rows, -1).astype(np.int32)
        admit_rows = rows if first_call else np.full((batch,), -1, np.int32)
        prefix = np.full((batch, self.max_blocks_per_seq), -1, np.int32)
        lengths = np.zeros((batch,), np.int32)
        for i, lane in enumerate(lanes):
            prefix[i, : len(lane.hit.blocks[0])] = lane.hit.blocks[0]
            lengths[i] = len(lane.tokens)
        host = self.manager.host
        manager, self.pool, sampled, new_keys, ok, used = _paged_prefill(
            graphdef, params, _device_view(self.manager), self.pool, admit_rows, prefix, lengths, chunk_rows,
            starts.astype(np.int32), num_new, tokens, sampling, keys)
        self.manager = manager.replace(host=host)
        sampled, ok, used, new_keys = jax.device_get((sampled, ok, used, jax.random.key_data(new_keys)))
        if not ok:
            raise BookkeepingError(
                f"engine admission failed: rows {[lane.row for lane in lanes]} with "
                f"{int(sum(ceil_div(int(n), self.page_size) for n in lengths))} blocks "
                f"({int((prefix >= 0).sum())} cached), {int(self.free_blocks()[0])} of {int(self.capacity[0])} "
                "blocks free")
        return sampled, np.asarray(new_keys), int(used)

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
    state have no host copy yet); no prefix cache."""

    can_swap = False
    prefix_cache = None

    def __init__(self, model, *, max_seqs: int, max_context_tokens: int, num_blocks: dict | None,
                 entry_format: str, prefill_chunk: int):
        self.max_seqs = max_seqs
        self.max_context_tokens = max_context_tokens
        self.prefill_width = min(pow2_at_least(prefill_chunk), pow2_at_least(max_context_tokens))
        self.manager = model.make_cache(max_seqs, max_context_tokens, entry_format=entry_format,
                                        num_blocks=num_blocks)
        self.pool = None
        groups = self.manager.groups
        self.groups = tuple(groups)
        self.capacity = np.asarray([g.allocator.capacity for g in groups.values()], np.int64)
        self._per_block = [(g.tokens_per_entry, g.entries_per_block) for g in groups.values()]
        config = self.manager.config
        self.bytes_per_token = sum(block_bytes(s, config) / s.tokens_per_block
                                   for s in self.manager.schemas if s.group is not None)
        # What cannot be shared per token: rings, windows, recurrent state.
        self.state_bytes_per_request = (self.manager.memory_bytes() - sum(
            block_bytes(s, config) * int(self.capacity[self.groups.index(s.group)] + 1)
            for s in self.manager.schemas if s.group is not None)) / (max_seqs + 1)

    def free_blocks(self) -> np.ndarray:
        return np.asarray(jax.device_get([g.allocator.num_free for g in self.manager.groups.values()]), np.int64)

    def blocks_for(self, num_tokens: int) -> np.ndarray:
        """Blocks a request of ``num_tokens`` holds per group (a compressed
        group's blocks hold only completed entries)."""
        return np.asarray([ceil_div(num_tokens // per_entry, per_block) for per_entry, per_block in self._per_block],
                          np.int64)

    def peak_blocks(self, prompt_len: int, total: int) -> np.ndarray:
        return self.blocks_for(total)

    def blocks_in_use(self) -> int:
        return int(self.manager.blocks_in_use)

    def limits(self) -> str:
        return (f"max_context_tokens={self.max_context_tokens} per row; the groups have "
                f"{self.capacity.tolist()} blocks")

    def match(self, tokens: list, namespace) -> PrefixHit:
        return PrefixHit(0, tuple([] for _ in self.groups))

    def unpin(self, hit) -> None:
        pass

    def evict(self, shortfall: np.ndarray) -> None:
        pass

    def _begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """Take the lanes' request slots: the lowest free ones, which must be
        their rows + 1 (the engine gives out the lowest free rows)."""
        self.manager, slots, ok = _admit_hybrid(self.manager, len(lanes), self.max_seqs)
        slots, ok = jax.device_get((slots, ok))
        want = [lane.row + 1 for lane in lanes]
        if not ok or slots[: len(lanes)].tolist() != want:
            raise BookkeepingError(f"hybrid admission gave slots {slots[: len(lanes)].tolist()} (ok={bool(ok)}) "
                                   f"for rows {[lane.row for lane in lanes]}, which need slots {want}")

    def _prefill_call(self, graphdef, params, lanes, first_call, starts, num_new, tokens, sampling, keys):
        slots = _fixed([lane.row + 1 for lane in lanes], self.max_seqs)
        slots = np.where(num_new > 0, slots, -1).astype(np.int32)
        self.manager, sampled, new_keys, ok, used = _hybrid_prefill(graphdef, params, self.manager, slots, tokens,
                                                                    num_new, sampling, keys)
        sampled, ok, used, new_keys = jax.device_get((sampled, ok, used, jax.random.key_data(new_keys)))
        if not ok:
            need = sum(self.blocks_for(len(lane.tokens)) for lane in lanes)
            raise BookkeepingError(f"engine prefill failed: rows {[lane.row for lane in lanes]} need {need.tolist()} "
                                   f"blocks of groups {list(self.groups)}, {self.free_blocks().tolist()} free")
        return sampled, np.asarray(new_keys), int(used)

    def _decode_view(self):
        return self.manager, None

    def _decode_done(self, manager, pool) -> None:
        self.manager = manager

    def retire(self, finished: list) -> None:
        """Release the rows' slots and every block they hold."""
        if not finished:
            return
        rows = [row for row, *_ in finished]
        self.manager, ok = _release_hybrid(self.manager, _fixed([r + 1 for r in rows], self.max_seqs))
        if not bool(ok):
            raise BookkeepingError(f"engine bookkeeping failed: releasing rows {rows} (slots "
                                   f"{[r + 1 for r in rows]}) was refused")

    def swap_out(self, row: int) -> bool:
        return False

    def swap_in(self, row: int) -> bool:
        return False

    def row_status(self) -> np.ndarray:
        held = np.asarray(jax.device_get(self.manager.slots.ref_count(jnp.arange(1, self.max_seqs + 1)))) > 0
        return np.where(held, ON_DEVICE, FREE)
