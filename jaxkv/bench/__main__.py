"""``python -m jaxkv.bench NAME [--json]``: run one benchmark and print a table.

``serve --shapes SHAPE[,SHAPE]`` is ``real_scale --shapes ...``: the engine
at a published checkpoint's shapes with random weights (the GPU bench).
``serve --disaggregated`` is ``disaggregated``: a prefill and a decode
server process against one server.

With ``--json`` the last line of output is one JSON object with the same
figures.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: name -> module implementing ``main(args) -> int``.
BENCHMARKS = {
    "alloc": "jaxkv.bench.alloc",
    "pool": "jaxkv.bench.pool",
    "prefix": "jaxkv.bench.prefix",
    "decode": "jaxkv.bench.decode",
    "memory": "jaxkv.bench.memory",
    "kernels": "jaxkv.bench.kernels",
    "hybrid": "jaxkv.bench.hybrid",
    "serve": "jaxkv.bench.serve",
    "scaling": "jaxkv.bench.scaling",
    "deployment": "jaxkv.bench.deployment",
    "isolation": "jaxkv.bench.isolation",
    "real_scale": "jaxkv.bench.real_scale",
    "compile_depth": "jaxkv.bench.compile_depth",
    "engine_aot": "jaxkv.bench.engine_aot",
    "spec": "jaxkv.bench.spec",
    "structured": "jaxkv.bench.structured",
    "disaggregated": "jaxkv.bench.disaggregated",
    "scan_copy": "jaxkv.bench.scan_copy",
    "sampler": "jaxkv.bench.sampler",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (smoke test)")
    parser.add_argument("--http", action="store_true", help="serve: the workload through python -m jaxkv.serve "
                        "(streaming clients over loopback) against the in-process engine")
    parser.add_argument("--mesh", action="store_true", help="scaling: every family's decode step on 1, 2, 4, 8 "
                        "CPU devices and across two jax.distributed processes (jaxkv.bench.mesh)")
    parser.add_argument("--plot", help="where a benchmark that draws saves its PNG (memory: bench_memory.png)")
    args, rest = parser.parse_known_args(argv)
    if args.name == "serve" and "--disaggregated" in rest:
        # Prefill and decode servers against one (issue 45's ``serve --disaggregated``).
        args.name = "disaggregated"
        rest = [a for a in rest if a != "--disaggregated"]
    if args.name == "serve" and any(a == "--shapes" or a.startswith("--shapes=") for a in rest):
        # The engine at a real model's shapes (random weights, the GPU bench): the real_scale benchmark,
        # under the name issue 41 gives it (``serve --shapes llama-3.1-8b``).
        args.name = "real_scale"
    module = importlib.import_module(BENCHMARKS[args.name])
    if rest:  # a benchmark with options of its own parses them (``parse_extra``); the others refuse them
        if not hasattr(module, "parse_extra"):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args = module.parse_extra(args, rest)
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
