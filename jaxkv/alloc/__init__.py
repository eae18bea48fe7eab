"""Device-side allocators: block free stack with ref counts, slot bitmask,
token/page allocator."""

from jaxkv.alloc.block import BlockAllocator
from jaxkv.alloc.slot import SlotAllocator
from jaxkv.alloc.token import TokenToKVPoolAllocator

__all__ = ["BlockAllocator", "SlotAllocator", "TokenToKVPoolAllocator"]
