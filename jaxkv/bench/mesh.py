"""``python -m jaxkv.bench scaling --mesh``: every family's decode step on 1,
2, 4 and 8 CPU devices (a ``tp`` mesh; the same batch, so the same total
work), and a two-process ``jax.distributed`` run against one process with
the same four devices.

Each figure comes from its own process (:mod:`jaxkv.bench.mesh_step`: a
process fixes its CPU device count when JAX starts). CPU devices here are
threads of one 2-core machine, so these times say little about GPU speed:
more devices mean more, smaller matmuls and collectives through memory. The
number that carries over to GPUs is the communication the compiled step
contains, reported as collectives per layer (Megatron tensor parallelism:
two all-reduces per layer, one after attention's output projection and
one after the MLP's down projection), and the per-step host cost of a
multi-process run (the ``per step`` column: one jitted call and a host
read per token, against the in-loop figure).
"""

from __future__ import annotations

import json

from jaxkv._processes import run_processes
from jaxkv.bench._timing import machine_description, print_json, print_table
from jaxkv.bench.mesh_step import FAMILIES

__all__ = ["main", "measure"]

DEVICE_COUNTS = (1, 2, 4, 8)
_TIMEOUT = 900


def _run(family: str, devices: int, processes: int, steps: int, repeats: int) -> dict:
    """One :mod:`jaxkv.bench.mesh_step` measurement (``processes`` workers
    of ``devices`` devices each, all bounded by a timeout)."""
    results = run_processes(["-m", "jaxkv.bench.mesh_step", family, "--devices", str(devices), "--steps", str(steps),
                             "--repeats", str(repeats)], processes, timeout=_TIMEOUT)
    for code, _, err in results:
        if code != 0:
            raise RuntimeError(f"{family} on {processes} x {devices} devices exited {code}:\n{err[-3000:]}")
    return json.loads(results[0][1].strip().splitlines()[-1])


def measure(families=tuple(FAMILIES), device_counts=DEVICE_COUNTS, steps: int = 16, repeats: int = 3) -> dict:
    """``{"devices": rows, "processes": rows}``: per family, the step time on
    each device count (ratio to one device) and collectives per layer; and
    the two-process run (2 x 2 devices) against one process of 4."""
    device_rows, process_rows = [], []
    for family in families:
        base = None
        for n in device_counts:
            r = _run(family, n, 1, steps, repeats)
            base = base or r
            device_rows.append(dict(r, ratio_loop=r["us_loop"] / base["us_loop"]))
        one = next((r for r in device_rows if r["family"] == family and r["devices"] == 4), None) \
            or _run(family, 4, 1, steps, repeats)
        two = _run(family, 2, 2, steps, repeats)
        process_rows.append(dict(family=family, us_loop_one=one["us_loop"], us_loop_two=two["us_loop"],
                                 us_step_one=one["us_per_step"], us_step_two=two["us_per_step"],
                                 ratio_loop=two["us_loop"] / one["us_loop"],
                                 ratio_step=two["us_per_step"] / one["us_per_step"],
                                 host_us_one=one["us_per_step"] - one["us_loop"],
                                 host_us_two=two["us_per_step"] - two["us_loop"]))
    return {"devices": device_rows, "processes": process_rows}


def main(args) -> int:
    print(machine_description())
    if args.quick:
        result = measure(families=("llama",), device_counts=(1, 2, 4), steps=4, repeats=1)
        print("--quick: llama on 1, 2 and 4 devices only; run without it for the table")
    else:
        result = measure()
    print_table("decode step on a tp mesh of CPU devices (batch 8, 24-token prompts; same work on every mesh; "
                "CPU devices share 2 cores: times say little about GPUs, collectives carry over)",
                ["family", "devices", "us/step in loop", "vs 1 device", "us/step per call", "all-reduce/layer",
                 "all-gather", "other collectives"],
                [[r["family"], r["devices"], r["us_loop"], r["ratio_loop"], r["us_per_step"],
                  r["all_reduce_per_layer"], r["collectives"]["all-gather"],
                  sum(v for k, v in r["collectives"].items() if k not in ("all-reduce", "all-gather"))]
                 for r in result["devices"]])
    print_table("two processes (jax.distributed on localhost, 2 CPU devices each, gloo) against one process "
                "with 4 devices; 'host' = per-call step minus in-loop step",
                ["family", "us/step loop 1p", "loop 2p", "2p / 1p", "us/step per call 1p", "per call 2p",
                 "2p / 1p", "host us 1p", "host us 2p"],
                [[r["family"], r["us_loop_one"], r["us_loop_two"], r["ratio_loop"], r["us_step_one"],
                  r["us_step_two"], r["ratio_step"], r["host_us_one"], r["host_us_two"]]
                 for r in result["processes"]])
    if args.json:
        print_json({"benchmark": "scaling --mesh", "machine": machine_description(), "results": result})
    return 0
