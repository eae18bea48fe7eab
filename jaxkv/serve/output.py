"""Output processing: what a step's tokens become for the caller.

:class:`OutputProcessor` gives each request the tokens a device call made
for it, in order, up to its first stop (a stop token id, a stop string in
its incremental text, ``max_new_tokens``), detokenizes them (a request's
detokenizer that raises fails that request alone: ``finish_reason
"error"``), records latency samples, and collects one
:class:`~jaxkv.serve.request.RequestOutput` per request that moved in a
step. The statistics types (:class:`EngineStats`, :class:`EngineProgress`,
:class:`EngineSummary`) and the counters they read live here too."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging

import numpy as np

from jaxkv.errors import BookkeepingError
from jaxkv.serve.request import Request, RequestOutput, find_stop

__all__ = ["Counters", "EngineProgress", "EngineStats", "EngineSummary", "OutputProcessor", "latency_stats"]

logger = logging.getLogger("jaxkv.serve")


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for a metrics endpoint (:meth:`Engine.stats`).

    ``running`` (holding a row on the device: prefilling or decoding),
    ``waiting`` (queued: new, not arrived yet, or preempted for
    recomputation), ``swapped`` (preempted to host memory): requests now.
    Per block group of the cache (``{group: number}``; ``"pages"`` for a
    paged pool): ``blocks_used`` / ``blocks_total`` (allocatable blocks held
    by requests or the prefix cache / all), ``tokens_used`` /
    ``tokens_total`` (those blocks times the group's tokens per block) and
    ``bytes_used`` / ``bytes_total`` (times the device bytes one block costs,
    :class:`~jaxkv.serve.sizing.GroupPlan`). Cumulative since the engine was
    built: ``prompt_tokens`` (prompt tokens admitted: the prefix cache's
    queries, re-admissions after recompute included), ``prefix_hit_tokens``
    (those served from the prefix cache), ``swap_preemptions``,
    ``recompute_preemptions``, ``preemptions`` (both), ``generated_tokens``,
    ``finished_requests``, ``aborted_requests``, ``iterations``,
    ``model_calls`` (jitted calls that ran the model: prefill calls, decode
    chunks, packed steps; the admission and retirement bookkeeping calls are
    not counted), ``model_iterations`` (iterations that made at least one
    such call: ``model_calls / model_iterations`` is the calls per busy
    iteration), ``token_slots`` / ``padding_slots`` (token positions those
    calls computed, and how many of them were padding: idle lanes, the
    bucket's tail, rows finished inside a decode chunk), ``step_failures``
    (steps that raised inside and were contained: the cache rebuilt, the
    requests in flight re-queued; see :mod:`jaxkv.serve.faults`) and
    ``failed_requests`` (requests finished with ``"error"``),
    ``spec_draft_tokens`` / ``spec_accepted_tokens`` (speculative decoding:
    draft tokens verified / kept; ``spec_packed_draft_tokens`` of them
    verified in packed steps' verify lanes), ``forked_requests``
    (siblings admitted on their parent's own pages: ``fork_of``),
    ``disk`` (the prefix cache's disk tier, None without one: its records
    and bytes now, records written / loaded / dropped / rejected and their
    bytes since start, ``hit_tokens`` read back into the host tier).
    ``cache_usage``:
    the cache's usage per group now (:class:`EngineSummary`). Since the
    previous :meth:`Engine.stats` call (drained by each call; at most the
    last 65536 of each are kept between calls): ``ttft`` (seconds from the
    iteration that saw a request arrive to its first token, one per request)
    and ``itl`` (seconds between consecutive tokens of a request, a decode
    call's wall time spread over the tokens it gave, one per token).
    """

    running: int
    waiting: int
    swapped: int
    blocks_used: dict
    blocks_total: dict
    tokens_used: dict
    tokens_total: dict
    bytes_used: dict
    bytes_total: dict
    prompt_tokens: int
    prefix_hit_tokens: int
    swap_preemptions: int
    recompute_preemptions: int
    preemptions: int
    generated_tokens: int
    finished_requests: int
    aborted_requests: int
    iterations: int
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    model_calls: int = 0
    model_iterations: int = 0
    token_slots: int = 0
    padding_slots: int = 0
    cache_usage: tuple = ()
    step_failures: int = 0
    failed_requests: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_packed_draft_tokens: int = 0
    forked_requests: int = 0
    disk: dict | None = None

    @property
    def prefix_query_tokens(self) -> int:
        """The prefix cache's queries in tokens (``prompt_tokens``)."""
        return self.prompt_tokens


@dataclasses.dataclass
class Counters:
    """The engine's cumulative counters (``run`` reports the change over it)."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    swaps: int = 0
    recomputes: int = 0
    iterations: int = 0
    generated: int = 0
    finished: int = 0
    aborted: int = 0
    model_calls: int = 0  # jitted calls that run the model (prefill, decode chunk, packed step)
    model_iterations: int = 0  # iterations that made at least one such call
    slots_computed: int = 0  # token slots those calls computed (padding included)
    slots_real: int = 0  # of which real tokens
    step_failures: int = 0  # steps whose exception was contained (cache rebuilt, requests re-queued)
    failed_requests: int = 0  # requests finished with "error"
    spec_drafted: int = 0  # speculative decoding: draft tokens verified
    spec_accepted: int = 0  # and kept
    spec_packed_drafted: int = 0  # of the verified, those in packed steps' verify lanes
    forked: int = 0  # siblings admitted on their parent's own pages (Engine.add_request's fork_of)


@dataclasses.dataclass(frozen=True)
class EngineProgress:
    """Where :meth:`Engine.run` stands, passed to its ``on_progress``
    callback after every scheduler iteration (and once at the end).

    ``finished``/``total``: requests of this run done / to serve;
    ``running``, ``waiting``, ``swapped``: requests in those states now;
    ``generated_tokens``: tokens generated in this run; ``elapsed_seconds``:
    wall time since ``run`` started; ``preemptions``: swap and recompute
    preemptions so far; ``iteration``: scheduler iterations so far.
    """

    finished: int
    total: int
    running: int
    waiting: int
    swapped: int
    generated_tokens: int
    elapsed_seconds: float
    preemptions: int
    iteration: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0


@dataclasses.dataclass
class EngineSummary:
    """What :meth:`Engine.run` did.

    ``prefix_hit_rate``: prompt tokens served from the prefix cache / prompt
    tokens admitted (every admission counts, re-admissions after a recompute
    preemption included, with their generated tokens as part of the prompt).
    ``peak_kv_blocks``: most device blocks in use at once (sequences and
    prefix cache together), of ``kv_blocks`` allocatable ones.
    ``ttft``: time to first token per request (from the iteration in which
    the scheduler saw it arrive to the end of the call that sampled its
    first token) and ``itl``: inter-token latency (a decode call's wall time
    spread evenly over the tokens it gave a request, and the wait across a
    preemption), each as ``(mean, p50, p99)`` seconds over the run.
    ``prefix_unit_tokens``: the cache's page (a hybrid cache shares whole
    pages by reference and hits at any token where a snapshot was kept; a
    paged pool hits whole pages) and ``hit_blocks``: blocks served from the
    prefix cache per block group. ``cache_usage``: the cache's
    ``usage()`` at the end of the run, one dict per group (``group``,
    ``blocks`` in use of ``capacity``, ``free``, ``tokens``, ``bytes``,
    ``cached_blocks`` the prefix cache holds, ``hit_unit``, ``min_hit``; a
    hybrid cache adds a ``snapshots`` row: snapshot rows held and free and
    their bytes).
    """

    requests: int
    generated_tokens: int
    wall_seconds: float
    tokens_per_second: float
    prompt_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    peak_kv_blocks: int
    kv_blocks: int
    swap_preemptions: int
    recompute_preemptions: int
    iterations: int
    ttft: tuple[float, float, float] = (0.0, 0.0, 0.0)
    itl: tuple[float, float, float] = (0.0, 0.0, 0.0)
    prefix_unit_tokens: int = 0
    hit_blocks: dict = dataclasses.field(default_factory=dict)
    cache_usage: tuple = ()

    @property
    def preemptions(self) -> int:
        return self.swap_preemptions + self.recompute_preemptions

    def usage_lines(self) -> list[str]:
        """``cache_usage`` as one line per group."""
        return [f"{u['group']}: {u['blocks']}/{u['capacity']} in use ({u['free']} free, {u['cached_blocks']} cached), "
                f"{u['tokens']} tokens, {u['bytes'] / 2**20:.2f} MiB; hit unit {u['hit_unit']} tokens, smallest hit "
                f"{u['min_hit']}" for u in self.cache_usage]

    def __str__(self) -> str:
        return (
            f"requests {self.requests} | generated tokens {self.generated_tokens} | "
            f"{self.wall_seconds:.2f} s | {self.tokens_per_second:.1f} tokens/s | "
            f"prefix hit rate {100 * self.prefix_hit_rate:.1f}% ({self.prefix_hit_tokens}/{self.prompt_tokens} tokens) | "
            f"peak KV blocks {self.peak_kv_blocks}/{self.kv_blocks} | "
            f"preemptions {self.preemptions} (swap {self.swap_preemptions}, recompute {self.recompute_preemptions}) | "
            f"TTFT mean/p50/p99 {_ms(self.ttft)} ms | ITL mean/p50/p99 {_ms(self.itl)} ms"
        )


def _ms(stats) -> str:
    return "/".join(f"{1000 * x:.1f}" for x in stats)


def latency_stats(values: list) -> tuple[float, float, float]:
    """``(mean, p50, p99)`` of ``values`` (zeros when empty)."""
    if not values:
        return (0.0, 0.0, 0.0)
    arr = np.asarray(values, np.float64)
    return (float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99)))


def spread_gaps(now: float, lasts: list, counts: list) -> list:
    """The inter-token gaps of requests that took ``counts[i]`` tokens
    (at least one) at ``now``, their previous token at ``lasts[i]``: per
    token, in order (the one rule of every gap record),
    ``(now - lasts[i]) / counts[i]`` (a request's gap spread evenly over
    the tokens one call gave it). In a steady decode step every request's
    previous token came at the same time (the previous step's, one float
    object) and each took the whole chunk: one list, without a list and a
    division per request (in the step at 256 rows, :meth:`OutputProcessor.take_all`
    took about 55-70 us less, of about 500)."""
    if not lasts:
        return []
    first, count = lasts[0], counts[0]
    if lasts.count(first) == len(lasts) and counts.count(count) == len(counts):
        return [(now - first) / count] * (count * len(lasts))
    return [gap for last, took in zip(lasts, counts) for gap in [(now - last) / took] * took]


class OutputProcessor:
    """Turns the tokens device calls made into each request's tokens, text
    and :class:`RequestOutput` (module docstring). ``pending``: request id
    -> ``[tokens, text, finished]`` of the step running now, or the
    request's whole :class:`RequestOutput` where :meth:`take_all`'s common
    case made it (drained by :meth:`collect`; written only by :meth:`_open`,
    which counts its lists, and :meth:`take_all`: a step with no list
    entry is collected without a pass); ``ttft_samples`` /
    ``itl_samples``: latency samples since the last
    :meth:`Engine.stats <jaxkv.serve.Engine.stats>`; ``run_itl``: while
    :meth:`Engine.run <jaxkv.serve.Engine.run>` runs, a list of every
    inter-token gap recorded since it began (its summary's), else None."""

    def __init__(self, counters: Counters, tokenizer=None, detokenizer=None):
        self.counters = counters
        self.tokenizer = tokenizer
        self._detokenizer = detokenizer
        self.pending: dict = {}
        self._open_entries = 0  # how many of ``pending`` are [tokens, text, finished] lists (_open), not outputs
        self.ttft_samples: collections.deque = collections.deque(maxlen=65536)
        self.itl_samples: collections.deque = collections.deque(maxlen=65536)
        self.run_itl: list | None = None

    def detokenizer_for(self, prompt: list):
        factory = self._detokenizer
        if factory is None:
            from jaxkv.text import IncrementalDetokenizer as factory  # noqa: N813 - the default factory
        return factory(self.tokenizer, prompt)

    def record_tokens(self, req: Request, count: int, now: float) -> None:
        """Latency bookkeeping for ``count`` tokens ``req`` got by ``now``."""
        if count <= 0:
            return
        self.counters.generated += count
        if req.first_token_at is None:
            req.first_token_at = req.last_token_at = now
            if req.arrived_at is not None:
                self.ttft_samples.append(now - req.arrived_at)
            count -= 1
        if count:
            self._record_gaps(spread_gaps(now, [req.last_token_at], [count]))
            req.last_token_at = now

    def _record_gaps(self, gaps: list) -> None:
        """Inter-token gaps (seconds), in the order their tokens came: for
        :meth:`Engine.stats <jaxkv.serve.Engine.stats>` and, during
        :meth:`Engine.run <jaxkv.serve.Engine.run>`, its summary. Kept per
        engine, not per request: a record of each request's own would be a
        list appended for every running request every step."""
        self.itl_samples.extend(gaps)
        if self.run_itl is not None:
            self.run_itl += gaps

    def take(self, req: Request, tokens: list, now: float, device_done: bool = False, logprobs=None) -> bool:
        """Give ``req`` the ``tokens`` a call made for it, in order, up to
        the first stop: a stop token id (EOS included), a stop string in
        its text, or ``max_new_tokens`` (the tokens after it are dropped:
        the device may decode a few past a stop it does not check). Records
        them for this step's :class:`RequestOutput`, with the text they
        complete; returns whether the request is finished (its
        ``finish_reason`` set). ``device_done``: the device stopped the row
        (EOS or length), which the same checks find. ``logprobs``: the
        tokens' entries (:func:`jaxkv.serve.caches.logprob_entries`), kept
        for those taken (each cut to the top count the request asked)."""
        if req.detok is None:  # no text: the first stop id, or max_new_tokens (the loop below, without text)
            return self._take_ids(req, tokens, now, device_done, logprobs)
        taken, reason, cut = [], None, None
        longest = max(map(len, req.stop), default=0)
        for token in tokens:
            taken.append(token)
            if token in req.stop_ids:
                reason = "stop"
                break
            if req.detok is not None:
                before = len(req.text)
                try:
                    req.text += req.detok.add([token])
                except Exception as err:  # noqa: BLE001 - this request's own failure: the others go on
                    req.error = f"detokenizing token {token} failed: {type(err).__name__}: {err}"
                    reason = "error"
                    self.counters.failed_requests += 1
                    logger.warning("request %d failed: %s", req.id, req.error)
                    break
                if req.stop:
                    cut = find_stop(req.text, req.stop, max(before - longest + 1, 0))
                    if cut is not None:
                        reason = "stop"
                        break
            if len(req.generated) + len(taken) >= req.max_new:
                reason = "length"
                break
        if reason is None and device_done:  # the checks above find what the device found; this only guards it
            reason = "length" if len(req.generated) + len(taken) >= req.max_new else "stop"
        req.generated += taken
        _keep_logprobs(req, logprobs, len(taken))
        self.record_tokens(req, len(taken), now)
        if req.detok is not None:
            if cut is not None:
                req.text = req.text[:cut]  # the stop string and what follows are never given out
            elif reason not in (None, "error") and hasattr(req.detok, "finish"):
                req.text += req.detok.finish()  # bytes held back for a character that never completed
            # While a stop string may still begin in the tail, that tail waits.
            end = len(req.text) if reason is not None or not req.stop else max(len(req.text) - longest + 1,
                                                                               req.emitted)
            text, req.emitted = req.text[req.emitted:end], max(end, req.emitted)
        else:
            text = ""
        if taken or text:  # a row a stalled decode gave nothing has nothing to say
            entry = self._open(req.id)
            entry[0] += taken
            entry[1] += text
        if reason is not None:
            req.finish_reason = reason
        return reason is not None

    def take_all(self, reqs: list, tokens: list, keys, now: float, done=None, logprobs=None) -> list:
        """For each request ``reqs[i]``, in order: ``req.key = keys[i]`` (its
        key data advanced by the call), then :meth:`take` of its tokens
        ``tokens[i]`` (``done[i]``: the device stopped its row, all False
        when None; ``logprobs[i]``: the tokens' entries, none when None).
        One call per step, not per request, given columns, not a tuple per
        request; the common case inline, with the same records. Returns
        the requests it finished, in order; ``BookkeepingError``, changing
        nothing, when a column's length is not the requests' count."""
        columns = [len(tokens), len(keys)] + [len(c) for c in (done, logprobs) if c is not None]
        if any(n != len(reqs) for n in columns):  # zip below would drop requests silently
            raise BookkeepingError(f"take_all: {len(reqs)} requests, columns of {columns} entries (tokens, keys, "
                                   "then done and log-probabilities where given)")
        finished = []
        take_ids, take, pending, make = self._take_ids, self.take, self.pending, RequestOutput._make
        # The common case's token count, and per request its previous token's time and its count: recorded once
        # (spread_gaps, in order) at the end, or before a request the common case does not take.
        generated, lasts, counts = 0, [], []
        done = itertools.repeat(False) if done is None else done
        for i, (req, run, key, device_done) in enumerate(zip(reqs, tokens, keys, done)):
            req.key = key
            count = len(run)
            # The common case, inline (every decoding request every step: 256 at 256 rows): no text, no
            # log-probabilities, a token seen before, no stop among these tokens and room for them all. It does
            # what _take_ids does for it.
            if (req.detok is not None or req.logprobs is not None or req.first_token_at is None or device_done
                    or not count or count >= req.max_new - len(req.generated)
                    or (req.stop_ids and not req.stop_ids.isdisjoint(run))):
                self._record_gaps(spread_gaps(now, lasts, counts))  # the samples stay in the order of the tokens
                self.counters.generated += generated
                generated, lasts, counts = 0, [], []
                if (take_ids if req.detok is None else take)(req, run, now, device_done,
                                                             None if logprobs is None else logprobs[i]):
                    finished.append(req)
                continue
            req.generated += run
            lasts.append(req.last_token_at)
            counts.append(count)
            generated += count
            req.last_token_at = now
            if req.id not in pending and req.prompt_logprobs is None:  # its output now: collect passes it on
                pending[req.id] = make(req.id, tuple(run), False, None, "", req.cached_tokens, None,
                                       req.spec_drafted, req.spec_accepted)
            else:
                self._open(req.id)[0] += run
        self._record_gaps(spread_gaps(now, lasts, counts))
        self.counters.generated += generated
        return finished

    def _take_ids(self, req: Request, tokens: list, now: float, device_done: bool, logprobs=None) -> bool:
        """:meth:`take` for a request without a detokenizer (no text, no
        stop strings): the same tokens, reason and records, in one pass."""
        reason, room, stop_ids = None, req.max_new - len(req.generated), req.stop_ids
        taken = tokens
        # The common case, every decoding request every step: no stop id among the tokens and room for them
        # all (one set operation); else find the first token that ends it.
        ends = len(tokens) >= room or (stop_ids and not stop_ids.isdisjoint(tokens))
        for i, token in enumerate(tokens if ends else ()):
            if token in stop_ids:
                reason = "stop"
            elif i + 1 >= room:
                reason = "length"
            else:
                continue
            taken = tokens[: i + 1]
            break
        if reason is None and device_done:  # the checks above find what the device found; this only guards it
            reason = "length" if len(req.generated) + len(taken) >= req.max_new else "stop"
        req.generated += taken
        count = len(taken)
        if req.logprobs is not None:
            _keep_logprobs(req, logprobs, count)
        if count and req.first_token_at is not None:  # record_tokens' common case, inline
            self.counters.generated += count
            self._record_gaps(spread_gaps(now, [req.last_token_at], [count]))
            req.last_token_at = now
        else:
            self.record_tokens(req, count, now)
        if taken:  # a row a stalled decode gave nothing has nothing to say
            self._open(req.id)[0] += taken
        if reason is not None:
            req.finish_reason = reason
        return reason is not None

    def mark_finished(self, req: Request) -> None:
        """Say in this step's output that ``req`` finished."""
        self._open(req.id)[2] = True

    def _open(self, rid: int) -> list:
        """This step's entry of request ``rid`` as ``[tokens, text,
        finished]``: a new empty one, or the output :meth:`take_all` made
        whole opened again (its request moves again in this step)."""
        entry = self.pending.get(rid)
        if entry is None:
            entry = self.pending[rid] = [[], "", False]
            self._open_entries += 1
        elif entry.__class__ is RequestOutput:
            entry = self.pending[rid] = [list(entry.new_token_ids), entry.new_text, entry.finished]
            self._open_entries += 1
        return entry

    def begin_step(self) -> None:
        """Drop what :meth:`collect` did not drain: a step's outputs begin empty."""
        self.pending, self._open_entries = {}, 0

    def collect(self, requests: dict) -> list[RequestOutput]:
        """This step's :class:`RequestOutput` per request that moved, in the
        order they first did; the pending entries are drained."""
        if not self._open_entries:  # every entry is an output take_all made whole (a steady step: no pass)
            out = list(self.pending.values())
            self.begin_step()
            return out
        out = []
        make = RequestOutput._make
        for rid, entry in self.pending.items():
            if entry.__class__ is RequestOutput:  # made whole by take_all
                out.append(entry)
                continue
            tokens, text, finished = entry
            req = requests[rid]
            logprobs = None
            if req.logprobs is not None:  # the pending tokens are the last generated
                logprobs = tuple(req.token_logprobs[len(req.token_logprobs) - len(tokens):])
            prompt = None
            if req.prompt_logprobs is not None and not req.prompt_scores_given and req.generated:
                prompt = (None, *(req.prompt_scores.get(i) for i in range(1, len(req.prompt))))
                req.prompt_scores_given = True
            out.append(make(rid, tuple(tokens), finished, req.finish_reason if finished else None, text,
                            req.cached_tokens, req.error if finished else None, req.spec_drafted,
                            req.spec_accepted, logprobs, prompt))
        self.begin_step()
        return out


def _keep_logprobs(req: Request, logprobs, count: int) -> None:
    """Append the first ``count`` of ``logprobs`` (entries of the tokens
    ``req`` just took) to its record, each cut to the ``req.logprobs`` top
    entries it asked; nothing for a request that asked none. A call that
    computed none for a request that asked is a bookkeeping bug."""
    if req.logprobs is None or count == 0:
        return
    if logprobs is None:
        raise BookkeepingError(f"request {req.id} asked for log-probabilities; the call that gave its tokens "
                               "computed none")
    top = req.logprobs
    req.token_logprobs += [(token, alternatives[:top]) for token, alternatives in logprobs[:count]]
