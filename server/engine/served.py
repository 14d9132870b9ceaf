"""What the engine serves: one ServedModel per ready model, and the table
of every model's state (ready, loading, unloading, why its last load failed).

Pure state on the event loop: no I/O, no locks. Listeners hear each state
change (health Watch and the readiness probe follow them).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from modeld.backends.base import Backend, GenerativeModel, InWorkerProcess, LoadedModel, RemoteHealth
from modeld.backends.model_config import ModelConfig
from modeld.server.batcher import DynamicBatcher
from modeld.server.memory import ModelKey
from modeld.server.metrics import GenerationMetrics
from modeld.server.repository import ModelSource
from modeld.server.requests import ModelState, ModelStatus
from modeld.server.stats import ModelStats
from modeld.server.store import Progress
from modeld.server.versions import model_of, version_of

MODEL_VERSION = "1"  # what an entry without version folders serves as (server/versions.py)

StateListener = Callable[[str, ModelState], None]


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
    def generative(self) -> GenerativeModel:
        assert isinstance(self.loaded, GenerativeModel), "checked by the dispatcher's capability test"
        return self.loaded

    # the facets are asked per request; a runtime-checkable isinstance costs
    # microseconds and `loaded` never changes, so each is answered once
    @functools.cached_property
    def worker(self) -> InWorkerProcess | None:
        """The worker process facet, where the model runs in one."""
        return self.loaded if isinstance(self.loaded, InWorkerProcess) else None

    @functools.cached_property
    def remote(self) -> RemoteHealth | None:
        """The remote engine's health facet, where a remote engine serves it."""
        return self.loaded if isinstance(self.loaded, RemoteHealth) else None

    @property
    def key(self) -> ModelKey:
        return ModelKey(self.backend.name, self.config.name)


class ModelTable:
    """Every model the engine knows the state of, by name."""

    def __init__(self) -> None:
        self.served: dict[str, ServedModel] = {}
        self.loading: dict[str, asyncio.Task] = {}
        self.unloading: set[str] = set()
        self.failures: dict[str, str] = {}  # the reason the last load failed
        # store models being fetched: URI, bytes, and whether a gateway's calls wait for the pull
        self.pulling: dict[str, tuple[str, Progress, bool]] = {}
        self.pulled_dirs: dict[str, Path] = {}  # store models pulled and loading: their cache folders
        self.aliases: dict[str, str] = {}  # served models' served_names -> their names
        self._stats: dict[str, ModelStats] = {}
        self._listeners: list[StateListener] = []

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def notify(self, name: str, state: ModelState) -> None:
        for listener in self._listeners:
            listener(name, state)

    def get(self, name: str) -> ServedModel | None:
        return self.served.get(name)

    def register(self, served: ServedModel, real_names: Callable[[], list[str]]) -> None:
        """Serve `served` by its name and its served_names (not those that
        are another model's own name)."""
        name = served.config.name
        self.served[name] = served
        if served.config.served_names:
            taken = set(real_names())
            for alias in served.config.served_names:
                if alias not in taken:
                    self.aliases.setdefault(alias, name)

    def unregister(self, name: str) -> None:
        self.served.pop(name, None)
        for alias in [a for a, n in self.aliases.items() if n == name]:
            del self.aliases[alias]

    def is_current(self, served: ServedModel) -> bool:
        return self.served.get(served.config.name) is served

    def is_active(self, name: str) -> bool:
        """Served, loading or unloading: known to the engine beyond the repository."""
        return name in self.served or name in self.loading

    def state_of(self, name: str) -> ModelState:
        if name in self.unloading:
            return ModelState.UNLOADING
        if name in self.served:
            return ModelState.READY
        if name in self.pulling:
            return ModelState.PULLING
        if name in self.loading:
            return ModelState.LOADING
        return ModelState.UNAVAILABLE

    def status(self, key: str) -> ModelStatus:
        """A model version's status, by its key (server/versions.py): the
        status names the model and the version apart."""
        served = self.served.get(key)
        pulling = self.pulling.get(key) if served is None else None
        name, version = model_of(key), version_of(key)
        if pulling is not None:
            uri, progress, waits = pulling
            return ModelStatus(name, version, ModelState.PULLING,
                               f"pulling {uri}: {progress.done} of {progress.total} bytes",
                               pull_done=progress.done, pull_total=progress.total, waits_for_pull=waits)
        return ModelStatus(
            name, version, self.state_of(key), self.failures.get(key, ""),
            served.backend.name if served else "", served.loaded.nbytes if served else 0,
            base=served.config.base if served else "",
        )

    def names(self) -> set[str]:
        return set(self.served) | set(self.loading)

    def stats(self, name: str) -> ModelStats:
        stats = self._stats.get(name)
        if stats is None:  # not setdefault: a ModelStats is costly to make (two HDR histograms)
            stats = self._stats[name] = ModelStats()
        return stats
