"""Attention kernels on a mesh (``jaxkv.nn.layers.HeadPlacement``,
:func:`jaxkv.nn.sharding.place_heads`): every attention module of a
sharded model learns its heads' placement, and the Pallas kernels (interpret
mode) under ``shard_map`` give one device's greedy tokens, on a ``tp`` that
splits the KV heads (each device its own) and one that does not (every head
on every device), for a Llama (GQA) and DeepSeek-V3 (MLA: one latent head,
the query heads split). The meshes run ``tests/heads_mesh_worker.py`` in a
subprocess (eight CPU devices). That a GPU program no longer gathers the
pool around the kernels is ``bench engine_aot``'s finding (docs/gpu.md):
interpret-mode kernels are plain XLA, which the CPU partitions anyway."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from jaxkv._processes import run_processes
from jaxkv.nn import AutoModelForCausalLM
from jaxkv.nn.layers import HeadPlacement
from jaxkv.nn.sharding import place_heads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def _placements(model):
    return [node.heads_placement for _, node in nnx.iter_graph(model) if hasattr(node, "heads_placement")]


@pytest.mark.parametrize("fixture", ["parity/llama_0", "dsv3/small", "qwen3_next/small", "gpt_oss/small",
                                     "gemma3/small"])
def test_every_attention_module_learns_its_placement(fixture):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, fixture))
    assert _placements(model) and all(p is None for p in _placements(model))  # one device
    mesh = AbstractMesh((2, 4), ("data", "tp"))
    assert place_heads(model, mesh) == len(_placements(model))
    assert set(_placements(model)) == {HeadPlacement(mesh, "tp")}
    assert place_heads(model, AbstractMesh((8, 1), ("data", "tp"))) == 0  # one tp device: nothing to split
    assert place_heads(model, None) == 0 and all(p is None for p in _placements(model))


@pytest.mark.parametrize("fixture", ["parity/llama_0", "dsv3/small"])
def test_pallas_kernels_on_a_mesh_give_one_devices_tokens(fixture):
    seed = int(np.random.default_rng().integers(1 << 30))
    [(code, out, err)] = run_processes(["-m", "tests.heads_mesh_worker", fixture, "--seed", str(seed)], 1,
                                       timeout=600, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert code == 0, f"seed {seed}: worker exited {code}\n{err[-4000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["devices"] == 8
    for name, mesh in result["meshes"].items():
        assert mesh["placed"] > 0, (seed, name)
        assert mesh["tokens"] == result["single"], (seed, name)
