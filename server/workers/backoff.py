"""How soon a model whose worker died may be started again.

A model that crashes its worker at once after every start (a bad file, a
runtime that aborts) must not be restarted in a tight loop: each start costs
seconds of CPU that the other models need. Each death within `reset_after_s`
of the worker's start doubles the wait before the next start, up to
`max_s`; a worker that lived longer than that starts the count afresh.
Pure bookkeeping with an injectable clock, so it is unit-tested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class _Streak:
    deaths: int = 0
    retry_at: float = 0.0
    reason: str = ""


@dataclass
class RestartBackoff:
    initial_s: float = 1.0
    max_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _streaks: dict[str, _Streak] = field(default_factory=dict)

    @property
    def reset_after_s(self) -> float:
        # a worker that outlived the longest wait was not crash-looping
        return max(self.max_s, self.initial_s)

    def delay_for(self, deaths: int) -> float:
        """The wait after `deaths` quick deaths in a row (1, 2, 4, ... x initial, capped)."""
        if deaths <= 0:
            return 0.0
        return min(self.initial_s * 2 ** min(deaths - 1, 62), self.max_s)

    def record_death(self, model: str, uptime_s: float, reason: str) -> float:
        """A worker of `model` died after `uptime_s`; returns the wait before the next start."""
        streak = self._streaks.setdefault(model, _Streak())
        streak.deaths = 1 if uptime_s > self.reset_after_s else streak.deaths + 1
        delay = self.delay_for(streak.deaths)
        streak.retry_at = self.clock() + delay
        streak.reason = reason
        return delay

    def retry_in(self, model: str) -> float:
        """Seconds until `model` may start again; 0 when it may now."""
        streak = self._streaks.get(model)
        if streak is None:
            return 0.0
        return max(streak.retry_at - self.clock(), 0.0)

    def last_reason(self, model: str) -> str:
        streak = self._streaks.get(model)
        return streak.reason if streak is not None else ""

    def deaths(self, model: str) -> int:
        streak = self._streaks.get(model)
        return streak.deaths if streak is not None else 0

    def forget(self, model: str) -> None:
        """An operator unloaded the model: its history no longer says anything."""
        self._streaks.pop(model, None)
