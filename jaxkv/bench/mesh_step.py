"""One measurement of ``python -m jaxkv.bench scaling --mesh``, run in its own
process (it must choose its CPU device count before JAX starts, and a
two-process run needs two processes): a family's decode step on a ``tp``
mesh of ``--devices`` devices, or across ``--num-processes`` processes of a
``jax.distributed`` run on localhost.

The models are random, at a small size whose heads, experts and GDN heads
all divide by 8 (``FAMILIES``: the fixture's config with these overrides),
so every device count splits the same parameters. The batch (8 prompts of
24 tokens) is the same on every mesh: the same total work.

Printed (one JSON line, process 0): microseconds per decode step inside the
jitted loop (``decode_loop``, no host round trip), per step as one jitted
call each followed by a host read (``decode_step``: the host's per-step cost
included), and the collectives the compiled step contains (counted in its
optimized HLO), per layer.

Usage: ``python -m jaxkv.bench.mesh_step FAMILY --devices N [--num-processes
K --process-id I --port P] [--steps S --repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from jaxkv._processes import add_process_arguments, join_cpu_run

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests",
                         "fixtures")
_WIDE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, intermediate_size=512)
#: family -> (fixture whose config.json is the base, overrides)
FAMILIES = {
    "llama": ("parity/llama_0", dict(_WIDE, head_dim=32)),
    "deepseek_v3": ("dsv3/small", dict(_WIDE, moe_intermediate_size=64)),
    "deepseek_v4": ("dsv4/small", dict(_WIDE, num_key_value_heads=1, index_n_heads=8, n_routed_experts=8,
                                       o_groups=8, moe_intermediate_size=64)),
    "qwen3_next": ("qwen3_next/small", dict(_WIDE, linear_num_key_heads=8, linear_num_value_heads=8, num_experts=8,
                                            moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    "gpt_oss": ("gpt_oss/small", dict(_WIDE, head_dim=32, num_local_experts=8)),
    "gemma3": ("gemma3/small", dict(_WIDE, head_dim=32)),
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
BATCH, PROMPT = 8, 24


def build_model(family: str):
    """The family's random benchmark model (``FAMILIES``)."""
    from flax import nnx

    from jaxkv import nn

    fixture, overrides = FAMILIES[family]
    with open(os.path.join(_FIXTURES, fixture, "config.json")) as f:
        config = dict(json.load(f), **overrides)
    model_cls, config_cls = {
        "llama": (nn.LlamaForCausalLM, nn.LlamaConfig), "deepseek_v3": (nn.DeepseekV3ForCausalLM, nn.DeepseekV3Config),
        "deepseek_v4": (nn.DeepseekV4ForCausalLM, nn.DeepseekV4Config),
        "qwen3_next": (nn.Qwen3NextForCausalLM, nn.Qwen3NextConfig), "gpt_oss": (nn.GptOssForCausalLM, nn.GptOssConfig),
        "gemma3": (nn.Gemma3ForCausalLM, nn.Gemma3Config)}[family]
    return model_cls(config_cls.from_hf(config), rngs=nnx.Rngs(0))


def count_collectives(hlo: str) -> dict:
    """How many of each collective the optimized HLO text calls (async
    pairs counted once, by their ``-start``)."""
    counts = {}
    for name in COLLECTIVES:
        counts[name] = len(re.findall(rf"= \S+ {name}(-start)?\(", hlo))
    return counts


def _args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("family", choices=sorted(FAMILIES))
    add_process_arguments(parser)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _args(argv)
    join_cpu_run(args.devices, args.num_processes, args.process_id, args.port)
    import jax
    import numpy as np

    from jaxkv.nn.generate import decode_loop, decode_step, start_hybrid, start_paged
    from jaxkv.nn.packed import cache_kind
    from jaxkv.nn.sampling import GREEDY
    from jaxkv.nn.scan import DecoderStack

    model = build_model(args.family)
    total = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, total), ("data", "tp")) if total > 1 else None
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, model.config.vocab_size, size=(BATCH, PROMPT)).tolist()
    max_new = 2 * args.steps + 2  # never finishes inside a timed run
    start = start_hybrid if cache_kind(model) == "hybrid" else start_paged

    def fresh():
        return start(model, prompts, max_new, mesh=mesh)[2]

    graphdef, params, state = start(model, prompts, max_new, mesh=mesh)
    hlo = decode_step.lower(graphdef, params, state, GREEDY).compile().as_text()
    collectives = count_collectives(hlo)

    def loop(state):
        return decode_loop(graphdef, params, state, GREEDY, num_steps=args.steps)

    def stepwise(state):
        for _ in range(args.steps):
            state = decode_step(graphdef, params, state, GREEDY)
            bool(state.ok)  # the host reads a flag every step, as generate(per_step=True) does
        return state

    times = {}
    for name, fn in (("loop", loop), ("per_step", stepwise)):
        jax.block_until_ready(fn(fresh()))  # compile
        best = float("inf")
        for _ in range(args.repeats):
            state = fresh()
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(state))
            best = min(best, time.perf_counter() - t0)
        times[name] = best / args.steps * 1e6
    layers = model.config.num_hidden_layers
    # The layers the program holds: a scanned stack (jaxkv.nn.scan) holds one layer per run of its pattern, in
    # the loop body, and its head and tail outside; each of them runs its collectives once per layer it stands for.
    stack = model.layers
    in_program = stack.layers_in_program if isinstance(stack, DecoderStack) else layers
    if jax.process_index() == 0:
        print(json.dumps({"family": args.family, "devices": total, "processes": jax.process_count(),
                          "us_loop": times["loop"], "us_per_step": times["per_step"], "layers": layers,
                          "collectives": collectives,
                          "all_reduce_per_layer": collectives["all-reduce"] / in_program}), flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
