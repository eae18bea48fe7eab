"""Paged generation with a Flax model: a small random Llama, three prompts of
different lengths, all decode steps inside one jitted while_loop with KV
blocks allocated on device. Prints the tokens and the KV blocks in use.

    python examples/paged_generation.py
"""

import time

import numpy as np
from flax import nnx

from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams, generate

config = LlamaConfig.from_hf(dict(
    model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=1024, tie_word_embeddings=False))
model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
rng = np.random.default_rng(0)
prompts = [rng.integers(1, 512, size=n).tolist() for n in (7, 30, 18)]

for name, sampling in (("top-p 0.9 at T=0.8", SamplingParams(temperature=0.8, top_p=0.9)),):
    start = time.perf_counter()
    out = generate(model, prompts, 24, page_size=8, sampling=sampling, seed=0)
    seconds = time.perf_counter() - start
    print(f"{name}: {sum(map(len, out.tokens))} tokens in {seconds:.2f} s (compile included)")
    for prompt, tokens in zip(prompts, out.tokens):
        print(f"  prompt of {len(prompt):2d} tokens -> {tokens[:12]} ...")
    device = out.state.manager.device
    print(f"  KV blocks free after the loop: {int(device.num_free)} of {device.capacity} (finished sequences freed theirs)")
