"""bench/pipeline_floor.py's frame readers and bench_token_cpu's figures
for it: frames and requests cut anywhere by the socket come out whole and
in order, and
the floor's Python is the front's whole CPU plus the worker's main thread
less its time in llama.cpp, its other (compute) threads left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
floor = pytest.importorskip("pipeline_floor")
bench = pytest.importorskip("bench_token_cpu")


def _frame(token: int, rid: int, text: str) -> bytes:
    data = text.encode()
    return floor.TOKEN.pack(token, rid, len(data)) + data


def test_frames_cut_anywhere_come_out_whole_and_in_order():
    stream = _frame(7, 1, "The") + _frame(8, 2, "") + _frame(9, 1, " café") + _frame(floor.END, 2, "")
    for cut in range(1, len(stream)):
        reader = floor.FrameReader()
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == [(7, 1, "The"), (8, 2, ""), (9, 1, " café"), (floor.END, 2, "")], cut


def test_a_partial_frame_waits_for_its_rest():
    reader = floor.FrameReader()
    whole = _frame(3, 5, "hello")
    assert reader.feed(whole[:5]) == []
    assert reader.feed(whole[5:-1]) == []
    assert reader.feed(whole[-1:] + _frame(4, 6, "!")) == [(3, 5, "hello"), (4, 6, "!")]


def test_requests_are_taken_whole_from_the_front_of_the_buffer():
    import orjson

    jobs = [orjson.dumps({"rid": i, "prompt": "x" * i}) for i in (1, 2)]
    data = b"".join(floor.REQUEST.pack(len(j)) + j for j in jobs)
    buffer = bytearray(data[:-3])
    assert [r["rid"] for r in floor.read_requests(buffer)] == [1]
    assert len(buffer) == len(data) - 3 - floor.REQUEST.size - len(jobs[0])  # the second, waiting for its end
    buffer += data[-3:]
    assert [r["prompt"] for r in floor.read_requests(buffer)] == ["xx"] and not buffer


def test_figures_count_the_front_and_the_worker_main_thread_less_its_compute():
    front, worker = 100, 200
    before = {(front, 100): 1.0, (front, 101): 0.5, (worker, 200): 10.0, (worker, 201): 20.0}
    after = {(front, 100): 1.02, (front, 101): 0.51, (worker, 200): 10.9, (worker, 201): 20.8,
             (front, 102): 0.002}  # a thread born during the phase counts from zero
    # the worker's main thread spent 0.9 s, 0.88 of it inside llama_decode
    got = bench.pipeline_figures(before, after, 880_000_000, front, worker, count=100, wall=1.0)
    assert got["front_ms_per_token"] == pytest.approx(0.32)
    assert got["worker_python_ms_per_token"] == pytest.approx(0.2)
    assert got["python_ms_per_token"] == pytest.approx(0.52)  # thread 201 (compute) left out
    assert got["tok_s"] == pytest.approx(100.0)


def test_summary_sets_modeld_and_the_tree_before_against_the_floor_by_stream_count():
    rounds = [{"streams": n, "python_ms_per_token": v * n, "front_ms_per_token": v / 2,
               "worker_python_ms_per_token": v / 2, "tok_s": 100.0}
              for n in (1, 8) for v in (0.3, 0.4, 0.35)]
    summary = {"after": {1: {"python_ms_per_token": 0.7}, 8: {"python_ms_per_token": 3.5}},
               "before": {1: {"python_ms_per_token": 1.0}, 8: {"python_ms_per_token": 5.6}}}
    got = bench.pipeline_summary(rounds, summary)["by_streams"]
    assert got[1]["python_ms_per_token"] == pytest.approx(0.35)
    assert got[1]["after_over_pipeline"] == pytest.approx(2.0)
    assert got[1]["pipeline_over_before"] == pytest.approx(0.35)
    assert got[8]["python_ms_per_token"] == pytest.approx(2.8)  # each stream count against its own rounds
    assert got[8]["after_over_pipeline"] == pytest.approx(1.25)
    assert got[8]["pipeline_over_before"] == pytest.approx(0.5)
    alone = bench.pipeline_summary(rounds, {"after": summary["after"]})["by_streams"][1]
    assert "pipeline_over_before" not in alone
