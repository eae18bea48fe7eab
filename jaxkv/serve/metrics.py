"""Prometheus metrics of the OpenAI-compatible server (:mod:`jaxkv.serve.http`).

Served at ``GET /metrics`` in the Prometheus text format by
``prometheus_client`` (the Prometheus project's own Python client). Every
server has its own :class:`~prometheus_client.CollectorRegistry`, so two
servers in one process (tests) never share a series.

Two kinds of series:

* measured by the server, per HTTP request, on the event loop as results
  arrive from the engine loop: ``jaxkv_time_to_first_token_seconds`` (from
  the request's arrival at the server to its first generated token reaching
  the event loop), ``jaxkv_inter_token_latency_seconds`` (the gap between
  two deliveries spread evenly over the tokens they brought: one
  observation per token after the first), ``jaxkv_e2e_request_latency_seconds``,
  ``jaxkv_prompt_tokens_total``, ``jaxkv_generation_tokens_total``,
  ``jaxkv_request_success_total{finish_reason}`` (``stop``, ``length``,
  ``abort``: a client that went away), ``jaxkv_http_errors_total{status}``;
  with API keys (``ServerMetrics(tenants=...)``) each of these also has label
  ``tenant``: the configured name of the tenant whose key the request
  carried (``""`` for an error answered before a key was accepted: 401,
  ``/health``'s 503), so each tenant's traffic is a series of its own;
  without keys they have no ``tenant`` label;
* read from the engine's :meth:`~jaxkv.serve.Engine.stats` when scraped
  (the engine loop takes the snapshot, so the engine is only touched by its
  own thread): ``jaxkv_requests_running``, ``jaxkv_requests_waiting``,
  ``jaxkv_kv_cache_used_tokens{group}`` / ``jaxkv_kv_cache_capacity_tokens{group}``
  and ``jaxkv_kv_cache_used_bytes{group}`` / ``jaxkv_kv_cache_capacity_bytes{group}``
  (one series per block group of the cache: ``pages`` for a paged pool),
  ``jaxkv_kv_cache_usage_ratio{group}``, ``jaxkv_kv_cache_free_blocks{group}``,
  ``jaxkv_prefix_cache_blocks{group}`` (blocks the prefix cache holds),
  ``jaxkv_prefix_cache_hit_unit_tokens{group}`` / ``jaxkv_prefix_cache_min_hit_tokens{group}``,
  ``jaxkv_prefix_cache_snapshots`` / ``jaxkv_prefix_cache_snapshot_bytes``
  (a hybrid cache's state snapshots), ``jaxkv_prefix_cache_queries_tokens_total``
  and ``jaxkv_prefix_cache_hits_tokens_total`` (prompt tokens admitted and
  those served from the prefix cache), ``jaxkv_prefix_cache_hit_rate``,
  ``jaxkv_preemptions_total``, ``jaxkv_engine_aborted_requests_total``,
  ``jaxkv_engine_finished_requests_total``, ``jaxkv_engine_iterations_total``,
  ``jaxkv_spec_draft_tokens_total`` / ``jaxkv_spec_accepted_tokens_total``
  (speculative decoding's drafts verified / kept), ``jaxkv_forked_requests_total``
  (``n`` / ``best_of`` siblings admitted on the first one's own pages),
  with a disk tier (``--kv-disk-dir``) ``jaxkv_kv_disk_records`` /
  ``jaxkv_kv_disk_bytes`` and the counters ``jaxkv_kv_disk_{written,loaded}_{records,bytes}_total``,
  ``jaxkv_kv_disk_hit_tokens_total``, ``jaxkv_kv_disk_{dropped,rejected}_records_total``,
  and the engine's own TTFT / ITL samples (drained from each snapshot) in
  ``jaxkv_engine_time_to_first_token_seconds`` and
  ``jaxkv_engine_inter_token_latency_seconds``;
* start-up: ``jaxkv_startup_seconds`` (command to ready),
  ``jaxkv_xla_compilations_total`` / ``jaxkv_xla_compile_seconds_total``
  (XLA backend compiles in this process, warm-up included: the count stays
  put while serving when the engine's programs are bucketed) and
  ``jaxkv_ready`` (1 once ``/health`` says ready).

Label values are bounded and never secret: ``tenant`` takes only configured
tenant names (never an API key, never a ``cache_salt``: a request's salt is
in no series), the engine series are per block group. ``/metrics`` needs no
API key and shows every tenant's name and traffic, and the prefix cache's
totals over all tenants: serve it to the scraper only, not publicly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as _missing:  # an optional dependency: say which extra brings it
    raise ImportError(f"/metrics needs prometheus_client ({_missing}): pip install 'jaxkv[serve]'") from _missing

__all__ = ["CONTENT_TYPE", "ServerMetrics", "engine_stats_dict"]

#: The Prometheus text exposition format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: CPU runs of a tiny model reach the low milliseconds, a loaded
# server or a large model on CPU the tens of seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def engine_stats_dict(stats) -> dict:
    """An :class:`~jaxkv.serve.engine.EngineStats` (a dataclass) or a
    mapping as a plain dict (None: empty)."""
    if stats is None:
        return {}
    if isinstance(stats, Mapping):
        return dict(stats)
    if dataclasses.is_dataclass(stats):
        return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    return dict(vars(stats))


def _per_group(value) -> dict[str, float]:
    """A per-group figure as ``{group: number}`` (a mapping, or one number for
    a single-group cache: ``pages``)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items()}
    return {"pages": float(value)}


class _EngineCollector:
    """Gauges and counters read from the latest engine snapshot at scrape
    time (see the module docstring)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):  # no describe-time collection (the snapshot may not exist yet)
        return []

    def collect(self):
        stats = self.metrics.engine_stats()
        get = stats.get
        yield GaugeMetricFamily("jaxkv_requests_running", "Requests holding a sequence row on the device "
                                "(prefilling or decoding).", value=float(get("running", 0)))
        yield GaugeMetricFamily("jaxkv_requests_waiting", "Requests queued for admission (new or preempted "
                                "for recomputation).", value=float(get("waiting", 0)))
        yield GaugeMetricFamily("jaxkv_requests_swapped", "Requests preempted to host memory.",
                                value=float(get("swapped", 0)))
        for name, doc, key in (
                ("jaxkv_kv_cache_used_tokens", "KV cache tokens in use per block group (blocks held by "
                 "requests or the prefix cache, times tokens per block).", "tokens_used"),
                ("jaxkv_kv_cache_capacity_tokens", "KV cache tokens per block group.", "tokens_total"),
                ("jaxkv_kv_cache_used_bytes", "KV cache bytes in use per block group.", "bytes_used"),
                ("jaxkv_kv_cache_capacity_bytes", "KV cache bytes per block group.", "bytes_total"),
                ("jaxkv_kv_cache_used_blocks", "KV cache blocks in use per block group.", "blocks_used"),
                ("jaxkv_kv_cache_capacity_blocks", "Allocatable KV cache blocks per block group.", "blocks_total")):
            family = GaugeMetricFamily(name, doc, labels=["group"])
            for group, value in _per_group(get(key)).items():
                family.add_metric([group], value)
            yield family
        usage = GaugeMetricFamily("jaxkv_kv_cache_usage_ratio", "Fraction of each block group's tokens in use.",
                                  labels=["group"])
        totals = _per_group(get("tokens_total"))
        for group, used in _per_group(get("tokens_used")).items():
            usage.add_metric([group], used / totals[group] if totals.get(group) else 0.0)
        yield usage
        for name, doc, key in (
                ("jaxkv_kv_cache_free_blocks", "Free blocks per block group (and free snapshot rows).", "free"),
                ("jaxkv_prefix_cache_blocks", "Blocks the prefix cache holds a reference to, per block group.",
                 "cached_blocks"),
                ("jaxkv_prefix_cache_hit_unit_tokens", "Tokens of a whole prefix-cache page per group.", "hit_unit"),
                ("jaxkv_prefix_cache_min_hit_tokens", "The shortest prefix a hit can be, in tokens.", "min_hit")):
            family = GaugeMetricFamily(name, doc, labels=["group"])
            for row in get("cache_usage", ()) or ():
                family.add_metric([str(row["group"])], float(row[key]))
            yield family
        snapshots = [row for row in get("cache_usage", ()) or () if row["group"] == "snapshots"]
        if snapshots:
            yield GaugeMetricFamily("jaxkv_prefix_cache_snapshots", "State snapshots the hybrid prefix cache holds.",
                                    value=float(snapshots[0]["blocks"]))
            yield GaugeMetricFamily("jaxkv_prefix_cache_snapshot_bytes", "Device bytes of the cached snapshots.",
                                    value=float(snapshots[0]["bytes"]))
        queries, hits = float(get("prompt_tokens", 0)), float(get("prefix_hit_tokens", 0))
        yield CounterMetricFamily("jaxkv_prefix_cache_queries_tokens", "Prompt tokens admitted (looked up in "
                                  "the prefix cache).", value=queries)
        yield CounterMetricFamily("jaxkv_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache.",
                                  value=hits)
        yield GaugeMetricFamily("jaxkv_prefix_cache_hit_rate", "Prefix cache hits / queries in tokens, since "
                                "start.", value=hits / queries if queries else 0.0)
        disk = get("disk")
        if disk:
            yield GaugeMetricFamily("jaxkv_kv_disk_records", "Records of the prefix cache's disk tier on disk.",
                                    value=float(disk["records"]))
            yield GaugeMetricFamily("jaxkv_kv_disk_bytes", "Bytes of the disk tier's records.",
                                    value=float(disk["bytes"]))
            for name, doc, key in (
                    ("jaxkv_kv_disk_written_records", "Records the disk tier wrote since start.", "written"),
                    ("jaxkv_kv_disk_written_bytes", "Bytes the disk tier wrote since start.", "write_bytes"),
                    ("jaxkv_kv_disk_loaded_records", "Records the disk tier read back since start.", "loaded"),
                    ("jaxkv_kv_disk_loaded_bytes", "Bytes the disk tier read back since start.", "load_bytes"),
                    ("jaxkv_kv_disk_hit_tokens", "Prompt tokens read back from the disk tier since start.",
                     "hit_tokens"),
                    ("jaxkv_kv_disk_dropped_records", "Records the disk tier deleted for its byte budget.",
                     "dropped"),
                    ("jaxkv_kv_disk_rejected_records", "Disk records skipped as corrupt, truncated or failing "
                     "their checksum.", "rejected")):
                yield CounterMetricFamily(name, doc, value=float(disk[key]))
        yield CounterMetricFamily("jaxkv_preemptions", "Requests preempted (swap and recompute) since start.",
                                  value=float(get("preemptions", 0)))
        for name, doc, key in (("jaxkv_engine_aborted_requests", "Requests the engine aborted (clients that "
                                "went away).", "aborted_requests"),
                               ("jaxkv_engine_finished_requests", "Requests the engine finished.",
                                "finished_requests"),
                               ("jaxkv_engine_iterations", "Scheduler iterations (engine steps).", "iterations"),
                               ("jaxkv_spec_draft_tokens", "Speculative decoding: draft tokens verified.",
                                "spec_draft_tokens"),
                               ("jaxkv_spec_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                                "spec_accepted_tokens"),
                               ("jaxkv_forked_requests", "Siblings (n > 1, best_of) admitted on the first "
                                "one's own pages.", "forked_requests")):
            yield CounterMetricFamily(name, doc, value=float(get(key, 0) or 0))
        with self.metrics.lock:
            compiles, compile_seconds = self.metrics.compiles, self.metrics.compile_seconds
        yield CounterMetricFamily("jaxkv_xla_compilations", "XLA backend compilations in this process.",
                                  value=float(compiles))
        yield CounterMetricFamily("jaxkv_xla_compile_seconds", "Seconds spent in XLA backend compilations.",
                                  value=float(compile_seconds))
        yield GaugeMetricFamily("jaxkv_ready", "1 once the server serves (model loaded, programs warmed up).",
                                value=1.0 if self.metrics.ready else 0.0)
        yield GaugeMetricFamily("jaxkv_startup_seconds", "Seconds from the command to ready.",
                                value=float(self.metrics.startup_seconds or 0.0))


class ServerMetrics:
    """The server's metrics (see the module docstring). ``observe_*`` are
    called on the event loop; :meth:`set_engine_stats` by whoever got the
    snapshot; :meth:`render` gives the exposition text.

    ``tenants``: the configured tenant names of a server with API keys (the
    per-request series get label ``tenant``, and each named tenant's token
    and latency series exist, at 0, from the start); None: no ``tenant``
    label, and the ``tenant`` argument of ``observe_*`` is ignored."""

    def __init__(self, tenants: Sequence[str] | None = None):
        self.tenants: tuple[str, ...] | None = None if tenants is None else tuple(tenants)
        per = () if self.tenants is None else ("tenant",)
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram("jaxkv_time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                              "generated token.", per, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("jaxkv_inter_token_latency_seconds", "Seconds between consecutive generated tokens of "
                             "a request.", per, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("jaxkv_e2e_request_latency_seconds", "Seconds from a request's arrival to its last "
                             "token.", per, buckets=_E2E_BUCKETS, registry=r)
        self.engine_ttft = Histogram("jaxkv_engine_time_to_first_token_seconds", "Seconds from the scheduler "
                                     "iteration that saw a request to its first token (the engine's own samples, "
                                     "taken in at each scrape).", buckets=_TTFT_BUCKETS, registry=r)
        self.engine_itl = Histogram("jaxkv_engine_inter_token_latency_seconds", "Seconds between consecutive "
                                    "tokens of a request as the engine measures them (a decode call's wall time "
                                    "spread over its tokens).", buckets=_ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("jaxkv_prompt_tokens", "Prompt tokens of the engine requests served.",
                                     per, registry=r)
        self.generation_tokens = Counter("jaxkv_generation_tokens", "Tokens generated.", per, registry=r)
        self.finished = Counter("jaxkv_request_success", "Engine requests finished, by finish reason.",
                                [*per, "finish_reason"], registry=r)
        self.errors = Counter("jaxkv_http_errors", "Error responses, by HTTP status.", [*per, "status"], registry=r)
        # A decode server's prompts taken from its prefill server (jaxkv.serve.disaggregated).
        self.kv_transfers = Counter("jaxkv_kv_transfer_requests", "Prompts whose KV came from the prefill server.",
                                    registry=r)
        self.kv_transfer_bytes = Counter("jaxkv_kv_transfer_bytes", "Bytes of KV pulled from the prefill server.",
                                         registry=r)
        self.kv_transfer_seconds = Counter("jaxkv_kv_transfer_seconds", "Seconds spent taking prompts' KV from "
                                           "the prefill server (its prefill, the pull, the adoption).", registry=r)
        self.kv_transfer_pull_seconds = Counter("jaxkv_kv_transfer_pull_seconds", "Seconds of the pulls alone "
                                                "(jax.experimental.transfer).", registry=r)
        self.kv_transfer_tokens = Counter("jaxkv_kv_transfer_adopted_tokens", "Prompt tokens whose KV was "
                                          "adopted into this server's prefix cache.", registry=r)
        self.kv_transfer_held = Counter("jaxkv_kv_transfer_held", "Prompts not asked of the prefill server: this "
                                        "server's prefix cache held them (all but less than a page).", registry=r)
        self.kv_transfer_failures = Counter("jaxkv_kv_transfer_failures", "Prompts no prefill server could "
                                            "hand over (computed here instead).", registry=r)
        self.kv_transfer_server = Counter("jaxkv_kv_transfer_server_requests", "Prompts asked of each prefill "
                                          "server, by outcome (ok, failed: the next server was asked).",
                                          ["server", "outcome"], registry=r)
        for tenant in self.tenants or ():
            for metric in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens):
                metric.labels(tenant=tenant)
        self.lock = threading.Lock()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.ready = False
        self.startup_seconds: float | None = None
        self._stats: dict = {}
        r.register(_EngineCollector(self))

    # ----------------------------------------------------------- engine

    def set_engine_stats(self, stats) -> None:
        """Keep ``stats`` (an ``EngineStats`` or a dict) for the next scrape;
        its TTFT / ITL samples (those since the previous snapshot) go into
        the engine-side histograms."""
        self._stats = engine_stats_dict(stats)
        for sample in self._stats.get("ttft", ()) or ():
            self.engine_ttft.observe(sample)
        for sample in self._stats.get("itl", ()) or ():
            self.engine_itl.observe(sample)

    def engine_stats(self) -> dict:
        return self._stats

    def count_compile(self, seconds: float) -> None:
        """One XLA backend compile of ``seconds`` (from a ``jax.monitoring``
        listener: any thread)."""
        with self.lock:
            self.compiles += 1
            self.compile_seconds += seconds

    # -------------------------------------------------------- requests

    def _series(self, metric, tenant: str | None, **labels):
        """``metric``'s series for ``tenant`` (``""``: none) and ``labels``."""
        if self.tenants is not None:
            labels["tenant"] = tenant or ""
        return metric.labels(**labels) if labels else metric

    def observe_tokens(self, arrival: float, last: float | None, now: float, count: int, *,
                       tenant: str | None = None) -> None:
        """``count`` tokens of a request that arrived at ``arrival`` delivered
        at ``now``; ``last``: when its previous tokens were (None: these are
        its first)."""
        if count <= 0:
            return
        self._series(self.generation_tokens, tenant).inc(count)
        if last is None:
            self._series(self.ttft, tenant).observe(now - arrival)
            count -= 1
            last = now
        if count:
            gap = (now - last) / count
            itl = self._series(self.itl, tenant)
            for _ in range(count):
                itl.observe(gap)

    def observe_prompt(self, count: int, *, tenant: str | None = None) -> None:
        """``count`` prompt tokens of a finished engine request."""
        self._series(self.prompt_tokens, tenant).inc(count)

    def observe_finished(self, arrival: float, now: float, reason: str | None, *, tenant: str | None = None) -> None:
        self._series(self.e2e, tenant).observe(now - arrival)
        self._series(self.finished, tenant, finish_reason=reason or "unknown").inc()

    def observe_error(self, status: int, *, tenant: str | None = None) -> None:
        self._series(self.errors, tenant, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
