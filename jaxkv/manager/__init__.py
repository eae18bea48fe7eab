"""Managers over pools: block tables and their kernel exports (the
BlockSpaceManager and the hybrid KVCacheManager arrive with their issues)."""
