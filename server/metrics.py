"""Prometheus metrics, one registry per daemon (tests start several)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("modeld_requests", "Successful calls (tensor and language models)", ["model", "backend", "protocol"], registry=r)
        self.failures = Counter("modeld_request_failures", "Failed calls by gRPC status", ["model", "status", "protocol"], registry=r)
        self.request_latency = Histogram("modeld_request_seconds", "Request latency inside the engine", ["model", "backend", "protocol"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_latency = Histogram("modeld_queue_seconds", "Time a request waited for its batch", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("modeld_batch_size", "Rows per executed batch", ["model", "backend"], buckets=_BATCH_BUCKETS, registry=r)
        self.loaded_bytes = Gauge("modeld_loaded_bytes", "Bytes held by each loaded model", ["model", "backend"], registry=r)
        self.budget_bytes = Gauge("modeld_memory_budget_bytes", "The memory budget shared by all backends", registry=r)
        self.used_bytes = Gauge("modeld_memory_used_bytes", "Bytes the budget holds: every loaded model plus the daemon's own share", registry=r)
        self.daemon_bytes = Gauge("modeld_memory_daemon_bytes", "The daemon's resident memory outside its in-process models, counted in the budget", registry=r)
        # read at scrape time (app.py sets the function): a soak test's leak check, and an operator's
        self.asyncio_tasks = Gauge("modeld_asyncio_tasks", "asyncio tasks alive in the daemon's event loop", registry=r)
        self.evictions = Counter("modeld_evictions", "Models evicted to make room", ["model", "backend"], registry=r)
        self.fallbacks = Counter("modeld_backend_fallbacks", "Times a backend failed and the next one was tried", ["model", "from_backend", "stage"], registry=r)
        self.backend_healthy = Gauge("modeld_backend_healthy", "0 while a backend's fallbacks have it skipped for new loads (its cool-down), else 1", ["backend"], registry=r)
        self.loads = Counter("modeld_model_loads", "Model loads by outcome", ["model", "outcome"], registry=r)
        # language models
        self.time_to_first_token = Histogram("modeld_time_to_first_token_seconds", "Arrival to first token", ["model", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("modeld_inter_token_seconds", "Time between tokens of one sequence", ["model", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("modeld_generated_tokens", "Completion tokens produced", ["model", "backend"], registry=r)
        self.running_sequences = Gauge("modeld_running_sequences", "Sequences in the running batch", ["model", "backend"], registry=r)
        self.waiting_sequences = Gauge("modeld_waiting_sequences", "Sequences waiting for a slot", ["model", "backend"], registry=r)
        self.kv_cells_used = Gauge("modeld_kv_cells_used", "KV cache cells holding tokens (running and cached)", ["model", "backend"], registry=r)
        self.kv_cells_capacity = Gauge("modeld_kv_cells_capacity", "KV cache cells in all", ["model", "backend"], registry=r)
        self.prefix_cache_hit_tokens = Counter("modeld_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", ["model", "backend"], registry=r)
        self.prompt_tokens = Counter("modeld_prompt_tokens", "Prompt tokens received", ["model", "backend"], registry=r)
        self.drafted_tokens = Counter("modeld_speculative_drafted_tokens", "Draft tokens proposed", ["model", "backend"], registry=r)
        self.accepted_tokens = Counter("modeld_speculative_accepted_tokens", "Draft tokens accepted", ["model", "backend"], registry=r)
        self.finished_sequences = Counter("modeld_finished_sequences", "Sequences by finish reason", ["model", "backend", "reason"], registry=r)
        # remote engines (backends/remote); their running/waiting requests and KV use go to the gauges above
        self.remote_healthy = Gauge("modeld_remote_healthy", "1 while a remote engine answers, 0 while failures mark it unhealthy", ["model", "backend"], registry=r)
        self.remote_failures = Counter("modeld_remote_failures", "Failed calls and probes of a remote engine (unreachable, timeout, server_error, broken_stream)", ["model", "backend", "kind"], registry=r)
        self.remote_kv_cache_usage = Gauge("modeld_remote_kv_cache_usage_ratio", "A remote engine's KV-cache usage (0-1), from its /metrics", ["model", "backend"], registry=r)
        self.remote_prefix_cache_hit_ratio = Gauge("modeld_remote_prefix_cache_hit_ratio", "A remote engine's prefix-cache hits over lookups since it started, from its /metrics", ["model", "backend"], registry=r)
        # worker processes (server/workers)
        self.worker_deaths = Counter("modeld_worker_deaths", "Worker processes that died (crash, signal, OOM kill), by stage: load or run", ["model", "backend", "stage"], registry=r)
        self.worker_restarts = Counter("modeld_worker_restarts", "Workers started again for a model whose worker had died", ["model", "backend"], registry=r)


@dataclass(frozen=True)
class StepFigures:
    """The scheduler's state after one generation step."""

    num_running: int = 0
    num_waiting: int = 0  # sequences waiting for a slot
    kv_used: int = 0  # KV cells holding tokens, running and cached
    kv_capacity: int = 0


class GenerationMetrics:
    """The generation loop's observer: its figures as Prometheus metrics, and
    the latest step's as `latest` for modeld.v1.Node.

    Speculative acceptance rate = accepted / drafted, both counters.
    """

    def __init__(self, metrics: Metrics, model: str, backend: str) -> None:
        self.m, self.labels = metrics, (model, backend)
        self.latest = StepFigures()  # all 0 until the first step after load
        # on_step and on_tokens run once per step and per token: the labelled
        # children are looked up once here, not on every call
        self._running, self._waiting, self._kv_used, self._kv_capacity = (
            g.labels(*self.labels) for g in (metrics.running_sequences, metrics.waiting_sequences,
                                             metrics.kv_cells_used, metrics.kv_cells_capacity))
        self._tokens = metrics.generated_tokens.labels(*self.labels)
        self._first_token = metrics.time_to_first_token.labels(*self.labels)
        self._inter_token = metrics.inter_token.labels(*self.labels)

    def on_step(self, num_running: int, num_waiting: int, kv_used: int, kv_capacity: int) -> None:
        self.latest = StepFigures(num_running, num_waiting, kv_used, kv_capacity)
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_used.set(kv_used)
        self._kv_capacity.set(kv_capacity)

    def on_tokens(self, count: int, first_token_s: float | None, inter_token_s: float | None) -> None:
        self._tokens.inc(count)
        if first_token_s is not None:
            self._first_token.observe(first_token_s)
        if inter_token_s is not None:
            self._inter_token.observe(inter_token_s)

    def on_finish(self, usage, reason) -> None:
        self.m.prompt_tokens.labels(*self.labels).inc(usage.prompt_tokens)
        self.m.prefix_cache_hit_tokens.labels(*self.labels).inc(usage.cached_prompt_tokens)
        self.m.drafted_tokens.labels(*self.labels).inc(usage.drafted_tokens)
        self.m.accepted_tokens.labels(*self.labels).inc(usage.accepted_tokens)
        self.m.finished_sequences.labels(*self.labels, reason.value).inc()

    # a remote engine's figures (backends/remote/model.py calls these where present)

    def on_remote_health(self, is_healthy: bool) -> None:
        self.m.remote_healthy.labels(*self.labels).set(1 if is_healthy else 0)

    def on_remote_failure(self, kind: str) -> None:
        self.m.remote_failures.labels(*self.labels, kind).inc()

    def on_remote_load(self, kv_cache_usage: float | None, prefix_cache_hit_ratio: float | None) -> None:
        if kv_cache_usage is not None:
            self.m.remote_kv_cache_usage.labels(*self.labels).set(kv_cache_usage)
        if prefix_cache_hit_ratio is not None:
            self.m.remote_prefix_cache_hit_ratio.labels(*self.labels).set(prefix_cache_hit_ratio)
