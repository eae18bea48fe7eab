"""Parallel sampling and beam search on ``fork`` + copy-on-write.

Both prefill the prompt ONCE (sequence row 0), then share its blocks with
the other rows through :meth:`BlockSpaceManager.fork` and decode every row
inside one jitted ``lax.while_loop``. Each step grows every running row by
one token with :meth:`BlockSpaceManager.append_slots`, which copies a shared,
partly filled last block into a fresh page before the row writes into it
(copy-on-write), so rows never see each other's tokens while the full
blocks of the prompt stay shared. The prefill and the model's decode step
are those of :mod:`jaxkv.nn.steps`.

* :func:`sample_n` / :func:`parallel_sample`: ``n`` independent samples of
  one prompt (vLLM's ``n > 1``). Row ``i`` draws from its own PRNG stream,
  ``fold_in(key(seed), i)`` split once per token, so a row's tokens do not
  depend on ``n`` or on the other rows. Finished rows free their blocks in
  the loop. The loop is :func:`jaxkv.nn.steps.decode_loop` (``generate``'s)
  with per-row keys.
* :func:`beam_search`: standard beam search over summed log-probabilities:
  each step keeps the best ``num_beams`` of the ``num_beams * vocab``
  continuations. A beam that continues another beam's parent gets that
  parent's KV by re-mapping rows inside the loop: the rows no beam continues
  are freed, the first child of each parent keeps the parent's row, and the
  other children are forked from it into the freed rows (block sharing, no
  copy; the next ``append_slots`` copies the shared last page). EOS handling
  follows Hugging Face: the top ``2 * num_beams`` candidates are scanned in
  order, an EOS candidate ranked within the first ``num_beams`` becomes a
  finished hypothesis scored ``sum_logprobs / generated_len ** length_penalty``
  (EOS counted), the best ``num_beams`` non-EOS candidates continue. It runs
  exactly ``max_new_tokens`` steps (no early stop), then the running beams
  join the finished hypotheses and the best ``num_beams`` are returned.

Models on the paged pool fork with :meth:`BlockSpaceManager.fork` (Llama
family, DeepSeek-V3: its MLA rows are blocks like any K/V). Hybrid-cache
models (gpt-oss, Gemma 3, Qwen3-Next, DeepSeek-V4) fork with
:meth:`KVCacheManager.fork`: every group's full blocks shared by reference,
a partly filled last block copied at once (not on the next write), and every
per-request state row copied (window rings, DeepSeek-V4's SWA and compressor
rings, Gated DeltaNet states: a state summarizes the whole prefix in one
tensor per slot, so it cannot be shared). Row ``b`` is request slot ``b +
1``; every row's slot is taken at the start and held to the end (a beam row
no beam continues is cleared with :meth:`KVCacheManager.clear` and forked
into).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv._ops import ceil_div, pow2_at_least
from jaxkv.errors import InvalidArgument, KVCacheOOM
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.manager.rows import slot_of
from jaxkv.nn.packed import cache_kind
from jaxkv.nn.sampling import GREEDY, SamplingParams
from jaxkv.nn.steps import (PROGRAM_OPTIONS, DecodeState, decode_logits, decode_loop, decode_step,
                            hybrid_prefill_chunk, prefill_chunk, start_decoding)
from jaxkv.pool.kv_pool import KVPool

__all__ = [
    "BeamOutput",
    "BeamState",
    "ParallelOutput",
    "ParallelState",
    "PromptSetup",
    "beam_loop",
    "beam_prefill",
    "beam_search",
    "beam_search_output",
    "parallel_loop",
    "parallel_sample",
    "parallel_step",
    "prefill_fork",
    "prefill_one",
    "sample_n",
    "sequence_keys",
    "setup_prompt",
]


# ------------------------------------------------------------------ helpers


def sequence_keys(seed: int, n: int) -> jax.Array:
    """The PRNG stream keys of rows ``0..n-1``: ``fold_in(key(seed), i)``.
    Each token of row ``i`` uses ``key, sub = split(key)`` and samples with
    ``sub``."""
    base = jax.random.key(seed)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n, dtype=jnp.uint32))


def prefill_one(graphdef, params, manager: BlockSpaceManager, pool: KVPool, prompt: Int[Array, "1 W"],
                length: Int[Array, ""]) -> tuple[BlockSpaceManager, KVPool, Float[Array, " V"], Bool[Array, ""]]:
    """Admit row 0 for the prompt and run it through the model; returns the
    manager, pool, the last prompt position's logits ``[V]`` and ``ok``.
    (A hybrid manager's rows are admitted already: row 0 is slot 1.)"""
    if pool is None:  # the manager holds its K/V: a hybrid cache
        row0 = slot_of(jnp.zeros((1,), jnp.int32))
        manager, last, ok = hybrid_prefill_chunk(graphdef, params, manager, row0, prompt,
                                                 jnp.reshape(length, (1,)).astype(jnp.int32))
        return manager, pool, last[0], ok
    row0 = jnp.zeros((1,), jnp.int32)
    lengths = jnp.reshape(length, (1,)).astype(jnp.int32)
    no_prefix = jnp.full((1, manager.max_blocks_per_seq), -1, jnp.int32)
    manager, ok = manager.admit_with_prefix(row0, no_prefix, lengths)
    pool, last = prefill_chunk(graphdef, params, manager, pool, row0, prompt, jnp.zeros((1,), jnp.int32), lengths)
    return manager, pool, last[0], ok


@dataclasses.dataclass(frozen=True)
class PromptSetup:
    """One prompt ready for :func:`prefill_fork` / :func:`beam_prefill`:
    ``padded [1, W]`` (``W`` a power of two), ``length`` (real tokens), a
    fresh ``manager`` with ``rows`` sequence rows and its ``pool`` of
    ``num_pages`` pages."""

    padded: jax.Array
    length: jax.Array
    manager: BlockSpaceManager
    pool: KVPool
    num_pages: int


def setup_prompt(model, prompt, rows: int, max_new_tokens: int, page_size: int,
                 num_pages: int | None = None) -> PromptSetup:
    """Check ``prompt`` and ``max_new_tokens`` (``InvalidArgument``) and build
    the :class:`PromptSetup` (default ``num_pages``: every row at full length,
    nothing shared)."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise InvalidArgument("the prompt must not be empty")
    if max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens={max_new_tokens}: must be >= 1")
    width = pow2_at_least(len(prompt))
    padded = np.zeros((1, width), np.int32)
    padded[0, : len(prompt)] = prompt
    if cache_kind(model) == "hybrid":
        if num_pages is not None:
            raise InvalidArgument("num_pages sizes the paged pool; a hybrid-cache model's cache holds every row at "
                                  "full length")
        manager = model.make_cache(rows, pow2_at_least(len(prompt) + max_new_tokens))
        manager, _, ok = manager.admit(rows, max_n=rows)  # row b is slot b + 1, held to the end
        if not bool(ok):
            raise KVCacheOOM(rows, manager.max_requests, manager.max_requests, unit="request slots")
        return PromptSetup(jnp.asarray(padded), jnp.asarray(len(prompt), jnp.int32), manager, None, 0)
    max_blocks = ceil_div(len(prompt) + max_new_tokens, page_size)
    if num_pages is None:
        num_pages = rows * max_blocks + 1
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=page_size,
                                       max_seqs=rows, max_blocks_per_seq=max_blocks)
    pool = model.make_pool(num_pages, page_size)
    return PromptSetup(jnp.asarray(padded), jnp.asarray(len(prompt), jnp.int32), manager, pool, num_pages)


def _out_of_blocks(manager, needed: int, what: str) -> KVCacheOOM:
    """The error of a failed prefill or decode: free and total blocks of the
    paged pool, or summed over a hybrid manager's groups."""
    free, total = manager.block_totals()
    groups = "" if manager.ROW_TABLES else f" (groups {list(manager.groups)})"
    return KVCacheOOM(needed, free, total, unit="blocks", detail=what + groups)


# --------------------------------------------------------- parallel sampling

#: The parallel-sampling loop carries :class:`jaxkv.nn.steps.DecodeState` with
#: one PRNG key per row; ``final_tables``/``final_lens`` keep each row's block
#: table and length as it finished (its blocks are freed then).
ParallelState = DecodeState


@partial(jax.jit, static_argnames=("graphdef", "max_new"), donate_argnums=(2, 3), compiler_options=PROGRAM_OPTIONS)
def prefill_fork(graphdef, params, manager: BlockSpaceManager, pool: KVPool, prompt, length, keys, eos_id,
                 sampling: SamplingParams = GREEDY, *, max_new: int) -> DecodeState:
    """Prefill ``prompt [1, W]`` (``length`` real tokens) once in row 0, fork
    row 0 into rows ``1..n-1`` (``n = len(keys)``) and sample each row's first
    token from the prompt's last logits with that row's key."""
    n = keys.shape[0]
    manager, pool, last_logits, ok = prefill_one(graphdef, params, manager, pool, prompt, length)
    if n > 1:
        manager, forked = manager.fork_rows(jnp.zeros((n - 1,), jnp.int32), jnp.arange(1, n, dtype=jnp.int32))
        ok &= forked
    logits = jnp.broadcast_to(last_logits, (n, last_logits.shape[-1]))
    return start_decoding(manager, pool, logits, keys, sampling, eos_id, max_new=max_new, ok=ok,
                          keep_final_tables=manager.ROW_TABLES)




#: One decode step of every running row (:func:`jaxkv.nn.steps.decode_step`).
parallel_step = decode_step
#: Decode until every row finished (:func:`jaxkv.nn.steps.decode_loop`).
parallel_loop = decode_loop


@dataclasses.dataclass
class ParallelOutput:
    """``tokens[i]``: the new tokens of sample ``i`` (EOS included when
    produced); ``state``: the final :class:`~jaxkv.nn.steps.DecodeState`."""

    tokens: list
    state: DecodeState


def parallel_sample(model, prompt, n: int, max_new_tokens: int, *, sampling: SamplingParams = GREEDY,
                    seed: int = 0, eos_token_id: int | None = None, page_size: int = 16,
                    num_pages: int | None = None) -> ParallelOutput:
    """:func:`sample_n` returning the final loop state as well."""
    if n < 1:
        raise InvalidArgument(f"n={n}: must be >= 1")
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {sampling!r}")
    setup = setup_prompt(model, prompt, n, max_new_tokens, page_size, num_pages)
    graphdef, params = nnx.split(model)
    eos_id = np.int32(-1 if eos_token_id is None else int(eos_token_id))
    state = prefill_fork(graphdef, params, setup.manager, setup.pool, setup.padded, setup.length,
                         sequence_keys(seed, n), eos_id, sampling, max_new=max_new_tokens)
    if not bool(state.ok):
        raise _out_of_blocks(state.manager, ceil_div(int(setup.length), page_size), "the prompt's prefill")
    state = decode_loop(graphdef, params, state, sampling)
    if not bool(state.ok):
        raise _out_of_blocks(state.manager, int(jnp.sum(state.blocked)), "decode ran out of KV blocks")
    tokens, counts = jax.device_get((state.tokens, state.num_generated))
    return ParallelOutput([tokens[i, : counts[i]].tolist() for i in range(n)], state)


def sample_n(model, prompt, n: int, max_new_tokens: int, *, sampling: SamplingParams = GREEDY,
             seed: int = 0, eos_token_id: int | None = None, page_size: int = 16,
             num_pages: int | None = None) -> list[list[int]]:
    """``n`` independent samples of up to ``max_new_tokens`` tokens after
    ``prompt`` (a token list). The prompt is prefilled once; its blocks are
    shared by all ``n`` rows through ``fork`` and copied on write. Row ``i``
    uses the PRNG stream of :func:`sequence_keys` (``seed``, ``i``). With
    ``temperature == 0`` all rows are the greedy continuation."""
    return parallel_sample(model, prompt, n, max_new_tokens, sampling=sampling, seed=seed,
                           eos_token_id=eos_token_id, page_size=page_size, num_pages=num_pages).tokens


# ------------------------------------------------------------- beam search

_NEG = -1e9  # score of the rows that do not hold a beam yet (as Hugging Face)


@struct.dataclass
class BeamState:
    """The carry of the beam-search loop (a pytree). Row ``r`` holds a beam:
    ``scores[r]`` its summed log-probability, ``tokens[r]`` its tokens
    (-1 past ``step``), ``logits[r]`` its next-token logits; ``active``
    marks rows holding blocks. ``hyp_*``: the best ``num_beams`` finished
    (EOS) hypotheses, ``hyp_scores`` length-normalized (-inf: empty slot)."""

    manager: BlockSpaceManager
    pool: KVPool
    logits: Float[Array, "beams vocab"]
    scores: Float[Array, " beams"]
    tokens: Int[Array, "beams max_new"]
    active: Bool[Array, " beams"]
    step: Int[Array, ""]
    eos_id: Int[Array, ""]
    length_penalty: Float[Array, ""]
    ok: Bool[Array, ""]
    hyp_tokens: Int[Array, "beams max_new"]
    hyp_lens: Int[Array, " beams"]
    hyp_scores: Float[Array, " beams"]


@partial(jax.jit, static_argnames=("graphdef", "num_beams", "max_new"), donate_argnums=(2, 3),
         compiler_options=PROGRAM_OPTIONS)
def beam_prefill(graphdef, params, manager: BlockSpaceManager, pool: KVPool, prompt, length, eos_id,
                 length_penalty, *, num_beams: int, max_new: int) -> BeamState:
    """Prefill the prompt once in row 0; row 0 holds the only live beam."""
    manager, pool, last_logits, ok = prefill_one(graphdef, params, manager, pool, prompt, length)
    b = num_beams
    return BeamState(
        manager, pool, jnp.broadcast_to(last_logits, (b, last_logits.shape[-1])),
        jnp.full((b,), _NEG, jnp.float32).at[0].set(0.0), jnp.full((b, max_new), -1, jnp.int32),
        jnp.arange(b) == 0, jnp.asarray(0, jnp.int32), jnp.asarray(eos_id, jnp.int32),
        jnp.asarray(length_penalty, jnp.float32), ok, jnp.full((b, max_new), -1, jnp.int32),
        jnp.zeros((b,), jnp.int32), jnp.full((b,), -jnp.inf, jnp.float32))


def _beam_select(state: BeamState):
    """One beam-search selection at step ``t = state.step``: returns the
    state with the hypotheses updated, and the new beams in rank order
    ``(scores [B], parents [B], tokens [B], histories [B, max_new])``."""
    b, v = state.logits.shape
    t = state.step
    logp = jax.nn.log_softmax(state.logits.astype(jnp.float32), axis=-1)
    cand = (state.scores[:, None] + logp).reshape(-1)
    values, index = jax.lax.top_k(cand, 2 * b)
    parent = (index // v).astype(jnp.int32)
    token = (index % v).astype(jnp.int32)
    rank = jnp.arange(2 * b)
    is_eos = token == state.eos_id
    histories = state.tokens[parent].at[:, t].set(token)  # [2B, max_new]
    # EOS within the top num_beams: a finished hypothesis (EOS counted in its length).
    gen_len = (t + 1).astype(jnp.float32)
    hyp_new = jnp.where(is_eos & (rank < b), values / gen_len ** state.length_penalty, -jnp.inf)
    pool_scores = jnp.concatenate([state.hyp_scores, hyp_new])
    keep_scores, keep = jax.lax.top_k(pool_scores, b)
    hyp_tokens = jnp.concatenate([state.hyp_tokens, histories])[keep]
    hyp_lens = jnp.concatenate([state.hyp_lens, jnp.full((2 * b,), t + 1, jnp.int32)])[keep]
    # The best num_beams non-EOS candidates continue (at most num_beams are EOS).
    chosen = jnp.argsort(jnp.where(is_eos, 2 * b, 0) + rank)[:b]
    state = state.replace(hyp_tokens=hyp_tokens, hyp_lens=hyp_lens, hyp_scores=keep_scores)
    return state, (values[chosen], parent[chosen], token[chosen], histories[chosen])


def _beam_rows(parents, active):
    """Rows of the new beams (rank order) given their parent rows: the first
    child of each parent keeps the parent's row; the other children take the
    rows no beam continues, in increasing order. Returns ``(rows, dropped,
    fork_src, fork_dst)`` (-1 padded)."""
    b = parents.shape[0]
    lane = jnp.arange(b)
    same = parents[:, None] == parents[None, :]
    first = jnp.sum(same & (lane[None, :] < lane[:, None]), axis=1) == 0
    is_parent = jnp.zeros((b,), bool).at[parents].set(True)
    spare = jnp.argsort(is_parent, stable=True)  # rows no beam continues first, ascending
    other = jnp.cumsum(~first) - 1
    rows = jnp.where(first, parents, spare[jnp.clip(other, 0, b - 1)])
    dropped = jnp.where(active & ~is_parent, lane, -1)
    return rows, dropped, jnp.where(first, -1, parents), jnp.where(first, -1, rows)


def _beam_body(graphdef, params, state: BeamState) -> BeamState:
    b = state.scores.shape[0]
    state, (scores, parents, tokens, histories) = _beam_select(state)
    rows, dropped, fork_src, fork_dst = _beam_rows(parents, state.active)
    manager, freed = state.manager.free_rows(dropped, keep=True)
    manager, forked = manager.fork_rows(fork_src, fork_dst)  # shares the parents' blocks
    last = jnp.zeros((b,), jnp.int32).at[rows].set(tokens)
    manager, pool, logits, _, appended = decode_logits(graphdef, params, manager, state.pool, last,
                                                       jnp.ones((b,), bool))  # CoW of shared last pages
    return state.replace(
        manager=manager, pool=pool, logits=logits,
        scores=jnp.zeros((b,), jnp.float32).at[rows].set(scores),
        tokens=jnp.zeros_like(state.tokens).at[rows].set(histories),
        active=jnp.ones((b,), bool), step=state.step + 1, ok=state.ok & freed & forked & appended)


@partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,), compiler_options=PROGRAM_OPTIONS)
def beam_loop(graphdef, params, state: BeamState):
    """Steps ``0 .. max_new-2`` in one ``lax.while_loop`` (select, re-map
    rows with free + fork, append_slots, decode), then the last selection;
    frees every row. Returns ``(state, (scores, tokens))`` of the running
    beams after the last step (rank order)."""
    max_new = state.tokens.shape[1]
    state = jax.lax.while_loop(lambda s: (s.step < max_new - 1) & s.ok,
                               lambda s: _beam_body(graphdef, params, s), state)
    state, (scores, _, _, histories) = _beam_select(state)
    manager, freed = state.manager.free_rows(jnp.where(state.active, jnp.arange(scores.shape[0]), -1), keep=False)
    return state.replace(manager=manager, ok=state.ok & freed), (scores, histories)


@dataclasses.dataclass
class BeamOutput:
    """``beams``: ``(tokens, score)`` best first; ``state``: the final
    :class:`BeamState` (every block freed)."""

    beams: list
    state: BeamState


def beam_search_output(model, prompt, num_beams: int, max_new_tokens: int, *, length_penalty: float = 1.0,
                       eos_token_id: int | None = None, page_size: int = 16,
                       num_pages: int | None = None) -> BeamOutput:
    """:func:`beam_search` returning the final loop state as well."""
    if num_beams < 1:
        raise InvalidArgument(f"num_beams={num_beams}: must be >= 1")
    if 2 * num_beams > model.config.vocab_size:
        raise InvalidArgument(f"num_beams={num_beams}: needs 2 * num_beams <= vocab_size")
    setup = setup_prompt(model, prompt, num_beams, max_new_tokens, page_size, num_pages)
    graphdef, params = nnx.split(model)
    eos_id = np.int32(-1 if eos_token_id is None else int(eos_token_id))
    state = beam_prefill(graphdef, params, setup.manager, setup.pool, setup.padded, setup.length, eos_id,
                         np.float32(length_penalty), num_beams=num_beams, max_new=max_new_tokens)
    if not bool(state.ok):
        raise _out_of_blocks(state.manager, ceil_div(int(setup.length), page_size), "the prompt's prefill")
    state, (scores, histories) = beam_loop(graphdef, params, state)
    if not bool(state.ok):
        raise _out_of_blocks(state.manager, 1, "beam search ran out of KV blocks")
    scores, histories, hyp_scores, hyp_tokens, hyp_lens = jax.device_get(
        (scores, histories, state.hyp_scores, state.hyp_tokens, state.hyp_lens))
    final = [(hyp_tokens[i, : hyp_lens[i]].tolist(), float(hyp_scores[i]))
             for i in range(num_beams) if np.isfinite(hyp_scores[i])]
    norm = float(max_new_tokens) ** float(length_penalty)
    final += [(histories[i].tolist(), float(scores[i]) / norm) for i in range(num_beams)]
    final.sort(key=lambda beam: -beam[1])  # stable: finished hypotheses first on ties
    return BeamOutput(final[:num_beams], state)


def beam_search(model, prompt, num_beams: int, max_new_tokens: int, *, length_penalty: float = 1.0,
                eos_token_id: int | None = None, page_size: int = 16,
                num_pages: int | None = None) -> list[tuple[list[int], float]]:
    """Beam search of ``max_new_tokens`` steps after ``prompt`` (a token
    list): ``num_beams`` ``(tokens, score)`` pairs, best first; ``score`` is
    the summed log-probability of the new tokens divided by
    ``len(tokens) ** length_penalty``. See the module docstring for the EOS
    rule. The prompt is prefilled once and shared by all beams."""
    return beam_search_output(model, prompt, num_beams, max_new_tokens, length_penalty=length_penalty,
                              eos_token_id=eos_token_id, page_size=page_size, num_pages=num_pages).beams
