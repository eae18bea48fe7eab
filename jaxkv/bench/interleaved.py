"""Rows of ``python -m jaxkv.bench hybrid`` for the interleaved sliding-window
families (gpt-oss, Gemma 3): KV memory per request at real sizes, window
rings against one table for all layers, from ``jax.eval_shape`` of the
caches :func:`jaxkv.nn.window_cache.interleaved_cache` builds (nothing is
allocated).

Shapes are the published configurations (``config.json`` of each
checkpoint): gpt-oss-20b 24 layers and gpt-oss-120b 36 layers, both 64 query
/ 8 KV heads of 64 dims, every other layer a window of 128; Gemma 3 4B 34
layers of 8 / 4 heads of 256 dims and Gemma 3 27B 62 layers of 32 / 16 heads
of 128 dims, five window layers of 1024 to one global. bf16 K/V.

A request's bytes are ``bytes(cache of 2 requests) - bytes(cache of 1)`` at
the same context (its blocks, table rows and rings); ``ratio`` is ring /
paged (target for gpt-oss at 32k: <= 0.55).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.nn.window_cache import interleaved_cache

__all__ = ["FAMILIES", "Family", "memory_rows", "step_rows"]

CONTEXTS = (8192, 32768, 131072)
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    sliding: tuple[bool, ...]
    heads: int
    kv_heads: int
    head_dim: int
    window: int


def _every_other(layers: int) -> tuple[bool, ...]:
    return tuple(i % 2 == 0 for i in range(layers))  # gpt-oss: layer 0 is a window layer


def _five_to_one(layers: int) -> tuple[bool, ...]:
    return tuple((i + 1) % 6 != 0 for i in range(layers))  # Gemma 3: every sixth layer is global


FAMILIES = (
    Family("gpt-oss-20b", _every_other(24), 64, 8, 64, 128),
    Family("gpt-oss-120b", _every_other(36), 64, 8, 64, 128),
    Family("Gemma 3 4B", _five_to_one(34), 8, 4, 256, 1024),
    Family("Gemma 3 27B", _five_to_one(62), 32, 16, 128, 1024),
)


def _bytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def request_bytes(family: Family, context: int, window_cache: str) -> int:
    """Bytes one more request of ``context`` tokens adds to the cache."""
    def build(n):
        return jax.eval_shape(lambda: interleaved_cache(
            family.sliding, n, context, num_kv_heads=family.kv_heads, head_dim=family.head_dim,
            num_query_heads=family.heads, window=family.window, dtype=jnp.bfloat16, window_cache=window_cache))
    return _bytes(build(2)) - _bytes(build(1))


def freed_window_bytes(family: Family, context: int, ring: int, page_size: int = 16) -> int:
    """Computed, not built: bytes of the request if the window layers kept
    paged blocks and gave back those wholly outside the window (vLLM's
    sliding-window group): at worst ``ceil(W / ps) + 1`` pages per window
    layer (the window straddles one more page than it fills) instead of the
    ring's ``W`` tokens."""
    token = 2 * family.kv_heads * family.head_dim * jnp.dtype(jnp.bfloat16).itemsize
    pages = -(-family.window // page_size) + 1
    return ring + sum(family.sliding) * (pages * page_size - family.window) * token


def memory_rows(budget_gib: float = 64.0) -> list[dict]:
    """Per family and context: bytes per request with window rings and with
    one table for all layers, their ratio, and requests per budget; beside
    them the computed bytes of window layers on pages freed outside the
    window (:func:`freed_window_bytes`)."""
    rows = []
    for family in FAMILIES:
        for context in CONTEXTS:
            ring, paged = (request_bytes(family, context, w) for w in ("ring", "paged"))
            freed = freed_window_bytes(family, context, ring)
            rows.append({"model": family.name, "context": context,
                         "window_layers": f"{sum(family.sliding)}/{len(family.sliding)}",
                         "ring_bytes_per_request": ring, "paged_bytes_per_request": paged,
                         "ring_bytes_per_token": ring / context, "paged_bytes_per_token": paged / context,
                         "ratio": ring / paged, "freed_pages_bytes_per_request": freed,
                         "ring_requests": int(budget_gib * GIB // ring), "paged_requests": int(budget_gib * GIB // paged)})
    return rows


# ---------------------------------------------------------------- decode step

#: Random models at the real attention layout of each family (heads, KV
#: heads, head dim, window, layer pattern over 4 / 6 layers), narrow
#: elsewhere so a CPU decodes them: hidden 512, MoE 4 experts of 512 (gpt-oss),
#: MLP 1024 (Gemma 3), vocab 1024, float32.
_STEP_MODELS = {
    "gpt-oss": dict(model_type="gpt_oss", vocab_size=1024, hidden_size=512, num_hidden_layers=4,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=512, max_position_embeddings=8192),
    "Gemma 3": dict(model_type="gemma3_text", vocab_size=1024, hidden_size=512, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"], intermediate_size=1024,
                    query_pre_attn_scalar=256, max_position_embeddings=8192),
}


def _llama_like(config) -> dict:
    """A Llama of the same width: hidden size, layers, query / KV heads, head dim."""
    return dict(model_type="llama", vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                intermediate_size=2 * config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"], rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8192,
                tie_word_embeddings=False)


def step_rows(steps: int, repeats: int, rng, *, batch: int = 4, prompt_len: int = 2048) -> list[dict]:
    """Decode time per step (one jitted loop of ``steps`` steps after a
    ``prompt_len``-token prompt, batch ``batch``) of each family with window
    rings and with one table for all layers, and of a Llama of the same
    width over the paged pool, timed interleaved in one run."""
    from flax import nnx

    from jaxkv.bench._timing import best_seconds_interleaved
    from jaxkv.manager.block_space import BlockSpaceManager
    from jaxkv.nn import (Gemma3Config, Gemma3ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, SamplingParams)
    from jaxkv.nn.generate import decode_loop, prefill, start_hybrid

    classes = {"gpt_oss": (GptOssForCausalLM, GptOssConfig), "gemma3_text": (Gemma3ForCausalLM, Gemma3Config)}

    greedy = SamplingParams()
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 - the loops donate their input
    rows = []
    for name, raw in _STEP_MODELS.items():
        cls, config_cls = classes[raw["model_type"]]
        model = cls(config_cls.from_hf(raw), rngs=nnx.Rngs(0))
        prompts = rng.integers(1, raw["vocab_size"], (batch, prompt_len)).tolist()
        fns = {}
        for layout in ("ring", "paged"):
            graphdef, params, state = start_hybrid(model, prompts, steps + 2, prefill_chunk_size=512,
                                                   cache_options={"window_cache": layout})
            fns[layout] = functools.partial(
                lambda g, p, s: decode_loop(g, p, copy(s), greedy, num_steps=steps, free_finished=False),
                graphdef, params, state)
            fns[f"{layout}_copy"] = functools.partial(lambda s: copy(s), state)
        llama = LlamaForCausalLM(LlamaConfig.from_hf(_llama_like(raw)), rngs=nnx.Rngs(0))
        max_blocks = (prompt_len + steps + 2) // 16 + 1
        pages = batch * max_blocks + 1
        bsm = BlockSpaceManager.create(num_device_blocks=pages, num_host_blocks=1, block_size=16, max_seqs=batch,
                                       max_blocks_per_seq=max_blocks)
        lgraph, lparams = nnx.split(llama)
        lstate = prefill(lgraph, lparams, bsm, llama.make_pool(pages, 16), jnp.asarray(prompts, jnp.int32),
                         jnp.full((batch,), prompt_len, jnp.int32), jax.random.key(0), np.int32(-1), greedy,
                         max_new=steps + 2)
        fns["llama"] = lambda: decode_loop(lgraph, lparams, copy(lstate), greedy, num_steps=steps,
                                           free_finished=False)
        fns["llama_copy"] = lambda: copy(lstate)
        for key in ("ring", "paged", "llama"):
            jax.block_until_ready(fns[key]())  # compile
        times = best_seconds_interleaved(fns, repeats)
        per_step = {key: max(times[key] - times[f"{key}_copy"], 0.0) / steps * 1e6 for key in ("ring", "paged", "llama")}
        rows.append({"model": name, "batch": batch, "context": prompt_len, "window": raw["sliding_window"],
                     "ring_us_per_step": per_step["ring"], "paged_us_per_step": per_step["paged"],
                     "llama_us_per_step": per_step["llama"], "ring_over_llama": per_step["ring"] / per_step["llama"],
                     "ring_over_paged": per_step["ring"] / per_step["paged"]})
        jax.clear_caches()  # each family's programs: a CPU process compiling many runs out of code memory
    return rows
