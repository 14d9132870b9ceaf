"""What hedged requests need: a budget for them, and the latency after which
a call is late enough to deserve one.

A hedge is a second copy of a slow unary call sent to a different replica;
the first answer wins. It trims the tail only while it is rare: the budget
caps hedges at `ratio` of requests, and the trigger is the model's recent p95
on the node the call went to, so about one call in twenty is ever late enough.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

import numpy as np
from hdrh.histogram import HdrHistogram

Clock = Callable[[], float]
T = TypeVar("T")

# 1 us .. 60 s at 2 significant digits: about 1% resolution, 2,560 counters of
# 4 bytes (10 KiB) per histogram. Longer calls are recorded as 60 s.
LOWEST_US = 1
HIGHEST_US = 60_000_000
SIGNIFICANT_DIGITS = 2
_WORD_SIZE = 4


def _new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS, word_size=_WORD_SIZE)


def _to_us(seconds: float) -> int:
    return min(HIGHEST_US, max(LOWEST_US, round(seconds * 1e6)))


def _counts(histogram: HdrHistogram) -> np.ndarray:
    # a view on the ctypes counters: reading them one by one from Python costs
    # about 0.5 ms per histogram, numpy reads all 2,560 in microseconds
    return np.frombuffer(histogram.counts, dtype=np.uint32)


class RollingHistogram:
    """Latency samples of the last `window_s` seconds, in two halves.

    `current` takes new samples; every window_s / 2 it becomes `previous` and
    the old `previous` is dropped, so queries see between window_s / 2 and
    window_s seconds of samples. `on_rotate`, if given, is called with this
    histogram just before each rotation, while it still holds the full window.
    """

    def __init__(
        self,
        window_s: float,
        clock: Clock = time.monotonic,
        on_rotate: Callable[[RollingHistogram], None] | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self._half_s = window_s / 2
        self._clock = clock
        self._on_rotate = on_rotate
        self._current = _new_histogram()
        self._previous = _new_histogram()
        self._rotate_at = clock() + self._half_s
        self._is_rotating = False  # lets on_rotate read the full window without rotating again
        self.last_record_at = float("-inf")

    def record(self, seconds: float) -> None:
        now = self._clock()
        self._roll(now)
        self._current.record_value(_to_us(seconds))
        self.last_record_at = now

    def count(self) -> int:
        self._roll(self._clock())
        return self._current.total_count + self._previous.total_count

    def quantile(self, q: float) -> float | None:
        """The q-quantile in seconds (to about 1%), None when the window is empty."""
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1], got {q}")
        self._roll(self._clock())
        counts = _counts(self._current).astype(np.int64) + _counts(self._previous)
        cumulative = np.cumsum(counts)
        total = int(cumulative[-1])
        if total == 0:
            return None
        # the same rank rule as HdrHistogram.get_value_at_percentile
        rank = max(1, int(q * total + 0.5))
        value = self._current.get_value_from_index(int(np.searchsorted(cumulative, rank)))
        # the middle of the value's bucket halves the error of either end
        low = self._current.get_lowest_equivalent_value(value)
        high = self._current.get_highest_equivalent_value(value)
        return (low + high) / 2 / 1e6

    def _roll(self, now: float) -> None:
        if now >= self._rotate_at and not self._is_rotating:
            self._rotate(now)

    def _rotate(self, now: float) -> None:
        if self._on_rotate is not None and self._current.total_count + self._previous.total_count:
            self._is_rotating = True
            try:
                self._on_rotate(self)
            finally:
                self._is_rotating = False
        num_halves = int((now - self._rotate_at) // self._half_s) + 1
        self._previous.reset()
        if num_halves == 1:
            self._current, self._previous = self._previous, self._current
        else:  # idle for a whole window or more: both halves are old
            self._current.reset()
        self._rotate_at += num_halves * self._half_s


class TokenBucket:
    """Hedges capped at `ratio` of requests: every eligible request earns
    `ratio` of a token (up to `burst`), a hedge spends a whole one. It starts
    empty, so even a burst of hedges right after start-up stays within the cap.
    """

    # 0.05 added twenty times is 0.9999999999999999, not 1
    _EPSILON = 1e-9

    def __init__(self, ratio: float = 0.05, burst: float = 10.0) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        if burst < 1:
            raise ValueError(f"burst must be at least 1 (one hedge costs one token), got {burst}")
        self._ratio = ratio
        self._burst = burst
        self._tokens = 0.0

    @property
    def tokens(self) -> float:
        return self._tokens

    def on_request(self) -> None:
        self._tokens = min(self._burst, self._tokens + self._ratio)

    def try_take(self) -> bool:
        if self._tokens + self._EPSILON < 1.0:
            return False
        self._tokens = max(0.0, self._tokens - 1.0)
        return True


class LatencyTracker:
    """Recent latency quantiles per key (for hedging: per (model, node)).

    Keys with no sample for a whole window are dropped, at most once a window,
    so a gateway that has seen many models over its life keeps only the
    recent ones (20 KiB each).
    """

    def __init__(self, window_s: float = 60.0, min_samples: int = 20, clock: Clock = time.monotonic) -> None:
        if window_s <= 0 or min_samples < 1:
            raise ValueError(f"need window_s > 0 and min_samples >= 1, got {window_s}, {min_samples}")
        self._window_s = window_s
        self._min_samples = min_samples
        self._clock = clock
        self._histograms: dict[Hashable, RollingHistogram] = {}
        self._next_sweep = clock() + window_s

    def __len__(self) -> int:
        return len(self._histograms)

    def record(self, key: Hashable, seconds: float) -> None:
        histogram = self._histograms.get(key)
        if histogram is None:
            histogram = self._histograms[key] = RollingHistogram(self._window_s, self._clock)
        histogram.record(seconds)
        if self._clock() >= self._next_sweep:
            self._sweep()

    def quantile(self, key: Hashable, q: float) -> float | None:
        if not 0 < q < 1:
            raise ValueError(f"q must be in (0, 1), got {q}")
        histogram = self._histograms.get(key)
        if histogram is None or histogram.count() < self._min_samples:
            return None
        return histogram.quantile(q)

    def _sweep(self) -> None:
        now = self._clock()
        self._next_sweep = now + self._window_s
        stale = [key for key, h in self._histograms.items() if now - h.last_record_at >= self._window_s]
        for key in stale:
            del self._histograms[key]


async def race(first: Awaitable[T], start_second: Callable[[], Awaitable[T] | None],
               delay_s: float) -> tuple[T, bool]:
    """`first`'s answer; if it has none after `delay_s`, `start_second()`
    (None: no hedge after all) runs beside it and the first of the two to
    answer wins, the other cancelled. When both fail, `first`'s failure.
    Returns the answer and whether the second one gave it. Neither call is
    left running when this returns or is cancelled (a client that left)."""
    first_task = asyncio.ensure_future(first)
    second_task = None
    try:
        done, _ = await asyncio.wait({first_task}, timeout=delay_s)
        if done:
            return first_task.result(), False
        second = start_second()
        if second is None:
            return await first_task, False
        second_task = asyncio.ensure_future(second)
        pending, failure = {first_task, second_task}, None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    return task.result(), task is second_task
                if failure is None or task is first_task:
                    failure = task.exception()
        raise failure
    finally:
        for task in (first_task, second_task):
            if task is not None and not task.done():
                task.cancel()
