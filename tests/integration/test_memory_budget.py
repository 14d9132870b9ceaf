"""The global memory budget through a real daemon: LRU eviction, pinning,
refusal that changes nothing, lazy reload, and bytes checked against RSS."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from daemon import daemon_share, start_daemon
from polling import wait_until

MB = 1_000_000
WEIGHTS = 10_000_000  # float32 -> a 40 MB model file


# what an idle daemon holds of its budget, plus the few MB its first model
# load leaves behind (runtime arenas and threads): room for two 40 MB models
# stays whatever this process measures, and three never fit
ROOM = 110 * MB


@pytest.fixture
def small_daemon(tmp_path):
    """Room for two 40 MB models, not three, beside the daemon's own share."""
    daemon = start_daemon("--no-preload", "--memory-budget", str(daemon_share() + ROOM), repository=tmp_path)
    yield daemon
    assert daemon.stop() == 0


def _load(client, name, num_weights=WEIGHTS, **extra):
    config = onnx_fixtures.triton_config(name, [("x", "FP32", [4])], [("y", "FP32", [4])], **extra)
    client.load_model(name, config=json.dumps(config), files={"file:1/model.onnx": onnx_fixtures.add_fp32(num_weights)})


def _infer(client, name):
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(client.infer(name, [x]).as_numpy("y"), 1.0, rtol=1e-4)


def _states(client) -> dict[str, str]:
    return {m.name: m.state for m in client.get_model_repository_index().models}


def _bytes(client, name) -> int:
    return client.get_inference_statistics(name).model_stats[0].memory_usage[0].byte_size


def _metric(daemon, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(f"{name}{{{label_text}}}" if labels else name) + r" ([0-9.e+]+)"
    match = re.search(pattern, text)
    # a missing series is a failure, not a zero: a renamed metric would
    # otherwise pass every "== 0" check
    assert match, f"no {name}{labels or ''} in /metrics"
    return float(match.group(1))


def test_lru_eviction_sequence(small_daemon):
    client = tc.InferenceServerClient(small_daemon.address)
    _load(client, "a")
    _load(client, "b")
    assert _bytes(client, "a") == pytest.approx(40 * MB, rel=0.05)
    for name in ("a", "b", "a"):
        _infer(client, name)
    _load(client, "c")
    assert _states(client) == {"a": "READY", "b": "UNAVAILABLE", "c": "READY"}
    assert _metric(small_daemon, "modeld_evictions_total", backend="onnx", model="b") == 1
    models_used = _metric(small_daemon, "modeld_memory_used_bytes") - _metric(small_daemon, "modeld_memory_daemon_bytes")
    assert models_used == pytest.approx(80 * MB, rel=0.05)
    # b was evicted, not forgotten: a request loads it again, evicting the LRU (a).
    _infer(client, "b")
    assert _states(client) == {"a": "UNAVAILABLE", "b": "READY", "c": "READY"}


def test_pinned_models_stay_and_a_load_that_cannot_fit_changes_nothing(small_daemon):
    client = tc.InferenceServerClient(small_daemon.address)
    _load(client, "pinned", pinned=True)
    _load(client, "other")
    _load(client, "newer")  # must evict "other", never "pinned"
    assert _states(client) == {"pinned": "READY", "other": "UNAVAILABLE", "newer": "READY"}
    before = _states(client)
    with pytest.raises(InferenceServerException) as err:
        _load(client, "huge", num_weights=3 * WEIGHTS)  # 120 MB > the budget less the daemon's share
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "memory budget" in err.value.message() and "--memory-budget" in err.value.message()
    after = _states(client)
    assert {k: v for k, v in after.items() if k != "huge"} == before and after.get("huge") != "READY"
    _infer(client, "pinned")
    _infer(client, "newer")


def test_model_without_lazy_load_is_unavailable_until_loaded(small_daemon):
    client = tc.InferenceServerClient(small_daemon.address)
    _load(client, "strict", lazy_load=False)
    _load(client, "x1")
    _infer(client, "x1")
    _load(client, "x2")  # evicts strict, the least recently used
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "strict")
    assert err.value.status() == "StatusCode.UNAVAILABLE" and "lazy loading is off" in err.value.message()
    client.load_model("strict")
    _infer(client, "strict")


def _settled_rss(daemon, still_bytes: int = 2 * MB) -> int:
    """The daemon's resident memory once it has stopped moving (threads it
    starts after start-up or a load still allocate for a moment), so the
    growth measured from it is the model's, not the start-up's."""
    readings = [daemon.rss()]

    def settled() -> int | None:
        time.sleep(0.25)
        readings.append(daemon.rss())
        return readings[-1] if abs(readings[-1] - readings[-2]) < still_bytes else None

    return wait_until(settled, what="the daemon's resident memory to settle")


def test_reported_bytes_match_rss_growth_and_unload_frees_them():
    daemon = start_daemon("--no-preload")
    try:
        client = tc.InferenceServerClient(daemon.address)
        rss_before = _settled_rss(daemon)
        client.load_model("minilm")
        reported = _bytes(client, "minilm")
        grown = daemon.rss() - rss_before
        assert 0.6 <= grown / reported <= 1.5, (grown, reported)
        client.unload_model("minilm")
        # what the books hold now is the daemon's own share, no model
        assert _metric(daemon, "modeld_memory_used_bytes") == _metric(daemon, "modeld_memory_daemon_bytes") > 0
        wait_until(lambda: rss_before + grown - daemon.rss() >= 0.5 * reported,
                   what=f"half of minilm's {reported} bytes back from the process")
    finally:
        assert daemon.stop() == 0


def test_the_budget_holds_for_the_whole_process(tmp_path):
    """The books count the daemon's own resident memory beside its models,
    so what the process holds stays within the budget while loads evict."""
    share = daemon_share()
    budget = share + ROOM
    daemon = start_daemon("--no-preload", "--memory-budget", str(budget), repository=tmp_path)
    try:
        client = tc.InferenceServerClient(daemon.address)
        started = daemon.events("daemon_started")[0]
        assert 0 < started["daemon_bytes"] <= budget
        for name in ("p", "q", "r", "s", "p"):
            _load(client, name)
            _infer(client, name)
            assert daemon.tree_rss() <= budget, (name, daemon.tree_rss(), budget)
            daemon_bytes = _metric(daemon, "modeld_memory_daemon_bytes")
            used = _metric(daemon, "modeld_memory_used_bytes")
            assert daemon_bytes >= started["daemon_bytes"] * 0.99
            assert used == pytest.approx(daemon_bytes + sum(_bytes(client, n) for n, state in _states(client).items()
                                                            if state == "READY"), abs=1)
            assert used <= budget
        assert sum(state == "READY" for state in _states(client).values()) == 2
    finally:
        assert daemon.stop() == 0


def test_one_large_batch_does_not_leave_onnxruntime_s_arena_at_its_peak():
    """onnxruntime's CPU arena keeps the memory of the largest batch it ran
    unless it shrinks after each run: 64 sentences of 250 words once left
    minilm's daemon 1 GB larger for good (and a 10-minute soak at 2.1 GB)."""
    daemon = start_daemon("--no-preload")
    try:
        client = tc.InferenceServerClient(daemon.address)
        client.load_model("minilm")
        before = _settled_rss(daemon)
        texts = tc.InferInput("text", [64], "BYTES")
        texts.set_data_from_numpy(np.array([" ".join(["word"] * 250).encode()] * 64, dtype=object))
        assert client.infer("minilm", [texts]).as_numpy("embedding").shape == (64, 384)
        wait_until(lambda: daemon.rss() - before < 150 * MB, what=f"the daemon back within 150 MB of {before} bytes")
    finally:
        assert daemon.stop() == 0
