"""A load's lowered CPU priority, and the threads it starts put back after."""

from __future__ import annotations

import os
import threading

import pytest

from modeld.server.load_priority import place_compile_caches, run_lowered

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"),
                                reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()))
    thread.start()
    thread.join()
    return box["value"]


def test_a_load_runs_lowered_and_what_it_started_goes_back():
    started = threading.Event()
    stop = threading.Event()
    seen = {}

    def pool_thread():  # a runtime's pool thread, started by the load, living on after it
        seen["pool_tid"] = threading.get_native_id()
        seen["pool_nice_at_start"] = _nice()
        started.set()
        stop.wait(30)

    def load():
        seen["load_nice"] = _nice()
        threading.Thread(target=pool_thread, daemon=True).start()
        started.wait(30)
        return "loaded"

    def run():
        base = _nice()
        result = run_lowered(load, nice=5)
        return base, result, _nice(), os.getpriority(os.PRIO_PROCESS, seen["pool_tid"])

    base, result, after, pool_after = _in_thread(run)
    stop.set()
    assert result == "loaded"
    assert seen["load_nice"] == seen["pool_nice_at_start"] == min(19, base + 5)
    if os.geteuid() == 0:  # putting a value back needs CAP_SYS_NICE
        assert after == pool_after == base


def test_a_failed_load_goes_back_too_and_zero_changes_nothing():
    def failing():
        raise ValueError("bad model")

    def run():
        base = _nice()
        with pytest.raises(ValueError):
            run_lowered(failing, nice=3)
        return base, _nice(), run_lowered(_nice, nice=0)

    base, after, unchanged = _in_thread(run)
    assert unchanged == base
    if os.geteuid() == 0:
        assert after == base


def test_compile_caches_go_under_the_store_and_an_operators_setting_wins(tmp_path, monkeypatch):
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    placed = place_compile_caches(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "4" and "TORCHINDUCTOR_COMPILE_THREADS" not in placed
