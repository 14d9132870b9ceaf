"""The model lifecycle: load (one try-backends-in-order loop, shared by first
loads, standbys and fallbacks), warm up, unload, evict, and follow worker
processes until they end.

Loads run one at a time so a backend's measured memory growth is its own;
concurrent loads of one model share one load.

A LoRA adapter (`format = "lora"`) loads its base first, then becomes
resident on the base's runtime, in the daemon or in the base's worker
process: its own entry in the budget (its measured bytes), tied to the
base's, so the base outlives its adapters; the base's unload, eviction or
worker death drops them first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

import anyio
import structlog

from modeld.backends.artifact_paths import scrub_paths
from modeld.backends.base import Backend, Capability, GenerativeModel, LoadedModel
from modeld.backends.errors import (
    FailedPrecondition, InvalidArgument, LoadFailed, ModeldError, NotFound, ResourceExhausted, error_for,
)
from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams
from modeld.backends.load_policy import LoadPolicy
from modeld.backends.model_config import ModelConfig, WhilePulling
from modeld.backends.registry import REMOTE_BACKENDS, BackendRegistry
from modeld.server.batcher import BatchReport, DynamicBatcher
from modeld.server.load_priority import run_lowered
from modeld.server.memory import ModelKey
from modeld.server.metrics import GenerationMetrics, Metrics
from modeld.server.os_memory import release_freed_memory
from modeld.server.repository import ModelRepository, ModelSource
from modeld.server.requests import ModelState
from modeld.server.rerank import resolve_embedding_model
from modeld.server.validation import warmup_inputs
from modeld.server.workers.supervisor import WorkerSupervisor

from .accounting import MemoryAccounting
from .health import BackendHealthWatch
from .served import ModelTable, ServedModel

log = structlog.get_logger("modeld.engine")

Registered = Callable[[ServedModel], None]


class NoBackendFits(Exception):
    """Every backend in the list refused the model or failed to load it."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class ModelLifecycle:
    def __init__(self, repository: ModelRepository, registry: BackendRegistry, models: ModelTable,
                 accounting: MemoryAccounting, health: BackendHealthWatch, workers: WorkerSupervisor,
                 metrics: Metrics) -> None:
        self.repository = repository
        self.registry = registry
        self.models = models
        self.accounting = accounting
        self.health = health
        self.workers = workers
        self.metrics = metrics
        self._load_lock = asyncio.Lock()
        self.load_policy = LoadPolicy()  # the daemon's settings (Engine.use_load_policy)
        # told of each model as it starts serving by name (failover follows remote engines)
        self.on_registered: list[Registered] = []

    # -- loading -------------------------------------------------------------

    async def load(self, name: str, source: ModelSource | None = None) -> ServedModel:
        """Load a model; concurrent loads of the same model share one load.

        With `source` (an inline model) an already loaded model is replaced.
        """
        loading = self.models.loading
        if name in loading:
            if source is None:
                return await asyncio.shield(loading[name])
            try:  # an inline reload waits for the load in progress, then replaces it
                await asyncio.shield(loading[name])
            except ModeldError:
                pass
        if source is None and name in self.models.served:
            return self.models.served[name]
        task = asyncio.get_running_loop().create_task(self._load(name, source))
        loading[name] = task
        task.add_done_callback(lambda done: self._load_finished(name, done))
        self.models.notify(name, ModelState.LOADING)
        return await asyncio.shield(task)

    def _load_finished(self, name: str, task: asyncio.Task) -> None:
        if self.models.loading.get(name) is task:
            del self.models.loading[name]
            self.models.pulled_dirs.pop(name, None)
        if not task.cancelled():
            task.exception()  # marks it retrieved even when every waiter left
        self.models.notify(name, self.models.state_of(name))

    async def _load(self, name: str, source: ModelSource | None) -> ServedModel:
        source = source or self.repository.resolve(name)
        if source.config.is_adapter:
            return await self._load_adapter(name, source)
        if source.config.source:
            source = await self._pull(name, source)
        source = resolve_embedding_model(self._resolve_draft(source), self.repository)
        if name in self.models.served:
            await self.unload(name, forget_inline=False)
        self.workers.check_backoff(name)  # a model whose worker keeps dying waits its turn

        def count(backend: Backend, exc: Exception) -> None:
            self.health.count_fallback(name, backend.name, "load", str(exc))
            log.warning("backend_load_failed", model=name, backend=backend.name, reason=str(exc))

        try:
            served = await self.load_first_fit(source, self.backends_for(source.config), on_failure=count)
        except NoBackendFits as exc:
            self.metrics.loads.labels(name, "failed").inc()
            # the runtimes' reasons may hold the model folder's absolute path
            # (an inline model's is a daemon temp folder) or other files'
            reason = scrub_paths(str(exc), (source.model_dir,)) or "no backend is available for its format"
            self.models.failures[name] = reason
            raise InvalidArgument(f"no backend could load model {name!r}: {reason}") from None
        self.models.failures.pop(name, None)
        self.metrics.loads.labels(name, "ok").inc()
        return served

    # -- LoRA adapters -------------------------------------------------------------

    async def _load_adapter(self, name: str, source: ModelSource) -> ServedModel:
        try:
            served = await self._load_adapter_on_base(name, source)
        except ModeldError as exc:
            self.metrics.loads.labels(name, "failed").inc()
            self.models.failures[name] = str(exc)
            raise
        self.models.failures.pop(name, None)
        self.metrics.loads.labels(name, "ok").inc()
        return served

    async def _load_adapter_on_base(self, name: str, source: ModelSource) -> ServedModel:
        config = source.config
        base = await self._adapter_base(name, config.base)
        if name in self.models.served:
            await self.unload(name, forget_inline=False)
        await self._make_room_for_adapter(name, base)
        key = ModelKey(base.backend.name, name)
        artifact = source.model_dir / config.artifact_path
        estimate = artifact.stat().st_size if artifact.is_file() else 0
        await self.accounting.reserve(key, estimate, config.pinned, frozenset({base.key}), base=base.key)
        try:
            async with self._load_lock:
                if base.worker is not None:  # on the base's runtime in its worker process
                    loaded = await base.loaded.load_adapter_async(config, source.model_dir)
                else:
                    loaded = await anyio.to_thread.run_sync(base.loaded.load_adapter, config, source.model_dir)
        except BaseException:
            self.accounting.cancel(key)
            raise
        try:
            await self.accounting.settle(key, loaded.nbytes, frozenset({base.key}))
        except ResourceExhausted:
            await loaded.unload_async()
            raise
        served = await self._start(self._make_served(config, source, base.backend, loaded))
        log.info("model_loaded", model=name, base=config.base, backend=base.backend.name, nbytes=loaded.nbytes)
        self.models.register(served, self.repository.names)
        self.models.notify(name, ModelState.READY)
        return served

    async def _adapter_base(self, name: str, base_name: str) -> ServedModel:
        """The adapter's base, loaded (it loads now if it is not), checked able to apply adapters."""
        try:
            base_source = self.repository.resolve(base_name)
        except NotFound:
            raise InvalidArgument(f"adapter {name!r}: config key base names {base_name!r}, which is not a model in "
                                  "the repository") from None
        if base_source.config.is_adapter:
            raise InvalidArgument(f"adapter {name!r}: config key base names {base_name!r}, itself an adapter; "
                                  "name the model it adapts")
        base = await self.load(base_name)
        if Capability.LORA not in base.backend.capabilities:
            takes = sorted(b.name for b in self.registry.available() if Capability.LORA in b.capabilities)
            where = [f"{n} (a remote engine)" if n in REMOTE_BACKENDS else f"{n} (in the daemon or a worker process)"
                     for n in takes]
            raise FailedPrecondition(
                f"adapter {name!r}: its base {base_name!r} is served by the {base.backend.name} backend, which "
                "cannot apply LoRA adapters; serve the base on a backend that does: "
                + (", ".join(where) or "none is available on this node"))
        return base

    def adapters_of(self, base_name: str) -> list[ServedModel]:
        return [s for s in self.models.served.values() if s.config.is_adapter and s.config.base == base_name]

    async def _make_room_for_adapter(self, name: str, base: ServedModel) -> None:
        """Keep the base's adapters within lora.max_loaded_loras: unload its
        least recently used idle one if the new one would pass the cap."""
        cap = base.config.lora.max_loaded_loras
        resident = {s.key: s for s in self.adapters_of(base.config.name)}
        if len(resident) < cap:
            return
        async with self.accounting.lock:
            memory = self.accounting.memory
            idle = [k for k in memory.adapters_of(base.key) if k in resident and memory.entry(k).is_evictable]
            if not idle:
                raise ResourceExhausted(
                    f"adapter {name!r}: its base {base.config.name!r} holds lora.max_loaded_loras = {cap} adapters, "
                    "every one busy or pinned; retry later or raise the base's lora.max_loaded_loras")
            await self.evict(idle[0])

    async def _pull(self, name: str, source: ModelSource) -> ModelSource:
        """Fetch a store model's files into the disk cache (PULLING meanwhile)."""
        future, progress = self.repository.start_pull(source)
        self.models.pulling[name] = (source.config.source, progress,
                                     source.config.while_pulling is WhilePulling.WAIT)
        self.models.notify(name, ModelState.PULLING)
        try:
            pulled = await asyncio.shield(future)
        except ModeldError as exc:
            self.metrics.loads.labels(name, "failed").inc()
            self.models.failures[name] = str(exc)
            raise
        finally:
            self.models.pulling.pop(name, None)
        self.models.notify(name, ModelState.LOADING)
        pulled_source = self.repository.pulled_source(source, pulled)
        self.models.pulled_dirs[name] = pulled_source.model_dir  # in use until the load ends
        return pulled_source

    def backends_for(self, config: ModelConfig, after: Backend | None = None) -> list[Backend]:
        """The model's backends in the order to try them (healthy first), from after `after`."""
        return self.registry.load_order(config.backends, self.health.is_healthy, after=after)

    async def load_first_fit(self, source: ModelSource, backends: list[Backend], *,
                             exclude: frozenset[ModelKey] = frozenset(), register: bool = True,
                             moves_on: tuple[type[Exception], ...] = (LoadFailed,),
                             on_failure: Callable[[Backend, Exception], None] | None = None) -> ServedModel:
        """The first backend in `backends` that can serve the model and loads
        it; a `moves_on` failure tries the next. Raises NoBackendFits with
        every backend's reason."""
        reasons: list[str] = []
        for backend in backends:
            verdict = backend.can_serve(source.config, source.model_dir)
            if not verdict.ok:
                reasons.append(f"{backend.name}: {verdict.reason}")
                continue
            try:
                return await self._load_on(backend, source, exclude, register)
            except moves_on as exc:
                reasons.append(f"{backend.name}: {exc}")
                if on_failure is not None:
                    on_failure(backend, exc)
        raise NoBackendFits(reasons)

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

    async def _load_on(self, backend: Backend, source: ModelSource, exclude: frozenset[ModelKey],
                       register: bool) -> ServedModel:
        config = dataclasses.replace(source.config, policy=self.load_policy)
        key = ModelKey(backend.name, config.name)
        estimate = backend.estimate_bytes(config, source.model_dir)
        await self.accounting.reserve(key, estimate, config.pinned, exclude)
        try:
            async with self._load_lock:
                if self.workers.isolates(backend, config):
                    loaded = await self.workers.load(backend, config, source.model_dir)
                else:
                    loaded = await anyio.to_thread.run_sync(run_lowered, backend.load, config, source.model_dir)
        except BaseException:
            self.accounting.cancel(key)
            raise
        try:
            await self.accounting.settle(key, loaded.nbytes, exclude)
        except ResourceExhausted:
            await loaded.unload_async()
            raise
        served = await self._start(self._make_served(config, source, backend, loaded))
        log.info("model_loaded", model=config.name, backend=backend.name, nbytes=loaded.nbytes, estimate=estimate,
                 standby=not register)
        if register:  # else a remote model's standby: reached through it, never by name
            self.models.register(served, self.repository.names)
            for listener in self.on_registered:
                listener(served)
            self.models.notify(config.name, ModelState.READY)
        return served

    async def _start(self, served: ServedModel) -> ServedModel:
        """Start serving: worker followed, batcher or loop started, warmed up."""
        if served.worker is not None and not served.config.is_adapter:  # an adapter dies with its base's worker
            self._follow_worker(served)
        # set before warm-up: a failed warm-up drops the model, which removes this series
        self.accounting.loaded(served)
        loaded = served.loaded
        if isinstance(loaded, GenerativeModel):
            await loaded.start()
        else:
            served.batcher.start()
        if served.config.warmup:
            await self._warm_up(served)
        if isinstance(loaded, GenerativeModel):
            # after warm-up, so the dummy sequence is not counted as traffic
            served.generation = GenerationMetrics(self.metrics, served.config.name, served.backend.name)
            loaded.set_observer(served.generation)
        return served

    def _make_served(self, config: ModelConfig, source: ModelSource, backend: Backend,
                     loaded: LoadedModel) -> ServedModel:
        stats = self.models.stats(config.name)
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
        execute = loaded.execute_async if served.worker is not None else loaded.execute
        served.batcher = DynamicBatcher(execute, config.max_batch_size, config.max_queue_delay_us,
                                        config.max_queue_size, on_batch, config.preferred_batch_sizes)
        return served

    async def _warm_up(self, served: ServedModel) -> None:
        """One dummy request before the model reports ready, straight to the
        batcher or the generation loop, so ModelStatistics never counts it."""
        try:
            if served.is_generative:
                await _warm_up_generation(served)
            else:
                await served.batcher.submit(warmup_inputs(served.loaded.inputs, served.config.is_batched), ())
        except ModeldError as exc:
            await self.drop(served)
            raise LoadFailed(f"warm-up request failed: {exc}") from exc
        served.warmed_up = True

    # -- unloading -----------------------------------------------------------

    async def unload(self, name: str, forget_inline: bool = True) -> None:
        """Stop taking requests, finish queued ones, free the memory."""
        loading = self.models.loading
        if name in loading and asyncio.current_task() is not loading[name]:
            try:
                await asyncio.shield(loading[name])
            except ModeldError:
                pass
        served = self.models.get(name)
        if served is None:
            if name not in self.repository.names():
                raise NotFound(f"unknown model {name!r}")
        else:
            self.models.unloading.add(name)
            self.models.notify(name, ModelState.UNLOADING)
            try:
                await self.drop(served)
            finally:
                self.models.unloading.discard(name)
        if forget_inline:
            self.repository.remove_inline(name)
        self.workers.forget(name)  # an operator's unload clears a crash loop's backoff
        self.models.notify(name, ModelState.UNAVAILABLE)

    async def drop(self, served: ServedModel) -> None:
        """Stop one ServedModel and free what it holds (its standby, and
        its LoRA adapters, first)."""
        if self.models.is_current(served):
            for adapter in self.adapters_of(served.config.name):
                await self.drop(adapter)
                self.models.notify(adapter.config.name, ModelState.UNAVAILABLE)
            self.models.unregister(served.config.name)
        self.accounting.num_dropping += 1
        try:
            await self.drop_standby(served)
            if served.batcher is not None:
                await served.batcher.stop()
            else:
                await served.generative.stop()
            await served.loaded.unload_async()
            await anyio.to_thread.run_sync(release_freed_memory)
        finally:
            self.accounting.num_dropping -= 1
        self.accounting.dropped(served)
        log.info("model_unloaded", model=served.config.name, backend=served.backend.name)

    async def drop_standby(self, served: ServedModel) -> None:
        task, served.standby = served.standby, None
        if task is None:
            return
        if not task.done():
            # still loading, maybe waiting for the memory lock our caller holds: drop it once in
            task.add_done_callback(self._drop_loaded)
            return
        if not task.cancelled() and task.exception() is None:
            await self.drop(task.result())

    def _drop_loaded(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            asyncio.get_running_loop().create_task(self.drop(task.result()))

    async def evict(self, key: ModelKey) -> None:
        name = key.model
        served = self.models.get(name)
        log.info("model_evicted", model=name, backend=key.backend)
        if served is not None and served.standby is not None and served.backend.name != key.backend:
            self.metrics.evictions.labels(name, key.backend).inc()
            await self.drop_standby(served)
            return
        if served is None or served.backend.name != key.backend:
            self.accounting.memory.remove(key)
            return
        self.metrics.evictions.labels(name, served.backend.name).inc()
        await self.drop(served)
        self.models.notify(name, ModelState.UNAVAILABLE)

    async def stop(self) -> None:
        for name in list(self.models.served):
            served = self.models.served.get(name)
            if served is not None:  # an adapter went with its base already
                await self.drop(served)

    # -- worker processes ---------------------------------------------------------

    def _follow_worker(self, served: ServedModel) -> None:
        """A worker model's memory follows its process's resident memory, and
        its death drops the model (its calls in flight already failed)."""
        in_worker = served.worker
        in_worker.worker.on_death = lambda how: asyncio.get_running_loop().create_task(self._worker_died(served, how))
        in_worker.watch_memory(lambda nbytes: self.accounting.resized(served, nbytes),
                               self.workers.policy.memory_interval_s)

    async def _worker_died(self, served: ServedModel, how: str) -> None:
        name = served.config.name
        worker = served.worker.worker
        self.workers.record_death(name, served.backend.name, how, time.monotonic() - worker.started)
        if not self.models.is_current(served) or name in self.models.unloading:
            return  # already being replaced or unloaded: that path drops it
        self.models.failures[name] = str(worker.death)
        # its adapters went with the process: they are dropped with it (never
        # left served on a worker that no longer holds them), and the next
        # request naming one loads the base and the adapter again
        for adapter in self.adapters_of(name):
            self.models.failures[adapter.config.name] = (
                f"its base {name!r} was unloaded when its worker died ({how}); the next request loads both again")
        await self.drop(served)
        self.models.notify(name, ModelState.UNAVAILABLE)


async def _warm_up_generation(served: ServedModel) -> None:
    # cache_prompt off: a warm-up must not leave a cached prefix behind
    request = GenerateRequest(served.config.name, prompt="warm-up",
                              params=SamplingParams(max_tokens=1, cache_prompt=False))
    async for event in served.generative.generate(request):
        if isinstance(event, FinalEvent) and event.error:
            raise error_for(event.error_kind, event.error)
