"""Token sampling: :class:`SamplingParams` and the one per-row sampler.

Every decode path of jaxkv (``generate``, ``sample_n``, ``beam_search``'s
callers and the serving engine) draws its tokens with :func:`sample`.

Rule, per row ``b`` of ``logits [B, V]``:

* ``temperature[b] == 0``: greedy, ``argmax`` (ties: the lowest id);
* otherwise a softmax draw from ``logits[b] / temperature[b]`` restricted to
  the ``top_k[b]`` most likely tokens (0 = all; ties at the k-th value are
  all kept) and then to the smallest set of the most likely tokens whose
  probability reaches ``top_p[b]`` (1 = all). The most likely token is
  always kept, whatever ``top_p`` and however small ``temperature`` (as in
  vLLM: a vanishing ``top_p`` or ``temperature`` tends to greedy, never to
  an empty set, whose draw would be token 0).

Parameters come either as one :class:`SamplingParams` (static: the same for
every row; a greedy one compiles to a bare ``argmax``) or as
:class:`RowSampling` (traced ``[B]`` arrays, so a batch mixing requests with
different parameters does not recompile). Keys come as one PRNG key (one
draw over the whole batch) or one key per row (``[B]``; row ``b`` draws with
``keys[b]`` alone, so its tokens do not depend on the other rows).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.errors import InvalidArgument
from jaxkv.nn.constraints import RowConstraints, constrain
from jaxkv.nn.penalties import RowPenalties, penalized
from jaxtyping import Array, Float, Int

__all__ = ["GREEDY", "LOGPROBS_MODES", "MAX_TOP_LOGPROBS", "TOP_K_MAX", "RowSampling", "SamplingParams",
           "TokenLogprobs", "filtered_logits", "row_rules", "sample", "sample_with_logprobs", "score_tokens",
           "split_keys", "token_logprobs"]


_F32 = np.finfo(np.float32)
#: The most top log-probabilities a token reports (OpenAI's ``top_logprobs`` bound).
MAX_TOP_LOGPROBS = 20
#: Where log-probabilities are read (vLLM's ``logprobs_mode`` names, less its logits modes):
#: ``"processed"`` the distribution a row samples from (``filtered_logits``: temperature, top-k and top-p
#: applied, tokens outside them at -inf; a greedy row's is the plain softmax), ``"raw"`` the model's
#: softmax before any of it.
LOGPROBS_MODES = ("processed", "raw")
#: The largest ``top_k`` (the device holds it as int32).
TOP_K_MAX = 2**31 - 1


def _real(name: str, value) -> float:
    """``value`` as a float if it is a finite real number (not a bool), else
    ``InvalidArgument`` naming ``SamplingParams.<name>``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"SamplingParams.{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidArgument(f"SamplingParams.{name} must be finite, got {number!r}")
    return number


def _normal_f32(number: float) -> bool:
    """Whether ``number`` is, as float32 (the device's dtype), finite and at
    least float32's smallest normal (``1.1754944e-38``): subnormals flush to
    0 on XLA's CPU and GPU backends, so a positive subnormal would reach the
    sampler as 0."""
    with np.errstate(over="ignore", under="ignore"):
        as32 = np.float32(number)
    return bool(np.isfinite(as32) and as32 >= _F32.smallest_normal)


@struct.dataclass
class SamplingParams:
    """One sampling rule for every row (see the module docstring): greedy when
    ``temperature == 0``; otherwise softmax sampling at ``temperature`` over
    the ``top_k`` most likely tokens (0 = all) and the smallest set whose
    probability reaches ``top_p`` (1 = all), the most likely token always
    kept.

    A pytree with no array leaves (every field is static), so passing it to a
    jitted function specialises the program to it, as a static argument would.

    Every field is checked here, where it enters, so that nothing downstream
    (:meth:`RowSampling.stack`, the engine's int32 / float32 casts) can fail
    on it: ``InvalidArgument`` naming the field and the value unless

    * ``temperature`` is a real number (not a bool), finite, and either 0 or
      a positive normal float32 (in ``[1.1754944e-38, 3.4028235e38]``:
      a positive subnormal would flush to 0 on the device, past float32's
      max it would be inf);
    * ``top_k`` is an integer (not a bool, not a float) in ``[0, 2**31 - 1]``
      (int32 on the device);
    * ``top_p`` is a real number in ``(0, 1]`` that is a positive normal
      float32 (``>= 1.1754944e-38``). Below that it would flush to 0 on the
      device; the sampler keeps the most likely token whatever ``top_p`` is,
      so the smallest accepted value samples the argmax, as any tiny
      ``top_p`` does.

    The checked values are stored as Python numbers (``temperature`` and
    ``top_p`` a ``float``, ``top_k`` an ``int``; a numpy scalar is
    converted).
    """

    temperature: float = struct.field(pytree_node=False, default=0.0)
    top_k: int = struct.field(pytree_node=False, default=0)
    top_p: float = struct.field(pytree_node=False, default=1.0)

    def __post_init__(self):
        temperature = _real("temperature", self.temperature)
        if temperature < 0 or (temperature > 0 and not _normal_f32(temperature)):
            raise InvalidArgument(
                f"SamplingParams.temperature must be 0 or in [{_F32.smallest_normal:.8g}, {_F32.max:.8g}] "
                f"(a positive normal float32), got {self.temperature!r}")
        top_k = self.top_k
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, numbers.Integral):
            raise InvalidArgument(
                f"SamplingParams.top_k must be an integer, got {type(top_k).__name__} {top_k!r}")
        if not 0 <= top_k <= TOP_K_MAX:
            raise InvalidArgument(f"SamplingParams.top_k must be in [0, {TOP_K_MAX}] (0: off), got {top_k}")
        top_p = _real("top_p", self.top_p)
        if not (0 < top_p <= 1 and _normal_f32(top_p)):
            raise InvalidArgument(
                f"SamplingParams.top_p must be in (0, 1] and at least float32's smallest normal "
                f"{_F32.smallest_normal:.8g}, got {self.top_p!r}")
        # Frozen dataclass: store the checked values as plain Python numbers.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", int(top_k))
        object.__setattr__(self, "top_p", top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


#: Greedy decoding (the default everywhere).
GREEDY = SamplingParams()


@struct.dataclass
class RowSampling:
    """Per-row sampling parameters as traced arrays.

    Fields:
        temperature: ``[B]`` float32, ``>= 0`` (0: greedy row).
        top_k: ``[B]`` int32, ``>= 0`` (0: no top-k filter).
        top_p: ``[B]`` float32 in ``(0, 1]`` (1: no nucleus filter).
    """

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]
    #: Static: the top log-probabilities each sampled token reports (:func:`token_logprobs`); -1: none
    #: computed, 0: the sampled token's own only. A program per value: the engine uses -1 or
    #: :data:`MAX_TOP_LOGPROBS`.
    logprobs: int = struct.field(pytree_node=False, default=-1)
    #: Static: which distribution they are read from (:data:`LOGPROBS_MODES`).
    logprobs_mode: str = struct.field(pytree_node=False, default="processed")
    #: Penalties, logit bias and ``min_tokens`` (:mod:`jaxkv.nn.penalties`), applied before the rest; None:
    #: no row has any (then nothing is computed for them).
    penalties: RowPenalties | None = None
    #: Structured-output constraints (:mod:`jaxkv.nn.constraints`), applied after the penalties; None: no
    #: row is constrained (then nothing is computed for them).
    constraints: RowConstraints | None = None

    @classmethod
    def broadcast(cls, params: SamplingParams, rows: int) -> RowSampling:
        """``params`` for each of ``rows`` rows."""
        return cls(jnp.full((rows,), params.temperature, jnp.float32), jnp.full((rows,), params.top_k, jnp.int32),
                   jnp.full((rows,), params.top_p, jnp.float32))

    @classmethod
    def stack(cls, rows: Sequence[SamplingParams | None]) -> RowSampling:
        """Row ``b`` follows ``rows[b]`` (None: greedy; e.g. an idle row).
        Host numpy arrays: build it outside ``jit``. Never raises for
        :class:`SamplingParams` built the ordinary way: their checks make
        every value fit the int32 / float32 arrays exactly (or to float32's
        rounding)."""
        rows = [GREEDY if p is None else p for p in rows]
        return cls(np.asarray([p.temperature for p in rows], np.float32), np.asarray([p.top_k for p in rows], np.int32),
                   np.asarray([p.top_p for p in rows], np.float32))


def row_rules(logits: Float[Array, "B V"], sampling: SamplingParams | RowSampling) -> Float[Array, "B V"]:
    """``logits`` with a :class:`RowSampling`'s per-row rules applied, for a
    call that samples one token per row from the rows' states as the host
    gave them: penalties and bias (:func:`~jaxkv.nn.penalties.penalized`),
    then structured-output masks (:func:`~jaxkv.nn.constraints.constrain`).
    A :class:`SamplingParams` has none."""
    if isinstance(sampling, SamplingParams):
        return logits
    return constrain(penalized(logits, sampling.penalties), sampling.constraints)


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(next_keys, subkeys)``: one ``jax.random.split`` of a single key, or
    of each key of a ``[B]`` array of per-row keys."""
    if keys.ndim == 0:
        return tuple(jax.random.split(keys))
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def sample(logits: Float[Array, "B V"], keys: jax.Array, params: SamplingParams | RowSampling) -> Int[Array, " B"]:
    """One token per row of ``logits [B, V]`` (int32 ``[B]``) by the rule of
    the module docstring. ``keys``: one typed PRNG key (``jax.random.key``),
    or ``[B]`` keys, one per row. ``params``: a :class:`SamplingParams` for
    every row, or :class:`RowSampling` arrays."""
    logits = jnp.asarray(logits)
    if isinstance(params, SamplingParams) and params.is_greedy:  # static: no sort, no draw
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _draw(logits, keys, *filtered_logits(logits, params))


def sample_with_logprobs(logits: Float[Array, "B V"], keys: jax.Array, params: SamplingParams | RowSampling
                         ) -> tuple[Int[Array, " B"], TokenLogprobs | None]:
    """:func:`sample`, and the tokens' :func:`token_logprobs` as ``params``
    asks (a :class:`RowSampling`'s static ``logprobs`` and
    ``logprobs_mode``; None when it asks none), the filtered logits
    computed once for both."""
    top_n = getattr(params, "logprobs", -1)
    if top_n < 0:
        return sample(logits, keys, params), None
    logits = jnp.asarray(logits)
    filtered = filtered_logits(logits, params)
    tokens = _draw(logits, keys, *filtered)
    return tokens, token_logprobs(logits, tokens, params, top_n, params.logprobs_mode, filtered=filtered)


def _draw(logits, keys, scaled, temperature) -> Int[Array, " B"]:
    """A draw from ``softmax(scaled)`` per row (:func:`filtered_logits`'
    results), the argmax of ``logits`` for a greedy row."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        raise InvalidArgument(f"sample needs typed PRNG keys (jax.random.key), got dtype {keys.dtype}")

    def drawn():
        if keys.ndim == 0:
            tokens = jax.random.categorical(keys, scaled, axis=-1)
        else:
            tokens = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled)
        return jnp.where(temperature > 0, tokens.astype(jnp.int32), greedy)

    # No row samples (every row greedy, the engine's idle rows too): the draw, a Gumbel noise over the whole
    # vocabulary per row, would be discarded; skip it. The keys are not advanced here either way.
    return jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: greedy)


def filtered_logits(logits: Float[Array, "B V"], params: SamplingParams | RowSampling
                    ) -> tuple[Float[Array, "B V"], Float[Array, " B"]]:
    """``(scaled, temperature)``: the logits :func:`sample` draws from,
    ``logits / temperature`` with every token outside the top-k and the
    nucleus at ``-inf`` (``softmax(scaled)`` is the distribution a
    non-greedy row samples from; speculative decoding's rejection rule
    compares these), and the per-row temperature (0: a greedy row, whose
    ``scaled`` are the logits divided by 1)."""
    vocab = logits.shape[-1]
    static = params if isinstance(params, SamplingParams) else None
    if static is not None:
        params = RowSampling.broadcast(static, logits.shape[0])
    temperature = jnp.asarray(params.temperature, jnp.float32)
    top_k = jnp.asarray(params.top_k, jnp.int32)
    top_p = jnp.asarray(params.top_p, jnp.float32)
    # Shifted so that each row's max is exactly 0 before dividing: a tiny
    # temperature then sends the other logits to -inf, never all of them
    # (all -inf would draw token 0); a row whose max is not finite is left
    # as it is (inf - inf would be NaN). Greedy rows divide by 1 so that no
    # inf/NaN is computed (their draw is discarded).
    shifted = logits.astype(jnp.float32)
    peak = jnp.max(shifted, axis=-1, keepdims=True)
    shifted = shifted - jnp.where(jnp.isfinite(peak), peak, 0.0)
    scaled = shifted / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # Both filters are the identity when no row asks for either (top_k 0 or >= V and top_p 1 in every row: the
    # engine's greedy and idle rows, plain temperature sampling): then skip them and their sort of the whole
    # vocabulary in every row, the most costly step of a sampler (a [256, 128256] sort per decode step at
    # Llama-3's vocabulary), whose result would change nothing.
    # (``~(top_p >= 1)``: a NaN top_p filters, as it does in _top_k_top_p.)
    if static is not None:  # known here: no program for a branch never taken
        filters = 0 < static.top_k < vocab or static.top_p < 1
        return (_top_k_top_p(scaled, top_k, top_p) if filters else scaled), temperature
    filters = jnp.any(((top_k > 0) & (top_k < vocab)) | ~(top_p >= 1))
    scaled = jax.lax.cond(filters, _top_k_top_p, lambda scaled, top_k, top_p: scaled, scaled, top_k, top_p)
    return scaled, temperature


def _top_k_top_p(scaled: Float[Array, "B V"], top_k: Int[Array, " B"], top_p: Float[Array, " B"]
                 ) -> Float[Array, "B V"]:
    """``scaled`` with each row's tokens outside its top-k, then outside its
    nucleus, at ``-inf`` (:func:`filtered_logits`)."""
    vocab = scaled.shape[-1]
    ordered = sorted_descending(scaled)  # most likely first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    # The most likely token is always in the nucleus: with a top_p the device
    # reads as 0 (or any top_p <= 0 in a RowSampling) no token would be, and
    # the draw over all -inf is token 0.
    # top_p = 1 keeps every token: float32's cumulative sum reaches 1.0 before the tail (tokens under ~6e-8
    # after a likely one), which ``before < 1`` would drop.
    nucleus = (before < top_p[:, None]) | (top_p >= 1)[:, None] | (jnp.arange(vocab) == 0)[None, :]
    cutoff = jnp.min(jnp.where(nucleus, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def sorted_descending(x: Float[Array, "B V"]) -> Float[Array, "B V"]:
    """Each row of float32 ``x`` sorted, largest first: ``jnp.sort(x)[:, ::-1]``
    (the same order: ``-0.0``, and subnormals, which XLA flushes, tie with
    ``0.0``; every NaN is the largest), by sorting int32 keys made once from
    the floats' bits, whose plain ``<`` is that order. ``jnp.sort`` hands
    XLA a comparator that makes those keys inside every comparison: 6-7x
    slower on XLA's CPU backend (100 vs 15 ms at 8 x 49,152; on a GPU not
    measured). The values come back from the keys: -0.0 and subnormals as
    0.0, a NaN as the canonical NaN, which no comparison, ``exp`` or sum of
    the sampler tells apart."""
    x = jnp.where(x == 0, 0.0, x).astype(jnp.float32)  # -0.0 (and flushed subnormals) -> 0.0, as jnp.sort does
    x = jnp.where(jnp.isnan(x), jnp.nan, x)  # one NaN, the largest (positive sign)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    # A negative float's bits are a negative int32 that grows with its magnitude: flipping its 31 low bits
    # reverses that, and keeps it negative (the map is its own inverse).
    flip = jnp.int32(0x7FFFFFFF)
    keys = jnp.where(bits < 0, bits ^ flip, bits)
    ordered = jax.lax.sort(keys, dimension=x.ndim - 1)[..., ::-1]
    return jax.lax.bitcast_convert_type(jnp.where(ordered < 0, ordered ^ flip, ordered), jnp.float32)


@struct.dataclass
class TokenLogprobs:
    """Log-probabilities of sampled tokens (leading axes: the tokens'):
    ``token`` the sampled token's, ``top_ids`` / ``top`` the ``N`` most
    likely tokens and theirs, most likely first (ties: the lower id
    first)."""

    token: Float[Array, "..."]
    top_ids: Int[Array, "... N"]
    top: Float[Array, "... N"]


def token_logprobs(logits: Float[Array, "B V"], tokens: Int[Array, " B"], params: SamplingParams | RowSampling,
                   top_n: int, mode: str = "processed", *, filtered=None) -> TokenLogprobs:
    """The log-probabilities of ``tokens`` drawn from ``logits`` by
    ``params``, and the ``top_n`` (static) most likely tokens', read in
    ``mode`` (:data:`LOGPROBS_MODES`): ``"processed"``: from the
    distribution :func:`sample` drew from (after temperature, top-k and
    top-p; a filtered token's is -inf; a greedy row's is the model's
    softmax, the distribution at temperature 1), ``"raw"``: the model's
    softmax. Float32. ``filtered``: :func:`filtered_logits` of these
    logits and params when already computed."""
    if mode not in LOGPROBS_MODES:
        raise InvalidArgument(f"logprobs mode {mode!r}: one of {LOGPROBS_MODES}")
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logprobs = raw
    if mode == "processed" and not (isinstance(params, SamplingParams) and params.is_greedy):
        scaled, temperature = filtered_logits(logits, params) if filtered is None else filtered
        logprobs = jnp.where((temperature > 0)[:, None], jax.nn.log_softmax(scaled, axis=-1), raw)
    token = jnp.take_along_axis(logprobs, tokens.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    if top_n == 0:
        return TokenLogprobs(token=token, top_ids=jnp.zeros((*token.shape, 0), jnp.int32),
                             top=jnp.zeros((*token.shape, 0), jnp.float32))
    top, top_ids = jax.lax.top_k(logprobs, top_n)
    return TokenLogprobs(token=token, top_ids=top_ids.astype(jnp.int32), top=top)


def score_tokens(logits: Float[Array, "E V"], targets: Int[Array, " E"], top_n: int
                 ) -> tuple[TokenLogprobs, Int[Array, " E"]]:
    """Prompt scoring: each ``targets[e]``'s log-probability under the
    model's softmax of ``logits[e]`` (raw: no temperature, penalties or
    constraint apply to a prompt), the ``top_n`` (static) most likely
    tokens', and the target's rank (1: the most likely; ties share the
    better rank), float32."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = jnp.take_along_axis(logprobs, targets.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > token[:, None], axis=-1, dtype=jnp.int32)
    top, top_ids = jax.lax.top_k(logprobs, top_n)
    return TokenLogprobs(token=token, top_ids=top_ids.astype(jnp.int32), top=top), rank
