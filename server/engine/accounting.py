"""Memory accounting: the budget's books kept true while models come and go.

`server/memory.py` is the pure LRU bookkeeping; this part makes room before a
load (evicting under one lock), swaps a load's estimate for its measured
bytes, follows worker processes as they grow, and keeps the daemon's own
resident memory in the books. Evicting is the lifecycle's job: it is passed
in as `evict`.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable

import structlog

from modeld.backends.errors import ResourceExhausted
from modeld.server.memory import MemoryManager, ModelKey
from modeld.server.metrics import Metrics
from modeld.server.os_memory import own_rss

from .served import ModelTable, ServedModel

log = structlog.get_logger("modeld.engine")

Evict = Callable[[ModelKey], Awaitable[None]]


class MemoryAccounting:
    def __init__(self, memory: MemoryManager, metrics: Metrics, models: ModelTable, evict: Evict) -> None:
        self.memory = memory
        self.metrics = metrics
        self._models = models
        self._evict = evict
        # Accounting and unload/evict decisions happen under this lock.
        self.lock = asyncio.Lock()
        # budget entries of loads still in progress: idle by the books (nothing
        # in flight), but evicting one would pull the books from under its load
        self.reserved: set[ModelKey] = set()
        self.num_dropping = 0  # models being dropped: their bytes leave the process before the books
        self._daemon_floor = 0  # the daemon's resident bytes at start, before any model
        self._daemon_samples: collections.deque[int] = collections.deque(maxlen=5)
        self._daemon_task: asyncio.Task | None = None
        metrics.budget_bytes.set(memory.budget)

    # -- loads ------------------------------------------------------------------

    async def reserve(self, key: ModelKey, estimate: int, is_pinned: bool, exclude: frozenset[ModelKey],
                      base: ModelKey | None = None) -> None:
        """Make room for a load's estimate and hold it in the books while it
        loads (base: a LoRA adapter's base, whose entry it is tied to)."""
        async with self.lock:
            for victim in self.memory.plan(estimate, exclude | self.reserved):
                await self._evict(victim)
            self.memory.add(key, estimate, is_pinned, base=base)
            self.reserved.add(key)

    def cancel(self, key: ModelKey) -> None:
        """A load that failed: its reservation leaves the books."""
        self.reserved.discard(key)
        self.memory.remove(key)

    async def settle(self, key: ModelKey, nbytes: int, exclude: frozenset[ModelKey]) -> None:
        """Swap the estimate for the backend's figure, evicting more if needed;
        the reservation ends either way."""
        try:
            async with self.lock:
                self.memory.resize(key, nbytes)
                if self.memory.free >= 0:
                    return
                try:
                    victims = self.memory.plan(0, exclude | self.reserved | {key})
                except ResourceExhausted:
                    self.memory.remove(key)
                    raise ResourceExhausted(self.memory.refusal(nbytes)) from None
                for victim in victims:
                    await self._evict(victim)
        finally:
            self.reserved.discard(key)

    def loaded(self, served: ServedModel) -> None:
        self.metrics.loaded_bytes.labels(served.config.name, served.backend.name).set(served.loaded.nbytes)
        self.metrics.used_bytes.set(self.memory.used)

    def dropped(self, served: ServedModel) -> None:
        self.memory.remove(served.key)
        self.metrics.loaded_bytes.remove(served.config.name, served.backend.name)
        self.metrics.used_bytes.set(self.memory.used)

    # -- growth after load ---------------------------------------------------------

    def resized(self, served: ServedModel, nbytes: int) -> None:
        """A worker's resident memory changed."""
        if served.key not in self.memory:
            return
        self.memory.resize(served.key, nbytes)
        self.metrics.loaded_bytes.labels(served.config.name, served.backend.name).set(nbytes)
        self.metrics.used_bytes.set(self.memory.used)
        if self.memory.free < 0:
            asyncio.get_running_loop().create_task(self.make_room(served))

    async def make_room(self, grown: ServedModel | None) -> None:
        """A worker (`grown`) or the daemon itself (None) grew past the budget:
        evict idle models to bring the books back under it (a grown model
        itself is busy or the most recent)."""
        async with self.lock:
            if self.memory.free >= 0:
                return
            keep = frozenset({grown.key}) if grown is not None else frozenset()
            try:
                victims = self.memory.plan(0, keep | self.reserved)
            except ResourceExhausted as exc:
                log.warning("memory_over_budget", model=grown.config.name if grown is not None else "",
                            daemon_bytes=self.memory.daemon_bytes, reason=str(exc))
                return
            for victim in victims:
                await self._evict(victim)

    # -- the daemon's own share of the budget ---------------------------------

    def count_daemon_memory(self, interval_s: float, window: int = 5) -> None:
        """Put the daemon's own resident memory in the books, from now on
        (call at start, before any model loads), re-read every `interval_s`
        so the books follow the process as it grows: imported runtimes,
        arenas, caches.

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
        self._daemon_task = asyncio.get_running_loop().create_task(self._follow_daemon_memory(interval_s))

    def refresh_daemon_bytes(self) -> None:
        """The daemon's share: its resident bytes less what its in-process
        models hold (worker models are other processes), never less than at
        start. Not read while a model loads or unloads in the daemon: its
        bytes are then in the process but not (or no longer) in the books."""
        if self._daemon_floor == 0 or self.reserved or self._models.unloading or self.num_dropping:
            return
        in_process = sum(self.memory.entry(key).nbytes for key in self.memory.keys_lru_first()
                         if not self._in_worker(key))
        self._daemon_samples.append(own_rss() - in_process)
        self.memory.daemon_bytes = max(self._daemon_floor, min(self._daemon_samples))
        self.metrics.daemon_bytes.set(self.memory.daemon_bytes)
        self.metrics.used_bytes.set(self.memory.used)

    def _in_worker(self, key: ModelKey) -> bool:
        served = self._models.get(key.model)
        return served is not None and served.backend.name == key.backend and served.worker is not None

    async def _follow_daemon_memory(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.refresh_daemon_bytes()
            if self.memory.free < 0:
                await self.make_room(None)

    def stop(self) -> None:
        if self._daemon_task is not None:
            self._daemon_task.cancel()
