"""The engine: finds a model, loads it on the right backend inside the memory
budget, batches and runs requests, and falls back when a backend fails.

Knows nothing of gRPC. All state changes happen on the event loop; blocking
backend work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import anyio
import numpy as np
import structlog

from modeld.backends.base import Backend, Capability, GenerativeModel, LoadedModel
from modeld.backends.generation.params import (
    FinalEvent, GenerateRequest, SamplingParams, SpeculativeMode, TokenEvent,
)
from modeld.backends.errors import (
    BackendFailure, DeadlineExceeded, ErrorKind, InvalidArgument, LoadFailed, ModeldError, NotFound, ResourceExhausted,
    Unavailable, Unimplemented, error_for,
)
from modeld.backends.model_config import ModelConfig
from modeld.backends.registry import BackendRegistry
from modeld.server.backend_health import BackendHealthTracker, HealthChange, HealthPolicy, UnhealthyBackend
from modeld.server.batcher import BatchReport, DynamicBatcher
from modeld.server.memory import MemoryManager, ModelKey
from modeld.server.metrics import GenerationMetrics, Metrics
from modeld.server.os_memory import release_freed_memory
from modeld.server.repository import ModelRepository, ModelSource
from modeld.server.rerank import plan_rerank, resolve_embedding_model
from modeld.server.request_context import current_protocol
from modeld.server.requests import InferRequest, InferResult, ModelState, ModelStatus
from modeld.server.stats import ModelStats
from modeld.server.validation import validate_inputs, warmup_inputs
from modeld.server.workers.proxy import own_rss
from modeld.server.workers.supervisor import WorkerPolicy, WorkerSupervisor

log = structlog.get_logger("modeld.engine")

MODEL_VERSION = "1"

_CAPABILITY_HINTS = {
    Capability.SEQUENCE_BATCHING: "stateful sequences (sequence_id) are not supported; send each request on its own",
    Capability.SHARED_MEMORY: "shared-memory tensors are not supported; send tensor data in raw_input_contents",
    Capability.GENERATION: "use a language model for generation",
}


@dataclass
class ServedModel:
    config: ModelConfig
    source: ModelSource
    backend: Backend
    loaded: LoadedModel
    batcher: DynamicBatcher | None  # None for language models, which batch themselves
    stats: ModelStats = field(default_factory=ModelStats)
    warmed_up: bool = False
    generation: GenerationMetrics | None = None  # language models: the loop's latest step figures
    # a remote engine's model: the next backend's load, serving while the remote is unhealthy
    standby: asyncio.Task | None = None

    @property
    def is_generative(self) -> bool:
        return isinstance(self.loaded, GenerativeModel)

    @property
    def key(self) -> ModelKey:
        return ModelKey(self.backend.name, self.config.name)


StateListener = Callable[[str, ModelState], None]


class Engine:
    def __init__(self, repository: ModelRepository, registry: BackendRegistry, memory: MemoryManager,
                 metrics: Metrics, lazy_load: bool = True, health_policy: HealthPolicy = HealthPolicy(),
                 max_streams: int = 1024) -> None:
        self.repository = repository
        # generations in progress at once, daemon-wide: past it a new one is
        # refused at once rather than queued behind work the node cannot take
        self.max_streams = max_streams
        self.num_streams = 0
        self.registry = registry
        self.memory = memory
        self.metrics = metrics
        self.lazy_load = lazy_load
        self._served: dict[str, ServedModel] = {}
        self._loading: dict[str, asyncio.Task] = {}
        # budget entries of loads still in progress: idle by the books (nothing
        # in flight), but evicting one would pull the books from under its load
        self._reserved: set[ModelKey] = set()
        self._unloading: set[str] = set()
        self._failures: dict[str, str] = {}
        self._stats: dict[str, ModelStats] = {}
        # Accounting and unload/evict decisions happen under this lock.
        self._memory_lock = asyncio.Lock()
        # Loads run one at a time so a backend's measured RSS growth is its own.
        self._load_lock = asyncio.Lock()
        self._listeners: list[StateListener] = []
        metrics.budget_bytes.set(memory.budget)
        self.backend_health = BackendHealthTracker(health_policy)
        self.backend_health.add_listener(self._on_backend_health)
        self._health_timer: asyncio.TimerHandle | None = None
        for backend in registry.available():
            metrics.backend_healthy.labels(backend.name).set(1)
        # which models run in a worker process, and their restart backoff
        self.workers = WorkerSupervisor(WorkerPolicy(), metrics)
        self._daemon_floor = 0  # the daemon's resident bytes at start, before any model
        self._daemon_samples: collections.deque[int] = collections.deque(maxlen=5)
        self._dropping = 0  # models being dropped: their bytes leave the process before the books
        self._daemon_task: asyncio.Task | None = None

    def use_workers(self, policy: WorkerPolicy) -> None:
        """The daemon's worker settings (default isolation, load timeout, backoff)."""
        self.workers = WorkerSupervisor(policy, self.metrics)

    # -- state ---------------------------------------------------------------

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def _notify(self, name: str, state: ModelState) -> None:
        for listener in self._listeners:
            listener(name, state)

    def state_of(self, name: str) -> ModelState:
        if name in self._unloading:
            return ModelState.UNLOADING
        if name in self._served:
            return ModelState.READY
        if name in self._loading:
            return ModelState.LOADING
        return ModelState.UNAVAILABLE

    def statuses(self) -> list[ModelStatus]:
        names = sorted(set(self.repository.names()) | set(self._served) | set(self._loading))
        return [self._status(n) for n in names]

    def _status(self, name: str) -> ModelStatus:
        served = self._served.get(name)
        return ModelStatus(
            name, MODEL_VERSION, self.state_of(name), self._failures.get(name, ""),
            served.backend.name if served else "", served.loaded.nbytes if served else 0,
        )

    def served(self, name: str) -> ServedModel | None:
        return self._served.get(name)

    def stats(self, name: str) -> ModelStats:
        stats = self._stats.get(name)
        if stats is None:  # not setdefault: a ModelStats is costly to make (two HDR histograms)
            stats = self._stats[name] = ModelStats()
        return stats

    def count_failure(self, model: str, kind: ErrorKind) -> None:
        """One failed call, by model, status and protocol, whatever front it came in by."""
        if model and model not in self._served and model not in self.repository.names():
            model = ""  # names clients made up would grow the series without bound
        self.metrics.failures.labels(model, kind.value, current_protocol()).inc()

    def check_version(self, name: str, version: str) -> None:
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"model {name!r} has no version {version!r}; it has version {MODEL_VERSION}")

    # -- loading -------------------------------------------------------------

    async def load(self, name: str, source: ModelSource | None = None) -> ServedModel:
        """Load a model; concurrent loads of the same model share one load.

        With `source` (an inline model) an already loaded model is replaced.
        """
        if name in self._loading:
            if source is None:
                return await asyncio.shield(self._loading[name])
            try:  # an inline reload waits for the load in progress, then replaces it
                await asyncio.shield(self._loading[name])
            except ModeldError:
                pass
        if source is None and name in self._served:
            return self._served[name]
        task = asyncio.get_running_loop().create_task(self._load(name, source))
        self._loading[name] = task
        task.add_done_callback(lambda done: self._load_finished(name, done))
        self._notify(name, ModelState.LOADING)
        return await asyncio.shield(task)

    def _load_finished(self, name: str, task: asyncio.Task) -> None:
        if self._loading.get(name) is task:
            del self._loading[name]
        if not task.cancelled():
            task.exception()  # marks it retrieved even when every waiter left
        self._notify(name, self.state_of(name))

    async def _load(self, name: str, source: ModelSource | None) -> ServedModel:
        source = resolve_embedding_model(self._resolve_draft(source or self.repository.resolve(name)), self.repository)
        if name in self._served:
            await self.unload(name, forget_inline=False)
        self.workers.check_backoff(name)  # a model whose worker keeps dying waits its turn
        reasons: list[str] = []
        for backend in self.registry.load_order(source.config.backends, self.backend_health.is_healthy):
            verdict = backend.can_serve(source.config, source.model_dir)
            if not verdict.ok:
                reasons.append(f"{backend.name}: {verdict.reason}")
                continue
            try:
                served = await self._load_on(backend, source)
            except LoadFailed as exc:
                reasons.append(f"{backend.name}: {exc}")
                self._count_fallback(name, backend.name, "load", str(exc))
                log.warning("backend_load_failed", model=name, backend=backend.name, reason=str(exc))
                continue
            self._failures.pop(name, None)
            self.metrics.loads.labels(name, "ok").inc()
            return served
        self.metrics.loads.labels(name, "failed").inc()
        reason = "; ".join(reasons) or "no backend is available for its format"
        self._failures[name] = reason
        raise InvalidArgument(f"no backend could load model {name!r}: {reason}")

    def _resolve_draft(self, source: ModelSource) -> ModelSource:
        """Turn `draft_model = "<name>"` under a backend's table into the
        draft's file path, which the backend loads next to the target."""
        # the config parser already refused a malformed name or the model itself
        resolved = {}
        for section in dataclasses.fields(source.config.backend_options):
            options = getattr(source.config.backend_options, section.name)
            draft_name = getattr(options, "draft_model", "")
            if not draft_name:
                continue
            draft = self.repository.resolve(draft_name)
            path = (draft.model_dir / draft.config.artifact_path).resolve()
            resolved[section.name] = dataclasses.replace(options, draft_path=str(path))
        backend_options = dataclasses.replace(source.config.backend_options, **resolved)
        return dataclasses.replace(source, config=dataclasses.replace(source.config, backend_options=backend_options))

    async def _load_on(self, backend: Backend, source: ModelSource,
                       exclude: frozenset[ModelKey] = frozenset(), register: bool = True) -> ServedModel:
        config = source.config
        key = ModelKey(backend.name, config.name)
        estimate = backend.estimate_bytes(config, source.model_dir)
        async with self._memory_lock:
            for victim in self.memory.plan(estimate, exclude | self._reserved):
                await self._evict(victim)
            self.memory.add(key, estimate, config.pinned)
            self._reserved.add(key)
        try:
            async with self._load_lock:
                if self.workers.isolates(backend, config):
                    loaded = await self.workers.load(backend, config, source.model_dir)
                else:
                    loaded = await anyio.to_thread.run_sync(backend.load, config, source.model_dir)
        except BaseException:
            self._reserved.discard(key)
            self.memory.remove(key)
            raise
        try:
            await self._settle_measured_size(key, loaded.nbytes, exclude)
        except ResourceExhausted:
            await _unload(loaded)
            raise
        finally:
            self._reserved.discard(key)
        served = self._make_served(config, source, backend, loaded)
        if hasattr(loaded, "worker"):  # a worker process (server/workers)
            self._follow_worker(served)
        # set before warm-up: a failed warm-up drops the model, which removes this series
        self.metrics.loaded_bytes.labels(config.name, backend.name).set(loaded.nbytes)
        self.metrics.used_bytes.set(self.memory.used)
        if served.is_generative:
            await loaded.start()
        else:
            served.batcher.start()
        if config.warmup:
            await self._warm_up(served)
        if served.is_generative:
            # after warm-up, so the dummy sequence is not counted as traffic
            served.generation = GenerationMetrics(self.metrics, config.name, backend.name)
            loaded.set_observer(served.generation)
        log.info("model_loaded", model=config.name, backend=backend.name, nbytes=loaded.nbytes, estimate=estimate,
                 standby=not register)
        if not register:
            return served  # a remote model's standby: reached through it, never by name
        self._served[config.name] = served
        follow_health = getattr(loaded, "set_health_listener", None)  # remote engines (backends/remote)
        if follow_health is not None:
            follow_health(lambda is_healthy: self._on_remote_health(served, is_healthy))
        self._notify(config.name, ModelState.READY)
        return served

    async def _settle_measured_size(self, key: ModelKey, nbytes: int, exclude: frozenset[ModelKey]) -> None:
        """Swap the estimate for the backend's figure, evicting more if needed."""
        async with self._memory_lock:
            self.memory.resize(key, nbytes)
            if self.memory.free >= 0:
                return
            try:
                victims = self.memory.plan(0, exclude | self._reserved | {key})
            except ResourceExhausted:
                self.memory.remove(key)
                raise ResourceExhausted(self.memory.refusal(nbytes)) from None
            for victim in victims:
                await self._evict(victim)

    def _make_served(self, config: ModelConfig, source: ModelSource, backend: Backend, loaded: LoadedModel) -> ServedModel:
        stats = self.stats(config.name)
        if isinstance(loaded, GenerativeModel):
            return ServedModel(config, source, backend, loaded, None, stats)
        name, backend_name = config.name, backend.name
        served = ServedModel(config, source, backend, loaded, None, stats, warmed_up=not config.warmup)

        def on_batch(report: BatchReport) -> None:
            if not served.warmed_up:
                return  # the warm-up batch is not traffic
            stats.record_batch(report)
            self.metrics.batch_size.labels(name, backend_name).observe(report.batch_size)
            for queue_ns in report.queue_ns:
                self.metrics.queue_latency.labels(name).observe(queue_ns / 1e9)

        # a worker's batches go out on the event loop, with no thread hop
        execute = getattr(loaded, "execute_async", None) or loaded.execute
        served.batcher = DynamicBatcher(execute, config.max_batch_size, config.max_queue_delay_us,
                                        config.max_queue_size, on_batch, config.preferred_batch_sizes)
        return served

    async def _warm_up(self, served: ServedModel) -> None:
        """One dummy request before the model reports ready, straight to the
        batcher or the generation loop, so ModelStatistics never counts it."""
        try:
            if served.is_generative:
                await self._warm_up_generation(served)
            else:
                await served.batcher.submit(warmup_inputs(served.loaded.inputs, served.config.is_batched), ())
        except ModeldError as exc:
            await self._drop(served)
            raise LoadFailed(f"warm-up request failed: {exc}") from exc
        served.warmed_up = True

    async def _warm_up_generation(self, served: ServedModel) -> None:
        # cache_prompt off: a warm-up must not leave a cached prefix behind
        request = GenerateRequest(served.config.name, prompt="warm-up",
                                  params=SamplingParams(max_tokens=1, cache_prompt=False))
        async for event in served.loaded.generate(request):
            if isinstance(event, FinalEvent) and event.error:
                raise error_for(event.error_kind, event.error)

    # -- unloading -----------------------------------------------------------

    async def unload(self, name: str, forget_inline: bool = True) -> None:
        """Stop taking requests, finish queued ones, free the memory."""
        if name in self._loading and asyncio.current_task() is not self._loading[name]:
            try:
                await asyncio.shield(self._loading[name])
            except ModeldError:
                pass
        served = self._served.get(name)
        if served is None:
            if name not in self.repository.names():
                raise NotFound(f"unknown model {name!r}")
        else:
            self._unloading.add(name)
            self._notify(name, ModelState.UNLOADING)
            try:
                await self._drop(served)
            finally:
                self._unloading.discard(name)
        if forget_inline:
            self.repository.remove_inline(name)
        self.workers.forget(name)  # an operator's unload clears a crash loop's backoff
        self._notify(name, ModelState.UNAVAILABLE)

    async def _drop(self, served: ServedModel) -> None:
        if self._served.get(served.config.name) is served:
            del self._served[served.config.name]
        self._dropping += 1
        try:
            await self._drop_standby(served)
            if served.batcher is not None:
                await served.batcher.stop()
            else:
                await served.loaded.stop()
            await _unload(served.loaded)
            await anyio.to_thread.run_sync(release_freed_memory)
        finally:
            self._dropping -= 1
        self.memory.remove(served.key)
        self.metrics.loaded_bytes.remove(served.config.name, served.backend.name)
        self.metrics.used_bytes.set(self.memory.used)
        log.info("model_unloaded", model=served.config.name, backend=served.backend.name)

    # -- worker processes ---------------------------------------------------------

    def _follow_worker(self, served: ServedModel) -> None:
        """A worker model's memory follows its process's resident memory, and
        its death drops the model (its calls in flight already failed)."""
        worker = served.loaded.worker
        worker.on_death = lambda how: asyncio.get_running_loop().create_task(self._worker_died(served, how))
        served.loaded.watch_memory(lambda nbytes: self._worker_resized(served, nbytes),
                                   self.workers.policy.memory_interval_s)

    async def _worker_died(self, served: ServedModel, how: str) -> None:
        name = served.config.name
        worker = served.loaded.worker
        self.workers.record_death(name, served.backend.name, how, time.monotonic() - worker.started)
        if self._served.get(name) is not served or name in self._unloading:
            return  # already being replaced or unloaded: that path drops it
        self._failures[name] = str(worker.death)
        await self._drop(served)
        self._notify(name, ModelState.UNAVAILABLE)

    def _worker_resized(self, served: ServedModel, nbytes: int) -> None:
        if served.key not in self.memory:
            return
        self.memory.resize(served.key, nbytes)
        self.metrics.loaded_bytes.labels(served.config.name, served.backend.name).set(nbytes)
        self.metrics.used_bytes.set(self.memory.used)
        if self.memory.free < 0:
            asyncio.get_running_loop().create_task(self._make_room(served))

    async def _make_room(self, grown: ServedModel | None) -> None:
        """A worker (`grown`) or the daemon itself (None) grew past the budget:
        evict idle models to bring the books back under it (a grown model
        itself is busy or the most recent)."""
        async with self._memory_lock:
            if self.memory.free >= 0:
                return
            keep = frozenset({grown.key}) if grown is not None else frozenset()
            try:
                victims = self.memory.plan(0, keep | self._reserved)
            except ResourceExhausted as exc:
                log.warning("memory_over_budget", model=grown.config.name if grown is not None else "",
                            daemon_bytes=self.memory.daemon_bytes, reason=str(exc))
                return
            for victim in victims:
                await self._evict(victim)

    async def _evict(self, key: ModelKey) -> None:
        name = key.model
        served = self._served.get(name)
        log.info("model_evicted", model=name, backend=key.backend)
        if served is not None and served.standby is not None and served.backend.name != key.backend:
            self.metrics.evictions.labels(name, key.backend).inc()
            await self._drop_standby(served)
            return
        if served is None or served.backend.name != key.backend:
            self.memory.remove(key)
            return
        self.metrics.evictions.labels(name, served.backend.name).inc()
        await self._drop(served)
        self._notify(name, ModelState.UNAVAILABLE)

    # -- the daemon's own share of the budget ---------------------------------

    def count_daemon_memory(self, interval_s: float | None = None, window: int = 5) -> None:
        """Put the daemon's own resident memory in the budget's books, from now
        on (call at start, before any model loads), re-read every
        `interval_s` (the workers' memory interval by default) so the books
        follow the process as it grows: imported runtimes, arenas, caches.

        The share is the least of the last `window` readings: a burst that
        passes (a 40 MB upload held for the moment its load takes) must not
        evict models, while growth that lasts a window is counted."""
        self._daemon_floor = own_rss()
        self._daemon_samples = collections.deque(maxlen=window)
        self.refresh_daemon_bytes()
        if self.memory.free <= 0:
            log.warning("memory_budget_below_daemon", memory_budget_bytes=self.memory.budget,
                        daemon_bytes=self.memory.daemon_bytes,
                        reason="the daemon alone holds the whole budget: every load will be refused; "
                               "raise --memory-budget")
        interval = interval_s if interval_s is not None else self.workers.policy.memory_interval_s
        self._daemon_task = asyncio.get_running_loop().create_task(self._follow_daemon_memory(interval))

    def refresh_daemon_bytes(self) -> None:
        """The daemon's share: its resident bytes less what its in-process
        models hold (worker models are other processes), never less than at
        start. Not read while a model loads or unloads in the daemon: its
        bytes are then in the process but not (or no longer) in the books."""
        if self._daemon_floor == 0 or self._reserved or self._unloading or self._dropping:
            return
        in_process = sum(self.memory.entry(key).nbytes for key in self.memory.keys_lru_first()
                         if not self._in_worker(key))
        self._daemon_samples.append(own_rss() - in_process)
        self.memory.daemon_bytes = max(self._daemon_floor, min(self._daemon_samples))
        self.metrics.daemon_bytes.set(self.memory.daemon_bytes)
        self.metrics.used_bytes.set(self.memory.used)

    def _in_worker(self, key: ModelKey) -> bool:
        served = self._served.get(key.model)
        return served is not None and served.backend.name == key.backend and hasattr(served.loaded, "worker")

    async def _follow_daemon_memory(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.refresh_daemon_bytes()
            if self.memory.free < 0:
                await self._make_room(None)

    async def stop(self) -> None:
        if self._daemon_task is not None:
            self._daemon_task.cancel()
        if self._health_timer is not None:
            self._health_timer.cancel()
        for name in list(self._served):
            await self._drop(self._served[name])

    # -- inference -----------------------------------------------------------

    async def ensure_loaded(self, name: str, version: str = "") -> ServedModel:
        self.check_version(name, version)
        served = self._served.get(name)
        if served is not None and name not in self._unloading:
            return served
        source = self.repository.resolve(name)
        lazy = source.config.lazy_load if source.config.lazy_load is not None else self.lazy_load
        if not lazy and name not in self._loading:
            raise Unavailable(f"model {name!r} is not loaded and lazy loading is off; load it first (RepositoryModelLoad)")
        return await self.load(name)

    @contextlib.contextmanager
    def _counting_call(self, name: str):
        """In flight from entry (a lazy load's wait included) until the call
        leaves, however it leaves, and a failure counted by its kind, once
        per call. A name nobody knows is not counted: ensure_loaded refuses
        it, and made-up names must not grow `_stats`."""
        if name not in self._served and name not in self._loading and name not in self.repository.names():
            yield
            return
        stats = self.stats(name)
        stats.begin_call()
        try:
            yield
        except ModeldError as exc:
            stats.count_failure(exc.kind)
            raise
        except Exception:  # a bug: the service answers INTERNAL
            stats.count_failure(ErrorKind.INTERNAL)
            raise
        finally:
            stats.end_call()

    async def infer(self, request: InferRequest) -> InferResult:
        with self._counting_call(request.model_name):
            return await self._infer(request)

    async def _infer(self, request: InferRequest) -> InferResult:
        served = await self.ensure_loaded(request.model_name, request.model_version)
        started = time.perf_counter_ns()
        try:
            async with _deadline(request.timeout_s):
                served, outputs = await self._infer_on(served, request)
        except ModeldError:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        self._count_success(served, time.perf_counter_ns() - started)
        return InferResult(request.model_name, MODEL_VERSION, request.id, outputs, served.backend.name)

    def _count_success(self, served: ServedModel, elapsed_ns: int) -> None:
        served.stats.record_success(elapsed_ns)
        labels = (served.config.name, served.backend.name, current_protocol())
        self.metrics.requests.labels(*labels).inc()
        self.metrics.request_latency.labels(*labels).observe(elapsed_ns / 1e9)

    async def _infer_on(self, served: ServedModel, request: InferRequest) -> tuple[ServedModel, dict[str, np.ndarray]]:
        """Run on `served`, or on the backend it falls back to; says which."""
        missing = served.backend.missing(request.required)
        if missing:
            raise Unimplemented(_capability_message(served, missing))
        rerank = plan_rerank(request, served.config)  # a rerank model's documents as rows of pairs
        if rerank is None:
            validate_inputs(request, served.loaded.inputs, served.loaded.outputs, served.config)
        self.memory.acquire(served.key)
        try:
            if rerank is not None:
                return served, await rerank.run(served.batcher.submit)
            return served, await served.batcher.submit(request.inputs, request.output_names, request.priority,
                                                       deadline=request.deadline)
        except BackendFailure as exc:
            fallback = await self._fall_back(served, exc)
            return await self._infer_on(fallback, request)
        finally:
            self.memory.release(served.key)

    # -- generation ------------------------------------------------------------

    async def generative(self, name: str, required: frozenset[Capability] = frozenset(),
                         fail_over: bool = False) -> ServedModel:
        served = await self._route_around_unhealthy(await self.ensure_loaded(name), fail_over)
        missing = served.backend.missing(required | {Capability.GENERATION})
        if missing or not served.is_generative:
            raise Unimplemented(_capability_message(served, missing or frozenset({Capability.GENERATION})))
        return served

    async def generate(self, request: GenerateRequest,
                       timeout_s: float | None = None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Stream a language model's tokens; leaving early cancels the sequence.

        A generation that fails inside the model ends with a FinalEvent that
        carries the error, then raises it with its own kind, so callers that
        stream can still send what came before.
        """
        if self.num_streams >= self.max_streams:
            raise ResourceExhausted(f"daemon stream limit {self.max_streams} reached (max_streams={self.max_streams}); "
                                    "retry later or on another node")
        self.num_streams += 1
        try:
            with self._counting_call(request.model_name):
                # aclosing: a consumer that leaves early closes the inner stream
                # now (its sequence and memory freed), not whenever it is collected
                async with contextlib.aclosing(self._generate_or_fail_over(request, timeout_s)) as events:
                    async for event in events:
                        yield event
        finally:
            self.num_streams -= 1

    async def _generate(self, request: GenerateRequest, timeout_s: float | None,
                        fail_over: bool = False) -> AsyncIterator[TokenEvent | FinalEvent]:
        served = await self.generative(request.model_name, _generation_capabilities(request), fail_over)
        self.memory.acquire(served.key)
        started = time.perf_counter_ns()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        events = served.loaded.generate(request)
        try:
            while True:
                try:
                    event = await _next_event(events, deadline, timeout_s)
                except StopAsyncIteration:
                    break
                yield event
                if isinstance(event, FinalEvent) and event.error:
                    log.warning("generation_failed", model=request.model_name, request_id=request.request_id,
                                reason=event.error)
                    raise error_for(event.error_kind, event.error)
            self._count_success(served, time.perf_counter_ns() - started)
        except ModeldError:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        finally:
            await events.aclose()  # a consumer that left cancels its sequence now
            self.memory.release(served.key)

    async def tokenize(self, name: str, text: str) -> list[int]:
        return await _resolved((await self.generative(name)).loaded.tokenize(text))

    async def detokenize(self, name: str, token_ids: list[int]) -> str:
        return await _resolved((await self.generative(name)).loaded.detokenize(token_ids))

    # -- remote engines: health and the standby --------------------------------------

    async def _generate_or_fail_over(self, request: GenerateRequest,
                                     timeout_s: float | None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """_generate; a remote engine that fails before its first event hands
        the request to its standby, once: nothing reached the caller, so
        nothing is replayed (a stream that broke mid-way ends with its error)."""
        current = self._served.get(request.model_name)
        via_remote = current is not None and getattr(current.loaded, "is_healthy", False)
        attempt = self._generate(request, timeout_s)
        try:
            first = await attempt.__anext__()
        except StopAsyncIteration:
            return
        except Unavailable as exc:
            await attempt.aclose()
            if not (via_remote and self._served.get(request.model_name) is current and self._later_backends(current)):
                raise
            log.warning("remote_request_failed_over", model=request.model_name, backend=current.backend.name,
                        request_id=request.request_id, reason=str(exc))
            attempt = self._generate(request, timeout_s, fail_over=True)
            first = await attempt.__anext__()
        async with contextlib.aclosing(attempt):
            yield first
            async for event in attempt:
                yield event

    async def _route_around_unhealthy(self, served: ServedModel, fail_over: bool = False) -> ServedModel:
        """The model itself, or the standby on the next backend in its list
        (loaded on first need) while its remote engine is unhealthy, or for a
        request it just failed (fail_over). With no standby possible the
        remote is tried anyway (it may be back); a failed-over request fails."""
        is_healthy = getattr(served.loaded, "is_healthy", True) and not fail_over
        if is_healthy or not self._later_backends(served):
            return served
        self._start_standby(served)
        try:
            standby = await asyncio.shield(served.standby)
        except ModeldError as exc:
            log.warning("remote_fallback_failed", model=served.config.name, backend=served.backend.name,
                        reason=str(exc))
            if fail_over:
                raise
            return served
        # counted, but not as the backend's health: the remote's own tracker
        # follows this one server, while the backend (a protocol) spans many
        self.metrics.fallbacks.labels(served.config.name, served.backend.name, "run").inc()
        return standby

    def _start_standby(self, served: ServedModel) -> None:
        task = served.standby
        if task is not None and not (task.done() and (task.cancelled() or task.exception() is not None)):
            return  # loading or loaded (a failed load is tried again)
        served.standby = asyncio.get_running_loop().create_task(self._load_standby(served))

    def _later_backends(self, served: ServedModel) -> list[Backend]:
        return self.registry.load_order(served.config.backends, self.backend_health.is_healthy, after=served.backend)

    async def _load_standby(self, served: ServedModel) -> ServedModel:
        reasons = []
        for backend in self._later_backends(served):
            verdict = backend.can_serve(served.config, served.source.model_dir)
            if not verdict.ok:
                reasons.append(f"{backend.name}: {verdict.reason}")
                continue
            try:
                return await self._load_on(backend, served.source, frozenset({served.key}), register=False)
            except (LoadFailed, ResourceExhausted) as exc:
                reasons.append(f"{backend.name}: {exc}")
        raise Unavailable(f"model {served.config.name!r}: its {served.backend.name} engine fails or is unhealthy and no "
                          f"later backend in its list can stand in ({'; '.join(reasons) or 'the list names none'})")

    def _on_remote_health(self, served: ServedModel, is_healthy: bool) -> None:
        """A remote engine turned (un)healthy: health Watch follows it, the
        standby loads at once, and leaves when the remote is back."""
        name = served.config.name
        if self._served.get(name) is not served:
            return
        self._notify(name, ModelState.READY if is_healthy else ModelState.UNAVAILABLE)
        if is_healthy:
            asyncio.get_running_loop().create_task(self._drop_standby(served))
        elif self._later_backends(served):
            self._start_standby(served)
            served.standby.add_done_callback(_retrieve)

    async def _drop_standby(self, served: ServedModel) -> None:
        task, served.standby = served.standby, None
        if task is None:
            return
        if not task.done():
            # still loading, maybe waiting for the memory lock our caller holds: drop it once in
            task.add_done_callback(self._drop_loaded)
            return
        if not task.cancelled() and task.exception() is None:
            await self._drop(task.result())

    def _drop_loaded(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            asyncio.get_running_loop().create_task(self._drop(task.result()))

    async def _fall_back(self, failed: ServedModel, exc: BackendFailure) -> ServedModel:
        """Move a model whose backend failed at run time to the next backend."""
        name = failed.config.name
        self._count_fallback(name, failed.backend.name, "run", str(exc))
        log.warning("backend_run_failed", model=name, backend=failed.backend.name, reason=str(exc))
        current = self._served.get(name)
        if current is not None and current is not failed:
            return current  # another request already moved it
        later = self.registry.load_order(failed.config.backends, self.backend_health.is_healthy, after=failed.backend)
        for backend in later:
            if not backend.can_serve(failed.config, failed.source.model_dir).ok:
                continue
            try:
                served = await self._load_on(backend, failed.source, exclude=frozenset({failed.key}))
            except LoadFailed:
                continue
            asyncio.get_running_loop().create_task(self._drop(failed))
            return served
        raise Unavailable(f"model {name!r} failed on backend {failed.backend.name} and no other backend can serve it: {exc}")

    # -- backend health: fallbacks mark a backend unhealthy for a cool-down ----

    def unhealthy_backends(self) -> list[UnhealthyBackend]:
        return self.backend_health.unhealthy()

    def _count_fallback(self, model: str, backend: str, stage: str, reason: str) -> None:
        self.metrics.fallbacks.labels(model, backend, stage).inc()
        self.backend_health.record_fallback(backend, f"model {model!r} ({stage}): {reason}")

    def _on_backend_health(self, change: HealthChange) -> None:
        self.metrics.backend_healthy.labels(change.backend).set(1 if change.is_healthy else 0)
        if change.is_healthy:
            log.info("backend_recovered", backend=change.backend, reason=change.reason)
            return
        log.warning("backend_unhealthy", backend=change.backend, reason=change.reason,
                    cooldown_s=self.backend_health.policy.cooldown_s)
        self._schedule_health_refresh()

    def _schedule_health_refresh(self) -> None:
        """Wake when the earliest cool-down ends, so the metric and the log
        turn on time even when no load asks the tracker. A wake-up a little
        early (asyncio's clock resolution) finds nothing due and sleeps again."""
        if self._health_timer is not None:
            self._health_timer.cancel()
            self._health_timer = None
        delay = self.backend_health.next_recovery_in()  # also recovers what is due
        if delay is not None:
            self._health_timer = asyncio.get_running_loop().call_later(delay, self._schedule_health_refresh)


@contextlib.asynccontextmanager
async def _deadline(timeout_s: float | None):
    """The request's own timeout (KServe's `timeout` parameter): work not
    done by then is cancelled, queued requests leave the queue, and running
    sequences leave the batch at the next step."""
    if timeout_s is None:
        yield
        return
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise _timed_out(timeout_s) from None


async def _next_event(events: AsyncIterator, deadline: float | None, timeout_s: float | None):
    # The timeout covers only the wait for the model, never the caller's own
    # work between events: a stream is consumed across many awaits.
    # asyncio.timeout_at rather than wait_for: wait_for wraps every event's
    # wait in a task of its own, a cost paid per token (the loop's clock is
    # time.monotonic, the deadline's too)
    if deadline is None:
        return await events.__anext__()
    try:
        async with asyncio.timeout_at(deadline):
            return await events.__anext__()
    except TimeoutError:
        raise _timed_out(timeout_s) from None


async def _unload(loaded: LoadedModel) -> None:
    """Unload on a thread, or on the loop for a worker model (ending its process)."""
    unload_async = getattr(loaded, "unload_async", None)
    if unload_async is not None:
        await unload_async()
    else:
        await anyio.to_thread.run_sync(loaded.unload)


async def _resolved(value):
    """A backend's answer, awaited where it is a coroutine (a remote engine's)."""
    return await value if inspect.isawaitable(value) else value


def _retrieve(task: asyncio.Task) -> None:
    # a standby load that fails is reported by the request that needs it; here
    # only marked retrieved, so asyncio does not log it as forgotten
    if not task.cancelled():
        task.exception()


def _timed_out(timeout_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"the request's timeout of {timeout_s:g} s passed before it finished")


def _generation_capabilities(request: GenerateRequest) -> frozenset[Capability]:
    needed = {Capability.GENERATION, Capability.STREAMING}
    if request.params.speculative is not SpeculativeMode.NONE:
        needed.add(Capability.SPECULATIVE_DECODING)
    if request.params.logprobs:
        needed.add(Capability.LOGPROBS)
    return frozenset(needed)


def _capability_message(served: ServedModel, missing: frozenset[Capability]) -> str:
    names = ", ".join(sorted(c.value for c in missing))
    hints = "; ".join(_CAPABILITY_HINTS[c] for c in missing if c in _CAPABILITY_HINTS)
    return (f"model {served.config.name!r} is served by backend {served.backend.name!r}, which lacks {names}"
            + (f": {hints}" if hints else ""))
