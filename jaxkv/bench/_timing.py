"""Timing and table helpers shared by the benchmarks.

Machines here are noisy, so every figure is the *minimum* over several
repeats (the least-disturbed run) and each benchmark reports ratios against a
baseline measured in the same process, interleaved with the subject.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable, Sequence

import jax


def best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Minimum wall time of ``fn()`` over ``repeats`` runs, waiting for device
    results. Call it once before timing so compilation is not counted."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def best_seconds_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5) -> dict[str, float]:
    """Minimum wall time of each function, measured in alternation (a, b, a, b,
    ...) so a noisy spell on the machine hits all of them alike."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def machine_description() -> str:
    devices = jax.devices()
    kind = devices[0].device_kind if devices else "?"
    return f"{platform.node() or 'host'}: {len(devices)} x {devices[0].platform} ({kind}), jax {jax.__version__}"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned text table (markdown-compatible)."""
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}\n")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |")


def print_json(payload: dict) -> None:
    """The ``--json`` contract: the last line of output is one JSON object."""
    print(json.dumps(payload, sort_keys=True))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def inline_cpu_dispatch() -> str:
    """Run CPU calls inline unless ``JAXKV_ASYNC_DISPATCH=1`` (possible only
    before JAX starts its backend): a host loop of small jitted calls that
    waits for each result is faster that way on a small CPU. Returns the
    dispatch mode, for the table title."""
    from jax._src import xla_bridge  # the only way to know whether the backend started

    if os.environ.get("JAXKV_ASYNC_DISPATCH") != "1" and not xla_bridge._backends:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    inline = not xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value and jax.default_backend() == "cpu"
    return "inline CPU dispatch" if inline else "async dispatch"
