"""The recent-latency quantiles behind modeld.v1.Node (two rotating HDR
histograms), and the per-model figures ModelStats keeps for it."""

from __future__ import annotations

import random

import pytest

from modeld.backends.errors import ErrorKind
from modeld.server.services.node import watch_interval_s
from modeld.server.stats import SERVER_SIDE_KINDS, ModelStats, WindowedQuantiles


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_no_samples_give_zero(clock):
    window = WindowedQuantiles(60, clock)
    assert window.quantile(0.99) == 0.0 and window.num_samples == 0


def test_quantiles_are_within_one_percent(clock):
    window = WindowedQuantiles(60, clock)
    rng = random.Random(7)
    samples = sorted(rng.uniform(0.001, 2.0) for _ in range(5000))
    for value in rng.sample(samples, len(samples)):
        window.record(value)
    for q in (0.5, 0.95, 0.99):
        exact = samples[int(q * len(samples)) - 1]
        assert window.quantile(q) == pytest.approx(exact, rel=0.01)
    assert window.num_samples == 5000


def test_a_quantile_covers_both_windows(clock):
    window = WindowedQuantiles(60, clock)
    for _ in range(99):
        window.record(0.010)
    clock.now += 61  # those samples are now the previous window
    window.record(5.0)
    assert window.num_samples == 100
    assert window.quantile(0.99) == pytest.approx(0.010, rel=0.01)
    assert window.quantile(1.0) == pytest.approx(5.0, rel=0.01)


def test_old_samples_leave_after_two_windows(clock):
    window = WindowedQuantiles(60, clock)
    window.record(3.0)
    clock.now += 61
    window.record(0.2)
    assert window.quantile(0.99) == pytest.approx(3.0, rel=0.01)
    clock.now += 60  # 3.0 is two windows old, 0.2 one
    assert window.num_samples == 1
    assert window.quantile(0.99) == pytest.approx(0.2, rel=0.01)
    clock.now += 60
    assert window.num_samples == 0 and window.quantile(0.99) == 0.0


def test_a_long_idle_gap_empties_both_windows_at_once(clock):
    window = WindowedQuantiles(60, clock)
    window.record(1.0)
    clock.now += 3600
    assert window.quantile(0.5) == 0.0
    window.record(0.5)  # rotation stays aligned: this lands in a fresh current window
    clock.now += 59
    assert window.quantile(0.5) == pytest.approx(0.5, rel=0.01)


def test_a_new_sample_replaces_a_cached_quantile(clock):
    window = WindowedQuantiles(60, clock)
    window.record(0.1)
    assert window.quantile(0.99) == pytest.approx(0.1, rel=0.01)
    for _ in range(10):
        window.record(1.0)
    assert window.quantile(0.99) == pytest.approx(1.0, rel=0.01)


def test_values_outside_the_range_are_clamped_not_dropped(clock):
    window = WindowedQuantiles(60, clock)
    window.record(0.0)
    window.record(7200.0)  # two hours: past the one-hour ceiling
    assert window.num_samples == 2
    assert window.quantile(0.5) == pytest.approx(1e-6, rel=0.01)
    assert window.quantile(1.0) == pytest.approx(3600.0, rel=0.01)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_a_quantile_outside_0_1_is_refused(clock, bad):
    with pytest.raises(ValueError):
        WindowedQuantiles(60, clock).quantile(bad)


def test_model_stats_count_calls_in_flight_and_server_side_failures():
    stats = ModelStats()
    stats.begin_call()
    stats.begin_call()
    assert (stats.num_requests, stats.num_in_flight) == (2, 2)
    stats.end_call()
    stats.record_success(25_000_000)
    for kind in ErrorKind:
        stats.count_failure(kind)
    assert (stats.num_requests, stats.num_in_flight) == (2, 1)
    assert stats.num_server_failures == len(SERVER_SIDE_KINDS)
    assert ErrorKind.INVALID_ARGUMENT not in SERVER_SIDE_KINDS and ErrorKind.CANCELLED not in SERVER_SIDE_KINDS
    assert stats.recent_latency.quantile(0.99) == pytest.approx(0.025, rel=0.01)


@pytest.mark.parametrize("interval_ms, seconds", [(0, 1.0), (10, 0.05), (50, 0.05), (100, 0.1), (2500, 2.5)])
def test_watch_interval(interval_ms, seconds):
    assert watch_interval_s(interval_ms) == seconds
