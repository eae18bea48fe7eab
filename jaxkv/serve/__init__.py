"""Serving: the continuous-batching engine, the top of jaxkv's layers.

* :class:`Engine`: a host scheduler (admission with prefix-cache hits,
  preemption by swap or recompute) around jitted prefill and multi-step
  decode chunks built from :mod:`jaxkv.nn.steps`.
* :mod:`jaxkv.serve.caches`: what the engine needs from a model's cache,
  for the paged pool (:class:`~jaxkv.serve.caches.PagedCache`) and the
  hybrid ``KVCacheManager`` (:class:`~jaxkv.serve.caches.HybridCache`).
* :class:`EngineSummary`: what :meth:`Engine.run` did;
  :class:`EngineProgress`: what its ``on_progress`` callback receives;
  :class:`RequestState`: a request's place in its life cycle.

``jaxkv.nn.Engine`` and ``jaxkv.nn.EngineSummary`` name the same classes.
"""

from jaxkv.serve.engine import Engine, EngineProgress, EngineSummary, RequestState

__all__ = ["Engine", "EngineProgress", "EngineSummary", "RequestState"]
