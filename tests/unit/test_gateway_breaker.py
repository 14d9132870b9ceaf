"""CircuitBreaker: when it trips, how long it stays open, and how it probes
its way back to closed; on a fake clock."""

from __future__ import annotations

import random

import grpc
import pytest

from modeld.server.gateway.breaker import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    ErrorWindow,
    is_server_failure,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
NO_JITTER = BreakerConfig(jitter=0.0)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def breaker(config: BreakerConfig = NO_JITTER, seed: int = 0) -> tuple[CircuitBreaker, FakeClock, list]:
    clock = FakeClock()
    transitions: list[tuple[BreakerState, BreakerState]] = []
    cb = CircuitBreaker(
        config, clock=clock, rng=random.Random(seed), on_transition=lambda old, new: transitions.append((old, new))
    )
    return cb, clock, transitions


def open_period(cb: CircuitBreaker, clock: FakeClock) -> float:
    assert cb.state is OPEN
    return cb.open_until - clock.now


def record(cb: CircuitBreaker, failed: bool) -> None:
    if failed:
        cb.record_failure()
    else:
        cb.record_success()


def fail_probe(cb: CircuitBreaker, clock: FakeClock) -> None:
    """Wait out the open period and fail the half-open probe."""
    clock.advance(open_period(cb, clock) + 0.001)
    assert cb.allow()
    cb.record_failure()


def test_server_failures_are_the_node_s_fault_and_client_errors_are_not():
    codes = grpc.StatusCode
    for code in (codes.UNAVAILABLE, codes.DEADLINE_EXCEEDED, codes.INTERNAL, codes.UNKNOWN):
        assert is_server_failure(code), code
    assert is_server_failure(None)  # no status at all: the connection broke
    for code in (
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
    ):
        assert not is_server_failure(code), code


def test_consecutive_failures_trip():
    cb, _, _ = breaker()
    for _ in range(4):
        cb.record_failure()
    assert cb.state is CLOSED and cb.allow()
    cb.record_failure()
    assert cb.state is OPEN
    assert not cb.allow() and not cb.would_allow()


def test_a_success_resets_the_consecutive_count():
    cb, _, _ = breaker(BreakerConfig(jitter=0.0, min_calls=100))
    for _ in range(3):
        for _ in range(4):
            cb.record_failure()
        cb.record_success()
    assert cb.state is CLOSED


def test_the_error_rate_over_the_window_trips():
    cb, clock, _ = breaker()
    for i in range(9):  # S F S F S F S F S: 4 failures of 9 calls, below min_calls
        record(cb, failed=i % 2 == 1)
        clock.advance(0.1)
    assert cb.state is CLOSED
    cb.record_failure()  # 5 of 10 reach the 50% rate with 10 calls
    assert cb.state is OPEN


def test_the_error_rate_stays_below_the_threshold():
    cb, clock, _ = breaker()
    for i in range(100):  # 1 failure in 3
        record(cb, failed=i % 3 == 0)
        clock.advance(0.05)
    assert cb.state is CLOSED


def test_failures_older_than_the_window_are_forgotten():
    cb, clock, _ = breaker(BreakerConfig(jitter=0.0, consecutive_failures=100))
    for i in range(9):  # 6 failures of 9 calls
        record(cb, failed=i % 3 != 0)
    clock.advance(11.0)
    cb.record_failure()  # 7 of 10 had the window not moved on
    assert cb.state is CLOSED


def test_the_window_counts_calls_of_the_last_window_s():
    clock = FakeClock()
    window = ErrorWindow(10.0, clock)
    window.record(failed=True)
    clock.advance(5.0)
    window.record(failed=False)
    assert window.counts() == (2, 1) and window.failure_rate() == 0.5
    clock.advance(5.5)
    assert window.counts() == (1, 0)
    clock.advance(10.0)
    assert window.counts() == (0, 0) and window.failure_rate() == 0.0


def test_open_becomes_half_open_when_the_period_is_over():
    cb, clock, _ = breaker()
    cb.trip()
    assert open_period(cb, clock) == pytest.approx(1.0)
    clock.advance(0.99)
    assert cb.state is OPEN and not cb.would_allow()
    clock.advance(0.02)
    assert cb.state is HALF_OPEN


def test_the_open_period_doubles_per_failed_probe_up_to_the_max():
    cb, clock, _ = breaker()
    cb.trip()
    periods = [open_period(cb, clock)]
    for _ in range(7):
        fail_probe(cb, clock)
        periods.append(open_period(cb, clock))
    assert periods == pytest.approx([1, 2, 4, 8, 16, 30, 30, 30])


def test_the_jitter_stays_within_its_bounds_and_varies():
    config = BreakerConfig(jitter=0.2)
    seen: list[list[float]] = []
    for seed in range(20):
        cb, clock, _ = breaker(config, seed)
        cb.trip()
        periods = [open_period(cb, clock)]
        for _ in range(6):
            fail_probe(cb, clock)
            periods.append(open_period(cb, clock))
        for period, base in zip(periods, [1, 2, 4, 8, 16, 30, 30]):
            assert base * 0.8 <= period <= base * 1.2, (period, base)
        seen.append(periods)
    assert len({round(p[0], 6) for p in seen}) > 10  # really random, so gateways do not probe in step


def test_half_open_admits_one_probe_at_a_time():
    cb, clock, _ = breaker()
    cb.trip()
    clock.advance(1.5)
    assert cb.would_allow() and cb.would_allow()  # asking takes no probe
    assert cb.allow()
    assert not cb.allow() and not cb.would_allow()
    cb.record_success()  # first of two successes needed
    assert cb.state is HALF_OPEN
    assert cb.allow()
    assert not cb.allow()
    cb.record_success()
    assert cb.state is CLOSED
    assert cb.allow() and cb.allow()


def test_release_frees_the_probe_without_a_verdict():
    cb, clock, _ = breaker()
    cb.trip()
    clock.advance(1.5)
    assert cb.allow()
    cb.release()
    assert cb.state is HALF_OPEN
    assert cb.allow()
    cb.record_success()
    cb.allow()
    cb.record_success()
    assert cb.state is CLOSED


def test_a_failed_probe_reopens_for_longer():
    cb, clock, _ = breaker()
    cb.trip()
    clock.advance(1.5)
    assert cb.allow()
    cb.record_success()
    assert cb.allow()
    cb.record_failure()  # one success is not enough; the failure reopens
    assert cb.state is OPEN
    assert open_period(cb, clock) == pytest.approx(2.0)


def test_closing_resets_the_doubling_and_the_window():
    cb, clock, _ = breaker()
    for _ in range(5):
        cb.record_failure()
    fail_probe(cb, clock)
    fail_probe(cb, clock)
    assert open_period(cb, clock) == pytest.approx(4.0)
    clock.advance(4.5)
    for _ in range(2):
        assert cb.allow()
        cb.record_success()
    assert cb.state is CLOSED
    cb.record_failure()  # the failures from before the close are gone
    assert cb.state is CLOSED
    cb.trip()
    assert open_period(cb, clock) == pytest.approx(1.0)


def test_closing_forgets_the_calls_that_tripped_it():
    cb, clock, _ = breaker()
    for i in range(10):  # trips on the error rate: 5 failures of 10 calls
        record(cb, failed=i % 2 == 1)
    assert cb.state is OPEN
    clock.advance(1.5)
    for _ in range(2):
        assert cb.allow()
        cb.record_success()
    assert cb.state is CLOSED
    cb.record_failure()  # 6 of 12 had the window kept them
    assert cb.state is CLOSED


def test_trip_opens_now_and_repeating_it_changes_nothing():
    cb, clock, transitions = breaker()
    cb.trip()
    until = cb.open_until
    clock.advance(0.5)
    cb.trip()
    assert cb.open_until == until
    assert transitions == [(CLOSED, OPEN)]


def test_stragglers_while_open_do_not_close_or_extend_it():
    cb, clock, _ = breaker()
    cb.trip()
    until = cb.open_until
    for _ in range(5):
        cb.record_success()
        cb.record_failure()
    assert cb.state is OPEN and cb.open_until == until


def test_on_transition_sees_every_change_in_order():
    cb, clock, transitions = breaker()
    for _ in range(5):
        cb.record_failure()
    fail_probe(cb, clock)
    clock.advance(2.5)
    cb.allow()
    cb.record_success()
    cb.allow()
    cb.record_success()
    assert transitions == [
        (CLOSED, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, CLOSED),
    ]


@pytest.mark.parametrize(
    "field, value",
    [
        ("consecutive_failures", 0),
        ("error_rate", 0.0),
        ("error_rate", 1.5),
        ("window_s", 0),
        ("jitter", 1.0),
        ("open_max_s", 0.5),
    ],
)
def test_invalid_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        BreakerConfig(**{field: value})


def test_probe_now_ends_a_long_open_period_but_probes_still_decide():
    cb, clock, _ = breaker()
    for _ in range(4):  # four trips: the next period would be 8 s
        cb.trip()
        clock.advance(cb.open_until - clock.now)
        assert cb.allow() and cb.state is HALF_OPEN
        cb.record_failure()
    assert cb.state is OPEN and cb.open_until - clock.now == 16.0
    cb.probe_now()
    assert cb.state is HALF_OPEN
    assert cb.allow() and not cb.allow()  # still one probe at a time
    cb.record_failure()
    assert cb.state is OPEN  # a failed probe reopens it
    cb.probe_now()
    for _ in range(NO_JITTER.half_open_successes):
        assert cb.allow()
        cb.record_success()
    assert cb.state is CLOSED
    cb.probe_now()  # closed: nothing to end
    assert cb.state is CLOSED
