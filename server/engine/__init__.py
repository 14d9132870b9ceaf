"""The engine: finds a model, loads it on the right backend inside the memory
budget, batches and runs requests, and falls back when a backend fails.

Knows nothing of gRPC or HTTP: the data plane (server/dataplane.py) is its
one caller on the request path. All state changes happen on the event loop;
blocking backend work runs in threads. The parts, each owning one thing:

- served.py: ServedModel and the table of every model's state;
- loading.py: the model lifecycle (load, warm-up, unload, evict, workers);
- accounting.py: the memory budget's books, the daemon's own share included;
- health.py and failover.py: backend health, remote standbys, run-time fallback;
- dispatch.py and deadlines.py: tensor calls and generations.
"""

from __future__ import annotations

import inspect
from typing import AsyncIterator

from modeld.backends.errors import ErrorKind
from modeld.backends.generation.params import FinalEvent, GenerateRequest, TokenEvent
from modeld.backends.load_policy import LoadPolicy
from modeld.backends.registry import BackendRegistry
from modeld.server.backend_health import HealthPolicy, UnhealthyBackend
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository, ModelSource
from modeld.server.request_context import current_protocol
from modeld.server.requests import InferRequest, InferResult, ModelState, ModelStatus
from modeld.server.stats import ModelStats
from modeld.server.workers.supervisor import WorkerPolicy, WorkerSupervisor

from .accounting import MemoryAccounting
from .dispatch import Dispatcher, check_version
from .failover import Failover
from .health import BackendHealthWatch
from .loading import ModelLifecycle
from .served import MODEL_VERSION, ModelTable, ServedModel, StateListener

__all__ = ["Engine", "MODEL_VERSION", "ServedModel", "StateListener"]


class Engine:
    def __init__(self, repository: ModelRepository, registry: BackendRegistry, memory: MemoryManager,
                 metrics: Metrics, lazy_load: bool = True, health_policy: HealthPolicy = HealthPolicy(),
                 max_streams: int = 1024) -> None:
        self.repository = repository
        self.registry = registry
        self.memory = memory
        self.metrics = metrics
        self.models = ModelTable()
        self.health = BackendHealthWatch(health_policy, registry, metrics)
        self.backend_health = self.health.tracker
        self.accounting = MemoryAccounting(memory, metrics, self.models, lambda key: self.lifecycle.evict(key))
        # which models run in a worker process, and their restart backoff
        workers = WorkerSupervisor(WorkerPolicy(), metrics)
        self.lifecycle = ModelLifecycle(repository, registry, self.models, self.accounting, self.health, workers,
                                        metrics)
        # the disk cache never evicts a model the engine serves or is loading
        # (asked from a pull's thread: list() copies each dict in one step under the GIL)
        repository.store.in_use = lambda: ([s.source.model_dir for s in list(self.models.served.values())]
                                           + list(self.models.pulled_dirs.values()))
        self.failover = Failover(self.lifecycle, self.health, metrics)
        self.dispatch = Dispatcher(self.lifecycle, self.failover, metrics, lazy_load, max_streams)

    @property
    def workers(self) -> WorkerSupervisor:
        return self.lifecycle.workers

    def use_workers(self, policy: WorkerPolicy) -> None:
        """The daemon's worker settings (default isolation, load timeout, backoff)."""
        self.lifecycle.workers = WorkerSupervisor(policy, self.metrics)

    def use_load_policy(self, policy: LoadPolicy) -> None:
        """The daemon's settings on what models' files may reach, given to every load."""
        self.lifecycle.load_policy = policy

    # -- state ---------------------------------------------------------------

    def add_listener(self, listener: StateListener) -> None:
        self.models.add_listener(listener)

    def state_of(self, name: str) -> ModelState:
        return self.models.state_of(self.dispatch.canonical(name))

    def statuses(self) -> list[ModelStatus]:
        return [self.models.status(n) for n in sorted(set(self.repository.names()) | self.models.names())]

    def served(self, name: str) -> ServedModel | None:
        return self.models.get(self.models.aliases.get(name, name))

    def stats(self, name: str) -> ModelStats:
        return self.models.stats(self.models.aliases.get(name, name))

    def is_known(self, name: str) -> bool:
        """Served, loading, or in the repository."""
        return self.dispatch.is_known(name)

    def check_version(self, name: str, version: str) -> None:
        check_version(name, version)

    def count_failure(self, model: str, kind: ErrorKind) -> None:
        """One failed call, by model, status and protocol, whatever front it came in by."""
        if model and not self.is_known(model):
            model = ""  # names clients made up would grow the series without bound
        self.metrics.failures.labels(model, kind.value, current_protocol()).inc()

    def unhealthy_backends(self) -> list[UnhealthyBackend]:
        return self.health.unhealthy()

    # -- lifecycle -------------------------------------------------------------

    async def load(self, name: str, source: ModelSource | None = None) -> ServedModel:
        return await self.lifecycle.load(name, source)

    async def unload(self, name: str, forget_inline: bool = True) -> None:
        await self.lifecycle.unload(name, forget_inline)

    async def ensure_loaded(self, name: str, version: str = "") -> ServedModel:
        return await self.dispatch.ensure_loaded(name, version)

    def count_daemon_memory(self, interval_s: float | None = None, window: int = 5) -> None:
        """Put the daemon's own resident memory in the budget's books (call at
        start, before any model loads), re-read every `interval_s` (the
        workers' memory interval by default)."""
        interval = interval_s if interval_s is not None else self.workers.policy.memory_interval_s
        self.accounting.count_daemon_memory(interval, window)

    def refresh_daemon_bytes(self) -> None:
        self.accounting.refresh_daemon_bytes()

    async def stop(self) -> None:
        self.accounting.stop()
        self.health.stop()
        await self.lifecycle.stop()

    # -- requests -------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResult:
        return await self.dispatch.infer(request)

    def generate(self, request: GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[TokenEvent | FinalEvent]:
        return self.dispatch.generate(request, timeout_s)

    async def generative(self, name: str) -> ServedModel:
        return await self.dispatch.generative(name)

    async def tokenize(self, name: str, text: str) -> list[int]:
        return await _resolved((await self.generative(name)).generative.tokenize(text))

    async def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The token ids generation would feed for this request's prompt."""
        return await _resolved((await self.generative(request.model_name)).generative.prompt_ids(request))

    async def detokenize(self, name: str, token_ids: list[int]) -> str:
        return await _resolved((await self.generative(name)).generative.detokenize(token_ids))


async def _resolved(value):
    """A model's answer, awaited where it is a coroutine (a remote engine's or a worker's)."""
    return await value if inspect.isawaitable(value) else value
