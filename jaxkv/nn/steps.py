"""The jitted building blocks every decode path of jaxkv is made of.

* :func:`model_step`: one model call (prefill or decode) over the paged pool
  from a split NNX model (``graphdef`` static, ``params`` traced).
* :func:`prefill_chunk`: run ``tokens [B, W]`` of admitted sequence rows at
  positions ``starts + t`` and return each row's last logits. ``generate``
  runs whole prompts through it, ``sample_n``/``beam_search`` one prompt in
  row 0, the engine the uncached tails of a batch, chunk by chunk.
* :func:`decode_logits`: one decode step of the model for the rows
  ``active``: for a model whose every layer has a sliding window, first the
  blocks that no query from this one on can see released
  (:meth:`~jaxkv.BlockSpaceManager.trim_window`), then ``append_slots`` (a
  new block at block boundaries, copy-on-write of a shared last block),
  block tables, model step. :func:`paged_peak_blocks` is the most blocks a
  sequence then holds at once (the fit rule of ``generate`` and the engine).
* :class:`DecodeState` and :func:`decode_body`: the decode step of
  ``generate``, ``sample_n`` and the engine: :func:`decode_logits`, then
  sample, record, stop on EOS or ``max_new`` and (optionally) free the
  finished rows. :func:`run_decode` runs it in one ``lax.while_loop``;
  :func:`decode_step` and :func:`decode_loop` are those two jitted.

Beam search uses :func:`prefill_chunk` and :func:`decode_logits` but keeps its
own selection step (:mod:`jaxkv.nn.parallel`).

Two caches run through the same decode state. A Llama-family model keeps
K/V in a :class:`~jaxkv.KVPool` whose blocks a
:class:`~jaxkv.BlockSpaceManager` hands out (row ``b`` is sequence ``b``). A
hybrid-cache model (DeepSeek-V4: it has ``make_cache``) keeps everything in
a :class:`~jaxkv.KVCacheManager` (``pool`` is None): row ``b`` is request
slot ``b + 1`` (a fresh manager admits slots lowest first; the rule and the
row operations both managers give are :mod:`jaxkv.manager.rows`), each decode step
reserves one token per running row (``KVCacheManager.reserve``, all or
nothing) and a finished row's slot and blocks are released in the step it
finishes. :func:`hybrid_prefill_chunk` is its prefill.

Invariants of :class:`DecodeState` (kept by every function here):

* ``finished[b]`` rows take no slot and write nothing; a row with
  ``free_finished`` was freed in the step it finished, after its block table
  and length were copied to ``final_tables[b]`` / ``final_lens[b]``;
* ``tokens[b, :written[b]]`` are the tokens recorded by this state (``-1``
  past them); ``num_generated[b] <= max_new[b]``;
* ``ok`` is False once an ``append_slots`` failed; the failing step
  appended, wrote and recorded nothing (all or nothing; only a windowed
  model's dead blocks may have been released before it, which no query can
  read and a retry would release anyway), ``blocked`` marks the rows that
  needed blocks, and every loop here stops.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.rows import slot_of
from jaxkv.nn.packed import PackedBatch
from jaxkv.nn.constraints import advance, constrain
from jaxkv.nn.penalties import SeenTokens, apply_penalties, count
from jaxkv.nn.sampling import (MAX_TOP_LOGPROBS, RowSampling, SamplingParams, TokenLogprobs, row_rules, sample,
                               sample_with_logprobs, score_tokens, split_keys)
from jaxkv.pool.kv_pool import KVPool
from jaxkv.pool.scrub import freed_blocks, scrub_kv_pool

__all__ = [
    "PROGRAM_OPTIONS",
    "DecodeState",
    "decode_body",
    "decode_logits",
    "decode_loop",
    "decode_step",
    "drop_decode_lanes",
    "finish_rows",
    "grow_decode_lanes",
    "hybrid_packed_step",
    "hybrid_prefill_chunk",
    "model_step",
    "paged_decode_peak",
    "paged_packed_step",
    "paged_peak_blocks",
    "paged_row_blocks",
    "paged_window",
    "place_tokens",
    "prefill_chunk",
    "run_decode",
    "start_decoding",
    "trim_out_of_window",
]

#: XLA options of every jitted program that runs a model over a KV cache (the engine's steps, ``generate``'s,
#: beam search's and speculation's loops): ``jax.jit(..., compiler_options=PROGRAM_OPTIONS)``.
#:
#: XLA:GPU's rematerialization pass is off in them. At a real KV budget it finds them past the device's memory
#: however little they hold besides the pool (compiled for an H100 at Llama-3.1-8B's shapes, a 51 GB pool:
#: "only reduced to 119 GiB" against a limit of 48 GiB, for programs whose peak is 68 GB: the donated pool
#: reckoned as argument and as result, it seems), and recomputes whatever it can, to no end: the 512-token
#: packed step ran 31 of its 32 q/k/v GEMMs twice (550 kernels; 453 without the pass), the decode step had
#: 555 kernels a step (543 without), with the same temporaries either way (0.54 GB). These programs'
#: temporaries are small by design and checked by ``bench engine_aot``, so the pass has nothing to save; a
#: recomputation gives the same values, so no token changes.
PROGRAM_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


def model_step(graphdef, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], pool: KVPool,
               slots: Int[Array, "B T"], tables: Int[Array, "B M"], starts: Int[Array, " B"],
               num_new: Int[Array, " B"], mode: str) -> tuple[Float[Array, "B T V"], KVPool]:
    """``model(tokens, positions, pool, slots, tables, starts, num_new, mode=mode)``
    of the model ``nnx.merge(graphdef, params)``: ``(logits, pool)``."""
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, pool, slots, tables, starts, num_new, mode=mode)


def prefill_chunk(graphdef, params, manager: BlockSpaceManager, pool: KVPool, rows: Int[Array, " B"],
                  tokens: Int[Array, "B W"], starts: Int[Array, " B"],
                  num_new: Int[Array, " B"]) -> tuple[KVPool, Float[Array, "B V"]]:
    """Write the K/V of ``tokens[b, :num_new[b]]`` of sequence ``rows[b]`` (an
    admitted row holding at least ``starts[b] + num_new[b]`` tokens' blocks;
    -1: an idle lane) at positions ``starts[b] + t``, attending everything
    the row holds up to each token. Returns ``(pool, logits)`` with
    ``logits[b]`` those of the row's last new token (garbage for idle lanes)."""
    width = tokens.shape[1]
    lane = jnp.arange(width, dtype=jnp.int32)[None, :]
    positions = starts[:, None] + lane
    slots = jnp.where(lane < num_new[:, None], manager.token_slots(rows, positions), -1)
    tables, _ = manager.batch_tables(rows)
    logits, pool = model_step(graphdef, params, tokens, positions, pool, slots, tables, starts, num_new, "prefill")
    last = jnp.take_along_axis(logits, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return pool, last


def hybrid_prefill_chunk(graphdef, params, manager: KVCacheManager, slots: Int[Array, " B"],
                         tokens: Int[Array, "B W"], num_new: Int[Array, " B"]
                         ) -> tuple[KVCacheManager, Float[Array, "B V"], Bool[Array, ""]]:
    """Reserve ``num_new[b]`` tokens for request slot ``slots[b]`` (-1: idle
    lane) and run ``tokens[b, :num_new[b]]`` through the hybrid model at the
    slot's next positions. Returns ``(manager, logits, ok)``: ``logits[b]``
    of row ``b``'s last new token; all or nothing (``ok`` False: nothing
    reserved or written). No snapshot is captured (see
    :func:`hybrid_packed_step`)."""
    manager, starts, ok = manager.reserve(slots, num_new, max_new_tokens=tokens.shape[1])
    model = nnx.merge(graphdef, params)
    logits, manager = model(tokens, manager, jnp.where(ok, slots, -1), jnp.maximum(starts, 0),
                            jnp.where(ok, num_new, 0))
    last = jnp.take_along_axis(logits, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return manager, last, ok


def _hybrid_decode_logits(graphdef, params, manager: KVCacheManager, last, active):
    """:func:`decode_logits` for a hybrid-cache model (row ``b`` = slot ``b + 1``).
    ``blocked`` marks every row that was to run when the reserve failed (the
    manager's reserve is all or nothing and does not say which row was short)."""
    slots = slot_of(jnp.where(active, jnp.arange(last.shape[0], dtype=jnp.int32), -1))
    manager, last_logits, ok = hybrid_prefill_chunk(graphdef, params, manager, slots, last[:, None],
                                                    active.astype(jnp.int32))
    return manager, None, last_logits, active & ~ok, ok


def decode_logits(graphdef, params, manager: BlockSpaceManager, pool: KVPool, last: Int[Array, " B"],
                  active: Bool[Array, " B"], *, scrub: bool = False):
    """One decode step of the model: sequence row ``b`` (for ``active[b]``)
    grows by the token ``last[b]`` (``append_slots``: a new block at a block
    boundary, copy-on-write of a shared last block), whose K/V are written
    and whose next-token logits are computed.

    Returns ``(manager, pool, logits [B, V], blocked [B], ok)``. When the
    append fails (``ok`` False) nothing was appended or written (a windowed
    model's rows may have released blocks no query can see any more: the
    trim comes first and is idempotent), every slot is -1 and the model ran
    with no real token: the caller drops the logits.
    A hybrid-cache manager (``pool`` None) takes :func:`_hybrid_decode_logits`.
    ``scrub`` (static): zero the blocks the window trim frees before the
    append can hand them out again (:mod:`jaxkv.pool.scrub`).
    """
    if pool is None:  # the manager holds its K/V: a hybrid cache
        return _hybrid_decode_logits(graphdef, params, manager, last, active)
    batch = last.shape[0]
    seqs = jnp.where(active, jnp.arange(batch, dtype=jnp.int32), -1)
    window = paged_window(nnx.merge(graphdef, params))
    if window is not None:
        # Blocks out of every layer's window go back BEFORE the append (the
        # query at ``seq_lens`` is the one about to run, so they are dead
        # either way): a row holds O(window) blocks, and a prompt that filled
        # the pool to its last page can take its first decode block from the
        # blocks leaving the window (after the prefill nothing trimmed them).
        manager, pool = trim_out_of_window(manager, pool, seqs, window, scrub)
    manager, pool, slots, blocked, ok = manager.append_slots(pool, seqs, 1)
    tables, lengths = manager.batch_tables(seqs)
    starts = jnp.maximum(lengths - 1, 0)
    running = active & ok
    logits, pool = model_step(graphdef, params, last[:, None], starts[:, None], pool, slots, tables, starts,
                              running.astype(jnp.int32), "decode")
    return manager, pool, logits[:, 0], blocked, ok


def trim_out_of_window(manager: BlockSpaceManager, pool: KVPool, seqs, window: int, scrub: bool):
    """``trim_window`` of ``seqs``; with ``scrub`` the freed blocks are
    zeroed at once (an append after it may take them)."""
    trimmed, _ = manager.trim_window(seqs, window)
    if scrub:
        pool = scrub_kv_pool(pool, freed_blocks(manager.device, trimmed.device, null=False))
    return trimmed, pool


def paged_row_blocks(num_tokens: int, block_size: int, window: int | None) -> int:
    """The fewest blocks a decoding row of ``num_tokens`` tokens holds: all
    ``ceil(num_tokens / block_size)``, or with a ``window`` on every layer
    those from the block of position ``num_tokens - window`` on (the step
    that appended position ``num_tokens - 1`` trimmed the rest first; a row
    just prefilled has not been trimmed yet and holds them all)."""
    held = -(-num_tokens // block_size)
    if window is None or num_tokens < 1:
        return held
    return held - max(num_tokens - window, 0) // block_size


def paged_decode_peak(first: int, last: int, block_size: int, window: int | None) -> int:
    """The most blocks a row holds at once while decode steps append
    positions ``first .. last - 1`` (0 when ``last <= first``): the step at
    ``p`` trims to the blocks of ``[p - window + 1, p)`` (no window: nothing)
    and appends ``p``, so it holds ``ceil((p + 1) / bs) - (p - window + 1) // bs``
    blocks (:func:`decode_logits`). Exact: the step's count is periodic in
    ``p`` (period ``bs``) once ``p >= window - 1``, so only the first
    ``window + bs`` steps are looked at."""
    if last <= first:
        return 0
    if window is None:
        return -(-last // block_size)
    stop = min(last, first + window + block_size)
    return max(-(-(p + 1) // block_size) - max(p - window + 1, 0) // block_size for p in range(first, stop))


def paged_peak_blocks(prompt_len: int, total: int, block_size: int, window: int | None) -> int:
    """The most blocks one sequence holds at once: its prompt's (prefilled
    whole, untrimmed) or a decode step's (:func:`paged_decode_peak`) on its
    way to ``total`` tokens. The fit rule of ``generate`` and the engine
    (``total`` = prompt + ``max_new_tokens``, one token more than the last
    step writes: the rule the block tables are sized by)."""
    return max(-(-prompt_len // block_size), paged_decode_peak(prompt_len, total, block_size, window))


def paged_window(model) -> int | None:
    """The sliding window of ``model`` when EVERY layer has it (Mistral;
    Qwen2/3 with ``use_sliding_window`` on all layers), else None: a paged
    pool's block table serves all layers, so a block can be released only
    when no layer can see it."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "sliding_window_layers", None) is not None:
        return None
    return int(window)


@struct.dataclass
class DecodeState:
    """Everything a decode loop carries (a pytree; see the module invariants).

    Fields:
        manager, pool: the block manager (row ``b`` is sequence ``b``) and the
            KV pool; or a hybrid :class:`~jaxkv.KVCacheManager` (row ``b`` is
            slot ``b + 1``) and None.
        tokens: ``[B, W]`` int32, the tokens recorded so far (-1 past ``written``).
        written: ``[B]`` int32, tokens recorded in ``tokens``.
        num_generated: ``[B]`` int32, tokens generated in all (the stop rule's count).
        max_new: ``[B]`` int32, a row finishes when ``num_generated`` reaches it.
        last: ``[B]`` int32, the token to feed next.
        finished: ``[B]`` bool, rows that take no further step (idle rows too).
        keys: PRNG keys: one key ``[]`` for the whole batch, or one per row
            ``[B]`` (a row's key advances only on the steps it runs, and not at
            all under a static greedy ``SamplingParams``: no draw is made).
        eos_id: ``[B]`` int32, the stop token per row (-1: none; traced, so it
            does not recompile).
        step: ``[]`` int32, loop counter.
        blocked: ``[B]`` bool, the rows the last failed append could not grow.
        final_tables: ``[B, M]`` int32, a row's block table when it was freed
            (-1 until then); final_lens: ``[B]`` int32, its length then. Both
            None unless asked for (``keep_final_tables``): ``sample_n`` reads
            them, and ``generate`` would only pay a table copy per step.
        peak_used: ``[]`` int32, most device blocks in use after any step.
        ok: ``[]`` bool, False once an allocation failed.
        logprobs: the recorded tokens' log-probabilities
            (:class:`~jaxkv.nn.sampling.TokenLogprobs`, ``[B, W]`` and
            ``[B, W, N]``; entry ``[b, i]`` is ``tokens[b, i]``'s), when the
            sampling parameters ask for them (a ``RowSampling``'s
            ``logprobs``); else None.
        seen: with penalties (a ``RowSampling``'s ``penalties``), each row's
            prompt tokens and output counts (:class:`~jaxkv.nn.penalties.SeenTokens`),
            updated with every token the loop samples; else None.
        grammar: with structured-output constraints (a ``RowSampling``'s
            ``constraints``), each row's automaton state
            (:mod:`jaxkv.nn.constraints`), advanced by every token the loop
            samples; else None.
    """

    manager: BlockSpaceManager
    pool: KVPool
    tokens: Int[Array, "batch width"]
    written: Int[Array, " batch"]
    num_generated: Int[Array, " batch"]
    max_new: Int[Array, " batch"]
    last: Int[Array, " batch"]
    finished: Bool[Array, " batch"]
    keys: jax.Array
    eos_id: Int[Array, " batch"]
    step: Int[Array, ""]
    blocked: Bool[Array, " batch"]
    final_tables: Int[Array, "batch max_blocks"] | None
    final_lens: Int[Array, " batch"] | None
    peak_used: Int[Array, ""]
    ok: Bool[Array, ""]
    logprobs: TokenLogprobs | None = None
    seen: SeenTokens | None = None
    grammar: Int[Array, " batch"] | None = None

    @classmethod
    def create(cls, manager: BlockSpaceManager, pool: KVPool, *, last, finished, num_generated, max_new, eos_id,
               keys, width: int, step=0, ok=True, keep_final_tables: bool = False,
               top_logprobs: int = -1, seen: SeenTokens | None = None, grammar=None) -> DecodeState:
        """A state with nothing recorded yet (``tokens`` all -1, ``written``
        0); ``max_new`` and ``eos_id`` broadcast to the batch.
        ``top_logprobs`` (>= 0): room for each token's log-probability and
        its top ``top_logprobs`` (``logprobs``). ``grammar``: each row's
        constraint state (a ``RowSampling``'s ``constraints.state``)."""
        last = jnp.asarray(last, jnp.int32)
        batch = last.shape[0]
        if keep_final_tables and not manager.ROW_TABLES:
            raise InvalidArgument("keep_final_tables needs a BlockSpaceManager (a hybrid cache has a table per group)")
        return cls(
            manager=manager, pool=pool, tokens=jnp.full((batch, width), -1, jnp.int32),
            written=jnp.zeros((batch,), jnp.int32), num_generated=jnp.asarray(num_generated, jnp.int32),
            max_new=jnp.broadcast_to(jnp.asarray(max_new, jnp.int32), (batch,)), last=last,
            finished=jnp.asarray(finished, bool), keys=keys,
            eos_id=jnp.broadcast_to(jnp.asarray(eos_id, jnp.int32), (batch,)), step=jnp.asarray(step, jnp.int32),
            blocked=jnp.zeros((batch,), bool),
            final_tables=jnp.full((batch, manager.max_blocks_per_seq), -1, jnp.int32) if keep_final_tables else None,
            final_lens=jnp.zeros((batch,), jnp.int32) if keep_final_tables else None,
            peak_used=manager.blocks_in_use,
            ok=jnp.asarray(ok, bool),
            logprobs=None if top_logprobs < 0 else TokenLogprobs(
                token=jnp.zeros((batch, width), jnp.float32),
                top_ids=jnp.zeros((batch, width, top_logprobs), jnp.int32),
                top=jnp.zeros((batch, width, top_logprobs), jnp.float32)),
            seen=seen, grammar=grammar)


def finish_rows(state: DecodeState, done: Bool[Array, " B"], free_finished: bool) -> DecodeState:
    """Mark ``done`` rows finished; with ``free_finished`` free them, first
    keeping their tables and lengths in ``final_*`` when the state has them."""
    state = state.replace(finished=state.finished | done)
    if not free_finished:
        return state
    manager = state.manager
    if state.final_tables is not None:
        state = state.replace(final_tables=jnp.where(done[:, None], manager.block_tables, state.final_tables),
                              final_lens=jnp.where(done, manager.seq_lens, state.final_lens))
    lanes = jnp.arange(done.shape[0], dtype=jnp.int32)

    def free(manager):
        return manager.free_rows(jnp.where(done, lanes, -1))[0]  # done rows are held: cannot fail

    # Most steps finish no row: skip the free's scatters then (a decode step
    # at batch 1 is a few hundred small kernels; these are a tenth of them).
    return state.replace(manager=jax.lax.cond(jnp.any(done), free, lambda m: m, manager))


def start_decoding(manager: BlockSpaceManager, pool: KVPool, last_logits: Float[Array, "B V"], keys: jax.Array,
                   sampling: SamplingParams | RowSampling, eos_id, *, max_new: int, ok,
                   keep_final_tables: bool = False) -> DecodeState:
    """Sample each row's first new token from ``last_logits`` (the prompt's
    last logits; row ``b`` is sequence ``b``) and start the decode state:
    ``tokens[:, 0]`` holds it, rows that finished at once (EOS, or
    ``max_new <= 1``) are freed."""
    batch = last_logits.shape[0]
    keys, subs = split_keys(keys)
    first = sample(last_logits, subs, sampling)
    state = DecodeState.create(manager, pool, last=first, finished=jnp.zeros((batch,), bool),
                               num_generated=jnp.ones((batch,), jnp.int32), max_new=max_new, eos_id=eos_id,
                               keys=keys, width=max_new, step=1, ok=ok, keep_final_tables=keep_final_tables)
    state = state.replace(tokens=state.tokens.at[:, 0].set(first), written=jnp.ones((batch,), jnp.int32))
    return finish_rows(state, (first == state.eos_id) | (max_new <= 1), True)


def decode_body(graphdef, params, state: DecodeState, sampling: SamplingParams | RowSampling, *,
                free_finished: bool = True, scrub: bool = False) -> DecodeState:
    """One decode step of every unfinished row: :func:`decode_logits`,
    :func:`~jaxkv.nn.sampling.sample`, record the token, finish rows on EOS or
    ``max_new`` (freeing them with ``free_finished``). A failed append
    records nothing and sets ``ok`` False and ``blocked``. ``scrub``
    (static): the blocks a sliding window trims are zeroed in the step
    (:mod:`jaxkv.pool.scrub`); rows freed with ``free_finished`` are not
    (the engine runs with it off and frees rows in its scrubbed retire
    call)."""
    batch, width = state.tokens.shape
    active = ~state.finished
    manager, pool, logits, now_blocked, ok = decode_logits(graphdef, params, state.manager, state.pool,
                                                           state.last, active, scrub=scrub)
    if state.seen is not None:
        logits = apply_penalties(logits, sampling.penalties, state.seen)
    if state.grammar is not None:
        logits = constrain(logits, sampling.constraints, state.grammar)
    if isinstance(sampling, SamplingParams) and sampling.is_greedy:  # static: no draw, so no key is spent
        keys, new, logprobs = state.keys, sample(logits, state.keys, sampling), None
    else:
        keys, subs = split_keys(state.keys)
        new, logprobs = sample_with_logprobs(logits, subs, sampling)
    running = active & ok
    if keys.ndim:  # per-row streams advance only with their row
        keys = jnp.where(running, keys, state.keys)
    column = jnp.where(running, state.written, width)  # out of range: dropped
    num_generated = state.num_generated + running
    if state.logprobs is not None:
        state = state.replace(logprobs=record_logprobs(state.logprobs, column, logprobs))
    if state.seen is not None:
        state = state.replace(seen=count(state.seen, new, running))
    if state.grammar is not None:
        state = state.replace(grammar=advance(sampling.constraints, state.grammar, new, running))
    state = state.replace(
        manager=manager, pool=pool, tokens=state.tokens.at[jnp.arange(batch), column].set(new, mode="drop"),
        written=state.written + running, num_generated=num_generated, last=jnp.where(running, new, state.last),
        keys=keys, step=state.step + 1, blocked=jnp.where(ok, state.blocked, now_blocked),
        peak_used=jnp.maximum(state.peak_used, manager.blocks_in_use), ok=state.ok & ok)
    done = running & ((new == state.eos_id) | (num_generated >= state.max_new))
    return finish_rows(state, done, free_finished)


def record_logprobs(recorded: TokenLogprobs, column: Int[Array, " B"], new: TokenLogprobs) -> TokenLogprobs:
    """``recorded`` (``[B, W, ...]``) with row ``b``'s entry ``column[b]``
    set to ``new``'s ``b``-th (a column past ``W`` is dropped)."""
    rows = jnp.arange(column.shape[0])
    return jax.tree.map(lambda acc, x: acc.at[rows, column].set(x, mode="drop"), recorded, new)


def run_decode(graphdef, params, state: DecodeState, sampling: SamplingParams | RowSampling, *,
               num_steps: int | None = None, free_finished: bool = True, scrub: bool = False) -> DecodeState:
    """:func:`decode_body` in one ``lax.while_loop`` until every row finished,
    an allocation failed, or (given ``num_steps``) that many steps ran."""
    stop_at = None if num_steps is None else state.step + num_steps

    def running(s):
        go = jnp.any(~s.finished) & s.ok
        return go if stop_at is None else go & (s.step < stop_at)

    return jax.lax.while_loop(running, lambda s: decode_body(graphdef, params, s, sampling,
                                                             free_finished=free_finished, scrub=scrub), state)


@partial(jax.jit, static_argnames=("graphdef", "free_finished"), donate_argnums=(2,), compiler_options=PROGRAM_OPTIONS)
def decode_step(graphdef, params, state: DecodeState, sampling: SamplingParams | RowSampling = SamplingParams(), *,
                free_finished: bool = True) -> DecodeState:
    """:func:`decode_body` as one jitted call (the state is donated)."""
    return decode_body(graphdef, params, state, sampling, free_finished=free_finished)


@partial(jax.jit, static_argnames=("graphdef", "num_steps", "free_finished"), donate_argnums=(2,),
         compiler_options=PROGRAM_OPTIONS)
def decode_loop(graphdef, params, state: DecodeState, sampling: SamplingParams | RowSampling = SamplingParams(), *,
                num_steps: int | None = None, free_finished: bool = True) -> DecodeState:
    """:func:`run_decode` as one jitted call (the state is donated)."""
    return run_decode(graphdef, params, state, sampling, num_steps=num_steps, free_finished=free_finished)


# ---------------------------------------------------------------- packed steps
#
# One scheduler iteration as ONE model call over a flat token stream
# (:mod:`jaxkv.nn.packed`): prefill-class lanes write into blocks their
# requests took at admission, decode-class lanes grow by one token here (a
# paged pool's ``append_slots``, a hybrid cache's ``reserve``), all of them
# or none. When the decode lanes cannot grow, they drop out of the step: they
# are the tail of the stream, so cutting ``cu_q_lens`` at the first decode
# lane turns their tokens into padding, and the prefill lanes still run.


def drop_decode_lanes(batch: PackedBatch, decode_ok: Bool[Array, ""]) -> PackedBatch:
    """``batch`` with its decode lanes' tokens turned into padding unless
    ``decode_ok``."""
    p = batch.num_prefill
    lane = jnp.arange(batch.num_lanes + 1, dtype=jnp.int32)
    cu = jnp.where(decode_ok | (lane <= p), batch.cu_q_lens, batch.cu_q_lens[p])
    positions = jnp.where(decode_ok | (batch.token_lanes < p), batch.positions, -1)
    return batch.replace(cu_q_lens=cu, positions=positions)


def _sample_lanes(logits: Float[Array, "S V"], keys: jax.Array, sampling: RowSampling, took: Bool[Array, " S"]):
    """Each lane's token from its last logits, drawn as every other path
    draws it (one split of the lane's key), the keys, advanced only for
    the lanes that ``took`` a token, and the tokens' log-probabilities
    when ``sampling`` asks for them (else None)."""
    advanced, subs = split_keys(keys)
    tokens, logprobs = sample_with_logprobs(row_rules(logits, sampling), subs, sampling)
    return tokens, jnp.where(took, advanced, keys), logprobs


def _split_scores(logits, batch: PackedBatch):
    """A packed step's logits split into the lanes' (``[S, V]``) and, when
    ``batch`` scores prompt tokens, their scores
    (:func:`~jaxkv.nn.sampling.score_tokens`: ``(TokenLogprobs, rank)``
    with the top :data:`~jaxkv.nn.sampling.MAX_TOP_LOGPROBS`); else None."""
    if batch.scored is None:
        return logits, None
    lanes = batch.num_lanes
    return logits[:lanes], score_tokens(logits[lanes:], batch.scored_targets, MAX_TOP_LOGPROBS)


def grow_decode_lanes(manager: BlockSpaceManager, pool: KVPool, batch: PackedBatch, width: int,
                      window: int | None, scrub: bool):
    """A paged packed step's decode lanes, grown: blocks out of every
    layer's ``window`` released first (as :func:`decode_logits`), then
    ``append_slots`` of ``width`` positions each (all or nothing: on
    failure the lanes drop out, ``blocked`` marks them). Returns
    ``(manager, pool, batch, blocked, ok)``."""
    seqs = jnp.where(batch.decode_lanes, batch.seq_ids, -1)
    if window is not None:
        manager, pool = trim_out_of_window(manager, pool, seqs, window, scrub)
    manager, pool, _, blocked, ok = manager.append_slots(pool, seqs, width)
    return manager, pool, drop_decode_lanes(batch, ok), blocked, ok


def place_tokens(manager: BlockSpaceManager, batch: PackedBatch) -> PackedBatch:
    """``batch`` with every real token's pool slot and every lane's block
    table filled in from ``manager``."""
    token_rows = batch.seq_ids[batch.token_lanes]
    slots = manager.token_slots(jnp.where(batch.real, token_rows, -1), jnp.maximum(batch.positions, 0)[:, None])[:, 0]
    tables, _ = manager.batch_tables(batch.seq_ids)
    return batch.replace(slots=slots, block_tables=tables)


def paged_packed_step(graphdef, params, manager: BlockSpaceManager, pool: KVPool, batch: PackedBatch,
                      sampling: RowSampling, keys: jax.Array, *, window: int | None = None, scrub: bool = False):
    """One packed step of a paged-pool model (``batch.seq_ids`` are sequence
    rows). Decode lanes first release the blocks out of every layer's
    ``window`` (as :func:`decode_logits`), then ``append_slots`` one token
    (all or nothing: on failure they drop out and ``blocked`` marks them);
    every real token's K/V are written at its row's slot, the model runs
    (``forward_packed``) and the lanes of ``batch.sample`` that ran draw a
    token. Returns ``(manager, pool, tokens [S], keys, decode_ok, blocked
    [S], blocks in use, logprobs, scores)`` (``logprobs``: the tokens'
    :class:`~jaxkv.nn.sampling.TokenLogprobs` when ``sampling`` asks for
    them, else None; ``scores``: the ``batch.scored`` prompt tokens' scores,
    :func:`~jaxkv.nn.sampling.score_tokens`, else None). ``scrub``: the trimmed blocks are zeroed before the
    append (:mod:`jaxkv.pool.scrub`)."""
    manager, pool, batch, blocked, ok = grow_decode_lanes(manager, pool, batch, 1, window, scrub)
    batch = place_tokens(manager, batch)
    logits, pool = nnx.merge(graphdef, params).forward_packed(batch, pool)
    logits, scores = _split_scores(logits, batch)
    took = batch.sample & (batch.q_lens > 0)
    tokens, keys, logprobs = _sample_lanes(logits, keys, sampling, took)
    return manager, pool, tokens, keys, ok, blocked, manager.device.num_used, logprobs, scores


def hybrid_packed_step(graphdef, params, manager: KVCacheManager, batch: PackedBatch, sampling: RowSampling,
                       keys: jax.Array):
    """One packed step of a hybrid-cache model (``batch.seq_ids`` are request
    slots): ``reserve`` the prefill lanes' tokens (their blocks were
    preallocated: ``prefill_ok`` False is a bookkeeping bug), then the
    decode lanes' (all or nothing; on failure they drop out), run the model
    (``forward_packed``), and draw a token for the lanes of ``batch.sample``
    that ran. Returns ``(manager, tokens [S], keys, prefill_ok, decode_ok,
    blocks in use, logprobs, scores)`` (``logprobs`` and ``scores`` as
    :func:`paged_packed_step`'s).
    Nothing here snapshots: the engine keeps its snapshots
    at prompt-piece ends (:mod:`jaxkv.serve.hybrid_cache`); a caller that
    built its manager with ``capture_every`` calls ``manager.capture`` after
    its own steps."""
    decode = batch.decode_lanes
    prefill = ~decode & (batch.q_lens > 0) & (batch.seq_ids >= 0)
    manager, _, prefill_ok = manager.reserve(jnp.where(prefill, batch.seq_ids, -1), jnp.where(prefill, batch.q_lens, 0),
                                             max_new_tokens=batch.max_prefill_len)
    manager, _, decode_ok = manager.reserve(jnp.where(decode, batch.seq_ids, -1), jnp.where(decode, 1, 0),
                                            max_new_tokens=1)
    batch = drop_decode_lanes(batch, decode_ok)
    batch = batch.replace(positions=jnp.where(prefill_ok | (batch.token_lanes >= batch.num_prefill),
                                              batch.positions, -1))
    logits, manager = nnx.merge(graphdef, params).forward_packed(batch, manager)
    logits, scores = _split_scores(logits, batch)
    ran = (batch.q_lens > 0) & jnp.where(decode, decode_ok, prefill_ok)
    tokens, keys, logprobs = _sample_lanes(logits, keys, sampling, batch.sample & ran)
    return manager, tokens, keys, prefill_ok, decode_ok, manager.blocks_in_use, logprobs, scores
