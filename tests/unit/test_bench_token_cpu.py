"""bench_token_cpu's floor of each stream count (bare two-process HTTP
token streams beside the decode) and the bare stream itself."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bench = pytest.importorskip("bench_token_cpu")
load = pytest.importorskip("grpc_load")
from racing import process_cpu_seconds  # noqa: E402


def _floor(server: float, client: float, loaded: float = 90.0, plain: float = 100.0, streams: int = 1) -> dict:
    return {"streams": streams, "decode_tok_s": loaded, "plain_decode_tok_s": plain,
            "python_ms_per_token": server + client,
            "load": {"server_cpu_ms_per_message": server, "client_cpu_ms_per_message": client}}


def test_floor_is_set_against_modeld_and_the_tree_before():
    floors = [_floor(0.2, 0.2), _floor(0.3, 0.2, 80.0), _floor(0.25, 0.25, 95.0)]
    summary = {"after": {1: {"python_ms_per_token": 0.6}}, "before": {1: {"python_ms_per_token": 1.0}}}
    got = bench.floor_summary(floors, summary, with_before=True)[1]
    assert got["python_ms_per_token"] == pytest.approx(0.5)
    assert got["after_over_floor"] == pytest.approx(1.2)
    # were modeld's own work free, after/before could fall no lower than this
    assert got["floor_over_before"] == pytest.approx(0.5)
    assert got["decode_beside_stream_over_alone"] == pytest.approx(0.9)


def test_floor_without_a_tree_before_or_a_profile():
    got = bench.floor_summary([_floor(0.2, 0.1)], {"after": {1: {"tok_s": 100.0}}}, with_before=False)[1]
    assert got["after_over_floor"] is None and "floor_over_before" not in got


def test_each_stream_count_is_set_against_its_own_floor():
    floors = [_floor(0.2, 0.2), _floor(0.05, 0.05, streams=8), _floor(0.04, 0.06, streams=8),
              _floor(0.06, 0.06, streams=8)]
    summary = {"after": {1: {"python_ms_per_token": 0.6}, 8: {"python_ms_per_token": 0.15}},
               "before": {1: {"python_ms_per_token": 0.8}, 8: {"python_ms_per_token": 0.25}}}
    got = bench.floor_summary(floors, summary, with_before=True)
    assert sorted(got) == [1, 8]
    assert got[1]["after_over_floor"] == pytest.approx(1.5)
    assert got[8]["python_ms_per_token"] == pytest.approx(0.1)  # the median of the three rounds
    assert got[8]["after_over_floor"] == pytest.approx(1.5)
    assert got[8]["floor_over_before"] == pytest.approx(0.4)


def test_bare_http_stream_counts_its_events_and_their_cpu():
    with load.GrpcStreamLoad(200.0, streams=2, protocol="http") as running:
        # until the server's CPU time has moved by a clock tick (10 ms), however busy the machine
        server = running.sides[0]
        start, deadline = process_cpu_seconds(server), time.monotonic() + 60
        while process_cpu_seconds(server) <= start and time.monotonic() < deadline:
            time.sleep(0.05)
    figures = running.figures
    assert figures["protocol"] == "http" and figures["streams"] == 2
    # the client counted every SSE event it read, at least each stream's first
    assert figures["messages_since_start"] >= 2
    assert figures["server_cpu_ms_per_message"] > 0
