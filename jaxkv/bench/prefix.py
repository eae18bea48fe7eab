"""``python -m jaxkv.bench prefix``: the radix prefix cache on a shared-prefix
trace, device allocator calls included; then (not with ``--quick``) hit rate
against the ideal per model family, workload and snapshot retention policy
on the engine, the same on a device too small to keep everything without
and with the prefix cache's host tier, and the host tier's transfer rates
(:mod:`jaxkv.bench.prefix_families`). ``--restart``: time to first token
of a repeated long prompt after a restart, cold against the disk tier
(:mod:`jaxkv.bench.prefix_restart`).

The trace (issue 4): ``numpy.random.default_rng(0)``; 10 system prompts of
800 tokens (``integers(1, 32000, size=800)``, one after another); then 2,000
requests, each drawing its prompt index ``integers(10)``, its total length
``integers(1000, 2001)`` and its suffix ``integers(1, 32000,
size=total-800)``. Page size 16; a device pool of 262,144 tokens (16,384
blocks), so the cache must evict.

Each request: match, pin, allocate (evicting when short), insert, release
duplicates, unpin. Run through ``PrefixScheduler`` one request per step and
eight per step (the way an engine admits), with one device call per step.
The baseline, timed in the same run: the same scheduler and tree with the
device call replaced by a Python free list, so the ratio column is the cost
of keeping the allocator on the device.

A fifth row, "engine path", drives the engine's own admission model on the
same trace, the way ``jaxkv.serve`` (``jaxkv.nn.Engine``) does it, through
public API only: match (capped at ``len - 1``), pin, evict when short, then
one jitted ``BlockSpaceManager.admit_with_prefix`` per step (each cached
block gets one ``incref`` into the sequence's table, the rest is acquired);
on finish ``insert`` the full pages and one jitted ``BlockSpaceManager.retire``
(the tree increfs what it keeps, the sequences are freed), then unpin.

Which model to pick:

* ``PrefixScheduler`` (*borrow under a pin*): a request uses the tree's
  blocks without taking references, so a hit costs no device work and a step
  is one small device call. Pick it when the caller owns its block lists
  itself (a paged-attention loop that takes block ids from the scheduler)
  and wants the cheapest admission.
* ``BlockSpaceManager.admit_with_prefix`` + ``PrefixCacheManager``
  (*incref*): every sequence holds one reference per table entry, so the
  block table is self-contained: copy-on-write, ``fork``, swap and
  ``append_slots`` work on shared prefix blocks unchanged, and a request can
  outlive its pin. It costs a device call more per step (and the table
  read). Pick it when sequences live in a ``BlockSpaceManager`` (any decode
  loop that grows, forks or swaps them: the engine does).

Figures are the median over several runs of the whole trace, in microseconds
per request.

On CPU the benchmark runs jitted calls inline (``jax_cpu_enable_async_dispatch
= False``, set before JAX starts its backend; ``JAXKV_ASYNC_DISPATCH=1`` keeps
JAX's default): a scheduler makes one small call per step and waits for its
result, and on a 2-core machine handing each call to a worker thread and back
costs more than the call itself.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from jaxkv._ops import ceil_div
from jaxkv.alloc.block import BlockAllocator
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.bench._timing import inline_cpu_dispatch, machine_description, print_json, print_table
from jaxkv.prefix.block_cache import PrefixCacheManager
from jaxkv.prefix.scheduler import PrefixScheduler

__all__ = ["main", "make_trace", "run_engine_path", "run_scheduler"]

PAGE_SIZE = 16
POOL_TOKENS = 262_144
SYSTEM_PROMPTS, SYSTEM_LEN = 10, 800


def make_trace(num_requests: int = 2000) -> list[np.ndarray]:
    """The issue's trace, drawn exactly in the order it specifies."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 32000, size=SYSTEM_LEN) for _ in range(SYSTEM_PROMPTS)]
    trace = []
    for _ in range(num_requests):
        index = rng.integers(SYSTEM_PROMPTS)
        total = rng.integers(1000, 2001)
        suffix = rng.integers(1, 32000, size=total - SYSTEM_LEN)
        trace.append(np.concatenate([prompts[index], suffix]))
    return trace


def run_scheduler(trace: list[np.ndarray], batch: int, *, device: bool = True) -> dict:
    """The whole trace through ``PrefixScheduler``, ``batch`` new requests per
    step (``device=False``: the host free-list baseline). Returns wall time
    and the cache's counters."""
    cache = PrefixCacheManager(PAGE_SIZE)
    num_blocks = POOL_TOKENS // PAGE_SIZE + 1
    if device:
        scheduler = PrefixScheduler(cache, BlockAllocator.create(num_blocks))
    else:
        scheduler = _HostListScheduler(cache, num_blocks)
    start = time.perf_counter()
    for first in range(0, len(trace), batch):
        admissions = scheduler.admit(trace[first : first + batch])
        if any(a is None for a in admissions):
            raise RuntimeError("the pool is large enough for every request of this trace")
        scheduler.prefill_done(admissions)
        scheduler.finish(admissions)
    scheduler.flush()
    seconds = time.perf_counter() - start
    stats = cache.stats()
    scheduler.check_mirror()
    return {
        "seconds": seconds,
        "hit_tokens": stats.hit_tokens,
        "query_tokens": stats.query_tokens,
        "evicted_tokens": stats.evicted_tokens,
        "device_calls": scheduler.device_calls,
    }


_admit = jax.jit(BlockSpaceManager.admit_with_prefix, donate_argnums=0)
_retire = jax.jit(BlockSpaceManager.retire, donate_argnums=0)


def _bucket(n: int) -> int:
    """Power-of-two padding for id arrays: a few compiled shapes, not one per count."""
    return 1 << max(n - 1, 63).bit_length()


def _padded(ids, size: int) -> np.ndarray:
    out = np.full((size,), -1, np.int32)
    out[: len(ids)] = ids
    return out


def run_engine_path(trace: list[np.ndarray], batch: int) -> dict:
    """The whole trace through the engine's admission model (module doc):
    ``batch`` requests per step, each admitted with
    ``BlockSpaceManager.admit_with_prefix`` (increfs on the cached blocks),
    prefilled (not modelled: no K/V is written), then finished with
    ``insert`` + ``BlockSpaceManager.retire``. Public API only."""
    cache = PrefixCacheManager(PAGE_SIZE)
    num_blocks = POOL_TOKENS // PAGE_SIZE + 1
    width = ceil_div(max(len(t) for t in trace), PAGE_SIZE)
    manager = BlockSpaceManager.create(num_device_blocks=num_blocks, num_host_blocks=0, block_size=PAGE_SIZE,
                                       max_seqs=batch, max_blocks_per_seq=width, watermark=0.0)
    device_calls = 0
    start = time.perf_counter()
    for first in range(0, len(trace), batch):
        requests = trace[first : first + batch]
        rows = np.full((batch,), -1, np.int32)
        prefix = np.full((batch, width), -1, np.int32)
        lengths = np.zeros((batch,), np.int32)
        nodes, needed = [], 0
        for lane, tokens in enumerate(requests):
            match = cache.match(tokens, max_tokens=len(tokens) - 1)
            cache.pin(match.node)
            nodes.append(match.node)
            rows[lane], lengths[lane] = lane, len(tokens)
            prefix[lane, : len(match.blocks)] = match.blocks
            needed += ceil_div(len(tokens), PAGE_SIZE) - len(match.blocks)
        free = int(manager.device.num_free)
        if free < needed:  # evict, and drop the tree's references in one call
            evicted = cache.evict(needed - free).blocks
            manager, ok = _retire(manager, _padded([], batch * width), _padded([], batch),
                                  _padded(evicted, _bucket(len(evicted))))
            device_calls += 1
            if not bool(ok):
                raise RuntimeError("engine-path eviction release failed")
        manager, ok = _admit(manager, rows, prefix, lengths)
        tables = np.asarray(jax.device_get(manager.block_tables))
        device_calls += 1
        if not bool(ok):
            raise RuntimeError("the pool is large enough for every request of this trace")
        incref = []
        for lane, tokens in enumerate(requests):  # finish: the tree takes what it keeps
            full_pages = len(tokens) // PAGE_SIZE
            incref += cache.insert(tokens[: full_pages * PAGE_SIZE], tables[lane, :full_pages]).new_blocks
        manager, ok = _retire(manager, _padded(incref, batch * width), rows, None)
        device_calls += 1
        for node in nodes:
            cache.release(node)
    if not bool(ok):
        raise RuntimeError("engine-path bookkeeping failed")
    seconds = time.perf_counter() - start
    stats = cache.stats()
    return {
        "seconds": seconds,
        "hit_tokens": stats.hit_tokens,
        "query_tokens": stats.query_tokens,
        "evicted_tokens": stats.evicted_tokens,
        "device_calls": device_calls,
    }


class _HostListScheduler(PrefixScheduler):
    """The same scheduler with the device call replaced by a Python free
    list: the baseline that shows what the device allocator costs."""

    def __init__(self, cache: PrefixCacheManager, num_blocks: int):
        super().__init__(cache, BlockAllocator.create(2))
        self._free = list(range(num_blocks - 1, 0, -1))
        self.num_free = num_blocks - 1

    def _call(self, release: list, num_new: int) -> np.ndarray:
        self._free += release
        self.device_calls += 1
        taken = self._free[len(self._free) - num_new :]
        del self._free[len(self._free) - num_new :]
        return np.asarray(taken[::-1], np.int32)

    def check_mirror(self) -> None:
        self.flush()
        assert len(self._free) == self.num_free


def parse_extra(args, rest: list):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench prefix")
    parser.add_argument("--restart", action="store_true", help="time to first token of a repeated long prompt "
                        "after a restart, cold vs the prefix cache's disk tier (jaxkv.bench.prefix_restart)")
    args.restart = parser.parse_args(rest).restart
    return args


def main(args) -> int:
    if getattr(args, "restart", False):
        from jaxkv.bench.prefix_restart import main as restart_main

        return restart_main(args)
    dispatch = inline_cpu_dispatch()
    num_requests = 300 if args.quick else 2000
    repeats = 1 if args.quick else 5
    trace = make_trace(num_requests)
    runs = {
        "8 per step, device allocator": lambda: run_scheduler(trace, 8),
        "8 per step, host free list": lambda: run_scheduler(trace, 8, device=False),
        "1 per step, device allocator": lambda: run_scheduler(trace, 1),
        "1 per step, host free list": lambda: run_scheduler(trace, 1, device=False),
        "8 per step, engine path (incref, admit_with_prefix)": lambda: run_engine_path(trace, 8),
    }
    for run in runs.values():  # compile every jitted step shape once
        run()
    results: dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so a noisy spell hits all alike
        for name, run in runs.items():
            results[name].append(run())
    rows, payload = [], []
    for name, measured in results.items():
        seconds = statistics.median(r["seconds"] for r in measured)
        baseline = statistics.median(r["seconds"] for r in results[name.split(",")[0] + ", host free list"])
        last = measured[-1]
        us = seconds / num_requests * 1e6
        rate = last["hit_tokens"] / last["query_tokens"]
        rows.append([name, f"{us:.1f}", f"{seconds / baseline:.2f}", f"{last['hit_tokens']:,} / {last['query_tokens']:,}",
                     f"{rate:.2%}", f"{last['evicted_tokens']:,}", last["device_calls"]])
        payload.append({"mode": name, "us_per_request": us, "ratio_to_host_free_list": seconds / baseline,
                        "hit_tokens": last["hit_tokens"], "query_tokens": last["query_tokens"], "hit_rate": rate,
                        "evicted_tokens": last["evicted_tokens"], "device_calls": last["device_calls"]})
    print_table(
        f"prefix cache, {num_requests} requests, page {PAGE_SIZE}, pool {POOL_TOKENS:,} tokens "
        f"(median of {repeats}, {dispatch}) on {machine_description()}",
        ["mode", "us/request", "x host free list", "hit tokens", "hit rate", "evicted tokens", "device calls"],
        rows,
    )
    print("\nScheduler rows borrow cached blocks under a pin; the engine-path row increfs them into a "
          "BlockSpaceManager table (see the module docstring for which to pick).")
    print("\nTargets (issue 4, 2-core CPU): 8 per step <= 60 us/request; 1 per step no slower than "
          "SGLang's RadixCache on the same loop (about 136-160 us/request).")
    families, host, rates = [], [], []
    if args.quick:  # CI's smoke run: three models' engines cost ~40 s of compiles (tests cover the hits)
        print("\nPer-family hit rates on the engine: run without --quick.")
    else:
        from jaxkv.bench.prefix_families import (HOST_TIER_BYTES, SMALL_DEVICE_TOKENS, family_hit_rows, host_tier_rows,
                                                 transfer_rows)

        family_rows, families = family_hit_rows()
        print()
        print_table("prefix-cache hits per family on the engine, under block and snapshot pressure "
                    "(jaxkv.bench.prefix_families)",
                    ["family", "workload", "retention", "page (tokens)", "hit tokens", "hit rate", "ideal rate",
                     "hit / ideal", "evicted tokens", "snapshot bytes"], family_rows)
        host_rows, host = host_tier_rows()
        print()
        print_table(f"hit / ideal on a device that keeps {SMALL_DEVICE_TOKENS} tokens per group (2 snapshot rows), "
                    f"without and with a {HOST_TIER_BYTES >> 20} MiB host tier of the prefix cache",
                    ["family", "workload", "device only", "with host tier", "tokens loaded from host"], host_rows)
        rate_rows, rates = transfer_rows()
        print()
        print_table("host tier transfer rate (one transfer path each way; tiny bench models' blocks)",
                    ["family", "blocks", "bytes", "to host GB/s", "to device GB/s", "measured"], rate_rows)
    if args.json:
        print_json({"benchmark": "prefix", "machine": machine_description(), "dispatch": dispatch, "results": payload,
                    "families": families, "host_tier": host, "host_transfer": rates})
    return 0
