"""Routed experts on a mesh (``jaxkv.nn.layers.Experts`` under
``shard_map``, :func:`jaxkv.nn.sharding.place_experts`): the same output
as one device, for the module alone on meshes that split its expert axis
over ``tp``, ``expert x tp`` and ``tp`` beside ``data``, and for the whole
forward of every family with routed experts (DeepSeek-V3, DeepSeek-V4,
Qwen3-Next on ``Experts``; gpt-oss on its own ``GptOssExperts``, with biases).

The mesh cases run ``tests/experts_mesh_worker.py`` in a subprocess (eight
CPU devices). That the GPU program no longer gathers every expert's weights
is ``bench engine_aot``'s finding (docs/gpu.md): the CPU backend decomposes
a ragged dot before partitioning and never gathered them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxkv._processes import run_processes
from jaxkv.nn import AutoModelForCausalLM
from jaxkv.nn.layers import Experts
from jaxkv.nn.sharding import place_experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def _experts(model):
    from flax import nnx

    return [m for _, m in nnx.iter_graph(model) if isinstance(m, Experts)]


def test_placement_follows_the_expert_split():
    """8 routed experts: split over expert x tp, or tp alone, get a placement
    naming those axes; whole (tp=3) or without a mesh, none."""
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "dsv3/small"))
    assert all(m.placement is None for m in _experts(model))  # loaded on one device
    assert place_experts(model, AbstractMesh((2, 4), ("expert", "tp"))) == len(_experts(model)) > 0
    assert {m.placement.axes for m in _experts(model)} == {("expert", "tp")}
    place_experts(model, AbstractMesh((1, 4), ("data", "tp")))
    assert {m.placement.axes for m in _experts(model)} == {("tp",)}
    assert place_experts(model, AbstractMesh((1, 3), ("data", "tp"))) == 0
    assert place_experts(model, AbstractMesh((8, 1), ("data", "tp"))) == 0  # one tp device: nothing to split
    place_experts(model, AbstractMesh((2, 4), ("expert", "tp")))
    assert place_experts(model, None) == 0 and all(m.placement is None for m in _experts(model))


@pytest.fixture(scope="module")
def worker():
    seed = int(np.random.default_rng().integers(1 << 30))
    [(code, out, err)] = run_processes(["-m", "tests.experts_mesh_worker", "--seed", str(seed)], 1, timeout=600,
                                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert code == 0, f"seed {seed}: worker exited {code}\n{err[-4000:]}"
    return seed, json.loads(out.strip().splitlines()[-1])


def test_sharded_experts_equal_one_device(worker):
    """The module alone: equal up to the order of the k additions per token
    (float32; ``psum`` adds the devices' partial sums), also computed in
    row chunks (``in_row_chunks``, the last case)."""
    seed, result = worker
    assert result["devices"] == 8
    assert result["modules"][-1]["rows_per_chunk"] < result["modules"][-1]["copies"]  # one case in row chunks
    for case in result["modules"]:
        assert case["placement"] == [a for a in case["mesh"] if a != "data"], (seed, case)
        assert case["max_abs_diff"] <= 1e-5 * max(case["max_abs"], 1.0), (seed, case)
        assert case["shard_map"], (seed, case)


def test_sharded_moe_families_equal_one_device(worker):
    """The forward of every family on ``Experts`` (logits of 13 tokens),
    each MoE layer placed, against one device's: equal up to float32
    summation order (tensor parallelism's own all-reduces included).

    The bound is 1e-4 of the largest logit, not the module's 1e-5: the
    order's rounding is amplified through every layer, and gpt-oss (clamped
    SwiGLU, attention sinks) reaches 1.4e-5 on some draws (seed 768117123
    in CI; per-token worst over seeds 0-7 spans 4e-7 to 1.0e-5). What this
    test exists to catch, a missing all-reduce or a wrong expert shard,
    drops or doubles whole partial sums: a change of the logits' own scale."""
    seed, result = worker
    assert {case["fixture"] for case in result["families"]} == {"dsv3/small", "dsv4/small", "qwen3_next/small",
                                                                "gpt_oss/small"}
    for case in result["families"]:
        assert case["placed"] == case["moe_modules"] > 0, (seed, case)
        assert case["max_abs_diff"] <= 1e-4 * max(case["max_abs"], 1.0), (seed, case)
        assert case["shard_map"], (seed, case)
