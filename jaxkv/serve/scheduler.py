"""The scheduler: who holds a row and what each iteration runs
(:class:`Scheduler`, the core that :class:`~jaxkv.serve.Engine` fronts; the
cache contract it speaks is :mod:`jaxkv.serve.caches`, how it contains a
failure :mod:`jaxkv.serve.faults`).

Requests arrive over time (``arrival_step``: the scheduler iteration from
which a request may be admitted; one added later than that iteration is
queued as arriving then). Each scheduler iteration (one ``step``):

0. **Abort** the requests :meth:`Engine.abort` named: a waiting one leaves
   the queue, a running one (prefilling or decoding) gives back its row and
   blocks as a finished one does (the pages it computed may stay in the
   prefix cache), a swapped-out one its row and host blocks.

1. **Resume** swapped-out requests (oldest first) while their blocks fit.
   New requests are admitted only when no request is left swapped out, so a
   preempted request is never starved by newcomers.
2. **Admit** waiting requests that have arrived, in order, while a sequence
   row is free and blocks allow. The prompt is matched in the radix prefix
   cache (hit capped at ``len - 1`` tokens, page aligned) and the matched
   node pinned; the cached blocks go at the start of the new sequence's block
   table with one ``incref`` each and the rest is acquired
   (:meth:`BlockSpaceManager.admit_with_prefix`, all or nothing; a hybrid
   cache restores the hit's snapshot and preallocates). A request is
   admitted when its prompt's blocks and its growth over the next decode
   chunk (capped by the tokens it has left; on a model with a window on
   every layer, its whole output, trimming counted) fit beside the running
   requests' growth; so every request ``add_request`` accepts is admitted
   on an empty engine. When blocks are short the prefix cache is evicted
   first (a windowed request whose hit would not leave room for its window
   is admitted without the hit); if the request still does not fit,
   admission stops for this iteration (FCFS).
   Prefill computes only the uncached tail (``starts = cached_len``).
3. **One device call** (the default ``scheduler="packed"``). While some
   admitted prompt is not all prefilled, the iteration is ONE packed step
   (:mod:`jaxkv.nn.packed`): a flat stream of the next token of every
   decoding request and, after them in the budget
   (``max_num_batched_tokens``, default ``prefill_chunk``), one prompt
   piece per prefilling request, oldest admission first, cut to what the
   budget has left; the stream's length is bucketed (16, 32, 48, 64, 96,
   128, ...: powers of two, and 1.5 times them from 32 on; then the budget;
   :meth:`Engine.stream_lengths`). The jitted call grows the decoding rows by
   a slot on device (a new block at block boundaries, copy-on-write; a
   hybrid cache reserves), writes every token's K/V, runs the model with
   ragged attention (each piece attends its request's cache and its own
   earlier tokens), samples the decoding requests and those whose last
   piece ran, and captures a hybrid cache's boundary snapshots. If the
   decoding rows cannot get blocks they drop out of that step (the prompt
   pieces still run) and are relieved as below. With nothing left to
   prefill, the iteration is the **decode** chunk: every running sequence
   decodes ``decode_chunk`` steps in ONE jitted ``lax.while_loop`` (each
   step appends a slot per running sequence on device, runs the model,
   samples with per-row temperature / top-k / top-p, stops rows on EOS or
   ``max_new_tokens``; if ``append_slots`` cannot get blocks the loop stops
   early and reports the blocked rows), which needs no host round trip per
   token. ``scheduler="padded"`` (the earlier scheduler): a ``[max_seqs,
   prefill_chunk]`` prefill call per iteration (every piece now, or with
   ``max_num_batched_tokens`` one call within the budget), then the decode
   chunk: two calls, and compute spent on padding lanes.
4. On the host: **finished** requests insert their full pages into the prefix
   cache (the tree takes its own reference: the ids ``insert`` reports as
   ``new_blocks`` are increfed; duplicates stay the sequence's and are freed
   with it), their sequences are freed and their prefixes unpinned. When the
   decode stalled for blocks: evict from the prefix cache, then **preempt** the
   most recently admitted running request (one its recomputation can
   bring back: a windowed request never is, its reserve covers its whole
   output): swap it to host
   (``num_host_pages > 0`` and it fits there), else free it and re-queue it
   at the front for recomputation (its full pages go into the prefix cache
   first, so recomputation usually hits; its generated tokens are kept and
   appended to its prompt when it is re-admitted).


Ownership (device allocator ref counts): the tree owns one reference to each
block it holds; a running sequence owns one reference per table entry (fresh
or cached). So after :meth:`Engine.run`, every device block is free or held by
the prefix cache alone (ref count 1).

Request life cycle (:class:`RequestState`)::

    WAITING --admit--> RUNNING --stop / max_new_tokens--> FINISHED
       |         ^         |  ^                              ^
       |         |         |  | swap in                      |
       | recompute preemption |                              |
       |                   v  |                              |
       |                  SWAPPED                            |
       +------------- abort (from any state) ----------------+

**Failures: a step is all or nothing** (:mod:`jaxkv.serve.faults`).
"""

from __future__ import annotations

import collections
import heapq
import logging
import time

import numpy as np

from jaxkv.errors import BookkeepingError
from jaxkv._ops import pow2_at_least
from jaxkv.nn.penalties import RowPenalties
from jaxkv.nn.sampling import MAX_TOP_LOGPROBS, RowSampling
from jaxkv.serve.caches import FREE, ON_DEVICE, STATUS_NAMES, SWAPPED, PrefillLane, logprob_entries
from jaxkv.serve.faults import MAX_REQUEST_FAULTS, FaultContainment, sampling_row
from jaxkv.serve.output import OutputProcessor
from jaxkv.serve.prefix_wait import WAIT_FOR_PREFIX_TOKENS, PrefixSharers
from jaxkv.serve.request import Request, RequestState
from jaxkv.serve.reserve import (admission_blocks, growth, growth_bound, growth_total, make_room, no_hit,
                                 readmittable)
from jaxkv.serve.row_inputs import RowInputs, asks_extra
from jaxkv.serve.speculation import Speculation
from jaxkv.serve.structured import ConstraintTable

__all__ = ["MAX_REQUEST_FAULTS", "Scheduler", "WAIT_FOR_PREFIX_TOKENS", "cached_sampling_row",
           "check_rows", "decodes", "decoding_columns", "decoding_rows", "row_sampling", "sampling_row",
           "stream_buckets", "stream_length", "stream_lengths"]

logger = logging.getLogger("jaxkv.serve")

def _cut_pieces(pieces: list, position: int) -> list:
    """``pieces`` (``(start, end)`` in order) with the one holding
    ``position`` strictly inside cut there."""
    out = []
    for start, end in pieces:
        if start < position < end:
            out += [(start, position), (position, end)]
        else:
            out.append((start, end))
    return out


def stream_buckets(tokens: int) -> list[int]:
    """16, 32, 48, 64, 96, 128, 192, ...: every bucket up to the first that
    holds ``tokens`` (powers of two, and from 32 on 1.5 times them too: a step
    past 32 tokens pads at most a third; small steps, cheap anyway, compile
    fewer programs)."""
    out, n = [], 16
    while True:
        for length in (n, n * 3 // 2) if n >= 32 else (n,):
            out.append(length)
            if length >= tokens:
                return out
        n *= 2


def stream_lengths(budget: int) -> list[int]:
    """The packed stream's lengths for a token ``budget``: 16, 32, 48, 64,
    96, 128, 192, ... (powers of two, and 1.5 times them from 32 on) below
    the budget, then the budget itself."""
    return [n for n in stream_buckets(budget) if n < budget] + [budget]


def stream_length(tokens: int, lengths: list[int]) -> int:
    """The smallest of ``lengths`` that holds ``tokens`` real tokens (past
    the budget only when more requests decode than it holds)."""
    for length in lengths:
        if tokens <= length:
            return length
    return stream_buckets(tokens)[-1]


def row_sampling(max_seqs: int, rows: dict, reqs_by_lane: dict, logprobs_mode: str = "processed",
                 history_width: int = 0, constraints: ConstraintTable | None = None) -> RowSampling:
    """Per-lane sampling arrays from the screened ``rows`` (request id ->
    :func:`sampling_row`) of the requests ``reqs_by_lane`` (idle lanes:
    greedy). When any of them asks for log-probabilities the call computes
    :data:`~jaxkv.nn.sampling.MAX_TOP_LOGPROBS` of them for every lane
    (read in ``logprobs_mode``): one more program, not one per count.
    When any asks for penalties, every lane gets its request's
    (:class:`~jaxkv.nn.penalties.RowPenalties`, histories ``history_width``
    wide; lanes without: none). When any follows a structured-output
    constraint, ``constraints`` (the engine's
    :class:`~jaxkv.serve.structured.ConstraintTable`) gives every lane its
    automaton and state (lanes without: the universal one)."""
    temperature = np.zeros((max_seqs,), np.float32)
    top_k = np.zeros((max_seqs,), np.int32)
    top_p = np.ones((max_seqs,), np.float32)
    if reqs_by_lane:
        lanes = np.fromiter(reqs_by_lane, np.int64, len(reqs_by_lane))
        values = [rows[req.id] for req in reqs_by_lane.values()]
        temperature[lanes] = [v[0] for v in values]
        top_k[lanes] = [v[1] for v in values]
        top_p[lanes] = [v[2] for v in values]
    # One pass finds the requests that ask for more than temperature, top-k and top-p (most steps: none).
    odd = [req for req in reqs_by_lane.values() if asks_extra(req)]
    wanted = any(req.logprobs is not None for req in odd)
    penalties = None
    if any(not req.penalties.is_off for req in odd):
        lanes = [None] * max_seqs
        for lane, req in reqs_by_lane.items():
            if not req.penalties.is_off:
                lanes[lane] = (req.penalties, req.prompt, req.generated, sorted(req.stop_ids))
        penalties = RowPenalties.stack(lanes, history_width)
    constrained, masked = {}, {}
    if any(req.constraint is not None or req.grammar is not None for req in odd):
        constrained = {lane: (req.constraint, req.automaton_state()) for lane, req in reqs_by_lane.items()
                       if req.constraint is not None}
        masked = {lane: req.grammar_bits for lane, req in reqs_by_lane.items() if req.grammar is not None}
    if (constrained or masked) and constraints is None:  # no engine table: one of its own for this call
        constraints = ConstraintTable(_constraint_vocab(reqs_by_lane.values()))
    return RowSampling(temperature, top_k, top_p, logprobs=MAX_TOP_LOGPROBS if wanted else -1,
                       logprobs_mode=logprobs_mode, penalties=penalties,
                       constraints=None if constraints is None else constraints.rows(max_seqs, constrained, masked))


def _constraint_vocab(requests) -> int | None:
    """The logits' width the first constrained request's automaton or
    grammar was built for (None: none is constrained)."""
    for req in requests:
        if req.constraint is not None:
            return req.constraint.vocab_size
        if req.grammar is not None:
            return req.grammar.grammar.vocab_size
    return None


#: ``sampling_row``'s results by sampling parameters (``SamplingParams`` is
#: frozen: the same object converts the same way), so a running request's
#: row is not converted again every iteration: ``id -> (params, row)``, the
#: object kept so that its id stays its own; bounded (cleared when full).
_SAMPLING_ROWS: dict = {}
_SAMPLING_ROWS_MAX = 4096


def cached_sampling_row(req: Request) -> tuple:
    """:func:`sampling_row` of ``req``, remembered per sampling-parameters
    object (a conversion that raises is never remembered: it raises again)."""
    params = req.sampling
    entry = _SAMPLING_ROWS.get(id(params))
    if entry is not None and entry[0] is params:
        return entry[1]
    row = sampling_row(req)
    if len(_SAMPLING_ROWS) >= _SAMPLING_ROWS_MAX:
        _SAMPLING_ROWS.clear()
    _SAMPLING_ROWS[id(params)] = (params, row)
    return row


def _rows_agree(requests: dict, rows: list, swapped: list, status: np.ndarray, decode_rows: list | None = None,
                decode_reqs: list | None = None) -> bool:
    """Whether :func:`check_rows` finds nothing (one pass over the rows:
    the common case, every iteration); False sends it to find what. In the
    same pass, ``decode_rows`` and ``decode_reqs`` (if given) get the row
    and the record of each RUNNING request whose prompt is all prefilled,
    in row order: the columns a step takes, with no second pass to make
    them."""
    status = np.asarray(status).tolist()
    if len(status) != len(rows):
        return False
    # The states by identity: an Enum's hash is a Python call (hash of its name), once per row otherwise.
    running, swapped_state, get = RequestState.RUNNING, RequestState.SWAPPED, requests.get
    collect = decode_rows is not None
    for row, (rid, held) in enumerate(zip(rows, status)):
        if rid is None:
            if held != FREE:
                return False
            continue
        req = get(rid)
        if req is None or req.row != row:
            return False
        state = req.state
        if state is running:
            if held != ON_DEVICE:
                return False
            if collect and not req.pieces:
                decode_rows.append(row)
                decode_reqs.append(req)
        elif state is not swapped_state or held != SWAPPED:
            return False
    return all(rid in requests and 0 <= requests[rid].row < len(rows) and rows[requests[rid].row] == rid
               for rid in swapped)


def check_rows(requests: dict, rows: list, swapped: list, status: np.ndarray) -> None:
    """Raise ``BookkeepingError`` (with the numbers) when the engine's
    records disagree with each other or with the cache: a RUNNING
    request must own its row in the row map and the row must be
    ON_DEVICE; a SWAPPED one likewise with the row SWAPPED; the row map
    names no request that is neither. ``status``: the cache's row status."""
    if _rows_agree(requests, rows, swapped, status):
        return
    # Every request holding a row is in the row map or the swapped list
    # (the second loop checks the map's side), so this stays O(max_seqs)
    # however many requests the engine has served.
    holders = {rid for rid in rows if rid is not None} | set(swapped)
    for req in (requests[rid] for rid in sorted(holders)):
        if req.state not in (RequestState.RUNNING, RequestState.SWAPPED):
            raise BookkeepingError(f"request {req.id} holds row {req.row} but is {req.state.name}")
        want = ON_DEVICE if req.state is RequestState.RUNNING else SWAPPED
        if not 0 <= req.row < len(rows):
            raise BookkeepingError(f"request {req.id} is {req.state.name} on row {req.row}, outside "
                                   f"[0, {len(rows)})")
        if rows[req.row] != req.id:
            raise BookkeepingError(f"request {req.id} is {req.state.name} on row {req.row}, but the row map "
                                   f"gives that row to request {rows[req.row]}")
        if status[req.row] != want:
            raise BookkeepingError(f"request {req.id} is {req.state.name} on row {req.row}, but the cache "
                                   f"has that row {STATUS_NAMES[int(status[req.row])]}")
    for row, rid in enumerate(rows):
        if rid is None and status[row] != FREE:
            raise BookkeepingError(f"row {row} is {STATUS_NAMES[int(status[row])]} in the cache "
                                   "but no request holds it in the row map")
        if rid is not None and requests[rid].row != row:
            raise BookkeepingError(f"row {row} is mapped to request {rid}, which is "
                                   f"{requests[rid].state.name} on row {requests[rid].row}")


def decoding_rows(requests: dict, rows: list, swapped: list, status: np.ndarray) -> list:
    """:func:`check_rows` (``BookkeepingError`` when the records disagree),
    and the decoding requests it passed: ``(row, request)`` of each
    RUNNING request whose prompt is all prefilled, in row order. One pass
    over the row map in the common case (the check's own)."""
    return list(zip(*decoding_columns(requests, rows, swapped, status)))


def decoding_columns(requests: dict, rows: list, swapped: list, status: np.ndarray) -> tuple[list, list]:
    """:func:`decoding_rows` as two columns, ``(rows, requests)``."""
    decode_rows, decode_reqs = [], []
    if _rows_agree(requests, rows, swapped, status, decode_rows, decode_reqs):
        return decode_rows, decode_reqs
    check_rows(requests, rows, swapped, status)  # raises with the numbers
    pairs = [(row, requests[rid]) for row, rid in enumerate(rows) if rid is not None and decodes(requests[rid])]
    return [row for row, _ in pairs], [req for _, req in pairs]


def decodes(req: Request) -> bool:
    """RUNNING with its whole prompt prefilled (``_rows_agree`` inlines it)."""
    return req.state is RequestState.RUNNING and not req.pieces


def _prompt_scoring(batch: list) -> list:
    """The prompt tokens this packed step scores: for each piece ``(start,
    end)`` of a request asking ``prompt_logprobs`` (lane = its index in
    ``batch``), the positions ``p`` in it before the prompt's last whose
    next prompt token is not scored yet, as ``(lane, offsets in the piece,
    next tokens)`` (:func:`~jaxkv.serve.caches.pack_stream`'s ``scored``)."""
    scored = []
    for lane, (req, (start, end)) in enumerate(batch):
        if req.prompt_logprobs is None:
            continue
        positions = [p for p in range(start, min(end, len(req.prompt) - 1)) if p + 1 not in req.prompt_scores]
        if positions:
            scored.append((lane, [p - start for p in positions], [req.prompt[p + 1] for p in positions]))
    return scored


def _record_prompt_scores(batch: list, scored: list, scores) -> None:
    """Each scored prompt token's entry into its request's
    ``prompt_scores`` (prompt index -> ``(logprob, rank, ((token id,
    logprob), ...))``, the top cut to what it asked)."""
    entries, rank = scores
    token, ids, top, rank = entries.token.tolist(), entries.top_ids.tolist(), entries.top.tolist(), rank.tolist()
    at = 0
    for lane, offsets, _ in scored:
        req, (start, _) = batch[lane]
        n = req.prompt_logprobs
        for offset in offsets:
            req.prompt_scores[start + offset + 1] = (token[at], rank[at], tuple(zip(ids[at][:n], top[at][:n])))
            at += 1


class Scheduler(FaultContainment):
    """The engine's core (module docstring): the requests' records, the row
    map and queues, and one scheduler iteration at a time over ``cache``.
    :class:`~jaxkv.serve.Engine` builds it and adds the public calls
    (intake, ``step``, ``run``, ``stats``).

    Invariants: a RUNNING request owns ``rows[req.row]`` and its row is
    ON_DEVICE in the cache, a SWAPPED one likewise SWAPPED, and no other
    row is held (:meth:`check_bookkeeping`); every live request is in
    exactly one of the queue, a row (RUNNING: in ``_prefilling`` while its
    prompt has pieces left) or the swapped list; a request's ``generated``
    tokens were all computed and given out."""

    def __init__(self, cache, graphdef, params, output: OutputProcessor, *, max_seqs: int, decode_chunk: int,
                 prefill_chunk: int, max_num_batched_tokens: int | None, scheduler: str, speculative=None,
                 draft=None, logprobs_mode: str = "processed"):
        self.cache = cache
        self.graphdef, self.params = graphdef, params
        self.output = output
        self.max_seqs, self.decode_chunk, self.prefill_chunk = max_seqs, decode_chunk, prefill_chunk
        #: Where requests' log-probabilities are read (:data:`~jaxkv.nn.sampling.LOGPROBS_MODES`).
        self.logprobs_mode = logprobs_mode
        #: The width of the token histories penalties read (every request fits: one program).
        self.history_width = pow2_at_least(cache.max_context_tokens + 1)
        #: The running requests' structured-output automata as device tables (built at the first one).
        self.constraints: ConstraintTable | None = None
        #: Speculative decoding (:class:`~jaxkv.serve.speculation.Speculation`; None: off).
        # ``draft``: a jaxkv.serve.drafts draft (method draft_model), else None.
        self.speculation = None if speculative is None else Speculation(speculative, max_seqs, cache, draft)
        # The decode steps whose blocks a running request reserves: a decode chunk's, or with speculation the
        # most tokens its verify steps can write (the cache's ``lookahead`` covers a step's rejected tail).
        self.reserve_chunk = decode_chunk if speculative is None else (
            decode_chunk * (speculative.num_speculative_tokens + 1))
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduler = scheduler
        self._requests: dict[int, Request] = {}
        self._live: set = set()  # ids of the requests not finished
        self._aborts: list = []  # ids to abort at the next iteration, in order
        self._waiting: collections.deque = collections.deque()  # ids in arrival order; recomputes go to the front
        self._arrivals: list = []  # heap of (arrival step, id): queued requests not yet seen arrived
        self._swapped: list = []  # ids, oldest preemption first
        self._prefilling: list = []  # requests admitted whose prompt is not all prefilled, oldest first
        self._rows: list = [None] * max_seqs  # row -> request id (running or swapped)
        self._step = 0
        self._order = 0
        self._count = output.counters
        self._hit_blocks = np.zeros(len(cache.groups), np.int64)
        self._peak = 0
        self._row_inputs: RowInputs | None = None  # the decoding requests' step inputs per row (_mirror())
        self._row_inputs_cache = None  # the cache it was made for
        self.last_failure: BaseException | None = None  # (FaultContainment)

    #: ``req``'s sampling row (:func:`cached_sampling_row`: converted once per distinct parameters; an
    #: attribute, so a test can inject a fault here, as :class:`FaultContainment` says).
    _sampling_row = staticmethod(cached_sampling_row)

    def _configure_cache(self) -> None:
        """Apply the engine's options to a new or rebuilt ``self.cache``
        (the engine's: isolation, events, mesh placement)."""

    def _iterate(self) -> None:
        calls = self._count.model_calls
        try:
            self._iterate_once()
        finally:
            self._count.model_iterations += self._count.model_calls > calls

    def _iterate_once(self) -> None:
        self._count.iterations += 1
        live = len(self._live)
        self._mark_arrivals()
        progressed = self._resume_swapped()
        if not self._swapped:
            progressed += self._admit()
        if self.scheduler == "packed":
            if self._prefilling:
                self._packed()
                self._step += 1
                return
        else:
            progressed += self._prefill()
        if not any(rid is not None and self._requests[rid].state is RequestState.RUNNING for rid in self._rows):
            # Requests that finished at their first token, or a request that failed in this iteration (its
            # blocks are back: the next iteration may admit what did not fit beside it) are progress too.
            if progressed or not self._live or len(self._live) < live:
                return
            future = [self._requests[i].arrival for i in self._waiting if self._requests[i].arrival > self._step]
            if future and len(future) == len(self._waiting) and not self._swapped:
                self._step = min(future)  # idle until the next arrival
                return
            raise self.cache.oom(self._blocks_wanted(), "nothing can run")
        self._decode()
        self._step += 1

    def _process_aborts(self) -> None:
        """Free what the requests :meth:`abort` named hold, and finish them
        (an abort leaves the list once done: a failure halfway keeps it for
        the next step)."""
        # The waiting ones leave the queue in one pass (removing each alone scanned the queue: a thousand aborts
        # from a queue of 10,000 took 88 ms). A failure below leaves them out of the queue and in ``_aborts``.
        waiting = {rid for rid in self._aborts
                   if rid in self._requests and self._requests[rid].state is RequestState.WAITING}
        if waiting:
            self._waiting = collections.deque(rid for rid in self._waiting if rid not in waiting)
        while self._aborts:
            rid = self._aborts[0]
            req = self._requests.get(rid)
            if req is None or req.state is RequestState.FINISHED:
                self._aborts.pop(0)
                continue
            if req.state is RequestState.SWAPPED:
                self._swapped.remove(rid)
                self.cache.free_swapped(req.row)
                self._rows[req.row] = None
                req.row = -1
            elif req.state is not RequestState.WAITING:  # RUNNING: prefilling or decoding (a waiting one is out)
                if req in self._prefilling:
                    self._prefilling.remove(req)
                self._retire([req], final=False, requeue=False)
            logger.debug("request %d aborted", rid)
            self._count.aborted += 1
            self._finish(req, "abort")
            self._aborts.pop(0)

    def _queue(self, req: Request) -> None:
        """Queue a new request: after every waiting request that arrives no
        later (admission stops at the first waiting request that has not
        arrived, so none that has may queue behind it). The queue is in
        arrival order (the requests put back at its front arrived before
        any new one), so the place is found from the back: at once for a
        request arriving now, however long the queue."""
        waiting, requests = self._waiting, self._requests
        at = len(waiting)
        while at and requests[waiting[at - 1]].arrival > req.arrival:
            at -= 1
        waiting.insert(at, req.id)
        heapq.heappush(self._arrivals, (req.arrival, req.id))

    def _mark_arrivals(self) -> None:
        """Stamp the wall time at which waiting requests are first seen
        arrived (the start of their time to first token): the queued
        requests whose arrival step has come, from a heap, so a step's
        work follows the requests arriving, not the queue's length."""
        arrivals = self._arrivals
        if not arrivals or arrivals[0][0] > self._step:
            return
        now = time.perf_counter()
        while arrivals and arrivals[0][0] <= self._step:
            req = self._requests.get(heapq.heappop(arrivals)[1])
            if req is not None and req.state is RequestState.WAITING and req.arrived_at is None:
                req.arrived_at = now

    def _finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished (no row held any more)."""
        req.state = RequestState.FINISHED
        req.finish_reason = req.finish_reason or reason
        self.outputs[req.id] = list(req.generated)
        self._live.discard(req.id)
        self._count.finished += 1
        self.output.mark_finished(req)

    def _update_peak(self, used=None):
        used = self.cache.blocks_in_use() if used is None else int(used)
        self._peak = max(self._peak, used)

    def _growth_reserve(self, skip=frozenset()) -> np.ndarray:
        """Blocks kept free for the running sequences (those on rows not in
        ``skip``) to grow into during their next decode chunk (a windowed
        model's: until they finish) when admitting or resuming, so that a
        request is not brought in only to force an immediate preemption
        (swap in / swap out thrash)."""
        # The row map, not every request ever added; array operations over
        # the running requests, not a call per request (growth_total).
        running = [req for req in (self._requests[rid] for row, rid in enumerate(self._rows)
                                   if rid is not None and row not in skip)
                   if req.state is RequestState.RUNNING]
        return growth_total(self.cache, running, self.reserve_chunk)

    def _blocks_wanted(self) -> np.ndarray:
        for rid in self._swapped:
            return self.cache.blocks_for(len(self._requests[rid].tokens))
        for rid in self._waiting:
            return admission_blocks(self.cache, self._requests[rid], no_hit(self.cache), self.reserve_chunk)
        return np.zeros(len(self.cache.groups), np.int64)

    def check_bookkeeping(self) -> None:
        """:func:`check_rows` of the records against the cache's row status,
        and the cache's host mirror of its free blocks and row status
        against the device (:meth:`~jaxkv.serve.caches.CacheBase.check_host_mirror`):
        ``BookkeepingError`` with the numbers. Every device call that
        decodes is preceded by the first check (:meth:`_check_rows`, on the
        row status the cache's last device call read with its results)."""
        self.cache.check_host_mirror()
        self._check_rows()

    def _check_rows(self) -> None:
        check_rows(self._requests, self._rows, self._swapped, self.cache.row_status())

    def _decoding_columns(self) -> tuple[list, list]:
        """:meth:`_check_rows`, and the decoding requests' rows and records
        in row order (:func:`decoding_columns`: read in the check's pass)."""
        return decoding_columns(self._requests, self._rows, self._swapped, self.cache.row_status())

    def _resume_swapped(self) -> int:
        """Swap requests back in, oldest first, while they fit; how many."""
        resumed = 0
        while self._swapped:
            req = self._requests[self._swapped[0]]
            # Room for its blocks plus its growth over the next decode chunk (a
            # request swapped out at a block boundary needs a new block at
            # once: without this it would be swapped straight back out,
            # forever), and the running requests' reserve.
            need = self.cache.held_blocks(req.kv_len) + growth(self.cache, req, self.reserve_chunk)
            if not make_room(self.cache, need + self._growth_reserve()):
                break
            if not self.cache.swap_in(req.row):
                break
            self._swapped.pop(0)
            req.state = RequestState.RUNNING
            logger.debug("request %d swapped in to row %d", req.id, req.row)
            resumed += 1
            self._update_peak()
        return resumed

    def _admit(self) -> int:
        """Admit and prefill arrived requests in order while rows and blocks
        allow; returns how many."""
        if not self._waiting or self._requests[self._waiting[0]].arrival > self._step or None not in self._rows:
            return 0  # nobody arrived, or no row is free: nothing below would run
        free_left = self._rows.count(None)  # rows free (each admission takes the lowest: self._rows.index)
        admitted = []  # PrefillLane per admitted request, in lane order
        reserved = np.zeros(len(self.cache.groups), np.int64)  # blocks the batch will take, growth included
        running = None  # the requests admitted before this batch: their reserve, taken before the first admission
        exact = False  # whether ``running`` is their reserve, not a bound of it (growth_bound)
        deferred = []  # waiting requests that wait for a prefix being prefilled, in order
        sharers = PrefixSharers(self._prefilling)  # whom a waiting request may wait for
        while self._waiting and free_left:
            req = self._requests[self._waiting[0]]
            if req.arrival > self._step:
                break
            tokens = req.tokens
            # A request that scores its prompt computes all of it: no prefix hit, no waiting for one.
            hit = no_hit(self.cache) if req.prompt_logprobs is not None else self.cache.match(tokens, req.namespace)
            wait, fork = self._fork(req, hit, admitted) if req.prompt_logprobs is None else (False, None)
            if not wait and fork is None and req.prompt_logprobs is None:
                wait = self._wait_for_prefix(req, hit, sharers)
            if wait:
                self.cache.unpin(hit)
                deferred.append(self._waiting.popleft())
                continue
            if fork is not None:  # the sibling's own pages: the tree's hit is not needed
                self.cache.unpin(hit)
                hit = fork
            if running is None:  # a bound of it first, from the rows held: no pass over their records
                running = growth_bound(self.cache, len(self._rows) - self._rows.count(None), self.reserve_chunk)
                exact = running is None
                if exact:
                    running = self._growth_reserve()
            want = admission_blocks(self.cache, req, hit, self.reserve_chunk)
            # Where the bound fits the free blocks, so does the reserve, and make_room evicts nothing either way:
            # the reserve itself is needed only where the bound does not fit.
            if not exact and not np.all(self.cache.free_blocks() >= reserved + want + running):
                running, exact = self._growth_reserve(skip={lane.row for lane in admitted}), True
            if not make_room(self.cache, reserved + want + running):
                self.cache.unpin(hit)
                if not hit.tokens or self.cache.window is None:
                    break
                # A windowed request reserves its whole window from the free
                # blocks while its hit's blocks stay the prefix cache's
                # (pinned): without the hit they may be evicted, and the
                # request needs no more than the fit rule counted. (Without a
                # window a hit only lowers what a request needs: waiting for
                # room keeps the hit.)
                hit = no_hit(self.cache)
                want = admission_blocks(self.cache, req, hit, self.reserve_chunk)
                if not make_room(self.cache, reserved + want + running):
                    break
            reserved += want
            self._count.forked += fork is not None
            self._waiting.popleft()
            req.row = self._rows.index(None)
            free_left -= 1
            req.hit, req.shared = hit, hit.block_counts()
            req.cached_tokens = hit.tokens
            req.state = RequestState.RUNNING
            self._rows[req.row] = req.id
            if req.order < 0:
                req.order = self._order
                self._order += 1
            self._count.prompt_tokens += len(tokens)
            self._count.hit_tokens += hit.tokens
            self._hit_blocks += hit.block_counts()
            admitted.append(PrefillLane(req.row, hit, tokens, req.key, req.namespace))
            sharers.admitted(req, hit.tokens)
        self._waiting.extendleft(reversed(deferred))  # in their places, ahead of those not looked at
        if admitted:
            self.cache.begin_prefill(admitted)  # rows, hits and every prompt's blocks, in one go
            for lane in admitted:
                req = self._requests[self._rows[lane.row]]
                # Packed steps cut the head piece to the budget left each step.
                width = self.max_num_batched_tokens if self.scheduler == "padded" else None
                req.lane, req.pieces = lane, self.cache.pieces(lane, width)
                self._prefilling.append(req)
        return len(admitted)

    def _fork(self, req: Request, hit, admitted: list) -> tuple[bool, object]:
        """For a sibling (``req.fork_of``, :meth:`Engine.add_request`):
        ``(wait, fork)``. It waits while its parent is queued, admitted in
        this same batch, or prefilling before the fork point (the prompt's
        last token but one; the cache is asked to keep the parent's state
        there, :meth:`add_cut`, which may cut its pieces there), unless the
        prefix cache's ``hit`` covers the point already. Past it, ``fork``
        is the cache's hit on the parent's own row (:meth:`fork_hit`, token
        grain; None where the cache has none or ``hit`` covers as much: the
        prefix cache's hit serves). A request prefilled before (a
        recompute), or whose parent is swapped out, finished or gone,
        neither waits nor forks."""
        parent = self._requests.get(req.fork_of) if req.fork_of is not None else None
        if parent is None or req.generated or parent.state is RequestState.FINISHED:
            return False, None
        point = len(req.prompt) - 1  # the sibling computes the last prompt token itself: its first token's logits
        if parent.state is RequestState.RUNNING and not any(lane.row == parent.row for lane in admitted):
            done = parent.pieces[0][0] if parent.pieces else parent.kv_len
            if done >= point:
                fork = self.cache.fork_hit(parent.row, point)
                return False, fork if fork is not None and fork.tokens >= hit.tokens else None
            if point > hit.tokens:  # not cached yet: wait for the parent to get there
                if self.cache.add_cut(parent.row, point) and parent.pieces:
                    parent.pieces = _cut_pieces(parent.pieces, point)
                return True, None
        # Queued, or admitted in this batch (its blocks are attached at the batch's end): wait for it, unless the
        # prefix cache holds the prompt already.
        waits = parent.state is RequestState.WAITING or any(lane.row == parent.row for lane in admitted)
        return waits and point > hit.tokens, None

    def _wait_for_prefix(self, req: Request, hit, sharers: PrefixSharers) -> bool:
        """Whether ``req`` should wait (stay in the queue, others may pass)
        for a request admitted in this batch or being prefilled that shares
        a longer prefix with it than the cache holds now
        (:mod:`jaxkv.serve.prefix_wait`'s rule, found by ``sharers``). The
        cache is asked to keep that prefix when the other request reaches
        it (:meth:`add_cut`, which may cut its pieces there), so ``req``
        hits it one step later instead of computing it a second time
        beside it (SGLang's in-batch prefix caching)."""
        found = sharers.first(req, hit.tokens, self.cache.hit_grain)
        if found is None:
            return False
        other, shared = found
        if self.cache.add_cut(other.row, shared) and other.pieces:
            other.pieces = _cut_pieces(other.pieces, shared)
        logger.debug("request %d waits for request %d to prefill %d shared tokens", req.id, other.id, shared)
        return True

    def _prefill(self) -> int:
        """Run prefill pieces of the admitted requests (oldest admission
        first, one piece per request per call): all of them, or with
        ``max_num_batched_tokens`` ONE call whose pieces total at most the
        budget less one token per decoding row (at least one piece). A
        request whose last piece ran gets its first token. Returns the
        number of calls."""
        calls = 0
        while self._prefilling:
            rows = self._screen(self._prefilling)
            if not self._prefilling:
                break
            budget = None
            if self.max_num_batched_tokens is not None:
                budget = self.max_num_batched_tokens - sum(
                    1 for rid in self._rows if rid is not None and decodes(self._requests[rid]))
            batch, total = [], 0
            for req in self._prefilling:
                start, end = req.pieces[0]
                if budget is not None and batch and total + end - start > budget:
                    break
                batch.append(req)
                total += end - start
            first, keys, peak, logprobs = self.cache.prefill_step(self.graphdef, self.params,
                                                        [(req.lane, req.pieces[0]) for req in batch],
                                                        self._row_sampling(rows, dict(enumerate(batch))))
            for req in batch:  # the pieces ran: consumed only now
                req.pieces.pop(0)
            self._count_call(self.max_seqs * self.cache.prefill_width, total)
            now = time.perf_counter()
            self._update_peak(peak)
            finished = []
            for lane, req in enumerate(batch):
                if req.pieces:
                    continue
                self._prefilling.remove(req)
                req.key = keys[lane]
                if self.output.take(req, [int(first[lane])], now, logprobs=logprob_entries(logprobs, lane, 1)):
                    finished.append(req)
            self._retire(finished, final=True)
            calls += 1
            if budget is not None:
                break
        return calls

    def _row_sampling(self, rows: dict, reqs_by_lane: dict) -> RowSampling:
        """:func:`row_sampling` of ``reqs_by_lane`` with the engine's
        settings (the constraint table made at the first constrained
        request)."""
        if self.constraints is None:
            vocab = _constraint_vocab(reqs_by_lane.values())
            if vocab is not None:
                self.constraints = ConstraintTable(vocab)
        return row_sampling(self.max_seqs, rows, reqs_by_lane, self.logprobs_mode, self.history_width,
                            self.constraints)

    def _count_call(self, slots: int, real: int) -> None:
        self._count.model_calls += 1
        self._count.slots_computed += slots
        self._count.slots_real += real

    def stream_lengths(self) -> list[int]:
        """The packed stream's lengths a step can compile (one program per
        length; :func:`stream_lengths`); ``[]`` for the padded scheduler."""
        if self.scheduler != "packed":
            return []
        return stream_lengths(self.max_num_batched_tokens or self.prefill_chunk)

    def _packed(self) -> None:
        """ONE packed step: the decode token of every decoding request, then
        (first in the stream) one prefill piece per prefilling request,
        oldest admission first, while the budget lasts (a piece longer than
        what is left is cut; at least one prompt token runs). A request
        whose last piece ran gets its first token, a decoding one its next."""
        # The decoding rows and requests as columns, made in the row check's pass (at 256 rows each list is a
        # pass); remade only when the decoding requests change below.
        decode_rows, reqs = self._decoding_columns()
        # The decode lanes' inputs come from the row mirror unless the step may verify drafts or a request asks
        # for more than plain sampling (then from every record). From the mirror, only the decoding requests
        # whose entries are stale are screened, as in _decode (prefilling ones always are: their rows are read).
        mirror, calls = self._mirror(), self._count.model_calls
        stale_at = mirror.stale(decode_rows, reqs, calls)  # reused below while the columns stay as they are
        stale = [reqs[i] for i in stale_at]
        mirrored = ((self.speculation is None or not self.cache.packs_verify_lanes)
                    and not any(map(asks_extra, stale)) and not any(map(asks_extra, self._prefilling)))
        screened = stale if mirrored else reqs
        rows = self._screen(screened + self._prefilling)
        # A decoding request that screening finished leaves the batch (``_prefilling`` lost its own already);
        # the common case, none, skips the pass.
        if len(rows) < len(screened) + len(self._prefilling):
            failed = {req.id for req in screened if req.id not in rows}
            kept = [(row, req) for row, req in zip(decode_rows, reqs) if req.id not in failed]
            decode_rows, reqs = [row for row, _ in kept], [req for _, req in kept]
            stale_at = None
        if not self._prefilling:  # every prompt left failed its screening: the next iteration decodes
            return
        budget = self.max_num_batched_tokens or self.prefill_chunk
        # Speculating requests verify drafts in this step too: k more tokens each (jaxkv.serve.speculation).
        speculation = verify = None
        # Not while any request of the step, prefilling ones included, asks for what verify steps do not compute
        # (their plain lanes draw with no logprobs, penalties or constraint, and score no prompt).
        if self.speculation is not None and self.cache.packs_verify_lanes and not any(
                asks_extra(req) for req in reqs + self._prefilling) and all(
                req.prompt_logprobs is None for req in self._prefilling):
            speculation, verify = self.speculation.packed_arguments(list(zip(decode_rows, reqs)), budget)
        extra = 0 if verify is None else int(verify.sum()) * self.speculation.config.num_speculative_tokens
        left = max(budget - len(reqs) - extra, 1)
        batch = []  # (request, (start, end)): a plan; its pieces are consumed once the call returned
        for req in self._prefilling:
            if left <= 0:
                break
            start, end = req.pieces[0]
            end = min(end, start + left)  # a piece longer than what is left is cut
            batch.append((req, (start, end)))
            left -= end - start
        # The cache may cap what one lane brings (Gated DeltaNet's [lanes, width] view): such a piece is cut too.
        cap = self.cache.prefill_lane_cap(len(batch), budget)
        batch = [(req, (start, min(end, start + cap))) for req, (start, end) in batch]
        # The decode lanes' inputs from the row mirror (the rows whose requests changed read from their records);
        # with speculation, or a request asking for more than plain sampling, from every record.
        index = None
        if speculation is None and not any(asks_extra(req) for req, _ in batch):  # (always so when mirrored)
            index = mirror.current(decode_rows, reqs, rows, calls, stale_at)
        if index is None and mirrored:  # the mirror declined: every record is read, so every request screened
            kept = self._screen_the_rest(list(zip(decode_rows, reqs)), rows, screened)
            decode_rows, reqs = [row for row, _ in kept], [req for _, req in kept]
        total = sum(end - start for _, (start, end) in batch) + len(reqs) + extra
        length = stream_length(total, self.stream_lengths())
        scored = _prompt_scoring(batch)
        if index is None:
            lanes = [req for req, _ in batch] + reqs
            decode = [(row, req.generated[-1], req.kv_len) for row, req in zip(decode_rows, reqs)]
            sampling, keys = self._row_sampling(rows, dict(enumerate(lanes))), [req.key for req in lanes]
        else:
            decode, keys = self._row_inputs.packed_arrays(index, len(batch))
            for lane, (req, _) in enumerate(batch):  # the prefill lanes come first
                keys[lane] = req.key
            sampling = self._row_inputs.sampling(np.arange(len(batch), len(batch) + len(index)), index,
                                                 [rows[req.id] for req, _ in batch])
        result = self.cache.packed_step(
            self.graphdef, self.params, [(req.lane, piece) for req, piece in batch], decode, sampling, keys,
            length,
            prefill_width=cap, **({} if speculation is None else {"speculation": speculation}),
            **({"scored": scored} if scored else {}))
        if speculation is not None:
            self.speculation.took(result.history)
        if scored:
            _record_prompt_scores(batch, scored, result.scores)
        for req, (_, end) in batch:  # the pieces ran
            if end < req.pieces[0][1]:
                req.pieces[0] = (end, req.pieces[0][1])  # the rest stays at the head
            else:
                req.pieces.pop(0)
        now = time.perf_counter()
        self._update_peak(result.peak)
        self._count_call(length, total if result.decode_ok else total - len(reqs) - extra)
        finished = []
        if result.counts is None:
            tokens = [[t] for t in result.tokens.tolist()]
        else:  # verify lanes gave their kept drafts too (the output cuts them at a stop)
            tokens = [row[:n] for row, n in zip(result.tokens.tolist(), result.counts.tolist())]
            if result.decode_ok:
                self.speculation.record_packed(list(zip(decode_rows, reqs)), len(batch), result, self._count)
        for lane, (req, _) in enumerate(batch):
            if req.pieces:
                continue
            self._prefilling.remove(req)
            req.key = result.keys[lane]
            if self.output.take(req, tokens[lane][:1], now, logprobs=logprob_entries(result.logprobs, lane, 1)):
                finished.append(req)
        if result.decode_ok:
            lanes = slice(len(batch), len(batch) + len(reqs))  # the decode lanes follow the prefill lanes
            logprobs = None if result.logprobs is None else [
                logprob_entries(result.logprobs, lane, len(tokens[lane])) for lane in range(lanes.start, lanes.stop)]
            finished += self.output.take_all(reqs, tokens[lanes], result.keys[lanes], now,
                                             logprobs=logprobs)
            if index is not None:  # each decode lane took one token (a request cut at a stop finished)
                self._row_inputs.advance(index, result.tokens[lanes], np.ones(len(index), np.int32),
                                         result.keys[lanes], self._count.model_calls)
        self._retire(finished, final=True)
        self.cache.end_step()  # what the step deferred and its retirement did not do
        self._release_trimmed_hits(req for req in reqs if req.state is RequestState.RUNNING)
        if not result.decode_ok:
            logger.debug("packed step: decode lanes stalled for blocks")
            self._relieve([req for lane, req in enumerate(reqs, start=len(batch))
                           if result.blocked[lane] and req.state is RequestState.RUNNING])

    def _decode(self) -> None:
        running = dict(zip(*self._decoding_columns()))
        if not running:
            return
        # The rows' inputs from the row mirror (those whose requests changed read from their records); from every
        # record while a request asks for log-probabilities, penalties or a constraint, which also pauses
        # speculation (verify steps compute none of them). Only the requests whose entries are stale are screened
        # (RowInputs.stale: a current entry's request was screened when it was written; at 256 rows this is a
        # call per request less); the others too when the records are read, or when a screening failed.
        mirror, calls, reqs = self._mirror(), self._count.model_calls, list(running.values())
        stale = [reqs[i] for i in mirror.stale(list(running), reqs, calls)]
        rows = self._screen(stale)
        index = np.fromiter(running, np.int64, len(running))
        if len(rows) < len(stale) or not mirror.write([(req.row, req) for req in stale], rows, calls):
            index = None
            running = dict(self._screen_the_rest(list(running.items()), rows, stale))
            reqs = list(running.values())
            if not running:
                return
        inputs = self._decode_inputs(running, rows) if index is None else mirror.decode_arrays(index)
        speculation = None if self.speculation is None or index is None else (
            self.speculation.arguments(running, self.decode_chunk))
        result = self.cache.decode(self.graphdef, self.params, *inputs, self.decode_chunk, speculation=speculation)
        if speculation is not None:
            self.speculation.took(result.history, result.count)
            self.speculation.record(running, speculation[0], result.drafted, result.accepted, result.steps,
                                    self._count)
        now = time.perf_counter()
        self._update_peak(result.peak)
        self._count_call(self.max_seqs * int(result.count.max(initial=0)), int(result.count.sum()))
        # take_all's columns, the running rows' in their order, made by whole-array operations (at 256 rows a
        # Python pass per column was a tenth of the iteration): a row's tokens are cut to its count only when
        # some row took less than the whole chunk, and "done" is given only when the device stopped a row.
        at = index if index is not None else np.fromiter(running, np.int64, len(running))
        took, keys, logprobs = result.count[at], result.keys[at], result.logprobs
        tokens = result.tokens[at].tolist()
        if not (took == result.tokens.shape[1]).all():
            tokens = [run[:count] for run, count in zip(tokens, took.tolist())]
        done = result.finished[at]
        done = [d and req.grammar is None for d, req in zip(done.tolist(), running.values())] if done.any() else None
        finished = self.output.take_all(
            reqs, tokens, list(keys), now, done,
            None if logprobs is None else [logprob_entries(logprobs, row, count)
                                           for row, count in zip(running, took.tolist())])
        if index is not None and speculation is None:  # each row took what it counted (one cut at a stop finished)
            self._row_inputs.advance(index, result.tokens[index, np.maximum(took - 1, 0)], took, keys,
                                     self._count.model_calls)
        self._retire(finished, final=True)
        self._release_trimmed_hits(req for req in running.values() if req.state is RequestState.RUNNING)
        if not result.ok:
            logger.debug("decode stalled for blocks: rows %s", np.flatnonzero(result.blocked).tolist())
            self._relieve([req for row, req in running.items()
                           if result.blocked[row] and req.state is RequestState.RUNNING])

    def _screen_the_rest(self, pairs: list, rows: dict, screened: list) -> list:
        """Screen the requests of ``pairs`` (``(row, request)``) that are
        not in ``screened``, their sampling rows added to ``rows``; returns
        the pairs whose requests passed (one that failed is finished: it
        leaves the step)."""
        done = {req.id for req in screened}
        rows.update(self._screen([req for _, req in pairs if req.id not in done]))
        return [(row, req) for row, req in pairs if req.id in rows]

    def _decode_inputs(self, running: dict, rows: dict) -> tuple:
        """The decode chunk's per-row inputs read from the records of
        ``running`` (row -> request; ``rows``: their screened sampling
        rows): :meth:`RowInputs.decode_arrays`'s, with each request's own
        sampling (log-probabilities, penalties, constraints)."""
        batch = self.max_seqs
        index = np.fromiter(running, np.int64, len(running))
        # One pass over the records, then one assignment per array (not a pass per field).
        # A row with a grammar takes one token (its mask is the host's, for that token alone): its max_new is
        # the next token, and the device's "done" for it means only that (jaxkv.serve.grammar).
        columns = np.array([(req.generated[-1], len(req.generated),
                             req.max_new if req.grammar is None else min(req.max_new, len(req.generated) + 1),
                             req.eos_id) for req in running.values()], np.int64)
        last = np.zeros((batch,), np.int32)
        active = np.zeros((batch,), bool)
        num_generated = np.zeros((batch,), np.int32)
        max_new = np.zeros((batch,), np.int32)
        eos = np.full((batch,), -1, np.int32)
        keys = [None] * batch
        last[index], num_generated[index], max_new[index], eos[index] = columns.T
        active[index] = True
        for row, req in running.items():
            keys[row] = req.key
        return (last, active, num_generated, max_new, eos, self._row_sampling(rows, running),
                self.cache.key_array(keys))

    def _mirror(self) -> RowInputs:
        """The row mirror of the decoding requests' step inputs
        (:class:`~jaxkv.serve.row_inputs.RowInputs`), a new one with each
        new cache (a rebuilt one serves its rows anew)."""
        if self._row_inputs is None or self._row_inputs_cache is not self.cache:
            self._row_inputs = RowInputs(self.max_seqs, self.cache.key_array([]).shape[1:], self.logprobs_mode)
            self._row_inputs_cache = self.cache
        return self._row_inputs

    def _release_trimmed_hits(self, reqs) -> None:
        """Unpin the prefix hits that a window trimmed out of their rows'
        tables (the first block is gone): the row no longer reads them, so
        the prefix cache may evict them when blocks are short (pinned, a
        windowed request would hold its whole hit plus its window). The
        request keeps counting the hit's blocks as shared (``shared``) in
        its reserve: they stay allocated until evicted."""
        if self.cache.window is None:
            return
        holding = [req for req in reqs if req.hit is not None and req.hit.tokens]
        if not holding:
            return
        first = self.cache.first_blocks()
        for req in holding:
            if first[req.row] < 0:
                self.cache.unpin(req.hit)
                req.hit = None

    def _relieve(self, blocked: list) -> None:
        """Free blocks for the rows that could not grow: evict the prefix
        cache, then preempt the most recently admitted running requests
        that recomputation can bring back (re-admitting one holding its
        prompt and output fits an empty engine). Raises ``KVCacheOOM`` when
        none is left to preempt (the admission reserve rules it out)."""
        if not blocked:
            return
        # Eviction only: room for every running request's next chunk.
        make_room(self.cache, self._growth_reserve())

        def need():  # the next token of each blocked row (and a verify step's drafts: the cache's lookahead)
            grow = 1 + self.cache.lookahead
            return sum((self.cache.blocks_for(r.kv_len + grow) - self.cache.blocks_for(r.kv_len) for r in blocked),
                       np.zeros(len(self.cache.groups), np.int64))

        while blocked and not make_room(self.cache, need()):
            running = [self._requests[rid] for rid in self._rows  # never one mid-prefill
                       if rid is not None and decodes(self._requests[rid])]
            victims = [req for req in running if readmittable(self.cache, req, self.reserve_chunk)]
            if not victims:
                stuck = blocked[0]
                raise self.cache.oom(need(), f"request {stuck.id} cannot grow and no running request can be "
                                             f"preempted (recomputing any would need more blocks than the groups "
                                             f"have: {self.cache.capacity.tolist()})")
            victim = max(victims, key=lambda r: r.order)
            self._preempt(victim)
            blocked = [req for req in blocked if req is not victim]

    def _preempt(self, req: Request) -> None:
        if self.cache.can_swap and self.cache.swap_out(req.row):
            self.cache.unpin(req.hit)
            req.hit = None
            req.shared = np.zeros(len(self.cache.groups), np.int64)  # swapped in, every block is its own
            req.state = RequestState.SWAPPED
            self._swapped.append(req.id)
            self._count.swaps += 1
            logger.debug("request %d swapped out from row %d", req.id, req.row)
            return
        logger.debug("request %d preempted for recomputation (row %d, %d tokens)", req.id, req.row, len(req.tokens))
        self._retire([req], final=False)
        self._count.recomputes += 1

    def _retire(self, reqs: list, *, final: bool, requeue: bool = True) -> None:
        """Give the requests' rows back to the cache (a paged cache first
        inserts their full pages into the prefix cache: those whose K/V are
        written, i.e. all but the last token, or of a request aborted
        mid-prefill the pieces prefilled so far) and unpin their prefixes.
        ``final``: they are done; else they go back to the front of the
        queue (``requeue``) or nowhere (an abort finishes them)."""
        if not reqs:
            return
        self.cache.retire([(req.row, req.tokens[: req.pieces[0][0] if req.pieces else req.kv_len], req.namespace,
                            req.hit) for req in reqs])
        for req in reqs:
            self._rows[req.row] = None
            req.hit, req.row, req.lane, req.pieces = None, -1, None, []
            if final:
                self._finish(req, "length")
            else:
                req.state = RequestState.WAITING
        if not final and requeue:
            for req in reversed(reqs):
                self._waiting.appendleft(req.id)
