"""Backend health from fallbacks: pure bookkeeping, no I/O, the clock passed in.

The engine counts a fallback each time a backend fails a model (a load, or a
run after which the model moves on); this tracker turns those counts into a
per-backend verdict the registry orders new loads by.

Invariants:
- a backend turns unhealthy at its `unhealthy_after`-th fallback within
  `window_s` (older ones have expired);
- it stays unhealthy for `cooldown_s` from that moment, whatever happens
  meanwhile: it is then tried only as a last resort, so its failures say
  nothing new and are not counted;
- it recovers with an empty history, so it takes `unhealthy_after` new
  fallbacks to mark it again.
Listeners hear each change once, in order. Recoveries are noticed when the
tracker is asked anything (or `refresh` is called): the engine calls
`refresh` when `next_recovery_in` says the earliest cool-down ends.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class HealthPolicy:
    # Above the 3-4 attempts a client's retry policy makes for one failing
    # request, so one caller retrying one bad model does not condemn the
    # backend on its own.
    unhealthy_after: int = 5
    window_s: float = 60.0
    # Long enough that a failing backend is not retried at every load, short
    # enough that a passing fault (a model file being replaced, a busy
    # device) costs half a minute on the next backend at most.
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.unhealthy_after, bool) or not isinstance(self.unhealthy_after, int) \
                or self.unhealthy_after < 1:
            raise ValueError(f"backend_unhealthy_after must be an integer >= 1, got {self.unhealthy_after!r}")
        for key, value in (("backend_health_window_s", self.window_s), ("backend_cooldown_s", self.cooldown_s)):
            if not value > 0:
                raise ValueError(f"{key} must be > 0, got {value!r}")


@dataclass(frozen=True)
class HealthChange:
    backend: str
    is_healthy: bool
    reason: str


@dataclass(frozen=True)
class UnhealthyBackend:
    name: str
    reason: str  # the fallbacks that marked it
    retry_in_s: float  # until new loads try it again


@dataclass(frozen=True)
class _Episode:
    reason: str
    until: float  # the tracker's clock


HealthListener = Callable[[HealthChange], None]


class BackendHealthTracker:
    def __init__(self, policy: HealthPolicy = HealthPolicy(), clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._fallbacks: dict[str, deque[float]] = {}  # backend -> times of its recent fallbacks
        self._unhealthy: dict[str, _Episode] = {}
        self._listeners: list[HealthListener] = []

    def add_listener(self, listener: HealthListener) -> None:
        self._listeners.append(listener)

    def record_fallback(self, backend: str, reason: str) -> None:
        now = self._refresh()
        if backend in self._unhealthy:
            return
        times = self._fallbacks.setdefault(backend, deque())
        times.append(now)
        while times[0] <= now - self.policy.window_s:
            times.popleft()
        if len(times) >= self.policy.unhealthy_after:
            self._mark_unhealthy(backend, now, f"{len(times)} fallbacks within {self.policy.window_s:g}s; "
                                              f"last: {reason}")

    def is_healthy(self, backend: str) -> bool:
        self._refresh()
        return backend not in self._unhealthy

    def unhealthy(self) -> list[UnhealthyBackend]:
        now = self._refresh()
        return [UnhealthyBackend(name, episode.reason, max(0.0, episode.until - now))
                for name, episode in sorted(self._unhealthy.items())]

    def next_recovery_in(self) -> float | None:
        """Seconds until the earliest cool-down ends; None while all are healthy."""
        now = self._refresh()
        return min((e.until - now for e in self._unhealthy.values()), default=None)

    def refresh(self) -> None:
        self._refresh()

    def _refresh(self) -> float:
        now = self._clock()
        for name in [n for n, e in self._unhealthy.items() if e.until <= now]:
            del self._unhealthy[name]
            self._changed(HealthChange(name, True, f"cool-down of {self.policy.cooldown_s:g}s over; "
                                                   "new loads try it again"))
        return now

    def _mark_unhealthy(self, backend: str, now: float, reason: str) -> None:
        self._fallbacks.pop(backend, None)  # it recovers with an empty history
        self._unhealthy[backend] = _Episode(reason, now + self.policy.cooldown_s)
        self._changed(HealthChange(backend, False, reason))

    def _changed(self, change: HealthChange) -> None:
        for listener in self._listeners:
            listener(change)
