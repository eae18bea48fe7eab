"""``generate``: prefill, then many decode steps inside ONE jitted
``lax.while_loop``, with block allocation on device.

Each decode step grows every running sequence by one token with
``BlockSpaceManager.append_slots`` (a new block when it crosses a block
boundary), writes the token's K/V through the model, samples, and frees the
blocks of sequences that just finished (EOS or ``max_new_tokens``), all
inside the loop: the host sees only the final tokens. The step itself is
:func:`jaxkv.nn.steps.decode_body`, shared with ``sample_n`` and the engine.

``decode_step`` is the loop body on its own (one jitted call per token), so
the per-step host loop and the multi-step loop can be compared exactly.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.errors import InvalidArgument, KVCacheOOM
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.nn.sampling import GREEDY, SamplingParams, sample
from jaxkv.nn.steps import DecodeState, decode_loop, decode_step, prefill_chunk, start_decoding
from jaxkv.pool.kv_pool import KVPool

__all__ = ["DecodeState", "GenerateOutput", "SamplingParams", "decode_loop", "decode_step", "generate", "prefill",
           "sample"]


@partial(jax.jit, static_argnames=("graphdef", "max_new"), donate_argnums=(2, 3))
def prefill(graphdef, params, manager: BlockSpaceManager, pool: KVPool, prompts, lengths, key, eos_id,
            sampling: SamplingParams = GREEDY, *, max_new: int) -> DecodeState:
    """Admit each prompt (sequence ``b`` is row ``b``; all or nothing: ``ok``
    False and nothing allocated when they do not fit), run the prompts
    through the model in one call and sample the first new token of each
    (:func:`jaxkv.nn.steps.start_decoding`)."""
    batch = prompts.shape[0]
    rows = jnp.arange(batch, dtype=jnp.int32)
    no_prefix = jnp.full((batch, manager.max_blocks_per_seq), -1, jnp.int32)
    manager, ok = manager.admit_with_prefix(rows, no_prefix, lengths)
    zeros = jnp.zeros((batch,), jnp.int32)
    pool, last_logits = prefill_chunk(graphdef, params, manager, pool, rows, prompts, zeros, lengths)
    return start_decoding(manager, pool, last_logits, key, sampling, eos_id, max_new=max_new, ok=ok)


@dataclasses.dataclass
class GenerateOutput:
    """``tokens[b]``: the new tokens of prompt ``b`` (EOS included when one
    was produced); ``state``: the final ``DecodeState`` (pool, manager)."""

    tokens: list
    state: DecodeState


def generate(model, input_ids, max_new_tokens: int, *, eos_token_id: int | None = None,
             sampling: SamplingParams = GREEDY, seed: int = 0, page_size: int = 16,
             num_pages: int | None = None, kv_dtype=None, per_step: bool = False,
             mesh=None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens for each prompt of ``input_ids``
    (a list of token lists, lengths may differ).

    The prompts are prefilled in one call, then all decoding runs in one
    jitted ``lax.while_loop`` (``per_step=True``: one jitted call per token
    instead, same tokens). Blocks come from a ``BlockSpaceManager`` over a
    pool of ``num_pages`` pages (default: enough for every sequence at full
    length); finished sequences free theirs inside the loop. One PRNG key
    (``seed``) is split once per step and drawn over the whole batch.

    The attention kernel is the model's choice (``LlamaForCausalLM(...,
    implementation=...)``).

    With ``mesh`` (a ``jax.sharding.Mesh`` with a ``tp`` axis and optionally
    a ``data`` axis; place the model first with ``jaxkv.nn.sharding.
    shard_model``) the pool's KV heads are split over ``tp``, the prompts over
    ``data`` and the block tables replicated; the same jitted steps then run
    across the mesh.

    Raises ``KVCacheOOM`` when the pool is too small for the prompts, and
    ``InvalidArgument`` for empty prompts, ``max_new_tokens < 1`` or a
    ``sampling`` that is not a ``SamplingParams``.
    """
    prompts = [list(map(int, p)) for p in input_ids]
    if not prompts or any(not p for p in prompts):
        raise InvalidArgument("generate needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {sampling!r}")
    batch = len(prompts)
    width = pow2_at_least(max(len(p) for p in prompts))  # fewer distinct shapes to compile
    padded = np.zeros((batch, width), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = prompt
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    max_blocks = ceil_div(int(lengths.max()) + max_new_tokens, page_size)
    if num_pages is None:
        num_pages = batch * max_blocks + 1
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=page_size,
                                       max_seqs=batch, max_blocks_per_seq=max_blocks)
    pool = model.make_pool(num_pages, page_size, dtype=kv_dtype)
    graphdef, params = nnx.split(model)
    eos_id = -1 if eos_token_id is None else int(eos_token_id)
    prompts_in, lengths_in, key = jnp.asarray(padded), jnp.asarray(lengths), jax.random.key(seed)
    if mesh is not None:
        from jaxkv.nn import sharding  # the placement rules live there

        pool = sharding.shard_pool(pool, mesh)
        manager, lengths_in, key = sharding.replicate((manager, lengths_in, key), mesh)
        prompts_in = jax.device_put(prompts_in, sharding.batch_spec(batch, mesh))
    state = prefill(graphdef, params, manager, pool, prompts_in, lengths_in, key, np.int32(eos_id), sampling,
                    max_new=max_new_tokens)
    if not bool(state.ok):
        need = int(sum(ceil_div(int(n), page_size) for n in lengths))
        raise KVCacheOOM(need, num_pages - 1, num_pages - 1, unit="blocks")
    if per_step:
        while bool(jnp.any(~state.finished)) and bool(state.ok):
            state = decode_step(graphdef, params, state, sampling)
    else:
        state = decode_loop(graphdef, params, state, sampling)
    if not bool(state.ok):
        raise KVCacheOOM(int(jnp.sum(state.blocked)), int(state.manager.device.num_free), num_pages - 1,
                         detail="decode ran out of KV blocks")
    tokens, counts = jax.device_get((state.tokens, state.num_generated))
    return GenerateOutput([tokens[b, : counts[b]].tolist() for b in range(batch)], state)
