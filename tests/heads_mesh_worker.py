"""One process of ``tests/test_heads_mesh.py``, run as a script so it sees
eight CPU devices: a fixture's greedy tokens through the Pallas kernels
(interpret mode) on one device, then on ``data x tp`` meshes whose ``tp``
splits the KV heads (each device its own heads under ``shard_map``) or does
not (every head on every device), printed as one JSON line.

Usage: ``python -m tests.heads_mesh_worker FIXTURE --seed S``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxkv._processes import join_cpu_run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("fixture")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    join_cpu_run(8)
    import jax
    import numpy as np
    from flax import nnx

    from jaxkv.nn import AutoModelForCausalLM, generate
    from jaxkv.nn.layers import HeadPlacement

    path = os.path.join(os.path.dirname(__file__), "fixtures", args.fixture)

    def load():
        return AutoModelForCausalLM.from_pretrained(path, implementation="pallas", interpret=True)

    model = load()
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, model.config.vocab_size, size=int(n)).tolist() for n in rng.integers(3, 20, size=3)]
    result = {"devices": len(jax.devices()), "kv_heads": int(model.config.num_key_value_heads),
              "single": generate(model, prompts, 5).tokens, "meshes": {}}
    for data, tp in ((4, 2), (1, 8)):
        model = load()
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(data, tp), ("data", "tp"))
        tokens = generate(model, prompts, 5, mesh=mesh).tokens
        placed = sum(1 for _, node in nnx.iter_graph(model)
                     if isinstance(getattr(node, "heads_placement", None), HeadPlacement))
        result["meshes"][f"{data}x{tp}"] = {"tokens": tokens, "placed": placed}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
