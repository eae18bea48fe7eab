"""Which cache a model gets and how big: the adapter of its ``cache_kind``
(:func:`jaxkv.nn.packed.cache_kind`), sized by the one rule of
:mod:`jaxkv.serve.sizing` (:func:`build_paged_cache`,
:func:`build_hybrid_cache`). The engine calls :func:`build_cache` and then
speaks only the contract of :mod:`jaxkv.serve.caches`."""

from __future__ import annotations

import collections.abc
import logging

import jax

from jaxkv import _host
from jaxkv._ops import ceil_div
from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn.packed import cache_kind
from jaxkv.nn.steps import paged_peak_blocks, paged_window
from jaxkv.serve import sizing
from jaxkv.serve.caches import KVCache, blocks_from_budget
from jaxkv.serve.hybrid_cache import HybridCache
from jaxkv.serve.options import CacheOptions
from jaxkv.serve.paged_cache import PagedCache

__all__ = ["build_cache", "build_hybrid_cache", "build_paged_cache"]

logger = logging.getLogger("jaxkv.serve")


def build_cache(model, options: CacheOptions, *, max_seqs: int, prefill_chunk: int,
                free_bytes: int | None = None) -> KVCache:
    """The cache for ``model`` by its ``cache_kind`` (:mod:`jaxkv.nn.packed`):
    a :class:`~jaxkv.serve.hybrid_cache.HybridCache` or a
    :class:`~jaxkv.serve.paged_cache.PagedCache`, sized by the one rule of
    :mod:`jaxkv.serve.sizing` from ``options`` (checked when they were made:
    :mod:`jaxkv.serve.options`). An option of the other kind of cache is
    refused (``InvalidArgument`` naming it and the options that apply)."""
    o = options
    if cache_kind(model) == "hybrid":
        given = [name for name, value in (("num_pages", o.num_pages), ("max_blocks_per_seq", o.max_blocks_per_seq),
                                          ("kv_dtype", o.kv_dtype)) if value is not None]
        given += [name for name, value in (("num_host_pages", o.num_host_pages),
                                           ("host_prefix_pages", o.host_prefix_pages)) if value]
        if given:
            raise InvalidArgument(f"{', '.join(given)}: options of the paged pool; {type(model).__name__} "
                                  "keeps its cache in a KVCacheManager (give max_model_len, kv_cache_memory, "
                                  "host_kv_memory; or max_context_tokens, num_blocks, entry_format)")
        return build_hybrid_cache(
            model, max_seqs=max_seqs, max_model_len=o.max_model_len, max_context_tokens=o.max_context_tokens,
            num_blocks=_block_counts(o.num_blocks), kv_cache_memory=o.kv_cache_memory, num_snapshots=o.num_snapshots,
            entry_format=o.entry_format, prefill_chunk=prefill_chunk, prefix_cache=o.prefix_cache,
            free_bytes=free_bytes, retention=o.snapshot_retention, snapshot_interval=o.snapshot_interval,
            host_kv_memory=o.host_kv_memory, host_prefix_memory=o.host_prefix_memory)
    given = [name for name, value in (("max_context_tokens", o.max_context_tokens), ("num_blocks", o.num_blocks),
                                      ("num_snapshots", o.num_snapshots), ("snapshot_interval", o.snapshot_interval))
             if value is not None] + (["snapshot_retention"] if o.snapshot_retention != "value" else [])
    if given:
        raise InvalidArgument(f"{', '.join(given)}: options of a hybrid cache; "
                              f"{type(model).__name__} runs over a paged pool (give max_model_len, "
                              "kv_cache_memory; or num_pages, max_blocks_per_seq)")
    return build_paged_cache(
        model, max_seqs=max_seqs, page_size=o.page_size, max_model_len=o.max_model_len, num_pages=o.num_pages,
        max_blocks_per_seq=o.max_blocks_per_seq, kv_cache_memory=o.kv_cache_memory,
        num_host_pages=o.num_host_pages, host_kv_memory=o.host_kv_memory, kv_dtype=o.kv_dtype,
        prefix_cache=o.prefix_cache, prefill_chunk=prefill_chunk, host_memory_kind=o.host_memory_kind,
        free_bytes=free_bytes, host_prefix_pages=o.host_prefix_pages, host_prefix_memory=o.host_prefix_memory)


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


def build_paged_cache(model, *, max_seqs: int, page_size: int, max_model_len: int | None, num_pages: int | None,
          max_blocks_per_seq: int | None, kv_cache_memory, num_host_pages: int | None, host_kv_memory,
          kv_dtype, prefix_cache: bool, prefill_chunk: int, host_memory_kind: str,
          free_bytes: int | None = None, host_prefix_pages: int | None = None,
          host_prefix_memory: int | None = None) -> PagedCache:
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
    refused with ``prefix_cache`` off). A ``max_model_len``
    given here that the pool cannot hold is refused; the default one is
    lowered to what the pool holds (logged)."""
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
        return sizing.tree_bytes(jax.eval_shape(make))

    budget, source = None, f"num_pages={num_pages} (expert option)"
    if num_pages is None:
        blocks, budget, source = blocks_from_budget(
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
                max_blocks_per_seq=ceil_div(max_model_len, page_size), num_host_pages=num_host_pages,
                prefix_cache=prefix_cache, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                host_memory_kind=host_memory_kind, max_model_len=max_model_len,
                host_prefix_pages=host_prefix_pages or 0)
    _, per_block = sizing.affine_bytes(lambda counts: measure(counts, max_model_len), 1)
    cache.plan = cache._plan(budget=budget, source=source, per_block=per_block[0])
    return cache


def build_hybrid_cache(model, *, max_seqs: int, max_model_len: int | None, max_context_tokens: int | None,
          num_blocks: dict | None, kv_cache_memory, num_snapshots: int | None, entry_format: str,
          prefill_chunk: int, prefix_cache: bool, free_bytes: int | None = None, retention: str = "value",
          snapshot_interval: int | None = None, host_kv_memory: int | None = None,
          host_prefix_memory: int | None = None) -> HybridCache:
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
        cache = HybridCache(model, max_seqs=max_seqs, max_context_tokens=length, num_blocks=num_blocks,
                    entry_format=entry_format, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                    num_snapshots=num_snapshots, retention=retention, snapshot_interval=snapshot_interval,
                    host_kv_memory=host_kv_memory or 0, host_prefix_memory=host_prefix_memory or 0)
        cache.plan = cache._plan(budget=None, source=f"num_blocks={num_blocks} (expert option)")
        return cache
    probe = jax.eval_shape(lambda: model.make_cache(1, length, entry_format=entry_format))
    names = list(probe.groups)
    per_entry = [(g.tokens_per_entry, g.entries_per_block) for g in probe.groups.values()]
    tokens_per_block = [g.tokens_per_block for g in probe.groups.values()]

    def blocks_for(n: int) -> list[int]:
        return [ceil_div(n // tpe, epb) for tpe, epb in per_entry]

    def measure(counts, cached, n):
        return sizing.tree_bytes(jax.eval_shape(lambda: model.make_cache(
            max_seqs, n, entry_format=entry_format, num_blocks=dict(zip(names, counts)),
            num_snapshots=cached)))

    budget_hint = (sizing.resolve_budget(kv_cache_memory, free_bytes=free_bytes)[0] if kv_cache_memory is not None
                   else sizing.default_budget(free_bytes)[0])
    if not prefix_cache:
        cached = 0
    elif num_snapshots is not None:
        cached = num_snapshots
    else:  # a quarter of the budget at most
        row = measure([2] * len(names), 2, length) - measure([2] * len(names), 1, length)
        cached = min(2 * max_seqs, budget_hint // 4 // row) if row > 0 else 2 * max_seqs
        cached = max(int(cached), 0)
    blocks, budget, source = blocks_from_budget(
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
    cache = HybridCache(model, max_seqs=max_seqs, max_context_tokens=length, num_blocks=dict(
        zip(names, (b + 1 for b in blocks))), entry_format=entry_format, prefill_chunk=prefill_chunk,
        prefix_cache=prefix_cache and cached > 0, num_snapshots=cached if cached else None, retention=retention,
        snapshot_interval=snapshot_interval, host_kv_memory=host_kv_memory or 0,
        host_prefix_memory=host_prefix_memory or 0)
    _, per_block = sizing.affine_bytes(lambda counts: measure(counts, cached, length), len(names))
    cache.plan = cache._plan(budget=budget, source=source, per_block=per_block)
    return cache
