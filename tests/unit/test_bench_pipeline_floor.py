"""bench/pipeline_floor.py's frame reader and bench_token_cpu's figures
for it: frames cut anywhere by the socket come out whole and in order, and
the floor's Python is the front's whole CPU plus the worker's main thread
less its time in llama.cpp, its other (compute) threads left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
floor = pytest.importorskip("pipeline_floor")
bench = pytest.importorskip("bench_token_cpu")


def _frame(token: int, text: str) -> bytes:
    data = text.encode()
    return floor.TOKEN.pack(token, len(data)) + data


def test_frames_cut_anywhere_come_out_whole_and_in_order():
    stream = _frame(7, "The") + _frame(8, "") + _frame(9, " café") + _frame(floor.END, "")
    for cut in range(1, len(stream)):
        reader = floor.FrameReader()
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == [(7, "The"), (8, ""), (9, " café"), (floor.END, "")], cut


def test_a_partial_frame_waits_for_its_rest():
    reader = floor.FrameReader()
    whole = _frame(3, "hello")
    assert reader.feed(whole[:5]) == []
    assert reader.feed(whole[5:-1]) == []
    assert reader.feed(whole[-1:] + _frame(4, "!")) == [(3, "hello"), (4, "!")]


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


def test_summary_sets_modeld_and_the_tree_before_against_the_floor():
    rounds = [{"python_ms_per_token": v, "front_ms_per_token": v / 2, "worker_python_ms_per_token": v / 2,
               "tok_s": 100.0} for v in (0.3, 0.4, 0.35)]
    summary = {"after": {1: {"python_ms_per_token": 0.7}}, "before": {1: {"python_ms_per_token": 1.0}}}
    got = bench.pipeline_summary(rounds, summary)
    assert got["python_ms_per_token"] == pytest.approx(0.35)
    assert got["after_over_pipeline"] == pytest.approx(2.0)
    assert got["pipeline_over_before"] == pytest.approx(0.35)
    assert "pipeline_over_before" not in bench.pipeline_summary(rounds, {"after": summary["after"]})
