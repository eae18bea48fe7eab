"""One process of a mesh test (``tests/test_mesh.py``), run as a script so it
sees its own CPU devices: every family's fixture generates on one device,
then on a mesh (``--mesh 4x2``: data x tp), through ``generate`` and the
``Engine``, and the tokens of both are printed as one JSON line. With
``--num-processes`` it joins a ``jax.distributed`` run on localhost first
(CPU collectives over gloo): every process runs this same code, the single
device reference on its own first device.

Usage: ``python -m tests.mesh_worker FIXTURE --mesh DxT --devices N
[--num-processes K --process-id I --port P] --seed S [--paths generate,engine]
[--speculative JSON]`` (``--speculative``: both engines speculate; the
speculative drafts verified and kept are printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxkv._processes import add_process_arguments, join_cpu_run


def _args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("fixture")
    parser.add_argument("--mesh", default="4x2")
    add_process_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", default="generate,engine")
    parser.add_argument("--speculative", default=None, help="the engine's speculative config (JSON)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _args(argv)
    join_cpu_run(args.devices, args.num_processes, args.process_id, args.port)
    import jax
    import numpy as np
    from flax import nnx

    from jaxkv.nn import AutoModelForCausalLM, SamplingParams, generate
    from jaxkv.nn.packed import cache_kind
    from jaxkv.serve import Engine

    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    model = AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, args.fixture))
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, size=int(n)).tolist() for n in rng.integers(3, 20, size=4)]
    # Speculating: each prompt twice, and longer outputs decoded in chunks after the prompts' packed steps. An n-gram
    # draft needs the last token seen before, so drafts are chance, not certain: with 6-9 new tokens (most of them
    # decoded in packed steps, which have no verify lanes on a hybrid cache) 5 of 30 seeds drew none on Qwen3-Next's
    # fixture; with 28-31, at least 8 in each of 40 seeds (15 on average).
    if args.speculative:
        prompts = [p + p for p in prompts]
    new_tokens, max_model_len = (28, 80) if args.speculative else (6, 48)
    sampling = SamplingParams(temperature=0.8, top_k=30)
    paths = args.paths.split(",")

    def run_engine(mesh):
        engine = Engine(model, max_seqs=4, max_model_len=max_model_len, prefill_chunk=16, decode_chunk=4, mesh=mesh,
                        speculative=args.speculative)
        ids = [engine.add_request(p, new_tokens + i, **({"sampling": sampling} if i % 2 else {}))
               for i, p in enumerate(prompts)]
        # the second round hits the first round's prefixes
        engine.run()
        ids += [engine.add_request(p[: len(p) - 1] + [1], 3) for p in prompts[:2]]
        engine.run()
        if mesh is not None:  # cache leaves the mesh splits (an MLA latent pool has none), and where they are
            from jaxkv.nn.sharding import cache_sharding

            cache = engine.cache.pool if engine.cache.pool is not None else engine.cache.manager
            leaves, planned = jax.tree.leaves(cache), jax.tree.leaves(cache_sharding(cache, mesh))
            split_cache.append(sum(1 for x in leaves if not x.sharding.is_fully_replicated))
            # after serving, every leaf still where cache_sharding puts it (a step's output is not re-split)
            as_planned.append(all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, planned)))
            planned_split.append(sum(1 for s in planned if not s.is_fully_replicated))
            draft = None if engine.speculation is None else engine.speculation.draft
            if getattr(draft, "pool", None) is not None:  # a separate draft's own cache, placed as planned
                leaves, planned = jax.tree.leaves(draft.pool), jax.tree.leaves(cache_sharding(draft.pool, mesh))
                draft_split.append([sum(1 for x in leaves if not x.sharding.is_fully_replicated),
                                    all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, planned))])
        stats = engine.stats()
        drafts.append([stats.spec_draft_tokens, stats.spec_accepted_tokens])
        return [engine.outputs[i] for i in ids]

    single, sharded, split_cache, as_planned, planned_split, drafts, draft_split = {}, {}, [], [], [], [], []
    if "generate" in paths:
        single["generate"] = generate(model, prompts, 6, sampling=sampling, seed=1).tokens
    if "engine" in paths:
        single["engine"] = run_engine(None)
    a, b = (int(x) for x in args.mesh.split("x"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(a, b), ("data", "tp"))
    if "generate" in paths:
        sharded["generate"] = generate(model, prompts, 6, sampling=sampling, seed=1, mesh=mesh).tokens
    if "engine" in paths:
        sharded["engine"] = run_engine(mesh)
    leaves = jax.tree.leaves(nnx.state(model))
    print(json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
        "kind": cache_kind(model), "single": single, "sharded": sharded,
        "split_params": sum(1 for x in leaves if not x.sharding.is_fully_replicated),
        "params": len(leaves), "split_cache": split_cache, "cache_as_planned": as_planned,
        "planned_split": planned_split, "drafts": drafts, "draft_split": draft_split,
    }), flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
