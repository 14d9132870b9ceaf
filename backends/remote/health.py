"""Whether a remote engine is answering: pure bookkeeping, no I/O.

Invariants: `is_healthy` turns False after `unhealthy_after` consecutive
failures (an unreachable server at once: nothing listens, so waiting for
more proof only fails more requests), and True again on the first success.
While unhealthy, probes back off exponentially from `probe_interval_s` to
`max_probe_interval_s`, so a dead server costs a request now and then, not a
storm; while healthy, probes run every `probe_interval_s` (they also fetch
the engine's load figures).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable


class FailureKind(Enum):
    """What went wrong talking to a remote, as the health tracker counts it.

    A 4xx answer is none of these: the server is alive and refused the
    request on its merits."""

    UNREACHABLE = "unreachable"  # connection refused, no route, name unknown
    TIMEOUT = "timeout"  # connecting or waiting for the next byte took too long
    SERVER_ERROR = "server_error"  # HTTP 5xx (or TGI's 424), or an error event in a stream
    BROKEN_STREAM = "broken_stream"  # the answer stopped mid-way, was malformed, or ended early


HealthListener = Callable[[bool, str], None]  # (is_healthy, the reason of the change)


class HealthTracker:
    def __init__(self, unhealthy_after: int, probe_interval_s: float, max_probe_interval_s: float,
                 on_change: HealthListener | None = None) -> None:
        self.unhealthy_after = unhealthy_after
        self.probe_interval_s = probe_interval_s
        self.max_probe_interval_s = max_probe_interval_s
        self.on_change = on_change
        self.is_healthy = True
        self.num_failures = 0  # consecutive, since the last success
        self.num_failures_unhealthy = 0  # of those, since it turned unhealthy: each doubles the probe wait
        self.last_error = ""

    def record_success(self) -> None:
        self.num_failures = self.num_failures_unhealthy = 0
        if not self.is_healthy:
            self.is_healthy = True
            self._changed("the remote answers again")

    def record_failure(self, kind: FailureKind, reason: str) -> None:
        self.num_failures += 1
        self.last_error = reason
        if not self.is_healthy:
            self.num_failures_unhealthy += 1
        elif kind is FailureKind.UNREACHABLE or self.num_failures >= self.unhealthy_after:
            self.is_healthy = False
            self._changed(reason)

    def next_probe_in(self) -> float:
        """Seconds until the next probe."""
        if self.is_healthy:
            return self.probe_interval_s
        doublings = min(self.num_failures_unhealthy, 30)  # 2**30 already passes any sane maximum
        return min(self.probe_interval_s * 2.0 ** doublings, self.max_probe_interval_s)

    def _changed(self, reason: str) -> None:
        if self.on_change is not None:
            self.on_change(self.is_healthy, reason)
