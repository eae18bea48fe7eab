"""``python -m jaxkv.allocator_tour``: a short tour of the jaxkv allocators.

Prints what it does at each step: host-path allocation with typed errors,
block sharing with reference counts, slot versions for prefix reuse, the
page-mode token allocator with a batched free, 1,000 decode steps of block
allocation running inside one jitted ``lax.scan``, and the radix prefix
cache admitting requests that share system prompts.
(The main demo, ``python -m jaxkv.demo``, serves requests with the engine.)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

__all__ = [
    "blocks_with_sharing",
    "decode_loop_in_scan",
    "main",
    "prefix_cache",
    "slots_with_versions",
    "tokens_and_rows",
]


def _say(text: str) -> None:
    print(f"  {text}")


def blocks_with_sharing() -> None:
    print("\n1. BlockAllocator: a ref-counted free stack of block ids (block 0 = null block)")
    blocks = jaxkv.BlockAllocator.create(num_blocks=16)
    blocks, prompt = blocks.acquire_or_raise(4)
    _say(f"a 4-block prompt got blocks {prompt.tolist()}; {int(blocks.num_free)} of {blocks.capacity} free")
    blocks = blocks.incref_or_raise(prompt)
    _say(f"a second sample shares them: ref counts {np.asarray(blocks.ref_count(prompt)).tolist()}")
    blocks = blocks.release_or_raise(prompt)
    _say(f"the first sample finishes: counts {np.asarray(blocks.ref_count(prompt)).tolist()}, still held")
    blocks = blocks.release_or_raise(prompt)
    _say(f"the second finishes: {int(blocks.num_free)} free again")
    try:
        blocks.release_or_raise(prompt[:1])
    except jaxkv.DoubleFree as error:
        _say(f"releasing block {prompt[0]} again -> DoubleFree: {error}")
    try:
        blocks.acquire_or_raise(40)
    except jaxkv.KVCacheOOM as error:
        _say(f"asking for 40 blocks -> KVCacheOOM: {error}")


def slots_with_versions() -> None:
    print("\n2. SlotAllocator: a uint32 bitmask with version counters (slot 0 = null slot)")
    slots = jaxkv.SlotAllocator.create(max_slots=100)
    slots, taken = slots.alloc_many_or_raise(3)
    _say(f"three requests got slots {taken.tolist()}, versions {np.asarray(slots.version(taken)).tolist()}")
    slots = slots.free_or_raise(taken[:1])
    slots = slots.occupy_or_raise(taken[:1])
    _say(f"slot {taken[0]} freed and re-occupied for a prefix hit: version stays "
         f"{int(slots.version(taken[0]))} (its cached K/V are still valid)")
    slots = slots.free_or_raise(taken[:1])
    slots, again = slots.alloc_or_raise()
    _say(f"freed and allocated anew: slot {again}, version {int(slots.version(again))} (contents now stale)")


def tokens_and_rows() -> None:
    print("\n3. TokenToKVPoolAllocator (page mode) + ReqToTokenPool")
    tokens = jaxkv.TokenToKVPoolAllocator.create(size=64, page_size=4)
    table = jaxkv.make_req_to_token_pool(max_reqs=4, max_context_len=32)
    table, rows = table.alloc_or_raise(2)
    tokens, first = tokens.alloc_or_raise(8)
    tokens, second = tokens.alloc_or_raise(12)
    table = table.write_or_raise(rows[0], 0, first)
    table = table.write_or_raise(rows[1], 0, second)
    _say(f"request rows {rows.tolist()}: token indices {first.tolist()} and {second.tolist()}")
    _say(f"{int(tokens.available_size())} of {tokens.size} tokens left; the pool needs "
         f"{tokens.buffer_size} rows (one null page)")
    group = tokens.free_group_begin()
    group.free(first)
    group.free(second)
    tokens = tokens.free_group_end(group)
    table = table.free_or_raise(rows)
    _say(f"both finish, freed as one group in one device call: {int(tokens.available_size())} tokens free, "
         f"rows point at slot 0 again: {np.asarray(table.req_to_token[rows[0], :4]).tolist()}")


def decode_loop_in_scan(batch: int = 8, steps: int = 1000, block_size: int = 16) -> None:
    print(f"\n4. {steps} decode steps for {batch} sequences in ONE jitted lax.scan")
    max_blocks = 8

    def step(carry, restart_at):
        blocks, table, lens = carry
        lens = lens + 1
        crossing = (lens - 1) % block_size == 0
        blocks, ids, acquired = blocks.acquire(jnp.sum(crossing), max_n=batch)
        rank = jnp.clip(jnp.cumsum(crossing) - 1, 0, batch - 1)
        rows = jnp.arange(batch)
        table = table.at[jnp.where(crossing, rows, batch), (lens - 1) // block_size].set(ids[rank], mode="drop")
        finished = lens >= restart_at
        blocks, released = blocks.release(jnp.where(finished[:, None], table, -1))
        table = jnp.where(finished[:, None], -1, table)
        lens = jnp.where(finished, 0, lens)
        return (blocks, table, lens), (acquired & released, blocks.num_used)

    rng = np.random.default_rng(0)
    restart_at = jnp.asarray(rng.integers(8, block_size * max_blocks, size=(steps, batch)), jnp.int32)
    carry = (jaxkv.BlockAllocator.create(batch * max_blocks + 1),
             jnp.full((batch, max_blocks), -1, jnp.int32), jnp.zeros((batch,), jnp.int32))
    run = jax.jit(lambda c, r: jax.lax.scan(step, c, r))
    jax.block_until_ready(run(carry, restart_at))
    start = time.perf_counter()
    (blocks, _, _), (oks, used) = jax.block_until_ready(run(carry, restart_at))
    seconds = time.perf_counter() - start
    _say(f"every acquire/release succeeded: {bool(jnp.all(oks))}; peak blocks in use {int(used.max())} "
         f"of {blocks.capacity}")
    _say(f"{steps} steps took {seconds * 1e3:.2f} ms ({seconds / steps * 1e6:.1f} us per step, "
         "no host round trip)")


def prefix_cache(num_requests: int = 200, page_size: int = 16) -> None:
    print("\n5. PrefixCacheManager + PrefixScheduler: requests sharing 4 system prompts, 8 admitted per step")
    rng = np.random.default_rng(0)
    system = [rng.integers(1, 32000, size=256) for _ in range(4)]
    prompts = [np.concatenate([system[rng.integers(4)], rng.integers(1, 32000, size=rng.integers(32, 200))])
               for _ in range(num_requests)]
    cache = jaxkv.PrefixCacheManager(page_size)
    scheduler = jaxkv.PrefixScheduler(cache, jaxkv.BlockAllocator.create(1024 + 1))  # 16k tokens: eviction
    for first in range(0, num_requests, 8):
        admitted = scheduler.admit(prompts[first : first + 8])
        scheduler.prefill_done(admitted)   # insert the pages; duplicates go back to the allocator
        scheduler.finish(admitted)         # the request's own tail pages go back; the tree keeps the rest
    scheduler.check_mirror()
    stats = cache.stats()
    _say(f"{stats.hit_tokens:,} of {stats.query_tokens:,} prompt tokens served from the cache "
         f"({stats.hit_rate:.1%}); {stats.evicted_tokens:,} tokens evicted, least recently used first")
    _say(f"{scheduler.device_calls} device calls for {num_requests} requests; the tree holds "
         f"{stats.evictable_tokens:,} tokens, blocks free: {int(scheduler.allocator.num_free)}")


def main() -> None:
    print(f"jaxkv {jaxkv.__version__} allocator demo on {jax.devices()[0].platform}")
    blocks_with_sharing()
    slots_with_versions()
    tokens_and_rows()
    decode_loop_in_scan()
    prefix_cache()
    print("\ndone.")


if __name__ == "__main__":
    main()
