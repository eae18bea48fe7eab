"""Which cache a model gets: the adapter of its ``cache_kind``
(:func:`jaxkv.nn.packed.cache_kind`), built by the sizing rule of
:mod:`jaxkv.serve.sizing`. The engine calls :func:`build_cache` and then
speaks only the contract of :mod:`jaxkv.serve.caches`."""

from __future__ import annotations

import collections.abc

from jaxkv import _host
from jaxkv.errors import InvalidArgument
from jaxkv.nn.packed import cache_kind
from jaxkv.prefix.snapshot_cache import RETENTION_POLICIES
from jaxkv.serve.caches import KVCache
from jaxkv.serve.hybrid_cache import HybridCache
from jaxkv.serve.paged_cache import PagedCache

__all__ = ["build_cache"]


def build_cache(model, *, max_seqs: int, max_model_len: int | None, kv_cache_memory, prefill_chunk: int,
                prefix_cache: bool, free_bytes: int | None, num_pages=None, page_size: int = 16,
                max_blocks_per_seq=None, num_host_pages=None, host_kv_memory=None, kv_dtype=None,
                host_memory_kind: str = "auto", max_context_tokens=None, num_blocks=None, num_snapshots=None,
                entry_format: str = "lossless", snapshot_retention: str = "value",
                snapshot_interval=None, host_prefix_pages=None, host_prefix_memory=None) -> KVCache:
    """The cache for ``model`` by its ``cache_kind`` (:mod:`jaxkv.nn.packed`):
    a :class:`~jaxkv.serve.hybrid_cache.HybridCache` or a
    :class:`~jaxkv.serve.paged_cache.PagedCache`, sized by the one rule of
    :mod:`jaxkv.serve.sizing` (options as :class:`jaxkv.serve.Engine`
    documents them). An option of the other kind of cache is refused
    (``InvalidArgument`` naming it and the options that apply)."""
    if cache_kind(model) == "hybrid":
        given = [name for name, value in (("num_pages", num_pages), ("max_blocks_per_seq", max_blocks_per_seq),
                                          ("kv_dtype", kv_dtype)) if value is not None]
        if num_host_pages:
            given.append("num_host_pages")
        if host_prefix_pages:
            given.append("host_prefix_pages")
        if given:
            raise InvalidArgument(f"{', '.join(given)}: options of the paged pool; {type(model).__name__} "
                                  "keeps its cache in a KVCacheManager (give max_model_len, kv_cache_memory, "
                                  "host_kv_memory; or max_context_tokens, num_blocks, entry_format)")
        if host_kv_memory is not None:
            host_kv_memory = _host.int_scalar(host_kv_memory, "host_kv_memory")
            if host_kv_memory < 0:
                raise InvalidArgument(f"host_kv_memory={host_kv_memory}: bytes must be >= 0")
        if max_context_tokens is not None:
            # max_model_len's other spelling, checked alike: one prompt token and one new token.
            max_context_tokens = _host.int_at_least(max_context_tokens, "max_context_tokens", 2)
        num_blocks = _block_counts(num_blocks)
        if num_snapshots is not None:
            num_snapshots = _host.int_at_least(num_snapshots, "num_snapshots", 1)
        if snapshot_interval is not None:
            snapshot_interval = _host.int_at_least(snapshot_interval, "snapshot_interval", 1)
        if host_prefix_memory is not None:
            host_prefix_memory = _host.int_at_least(host_prefix_memory, "host_prefix_memory", 0)
        if snapshot_retention not in RETENTION_POLICIES:
            raise InvalidArgument(f"snapshot_retention={snapshot_retention!r}: choose one of {RETENTION_POLICIES}")
        return HybridCache.build(
            model, max_seqs=max_seqs, max_model_len=max_model_len, max_context_tokens=max_context_tokens,
            num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, num_snapshots=num_snapshots,
            entry_format=entry_format, prefill_chunk=prefill_chunk, prefix_cache=bool(prefix_cache),
            free_bytes=free_bytes, retention=snapshot_retention, snapshot_interval=snapshot_interval,
            host_kv_memory=host_kv_memory, host_prefix_memory=host_prefix_memory)
    else:
        given = [name for name, value in (("max_context_tokens", max_context_tokens), ("num_blocks", num_blocks),
                                          ("num_snapshots", num_snapshots), ("snapshot_interval", snapshot_interval))
                 if value is not None] + (["snapshot_retention"] if snapshot_retention != "value" else [])
        if given:
            raise InvalidArgument(f"{', '.join(given)}: options of a hybrid cache; "
                                  f"{type(model).__name__} runs over a paged pool (give max_model_len, "
                                  "kv_cache_memory; or num_pages, max_blocks_per_seq)")
        return PagedCache.build(
            model, max_seqs=max_seqs, page_size=_host.int_at_least(page_size, "page_size", 1),
            max_model_len=max_model_len,
            num_pages=None if num_pages is None else _host.int_at_least(num_pages, "num_pages", 2),  # page 0: null
            max_blocks_per_seq=(None if max_blocks_per_seq is None
                                else _host.int_at_least(max_blocks_per_seq, "max_blocks_per_seq", 1)),
            kv_cache_memory=kv_cache_memory,
            num_host_pages=None if num_host_pages is None else _host.int_at_least(num_host_pages, "num_host_pages", 0),
            host_kv_memory=host_kv_memory, kv_dtype=kv_dtype, prefix_cache=bool(prefix_cache),
            prefill_chunk=prefill_chunk, host_memory_kind=host_memory_kind, free_bytes=free_bytes,
            host_prefix_pages=(None if host_prefix_pages is None
                               else _host.int_at_least(host_prefix_pages, "host_prefix_pages", 0)),
            host_prefix_memory=(None if host_prefix_memory is None
                                else _host.int_at_least(host_prefix_memory, "host_prefix_memory", 0)))


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
