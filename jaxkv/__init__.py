"""jaxkv: the KV-cache memory manager for LLM inference in JAX.

Every device-side structure is a frozen pytree and every operation a pure
function (state first in, new state first out, ``ok`` last) that works under
``jax.jit`` and inside ``lax.scan``. Host-facing ``*_or_raise`` methods turn
``ok`` flags into the typed errors below.
"""

from jaxkv.alloc import BlockAllocator, SlotAllocator, TokenToKVPoolAllocator
from jaxkv.alloc.token import FreeGroup
from jaxkv.checks import checked
from kernels_pallas.reference import dense_decode_attention, paged_decode_attention
from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.manager import kernel_tables
from jaxkv.manager.block_space import ALLOC_LATER, ALLOC_NEVER, ALLOC_OK, BlockSpaceManager
from jaxkv.pool import GDNPool, KVPool, ReqToTokenPool, make_full_attention_net_mem_pool, make_req_to_token_pool
from jaxkv.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheLocked,
    PrefixCacheManager,
    PrefixCacheStats,
    PrefixScheduler,
    SlotPrefixCacheManager,
    SnapshotCache,
)

from jaxkv.manager.hybrid import KVCacheManager, LayerCacheHandle
from jaxkv.manager.hybrid_host import HostStore, swap_in_request, swap_out_request
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerCacheSchema,
    LayerSpec,
    deepseek_v4_schedule,
    qwen3_next_schedule,
)

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator",
    "SlotAllocator",
    "TokenToKVPoolAllocator",
    "FreeGroup",
    "checked",
    "KVPool",
    "make_full_attention_net_mem_pool",
    "ReqToTokenPool",
    "make_req_to_token_pool",
    "BlockSpaceManager",
    "KVCacheManager",
    "LayerCacheHandle",
    "HostStore",
    "swap_out_request",
    "swap_in_request",
    "AttentionKind",
    "HybridConfig",
    "LayerCacheSchema",
    "LayerSpec",
    "deepseek_v4_schedule",
    "qwen3_next_schedule",
    "GDNPool",
    "ALLOC_OK",
    "ALLOC_LATER",
    "ALLOC_NEVER",
    "kernel_tables",
    "PrefixCacheManager",
    "PrefixScheduler",
    "SlotPrefixCacheManager",
    "SnapshotCache",
    "PrefixCacheStats",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "paged_decode_attention",
    "dense_decode_attention",
    "KVCacheError",
    "KVCacheOOM",
    "DoubleFree",
    "InvalidId",
    "InvalidArgument",
    "CacheLocked",
]

# Text in, text out (jaxkv.text: tokenizer, chat template, streaming detokenizer), imported on first use
# (PEP 562) so `import jaxkv` does not load tokenizers and jinja2.
_FROM_TEXT = ("ChatTemplateError", "IncrementalDetokenizer", "Tokenizer")
__all__ += list(_FROM_TEXT)


def __getattr__(name: str):
    if name in _FROM_TEXT:
        import jaxkv.text

        return getattr(jaxkv.text, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FROM_TEXT))
