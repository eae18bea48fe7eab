"""Continuous batching with shared prefixes: requests arrive over time, are
admitted when blocks allow, reuse cached system prompts from the radix
prefix cache (only their own tails are prefilled), decode in multi-step
jitted chunks, finish and free.

    python examples/continuous_batching.py
"""

import numpy as np
from flax import nnx

from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.serve import Engine

config = LlamaConfig.from_hf(dict(
    model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=1024, tie_word_embeddings=True))
model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
rng = np.random.default_rng(0)
system_prompts = [rng.integers(1, 512, size=40).tolist() for _ in range(2)]

engine = Engine(model, num_pages=64, page_size=8, max_seqs=6, max_blocks_per_seq=16, decode_chunk=8)
for i in range(16):
    prompt = system_prompts[i % 2] + rng.integers(1, 512, size=rng.integers(3, 12)).tolist()
    engine.add_request(prompt, max_new_tokens=int(rng.integers(4, 16)), arrival_step=i // 4)
summary = engine.run()
print(summary)
print(f"prefix hit rate {summary.prefix_hit_rate:.0%}: cached system prompts were not prefilled again")
