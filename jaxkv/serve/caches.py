"""The cache contract the engine schedules over (one adapter per cache kind).

The engine (:mod:`jaxkv.serve.engine`) decides who runs; a cache owns every
device array of the model's KV state and the jitted steps that touch it. The
engine asks a cache only these questions, all on the host, in units the cache
defines:

* ``groups`` / ``capacity`` / :meth:`free_blocks`: the block groups (one for
  a paged pool; one per kind and ratio for a hybrid cache), how many blocks
  each can hand out and how many are free now (numpy ``[G]`` vectors: the
  engine adds and compares them group by group). The free counts are
  mirrored on the host (as is the row status): read with the results of
  the jitted call that changed them (one transfer), kept until the device
  state is replaced again, and checked against the device by
  :meth:`CacheBase.check_host_mirror`;
* :meth:`blocks_for` ``(num_tokens)``: the blocks a request holding that
  many tokens needs in each group; :meth:`peak_blocks` (the fit rule of
  ``add_request``) and :meth:`growth` (what admission and the running
  requests reserve), which count the same decode steps, a sliding window's
  trimming included (``window``, :meth:`decode_peak`, :meth:`held_blocks`;
  and their ``*_many`` forms over arrays of requests, equal row by row,
  with which the engine reserves for every running request at once);
  and :meth:`oom` to turn a shortfall into a ``KVCacheOOM`` naming the
  short group;
* :meth:`match` / :meth:`unpin` / :meth:`evict` / :meth:`can_evict`: what a
  cached prefix is made of (a :class:`PrefixHit`: tokens, blocks per group,
  the pinned node) and giving its blocks back under pressure (a cache
  without a prefix cache matches nothing and evicts nothing);
* :meth:`prefill` (admit rows and run their uncached tails, sampling each
  row's first token), :meth:`packed_step` (ONE jitted call over a packed
  stream of prompt pieces and decode tokens, :mod:`jaxkv.nn.packed`),
  :meth:`decode` (``decode_chunk`` steps in one jitted loop), :meth:`retire` (insert finished pages into the prefix cache, free
  rows), :meth:`swap_out` / :meth:`swap_in` (``can_swap`` False: the engine
  preempts by recomputation), :meth:`end_step` (what a packed step
  deferred: one call at its end), :meth:`row_status` (FREE / ON_DEVICE /
  SWAPPED per row, for the engine's bookkeeping check; mirrored on the host
  like the free counts);
* ``bytes_per_token``: KV bytes one token costs (per-request state apart);
  ``plan``: the :class:`~jaxkv.serve.sizing.CachePlan` the cache was built
  from (:func:`~jaxkv.serve.build.build_paged_cache` / :func:`~jaxkv.serve.build.build_hybrid_cache` apply the one
  sizing rule of :mod:`jaxkv.serve.sizing`), ``device_bytes()``: the bytes
  of every device array it holds now.

Sequence row ``r`` of the engine is row ``r`` of a :class:`PagedCache`'s
:class:`~jaxkv.BlockSpaceManager` and request slot :func:`slot_of` ``(r) =
r + 1`` (:mod:`jaxkv.manager.rows`, where the rule is written once) of a :class:`HybridCache`'s :class:`~jaxkv.KVCacheManager` (slot 0
is the manager's null slot; the manager admits the lowest free slot and the
engine the lowest free row; :meth:`begin_prefill` checks that they agree).

The adapters: :class:`~jaxkv.serve.paged_cache.PagedCache` (a paged pool
under a ``BlockSpaceManager``, ``cache_kind`` "paged") and
:class:`~jaxkv.serve.hybrid_cache.HybridCache` (a ``KVCacheManager``,
"hybrid"); :func:`jaxkv.serve.build.build_cache` picks one from the model. :class:`KVCache`
names the contract as a ``typing.Protocol``; :class:`CacheBase` is what the
adapters share (the chunked prefill loop and the decode chunk).

Sampling is per row: every jitted step takes one PRNG key per row and
returns it advanced only for the rows that ran, so a request's draws depend
on its own key alone (see :meth:`jaxkv.serve.Engine.add_request`'s ``seed``).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._ops import pow2_at_least
from jaxkv.errors import BookkeepingError, InvalidArgument, KVCacheOOM
from jaxkv.manager.block_space import FREE, ON_DEVICE, STATUS_NAMES, SWAPPED
from jaxkv.manager.rows import row_of, slot_of
from jaxkv.nn import sharding
from jaxkv.nn.packed import PackedBatch, PackedLane, host_arrays, write_lanes
from jaxkv.nn.penalties import seen_tokens
from jaxkv.nn.sampling import RowSampling, TokenLogprobs, row_rules, sample_with_logprobs, split_keys
from jaxkv.nn.speculative import SpecState, draft_catch_up, speculative_body
from jaxkv.nn.steps import PROGRAM_OPTIONS, DecodeState, run_decode
from jaxkv.serve import sizing
from jaxkv.serve.sizing import CachePlan

__all__ = ["CacheBase", "DecodeResult", "FREE", "KVCache", "ON_DEVICE", "PackedResult", "PrefillLane", "PrefixHit",
           "STATUS_NAMES", "SWAPPED", "apply_history_updates", "blocks_from_budget", "decode_chunk", "fetch",
           "fixed_ids", "keys_as_given", "logprob_entries", "pack_stream", "pow2_ids", "remembers_arguments",
           "row_of", "sample_first", "slot_of", "speculative_chunk", "typed_keys"]


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """What a cached prefix is made of: ``tokens`` served from the cache,
    ``blocks`` (one list per group) that go at the start of the request's
    tables, the pinned tree ``node`` (None: no prefix cache) and, for a
    hybrid cache, the ``snapshot`` of the per-request state at ``tokens``."""

    tokens: int
    blocks: tuple[list, ...]
    node: object = None
    snapshot: int = -1  # hybrid cache: the snapshot row holding the state at ``tokens``
    matched: int = 0  # hybrid cache: how far ``tokens`` agree with anything cached (token grain)
    copied: tuple = ()  # hybrid cache, per group: 1 when the hit's last block is partly filled (copied on attach)
    loads: tuple = ()  # hybrid cache, per group: blocks admission takes beyond the tokens' own (a host-tier hit)

    def block_counts(self) -> np.ndarray:
        """Blocks per group the request shares with the cache (a block
        copied on attach is the request's own)."""
        counts = np.asarray([len(b) for b in self.blocks], np.int64)
        return counts - np.asarray(self.copied, np.int64) if self.copied else counts

    def extra_blocks(self) -> np.ndarray | int:
        """Free blocks per group admitting this hit takes beyond its
        tokens' blocks less :meth:`block_counts` (a host-tier hit loaded
        into fresh blocks: the copy of its partly filled last block)."""
        return np.asarray(self.loads, np.int64) if self.loads else 0


@dataclasses.dataclass(frozen=True)
class PrefillLane:
    """One admitted request in a prefill batch: its sequence ``row``, its
    prefix ``hit``, every token it holds (``tokens``: prompt, plus the tokens
    generated before a recompute preemption), its PRNG key data and its
    prefix-cache namespace."""

    row: int
    hit: PrefixHit
    tokens: list
    key: np.ndarray
    namespace: object = None


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """A decode chunk's outcome on the host, per row: ``tokens[r, :count[r]]``
    generated, ``finished``, the rows' advanced key data ``keys``, whether
    every allocation succeeded (``ok``; else ``blocked`` marks the rows that
    needed blocks) and the most blocks in use at once (``peak``)."""

    tokens: np.ndarray
    count: np.ndarray
    finished: np.ndarray
    keys: np.ndarray
    ok: bool
    blocked: np.ndarray
    peak: int
    drafted: np.ndarray | None = None  # with speculation: draft tokens each row verified in the chunk,
    accepted: np.ndarray | None = None  # those it kept,
    steps: np.ndarray | None = None  # and the verify steps it ran
    logprobs: TokenLogprobs | None = None  # the tokens' log-probabilities ([B, W] entries), when asked for
    history: object = None  # with speculation: the rows' token histories, updated, on the device


@dataclasses.dataclass(frozen=True)
class PackedResult:
    """A packed step's outcome on the host, per lane (prefill lanes first,
    then decode lanes, in the order given): the ``tokens`` drawn (meaningful
    for the lanes that sample), the lanes' advanced key data ``keys``,
    whether the decode lanes grew (``decode_ok``; else they did not run and
    ``blocked`` marks those that needed blocks) and the blocks in use after
    it (``peak``)."""

    tokens: np.ndarray
    keys: np.ndarray
    decode_ok: bool
    blocked: np.ndarray
    peak: int
    # With verify lanes (speculation): tokens is [S, k + 1], lane s gave tokens[s, :counts[s]], after verifying
    # drafted[s] drafts and keeping accepted[s].
    counts: np.ndarray | None = None
    drafted: np.ndarray | None = None
    accepted: np.ndarray | None = None
    logprobs: TokenLogprobs | None = None  # the tokens' log-probabilities ([S] entries), when asked for
    scores: tuple | None = None  # prompt scoring: (TokenLogprobs, rank) of the scored tokens, in the order given
    history: object = None  # with verify lanes: the rows' token histories, updated, on the device



class _HashedGraphDef(nnx.GraphDef):
    """A :class:`flax.nnx.GraphDef` whose hash is computed once. Every
    jitted step takes the model's graph definition as a static argument,
    which ``jax.jit`` hashes on every call: flax recomputes it over every
    node each time, about 0.1 ms of host time per call for a small model
    (more per layer of an unscanned one), on every call of every
    iteration. Equal to another of its kind with the same fields (the
    programs of two engines of one model are shared), as a plain
    ``GraphDef`` is to a plain one."""

    __slots__ = ("_hash",)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return hashed_graphdef, (nnx.GraphDef(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}),)


def hashed_graphdef(graphdef: nnx.GraphDef) -> nnx.GraphDef:
    """``graphdef`` with its hash computed once (:class:`_HashedGraphDef`):
    what the engine and its drafts pass to their jitted steps."""
    if isinstance(graphdef, _HashedGraphDef):
        return graphdef
    out = object.__new__(_HashedGraphDef)
    for field in dataclasses.fields(graphdef):
        object.__setattr__(out, field.name, getattr(graphdef, field.name))
    object.__setattr__(out, "_hash", hash(graphdef))
    return out


@functools.cache
def _backend_is_cpu() -> bool:
    return jax.default_backend() == "cpu"


def fetch(tree):
    """``jax.device_get(tree)`` of a step's results, as numpy arrays (None
    leaves stay None). On the CPU backend the arrays already lie in host
    memory and each is read where it is (``device_get`` would first start
    an asynchronous host copy per leaf: about 20 us each on the 2-core
    development VM, for nothing to copy, a tenth of a 256-row iteration's
    host time); on an accelerator ``device_get`` starts every copy before
    waiting on one."""
    if not _backend_is_cpu():
        return jax.device_get(tree)
    return _read_in_place(tree)


def _read_in_place(node):
    """``jax.tree.map(np.asarray, node)`` for the CPU backend, with the
    trees the caches fetch (tuples and lists of arrays and None) walked
    here: in the step, ``jax.tree`` flattening and rebuilding cost about
    13 us a call, more than reading the arrays. Any other node goes to ``jax.tree.map``."""
    if node is None:
        return None
    if node.__class__ is tuple or node.__class__ is list:
        return node.__class__([_read_in_place(child) for child in node])
    if isinstance(node, (jax.Array, np.ndarray)):
        return np.asarray(node)
    return jax.tree.map(np.asarray, node)


def _typed(keys) -> bool:
    return jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)


def typed_keys(keys) -> jax.Array:
    """Inside a jitted step: typed PRNG keys from ``keys``, typed keys as
    given or key data (``uint32 [..., 2]``) wrapped. The caches pass key
    data and get key data back (:func:`keys_as_given`): the wrap and the
    unwrap are part of the step's one call, not two more dispatches per
    iteration."""
    return keys if _typed(keys) else jax.random.wrap_key_data(keys)


def keys_as_given(keys, given):
    """Inside a jitted step: the typed ``keys`` in the form ``given`` came
    in (typed keys, or their key data)."""
    return keys if _typed(given) else jax.random.key_data(keys)


def fixed_ids(ids, size: int) -> np.ndarray:
    """``ids`` padded with -1 to ``size`` (one compiled shape per call site)."""
    out = np.full((size,), -1, np.int32)
    out[: len(ids)] = ids
    return out


def pow2_ids(ids) -> np.ndarray:
    """``ids`` padded with -1 to a power of two (few compiled shapes)."""
    return fixed_ids(list(ids), pow2_at_least(max(len(ids), 1)))


def pack_stream(prefill: list[PackedLane], decode_seq_ids, decode_tokens, decode_positions, *, num_lanes: int,
                num_tokens: int, num_prefill_lanes: int, max_prefill_len: int, decode_widths=None,
                scored=None) -> PackedBatch:
    """:func:`jaxkv.nn.packed.pack` of the lanes ``prefill`` followed by one
    decode lane ``PackedLane(decode_seq_ids[j], [decode_tokens[j]],
    decode_positions[j])`` per entry of the decode arrays, with ``num_prefill
    = len(prefill)``: the same batch (same checks, same values), the decode
    lanes (one per running request) written with array operations instead
    of a loop. Its arrays are numpy arrays: the jitted step takes them as
    its arguments (one transfer in its dispatch, not one call per array).
    ``decode_widths`` (default all 1): a decode lane of width ``w > 1`` is
    a speculative verify lane: its token, then ``w - 1`` placeholder
    tokens (0) at the following positions, which the device fills with
    drafts (:func:`jaxkv.nn.speculative.paged_packed_verify_step`).
    ``scored`` (prompt scoring): ``(prefill lane, offsets, next tokens)``
    per lane whose tokens at those offsets of its piece are scored
    (``PackedBatch.scored``, padded to a power of two with index 0)."""
    num_prefill = len(prefill)
    decode_tokens = np.asarray(decode_tokens, np.int64).reshape(-1)
    decode_positions = np.asarray(decode_positions, np.int64).reshape(-1)
    decode_seq_ids = np.asarray(decode_seq_ids, np.int64).reshape(-1)
    num_decode = decode_tokens.size
    widths = None if decode_widths is None else np.asarray(decode_widths, np.int64).reshape(-1)
    if widths is None and max_prefill_len < 1:  # no lane of the prefill class takes a token: the checks below say so
        widths = np.ones((num_decode,), np.int64)
    if not 0 <= num_prefill <= num_prefill_lanes:
        raise InvalidArgument(f"num_prefill={num_prefill} must be in [0, num_prefill_lanes={num_prefill_lanes}]")
    if num_prefill + num_decode > num_lanes:
        raise InvalidArgument(f"{num_prefill + num_decode} lanes for a batch of {num_lanes}")
    total = sum(len(lane.tokens) for lane in prefill) + (num_decode if widths is None else int(widths.sum()))
    if total > num_tokens:
        raise InvalidArgument(f"the lanes bring {total} tokens, more than the batch's {num_tokens}")
    arrays = host_arrays(num_lanes, num_tokens)
    token_ids, positions, token_lanes, cu, kv_lens, seq_ids, sample = arrays
    at = write_lanes(prefill, arrays, num_prefill_lanes=num_prefill_lanes, max_prefill_len=max_prefill_len)
    if num_decode:
        lanes = np.arange(num_prefill, num_prefill + num_decode)
        if widths is None:  # one token per lane, the common case: written as they are, no per-token expansion
            span = slice(at, at + num_decode)
            token_ids[span], positions[span], token_lanes[span] = decode_tokens, decode_positions, lanes
            ends = np.arange(1, num_decode + 1)
            kv_lens[lanes] = decode_positions + 1
        else:
            # A decode-class lane brings one token, or a verify lane's k + 1 (the step views that class at its
            # widest: jaxkv.nn.speculative.hybrid_packed_verify_step).
            bounds = np.where(lanes < num_prefill_lanes, max_prefill_len, widths.max())
            if (widths > bounds).any():  # a lane over its class's bound
                j = int(np.flatnonzero(widths > bounds)[0])
                raise InvalidArgument(f"lane {lanes[j]} brings {widths[j]} tokens; lanes of its class take at most "
                                      f"{bounds[j]} ({num_prefill_lanes} prefill lanes of {max_prefill_len})")
            ends = np.cumsum(widths)
            entry = np.repeat(np.arange(num_decode), widths)  # the decode entry of each token
            offset = np.arange(int(ends[-1])) - (ends - widths)[entry]
            span = slice(at, at + int(ends[-1]))
            token_ids[span] = np.where(offset == 0, decode_tokens[entry], 0)
            positions[span] = decode_positions[entry] + offset
            token_lanes[span] = lanes[entry]
            kv_lens[lanes] = decode_positions + widths
        seq_ids[lanes] = decode_seq_ids
        sample[lanes] = True
        cu[lanes + 1] = at + ends
        at += int(ends[-1])
    cu[num_prefill + num_decode + 1:] = at
    index = targets = None
    if scored:  # (prefill lane, token offsets in its piece, next tokens): stream indices, a power-of-two count
        index = np.concatenate([cu[lane] + np.asarray(offsets, np.int64) for lane, offsets, _ in scored])
        targets = np.concatenate([np.asarray(t, np.int64) for _, _, t in scored])
        width = pow2_at_least(len(index))
        index = np.pad(index, (0, width - len(index))).astype(np.int32)
        targets = np.pad(targets, (0, width - len(targets))).astype(np.int32)
    return PackedBatch(token_ids=token_ids, positions=positions, token_lanes=token_lanes, cu_q_lens=cu,
                       kv_lens=kv_lens, seq_ids=seq_ids, sample=sample, num_prefill=np.asarray(num_prefill, np.int32),
                       scored=index, scored_targets=targets, num_prefill_lanes=int(num_prefill_lanes),
                       max_prefill_len=int(max_prefill_len))



def sample_first(last_logits, keys, sampling: RowSampling):
    """The first token of each lane, drawn as ``start_decoding`` draws it
    (one split of the lane's key), the advanced keys, and the tokens'
    log-probabilities when ``sampling`` asks for them (else None)."""
    keys, subs = split_keys(keys)
    tokens, logprobs = sample_with_logprobs(row_rules(last_logits, sampling), subs, sampling)
    return tokens, keys, logprobs


def logprob_entries(logprobs: TokenLogprobs | None, index, count: int) -> list | None:
    """Host log-probabilities (numpy :class:`~jaxkv.nn.sampling.TokenLogprobs`)
    of ``count`` tokens at ``index`` (a lane, or a row whose tokens run
    along the next axis), as the engine records them per token:
    ``(logprob, ((token id, logprob), ...))`` with every top entry the call
    computed (the request keeps as many as it asked). None without."""
    if logprobs is None:
        return None
    token, ids, top = logprobs.token[index], logprobs.top_ids[index], logprobs.top[index]
    if token.ndim == 0:
        token, ids, top = token[None], ids[None], top[None]
    return [(float(token[i]), tuple(zip(ids[i].tolist(), top[i].tolist()))) for i in range(count)]



@partial(jax.jit, static_argnames=("graphdef", "num_steps", "scrub"), donate_argnums=(2, 3),
         compiler_options=PROGRAM_OPTIONS)
def decode_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                 sampling: RowSampling, keys, *, num_steps: int, scrub: bool = False) -> DecodeState:
    """The engine's decode chunk (a paged cache's; the benchmarks time it).
    Up to ``num_steps`` decode steps of the rows ``active`` in one
    ``lax.while_loop`` (:func:`jaxkv.nn.steps.run_decode`); rows stay
    allocated when they finish (the engine retires them). Stops early when
    no row runs or an allocation fails (``ok`` False; ``blocked`` marks the
    rows that needed blocks). ``scrub``: blocks a sliding window frees are
    zeroed in the step that frees them (:mod:`jaxkv.pool.scrub`)."""
    penalties, seen = getattr(sampling, "penalties", None), None  # a SamplingParams has neither field
    if penalties is not None:
        seen = seen_tokens(penalties, nnx.merge(graphdef, params).config.vocab_size)
    constraints = getattr(sampling, "constraints", None)
    state = DecodeState.create(manager.in_step(), pool, last=last, finished=~active,
                               num_generated=num_generated, max_new=max_new, eos_id=eos_id, keys=typed_keys(keys),
                               width=num_steps, top_logprobs=getattr(sampling, "logprobs", -1), seen=seen,
                               grammar=None if constraints is None else constraints.state)
    state = run_decode(graphdef, params, state, sampling, num_steps=num_steps, free_finished=False, scrub=scrub)
    return state.replace(keys=keys_as_given(state.keys, keys))


def apply_history_updates(history, updates):
    """``history`` with ``updates`` (``(rows, columns, tokens)``, None:
    none) written; rows out of range (padding) are dropped."""
    if updates is None:
        return history
    rows, columns, tokens = updates
    return jnp.asarray(history).at[rows, columns].set(tokens, mode="drop")


@partial(jax.jit, static_argnames=("graphdef", "num_steps", "config", "scrub", "draft_graphdef"),
         donate_argnums=(2, 3, 11, 16, 17), compiler_options=PROGRAM_OPTIONS)
def speculative_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                      sampling: RowSampling, keys, history, history_len, speculate, steps, draft_params=None,
                      draft_manager=None, draft_pool=None, draft_reset=None, catch_up=None, history_updates=None, *,
                      num_steps: int, config, scrub: bool = False, draft_graphdef=None) -> SpecState:
    """The engine's decode chunk with speculation (a paged cache's): up to
    ``num_steps`` verify steps (:func:`jaxkv.nn.speculative.speculative_body`,
    ``config.num_speculative_tokens`` drafts each) of the rows ``active`` in
    one ``lax.while_loop``; rows stay allocated when they finish. A row
    drafts from ``history[r, :history_len[r]]`` (its prompt and output, the
    last being ``last[r]``) when ``speculate[r]``, else decodes one token
    per step (``history`` donated, ``history_updates`` written into it
    first: :func:`apply_history_updates`; the result's ``history`` has the
    rows' emitted tokens appended at ``history_len``); with
    ``draft_graphdef`` / ``draft_params`` the drafts are
    that model's instead: an early exit that shares the pool
    (``early_exit_draft(..., share_pool=True)``), or, with
    ``draft_manager`` / ``draft_pool`` (donated), a separate model over its
    own paged cache, whose rows ``draft_reset`` are emptied and which is
    first fed the packed batch ``catch_up`` (None: nothing;
    :func:`~jaxkv.nn.speculative.draft_catch_up`; a failed catch-up sets
    ``ok`` False and runs no step). Runs ``steps`` (traced, at most
    ``num_steps``) verify steps; stops early as :func:`decode_chunk` does."""
    width = num_steps * (config.num_speculative_tokens + 1)
    state = DecodeState.create(manager.in_step(), pool, last=last, finished=~active,
                               num_generated=num_generated, max_new=max_new, eos_id=eos_id, keys=typed_keys(keys),
                               width=width)
    draft = {}
    if draft_manager is not None:
        draft_manager, draft_pool, caught_up = draft_catch_up(draft_graphdef, draft_params, draft_manager, draft_pool,
                                                              draft_reset, catch_up)
        state = state.replace(ok=state.ok & caught_up)
        draft = dict(draft_manager=draft_manager, draft_pool=draft_pool)
    zeros = jnp.zeros(last.shape, jnp.int32)
    spec = SpecState(decode=state, history=apply_history_updates(history, history_updates), history_len=history_len,
                     drafted=zeros, accepted=zeros, steps=zeros, **draft)
    stop_at = state.step + jnp.minimum(steps, num_steps)
    spec = jax.lax.while_loop(
        lambda s: jnp.any(~s.decode.finished) & s.decode.ok & (s.decode.step < stop_at),
        lambda s: speculative_body(graphdef, params, s, sampling, config, free_finished=False, scrub=scrub,
                                   speculate=speculate, draft_graphdef=draft_graphdef, draft_params=draft_params),
        spec)
    return spec.replace(decode=spec.decode.replace(keys=keys_as_given(spec.decode.keys, keys)))


def remembers_arguments(init):
    """Decorate an adapter's ``__init__`` so that :meth:`CacheBase.rebuilt`
    can build the same cache again (the arguments are kept as given)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        self._fresh = functools.partial(type(self), *args, **kwargs)
        init(self, *args, **kwargs)

    return wrapper


class CacheBase(abc.ABC):
    """What both caches share: the fixed-width chunked prefill loop and the
    decode chunk; subclasses supply the per-chunk jitted call."""

    max_seqs: int
    prefill_width: int
    groups: tuple[str, ...]
    capacity: np.ndarray
    window: int | None = None  # every layer's sliding window, when decode trims blocks out of it
    #: Zero every block (and reset every state row) in the jitted call that frees it (:mod:`jaxkv.pool.scrub`).
    scrub: bool = False
    #: Tokens a row may hold past its request's end for a moment (a speculative verify step's rejected
    #: drafts): counted in every request's peak and reserve.
    lookahead: int = 0

    # ------------------------------------------------------------ host mirror
    # The device bookkeeping (``manager``) is replaced, never changed in place,
    # by every call that changes it. Assigning it drops the host's copy of its
    # free counts and row status; the calls that change it read them again in
    # the same transfer as their results (``_host_leaves``, ``_mirror``), and
    # ``free_blocks`` / ``row_status`` read the device only when the last
    # change did not (e.g. a swap). So the scheduler's questions between two
    # device calls cost no device read.
    #
    # A cache may put a change off to fold it into its next step's call
    # (``_deferred``, its arguments: PagedCache's admission, taken by its
    # packed step). The host mirror then holds what the change will make,
    # exactly; reading ``manager`` makes the change first
    # (``_run_deferred``), so no reader sees the state before it.

    _deferred = None  # the deferred change's arguments, or None

    @property
    def manager(self):
        if self._deferred is not None:
            self._run_deferred()
        return self._manager

    def _run_deferred(self) -> None:
        """Make the deferred change now, in a call of its own (a cache that
        defers a change says how)."""
        raise BookkeepingError(f"{type(self).__name__} deferred a change it cannot make: {self._deferred!r}")

    @manager.setter
    def manager(self, value) -> None:
        self._manager = value
        self._host = self._host_tables = None

    @abc.abstractmethod
    def _host_leaves(self, manager) -> tuple:
        """The device arrays of ``manager`` the host mirrors, to read with a
        call's results: ``(free blocks per group [scalars], the row status's
        source)``; each adapter says which."""

    def _mirror(self, leaves) -> None:
        """Mirror :meth:`_host_leaves` of the ``manager`` just assigned, as
        read on the host (with a call's results)."""
        free, status = leaves
        self._host = (np.asarray(free, np.int64).reshape(-1), np.asarray(status))

    def _host_view(self) -> tuple:
        if self.__dict__.get("_host") is None:
            self._mirror(fetch(self._host_leaves(self._manager)))
        return self._host

    def free_blocks(self) -> np.ndarray:
        """Free blocks per group now (the host's mirror)."""
        return self._host_view()[0].copy()

    def row_status(self) -> np.ndarray:
        """FREE / ON_DEVICE / SWAPPED per sequence row (the host's mirror)."""
        return self._status_from(self._host_view()[1])

    @abc.abstractmethod
    def _status_from(self, source: np.ndarray) -> np.ndarray:
        """The row status from its source array (:meth:`_host_leaves`); each
        adapter says how."""

    def check_host_mirror(self) -> None:
        """``BookkeepingError`` (with the numbers) when the host's mirror of
        the free counts or the row status disagrees with the device (a
        debug check: :meth:`~jaxkv.serve.Engine.check_bookkeeping` calls
        it)."""
        if self._deferred is not None:  # the mirror holds what it will make: compare after it
            self._run_deferred()
        mirror = self.__dict__.get("_host")
        if mirror is None:
            return
        free, status = fetch(self._host_leaves(self._manager))
        free, status = np.asarray(free, np.int64).reshape(-1), np.asarray(status)
        if not np.array_equal(mirror[0], free):
            raise BookkeepingError(f"the host's free-block counts {mirror[0].tolist()} disagree with the device's "
                                   f"{free.tolist()} (groups {list(self.groups)})")
        if not np.array_equal(mirror[1], status):
            raise BookkeepingError(f"the host's row status {self._status_from(mirror[1]).tolist()} disagrees with the "
                                   f"device's {self._status_from(status).tolist()}")

    def place_on(self, mesh) -> None:
        """Put the device state on ``mesh`` (:mod:`jaxkv.nn.sharding`: heads
        over ``tp``, bookkeeping replicated; in every process of a
        multi-process run alike). The host tiers (swap, host prefix pages)
        keep single-device placements, so they are refused on a mesh."""
        tiers = self._host_tiers()
        if tiers:
            raise InvalidArgument(f"{', '.join(tiers)}: a host tier is not available on a mesh yet (its pages are "
                                  "placed per device); leave it out with mesh=")
        if self.pool is not None:
            self.pool = sharding.shard_cache(self.pool, mesh)
            self.manager = sharding.replicate(self.manager, mesh)
        else:
            self.manager = sharding.shard_cache(self.manager, mesh)

    def _host_tiers(self) -> list[str]:  # the options that gave this cache a host tier
        return []

    def rebuilt(self) -> "CacheBase":
        """A new, empty cache of this one's sizes and options (its ``plan``
        and ``lookahead`` kept; isolation, events and mesh placement are the caller's to apply
        again), built after this one has let go of every array it held, so
        the device never holds both: the engine's way back from a step that
        failed part-way (:meth:`jaxkv.serve.Engine.step`), whatever state
        the failure left here. This object is unusable afterwards."""
        fresh, plan, lookahead = self._fresh, self.plan, self.lookahead
        self.__dict__.clear()  # a failed step's traceback may still reference this object: drop its arrays
        cache = fresh()
        cache.plan, cache.lookahead = plan, lookahead
        return cache

    def isolate(self, *, scrub_on_free: bool = False, prefix_quota: float | None = None) -> None:
        """Tenant isolation (the engine's options of the same names):
        ``scrub_on_free`` zeroes every block and resets every state row in
        the jitted call that frees it (:mod:`jaxkv.pool.scrub`);
        ``prefix_quota`` (a fraction in (0, 1]) caps the share of each
        block group (and of the snapshot rows) one owner's cached prefixes
        may hold (:func:`~jaxkv.prefix.radix.owner_key`: a tenant's salts
        count as one), and makes eviction take from owners over their fair
        share first (:meth:`_set_quota`)."""
        self.scrub = bool(scrub_on_free)
        if prefix_quota is not None:
            quota = float(prefix_quota)
            if not 0.0 < quota <= 1.0:
                raise InvalidArgument(f"prefix_quota={prefix_quota!r}: a fraction in (0, 1] of each block group "
                                      "one tenant's cached prefixes may hold")
            self._set_quota(quota)

    def _set_quota(self, quota: float) -> None:
        self.prefix_cache.set_quota(max(1, int(quota * int(self.capacity[0]))))

    def take_events(self) -> list:
        """Events of the cache's own beyond its prefix tree's (a hybrid
        cache's snapshot records); none here."""
        return []

    # ------------------------------------------------------- block arithmetic
    # What a request costs, per group. The engine's fit rule (add_request) is
    # ``peak_blocks``; admission and the running requests' reserve are
    # ``growth``; both count the same steps, so a request the rule accepts is
    # admitted on an empty engine.

    def decode_peak(self, first: int, last: int) -> np.ndarray:
        """The most blocks a row holds at once while decode steps append
        positions ``first .. last - 1`` (zeros when ``last <= first``)."""
        return self.blocks_for(last) if last > first else np.zeros(len(self.groups), np.int64)

    def held_blocks(self, num_tokens: int) -> np.ndarray:
        """The fewest blocks a decoding row of ``num_tokens`` tokens holds."""
        return self.blocks_for(num_tokens)

    def peak_blocks(self, prompt_len: int, total: int) -> np.ndarray:
        """The most blocks a request of ``prompt_len`` prompt tokens holds at
        once on its way to ``total`` tokens (the prompt's, prefilled whole,
        or a decode step's); ``add_request`` refuses a request whose peak
        exceeds a group's capacity."""
        return np.maximum(self.blocks_for(prompt_len), self.decode_peak(prompt_len, total + self.lookahead))

    def first_blocks(self) -> np.ndarray:
        """Per row, the first block of its table, -1 once a sliding window
        trimmed it away (the engine then unpins the row's hit). Without a
        window (``window`` None) nothing is trimmed: zeros."""
        return np.zeros((self.max_seqs,), np.int64)

    def can_evict(self) -> bool:
        """Whether the prefix cache holds a page it could evict now."""
        return self.prefix_cache.evictable_blocks > 0

    def fork_hit(self, row: int, num_tokens: int) -> PrefixHit | None:
        """A hit on row ``row``'s own first ``num_tokens`` tokens (a
        sibling forking it, :meth:`Engine.add_request`'s ``fork_of``),
        admitted as a prefix hit is; None when this cache has no such hit
        (a hybrid cache's siblings take the state it snapshots at their
        cut, through its prefix cache)."""
        return None

    def growth(self, num_tokens: int, steps: int, held: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """Free blocks a row may still take over its next ``steps`` decode
        steps: it holds ``num_tokens`` tokens in ``held`` blocks, ``shared``
        of them a prefix hit's (the prefix cache holds those blocks too).
        Without trimming the hit's blocks stay in the table, so this is
        ``blocks_for(num_tokens + steps) - held``."""
        return np.maximum(self.blocks_for(num_tokens + steps) - held, 0)

    # The same arithmetic over many requests at once (``num_tokens`` and
    # ``steps``: int arrays ``[n]``; ``held`` and ``shared``: ``[n, G]``;
    # results ``[n, G]``), equal row by row to the methods above: the
    # engine's reserve over every running request costs array operations,
    # not a call per request.

    def blocks_for_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """:meth:`blocks_for` of each entry of ``num_tokens``."""
        out = np.zeros((len(num_tokens), len(self.groups)), np.int64)
        for i, n in enumerate(np.asarray(num_tokens).tolist()):
            out[i] = self.blocks_for(n)
        return out

    def held_blocks_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """:meth:`held_blocks` of each entry of ``num_tokens``."""
        return self.blocks_for_many(num_tokens)

    def decode_peak_many(self, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        """:meth:`decode_peak` of each pair ``(first[i], last[i])``."""
        return np.where((np.asarray(last) > np.asarray(first))[:, None], self.blocks_for_many(last), 0)

    def growth_many(self, num_tokens: np.ndarray, steps: np.ndarray, held: np.ndarray,
                    shared: np.ndarray) -> np.ndarray:
        """:meth:`growth` of each request."""
        return np.maximum(self.blocks_for_many(np.asarray(num_tokens) + np.asarray(steps)) - held, 0)

    def key_array(self, key_data: list | np.ndarray) -> np.ndarray:
        """Key data ``[max_seqs, ...]`` from per-lane key data (idle lanes,
        None: zeros), or that array itself: what every jitted step takes and
        gives back (:func:`typed_keys`)."""
        if isinstance(key_data, np.ndarray):
            return key_data
        data = np.zeros((self.max_seqs, *self._key_shape), np.uint32)
        for lane, key in enumerate(key_data):
            if key is not None:
                data[lane] = key
        return data

    _key_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape  # no backend at import

    def begin_prefill(self, lanes: list[PrefillLane]) -> None:
        """Admit ``lanes``: take their rows, start hits from their cached
        prefixes and give every row the blocks its whole prompt needs, so
        no prefill step can run out of blocks (all or nothing; the engine
        checked the blocks: ``BookkeepingError`` otherwise)."""
        self._begin_prefill(lanes)

    def pieces(self, lane: PrefillLane, width: int | None = None) -> list[tuple[int, int]]:
        """``(start, end)`` token ranges that prefill ``lane`` in order: from
        its hit to its end on a grid of ``width`` tokens (at most
        ``prefill_width``), also cut at :meth:`_cuts`."""
        width = min(width or self.prefill_width, self.prefill_width)
        ends = sorted({*range(lane.hit.tokens + width, len(lane.tokens), width),
                       *(c for c in self._cuts(lane) if lane.hit.tokens < c < len(lane.tokens)), len(lane.tokens)})
        return list(zip([lane.hit.tokens, *ends[:-1]], ends))

    def prefill_step(self, graphdef, params, batch: list[tuple[PrefillLane, tuple[int, int]]],
                     sampling: RowSampling):
        """ONE jitted call prefilling lane ``i``'s piece ``batch[i][1]``
        (pieces of one lane in order, after :meth:`begin_prefill`) and
        sampling a token from its last position. Returns ``(sampled [n],
        key data [n, ...] advanced by that draw, blocks in use, logprobs)``
        (``logprobs``: the tokens' host :class:`TokenLogprobs` when
        ``sampling`` asks for them, else None): a lane's first token and key
        are those of the call with its last piece."""
        width = self.prefill_width
        starts = np.zeros((self.max_seqs,), np.int32)
        num_new = np.zeros((self.max_seqs,), np.int32)
        tokens = np.zeros((self.max_seqs, width), np.int32)
        for i, (lane, (start, end)) in enumerate(batch):
            starts[i], num_new[i] = start, end - start
            tokens[i, : end - start] = lane.tokens[start:end]
        lanes = [lane for lane, _ in batch]
        sampled, keys, used, logprobs = self._prefill_call(graphdef, params, lanes, starts, num_new, tokens,
                                                           sampling, self.key_array([lane.key for lane in lanes]))
        return sampled[: len(batch)], keys[: len(batch)], used, logprobs

    def _cuts(self, lane: PrefillLane) -> list[int]:
        return []

    #: Whether :meth:`packed_step` takes speculative verify lanes (a paged pool's does).
    packs_verify_lanes = False

    def packed_step(self, graphdef, params, prefill: list[tuple[PrefillLane, tuple[int, int]]],
                    decode: list[tuple[int, int, int]] | np.ndarray, sampling: RowSampling,
                    key_data: list | np.ndarray, num_tokens: int, prefill_width: int | None = None,
                    speculation=None, scored=None) -> PackedResult:
        """ONE jitted call for a scheduler iteration: the prefill pieces
        ``prefill`` (lane, ``(start, end)``; pieces of one lane in order,
        after :meth:`begin_prefill`; a piece that ends the lane's tokens
        samples its first token) and the decode tokens ``decode`` (``(row,
        token, position)`` per entry, or those rows as an ``[n, 3]`` array:
        each row grows by one token, all or nothing), packed end to end into
        a stream of ``num_tokens`` (a bucket). Lane ``i`` of ``sampling`` /
        ``key_data`` (:meth:`key_array`'s) is ``prefill[i]``, then the
        decode rows in order. ``prefill_width``: the longest piece this step
        may carry (:meth:`prefill_lane_cap`; default ``num_tokens``).
        ``speculation`` (caches with :attr:`packs_verify_lanes`): ``(config,
        (history, updates), history_len, verify, draft)``, ``verify`` a bool
        per decode entry: those rows are verify lanes of ``k + 1`` tokens
        (drafts found on the device from the history, or drawn by
        ``draft``, an early exit's ``(graphdef, params)``, over a paged
        pool; the result then has their tokens and counts). ``scored``: prompt tokens to score (:func:`pack_stream`'s;
        the result's ``scores`` then has them, in that order)."""
        lanes = [PackedLane(self._seq_id(lane.row), lane.tokens[start:end], start, end == len(lane.tokens))
                 for lane, (start, end) in prefill]
        rows, tokens, positions = np.asarray(decode, np.int64).reshape(-1, 3).T
        if speculation is not None and not self.packs_verify_lanes:
            raise InvalidArgument(f"{type(self).__name__} packs no speculative verify lanes")
        result = self._packed_call(graphdef, params, lanes, (self._seq_ids(rows), tokens, positions), sampling,
                                   self.key_array(key_data), num_tokens, want_tables=self._wants_tables(prefill),
                                   prefill_width=min(num_tokens, prefill_width or num_tokens),
                                   **({} if speculation is None else {"speculation": speculation}),
                                   **({} if not scored else {"scored": scored}))
        self._after_prefill([lane for lane, _ in prefill], [start for _, (start, _) in prefill],
                            [end - start for _, (start, end) in prefill], defer=True)
        return result

    def prefill_lane_cap(self, num_prefill: int, budget: int) -> int:
        """The most tokens one prefill lane may bring to a packed step of
        ``num_prefill`` prefill lanes within ``budget`` tokens: the budget
        (a hybrid cache with Gated DeltaNet layers caps it: :class:`HybridCache`)."""
        return budget

    def _after_prefill(self, lanes: list[PrefillLane], starts, num_new, defer: bool = False) -> None:
        """Host bookkeeping after prefill pieces ran (a hybrid cache's
        snapshots; ``defer``: device work may wait for :meth:`end_step`)."""

    def end_step(self) -> None:
        """Device work a packed step deferred (:meth:`_after_prefill`) and
        its retirement did not do; the scheduler calls it at the end of
        every packed step."""

    def _wants_tables(self, prefill: list[tuple[PrefillLane, tuple[int, int]]]) -> bool:
        """Whether :meth:`_after_prefill` will read the block tables after
        these pieces ran (then the packed call reads them with its results)."""
        return False

    def _seq_id(self, row: int) -> int:
        return row

    def _seq_ids(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`_seq_id` of each of ``rows`` (int array)."""
        return rows

    def decode(self, graphdef, params, last, active, num_generated, max_new, eos_id, sampling: RowSampling,
               key_data: list, num_steps: int, speculation=None) -> DecodeResult:
        """``num_steps`` decode steps of the rows ``active`` in one jitted
        loop; finished rows stay allocated until :meth:`retire`. ``key_data``:
        per row, its key data (None: idle), or :meth:`key_array` of that.
        ``speculation``: ``(config, (history, updates), history_len,
        speculate, steps, draft)``: ``steps`` verify steps instead (:func:`speculative_chunk`;
        ``draft`` a :mod:`jaxkv.serve.drafts` draft (its plan made) or None;
        the result then says how many drafts each row verified and kept)."""
        manager, pool = self._decode_view()
        drafted = accepted = steps = draft_lengths = history = draft = None
        if speculation is not None and (getattr(sampling, "logprobs", -1) >= 0
                                        or getattr(sampling, "penalties", None) is not None
                                        or getattr(sampling, "constraints", None) is not None):
            raise InvalidArgument("log-probabilities, penalties and constraints are computed by plain decode chunks "
                                  "(the scheduler runs one while a request asks for them), not by speculative ones")
        keys = self.key_array(key_data)
        if speculation is None:
            state = decode_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                                 sampling, keys, num_steps=num_steps, scrub=self.scrub)
        else:
            config, (history, updates), history_len, speculate, steps, draft = speculation
            draft_args, draft_graphdef = (None,) * 5, None
            if draft is not None:
                draft_args, draft_graphdef = draft.chunk_arguments()
            spec = speculative_chunk(graphdef, params, manager, pool, last, active, num_generated, max_new, eos_id,
                                     sampling, keys, history, history_len, speculate,
                                     np.int32(steps), *draft_args, updates, num_steps=num_steps, config=config,
                                     scrub=self.scrub, draft_graphdef=draft_graphdef)
            state, drafted, accepted, steps = spec.decode, spec.drafted, spec.accepted, spec.steps
            history = spec.history
            draft_lengths = None if draft is None else draft.lengths(spec)
        self._decode_done(state.manager, state.pool)
        out, count, finished, ok, blocked, peak, keys, host, drafted, accepted, steps, logprobs, draft_lengths = (
            fetch((state.tokens, state.written, state.finished, state.ok, state.blocked, state.peak_used, state.keys,
                   self._host_leaves(self.manager), drafted, accepted, steps, state.logprobs, draft_lengths)))
        if draft is not None:
            draft.finish(spec, draft_lengths, bool(ok), blocked)
        self._mirror(host)
        return DecodeResult(out, count, finished, np.asarray(keys), bool(ok), blocked, int(peak), drafted, accepted,
                            steps, logprobs, None if speculation is None else history)

    def oom(self, need: np.ndarray, detail: str) -> KVCacheOOM:
        """``KVCacheOOM`` for the group with the largest shortfall of ``need``."""
        free = self.free_blocks()
        g = int(np.argmax(need - free))
        unit = "blocks" if len(self.groups) == 1 else f"{self.groups[g]} blocks"
        return KVCacheOOM(int(need[g]), int(free[g]), int(self.capacity[g]), unit=unit, detail=detail)



# ------------------------------------------------------------ sizing


def blocks_from_budget(measure, tokens_per_block: list[int], cap: list[int], kv_cache_memory,
                        free_bytes: int | None) -> tuple[list[int], int | None, str]:
    """Allocatable blocks per group from the budget (:mod:`jaxkv.serve.sizing`):
    ``kv_cache_memory`` solved whole; the default budget capped at ``cap``
    (every row at ``max_model_len``), which is used as it is when it fits.
    ``measure(counts)``: device bytes of the cache with ``counts`` blocks per
    group (null block included). Returns ``(blocks, budget or None, source)``;
    ``InvalidArgument`` with the numbers when not one block per group fits."""
    fixed, per_block = sizing.affine_bytes(measure, len(tokens_per_block))
    if kv_cache_memory is not None:
        budget, source = sizing.resolve_budget(kv_cache_memory, free_bytes=free_bytes)
    else:
        budget, source = sizing.default_budget(free_bytes)
        if fixed + sum(b * (n + 1) for b, n in zip(per_block, cap)) <= budget:
            return list(cap), None, f"default: every sequence row at max_model_len, within {source}"
    blocks = sizing.solve(budget, fixed, per_block, tokens_per_block)
    if blocks is None:
        raise InvalidArgument(
            f"{source}: {budget} bytes do not hold the cache's fixed {fixed} bytes (tables, allocators, "
            f"per-request state) plus one block per group ({per_block} bytes each, and a null block each)")
    return blocks, budget, source


# ------------------------------------------------------------ paged pool


class KVCache(Protocol):
    """The contract the engine schedules over (module docstring): what it
    reads and calls on a cache, whatever its kind. :class:`CacheBase`
    implements the shared part; the adapters the rest."""

    groups: tuple[str, ...]
    capacity: np.ndarray
    unit: int
    hit_grain: int  # a hit's length is a multiple of it (a page; 1 for a hybrid cache's token-grain hits)
    window: int | None
    can_swap: bool
    scrub: bool
    lookahead: int  # tokens a row may hold past its request's end for a moment (speculation's rejected drafts)
    packs_verify_lanes: bool  # whether packed_step takes speculative verify lanes
    max_seqs: int
    max_context_tokens: int
    prefill_width: int
    bytes_per_token: float
    plan: CachePlan
    prefix_cache: object  # its tree (events, inspection)
    manager: object  # the device bookkeeping (BlockSpaceManager or KVCacheManager), for inspection
    pool: object  # a paged pool's KV pages (None for a hybrid cache, whose manager holds them)

    def free_blocks(self) -> np.ndarray: ...
    def check_host_mirror(self) -> None: ...
    def blocks_for(self, num_tokens: int) -> np.ndarray: ...
    def peak_blocks(self, prompt_len: int, total: int) -> np.ndarray: ...
    def held_blocks(self, num_tokens: int) -> np.ndarray: ...
    def growth(self, num_tokens: int, steps: int, held: np.ndarray, shared: np.ndarray) -> np.ndarray: ...
    def blocks_for_many(self, num_tokens: np.ndarray) -> np.ndarray: ...
    def held_blocks_many(self, num_tokens: np.ndarray) -> np.ndarray: ...
    def growth_many(self, num_tokens: np.ndarray, steps: np.ndarray, held: np.ndarray,
                    shared: np.ndarray) -> np.ndarray: ...
    def blocks_in_use(self) -> int: ...
    def limits(self) -> str: ...
    def oom(self, need: np.ndarray, detail: str) -> KVCacheOOM: ...
    def place_on(self, mesh) -> None: ...
    def match(self, tokens: list, namespace) -> PrefixHit: ...
    def cached_length(self, tokens: list, namespace) -> int: ...
    def unpin(self, hit: PrefixHit | None) -> None: ...
    def can_evict(self) -> bool: ...
    def evict(self, shortfall: np.ndarray) -> None: ...
    def begin_prefill(self, lanes: list[PrefillLane]) -> None: ...
    def add_cut(self, row: int, position: int) -> bool: ...
    def fork_hit(self, row: int, num_tokens: int) -> PrefixHit | None: ...
    def pieces(self, lane: PrefillLane, width: int | None = None) -> list[tuple[int, int]]: ...
    def prefill_step(self, graphdef, params, batch, sampling: RowSampling): ...
    def packed_step(self, graphdef, params, prefill, decode, sampling: RowSampling, key_data: list | np.ndarray,
                    num_tokens: int, prefill_width: int | None = None, speculation=None,
                    scored=None) -> PackedResult: ...
    def prefill_lane_cap(self, num_prefill: int, budget: int) -> int: ...
    def key_array(self, key_data: list | np.ndarray) -> np.ndarray: ...
    def decode(self, graphdef, params, last, active, num_generated, max_new, eos_id, sampling: RowSampling,
               key_data: list | np.ndarray, num_steps: int, speculation=None) -> DecodeResult: ...
    def retire(self, finished: list) -> None: ...
    def end_step(self) -> None: ...
    def swap_out(self, row: int) -> bool: ...
    def swap_in(self, row: int) -> bool: ...
    def free_swapped(self, row: int) -> None: ...
    def row_status(self) -> np.ndarray: ...
    def first_blocks(self) -> np.ndarray: ...
    def usage(self) -> list: ...
    def device_bytes(self) -> int: ...
    def isolate(self, *, scrub_on_free: bool = False, prefix_quota: float | None = None) -> None: ...
    def reset_prefix(self) -> bool: ...
    def take_events(self) -> list: ...
    def rebuilt(self) -> "KVCache": ...
