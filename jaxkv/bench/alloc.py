"""``python -m jaxkv.bench alloc``: the block allocator inside a jitted decode loop.

Workload (same for every column): ``batch`` sequences, 16-token blocks, each
sequence grows by one token per step up to a target length drawn from
[16, 256]; a sequence whose new token opens a block acquires one block; a
finished sequence releases all its blocks and restarts as a new request
(at most ``batch // 32`` releases per step, the rest wait a step, as an engine
that frees a bounded number of requests per step would).

Columns, all in microseconds per decode step:

* ``jaxkv scan``: the whole step (allocator + block-table bookkeeping), many
  steps in one jitted ``lax.scan``;
* ``allocator``: the allocator's share of it: the scan minus the same scan
  with acquire/release replaced by a stateless stand-in;
* ``numpy list``: the same workload on a plain Python/numpy free list (the
  host allocator of vLLM v0 / SGLang), run in the same process;
* ``jit per step``: jaxkv with one jitted call per step from a host loop, the
  cost that running the loop inside jit removes.

The jaxkv and numpy runs must end with identical block tables (checked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.alloc.block import BlockAllocator
from jaxkv.bench._timing import best_seconds, best_seconds_interleaved, machine_description, print_json, print_table

__all__ = ["main", "measure", "run_numpy"]

BLOCK_SIZE = 16
MAX_BLOCKS = 16  # sequences of up to 256 tokens
BATCHES = (1, 64, 256)


def _max_releases(batch: int) -> int:
    return max(1, batch // 32)


def _schedule(batch: int, steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lo, hi = BLOCK_SIZE, BLOCK_SIZE * MAX_BLOCKS
    return (
        rng.integers(lo, hi + 1, size=batch).astype(np.int32),
        rng.integers(lo, hi + 1, size=(steps, batch)).astype(np.int32),
    )


def _make_step(batch: int, use_allocator: bool):
    """One decode step over ``(allocator, table, lens, targets, clock)``."""
    rows = jnp.arange(batch, dtype=jnp.int32)
    releases = _max_releases(batch)

    def step(carry, new_targets):
        allocator, table, lens, targets, clock = carry
        growing = lens < targets
        lens = lens + growing
        crossing = growing & ((lens - 1) % BLOCK_SIZE == 0)
        if use_allocator:
            allocator, ids, acquired = allocator.acquire(jnp.sum(crossing, dtype=jnp.int32), max_n=batch)
        else:  # stand-in: fresh-looking ids, no state
            ids, acquired = (clock * 7 + rows) % (batch * MAX_BLOCKS) + 1, jnp.bool_(True)
        rank = jnp.cumsum(crossing, dtype=jnp.int32) - 1
        block_index = (lens - 1) // BLOCK_SIZE
        table = table.at[jnp.where(crossing, rows, batch), block_index].set(
            ids[jnp.clip(rank, 0, batch - 1)], mode="drop"
        )
        finished = jnp.nonzero(lens >= targets, size=releases, fill_value=batch)[0]
        freed_blocks = table.at[finished].get(mode="fill", fill_value=-1)
        if use_allocator:
            allocator, released = allocator.release(freed_blocks)
        else:
            released = jnp.sum(freed_blocks) > jnp.iinfo(jnp.int32).min
        # Indices derived from the rows just read (always equal to ``finished``)
        # order that read before this in-place write; otherwise XLA copies the table.
        table = table.at[jnp.where(freed_blocks[:, 0] >= -1, finished, batch)].set(-1, mode="drop")
        lens = lens.at[finished].set(0, mode="drop")
        targets = targets.at[finished].set(new_targets.at[finished].get(mode="fill", fill_value=0), mode="drop")
        return (allocator, table, lens, targets, clock + 1), acquired & released

    return step


def _initial_carry(batch: int, first_targets: np.ndarray):
    return (
        BlockAllocator.create(batch * MAX_BLOCKS + 1),
        jnp.full((batch, MAX_BLOCKS), -1, jnp.int32),
        jnp.zeros((batch,), jnp.int32),
        jnp.asarray(first_targets),
        jnp.int32(0),
    )


def run_numpy(batch: int, first_targets: np.ndarray, new_targets: np.ndarray) -> np.ndarray:
    """The workload on a Python list used as a free stack; returns the final table."""
    free = list(range(batch * MAX_BLOCKS, 0, -1))  # pop() returns 1, 2, 3, ...
    table = np.full((batch, MAX_BLOCKS), -1, np.int64)
    lens = np.zeros(batch, np.int64)
    targets = first_targets.astype(np.int64).copy()
    releases = _max_releases(batch)
    for step_targets in new_targets:
        growing = lens < targets
        lens += growing
        crossing = np.flatnonzero(growing & ((lens - 1) % BLOCK_SIZE == 0))
        if len(crossing) > len(free):
            raise MemoryError("numpy baseline ran out of blocks")
        for row in crossing:
            table[row, (lens[row] - 1) // BLOCK_SIZE] = free.pop()
        for row in np.flatnonzero(lens >= targets)[:releases]:
            held = table[row]
            free.extend(held[held >= 0].tolist())
            table[row] = -1
            lens[row] = 0
            targets[row] = step_targets[row]
    return table


def measure(batch: int, steps: int, repeats: int) -> dict:
    first_targets, new_targets = _schedule(batch, steps)
    carry = _initial_carry(batch, first_targets)
    schedule = jnp.asarray(new_targets)

    def scan_of(use_allocator):
        return jax.jit(lambda c, s: jax.lax.scan(_make_step(batch, use_allocator), c, s))

    full, stand_in = scan_of(True), scan_of(False)
    final, oks = full(carry, schedule)
    stand_in(carry, schedule)
    if not bool(jnp.all(oks)):
        raise RuntimeError("an acquire or release failed in the benchmark workload")
    expected_table = run_numpy(batch, first_targets, new_targets)
    agree = bool(np.array_equal(np.asarray(final[1]), expected_table))

    best = best_seconds_interleaved(
        {
            "full": lambda: full(carry, schedule),
            "stand_in": lambda: stand_in(carry, schedule),
            "numpy": lambda: run_numpy(batch, first_targets, new_targets),
        },
        repeats,
    )
    t_full, t_stand_in, t_numpy = best["full"], best["stand_in"], best["numpy"]

    host_steps = min(steps, 200)
    one_step = jax.jit(_make_step(batch, True))
    step_inputs = [jnp.asarray(new_targets[t]) for t in range(host_steps)]  # sliced up front

    def host_loop():
        c = carry
        for inputs in step_inputs:
            c, ok = one_step(c, inputs)
        return c

    host_loop()
    t_host = best_seconds(host_loop, max(1, repeats // 2))

    per_step = 1e6 / steps
    return {
        "batch": batch,
        "jaxkv_scan_us": t_full * per_step,
        "allocator_us": max(t_full - t_stand_in, 0.0) * per_step,
        "numpy_list_us": t_numpy * per_step,
        "jit_per_step_us": t_host * 1e6 / host_steps,
        "numpy_over_scan": t_numpy / t_full,
        "tables_agree": agree,
    }


def main(args) -> int:
    steps, repeats = (300, 2) if args.quick else (2000, 15)
    results = [measure(b, steps, repeats) for b in BATCHES]
    print(f"alloc benchmark on {machine_description()}; {steps} steps per scan, best of {repeats}")
    print_table(
        "Per decode step (microseconds); lower is better",
        ["batch", "jaxkv scan", "allocator", "numpy list", "jit per step", "numpy / scan", "same tables"],
        [
            [
                r["batch"],
                r["jaxkv_scan_us"],
                r["allocator_us"],
                r["numpy_list_us"],
                r["jit_per_step_us"],
                r["numpy_over_scan"],
                "yes" if r["tables_agree"] else "NO",
            ]
            for r in results
        ],
    )
    if args.json:
        print_json({"benchmark": "alloc", "machine": machine_description(), "steps": steps, "results": results})
    return 0 if all(r["tables_agree"] for r in results) else 1
