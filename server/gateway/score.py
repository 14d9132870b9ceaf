"""A health score per node in [0, 1], which weights the gateway's routing.

    score = (errors   * (1 - error rate over the window)
           + latency  * min(1, baseline p99 / current p99)
           + memory   * free fraction of the node's memory
           + pressure * (1 - min(1, in-flight calls / max_in_flight)))
            / sum of the weights

A node that answers everything, as fast as it usually does, with memory to
spare and nothing queued scores 1. The breaker decides whether a node gets
calls at all; the score decides how much of the traffic it attracts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from .breaker import ErrorWindow
from .hedge import RollingHistogram

Clock = Callable[[], float]

# A window's p99 with fewer calls behind it is one of its slowest few calls,
# too noisy to become the node's normal.
MIN_BASELINE_SAMPLES = 20
# How fast the baseline may rise, per completed window: 5% per 15 s half-window
# (the default) doubles it in about 3.5 minutes, so a node that has really
# become slower (a bigger model, a busier GPU) stops looking degraded after a
# few minutes, while a spike of a window or two barely moves it.
BASELINE_RISE = 1.05
# score() reuses its latency factor for this long: computing it reads two
# histograms (about 50 us), and the gateway scores a few nodes per request.
LATENCY_REFRESH_S = 0.1


@dataclass(frozen=True)
class ScoreWeights:
    errors: float = 0.4
    latency: float = 0.3
    memory: float = 0.2
    pressure: float = 0.1

    def __post_init__(self) -> None:
        values = [getattr(self, f.name) for f in fields(self)]
        if any(v < 0 for v in values) or sum(values) <= 0:
            raise ValueError(f"score weights must be non-negative with a positive sum, got {self}")

    @property
    def total(self) -> float:
        return self.errors + self.latency + self.memory + self.pressure


class NodeHealth:
    """What the gateway knows of one node's health: outcomes and latencies of
    the calls it sent there, and the memory and in-flight count the node reports."""

    def __init__(
        self,
        weights: ScoreWeights = ScoreWeights(),
        clock: Clock = time.monotonic,
        window_s: float = 30.0,
        max_in_flight: int = 64,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._weights = weights
        self._clock = clock
        self._max_in_flight = max_in_flight
        self._errors = ErrorWindow(window_s, clock)
        self._latency = RollingHistogram(window_s, clock, on_rotate=self._absorb_window)
        self._baseline: float | None = None
        self._free_fraction = 1.0
        self._num_in_flight = 0
        self._latency_factor_cache = (float("-inf"), 1.0)  # (computed at, value)

    def record(self, ok: bool, latency_s: float | None = None) -> None:
        """One call's outcome: ok=False only for server failures; the latency
        of successful calls (a failure's latency says little about the node)."""
        self._errors.record(failed=not ok)
        if ok and latency_s is not None:
            self._latency.record(latency_s)

    def set_memory(self, used: int, total: int) -> None:
        free = 1.0 - used / total if total > 0 else 1.0
        self._free_fraction = min(1.0, max(0.0, free))

    def set_in_flight(self, n: int) -> None:
        self._num_in_flight = max(0, n)

    def error_rate(self) -> float:
        return self._errors.failure_rate()

    def p99(self) -> float | None:
        """p99 latency in seconds over the last window_s / 2 .. window_s seconds."""
        return self._latency.quantile(0.99)

    def baseline_p99(self) -> float | None:
        """The node's normal p99: the lowest p99 of a full window seen so far,
        allowed to rise by BASELINE_RISE per window so that one lucky window
        does not pin it forever, and never above the current window's p99 once
        that has MIN_BASELINE_SAMPLES calls (a node faster than its baseline is
        simply healthy). Only windows with MIN_BASELINE_SAMPLES calls count;
        None until one has."""
        return self._baseline_under(self._settled_p99())

    def score(self) -> float:
        """The weighted sum in the module docstring. The latency term is 1
        while the window has fewer than MIN_BASELINE_SAMPLES calls (the p99 of
        a handful is just the slowest one), and is recomputed at most every
        LATENCY_REFRESH_S; the other terms are always current."""
        w = self._weights
        value = (
            w.errors * (1.0 - self.error_rate())
            + w.latency * self._cached_latency_factor()
            + w.memory * self._free_fraction
            + w.pressure * (1.0 - min(1.0, self._num_in_flight / self._max_in_flight))
        ) / w.total
        return min(1.0, max(0.0, value))

    def _cached_latency_factor(self) -> float:
        now = self._clock()
        computed_at, value = self._latency_factor_cache
        if now - computed_at >= LATENCY_REFRESH_S:
            value = self._latency_factor()
            self._latency_factor_cache = (now, value)
        return value

    def _latency_factor(self) -> float:
        current = self._settled_p99()
        baseline = self._baseline_under(current)
        if current is None or baseline is None or current <= 0:
            return 1.0
        return min(1.0, baseline / current)

    def _baseline_under(self, current: float | None) -> float | None:
        if current is None or self._baseline is None:
            return self._baseline if current is None else current
        return min(self._baseline, current)

    def _settled_p99(self) -> float | None:
        if self._latency.count() < MIN_BASELINE_SAMPLES:
            return None
        return self._latency.quantile(0.99)

    def _absorb_window(self, window: RollingHistogram) -> None:
        # called before each rotation, while `window` still spans a full window
        if window.count() < MIN_BASELINE_SAMPLES:
            return
        p99 = window.quantile(0.99)
        if p99 is None:
            return
        self._baseline = p99 if self._baseline is None else min(self._baseline * BASELINE_RISE, p99)
