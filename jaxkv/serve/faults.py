"""How the engine contains a failure (:class:`FaultContainment`, a part of
:class:`~jaxkv.serve.scheduler.Scheduler`).

**A step is all or nothing** (DESIGN.md, principle 8).

* A request whose own part of a step fails (its sampling parameters cannot
  be put on the device, its detokenizer raises) is finished alone, with
  ``finish_reason="error"`` and the message in ``RequestOutput.error``;
  what it computed stays computed (its pages may serve later hits), what
  it did not compute is never inserted (prompt pieces are consumed only
  after the call that ran them returned). The others go on.
* Any other exception inside :meth:`~jaxkv.serve.Engine.step` (a jitted call, the cache's
  bookkeeping, retirement, a swap, an engine bug) is contained: the engine
  lets go of the whole cache and builds it again empty
  (:meth:`~jaxkv.serve.caches.CacheBase.rebuilt`; same sizes, no device
  array of the old one kept), finishes the requests whose last token was
  already given out, and puts every request that held a row back at the
  front of the queue, oldest admission first, as a recompute preemption
  does: it keeps its tokens and is prefilled again. So no request's tokens
  change (a recomputation gives the same tokens), the prefix cache starts
  empty and can hold no token that was not computed, and nothing leaks.
  ``step`` logs the exception (logger ``jaxkv.serve``, ERROR, with its
  traceback), counts it (``EngineStats.step_failures``, the last one in
  :attr:`Engine.last_failure`) and returns the outputs the step made
  before it. A request in flight at :data:`MAX_REQUEST_FAULTS` such
  failures is finished with ``"error"``, so a fault that repeats cannot
  keep the engine busy forever.
* ``KVCacheOOM`` from "nothing can run" is not a failure of a step but of
  the fit rule, and is raised as before.
"""

from __future__ import annotations

import collections
import logging
import traceback

import numpy as np

from jaxkv.errors import KVCacheOOM
from jaxkv.serve.request import Request, RequestState

__all__ = ["MAX_REQUEST_FAULTS", "FaultContainment", "requeued", "sampling_row"]

logger = logging.getLogger("jaxkv.serve")

#: Failed steps a request may be in flight for before it is finished with
#: ``"error"`` (each failure re-queues it; module docstring).
MAX_REQUEST_FAULTS = 3


def sampling_row(req: Request) -> tuple:
    """``req``'s temperature, top-k and top-p as the device's dtypes
    (raises for a value they cannot hold: the request's own failure)."""
    params = req.sampling
    with np.errstate(over="raise"):  # a float32 overflow is an error here, not an inf
        return np.float32(params.temperature), np.int32(params.top_k), np.float32(params.top_p)


def requeued(first: list, live: set, waiting) -> collections.deque:
    """The queue after a contained failure: every live request not finished
    queued once: ``first`` (the requests that held a row, oldest admission
    first), then any live one in neither (an admission had taken it out of
    the queue), then ``waiting`` as it was."""
    queued, front = set(waiting), set(first)
    taken = [rid for rid in sorted(live) if rid not in queued and rid not in front]
    return collections.deque(first + taken + [rid for rid in waiting if rid in live and rid not in front])


class FaultContainment:
    """The scheduler's failure handling (module docstring). A part of
    :class:`~jaxkv.serve.scheduler.Scheduler`, whose records it reads and
    rewrites: ``_requests``, ``_live``, ``_waiting``, ``_rows``,
    ``_prefilling``, ``_swapped``, ``_count``, ``cache``; and whose
    ``_process_aborts``, ``_iterate``, ``_retire``, ``_finish`` and
    ``_configure_cache`` it calls."""

    #: The last exception a step contained (module docstring), None before any.
    last_failure: BaseException | None = None

    def _run_iteration(self) -> None:
        """Aborts, then one iteration, its failures contained (module
        docstring): only ``KVCacheOOM`` from "nothing can run" escapes."""
        try:
            self._process_aborts()
            if self._live:
                self._iterate()
        except KVCacheOOM:  # the fit rule failed, not the step: nothing moved
            raise
        except Exception as err:  # noqa: BLE001 - contained: module docstring
            self._recover(err)

    def _recover(self, err: Exception) -> None:
        """Contain ``err``, raised inside a step (module docstring):
        whatever it left half done, in the cache or in these
        records, is dropped. Requests already given their last token are
        finished; every other request that held a row (or was being
        admitted) goes back to the front of the queue, oldest admission
        first, with its tokens (a request in flight at
        :data:`MAX_REQUEST_FAULTS` failures is finished with ``"error"``);
        then the cache is rebuilt empty."""
        self._count.step_failures += 1
        self.last_failure = err
        held = [req for req in (self._requests[rid] for rid in sorted(self._live))
                if req.row >= 0 or req.state in (RequestState.RUNNING, RequestState.SWAPPED)]
        logger.error("engine step failed (%s: %s); rebuilding the cache and re-queueing %d request(s)",
                     type(err).__name__, err, len(held), exc_info=err)
        traceback.clear_frames(err.__traceback__)  # the frames' locals may hold the old cache's arrays
        requeue = []
        for req in sorted(held, key=lambda r: (r.order, r.id)):
            req.row, req.hit, req.shared, req.lane, req.pieces = -1, None, None, None, []
            req.state = RequestState.WAITING
            if req.finish_reason is not None:  # its last token was given out before the failure
                self._finish(req, req.finish_reason)
                continue
            req.faults += 1
            if req.faults >= MAX_REQUEST_FAULTS:
                self._error(req, f"the engine failed {req.faults} times while this request was in flight "
                                 f"(last: {type(err).__name__}: {err})")
                continue
            requeue.append(req.id)
        self._waiting = requeued(requeue, self._live, self._waiting)
        self._rows = [None] * self.max_seqs
        self._prefilling, self._swapped = [], []
        self.cache = self.cache.rebuilt()
        if self.speculation is not None:  # rows now serve other requests; a draft's cache may be half updated
            self.speculation.rebuilt()
        self._configure_cache()

    def _error(self, req: Request, message: str) -> None:
        """Finish ``req`` alone with ``"error"`` (``message`` says why): a
        running one gives back its row and blocks as an aborted one does
        (only what it computed may stay in the prefix cache)."""
        req.error, req.finish_reason = message, "error"
        logger.warning("request %d failed: %s", req.id, message)
        self._count.failed_requests += 1
        if req in self._prefilling:
            self._prefilling.remove(req)
        if req.state is RequestState.RUNNING:
            self._retire([req], final=False, requeue=False)
        elif req.state is RequestState.WAITING and req.id in self._waiting:
            self._waiting.remove(req.id)
        self._finish(req, "error")

    def _screen(self, reqs) -> dict:
        """Each request's sampling row as the device takes it (``{id: row}``)
        and, for a request with a grammar, its next token's mask
        (``grammar_bits``, :mod:`jaxkv.serve.grammar`); a request whose
        parameters cannot be put there, or whose grammar fails, is finished
        with ``"error"`` (:meth:`_error`) and left out. A decode chunk, and
        a packed step's decode lanes, screen only the requests whose
        row-mirror entries are stale
        (:meth:`~jaxkv.serve.row_inputs.RowInputs.stale`): a current entry
        was written from a screened request, whose parameters do not change."""
        rows = {}
        for req in list(reqs):
            try:
                rows[req.id] = self._sampling_row(req)
            except Exception as err:  # noqa: BLE001 - this request's own failure
                self._error(req, f"its sampling parameters cannot be used: {type(err).__name__}: {err}")
                continue
            if req.grammar is not None:
                try:
                    req.grammar_bits = req.grammar.mask(req.generated)
                except Exception as err:  # noqa: BLE001 - this request's own failure
                    del rows[req.id]
                    self._error(req, f"its grammar failed: {type(err).__name__}: {err}")
        return rows

    #: ``req``'s sampling row (:func:`sampling_row`; an attribute, so a test can inject a fault here).
    _sampling_row = staticmethod(sampling_row)
