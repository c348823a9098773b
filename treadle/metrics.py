"""Prometheus metrics, all named `treadle:*`, on a registry of the engine's own.

Two sources: request outcomes and latencies, observed by the output processor as tokens arrive;
and the engine's state (running and waiting requests, KV usage, prefix cache, preemptions,
speculative decoding, KV connectors' stores), read from `SchedulerStats` when the metrics are
scraped.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from treadle.core.stats import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                      0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class RequestMetrics:
    """Observed per request by the output processor."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.finished = Counter("treadle:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=registry)
        self.prompt_tokens = Counter("treadle:prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("treadle:generation_tokens", "Generated tokens",
                                         registry=registry)
        self.ttft = Histogram("treadle:time_to_first_token_seconds", "Time to the first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("treadle:inter_token_latency_seconds", "Time between token outputs",
                             buckets=_TOKEN_GAP_BUCKETS, registry=registry)
        self.tpot = Histogram("treadle:time_per_output_token_seconds",
                              "Per request: (latency - TTFT) / (output tokens - 1)",
                              buckets=_TOKEN_GAP_BUCKETS, registry=registry)
        self.e2e = Histogram("treadle:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("treadle:request_queue_time_seconds",
                                    "Arrival to first schedule", buckets=_LATENCY_BUCKETS,
                                    registry=registry)


class EngineStatsCollector(Collector):
    """Engine counters and gauges from the latest `SchedulerStats` snapshot."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        yield GaugeMetricFamily("treadle:num_requests_running", "Requests being computed",
                                value=s.num_running_reqs)
        yield GaugeMetricFamily("treadle:num_requests_waiting", "Requests waiting to be scheduled",
                                value=s.num_waiting_reqs)
        yield GaugeMetricFamily("treadle:kv_cache_usage_perc",
                                "Fraction of KV blocks held by requests (1 = full)",
                                value=s.kv_cache_usage)
        yield CounterMetricFamily("treadle:prefix_cache_queries", "Prompt tokens looked up",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("treadle:prefix_cache_hits", "Prompt tokens found cached",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("treadle:num_preemptions", "Preemptions", value=s.num_preemptions)
        yield CounterMetricFamily("treadle:window_freed_blocks",
                                  "KV blocks given back from behind every sliding window",
                                  value=s.num_window_freed_blocks)
        spec = s.spec_decoding
        yield CounterMetricFamily("treadle:spec_decode_num_drafts", "Steps verifying drafts",
                                  value=spec.num_drafts)
        yield CounterMetricFamily("treadle:spec_decode_num_draft_tokens", "Draft tokens verified",
                                  value=spec.num_draft_tokens)
        yield CounterMetricFamily("treadle:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=spec.num_accepted_tokens)
        per_pos = CounterMetricFamily("treadle:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position", labels=["position"])
        for position, count in enumerate(spec.accepted_per_position):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        yield from _kv_tier_metrics(s)


# KVTierStats fields as metrics, labelled by connector: (field, name, help, counter or gauge).
_KV_TIER_METRICS = (
    ("hits", "kv_tier_hits", "KV blocks a connector's store was asked to load", True),
    ("misses", "kv_tier_misses", "KV blocks past the prefix-cache hit a store did not have", True),
    ("failed_loads", "kv_tier_failed_loads", "KV block loads that failed", True),
    ("bytes_loaded", "kv_tier_loaded_bytes", "Bytes of KV loaded from a store", True),
    ("bytes_saved", "kv_tier_saved_bytes", "Bytes of KV saved to a store", True),
    ("evictions", "kv_tier_evictions", "KV blocks a store evicted to stay within its budget", True),
    ("dropped_saves", "kv_tier_dropped_saves", "KV block saves dropped (store down or busy)", True),
    ("bytes_stored", "kv_tier_stored_bytes", "Bytes of KV a store holds (0: not tracked)", False),
    ("capacity_bytes", "kv_tier_capacity_bytes", "A store's budget in bytes (0: unbounded)", False),
)


def _kv_tier_metrics(stats: SchedulerStats) -> Iterator[Metric]:
    if not stats.kv_tiers:
        return
    for attr, name, text, is_counter in _KV_TIER_METRICS:
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
            f"treadle:{name}", text, labels=["connector"])
        for tier in stats.kv_tiers:
            family.add_metric([tier.connector], getattr(tier, attr))
        yield family


class PrometheusMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)

    def render(self, stats: SchedulerStats) -> bytes:
        """The text exposition format, with engine state as of `stats`."""
        self.engine.stats = stats
        return generate_latest(self.registry)
