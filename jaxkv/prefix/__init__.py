"""Radix-tree prefix caches (seed 001, SGLang RadixCache / vLLM prefix caching)."""

from jaxkv.prefix.block_cache import (  # noqa: F401 - the public names of this package
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheLocked,
    Evicted,
    InsertResult,
    MatchResult,
    PrefixCacheManager,
    PrefixCacheStats,
)
from jaxkv.prefix.scheduler import Admission, PrefixScheduler  # noqa: F401
from jaxkv.prefix.slot_cache import SlotPrefixCacheManager, SlotPrefixCacheStats  # noqa: F401
from jaxkv.prefix.snapshot_cache import SnapshotCache, SnapshotHit, SnapshotRecord  # noqa: F401

__all__ = [
    "Admission",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheLocked",
    "Evicted",
    "InsertResult",
    "MatchResult",
    "PrefixCacheManager",
    "PrefixCacheStats",
    "PrefixScheduler",
    "SlotPrefixCacheManager",
    "SlotPrefixCacheStats",
    "SnapshotCache",
    "SnapshotHit",
    "SnapshotRecord",
]
