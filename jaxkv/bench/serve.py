"""``python -m jaxkv.bench serve``: the engine serving a Poisson arrival
workload with shared prefixes, scheduled with token budgets against the
scheduler that prefills whole prompts at admission, in the same run.

The workload (``numpy.random.default_rng(0)``): a small random-weight Llama
(2 layers, hidden 128, the demo's model) on CPU; requests arrive at
scheduler steps drawn from a Poisson process (exponential gaps, mean 0.5
steps); each is one of four 64-token system prompts plus a 8..32-token
question, one in five with a 192..384-token document appended (the long
prompts that stall decoding when prefilled whole), and 16..32 new tokens,
sampled (temperature 0.7) with a seed per request, so every configuration
generates the same tokens.

Each configuration serves the whole workload on a fresh engine (same pool,
rows and chunk widths, so one set of compiled programs serves all: a
warm-up run compiles them first). Reported per configuration: wall time,
generated tokens/s, time to first token and inter-token latency (mean,
p50, p99, from the engine's summary), prefix hit rate, and the ratios of
TTFT p50 / ITL p99 / throughput to the whole-prompt scheduler. Figures are
the median of the repeats (interleaved, so a noisy spell hits every
configuration alike).
"""

from __future__ import annotations

import statistics

import numpy as np
from flax import nnx

from jaxkv.bench._timing import machine_description, print_json, print_table
from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams
from jaxkv.serve import Engine

__all__ = ["main", "poisson_workload"]

CONFIG = dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=2048, tie_word_embeddings=False)
ENGINE = dict(num_pages=384, page_size=16, max_seqs=8, max_blocks_per_seq=32, decode_chunk=4, prefill_chunk=256)


def poisson_workload(num_requests: int, rng) -> list[tuple[list, int, int]]:
    """``(prompt, max_new_tokens, arrival_step)`` per request (module docstring)."""
    vocab = CONFIG["vocab_size"]
    systems = [rng.integers(3, vocab, 64).tolist() for _ in range(4)]
    arrival, out = 0.0, []
    for _ in range(num_requests):
        arrival += rng.exponential(0.5)
        prompt = systems[int(rng.integers(4))] + rng.integers(3, vocab, int(rng.integers(8, 33))).tolist()
        if rng.random() < 0.2:
            prompt += rng.integers(3, vocab, int(rng.integers(192, 385))).tolist()
        out.append((prompt, int(rng.integers(16, 33)), int(arrival)))
    return out


def _serve(model, workload, budget):
    engine = Engine(model, **ENGINE, max_num_batched_tokens=budget)
    sampling = SamplingParams(temperature=0.7)
    ids = [engine.add_request(p, n, arrival_step=a, sampling=sampling, seed=i)
           for i, (p, n, a) in enumerate(workload)]
    summary = engine.run()
    return summary, [engine.outputs[i] for i in ids]


def main(args) -> int:
    num_requests = 8 if args.quick else 64
    repeats = 1 if args.quick else 3
    workload = poisson_workload(num_requests, np.random.default_rng(0))
    model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))
    configs = {"whole prompts at admission": None, "budget 512": 512, "budget 256": 256, "budget 128": 128}
    if args.quick:  # CI's smoke run: the two ends
        configs = {"whole prompts at admission": None, "budget 128": 128}
    else:  # compile every program once first (all configurations share them)
        _serve(model, workload[:4], None)
        _serve(model, workload[:4], 128)
    runs: dict[str, list] = {name: [] for name in configs}
    outputs = {}
    for _ in range(repeats):
        for name, budget in configs.items():
            summary, outputs[name] = _serve(model, workload, budget)
            runs[name].append(summary)
    same = all(out == outputs["whole prompts at admission"] for out in outputs.values())
    rows, payload = [], []
    base_tps = statistics.median(s.tokens_per_second for s in runs["whole prompts at admission"])
    base_ttft = statistics.median(s.ttft[1] for s in runs["whole prompts at admission"])
    base_itl = statistics.median(s.itl[2] for s in runs["whole prompts at admission"])
    for name, summaries in runs.items():
        def med(f):
            return statistics.median(f(s) for s in summaries)

        ttft = tuple(med(lambda s, i=i: s.ttft[i]) for i in range(3))
        itl = tuple(med(lambda s, i=i: s.itl[i]) for i in range(3))
        tps = med(lambda s: s.tokens_per_second)
        wall = med(lambda s: s.wall_seconds)
        hit = summaries[-1].prefix_hit_rate
        rows.append([name, f"{wall:.2f}", f"{tps:.0f}", "/".join(f"{1e3 * x:.0f}" for x in ttft),
                     "/".join(f"{1e3 * x:.1f}" for x in itl), f"{hit:.0%}", f"{ttft[1] / base_ttft:.2f}",
                     f"{itl[2] / base_itl:.2f}", f"{tps / base_tps:.2f}"])
        payload.append({"scheduler": name, "max_num_batched_tokens": configs[name], "wall_seconds": wall,
                        "tokens_per_second": tps, "ttft_mean_p50_p99_s": ttft, "itl_mean_p50_p99_s": itl,
                        "prefix_hit_rate": hit, "ttft_p50_ratio": ttft[1] / base_ttft,
                        "itl_p99_ratio": itl[2] / base_itl, "throughput_ratio": tps / base_tps})
    print_table(f"serving {num_requests} Poisson-arriving requests with shared prefixes, tiny Llama "
                f"(median of {repeats}) on {machine_description()}",
                ["scheduler", "wall s", "tokens/s", "TTFT ms mean/p50/p99", "ITL ms mean/p50/p99", "prefix hits",
                 "TTFT p50 / whole", "ITL p99 / whole", "tokens/s / whole"], rows)
    print(f"\nSame tokens under every scheduler (seeded requests): {same}")
    if args.json:
        print_json({"benchmark": "serve", "machine": machine_description(), "same_tokens": same, "results": payload})
    return 0 if same else 1
