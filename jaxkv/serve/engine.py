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
``"abort"``, ``"error"``: see :mod:`jaxkv.serve.faults`);
:meth:`Engine.abort` frees what a request holds at the next
iteration; :meth:`Engine.stats` is a snapshot for a metrics endpoint.
:meth:`Engine.run` is a loop over ``step`` (with a summary), so a request
streamed through ``step`` gets exactly the tokens ``run`` gives it.

The parts (vLLM v1's split, at jaxkv's size): :mod:`jaxkv.serve.options`
(every option, defined and checked once: ``Engine(model, options)`` or
keywords), :mod:`jaxkv.serve.request`
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
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv import _host
from jaxkv._ops import pow2_at_least
from jaxkv.errors import InvalidArgument
from jaxkv.nn import sharding
from jaxkv.nn.packed import cache_kind
from jaxkv.nn.sampling import GREEDY, SamplingParams
from jaxkv.nn.speculative import draft_model_for, early_exit_draft
from jaxkv.serve.build import (build_cache, derive_scheduler_defaults, paged_token_bytes, program_reserve,
                               resolve_options)
from jaxkv.serve.caches import hashed_graphdef
from jaxkv.serve.drafts import build_draft
from jaxkv.serve.options import Derived, EngineOptions, is_derived
from jaxkv.serve.output import (Counters, EngineProgress, EngineStats, EngineSummary, OutputProcessor,
                                latency_stats)
from jaxkv.serve.request import RequestOutput, RequestState, new_request
from jaxkv.serve.scheduler import MAX_REQUEST_FAULTS, WAIT_FOR_PREFIX_TOKENS, Scheduler
from jaxkv.serve.sizing import CachePlan

__all__ = ["MAX_REQUEST_FAULTS", "WAIT_FOR_PREFIX_TOKENS", "Engine", "EngineProgress", "EngineStats",
           "EngineSummary", "RequestOutput", "RequestState"]

logger = logging.getLogger("jaxkv.serve")


def _with_token_budget(options: EngineOptions, tokens: int | None, derived: set, cache) -> EngineOptions:
    """``options`` with the token budget the sizing lowered to ``tokens``
    (:func:`jaxkv.serve.build.room_for_programs`: a derived budget whose
    packed step's temporaries left the cache too little), and a derived
    ``prefill_chunk`` that followed it (the packed scheduler's default) with
    it; ``options`` as they are otherwise."""
    sched = options.scheduler
    current = sched.max_num_batched_tokens or sched.prefill_chunk
    if tokens is None or tokens >= current:
        return options
    changes = {"max_num_batched_tokens": tokens}
    if "prefill_chunk" in derived and sched.prefill_chunk > tokens:
        changes["prefill_chunk"] = tokens
        if cache is not None:  # (None: to be built again for fewer rows, with this prefill_chunk)
            cache.prefill_width = min(cache.prefill_width, pow2_at_least(tokens))
    logger.info("scheduler: %s (the derived token budget %d lowered: its packed step's temporaries left the KV "
                "cache too little)", ", ".join(f"{k}={v}" for k, v in changes.items()), current)
    return options.replace(**changes)


def _rows_for_room(model, options: EngineOptions, reserve, derived: set, mesh, free_bytes: int | None) -> int | None:
    """Fewer sequence rows when the derived ``max_seqs`` was derived from a
    budget the programs' temporaries then cut (``reserve.limited_to``,
    :func:`jaxkv.serve.build.room_for_programs`): the rows the same rule
    derives from the budget they left; None when it derives no fewer (or
    ``max_seqs`` was given). Each row costs its per-request state whatever
    the budget (large for DeepSeek-V4 and Qwen3-Next), so rows derived for
    the larger budget would leave the blocks little."""
    room = getattr(reserve, "limited_to", None)
    if room is None or "max_seqs" not in derived:
        return None
    again = options.replace(kv_cache_memory=int(room), max_seqs=Derived(options.scheduler.max_seqs))
    rows = derive_scheduler_defaults(model, again, mesh=mesh, free_bytes=free_bytes).values()["max_seqs"]
    if rows >= options.scheduler.max_seqs:
        return None
    logger.info("scheduler: max_seqs=%d (the derived %d rows: the %d bytes the programs leave the cache hold fewer)",
                rows, options.scheduler.max_seqs, room)
    return rows


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
        options: an :class:`~jaxkv.serve.options.EngineOptions` (cache,
            scheduler and tenant options, each defined and documented once
            in :mod:`jaxkv.serve.options`); default: every default.
        **kwargs: any option by its name (``max_seqs=16``,
            ``kv_cache_memory=0.9``, ``scrub_on_free=True``, ...), applied
            over ``options`` (:meth:`EngineOptions.replace
            <jaxkv.serve.options.EngineOptions.replace>`); an unknown name is a
            ``TypeError``.
        tokenizer: a :class:`jaxkv.text.Tokenizer` (or anything with its
            ``decode``): requests' text is detokenized incrementally
            (``RequestOutput.new_text``) and ``stop`` strings work.
        detokenizer: ``detokenizer(tokenizer, prompt_ids)`` makes a request's
            incremental detokenizer (``add(ids) -> new text``, optionally
            ``finish() -> held-back text``); default
            :class:`jaxkv.text.IncrementalDetokenizer`.
        mesh: a ``jax.sharding.Mesh`` (axes ``tp``, ``data``, ``expert``;
            :mod:`jaxkv.nn.sharding`): the model is placed with
            ``shard_model`` unless it is on the mesh already, the cache's
            heads split over ``tp``, its bookkeeping replicated, and every
            jitted step runs across the mesh. Under ``jax.distributed`` every
            process builds the same engine and makes the same calls (the
            scheduler is deterministic given its inputs) and each gets every
            request's tokens (``docs/scale.md``). The cache and the derived
            scheduler defaults are sized by one device's share (its budget,
            what it holds of a split cache); the host tiers are refused on
            a mesh.
        free_bytes: the free device bytes the sizing rule reads (default:
            :func:`~jaxkv.serve.sizing.device_free_bytes`; for tests).

    Raises ``InvalidArgument``, naming the option, for a value its rule
    refuses (:mod:`jaxkv.serve.options`: not an integer, too small, a string
    for a bool or a number, an unknown choice), a ``kv_cache_memory`` that
    holds less than the cache's fixed bytes and a block per group, a
    ``num_blocks`` that names a group the model lacks, a ``kv_dtype`` a pool
    cannot store, contradictory sizing options (above), or an option of the
    other kind of cache.
    """

    def __init__(self, model, options: EngineOptions | None = None, *, tokenizer=None, detokenizer=None,
                 mesh=None, free_bytes: int | None = None, **kwargs):
        options = EngineOptions() if options is None else options
        if not isinstance(options, EngineOptions):
            raise InvalidArgument(f"options must be an EngineOptions, got {_host.short_repr(options)}")
        options = options.replace(**kwargs) if kwargs else options
        if mesh is not None:  # the model, unless placed already: free memory is read after its weights are placed
            sharding.prepare(model, mesh)
        derived = {name for name in ("max_seqs", "max_num_batched_tokens", "prefill_chunk")
                   if is_derived(getattr(options.scheduler, name))}
        #: The options the engine runs with (checked, :mod:`jaxkv.serve.options`; the scheduler options
        #: left out derived for the device and logged, :func:`~jaxkv.serve.build.resolve_options`).
        self.options = options = resolve_options(model, options, mesh=mesh, free_bytes=free_bytes)
        cache_options = options.cache
        sched, tenants = options.scheduler, options.tenants
        draft_model, shares_pool = _draft_model(model, sched.speculative)  # refused before the cache is sized
        lookahead = 0 if sched.speculative is None else sched.speculative.num_speculative_tokens
        draft_kv_dtype = cache_options.kv_dtype if cache_kind(model) == "paged" else None
        draft_token_bytes = (0.0 if draft_model is None or shares_pool else
                             paged_token_bytes(draft_model, cache_options.page_size, draft_kv_dtype)[0])
        reserve = program_reserve(model, options, mesh=mesh, lowerable="max_num_batched_tokens" in derived)
        short = None
        try:
            self.cache = build_cache(model, cache_options, max_seqs=sched.max_seqs, prefill_chunk=sched.prefill_chunk,
                                     free_bytes=free_bytes, mesh=mesh, lookahead=lookahead,
                                     draft_token_bytes=draft_token_bytes, temporaries=reserve)
        except InvalidArgument as err:  # the rows' own state past what the programs leave: fewer rows may fit
            if getattr(reserve, "limited_to", None) is None or "max_seqs" not in derived:
                raise
            self.cache, short = None, err
        self.options = options = _with_token_budget(options, getattr(reserve, "token_budget", None), derived,
                                                    self.cache)
        rows = _rows_for_room(model, options, reserve, derived, mesh, free_bytes)
        if rows is None and short is not None:
            raise short
        if rows is not None:  # sized again for fewer rows, beside the programs as measured (more rows: an upper bound)
            self.options = options = options.replace(max_seqs=rows)
            measured = reserve.measured
            self.cache = None  # its arrays go before the new ones are made
            self.cache = build_cache(model, cache_options, max_seqs=rows, prefill_chunk=options.scheduler.prefill_chunk,
                                     free_bytes=free_bytes, mesh=mesh, lookahead=lookahead,
                                     draft_token_bytes=draft_token_bytes, temporaries=lambda shapes: measured)
        sched = options.scheduler
        scrub_on_free, prefix_quota = tenants.scrub_on_free, tenants.prefix_quota
        enable_kv_events = tenants.enable_kv_events
        # What a rebuilt cache gets again (see _recover).
        self._isolation = dict(scrub_on_free=scrub_on_free, prefix_quota=prefix_quota)
        self._kv_events, self._mesh = enable_kv_events, mesh
        if mesh is not None and draft_model is not None:  # the draft, unless placed already
            sharding.prepare(draft_model, mesh)
        # After the placement: the draft keeps its parameters as they are now.
        draft = build_draft(draft_model, model, shares_pool, self.cache, max_seqs=sched.max_seqs,
                            page_size=cache_options.page_size, lookahead=lookahead, kv_dtype=draft_kv_dtype,
                            catch_up_tokens=sched.max_num_batched_tokens or max(sched.prefill_chunk, 512), mesh=mesh)
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
        super().__init__(self.cache, hashed_graphdef(graphdef), params,
                         OutputProcessor(Counters(), tokenizer, detokenizer),
                         max_seqs=sched.max_seqs, decode_chunk=sched.decode_chunk, prefill_chunk=sched.prefill_chunk,
                         max_num_batched_tokens=sched.max_num_batched_tokens, scheduler=sched.scheduler,
                         speculative=sched.speculative, draft=draft, logprobs_mode=sched.logprobs_mode)
        self.key = jax.random.key(sched.seed)
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
                    namespace: Hashable = None, seed: int | None = None, arrival_step: int = 0,
                    logprobs: int | None = None, penalties=None, constraint=None,
                    prompt_logprobs: int | None = None, fork_of: int | None = None) -> int:
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

        ``logprobs`` (an integer in ``[0, 20]``; None: none): each token's
        log-probability and the ``logprobs`` most likely tokens' come in
        ``RequestOutput.new_logprobs``, read where the engine's
        ``logprobs_mode`` says. They are computed in the same jitted calls
        as the tokens; an iteration that runs such a request computes the
        top 20 for every row (one more program), and a speculating engine
        runs plain decode chunks while one runs.

        ``penalties`` (a :class:`jaxkv.nn.penalties.Penalties` or a dict of
        its fields: ``presence``, ``frequency``, ``repetition``,
        ``logit_bias``, ``min_tokens``; None: none): applied to the logits
        in the jitted calls before temperature, top-k and top-p, from the
        request's prompt and output tokens (a ``[rows, vocab]`` state the
        decode loop updates itself). An iteration that runs such a request
        sends every penalized row's tokens with the call; a speculating
        engine runs plain decode chunks while one runs.

        ``prompt_logprobs`` (an integer in ``[0, 20]``; None: none): each
        prompt token's log-probability given the tokens before it, its rank
        and the ``prompt_logprobs`` most likely tokens', computed in the
        packed steps that prefill the prompt (the logits of every prompt
        position, scored on the device) and given in the
        ``RequestOutput.prompt_logprobs`` of the output carrying the first
        token. Such a request takes no prefix-cache hit (every prompt token
        is computed); the packed scheduler only.

        ``constraint`` (a :class:`~jaxkv.nn.constraints.TokenAutomaton`,
        e.g. :func:`jaxkv.serve.structured.compile_constraint` of a JSON
        schema; None: none): the output follows it, every token outside it
        masked to -inf on the device after the penalties; the decode loop
        advances the row's automaton itself. An iteration that runs such a
        request stacks the running constraints' tables into the call (built
        again only when that set changes); a speculating engine runs plain
        decode chunks while one runs. A
        :class:`~jaxkv.serve.grammar.HostGrammar` (``compile_constraint(...,
        grammar=...)``: a context-free grammar) is parsed on the host
        instead: the request takes one token per device call, its mask
        computed before each, while the other rows keep their decode chunk.

        ``fork_of`` (the id of a request added before with the same prompt
        and namespace; None: none): a sibling of that request (``n`` > 1,
        ``best_of``), which prefills the prompt once for both. This one
        waits while the other is queued or prefilling before the prompt's
        last token, then starts from the other's cache and computes only
        the last prompt token: on a paged pool it takes the other's whole
        pages straight from its block table (one more owner each, no prefix
        cache needed) and a copy of its partly filled page; on a hybrid
        cache it takes the other's state at the last token but one (a
        snapshot the cache captures there for it, through the prefix
        cache). Its tokens are those it gives alone. When the other
        is past that point (it ran on, was preempted, finished or was
        aborted), this one is admitted as any other request.

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
        ``arrival_step``; a non-integer ``seed``; ``logprobs`` or
        ``prompt_logprobs`` that is not an integer in ``[0, 20]``,
        ``prompt_logprobs`` under the padded scheduler; ``penalties`` out of their ranges
        (:class:`~jaxkv.nn.penalties.Penalties`), with a ``logit_bias`` id
        outside the vocabulary or ``min_tokens`` above ``max_new_tokens``;
        a ``constraint`` that is not a ``TokenAutomaton`` or was built for
        another vocabulary size; ``sampling`` that is not a
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
                          has_tokenizer=self.tokenizer is not None, cache=self.cache, engine_key=self.key,
                          logprobs=logprobs, penalties=penalties, constraint=constraint,
                          prompt_logprobs=prompt_logprobs)
        if fork_of is not None:
            parent = self._requests.get(fork_of) if isinstance(fork_of, int) else None
            if parent is None:
                raise InvalidArgument(f"fork_of={fork_of!r}: no request of this engine has that id")
            if parent.prompt != req.prompt or parent.namespace != req.namespace:
                raise InvalidArgument(f"fork_of={fork_of}: request {fork_of} has another prompt or namespace "
                                      f"({len(parent.prompt)} tokens against {len(req.prompt)})")
            req.fork_of = fork_of
        if prompt_logprobs is not None and self.scheduler != "packed":
            raise InvalidArgument("prompt_logprobs are scored in packed steps: use the packed scheduler "
                                  "(Engine(..., scheduler='packed'), the default)")
        if self.tokenizer is not None:
            req.detok = self.output.detokenizer_for(req.prompt)
        self._next_id += 1
        self._requests[rid] = req
        self._live.add(rid)
        self._queue(req)
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
            if on_progress is None and not logger.isEnabledFor(logging.DEBUG):
                return  # nobody reads it: its counts are a pass over every request of the run, each iteration
            progress = self._progress(pending, total, start, generated_before, before)
            logger.debug("iteration %d: %d/%d finished, running %d, waiting %d, swapped %d, %d tokens, "
                         "%d preemptions", progress.iteration, progress.finished, total, progress.running,
                         progress.waiting, progress.swapped, progress.generated_tokens, progress.preemptions)
            if on_progress is not None:
                on_progress(progress)

        self.output.run_itl = itl = []  # the run's inter-token gaps, recorded as they come
        try:
            while self._live:
                self.step()
                report()
            report()
        finally:
            self.output.run_itl = None
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
            itl=latency_stats(itl))
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

        All or nothing (:mod:`jaxkv.serve.faults`): a request whose own
        part fails is finished alone with ``"error"``; any other exception
        is contained (the cache rebuilt empty, the requests in flight
        re-queued with their tokens; logged, counted, kept in
        :attr:`last_failure`) and the outputs made before it are returned.
        Raises only ``KVCacheOOM`` when nothing can run (:meth:`run`), and
        whatever rebuilding the cache raises (then the engine is unusable)."""
        self.output.begin_step()
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
            failed_requests=count.failed_requests, spec_draft_tokens=count.spec_drafted,
            spec_accepted_tokens=count.spec_accepted, spec_packed_draft_tokens=count.spec_packed_drafted,
            forked_requests=count.forked, disk=self._disk_stats())

    def _disk_stats(self) -> dict | None:
        disk = getattr(self.cache, "disk", None)
        if disk is None:
            return None
        stats = disk.store.stats()
        return dict(records=stats.records, bytes=stats.bytes, written=stats.written, loaded=stats.loaded,
                    write_bytes=stats.write_bytes, load_bytes=stats.load_bytes, dropped=stats.dropped,
                    rejected=stats.rejected, hit_tokens=disk.loaded_tokens)

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish the work that outlives a step: the prefix cache's disk
        tier writes its queued records (a server calls this on shutdown).
        The engine stays usable."""
        disk = getattr(self.cache, "disk", None)
        if disk is not None:
            disk.store.flush(timeout)

    def _progress(self, pending, total, start, generated_before, before: Counters) -> EngineProgress:
        states = collections.Counter(r.state for r in pending)
        return EngineProgress(
            finished=states[RequestState.FINISHED], total=total, running=states[RequestState.RUNNING],
            waiting=states[RequestState.WAITING], swapped=states[RequestState.SWAPPED],
            generated_tokens=sum(len(r.generated) for r in pending) - generated_before,
            elapsed_seconds=time.perf_counter() - start,
            preemptions=self._count.swaps + self._count.recomputes - before.swaps - before.recomputes,
            iteration=self._count.iterations - before.iterations)


def _draft_model(model, config) -> tuple:
    """The engine's draft model for ``config`` (a ``SpeculativeConfig`` or
    None) and whether it runs over the target's pool: ``(None, False)``
    for n-gram lookup (or no speculation); for ``draft_layers``, the
    target's first layers over its own paged pool
    (:func:`jaxkv.nn.speculative.early_exit_draft` with ``share_pool``);
    for ``model``, that model (:func:`~jaxkv.nn.speculative.draft_model_for`:
    a paged-pool model of the target's vocabulary), which keeps a cache of
    its own (:class:`~jaxkv.serve.drafts.DraftCache`; on a mesh, placed
    there as the target's cache is). ``InvalidArgument`` for an early exit
    of a hybrid-cache target."""
    if config is None or config.method != "draft_model":
        return None, False
    if config.model is not None:
        return draft_model_for(model, config), False
    if cache_kind(model) != "paged":
        raise InvalidArgument(f"speculative draft_layers: {type(model).__name__} keeps a hybrid cache; the engine's "
                              "early-exit draft runs over a paged pool (the Llama family, DeepSeek-V3); give a "
                              "separate draft model (\"model\") or use method 'ngram'")
    return early_exit_draft(model, config.draft_layers, share_pool=True), True
