"""TokenToKVPoolAllocator: hands out token indices into a KV pool (seed 002).

Token mode (``page_size == 1``) hands out single indices; page mode
(``page_size > 1``) hands out whole pages, as the ``page_size`` consecutive
indices of each page, and frees by page. A page-mode ``alloc(n)`` with ``n``
not a multiple of ``page_size`` takes ``ceil(n / page_size)`` pages and
returns their first ``n`` indices (as pymllm does): the rest of the last
page stays the caller's and is freed with the page. Underneath is a
:class:`~jaxkv.alloc.block.BlockAllocator` over page ids, so token mode is
simply page mode with pages of one token.

Index layout of the pool it feeds (``buffer_size = size + page_size`` rows):

* page 0, indices ``0 .. page_size-1``, is the null page: never handed out,
  padded writes land there;
* page ``p`` covers indices ``p*page_size .. (p+1)*page_size - 1``, for
  ``p in 1 .. size // page_size``.

``size`` must be a whole number of pages, so no page can run past the buffer
(the pymllm page-mode bug this layout makes impossible).

Invariants: every handed-out index is in ``[page_size, buffer_size)``; a page
is either wholly free or wholly held; a failed op leaves the state unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import _host
from jaxkv._ops import INT32_MAX, ceil_div
from jaxkv.checks import first_where, require
from jaxkv.alloc.block import BlockAllocator
from jaxkv.errors import DoubleFree, InvalidArgument, InvalidId, KVCacheError, KVCacheOOM
from jaxkv.types import Array, Count, Ids, Int, Ok

__all__ = ["FreeGroup", "TokenToKVPoolAllocator"]


@struct.dataclass
class TokenToKVPoolAllocator:
    """Allocator of token indices ``page_size .. size + page_size - 1``.

    Fields:
        pages: the page-id allocator (``num_blocks = size // page_size + 1``).
        page_size: static, tokens per page (1 = token mode).
    """

    pages: BlockAllocator
    page_size: int = struct.field(pytree_node=False)

    @classmethod
    def create(cls, size: int, *, page_size: int = 1, need_sort: bool = True) -> "TokenToKVPoolAllocator":
        """``size`` allocatable tokens, all free.

        ``need_sort`` (seed 002's default True) makes ``alloc`` return the
        lowest free indices first, for memory locality, at O(num_pages) per
        call; False pops a free stack at O(n) per call (most recently freed
        pages first).
        """
        if page_size < 1:
            raise InvalidArgument(f"page_size={page_size} must be >= 1")
        if size < page_size or size % page_size:
            raise InvalidArgument(
                f"size={size} must be a positive multiple of page_size={page_size}, "
                "so that no page runs past the buffer"
            )
        pages = BlockAllocator.create(size // page_size + 1, lowest_first=need_sort)
        return cls(pages=pages, page_size=page_size)

    @property
    def size(self) -> int:
        """Allocatable tokens (excludes the null page)."""
        return self.pages.capacity * self.page_size

    @property
    def buffer_size(self) -> int:
        """Rows the KV pool needs: ``size`` plus the null page."""
        return self.pages.num_blocks * self.page_size

    @property
    def need_sort(self) -> bool:
        return self.pages.lowest_first

    def available_size(self) -> Int[Array, ""]:
        """Tokens that can still be allocated (whole free pages * page_size)."""
        return self.pages.num_free * self.page_size

    def clear(self) -> "TokenToKVPoolAllocator":
        """Every index free again (same configuration)."""
        return self.replace(pages=self.pages.reset())

    # ------------------------------------------------------------------ device ops

    def alloc(self, n: Count, *, max_n: int) -> tuple["TokenToKVPoolAllocator", Int[Array, "max_n"], Ok]:
        """Take ``n`` token indices (traced ``n``, static ``max_n``).

        In page mode the indices are whole pages, each page's indices
        consecutive: ``ceil(n / page_size)`` pages are taken and their first
        ``n`` indices returned, so when ``n`` is not a multiple of
        ``page_size`` the rest of the last page is held too (the caller's,
        freed with the page). Returns ``(state, indices, ok)`` with
        ``indices[n:] == -1``. Fails (all -1, state unchanged) when ``n`` is
        negative, above ``max_n``, or needs more pages than are free.
        """
        n = jnp.asarray(n, jnp.int32)
        ps = self.page_size
        max_pages = ceil_div(max_n, ps)
        fits = (n >= 0) & (n <= max_n)
        require(fits, InvalidArgument, f"alloc of {{}} tokens: need 0 <= n <= max_n={max_n}", n)
        # An impossible page count makes the page allocator fail, state unchanged.
        pages, page_ids, ok = self.pages.acquire(jnp.where(fits, ceil_div(n, ps), max_pages + 1), max_n=max_pages)
        offsets = jnp.arange(ps, dtype=jnp.int32)
        indices = jnp.where(page_ids[:, None] >= 0, page_ids[:, None] * ps + offsets, -1).reshape(-1)[:max_n]
        indices = jnp.where(jnp.arange(max_n) < n, indices, -1)
        return self.replace(pages=pages), indices, ok

    def free(self, indices: Ids) -> tuple["TokenToKVPoolAllocator", Ok]:
        """Return token indices (any shape, -1 ignored); page mode frees each
        page named by any of its indices, once.

        One call frees any number of requests' indices (pass them stacked and
        -1 padded): that is the device form of seed 002's free group.

        Fails (state unchanged) if an index is outside
        ``[page_size, buffer_size)`` (``InvalidId``), is named twice, or lies
        in a free page (``DoubleFree``).
        """
        indices = jnp.asarray(indices, jnp.int32).reshape(-1)
        ps = self.page_size
        given = indices != -1
        in_range = (indices >= ps) & (indices < self.buffer_size)
        if ps == 1:
            # Index == page id; the page allocator itself rejects out-of-range
            # ids and repeats.
            pages, ok = self.pages.release(indices, what="token index")
            return self.replace(pages=pages), ok
        # Page mode: a repeated token index is a double free even though its page
        # is named legitimately by many indices; sorting finds repeats and the
        # first index of each page (one sort serves both, so this is not
        # ``_ops.ids_distinct``, which would sort a second time).
        big = INT32_MAX
        ordered = jnp.sort(jnp.where(given, indices, big))
        present = ordered != big
        repeated = jnp.any(present[1:] & (ordered[1:] == ordered[:-1]))
        page = jnp.where(present, ordered // ps, -1)
        first_of_page = present & (page != jnp.concatenate([jnp.array([-1], page.dtype), page[:-1]]))
        bad = given & ~in_range
        require(~jnp.any(bad), InvalidId, f"free of token index id {{}} outside [{ps}, {self.buffer_size})",
                first_where(indices, bad))
        require(~repeated, DoubleFree, "double free: a token index is named more than once")
        valid = jnp.all(~given | in_range) & ~repeated
        to_release = jnp.where(first_of_page & valid, page, -1)
        released, ok = self.pages.release(to_release, what="page")
        ok = ok & valid
        # release() with an all -1 argument (invalid input) succeeds trivially
        # and changes nothing, so on ``~valid`` the state is already unchanged.
        return self.replace(pages=released), ok

    # -------------------------------------------------------------- host paths

    def alloc_or_raise(self, n: int) -> tuple["TokenToKVPoolAllocator", np.ndarray]:
        """Host path of :meth:`alloc`: ``n`` indices as numpy (whole pages,
        the last one possibly in part), or raises ``KVCacheOOM`` (tokens
        requested / available / total) or ``InvalidArgument``."""
        n = _host.int_scalar(n, "number of tokens")
        if n < 0:
            raise InvalidArgument(f"alloc({n}): need a non-negative number of tokens")
        _host.count_or_raise(n, self.size, self.available_size, "tokens")
        max_n = _host.pow2_at_least(ceil_div(n, self.page_size)) * self.page_size
        state, indices, ok = _alloc(self, n, max_n=max_n)
        if not bool(ok):
            raise KVCacheOOM(n, int(self.available_size()), self.size, unit="tokens")
        return state, np.asarray(indices)[:n]

    def free_or_raise(self, indices) -> "TokenToKVPoolAllocator":
        """Host path of :meth:`free`; raises ``InvalidId`` or ``DoubleFree``."""
        state, ok = _free(self, _host.padded_ids(indices))
        if not bool(ok):
            raise self.free_error(indices) or _host.unexplained("free", indices)
        return state

    def free_group_begin(self) -> "FreeGroup":
        """Start collecting frees on the host; :meth:`free_group_end` applies
        them all in one device call (seed 002's batched free)."""
        return FreeGroup()

    def free_group_end(self, group: "FreeGroup") -> "TokenToKVPoolAllocator":
        """Apply every free collected in ``group`` with one device call."""
        return self.free_or_raise(group.indices())

    def free_error(self, indices) -> KVCacheError | None:
        """Why ``free(indices)`` fails on this state (``InvalidId``,
        ``DoubleFree``), or None when it succeeds (the explainer style of
        ``jaxkv._host``)."""
        given = _host.given_ids(indices)
        ps = self.page_size
        bad = np.unique(given[(given < ps) | (given >= self.buffer_size)])
        if bad.size:
            return InvalidId(
                f"free: token indices {_host.preview(bad)} outside [{ps}, {self.buffer_size}) "
                f"(indices 0..{ps - 1} are the null page)", bad)
        unique, times = np.unique(given, return_counts=True)
        if (times > 1).any():
            return DoubleFree(
                f"free: double free: token indices {_host.preview(unique[times > 1])} named more than once",
                unique[times > 1])
        pages = np.unique(unique // ps)
        free_pages = pages[np.asarray(self.pages.ref_counts)[pages] == 0]
        if not free_pages.size:
            return None
        return DoubleFree(
            f"free: double free: token indices in free pages {_host.preview(free_pages)} (page_size={ps})",
            free_pages)


class FreeGroup:
    """Host-side collector of frees, applied by one device call
    (``TokenToKVPoolAllocator.free_group_end``).

    Collecting is a list append; the indices are concatenated and padded once
    at the end, so many finished requests cost one device update.
    """

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []

    def free(self, indices) -> None:
        """Queue ``indices`` (any shape, -1 ignored) for freeing."""
        self._parts.append(_host.int_array(indices, "indices").reshape(-1))

    def indices(self) -> np.ndarray:
        """Everything queued so far, concatenated."""
        if not self._parts:
            return np.zeros((0,), np.int64)
        return np.concatenate(self._parts)


_alloc = jax.jit(TokenToKVPoolAllocator.alloc, static_argnames=("max_n",))
_free = jax.jit(TokenToKVPoolAllocator.free)
