"""GDNPool: per-request recurrent and conv states of Gated DeltaNet layers (seed 002).

A linear-attention layer (Gated DeltaNet, as in Qwen3-Next) keeps no K/V per
token: each request carries a fixed-size state per layer, a ``[Dv, Dk]``
matrix per value head (the recurrent state) and the last ``kernel - 1``
inputs of its causal conv1d (the conv state). This pool holds those states for
every request slot and every GDN layer::

    recurrent_state [num_gdn_layers, pool_size, num_v_heads, head_v_dim, head_k_dim]  float32
    conv_state      [num_gdn_layers, pool_size, conv_dim, conv_kernel_size - 1]         dtype, stored as conv_bits

with ``pool_size = max_reqs + 1 + max_track_slots`` and
``conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim``
(the q, k and v channels, see :meth:`GDNPool.conv_dim_for`). The recurrent
state is float32 whatever ``dtype`` is: it accumulates over the whole
sequence (FlashInfer's kernels require it too); ``dtype`` is the conv state's.
``recurrent_state[l, s, h]`` is the matrix ``S`` of the delta rule
``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, read as
``o_t = S_t q_t``; ``conv_state[l, s, :, -1]`` is the most recent conv input.

Slot ids, one index space:

* slot 0 is the padding slot: never handed out; a padded batch row may write
  to it (harmless) and what it reads there is garbage. ``reset_states`` and
  ``copy_states`` refuse it, since naming it there is a bug;
* request slots ``1 .. max_reqs`` are the rows of the
  :class:`~jaxkv.ReqToTokenPool` the caller allocated; this pool does not
  track which are in use (seed 002: "indexed by req_pool_idx");
* track slots ``max_reqs + 1 .. max_reqs + max_track_slots`` hold snapshots
  (prefix caching of linear layers: a cached prefix needs the state after it,
  which later tokens overwrite in the request's slot). They are handed out by
  :meth:`GDNPool.alloc_track_slot`, lowest first, and returned by
  :meth:`GDNPool.free_track_slot`. A slot fresh from ``alloc_track_slot``
  holds stale contents: fill it with :meth:`GDNPool.copy_states`.

Invariants:

* after ``reset_states(ids)`` both states of those slots are zero in every
  layer (a new request starts from the zero state); no other slot changes;
* a failed op (``ok`` False) returns the state it was given, unchanged; the
  big arrays are updated only by ``.at[...]`` scatters whose indices are
  redirected out of bounds (dropped) on failure, so a caller that donates the
  pool into its jitted step gets in-place updates and no whole-pool select.
  For that, a bfloat16 / float16 / fp8 conv state is stored as raw integer
  bits of the same width (``conv_bits``; :mod:`kernels_pallas.bits`): XLA's
  CPU backend converts a whole bf16 array for every scatter into it, an
  integer one it updates in place. Writes bitcast only the new rows; reads
  gather rows of ``conv_bits`` and bitcast those. ``conv_state`` is the
  typed view of the whole array (a bitcast: free on GPU, a typed copy
  outside ``jit``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Float, Shaped

from jaxkv import _host
from jaxkv.checks import first_where, require
from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.types import Array, ArrayLike, Bool, Ids, Int, Ok
from kernels_pallas.bits import bits_dtype, from_bits, to_bits

RecurrentState = Float[Array, "... v_heads v_dim k_dim"]
ConvState = Float[Array, "... conv_dim conv_width"]


@struct.dataclass
class GDNPool:
    """Recurrent and conv states of every GDN layer for every slot; see the
    module docstring for layout and slot ids.

    Fields:
        recurrent_state: float32 ``[num_gdn_layers, pool_size, num_v_heads,
            head_v_dim, head_k_dim]``.
        conv_bits: the conv state, ``[num_gdn_layers, pool_size, conv_dim,
            conv_kernel_size - 1]`` in ``dtype``'s storage
            (``bits_dtype(dtype)``: uint16 for bfloat16/float16, uint8 for
            fp8, the dtype itself for float32); :attr:`conv_state` is the
            typed view. Write it with :func:`~kernels_pallas.bits.to_bits`
            values (``pool.replace(conv_bits=to_bits(x, pool.dtype))``).
        track_held: bool ``[max_track_slots]``; entry ``i`` is True while track
            slot ``max_reqs + 1 + i`` is handed out.
        max_reqs: static; request slots are ``1 .. max_reqs``.
        conv_dtype: static; the name of the conv state's logical dtype.
    """

    recurrent_state: Float[Array, "layers slots v_heads v_dim k_dim"]
    conv_bits: Shaped[Array, "layers slots conv_dim conv_width"]
    track_held: Bool[Array, "max_track_slots"]
    max_reqs: int = struct.field(pytree_node=False)
    conv_dtype: str = struct.field(pytree_node=False)

    # ------------------------------------------------------------------ creation

    @staticmethod
    def conv_dim_for(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int) -> int:
        """Channels of the causal conv: q and k (``num_k_heads * head_k_dim``
        each) and v (``num_v_heads * head_v_dim``)."""
        return 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim

    @classmethod
    def create(
        cls,
        max_reqs: int,
        num_gdn_layers: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_dim: int | None = None,
        conv_kernel_size: int = 4,
        *,
        num_k_heads: int | None = None,
        dtype=jnp.bfloat16,
        max_track_slots: int = 0,
    ) -> "GDNPool":
        """A zero-filled pool with every track slot free (seed 002's constructor).

        ``conv_dim`` may be left out when ``num_k_heads`` is given (it is then
        :meth:`conv_dim_for`); when both are given they must agree.
        ``dtype`` is the conv state's storage dtype (a float dtype); the
        recurrent state is always float32.
        """
        if num_k_heads is not None:
            if num_k_heads < 1:
                raise InvalidArgument(f"num_k_heads={num_k_heads} must be >= 1")
            implied = cls.conv_dim_for(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
            if conv_dim is not None and conv_dim != implied:
                raise InvalidArgument(
                    f"conv_dim={conv_dim} but 2*{num_k_heads}*{head_k_dim} + {num_v_heads}*{head_v_dim} = {implied}"
                )
            conv_dim = implied
        if conv_dim is None:
            raise InvalidArgument("GDNPool.create needs conv_dim or num_k_heads")
        sizes = dict(max_reqs=max_reqs, num_gdn_layers=num_gdn_layers, num_v_heads=num_v_heads,
                     head_k_dim=head_k_dim, head_v_dim=head_v_dim, conv_dim=conv_dim,
                     conv_kernel_size=conv_kernel_size)
        bad = {name: value for name, value in sizes.items() if int(value) < 1}
        if bad or max_track_slots < 0:
            bad.update({} if max_track_slots >= 0 else {"max_track_slots": max_track_slots})
            raise InvalidArgument(f"sizes must be >= 1 (max_track_slots >= 0): {bad}")
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise InvalidArgument(f"conv state dtype must be a float dtype, not {dtype.name}")
        pool_size = max_reqs + 1 + max_track_slots
        return cls(
            recurrent_state=jnp.zeros((num_gdn_layers, pool_size, num_v_heads, head_v_dim, head_k_dim), jnp.float32),
            conv_bits=jnp.zeros((num_gdn_layers, pool_size, conv_dim, conv_kernel_size - 1), bits_dtype(dtype)),
            track_held=jnp.zeros((max_track_slots,), jnp.bool_),
            max_reqs=int(max_reqs),
            conv_dtype=dtype.name,
        )

    # ---------------------------------------------------------------- properties

    @property
    def num_gdn_layers(self) -> int:
        return self.recurrent_state.shape[0]

    @property
    def pool_size(self) -> int:
        """All slots, padding slot 0 included: ``max_reqs + 1 + max_track_slots``."""
        return self.recurrent_state.shape[1]

    @property
    def num_v_heads(self) -> int:
        return self.recurrent_state.shape[2]

    @property
    def head_v_dim(self) -> int:
        return self.recurrent_state.shape[3]

    @property
    def head_k_dim(self) -> int:
        return self.recurrent_state.shape[4]

    @property
    def conv_state(self) -> Float[Array, "layers slots conv_dim conv_width"]:
        """The conv state as :attr:`dtype` (a bitcast view of :attr:`conv_bits`;
        to read a few slots, gather rows of ``conv_bits`` and bitcast those as
        :meth:`get_states` does)."""
        return from_bits(self.conv_bits, self.dtype)

    @property
    def conv_dim(self) -> int:
        return self.conv_bits.shape[2]

    @property
    def conv_kernel_size(self) -> int:
        return self.conv_bits.shape[3] + 1

    @property
    def dtype(self) -> jnp.dtype:
        """Logical dtype of the conv state (its storage is ``bits_dtype(dtype)``)."""
        return jnp.dtype(self.conv_dtype)

    @property
    def max_track_slots(self) -> int:
        return self.track_held.shape[0]

    @property
    def first_track_slot(self) -> int:
        """Id of the first track slot (``max_reqs + 1``)."""
        return self.max_reqs + 1

    @property
    def track_slot_ids(self) -> np.ndarray:
        """All track slot ids, ``max_reqs + 1 .. max_reqs + max_track_slots``."""
        return np.arange(self.first_track_slot, self.pool_size, dtype=np.int32)

    def mem_bytes(self) -> int:
        """Deprecated alias of :meth:`memory_bytes` (the library's one name for sizes)."""
        return self.memory_bytes()

    def memory_bytes(self) -> int:
        """Exact bytes of the arrays the pool owns (both states and the track
        flags), from static shapes: also works on ``jax.eval_shape`` output."""
        return sum(
            int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jax.tree_util.tree_leaves(self)
        )

    def num_free_track_slots(self) -> Int[Array, ""]:
        """Track slots free to allocate."""
        return self.max_track_slots - jnp.sum(self.track_held, dtype=jnp.int32)

    # -------------------------------------------------------------- track slots

    def alloc_track_slot(self) -> tuple["GDNPool", Int[Array, ""], Ok]:
        """Hand out the lowest free track slot. Returns ``(state, slot, ok)``;
        when none is free: ``slot == -1``, ``ok`` False, state unchanged."""
        if self.max_track_slots == 0:
            return self, jnp.asarray(-1, jnp.int32), jnp.asarray(False)
        free = ~self.track_held
        ok = jnp.any(free)
        local = jnp.argmax(free).astype(jnp.int32)
        held = self.track_held.at[jnp.where(ok, local, self.max_track_slots)].set(True, mode="drop")
        slot = jnp.where(ok, self.first_track_slot + local, -1).astype(jnp.int32)
        return self.replace(track_held=held), slot, ok

    def free_track_slot(self, slot: Ids) -> tuple["GDNPool", Ok]:
        """Return track slot(s) (a scalar or any shape; -1 ignored).

        Fails (``ok`` False, state unchanged) when an id is not a track slot
        (``InvalidId``: request slots are not managed here), is not held, or
        appears twice (``DoubleFree``). Contents are not scrubbed here (the hybrid
        cache resets the snapshot rows it lets go under scrub-on-free:
        ``KVCacheManager.reset_state_rows``).
        """
        slots = jnp.asarray(slot, jnp.int32).reshape(-1)
        given = slots != -1
        size = self.max_track_slots
        local = slots - self.first_track_slot
        in_range = (local >= 0) & (local < size)
        if size == 0:
            held = jnp.zeros_like(given)
        else:
            held = self.track_held.at[jnp.where(in_range, local, size)].get(mode="fill", fill_value=False)
        twice = _repeats(slots, given)
        require(~jnp.any(given & ~in_range), InvalidId,
                f"free of track slot id {{}} outside [{self.first_track_slot}, {self.pool_size})",
                first_where(slots, given & ~in_range))
        require(~jnp.any(given & in_range & (~held | twice)), DoubleFree,
                "double free: track slot id {} is not held or is freed twice",
                first_where(slots, given & in_range & (~held | twice)))
        ok = jnp.all(~given | (in_range & held)) & ~jnp.any(twice)
        if size == 0:
            return self, ok
        track_held = self.track_held.at[jnp.where(ok & given, local, size)].set(False, mode="drop")
        return self.replace(track_held=track_held), ok

    # ------------------------------------------------------------ state ops

    def reset_states(self, ids: Ids) -> tuple["GDNPool", Ok]:
        """Zero both states of slots ``ids`` (any shape, -1 ignored, repeats
        allowed) in every layer: the state of a new request. Fails (``ok``
        False, state unchanged) when an id is outside ``[1, pool_size)``."""
        ids = jnp.asarray(ids, jnp.int32).reshape(-1)
        given = ids != -1
        bad = given & ~self._is_slot(ids)
        self._require_slots(ids, bad, "reset")
        ok = ~jnp.any(bad)
        target = jnp.where(ok & given, ids, self.pool_size)
        recurrent = self.recurrent_state.at[:, target].set(0, mode="drop")
        conv = self.conv_bits.at[:, target].set(0, mode="drop")  # zero bits are 0.0
        return self.replace(recurrent_state=recurrent, conv_bits=conv), ok

    def copy_states(self, src: Ids, dst: Ids) -> tuple["GDNPool", Ok]:
        """``slot dst[i] <- slot src[i]``, both states, every layer (snapshot a
        request into a track slot, restore it, or fork a request).

        ``src`` and ``dst`` have the same shape (checked when tracing); a pair
        with -1 on either side is skipped. All sources are read before any
        destination is written, so ``[1, 2] -> [2, 3]`` moves the old slot 2.
        ``src[i] == dst[i]`` is a no-op. Fails (``ok`` False, state unchanged)
        when an id of a copied pair is outside ``[1, pool_size)``
        (``InvalidId``) or a destination repeats (``InvalidArgument``: which
        copy wins would be undefined).
        """
        src = jnp.asarray(src, jnp.int32)
        dst = jnp.asarray(dst, jnp.int32)
        if src.shape != dst.shape:
            raise InvalidArgument(f"copy_states: src has shape {src.shape} but dst has shape {dst.shape}")
        src, dst = src.reshape(-1), dst.reshape(-1)
        pair = (src != -1) & (dst != -1)
        bad_src = pair & ~self._is_slot(src)
        bad_dst = pair & ~self._is_slot(dst)
        twice = _repeats(dst, pair)
        self._require_slots(src, bad_src, "copy from")
        self._require_slots(dst, bad_dst, "copy to")
        require(~jnp.any(twice), InvalidArgument, "copy_states to repeated destination slot id {}",
                first_where(dst, twice))
        ok = ~jnp.any(bad_src | bad_dst | twice)
        take = ok & pair
        source = jnp.where(take, src, 0)
        target = jnp.where(take, dst, self.pool_size)
        recurrent = self.recurrent_state.at[:, target].set(self.recurrent_state[:, source], mode="drop")
        conv = self.conv_bits.at[:, target].set(self.conv_bits[:, source], mode="drop")
        return self.replace(recurrent_state=recurrent, conv_bits=conv), ok

    def get_layer_state(
        self, layer: int | Int[Array, ""]
    ) -> tuple[Float[Array, "slots v_heads v_dim k_dim"], Float[Array, "slots conv_dim conv_width"]]:
        """``(recurrent [pool_size, Hv, Dv, Dk], conv [pool_size, conv_dim,
        kernel - 1])`` of one GDN layer (the seed's per-layer view)."""
        layer = self._check_layer(layer)
        return self.recurrent_state[layer], from_bits(self.conv_bits[layer], self.dtype)

    def get_states(self, layer: int | Int[Array, ""], ids: Ids) -> tuple[RecurrentState, ConvState]:
        """The states of slots ``ids`` in ``layer``: ``(recurrent [*ids.shape,
        Hv, Dv, Dk] float32, conv [*ids.shape, conv_dim, kernel - 1] dtype)``.
        -1 (and any id outside the pool) reads zeros; slot 0 reads its garbage."""
        layer = self._check_layer(layer)
        ids = jnp.asarray(ids, jnp.int32)
        index = jnp.where((ids >= 0) & (ids < self.pool_size), ids, self.pool_size)
        recurrent = self.recurrent_state.at[layer, index].get(mode="fill", fill_value=0)
        conv = self.conv_bits.at[layer, index].get(mode="fill", fill_value=0)  # zero bits are 0.0
        return recurrent, from_bits(conv, self.dtype)

    def set_layer_state(
        self,
        layer: int | Int[Array, ""],
        ids: Ids,
        recurrent: Float[ArrayLike, "... v_heads v_dim k_dim"],
        conv: Float[ArrayLike, "... conv_dim conv_width"],
    ) -> "GDNPool":
        """Write the new states of a batch of slots in ``layer`` (after a step).

        ``ids`` has any shape (flattened to ``n``); ``recurrent`` and ``conv``
        hold ``n`` states each (leading shape anything of size ``n``).
        ``recurrent`` is stored as float32, ``conv`` cast to the pool dtype.
        Rows whose id is -1 are skipped; slot 0 may be written (padding). The
        ids must be distinct (which of two writes to one slot wins is
        undefined; :func:`jaxkv.checked` reports it). Concrete ids outside
        ``[-1, pool_size)`` raise ``InvalidId``; traced ones are dropped.
        """
        layer = self._check_layer(layer)
        ids = jnp.asarray(ids, jnp.int32).reshape(-1)
        if not isinstance(ids, jax.core.Tracer):
            host = np.asarray(ids)
            bad = host[(host < -1) | (host >= self.pool_size)]
            if bad.size:
                raise InvalidId(
                    f"set_layer_state of slot ids {_host.preview(np.unique(bad))} outside "
                    f"[0, {self.pool_size}) (-1 is padding)", np.unique(bad))
        n = ids.shape[0]
        recurrent = _rows(recurrent, n, self.recurrent_state.shape[2:], "recurrent")
        conv = _rows(conv, n, self.conv_bits.shape[2:], "conv")
        given = ids != -1
        in_pool = (ids >= 0) & (ids < self.pool_size)
        require(~jnp.any(given & ~in_pool), InvalidId,
                f"set_layer_state of slot id {{}} outside [0, {self.pool_size})", first_where(ids, given & ~in_pool))
        require(~jnp.any(_repeats(ids, given)), InvalidArgument,
                "set_layer_state writes slot id {} twice", first_where(ids, _repeats(ids, given)))
        target = jnp.where(given & in_pool, ids, self.pool_size)
        return self.replace(
            recurrent_state=self.recurrent_state.at[layer, target].set(recurrent.astype(jnp.float32), mode="drop"),
            conv_bits=self.conv_bits.at[layer, target].set(to_bits(conv, self.dtype), mode="drop"),
        )

    # -------------------------------------------------------------- host paths

    def alloc_track_slot_or_raise(self) -> tuple["GDNPool", int]:
        """Host path of :meth:`alloc_track_slot`: ``(state, slot)`` or
        ``KVCacheOOM`` (requested 1, available, total track slots)."""
        if self.max_track_slots == 0:
            raise KVCacheOOM(1, 0, 0, unit="track slots")
        state, slot, ok = _alloc_track_slot(self)
        if not bool(ok):
            raise KVCacheOOM(1, int(self.num_free_track_slots()), self.max_track_slots, unit="track slots")
        return state, int(slot)

    def free_track_slot_or_raise(self, slot) -> "GDNPool":
        """Host path of :meth:`free_track_slot`; raises ``InvalidId`` (not a
        track slot) or ``DoubleFree`` (not held, or named twice)."""
        state, ok = _free_track_slot(self, _host.padded_ids(slot))
        if bool(ok):
            return state
        raise self.free_track_slot_error(slot) or _host.unexplained("free_track_slot", slot)

    def free_track_slot_error(self, slot) -> KVCacheError | None:
        """Why ``free_track_slot(slot)`` fails on this state (``InvalidId``,
        ``DoubleFree``), or None when it succeeds (the explainer style of
        ``jaxkv._host``)."""
        given = _host.given_ids(slot)
        lo, hi = self.first_track_slot, self.pool_size - 1
        bad = np.unique(given[(given < lo) | (given > hi)])
        if bad.size:
            span = f"{lo}..{hi}" if hi >= lo else "none"
            return InvalidId(
                f"free of track slot ids {_host.preview(bad)}: track slots are {span} "
                f"(request slots 1..{self.max_reqs} and padding slot 0 are not freed here)", bad)
        held = np.asarray(self.track_held)
        unique, times = np.unique(given, return_counts=True)
        owners = held[unique - lo].astype(int)
        over = times > owners
        if not over.any():
            return None
        details = "; ".join(f"track slot {i} freed {t}x while held {o}x"
                            for i, t, o in list(zip(unique[over], times[over], owners[over]))[:8])
        return DoubleFree(f"double free: {details}", unique[over])

    def reset_states_or_raise(self, ids) -> "GDNPool":
        """Host path of :meth:`reset_states`; raises ``InvalidId``."""
        state, ok = _reset_states(self, _host.padded_ids(ids))
        if not bool(ok):
            raise self.reset_states_error(ids) or _host.unexplained("reset_states", ids)
        return state

    def reset_states_error(self, ids) -> KVCacheError | None:
        """Why ``reset_states(ids)`` fails on this state (``InvalidId``), or
        None when it succeeds."""
        return self._slot_error(ids, "reset")

    def copy_states_or_raise(self, src, dst) -> "GDNPool":
        """Host path of :meth:`copy_states`; raises ``InvalidId`` (an id
        outside ``[1, pool_size)``) or ``InvalidArgument`` (shape mismatch,
        repeated destination)."""
        # Through the integer gate: np.asarray(..., np.int64) would turn 4.5,
        # True or "4" into a real slot id and raise untyped errors for NaN,
        # None, ragged lists and ints past int64.
        src_ids = _host.int_array(src, "src")
        dst_ids = _host.int_array(dst, "dst")
        if src_ids.shape != dst_ids.shape:
            raise InvalidArgument(f"copy_states: src has shape {src_ids.shape} but dst has shape {dst_ids.shape}")
        src_flat, dst_flat = src_ids.reshape(-1), dst_ids.reshape(-1)
        state, ok = _copy_states(self, _host.padded_ids(src_flat), _host.padded_ids(dst_flat))
        if bool(ok):
            return state
        raise self.copy_states_error(src_flat, dst_flat) or _host.unexplained("copy_states", dst_flat)

    def copy_states_error(self, src, dst) -> KVCacheError | None:
        """Why ``copy_states(src, dst)`` (same-shape id arrays) fails on this
        state (``InvalidId``, ``InvalidArgument`` for a repeated
        destination), or None when it succeeds."""
        src_flat = _host.int_array(src, "src").reshape(-1)
        dst_flat = _host.int_array(dst, "dst").reshape(-1)
        pair = (src_flat != -1) & (dst_flat != -1)
        for ids, what in ((src_flat, "copy from"), (dst_flat, "copy to")):
            bad = ids[pair & ((ids < 1) | (ids >= self.pool_size))]
            if bad.size:
                return self._slot_error(bad, what)
        unique, times = np.unique(dst_flat[pair], return_counts=True)
        if not (times > 1).any():
            return None
        return InvalidArgument(
            f"copy_states to repeated destination slots {_host.preview(unique[times > 1])}: "
            "which copy would win is undefined")

    # --------------------------------------------------------------- internals

    def _is_slot(self, ids: Int[Array, "m"]) -> Bool[Array, "m"]:
        return (ids >= 1) & (ids < self.pool_size)

    def _require_slots(self, ids, bad, op: str) -> None:
        require(~jnp.any(bad), InvalidId,
                f"{op} slot id {{}} outside [1, {self.pool_size}) (slot 0 is the padding slot)",
                first_where(ids, bad))

    def _slot_error(self, ids, op: str) -> InvalidId | None:
        given = _host.given_ids(ids)
        bad = np.unique(given[(given < 1) | (given >= self.pool_size)])
        if not bad.size:
            return None
        return InvalidId(
            f"{op} slot ids {_host.preview(bad)} outside [1, {self.pool_size}) "
            f"(slot 0 is the padding slot; request slots 1..{self.max_reqs}, "
            f"track slots {self.first_track_slot}..{self.pool_size - 1})", bad)

    def _check_layer(self, layer):
        """A concrete layer (Python, numpy or JAX integer) as a checked
        Python int; a traced one as is."""
        if isinstance(layer, jax.core.Tracer):
            return layer
        layer = _host.int_scalar(layer, "layer")
        if not 0 <= layer < self.num_gdn_layers:
            raise InvalidId(f"GDN layer {layer} outside [0, {self.num_gdn_layers})", [layer])
        return layer


def _repeats(ids: Int[Array, "m"], mask: Bool[Array, "m"]) -> Bool[Array, "m"]:
    """True at every masked position whose id also occurs at an earlier masked
    position. O(m^2) comparisons: the id lists here are batch-sized."""
    m = ids.shape[0]
    same = (ids[:, None] == ids[None, :]) & mask[:, None] & mask[None, :]
    earlier = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]
    return jnp.any(same & earlier, axis=1)


def _rows(x, n: int, shape: tuple[int, ...], name: str) -> Array:
    x = jnp.asarray(x)
    want = n * int(np.prod(shape, dtype=np.int64))
    if x.size != want or x.ndim < len(shape) or tuple(x.shape[x.ndim - len(shape):]) != tuple(shape):
        raise InvalidArgument(f"{name} has shape {tuple(x.shape)} but {n} slot ids need [{n}, {', '.join(map(str, shape))}]")
    return x.reshape((n, *shape))


_alloc_track_slot = jax.jit(GDNPool.alloc_track_slot)
_free_track_slot = jax.jit(GDNPool.free_track_slot)
_reset_states = jax.jit(GDNPool.reset_states)
_copy_states = jax.jit(GDNPool.copy_states)

__all__ = ["GDNPool"]
