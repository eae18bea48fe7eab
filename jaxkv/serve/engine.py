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

The parts (vLLM v1's split, at jaxkv's size): :mod:`jaxkv.serve.request`
(intake: what ``add_request`` checks; the request's record),
:mod:`jaxkv.serve.scheduler` (:class:`~jaxkv.serve.scheduler.Scheduler`:
admission, prefill and decode iterations, preemption, retirement, and how
a failed step is contained: its module docstring walks one iteration),
:mod:`jaxkv.serve.output` (detokenization, stop strings,
:class:`RequestOutput`, statistics). :class:`Engine` is the scheduler with
the public calls on top.

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
import dataclasses
import logging
import numbers
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv import _host
from jaxkv.errors import InvalidArgument
from jaxkv.nn import sharding
from jaxkv.nn.sampling import GREEDY, SamplingParams
from jaxkv.serve.build import build_cache
from jaxkv.serve.output import (Counters, EngineProgress, EngineStats, EngineSummary, OutputProcessor,
                                latency_stats)
from jaxkv.serve.request import RequestOutput, RequestState, new_request
from jaxkv.serve.scheduler import MAX_REQUEST_FAULTS, WAIT_FOR_PREFIX_TOKENS, Scheduler
from jaxkv.serve.sizing import CachePlan

__all__ = ["MAX_REQUEST_FAULTS", "WAIT_FOR_PREFIX_TOKENS", "Engine", "EngineProgress", "EngineStats",
           "EngineSummary", "RequestOutput", "RequestState"]

logger = logging.getLogger("jaxkv.serve")


def _flag(value, name: str) -> bool:
    """A yes/no option: a bool (numpy's too), else ``InvalidArgument`` (a
    string such as ``"no"`` would be true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{name}={_host.short_repr(value)}: give True or False")
    return bool(value)


class Engine(Scheduler):
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
        if scheduler not in ("packed", "padded"):
            raise InvalidArgument(f"scheduler={scheduler!r}: choose 'packed' or 'padded'")
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
        graphdef, params = nnx.split(model)
        super().__init__(self.cache, graphdef, params, OutputProcessor(Counters(), tokenizer, detokenizer),
                         max_seqs=max_seqs, decode_chunk=decode_chunk, prefill_chunk=prefill_chunk,
                         max_num_batched_tokens=max_num_batched_tokens, scheduler=scheduler)
        self.key = jax.random.key(seed)
        self.outputs: dict[int, list] = {}
        self._next_id = 0

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
        rid = self._next_id
        req = new_request(rid, prompt_tokens, max_new_tokens, sampling=sampling, eos_token_id=eos_token_id,
                          stop_token_ids=stop_token_ids, stop=stop, namespace=namespace, seed=seed,
                          arrival_step=arrival_step, now_step=self._step, vocab=self.vocab_size,
                          has_tokenizer=self.tokenizer is not None, cache=self.cache, engine_key=self.key)
        arrival = req.arrival
        if self.tokenizer is not None:
            req.detok = self.output.detokenizer_for(req.prompt)
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
            ttft=latency_stats([r.first_token_at - r.arrived_at for r in pending if r.arrived_at is not None
                                 and r.first_token_at is not None and r.first_token_at >= start]),
            itl=latency_stats([gap for r in pending for gap in r.gaps]))
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
        self.output.pending = {}
        self._run_iteration()
        return self.output.collect(self._requests)

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
        ttft, itl = tuple(self.output.ttft_samples), tuple(self.output.itl_samples)
        self.output.ttft_samples.clear()
        self.output.itl_samples.clear()
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

    def _progress(self, pending, total, start, generated_before, before: Counters) -> EngineProgress:
        states = collections.Counter(r.state for r in pending)
        return EngineProgress(
            finished=states[RequestState.FINISHED], total=total, running=states[RequestState.RUNNING],
            waiting=states[RequestState.WAITING], swapped=states[RequestState.SWAPPED],
            generated_tokens=sum(len(r.generated) for r in pending) - generated_before,
            elapsed_seconds=time.perf_counter() - start,
            preemptions=self._count.swaps + self._count.recomputes - before.swaps - before.recomputes,
            iteration=self._count.iterations - before.iterations)
