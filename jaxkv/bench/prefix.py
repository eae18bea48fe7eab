"""``python -m jaxkv.bench prefix``: the radix prefix cache on a shared-prefix
trace, device allocator calls included.

The trace (issue 4): ``numpy.random.default_rng(0)``; 10 system prompts of
800 tokens (``integers(1, 32000, size=800)``, one after another); then 2,000
requests, each drawing its prompt index ``integers(10)``, its total length
``integers(1000, 2001)`` and its suffix ``integers(1, 32000,
size=total-800)``. Page size 16; a device pool of 262,144 tokens (16,384
blocks), so the cache must evict.

Each request: match, pin, allocate (evicting when short), insert, release
duplicates, unpin. Run through ``PrefixScheduler`` one request per step and
eight per step (the way an engine admits), both with one device call per
step. The baseline, timed in the same run: the same loop over seed 001's tree
shape (one node per token, no compressed edges) with a host-side Python free
list, i.e. what a straight port of the seed costs with no device calls at all.

Figures are the median over several runs of the whole trace, in microseconds
per request.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from jaxkv.alloc.block import BlockAllocator
from jaxkv.bench._timing import machine_description, print_json, print_table
from jaxkv.prefix.paged import PrefixCacheManager
from jaxkv.prefix.scheduler import PrefixScheduler

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


def run_scheduler(trace: list[np.ndarray], batch: int) -> dict:
    """The whole trace through ``PrefixScheduler``, ``batch`` new requests per
    step. Returns wall time and the cache's counters."""
    cache = PrefixCacheManager(PAGE_SIZE)
    scheduler = PrefixScheduler(cache, BlockAllocator.create(POOL_TOKENS // PAGE_SIZE + 1))
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


class _TokenNode:
    __slots__ = ("children", "blocks", "parent", "token", "last_access", "lock")

    def __init__(self, parent, token):
        self.children = {}
        self.blocks = None  # block id when this node ends a page
        self.parent = parent
        self.token = token
        self.last_access = 0
        self.lock = 0


def run_seed_baseline(trace: list[np.ndarray]) -> dict:
    """Seed 001's tree shape (a node per token) holding page ids at page
    ends, with LRU leaf eviction and a Python free list: the same loop, no
    device. Counts hits like the scheduler (page-aligned, capped at len-1)."""
    free = list(range(POOL_TOKENS // PAGE_SIZE, 0, -1))
    root = _TokenNode(None, None)
    clock = hit = query = evicted = 0
    start = time.perf_counter()
    for prompt in trace:
        tokens = prompt.tolist()
        clock += 1
        query += len(tokens)
        # match (page-aligned) and lock
        node, path, blocks = root, [], []
        limit = (len(tokens) - 1) // PAGE_SIZE * PAGE_SIZE
        for i in range(limit):
            child = node.children.get(tokens[i])
            if child is None:
                break
            node = child
            path.append(node)
            if (i + 1) % PAGE_SIZE == 0:
                blocks.append(node.blocks)
        path = path[: len(blocks) * PAGE_SIZE]
        hit += len(blocks) * PAGE_SIZE
        for n in path:
            n.lock += 1
            n.last_access = clock
        # allocate, evicting least recently used unlocked page-end leaves
        need = -(-len(tokens) // PAGE_SIZE) - len(blocks)
        leaves: list = []
        while need > len(free):
            if not leaves:
                leaves = [n for n in _iter_nodes(root) if not n.children and not n.lock and n is not root]
                leaves.sort(key=lambda n: n.last_access, reverse=True)
                if not leaves:
                    raise RuntimeError("baseline: nothing left to evict")
            leaf = leaves.pop()
            for _ in range(PAGE_SIZE):  # a page's token nodes, from its end, up to a branch
                parent = leaf.parent
                if leaf.blocks is not None:
                    free.append(leaf.blocks)
                    evicted += PAGE_SIZE
                del parent.children[leaf.token]
                if parent is root or parent.children or parent.lock:
                    break
                leaf = parent
        fresh = [free.pop() for _ in range(need)]
        # insert the whole pages; pages already cached would be duplicates
        node, new_blocks = root, list(fresh)
        for i in range(len(tokens) // PAGE_SIZE * PAGE_SIZE):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _TokenNode(node, tokens[i])
            child.last_access = clock
            if (i + 1) % PAGE_SIZE == 0 and child.blocks is None:
                child.blocks = new_blocks.pop(0) if new_blocks else free.pop()
            node = child
        free.extend(new_blocks)  # the partial last page's block
        for n in path:
            n.lock -= 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "hit_tokens": hit, "query_tokens": query, "evicted_tokens": evicted, "device_calls": 0}


def _iter_nodes(root):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def main(args) -> int:
    num_requests = 300 if args.quick else 2000
    repeats = 1 if args.quick else 5
    trace = make_trace(num_requests)
    runs = {
        "jaxkv, 8 per step": lambda: run_scheduler(trace, 8),
        "jaxkv, 1 per step": lambda: run_scheduler(trace, 1),
        "seed-001 tree, host free list": lambda: run_seed_baseline(trace),
    }
    for run in runs.values():  # compile every jitted step shape once
        run()
    results: dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so a noisy spell hits all alike
        for name, run in runs.items():
            results[name].append(run())
    baseline = statistics.median(r["seconds"] for r in results["seed-001 tree, host free list"])
    rows, payload = [], []
    for name, measured in results.items():
        seconds = statistics.median(r["seconds"] for r in measured)
        last = measured[-1]
        us = seconds / num_requests * 1e6
        rate = last["hit_tokens"] / last["query_tokens"]
        rows.append([name, f"{us:.1f}", f"{seconds / baseline:.2f}", f"{last['hit_tokens']:,} / {last['query_tokens']:,}",
                     f"{rate:.2%}", f"{last['evicted_tokens']:,}", last["device_calls"]])
        payload.append({"mode": name, "us_per_request": us, "ratio_to_baseline": seconds / baseline,
                        "hit_tokens": last["hit_tokens"], "query_tokens": last["query_tokens"], "hit_rate": rate,
                        "evicted_tokens": last["evicted_tokens"], "device_calls": last["device_calls"]})
    print_table(
        f"prefix cache, {num_requests} requests, page {PAGE_SIZE}, pool {POOL_TOKENS:,} tokens "
        f"(median of {repeats}) on {machine_description()}",
        ["mode", "us/request", "x baseline", "hit tokens", "hit rate", "evicted tokens", "device calls"],
        rows,
    )
    print("\nTargets (issue 4, 2-core CPU): 8 per step <= 60 us/request; 1 per step no slower than "
          "SGLang's RadixCache on the same loop (about 136-160 us/request).")
    if args.json:
        print_json({"benchmark": "prefix", "machine": machine_description(), "results": payload})
    return 0
