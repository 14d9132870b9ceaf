"""bench_step_parts' clock: a part's figure leaves out the llama.cpp calls
made inside it, what no part covers is reported as `other`, and a
skipped decode runs nothing while its rows are kept apart in the medians."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bench = pytest.importorskip("bench_step_parts")


def _burn(ns: int) -> None:
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


class _Step:
    def decode_part(self, llama) -> None:
        llama.llama_decode(20_000_000)  # compute: 20 ms of this thread's CPU

    def python_part(self) -> None:
        _burn(10_000_000)


def test_parts_leave_out_the_compute_inside_them(monkeypatch):
    llama = types.SimpleNamespace(llama_decode=_burn, llama_sampler_sample=_burn)
    module = types.ModuleType("fake_step_module")
    module.Step = _Step
    monkeypatch.setitem(sys.modules, "fake_step_module", module)
    monkeypatch.setattr(_Step, "decode_part", _Step.decode_part)
    monkeypatch.setattr(_Step, "python_part", _Step.python_part)
    clock = bench.Clock()
    clock.wrap_compute(llama)
    clock.wrap_part("fake_step_module:Step.decode_part")
    clock.wrap_part("fake_step_module:Step.python_part")
    step = _Step()
    step.decode_part(llama)
    step.python_part()
    assert clock.compute_ns >= 20_000_000
    assert clock.parts["Step.decode_part"] < 2_000_000  # the call around the decode, not the decode
    assert clock.parts["Step.python_part"] >= 10_000_000


def test_summary_per_token_and_what_no_part_covers():
    got = bench.summarise({"A.a": 3_000, "B.b": 5_000}, step_ns=110_000, compute_ns=100_000, tokens=2)
    assert got["step_thread_python_us_per_token"] == pytest.approx(5.0)
    assert list(got["parts_us_per_token"]) == ["B.b", "A.a", "other"]  # largest first, then the rest
    assert got["parts_us_per_token"]["other"] == pytest.approx(1.0)


def test_parts_switched_off_run_unclocked(monkeypatch):
    module = types.ModuleType("fake_step_module")
    module.Step = _Step
    monkeypatch.setitem(sys.modules, "fake_step_module", module)
    monkeypatch.setattr(_Step, "python_part", _Step.python_part)
    clock = bench.Clock()
    clock.wrap_part("fake_step_module:Step.python_part")
    clock.parts_on = False
    _Step().python_part()
    assert clock.parts == {}
    clock.parts_on = True
    _Step().python_part()
    assert clock.parts["Step.python_part"] >= 10_000_000


def test_skipped_decode_runs_nothing_and_counts_no_compute():
    calls = []

    def decode(*args):
        calls.append("decode")
        _burn(5_000_000)
        return 0

    def sample(*args):
        calls.append("sample")
        _burn(5_000_000)
        return 7

    llama = types.SimpleNamespace(llama_decode=decode, llama_sampler_sample=sample)
    clock = bench.Clock()
    clock.wrap_compute(llama)
    clock.skip_decode = True
    assert llama.llama_decode("ctx", "batch") == 0
    assert calls == [] and clock.compute_ns == 0
    assert llama.llama_sampler_sample("chain", "ctx", 0) == 7  # a sampler still draws, from the buffer as left
    assert calls == ["sample"] and clock.compute_ns >= 5_000_000
    clock.skip_decode = False
    llama.llama_decode("ctx", "batch")
    assert calls == ["sample", "decode"] and clock.compute_ns >= 10_000_000


def test_medians_set_each_stream_count_after_decodes_against_no_decode():
    rows = [{"round": 0, "streams": 1, "unclocked_step_thread_python_us_per_token": 300.0,
             "step_thread_python_us_per_token": 310.0, "parts_us_per_token": {"A.a": 100.0}},
            {"round": 1, "streams": 1, "unclocked_step_thread_python_us_per_token": 320.0,
             "step_thread_python_us_per_token": 330.0, "parts_us_per_token": {"A.a": 120.0}},
            {"round": 0, "streams": 1, "no_decode": True, "unclocked_step_thread_python_us_per_token": 50.0},
            {"round": 1, "streams": 1, "no_decode": True, "unclocked_step_thread_python_us_per_token": 70.0}]
    got = bench.medians(rows)[1]
    assert got["unclocked_step_thread_python_us_per_token"] == pytest.approx(310.0)  # the no-decode rows left out
    assert got["parts_us_per_token"] == {"A.a": pytest.approx(110.0)}
    assert got["no_decode_step_thread_python_us_per_token"] == pytest.approx(60.0)
    assert got["after_decode_over_no_decode"] == pytest.approx(5.17)
