"""Failover: a model whose backend fails moves on to the next backend in its
list. Two ways:

- a remote engine that turns unhealthy (or fails a request before its first
  event) is covered by a standby: the next backend's load of the same model,
  reached through the remote's ServedModel and dropped when the remote is
  back;
- a local backend that fails at run time (BackendFailure) hands the model to
  the next backend for good, the fallback counted against its health.
"""

from __future__ import annotations

import asyncio

import structlog

from modeld.backends.base import Backend
from modeld.backends.errors import BackendFailure, LoadFailed, ModeldError, ResourceExhausted, Unavailable
from modeld.server.metrics import Metrics
from modeld.server.requests import ModelState

from .health import BackendHealthWatch
from .loading import ModelLifecycle, NoBackendFits
from .served import ModelTable, ServedModel

log = structlog.get_logger("modeld.engine")


class Failover:
    def __init__(self, lifecycle: ModelLifecycle, health: BackendHealthWatch, metrics: Metrics) -> None:
        self.lifecycle = lifecycle
        self.models: ModelTable = lifecycle.models
        self.health = health
        self.metrics = metrics
        lifecycle.on_registered.append(self._follow_remote)

    def later_backends(self, served: ServedModel) -> list[Backend]:
        return self.lifecycle.backends_for(served.config, after=served.backend)

    # -- remote engines: the standby -------------------------------------------

    def can_fail_over(self, served: ServedModel) -> bool:
        """A request that failed on this (still current) model before its first
        event may be retried once on the standby."""
        return self.models.is_current(served) and bool(self.later_backends(served))

    async def route_around_unhealthy(self, served: ServedModel, fail_over: bool = False) -> ServedModel:
        """The model itself, or the standby on the next backend in its list
        (loaded on first need) while its remote engine is unhealthy, or for a
        request it just failed (fail_over). With no standby possible the
        remote is tried anyway (it may be back); a failed-over request fails."""
        remote = served.remote
        is_healthy = (remote is None or remote.is_healthy) and not fail_over
        if is_healthy or not self.later_backends(served):
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

    async def _load_standby(self, served: ServedModel) -> ServedModel:
        try:
            return await self.lifecycle.load_first_fit(
                served.source, self.later_backends(served), exclude=frozenset({served.key}), register=False,
                moves_on=(LoadFailed, ResourceExhausted))
        except NoBackendFits as exc:
            raise Unavailable(f"model {served.config.name!r}: its {served.backend.name} engine fails or is unhealthy "
                              f"and no later backend in its list can stand in ({exc or 'the list names none'})") from None

    def _follow_remote(self, served: ServedModel) -> None:
        remote = served.remote
        if remote is not None:
            remote.set_health_listener(lambda is_healthy: self._on_remote_health(served, is_healthy))

    def _on_remote_health(self, served: ServedModel, is_healthy: bool) -> None:
        """A remote engine turned (un)healthy: health Watch follows it, the
        standby loads at once, and leaves when the remote is back."""
        name = served.config.name
        if not self.models.is_current(served):
            return
        self.models.notify(name, ModelState.READY if is_healthy else ModelState.UNAVAILABLE)
        if is_healthy:
            asyncio.get_running_loop().create_task(self.lifecycle.drop_standby(served))
        elif self.later_backends(served):
            self._start_standby(served)
            served.standby.add_done_callback(_retrieve)

    # -- local backends: run-time fallback -------------------------------------------

    async def fall_back(self, failed: ServedModel, exc: BackendFailure) -> ServedModel:
        """Move a model whose backend failed at run time to the next backend."""
        name = failed.config.name
        self.health.count_fallback(name, failed.backend.name, "run", str(exc))
        log.warning("backend_run_failed", model=name, backend=failed.backend.name, reason=str(exc))
        current = self.models.get(name)
        if current is not None and current is not failed:
            return current  # another request already moved it
        try:
            served = await self.lifecycle.load_first_fit(failed.source, self.later_backends(failed),
                                                         exclude=frozenset({failed.key}))
        except NoBackendFits:
            raise Unavailable(f"model {name!r} failed on backend {failed.backend.name} and no other backend "
                              f"can serve it: {exc}") from None
        asyncio.get_running_loop().create_task(self.lifecycle.drop(failed))
        return served


def _retrieve(task: asyncio.Task) -> None:
    # a standby load that fails is reported by the request that needs it; here
    # only marked retrieved, so asyncio does not log it as forgotten
    if not task.cancelled():
        task.exception()
