"""NodeHealth: the score formula on constructed inputs, and the latency
baseline it compares against; on a fake clock."""

from __future__ import annotations

import pytest

from modeld.server.gateway.score import BASELINE_RISE, LATENCY_REFRESH_S, NodeHealth, ScoreWeights


class FakeClock:
    def __init__(self, now: float = 500.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def node(**kwargs) -> tuple[NodeHealth, FakeClock]:
    clock = FakeClock()
    return NodeHealth(clock=clock, **kwargs), clock


def record_latencies(health: NodeHealth, seconds: float, n: int = 100) -> None:
    for _ in range(n):
        health.record(True, seconds)


def test_a_node_with_nothing_against_it_scores_one():
    health, _ = node()
    assert health.score() == 1.0
    assert health.error_rate() == 0.0
    assert health.p99() is None and health.baseline_p99() is None


def test_errors_weigh_forty_percent():
    health, _ = node()
    for i in range(10):
        health.record(ok=i >= 3)
    assert health.error_rate() == pytest.approx(0.3)
    assert health.score() == pytest.approx(0.4 * 0.7 + 0.3 + 0.2 + 0.1)


def test_errors_leave_the_window():
    health, clock = node(window_s=30.0)
    for _ in range(5):
        health.record(ok=False)
    clock.advance(31.0)
    assert health.error_rate() == 0.0
    assert health.score() == 1.0


def test_memory_weighs_twenty_percent():
    health, _ = node()
    health.set_memory(used=750, total=1000)
    assert health.score() == pytest.approx(0.4 + 0.3 + 0.2 * 0.25 + 0.1)
    health.set_memory(used=1200, total=1000)  # over budget is no free memory, not negative
    assert health.score() == pytest.approx(0.8)
    health.set_memory(used=5, total=0)  # unknown total: assume free
    assert health.score() == 1.0


def test_in_flight_calls_weigh_ten_percent():
    health, _ = node(max_in_flight=64)
    health.set_in_flight(32)
    assert health.score() == pytest.approx(0.95)
    health.set_in_flight(500)
    assert health.score() == pytest.approx(0.9)


def test_latency_against_the_baseline_weighs_thirty_percent():
    health, clock = node(window_s=30.0)
    record_latencies(health, 0.010)
    clock.advance(15.0)  # the first half-window rotates: 10 ms becomes the baseline
    record_latencies(health, 0.040, n=300)
    assert health.baseline_p99() == pytest.approx(0.010, rel=0.02)
    assert health.p99() == pytest.approx(0.040, rel=0.02)
    assert health.score() == pytest.approx(0.4 + 0.3 * 0.25 + 0.2 + 0.1, abs=0.005)


def test_all_four_together_and_custom_weights():
    health, clock = node(weights=ScoreWeights(errors=2, latency=0, memory=1, pressure=1), max_in_flight=10)
    for i in range(4):
        health.record(ok=i != 0)
    health.set_memory(used=1, total=2)
    health.set_in_flight(10)
    assert health.score() == pytest.approx((2 * 0.75 + 1 * 0.5 + 0) / 4)


def test_the_baseline_is_the_current_p99_until_a_window_completes():
    health, _ = node()
    record_latencies(health, 0.005, n=10)
    assert health.baseline_p99() is None  # too few calls to call it normal
    record_latencies(health, 0.005, n=20)
    assert health.baseline_p99() == pytest.approx(0.005, rel=0.02)
    assert health.score() == 1.0


def test_the_baseline_rises_slowly_to_a_new_normal():
    health, clock = node(window_s=30.0)
    record_latencies(health, 0.010)
    clock.advance(15.0)
    for rotation in range(1, 30):
        record_latencies(health, 0.020)
        clock.advance(15.0)
        health.p99()  # reading rotates, and the window rotating moves the baseline
        if rotation <= 2:
            # each slow window moves it by BASELINE_RISE, no more
            assert health.baseline_p99() == pytest.approx(0.010 * BASELINE_RISE**rotation, rel=0.01)
    assert health.baseline_p99() == pytest.approx(0.020, rel=0.02)
    assert health.score() == pytest.approx(1.0, abs=0.01)


def test_one_lucky_window_does_not_pin_the_baseline():
    health, clock = node(window_s=30.0)
    record_latencies(health, 0.001)  # once, absurdly fast
    clock.advance(15.0)
    for _ in range(80):
        record_latencies(health, 0.010)
        clock.advance(15.0)
    assert health.baseline_p99() == pytest.approx(0.010, rel=0.02)


def test_a_handful_of_slow_calls_says_nothing_yet():
    health, clock = node(window_s=30.0)
    record_latencies(health, 0.010)
    clock.advance(45.0)  # the window empties; 10 ms stays the baseline
    record_latencies(health, 1.0, n=5)
    assert health.score() == 1.0
    record_latencies(health, 1.0, n=20)
    clock.advance(LATENCY_REFRESH_S)
    assert health.baseline_p99() == pytest.approx(0.010, rel=0.02)
    assert health.score() == pytest.approx(0.7 + 0.3 * 0.01, abs=0.001)


def test_failures_latencies_are_not_recorded():
    health, _ = node()
    for _ in range(30):
        health.record(False, 5.0)
    assert health.p99() is None


def test_score_reuses_its_latency_factor_briefly():
    health, clock = node(window_s=30.0)
    record_latencies(health, 0.010)
    clock.advance(15.0)
    record_latencies(health, 0.010, n=300)
    assert health.score() == pytest.approx(1.0, abs=0.005)
    record_latencies(health, 0.100, n=300)
    assert health.score() == pytest.approx(1.0, abs=0.005)
    clock.advance(LATENCY_REFRESH_S)
    assert health.score() < 0.8


def test_invalid_weights_are_refused():
    with pytest.raises(ValueError):
        ScoreWeights(errors=-1)
    with pytest.raises(ValueError):
        ScoreWeights(0, 0, 0, 0)
