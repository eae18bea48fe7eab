"""Penalties and logit bias, applied to the logits inside the jitted sampler.

What each request may ask (:class:`Penalties`, OpenAI's and vLLM's rules):

* ``presence`` (OpenAI ``presence_penalty``, in ``[-2, 2]``): subtracted
  from the logit of every token the request has generated at least once;
* ``frequency`` (``frequency_penalty``, ``[-2, 2]``): subtracted once per
  time the token was generated;
* ``repetition`` (vLLM / transformers ``repetition_penalty``, ``(0, 10]``,
  1 = off): the logit of every token seen in the prompt or the output is
  divided by it when positive, multiplied when not;
* ``logit_bias`` (token id -> value in ``[-100, 100]``, at most
  :data:`MAX_LOGIT_BIAS` entries): added to those tokens' logits;
* ``min_tokens``: until the request has generated that many tokens, its
  stop token ids (EOS included) get ``-inf``.

The order is vLLM's: repetition, then frequency and presence, then the
bias, then the ``min_tokens`` ban; temperature, top-k and top-p come after
(:func:`jaxkv.nn.sampling.sample`), so the processed log-probabilities
include all of it.

On the device a batch's penalties are :class:`RowPenalties` (per-row
arrays; a batch where no request asks takes none, so it costs nothing)
with each row's tokens so far (``history``: prompt then output), from which
:func:`seen_tokens` builds the per-row ``[B, V]`` state once per jitted
call; the decode loop then adds each token it samples (:func:`count`), so
the multi-step loop needs no host.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv._ops import pow2_at_least
from jaxkv.errors import InvalidArgument

__all__ = ["MAX_LOGIT_BIAS", "MAX_STOP_IDS", "Penalties", "RowPenalties", "SeenTokens", "apply_penalties", "count",
           "penalized", "seen_tokens"]

#: The most ``logit_bias`` entries a request may give (OpenAI's bound).
MAX_LOGIT_BIAS = 300
#: The most stop token ids ``min_tokens`` bans (EOS included).
MAX_STOP_IDS = 16


def _number(name: str, value, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidArgument(f"Penalties.{name} must be a finite real number, got {value!r}")
    if (value <= low if low_open else value < low) or value > high:
        raise InvalidArgument(f"Penalties.{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Penalties:
    """One request's penalties (module docstring); the defaults are off.
    Checked here: ``InvalidArgument`` naming the field for a value out of
    its range, a bias key that is not a non-negative integer, or more than
    :data:`MAX_LOGIT_BIAS` bias entries (token ids are checked against the
    vocabulary where the request enters the engine)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple = ()  # ((token id, bias), ...); a dict is accepted and stored sorted
    min_tokens: int = 0
    #: Whether every field is at its default (nothing to apply). Computed once: the engine asks it of every
    #: request on every step.
    is_off: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "presence", _number("presence", self.presence, -2.0, 2.0))
        object.__setattr__(self, "frequency", _number("frequency", self.frequency, -2.0, 2.0))
        object.__setattr__(self, "repetition", _number("repetition", self.repetition, 0.0, 10.0, low_open=True))
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            items = [(token, value) for token, value in items]
        except (TypeError, ValueError):
            raise InvalidArgument(f"Penalties.logit_bias must map token ids to numbers, got {bias!r}") from None
        if len(items) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"Penalties.logit_bias has {len(items)} entries; at most {MAX_LOGIT_BIAS}")
        checked = {}
        for token, value in items:
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, numbers.Integral) or token < 0:
                raise InvalidArgument(f"Penalties.logit_bias: {token!r} is not a token id (an integer >= 0)")
            checked[int(token)] = _number(f"logit_bias[{token}]", value, -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple(sorted(checked.items())))
        min_tokens = self.min_tokens
        if isinstance(min_tokens, (bool, np.bool_)) or not isinstance(min_tokens, numbers.Integral) or min_tokens < 0:
            raise InvalidArgument(f"Penalties.min_tokens must be an integer >= 0, got {min_tokens!r}")
        object.__setattr__(self, "min_tokens", int(min_tokens))
        object.__setattr__(self, "is_off", self.presence == 0 and self.frequency == 0 and self.repetition == 1
                           and not self.logit_bias and self.min_tokens == 0)


OFF = Penalties()


@struct.dataclass
class RowPenalties:
    """A batch's penalties as arrays (row ``b``'s request's :class:`Penalties`)
    and each row's tokens so far: ``history[b, :prompt_len[b]]`` its prompt,
    ``history[b, prompt_len[b]:length[b]]`` its output; ``bias_ids`` /
    ``stop_ids`` padded with -1."""

    presence: Float[Array, " B"]
    frequency: Float[Array, " B"]
    repetition: Float[Array, " B"]
    bias_ids: Int[Array, "B NB"]
    bias: Float[Array, "B NB"]
    min_tokens: Int[Array, " B"]
    stop_ids: Int[Array, "B NS"]
    history: Int[Array, "B H"]
    prompt_len: Int[Array, " B"]
    length: Int[Array, " B"]

    @classmethod
    def stack(cls, rows: list, width: int) -> RowPenalties:
        """Host arrays for ``rows``: per row None (no request, or one without
        penalties) or ``(penalties, prompt, output, stop ids)``; histories
        cut at ``width`` tokens (the most recent kept)."""
        batch = len(rows)
        # A power of two: one program per bucket, not per count.
        bias_width = pow2_at_least(max([len(r[0].logit_bias) for r in rows if r is not None] + [1]))
        out = dict(presence=np.zeros(batch, np.float32), frequency=np.zeros(batch, np.float32),
                   repetition=np.ones(batch, np.float32), bias_ids=np.full((batch, bias_width), -1, np.int32),
                   bias=np.zeros((batch, bias_width), np.float32), min_tokens=np.zeros(batch, np.int32),
                   stop_ids=np.full((batch, MAX_STOP_IDS), -1, np.int32), history=np.zeros((batch, width), np.int32),
                   prompt_len=np.zeros(batch, np.int32), length=np.zeros(batch, np.int32))
        for b, row in enumerate(rows):
            if row is None:
                continue
            pen, prompt, output, stops = row
            out["presence"][b], out["frequency"][b], out["repetition"][b] = pen.presence, pen.frequency, pen.repetition
            out["min_tokens"][b] = pen.min_tokens
            if pen.logit_bias:
                ids, values = zip(*pen.logit_bias)
                out["bias_ids"][b, :len(ids)], out["bias"][b, :len(ids)] = ids, values
            stops = list(stops)[:MAX_STOP_IDS]
            out["stop_ids"][b, :len(stops)] = stops
            tokens = (list(prompt) + list(output))[-width:]
            prompt_len = max(len(prompt) - (len(prompt) + len(output) - len(tokens)), 0)
            out["history"][b, :len(tokens)] = tokens
            out["prompt_len"][b], out["length"][b] = prompt_len, len(tokens)
        return cls(**out)


@struct.dataclass
class SeenTokens:
    """Per row: ``in_prompt [B, V]`` the tokens its prompt holds, ``counts
    [B, V]`` how often each token is in its output, ``generated [B]`` its
    output's length."""

    in_prompt: Bool[Array, "B V"]
    counts: Int[Array, "B V"]
    generated: Int[Array, " B"]


def seen_tokens(penalties: RowPenalties, vocab: int) -> SeenTokens:
    """The per-row state of ``penalties``' histories (one scatter each)."""
    batch, width = penalties.history.shape
    position = jnp.arange(width, dtype=jnp.int32)[None, :]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))
    prompt = position < penalties.prompt_len[:, None]
    output = (position >= penalties.prompt_len[:, None]) & (position < penalties.length[:, None])
    tokens = jnp.clip(penalties.history, 0, vocab - 1)
    in_prompt = jnp.zeros((batch, vocab), bool).at[rows, tokens].max(prompt)
    counts = jnp.zeros((batch, vocab), jnp.int32).at[rows, tokens].add(output.astype(jnp.int32))
    return SeenTokens(in_prompt=in_prompt, counts=counts, generated=penalties.length - penalties.prompt_len)


def count(seen: SeenTokens, tokens: Int[Array, " B"], took: Bool[Array, " B"]) -> SeenTokens:
    """``seen`` after the rows that ``took`` a token generated ``tokens``."""
    rows = jnp.arange(tokens.shape[0])
    return seen.replace(counts=seen.counts.at[rows, tokens].add(took.astype(jnp.int32)),
                        generated=seen.generated + took)


def apply_penalties(logits: Float[Array, "B V"], penalties: RowPenalties, seen: SeenTokens) -> Float[Array, "B V"]:
    """``logits`` with each row's penalties applied (module docstring's
    order), float32."""
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    repetition = penalties.repetition[:, None]
    in_output = seen.counts > 0
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen.in_prompt | in_output, repeated, logits)
    logits = logits - penalties.frequency[:, None] * seen.counts - penalties.presence[:, None] * in_output
    bias_ids = penalties.bias_ids
    logits = logits.at[rows, jnp.where(bias_ids >= 0, bias_ids, vocab)].add(penalties.bias, mode="drop")
    early = (seen.generated < penalties.min_tokens)[:, None]
    stops = jnp.where(early & (penalties.stop_ids >= 0), penalties.stop_ids, vocab)
    return logits.at[rows, stops].set(-jnp.inf, mode="drop")


def penalized(logits: Float[Array, "B V"], penalties: RowPenalties | None) -> Float[Array, "B V"]:
    """``logits`` with ``penalties`` applied from their histories (a call
    that samples one token per row); as they are when None."""
    if penalties is None:
        return logits
    return apply_penalties(logits, penalties, seen_tokens(penalties, logits.shape[-1]))
