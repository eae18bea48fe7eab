"""``python -m jaxkv.bench scan_copy``: is a stacked layer's weight copied
before its matmul? The question that keeps a GPU model's layers unrolled.

A model whose layers run under one ``lax.scan`` (:mod:`jaxkv.nn.scan`)
compiles in a time that does not grow with depth, but its weights are
*stacked* (one array per parameter, a row per layer), and XLA:GPU hands a
cuBLAS matmul a copy of the row it reads: at batch 1 a decode step reads
its weights three times instead of once (an H200 measured 12.4 ms per
Llama-3.1-8B step stacked, 6.1 ms with a parameter per layer; docs/gpu.md).
So a GPU model keeps a parameter per layer (``default_scan_layers``) and
pays compile time that grows with depth.

This bench times what would let a GPU keep the scan, on the device it runs
on: ``--layers`` gated MLPs (``silu(x W_gate) * (x W_up) W_down``, a
decoder layer's weights less attention's) at a checkpoint's
shapes (``--shape``: ``llama-3.1-8b``, hidden 4,096 and intermediate
14,336; ``tiny`` for a CPU), batch ``--batch`` (default 1: a decode
step's matvec, bound by reading the weights), bf16, in these forms:

* ``per layer``: a parameter per layer, the layers unrolled (the GPU
  default today): the baseline;
* ``scan``: stacked under one ``lax.scan`` (the CPU default);
* on a GPU, the scan compiled with XLA options that might read the row in
  place: ``xla_gpu_enable_dynamic_slice_fusion`` (a library matmul given
  the row's address; also with Triton matmuls off, as XLA's autotuner
  picks cuBLAS for these shapes on a device) and Triton matmuls only
  (``xla_gpu_enable_triton_gemm``, no cuBLAS fallback: a Triton fusion may
  read a slice itself), and the baseline under the Triton option too (a
  slower matmul would cancel the gain).

Per form: compile seconds, the compiled program's temporary bytes (a
temporary of one layer's weight is the copy), the step's time (the best of
``--repeats`` interleaved calls), the weights' bytes over that time (GB/s;
a step that reads the weights once approaches the device's bandwidth), the
time against ``per layer``'s, and whether its output equals the
baseline's (same weights, bf16 tolerance). A form whose compile fails says
why; the others still run. Run it on a GPU (``bash tools/device_check.sh
scan_copy``); on a CPU it runs the two forms at ``tiny`` shapes (what the
test checks: the program, not a GPU figure).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.bench._timing import best_seconds_interleaved, machine_description, print_json, print_table

__all__ = ["GPU_OPTIONS", "SHAPES", "forms", "main", "parse_extra", "run"]

#: ``--shape`` name -> (hidden size, intermediate size).
SHAPES = {"llama-3.1-8b": (4096, 14336), "tiny": (256, 512)}
#: On a GPU: name -> XLA options of the scan forms tried beside the plain scan.
GPU_OPTIONS = {
    "dynamic-slice fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "dynamic-slice fusion, cuBLAS matmuls": {"xla_gpu_enable_dynamic_slice_fusion": True,
                                             "xla_gpu_enable_triton_gemm": False},
    "Triton matmuls only": {"xla_gpu_enable_triton_gemm": True, "xla_gpu_cublas_fallback": False},
}
#: Outputs of two forms agree within this, relative to the baseline's largest magnitude (bf16 sums in
#: another order).
TOLERANCE = 2e-2


def _mlp(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def per_layer(weights, x):
    """The layers unrolled over a parameter per layer (a list of ``(gate, up, down)``)."""
    for gate, up, down in weights:
        x = _mlp(x, gate, up, down)
    return x


def scanned(stacked, x):
    """The layers under one ``lax.scan`` over stacked ``(gate, up, down)``."""
    return jax.lax.scan(lambda h, w: (_mlp(h, *w), None), x, stacked)[0]


def forms(backend: str) -> list[tuple[str, object, bool, dict]]:
    """``(name, function, takes the stacked weights, XLA options)`` per form
    timed on ``backend``."""
    out = [("per layer", per_layer, False, {}), ("scan", scanned, True, {})]
    if backend in ("gpu", "cuda", "rocm"):
        out += [(f"scan, {name}", scanned, True, options) for name, options in GPU_OPTIONS.items()]
        out.append(("per layer, Triton matmuls only", per_layer, False, GPU_OPTIONS["Triton matmuls only"]))
    return out


def _arguments(shape: str, layers: int, batch: int, seed: int, device=None):
    """``(stacked weights, per-layer weights, x)``: arrays, or with ``device``
    (a deviceless target, :func:`kernels_pallas.aot_check.topology_device`)
    their shapes placed there (nothing allocated)."""
    hidden, inter = SHAPES[shape]
    shapes = [(layers, hidden, inter), (layers, hidden, inter), (layers, inter, hidden)]
    if device is not None:
        from jax.sharding import SingleDeviceSharding

        sharding = SingleDeviceSharding(device)
        stacked = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes)
        weights = [tuple(jax.ShapeDtypeStruct(s[1:], jnp.bfloat16, sharding=sharding) for s in shapes)
                   for _ in range(layers)]
        return stacked, weights, jax.ShapeDtypeStruct((batch, hidden), jnp.bfloat16, sharding=sharding)
    keys = jax.random.split(jax.random.key(seed), 4)
    scale = jnp.bfloat16(hidden ** -0.5)  # keeps the activations of a deep stack in range
    stacked = tuple(jax.random.normal(k, s, jnp.bfloat16) * scale for k, s in zip(keys[:3], shapes))
    weights = [tuple(w[i] for w in stacked) for i in range(layers)]  # a buffer of its own per layer
    return stacked, weights, jax.random.normal(keys[3], (batch, hidden), jnp.bfloat16)


def run(shape: str, layers: int, batch: int, repeats: int, seed: int = 0, aot: str | None = None) -> list[dict]:
    """Every form of :func:`forms` on the default backend; one dict per form
    (module docstring's figures; ``error`` set where its compile failed).
    ``aot`` (a GPU name of :func:`kernels_pallas.aot_check.topology_device`,
    e.g. ``"h100"``): compiled for that GPU without one, every GPU form,
    compile seconds and temporaries only (nothing runs)."""
    device = None
    if aot is not None:
        from kernels_pallas.aot_check import topology_device

        device = topology_device(aot)
    stacked, weights, x = _arguments(shape, layers, batch, seed, device)
    weight_bytes = sum(int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize for w in stacked)
    rows, calls = [], {}
    for name, fn, takes_stacked, options in forms("cuda" if aot else jax.default_backend()):
        args = (stacked if takes_stacked else weights, x)
        row = {"form": name, "options": options, "error": None}
        start = time.perf_counter()
        try:
            lowered = (jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)) if aot
                       else jax.jit(fn).lower(*args))
            compiled = lowered.compile(compiler_options=options or None)
        except Exception as err:  # noqa: BLE001 - a form XLA cannot compile is a finding, not the bench's end
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows.append(row)
            continue
        row["compile_s"] = time.perf_counter() - start
        memory = compiled.memory_analysis()
        row["temp_bytes"] = None if memory is None else int(memory.temp_size_in_bytes)
        row["temp_over_layer_weight"] = (None if memory is None
                                         else row["temp_bytes"] / (weight_bytes / layers))
        calls[name] = (compiled, args)
        rows.append(row)
    if aot is not None:
        return rows
    if "per layer" not in calls:
        raise RuntimeError(f"the baseline (a parameter per layer) did not compile: {rows[0]['error']}")
    best = best_seconds_interleaved({name: (lambda c=c, a=a: c(*a)) for name, (c, a) in calls.items()},
                                    repeats)
    baseline = np.asarray(jax.device_get(calls["per layer"][0](*calls["per layer"][1])), np.float32)
    magnitude = float(np.abs(baseline).max()) or 1.0
    for row in rows:
        if row["error"] is not None:
            continue
        out = np.asarray(jax.device_get(calls[row["form"]][0](*calls[row["form"]][1])), np.float32)
        row["step_ms"] = best[row["form"]] * 1e3
        row["weight_gb_per_s"] = weight_bytes / best[row["form"]] / 1e9
        row["vs_per_layer"] = best[row["form"]] / best["per layer"]
        row["max_diff"] = float(np.abs(out - baseline).max()) / magnitude
        row["same_output"] = row["max_diff"] <= TOLERANCE
    return rows


def parse_extra(args, rest: list[str]):
    """``scan_copy``'s options (``python -m jaxkv.bench``'s hook)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m jaxkv.bench scan_copy")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default llama-3.1-8b on a GPU, tiny elsewhere")
    p.add_argument("--layers", type=int, help="stacked layers (default 8 on a GPU, 4 elsewhere; --quick 2)")
    p.add_argument("--batch", type=int, default=1, help="rows of the step (default 1: a decode matvec)")
    p.add_argument("--repeats", type=int, help="timed calls per form, interleaved (default 20; --quick 2)")
    p.add_argument("--aot", metavar="GPU", help="compile for that GPU without one (h100, a100: needs "
                   "jax[cuda12]; JAX_PLATFORMS=cpu): every GPU form's compile and temporaries, nothing timed")
    for name, value in vars(p.parse_args(rest)).items():
        setattr(args, name, value)
    return args


def main(args) -> int:
    aot = getattr(args, "aot", None)
    gpu = aot is not None or jax.default_backend() in ("gpu", "cuda", "rocm")
    shape = getattr(args, "shape", None) or ("llama-3.1-8b" if gpu and not args.quick else "tiny")

    def given(name, default):
        value = getattr(args, name, None)
        return default if value is None else value

    layers = given("layers", 2 if args.quick else 8 if gpu else 4)
    batch = given("batch", 1)
    repeats = given("repeats", 2 if args.quick else 20)
    if layers < 1 or batch < 1 or repeats < 1:
        raise SystemExit("--layers, --batch and --repeats: at least 1")
    rows = run(shape, layers, batch, repeats, aot=aot)
    hidden, inter = SHAPES[shape]
    table = []
    for r in rows:
        if r["error"] is not None:
            table.append([r["form"], "compile failed", "", "", "", "", "", r["error"]])
            continue
        temp = "?" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 1e6:.1f} ({r['temp_over_layer_weight']:.2f})"
        timed = ([f"{r['step_ms']:.3f}", f"{r['weight_gb_per_s']:.0f}", f"{r['vs_per_layer']:.2f}",
                  "yes" if r["same_output"] else f"NO ({r['max_diff']:.3g})"] if aot is None else ["", "", "", ""])
        table.append([r["form"], f"{r['compile_s']:.2f}", temp, *timed, ""])
    where = f"compiled for {aot} without one (nothing timed)" if aot else f"best of {repeats}"
    print_table(f"stacked weights under a scan vs a parameter per layer: {layers} gated MLPs at {shape} shapes "
                f"(hidden {hidden}, intermediate {inter}), batch {batch}, bf16, {where} on {machine_description()}",
                ["form", "compile s", "temporaries MB (x one layer's weights)", "step ms", "weights GB/s",
                 "vs per layer", "same output", "error"], table)
    print("\nA temporary of about one layer's weights (x 1.0) is the row copied before its matmul; a scan form "
          "at about 1.0x 'per layer' reads its weights once.")
    if getattr(args, "json", False):
        print_json({"benchmark": "scan_copy", "shape": shape, "layers": layers, "batch": batch, "aot": aot,
                    "machine": machine_description(), "results": rows})
    return 0
