"""The packed batch: one scheduler iteration's work as one flat token stream.

A packed (ragged) step runs the decode token of each running request and the
prefill pieces of others end to end, with no padding between them, in ONE
model call (vLLM v1, SGLang, tpu-inference). :class:`PackedBatch` is that
call's description, the same for every model family:

* ``token_ids [T]``, ``positions [T]``: the flat stream (padding tokens past
  ``cu_q_lens[S]`` have position -1 and id 0);
* ``token_lanes [T]``: the lane (request of this step) of each token
  (padding: 0; a padding token is told apart by its position);
* ``cu_q_lens [S + 1]``: lane ``s`` owns tokens ``[cu_q_lens[s],
  cu_q_lens[s + 1])``, at positions ``kv_lens[s] - q_len .. kv_lens[s] - 1``;
* ``kv_lens [S]``: tokens lane ``s``'s request holds after this step;
* ``seq_ids [S]``: the request's sequence row (paged pool) or request slot
  (hybrid :class:`~jaxkv.KVCacheManager`) per lane (-1: an idle lane);
* ``sample [S]``: the lanes that sample a token from their last position
  (decode lanes, and prefill lanes whose piece ends the prompt);
* ``num_prefill []``: lanes ``[0, num_prefill)`` are prefill lanes, which
  write into blocks their requests took at admission; the lanes after them
  are decode lanes (at most one token each), which the step grows by a
  token. Decode lanes are the tail of the stream, so a step can drop them
  all by cutting ``cu_q_lens`` (when they cannot grow);
* ``slots [T]``, ``block_tables [S, M]``: a paged pool's write slot per token
  and table per lane, filled on device by the step (None before; a hybrid
  cache keeps its own tables).

Static fields bound the shapes (each distinct value compiles one program):
``T`` (the bucketed stream length), ``S`` (lanes, the engine's
``max_seqs``), and the segment classes: lanes ``[0, num_prefill_lanes)``
may carry up to ``max_prefill_len`` tokens, the other lanes at most one
(``num_prefill <= num_prefill_lanes``; a paged-pool step never looks at
them and keeps them fixed, ``S`` and ``T``, so it compiles once per ``T``).
Per-token work (projections, MLPs, MoE, norms) runs over the flat
stream; only the per-request sequence mixers that need a ``[rows, width]``
layout (Gated DeltaNet's chunked delta rule and causal conv) view it through
:meth:`PackedBatch.segments`, one small padded view per lane class.

:func:`pack` builds a batch on the host from ``(seq_id, tokens, start,
sample)`` lanes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

from jaxkv.errors import InvalidArgument

__all__ = ["CACHE_KINDS", "PackedBatch", "PackedLane", "cache_kind", "host_arrays", "lane_logits", "logit_tokens", "pack",
           "packed_logits", "write_lanes"]


#: What a model keeps its cache in: ``"paged"`` (a :class:`~jaxkv.KVPool`
#: under a :class:`~jaxkv.BlockSpaceManager`; ``model.make_pool``,
#: ``forward_packed(batch, pool)``) or ``"hybrid"`` (a
#: :class:`~jaxkv.KVCacheManager`; ``model.make_cache``,
#: ``forward_packed(batch, manager)``).
CACHE_KINDS = ("paged", "hybrid")


def cache_kind(model) -> str:
    """The model's ``cache_kind`` class attribute (one of :data:`CACHE_KINDS`);
    ``InvalidArgument`` for a model that declares none."""
    kind = getattr(model, "cache_kind", None)
    if kind not in CACHE_KINDS:
        raise InvalidArgument(f"{type(model).__name__} declares no cache_kind ({' or '.join(CACHE_KINDS)}): "
                              "jaxkv runs the families of jaxkv.nn.AutoModelForCausalLM")
    return kind


@dataclasses.dataclass(frozen=True)
class PackedLane:
    """One request's part of a packed step (host side): its sequence row or
    request slot ``seq_id``, the ``tokens`` it brings, the position of the
    first (``start``: tokens it held before the step) and whether it samples
    a token from its last position."""

    seq_id: int
    tokens: Sequence[int]
    start: int
    sample: bool = True


@struct.dataclass
class PackedBatch:
    """One packed step (see the module docstring). Fields:

    token_ids, positions, token_lanes: ``[T]`` int32.
    cu_q_lens: ``[S + 1]`` int32; kv_lens, seq_ids: ``[S]`` int32; sample: ``[S]`` bool.
    num_prefill: ``[]`` int32, the prefill lanes (the first ones).
    slots: ``[T]`` int32 or None; block_tables: ``[S, M]`` int32 or None.
    num_prefill_lanes, max_prefill_len: static lane classes.

    Invariants: ``cu_q_lens`` is non-decreasing from 0 to at most ``T``;
    ``num_prefill <= num_prefill_lanes``; lane ``s < num_prefill_lanes`` has
    ``q_len <= max_prefill_len``, every other lane ``q_len <= 1``; ``q_len <= kv_lens[s]``; a token's position
    is ``kv_lens[s] - q_len + i`` for its index ``i`` in its lane, -1 past
    ``cu_q_lens[S]``; an idle lane (``seq_id`` -1) has no tokens.
    """

    token_ids: Int[Array, " T"]
    positions: Int[Array, " T"]
    token_lanes: Int[Array, " T"]
    cu_q_lens: Int[Array, " S1"]
    kv_lens: Int[Array, " S"]
    seq_ids: Int[Array, " S"]
    sample: Bool[Array, " S"]
    num_prefill: Int[Array, ""]
    slots: Int[Array, " T"] | None = None
    block_tables: Int[Array, "S M"] | None = None
    #: Prompt scoring (``prompt_logprobs``): stream indices whose logits are returned too, after each lane's
    #: last token's, and the token that follows each (whose log-probability is read); None: none.
    scored: Int[Array, " E"] | None = None
    scored_targets: Int[Array, " E"] | None = None
    num_prefill_lanes: int = struct.field(pytree_node=False, default=0)
    max_prefill_len: int = struct.field(pytree_node=False, default=1)

    @property
    def num_tokens(self) -> int:
        """``T``: the stream's static length (real tokens and padding)."""
        return self.token_ids.shape[0]

    @property
    def num_lanes(self) -> int:
        return self.seq_ids.shape[0]

    @property
    def q_lens(self) -> Int[Array, " S"]:
        return self.cu_q_lens[1:] - self.cu_q_lens[:-1]

    @property
    def decode_lanes(self) -> Bool[Array, " S"]:
        """Lanes the step grows by one token (after the prefill lanes, with a token)."""
        lane = jnp.arange(self.num_lanes, dtype=jnp.int32)
        return (lane >= self.num_prefill) & (self.q_lens > 0) & (self.seq_ids >= 0)

    @property
    def real(self) -> Bool[Array, " T"]:
        return self.positions >= 0

    @property
    def last_tokens(self) -> Int[Array, " S"]:
        """Flat index of each lane's last token (0 for a lane with none)."""
        return jnp.maximum(self.cu_q_lens[1:] - 1, 0)

    @property
    def logits_at(self) -> Int[Array, " L"]:
        """The stream indices a model's packed step returns logits for:
        each lane's last token (``[S]``), then the ``scored`` ones."""
        if self.scored is None:
            return self.last_tokens
        return jnp.concatenate([self.last_tokens, self.scored])

    def segments(self, lanes: str, decode_width: int = 1):
        """A ``[rows, width]`` view of one lane class: ``"prefill"`` (rows
        ``num_prefill_lanes``, width ``max_prefill_len``) or ``"decode"``
        (the other lanes, width ``decode_width``: 1, or a speculative verify
        lane's ``k + 1`` when the step has them). Returns ``(first_lane, index [rows,
        width], valid [rows, width])``: ``index`` are flat token indices
        (clamped into ``[0, T)``), ``valid`` marks the lane's real tokens.
        Gather with ``x[index]``; scatter back with ``x.at[where(valid,
        index, T)].set(y, mode="drop")``."""
        if lanes == "prefill":
            first, rows, width = 0, self.num_prefill_lanes, self.max_prefill_len
        elif lanes == "decode":
            first, rows, width = self.num_prefill_lanes, self.num_lanes - self.num_prefill_lanes, decode_width
        else:
            raise InvalidArgument(f"lanes must be 'prefill' or 'decode', got {lanes!r}")
        lane = first + jnp.arange(rows, dtype=jnp.int32)
        offset = jnp.arange(width, dtype=jnp.int32)[None, :]
        index = self.cu_q_lens[lane][:, None] + offset
        valid = offset < self.q_lens[lane][:, None]
        return first, jnp.clip(index, 0, self.num_tokens - 1), valid


def pack(lanes: Sequence[PackedLane], *, num_lanes: int, num_tokens: int, num_prefill_lanes: int = 0,
         max_prefill_len: int = 1, num_prefill: int | None = None) -> PackedBatch:
    """Build a :class:`PackedBatch` on the host: lane ``i`` of the batch is
    ``lanes[i]`` (idle lanes after them); the first ``num_prefill`` lanes
    (default ``num_prefill_lanes``) are prefill lanes, the others decode
    lanes. The first ``num_prefill_lanes`` lanes may bring up to
    ``max_prefill_len`` tokens, the rest at most one. Raises
    ``InvalidArgument`` (with the numbers) when the lanes do not fit those
    bounds."""
    num_prefill = num_prefill_lanes if num_prefill is None else num_prefill
    if not 0 <= num_prefill <= num_prefill_lanes:
        raise InvalidArgument(f"num_prefill={num_prefill} must be in [0, num_prefill_lanes={num_prefill_lanes}]")
    if len(lanes) > num_lanes:
        raise InvalidArgument(f"{len(lanes)} lanes for a batch of {num_lanes}")
    total = sum(len(lane.tokens) for lane in lanes)
    if total > num_tokens:
        raise InvalidArgument(f"the lanes bring {total} tokens, more than the batch's {num_tokens}")
    arrays = host_arrays(num_lanes, num_tokens)
    token_ids, positions, token_lanes, cu, kv_lens, seq_ids, sample = arrays
    at = write_lanes(lanes, arrays, num_prefill_lanes=num_prefill_lanes, max_prefill_len=max_prefill_len)
    cu[len(lanes) + 1:] = at
    return PackedBatch(token_ids=jnp.asarray(token_ids), positions=jnp.asarray(positions),
                       token_lanes=jnp.asarray(token_lanes), cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv_lens),
                       seq_ids=jnp.asarray(seq_ids), sample=jnp.asarray(sample),
                       num_prefill=jnp.asarray(num_prefill, jnp.int32), num_prefill_lanes=int(num_prefill_lanes), max_prefill_len=int(max_prefill_len))


def host_arrays(num_lanes: int, num_tokens: int) -> tuple[np.ndarray, ...]:
    """A packed batch's arrays, empty, on the host: ``(token_ids,
    positions, token_lanes, cu_q_lens, kv_lens, seq_ids, sample)``."""
    return (np.zeros((num_tokens,), np.int32), np.full((num_tokens,), -1, np.int32),
            np.zeros((num_tokens,), np.int32), np.zeros((num_lanes + 1,), np.int32), np.zeros((num_lanes,), np.int32),
            np.full((num_lanes,), -1, np.int32), np.zeros((num_lanes,), bool))


def write_lanes(lanes: Sequence[PackedLane], arrays: tuple, *, num_prefill_lanes: int, max_prefill_len: int) -> int:
    """Write ``lanes`` as lanes ``0..`` of the :func:`host_arrays`
    ``arrays`` (``InvalidArgument`` for a lane over its class's bound: the
    first ``num_prefill_lanes`` take up to ``max_prefill_len`` tokens, the
    others one). Returns the tokens written."""
    token_ids, positions, token_lanes, cu, kv_lens, seq_ids, sample = arrays
    at = 0
    for i, lane in enumerate(lanes):
        n = len(lane.tokens)
        bound = max_prefill_len if i < num_prefill_lanes else 1
        if n > bound:
            raise InvalidArgument(f"lane {i} brings {n} tokens; lanes of its class take at most {bound} "
                                  f"({num_prefill_lanes} prefill lanes of {max_prefill_len})")
        token_ids[at:at + n] = lane.tokens
        positions[at:at + n] = np.arange(lane.start, lane.start + n)
        token_lanes[at:at + n] = i
        kv_lens[i] = lane.start + n
        seq_ids[i] = lane.seq_id
        sample[i] = lane.sample and n > 0
        at += n
        cu[i + 1] = at
    return at


def logit_tokens(batch: PackedBatch, verify, width: int):
    """Flat token indices ``[S, width]`` whose logits a packed step needs:
    a ``verify`` lane's first ``width`` tokens (a speculative verify lane:
    its fed token and drafts), every other lane's last token (repeated);
    a verify lane's indices past its tokens repeat its last."""
    offset = jnp.arange(width, dtype=jnp.int32)[None, :]
    first = batch.cu_q_lens[:-1][:, None]
    last = batch.last_tokens[:, None]
    return jnp.where(verify[:, None], jnp.minimum(first + offset, last), last)


def lane_logits(logits_of, hidden, batch: PackedBatch, verify=None, width: int = 1):
    """``logits_of`` (a model's final norm and LM head) on the stream's
    hidden states ``hidden [T, ...]`` that a packed step returns logits
    for: ``batch.logits_at`` (``[S, V]``, or more with scored prompt
    tokens), or with ``verify`` (bool ``[S]``) those of
    :func:`logit_tokens` (``[S, width, V]``)."""
    if verify is None:
        return logits_of(hidden[batch.logits_at])
    index = logit_tokens(batch, verify, width)
    return logits_of(hidden[index.reshape(-1)]).reshape(*index.shape, -1)


def packed_logits(model, batch: PackedBatch, pool, x, verify=None, width: int = 1):
    """The packed step of a paged-pool model (Llama family, DeepSeek-V3):
    ``x [1, T, hidden]`` (the embedded stream) through every decoder layer in
    ``"ragged"`` mode, then the final norm and LM head on each lane's last
    token only. Returns ``(logits [S, V] float32, pool)``; with ``verify``
    (bool ``[S]``, speculative verify lanes) ``logits [S, width, V]`` at
    :func:`logit_tokens`."""
    if batch.slots is None or batch.block_tables is None:
        raise InvalidArgument("a paged packed step needs the batch's slots and block_tables (filled on device)")
    model._check_pool(pool)
    positions, slots = batch.positions[None], batch.slots[None]

    def step(layer, i, carry):
        x, pool = carry
        return layer(x, positions, pool, i, slots, None, None, None, mode="ragged", batch=batch)

    x, pool = model.layers.run(step, (x, pool))  # a DecoderStack: scanned where layers repeat
    if verify is None:
        return model.logits_from_hidden(x[:, batch.logits_at])[0], pool
    index = logit_tokens(batch, verify, width)
    return model.logits_from_hidden(x[0][index]), pool
