"""A circuit breaker per node: stop sending calls to a node that is failing,
and find out, one probe at a time, when it has recovered.

    CLOSED --(5 failures in a row, or >= 50% of >= 10 calls in 10 s fail)--> OPEN
    OPEN --(open period over; read on `state`)--> HALF_OPEN
    HALF_OPEN --(one probe at a time; 2 successes)--> CLOSED
    HALF_OPEN --(a probe fails)--> OPEN, for twice as long as last time

The open period starts at `open_base_s`, doubles with each trip that follows
without a close in between, stops growing at `open_max_s`, and is then spread
by +-`jitter` so that the gateways of a fleet, which all saw the same node
fail at the same moment, do not all probe it at the same moment.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import grpc

Clock = Callable[[], float]


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The codes that say something about the node rather than about the request:
# an INVALID_ARGUMENT or NOT_FOUND is the caller's problem, and a healthy node
# answers it just as fast as any other call.
SERVER_FAILURES: frozenset[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


def is_server_failure(code: grpc.StatusCode | None) -> bool:
    """Whether a call's outcome counts against the node; None is a call that
    never got a status (the connection failed), which does."""
    return code is None or code in SERVER_FAILURES


class ErrorWindow:
    """Calls and failures over roughly the last `window_s` seconds.

    Counted in `num_buckets` time buckets rather than per call, so the memory
    is fixed however busy the node is; the window therefore slides in steps of
    window_s / num_buckets and covers between (num_buckets - 1) and num_buckets
    of them.
    """

    def __init__(self, window_s: float, clock: Clock = time.monotonic, num_buckets: int = 10) -> None:
        if window_s <= 0 or num_buckets < 1:
            raise ValueError(f"need window_s > 0 and num_buckets >= 1, got {window_s}, {num_buckets}")
        self._bucket_s = window_s / num_buckets
        self._num_buckets = num_buckets
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [bucket index, calls, failures], oldest first
        self._num_calls = 0
        self._num_failures = 0

    def record(self, failed: bool) -> None:
        index = self._expire()
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append([index, 0, 0])
        bucket = self._buckets[-1]
        bucket[1] += 1
        self._num_calls += 1
        if failed:
            bucket[2] += 1
            self._num_failures += 1

    def counts(self) -> tuple[int, int]:
        """(calls, failures) in the window."""
        self._expire()
        return self._num_calls, self._num_failures

    def failure_rate(self) -> float:
        calls, failures = self.counts()
        return failures / calls if calls else 0.0

    def clear(self) -> None:
        self._buckets.clear()
        self._num_calls = self._num_failures = 0

    def _expire(self) -> int:
        index = math.floor(self._clock() / self._bucket_s)
        oldest_kept = index - self._num_buckets + 1
        while self._buckets and self._buckets[0][0] < oldest_kept:
            _, calls, failures = self._buckets.popleft()
            self._num_calls -= calls
            self._num_failures -= failures
        return index


@dataclass(frozen=True)
class BreakerConfig:
    consecutive_failures: int = 5
    error_rate: float = 0.5  # trip when the failure rate over the window reaches this...
    window_s: float = 10.0
    min_calls: int = 10  # ...and the window holds at least this many calls
    open_base_s: float = 1.0  # first open period; doubles per consecutive trip
    open_max_s: float = 30.0
    jitter: float = 0.2  # +-20% of the open period, random
    half_open_successes: int = 2  # probes that must succeed to close

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be {rule}"
            for name, ok, rule in (
                ("consecutive_failures", self.consecutive_failures >= 1, "at least 1"),
                ("error_rate", 0 < self.error_rate <= 1, "in (0, 1]"),
                ("window_s", self.window_s > 0, "positive"),
                ("min_calls", self.min_calls >= 1, "at least 1"),
                ("open_base_s", self.open_base_s > 0, "positive"),
                ("open_max_s", self.open_max_s >= self.open_base_s, "at least open_base_s"),
                ("jitter", 0 <= self.jitter < 1, "in [0, 1)"),
                ("half_open_successes", self.half_open_successes >= 1, "at least 1"),
            )
            if not ok
        ]
        if problems:
            raise ValueError("invalid breaker config: " + "; ".join(problems))

    def open_period(self, num_trips: int, rng: random.Random) -> float:
        """The open period after the `num_trips`-th trip in a row (1-based)."""
        # cap before the jitter: capping after it would put every gateway at
        # exactly open_max_s, in step again, once the node has failed long enough
        base = min(self.open_max_s, self.open_base_s * 2.0 ** min(num_trips - 1, 64))
        return base * (1.0 + rng.uniform(-self.jitter, self.jitter))


class CircuitBreaker:
    """One node's breaker. Not thread-safe: it lives on the gateway's event loop.

    Contract for callers: every call that `allow()` admitted ends with exactly
    one of `record_success`, `record_failure` (server failures only, see
    `is_server_failure`) or `release` (no verdict), in a `finally`; otherwise a
    half-open probe never ends and the node is never tried again.

    Outcomes are not tied to the call that was admitted: a call admitted while
    CLOSED that ends while HALF_OPEN with a probe in flight is taken as that
    probe's verdict. Stragglers arriving while OPEN, or while HALF_OPEN with no
    probe in flight, are ignored.
    """

    def __init__(
        self,
        config: BreakerConfig = BreakerConfig(),
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._window = ErrorWindow(config.window_s, clock)
        self._num_consecutive_failures = 0
        self._num_trips = 0  # trips since the last close: the exponent of the open period
        self._open_until = 0.0
        self._is_probe_in_flight = False
        self._num_probe_successes = 0

    @property
    def config(self) -> BreakerConfig:
        return self._config

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
            self._is_probe_in_flight = False
            self._num_probe_successes = 0
            self._move_to(BreakerState.HALF_OPEN)
        return self._state

    @property
    def open_until(self) -> float:
        """When the current open period ends (clock time); meaningful while OPEN."""
        return self._open_until

    def would_allow(self) -> bool:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            return not self._is_probe_in_flight
        return state is BreakerState.CLOSED

    def allow(self) -> bool:
        if not self.would_allow():
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._is_probe_in_flight = True
        return True

    def record_success(self) -> None:
        if self._state is BreakerState.CLOSED:
            self._num_consecutive_failures = 0
            self._window.record(failed=False)
        elif self._state is BreakerState.HALF_OPEN and self._is_probe_in_flight:
            self._is_probe_in_flight = False
            self._num_probe_successes += 1
            if self._num_probe_successes >= self._config.half_open_successes:
                self._close()

    def record_failure(self) -> None:
        if self._state is BreakerState.CLOSED:
            self._num_consecutive_failures += 1
            self._window.record(failed=True)
            if self._should_trip():
                self._open()
        elif self._state is BreakerState.HALF_OPEN and self._is_probe_in_flight:
            self._open()

    def release(self) -> None:
        if self._state is BreakerState.HALF_OPEN:
            self._is_probe_in_flight = False

    def trip(self) -> None:
        """Open now, unless already open: a health watch repeating NOT_SERVING
        must not keep doubling the period."""
        if self.state is not BreakerState.OPEN:
            self._open()

    def probe_now(self) -> None:
        """End the open period now: strong evidence that the node is back (its
        health watch says SERVING again after a restart) should not wait out
        a period that doubled while it was down. Half-open probes still
        decide whether it closes."""
        if self._state is BreakerState.OPEN:
            self._open_until = self._clock()

    def _should_trip(self) -> bool:
        config = self._config
        if self._num_consecutive_failures >= config.consecutive_failures:
            return True
        calls, failures = self._window.counts()
        return calls >= config.min_calls and failures >= config.error_rate * calls

    def _open(self) -> None:
        self._num_trips += 1
        self._open_until = self._clock() + self._config.open_period(self._num_trips, self._rng)
        self._is_probe_in_flight = False
        self._move_to(BreakerState.OPEN)

    def _close(self) -> None:
        # the window still holds the failures that tripped the breaker: keeping
        # them would reopen it at the first failure after the close
        self._window.clear()
        self._num_consecutive_failures = 0
        self._num_trips = 0
        self._move_to(BreakerState.CLOSED)

    def _move_to(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        if self._on_transition is not None and old is not new:
            self._on_transition(old, new)
