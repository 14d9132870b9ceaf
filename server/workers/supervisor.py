"""Which models run in a worker, and what happens when a worker dies.

The engine asks `isolates` at load time (the model's `isolation` key, else
the daemon's default), loads through `load`, reports each death with
`record_death`, and checks `check_backoff` before loading a model whose
worker died: during the backoff the request fails UNAVAILABLE saying when
the next start may happen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from modeld.backends.base import Backend
from modeld.backends.errors import Unavailable
from modeld.backends.model_config import Isolation
from modeld.backends.registry import NATIVE_LLM_BACKENDS, REMOTE_BACKENDS
from modeld.server.workers.backoff import RestartBackoff
from modeld.server.workers.stand_in import WorkerCrashedOnLoad, load_in_worker

log = structlog.get_logger("modeld.workers")



@dataclass(frozen=True)
class WorkerPolicy:
    default_isolation: Isolation = Isolation.IN_PROCESS
    load_timeout_s: float = 300.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    memory_interval_s: float = 2.0  # how often a worker's resident memory is re-read
    log_level: str = "info"
    log_format: str = "json"


class WorkerSupervisor:
    def __init__(self, policy: WorkerPolicy, metrics) -> None:
        self.policy = policy
        self.metrics = metrics
        self.backoff = RestartBackoff(policy.restart_backoff_s, policy.restart_backoff_max_s)

    def isolates(self, backend: Backend, config) -> bool:
        """Whether this model, on this backend, runs in a worker process."""
        if backend.name in REMOTE_BACKENDS:
            return False  # a remote engine holds nothing here to isolate
        isolation = getattr(config, "isolation", None) or self.policy.default_isolation
        if isolation == Isolation.AUTO:
            return backend.name in NATIVE_LLM_BACKENDS
        return isolation == Isolation.PROCESS

    def check_backoff(self, model: str) -> None:
        wait = self.backoff.retry_in(model)
        if wait > 0:
            raise Unavailable(
                f"model {model!r} is not restarted yet: its worker died {self.backoff.deaths(model)} time(s) in a row "
                f"(last: {self.backoff.last_reason(model)}); the next start may happen in {wait:.1f} s")

    async def load(self, backend: Backend, config, model_dir: Path):
        if self.backoff.deaths(config.name):
            self.metrics.worker_restarts.labels(config.name, backend.name).inc()
        started = time.monotonic()
        try:
            return await load_in_worker(backend.name, config, model_dir, self.policy.load_timeout_s,
                                        self.policy.log_level, self.policy.log_format)
        except WorkerCrashedOnLoad as exc:
            self.record_death(config.name, backend.name, str(exc), time.monotonic() - started, stage="load")
            raise

    def record_death(self, model: str, backend: str, how: str, uptime_s: float, stage: str = "run") -> float:
        delay = self.backoff.record_death(model, uptime_s, how)
        self.metrics.worker_deaths.labels(model, backend, stage).inc()
        log.error("worker_restart_backoff", model=model, backend=backend, stage=stage, reason=how,
                  deaths_in_a_row=self.backoff.deaths(model), retry_in_s=round(delay, 3))
        return delay

    def forget(self, model: str) -> None:
        self.backoff.forget(model)
