"""Speculative decoding over the paged pool, inside one jitted loop.

A verify step feeds each running row its next token and ``k`` drafted
tokens (``k + 1`` positions, one model call in prefill mode, K/V written for
all of them), keeps the longest accepted prefix of the drafts plus one token
of the target's own, and rolls the cache back over the positions it did not
keep: :meth:`~jaxkv.BlockSpaceManager.truncate` puts the row's length back
and releases the blocks that became empty (a block that a fork or the
prefix cache also holds keeps its other owners). Slots past the new length
in the row's last block keep the rejected K/V until the next step writes
over them; attention masks them by length (the tests poison them with NaN).

Parts, each a pure function over arrays, usable alone:

* :class:`SpeculativeConfig`: vLLM's ``--speculative-config`` fields for the
  n-gram method (``method``, ``num_speculative_tokens``,
  ``prompt_lookup_max``, ``prompt_lookup_min``).
* :func:`ngram_propose`: prompt lookup on the device: the longest suffix of
  each row's history (``prompt_lookup_max`` down to ``prompt_lookup_min``
  tokens) that occurred earlier, and the tokens that followed its most
  recent earlier occurrence.
* :func:`accept_drafts`: greedy verification (the longest prefix equal to
  the target's argmax) or, for sampled rows, the rejection rule of
  Leviathan et al. / Chen et al.: accept draft ``d`` with probability
  ``min(1, p(d) / q(d))``, on a rejection draw from ``max(0, p - q)``
  normalised, after all ``n`` accepted draw from ``p``; the tokens then
  follow the target's distribution exactly. ``p`` is the distribution
  :func:`~jaxkv.nn.sampling.sample` draws from (temperature, top-k, top-p
  applied: :func:`~jaxkv.nn.sampling.filtered_logits`); an n-gram draft is
  deterministic (``q`` one-hot).
* :func:`speculative_body`: one verify step of a :class:`SpecState`;
  :func:`speculative_loop` runs it in one ``lax.while_loop`` and
  :func:`speculative_step` is one jitted step. ``generate(...,
  speculative=...)`` (:mod:`jaxkv.nn.generate`) drives them.

Rollback of a hybrid cache: gpt-oss's and Gemma 3's window rings get
``k`` slots of slack (:func:`hybrid_cache_options`; a ring then rolls back
by its length: :class:`~jaxkv.pool.window.WindowLayerCache`); Qwen3-Next's
Gated DeltaNet states and DeepSeek-V4's SWA and compressor rings,
compressed entries and indexer keys take a checkpoint and a replay: every
state row a row's verify pass advances is copied first into a checkpoint
row, and a row that rejected a draft gets it back and replays the tokens
it keeps (one more model call of the verify's width), in a decode
chunk's verify step as in a packed step's verify lanes
(:func:`hybrid_packed_verify_step`). The blocks past
the kept tokens are released by :meth:`~jaxkv.KVCacheManager.truncate`.
Paged positions need no undo: a length and the blocks past it.

The engine's side (histories on the host, the rule that turns a
request's speculation off) is :mod:`jaxkv.serve.speculation`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv.errors import InvalidArgument
from jaxkv.nn.packed import PackedBatch, cache_kind
from jaxkv.nn.sampling import RowSampling, SamplingParams, filtered_logits, sample, split_keys
from jaxkv.manager.rows import slot_of
from jaxkv.nn.steps import (PROGRAM_OPTIONS, DecodeState, decode_logits, drop_decode_lanes, finish_rows,
                            grow_decode_lanes, model_step, paged_window, place_tokens, trim_out_of_window)
from jaxkv.pool.scrub import freed_blocks, scrub_kv_pool

__all__ = ["SpecState", "SpeculativeConfig", "accept_drafts", "draft_catch_up", "draft_model_for", "early_exit_draft",
           "hybrid_cache_options", "hybrid_packed_verify_step", "ngram_propose", "paged_packed_verify_step",
           "speculative_body", "speculative_loop", "speculative_step"]


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with (vLLM's ``--speculative-config`` names).

    ``method``: ``"ngram"`` (prompt lookup; the only method built so far).
    ``num_speculative_tokens``: drafts per verify step (``k``).
    ``prompt_lookup_max`` / ``prompt_lookup_min``: the longest and shortest
    suffix that is looked up (vLLM's defaults for ngram are min 1 when only
    max is given; here 3 and 1 when neither is). ``draft_model``: drafts
    drawn from another model of the same vocabulary, ``model`` (a jaxkv
    paged-pool model or a checkpoint path), or the target's own first
    ``draft_layers`` layers with its final norm and head (a self-speculative
    early exit: :func:`early_exit_draft`); the draft keeps its own paged
    cache, rolled back with the target's. ``min_accepted_per_step``
    (jaxkv's; the engine only; None: derived for the device): the drafts a
    verify step must keep, per row, to pay for itself; a request below it
    after its probation stops speculating, and a chunk whose rows together
    keep less runs plain (:mod:`jaxkv.serve.speculation`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    min_accepted_per_step: float | None = None
    draft_layers: int | None = None
    model: object = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.method not in ("ngram", "draft_model"):
            raise InvalidArgument(f"speculative method {self.method!r}: 'ngram' and 'draft_model' are built "
                                  f"(EAGLE and MTP are not yet)")
        if self.method == "draft_model" and (self.draft_layers is None) == (self.model is None):
            raise InvalidArgument("speculative method 'draft_model' takes one of model (a jaxkv model or a "
                                  "checkpoint path) and draft_layers (the target's own first layers)")
        if self.method == "ngram" and (self.draft_layers is not None or self.model is not None):
            raise InvalidArgument("model and draft_layers are for method 'draft_model'")
        if self.draft_layers is not None and (isinstance(self.draft_layers, bool)
                                              or not isinstance(self.draft_layers, int) or self.draft_layers < 1):
            raise InvalidArgument(f"SpeculativeConfig.draft_layers must be an integer >= 1, got {self.draft_layers!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"SpeculativeConfig.{name} must be an integer >= 1, got {value!r}")
        value = self.min_accepted_per_step
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value <= self.num_speculative_tokens):
            raise InvalidArgument(f"SpeculativeConfig.min_accepted_per_step={value!r}: a number in [0, "
                                  f"num_speculative_tokens={self.num_speculative_tokens}]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidArgument(f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max="
                                  f"{self.prompt_lookup_max}")

    @classmethod
    def of(cls, value) -> SpeculativeConfig:
        """A config from a ``SpeculativeConfig`` or a dict of its fields
        (unknown keys refused by name)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise InvalidArgument(f"speculative config: unknown keys {unknown} (known: {sorted(known)})")
            return cls(**value)
        raise InvalidArgument(f"speculative must be a SpeculativeConfig or a dict, got {type(value).__name__}")


def ngram_propose(history: Int[Array, "B H"], length: Int[Array, " B"], *, k: int, max_n: int, min_n: int
                  ) -> tuple[Int[Array, "B k"], Int[Array, " B"]]:
    """Prompt-lookup drafts for each row of ``history`` (its first
    ``length[b]`` entries are the row's tokens, prompt then output).

    For ``n`` from ``max_n`` down to ``min_n`` (static), the row's last
    ``n`` tokens are looked up among its earlier tokens; the longest ``n``
    with a match wins, and of its matches the most recent one that is
    followed by at least one token. Returns ``(drafts [B, k], num_drafts
    [B])``: up to ``k`` tokens that followed the match (fewer when the
    history ends first; 0 and drafts 0 when nothing matched)."""
    batch, width = history.shape
    start = jnp.arange(width, dtype=jnp.int32)[None, :]  # candidate start of an earlier occurrence
    best = jnp.full((batch,), -1, jnp.int32)  # where the drafts start in the history
    for n in range(max_n, min_n - 1, -1):
        suffix_at = length - n  # the suffix is history[suffix_at : length]
        equal = jnp.ones((batch, width), bool)
        for t in range(n):
            want = jnp.take_along_axis(history, jnp.clip(suffix_at + t, 0, width - 1)[:, None], axis=1)
            got = jnp.take_along_axis(history, jnp.clip(start + t, 0, width - 1), axis=1)
            equal = equal & (got == want)
        # An earlier occurrence followed by a token: it ends (start + n) before the history's last token.
        usable = equal & (start + n <= length[:, None] - 1) & (suffix_at[:, None] >= 0)
        found = jnp.max(jnp.where(usable, start + n, -1), axis=1)
        best = jnp.where((best < 0) & (found >= 0), found, best)
    offsets = jnp.arange(k, dtype=jnp.int32)[None, :]
    num = jnp.where(best >= 0, jnp.clip(length - best, 0, k), 0)
    drafts = jnp.take_along_axis(history, jnp.clip(best[:, None] + offsets, 0, width - 1), axis=1)
    return jnp.where(offsets < num[:, None], drafts, 0), num.astype(jnp.int32)


def _residual(p: Float[Array, "... V"], q: Float[Array, "... V"]) -> Float[Array, "... V"]:
    """``max(0, p - q)``: what a rejection resamples from (unnormalised)."""
    return jnp.maximum(p - q, 0.0)


def accept_drafts(logits: Float[Array, "B K1 V"], drafts: Int[Array, "B K"], num_drafts: Int[Array, " B"],
                  sampling: SamplingParams | RowSampling, key: jax.Array | None,
                  draft_probs: Float[Array, "B K V"] | None = None) -> tuple[Int[Array, "B K1"], Int[Array, " B"]]:
    """Verify ``drafts`` against the target's ``logits`` (position ``i``:
    the logits after the row's token and drafts ``< i``; ``K1 = K + 1``).

    Returns ``(tokens [B, K1], accepted [B])``: the row emits
    ``tokens[b, :accepted[b] + 1]``, the first ``accepted[b]`` drafts and
    one token of the target's (its argmax, or a draw by the rejection rule
    of the module docstring); entries past that are 0. Draft ``i`` is only
    considered for ``i < num_drafts[b]``. ``draft_probs``: the draft's
    distribution per position (None: deterministic drafts, ``q`` one-hot).
    ``key``: one PRNG key for the batch, or ``[B]`` keys, one per row
    (unused when ``sampling`` is a greedy ``SamplingParams``)."""
    batch, width, vocab = logits.shape
    k = width - 1
    index = jnp.arange(width, dtype=jnp.int32)[None, :]
    drafts = jnp.concatenate([drafts.astype(jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, K1]
    drafted = index < num_drafts[:, None]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(sampling, SamplingParams) and sampling.is_greedy:
        matches = drafted & (drafts == greedy)
        accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
        final = jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0]
    else:
        scaled, temperature = filtered_logits(logits.reshape(batch * width, vocab),
                                              _per_position(sampling, batch, width))
        p = jax.nn.softmax(scaled.reshape(batch, width, vocab), axis=-1)
        if draft_probs is None:
            q = jax.nn.one_hot(drafts[:, :k], vocab, dtype=p.dtype)
        else:
            q = draft_probs.astype(p.dtype)
        q = jnp.concatenate([q, jnp.zeros((batch, 1, vocab), p.dtype)], axis=1)  # no draft past K
        p_d = jnp.take_along_axis(p, drafts[:, :, None], axis=2)[:, :, 0]
        q_d = jnp.take_along_axis(q, drafts[:, :, None], axis=2)[:, :, 0]
        if key.ndim == 0:
            accept_key, draw_key = jax.random.split(key)
            u = jax.random.uniform(accept_key, (batch, width))
        else:  # one stream per row: a row's draws do not depend on the others
            pairs = jax.vmap(jax.random.split)(key)
            accept_key, draw_key = pairs[:, 0], pairs[:, 1]
            u = jax.vmap(lambda k: jax.random.uniform(k, (width,)))(accept_key)
        # Accept with min(1, p/q): u * q < p (q > 0 for a drafted token).
        matches = drafted & (u * q_d < p_d)
        accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
        p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
        q_at = jnp.take_along_axis(q, accepted[:, None, None], axis=1)[:, 0]
        rejected = accepted < num_drafts  # stopped at a drafted token: resample from the residual
        weights = jnp.where(rejected[:, None], _residual(p_at, q_at), p_at)
        # A residual of all zeros (p == q there) cannot be drawn from; then p is used (a null-probability case).
        weights = jnp.where(jnp.sum(weights, axis=-1, keepdims=True) > 0, weights, p_at)
        if key.ndim == 0:
            drawn = jax.random.categorical(draw_key, jnp.log(weights), axis=-1).astype(jnp.int32)
        else:
            drawn = jax.vmap(lambda k, w: jax.random.categorical(k, w))(draw_key, jnp.log(weights)).astype(jnp.int32)
        row_temperature = temperature.reshape(batch, width)[:, 0]
        sampled = jnp.where(row_temperature > 0, drawn, jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0])
        # A greedy row of a mixed batch takes the greedy rule.
        greedy_accepted = jnp.sum(jnp.cumprod(drafted & (drafts == greedy), axis=1), axis=1).astype(jnp.int32)
        accepted = jnp.where(row_temperature > 0, accepted, greedy_accepted)
        final = jnp.where(row_temperature > 0, sampled,
                          jnp.take_along_axis(greedy, greedy_accepted[:, None], axis=1)[:, 0])
    tokens = jnp.where(index < accepted[:, None], drafts, 0)
    tokens = jnp.where(index == accepted[:, None], final[:, None], tokens)
    return tokens, accepted


def _per_position(sampling: SamplingParams | RowSampling, batch: int, width: int) -> SamplingParams | RowSampling:
    """``sampling`` for ``batch * width`` rows (row ``b``'s parameters at each of its positions)."""
    if isinstance(sampling, SamplingParams):
        return sampling
    return jax.tree_util.tree_map(lambda a: jnp.repeat(jnp.asarray(a), width, axis=0), sampling)


@struct.dataclass
class SpecState:
    """A :class:`~jaxkv.nn.steps.DecodeState` (its invariants hold) plus
    what speculation carries: ``history [B, H]`` each row's tokens (prompt
    then output; ``history_len [B]`` of them; ``decode.last`` is the last),
    and the per-row totals ``drafted`` (draft tokens verified) and
    ``accepted`` (of them kept) and ``steps`` (verify steps the row ran
    with at least one draft). With a draft model (``draft_manager``,
    ``draft_pool``): its cache holds the same tokens as the target's."""

    decode: DecodeState
    history: Int[Array, "B H"]
    history_len: Int[Array, " B"]
    drafted: Int[Array, " B"]
    accepted: Int[Array, " B"]
    steps: Int[Array, " B"]
    draft_manager: object = None  # a draft model's BlockSpaceManager and KVPool (row b = row b), or None
    draft_pool: object = None


def speculative_body(graphdef, params, state: SpecState, sampling: SamplingParams | RowSampling,
                     config: SpeculativeConfig, *, free_finished: bool = True, scrub: bool = False,
                     speculate: Bool[Array, " B"] | None = None, draft_graphdef=None,
                     draft_params=None) -> SpecState:
    """One verify step of every unfinished row.

    Propose up to ``k`` drafts (:func:`ngram_propose`, or ``k`` from the
    draft model ``draft_graphdef`` / ``draft_params``: :func:`_draft_propose`),
    grow each row by
    ``[last, drafts]`` (all or nothing: a failed allocation runs nothing,
    records nothing and sets ``ok`` False and ``blocked``), run them through
    the model at the row's next positions, verify (:func:`accept_drafts`),
    record the emitted tokens (cut at EOS and at ``max_new``), roll the rows
    back to the positions kept and finish the rows that ended (freeing them
    with ``free_finished``, as :func:`~jaxkv.nn.steps.decode_body`). A step
    in which no row has a draft runs one position per row instead over a
    hybrid cache (a paged pool verifies ``k + 1`` positions every step:
    the switch would copy the pool on XLA:GPU). The
    cache is a paged pool (:func:`_paged_verify`) or a hybrid
    :class:`~jaxkv.KVCacheManager` (:func:`_hybrid_verify`). ``scrub``
    (static; paged pool): blocks the step releases are zeroed in it.
    ``speculate`` (``[B]``, default all): rows that get drafts; the others
    decode one token per step (the engine turns speculation off for a
    request whose drafts are rarely accepted). Keys: one for the batch or
    one per row (a row's advances only on the steps it runs)."""
    d = state.decode
    k = config.num_speculative_tokens
    active = ~d.finished
    options = dict(sampling=sampling, free_finished=free_finished, scrub=scrub)
    if draft_graphdef is not None and state.draft_manager is not None:  # a draft with a cache of its own
        if _greedy(sampling):
            keys, key = d.keys, None
        elif d.keys.ndim == 0:
            keys, key = jax.random.split(d.keys)
        else:  # one stream per row: the draft's draws fold off it, the verify's split then advances it
            keys, key = d.keys, _fold_keys(d.keys, _DRAFT_STREAM)
        drafting = active if speculate is None else active & speculate
        drafts, probs, state = _draft_propose(draft_graphdef, draft_params, state, k, sampling, key, drafting)
        num_drafts = jnp.where(drafting, k, 0).astype(jnp.int32)
        return _advance(graphdef, params, state.replace(decode=state.decode.replace(keys=keys)), drafts,
                        num_drafts, draft_probs=probs, draft_rows=drafting, **options)
    if draft_graphdef is not None:  # an early exit over the target's own pool: drafts after the append
        if d.pool is None:
            raise InvalidArgument("a draft that shares the target's pool (early_exit_draft(..., share_pool=True)) "
                                  "needs a paged-pool target; a hybrid cache's target takes a draft with its own "
                                  "cache")
        # The draft's draws: a stream folded off the row's key (one key for the batch or one per row), which the
        # verify's split then advances.
        key = None if _greedy(sampling) else _fold_keys(d.keys, _DRAFT_STREAM)
        drafts = jnp.zeros((d.last.shape[0], k), jnp.int32)  # placeholders: the propose fills them in
        num_drafts = jnp.where(active if speculate is None else active & speculate, k, 0).astype(jnp.int32)
        propose = partial(_shared_pool_propose, draft_graphdef, draft_params, sampling=sampling, key=key)
    else:
        drafts, num_drafts = ngram_propose(state.history, state.history_len, k=k, max_n=config.prompt_lookup_max,
                                           min_n=config.prompt_lookup_min)
        num_drafts = jnp.where(active if speculate is None else active & speculate, num_drafts, 0)
        propose = None
    if d.pool is not None:
        # A paged pool: every step verifies k + 1 positions, drafts or not. A switch to a one-position decode
        # step when no row has a draft (as a hybrid cache's below) makes XLA:GPU copy the pool in the
        # conditional, both branches writing K/V into it (python -m jaxkv.bench engine_aot's speculative chunk
        # of Llama-3.1-8B: three 25.6 GB copies, a 153 GB program; none without the switch).
        return _advance(graphdef, params, state, drafts, num_drafts, propose=propose, **options)
    # A hybrid cache: a step in which no row has a draft is a plain decode step (one position per row, not
    # k + 1). An index switch, not a predicated cond: XLA:GPU copies the operand of a predicated conditional
    # that a branch updates in place (see BlockSpaceManager.append_slots).
    return jax.lax.switch(
        jnp.any(num_drafts > 0).astype(jnp.int32),
        [lambda s: _advance(graphdef, params, s, drafts[:, :0], jnp.zeros_like(num_drafts), **options),
         lambda s: _advance(graphdef, params, s, drafts, num_drafts, propose=propose, **options)], state)


def _greedy(sampling) -> bool:
    return isinstance(sampling, SamplingParams) and sampling.is_greedy


#: What an early-exit draft's draws fold into the row's key (any constant the verify's split never yields).
_DRAFT_STREAM = 0x64726166  # "draf"


def _fold_keys(keys: jax.Array, data: int) -> jax.Array:
    """``jax.random.fold_in`` of one key, or of each of ``[B]`` keys."""
    if keys.ndim == 0:
        return jax.random.fold_in(keys, data)
    return jax.vmap(lambda key: jax.random.fold_in(key, data))(keys)


def _draft_propose(draft_graphdef, draft_params, state: SpecState, k: int, sampling, key, drafting):
    """``k`` drafts per ``drafting`` row from the draft model, one decode
    step each over its own paged cache (its token, its argmax or a draw
    from its distribution after the same temperature / top-k / top-p), and
    one step more that writes the last draft's K/V (so that a row that
    keeps every draft has them all). Returns ``(drafts [B, k], probs [B, k,
    V] or None (greedy), state)`` with the draft cache of the drafting rows
    grown by ``k + 1`` positions (the other rows' left alone);
    :func:`_advance` truncates it to what the target keeps. The draft cache
    must have room (``generate`` sizes it for every row at full length, the
    engine plans it: :class:`~jaxkv.serve.drafts.DraftCache`): a
    failed append there sets the state's ``ok`` False, which stops the loop
    (``generate`` then raises ``KVCacheOOM``)."""
    d = state.decode
    manager, pool = state.draft_manager, state.draft_pool
    token, drafts, probs, ok = d.last, [], [], jnp.asarray(True)
    for i in range(k + 1):
        manager, pool, logits, _, step_ok = decode_logits(draft_graphdef, draft_params, manager, pool, token,
                                                          drafting)
        ok = ok & step_ok
        if i == k:
            break
        token, q = _draft_token(logits, sampling, key, i)
        drafts.append(token)
        if q is not None:
            probs.append(q)
    state = state.replace(decode=d.replace(ok=d.ok & ok), draft_manager=manager, draft_pool=pool)
    return jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1) if probs else None, state


def draft_catch_up(graphdef, params, manager, pool, reset: Bool[Array, " B"], batch: PackedBatch | None):
    """Bring a draft model's own paged cache up to tokens its target holds
    already (the engine's separate draft: :class:`~jaxkv.serve.drafts.DraftCache`
    plans the batch on the host). Rows of ``reset`` are emptied first
    (truncated to no token: a row that now serves another request, or one
    whose draft is given up), then lane ``s`` of ``batch`` grows its row
    ``seq_ids[s]`` by its ``q_len`` tokens (one ragged ``append_slots``, all
    or nothing) and the draft model writes their K/V (``forward_packed``;
    the logits are dropped). Every row of ``manager`` must be ON_DEVICE,
    empty ones at length 0, and a lane's first position its row's length.
    Returns ``(manager, pool, ok)``; on a failed append nothing is written
    (the resets stand)."""
    rows = jnp.arange(reset.shape[0], dtype=jnp.int32)
    manager, _ = manager.truncate(jnp.where(reset, rows, -1), 0)
    if batch is None:
        return manager, pool, jnp.asarray(True)
    seqs = jnp.where(batch.q_lens > 0, batch.seq_ids, -1)
    manager, pool, _, _, ok = manager.append_slots(pool, seqs, batch.num_tokens, counts=batch.q_lens)
    batch = place_tokens(manager, batch)

    def write(p):
        return nnx.merge(graphdef, params).forward_packed(batch, p)[1]

    # An index switch, not a predicated cond (see BlockSpaceManager.append_slots).
    pool = jax.lax.switch(ok.astype(jnp.int32), [lambda p: p, write], pool)
    return manager, pool, ok


def _draft_token(logits: Float[Array, "B V"], sampling, key, i: int):
    """The draft's token after ``logits`` (draft position ``i``): its argmax
    (greedy), or a draw from its distribution after the target's
    temperature / top-k / top-p; returns ``(token [B], probs [B, V] or
    None)`` (``probs``: what the rejection rule reads as ``q``)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if _greedy(sampling):
        return greedy, None
    scaled, temperature = filtered_logits(logits, sampling)
    keys = _fold_keys(key, i)
    if keys.ndim == 0:
        drawn = jax.random.categorical(keys, scaled, axis=-1)
    else:  # one stream per row
        drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy), jax.nn.softmax(scaled, axis=-1)


def _shared_pool_propose(draft_graphdef, draft_params, pool, last, slots, tables, starts, running, *, sampling, key):
    """``k`` drafts per running row from an early-exit draft that runs over
    the target's own pool (``early_exit_draft(..., share_pool=True)``: its
    layers are the target's first, so the K/V the target wrote for them
    are the draft's). Called once the verify step's ``k + 1`` positions are
    appended (``slots [B, k+1]`` from position ``starts``): draft step ``i``
    feeds token ``i`` (``last``, then the drafts) at position ``starts +
    i`` into slot ``slots[:, i]`` of the first layers, decode attention
    over everything before it. The verify pass then writes all ``k + 1``
    positions of every layer again, so no draft K/V outlives the step and
    the rollback is the target's alone. Returns ``(drafts [B, k], probs
    [B, k, V] or None, pool)``."""
    k = slots.shape[1] - 1
    token, drafts, probs = last, [], []
    for i in range(k):
        logits, pool = model_step(draft_graphdef, draft_params, token[:, None], (starts + i)[:, None], pool,
                                  slots[:, i:i + 1], tables, starts + i, running.astype(jnp.int32), "decode")
        token, q = _draft_token(logits[:, 0], sampling, key, i)
        drafts.append(token)
        probs.append(q)
    return jnp.stack(drafts, axis=1), None if probs[0] is None else jnp.stack(probs, axis=1), pool


def _advance(graphdef, params, state: SpecState, drafts, num_drafts, *, sampling, free_finished: bool,
             scrub: bool, draft_probs=None, propose=None, draft_rows=None) -> SpecState:
    """:func:`speculative_body` once the drafts are known (``drafts [B, k]``;
    ``k`` may be 0: a plain decode step), or with ``propose`` once the
    verify step's positions are appended (an early exit over the target's
    pool: :func:`_shared_pool_propose`; ``drafts`` are placeholders). A
    draft model's cache (``state.draft_manager``) is truncated with the
    target's on the rows that drafted (``draft_rows``, bool ``[B]``)."""
    d = state.decode
    batch, width = d.tokens.shape
    k = drafts.shape[1]
    active = ~d.finished
    inputs = jnp.concatenate([d.last[:, None], drafts], axis=1)
    if d.pool is not None:
        logits, blocked, ok, rollback, drafts, probs = _paged_verify(graphdef, params, d.manager, d.pool, inputs,
                                                                     num_drafts, active, scrub, propose)
        draft_probs = draft_probs if propose is None else probs
    else:
        logits, blocked, ok, rollback = _hybrid_verify(graphdef, params, d.manager, inputs, num_drafts, active)
    running = active & ok
    if _greedy(sampling):  # static: no draw, so no key is spent
        keys, key = d.keys, None
    else:
        keys, key = split_keys(d.keys)
        if keys.ndim:  # per-row streams advance only with their row
            keys = jnp.where(running, keys, d.keys)
    emitted, accepted = accept_drafts(logits, drafts, num_drafts, sampling, key, draft_probs)
    manager, pool = rollback(jnp.where(running, accepted, -1))
    if draft_rows is not None:  # the draft keeps what the target keeps (a row that did not run: nothing)
        draft_rows = jnp.where(draft_rows, jnp.arange(batch, dtype=jnp.int32), -1)
        kept, _ = state.draft_manager.truncate(draft_rows, state.draft_manager.seq_lens - (k + 1)
                                               + jnp.where(running, accepted + 1, 0))
        state = state.replace(draft_manager=kept)
    # Emitted tokens: the accepted drafts and one of the target's, cut after an EOS and at max_new.
    lane = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    count = accepted + 1
    is_eos = (emitted == d.eos_id[:, None]) & (lane < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, lane, k + 1), axis=1)
    count = jnp.minimum(jnp.minimum(count, first_eos + 1), d.max_new - d.num_generated)
    count = jnp.where(running, count, 0)
    rows = jnp.arange(batch)[:, None]
    column = jnp.where(lane < count[:, None], d.written[:, None] + lane, width)  # out of range: dropped
    history_column = jnp.where(lane < count[:, None], state.history_len[:, None] + lane, state.history.shape[1])
    last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    num_generated = d.num_generated + count
    decode = d.replace(
        manager=manager, pool=pool, tokens=d.tokens.at[rows, column].set(emitted, mode="drop"),
        written=d.written + count, num_generated=num_generated, last=jnp.where(running, last, d.last), keys=keys,
        step=d.step + 1, blocked=jnp.where(ok, d.blocked, blocked),
        peak_used=jnp.maximum(d.peak_used, manager.blocks_in_use), ok=d.ok & ok)
    done = running & ((first_eos < count) | (num_generated >= d.max_new))
    return state.replace(decode=finish_rows(decode, done, free_finished),
                         history=state.history.at[rows, history_column].set(emitted, mode="drop"),
                         history_len=state.history_len + count,
                         drafted=state.drafted + jnp.where(running, num_drafts, 0),
                         accepted=state.accepted + jnp.where(running, accepted, 0),
                         steps=state.steps + (running & (num_drafts > 0)))


def _paged_verify(graphdef, params, manager, pool, inputs, num_drafts, active, scrub: bool = False, propose=None):
    """The verify pass over a paged pool: ``append_slots`` of ``k + 1``
    tokens per row (a windowed model's dead blocks trimmed first, as
    :func:`~jaxkv.nn.steps.decode_logits` does), the model's packed
    (ragged) step over the rows' ``k + 1`` tokens (:func:`_verify_batch`).
    ``propose`` (:func:`_shared_pool_propose`, bound to its draft): called
    after the append, it supplies the drafts ``inputs[:, 1:]`` (else they
    are given). Returns ``(logits [B, k+1, V], blocked, ok, rollback,
    drafts [B, k], draft probs or None)``; ``rollback(accepted)`` (-1: a
    row that did not run) truncates each row to its length before the step
    plus ``accepted + 1`` (the fed token and the accepted drafts) and
    returns ``(manager, pool)``; with ``scrub`` the blocks it releases are
    zeroed (:mod:`jaxkv.pool.scrub`)."""
    batch, width = inputs.shape
    seqs = jnp.where(active, jnp.arange(batch, dtype=jnp.int32), -1)
    window = paged_window(nnx.merge(graphdef, params))
    if window is not None:
        manager, pool = trim_out_of_window(manager, pool, seqs, window, scrub)
    starts = manager.seq_lens
    manager, pool, slots, blocked, ok = manager.append_slots(pool, seqs, width)
    running = active & ok
    tables, _ = manager.batch_tables(seqs)
    probs = None
    if propose is not None:
        drafts, probs, pool = propose(pool, inputs[:, 0], slots, tables, starts, running)
        inputs = jnp.concatenate([inputs[:, :1], drafts], axis=1)
    # The packed (ragged) attention, as a packed step's: the dense prefill attention would gather each row's
    # whole context (engine_aot's speculative chunk of Llama-3.1-8B: [256, 8, 4096, 128] f32 per K and V).
    logits, pool = nnx.merge(graphdef, params).forward_packed(_verify_batch(inputs, starts, running, slots, tables),
                                                              pool, verify=running, width=width)

    def rollback(accepted):
        kept, _ = manager.truncate(jnp.where(accepted >= 0, seqs, -1), starts + accepted + 1)
        if scrub:
            return kept, scrub_kv_pool(pool, freed_blocks(manager.device, kept.device, null=False))
        return kept, pool

    return logits, blocked, ok, rollback, inputs[:, 1:], probs


def _verify_batch(inputs: Int[Array, "B W"], starts: Int[Array, " B"], running: Bool[Array, " B"],
                  slots: Int[Array, "B W"], tables: Int[Array, "B M"]) -> PackedBatch:
    """The verify pass of rows ``running`` as one packed batch: lane ``b``
    is row ``b``'s ``W`` tokens ``inputs[b]`` at positions ``starts[b] +
    i`` (written into ``slots[b]``, attending through ``tables[b]``), end to
    end in a stream of ``B x W`` (a row that does not run brings none; the
    stream's tail is padding)."""
    batch, width = inputs.shape
    total = batch * width
    q_lens = jnp.where(running, width, 0).astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    offset = jnp.arange(width, dtype=jnp.int32)[None, :]
    at = jnp.where(running[:, None], cu[:-1, None] + offset, total)  # stream index of each token (dropped: none)

    def stream(values, fill):
        return jnp.full((total,), fill, jnp.int32).at[at].set(values.astype(jnp.int32), mode="drop")

    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], inputs.shape)
    return PackedBatch(token_ids=stream(inputs, 0), positions=stream(starts[:, None] + offset, -1),
                       token_lanes=stream(rows, 0), cu_q_lens=cu, kv_lens=jnp.where(running, starts + width, 0),
                       seq_ids=jnp.where(running, rows[:, 0], -1), sample=running,
                       num_prefill=jnp.asarray(batch, jnp.int32), slots=stream(slots, -1), block_tables=tables,
                       num_prefill_lanes=batch, max_prefill_len=width)


def _checkpoint_rows(manager, slots: Int[Array, " B"], rows: int) -> Int[Array, " B"]:
    """The checkpoint state row of each request slot ``slots`` (-1 stays
    -1) when the engine has ``rows`` rows: the ``b``-th of the manager's
    last ``rows`` snapshot rows for row ``b`` (slot ``b + 1``; the prefix
    cache keeps the snapshot rows before them). Raises ``InvalidArgument``
    when the manager has fewer snapshot rows."""
    if manager.num_snapshots < rows:
        raise InvalidArgument(f"speculating over a hybrid cache needs a checkpoint row per row: {rows} rows, "
                              f"the manager has {manager.num_snapshots} snapshot rows (make_cache(..., "
                              "num_snapshots=))")
    return jnp.where(slots >= 0, manager.num_slots + manager.num_snapshots - rows + slots - 1, -1)


def _restore_and_replay(model, manager, replay: Bool[Array, " B"], slots, checkpoint, inputs: Int[Array, "B W"],
                        starts, accepted):
    """The hybrid rollback of the rows ``replay`` (request ``slots``, whose
    state rows were copied to ``checkpoint`` before a verify pass fed
    ``inputs`` at ``starts``): truncated to ``starts + accepted + 1``,
    their state rows restored from the checkpoint and the kept tokens
    ``inputs[:, :accepted + 1]`` run through ``model`` again (one model
    call, skipped when no row replays)."""
    rows = jnp.where(replay, slots, -1)
    kept, _ = manager.truncate(rows, starts + accepted + 1)

    def restore_and_replay(m):
        m = m.copy_state(jnp.where(replay, checkpoint, -1), rows)
        _, m = model(inputs, m, rows, jnp.maximum(starts, 0), jnp.where(replay, accepted + 1, 0))
        return m

    # An index switch, not a predicated cond: XLA:GPU copies the operand of a predicated conditional that a branch
    # updates in place (see BlockSpaceManager.append_slots).
    return jax.lax.switch(jnp.any(replay).astype(jnp.int32), [lambda m: m, restore_and_replay], kept)


def _hybrid_verify(graphdef, params, manager, inputs, num_drafts, active):
    """The verify pass over a hybrid :class:`~jaxkv.KVCacheManager` (row
    ``b`` = slot ``b + 1``): each row with drafts first copies its state
    rows (GDN conv and recurrent states, SWA, window and compressor rings)
    into its checkpoint row (:func:`_checkpoint_rows`; the manager needs
    ``num_snapshots >= B``), then reserves ``num_drafts + 1`` tokens and
    runs them. ``rollback(accepted)``: a row that rejected a draft is
    truncated to its length before the step plus ``accepted + 1``, its
    state rows restored from the checkpoint and the kept tokens replayed
    (:func:`_restore_and_replay`). A manager whose only state rows are
    window rings with ``k`` slots of slack
    (:meth:`~jaxkv.KVCacheManager.rolls_back_by_length`) needs neither: it
    is truncated, no checkpoint taken. Returns ``(logits, blocked, ok,
    rollback)`` as :func:`_paged_verify`."""
    batch, width = inputs.shape
    model = nnx.merge(graphdef, params)
    slots = slot_of(jnp.where(active, jnp.arange(batch, dtype=jnp.int32), -1))
    by_length = manager.rolls_back_by_length(width - 1)  # static
    if not by_length:
        checkpoint = _checkpoint_rows(manager, slots, batch)
        drafted = active & (num_drafts > 0)
        manager = manager.copy_state(jnp.where(drafted, slots, -1), jnp.where(drafted, checkpoint, -1))
    manager, starts, ok = manager.reserve(slots, jnp.where(active, num_drafts + 1, 0), max_new_tokens=width)
    logits, manager = model(inputs, manager, jnp.where(ok, slots, -1), jnp.maximum(starts, 0),
                            jnp.where(ok & active, num_drafts + 1, 0))

    def rollback(accepted):
        if by_length:
            kept, _ = manager.truncate(jnp.where(accepted >= 0, slots, -1), starts + accepted + 1)
            return kept, None
        replay = (accepted >= 0) & (accepted < num_drafts)
        return _restore_and_replay(model, manager, replay, slots, checkpoint, inputs, starts, accepted), None

    return logits, active & ~ok, ok, rollback


def hybrid_packed_verify_step(graphdef, params, manager, batch: PackedBatch, sampling: RowSampling, keys, history,
                              history_len, verify, *, config: SpeculativeConfig):
    """:func:`~jaxkv.nn.steps.hybrid_packed_step` with speculative verify
    lanes: a decode lane marked in ``verify`` (bool ``[S]``) brings ``k +
    1`` tokens (its next token, then ``k`` placeholders:
    :func:`jaxkv.serve.caches.pack_stream`'s verify lanes), whose first
    ``n`` become the n-gram drafts of its row's history (``history[slot -
    1, :history_len[slot - 1]]``) here on the device and whose rest turn
    into padding, so prefill pieces, plain decode lanes and verify lanes
    run in one model call (``forward_packed(..., verify=, width=)``).

    The prefill lanes reserve their pieces, every decode lane its token
    and drafts (all or nothing; on failure the decode lanes drop out). A
    verify lane with drafts over a cache with state a rejected token
    overwrites (GDN states, DeepSeek-V4's rings and compressors) copies its
    state rows to its checkpoint row first; after verification a lane that
    rejected a draft is truncated to its token and accepted drafts and, on
    such a cache, restored and replayed (:func:`_restore_and_replay`: one
    more model call over the decode lanes, skipped when none rejected);
    a cache of slack window rings is only truncated. Returns ``(manager,
    tokens [S, k+1], counts [S], keys, prefill_ok, decode_ok, blocks in
    use, drafted [S], accepted [S])``: lane ``s`` gave ``tokens[s,
    :counts[s]]``."""
    k = config.num_speculative_tokens
    width = k + 1
    model = nnx.merge(graphdef, params)
    decode = batch.decode_lanes
    prefill = ~decode & (batch.q_lens > 0) & (batch.seq_ids >= 0)
    verify = verify & decode
    rows = jnp.where(verify, batch.seq_ids - 1, 0)  # a hybrid lane's seq_id is its request slot, row + 1
    drafts, num_drafts = ngram_propose(history[rows], history_len[rows], k=k, max_n=config.prompt_lookup_max,
                                       min_n=config.prompt_lookup_min)
    num_drafts = jnp.where(verify, num_drafts, 0)
    first = batch.cu_q_lens[:-1]
    offset = jnp.arange(width, dtype=jnp.int32)[None, :]
    # A verify lane's drafts take its placeholders 1..n; the placeholders past them become padding.
    spots = first[:, None] + offset[:, 1:]
    token_ids = batch.token_ids.at[jnp.where(verify[:, None], spots, batch.num_tokens)].set(drafts, mode="drop")
    unused = (verify[batch.token_lanes]
              & (jnp.arange(batch.num_tokens) - first[batch.token_lanes] > num_drafts[batch.token_lanes]))
    batch = batch.replace(token_ids=token_ids, positions=jnp.where(unused, -1, batch.positions))
    manager, _, prefill_ok = manager.reserve(jnp.where(prefill, batch.seq_ids, -1), jnp.where(prefill, batch.q_lens, 0),
                                             max_new_tokens=batch.max_prefill_len)
    by_length = manager.rolls_back_by_length(k)  # static
    drafted = verify & (num_drafts > 0)
    slots = jnp.where(decode, batch.seq_ids, -1)
    if not by_length:
        checkpoint = _checkpoint_rows(manager, slots, batch.num_lanes)
        manager = manager.copy_state(jnp.where(drafted, slots, -1), jnp.where(drafted, checkpoint, -1))
    manager, starts, decode_ok = manager.reserve(slots, jnp.where(decode, num_drafts + 1, 0), max_new_tokens=width)
    batch = drop_decode_lanes(batch, decode_ok)
    batch = batch.replace(positions=jnp.where(prefill_ok | (batch.token_lanes >= batch.num_prefill),
                                              batch.positions, -1))
    verify = verify & decode_ok
    logits, manager = model.forward_packed(batch, manager, verify=verify, width=width)
    took = batch.sample & (batch.q_lens > 0) & jnp.where(decode, decode_ok, prefill_ok)
    tokens, counts, keys, accepted = _draw_lanes(logits, drafts, num_drafts, verify, took, sampling, keys)
    rejected = verify & (accepted < num_drafts)
    if by_length:
        manager, _ = manager.truncate(jnp.where(rejected, slots, -1), starts + accepted + 1)
    else:
        inputs = batch.token_ids[jnp.clip(first[:, None] + offset, 0, batch.num_tokens - 1)]
        manager = _restore_and_replay(model, manager, rejected, slots, checkpoint, inputs, starts, accepted)
    return manager, tokens, counts, keys, prefill_ok, decode_ok, manager.blocks_in_use, num_drafts, accepted


def _draw_lanes(logits: Float[Array, "S K1 V"], drafts, num_drafts, verify: Bool[Array, " S"],
                took: Bool[Array, " S"], sampling: RowSampling, keys, draft_probs=None):
    """A packed step's tokens with verify lanes (``logits`` as
    ``forward_packed(..., verify=, width=)`` returns them: a plain lane's
    columns all hold its last token's): a plain lane draws one token as
    :func:`~jaxkv.nn.steps.paged_packed_step` does, a verify lane its
    accepted drafts and one token of the target's (:func:`accept_drafts`).
    Returns ``(tokens [S, K1], counts [S], keys, accepted [S])``: lane
    ``s`` gave ``tokens[s, :counts[s]]`` (a plain lane 1 when it ``took`` a
    token, else 0); keys advanced for the lanes that took one; ``accepted``
    0 off the verify lanes."""
    advanced, subs = split_keys(keys)
    plain = sample(logits[:, -1], subs, sampling)
    emitted, accepted = accept_drafts(logits, drafts, num_drafts, sampling, None if _greedy(sampling) else subs,
                                      draft_probs=draft_probs)
    tokens = jnp.where(verify[:, None], emitted, plain[:, None])
    counts = jnp.where(verify, accepted + 1, took.astype(jnp.int32))
    return tokens, counts, jnp.where(took, advanced, keys), jnp.where(verify, accepted, 0)


def paged_packed_verify_step(graphdef, params, manager, pool, batch: PackedBatch, sampling: RowSampling, keys,
                             history, history_len, verify, *, config: SpeculativeConfig, window=None,
                             scrub: bool = False, draft_graphdef=None, draft_params=None):
    """:func:`~jaxkv.nn.steps.paged_packed_step` with speculative verify
    lanes: a decode lane marked in ``verify`` (bool ``[S]``) brings ``k +
    1`` tokens (its next token, then ``k`` placeholders at the following
    positions: :func:`jaxkv.serve.caches.pack_stream`'s verify lanes),
    which become n-gram drafts of its row's ``history[seq_id,
    :history_len[seq_id]]`` here on the device, so prefill pieces, plain
    decode lanes and verify lanes run in one model call. With
    ``draft_graphdef`` / ``draft_params`` (an early exit over this pool:
    ``early_exit_draft(..., share_pool=True)``; ``history`` unused) the
    drafts are that model's instead, ``k`` of them per verify lane, drawn
    in ``k`` decode steps of the draft over the lanes' appended positions
    before the packed call (:func:`_shared_pool_propose`; sampled lanes
    verify by the rejection rule against the draft's distribution).

    Every decode lane appends ``k + 1`` positions (one ``append_slots``,
    all or nothing: the engine's reserve counts the lookahead), the model
    returns the logits of a verify lane's ``k + 1`` tokens and of every
    other lane's last (:func:`~jaxkv.nn.packed.packed_logits`), plain lanes
    draw as :func:`~jaxkv.nn.steps.paged_packed_step` draws, verify lanes
    by :func:`accept_drafts`, and each decode lane is truncated to what it
    keeps (its token, and a verify lane's accepted drafts). Returns
    ``(manager, pool, tokens [S, k+1], counts [S], keys, decode_ok, blocked
    [S], blocks in use, drafted [S], accepted [S])``: lane ``s`` gave
    ``tokens[s, :counts[s]]`` (the host cuts them at a stop)."""
    k = config.num_speculative_tokens
    decode = batch.decode_lanes
    seqs = jnp.where(decode, batch.seq_ids, -1)
    starts = manager.seq_lens[jnp.clip(seqs, 0, manager.seq_lens.shape[0] - 1)]  # a trim keeps the lengths
    manager, pool, batch, blocked, ok = grow_decode_lanes(manager, pool, batch, k + 1, window, scrub)
    verify = verify & decode & ok
    batch = place_tokens(manager, batch)
    first = batch.cu_q_lens[:-1]
    probs = None
    if draft_graphdef is None:
        rows = jnp.where(verify, batch.seq_ids, 0)
        drafts, num_drafts = ngram_propose(history[rows], history_len[rows], k=k, max_n=config.prompt_lookup_max,
                                           min_n=config.prompt_lookup_min)
        num_drafts = jnp.where(verify, num_drafts, 0)
    else:
        # The draft's draws: a stream folded off each lane's key, which the verify's split then advances.
        key = None if _greedy(sampling) else _fold_keys(keys, _DRAFT_STREAM)
        lane_slots = jnp.where(verify[:, None], batch.slots[jnp.clip(
            first[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :], 0, batch.num_tokens - 1)], -1)
        drafts, probs, pool = _shared_pool_propose(draft_graphdef, draft_params, pool, batch.token_ids[first],
                                                   lane_slots, batch.block_tables, starts, verify, sampling=sampling,
                                                   key=key)
        num_drafts = jnp.where(verify, k, 0).astype(jnp.int32)
    # The drafts take the lane's placeholder tokens 1..k (padding lanes' writes dropped).
    spots = first[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
    token_ids = batch.token_ids.at[jnp.where(verify[:, None], spots, batch.num_tokens)].set(drafts, mode="drop")
    batch = batch.replace(token_ids=token_ids)
    logits, pool = nnx.merge(graphdef, params).forward_packed(batch, pool, verify=verify, width=k + 1)
    took = batch.sample & (batch.q_lens > 0)
    tokens, counts, keys, accepted = _draw_lanes(logits, drafts, num_drafts, verify, took, sampling, keys, probs)
    # Each decode lane that ran keeps its token and a verify lane its accepted drafts.
    kept, _ = manager.truncate(jnp.where(decode & ok, seqs, -1), starts + accepted + 1)
    if scrub:
        pool = scrub_kv_pool(pool, freed_blocks(manager.device, kept.device, null=False))
    return kept, pool, tokens, counts, keys, ok, blocked, kept.device.num_used, num_drafts, accepted


def hybrid_cache_options(model, num_drafts: int, rows: int, **make_cache_args) -> tuple[dict, int]:
    """How to build ``model``'s hybrid cache for verify steps of
    ``num_drafts`` drafts over ``rows`` rows: ``(options, checkpoint
    rows)``. Window rings get ``num_drafts`` slots of slack (``options``:
    ``ring_slack``, for a model that has them); a cache that then still
    holds state a rejected token overwrites (Gated DeltaNet states,
    DeepSeek-V4's rings and compressors) needs ``rows`` checkpoint rows,
    the last of its ``num_snapshots`` (:func:`_hybrid_verify`); one whose
    only state is slack rings needs none. ``make_cache_args``: the other
    ``make_cache`` arguments (a probe of shapes only is built)."""
    probe = jax.eval_shape(lambda: model.make_cache(1, **make_cache_args))
    options = {}
    if probe.window_pool is not None:
        options = {"ring_slack": num_drafts}
        probe = jax.eval_shape(lambda: model.make_cache(1, **make_cache_args, **options))
    return options, 0 if probe.rolls_back_by_length(num_drafts) else rows


@partial(jax.jit, static_argnames=("graphdef", "config", "draft_graphdef"), donate_argnums=(2,),
         compiler_options=PROGRAM_OPTIONS)
def speculative_loop(graphdef, params, state: SpecState, sampling: SamplingParams | RowSampling,
                     config: SpeculativeConfig, draft_graphdef=None, draft_params=None) -> SpecState:
    """:func:`speculative_body` in one ``lax.while_loop`` until every row
    finished or an allocation failed (the state is donated)."""
    return jax.lax.while_loop(lambda s: jnp.any(~s.decode.finished) & s.decode.ok,
                              lambda s: speculative_body(graphdef, params, s, sampling, config,
                                                         draft_graphdef=draft_graphdef, draft_params=draft_params),
                              state)


@partial(jax.jit, static_argnames=("graphdef", "config", "draft_graphdef"), donate_argnums=(2,),
         compiler_options=PROGRAM_OPTIONS)
def speculative_step(graphdef, params, state: SpecState, sampling: SamplingParams | RowSampling,
                     config: SpeculativeConfig, draft_graphdef=None, draft_params=None) -> SpecState:
    """One :func:`speculative_body` as one jitted call (the state is donated)."""
    return speculative_body(graphdef, params, state, sampling, config, draft_graphdef=draft_graphdef,
                            draft_params=draft_params)


def draft_model_for(target, config: SpeculativeConfig):
    """The draft model of a ``draft_model`` config: the target's first
    ``draft_layers`` layers over the target's own pool
    (:func:`~jaxkv.nn.speculative.early_exit_draft` with ``share_pool``),
    or ``model`` (a jaxkv model, or a checkpoint path loaded with
    ``AutoModelForCausalLM``). It must run over a paged pool and share the
    target's vocabulary (``InvalidArgument`` otherwise)."""
    if config.draft_layers is not None:
        draft = early_exit_draft(target, config.draft_layers, share_pool=True)
    elif isinstance(config.model, (str, os.PathLike)):
        from jaxkv.nn.auto import AutoModelForCausalLM  # noqa: PLC0415 (auto imports every family)

        draft = AutoModelForCausalLM.from_pretrained(config.model)
    else:
        draft = config.model
    if cache_kind(draft) != "paged":
        raise InvalidArgument(f"the draft model {type(draft).__name__} keeps a hybrid cache; a draft runs over a "
                              "paged pool (a Llama-family or DeepSeek-V3 model)")
    vocab, draft_vocab = target.config.vocab_size, draft.config.vocab_size
    if vocab != draft_vocab:
        raise InvalidArgument(f"the draft model's vocabulary has {draft_vocab} tokens, the target's {vocab}: "
                              "they must be the same")
    return draft


def early_exit_draft(model, num_layers: int, *, share_pool: bool = False):
    """A self-speculative draft: ``model``'s first ``num_layers`` layers with
    its embedding, final norm and head (the same arrays, copied), as a model
    of the same family (LayerSkip's early exit, without its training).
    Families that export transformers-named tensors (``hf_state_dict``) and
    build from them; ``InvalidArgument`` otherwise, or for ``num_layers``
    not below the model's depth.

    ``share_pool``: the draft runs over ``model``'s own paged pool (its
    ``pool_layers`` is the target's depth; layer ``i`` reads and writes the
    pool's layer ``i``, the layers past ``num_layers`` are left alone).
    The K/V the target writes for its first layers are then the draft's:
    the draft needs no cache, no prefill and no rollback of its own
    (:func:`_shared_pool_propose`). Else it takes a pool of its own depth."""
    if not hasattr(model, "hf_state_dict") or not hasattr(type(model), "from_hf_state_dict"):
        raise InvalidArgument(f"draft_layers: {type(model).__name__} cannot be cut to its first layers (it has no "
                              "hf_state_dict / from_hf_state_dict); give a draft model instead")
    depth = model.config.num_hidden_layers
    if not 1 <= num_layers < depth:
        raise InvalidArgument(f"draft_layers={num_layers}: must be in [1, {depth}) for a model of {depth} layers")
    hf = model.config.to_hf()
    hf["num_hidden_layers"] = num_layers
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = hf["layer_types"][:num_layers]
    config = type(model.config).from_hf(hf)
    tensors = {name: value for name, value in model.hf_state_dict().items()
               if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers)}
    # The target's compute settings (dtypes, kernels, scan) where its family takes them.
    settings = {name: getattr(model, name) for name in ("dtype", "param_dtype", "precision", "implementation",
                                                         "interpret") if hasattr(model, name)}
    if hasattr(model, "layers") and hasattr(model.layers, "reps"):
        settings["scan_layers"] = bool(model.layers.reps)
    accepted = inspect.signature(type(model).from_hf_state_dict).parameters
    draft = type(model).from_hf_state_dict(config, tensors, **{k: v for k, v in settings.items() if k in accepted})
    if share_pool:
        draft.pool_layers = depth
    return draft
