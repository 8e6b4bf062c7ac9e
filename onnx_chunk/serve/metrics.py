"""The server's Prometheus metrics: what happened to requests, and the runtime's own counters.

Every number comes from an event: the latency histograms and request counters are observed by
the server as tokens arrive and requests end; the variant cache's and the engine's numbers are
read from `Runtime.stats` at each scrape (the cache bumps each counter by the event it names),
never estimated. Each app has its own registry, so several apps live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from onnx_chunk.runtime.facade import Runtime

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a tiny CPU model's decode step to a long prompt's prefill under load.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The metrics of one app, in a registry of their own."""

    def __init__(self, runtime: Runtime) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("onnx_chunk_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("onnx_chunk_inter_token_seconds",
                                     "Between two consecutive tokens of one request.",
                                     buckets=_ITL_BUCKETS, registry=self.registry)
        self.requests = Counter("onnx_chunk_requests",
                                "Generation requests ended, by finish reason "
                                "(stop, length, cancelled, error).",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter("onnx_chunk_rejected_requests",
                                "Requests answered with an error status before generating.",
                                ["status"], registry=self.registry)
        self.registry.register(_RuntimeCollector(runtime))

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)


class _RuntimeCollector(Collector):
    """The variant cache's and the batch engine's counters, read at each scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        stats = self._runtime.stats
        cache, engine = stats.cache, stats.engine
        yield _counter("onnx_chunk_variant_compiles", "Variants built (session creations).",
                       cache.compiles)
        yield _counter("onnx_chunk_variant_cache_hits", "Forwards served by a live variant.",
                       cache.hits)
        yield _counter("onnx_chunk_variant_evictions", "Variants evicted to make room.",
                       cache.evictions)
        yield _gauge("onnx_chunk_variants", "Variants live now.", cache.variants)
        yield _gauge("onnx_chunk_variant_bytes",
                     "Bytes the live variants were measured at.", cache.bytes_held)
        yield _gauge("onnx_chunk_queue_length", "Requests waiting for a slot.",
                     0 if engine is None else engine.queued)
        yield _gauge("onnx_chunk_running_slots", "Slots holding a request now.",
                     0 if engine is None else engine.running)
        yield _gauge("onnx_chunk_slots", "Slots of the batch engine.", stats.max_batch)
        yield _counter("onnx_chunk_prefix_hits",
                       "Requests that reused a prefix their slot kept from an earlier request.",
                       0 if engine is None else engine.prefix_hits)
        yield _counter("onnx_chunk_prefix_reused_tokens",
                       "Prompt tokens not prefilled again: reused from a slot's kept prefix.",
                       0 if engine is None else engine.prefix_reused_tokens)
        yield _counter("onnx_chunk_prefix_refused",
                       "Requests that shared more kept tokens with a free slot than a window "
                       "cache or recurrent state let them reuse.",
                       0 if engine is None else engine.prefix_refused)
        yield _counter("onnx_chunk_draft_tokens", "Tokens drafted by speculative decoding.",
                       0 if engine is None else engine.draft_tokens)
        yield _counter("onnx_chunk_accepted_tokens",
                       "Drafted tokens the verifications kept.",
                       0 if engine is None else engine.accepted_tokens)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
