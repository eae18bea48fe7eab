"""Managers over pools: the BlockSpaceManager (paging, copy-on-write, swap),
block-table exports for kernels, and the hybrid KVCacheManager (seed 004)."""

__all__: list = []  # import the managers from their modules, or from jaxkv
