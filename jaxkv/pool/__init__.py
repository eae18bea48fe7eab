"""Pools: the request-to-token table (and, in later issues, K/V and state pools)."""

from jaxkv.pool.req_to_token import ReqToTokenPool, make_req_to_token_pool

__all__ = ["ReqToTokenPool", "make_req_to_token_pool"]
