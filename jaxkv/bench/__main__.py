"""``python -m jaxkv.bench NAME [--json]``: run one benchmark and print a table.

With ``--json`` the last line of output is one JSON object with the same
figures. Benchmarks of later issues are listed with the issue that brings them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: name -> module implementing ``main(args) -> int``; None = not built yet.
BENCHMARKS = {
    "alloc": "jaxkv.bench.alloc",
    "pool": "jaxkv.bench.pool",
    "prefix": "jaxkv.bench.prefix",
    "decode": "jaxkv.bench.decode",
    "memory": "jaxkv.bench.memory",
    "kernels": "jaxkv.bench.kernels",
    "hybrid": "jaxkv.bench.hybrid",
    "serve": "jaxkv.bench.serve",
    "scaling": None,  # issue 18 builds it (per-step cost at pool sizes P, 4P, 16P)
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (smoke test)")
    parser.add_argument("--plot", help="where a benchmark that draws saves its PNG (memory: bench_memory.png)")
    args = parser.parse_args(argv)
    module = BENCHMARKS[args.name]
    if module is None:
        print(f"benchmark {args.name!r} is not built yet: it arrives with the issue that builds its subject")
        return 2
    return importlib.import_module(module).main(args)


if __name__ == "__main__":
    sys.exit(main())
