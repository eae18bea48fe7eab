"""What a request costs in blocks, per group of the cache: the arithmetic
of admission, the running requests' reserve and preemption
(:mod:`jaxkv.serve.scheduler`). Pure functions of the cache's block
arithmetic (:mod:`jaxkv.serve.caches`) and a request's record; only
:func:`make_room` changes anything (it evicts cached prefixes).

The rule they keep: a request ``add_request`` accepts is admitted on an
empty engine (:func:`admission_blocks` with no hit is at most the cache's
``peak_blocks``), and a running request reserves the blocks of its next
decode chunk (:func:`growth`), so admitting another never forces an
immediate preemption."""

from __future__ import annotations

import numpy as np

from jaxkv.serve.caches import PrefixHit
from jaxkv.serve.request import Request

__all__ = ["admission_blocks", "growth", "growth_bound", "growth_total", "make_room", "no_hit", "readmittable",
           "steps_ahead"]


def steps_ahead(cache, req: Request, decode_chunk: int) -> int:
    """Decode steps whose blocks ``req`` reserves: its next chunk's,
    never more than it has tokens left to generate (one more than its
    remaining decode steps: the fit rule's count, see
    :func:`jaxkv.nn.steps.paged_peak_blocks`). With a window on every
    layer, all it has left: a windowed request then never has to be
    preempted, which matters because a recomputation would prefill its
    prompt and output whole, more blocks than its window needs and
    possibly more than the pool has."""
    left = max(req.max_new - len(req.generated), 0)
    # A speculative verify step may hold ``lookahead`` rejected tokens past the request's end for a moment
    # (a chunk then writes at most ``left + lookahead`` positions; ``decode_chunk`` counts a verify step's).
    ahead = left + cache.lookahead if left else 0
    return ahead if cache.window is not None else min(decode_chunk, ahead)


def growth(cache, req: Request, decode_chunk: int) -> np.ndarray:
    """Free blocks ``req`` (RUNNING) may take over :func:`steps_ahead`."""
    steps = steps_ahead(cache, req, decode_chunk)
    if req.pieces or not req.generated:  # still prefilling: it holds its whole prompt's blocks, untrimmed
        tokens = len(req.tokens)
        return cache.growth(tokens, steps, cache.blocks_for(tokens), req.shared)
    # Decoding: the fewest blocks it can hold at kv_len (a row not trimmed
    # yet holds more, so this over-reserves by at most the trim).
    return cache.growth(req.kv_len, steps, cache.held_blocks(req.kv_len), req.shared)


def growth_total(cache, reqs: list, decode_chunk: int) -> np.ndarray:
    """The sum of :func:`growth` over ``reqs`` (RUNNING requests), computed
    with array operations over them (the cache's ``*_many`` arithmetic,
    equal row by row to its per-request methods): the running requests'
    reserve costs the host a pass over their records, not a call per
    request and group."""
    groups = len(cache.groups)
    if not reqs:
        return np.zeros(groups, np.int64)
    n = len(reqs)
    columns = np.asarray([(len(r.prompt), len(r.generated), r.max_new, bool(r.pieces) or not r.generated)
                          for r in reqs], np.int64).reshape(n, 4)
    prompt, generated, max_new, prefilling = columns.T
    prefilling = prefilling.astype(bool)
    shared = np.asarray([r.shared for r in reqs], np.int64).reshape(n, groups)
    left = np.maximum(max_new - generated, 0)
    ahead = np.where(left > 0, left + cache.lookahead, 0)
    steps = ahead if cache.window is not None else np.minimum(decode_chunk, ahead)  # steps_ahead
    tokens = prompt + generated
    # Still prefilling: its whole prompt's blocks, untrimmed; decoding: the fewest blocks it holds at kv_len.
    num = np.where(prefilling, tokens, tokens - 1)
    held = np.where(prefilling[:, None], cache.blocks_for_many(num), cache.held_blocks_many(num))
    return cache.growth_many(num, steps, held, shared).sum(axis=0).astype(np.int64)


def growth_bound(cache, count: int, decode_chunk: int) -> np.ndarray | None:
    """A bound of :func:`growth_total` over any ``count`` running requests,
    per group, from the block arithmetic alone (no pass over their
    records): None with a window on every layer (a request then reserves
    all it has left). Without one, a request reserves at most
    ``decode_chunk`` steps, and ``n + s`` tokens take at most
    ``blocks_for(s) + 1`` more blocks than ``n`` do (the ``+ 1``: a
    boundary crossed, or an entry a compressed group completes)."""
    if cache.window is not None:
        return None
    return count * (cache.blocks_for(decode_chunk) + 1)


def admission_blocks(cache, req: Request, hit, decode_chunk: int) -> np.ndarray:
    """Free blocks admitting ``req`` with ``hit`` takes now (its tokens'
    blocks less the hit's) plus its growth over :func:`steps_ahead`.
    On an empty engine with no hit this is at most ``peak_blocks``, the
    rule ``add_request`` checked."""
    tokens = len(req.tokens)
    held, shared = cache.blocks_for(tokens), hit.block_counts()
    return held - shared + hit.extra_blocks() + cache.growth(tokens, steps_ahead(cache, req, decode_chunk), held, shared)


def no_hit(cache) -> PrefixHit:
    """A prefix hit of nothing (one empty block list per group)."""
    return PrefixHit(0, tuple([] for _ in cache.groups))


def make_room(cache, blocks: np.ndarray) -> bool:
    """Evict cached prefixes until ``blocks`` (per group) are free;
    whether they are. Evicts again while short: a page a running row
    still holds (a windowed row's hit) gives no block back."""
    free = cache.free_blocks()
    while np.any(free < blocks) and cache.can_evict():
        cache.evict(np.maximum(blocks - free, 0))
        free = cache.free_blocks()
    return bool(np.all(free >= blocks))


def readmittable(cache, req: Request, decode_chunk: int) -> bool:
    """Whether ``req``, preempted for recomputation now, fits an empty
    engine again (its prompt and output prefilled whole). Always, without
    a window; a windowed request is never preempted (its reserve covers
    its whole output), so this only guards that rule. (Swapping would
    not need it, but a swap-out the host pool cannot take falls back to
    recomputation.)"""
    return bool(np.all(admission_blocks(cache, req, no_hit(cache), decode_chunk) <= cache.capacity))
