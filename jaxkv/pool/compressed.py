"""CompressedLayerCache: the arrays of DeepSeek-V4 SWA / CSA / HCA layers, stacked.

A DeepSeek-V4 layer keeps, per request slot, a sliding-window ring of its
last ``window`` tokens and (CSA/HCA) a compressor ring; its compressed
entries (and a CSA layer's indexer keys) live in blocks shared with the other
layers of its group, indexed by the group's block table (the manager owns the
tables: :class:`jaxkv.manager.block_group.BlockGroup`). Entries are stored in
an fp8 :class:`~kernels_pallas.formats.CompressedEntries` format. One cache
holds every layer of one *store class* (layers whose arrays have the same
schema: same kind, group, ratio and formats), a leading layer axis first
(the layer's row in its class)::

    swa         [L, num_slots, window]                     ring, position p at p % window
    entries     [L, num_blocks, entries_per_block]         entry i at [table[i // E], i % E]
    index_keys  [L, num_blocks, entries_per_block]         CSA indexer keys, same layout
    comp_kv     [L, num_slots, compressor_rows, width]     float32, initial 0
    comp_score  [L, num_slots, compressor_rows, width]     float32, initial -inf
    index_kv, index_score                                  the indexer's ring (CSA)

Why stacked, as :class:`~jaxkv.pool.window.WindowLayerCache` and
:class:`~jaxkv.KVPool` are: a model whose layers run under one ``lax.scan``
(:mod:`jaxkv.nn.scan`) reaches its layer with a traced index, and every read
gathers at ``[layer, ...]`` and every write scatters at ``[layer, ...]``
into the scan's carry, in place; slicing one layer's arrays out and back
would copy them every layer of every step. Per-layer operations take the
layer (:func:`store_entries`, the gathers' ``layer=``,
:func:`~jaxkv.manager.dsv4_compressor.compress_step`); per-request and
per-block operations (:meth:`~CompressedLayerCache.reset`, ``copy_rows``,
``copy_blocks``) act on every layer at once (axis 1).

What a layer stores is decided by its schema
(:mod:`jaxkv.manager.hybrid_schema`); this module takes the sizes as plain
numbers so the pool layer does not import the manager.

Invariants (checked by the hybrid manager's tests after every operation):

* after ``reset(targets)`` the SWA rows of those slots dequantize to zero and
  their compressor rings hold kv 0 / score -inf (rows before position 0
  weigh nothing in the pooling), in every layer; no other slot changes;
* block 0 of ``entries`` / ``index_keys`` is the null block: padded writes go
  out of range and are dropped by :func:`store_entries`, never into a block
  some request holds;
* every array is updated by ``.at[...]`` scatters in ``mode="drop"``, so a
  caller that donates the cache into its jitted step updates it in place.
  The fp8 / bf16 parts of the entries are scattered as raw bits (into
  ``nope_bits`` / ``rope_bits``, values from :func:`~kernels_pallas.bits.to_bits`):
  XLA's CPU backend copies a whole bf16/fp8 array for every scatter into
  it, an integer one it updates in place (:mod:`kernels_pallas.bits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from jaxkv.errors import InvalidArgument
from kernels_pallas.formats import CompressedEntries, EntryFormat

__all__ = ["CompressedLayerCache", "store_entries"]


def store_entries(pool: CompressedEntries, rows: Int[Array, " n"], values: Float[Array, "n D"], *,
                  layer=None) -> CompressedEntries:
    """Quantize ``values [n, D]`` into ``pool``'s format and store them at flat
    rows of the pool (``rows`` index ``pool`` flattened over its leading
    dims; rows past the pool are dropped, which is how callers skip a
    padded or refused write). ``layer`` (an int or a traced int32): ``pool``
    is stacked (``[L, ...]``), ``rows`` index layer ``layer`` flattened over
    the dims after the layer axis, and the scatter writes that layer in place."""
    q = CompressedEntries.quantize(values, pool.fmt)  # only the new rows, stored as bits
    lead = pool.shape if layer is None else pool.shape[1:]

    # Flat rows -> coordinates of the leading dims (a row past the pool gets a
    # first coordinate past lead[0]: dropped). Scattering at coordinates
    # rather than into a flattened view keeps every array in its own layout:
    # a reshape around the scatter made XLA copy arrays with a size-1 dim
    # (an HCA layer's one entry per block).
    coords, rest = [], rows
    for size in reversed(lead[1:]):
        coords.append(rest % size)
        rest = rest // size
    coords = (rest, *reversed(coords))
    if layer is not None:
        coords = (layer, *coords)

    def put(arr, new):
        return arr.at[coords].set(new, mode="drop")

    return pool.replace(nope_bits=put(pool.nope_bits, q.nope_bits), scales=put(pool.scales, q.scales),
                        rope_bits=put(pool.rope_bits, q.rope_bits))


@struct.dataclass
class CompressedLayerCache:
    """The arrays of the SWA / CSA / HCA layers of one store class (None
    where the kind has none), each with a leading layer axis ``L``.

    Fields:
      swa: the SWA rings, ``[L, num_slots, window]`` entries (position ``p``
        of slot ``s`` in layer row ``l`` at ``[l, s, p % window]``).
      entries: compressed entries, ``[L, num_blocks, entries_per_block]``
        (entry ``i`` of slot ``s`` at ``[l, tables[s, i // E], i % E]``).
      index_keys: CSA indexer keys, same layout as ``entries``.
      comp_kv, comp_score: float32 ``[L, num_slots, rows, width]``
        compressor rings (initial 0 and -inf).
      index_kv, index_score: the indexer's compressor rings (CSA).
    """

    swa: CompressedEntries
    entries: CompressedEntries | None = None
    index_keys: CompressedEntries | None = None
    comp_kv: Float[Array, "slots rows width"] | None = None
    comp_score: Float[Array, "slots rows width"] | None = None
    index_kv: Float[Array, "slots rows iwidth"] | None = None
    index_score: Float[Array, "slots rows iwidth"] | None = None

    @classmethod
    def create(cls, entry_format: EntryFormat, num_slots: int, window: int, *, num_blocks: int = 0,
               entries_per_block: int = 0, compressor_rows: int = 0, compressor_width: int = 0,
               index_format: EntryFormat | None = None, index_compressor_width: int = 0, num_layers: int = 1
               ) -> "CompressedLayerCache":
        """Initial arrays of ``num_layers`` layers: SWA-only layers when
        ``entries_per_block`` is 0, else compressed entries in
        ``num_blocks`` blocks plus a compressor ring of ``compressor_rows x
        compressor_width``; ``index_format`` adds the CSA indexer's keys and
        ring."""
        if num_layers < 1:
            raise InvalidArgument(f"a compressed layer cache holds num_layers >= 1 layers, got {num_layers}")
        swa = CompressedEntries.zeros(entry_format, (num_layers, num_slots, window))
        if not entries_per_block:
            return cls(swa=swa)
        if num_blocks < 1 or compressor_rows < 1 or compressor_width < 1:
            raise InvalidArgument(f"a compressed layer needs num_blocks, compressor_rows and compressor_width "
                                  f">= 1, got {num_blocks}, {compressor_rows}, {compressor_width}")
        paged = (num_layers, num_blocks, entries_per_block)
        ring = (num_layers, num_slots, compressor_rows)
        fields = dict(entries=CompressedEntries.zeros(entry_format, paged),
                      comp_kv=jnp.zeros(ring + (compressor_width,), jnp.float32),
                      comp_score=jnp.full(ring + (compressor_width,), -jnp.inf, jnp.float32))
        if index_format is not None:
            fields.update(index_keys=CompressedEntries.zeros(index_format, paged),
                          index_kv=jnp.zeros(ring + (index_compressor_width,), jnp.float32),
                          index_score=jnp.full(ring + (index_compressor_width,), -jnp.inf, jnp.float32))
        return cls(swa=swa, **fields)

    @property
    def num_layers(self) -> int:
        return self.swa.shape[0]

    def layer(self, row: int) -> "CompressedLayerCache":
        """Layer row ``row``'s arrays as a one-layer view without the layer
        axis (``swa [num_slots, window]``, ...): a copy, for reading (tests,
        host tools). Steps read and write the stacked arrays in place."""
        return jax.tree.map(lambda a: a[row], self)

    def copy_rows(self, source: Int[Array, " n"], target: Int[Array, " n"]) -> "CompressedLayerCache":
        """Per-request rows ``target[i] <- source[i]`` in every layer (SWA
        ring and compressor rings; out-of-range targets dropped). All
        sources are read before any target is written."""
        def copy(arr):
            return arr.at[:, target].set(arr[:, source], mode="drop")

        def copy_entries(entries):
            return entries.replace(nope_bits=copy(entries.nope_bits), scales=copy(entries.scales),
                                   rope_bits=copy(entries.rope_bits))

        out = self.replace(swa=copy_entries(self.swa))
        for name in ("comp_kv", "comp_score", "index_kv", "index_score"):
            if getattr(self, name) is not None:
                out = out.replace(**{name: copy(getattr(self, name))})
        return out

    def copy_blocks(self, source: Int[Array, " n"], target: Int[Array, " n"]) -> "CompressedLayerCache":
        """Block ``target[i] <- source[i]`` of the compressed entries and (CSA)
        the indexer keys, in every layer, every entry of the block (copy-on-write of a shared
        block; out-of-range targets dropped, so the caller skips a pair by
        sending its target past the blocks). All sources are read before any
        target is written. Per-request rows (SWA and compressor rings) are
        not blocks: see :meth:`copy_rows`. An SWA-only layer has no blocks
        and is returned as is."""
        def copy(entries):
            if entries is None:
                return None
            return entries.replace(
                nope_bits=entries.nope_bits.at[:, target].set(entries.nope_bits[:, source], mode="drop"),
                scales=entries.scales.at[:, target].set(entries.scales[:, source], mode="drop"),
                rope_bits=entries.rope_bits.at[:, target].set(entries.rope_bits[:, source], mode="drop"))

        return self.replace(entries=copy(self.entries), index_keys=copy(self.index_keys))

    def row_state(self) -> "CompressedLayerCache":
        """The per-request part (SWA and compressor rings): the paged
        entries dropped."""
        return self.replace(entries=None, index_keys=None)

    def with_row_state(self, rows: "CompressedLayerCache") -> "CompressedLayerCache":
        """This cache with its per-request arrays replaced by ``rows``'."""
        return rows.replace(entries=self.entries, index_keys=self.index_keys)

    def reset(self, targets: Int[Array, " n"]) -> "CompressedLayerCache":
        """Initial state for slots ``targets`` in every layer (out-of-range
        entries dropped)."""
        def zero_rows(entries):  # all-zero bits are 0.0 in every float format
            return entries.replace(nope_bits=entries.nope_bits.at[:, targets].set(0, mode="drop"),
                                   scales=entries.scales.at[:, targets].set(entries.fmt.unit_scale, mode="drop"),
                                   rope_bits=entries.rope_bits.at[:, targets].set(0, mode="drop"))

        out = self.replace(swa=zero_rows(self.swa))
        for kv, score in (("comp_kv", "comp_score"), ("index_kv", "index_score")):
            if getattr(self, kv) is not None:
                out = out.replace(**{kv: getattr(self, kv).at[:, targets].set(0.0, mode="drop"),
                                     score: getattr(self, score).at[:, targets].set(-jnp.inf, mode="drop")})
        return out
