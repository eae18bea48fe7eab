"""Parallel sampling and beam search through fork and copy-on-write: the
prompt is prefilled once, sequences share its blocks, and the partly filled
last block is copied on the first write, all inside the jitted loop.

    python examples/fork_sampling_beam.py
"""

import numpy as np
from flax import nnx

from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams, beam_search, sample_n

config = LlamaConfig.from_hf(dict(
    model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=512, tie_word_embeddings=True))
model = LlamaForCausalLM(config, rngs=nnx.Rngs(1))
prompt = np.random.default_rng(1).integers(1, 256, size=13).tolist()  # ends mid-block: CoW on fork

samples = sample_n(model, prompt, 4, 12, sampling=SamplingParams(temperature=1.0, top_k=40), seed=0, page_size=4)
print("4 samples sharing one prefill:")
for tokens in samples:
    print("  ", tokens)
print("3 beams:")
for tokens, score in beam_search(model, prompt, 3, 8, page_size=4):
    print(f"   {score:8.3f}  {tokens}")
