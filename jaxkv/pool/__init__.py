"""Pools: paged K/V storage, the request-to-token table, Gated DeltaNet states,
DeepSeek-V4 compressed entries, and host pages for swap."""

from jaxkv.pool.compressed import CompressedLayerCache
from jaxkv.pool.gdn_pool import GDNPool
from jaxkv.pool.kv_pool import KVPool, make_full_attention_net_mem_pool
from jaxkv.pool.req_to_token import ReqToTokenPool, make_req_to_token_pool

__all__ = ["CompressedLayerCache", "GDNPool", "KVPool", "make_full_attention_net_mem_pool", "ReqToTokenPool", "make_req_to_token_pool"]
