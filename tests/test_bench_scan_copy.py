"""``bench scan_copy`` (:mod:`jaxkv.bench.scan_copy`): whether a stacked
layer's weight is copied before its matmul, the question that keeps a GPU
model's layers unrolled. Here: its forms compute the gated MLP stack a
float64 numpy loop computes, on weights drawn fresh; the scan and the
parameter per layer give the same output; and compiled for H100 without a
GPU (``aot``), the scan's temporaries hold a copy of a layer's matrix that
the parameter per layer does not have."""

from __future__ import annotations

import json

import jax
import numpy as np

from jaxkv.bench.__main__ import main
from jaxkv.bench.scan_copy import _arguments, per_layer, run, scanned


def _reference(stacked, x) -> np.ndarray:
    gate, up, down = (np.asarray(w, np.float64) for w in stacked)
    h = np.asarray(x, np.float64)
    for i in range(gate.shape[0]):
        a = h @ gate[i]
        h = (a / (1 + np.exp(-a)) * (h @ up[i])) @ down[i]
    return h


def test_both_forms_compute_the_mlp_stack():
    seed = int(np.random.default_rng().integers(2**31))
    stacked, weights, x = _arguments("tiny", 3, 2, seed)
    want = _reference(stacked, x)
    scale = np.abs(want).max()
    for fn, w in ((per_layer, weights), (scanned, stacked)):
        got = np.asarray(jax.jit(fn)(w, x), np.float64)
        # bf16 activations between the matmuls: about 3 significant digits per layer
        assert np.abs(got - want).max() <= 0.05 * scale, (fn.__name__, seed)


def test_the_bench_runs_both_forms_on_a_cpu(capsys):
    assert main(["scan_copy", "--quick", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["form"]: r for r in payload["results"]}
    assert set(rows) == {"per layer", "scan"} and payload["shape"] == "tiny"
    for r in rows.values():
        assert r["error"] is None and r["same_output"] and r["step_ms"] > 0 and r["compile_s"] > 0
    assert rows["per layer"]["vs_per_layer"] == 1.0


def test_aot_the_scan_copies_a_layer_matrix_the_parameter_per_layer_does_not():
    """At Llama-3.1-8B's MLP shapes for H100: one of the layer's three
    matrices (a third of its weights) is a temporary of the scan, under
    every option tried that compiles, and none of the parameter per layer
    (docs/gpu.md: why a GPU model keeps a parameter per layer)."""
    rows = {r["form"]: r for r in run("llama-3.1-8b", 2, 1, 1, aot="h100")}
    assert rows["per layer"]["error"] is None and rows["per layer"]["temp_over_layer_weight"] < 0.01
    scans = [r for name, r in rows.items() if name.startswith("scan") and r["error"] is None]
    assert rows["scan"] in scans
    for r in scans:
        assert r["temp_over_layer_weight"] >= 1 / 3 - 0.01, r
    assert all(r["error"] is None or r["error"].strip() for r in rows.values())
