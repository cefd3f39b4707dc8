"""``GET /metrics`` in Prometheus' text format (issue 13): requests, latency, the prefix cache and, with
``--compile``, the graphs compiled so far (issue 18).

Latency is measured where the engine hands an output over (its thread), per choice: time to first token from
the request's arrival, and the gaps between later tokens. Engine and cache figures are read when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from k3.serve.engine import Engine, Output

__all__ = ["Metrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        yield GaugeMetricFamily("k3_requests_running", "Requests admitted to the batch", value=len(e.running))
        yield GaugeMetricFamily("k3_requests_waiting", "Requests waiting for a batch slot", value=e.num_waiting)
        finished = CounterMetricFamily("k3_requests_finished", "Requests ended, by finish reason", labels=["reason"])
        for reason, count in sorted(e.finished.items()):
            finished.add_metric([reason], count)
        yield finished
        if e.compiled is not None:  # `--compile`: a graph built while serving stalls every running request
            yield CounterMetricFamily("k3_compiled_graphs", "Graphs compiled (one per new shape key)",
                                      value=e.compiled.compilations)
            yield CounterMetricFamily("k3_compile_seconds", "Seconds the latest compilation of each shape key took",
                                      value=sum(e.compiled.compile_seconds.values()))
            yield CounterMetricFamily("k3_compiled_graphs_cached", "Of the graphs compiled, those loaded from an "
                                      "on-disk cache (inductor's, or saved precompiled graphs)",
                                      value=e.compiled.cache_hits)
            if (plan := e.compiled.plan) is not None:  # compiling in the background: families not ready run eagerly
                yield GaugeMetricFamily("k3_compile_graphs_built", "Graphs the background compilation has built",
                                        value=plan.built)
                yield GaugeMetricFamily("k3_compile_graphs_planned", "Graphs the background compilation builds",
                                        value=len(plan.planned))
            yield CounterMetricFamily("k3_compiled_steps", "Model steps run on compiled graphs",
                                      value=e.compiled.graph_calls)
            yield CounterMetricFamily("k3_eager_steps", "Model steps of a compiled engine run eagerly (no graph for "
                                      "them, or not built yet)", value=e.compiled.eager_calls)
        cache = e.prefix_cache
        if cache is None:
            return
        s = cache.stats
        for name, help_, value in (
                ("lookups", "Prefix-cache lookups", s.lookups), ("hits", "Lookups that reused a prefix", s.hits),
                ("prompt_tokens", "Prompt tokens looked up", s.tokens_looked_up),
                ("reused_tokens", "Prompt tokens restored instead of recomputed", s.tokens_reused),
                ("evictions", "Pages and checkpoints evicted", s.evictions)):
            yield CounterMetricFamily(f"k3_prefix_cache_{name}", help_, value=value)
        yield GaugeMetricFamily("k3_prefix_cache_hit_rate", "Share of looked-up prompt tokens that were reused",
                                value=s.tokens_reused / s.tokens_looked_up if s.tokens_looked_up else 0.0)
        yield GaugeMetricFamily("k3_prefix_cache_bytes", "Bytes held by cached pages and checkpoints",
                                value=cache.bytes_used)
        yield GaugeMetricFamily("k3_prefix_cache_budget_bytes", "The cache's byte budget", value=cache.budget)
        yield GaugeMetricFamily("k3_prefix_cache_entries", "Cached pages and checkpoints", value=len(cache))


class Metrics:
    """The server's registry: engine and cache collectors, and latency histograms fed by `Timer`s."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("k3_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("k3_inter_token_latency_seconds", "Between consecutive tokens of one choice",
                             buckets=_ITL_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> Timer:
        return Timer(self)


class Timer:
    """Latency of one HTTP request's choices; `observe` runs on the engine thread as outputs are handed over."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.start, self.last = metrics, time.monotonic(), {}

    def observe(self, index: int, output: Output) -> None:
        if not output.token_ids:
            return
        now = time.monotonic()
        previous = self.last.get(index)
        if previous is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - previous)
        self.last[index] = now
