"""HealthTracker: consecutive failures mark a remote unhealthy, one success
heals it, probes back off while it is down."""

from __future__ import annotations

from modeld.backends.remote.health import FailureKind, HealthTracker


def _tracker(changes: list) -> HealthTracker:
    return HealthTracker(unhealthy_after=3, probe_interval_s=0.5, max_probe_interval_s=4.0,
                         on_change=lambda healthy, reason: changes.append((healthy, reason)))


def test_consecutive_failures_mark_it_unhealthy_and_a_success_heals_it():
    changes: list = []
    tracker = _tracker(changes)
    tracker.record_failure(FailureKind.TIMEOUT, "slow 1")
    tracker.record_failure(FailureKind.SERVER_ERROR, "500")
    assert tracker.is_healthy and not changes
    tracker.record_failure(FailureKind.BROKEN_STREAM, "cut off")
    assert not tracker.is_healthy and changes == [(False, "cut off")]
    tracker.record_failure(FailureKind.TIMEOUT, "still slow")
    assert changes == [(False, "cut off")]  # told once
    tracker.record_success()
    assert tracker.is_healthy and changes[-1][0] is True and tracker.num_failures == 0


def test_a_success_in_between_resets_the_count():
    tracker = _tracker([])
    for _ in range(5):
        tracker.record_failure(FailureKind.TIMEOUT, "slow")
        tracker.record_failure(FailureKind.TIMEOUT, "slow")
        tracker.record_success()
    assert tracker.is_healthy


def test_an_unreachable_server_is_unhealthy_at_once():
    changes: list = []
    tracker = _tracker(changes)
    tracker.record_failure(FailureKind.UNREACHABLE, "connection refused")
    assert not tracker.is_healthy and changes == [(False, "connection refused")]
    assert tracker.last_error == "connection refused"


def test_probes_back_off_while_unhealthy_and_reset_after():
    tracker = _tracker([])
    assert tracker.next_probe_in() == 0.5
    tracker.record_failure(FailureKind.UNREACHABLE, "down")
    waits = []
    for _ in range(6):
        waits.append(tracker.next_probe_in())
        tracker.record_failure(FailureKind.UNREACHABLE, "down")
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    tracker.record_success()
    assert tracker.next_probe_in() == 0.5


def test_a_long_outage_never_overflows_the_backoff():
    tracker = _tracker([])
    for _ in range(5000):
        tracker.record_failure(FailureKind.TIMEOUT, "down")
    assert tracker.next_probe_in() == 4.0
