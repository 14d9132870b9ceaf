"""Prometheus metrics, one registry per daemon (tests start several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("modeld_requests", "Inference requests", ["model", "backend"], registry=r)
        self.failures = Counter("modeld_request_failures", "Failed requests by gRPC status", ["model", "status"], registry=r)
        self.request_latency = Histogram("modeld_request_seconds", "Request latency inside the engine", ["model", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_latency = Histogram("modeld_queue_seconds", "Time a request waited for its batch", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("modeld_batch_size", "Rows per executed batch", ["model", "backend"], buckets=_BATCH_BUCKETS, registry=r)
        self.loaded_bytes = Gauge("modeld_loaded_bytes", "Bytes held by each loaded model", ["model", "backend"], registry=r)
        self.budget_bytes = Gauge("modeld_memory_budget_bytes", "The memory budget shared by all backends", registry=r)
        self.used_bytes = Gauge("modeld_memory_used_bytes", "Bytes held by all loaded models", registry=r)
        self.evictions = Counter("modeld_evictions", "Models evicted to make room", ["model", "backend"], registry=r)
        self.fallbacks = Counter("modeld_backend_fallbacks", "Times a backend failed and the next one was tried", ["model", "from_backend", "stage"], registry=r)
        self.loads = Counter("modeld_model_loads", "Model loads by outcome", ["model", "outcome"], registry=r)
