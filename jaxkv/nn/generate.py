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
from jaxkv.nn import sharding
from jaxkv.nn.packed import cache_kind
from jaxkv.nn.sampling import GREEDY, SamplingParams, sample
from jaxkv.nn.speculative import (SpecState, SpeculativeConfig, draft_model_for, hybrid_cache_options,
                                   speculative_loop, speculative_step)
from jaxkv.nn.steps import (PROGRAM_OPTIONS, DecodeState, decode_loop, decode_step, hybrid_prefill_chunk,
                            paged_peak_blocks, paged_window, prefill_chunk, start_decoding)
from jaxkv.pool.kv_pool import KVPool

__all__ = ["DecodeState", "GenerateOutput", "SamplingParams", "decode_loop", "decode_step", "generate", "prefill",
           "sample", "start_hybrid", "start_paged"]


@partial(jax.jit, static_argnames=("graphdef", "max_new"), donate_argnums=(2, 3), compiler_options=PROGRAM_OPTIONS)
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
    was produced); ``state``: the final ``DecodeState`` (pool, manager).
    With speculation: ``draft_tokens[b]`` drafts verified for prompt ``b``,
    ``accepted_tokens[b]`` of them kept, ``verify_steps[b]`` verify steps with a
    draft it ran (None without)."""

    tokens: list
    state: DecodeState
    draft_tokens: list | None = None
    accepted_tokens: list | None = None
    verify_steps: list | None = None


_hybrid_chunk = jax.jit(hybrid_prefill_chunk, static_argnames=("graphdef",), donate_argnums=(2,),
                        compiler_options=PROGRAM_OPTIONS)
_admit = jax.jit(lambda manager, n: manager.admit(n, max_n=n), static_argnums=(1,))


@partial(jax.jit, static_argnames=("max_new",))
def _start(manager, last_logits, key, eos_id, sampling, *, max_new):
    return start_decoding(manager, None, last_logits, key, sampling, eos_id, max_new=max_new, ok=True)


def generate(model, input_ids, max_new_tokens: int, *, eos_token_id: int | None = None,
             sampling: SamplingParams = GREEDY, seed: int = 0, page_size: int = 16,
             num_pages: int | None = None, kv_dtype=None, per_step: bool = False,
             mesh=None, entry_format: str = "lossless", prefill_chunk_size: int | None = None,
             num_blocks: dict[str, int] | None = None, speculative=None) -> GenerateOutput:
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

    With ``mesh`` (a ``jax.sharding.Mesh`` with ``tp``, ``data`` and / or
    ``expert`` axes, see :mod:`jaxkv.nn.sharding`; the model is placed with
    ``shard_model`` unless it is on ``mesh`` already) the cache's heads are
    split over ``tp`` (a paged pool's KV heads, a hybrid cache's attention
    heads and GDN states), a paged batch's prompts over ``data``, the
    bookkeeping replicated; the same jitted steps then run across the mesh,
    in one process or in every process of a ``jax.distributed`` run (each
    process calls ``generate`` with the same arguments and gets every
    sequence's tokens).

    A hybrid-cache model (DeepSeek-V4, which has ``make_cache``) decodes
    over its :class:`~jaxkv.KVCacheManager` instead: ``entry_format``
    (``"lossless"`` or ``"fp8"``) and ``num_blocks`` (blocks per group;
    default every request at full length) shape it, ``prefill_chunk_size``
    prefills the prompts that many tokens per request per call (default:
    whole prompts in one call); ``page_size``, ``num_pages`` and
    ``kv_dtype`` are for the paged pool and refused here.

    ``speculative`` (a :class:`~jaxkv.nn.speculative.SpeculativeConfig` or a
    dict of its fields, e.g. ``{"method": "ngram", "num_speculative_tokens":
    4}``, or ``{"method": "draft_model", "draft_layers": 8}``): decode by
    verify steps of prompt-lookup or draft-model drafts in one jitted loop
    (:mod:`jaxkv.nn.speculative`), for every family (a hybrid cache rolls
    its state rows back by a checkpoint and a replay; a draft model keeps a
    paged cache of its own, the target's first layers run over the target's
    pool); greedy tokens are those without it, sampled
    ones follow the same distribution. The output then says how many
    drafts were verified and accepted per prompt.

    Raises ``KVCacheOOM`` when the pool is too small for the prompts or for
    their decoding, and ``InvalidArgument`` for empty prompts,
    ``max_new_tokens < 1`` or a ``sampling`` that is not a
    ``SamplingParams``. One prompt whose
    :func:`jaxkv.nn.steps.paged_peak_blocks` fits ``num_pages - 1`` pages
    runs on them (the engine's ``add_request`` rule; with a window on every
    layer the blocks that leave it are released before each decode step
    takes its block).
    """
    prompts = [list(map(int, p)) for p in input_ids]
    if not prompts or any(not p for p in prompts):
        raise InvalidArgument("generate needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {sampling!r}")
    if speculative is not None:
        return _generate_speculative(model, prompts, max_new_tokens, SpeculativeConfig.of(speculative),
                                     eos_token_id=eos_token_id, sampling=sampling, seed=seed, page_size=page_size,
                                     num_pages=num_pages, kv_dtype=kv_dtype, per_step=per_step, mesh=mesh,
                                     entry_format=entry_format, chunk=prefill_chunk_size, num_blocks=num_blocks)
    if cache_kind(model) == "hybrid":
        if kv_dtype is not None or num_pages is not None:
            raise InvalidArgument("kv_dtype and num_pages are for the paged pool; a hybrid-cache model takes "
                                  "entry_format and num_blocks")
        return _generate_hybrid(model, prompts, max_new_tokens, eos_token_id=eos_token_id, sampling=sampling,
                                seed=seed, per_step=per_step, entry_format=entry_format,
                                chunk=prefill_chunk_size, num_blocks=num_blocks, mesh=mesh)
    graphdef, params, state = start_paged(model, prompts, max_new_tokens, eos_token_id=eos_token_id,
                                          sampling=sampling, seed=seed, page_size=page_size, num_pages=num_pages,
                                          kv_dtype=kv_dtype, mesh=mesh)
    num_pages = state.manager.device.capacity + 1
    # The most blocks each row holds at once (its prompt's, or with a window
    # on every layer a decode step's window: the engine's fit rule), for the
    # message when decoding runs out of blocks.
    peaks = [paged_peak_blocks(len(p), len(p) + max_new_tokens, page_size, paged_window(model)) for p in prompts]
    return _decode_to_end(graphdef, params, state, sampling, per_step, lambda s: KVCacheOOM(
        int(jnp.sum(s.blocked)), int(s.manager.device.num_free), num_pages - 1,
        detail=f"decode ran out of KV blocks (the rows hold at most {peaks} blocks each, {sum(peaks)} together; "
               f"the pool has {num_pages - 1})"))


def start_paged(model, prompts, max_new_tokens: int, *, eos_token_id: int | None = None,
                sampling: SamplingParams = GREEDY, seed: int = 0, page_size: int = 16, num_pages: int | None = None,
                kv_dtype=None, mesh=None, extra_tokens: int = 0):
    """The prefill half of :func:`generate` for a paged model: a
    ``BlockSpaceManager`` and pool (row ``b`` = prompt ``b``; placed on
    ``mesh`` when given), every prompt prefilled in one call, first tokens
    sampled. ``extra_tokens``: room in each row's table (and the default
    pool) for that many tokens past ``max_new_tokens`` (a verify step's
    drafts). Returns ``(graphdef, params, state)`` for :func:`decode_loop` /
    :func:`decode_step`. Raises ``KVCacheOOM`` when the prompts do not fit."""
    prompts = [list(map(int, p)) for p in prompts]
    batch = len(prompts)
    width = pow2_at_least(max(len(p) for p in prompts))  # fewer distinct shapes to compile
    padded = np.zeros((batch, width), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = prompt
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    max_blocks = ceil_div(int(lengths.max()) + max_new_tokens + extra_tokens, page_size)
    if num_pages is None:
        num_pages = batch * max_blocks + 1
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=page_size,
                                       max_seqs=batch, max_blocks_per_seq=max_blocks)
    pool = model.make_pool(num_pages, page_size, dtype=kv_dtype)
    eos_id = -1 if eos_token_id is None else int(eos_token_id)
    prompts_in, lengths_in, key = jnp.asarray(padded), jnp.asarray(lengths), jax.random.key(seed)
    if mesh is not None:
        sharding.prepare(model, mesh)
        pool = sharding.shard_pool(pool, mesh)
        manager, lengths_in, key = sharding.replicate((manager, lengths_in, key), mesh)
        prompts_in = sharding.put(padded, sharding.batch_spec(batch, mesh))
    graphdef, params = nnx.split(model)
    state = prefill(graphdef, params, manager, pool, prompts_in, lengths_in, key, np.int32(eos_id), sampling,
                    max_new=max_new_tokens)
    if not bool(state.ok):
        need = int(sum(ceil_div(int(n), page_size) for n in lengths))
        raise KVCacheOOM(need, num_pages - 1, num_pages - 1, unit="blocks")
    return graphdef, params, state


def _decode_to_end(graphdef, params, state: DecodeState, sampling, per_step: bool, oom) -> GenerateOutput:
    """Decode every row to its end (one jitted loop, or one call per step
    with ``per_step``); ``oom(state)`` is raised when an allocation failed."""
    if per_step:
        while bool(jnp.any(~state.finished)) and bool(state.ok):
            state = decode_step(graphdef, params, state, sampling)
    else:
        state = decode_loop(graphdef, params, state, sampling)
    if not bool(state.ok):
        raise oom(state)
    tokens, counts = sharding.fetch((state.tokens, state.num_generated))
    return GenerateOutput([tokens[b, : counts[b]].tolist() for b in range(tokens.shape[0])], state)


def _generate_hybrid(model, prompts, max_new_tokens, *, eos_token_id, sampling, seed, per_step, entry_format,
                     chunk, num_blocks, mesh) -> GenerateOutput:
    """:func:`generate` over a hybrid model's cache: :func:`start_hybrid`,
    then the same decode loop as the paged path."""
    graphdef, params, state = start_hybrid(model, prompts, max_new_tokens, eos_token_id=eos_token_id,
                                           sampling=sampling, seed=seed, entry_format=entry_format,
                                           prefill_chunk_size=chunk, num_blocks=num_blocks, mesh=mesh)
    return _decode_to_end(graphdef, params, state, sampling, per_step, lambda s: _hybrid_oom(
        s.manager, np.asarray(s.manager.seq_lens)[1:] + np.asarray(s.blocked), "decode"))


def start_hybrid(model, prompts, max_new_tokens: int, *, eos_token_id: int | None = None,
                 sampling: SamplingParams = GREEDY, seed: int = 0, entry_format: str = "lossless",
                 prefill_chunk_size: int | None = None, num_blocks: dict[str, int] | None = None,
                 cache_options: dict | None = None, mesh=None, extra_tokens: int = 0):
    """The prefill half of :func:`generate` for a hybrid-cache model: a cache
    from ``model.make_cache`` (``entry_format``, ``num_blocks``, and the
    model's own ``cache_options``, e.g. ``window_cache``), every prompt
    admitted (row ``b`` = slot ``b + 1``), prefilled ``prefill_chunk_size``
    tokens per row per call (default: whole prompts), first tokens sampled.
    ``extra_tokens``: room for that many tokens past ``max_new_tokens`` per
    row (a verify step's drafts). Returns ``(graphdef, params, state)`` for
    :func:`decode_loop` / :func:`decode_step`. Raises ``KVCacheOOM`` naming
    the short group."""
    prompts = [list(map(int, p)) for p in prompts]
    chunk = prefill_chunk_size
    batch = len(prompts)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    context = pow2_at_least(int(lengths.max()) + max_new_tokens + extra_tokens)  # fewer distinct shapes to compile
    if chunk is not None and (isinstance(chunk, bool) or int(chunk) < 1):
        raise InvalidArgument(f"prefill_chunk_size must be an integer >= 1, got {chunk!r}")
    width = pow2_at_least(int(lengths.max())) if chunk is None else int(chunk)
    manager = model.make_cache(batch, context, entry_format=entry_format, num_blocks=num_blocks,
                               **(cache_options or {}))
    if mesh is not None:  # heads over tp, the rest replicated (jaxkv.nn.sharding.cache_sharding)
        sharding.prepare(model, mesh)
        manager = sharding.shard_cache(manager, mesh)
    manager, slots, ok = _admit(manager, batch)
    if not bool(ok) or np.asarray(slots).tolist() != list(range(1, batch + 1)):
        raise KVCacheOOM(batch, manager.max_requests, manager.max_requests, unit="request slots")
    graphdef, params = nnx.split(model)
    last_logits = None
    for start in range(0, int(lengths.max()), width):
        counts = np.clip(lengths - start, 0, width).astype(np.int32)
        tokens = np.zeros((batch, width), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : counts[row]] = prompt[start:start + counts[row]]
        manager, logits, ok = _hybrid_chunk(graphdef, params, manager, slots, jnp.asarray(tokens),
                                            jnp.asarray(counts))
        if not bool(ok):
            raise _hybrid_oom(manager, lengths, f"prefill of tokens {start} .. {start + width - 1}")
        ends_here = (counts > 0) & (start + counts == lengths)
        last_logits = logits if last_logits is None else jnp.where(jnp.asarray(ends_here)[:, None], logits,
                                                                    last_logits)
    eos_id = -1 if eos_token_id is None else int(eos_token_id)
    state = _start(manager, last_logits, jax.random.key(seed), np.int32(eos_id), sampling, max_new=max_new_tokens)
    return graphdef, params, state


def _hybrid_oom(manager, lengths, what: str) -> KVCacheOOM:
    """``KVCacheOOM`` naming the group that cannot hold ``lengths`` tokens per row."""
    worst = None
    for name, group in manager.groups.items():
        need = int(sum(int(group.blocks_for(jnp.int32(int(n)))) for n in lengths))
        short = need - group.allocator.capacity
        if worst is None or short > worst[0]:
            worst = (short, name, need, group.allocator.capacity)
    _, name, need, capacity = worst
    return KVCacheOOM(need, capacity, capacity, unit=f"{name} blocks",
                      detail=f"{what} needs more blocks than group {name!r} has (give num_blocks)")


def _generate_speculative(model, prompts, max_new_tokens, config: SpeculativeConfig, *, eos_token_id, sampling, seed,
                          page_size, num_pages, kv_dtype, per_step, mesh, entry_format, chunk,
                          num_blocks) -> GenerateOutput:
    """:func:`generate` by verify steps (:mod:`jaxkv.nn.speculative`): the
    prefill with room for ``k`` more tokens per row (a hybrid cache with a
    checkpoint row per prompt), then
    :func:`~jaxkv.nn.speculative.speculative_loop` (or one jitted call per
    verify step with ``per_step``)."""
    k = config.num_speculative_tokens
    batch = len(prompts)
    draft_model = draft_model_for(model, config) if config.method == "draft_model" else None  # refused before a compile
    if cache_kind(model) == "hybrid":
        if kv_dtype is not None or num_pages is not None:
            raise InvalidArgument("kv_dtype and num_pages are for the paged pool; a hybrid-cache model takes "
                                  "entry_format and num_blocks")
        # Window rings with k slots of slack; a checkpoint row per prompt where other state must be restored.
        options, checkpoints = hybrid_cache_options(model, k, batch, max_context_tokens=64, entry_format=entry_format)
        graphdef, params, state = start_hybrid(model, prompts, max_new_tokens, eos_token_id=eos_token_id,
                                               sampling=sampling, seed=seed, entry_format=entry_format,
                                               prefill_chunk_size=chunk, num_blocks=num_blocks, mesh=mesh,
                                               cache_options=dict(options, num_snapshots=checkpoints),
                                               extra_tokens=k)
    else:
        graphdef, params, state = start_paged(model, prompts, max_new_tokens, eos_token_id=eos_token_id,
                                              sampling=sampling, seed=seed, page_size=page_size, num_pages=num_pages,
                                              kv_dtype=kv_dtype, mesh=mesh, extra_tokens=k)
    draft_graphdef = draft_params = None
    draft = {}
    if draft_model is not None and config.draft_layers is not None:  # the early exit runs over the target's pool
        draft_graphdef, draft_params = nnx.split(draft_model)
    elif draft_model is not None:
        draft_graphdef, draft_params, draft_state = start_paged(
            draft_model, prompts, max_new_tokens, sampling=sampling, seed=seed, page_size=page_size,
            kv_dtype=kv_dtype, mesh=mesh, extra_tokens=k + 1)  # every row at full length: no append can fail
        draft = dict(draft_manager=draft_state.manager, draft_pool=draft_state.pool)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    history = np.zeros((batch, pow2_at_least(int(lengths.max()) + max_new_tokens + k + 1)), np.int32)
    for row, prompt in enumerate(prompts):
        history[row, : len(prompt)] = prompt
    history[np.arange(batch), lengths] = np.asarray(state.tokens[:, 0])
    zeros = np.zeros((batch,), np.int32)  # three buffers: the loop donates each
    spec = SpecState(decode=state, history=jnp.asarray(history), history_len=jnp.asarray(lengths + 1),
                     drafted=jnp.asarray(zeros), accepted=jnp.asarray(zeros), steps=jnp.asarray(zeros), **draft)
    if per_step:
        while bool(jnp.any(~spec.decode.finished)) and bool(spec.decode.ok):
            spec = speculative_step(graphdef, params, spec, sampling, config, draft_graphdef, draft_params)
    else:
        spec = speculative_loop(graphdef, params, spec, sampling, config, draft_graphdef, draft_params)
    state = spec.decode
    if not bool(state.ok):
        if state.pool is None:
            raise _hybrid_oom(state.manager, np.asarray(state.manager.seq_lens)[1:] + (k + 1) * np.asarray(
                state.blocked), f"a verify step of up to {k + 1} tokens per row")
        raise KVCacheOOM(int(jnp.sum(state.blocked)), int(state.manager.device.num_free),
                         int(state.manager.device.capacity),
                         detail=f"a verify step of {k + 1} tokens per row ran out of KV blocks")
    tokens, counts, drafted, accepted, steps = sharding.fetch((state.tokens, state.num_generated, spec.drafted,
                                                               spec.accepted, spec.steps))
    return GenerateOutput([tokens[b, : counts[b]].tolist() for b in range(batch)], state,
                          drafted.tolist(), accepted.tolist(), steps.tolist())
