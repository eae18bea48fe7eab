"""``generate``: prefill, then many decode steps inside ONE jitted
``lax.while_loop``, with block allocation on device.

Each decode step grows every running sequence by one token with
``BlockSpaceManager.append_slots`` (a new block when it crosses a block
boundary), writes the token's K/V through the model, samples, and frees the
blocks of sequences that just finished (EOS or ``max_new_tokens``), all
inside the loop: the host sees only the final tokens.

``decode_step`` is the loop body on its own (one jitted call per token), so
the per-step host loop and the multi-step loop can be compared exactly.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxkv import _host
from jaxkv.errors import InvalidArgument, KVCacheOOM
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.pool.kv_pool import KVPool


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature == 0``; otherwise softmax sampling at
    ``temperature`` restricted to the ``top_k`` most likely tokens (0 = all)
    and to the smallest set whose probability reaches ``top_p`` (1 = all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"bad sampling parameters {self}")


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """One token per row of ``logits [B, V]`` (int32 ``[B]``)."""
    if params.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k:
        kth = jax.lax.top_k(logits, params.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        cutoff = jnp.min(jnp.where(before < params.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries (a pytree).

    ``tokens [B, max_new]``: generated tokens (``pad_id`` past each row's
    end); ``num_generated [B]``; ``last [B]``: the token to feed next;
    ``finished [B]``; ``step``: loop counter; ``key``: PRNG key; ``eos_id``:
    the stop token (-1: none; traced, so changing it does not recompile);
    ``ok``: False once an allocation failed (the loop stops; nothing was
    half-done).
    """

    manager: BlockSpaceManager
    pool: KVPool
    tokens: jax.Array
    num_generated: jax.Array
    last: jax.Array
    finished: jax.Array
    step: jax.Array
    key: jax.Array
    eos_id: jax.Array
    ok: jax.Array


def _model_step(graphdef, params, tokens, positions, pool, slots, tables, starts, num_new, mode):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, pool, slots, tables, starts, num_new, mode=mode)


@partial(jax.jit, static_argnames=("graphdef", "sampling", "max_new"), donate_argnums=(2, 3))
def prefill(graphdef, params, manager: BlockSpaceManager, pool: KVPool, prompts, lengths, key, eos_id, *,
            sampling: SamplingParams, max_new: int) -> DecodeState:
    """Allocate each prompt's blocks (sequence ``b`` is row ``b``), run the
    prompts through the model in one call and sample the first new token."""
    batch, width = prompts.shape
    ok = jnp.asarray(True)
    for row in range(batch):  # one sequence group per prompt (static batch)
        manager, allocated = manager.allocate(jnp.asarray([row], jnp.int32), lengths[row])
        ok &= allocated
    seqs = jnp.arange(batch, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    slots = jnp.where(positions < lengths[:, None], manager.token_slots(seqs, positions), -1)
    tables, _ = manager.batch_tables(seqs)
    logits, pool = _model_step(graphdef, params, prompts, positions, pool, slots, tables,
                               jnp.zeros((batch,), jnp.int32), lengths, "prefill")
    last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = sample(last_logits, sub, sampling)
    tokens = jnp.full((batch, max_new), -1, jnp.int32).at[:, 0].set(first)
    finished = (first == eos_id) | (max_new <= 1)
    manager, _ = manager.free(jnp.where(finished, seqs, -1))
    return DecodeState(manager, pool, tokens, jnp.ones((batch,), jnp.int32), first, finished,
                       jnp.asarray(1, jnp.int32), key, jnp.asarray(eos_id, jnp.int32), ok)


def _decode_body(graphdef, params, state: DecodeState, sampling: SamplingParams) -> DecodeState:
    batch, max_new = state.tokens.shape
    seqs = jnp.where(state.finished, -1, jnp.arange(batch, dtype=jnp.int32))
    manager, pool, slots, _, ok = state.manager.append_slots(state.pool, seqs, 1)
    tables, lengths = manager.batch_tables(seqs)
    starts = jnp.maximum(lengths - 1, 0)
    logits, pool = _model_step(graphdef, params, state.last[:, None], starts[:, None], pool, slots,
                               tables, starts, (~state.finished).astype(jnp.int32), "decode")
    key, sub = jax.random.split(state.key)
    new = sample(logits[:, 0], sub, sampling)
    running = ~state.finished & ok
    column = jnp.where(running, state.num_generated, max_new)  # out of range: dropped
    tokens = state.tokens.at[jnp.arange(batch), column].set(new, mode="drop")
    num_generated = state.num_generated + running
    done = running & ((new == state.eos_id) | (num_generated >= max_new))
    manager, _ = manager.free(jnp.where(done, seqs, -1))
    return DecodeState(manager, pool, tokens, num_generated, jnp.where(running, new, state.last),
                       state.finished | done, state.step + 1, key, state.eos_id, state.ok & ok)


@partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnums=(2,))
def decode_step(graphdef, params, state: DecodeState, *, sampling: SamplingParams) -> DecodeState:
    """One decode step for every running sequence (one jitted call)."""
    return _decode_body(graphdef, params, state, sampling)


@partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnums=(2,))
def decode_loop(graphdef, params, state: DecodeState, *, sampling: SamplingParams) -> DecodeState:
    """Decode until every sequence finished (or an allocation failed), in one
    ``lax.while_loop``."""
    def running(state):
        return jnp.any(~state.finished) & state.ok

    return jax.lax.while_loop(running, lambda s: _decode_body(graphdef, params, s, sampling), state)


@dataclasses.dataclass
class GenerateOutput:
    """``tokens[b]``: the new tokens of prompt ``b`` (EOS included when one
    was produced); ``state``: the final ``DecodeState`` (pool, manager)."""

    tokens: list
    state: DecodeState


def generate(model, input_ids, max_new_tokens: int, *, eos_token_id: int | None = None,
             sampling: SamplingParams = SamplingParams(), seed: int = 0, page_size: int = 16,
             num_pages: int | None = None, kv_dtype=None, per_step: bool = False,
             mesh=None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens for each prompt of ``input_ids``
    (a list of token lists, lengths may differ).

    The prompts are prefilled in one call, then all decoding runs in one
    jitted ``lax.while_loop`` (``per_step=True``: one jitted call per token
    instead, same tokens). Blocks come from a ``BlockSpaceManager`` over a
    pool of ``num_pages`` pages (default: enough for every sequence at full
    length); finished sequences free theirs inside the loop.

    With ``mesh`` (a ``jax.sharding.Mesh`` with a ``tp`` axis and optionally
    a ``data`` axis; place the model first with ``jaxkv.nn.sharding.
    shard_model``) the pool's KV heads are split over ``tp``, the prompts over
    ``data`` and the block tables replicated; the same jitted steps then run
    across the mesh.

    Raises ``KVCacheOOM`` when the pool is too small for the prompts, and
    ``InvalidArgument`` for empty prompts or ``max_new_tokens < 1``.
    """
    prompts = [list(map(int, p)) for p in input_ids]
    if not prompts or any(not p for p in prompts):
        raise InvalidArgument("generate needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens={max_new_tokens}: must be >= 1")
    batch = len(prompts)
    width = _host.pow2_at_least(max(len(p) for p in prompts))  # fewer distinct shapes to compile
    padded = np.zeros((batch, width), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = prompt
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    max_blocks = -(-(int(lengths.max()) + max_new_tokens) // page_size)
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
    state = prefill(graphdef, params, manager, pool, prompts_in, lengths_in, key, np.int32(eos_id),
                    sampling=sampling, max_new=max_new_tokens)
    if not bool(state.ok):
        need = int(sum(-(-int(n) // page_size) for n in lengths))
        raise KVCacheOOM(need, num_pages - 1, num_pages - 1, unit="blocks")
    if per_step:
        while bool(jnp.any(~state.finished)) and bool(state.ok):
            state = decode_step(graphdef, params, state, sampling=sampling)
    else:
        state = decode_loop(graphdef, params, state, sampling=sampling)
    if not bool(state.ok):
        raise KVCacheOOM(1, 0, num_pages - 1, unit="blocks (decode ran out of KV blocks)")
    tokens, counts = jax.device_get((state.tokens, state.num_generated))
    return GenerateOutput([tokens[b, : counts[b]].tolist() for b in range(batch)], state)
