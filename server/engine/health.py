"""Backend health as the engine sees it: each fallback counted against its
backend, which turns unhealthy for a cool-down (the tracker in
server/backend_health.py decides), with the metric and the log following on
time."""

from __future__ import annotations

import asyncio

import structlog

from modeld.backends.registry import BackendRegistry
from modeld.server.backend_health import BackendHealthTracker, HealthChange, HealthPolicy, UnhealthyBackend
from modeld.server.metrics import Metrics

log = structlog.get_logger("modeld.engine")


class BackendHealthWatch:
    def __init__(self, policy: HealthPolicy, registry: BackendRegistry, metrics: Metrics) -> None:
        self.metrics = metrics
        self.tracker = BackendHealthTracker(policy)
        self.tracker.add_listener(self._on_change)
        self._timer: asyncio.TimerHandle | None = None
        for backend in registry.available():
            metrics.backend_healthy.labels(backend.name).set(1)

    def is_healthy(self, backend: str) -> bool:
        return self.tracker.is_healthy(backend)

    def unhealthy(self) -> list[UnhealthyBackend]:
        return self.tracker.unhealthy()

    def count_fallback(self, model: str, backend: str, stage: str, reason: str) -> None:
        self.metrics.fallbacks.labels(model, backend, stage).inc()
        self.tracker.record_fallback(backend, f"model {model!r} ({stage}): {reason}")

    def _on_change(self, change: HealthChange) -> None:
        self.metrics.backend_healthy.labels(change.backend).set(1 if change.is_healthy else 0)
        if change.is_healthy:
            log.info("backend_recovered", backend=change.backend, reason=change.reason)
            return
        log.warning("backend_unhealthy", backend=change.backend, reason=change.reason,
                    cooldown_s=self.tracker.policy.cooldown_s)
        self._schedule_refresh()

    def _schedule_refresh(self) -> None:
        """Wake when the earliest cool-down ends, so the metric and the log
        turn on time even when no load asks the tracker. A wake-up a little
        early (asyncio's clock resolution) finds nothing due and sleeps again."""
        self.stop()
        delay = self.tracker.next_recovery_in()  # also recovers what is due
        if delay is not None:
            self._timer = asyncio.get_running_loop().call_later(delay, self._schedule_refresh)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
