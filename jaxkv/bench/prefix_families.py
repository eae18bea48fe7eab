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
  tokens, 16 new tokens each;
* **agentic**: 2 agents sharing a 200-token system prompt, each with its
  own 30-token task, 6 steps each: a step sends the context so far and
  gets a short completion (6 tokens, the "tool call"), then a 40..80-token
  tool result is appended to the context.

Under pressure: blocks for about two full-length requests per group and 8
cached snapshots (hybrid models), so cached prefixes are evicted. The
hybrid families run twice: with the default retention policy ("value") and
with plain LRU over the snapshots (``snapshot_retention="lru"``), so the
policy's gain is measured on the same trace. ``snapshot bytes``: the device
bytes of the hybrid cache's snapshot rows (the state of every layer: SWA and
compressor rings, GDN states) plus the blocks its records hold, at the end.

"ideal" is what a cache of unlimited size at token granularity would serve:
for each request the longest prefix (at most ``len - 1`` tokens) it shares
with any earlier request's prompt and output, in the order served.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
from flax import nnx

from jaxkv.nn.packed import cache_kind
from jaxkv.serve import Engine

__all__ = ["family_hit_rows", "host_tier_rows", "ideal_hits", "transfer_rows"]


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


def _agentic_workload(rng, vocab: int):
    """Per agent: its context (system prompt + task); the steps are driven by :func:`family_hit_rows`."""
    system = rng.integers(1, vocab, 200).tolist()
    return [system + rng.integers(1, vocab, 30).tolist() for _ in range(2)]


WORKLOADS = ("shared system prompt", "multi-turn", "agentic")


def _engine(model, max_seqs: int, context: int, retention: str = "value"):
    if cache_kind(model) == "hybrid":
        probe = Engine(model, max_seqs=1, max_context_tokens=context, prefix_cache=False)
        blocks = {name: int(2 * b) + 1 for name, b in zip(probe.cache.groups, probe.cache.blocks_for(context))}
        return Engine(model, max_seqs=max_seqs, max_context_tokens=context, num_blocks=blocks, num_snapshots=8,
                      decode_chunk=8, prefill_chunk=128, snapshot_retention=retention)
    pages = 2 * (context // 16) + 1
    return Engine(model, num_pages=pages, page_size=16, max_seqs=max_seqs, max_blocks_per_seq=context // 16,
                  decode_chunk=8, prefill_chunk=128)


def _release_compiled() -> None:
    """Drop JAX's compiled programs between engines: every engine here has
    its own shapes, and one process compiling dozens of them ran out of
    memory maps on the 2-core VM."""
    jax.clear_caches()
    gc.collect()


def _serve(engine, model, workload: str, rng) -> tuple[int, int, list]:
    """Run ``workload`` on ``engine``: ``(hit tokens, prompt tokens, [(prompt, output)] in order served)``."""
    vocab = model.config.vocab_size
    served, hit, prompt_tokens = [], 0, 0

    def wave(requests):
        nonlocal hit, prompt_tokens
        ids = [engine.add_request(p, n, arrival_step=engine._step + a) for p, n, a in requests]
        summary = engine.run()
        hit += summary.prefix_hit_tokens
        prompt_tokens += summary.prompt_tokens
        outputs = [engine.outputs[i] for i in ids]
        served.extend((p, out) for (p, _, _), out in zip(requests, outputs))
        return outputs

    if workload == "shared system prompt":
        wave(_system_prompt_workload(rng, vocab)[0])
    elif workload == "multi-turn":
        conversations = [rng.integers(1, vocab, int(rng.integers(20, 41))).tolist() for _ in range(3)]
        for _ in range(4):
            outputs = wave([(c, 16, 0) for c in conversations])
            conversations = [c + out + rng.integers(1, vocab, int(rng.integers(20, 41))).tolist()
                             for c, out in zip(conversations, outputs)]
    else:
        contexts = _agentic_workload(rng, vocab)
        for _ in range(6):
            outputs = wave([(c, 6, 0) for c in contexts])
            contexts = [c + out + rng.integers(1, vocab, int(rng.integers(40, 81))).tolist()
                        for c, out in zip(contexts, outputs)]
    return hit, prompt_tokens, served


def family_hit_rows() -> tuple[list, list]:
    """``(table rows, JSON records)`` of hit rate vs ideal per family, workload and retention policy."""
    rows, payload = [], []
    for family, model in family_models().items():
        hybrid = cache_kind(model) == "hybrid"
        for workload in WORKLOADS:
            for retention in ("value", "lru") if hybrid else ("-",):
                rng = np.random.default_rng(0)
                engine = _engine(model, max_seqs=4, context=1024, **({"retention": retention} if hybrid else {}))
                hit, prompt_tokens, served = _serve(engine, model, workload, rng)
                ideal = ideal_hits(served)
                unit = engine.cache.unit
                evicted = engine.prefix_cache.stats().evicted_tokens
                snapshot_bytes = _snapshot_bytes(engine) if hybrid else 0
                _release_compiled()
                rows.append([family, workload, retention, unit, f"{hit:,} / {prompt_tokens:,}",
                             f"{hit / prompt_tokens:.1%}", f"{ideal / prompt_tokens:.1%}",
                             f"{hit / ideal:.1%}" if ideal else "-", f"{evicted:,}",
                             f"{snapshot_bytes / 1024:,.0f} KiB" if hybrid else "-"])
                payload.append({"family": family, "workload": workload, "retention": retention, "unit_tokens": unit,
                                "hit_tokens": hit, "prompt_tokens": prompt_tokens, "ideal_tokens": ideal,
                                "hit_over_ideal": hit / ideal if ideal else None, "evicted_tokens": evicted,
                                "snapshot_bytes": snapshot_bytes})
    return rows, payload


def _snapshot_bytes(engine) -> int:
    """Device bytes the hybrid prefix cache's snapshots hold: their state
    rows, and the blocks their records' tails hold that no page holds."""
    snapshots = engine.cache.snapshots
    total = snapshots.usage()["snapshot_bytes"]
    for g, (name, per) in enumerate(zip(engine.cache.groups, engine.cache.group_block_bytes)):
        pages = {b for ids in snapshots.pages.values() for b in ids[g]}
        tails = {b for record in snapshots.records.values() for b in record.tail[g]}
        total += len(tails - pages) * per
    return total


SMALL_DEVICE_TOKENS = 832


def _small_engine(model, context: int, host_bytes: int):
    """An engine whose device keeps :data:`SMALL_DEVICE_TOKENS` tokens per
    group (the longest request of the workloads, about 750 tokens, and
    little more; two snapshot rows for a hybrid model), with
    ``host_bytes`` of host tier for the prefix cache (0: none)."""
    host = {"host_prefix_memory": host_bytes} if host_bytes else {}
    if cache_kind(model) == "hybrid":
        probe = Engine(model, max_seqs=1, max_context_tokens=context, prefix_cache=False)
        blocks = {name: int(b) + 2 for name, b in zip(probe.cache.groups, probe.cache.blocks_for(SMALL_DEVICE_TOKENS))}
        return Engine(model, max_seqs=4, max_context_tokens=context, num_blocks=blocks, num_snapshots=2,
                      decode_chunk=8, prefill_chunk=128, **host)
    return Engine(model, num_pages=SMALL_DEVICE_TOKENS // 16 + 1, page_size=16, max_seqs=4,
                  max_blocks_per_seq=context // 16, decode_chunk=8, prefill_chunk=128, **host)


HOST_TIER_BYTES = 256 << 20


def host_tier_rows() -> tuple[list, list]:
    """``(table rows, JSON records)``: hit / ideal per family and workload
    on a device too small to keep everything (:func:`_small_engine`), without and with the host
    tier of the prefix cache (:data:`HOST_TIER_BYTES`), the tokens it
    brought back; then the tier's transfer rates per family."""
    rows, payload = [], []
    for family, model in family_models().items():
        for workload in WORKLOADS:
            figures = {}
            for host_bytes in (0, HOST_TIER_BYTES):
                engine = _small_engine(model, 1024, host_bytes)
                hit, prompt_tokens, served = _serve(engine, model, workload, np.random.default_rng(0))
                ideal = ideal_hits(served)
                stats = engine.cache.prefix_stats()
                loaded = (stats.loaded_tokens if hasattr(stats, "loaded_tokens") else
                          getattr(engine.cache, "host_loaded_tokens", 0))
                figures[bool(host_bytes)] = (hit / ideal if ideal else None, int(loaded))
                _release_compiled()
            (off, _), (on, loaded) = figures[False], figures[True]
            rows.append([family, workload, f"{off:.1%}", f"{on:.1%}", f"{loaded:,}"])
            payload.append({"family": family, "workload": workload, "hit_over_ideal_device_only": off,
                            "hit_over_ideal_with_host_tier": on, "host_loaded_tokens": loaded})
    return rows, payload


def transfer_rows(num_blocks: int = 64) -> tuple[list, list]:
    """``(table rows, JSON records)``: the host tier's transfer rate per
    family, ``num_blocks`` blocks (pages) of every group each way."""
    from jaxkv.manager.hybrid_host import read_blocks, transfer_rate, tree_nbytes
    from jaxkv.serve.paged_cache import host_tier_rate

    rows, payload = [], []
    for family, model in family_models().items():
        engine = _engine(model, max_seqs=4, context=1024)
        if cache_kind(model) == "hybrid":
            manager = engine.cache.manager
            ids = {name: np.arange(1, min(num_blocks, g.allocator.capacity) + 1) for name, g in manager.groups.items()}
            size = tree_nbytes(read_blocks(manager, ids))
            engine.cache.manager, rate = transfer_rate(manager, num_blocks)
            out = back = rate
            kind = "round trip"
        else:
            rate = host_tier_rate(engine, num_blocks)
            out, back, kind, size = rate.offload_gbps, rate.load_gbps, "each way", rate.bytes
        rows.append([family, f"{num_blocks}", f"{size / 2**20:.2f} MiB", f"{out:.2f}", f"{back:.2f}", kind])
        payload.append({"family": family, "blocks": num_blocks, "bytes": int(size), "to_host_gbps": out,
                        "to_device_gbps": back, "measured": kind})
    return rows, payload
