"""Token sampling: :class:`SamplingParams` and the one per-row sampler.

Every decode path of jaxkv (``generate``, ``sample_n``, ``beam_search``'s
callers and the serving engine) draws its tokens with :func:`sample`.

Rule, per row ``b`` of ``logits [B, V]``:

* ``temperature[b] == 0``: greedy, ``argmax`` (ties: the lowest id);
* otherwise a softmax draw from ``logits[b] / temperature[b]`` restricted to
  the ``top_k[b]`` most likely tokens (0 = all; ties at the k-th value are
  all kept) and then to the smallest set of the most likely tokens whose
  probability reaches ``top_p[b]`` (1 = all).

Parameters come either as one :class:`SamplingParams` (static: the same for
every row; a greedy one compiles to a bare ``argmax``) or as
:class:`RowSampling` (traced ``[B]`` arrays, so a batch mixing requests with
different parameters does not recompile). Keys come as one PRNG key (one
draw over the whole batch) or one key per row (``[B]``; row ``b`` draws with
``keys[b]`` alone, so its tokens do not depend on the other rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.errors import InvalidArgument
from jaxtyping import Array, Float, Int

__all__ = ["GREEDY", "RowSampling", "SamplingParams", "sample", "split_keys"]


@struct.dataclass
class SamplingParams:
    """One sampling rule for every row (see the module docstring): greedy when
    ``temperature == 0``; otherwise softmax sampling at ``temperature`` over
    the ``top_k`` most likely tokens (0 = all) and the smallest set whose
    probability reaches ``top_p`` (1 = all).

    A pytree with no array leaves (every field is static), so passing it to a
    jitted function specialises the program to it, as a static argument would.

    Raises ``InvalidArgument`` for ``temperature < 0``, ``top_k < 0`` or
    ``top_p`` outside ``(0, 1]``.
    """

    temperature: float = struct.field(pytree_node=False, default=0.0)
    top_k: int = struct.field(pytree_node=False, default=0)
    top_p: float = struct.field(pytree_node=False, default=1.0)

    def __post_init__(self):
        if not (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1):
            raise InvalidArgument(
                f"bad sampling parameters: temperature={self.temperature} (>= 0), top_k={self.top_k} (>= 0), "
                f"top_p={self.top_p} (in (0, 1])")

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

    @classmethod
    def broadcast(cls, params: SamplingParams, rows: int) -> RowSampling:
        """``params`` for each of ``rows`` rows."""
        return cls(jnp.full((rows,), params.temperature, jnp.float32), jnp.full((rows,), params.top_k, jnp.int32),
                   jnp.full((rows,), params.top_p, jnp.float32))

    @classmethod
    def stack(cls, rows: Sequence[SamplingParams | None]) -> RowSampling:
        """Row ``b`` follows ``rows[b]`` (None: greedy; e.g. an idle row).
        Host numpy arrays: build it outside ``jit``."""
        rows = [GREEDY if p is None else p for p in rows]
        return cls(np.asarray([p.temperature for p in rows], np.float32), np.asarray([p.top_k for p in rows], np.int32),
                   np.asarray([p.top_p for p in rows], np.float32))


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
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(params, SamplingParams):
        if params.is_greedy:  # static: no sort, no draw
            return greedy
        params = RowSampling.broadcast(params, logits.shape[0])
    temperature = jnp.asarray(params.temperature, jnp.float32)
    top_k = jnp.asarray(params.top_k, jnp.int32)
    top_p = jnp.asarray(params.top_p, jnp.float32)
    vocab = logits.shape[-1]
    # Greedy rows divide by 1 so that no inf/NaN is computed (their draw is discarded).
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # most likely first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        raise InvalidArgument(f"sample needs typed PRNG keys (jax.random.key), got dtype {keys.dtype}")
    if keys.ndim == 0:
        drawn = jax.random.categorical(keys, scaled, axis=-1)
    else:
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
