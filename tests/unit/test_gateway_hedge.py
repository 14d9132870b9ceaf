"""Hedging's budget and latency trigger: the token bucket's cap, and the
tracker's quantiles against numpy's on the same data; on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from modeld.server.gateway.hedge import LatencyTracker, RollingHistogram, TokenBucket


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_hedges_are_capped_at_five_percent_of_requests():
    bucket = TokenBucket(ratio=0.05, burst=10)
    hedges = 0
    for _ in range(10_000):
        bucket.on_request()
        hedges += bucket.try_take()  # every request would like a hedge
    assert 490 <= hedges <= 500


def test_unused_tokens_pile_up_only_to_the_burst():
    bucket = TokenBucket(ratio=0.05, burst=10)
    assert not bucket.try_take()  # starts empty
    for _ in range(1000):
        bucket.on_request()
    assert [bucket.try_take() for _ in range(11)] == [True] * 10 + [False]


def test_token_bucket_refuses_nonsense():
    with pytest.raises(ValueError):
        TokenBucket(ratio=1.5)
    with pytest.raises(ValueError):
        TokenBucket(burst=0.5)


def test_quantiles_match_numpy_within_two_percent():
    rng = np.random.default_rng(0)
    samples = rng.lognormal(mean=np.log(0.02), sigma=0.8, size=5000)  # 20 ms median, a long tail
    tracker = LatencyTracker(clock=FakeClock())
    for seconds in samples:
        tracker.record("m", float(seconds))
    for q in (0.5, 0.9, 0.95, 0.99):
        assert tracker.quantile("m", q) == pytest.approx(np.quantile(samples, q), rel=0.02), q


def test_quantiles_span_microseconds_to_a_minute():
    tracker = LatencyTracker(min_samples=1, clock=FakeClock())
    tracker.record("fast", 0.000_050)
    tracker.record("slow", 45.0)
    tracker.record("off the scale", 600.0)  # recorded as the 60 s ceiling
    assert tracker.quantile("fast", 0.5) == pytest.approx(0.000_050, rel=0.02)
    assert tracker.quantile("slow", 0.5) == pytest.approx(45.0, rel=0.02)
    assert tracker.quantile("off the scale", 0.5) == pytest.approx(60.0, rel=0.02)


def test_no_quantile_below_min_samples_and_keys_are_separate():
    tracker = LatencyTracker(min_samples=20, clock=FakeClock())
    for _ in range(19):
        tracker.record(("m", "a"), 0.010)
        tracker.record(("m", "b"), 0.500)
    assert tracker.quantile(("m", "a"), 0.95) is None
    tracker.record(("m", "a"), 0.010)
    assert tracker.quantile(("m", "a"), 0.95) == pytest.approx(0.010, rel=0.02)
    assert tracker.quantile(("m", "b"), 0.95) is None
    assert tracker.quantile("never seen", 0.95) is None
    with pytest.raises(ValueError):
        tracker.quantile(("m", "a"), 1.0)


def test_the_window_moves_on():
    clock = FakeClock()
    tracker = LatencyTracker(window_s=60.0, min_samples=20, clock=clock)
    for _ in range(100):
        tracker.record("m", 0.010)
    clock.advance(31.0)  # one rotation: the 10 ms calls are now the older half
    for _ in range(100):
        tracker.record("m", 0.100)
    assert tracker.quantile("m", 0.25) == pytest.approx(0.010, rel=0.02)
    assert tracker.quantile("m", 0.75) == pytest.approx(0.100, rel=0.02)
    clock.advance(30.0)  # second rotation: the 10 ms calls are gone
    assert tracker.quantile("m", 0.25) == pytest.approx(0.100, rel=0.02)
    clock.advance(30.0)  # and now the 100 ms ones too
    assert tracker.quantile("m", 0.25) is None


def test_a_long_idle_gap_empties_the_window():
    clock = FakeClock()
    histogram = RollingHistogram(10.0, clock)
    histogram.record(0.010)
    clock.advance(3600.0)
    assert histogram.count() == 0 and histogram.quantile(0.5) is None
    histogram.record(0.020)
    clock.advance(4.0)
    assert histogram.count() == 1  # still aligned to 5 s halves after the gap


def test_on_rotate_sees_the_full_window_before_it_moves():
    clock = FakeClock()
    seen: list[tuple[int, float | None]] = []
    histogram = RollingHistogram(10.0, clock, on_rotate=lambda h: seen.append((h.count(), h.quantile(0.5))))
    for _ in range(10):
        histogram.record(0.010)
    clock.advance(5.0)
    for _ in range(30):
        histogram.record(0.030)
    clock.advance(5.0)
    histogram.count()
    assert seen[0][0] == 10
    assert seen[1][0] == 40 and seen[1][1] == pytest.approx(0.030, rel=0.02)
    assert histogram.count() == 30


def test_keys_idle_for_a_window_are_dropped():
    clock = FakeClock()
    tracker = LatencyTracker(window_s=60.0, clock=clock)
    for i in range(50):
        tracker.record(("old", i), 0.010)
    clock.advance(61.0)
    tracker.record("busy", 0.010)
    assert len(tracker) == 1
