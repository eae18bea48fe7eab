"""WindowLayerCache: the K/V rings of the sliding-window attention layers.

Interleaved models (gpt-oss: every other layer attends a window of 128
tokens; Gemma 3: five window layers to one global) give a window layer no
use for a key older than its window. Such a layer keeps, per request state
row, a ring of the K and V of its last ``window`` tokens instead of paged
blocks. One cache holds the rings of every window layer of a model, a
leading layer axis first (the layer index: the layer's rank among the
window layers), as :class:`~jaxkv.KVPool` holds every full-attention
layer's pages::

    k_bits  [num_layers, num_rows, num_kv_heads, slots, head_dim]   position p at [layer, row, :, p % slots]
    v_bits  [num_layers, num_rows, num_kv_heads, slots, head_dim]
    pos     [num_layers, num_rows, slots] int32                      position held there, -1: empty

where ``slots = window + slack``. **Slack** (``slack`` extra slots, 0 by
default) is for speculative decoding: a verify step writes ``k + 1``
positions and may keep only the first of them. With ``k`` slots of slack
the positions it writes overwrite only keys older than any later query's
window (position ``p`` lands where ``p - window - slack`` was), and the
rejected ones it leaves behind hold positions at or past the row's new
length, which every read masks (below) until they are written again: a
ring rolls back by its length alone, with no copy and no undo log, for
``slack / window`` more memory.

(heads before the window, as the paged pool's ``[KVH, P, ps, D]``: a
gathered row is ``[KVH, W, D]``, the layout attention's batched dot wants,
so no transpose of it is made)

so its memory per request is ``window`` tokens per layer however long the
request grows. Why one stacked cache and not one per layer: a model whose
layers run under one ``lax.scan`` (:mod:`jaxkv.nn.scan`) reaches its layer
with a traced index, and a scatter at ``[layer, rows, ...]`` into the
scan's carry updates the rings in place, where slicing one layer's rings
out and back would copy them every layer of every step.

A ring row is per-request state like DeepSeek-V4's SWA ring or a Gated
DeltaNet state: the hybrid manager resets it (in every layer) on admission
and release, copies it into snapshot rows (prefix caching restores the
window layers from a snapshot) and moves it to host with the other state
rows.

``pos`` makes a row self-describing: a read masks slots by the position they
hold, not by arithmetic on the request's length, so a restored or copied row
can never show a key from another request or from outside its window.

Invariants (checked by tests after every operation):

* after ``reset(targets)`` those rows hold zeros and ``pos == -1`` in every
  layer; no other row changes;
* every array is updated by ``.at[...]`` scatters in ``mode="drop"`` (an
  out-of-range row is a skipped write), so a caller that donates the cache
  into its jitted step updates it in place; 16- and 8-bit values are stored
  as raw integer bits (:mod:`kernels_pallas.bits`: XLA's CPU backend copies
  a whole bf16 array for every scatter into it).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int, Shaped

from jaxkv.errors import InvalidArgument
from kernels_pallas.bits import bits_dtype, from_bits, to_bits

__all__ = ["WindowLayerCache"]

#: The state rows' axis in every array.
ROW_AXIS = 1


@struct.dataclass
class WindowLayerCache:
    """The rings of every window layer (see the module docstring)."""

    k_bits: Shaped[Array, "layers rows kvh slots d"]
    v_bits: Shaped[Array, "layers rows kvh slots d"]
    pos: Int[Array, "layers rows slots"]
    dtype: object = struct.field(pytree_node=False)
    slack: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(cls, num_rows: int, window: int, num_kv_heads: int, head_dim: int, dtype, *,
               num_layers: int = 1, slack: int = 0) -> "WindowLayerCache":
        """Every row of every layer empty (zeros, ``pos`` -1); ``window +
        slack`` slots per ring (the module docstring)."""
        if min(num_layers, num_rows, window, num_kv_heads, head_dim) < 1 or slack < 0:
            raise InvalidArgument(f"window rings need layers, rows, window, kv heads and head_dim >= 1 and slack "
                                  f">= 0, got {num_layers}, {num_rows}, {window}, {num_kv_heads}, {head_dim}, {slack}")
        shape = (num_layers, num_rows, num_kv_heads, window + slack, head_dim)
        storage = bits_dtype(dtype)
        return cls(k_bits=jnp.zeros(shape, storage), v_bits=jnp.zeros(shape, storage),
                   pos=jnp.full(shape[:2] + shape[3:4], -1, jnp.int32), dtype=jnp.dtype(dtype), slack=slack)

    @property
    def num_layers(self) -> int:
        return self.k_bits.shape[0]

    @property
    def num_rows(self) -> int:
        return self.k_bits.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_bits.shape[2]

    @property
    def slots(self) -> int:
        """Slots per ring: the window and the slack."""
        return self.k_bits.shape[3]

    @property
    def window(self) -> int:
        """Tokens a query attends (its own and the ``window - 1`` before it)."""
        return self.slots - self.slack

    @property
    def head_dim(self) -> int:
        return self.k_bits.shape[4]

    def read(self, layer, rows: Int[Array, " n"]):
        """``(k, v [n, KVH, slots, D] in dtype, pos [n, slots])`` of rows ``rows``
        (in range) of ``layer`` (an int or a traced int32)."""
        return (from_bits(self.k_bits[layer, rows], self.dtype), from_bits(self.v_bits[layer, rows], self.dtype),
                self.pos[layer, rows])

    def write(self, layer, rows: Int[Array, " T"], positions: Int[Array, " T"], k, v) -> "WindowLayerCache":
        """Token ``t``'s K/V ``[T, KVH, D]`` into ``[layer, rows[t], :,
        positions[t] % slots]``; a row out of range (the caller's way to
        skip a token) is dropped. Two tokens naming one slot: undefined
        which wins (callers write each request's newest ``slots`` tokens
        only)."""
        slot = jnp.where(positions >= 0, positions % self.slots, 0)
        return self.replace(k_bits=self.k_bits.at[layer, rows, :, slot].set(to_bits(k, self.dtype), mode="drop"),
                            v_bits=self.v_bits.at[layer, rows, :, slot].set(to_bits(v, self.dtype), mode="drop"),
                            pos=self.pos.at[layer, rows, slot].set(positions, mode="drop"))

    def copy_rows(self, source: Int[Array, " n"], target: Int[Array, " n"]) -> "WindowLayerCache":
        """Rows ``target[i] <- source[i]`` in every layer (out-of-range
        targets dropped); all sources are read before any target is written."""
        return self.replace(**{name: getattr(self, name).at[:, target].set(getattr(self, name)[:, source],
                                                                             mode="drop")
                               for name in ("k_bits", "v_bits", "pos")})

    def reset(self, targets: Int[Array, " n"]) -> "WindowLayerCache":
        """Rows ``targets`` empty again in every layer (out-of-range entries dropped)."""
        return self.replace(k_bits=self.k_bits.at[:, targets].set(0, mode="drop"),
                            v_bits=self.v_bits.at[:, targets].set(0, mode="drop"),
                            pos=self.pos.at[:, targets].set(-1, mode="drop"))

    def take_rows(self, rows: Int[Array, " n"]) -> "WindowLayerCache":
        """Rows ``rows`` (in range) of every layer, as a cache of ``n`` rows."""
        return self.replace(k_bits=self.k_bits[:, rows], v_bits=self.v_bits[:, rows], pos=self.pos[:, rows])

    def put_rows(self, targets: Int[Array, " n"], data: "WindowLayerCache") -> "WindowLayerCache":
        """Row ``targets[i] <- data`` row ``i`` in every layer (out-of-range
        targets dropped)."""
        return self.replace(**{name: getattr(self, name).at[:, targets].set(getattr(data, name), mode="drop")
                               for name in ("k_bits", "v_bits", "pos")})
