"""bench_minilm's latency arithmetic: the goal and the floor it is read against."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_minilm import latency_floor, latency_goal  # noqa: E402


def _record(daemon: float, inproc: float, tiny: float) -> dict:
    return {"latency": {"daemon": {"p50_ms": daemon}, "inproc_onnxruntime": {"p50_ms": inproc},
                        "daemon_tiny_model_floor": {"p50_ms": tiny}}}


def test_goal_is_fifteen_percent_plus_half_a_millisecond_of_in_process():
    ratio, limit, ok = latency_goal(_record(12.0, 10.0, 1.0))
    assert ratio == pytest.approx(1.2)
    assert limit == pytest.approx(12.0)
    assert ok  # at the limit passes
    assert not latency_goal(_record(12.01, 10.0, 1.0))[2]


def test_floor_is_in_process_plus_a_request_that_does_no_work():
    floor = latency_floor(_record(12.0, 10.0, 1.5))
    assert floor["daemon_overhead_ms"] == pytest.approx(2.0)
    assert floor["tiny_model_round_trip_ms"] == 1.5
    assert floor["inproc_plus_tiny_ms"] == pytest.approx(11.5)
    assert floor["daemon_over_inproc_plus_tiny"] == pytest.approx(12.0 / 11.5)
