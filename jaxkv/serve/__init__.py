"""Serving: the continuous-batching engine, the top of jaxkv's layers.

* :class:`Engine`: a host scheduler (admission with prefix-cache hits,
  preemption by swap or recompute) around jitted prefill and multi-step
  decode chunks built from :mod:`jaxkv.nn.steps`. Online:
  :meth:`Engine.add_request` at any time, :meth:`Engine.step` (one
  scheduler iteration, a :class:`RequestOutput` per request that made
  tokens or finished), :meth:`Engine.abort`, :meth:`Engine.stats`
  (:class:`EngineStats`); :meth:`Engine.run` loops over ``step``. Its
  parts: :mod:`jaxkv.serve.options` (every option, defined and checked
  once: :class:`EngineOptions`), :mod:`jaxkv.serve.request` (intake and
  the request's record), :mod:`jaxkv.serve.scheduler` (admission,
  iterations, preemption, retirement, failure containment),
  :mod:`jaxkv.serve.reserve` (what a request costs in blocks),
  :mod:`jaxkv.serve.output` (detokenization, stop strings, outputs,
  statistics); :mod:`jaxkv.serve.http` the OpenAI server.
* :mod:`jaxkv.serve.caches`: the cache contract the engine speaks (the
  ``KVCache`` protocol and what the adapters share), one thin adapter per
  cache kind: :mod:`jaxkv.serve.paged_cache` (a paged pool, the radix
  prefix cache with its host tier, swap) and :mod:`jaxkv.serve.hybrid_cache`
  (a hybrid ``KVCacheManager``, the snapshot prefix cache of
  :mod:`jaxkv.prefix.snapshot_cache` with its host tier, swap of every
  group); :mod:`jaxkv.serve.build` picks one by the model's ``cache_kind``.
* :mod:`jaxkv.serve.sizing`: one sizing rule for every family
  (``max_model_len``, ``kv_cache_memory``) and the :class:`CachePlan` it
  gives (``engine.cache_plan``).
* :class:`EngineSummary`: what :meth:`Engine.run` did;
  :class:`EngineProgress`: what its ``on_progress`` callback receives;
  :class:`RequestState`: a request's place in its life cycle.

``jaxkv.nn.Engine`` and ``jaxkv.nn.EngineSummary`` name the same classes.
"""

from jaxkv.serve.engine import (Engine, EngineProgress, EngineStats, EngineSummary, RequestOutput,
                                RequestState)
from jaxkv.serve.options import CacheOptions, EngineOptions, SchedulerOptions, TenantOptions
from jaxkv.serve.sizing import CachePlan, GroupPlan

__all__ = ["CacheOptions", "CachePlan", "Engine", "EngineOptions", "EngineProgress", "EngineStats", "EngineSummary",
           "GroupPlan", "RequestOutput", "RequestState", "SchedulerOptions", "TenantOptions"]
