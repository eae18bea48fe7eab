"""Alias of :mod:`jaxkv.prefix.block_cache` (this module's former name), kept so old imports work."""

from jaxkv.prefix.block_cache import (  # noqa: F401 - re-exported
    AllBlocksCleared, BlockRemoved, BlockStored, CacheLocked, Evicted, InsertResult, MatchResult,
    PrefixCacheManager, PrefixCacheStats, __all__,
)
