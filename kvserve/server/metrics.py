"""Prometheus metrics of ``kvserve serve`` (``GET /metrics``), via prometheus-client.

Engine gauges and counters come from the latest ``EngineStats`` snapshot the
engine process sends (at most every 100 ms while busy, and on becoming idle);
latency histograms are measured here, where the client sees the tokens.
Names follow SGLang's (``num_running_reqs``, ``num_queue_reqs``, ...) under the
``kvserve:`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.messages import EngineStats

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                      10.0, 30.0, 60.0)

# EngineStats field -> (metric name, help); gauges then counters
_GAUGES = {
    "running": ("kvserve:num_running_reqs", "requests in the running batch"),
    "waiting": ("kvserve:num_queue_reqs", "requests in the waiting queue"),
    "kv_used_tokens": ("kvserve:kv_used_tokens", "KV tokens held by live requests"),
    "kv_cached_tokens": ("kvserve:kv_cached_tokens", "KV tokens in the evictable prefix cache"),
    "kv_total_tokens": ("kvserve:kv_total_tokens", "KV pool size in tokens"),
}
_COUNTERS = {
    "prompt_tokens": ("kvserve:prompt_tokens", "prompt tokens of admitted requests"),
    "cached_tokens": ("kvserve:prefix_cache_hit_tokens", "prompt tokens served by the cache"),
    "retractions": ("kvserve:retractions", "requests retracted under memory pressure"),
    "aborts": ("kvserve:aborts", "requests aborted (client, disconnect, out of memory)"),
    "finished": ("kvserve:finished_reqs", "requests finished (any reason)"),
    "queue_full": ("kvserve:queue_full_rejections", "requests refused with 429 (queue full)"),
    "checker_runs": ("kvserve:checker_runs", "invariant checker runs"),
    "violations": ("kvserve:checker_violations", "checker runs that found a violation"),
}


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        if stats is None:
            return
        for field, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
        for field, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))


class ServerMetrics:
    """A registry of its own (several apps can live in one test process)."""

    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot))
        self.ttft = Histogram("kvserve:time_to_first_token_seconds",
                              "arrival to first token", buckets=_LATENCY_BUCKETS_S,
                              registry=self.registry)
        self.itl = Histogram("kvserve:inter_token_latency_seconds",
                             "time between token chunks, per token", buckets=_LATENCY_BUCKETS_S,
                             registry=self.registry)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "arrival to finish",
                             buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.http_errors = Counter("kvserve:http_errors", "error replies by status",
                                   ["status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
