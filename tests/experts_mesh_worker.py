"""One process of ``tests/test_experts_mesh.py``, run as a script so it sees
its own eight CPU devices: the routed experts (``jaxkv.nn.layers.Experts``)
on meshes that split their expert axis, against one device, and whether the
program runs them under ``shard_map``. Prints one JSON line.

Usage: ``python -m tests.experts_mesh_worker --seed S``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxkv._processes import join_cpu_run

#: (mesh shape, axis names, experts): tp alone, expert x tp, data x tp.
MESHES = (((8,), ("tp",), 16), ((2, 4), ("expert", "tp"), 16), ((2, 4), ("data", "tp"), 8),
          ((4, 2), ("data", "tp"), 6))
#: The fixtures with routed experts (``Experts``; gpt-oss's ``GptOssExperts``),
#: and the ``data x tp`` mesh whose ``tp`` divides their expert count (dsv3:
#: 8, dsv4: 4, qwen3_next: 6, gpt_oss: 4).
FAMILIES = (("dsv3/small", (1, 8)), ("dsv3/small", (4, 2)), ("dsv4/small", (2, 4)), ("qwen3_next/small", (4, 2)),
            ("gpt_oss/small", (2, 4)))


def runs_shard_map(lowered) -> bool:
    """Whether a lowered program holds a ``shard_map`` (manual) region."""
    text = lowered.as_text()
    return "manual_computation" in text or "shard_map" in text


def _axes(module):
    return None if module.placement is None else list(module.placement.axes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    join_cpu_run(8)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.nn import layers
    from jaxkv.nn.layers import Experts
    from jaxkv.nn.sharding import shard_model

    rng = np.random.default_rng(args.seed)
    default_budget = layers.MASKED_ELEMENTS
    out = {"devices": len(jax.devices()), "modules": [], "families": []}

    for (shape, names, e), budget in [(case, None) for case in MESHES] + [(MESHES[0], 16 * 2 * 32)]:
        layers.MASKED_ELEMENTS = budget or default_budget  # the last case: chunks of 16 rows (in_row_chunks)
        d, i, n, k = 32, 24, 37, 3
        routed = jax.jit(lambda graphdef, state, x, experts, weights: nnx.merge(graphdef, state).experts(
            x, experts, weights))  # traced anew for each case (the chunk size is read when tracing)
        holder = nnx.Dict(experts=Experts(e, d, i, rngs=nnx.Rngs(int(rng.integers(1 << 20))), limit=7.0))
        x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
        chosen = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
        weights = jnp.asarray(rng.random((n, k)), jnp.float32)
        single = np.asarray(routed(*nnx.split(holder), x, chosen, weights))
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        shard_model(holder, mesh)
        graphdef, state = nnx.split(holder)
        sharded = np.asarray(routed(graphdef, state, x, chosen, weights))
        out["modules"].append({
            "mesh": dict(zip(names, shape)), "experts": e, "placement": _axes(holder["experts"]),
            "rows_per_chunk": layers.rows_per_chunk(e // int(np.prod([mesh.shape[a] for a in names if a != "data"])),
                                                    max(d, i)), "copies": n * k,
            "max_abs_diff": float(np.max(np.abs(sharded - single))), "max_abs": float(np.max(np.abs(single))),
            "shard_map": runs_shard_map(routed.lower(graphdef, state, x, chosen, weights))})

    layers.MASKED_ELEMENTS = default_budget
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    for fixture, shape in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, fixture))
        tokens = jnp.asarray(rng.integers(1, model.config.vocab_size, size=(1, 13)), jnp.int32)
        forward = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state).forward_dense(tokens))
        single = np.asarray(forward(*nnx.split(model), tokens))
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "tp"))
        shard_model(model, mesh)
        graphdef, state = nnx.split(model)
        sharded = np.asarray(forward(graphdef, state, tokens))
        experts = [m for _, m in nnx.iter_graph(model)
                   if isinstance(m, nnx.Module) and hasattr(m, "placement") and hasattr(m, "gate_up_proj")]
        out["families"].append({
            "fixture": fixture, "mesh": dict(zip(("data", "tp"), shape)), "moe_modules": len(experts),
            "placed": sum(m.placement is not None for m in experts),
            "max_abs_diff": float(np.max(np.abs(sharded - single))), "max_abs": float(np.max(np.abs(single))),
            "shard_map": runs_shard_map(forward.lower(graphdef, state, tokens))})
        jax.clear_caches()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
