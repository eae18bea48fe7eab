"""Which request a waiting one should wait for: in-batch prefix sharing
(SGLang's in-batch prefix caching), found without comparing every pair.

A request being admitted may share a prefix with a request admitted in the
same batch, or still prefilling, that is longer than what the prefix cache
holds now. Computing that prefix a second time beside the other request
wastes the compute; waiting until the other request has prefilled it
turns it into a hit (:meth:`jaxkv.serve.scheduler.Scheduler._wait_for_prefix`
asks the cache to keep the prefix there).

**The rule** (:meth:`PrefixSharers.first`). A waiting request ``req``
waits for the first request ``other`` that meets all of these:

* ``other`` is one of the requests admitted in this batch (in admission
  order), or else one of those prefilling with a piece left (in their
  order);
* ``other`` is in ``req``'s namespace;
* the common prefix of ``req``'s tokens but the last and ``other``'s
  tokens, rounded down to the cache's hit grain (``shared``), is at least
  :data:`WAIT_FOR_PREFIX_TOKENS` longer than ``req``'s hit;
* ``other`` has not prefilled those ``shared`` tokens yet.

**Why an index.** Comparing every pair costs a burst of N arrivals N^2 / 2
comparisons of whole prompts: 256 arrivals of 256 tokens took 0.7 s of
host time in one step on the 2-core CPU VM. Two requests that share at
least :data:`WAIT_FOR_PREFIX_TOKENS` tokens have the same first
:data:`WAIT_FOR_PREFIX_TOKENS` tokens (their *head*). So :class:`PrefixSharers`
keeps the candidates by namespace and head. A waiting request compares its
tokens only with the candidates of its own head, and when there are none it
costs one dictionary lookup. The rule and the order are unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from jaxkv.serve.request import Request

__all__ = ["WAIT_FOR_PREFIX_TOKENS", "PrefixSharers", "common_prefix"]

#: The fewest tokens a waiting request must gain to wait for a request being
#: prefilled that shares them.
WAIT_FOR_PREFIX_TOKENS = 32


def common_prefix(a: list, b: list) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _key(req: Request) -> tuple[Hashable, tuple]:
    """``(namespace, head)``: two requests sharing at least
    :data:`WAIT_FOR_PREFIX_TOKENS` tokens have equal keys. A context shorter
    than the head has a shorter tuple, so it matches no full head (it
    cannot share that many tokens)."""
    return req.namespace, tuple(req.tokens_between(0, WAIT_FOR_PREFIX_TOKENS))


class PrefixSharers:
    """The requests a waiting request of one admission batch may wait for
    (module docstring): those :meth:`admitted` in the batch, then those in
    ``prefilling`` that have a piece left. Made at the start of a batch.

    Invariant: a request's candidates are the requests of its
    :func:`_key` among those, in the rule's order. The heads are computed
    only when a waiting request first looks (a batch in which no prompt is
    long enough never computes one)."""

    def __init__(self, prefilling: list):
        self._prefilling = prefilling
        self._prefilling_by_key: dict | None = None  # built at the first lookup
        self._admitted_by_key: dict = {}
        self._unindexed: list = []  # (request, tokens cached when admitted): admitted, not yet in the index

    def admitted(self, req: Request, done: int) -> None:
        """``req`` was admitted in this batch, with ``done`` tokens cached
        (its hit)."""
        self._unindexed.append((req, done))

    def first(self, req: Request, hit_tokens: int, grain: int) -> tuple[Request, int] | None:
        """``(other, shared)``: the request ``req`` should wait for and the
        tokens they share (rounded down to ``grain``), or None. ``req``
        holds a hit of ``hit_tokens`` tokens."""
        limit = len(req.prompt) + len(req.generated) - 1  # its last token is computed for its first logits
        if limit < hit_tokens + WAIT_FOR_PREFIX_TOKENS:
            return None  # it shares at most ``limit`` tokens with anyone
        if self._prefilling_by_key is None:
            self._prefilling_by_key = {}
            for other in self._prefilling:
                if other.pieces:
                    self._prefilling_by_key.setdefault(_key(other), []).append(other)
        for other, done in self._unindexed:
            self._admitted_by_key.setdefault(_key(other), []).append((other, done))
        self._unindexed.clear()
        key = _key(req)
        # A prefilling request's progress is read now: an earlier wait in this batch may have cut its pieces.
        candidates = self._admitted_by_key.get(key, []) + [
            (other, other.pieces[0][0]) for other in self._prefilling_by_key.get(key, ())]
        if not candidates:
            return None
        tokens = req.tokens[:limit]
        for other, done in candidates:
            shared = common_prefix(tokens, other.tokens)
            shared -= shared % grain
            if shared - hit_tokens >= WAIT_FOR_PREFIX_TOKENS and done < shared:
                return other, shared
        return None
