"""ReqToTokenPool: the (request row, position) -> KV index table (seed 002).

``req_to_token[row, pos]`` is the token index in the KV pool that holds the
K/V of position ``pos`` of the request in ``row``. The table is pure mapping:
the caller keeps each request's length (as in seed 002).

Invariants:

* row 0 is the null row (the padding request of a batch; GDN state pools
  index the same row space and keep slot 0 as padding too): never handed out,
  always all zeros;
* a row that is not held is all zeros, i.e. every unused position points at
  the null KV slot 0, so a stale row can never read another request's K/V;
* a failed op leaves the state unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import _host
from jaxkv._ops import INT32_MAX
from jaxkv.checks import first_where, require
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.types import Array, ArrayLike, Count, Ids, Int, Ok

__all__ = ["ReqToTokenPool", "make_req_to_token_pool"]


@struct.dataclass
class ReqToTokenPool:
    """Rows ``1 .. max_reqs`` of an int32 ``[max_reqs + 1, max_context_len]`` table.

    Fields:
        req_to_token: int32 ``[max_reqs + 1, max_context_len]``.
        rows: allocator of row ids (``num_blocks = max_reqs + 1``).
    """

    req_to_token: Int[Array, "rows max_context_len"]
    rows: BlockAllocator

    @classmethod
    def create(cls, max_reqs: int, max_context_len: int) -> "ReqToTokenPool":
        if max_reqs < 1 or max_context_len < 1:
            raise InvalidArgument(
                f"max_reqs={max_reqs} and max_context_len={max_context_len} must both be >= 1"
            )
        return cls(
            req_to_token=jnp.zeros((max_reqs + 1, max_context_len), jnp.int32),
            rows=BlockAllocator.create(max_reqs + 1, lowest_first=True),
        )

    @property
    def size(self) -> int:
        """Number of request rows (``max_reqs``)."""
        return self.rows.capacity

    @property
    def max_context_len(self) -> int:
        return self.req_to_token.shape[1]

    def available_size(self) -> Int[Array, ""]:
        """Rows free to allocate."""
        return self.rows.num_free

    def clear(self) -> "ReqToTokenPool":
        """Every row free and zero."""
        return ReqToTokenPool.create(self.size, self.max_context_len)

    # ------------------------------------------------------------------ device ops

    def alloc(self, n: Count = 1, *, max_n: int = 1) -> tuple["ReqToTokenPool", Int[Array, "max_n"], Ok]:
        """Take ``n`` rows (lowest first). Returns ``(state, rows, ok)`` with
        ``rows[n:] == -1``; fails (state unchanged) when fewer are free."""
        rows, ids, ok = self.rows.acquire(n, max_n=max_n)
        return self.replace(rows=rows), ids, ok

    def free(self, rows: Ids) -> tuple["ReqToTokenPool", Ok]:
        """Return rows (any shape, -1 ignored) and point all their positions at
        slot 0. Fails (state unchanged) on an out-of-range or free row."""
        rows = jnp.asarray(rows, jnp.int32).reshape(-1)
        allocator, ok = self.rows.release(rows, what="row")
        cleared = jnp.where(ok & (rows != -1), rows, self.req_to_token.shape[0])
        table = self.req_to_token.at[cleared].set(0, mode="drop")
        return self.replace(req_to_token=table, rows=allocator), ok

    def write(
        self,
        rows: Ids,
        starts: Ids,
        values: Int[ArrayLike, "... m"],
        lengths: Ids | None = None,
    ) -> tuple["ReqToTokenPool", Ok]:
        """``req_to_token[rows[b], starts[b] + j] = values[b, j]`` for
        ``j < lengths[b]`` (default: all ``m``).

        Scalars or 1-D ``rows``/``starts``/``lengths`` with ``values`` of shape
        ``[m]`` or ``[b, m]``; a row of -1 is skipped (batch padding). Fails
        (state unchanged) when a row is not held, a start is negative, a length
        exceeds ``m`` or a write would pass ``max_context_len``. Two batch
        entries writing the same position keep one of their values (which one
        is unspecified: XLA's scatter order); the host path writes one row.
        """
        values = jnp.asarray(values, jnp.int32)
        values = values.reshape(-1, values.shape[-1])
        batch, width = values.shape
        rows = jnp.broadcast_to(jnp.asarray(rows, jnp.int32).reshape(-1), (batch,))
        starts = jnp.broadcast_to(jnp.asarray(starts, jnp.int32).reshape(-1), (batch,))
        if lengths is None:
            lengths = jnp.full((batch,), width, jnp.int32)
        lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), (batch,))
        active = rows != -1
        # starts <= max_context_len - lengths, not starts + lengths <= ...: the sum
        # can wrap around int32 (start near 2**31) and pass the check.
        fits = (starts >= 0) & (lengths >= 0) & (lengths <= width) & (starts <= self.max_context_len - lengths)
        held = self.rows.ref_count(rows) > 0
        require(jnp.all(~active | held), InvalidId, "write to row id {} which is not held", first_where(rows, active & ~held))
        require(jnp.all(~active | fits), InvalidArgument,
                f"write of {{}} positions at start {{}} passes max_context_len={self.max_context_len}",
                first_where(lengths, active & ~fits), first_where(starts, active & ~fits))
        ok = jnp.all(~active | (fits & held))
        lane = jnp.arange(width, dtype=jnp.int32)
        write = ok & active[:, None] & (lane[None, :] < lengths[:, None])
        target_rows = jnp.where(write, rows[:, None], self.req_to_token.shape[0])
        table = self.req_to_token.at[target_rows, starts[:, None] + lane[None, :]].set(values, mode="drop")
        return self.replace(req_to_token=table), ok

    # -------------------------------------------------------------- host paths

    def alloc_or_raise(self, n: int = 1) -> tuple["ReqToTokenPool", np.ndarray]:
        """Host path of :meth:`alloc`; raises ``KVCacheOOM`` (rows)."""
        n = _host.count_or_raise(n, self.size, self.available_size, "rows")
        state, ids, ok = _alloc(self, n, max_n=_host.pow2_at_least(n))
        if not bool(ok):
            raise KVCacheOOM(n, int(self.available_size()), self.size, unit="rows")
        return state, np.asarray(ids)[:n]

    def free_or_raise(self, rows) -> "ReqToTokenPool":
        """Host path of :meth:`free`; raises ``InvalidId`` or ``DoubleFree``."""
        state, ok = _free(self, _host.padded_ids(rows))
        if not bool(ok):
            raise self.free_error(rows) or _host.unexplained("free", rows)
        return state

    def free_error(self, rows) -> KVCacheError | None:
        """Why ``free(rows)`` fails on this state (``InvalidId``,
        ``DoubleFree``), or None when it succeeds (the explainer style of
        ``jaxkv._host``)."""
        return self.rows.release_error(rows, unit="row")

    def write_or_raise(self, row: int, start: int, values) -> "ReqToTokenPool":
        """Host path of :meth:`write` for one row; raises ``InvalidId`` (row
        not held, including -1, which the device op skips as batch padding)
        or ``InvalidArgument`` (write past ``max_context_len``, non-integer
        arguments)."""
        values = _host.int_array(values, "values").reshape(-1)
        row, start = _host.int_scalar(row, "row"), _host.int_scalar(start, "start")
        if not (1 <= row <= self.size) or int(self.rows.ref_count(row)) == 0:
            raise InvalidId(f"write to row {row}, which is not held (rows 1..{self.size})", [row])
        if values.size and (values.min() < 0 or values.max() > INT32_MAX):
            raise InvalidArgument(
                f"write of token indices {_host.preview(values)}: indices must lie in [0, 2**31)"
            )
        width = _host.pow2_at_least(values.size)
        padded = np.zeros((width,), np.int32)
        padded[: values.size] = values
        # Out-of-int32 starts become values the device op rejects.
        state, ok = _write(self, row, min(max(start, -1), 2**31 - 1), padded, values.size)
        if not bool(ok):
            raise InvalidArgument(
                f"write of {values.size} positions at start {start} to row {row}: "
                f"positions must lie in [0, {self.max_context_len})"
            )
        return state


def make_req_to_token_pool(max_reqs: int, max_context_len: int) -> ReqToTokenPool:
    """Seed 002's factory: a :class:`ReqToTokenPool` with every row free."""
    return ReqToTokenPool.create(max_reqs, max_context_len)


_alloc = jax.jit(ReqToTokenPool.alloc, static_argnames=("max_n",))
_free = jax.jit(ReqToTokenPool.free)
_write = jax.jit(ReqToTokenPool.write)
