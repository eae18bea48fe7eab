"""Sharding: the model's parameters and the KV pool on a (data, tp) mesh of 8
CPU devices generate exactly the tokens of a single device. Runs in a
subprocess so that only it sees 8 host devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    from flax import nnx
    from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams, generate
    from jaxkv.nn.sharding import shard_model

    assert len(jax.devices()) == 8, jax.devices()
    config = LlamaConfig.from_hf(dict(
        model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 97, size=n).tolist() for n in (5, 11, 3, 8)]
    sampling = SamplingParams(temperature=0.8, top_k=30)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    single = generate(model, prompts, 6, page_size=4, sampling=sampling, seed=1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tp"))
    shard_model(model, mesh)
    kernel = model.layers[0].self_attn.k_proj.kernel.value
    out = generate(model, prompts, 6, page_size=4, sampling=sampling, seed=1, mesh=mesh)
    print(json.dumps({
        "single": single.tokens,
        "sharded": out.tokens,
        "kernel_spec": str(kernel.sharding.spec),
        "kernel_devices": len(kernel.sharding.device_set),
        "pool_spec": str(out.state.pool.k_pages.sharding.spec),
        "pool_shard_heads": out.state.pool.k_pages.addressable_shards[0].data.shape[1],
    }))
""")


def test_sharded_generate_matches_one_device():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sharded"] == result["single"]
    assert all(len(t) == 6 for t in result["single"])
    assert "tp" in result["kernel_spec"] and result["kernel_devices"] == 8
    assert "tp" in result["pool_spec"]
    assert result["pool_shard_heads"] == 1  # 2 KV heads over a tp axis of 2
