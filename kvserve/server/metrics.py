"""Prometheus metrics of ``kvserve serve`` (``GET /metrics``), via prometheus-client.

Engine gauges and counters come from the latest ``EngineStats`` snapshot the
engine process sends (at most every 100 ms while busy, and on becoming idle);
latency histograms are measured here, where the client sees the tokens.
Names follow SGLang's and vLLM's (``num_running_reqs``, ``num_queue_reqs``,
``prompt_tokens_total``, ``generation_tokens_total``, ...) under the ``kvserve:``
prefix, and every series has a ``model_name`` label (the served model name), as
theirs do.

Token counters: ``kvserve:prompt_tokens_total`` counts each request's whole prompt
once, at its first admission (cached prefix tokens included, as vLLM counts them;
``kvserve:prefix_cache_hit_tokens_total`` is the cached part);
``kvserve:generation_tokens_total`` counts every token appended to an output, the
same tokens the replies' ``completion_tokens`` count (aborted requests' too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.messages import EngineStats

_MODEL_LABEL = "model_name"
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                      10.0, 30.0, 60.0)

# EngineStats field -> (metric name, help); gauges then counters
_GAUGES = {
    "running": ("kvserve:num_running_reqs", "requests in the running batch"),
    "waiting": ("kvserve:num_queue_reqs", "requests in the waiting queue"),
    "kv_used_tokens": ("kvserve:kv_used_tokens", "KV tokens held by live requests"),
    "kv_cached_tokens": ("kvserve:kv_cached_tokens", "KV tokens in the evictable prefix cache"),
    "kv_total_tokens": ("kvserve:kv_total_tokens", "KV pool size in tokens"),
    "open_sessions": ("kvserve:num_sessions", "open streaming sessions"),
}
_COUNTERS = {
    "prompt_tokens": ("kvserve:prompt_tokens", "prompt tokens of admitted requests "
                      "(counted once per request, cached tokens included)"),
    "generation_tokens": ("kvserve:generation_tokens", "tokens generated (appended to "
                          "outputs)"),
    "cached_tokens": ("kvserve:prefix_cache_hit_tokens", "prompt tokens served by the cache"),
    "retractions": ("kvserve:retractions", "requests retracted under memory pressure"),
    "aborts": ("kvserve:aborts", "requests aborted (client, disconnect, out of memory)"),
    "finished": ("kvserve:finished_reqs", "requests finished (any reason)"),
    "queue_full": ("kvserve:queue_full_rejections", "requests refused with 429 (queue full)"),
    "checker_runs": ("kvserve:checker_runs", "invariant checker runs"),
    "violations": ("kvserve:checker_violations", "checker runs that found a violation"),
    "session_slot_hits": ("kvserve:session_slot_hits", "session turns admitted on the KV "
                          "their session held (no prefix match)"),
    "session_reclaimed": ("kvserve:session_reclaimed", "idle sessions' KV given back under "
                          "memory pressure"),
}


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats | None],
                 model_name: Callable[[], str]) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        if stats is None:
            return
        labels = [self.model_name()]
        for field, (name, doc) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=[_MODEL_LABEL])
            gauge.add_metric(labels, getattr(stats, field))
            yield gauge
        for field, (name, doc) in _COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=[_MODEL_LABEL])
            counter.add_metric(labels, getattr(stats, field))
            yield counter


class ServerMetrics:
    """A registry of its own (several apps can live in one test process).

    ``snapshot()``: the engine's latest stats (None before the first);
    ``model_name()``: the served model name, the ``model_name`` label of every series.
    ``ttft``, ``itl`` and ``e2e`` are the histograms of the served model (observe
    seconds); ``count_error(status)`` counts an HTTP error reply.
    """

    def __init__(self, snapshot: Callable[[], EngineStats | None],
                 model_name: Callable[[], str]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot, model_name))
        self._ttft = Histogram("kvserve:time_to_first_token_seconds",
                               "arrival to first token", [_MODEL_LABEL],
                               buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._itl = Histogram("kvserve:inter_token_latency_seconds",
                              "time between token chunks, per token", [_MODEL_LABEL],
                              buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._e2e = Histogram("kvserve:e2e_request_latency_seconds", "arrival to finish",
                              [_MODEL_LABEL], buckets=_LATENCY_BUCKETS_S,
                              registry=self.registry)
        self._http_errors = Counter("kvserve:http_errors", "error replies by status",
                                    [_MODEL_LABEL, "status"], registry=self.registry)

    @property
    def ttft(self) -> Histogram:
        return self._ttft.labels(self.model_name())

    @property
    def itl(self) -> Histogram:
        return self._itl.labels(self.model_name())

    @property
    def e2e(self) -> Histogram:
        return self._e2e.labels(self.model_name())

    def count_error(self, status: int) -> None:
        self._http_errors.labels(self.model_name(), str(status)).inc()

    def render(self) -> bytes:
        name = self.model_name()
        if name:  # the histograms show their (empty) series from the first scrape on
            for family in (self._ttft, self._itl, self._e2e):
                family.labels(name)
        return generate_latest(self.registry)
