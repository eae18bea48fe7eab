"""What scrub-on-free costs (``Engine(scrub_on_free=True)``,
:mod:`jaxkv.pool.scrub`): the second part of ``python -m jaxkv.bench
isolation``.

* **One freeing call**: a row takes 1, 16 or 256 pages of a pool of
  ``POOL_PAGES`` and retires (``BlockSpaceManager.retire``, the call that
  frees a finished request's pages), in one jitted call, with and without
  the scrub (as the engine's scrubbed retire call does it), timed interleaved in the
  same run. The scrub writes the freed pages' zeros: its extra time grows
  with the pages freed, not with the pool (on a GPU; XLA's CPU backend may
  copy a whole array around a scatter).
* **Serving**: the same seeded workload (shared prefixes, so the prefix
  cache evicts and rows free blocks every few steps) through an engine
  with and without the option, tiny Llama (paged) and tiny Qwen3-Next
  (hybrid: GDN states and full-attention pages), best wall time of the
  repeats, interleaved; tokens must be identical.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.bench._timing import best_seconds_interleaved
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.pool.scrub import freed_blocks, scrub_kv_pool
from jaxkv.serve import Engine

__all__ = ["call_rows", "serving_rows"]

POOL_PAGES = 2048
PAGE_SIZE = 16


@partial(jax.jit, static_argnames=("pages", "scrub"), donate_argnums=(0, 1))
def _cycle(manager: BlockSpaceManager, pool, *, pages: int, scrub: bool):
    """Row 0 takes ``pages`` pages, then retires (frees them), with or
    without the scrub: the paged cache's freeing call, in a loop that can
    repeat (both variants donate and return the pool)."""
    manager, _ = manager.allocate(jnp.zeros((1,), jnp.int32), jnp.full((1,), pages * manager.block_size, jnp.int32))
    ids = (jnp.full((1,), -1, jnp.int32), jnp.zeros((1,), jnp.int32), jnp.full((1,), -1, jnp.int32))
    retired, _ = manager.retire(*ids)
    if scrub:  # what the engine's scrubbed retire call adds (jaxkv.serve.paged_cache)
        pool = scrub_kv_pool(pool, freed_blocks(manager.device, retired.device))
    return retired, pool


def call_rows(repeats: int, quick: bool) -> list[dict]:
    """Time of an allocate-and-retire call with and without the scrub, per
    pages freed, on a pool of ``POOL_PAGES`` pages."""
    config = LlamaConfig.from_hf(dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4 if quick else 8, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=32, max_position_embeddings=4096))
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rows = []
    for pages in (1, 16, 256):
        state = {}
        for scrub in (False, True):
            state[scrub] = (BlockSpaceManager.create(num_device_blocks=POOL_PAGES, num_host_blocks=2,
                                                     block_size=PAGE_SIZE, max_seqs=1, max_blocks_per_seq=pages,
                                                     watermark=0.0), model.make_pool(POOL_PAGES, PAGE_SIZE))
        pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state[False][1]))

        def run(scrub: bool, pages=pages, state=state):
            state[scrub] = _cycle(*state[scrub], pages=pages, scrub=scrub)
            return state[scrub]

        times = best_seconds_interleaved({"plain": lambda: run(False), "scrub": lambda: run(True)}, repeats)
        rows.append({"pages_freed": pages, "pool_pages": POOL_PAGES, "pool_mb": pool_bytes / 1e6,
                     "plain_us": 1e6 * times["plain"], "scrub_us": 1e6 * times["scrub"],
                     "extra_us": 1e6 * max(times["scrub"] - times["plain"], 0.0),
                     "zeroed_mb": pages * pool_bytes / POOL_PAGES / 1e6})
    return rows


def _workload(rng, vocab: int, count: int) -> list[list[int]]:
    systems = [rng.integers(1, vocab, 48).tolist() for _ in range(3)]
    return [systems[i % 3] + rng.integers(1, vocab, int(rng.integers(4, 24))).tolist() for i in range(count)]


def serving_rows(repeats: int, quick: bool) -> list[dict]:
    """Engine wall time and tokens with and without the option."""
    from jaxkv.bench.prefix_families import family_models

    models = family_models()
    cases = {"llama (paged)": (models["llama (paged)"], dict(num_pages=48, page_size=8, max_blocks_per_seq=16)),
             "qwen3-next (hybrid)": (models["qwen3-next (GDN snapshots)"],
                                     dict(max_context_tokens=128, num_blocks={"full": 32}, num_snapshots=4))}
    rows = []
    count = 8 if quick else 24
    for name, (model, options) in cases.items():
        prompts = _workload(np.random.default_rng(0), model.config.vocab_size, count)
        outputs = {}

        def serve(scrub: bool, model=model, options=options, prompts=prompts):
            engine = Engine(model, max_seqs=4, decode_chunk=4, prefill_chunk=64, scrub_on_free=scrub, **options)
            ids = [engine.add_request(p, 8) for p in prompts]
            engine.run()
            outputs[scrub] = [engine.outputs[i] for i in ids]

        serve(False)  # compiles both programs' shared parts; each is warmed below
        serve(True)
        times = best_seconds_interleaved({"off": lambda: serve(False), "on": lambda: serve(True)}, repeats)
        if outputs[True] != outputs[False]:
            raise AssertionError(f"{name}: scrub_on_free changed the tokens")
        rows.append({"model": name, "requests": count, "off_s": times["off"], "on_s": times["on"],
                     "ratio": times["on"] / times["off"], "same_tokens": True})
    return rows
