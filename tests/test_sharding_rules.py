"""Placement rules of ``jaxkv.nn.sharding`` (no compile: abstract meshes and
shapes) and the errors a mesh user gets. That sharded runs give one
device's tokens is tests/test_mesh.py's job."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.nn.sharding import placement_report, shard_model
from jaxkv.serve import Engine
from jaxkv.serve.__main__ import tensor_parallel_mesh

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def dsv3():
    return AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "dsv3/small"))


def test_experts_split_over_expert_times_tp_or_the_axis_that_divides(dsv3):
    """8 routed experts: over expert x tp on a 2 x 4 mesh (one expert per
    device), over tp alone without an expert axis, whole when neither divides."""
    name = next(n for n in placement_report(dsv3, AbstractMesh((2, 4), ("expert", "tp")))["split"]
                if n.endswith("experts/gate_up_proj"))
    lead = (None,) if "/stacked/" in name else ()  # the MoE layers run under a scan: their layer axis stays whole
    assert placement_report(dsv3, AbstractMesh((2, 4), ("expert", "tp")))["split"][name] == lead + (
        ("expert", "tp"), None, None)
    assert placement_report(dsv3, AbstractMesh((1, 4), ("data", "tp")))["split"][name] == lead + ("tp", None, None)
    assert name in placement_report(dsv3, AbstractMesh((1, 3), ("data", "tp")))["replicated"]


def test_bytes_per_device_counts_each_split_once(dsv3):
    """The report's per-device bytes against a count from the shapes: every
    leaf's bytes divided by the devices its spec splits it over."""
    mesh = AbstractMesh((2, 4), ("expert", "tp"))
    report = placement_report(dsv3, mesh)
    from flax import nnx

    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(dsv3))
    expected = 0
    for path, leaf in leaves:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        name = name.replace("/value", "")
        spec = report["split"].get(name, ())
        parts = 1
        for entry in spec:
            for axis in ((entry,) if isinstance(entry, str) else (entry or ())):
                parts *= mesh.shape[axis]
        expected += leaf.size * leaf.dtype.itemsize // parts
    assert report["bytes_per_device"] == expected
    assert report["bytes_per_device"] < sum(x.size * x.dtype.itemsize for _, x in leaves)
    # attention heads split over tp, the latent projection kept whole
    assert any(n.endswith("self_attn/q_b_proj/weight") for n in report["split"])
    assert any(n.endswith("self_attn/kv_a_proj_with_mqa/weight") for n in report["replicated"])


def _tiny_llama():
    from flax import nnx

    config = LlamaConfig.from_hf(dict(
        model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=False))
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def test_mesh_errors_name_what_to_change():
    model = _tiny_llama()
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tp"))
    with pytest.raises(InvalidArgument, match="host tier is not available on a mesh"):
        Engine(model, mesh=one, max_seqs=2, num_pages=8, num_host_pages=4)
    with pytest.raises(InvalidArgument, match="must be a jax.sharding.Mesh"):
        shard_model(model, "tp")
    with pytest.raises(InvalidArgument, match="neither a 'tp' nor a 'data' axis"):
        shard_model(model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",)))
    with pytest.raises(InvalidArgument, match=r"--tensor-parallel-size 64: this host has \d+"):
        tensor_parallel_mesh(64)
