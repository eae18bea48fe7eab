"""Preemption under memory pressure: a KV pool far too small for the
running requests. When a decode step cannot get a block, the engine evicts
cached prefixes, then preempts the most recently admitted request: swapped
to host memory (first run) or freed and recomputed later (second run). Every
request still gets exactly the tokens it would get alone.

    python examples/swap_under_pressure.py
"""

import numpy as np
from flax import nnx

from jaxkv.nn import LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine

config = LlamaConfig.from_hf(dict(
    model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=512, tie_word_embeddings=False))
model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
rng = np.random.default_rng(1)
prompts = [rng.integers(1, 256, size=10).tolist() for _ in range(4)]
MAX_NEW = 12
alone = [generate(model, [p], MAX_NEW, page_size=4).tokens[0] for p in prompts]

for host_pages, how in ((32, "swap to host"), (0, "recompute")):
    engine = Engine(model, num_pages=10, page_size=4, max_seqs=4, max_blocks_per_seq=8, decode_chunk=4,
                    num_host_pages=host_pages, host_memory_kind="numpy")
    ids = [engine.add_request(p, MAX_NEW) for p in prompts]
    summary = engine.run()
    same = all(engine.outputs[rid] == ref for rid, ref in zip(ids, alone))
    print(f"{how}: {summary.swap_preemptions} swaps, {summary.recompute_preemptions} recomputes, "
          f"peak {summary.peak_kv_blocks}/{summary.kv_blocks} blocks; outputs equal to running alone: {same}")
    assert same
