"""The second table of ``python -m jaxkv.bench prefix``: prefix-cache hit rate
per model family, on the engine, against the ideal.

Three tiny random-weight models, one per cache shape: a Llama (paged pool,
16-token pages), a Qwen3-Next (paged full-attention group with 16-token
pages plus Gated DeltaNet state snapshots) and a DeepSeek-V4 (SWA ring,
CSA/HCA compressed blocks of 128 tokens, ring snapshots). Two workloads,
``numpy.random.default_rng(0)``:

* **shared system prompt**: 3 system prompts of 300 tokens, each request
  one of them plus a 10..40-token question, 8 new tokens; arriving two per
  scheduler step;
* **multi-turn**: 3 conversations of 4 turns; turn ``k`` sends the whole
  conversation so far (previous prompts and answers) plus 20..40 new
  tokens, 16 new tokens each.

Under pressure: blocks for about two full-length requests per group and 8
cached snapshots (hybrid models), so cached prefixes are evicted.

"ideal" is what a cache of unlimited size at token granularity would serve:
for each request the longest prefix (at most ``len - 1`` tokens) it shares
with any earlier request's prompt and output, in the order served.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxkv.nn.packed import cache_kind
from jaxkv.serve import Engine

__all__ = ["family_hit_rows", "ideal_hits"]


def family_models() -> dict:
    """The tiny random models of this benchmark, one per family, by name (also `bench serve`'s hybrid model)."""
    from jaxkv.nn import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3NextForCausalLM
    from jaxkv.nn.deepseek_v4_config import DeepseekV4Config
    from jaxkv.nn.qwen3_next_config import Qwen3NextConfig

    vocab = 512
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32), rngs=nnx.Rngs(0))
    qwen = Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(dict(
        model_type="qwen3_next", vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])), rngs=nnx.Rngs(0))
    dsv4 = DeepseekV4ForCausalLM(DeepseekV4Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, moe_intermediate_size=32,
        head_dim=128, partial_rotary_factor=0.5, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
        o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=64, index_topk=8, sliding_window=64,
        compress_rates=(4, 16), layer_types=("sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"),
        mlp_layer_types=("hash_moe", "moe", "moe")), rngs=nnx.Rngs(0))
    return {"llama (paged)": llama, "qwen3-next (GDN snapshots)": qwen, "deepseek-v4 (ring snapshots)": dsv4}


def _system_prompt_workload(rng, vocab: int):
    systems = [rng.integers(1, vocab, 300).tolist() for _ in range(3)]
    count = 24
    return [[(systems[int(rng.integers(3))] + rng.integers(1, vocab, int(rng.integers(10, 41))).tolist(), 8, i // 2)
             for i in range(count)]]


def ideal_hits(served: list[tuple[list, list]]) -> int:
    """Tokens a cache of unlimited size at token granularity would serve:
    for each ``(prompt, output)`` in order, the longest prefix (at most
    ``len(prompt) - 1``) shared with an earlier prompt + output."""
    total, seen = 0, []
    for prompt, output in served:
        best = 0
        for earlier in seen:
            n = min(len(earlier), len(prompt) - 1)
            mismatch = np.flatnonzero(np.asarray(earlier[:n]) != np.asarray(prompt[:n]))
            best = max(best, int(mismatch[0]) if mismatch.size else n)
        total += best
        seen.append(prompt + output)
    return total


def _engine(model, max_seqs: int, context: int):
    if cache_kind(model) == "hybrid":
        probe = Engine(model, max_seqs=1, max_context_tokens=context, prefix_cache=False)
        blocks = {name: int(2 * b) + 1 for name, b in zip(probe.cache.groups, probe.cache.blocks_for(context))}
        return Engine(model, max_seqs=max_seqs, max_context_tokens=context, num_blocks=blocks, num_snapshots=8,
                      decode_chunk=8, prefill_chunk=128)
    pages = 2 * (context // 16) + 1
    return Engine(model, num_pages=pages, page_size=16, max_seqs=max_seqs, max_blocks_per_seq=context // 16,
                  decode_chunk=8, prefill_chunk=128)


def family_hit_rows() -> tuple[list, list]:
    """``(table rows, JSON records)`` of hit rate vs ideal per family and workload."""
    rows, payload = [], []
    for family, model in family_models().items():
        vocab = model.config.vocab_size
        for workload in ("shared system prompt", "multi-turn"):
            rng = np.random.default_rng(0)
            engine = _engine(model, max_seqs=4, context=1024)
            served, hit, prompt_tokens = [], 0, 0
            if workload == "shared system prompt":
                waves = _system_prompt_workload(rng, vocab)
            else:
                waves = None
                conversations = [rng.integers(1, vocab, int(rng.integers(20, 41))).tolist() for _ in range(3)]
            for turn in range(1 if waves else 4):
                wave = waves[0] if waves else [(c, 16, 0) for c in conversations]
                ids = [engine.add_request(p, n, arrival_step=engine._step + a) for p, n, a in wave]
                summary = engine.run()
                hit += summary.prefix_hit_tokens
                prompt_tokens += summary.prompt_tokens
                outputs = [engine.outputs[i] for i in ids]
                served += [(p, out) for (p, _, _), out in zip(wave, outputs)]
                if not waves:
                    conversations = [c + out + rng.integers(1, vocab, int(rng.integers(20, 41))).tolist()
                                     for c, out in zip(conversations, outputs)]
            ideal = ideal_hits(served)
            unit = engine.cache.unit
            evicted = engine.prefix_cache.stats().evicted_tokens
            rows.append([family, workload, unit, f"{hit:,} / {prompt_tokens:,}", f"{hit / prompt_tokens:.1%}",
                         f"{ideal / prompt_tokens:.1%}", f"{hit / ideal:.1%}" if ideal else "-", f"{evicted:,}"])
            payload.append({"family": family, "workload": workload, "unit_tokens": unit, "hit_tokens": hit,
                            "prompt_tokens": prompt_tokens, "ideal_tokens": ideal,
                            "hit_over_ideal": hit / ideal if ideal else None, "evicted_tokens": evicted})
    return rows, payload
