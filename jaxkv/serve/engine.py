"""A continuous-batching engine: a host scheduler around jitted steps.

The engine schedules; the model's cache (:mod:`jaxkv.serve.caches`) owns the
device state and the jitted steps, behind one contract: a
:class:`~jaxkv.serve.paged_cache.PagedCache` (paged pool, prefix cache, swap)
for a "paged" model, a :class:`~jaxkv.serve.hybrid_cache.HybridCache` (the
model's ``KVCacheManager``; prefix cache with state snapshots, swap of every
group) for a "hybrid" one (the model's ``cache_kind``;
:func:`jaxkv.serve.build.build_cache` picks).
Blocks are counted per group of the cache (one group for a paged pool);
what follows says "blocks" for each group's count. The cache is sized by
one rule for every family (:mod:`jaxkv.serve.sizing`: ``max_model_len``,
``kv_cache_memory``; ``Engine(model)`` needs neither), reported as
``engine.cache_plan``.

**Online.** :meth:`Engine.add_request` queues a request at any time, also
between iterations while others run; :meth:`Engine.step` runs ONE
scheduler iteration and returns a :class:`RequestOutput` per request that
made tokens (a decode chunk makes up to ``decode_chunk`` per request, all
reported, in order) or finished in it (``"stop"``, ``"length"``,
``"abort"``); :meth:`Engine.abort` frees what a request holds at the next
iteration; :meth:`Engine.stats` is a snapshot for a metrics endpoint.
:meth:`Engine.run` is a loop over ``step`` (with a summary), so a request
streamed through ``step`` gets exactly the tokens ``run`` gives it.

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

**Failures: a step is all or nothing.** (DESIGN.md, principle 8.)

* A request whose own part of a step fails (its sampling parameters cannot
  be put on the device, its detokenizer raises) is finished alone, with
  ``finish_reason="error"`` and the message in ``RequestOutput.error``;
  what it computed stays computed (its pages may serve later hits), what
  it did not compute is never inserted (prompt pieces are consumed only
  after the call that ran them returned). The others go on.
* Any other exception inside :meth:`step` (a jitted call, the cache's
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

Progress is reported, never printed: ``run(on_progress=fn)`` calls ``fn``
with an :class:`EngineProgress` after every scheduler iteration, and the
logger ``"jaxkv.serve"`` gets a DEBUG record per iteration and an INFO
record with the summary (``logging.basicConfig(level=logging.INFO)`` shows
them). ``python -m jaxkv.demo`` draws a progress bar from the callback.

Example::

    engine = Engine(model)                      # or Engine(model, max_model_len=8192, kv_cache_memory=0.9)
    print(engine.cache_plan)                    # tokens, bytes per token, prefix-hit unit per group
    rid = engine.add_request([1, 2, 3], max_new_tokens=16)
    summary = engine.run(on_progress=lambda p: print(p.finished, "/", p.total))
    print(summary)
    engine.outputs[rid]   # the generated token ids

    # online: stream while adding and aborting
    rid = engine.add_request([4, 5, 6], 64, stop_token_ids=[2])
    while engine.has_unfinished():
        for out in engine.step():               # RequestOutput per request that moved
            print(out.request_id, out.new_token_ids, out.finish_reason)
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import enum
import logging
import numbers
import time
import traceback
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv import _host
from jaxkv.errors import BookkeepingError, InvalidArgument, KVCacheOOM
from jaxkv.nn import sharding
from jaxkv.nn.sampling import GREEDY, RowSampling, SamplingParams
from jaxkv.serve.build import build_cache
from jaxkv.serve.caches import FREE, ON_DEVICE, STATUS_NAMES, SWAPPED, PrefillLane, PrefixHit
from jaxkv.serve.sizing import CachePlan

__all__ = ["Engine", "EngineProgress", "EngineStats", "EngineSummary", "RequestOutput", "RequestState"]

logger = logging.getLogger("jaxkv.serve")


# ---------------------------------------------------------------- host side

#: The fewest tokens a waiting request must gain to wait for a request being
#: prefilled that shares them (:meth:`Engine._wait_for_prefix`).
WAIT_FOR_PREFIX_TOKENS = 32

#: Failed steps a request may be in flight for before it is finished with
#: ``"error"`` (each failure re-queues it; see "Failures" above).
MAX_REQUEST_FAULTS = 3


def _common_prefix(a: list, b: list) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


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


def _stop_strings(stop) -> tuple[str, ...]:
    """``stop`` (a string or a sequence of strings) as a tuple of non-empty
    strings (None: none), else ``InvalidArgument``."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stop = tuple(stop)
    except TypeError:
        raise InvalidArgument(f"stop={stop!r}: give a string or a sequence of strings") from None
    if not all(isinstance(x, str) and x for x in stop):
        raise InvalidArgument(f"stop={list(stop)!r}: stop strings must be non-empty strings")
    return stop


def _flag(value, name: str) -> bool:
    """A yes/no option: a bool (numpy's too), else ``InvalidArgument`` (a
    string such as ``"no"`` would be true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{name}={_host.short_repr(value)}: give True or False")
    return bool(value)


def _find_stop(text: str, stops: tuple, start: int) -> int | None:
    """Where the earliest of ``stops`` begins in ``text`` at or after ``start``."""
    found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
    return min(found) if found else None


class RequestState(enum.Enum):
    """Where a request is in its life cycle (see the module docstring)."""

    WAITING = "waiting"  # queued: not arrived, not admitted yet, or preempted for recomputation
    RUNNING = "running"  # holds a sequence row and device blocks
    SWAPPED = "swapped"  # holds a sequence row whose blocks are in host memory
    FINISHED = "finished"  # done; its tokens are in Engine.outputs


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one :meth:`Engine.step`.

    ``new_token_ids``: the tokens it made in this step, in order (a decode
    chunk makes several; a stop token or EOS is included, tokens a stop
    condition cut off are not); ``finished``: whether it is done, and
    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string),
    ``"length"`` (``max_new_tokens``), ``"abort"`` (:meth:`Engine.abort`),
    ``"error"`` (its own part of a step failed, or it was in flight at
    :data:`MAX_REQUEST_FAULTS` failed steps: ``error`` says why), or None
    while it runs; ``new_text``: with a tokenizer, the text those
    tokens complete (stop tokens and EOS add none; with stop strings, the
    last ``len(longest stop string) - 1`` characters are held back until
    they cannot begin one, and a stop string and what follows it are never
    emitted), else ``""``; ``cached_tokens``: prompt tokens served from the
    prefix cache at its admission (its latest one, after a recompute
    preemption; OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
    """

    request_id: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    new_text: str = ""
    cached_tokens: int = 0
    error: str | None = None


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
    requests in flight re-queued; see the engine's "Failures") and
    ``failed_requests`` (requests finished with ``"error"``). ``cache_usage``:
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

    @property
    def prefix_query_tokens(self) -> int:
        """The prefix cache's queries in tokens (``prompt_tokens``)."""
        return self.prompt_tokens


@dataclasses.dataclass
class _Counters:
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


@dataclasses.dataclass
class _Request:
    id: int
    prompt: list
    max_new: int
    sampling: SamplingParams
    eos_id: int  # the stop id the device checks (-1: none)
    arrival: int
    namespace: Hashable
    key: np.ndarray  # PRNG key data of the request's own stream (advanced as it samples)
    stop_ids: frozenset = frozenset()  # every stop token id (eos included): checked on the host
    stop: tuple = ()  # stop strings
    detok: object = None  # incremental detokenizer (with a tokenizer)
    text: str = ""  # the detokenized output so far (a stop string cut off)
    emitted: int = 0  # characters of ``text`` already given out in a RequestOutput
    finish_reason: str | None = None
    error: str | None = None  # why it finished with "error"
    faults: int = 0  # failed steps it was in flight for (MAX_REQUEST_FAULTS finishes it)
    generated: list = dataclasses.field(default_factory=list)
    state: RequestState = RequestState.WAITING
    row: int = -1  # sequence row while RUNNING or SWAPPED, else -1
    hit: object = None  # its pinned prefix hit (PrefixHit) while running (None once a window trimmed it away)
    shared: object = None  # per group, the blocks of its admission's hit (shared with the prefix cache)
    lane: object = None  # its PrefillLane while its prompt is prefilled
    pieces: list = dataclasses.field(default_factory=list)  # (start, end) prompt pieces still to prefill
    order: int = -1  # admission order (preemption picks the largest)
    arrived_at: float | None = None  # wall time when the scheduler first saw it arrived
    cached_tokens: int = 0  # prompt tokens its latest admission served from the prefix cache
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list = dataclasses.field(default_factory=list)  # seconds between consecutive tokens

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the cache: all but the last sampled one."""
        return len(self.prompt) + len(self.generated) - 1


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


def _buckets(tokens: int) -> list[int]:
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


def _latency_stats(values: list) -> tuple[float, float, float]:
    """``(mean, p50, p99)`` of ``values`` (zeros when empty)."""
    if not values:
        return (0.0, 0.0, 0.0)
    arr = np.asarray(values, np.float64)
    return (float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99)))


class Engine:
    """Continuous batching over a model's cache (see the module docstring).

    The model picks the cache by its ``cache_kind``
    (:func:`jaxkv.serve.build.build_cache`): a "paged" model (Llama,
    Mistral, Qwen2/3, DeepSeek-V3) runs over a paged pool with the prefix
    cache; a "hybrid" one (DeepSeek-V4, Qwen3-Next) over its
    :class:`~jaxkv.KVCacheManager` with the snapshot prefix cache. Both
    preempt by swap to host memory when ``host_kv_memory`` is given, else by
    recomputation.

    **Sizing** (one rule for every family, :mod:`jaxkv.serve.sizing`):
    ``Engine(model)`` needs no sizing argument. ``max_model_len`` is the
    longest request (prompt + output; default ``min(max_position_embeddings,
    4096)``) and ``kv_cache_memory`` the device bytes of the cache (an int,
    or a float in ``(0, 1]``: that fraction of the device's free memory, 1
    GiB standing for it on the CPU; default 0.8 of it, capped at every
    sequence row at ``max_model_len``). Pages / blocks per group, cached
    snapshots and host pages follow; ``cache_plan`` says what came out and
    the ``jaxkv.serve`` logger logs it at INFO, one line per group (tokens
    held, bytes per token, prefix-hit unit). The expert options below still
    size the cache directly; with them: ``kv_cache_memory`` beside
    ``num_pages`` or ``num_blocks`` (both size the blocks), ``max_model_len``
    beside a ``max_blocks_per_seq`` of another width or a different
    ``max_context_tokens``, ``host_kv_memory`` beside ``num_host_pages``,
    and a ``max_model_len`` the blocks cannot hold are refused
    (``InvalidArgument`` with the numbers); a default ``max_model_len`` the
    budget cannot hold is lowered to what it holds.

    Args:
        model: a model of :class:`jaxkv.nn.AutoModelForCausalLM`'s families.
        tokenizer: a :class:`jaxkv.text.Tokenizer` (or anything with its
            ``decode``): requests' text is detokenized incrementally
            (``RequestOutput.new_text``) and ``stop`` strings work.
        max_model_len: the longest request, prompt plus output tokens.
        kv_cache_memory: the cache's device bytes (int), or a fraction in
            ``(0, 1]`` of the device's free memory.
        host_kv_memory: bytes of host memory for swapped-out requests
            (default none: preemption by recomputation): host pages of a
            paged pool; a hybrid cache's request images (state rows and
            every group's blocks, :mod:`jaxkv.manager.hybrid_host`).
        max_seqs: sequence rows (running plus swapped-out requests).
        num_pages: (paged pool, expert) device KV pages (blocks) including
            the null page 0.
        page_size: (paged pool) tokens per page.
        max_blocks_per_seq: (paged pool, expert) block-table width; a
            request needs ``ceil((len(prompt) + max_new_tokens) / page_size)``
            blocks (``max_model_len``'s other spelling).
        num_host_pages: (paged pool, expert) host pages for swapping (0:
            preempt by recompute).
        host_prefix_pages: (paged pool) pages of host memory for the
            prefix cache's host tier (default None / 0: none): evicted
            cached prefixes are copied there instead of dropped and a later
            hit loads them back (:mod:`jaxkv.serve.paged_cache`; a pool
            apart from the swap pool, in ``host_memory_kind``). Needs
            ``prefix_cache``; ignored (logged) when every layer is windowed.
        host_prefix_memory: bytes of host memory for the prefix cache's
            host tier, any cache: a paged pool's host pages (as
            ``host_prefix_pages``), a hybrid cache's records evicted from
            the device, whole (blocks of every group and the state
            snapshot; :class:`~jaxkv.serve.hybrid_cache.HybridCache`).
        kv_dtype: (paged pool) pool dtype (default: the model's).
        host_memory_kind: (paged pool) the swap pool's memory
            (``create_host_pool``: ``"auto"``, ``"pinned_host"`` or ``"numpy"``).
        max_context_tokens: (hybrid cache) ``max_model_len``'s other spelling.
        num_blocks: (hybrid cache, expert) blocks per group (null block
            included; groups left out: every row at ``max_model_len``).
        entry_format: (hybrid cache) DeepSeek-V4's ``"lossless"`` or ``"fp8"``.
        num_snapshots: (hybrid cache) cached prefix snapshots of per-request
            state (default: see :mod:`jaxkv.serve.sizing`; see
            :class:`~jaxkv.serve.hybrid_cache.HybridCache`).
        snapshot_retention: (hybrid cache) which cached snapshot goes
            first when a new one needs its row: ``"value"`` (default) or
            ``"lru"`` (:mod:`jaxkv.prefix.snapshot_cache`).
        snapshot_interval: (hybrid cache) prefill tokens between a
            request's interval snapshots (default ``max(page, 256)``).
        prefix_cache: use the radix prefix cache.
        decode_chunk: decode steps per jitted call.
        prefill_chunk: most prompt tokens per row in one prefill call (longer
            uncached tails are prefilled in several calls).
        scheduler: ``"packed"`` (default): an iteration with prefill work is
            ONE jitted call over a flat token stream that packs the
            decode token of every decoding request with prefill pieces of
            the admitted ones (:mod:`jaxkv.nn.packed`, ragged attention), at
            most ``max_num_batched_tokens`` tokens, the stream's length
            bucketed (16, 32, 48, 64, 96, ... up to the budget) so few
            programs compile; an iteration with only decode work runs the
            multi-step decode chunk (``decode_chunk`` tokens per request in
            one call, faster when nothing waits to be prefilled).
            ``"padded"``: the earlier scheduler, a ``[max_seqs,
            prefill_chunk]`` prefill call and then a decode chunk per
            iteration.
        max_num_batched_tokens: the token budget of a scheduler iteration.
            Packed scheduler: the stream's tokens, decode tokens included
            (a prompt piece is cut to what is left of it; at least one
            prompt token runs per packed step); None: ``prefill_chunk``.
            Padded scheduler: None prefills admitted prompts whole before
            the next decode chunk; given, each iteration runs ONE prefill
            call of at most this many prompt tokens less one per decoding
            request, then the decode chunk.
        seed: the engine's PRNG seed; a request without its own ``seed``
            samples from the stream ``fold_in(key(seed), request id)``.
        detokenizer: ``detokenizer(tokenizer, prompt_ids)`` makes a request's
            incremental detokenizer (``add(ids) -> new text``, optionally
            ``finish() -> held-back text``); default
            :class:`jaxkv.text.IncrementalDetokenizer`.
        free_bytes: the free device bytes the sizing rule reads (default:
            :func:`~jaxkv.serve.sizing.device_free_bytes`; for tests).
        mesh: a ``jax.sharding.Mesh`` (axes ``tp``, ``data``, ``expert``;
            :mod:`jaxkv.nn.sharding`): the model is placed with
            ``shard_model`` unless it is on the mesh already, the cache's
            heads split over ``tp``, its bookkeeping replicated, and every
            jitted step runs across the mesh. Under ``jax.distributed`` every
            process builds the same engine and makes the same calls (the
            scheduler is deterministic given its inputs) and each gets every
            request's tokens (``docs/scale.md``). Sizing reads one device's
            memory; the host tiers are refused on a mesh.
        scrub_on_free: zero every block of every pool (K/V pages and fp8
            scales, DeepSeek-V4 compressed entries and indexer keys) and
            reset every state row (snapshot rows; request slots are reset
            always) in the jitted call that frees it: a finished, aborted
            or preempted request, an eviction, a sliding window's trim
            (:mod:`jaxkv.pool.scrub`). Off by default: costs about the
            bytes it zeroes (README, "Tenants").
        prefix_quota: a fraction in ``(0, 1]``: the most of each block
            group (and of the snapshot rows) one owner's cached prefixes
            may hold (a namespace is its own owner, but the namespaces
            ``("tenant", name, salt)`` of one tenant count as one); eviction
            then takes from owners over their fair share first. Running requests are never affected
            (their blocks are theirs; a pinned prefix is never evicted).
            None (default): one LRU over every namespace.
        enable_kv_events: record the prefix cache's events (pages stored
            and removed, snapshot records) for :meth:`take_kv_events`;
            each event names its namespace.

    Raises ``InvalidArgument``, naming the argument, for a size or count
    that is not an integer or is too small (``num_pages < 2``, others
    ``< 1``, ``num_host_pages < 0``, ``max_model_len < 2``), a
    ``kv_cache_memory`` that is neither bytes nor a fraction in ``(0, 1]``
    or holds less than the cache's fixed bytes and a block per group, a
    ``num_blocks`` that is not a dict of group name to integer ``>= 2`` or
    names a group the model lacks, a non-integer ``seed``, an unknown
    ``host_memory_kind``, contradictory sizing options (above), or an
    option of the other kind of cache.
    """

    def __init__(self, model, *, tokenizer=None, max_model_len: int | None = None, kv_cache_memory=None,
                 host_kv_memory: int | None = None, max_seqs: int = 8, num_pages: int | None = None,
                 page_size: int = 16, max_blocks_per_seq: int | None = None, num_host_pages: int | None = None,
                 kv_dtype=None, host_memory_kind: str = "auto", max_context_tokens: int | None = None,
                 num_blocks: dict[str, int] | None = None, entry_format: str = "lossless",
                 num_snapshots: int | None = None, snapshot_retention: str = "value",
                 snapshot_interval: int | None = None, prefix_cache: bool = True, decode_chunk: int = 8,
                 prefill_chunk: int = 256, max_num_batched_tokens: int | None = None, seed: int = 0,
                 detokenizer: Callable | None = None, free_bytes: int | None = None, scheduler: str = "packed",
                 host_prefix_pages: int | None = None, host_prefix_memory: int | None = None, mesh=None,
                 scrub_on_free: bool = False, prefix_quota: float | None = None, enable_kv_events: bool = False):
        max_seqs = _host.int_at_least(max_seqs, "max_seqs", 1)
        decode_chunk = _host.int_at_least(decode_chunk, "decode_chunk", 1)
        prefill_chunk = _host.int_at_least(prefill_chunk, "prefill_chunk", 1)
        if max_num_batched_tokens is not None:
            max_num_batched_tokens = _host.int_at_least(max_num_batched_tokens, "max_num_batched_tokens", 1)
        self.max_num_batched_tokens = max_num_batched_tokens
        if scheduler not in ("packed", "padded"):
            raise InvalidArgument(f"scheduler={scheduler!r}: choose 'packed' or 'padded'")
        self.scheduler = scheduler
        self.prefill_chunk = prefill_chunk
        seed = _host.int_scalar(seed, "seed")
        scrub_on_free = _flag(scrub_on_free, "scrub_on_free")
        enable_kv_events = _flag(enable_kv_events, "enable_kv_events")
        prefix_cache = _flag(prefix_cache, "prefix_cache")
        if prefix_quota is not None and (not isinstance(prefix_quota, numbers.Real)
                                         or isinstance(prefix_quota, (bool, np.bool_))):
            raise InvalidArgument(f"prefix_quota={_host.short_repr(prefix_quota)}: a number in (0, 1], the share of "
                                  "each block group one tenant's cached prefixes may hold (None: no quota)")
        if max_model_len is not None:
            max_model_len = _host.int_at_least(max_model_len, "max_model_len", 2)  # one prompt and one new token
        if host_memory_kind not in ("auto", "pinned_host", "numpy"):  # checked even when nothing is swapped
            raise InvalidArgument(f"host_memory_kind={host_memory_kind!r}: choose 'auto', 'pinned_host' or 'numpy'")
        self.cache = build_cache(
            model, max_seqs=max_seqs, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
            prefill_chunk=prefill_chunk, prefix_cache=prefix_cache, free_bytes=free_bytes, num_pages=num_pages,
            page_size=page_size, max_blocks_per_seq=max_blocks_per_seq, num_host_pages=num_host_pages,
            host_kv_memory=host_kv_memory, kv_dtype=kv_dtype, host_memory_kind=host_memory_kind,
            max_context_tokens=max_context_tokens, num_blocks=num_blocks, num_snapshots=num_snapshots,
            snapshot_retention=snapshot_retention, snapshot_interval=snapshot_interval,
            entry_format=entry_format, host_prefix_pages=host_prefix_pages, host_prefix_memory=host_prefix_memory)
        # What a rebuilt cache gets again (see _recover).
        self._isolation = dict(scrub_on_free=scrub_on_free, prefix_quota=prefix_quota)
        self._kv_events, self._mesh = enable_kv_events, mesh
        if mesh is not None:  # the model, unless placed already
            sharding.prepare(model, mesh)
        self._configure_cache()
        #: How the cache was sized (:class:`~jaxkv.serve.sizing.CachePlan`), logged at start-up.
        self.cache_plan: CachePlan = self.cache.plan
        for line in self.cache_plan.lines():
            logger.info("%s", line)
        self.max_model_len = self.cache.max_context_tokens
        # Token ids are checked against it (None: a model without ``config.vocab_size``).
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        self.tokenizer = tokenizer
        self._detokenizer = detokenizer
        self.max_seqs = max_seqs
        self.decode_chunk = decode_chunk
        self.graphdef, self.params = nnx.split(model)
        self.key = jax.random.key(seed)
        self.outputs: dict[int, list] = {}
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._live: set = set()  # ids of the requests not finished
        self._aborts: list = []  # ids to abort at the next iteration, in order
        self._out: dict = {}  # request id -> [tokens, text, finished] of the step running now
        self._waiting: collections.deque = collections.deque()  # ids; recomputes go to the front
        self._swapped: list = []  # ids, oldest preemption first
        self._prefilling: list = []  # requests admitted whose prompt is not all prefilled, oldest first
        self._rows: list = [None] * max_seqs  # row -> request id (running or swapped)
        self._step = 0
        self._order = 0
        self._count = _Counters()
        self._hit_blocks = np.zeros(len(self.cache.groups), np.int64)
        self._peak = 0
        self._ttft_samples: collections.deque = collections.deque(maxlen=65536)
        self._itl_samples: collections.deque = collections.deque(maxlen=65536)
        #: The last exception a step contained (see "Failures"), None before any.
        self.last_failure: BaseException | None = None

    def _configure_cache(self) -> None:
        """Tenant isolation, events and mesh placement of ``self.cache``
        (a new cache or a rebuilt one)."""
        self.cache.isolate(**self._isolation)
        if self._kv_events:
            self.cache.prefix_cache.enable_events = True
        if self._mesh is not None:  # the cache's device state on the mesh
            self.cache.place_on(self._mesh)

    # The paged cache's structures, for callers that inspect them (tests, tools).
    manager = property(lambda self: self.cache.manager)
    pool = property(lambda self: self.cache.pool)
    prefix_cache = property(lambda self: self.cache.prefix_cache)

    @property
    def capacity(self) -> int:
        """Allocatable device blocks, summed over the cache's groups."""
        return int(self.cache.capacity.sum())

    # -------------------------------------------------------------- requests

    def add_request(self, prompt_tokens: Sequence[int], max_new_tokens: int, *,
                    sampling: SamplingParams = GREEDY, eos_token_id: int | None = None,
                    stop_token_ids: Sequence[int] = (), stop: str | Sequence[str] = (),
                    namespace: Hashable = None, seed: int | None = None, arrival_step: int = 0) -> int:
        """Queue a request; returns its id (its key in :attr:`outputs`).
        Works at any time, also between :meth:`step` calls while other
        requests run: it is admitted at the next iteration that has room.

        ``seed``: the request samples from its own stream ``key(seed)``,
        split exactly as :func:`jaxkv.nn.generate` splits its key for one
        prompt, so ``generate(model, [prompt], seed=seed, sampling=...)``
        gives the same tokens, whatever runs beside it and whether or not it
        is preempted (without a seed the stream is the engine's, folded with
        the request id: reproducible run to run, but not ``generate``'s).

        Stopping: at ``max_new_tokens`` (``"length"``), or ``"stop"`` at
        ``eos_token_id`` or any of ``stop_token_ids`` (the stop token is the
        last token given out; the device checks one of them and stops the
        row inside the decode chunk, the host the others, cutting the chunk
        there), or when the output text contains one of the ``stop`` strings
        (needs the engine's ``tokenizer``; the tokens up to the one that
        completed it are given out, the text up to the stop string).

        ``arrival_step``: the scheduler iteration from which it may be
        admitted (simulated arrivals for :meth:`run`; 0: at once; a step
        already passed counts as now, so it queues behind the requests that
        arrived before it).

        Raises ``InvalidArgument``, naming the argument, and queues nothing
        for: a prompt that is empty or not a 1-D sequence of integer token
        ids in the vocabulary (floats, bools, strings and ``None`` included);
        ``max_new_tokens`` that is not an integer ``>= 1``; an
        ``eos_token_id`` or ``stop_token_ids`` outside the vocabulary;
        ``stop`` that is not a string or a sequence of non-empty strings, or
        is given to an engine without a tokenizer; a negative or non-integer
        ``arrival_step``; a non-integer ``seed``; ``sampling`` that is not a
        ``SamplingParams``; an unhashable ``namespace``; a request that could
        never fit (more than ``max_model_len`` tokens, or more blocks than a
        group has at its peak: ``cache.peak_blocks``, the prompt's blocks or,
        with a window on every layer, a decode step's window; the message
        gives the numbers). A request accepted here is admitted once the
        engine has room, and runs to its end: admission reserves no more
        than this rule counts, and a windowed request is never preempted.

        Requests are queued in arrival order (ties: in the order added), so
        they need not be added in that order."""
        prompt = _host.int_array(prompt_tokens, "prompt_tokens", ndim=1).tolist()
        if not prompt:
            raise InvalidArgument("prompt_tokens is empty: a request needs at least one token")
        self._check_token_ids(prompt, "prompt_tokens")
        max_new_tokens = _host.int_at_least(max_new_tokens, "max_new_tokens", 1)
        eos_id = -1
        if eos_token_id is not None:
            eos_id = _host.int_scalar(eos_token_id, "eos_token_id")
            self._check_token_ids([eos_id], "eos_token_id")
        try:
            stop_ids = [] if stop_token_ids is None else list(stop_token_ids)
        except TypeError:
            raise InvalidArgument(f"stop_token_ids={stop_token_ids!r}: give a sequence of token ids") from None
        stop_ids = _host.int_array(stop_ids, "stop_token_ids", ndim=1).tolist() if stop_ids else []
        self._check_token_ids(stop_ids, "stop_token_ids")
        stop = _stop_strings(stop)
        if stop and self.tokenizer is None:
            raise InvalidArgument(f"stop={list(stop)}: stop strings need the engine's tokenizer "
                                  "(Engine(model, tokenizer=...)); give stop_token_ids instead")
        # A request added after its arrival step arrives now: queued after those already there.
        arrival = max(_host.int_at_least(arrival_step, "arrival_step", 0), self._step)
        if not isinstance(sampling, SamplingParams):
            raise InvalidArgument(f"sampling must be a SamplingParams, got {sampling!r}")
        try:
            hash(namespace)
        except TypeError:
            raise InvalidArgument(f"namespace must be hashable, got {namespace!r}") from None
        total = len(prompt) + max_new_tokens
        blocks = self.cache.peak_blocks(len(prompt), total)
        if total > self.cache.max_context_tokens or np.any(blocks > self.cache.capacity):
            raise InvalidArgument(
                f"add_request: {len(prompt)} + {max_new_tokens} tokens need blocks {blocks.tolist()} of groups "
                f"{list(self.cache.groups)} at their peak and can never fit: {self.cache.limits()}")
        if seed is not None:
            seed = _host.int_scalar(seed, "seed")
        rid = self._next_id
        key = jax.random.fold_in(self.key, rid) if seed is None else jax.random.key(seed)
        device_stop = eos_id if eos_id >= 0 else (stop_ids[0] if stop_ids else -1)
        req = _Request(rid, prompt, max_new_tokens, sampling, device_stop, arrival, namespace,
                       np.asarray(jax.random.key_data(key)),
                       stop_ids=frozenset(stop_ids + ([eos_id] if eos_id >= 0 else [])), stop=stop)
        if self.tokenizer is not None:
            req.detok = self._make_detokenizer(prompt)
        self._next_id += 1
        self._requests[rid] = req
        self._live.add(rid)
        # After every request that arrives no later: admission stops at the
        # first waiting request that has not arrived, so none that has may
        # queue behind it.
        later = (i for i, other in enumerate(self._waiting) if self._requests[other].arrival > arrival)
        self._waiting.insert(next(later, len(self._waiting)), rid)
        self.outputs[rid] = []
        return rid

    def _make_detokenizer(self, prompt: list):
        factory = self._detokenizer
        if factory is None:
            from jaxkv.text import IncrementalDetokenizer as factory  # noqa: N813 - the default factory
        return factory(self.tokenizer, prompt)

    def abort(self, request_id: int) -> None:
        """Stop ``request_id``: at the next iteration (:meth:`step`) it gives
        back everything it holds (sequence row, blocks, host blocks of a
        swapped-out request, its prefix-cache pin; what it computed may stay
        in the prefix cache as cached pages) and its last
        :class:`RequestOutput` says ``"abort"``. Unknown or finished ids,
        and a second abort, do nothing."""
        req = self._requests.get(request_id) if isinstance(request_id, (int, np.integer)) else None
        if req is None or req.state is RequestState.FINISHED or request_id in self._aborts:
            return
        self._aborts.append(int(request_id))

    def has_unfinished(self) -> bool:
        """Whether any request added is not finished (:meth:`step` has work)."""
        return bool(self._live)

    def finish_reason(self, request_id: int) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``, or None while it runs."""
        return self._requests[request_id].finish_reason

    def forget(self, request_id: int) -> list:
        """Drop a finished request's records (a long-running server calls it
        once it has the request's last output); returns its tokens.
        ``InvalidArgument`` for a request that is not finished."""
        req = self._requests.get(request_id)
        if req is None or req.state is not RequestState.FINISHED:
            raise InvalidArgument(f"forget({request_id}): only a finished request can be forgotten "
                                  f"({'unknown' if req is None else req.state.name})")
        del self._requests[request_id]
        return self.outputs.pop(request_id)

    def _check_token_ids(self, ids: list, name: str) -> None:
        """``InvalidArgument`` naming ``name`` for ids outside the vocabulary
        (the embedding lookup would not fail, it would read garbage)."""
        vocab = self.vocab_size
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InvalidArgument(f"{name} holds token ids outside the vocabulary [0, {vocab or '...'}): "
                                  f"{_host.preview(bad)}")

    # ------------------------------------------------------------------- run

    def run(self, on_progress: Callable[[EngineProgress], None] | None = None) -> EngineSummary:
        """Serve every queued request to completion: :meth:`step` until none
        is left; returns the summary (``outputs`` holds the tokens).
        ``on_progress`` is called with an :class:`EngineProgress` after
        every scheduler iteration and once at the end (its counts never
        decrease; the last has ``finished == total``). Nothing is printed:
        see the module docstring for logging.

        Raises ``KVCacheOOM`` when nothing can run (a request cannot get its
        blocks even with every other request preempted and the prefix cache
        evicted), and ``BookkeepingError`` if the engine's records disagree
        with the cache's (a bug)."""
        before = dataclasses.replace(self._count)
        hit_blocks_before = self._hit_blocks.copy()
        self._peak = 0
        start = time.perf_counter()
        pending = [self._requests[rid] for rid in sorted(self._live)]
        total = len(pending)
        generated_before = sum(len(r.generated) for r in pending)
        self._update_peak()
        logger.info("engine run: %d requests, %d KV blocks (groups %s), %d sequence rows", total, self.capacity,
                    list(self.cache.groups), self.max_seqs)

        def report():
            progress = self._progress(pending, total, start, generated_before, before)
            logger.debug("iteration %d: %d/%d finished, running %d, waiting %d, swapped %d, %d tokens, "
                         "%d preemptions", progress.iteration, progress.finished, total, progress.running,
                         progress.waiting, progress.swapped, progress.generated_tokens, progress.preemptions)
            if on_progress is not None:
                on_progress(progress)

        while self._live:
            self.step()
            report()
        report()
        wall = time.perf_counter() - start
        generated = sum(len(r.generated) for r in pending) - generated_before
        count = self._count
        prompt_tokens, hit_tokens = count.prompt_tokens - before.prompt_tokens, count.hit_tokens - before.hit_tokens
        summary = EngineSummary(
            requests=total, generated_tokens=generated, wall_seconds=wall,
            tokens_per_second=generated / wall if wall > 0 else 0.0, prompt_tokens=prompt_tokens,
            prefix_hit_tokens=hit_tokens, prefix_unit_tokens=self.cache.unit, cache_usage=tuple(self.cache.usage()),
            hit_blocks=dict(zip(self.cache.groups, (self._hit_blocks - hit_blocks_before).tolist())),
            prefix_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            peak_kv_blocks=self._peak, kv_blocks=self.capacity, swap_preemptions=count.swaps - before.swaps,
            recompute_preemptions=count.recomputes - before.recomputes,
            iterations=count.iterations - before.iterations,
            ttft=_latency_stats([r.first_token_at - r.arrived_at for r in pending if r.arrived_at is not None
                                 and r.first_token_at is not None and r.first_token_at >= start]),
            itl=_latency_stats([gap for r in pending for gap in r.gaps]))
        logger.info("engine run done: %s", summary)
        return summary

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration (see the module docstring): aborts, then
        resume, admit, prefill, and one decode chunk (ONE jitted call of up
        to ``decode_chunk`` tokens per running request). Returns one
        :class:`RequestOutput` per request that made tokens or finished in
        it, in the order they first did; ``[]`` when there is nothing to do.

        The tokens a request gets over its steps are exactly those
        :meth:`run` gives it (``run`` is a loop over ``step``), whenever it
        was added.

        All or nothing (module docstring, "Failures"): a request whose own
        part fails is finished alone with ``"error"``; any other exception
        is contained (the cache rebuilt empty, the requests in flight
        re-queued with their tokens; logged, counted, kept in
        :attr:`last_failure`) and the outputs made before it are returned.
        Raises only ``KVCacheOOM`` when nothing can run (:meth:`run`), and
        whatever rebuilding the cache raises (then the engine is unusable)."""
        self._out = {}
        try:
            self._process_aborts()
            if self._live:
                self._iterate()
        except KVCacheOOM:  # the fit rule failed, not the step: nothing moved
            raise
        except Exception as err:  # noqa: BLE001 - contained: see "Failures"
            self._recover(err)
        out = []
        for rid, (tokens, text, finished) in self._out.items():
            req = self._requests[rid]
            out.append(RequestOutput(rid, tuple(tokens), finished, req.finish_reason if finished else None, text,
                                     req.cached_tokens, req.error if finished else None))
        self._out = {}
        return out

    def _recover(self, err: Exception) -> None:
        """Contain ``err``, raised inside a step (module docstring,
        "Failures"): whatever it left half done, in the cache or in these
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
        # Every live request not finished is queued once: the re-queued ones
        # first, then any an admission had taken out of the queue, then the
        # queue as it was.
        queued = set(self._waiting)
        taken = [rid for rid in sorted(self._live) if rid not in queued and rid not in requeue]
        self._waiting = collections.deque(
            requeue + taken + [rid for rid in self._waiting if rid in self._live and rid not in requeue])
        self._rows = [None] * self.max_seqs
        self._prefilling, self._swapped = [], []
        self.cache = self.cache.rebuilt()
        self._configure_cache()

    def _error(self, req: _Request, message: str) -> None:
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
        """Each request's sampling row as the device takes it (``{id: row}``);
        a request whose parameters cannot be put there is finished with
        ``"error"`` (:meth:`_error`) and left out."""
        rows = {}
        for req in list(reqs):
            try:
                rows[req.id] = self._sampling_row(req)
            except Exception as err:  # noqa: BLE001 - this request's own failure
                self._error(req, f"its sampling parameters cannot be used: {type(err).__name__}: {err}")
        return rows

    @staticmethod
    def _sampling_row(req: _Request) -> tuple:
        """``req``'s temperature, top-k and top-p as the device's dtypes
        (raises for a value they cannot hold)."""
        params = req.sampling
        with np.errstate(over="raise"):  # a float32 overflow is an error here, not an inf
            return np.float32(params.temperature), np.int32(params.top_k), np.float32(params.top_p)

    def _iterate(self) -> None:
        calls = self._count.model_calls
        try:
            self._iterate_once()
        finally:
            self._count.model_iterations += self._count.model_calls > calls

    def _iterate_once(self) -> None:
        self._count.iterations += 1
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
            if progressed or not self._live:
                return  # e.g. requests that finished at their first token
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
        while self._aborts:
            rid = self._aborts[0]
            req = self._requests.get(rid)
            if req is None or req.state is RequestState.FINISHED:
                self._aborts.pop(0)
                continue
            if req.state is RequestState.WAITING:
                self._waiting.remove(rid)
            elif req.state is RequestState.SWAPPED:
                self._swapped.remove(rid)
                self.cache.free_swapped(req.row)
                self._rows[req.row] = None
                req.row = -1
            else:  # RUNNING: prefilling or decoding
                if req in self._prefilling:
                    self._prefilling.remove(req)
                self._retire([req], final=False, requeue=False)
            logger.debug("request %d aborted", rid)
            self._count.aborted += 1
            self._finish(req, "abort")
            self._aborts.pop(0)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix of every namespace (vLLM's
        ``reset_prefix_cache``): device pages, snapshot records, host-tier
        copies; with ``scrub_on_free`` their bytes are zeroed. Returns
        False, changing nothing, while a request holds a cached prefix
        (run it to the end, or abort it, first)."""
        return self.cache.reset_prefix()

    def take_kv_events(self) -> list:
        """The prefix cache's events since the last call, oldest first
        (``enable_kv_events``): :class:`~jaxkv.prefix.BlockStored` /
        :class:`~jaxkv.prefix.BlockRemoved` / ``AllBlocksCleared`` of its
        pages (device or host medium) and, for a hybrid cache, its snapshot
        records' ``(kind, id, tokens, namespace)``. Every event names the
        namespace it belongs to: route a tenant only its own."""
        return self.cache.prefix_cache.take_events() + self.cache.take_events()

    def cached_tokens(self, request_id: int) -> int:
        """Prompt tokens the request's latest admission served from the
        prefix cache (0 before it is admitted)."""
        return self._requests[request_id].cached_tokens

    def stats(self) -> EngineStats:
        """A snapshot for a metrics endpoint (see :class:`EngineStats`); the
        TTFT and ITL samples are those recorded since the previous call."""
        running = sum(1 for rid in self._rows if rid is not None and self._requests[rid].state is RequestState.RUNNING)
        used = self.cache.capacity - self.cache.free_blocks()
        names = self.cache.groups
        plan = {g.name: g for g in self.cache_plan.groups}
        ttft, itl = tuple(self._ttft_samples), tuple(self._itl_samples)
        self._ttft_samples.clear()
        self._itl_samples.clear()
        count = self._count
        return EngineStats(
            running=running, waiting=len(self._waiting), swapped=len(self._swapped),
            blocks_used={n: int(u) for n, u in zip(names, used)},
            blocks_total={n: int(c) for n, c in zip(names, self.cache.capacity)},
            tokens_used={n: int(u) * plan[n].tokens_per_block for n, u in zip(names, used)},
            tokens_total={n: plan[n].tokens for n in names},
            bytes_used={n: int(u) * plan[n].bytes_per_block for n, u in zip(names, used)},
            bytes_total={n: plan[n].blocks * plan[n].bytes_per_block for n in names},
            prompt_tokens=count.prompt_tokens, prefix_hit_tokens=count.hit_tokens, swap_preemptions=count.swaps,
            recompute_preemptions=count.recomputes, preemptions=count.swaps + count.recomputes,
            generated_tokens=count.generated, finished_requests=count.finished, aborted_requests=count.aborted,
            iterations=count.iterations, ttft=ttft, itl=itl, model_calls=count.model_calls,
            model_iterations=count.model_iterations,
            token_slots=count.slots_computed, padding_slots=count.slots_computed - count.slots_real,
            cache_usage=tuple(self.cache.usage()), step_failures=count.step_failures,
            failed_requests=count.failed_requests)

    def _progress(self, pending, total, start, generated_before, before: _Counters) -> EngineProgress:
        states = collections.Counter(r.state for r in pending)
        return EngineProgress(
            finished=states[RequestState.FINISHED], total=total, running=states[RequestState.RUNNING],
            waiting=states[RequestState.WAITING], swapped=states[RequestState.SWAPPED],
            generated_tokens=sum(len(r.generated) for r in pending) - generated_before,
            elapsed_seconds=time.perf_counter() - start,
            preemptions=self._count.swaps + self._count.recomputes - before.swaps - before.recomputes,
            iteration=self._count.iterations - before.iterations)

    # ------------------------------------------------------------- helpers

    def _mark_arrivals(self) -> None:
        """Stamp the wall time at which waiting requests are first seen
        arrived (the start of their time to first token)."""
        now = time.perf_counter()
        for rid in self._waiting:
            req = self._requests[rid]
            if req.arrival > self._step:
                break  # queued in arrival order
            if req.arrived_at is None:
                req.arrived_at = now

    def _record_tokens(self, req: _Request, count: int, now: float) -> None:
        """Latency bookkeeping for ``count`` tokens ``req`` got by ``now``."""
        if count <= 0:
            return
        self._count.generated += count
        if req.first_token_at is None:
            req.first_token_at = req.last_token_at = now
            if req.arrived_at is not None:
                self._ttft_samples.append(now - req.arrived_at)
            count -= 1
        if count:
            gaps = [(now - req.last_token_at) / count] * count
            req.gaps += gaps
            self._itl_samples.extend(gaps)
            req.last_token_at = now

    def _take(self, req: _Request, tokens: list, now: float, device_done: bool = False) -> bool:
        """Give ``req`` the ``tokens`` a call made for it, in order, up to
        the first stop: a stop token id (EOS included), a stop string in
        its text, or ``max_new_tokens`` (the tokens after it are dropped:
        the device may decode a few past a stop it does not check). Records
        them for this step's :class:`RequestOutput`, with the text they
        complete; returns whether the request is finished (its
        ``finish_reason`` set). ``device_done``: the device stopped the row
        (EOS or length), which the same checks find."""
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
                    self._count.failed_requests += 1
                    logger.warning("request %d failed: %s", req.id, req.error)
                    break
                if req.stop:
                    cut = _find_stop(req.text, req.stop, max(before - longest + 1, 0))
                    if cut is not None:
                        reason = "stop"
                        break
            if len(req.generated) + len(taken) >= req.max_new:
                reason = "length"
                break
        if reason is None and device_done:  # the checks above find what the device found; this only guards it
            reason = "length" if len(req.generated) + len(taken) >= req.max_new else "stop"
        req.generated += taken
        self._record_tokens(req, len(taken), now)
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
            entry = self._out.setdefault(req.id, [[], "", False])
            entry[0] += taken
            entry[1] += text
        if reason is not None:
            req.finish_reason = reason
        return reason is not None

    def _finish(self, req: _Request, reason: str) -> None:
        """Mark ``req`` finished (no row held any more)."""
        req.state = RequestState.FINISHED
        req.finish_reason = req.finish_reason or reason
        self.outputs[req.id] = list(req.generated)
        self._live.discard(req.id)
        self._count.finished += 1
        entry = self._out.setdefault(req.id, [[], "", False])
        entry[2] = True

    def _update_peak(self, used=None):
        used = self.cache.blocks_in_use() if used is None else int(used)
        self._peak = max(self._peak, used)

    def _steps_ahead(self, req: _Request) -> int:
        """Decode steps whose blocks ``req`` reserves: its next chunk's,
        never more than it has tokens left to generate (one more than its
        remaining decode steps: the fit rule's count, see
        :func:`jaxkv.nn.steps.paged_peak_blocks`). With a window on every
        layer, all it has left: a windowed request then never has to be
        preempted, which matters because a recomputation would prefill its
        prompt and output whole, more blocks than its window needs and
        possibly more than the pool has."""
        left = max(req.max_new - len(req.generated), 0)
        return left if self.cache.window is not None else min(self.decode_chunk, left)

    def _growth(self, req: _Request) -> np.ndarray:
        """Free blocks ``req`` (RUNNING) may take over :meth:`_steps_ahead`."""
        steps = self._steps_ahead(req)
        if req.pieces or not req.generated:  # still prefilling: it holds its whole prompt's blocks, untrimmed
            tokens = len(req.tokens)
            return self.cache.growth(tokens, steps, self.cache.blocks_for(tokens), req.shared)
        # Decoding: the fewest blocks it can hold at kv_len (a row not trimmed
        # yet holds more, so this over-reserves by at most the trim).
        return self.cache.growth(req.kv_len, steps, self.cache.held_blocks(req.kv_len), req.shared)

    def _admission_blocks(self, req: _Request, hit) -> np.ndarray:
        """Free blocks admitting ``req`` with ``hit`` takes now (its tokens'
        blocks less the hit's) plus its growth over :meth:`_steps_ahead`.
        On an empty engine with no hit this is at most ``peak_blocks``, the
        rule ``add_request`` checked."""
        tokens = len(req.tokens)
        held, shared = self.cache.blocks_for(tokens), hit.block_counts()
        return held - shared + hit.extra_blocks() + self.cache.growth(tokens, self._steps_ahead(req), held, shared)

    def _growth_reserve(self) -> np.ndarray:
        """Blocks kept free for the running sequences to grow into during
        their next decode chunk (a windowed model's: until they finish) when
        admitting or resuming, so that a request is not brought in only to
        force an immediate preemption (swap in / swap out thrash)."""
        # The row map, not every request ever added: O(max_seqs) per call.
        reserve = np.zeros(len(self.cache.groups), np.int64)
        for rid in self._rows:
            if rid is not None and self._requests[rid].state is RequestState.RUNNING:
                reserve += self._growth(self._requests[rid])
        return reserve

    def _blocks_wanted(self) -> np.ndarray:
        for rid in self._swapped:
            return self.cache.blocks_for(len(self._requests[rid].tokens))
        for rid in self._waiting:
            return self._admission_blocks(self._requests[rid], self._no_hit())
        return np.zeros(len(self.cache.groups), np.int64)

    def _no_hit(self) -> PrefixHit:
        return PrefixHit(0, tuple([] for _ in self.cache.groups))

    def _make_room(self, blocks: np.ndarray) -> bool:
        """Evict cached prefixes until ``blocks`` (per group) are free;
        whether they are. Evicts again while short: a page a running row
        still holds (a windowed row's hit) gives no block back."""
        free = self.cache.free_blocks()
        while np.any(free < blocks) and self.cache.can_evict():
            self.cache.evict(np.maximum(blocks - free, 0))
            free = self.cache.free_blocks()
        return bool(np.all(free >= blocks))

    def _sampling(self, rows: dict, reqs_by_lane: dict) -> RowSampling:
        """Per-lane sampling arrays from the :meth:`_screen`-ed ``rows`` of
        the requests ``reqs_by_lane`` (idle lanes: greedy)."""
        temperature = np.zeros((self.max_seqs,), np.float32)
        top_k = np.zeros((self.max_seqs,), np.int32)
        top_p = np.ones((self.max_seqs,), np.float32)
        for lane, req in reqs_by_lane.items():
            temperature[lane], top_k[lane], top_p[lane] = rows[req.id]
        return RowSampling(temperature, top_k, top_p)

    def check_bookkeeping(self) -> None:
        """Raise ``BookkeepingError`` (with the numbers) when the engine's
        records disagree with each other or with the cache: a RUNNING
        request must own its row in the row map and the row must be
        ON_DEVICE; a SWAPPED one likewise with the row SWAPPED; the row map
        names no request that is neither. Called before every decode."""
        status = self.cache.row_status()
        # Every request holding a row is in the row map or the swapped list
        # (the second loop checks the map's side), so this stays O(max_seqs)
        # however many requests the engine has served.
        holders = {rid for rid in self._rows if rid is not None} | set(self._swapped)
        for req in (self._requests[rid] for rid in sorted(holders)):
            if req.state not in (RequestState.RUNNING, RequestState.SWAPPED):
                raise BookkeepingError(f"request {req.id} holds row {req.row} but is {req.state.name}")
            want = ON_DEVICE if req.state is RequestState.RUNNING else SWAPPED
            if not 0 <= req.row < self.max_seqs:
                raise BookkeepingError(f"request {req.id} is {req.state.name} on row {req.row}, outside "
                                       f"[0, {self.max_seqs})")
            if self._rows[req.row] != req.id:
                raise BookkeepingError(f"request {req.id} is {req.state.name} on row {req.row}, but the row map "
                                       f"gives that row to request {self._rows[req.row]}")
            if status[req.row] != want:
                raise BookkeepingError(f"request {req.id} is {req.state.name} on row {req.row}, but the cache "
                                       f"has that row {STATUS_NAMES[int(status[req.row])]}")
        for row, rid in enumerate(self._rows):
            if rid is None and status[row] != FREE:
                raise BookkeepingError(f"row {row} is {STATUS_NAMES[int(status[row])]} in the cache "
                                       "but no request holds it in the row map")
            if rid is not None and self._requests[rid].row != row:
                raise BookkeepingError(f"row {row} is mapped to request {rid}, which is "
                                       f"{self._requests[rid].state.name} on row {self._requests[rid].row}")

    # ---------------------------------------------------------- scheduling

    def _resume_swapped(self) -> int:
        """Swap requests back in, oldest first, while they fit; how many."""
        resumed = 0
        while self._swapped:
            req = self._requests[self._swapped[0]]
            # Room for its blocks plus its growth over the next decode chunk (a
            # request swapped out at a block boundary needs a new block at
            # once: without this it would be swapped straight back out,
            # forever), and the running requests' reserve.
            if not self._make_room(self.cache.held_blocks(req.kv_len) + self._growth(req) + self._growth_reserve()):
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
        free_rows = [row for row in range(self.max_seqs) if self._rows[row] is None]
        admitted = []  # PrefillLane per admitted request, in lane order
        reserved = np.zeros(len(self.cache.groups), np.int64)  # blocks the batch will take, growth included
        running = self._growth_reserve()  # the requests admitted before this batch
        deferred = []  # waiting requests that wait for a prefix being prefilled, in order
        while self._waiting and free_rows:
            req = self._requests[self._waiting[0]]
            if req.arrival > self._step:
                break
            tokens = req.tokens
            hit = self.cache.match(tokens, req.namespace)
            if self._wait_for_prefix(req, hit, admitted):
                self.cache.unpin(hit)
                deferred.append(self._waiting.popleft())
                continue
            want = self._admission_blocks(req, hit)
            if not self._make_room(reserved + want + running):
                self.cache.unpin(hit)
                if not hit.tokens or self.cache.window is None:
                    break
                # A windowed request reserves its whole window from the free
                # blocks while its hit's blocks stay the prefix cache's
                # (pinned): without the hit they may be evicted, and the
                # request needs no more than the fit rule counted. (Without a
                # window a hit only lowers what a request needs: waiting for
                # room keeps the hit.)
                hit = self._no_hit()
                want = self._admission_blocks(req, hit)
                if not self._make_room(reserved + want + running):
                    break
            reserved += want
            self._waiting.popleft()
            req.row = free_rows.pop(0)
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

    def _wait_for_prefix(self, req: _Request, hit, admitted: list) -> bool:
        """Whether ``req`` should wait (stay in the queue, others may pass)
        for a request being prefilled that shares a longer prefix with it
        than the cache holds now: at least :data:`WAIT_FOR_PREFIX_TOKENS`
        more tokens (in the cache's hit grain) that the other request has
        not prefilled yet. The cache is asked to keep that prefix when the
        other request reaches it (:meth:`add_cut`, which may cut its
        pieces there), so ``req`` hits it one step later instead of
        computing it a second time beside it (SGLang's in-batch prefix
        caching)."""
        limit = len(req.tokens) - 1
        grain = self.cache.hit_grain
        others = [(self._requests[self._rows[lane.row]], lane.hit.tokens) for lane in admitted]
        others += [(other, other.pieces[0][0]) for other in self._prefilling if other.pieces]
        for other, done in others:
            if other.namespace != req.namespace:
                continue
            shared = _common_prefix(req.tokens[:limit], other.tokens)
            shared -= shared % grain
            if shared - hit.tokens < WAIT_FOR_PREFIX_TOKENS or done >= shared:
                continue
            if self.cache.add_cut(other.row, shared) and other.pieces:
                other.pieces = _cut_pieces(other.pieces, shared)
            logger.debug("request %d waits for request %d to prefill %d shared tokens", req.id, other.id, shared)
            return True
        return False

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
                    1 for rid in self._rows if rid is not None and self._decoding(self._requests[rid]))
            batch, total = [], 0
            for req in self._prefilling:
                start, end = req.pieces[0]
                if budget is not None and batch and total + end - start > budget:
                    break
                batch.append(req)
                total += end - start
            first, keys, peak = self.cache.prefill_step(self.graphdef, self.params,
                                                        [(req.lane, req.pieces[0]) for req in batch],
                                                        self._sampling(rows, dict(enumerate(batch))))
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
                if self._take(req, [int(first[lane])], now):
                    finished.append(req)
            self._retire(finished, final=True)
            calls += 1
            if budget is not None:
                break
        return calls

    def _count_call(self, slots: int, real: int) -> None:
        self._count.model_calls += 1
        self._count.slots_computed += slots
        self._count.slots_real += real

    def _stream_length(self, tokens: int) -> int:
        """The packed stream's bucket for ``tokens`` real tokens: the
        smallest of :meth:`stream_lengths` that holds them (a length past the
        budget only when more requests decode than it holds)."""
        for length in self.stream_lengths():
            if tokens <= length:
                return length
        return _buckets(tokens)[-1]

    def stream_lengths(self) -> list[int]:
        """The packed stream's lengths a step can compile (one program per
        length): 16, 32, 48, 64, 96, 128, 192, ... (powers of two, and 1.5
        times them from 32 on) below the token budget, then the budget itself. ``[]`` for the padded scheduler."""
        if self.scheduler != "packed":
            return []
        budget = self._token_budget()
        return [n for n in _buckets(budget) if n < budget] + [budget]

    def _token_budget(self) -> int:
        """The packed scheduler's tokens per step."""
        return self.max_num_batched_tokens or self.prefill_chunk

    def _packed(self) -> None:
        """ONE packed step: the decode token of every decoding request, then
        (first in the stream) one prefill piece per prefilling request,
        oldest admission first, while the budget lasts (a piece longer than
        what is left is cut; at least one prompt token runs). A request
        whose last piece ran gets its first token, a decoding one its next."""
        self.check_bookkeeping()
        decoding = [(row, self._requests[rid]) for row, rid in enumerate(self._rows)
                    if rid is not None and self._decoding(self._requests[rid])]
        rows = self._screen([req for _, req in decoding] + self._prefilling)
        decoding = [(row, req) for row, req in decoding if req.id in rows]
        if not self._prefilling:  # every prompt left failed its screening: the next iteration decodes
            return
        left = max(self._token_budget() - len(decoding), 1)
        batch = []  # (request, (start, end)): a plan; its pieces are consumed once the call returned
        for req in self._prefilling:
            if left <= 0:
                break
            start, end = req.pieces[0]
            end = min(end, start + left)  # a piece longer than what is left is cut
            batch.append((req, (start, end)))
            left -= end - start
        lanes = [req for req, _ in batch] + [req for _, req in decoding]
        total = sum(end - start for _, (start, end) in batch) + len(decoding)
        length = self._stream_length(total)
        result = self.cache.packed_step(
            self.graphdef, self.params, [(req.lane, piece) for req, piece in batch],
            [(row, req.generated[-1], req.kv_len) for row, req in decoding],
            self._sampling(rows, dict(enumerate(lanes))), [req.key for req in lanes], length)
        for req, (_, end) in batch:  # the pieces ran
            if end < req.pieces[0][1]:
                req.pieces[0] = (end, req.pieces[0][1])  # the rest stays at the head
            else:
                req.pieces.pop(0)
        now = time.perf_counter()
        self._update_peak(result.peak)
        self._count_call(length, total if result.decode_ok else total - len(decoding))
        finished = []
        for lane, (req, _) in enumerate(batch):
            if req.pieces:
                continue
            self._prefilling.remove(req)
            req.key = result.keys[lane]
            if self._take(req, [int(result.tokens[lane])], now):
                finished.append(req)
        if result.decode_ok:
            for lane, (_, req) in enumerate(decoding, start=len(batch)):
                req.key = result.keys[lane]
                if self._take(req, [int(result.tokens[lane])], now):
                    finished.append(req)
        self._retire(finished, final=True)
        self._release_trimmed_hits(req for _, req in decoding if req.state is RequestState.RUNNING)
        if not result.decode_ok:
            logger.debug("packed step: decode lanes stalled for blocks")
            self._relieve([req for lane, (_, req) in enumerate(decoding, start=len(batch))
                           if result.blocked[lane] and req.state is RequestState.RUNNING])

    @staticmethod
    def _decoding(req: _Request) -> bool:
        """RUNNING with its whole prompt prefilled."""
        return req.state is RequestState.RUNNING and not req.pieces

    def _decode(self) -> None:
        running = {row: self._requests[rid] for row, rid in enumerate(self._rows)
                   if rid is not None and self._decoding(self._requests[rid])}
        if not running:
            return
        self.check_bookkeeping()
        rows = self._screen(running.values())
        running = {row: req for row, req in running.items() if req.id in rows}
        if not running:
            return
        batch = self.max_seqs
        last = np.zeros((batch,), np.int32)
        active = np.zeros((batch,), bool)
        num_generated = np.zeros((batch,), np.int32)
        max_new = np.zeros((batch,), np.int32)
        eos = np.full((batch,), -1, np.int32)
        keys = [None] * batch
        for row, req in running.items():
            last[row] = req.generated[-1]
            active[row] = True
            num_generated[row] = len(req.generated)
            max_new[row] = req.max_new
            eos[row] = req.eos_id
            keys[row] = req.key
        result = self.cache.decode(self.graphdef, self.params, last, active, num_generated, max_new, eos,
                                   self._sampling(rows, running), keys, self.decode_chunk)
        now = time.perf_counter()
        self._update_peak(result.peak)
        self._count_call(self.max_seqs * int(result.count.max(initial=0)), int(result.count.sum()))
        finished = []
        for row, req in running.items():
            req.key = result.keys[row]
            if self._take(req, result.tokens[row, : result.count[row]].tolist(), now, bool(result.finished[row])):
                finished.append(req)
        self._retire(finished, final=True)
        self._release_trimmed_hits(req for req in running.values() if req.state is RequestState.RUNNING)
        if not result.ok:
            logger.debug("decode stalled for blocks: rows %s", np.flatnonzero(result.blocked).tolist())
            self._relieve([req for row, req in running.items()
                           if result.blocked[row] and req.state is RequestState.RUNNING])

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
        self._make_room(self._growth_reserve())

        def need():  # the next token of each blocked row
            return sum((self.cache.blocks_for(r.kv_len + 1) - self.cache.blocks_for(r.kv_len) for r in blocked),
                       np.zeros(len(self.cache.groups), np.int64))

        while blocked and not self._make_room(need()):
            running = [self._requests[rid] for rid in self._rows  # never one mid-prefill
                       if rid is not None and self._decoding(self._requests[rid])]
            victims = [req for req in running if self._readmittable(req)]
            if not victims:
                stuck = blocked[0]
                raise self.cache.oom(need(), f"request {stuck.id} cannot grow and no running request can be "
                                             f"preempted (recomputing any would need more blocks than the groups "
                                             f"have: {self.cache.capacity.tolist()})")
            victim = max(victims, key=lambda r: r.order)
            self._preempt(victim)
            blocked = [req for req in blocked if req is not victim]

    def _readmittable(self, req: _Request) -> bool:
        """Whether ``req``, preempted for recomputation now, fits an empty
        engine again (its prompt and output prefilled whole). Always, without
        a window; a windowed request is never preempted (its reserve covers
        its whole output), so this only guards that rule. (Swapping would
        not need it, but a swap-out the host pool cannot take falls back to
        recomputation.)"""
        return bool(np.all(self._admission_blocks(req, self._no_hit()) <= self.cache.capacity))

    def _preempt(self, req: _Request) -> None:
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
