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
import numpy as np


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


def best_seconds_threaded(runs: dict, repeats: int) -> dict[str, float]:
    """``runs[name] = (fn, state)`` with ``fn(state) -> (state, ok)``: the
    minimum seconds of a call of each, interleaved. Each call continues from
    the state the previous one returned (``fn`` donates it: no copy to time
    or subtract); a call whose ``ok`` is not all True raises."""
    states = {name: state for name, (_, state) in runs.items()}
    for name, (fn, _) in runs.items():  # compile and warm up
        states[name] = jax.block_until_ready(fn(states[name]))[0]
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, (fn, _) in runs.items():
            start = time.perf_counter()
            states[name], out = jax.block_until_ready(fn(states[name]))
            best[name] = min(best[name], time.perf_counter() - start)
            if not bool(np.all(np.asarray(jax.device_get(out)))):
                raise AssertionError(f"{name}: a step failed")
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


def _read_backends_started() -> bool:
    """Whether JAX has started a backend. JAX has no public API for this, so it
    reads ``jax._src.xla_bridge._backends``; a JAX that moved it raises
    ``ImportError`` / ``AttributeError`` here (see :func:`backend_started`)."""
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def backend_started() -> bool | None:
    """Whether JAX has started a backend; None when this JAX does not say
    (its internals changed): callers then leave the config alone."""
    try:
        return _read_backends_started()
    except (ImportError, AttributeError):
        return None


def _config_value(name: str):
    """A JAX config option's value through public API, None if unknown."""
    try:
        return jax.config.read(name)
    except (AttributeError, KeyError):
        return getattr(jax.config, name, None)


def inline_cpu_dispatch() -> str:
    """Run CPU calls inline unless ``JAXKV_ASYNC_DISPATCH=1`` (possible only
    before JAX starts its backend): a host loop of small jitted calls that
    waits for each result is faster that way on a small CPU. Returns the
    dispatch mode, for the table title.

    Guarded against JAX upgrades: when this JAX cannot say whether its
    backend started (:func:`backend_started` is None), the config is left
    alone and the title says the mode is unknown, never wrong."""
    started = backend_started()
    if os.environ.get("JAXKV_ASYNC_DISPATCH") != "1" and started is False:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    enabled = _config_value("jax_cpu_enable_async_dispatch")
    if started is None or enabled is None:
        return "dispatch mode unknown (JAX internals changed)"
    inline = not enabled and jax.default_backend() == "cpu"
    return "inline CPU dispatch" if inline else "async dispatch"


__all__ = [
    "backend_started",
    "best_seconds",
    "best_seconds_interleaved",
    "best_seconds_threaded",
    "inline_cpu_dispatch",
    "machine_description",
    "print_json",
    "print_table",
]
