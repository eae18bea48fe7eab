"""What the engine's sampler costs per step: ``python -m jaxkv.bench sampler``.

The engine samples with per-row parameters (:class:`~jaxkv.nn.sampling.RowSampling`,
traced arrays, so a batch mixing requests never recompiles). The top-k /
top-p rule sorts each row's whole vocabulary, and a sampled row draws a
Gumbel noise over it; both are skipped (``lax.cond``) when no row of the
batch needs them. Timed here, one jitted :func:`~jaxkv.nn.sampling.sample`
call over ``[rows, vocab]`` float32 logits, against a bare ``argmax`` of
the same logits in the same run:

* **greedy rows**: every row at temperature 0 (the default, and every idle row);
* **temperature only**: every row samples at 0.8 (the draw runs, no sort);
* **one row top-p**: one row asks for top_p 0.9, the rest greedy (the sort and
  the draw run for every row: what every batch cost before the skip);
* **all top-p**: every row samples at 0.8 with top_p 0.9.

The shapes: SmolLM2's vocabulary (49,152) at 8 rows, Llama-3's (128,256)
at 64 rows (``--quick``: the first only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.bench._timing import best_seconds_interleaved, machine_description, print_json, print_table
from jaxkv.nn.sampling import RowSampling, sample

__all__ = ["CASES", "rows_for"]

SHAPES = [(8, 49152), (64, 128256)]

#: case -> (temperature, top_p) per row, given the row count.
CASES = {
    "greedy rows": lambda n: (np.zeros(n), np.ones(n)),
    "temperature only": lambda n: (np.full(n, 0.8), np.ones(n)),
    "one row top-p": lambda n: (np.where(np.arange(n) == 0, 0.8, 0.0), np.where(np.arange(n) == 0, 0.9, 1.0)),
    "all top-p": lambda n: (np.full(n, 0.8), np.full(n, 0.9)),
}


def rows_for(rows: int, vocab: int, repeats: int, seed: int = 0) -> list[dict]:
    """One row per case: best milliseconds of a ``sample`` call and its ratio
    to ``argmax`` over the same ``[rows, vocab]`` logits, interleaved."""
    logits = jnp.asarray(np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32))
    keys = jax.random.split(jax.random.key(seed), rows)
    jitted_sample, argmax = jax.jit(sample), jax.jit(lambda x: jnp.argmax(x, axis=-1))
    params = {}
    for case, make in CASES.items():
        temperature, top_p = make(rows)
        params[case] = RowSampling(temperature.astype(np.float32), np.zeros(rows, np.int32), top_p.astype(np.float32))
    fns = {"argmax": lambda: argmax(logits)}
    fns.update({case: (lambda p=p: jitted_sample(logits, keys, p)) for case, p in params.items()})
    for fn in fns.values():  # compile outside the timing
        jax.block_until_ready(fn())
    best = best_seconds_interleaved(fns, repeats)
    return [{"rows": rows, "vocab": vocab, "case": case, "ms": 1e3 * best[case],
             "argmax_ms": 1e3 * best["argmax"], "x_argmax": best[case] / best["argmax"]} for case in CASES]


def main(args) -> int:
    shapes = SHAPES[:1] if args.quick else SHAPES
    repeats = 3 if args.quick else 7
    results = [row for rows, vocab in shapes for row in rows_for(rows, vocab, repeats)]
    print_table(f"the sampler per call (best of {repeats}, interleaved) on {machine_description()}",
                ["rows", "vocab", "case", "ms", "argmax ms", "x argmax"],
                [[r["rows"], r["vocab"], r["case"], r["ms"], r["argmax_ms"], r["x_argmax"]] for r in results])
    if args.json:
        print_json({"benchmark": "sampler", "results": results})
    return 0
