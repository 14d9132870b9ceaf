"""Prometheus metrics, one registry per daemon (tests start several)."""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

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
        # modeld_inter_token_seconds, modeld_generated_tokens, modeld_running_sequences,
        # modeld_waiting_sequences and modeld_kv_cells_{used,capacity}: per step and per
        # token, kept as plain numbers (GenerationFigures) and read at scrape time
        self.generation_figures: dict[tuple[str, str], GenerationFigures] = {}
        r.register(_GenerationCollector(self.generation_figures))
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


class GenerationFigures:
    """One (model, backend)'s step and token figures as plain numbers, read
    by _GenerationCollector when Prometheus scrapes. A labelled Gauge or
    Histogram takes a lock and four Python calls per update: at one stream
    the step figures and the inter-token time change on every token, and
    those calls were a sizeable share of the daemon's work per token. Kept
    per label pair across reloads, as labelled children were: counters
    never go back. Updated on the event loop only; a scrape (another
    thread) reads whole numbers, at worst one token behind."""

    __slots__ = ("step", "tokens", "inter_counts", "inter_sum", "created")

    def __init__(self) -> None:
        self.step = (0, 0, 0, 0)  # StepFigures' fields, as a tuple: made per step
        self.tokens = 0
        self.inter_counts = [0] * (len(_LATENCY_BUCKETS) + 1)  # per bucket, not cumulative; the last: +Inf
        self.inter_sum = 0.0
        self.created = time.time()


_FIGURE_LABELS = ["model", "backend"]
_STEP_GAUGES = (  # (name, help) of GenerationFigures.step's fields, in order
    ("modeld_running_sequences", "Sequences in the running batch"),
    ("modeld_waiting_sequences", "Sequences waiting for a slot"),
    ("modeld_kv_cells_used", "KV cache cells holding tokens (running and cached)"),
    ("modeld_kv_cells_capacity", "KV cache cells in all"),
)
_TOKENS = ("modeld_generated_tokens", "Completion tokens produced")
_INTER_TOKEN = ("modeld_inter_token_seconds", "Time between tokens of one sequence")
_BUCKET_NAMES = [floatToGoString(b) for b in _LATENCY_BUCKETS] + ["+Inf"]


class _GenerationCollector:
    """The families of GenerationFigures, with the names, types and labels
    the prometheus_client metrics they replace exposed."""

    def __init__(self, figures: dict[tuple[str, str], GenerationFigures]) -> None:
        self.figures = figures

    def describe(self):  # names only: the registry refuses a second metric of one of them
        yield from (GaugeMetricFamily(name, doc, labels=_FIGURE_LABELS) for name, doc in _STEP_GAUGES)
        yield CounterMetricFamily(*_TOKENS, labels=_FIGURE_LABELS)
        yield HistogramMetricFamily(*_INTER_TOKEN, labels=_FIGURE_LABELS)

    def collect(self):
        gauges = [GaugeMetricFamily(name, doc, labels=_FIGURE_LABELS) for name, doc in _STEP_GAUGES]
        tokens = CounterMetricFamily(*_TOKENS, labels=_FIGURE_LABELS)
        inter = HistogramMetricFamily(*_INTER_TOKEN, labels=_FIGURE_LABELS)
        for labels, f in list(self.figures.items()):
            for gauge, value in zip(gauges, f.step):
                gauge.add_metric(labels, value)
            tokens.add_metric(labels, f.tokens, created=f.created)
            cumulative, buckets = 0, []
            for name, count in zip(_BUCKET_NAMES, list(f.inter_counts)):
                cumulative += count
                buckets.append((name, cumulative))
            inter.add_metric(labels, buckets, f.inter_sum)
            inter.samples.append(Sample(_INTER_TOKEN[0] + "_created", dict(zip(_FIGURE_LABELS, labels)), f.created))
        yield from gauges
        yield tokens
        yield inter


class GenerationMetrics:
    """The generation loop's observer: its figures as Prometheus metrics, and
    the latest step's as `latest` for modeld.v1.Node.

    Speculative acceptance rate = accepted / drafted, both counters.
    """

    def __init__(self, metrics: Metrics, model: str, backend: str) -> None:
        self.m, self.labels = metrics, (model, backend)
        self.figures = metrics.generation_figures.setdefault(self.labels, GenerationFigures())
        self.figures.step = (0, 0, 0, 0)  # all 0 until the first step after load
        self._first_token = metrics.time_to_first_token.labels(*self.labels)  # once a request: a Histogram

    @property
    def latest(self) -> StepFigures:
        return StepFigures(*self.figures.step)

    def on_step(self, num_running: int, num_waiting: int, kv_used: int, kv_capacity: int) -> None:
        self.figures.step = (num_running, num_waiting, kv_used, kv_capacity)

    def on_tokens(self, count: int, first_token_s: float | None, inter_token_s: float | None) -> None:
        f = self.figures
        f.tokens += count
        if first_token_s is not None:
            self._first_token.observe(first_token_s)
        if inter_token_s is not None:
            # Histogram's own rule: a value on a bound counts in that bound's bucket (le)
            f.inter_counts[bisect_left(_LATENCY_BUCKETS, inter_token_s)] += 1
            f.inter_sum += inter_token_s

    def on_tokens_many(self, figures: tuple[tuple[int, float | None, float | None], ...]) -> None:
        """on_tokens for each of a step's streams, as a worker sends them: in one message."""
        for count, first_token_s, inter_token_s in figures:
            self.on_tokens(count, first_token_s, inter_token_s)

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
