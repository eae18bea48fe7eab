"""Which cache a model gets and how big: the adapter of its ``cache_kind``
(:func:`jaxkv.nn.packed.cache_kind`), sized by the one rule of
:mod:`jaxkv.serve.sizing` (:func:`build_paged_cache`,
:func:`build_hybrid_cache`), and the scheduler options derived for the
device (:func:`resolve_options`). The engine calls :func:`resolve_options`
and :func:`build_cache` and then speaks only the contract of
:mod:`jaxkv.serve.caches`.

On a mesh (``mesh=``) both count one device's share: the bytes a block
costs are what one device holds of it (:func:`jaxkv.serve.sizing.device_bytes`
over :func:`jaxkv.nn.sharding.cache_sharding`: a KV pool's heads split over
``tp``, bookkeeping and latent caches whole), against one device's budget
(the least free memory of the mesh's devices)."""

from __future__ import annotations

import collections.abc
import dataclasses
import logging

import jax

from jaxkv import _host
from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn import sharding
from jaxkv.nn.packed import cache_kind
from jaxkv.nn.speculative import hybrid_cache_options
from jaxkv.nn.steps import paged_peak_blocks, paged_window
from jaxkv.serve import sizing
from jaxkv.serve.caches import KVCache, blocks_from_budget
from jaxkv.serve.hybrid_cache import HybridCache
from jaxkv.serve.options import CacheOptions, EngineOptions, is_derived
from jaxkv.serve.paged_cache import PagedCache
from jaxkv.serve.program_memory import (PROGRAM_MARGIN, MeasuredPrograms, ProgramMemory, as_shapes,
                                        engine_programs)
from jaxkv.serve.program_memory import measure as measure_programs

__all__ = ["build_cache", "build_hybrid_cache", "build_paged_cache", "derive_scheduler_defaults", "measures_programs",
           "program_reserve", "resolve_options", "room_for_programs"]

logger = logging.getLogger("jaxkv.serve")


def build_cache(model, options: CacheOptions, *, max_seqs: int, prefill_chunk: int,
                free_bytes: int | None = None, mesh=None, lookahead: int = 0,
                draft_token_bytes: float = 0.0, temporaries=None) -> KVCache:
    """The cache for ``model`` by its ``cache_kind`` (:mod:`jaxkv.nn.packed`):
    a :class:`~jaxkv.serve.hybrid_cache.HybridCache` or a
    :class:`~jaxkv.serve.paged_cache.PagedCache`, sized by the one rule of
    :mod:`jaxkv.serve.sizing` from ``options`` (checked when they were made:
    :mod:`jaxkv.serve.options`). ``mesh``: the mesh the cache will be
    placed on (the caller places it): sized by one device's share (module
    docstring), its plan's bytes per device; ``free_bytes`` default then
    the least free memory of the mesh's devices. ``lookahead``: tokens a
    row may hold past its request's end for a moment (a speculative verify
    step's rejected drafts): the tables get room for them and the
    reserve counts them. ``draft_token_bytes``: the bytes one token costs
    a separate draft model's cache, which holds the tokens the target's
    holds (:class:`~jaxkv.serve.drafts.DraftCache`): a budget sizes both
    together. ``temporaries``: with the default budget, what the engine's
    programs need beside the cache (:func:`program_reserve`): the cache
    leaves room for it (:func:`room_for_programs`). An option of the
    other kind of cache is refused (``InvalidArgument`` naming it and the
    options that apply)."""
    o = options
    if free_bytes is None and mesh is not None:
        free_bytes = sizing.mesh_free_bytes(mesh)
    if cache_kind(model) == "hybrid":
        given = [name for name, value in (("num_pages", o.num_pages), ("max_blocks_per_seq", o.max_blocks_per_seq),
                                          ("kv_dtype", o.kv_dtype)) if value is not None]
        given += [name for name, value in (("num_host_pages", o.num_host_pages),
                                           ("host_prefix_pages", o.host_prefix_pages)) if value]
        if given:
            raise InvalidArgument(f"{', '.join(given)}: options of the paged pool; {type(model).__name__} "
                                  "keeps its cache in a KVCacheManager (give max_model_len, kv_cache_memory, "
                                  "host_kv_memory; or max_context_tokens, num_blocks, entry_format)")
        cache = build_hybrid_cache(
            model, max_seqs=max_seqs, max_model_len=o.max_model_len, max_context_tokens=o.max_context_tokens,
            num_blocks=_block_counts(o.num_blocks), kv_cache_memory=o.kv_cache_memory, num_snapshots=o.num_snapshots,
            entry_format=o.entry_format, prefill_chunk=prefill_chunk, prefix_cache=o.prefix_cache,
            free_bytes=free_bytes, retention=o.snapshot_retention, snapshot_interval=o.snapshot_interval,
            host_kv_memory=o.host_kv_memory, host_prefix_memory=o.host_prefix_memory, mesh=mesh, lookahead=lookahead,
            draft_token_bytes=draft_token_bytes, temporaries=temporaries)
        if o.kv_disk_dir is not None:
            cache.attach_disk(model, o.kv_disk_dir, o.kv_disk_bytes, o.entry_format)
        return cache
    if o.kv_disk_dir is not None and not o.prefix_cache:
        raise InvalidArgument(f"kv_disk_dir={o.kv_disk_dir!r}: the disk tier belongs to the prefix cache; "
                              "prefix_cache is off")
    given = [name for name, value in (("max_context_tokens", o.max_context_tokens), ("num_blocks", o.num_blocks),
                                      ("num_snapshots", o.num_snapshots), ("snapshot_interval", o.snapshot_interval))
             if value is not None] + (["snapshot_retention"] if o.snapshot_retention != "value" else [])
    if given:
        raise InvalidArgument(f"{', '.join(given)}: options of a hybrid cache; "
                              f"{type(model).__name__} runs over a paged pool (give max_model_len, "
                              "kv_cache_memory; or num_pages, max_blocks_per_seq)")
    cache = build_paged_cache(
        model, max_seqs=max_seqs, page_size=o.page_size, max_model_len=o.max_model_len, num_pages=o.num_pages,
        max_blocks_per_seq=o.max_blocks_per_seq, kv_cache_memory=o.kv_cache_memory,
        num_host_pages=o.num_host_pages, host_kv_memory=o.host_kv_memory, kv_dtype=o.kv_dtype,
        prefix_cache=o.prefix_cache, prefill_chunk=prefill_chunk, host_memory_kind=o.host_memory_kind,
        free_bytes=free_bytes, host_prefix_pages=o.host_prefix_pages, host_prefix_memory=o.host_prefix_memory,
        mesh=mesh, lookahead=lookahead, draft_token_bytes=draft_token_bytes, temporaries=temporaries)
    if o.kv_disk_dir is not None:
        cache.attach_disk(model, o.kv_disk_dir, o.kv_disk_bytes)
    return cache


def _pool_bytes(pool, mesh) -> int:
    """Bytes one device holds of a KV pool (``mesh`` None: all of it)."""
    if mesh is None:
        return sizing.tree_bytes(pool)
    return sizing.device_bytes(pool, sharding.pool_sharding(pool, mesh))


def _paged_bytes(tree, mesh) -> int:
    """Bytes one device holds of a paged cache's ``(manager, pool)``: the
    manager (bookkeeping) replicated, the pool split by its heads."""
    manager, pool = tree
    return sizing.tree_bytes(manager) + _pool_bytes(pool, mesh)


def _hybrid_bytes(manager, mesh) -> int:
    """Bytes one device holds of a hybrid cache's ``KVCacheManager``."""
    if mesh is None:
        return sizing.tree_bytes(manager)
    return sizing.device_bytes(manager, sharding.cache_sharding(manager, mesh))


def _mesh_words(mesh) -> str:
    return "x".join(f"{name}={size}" for name, size in dict(mesh.shape).items())


def _per_device_plan(plan: sizing.CachePlan, mesh, device_total: int, ratios) -> sizing.CachePlan:
    """``plan`` with one device's bytes: the cache's device bytes, and each
    group's bytes per token over ``ratios[g]`` (its whole block's bytes over
    one device's share)."""
    groups = tuple(dataclasses.replace(g, bytes_per_token=g.bytes_per_token / r) for g, r in zip(plan.groups, ratios))
    return dataclasses.replace(plan, groups=groups, device_bytes=int(device_total),
                               source=f"{plan.source}; bytes per device of a {_mesh_words(mesh)} mesh")


def _block_counts(value) -> dict[str, int] | None:
    """``num_blocks`` of a hybrid cache checked: None, or a dict mapping block
    group names (str) to integers ``>= 2`` (the null block included), else
    ``InvalidArgument`` naming ``num_blocks``, what was given and what is
    expected. (Group names the model does not have are refused by
    ``KVCacheManager.create``, which knows them.)"""
    if value is None:
        return None
    expected = "expected None or a dict of block group name -> integer >= 2 (null block included), e.g. {'full': 64}"
    if not isinstance(value, collections.abc.Mapping):
        raise InvalidArgument(f"num_blocks={_host.short_repr(value)} ({type(value).__name__}): {expected}")
    counts = {}
    for name, count in value.items():
        if not isinstance(name, str):
            raise InvalidArgument(f"num_blocks={_host.short_repr(value)}: group name {name!r} is not a string; {expected}")
        try:
            counts[name] = _host.int_scalar(count, f"num_blocks[{name!r}]")
        except InvalidArgument as err:
            raise InvalidArgument(f"num_blocks={_host.short_repr(value)}: {err}; {expected}") from None
        if counts[name] < 2:
            raise InvalidArgument(f"num_blocks={_host.short_repr(value)}: group {name!r} has {counts[name]} blocks; "
                                  f"{expected}")
    return counts


def _sized_with_draft(sized, draft_token_bytes: float, tokens_per_block: int, draft_cap: int):
    """Blocks from the budget with a separate draft model's cache beside
    the target's (``sized(draft_bytes)``: :func:`blocks_from_budget` with
    ``draft_bytes(counts)`` added to the cache's bytes). The draft holds
    the tokens the target's first group holds, at most ``draft_cap`` (every
    row at full length: its rows share nothing): first solved with the
    draft's bytes growing with the target's tokens; when the target then
    holds more than the cap, solved again with the draft at the cap (a
    fixed cost, so the target's tokens only grow and stay past the cap)."""
    blocks, budget, source = sized(lambda counts: int(draft_token_bytes * counts[0] * tokens_per_block))
    if draft_token_bytes and blocks[0] * tokens_per_block > draft_cap:
        blocks, budget, source = sized(lambda counts: int(draft_token_bytes * draft_cap))
    return blocks, budget, source


def room_for_programs(temporaries, free_bytes: int | None, solve, cache_bytes, shapes):
    """The default budget's blocks (``solve(None)``), unless they, the
    engine's programs' temporaries over them (``temporaries(shapes(blocks))``,
    a :class:`~jaxkv.serve.program_memory.ProgramMemory`) and
    :data:`~jaxkv.serve.program_memory.PROGRAM_MARGIN` pass the free memory:
    then the blocks of what is left (``solve(bytes)``). The fraction the
    default leaves free is a guess; this is XLA's figure for the programs
    that will run (:mod:`jaxkv.serve.program_memory`).

    When what is left is under half the cache the default gives and the
    token budget was derived (``temporaries`` a
    :class:`~jaxkv.serve.program_memory.MeasuredPrograms` that is
    ``lowerable``), the token budget is lowered first until the temporaries
    leave that half (:meth:`~jaxkv.serve.program_memory.MeasuredPrograms.lower`;
    the engine runs with it): a packed step over 8,192 tokens of
    DeepSeek-V4-Flash on eight H100s needs 29 GB of temporaries where 6.8 GB
    are free. Returns ``(blocks, budget, source, bytes kept for the
    programs)``; ``InvalidArgument`` with the numbers when the temporaries
    leave no room."""
    blocks, budget, source = solve(None)
    memory = temporaries(shapes(blocks))
    free, where = sizing.free_memory(free_bytes)
    room = free - memory.largest - PROGRAM_MARGIN
    logger.info("KV cache: %s; %d bytes free (%s)", memory.words(), free, where)
    half = cache_bytes(blocks) // 2  # of the cache the default gives
    lowered = ""
    if room < half and getattr(temporaries, "lowerable", False):
        before = temporaries.token_budget
        better = temporaries.lower(shapes(blocks), memory, free - PROGRAM_MARGIN - half)
        if better is not None:
            lowered = (f"; the token budget lowered from {before} to {temporaries.token_budget}: "
                       f"{memory.words()} left {max(room, 0)} bytes")
            memory, room = better, free - better.largest - PROGRAM_MARGIN
            logger.info("KV cache: token budget lowered from %d to %d: %s", before, temporaries.token_budget,
                        memory.words())
    if cache_bytes(blocks) <= room:
        return blocks, budget, f"{source}; leaves room for {memory.words()}{lowered}", memory.largest
    if room < 1:
        raise InvalidArgument(
            f"{free} free device bytes ({where}) do not hold {memory.words()} and a margin of {PROGRAM_MARGIN} "
            "bytes: no room is left for the KV cache. Give a smaller max_num_batched_tokens or max_seqs, more "
            "devices, or kv_cache_memory= (bytes) to size the cache by hand")
    if isinstance(temporaries, MeasuredPrograms):  # what the engine re-derives its rows from (also if this raises)
        temporaries.measured, temporaries.limited_to = memory, room
    blocks, budget, _ = solve(room)
    return blocks, budget, (f"default: {free} free bytes ({where}) less {memory.words()} and a margin of "
                            f"{PROGRAM_MARGIN} bytes: {room} bytes (0.8 of the free memory would not leave them)"
                            f"{lowered}"), memory.largest


def build_paged_cache(model, *, max_seqs: int, page_size: int, max_model_len: int | None, num_pages: int | None,
          max_blocks_per_seq: int | None, kv_cache_memory, num_host_pages: int | None, host_kv_memory,
          kv_dtype, prefix_cache: bool, prefill_chunk: int, host_memory_kind: str,
          free_bytes: int | None = None, host_prefix_pages: int | None = None,
          host_prefix_memory: int | None = None, mesh=None, lookahead: int = 0,
          draft_token_bytes: float = 0.0, temporaries=None) -> PagedCache:
    """The one sizing rule (:mod:`jaxkv.serve.sizing`) for a paged pool.

    ``max_model_len`` (None: from ``max_blocks_per_seq * page_size`` when
    that is given, else :func:`~jaxkv.serve.sizing.default_max_model_len`)
    sets the table width ``ceil(max_model_len / page_size)``; giving
    both with another width is refused. Pages: ``num_pages`` as given
    (an expert option; ``kv_cache_memory`` beside it is refused), else
    from the budget. Host pages: ``num_host_pages``, or
    ``host_kv_memory`` bytes of host memory (not both; default none).
    ``host_prefix_pages``: pages of the prefix cache's host tier, or
    ``host_prefix_memory`` bytes of them (not both; None or 0: none;
    refused with ``prefix_cache`` off). A ``max_model_len`` given here
    that the pool cannot hold is refused; the default one is
    lowered to what the pool holds (logged). ``mesh``: bytes are one
    device's (the pool split by heads; :func:`build_cache`)."""
    window = paged_window(model)
    if host_prefix_pages and not prefix_cache:
        raise InvalidArgument(f"host_prefix_pages={host_prefix_pages}: a host tier of the prefix cache needs "
                              "prefix_cache=True")
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
    if host_prefix_memory is not None:
        if host_prefix_pages is not None:
            raise InvalidArgument(f"host_prefix_pages={host_prefix_pages} and host_prefix_memory="
                                  f"{host_prefix_memory} both size the prefix cache's host tier: give one of them")
        host_prefix_pages = host_prefix_memory // page_bytes
        if host_prefix_pages and not prefix_cache:
            raise InvalidArgument(f"host_prefix_memory={host_prefix_memory}: a host tier of the prefix cache "
                                  "needs prefix_cache=True")

    def need(length: int) -> int:  # blocks a request of ``length`` tokens holds at its peak
        return max(paged_peak_blocks(max(length - 1, 1), length, page_size, window),
                   paged_peak_blocks(1, length, page_size, window))

    def measure(counts, length):
        def make():
            manager = BlockSpaceManager.create(
                num_device_blocks=counts[0], num_host_blocks=max(num_host_pages, 2), block_size=page_size,
                max_seqs=max_seqs, max_blocks_per_seq=ceil_div(length, page_size), watermark=0.0)
            return manager, model.make_pool(counts[0], page_size, dtype=kv_dtype)
        return _paged_bytes(jax.eval_shape(make), mesh)

    budget, source, reserved = None, f"num_pages={num_pages} (expert option)", 0
    if num_pages is None:
        draft_cap = max_seqs * (max_model_len + lookahead + 1)

        def solve(memory):
            def sized(draft_bytes):
                return blocks_from_budget(lambda counts: measure(counts, max_model_len) + draft_bytes(counts),
                                          [page_size], [max_seqs * need(max_model_len)], memory, free_bytes)
            return _sized_with_draft(sized, draft_token_bytes, page_size, draft_cap)

        def shapes(blocks):  # the cache's arrays as the programs take them (the manager without its host allocator)
            manager, pool = jax.eval_shape(lambda: (BlockSpaceManager.create(
                num_device_blocks=blocks[0] + 1, num_host_blocks=2, block_size=page_size, max_seqs=max_seqs,
                max_blocks_per_seq=ceil_div(max_model_len + lookahead, page_size), watermark=0.0),
                model.make_pool(blocks[0] + 1, page_size, dtype=kv_dtype)))
            manager = manager.replace(host=None)
            if mesh is None:
                return manager, pool
            return (as_shapes(manager, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
                    as_shapes(pool, sharding.pool_sharding(pool, mesh)))

        def cache_bytes(blocks):
            return measure([blocks[0] + 1], max_model_len) + int(draft_token_bytes * min(blocks[0] * page_size,
                                                                                          draft_cap))

        if kv_cache_memory is None and temporaries is not None:
            blocks, budget, source, reserved = room_for_programs(temporaries, free_bytes, solve, cache_bytes,
                                                                  shapes)
        else:
            blocks, budget, source = solve(kv_cache_memory)
        held = blocks[0] * page_size
        if need(max_model_len) > blocks[0] and not len_given and held >= 2:
            logger.info("KV cache: the default max_model_len %d does not fit %d pages of %d; lowered to %d",
                        max_model_len, blocks[0], page_size, held)
            max_model_len = held
            while need(max_model_len) > blocks[0]:  # a window's peak may be a block over the tokens
                max_model_len -= 1
        num_pages = blocks[0] + 1
    elif need(max_model_len) > num_pages - 1 and not len_given and (num_pages - 1) * page_size >= 2:
        # The expert pool is smaller than the default length: advertise what it holds, as for a budget.
        logger.info("KV cache: the default max_model_len %d does not fit num_pages=%d of %d; lowered to %d",
                    max_model_len, num_pages, page_size, (num_pages - 1) * page_size)
        max_model_len = (num_pages - 1) * page_size
        while max_model_len > 2 and need(max_model_len) > num_pages - 1:
            max_model_len -= 1
    if explicit and need(max_model_len) > num_pages - 1 and window is None:
        raise InvalidArgument(
            f"max_model_len={max_model_len}: a request of {max_model_len} tokens holds {need(max_model_len)} "
            f"pages of {page_size} at its peak; the pool has {num_pages - 1} ({source}); give a smaller "
            "max_model_len or more memory")
    cache = PagedCache(model, num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                max_blocks_per_seq=ceil_div(max_model_len + lookahead, page_size), num_host_pages=num_host_pages,
                prefix_cache=prefix_cache, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                host_memory_kind=host_memory_kind, max_model_len=max_model_len,
                host_prefix_pages=host_prefix_pages or 0)
    cache.lookahead = lookahead
    _, per_block = sizing.affine_bytes(lambda counts: measure(counts, max_model_len), 1)
    cache.plan = cache._plan(budget=budget, source=source, per_block=per_block[0])
    if mesh is not None:
        pools = [jax.eval_shape(lambda n=n: model.make_pool(n, page_size, dtype=kv_dtype)) for n in (2, 3)]
        ratio = ((sizing.tree_bytes(pools[1]) - sizing.tree_bytes(pools[0]))
                 / max(_pool_bytes(pools[1], mesh) - _pool_bytes(pools[0], mesh), 1))
        cache.plan = _per_device_plan(cache.plan, mesh, measure([num_pages], max_model_len), [ratio])
    cache.plan = dataclasses.replace(cache.plan, program_bytes=reserved)
    return cache


def build_hybrid_cache(model, *, max_seqs: int, max_model_len: int | None, max_context_tokens: int | None,
          num_blocks: dict | None, kv_cache_memory, num_snapshots: int | None, entry_format: str,
          prefill_chunk: int, prefix_cache: bool, free_bytes: int | None = None, retention: str = "value",
          snapshot_interval: int | None = None, host_kv_memory: int | None = None,
          host_prefix_memory: int | None = None, mesh=None, lookahead: int = 0,
          draft_token_bytes: float = 0.0, temporaries=None) -> HybridCache:
    """The one sizing rule (:mod:`jaxkv.serve.sizing`) for a hybrid cache.

    ``max_model_len`` and ``max_context_tokens`` name the same limit
    (giving both with different values is refused; default
    :func:`~jaxkv.serve.sizing.default_max_model_len`). Blocks per group:
    ``num_blocks`` as given (an expert option; groups it leaves out get
    every row at full length, as ``KVCacheManager.create`` does;
    ``kv_cache_memory`` beside it is refused), else from the budget, all
    groups holding the same tokens. Cached snapshots: ``num_snapshots``,
    else with a budget ``min(2 * max_seqs, what a quarter of it holds)``
    (0: no prefix cache), else ``2 * max_seqs``; ``retention`` and
    ``snapshot_interval`` as in :class:`HybridCache`; ``host_kv_memory``:
    host bytes for swapped-out rows (None or 0: preempt by recompute);
    ``host_prefix_memory``: host bytes for prefixes evicted from the
    device (None or 0: none). A ``max_model_len`` given that a group cannot hold
    is refused; the default one is lowered to what every group holds.
    ``mesh``: bytes are one device's (:func:`build_cache`; the expert
    ``num_blocks`` are used as given). ``lookahead``: speculation's drafts
    per verify step (:class:`HybridCache`: a checkpoint state row per
    sequence row, counted in the budget, and tables ``lookahead`` tokens
    longer)."""
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
        cache = HybridCache(model, max_seqs=max_seqs, max_context_tokens=length, num_blocks=num_blocks,
                    entry_format=entry_format, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                    num_snapshots=num_snapshots, retention=retention, snapshot_interval=snapshot_interval,
                    host_kv_memory=host_kv_memory or 0, host_prefix_memory=host_prefix_memory or 0,
                    lookahead=lookahead)
        cache.plan = cache._plan(budget=None, source=f"num_blocks={num_blocks} (expert option)")
        return cache
    probe = jax.eval_shape(lambda: model.make_cache(1, length, entry_format=entry_format))
    names = list(probe.groups)
    per_entry = [(g.tokens_per_entry, g.entries_per_block) for g in probe.groups.values()]
    tokens_per_block = [g.tokens_per_block for g in probe.groups.values()]

    def blocks_for(n: int) -> list[int]:
        return [ceil_div(n // tpe, epb) for tpe, epb in per_entry]

    # HybridCache's speculation rows: ring slack, checkpoint rows.
    options, checkpoints = (hybrid_cache_options(model, lookahead, max_seqs, max_context_tokens=length,
                                                 entry_format=entry_format) if lookahead else ({}, 0))

    def measure(counts, cached, n, on=mesh):
        return _hybrid_bytes(jax.eval_shape(lambda: model.make_cache(
            max_seqs, n + lookahead, entry_format=entry_format, num_blocks=dict(zip(names, counts)),
            num_snapshots=cached + checkpoints, **options)), on)

    def snapshots(memory) -> int:  # cached snapshots for a budget: a quarter of it at most
        if not prefix_cache:
            return 0
        if num_snapshots is not None:
            return num_snapshots
        row = measure([2] * len(names), 2, length) - measure([2] * len(names), 1, length)
        hint = (sizing.resolve_budget(memory, free_bytes=free_bytes)[0] if memory is not None
                else sizing.default_budget(free_bytes)[0])
        return max(int(min(2 * max_seqs, hint // 4 // row) if row > 0 else 2 * max_seqs), 0)

    draft_cap = max_seqs * (length + lookahead + 1)
    cached = snapshots(kv_cache_memory)

    def solve(memory):
        nonlocal cached
        cached = snapshots(memory)

        def sized(draft_bytes):
            return blocks_from_budget(lambda counts: measure(counts, cached, length) + draft_bytes(counts),
                                      tokens_per_block, [max_seqs * b for b in blocks_for(length + lookahead)],
                                      memory, free_bytes)
        return _sized_with_draft(sized, draft_token_bytes, tokens_per_block[0], draft_cap)

    def shapes(blocks):  # the cache's arrays as the programs take them
        manager = jax.eval_shape(lambda: model.make_cache(
            max_seqs, length + lookahead, entry_format=entry_format,
            num_blocks=dict(zip(names, (b + 1 for b in blocks))), num_snapshots=cached + checkpoints, **options))
        return (manager if mesh is None else as_shapes(manager, sharding.cache_sharding(manager, mesh)),)

    def cache_bytes(blocks):
        return (measure([b + 1 for b in blocks], cached, length)
                + int(draft_token_bytes * min(blocks[0] * tokens_per_block[0], draft_cap)))

    reserved = 0
    if kv_cache_memory is None and temporaries is not None:
        blocks, budget, source, reserved = room_for_programs(temporaries, free_bytes, solve, cache_bytes, shapes)
    else:
        blocks, budget, source = solve(kv_cache_memory)
    held = min(b * t for b, t in zip(blocks, tokens_per_block))  # tokens every group holds
    # A request at max_model_len holds a verify step's rejected drafts past it for a moment.
    fits = all(need <= have for need, have in zip(blocks_for(length + lookahead), blocks))
    if not fits and len_given:
        extra = f" and {lookahead} speculated" if lookahead else ""
        raise InvalidArgument(
            f"max_model_len={length}: a request of {length}{extra} tokens holds {blocks_for(length + lookahead)} "
            f"blocks of groups {names}; the groups have {blocks} ({source}); give a smaller max_model_len or more "
            "memory")
    if not fits:
        logger.info("KV cache: the default max_model_len %d does not fit blocks %s of groups %s; lowered to %d",
                    length, blocks, names, held - lookahead)
        length = held - lookahead
    cache = HybridCache(model, max_seqs=max_seqs, max_context_tokens=length, num_blocks=dict(
        zip(names, (b + 1 for b in blocks))), entry_format=entry_format, prefill_chunk=prefill_chunk,
        prefix_cache=prefix_cache and cached > 0, num_snapshots=cached if cached else None, retention=retention,
        snapshot_interval=snapshot_interval, host_kv_memory=host_kv_memory or 0,
        host_prefix_memory=host_prefix_memory or 0, lookahead=lookahead)
    _, per_block = sizing.affine_bytes(lambda counts: measure(counts, cached, length), len(names))
    cache.plan = cache._plan(budget=budget, source=source, per_block=per_block)
    if mesh is not None:
        _, whole = sizing.affine_bytes(lambda counts: measure(counts, cached, length, None), len(names))
        cache.plan = _per_device_plan(cache.plan, mesh, measure([b + 1 for b in blocks], cached, length),
                                      [w / max(d, 1) for w, d in zip(whole, per_block)])
    cache.plan = dataclasses.replace(cache.plan, program_bytes=reserved)
    return cache


# ------------------------------------------------------- program temporaries


def program_reserve(model, options: EngineOptions, *, mesh=None, lowerable: bool = False):
    """What :func:`build_cache`'s ``temporaries`` gets for ``model`` run
    with ``options`` (resolved: :func:`resolve_options`): None when the
    cache is sized by hand (``kv_cache_memory``, ``num_pages``,
    ``num_blocks``) or on a CPU (:func:`measures_programs`); with
    ``program_memory`` given, those bytes; else a
    :class:`~jaxkv.serve.program_memory.MeasuredPrograms` that compiles the
    engine's largest programs over the cache's shapes (the packed step at
    the token budget, or the padded prefill call, and the decode chunk:
    :func:`jaxkv.serve.program_memory.engine_programs`) and reads their
    temporaries; ``lowerable``: the token budget was derived and may be
    lowered (:func:`room_for_programs`; the engine then runs with the
    reserve's ``token_budget``). ``model`` as the engine will run it
    (placed on ``mesh`` already)."""
    from flax import nnx

    from jaxkv.serve.caches import hashed_graphdef

    c, sched = options.cache, options.scheduler
    if c.kv_cache_memory is not None or c.num_pages is not None or c.num_blocks is not None:
        return None
    if c.program_memory is not None:
        given = ProgramMemory((("program_memory", int(c.program_memory)),), 0.0)
        return lambda shapes: given
    if not measures_programs(mesh):
        return None
    graphdef, params = nnx.split(model)
    graphdef = hashed_graphdef(graphdef)  # as the engine passes it: the same compiled programs
    # Unplaced on one device, as the engine's arrays are (jit then serves its first call from this compile).
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None if mesh is None
                                                         else x.sharding), params)
    kind = cache_kind(model)
    window = paged_window(model) if kind == "paged" else None
    stream = (sched.max_num_batched_tokens or sched.prefill_chunk) if sched.scheduler == "packed" else None
    replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def measure_at(cache_shapes: tuple, tokens: int | None) -> ProgramMemory:
        has_gdn = kind == "hybrid" and cache_shapes[0].gdn is not None
        return measure_programs(engine_programs(
            graphdef, params, cache_shapes, kind=kind, max_seqs=sched.max_seqs, decode_chunk=sched.decode_chunk,
            stream_length=tokens, prefill_chunk=pow2_at_least(sched.prefill_chunk), has_gdn=has_gdn, window=window,
            scrub=options.tenants.scrub_on_free, sharding=replicated))

    return MeasuredPrograms(measure_at, stream, lowerable=lowerable, floor=sched.max_seqs)


def measures_programs(mesh=None) -> bool:
    """Whether the engine measures its programs' temporaries before sizing
    its cache (:func:`program_reserve`): on an accelerator. A CPU keeps no
    memory statistics (:data:`~jaxkv.serve.sizing.CPU_FREE_BYTES` stands
    for its free memory: no device's limit to fit), and its compiles are
    the slow part of a CPU engine's start."""
    return _platform(mesh) != "cpu"


# ------------------------------------------------------- scheduler defaults

#: The scheduler options derived for the device when the user leaves them out.
DERIVED_OPTIONS = ("max_seqs", "max_num_batched_tokens", "decode_chunk", "prefill_chunk")


def _platform(mesh) -> str:
    """The platform of ``mesh``'s devices (an ``AbstractMesh`` has none:
    this process's first device's)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    return jax.devices()[0].platform


def paged_token_bytes(model, page_size: int, kv_dtype, mesh=None) -> tuple[float, float]:
    """The pool bytes one token costs ``model``'s paged pool: ``(on one
    device of mesh, whole)`` (the same without a mesh)."""
    pools = [jax.eval_shape(lambda n=n: model.make_pool(n, page_size, dtype=kv_dtype)) for n in (2, 3)]
    whole = sizing.tree_bytes(pools[1]) - sizing.tree_bytes(pools[0])
    device = _pool_bytes(pools[1], mesh) - _pool_bytes(pools[0], mesh)
    return device / page_size, whole / page_size


def derive_scheduler_defaults(model, options: EngineOptions, *, mesh=None, free_bytes: int | None = None,
                              platform: str | None = None) -> sizing.SchedulerDefaults:
    """What :func:`jaxkv.serve.sizing.scheduler_defaults` calls for on this
    device with ``model`` and ``options`` (a ``max_seqs`` given is kept):
    the platform (``platform``, default that of ``mesh``'s devices, else of
    ``jax.devices()[0]``); on a CPU nothing more is read. Else the numbers
    are measured from the shapes the cache would have (``jax.eval_shape``;
    nothing is allocated), on ``mesh`` one device's share (a ``Mesh`` or an
    ``AbstractMesh``): the budget (``kv_cache_memory``, default
    :data:`~jaxkv.serve.sizing.DEFAULT_MEMORY_FRACTION` of the free memory,
    ``free_bytes`` or the mesh's least; with the expert ``num_pages`` /
    ``num_blocks``, the bytes of those blocks), the bytes one token costs
    whole and on one device (their ratio is the split), the bytes one more
    sequence row costs (table row, per-request state), and ``max_model_len``
    (given, else :func:`~jaxkv.serve.sizing.default_max_model_len`). A
    hybrid cache with a prefix cache leaves a quarter of the budget to its
    snapshots, as its sizing does."""
    platform = _platform(mesh) if platform is None else platform
    sched, o = options.scheduler, options.cache
    given_rows = None if is_derived(sched.max_seqs) else int(sched.max_seqs)
    packed = sched.scheduler == "packed"
    if platform == "cpu":
        return sizing.scheduler_defaults("cpu", 1, 1.0, 1, max_seqs=given_rows, packed=packed)
    if free_bytes is None and mesh is not None:
        free_bytes = sizing.mesh_free_bytes(mesh)
    length = o.max_model_len if o.max_model_len is not None else o.max_context_tokens
    if length is None and o.max_blocks_per_seq is not None:
        length = o.max_blocks_per_seq * o.page_size
    if length is None:
        length = sizing.default_max_model_len(model, platform)
    if o.kv_cache_memory is not None:
        budget = sizing.resolve_budget(o.kv_cache_memory, free_bytes=free_bytes)[0]
    else:
        budget = sizing.default_budget(free_bytes)[0]
    if cache_kind(model) == "hybrid":
        probe = jax.eval_shape(lambda: model.make_cache(1, length, entry_format=o.entry_format))
        names = list(probe.groups)
        tokens_per_block = [g.tokens_per_block for g in probe.groups.values()]

        def measure(rows, counts, snapshots, on):
            return _hybrid_bytes(jax.eval_shape(lambda: model.make_cache(
                rows, length, entry_format=o.entry_format, num_blocks=dict(zip(names, counts)),
                num_snapshots=snapshots)), on)

        device = sizing.affine_bytes(lambda counts: measure(1, counts, 0, mesh), len(names))[1]
        whole = device if mesh is None else sizing.affine_bytes(lambda c: measure(1, c, 0, None), len(names))[1]
        per_token = sum(b / t for b, t in zip(device, tokens_per_block))
        per_token_whole = sum(b / t for b, t in zip(whole, tokens_per_block))
        row = measure(2, [2] * len(names), 1, mesh) - measure(1, [2] * len(names), 1, mesh)
        if o.prefix_cache:
            budget = budget * 3 // 4
        held = min(((int(n) - 1) * tokens_per_block[names.index(g)] for g, n in (o.num_blocks or {}).items()
                    if g in names), default=None)
        if held is not None:  # expert block counts: the tokens the groups given hold
            budget, row = max(int(held * per_token), 1), 0
    else:
        per_token, per_token_whole = paged_token_bytes(model, o.page_size, o.kv_dtype, mesh)
        page_device = per_token * o.page_size

        def manager(rows):
            return sizing.tree_bytes(jax.eval_shape(lambda: BlockSpaceManager.create(
                num_device_blocks=2, num_host_blocks=2, block_size=o.page_size, max_seqs=rows,
                max_blocks_per_seq=ceil_div(length, o.page_size), watermark=0.0)))

        row = manager(2) - manager(1)
        if o.num_pages is not None:
            budget, row = max((o.num_pages - 1) * page_device, 1), 0
    split = per_token_whole / per_token if per_token > 0 else 1.0
    return sizing.scheduler_defaults(platform, int(budget), per_token_whole, length, max(split, 1.0),
                                     bytes_per_row=row, max_seqs=given_rows, packed=packed)


def resolve_options(model, options: EngineOptions, *, mesh=None, free_bytes: int | None = None,
                    platform: str | None = None) -> EngineOptions:
    """``options`` with the scheduler options the user left out
    (:data:`DERIVED_OPTIONS` still :class:`~jaxkv.serve.options.Derived`, or
    None) set for this device (:func:`derive_scheduler_defaults`; the rule in
    :mod:`jaxkv.serve.sizing`), each derivation logged at INFO on the
    ``jaxkv.serve`` logger with its numbers. Options given stay as given;
    ``options`` with nothing left to derive comes back unchanged (so calling
    this twice is calling it once). The engine calls it before it builds
    its cache, so ``engine.options`` holds the values it runs with."""
    open_options = [name for name in DERIVED_OPTIONS if is_derived(getattr(options.scheduler, name))]
    if not open_options:
        return options
    defaults = derive_scheduler_defaults(model, options, mesh=mesh, free_bytes=free_bytes, platform=platform)
    values = {name: defaults.values()[name] for name in open_options}
    current = options.scheduler
    if all(type(getattr(current, name)) is type(value) and getattr(current, name) == value
           for name, value in values.items()):
        return options  # resolved already (a CPU's None token budget stays None): nothing to log again
    for line in defaults.lines(open_options):
        logger.info("%s", line)
    return options.replace(**values)
