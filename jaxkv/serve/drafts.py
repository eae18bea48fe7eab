"""The engine's draft models (``{"method": "draft_model", ...}``).

Two kinds, one interface (:meth:`chunk_arguments` for
:func:`jaxkv.serve.caches.speculative_chunk`, :meth:`finish` after it):

* :class:`SharedPoolDraft`: the target's own first ``draft_layers``
  layers over the target's paged pool (a self-speculative early exit:
  no cache, no prefill, no rollback of its own).
* :class:`DraftCache`: a separate model of the same vocabulary
  (``"model"``: a jaxkv paged-pool model or a checkpoint path) with a
  paged cache of its own, for any target (a hybrid cache's too).

A :class:`DraftCache` is an accelerator, never a source of tokens: the
target verifies every draft, so what the draft's cache holds changes how
many drafts are kept, never which tokens come out. That frees it from the
target's bookkeeping. It is filled lazily: each speculative chunk first
*catches up* the rows that will draft (a ragged append and one packed
forward of the draft over the tokens their target holds and the draft
does not yet: a new request's prompt once, then what plain chunks and
packed steps added; :func:`jaxkv.nn.speculative.draft_catch_up`), in the
same device call as the verify steps. Prefix hits, swaps, preemption and
aborts need nothing from it: a row whose request changed, or that stops
speculating, is emptied in the next chunk and caught up again when needed.

Its memory: as many pages of the target's page size as hold the tokens the
target's cache holds; a budget (``kv_cache_memory``, or the default)
sizes both together (:func:`jaxkv.serve.build.build_cache`'s
``draft_token_bytes``). The host plans each chunk so
that no append in it can fail (:meth:`DraftCache.plan`): the rows that
would overflow the pool, taken in admission order, do not speculate in
that chunk (and give their pages back), and the catch-up of one chunk is
capped at ``catch_up_tokens`` (a row still behind after it waits for the
next chunk).
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.errors import KVCacheError
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn import sharding
from jaxkv.nn.packed import PackedLane, pack
from jaxkv.serve.caches import hashed_graphdef

logger = logging.getLogger("jaxkv.serve")

__all__ = ["DraftCache", "DraftPlan", "SharedPoolDraft", "build_draft", "catch_up_bucket", "param_fraction"]


def param_fraction(draft, target) -> float:
    """The draft's parameters over the target's (bytes): what one draft
    decode step costs next to one of the target's, for θ
    (:func:`jaxkv.serve.speculation.break_even`; decode reads the weights)."""
    def size(model):
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))

    return size(draft) / max(size(target), 1)


class SharedPoolDraft:
    """An early-exit draft over the target's own paged pool
    (:func:`jaxkv.nn.speculative.early_exit_draft` with ``share_pool``)."""

    #: Its drafts are drawn in a packed step's verify lanes too (over the pool the lanes were appended to).
    packs_verify_lanes = True

    def __init__(self, draft, target):
        graphdef, self.params = nnx.split(draft)
        self.graphdef = hashed_graphdef(graphdef)
        #: A draft step's cost in target decode steps: its layers over the target's.
        self.cost_fraction = draft.config.num_hidden_layers / draft.pool_layers

    def plan(self, running: dict, speculate: np.ndarray, steps: int, k: int) -> np.ndarray:
        """Every speculating row drafts (the pool is the target's)."""
        return speculate

    def chunk_arguments(self) -> tuple:
        """``(draft_params, draft_manager, draft_pool, draft_reset, catch_up)``
        for :func:`~jaxkv.serve.caches.speculative_chunk`, then its static
        ``draft_graphdef``."""
        return (self.params, None, None, None, None), self.graphdef

    def finish(self, spec, draft_lengths, ok: bool, blocked) -> None:
        """Nothing to keep: the target's pool is the draft's."""

    def lengths(self, spec):
        return None

    def rebuilt(self) -> None:
        """Nothing held."""


def catch_up_bucket(tokens: int, cap: int) -> int:
    """The stream length of a catch-up of ``tokens``: the least power of 4
    from 16 that holds them, at most ``pow2_at_least(cap)``. Each length
    compiles the speculative chunk once more (it is a static shape), so
    the lengths are few: a catch-up pads at most 4x, and only the draft
    runs over it."""
    size, top = 16, max(pow2_at_least(cap), 16)
    while size < tokens and size < top:
        size *= 4
    return min(size, top)


@dataclasses.dataclass
class DraftPlan:
    """One chunk's work for a :class:`DraftCache` (:meth:`DraftCache.plan`):
    rows to empty, the catch-up batch (None: nothing to feed) and each
    row's owner once the chunk ran."""

    reset: np.ndarray
    batch: object
    owner: list


@partial(jax.jit, donate_argnums=(0,))
def _open_rows(manager: BlockSpaceManager) -> BlockSpaceManager:
    """Every row ON_DEVICE at length 0 (one shared token allocated, then
    truncated away), so that catch-ups only ever append and truncate."""
    rows = jnp.arange(manager.max_seqs, dtype=jnp.int32)
    opened, _ = manager.allocate(rows, 1)
    empty, _ = opened.truncate(rows, 0)
    return empty


class DraftCache:
    """A separate draft model and its own paged cache (module docstring).

    Invariants: every row of :attr:`manager` is ON_DEVICE; ``length[r]``
    (the host's mirror, read back with each chunk's results) is the tokens
    row ``r`` holds; a row whose ``owner`` is request ``q`` holds the K/V
    the draft model computes for ``q``'s first ``length[r]`` tokens (prompt
    then output); a row with no owner is empty."""

    #: Its requests bring one token to packed steps (the cache is caught up in the speculative chunks only).
    packs_verify_lanes = False

    def __init__(self, draft, target, *, max_seqs: int, num_pages: int, page_size: int, max_tokens: int,
                 catch_up_tokens: int, kv_dtype=None, mesh=None):
        graphdef, self.params = nnx.split(draft)
        self.graphdef = hashed_graphdef(graphdef)
        self.cost_fraction = param_fraction(draft, target)
        self.max_seqs, self.page_size, self.num_pages = max_seqs, page_size, num_pages
        #: The longest a row grows (a request at max_model_len with a verify step's drafts past it).
        self.max_tokens = max_tokens
        self.catch_up_tokens = max(int(catch_up_tokens), 1)
        self._make = partial(self._fresh, draft, kv_dtype, mesh)
        self.rebuilt()

    def _fresh(self, draft, kv_dtype, mesh):
        """An empty cache; on ``mesh`` placed as the target's paged cache is
        (:meth:`~jaxkv.serve.caches.CacheBase.place_on`: the pool's heads
        over ``tp``, the manager replicated)."""
        manager = BlockSpaceManager.create(
            num_device_blocks=self.num_pages, num_host_blocks=2, block_size=self.page_size, max_seqs=self.max_seqs,
            max_blocks_per_seq=ceil_div(self.max_tokens, self.page_size), watermark=0.0)
        manager, pool = _open_rows(manager), draft.make_pool(self.num_pages, self.page_size, dtype=kv_dtype)
        if mesh is not None:
            manager, pool = sharding.replicate(manager, mesh), sharding.shard_cache(pool, mesh)
        return manager, pool

    def rebuilt(self) -> None:
        """Empty again (at start-up, and after a contained engine failure:
        the arrays a failed call was given may be gone)."""
        self.manager, self.pool = self._make()
        self.capacity = int(self.manager.device.capacity)
        self.length = np.zeros((self.max_seqs,), np.int64)
        self.owner: list = [None] * self.max_seqs
        self.pending: DraftPlan | None = None

    @property
    def pool_bytes(self) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self.pool))

    def _blocks(self, tokens: int) -> int:
        return ceil_div(max(int(tokens), 0), self.page_size)

    def plan(self, running: dict, speculate: np.ndarray, steps: int, k: int) -> np.ndarray:
        """Plan the next chunk (``steps`` verify steps of ``k`` drafts) for
        the rows ``running`` (row -> request) that ``speculate``; returns
        the rows that draft in it (a subset: the others decode one token a
        step). Nothing changes until :meth:`finish` (the plan is kept in
        :attr:`pending`; a chunk that does not run leaves it unused).

        Rows of no speculating request are emptied. A speculating row
        keeps its tokens when its owner is still its request (else it is
        emptied and fed from the start) and is fed the tokens its target
        holds past them; it drafts when it is then level with the target
        and its peak in the chunk (``steps`` verify steps of ``k + 1``
        positions) fits the free pages left by the rows before it (in
        admission order). A row that does not fit is emptied; one that
        the ``catch_up_tokens`` cap leaves behind keeps what it got."""
        owner = [None] * self.max_seqs
        drafting = np.zeros_like(speculate)
        for row, req in running.items():
            if speculate[row]:
                owner[row] = req.id
        reset = np.array([self.length[row] > 0 and self.owner[row] != owner[row] for row in range(self.max_seqs)])
        have = np.where(reset, 0, self.length)
        free = self.capacity - sum(self._blocks(n) for n in have)
        budget, lanes = self.catch_up_tokens, []
        for row, req in sorted(((row, req) for row, req in running.items() if speculate[row]),
                               key=lambda item: item[1].order):
            held = req.kv_len  # all but the last token (the next verify step feeds it)
            if have[row] > held:  # never expected (the target only grows): start again
                reset[row], free, have[row] = True, free + self._blocks(have[row]), 0
            take = min(held - int(have[row]), budget)
            level = take == held - have[row]
            peak = min(held + steps * (k + 1), self.max_tokens) if level else have[row] + take
            more = self._blocks(peak) - self._blocks(have[row])
            if more > free:  # no room: give the row's pages back, it decodes plainly in this chunk
                reset[row] = reset[row] or have[row] > 0
                free += self._blocks(have[row])
                owner[row], have[row] = None, 0
                continue
            free -= more
            if take:
                start = int(have[row])
                lanes.append(PackedLane(row, req.tokens_between(start, start + take), start, sample=False))
                budget -= take
            drafting[row] = level
        batch = None
        if lanes:
            size = catch_up_bucket(sum(len(lane.tokens) for lane in lanes), self.catch_up_tokens)
            batch = pack(lanes, num_lanes=self.max_seqs, num_tokens=size, num_prefill_lanes=self.max_seqs,
                         max_prefill_len=size)
        self.pending = DraftPlan(reset, batch, owner)
        return drafting

    def chunk_arguments(self) -> tuple:
        """As :meth:`SharedPoolDraft.chunk_arguments`, for the planned chunk."""
        plan = self.pending
        return (self.params, self.manager, self.pool, jnp.asarray(plan.reset), plan.batch), self.graphdef

    def lengths(self, spec):
        """The device array of row lengths to read back with the chunk's results."""
        return spec.draft_manager.seq_lens

    def finish(self, spec, draft_lengths, ok: bool, blocked) -> None:
        """Take the draft's cache back from the chunk ``spec`` (its state
        after the catch-up and the verify steps), ``draft_lengths`` (its
        rows' lengths, read on the host), and the chunk's ``ok`` and
        ``blocked``: a chunk that stopped with no target row blocked was
        stopped by the draft's cache, which :meth:`plan` rules out
        (``KVCacheError``: a bug, which the engine contains)."""
        plan, self.pending = self.pending, None
        self.manager, self.pool = spec.draft_manager, spec.draft_pool
        lengths = np.asarray(draft_lengths, np.int64)
        over = [row for row in range(self.max_seqs) if plan.owner[row] is None and lengths[row] > 0]
        if over or (not ok and not np.any(blocked)):
            raise KVCacheError(f"draft cache: an append failed or rows {over} hold tokens of no request "
                               f"({self.capacity} pages of {self.page_size}; lengths {lengths.tolist()}): "
                               "DraftCache.plan is wrong")
        self.length, self.owner = lengths, plan.owner


def build_draft(draft_model, target, shares_pool: bool, cache, *, max_seqs: int, page_size: int, lookahead: int,
                catch_up_tokens: int, kv_dtype=None, mesh=None):
    """The engine's draft for ``draft_model`` (None: none): over the
    target's pool (``shares_pool``) or a :class:`DraftCache` holding as
    many tokens as the target's ``cache`` (its plan's largest group), at
    most every row at full length (``max_context_tokens + lookahead + 1``
    tokens each: its rows share nothing), logged; on ``mesh`` (the draft
    model placed there already) its cache too."""
    if draft_model is None:
        return None
    if shares_pool:
        return SharedPoolDraft(draft_model, target)
    row = cache.max_context_tokens + lookahead + 1
    tokens = min(max(g.tokens for g in cache.plan.groups), max_seqs * row)
    draft = DraftCache(draft_model, target, max_seqs=max_seqs, num_pages=ceil_div(tokens, page_size) + 1,
                       page_size=page_size, max_tokens=row, catch_up_tokens=catch_up_tokens, kv_dtype=kv_dtype,
                       mesh=mesh)
    logger.info("speculative draft model %s: a paged cache of its own, %d pages of %d tokens (%d bytes)",
                type(draft_model).__name__, draft.num_pages, draft.page_size, draft.pool_bytes)
    return draft
