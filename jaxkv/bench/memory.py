"""``python -m jaxkv.bench memory``: a serving simulation in the style of the
PagedAttention paper: how much of a fixed KV budget each allocation policy
wastes, and how many requests it therefore runs at once.

The workload (``numpy.random.default_rng(0)``): requests arrive as a Poisson
process (mean 1.5 per simulated step) with prompts of 32..512 tokens and
outputs of 16..512 tokens (uniform), served first come first served under a
budget of 2,048 blocks of 16 tokens (32,768 tokens) and at most 256 running
sequences. A simulated step admits what fits, then every running sequence
generates one token (the prompt is written when it is admitted).

Policies:

* **paged** (jaxkv): jaxkv's own ``BlockSpaceManager`` on device, one jitted
  call per step (free finished rows, ``admit_with_prefix`` the admitted
  prompts, ``append_slots`` every running row): a sequence holds
  ``ceil(len / 16)`` blocks; when ``append_slots`` cannot grow every row, the
  most recently admitted request is preempted (freed and queued again at
  the front, recomputed later);
* **paged, sliding window 256**: the same with every layer windowed, as for
  Mistral: ``BlockSpaceManager.trim_window`` releases the blocks that left
  the window after each step (what ``generate`` and the engine do);
* **reserve max length**: each request reserves ``max_len = 1,024`` tokens
  at admission (static batching systems before paging);
* **reserve actual length** (oracle): each request reserves exactly its
  prompt + output length, known in advance.

Reported: KV memory waste (reserved but not holding a token that attention
can still read, summed over steps, % of reserved), mean and peak running
sequences, throughput (requests finished per simulated step) and steps to
drain the workload. A PNG of blocks in use per step for each policy is
written where ``--plot`` says (default ``bench_memory.png``) when
matplotlib is installed (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._ops import ceil_div
from jaxkv.bench._timing import machine_description, print_json, print_table
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.pool.kv_pool import KVPool

__all__ = ["main", "simulate_paged", "simulate_reserved", "workload"]

PAGE = 16
BUDGET_BLOCKS = 2048
MAX_SEQS = 256
MAX_LEN = 1024
WINDOW = 256


@dataclasses.dataclass
class Outcome:
    """One policy's run: per step blocks reserved and tokens that count."""

    name: str
    reserved_tokens: list = dataclasses.field(default_factory=list)
    used_tokens: list = dataclasses.field(default_factory=list)
    running: list = dataclasses.field(default_factory=list)
    finished: int = 0
    preemptions: int = 0

    def row(self) -> dict:
        reserved, used = np.asarray(self.reserved_tokens, np.float64), np.asarray(self.used_tokens, np.float64)
        steps = len(self.running)
        return {"policy": self.name, "waste_pct": 100 * float((reserved - used).sum() / max(reserved.sum(), 1)),
                "mean_running": float(np.mean(self.running)), "peak_running": int(np.max(self.running)),
                "requests_per_step": self.finished / steps, "steps": steps, "preemptions": self.preemptions,
                "peak_blocks": int(reserved.max() // PAGE)}


def workload(num_requests: int, rng) -> list[tuple[int, int, int]]:
    """``(arrival step, prompt tokens, output tokens)`` per request."""
    arrivals = np.floor(np.cumsum(rng.exponential(1 / 1.5, num_requests))).astype(int)
    prompts = rng.integers(32, 513, num_requests)
    outputs = rng.integers(16, 513, num_requests)
    return [(int(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


@partial(jax.jit, static_argnames=("window",), donate_argnums=(0, 1))
def _paged_step(manager: BlockSpaceManager, pool: KVPool, free_rows, admit_rows, admit_lens, grow_rows, *,
                window: int):
    """Free, admit, grow every running row by one token, trim to the window."""
    manager, _ = manager.free(free_rows)
    no_prefix = jnp.full((admit_rows.shape[0], manager.max_blocks_per_seq), -1, jnp.int32)
    manager, admitted = manager.admit_with_prefix(admit_rows, no_prefix, admit_lens)
    manager, pool, _, blocked, grown = manager.append_slots(pool, grow_rows, 1)
    if window:
        manager, _ = manager.trim_window(jnp.where(grown, grow_rows, -1), window)
    return manager, pool, admitted, grown, blocked, manager.device.num_used


def simulate_paged(requests, window: int = 0) -> Outcome:
    """The paged policies through jaxkv's ``BlockSpaceManager`` (module docstring)."""
    name = f"paged, sliding window {window}" if window else "paged (jaxkv)"
    out = Outcome(name)
    manager = BlockSpaceManager.create(num_device_blocks=BUDGET_BLOCKS + 1, num_host_blocks=1, block_size=PAGE,
                                       max_seqs=MAX_SEQS, max_blocks_per_seq=ceil_div(MAX_LEN, PAGE))
    pool = KVPool.create(num_pages=BUDGET_BLOCKS + 1, page_size=PAGE, num_layers=1, k_heads=1, k_dim=1)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    queue: list = []
    running: dict = {}  # row -> [request, tokens held, tokens at the end, admission order]
    free_rows, order, step, used_blocks = list(range(MAX_SEQS)), 0, 0, 0
    done_rows: list = []
    while pending or queue or running:
        while pending and requests[pending[0]][0] <= step:
            queue.append(pending.pop(0))
        admit = []
        free = BUDGET_BLOCKS - used_blocks + sum(ceil_div(running[r][1], PAGE) for r in done_rows)  # after frees
        growth = len(running) - len(done_rows)  # a block each, at most, for this step's token
        while queue and free_rows:
            _, prompt, output = requests[queue[0]]
            need = ceil_div(prompt, PAGE)
            if need + growth + 1 > free:
                break
            row = free_rows.pop(0)
            admit.append((row, prompt))
            running[row] = [queue.pop(0), prompt, prompt + output, order]
            order += 1
            free -= need
            growth += 1
        grow = [r for r in running if r not in done_rows]
        while True:
            manager, pool, admitted, grown, blocked, num_used = _paged_step(
                manager, pool, _fixed(done_rows, MAX_SEQS), _fixed([r for r, _ in admit], MAX_SEQS),
                _fixed([n for _, n in admit], MAX_SEQS, fill=0), _fixed(grow, MAX_SEQS), window=window)
            admitted, grown = bool(admitted), bool(grown)
            assert admitted, "the host admitted what did not fit"  # the host's count mirrors the device's
            for row in done_rows:
                del running[row]
                free_rows.append(row)
            done_rows, admit = [], []
            if grown:
                break
            # Preempt the newest request until the rest can grow (recompute later).
            victim = max(grow, key=lambda r: running[r][3])
            queue.insert(0, running[victim][0])
            done_rows.append(victim)
            grow.remove(victim)
            out.preemptions += 1
        for row in grow:
            running[row][1] += 1
        used_blocks = int(num_used)
        done_rows = [r for r, (_, held, end, _) in running.items() if held >= end]
        out.finished += len(done_rows)
        visible = sum(min(held, window) if window else held for _, held, _, _ in running.values())
        out.reserved_tokens.append(used_blocks * PAGE)
        out.used_tokens.append(visible)
        out.running.append(len(running))
        step += 1
    return out


def _fixed(ids, size, fill=-1) -> np.ndarray:
    out = np.full((size,), fill, np.int32)
    out[: len(ids)] = ids
    return out


def simulate_reserved(requests, policy: str) -> Outcome:
    """Reservation at admission: ``"max"`` (``MAX_LEN`` tokens, in blocks) or
    ``"oracle"`` (exactly prompt + output tokens)."""
    out = Outcome("reserve max length" if policy == "max" else "reserve actual length (oracle)")
    budget = BUDGET_BLOCKS * PAGE
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    queue: list = []
    running: list = []  # [tokens held, tokens at the end, tokens reserved]
    reserved, step = 0, 0
    while pending or queue or running:
        while pending and requests[pending[0]][0] <= step:
            queue.append(pending.pop(0))
        while queue and len(running) < MAX_SEQS:
            _, prompt, output = requests[queue[0]]
            need = MAX_LEN if policy == "max" else prompt + output
            if reserved + need > budget:
                break
            queue.pop(0)
            running.append([prompt, prompt + output, need])
            reserved += need
        for seq in running:
            seq[0] += 1
        out.reserved_tokens.append(reserved)
        out.used_tokens.append(sum(held for held, _, _ in running))
        out.running.append(len(running))
        finished = [seq for seq in running if seq[0] >= seq[1]]
        out.finished += len(finished)
        reserved -= sum(seq[2] for seq in finished)
        running = [seq for seq in running if seq[0] < seq[1]]
        step += 1
    return out


def _plot(outcomes: list[Outcome], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e \".[bench]\"): no plot"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for o in outcomes:
        top.plot(np.asarray(o.reserved_tokens) / PAGE, label=o.name, linewidth=1)
        bottom.plot(np.asarray(o.used_tokens) / PAGE, label=o.name, linewidth=1)
    top.axhline(BUDGET_BLOCKS, color="gray", linestyle="--", linewidth=0.8, label="budget")
    top.set_ylabel(f"blocks reserved ({PAGE} tokens)")
    bottom.set_ylabel("blocks' worth of tokens held")
    bottom.set_xlabel("simulated step")
    top.set_title("KV blocks reserved (top) and actually holding readable tokens (bottom), per policy")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {os.path.abspath(path)}"


def main(args) -> int:
    requests = workload(40 if args.quick else 1000, np.random.default_rng(0))
    outcomes = [simulate_paged(requests), simulate_paged(requests, WINDOW), simulate_reserved(requests, "max"),
                simulate_reserved(requests, "oracle")]
    rows = [o.row() for o in outcomes]
    print_table(f"serving simulation, {len(requests)} requests, KV budget {BUDGET_BLOCKS} blocks of {PAGE} tokens, "
                f"max length {MAX_LEN} ({machine_description()})",
                ["policy", "KV waste %", "mean running", "peak running", "requests/step", "steps", "preemptions",
                 "peak blocks"],
                [[r["policy"], f"{r['waste_pct']:.1f}", f"{r['mean_running']:.1f}", r["peak_running"],
                  f"{r['requests_per_step']:.3f}", r["steps"], r["preemptions"], r["peak_blocks"]] for r in rows])
    print("\nWaste: reserved KV slots not holding a token attention can still read (future tokens of a "
          "reservation, the unfilled end of a last block, tokens that left a sliding window).")
    print(_plot(outcomes, getattr(args, "plot", None) or "bench_memory.png"))
    if args.json:
        print_json({"benchmark": "memory", "machine": machine_description(), "results": rows})
    return 0
