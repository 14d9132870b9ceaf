"""Load/evict churn under a memory budget too small for the models it serves.

Tensor models on the onnx and reference backends (graphs built in code,
each with a weight vector that sizes it) take turns: every request
lazily loads its model, and the budget holds only a few, so each load
evicts the least recently used idle one. Meanwhile one model has a
request in flight the whole time (its batch waits for company that only
comes at the end): it must never be evicted.

RSS: the daemon's resident memory (/proc/<pid>/status VmRSS) is sampled
every 20 ms throughout. The budget holds for the whole process (the
daemon's own share is in its books beside the models), so it is sized as
an idle daemon's share plus room for a few models, and asserted: max RSS
<= budget + 10%. The RSS before anything was loaded, and after one model
on each backend was loaded and unloaded again (the runtimes' code and
allocator arenas in place), are recorded too.

`make test` runs 50 cycles; `make stress` 1,000 (MODELD_STRESS_SCALE=20)
and records the figures in bench/results/stress.json.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import onnx_fixtures
from daemon import daemon_share, start_daemon
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from stress.stress_config import record, scaled

pytestmark = pytest.mark.stress

CYCLES = scaled(50)
MIB = 1024**2
# floats: 32 MiB of weights, which is what an ONNX model counts once loaded (its figure is
# the memory the load keeps; the reference runtime keeps more); six of them do not fit the room
WEIGHTS = 8 * MIB
MODEL_ROOM = 192 * MIB  # beside the daemon's own share: the held model and two or three others
CHURN = [("onnx0", "onnx"), ("ref0", "reference"), ("onnx1", "onnx"), ("onnx2", "onnx"), ("ref1", "reference"),
         ("onnx3", "onnx")]
HELD_DELAY_US = 3_600 * 10**6  # the held model's batch waits an hour for company
HELD_BATCH = 8


def _model(root: Path, name: str, backend: str, batching: str = "") -> None:
    (root / name).mkdir()
    (root / name / "model.onnx").write_bytes(onnx_fixtures.add_fp32(WEIGHTS))
    (root / name / "model.toml").write_text(
        f'format = "onnx"\nbackends = ["{backend}"]\nmemory_estimate = "66MiB"\n{batching}\n')


def _request(model: str, rows: int = 1) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.zeros((rows, 4), np.float32).tobytes())
    return request


def _ones(response: pb.ModelInferResponse, rows: int) -> bool:
    return np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [1.0] * (4 * rows)


class RssSampler(threading.Thread):
    def __init__(self, daemon) -> None:
        super().__init__(daemon=True)
        self.target, self.max, self._done = daemon, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self.max = max(self.max, self.target.rss())
            except (FileNotFoundError, RuntimeError):
                return  # the daemon is gone: the test says so
            time.sleep(0.02)

    def stop(self) -> int:
        self._done.set()
        self.join(5)
        return self.max


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    _model(root, "held", "onnx", f"[batching]\nmax_batch_size = {HELD_BATCH}\nmax_queue_delay_us = {HELD_DELAY_US}")
    for name, backend in CHURN:
        _model(root, name, backend)
    budget = daemon_share() + MODEL_ROOM
    proc = start_daemon("--no-preload", "--http-port", "-1", "--memory-budget", str(budget), repository=root,
                        env={"MODELD_DRAIN_DELAY_S": "0"})
    proc.budget = budget
    yield proc
    assert proc.stop() == 0


def test_churn_stays_within_budget_and_never_evicts_a_busy_model(daemon):
    rss_start, budget = daemon.rss(), daemon.budget
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name in ("onnx0", "ref0"):  # the runtimes' code and arenas: the baseline, not model memory
            assert _ones(stub.ModelInfer(_request(name), timeout=60), 1)
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=name), timeout=60)
        rss_baseline = daemon.rss()

        held: dict = {}
        waiter = threading.Thread(target=lambda: held.update(response=stub.ModelInfer(_request("held"), timeout=3600)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not any(e.get("model") == "held" for e in daemon.events("model_loaded")):
            assert time.monotonic() < deadline, "the held model did not load"
            time.sleep(0.05)
        sampler = RssSampler(daemon)
        sampler.start()
        try:
            for cycle in range(CYCLES):
                name = CHURN[cycle % len(CHURN)][0]
                assert _ones(stub.ModelInfer(_request(name), timeout=120), 1), f"cycle {cycle}: {name}"
                assert waiter.is_alive(), "the held request ended early"
                assert daemon.proc.poll() is None
        finally:
            rss_max = sampler.stop()
        # company at last: the held batch fills and runs
        assert _ones(stub.ModelInfer(_request("held", HELD_BATCH - 1), timeout=60), HELD_BATCH - 1)
        waiter.join(60)
        assert _ones(held["response"], 1)

    evicted = [e.get("model") for e in daemon.events("model_evicted")]
    loads = len(daemon.events("model_loaded"))
    over = rss_max / budget
    record("churn", {
        "cycles": CYCLES, "models": [n for n, _ in CHURN], "backends": sorted({b for _, b in CHURN}),
        "loads": loads, "evictions": len(evicted), "held_model_evictions": evicted.count("held"),
        "budget_bytes": budget, "model_room_bytes": MODEL_ROOM, "rss_start_bytes": rss_start,
        "rss_after_runtimes_bytes": rss_baseline, "rss_max_bytes": rss_max, "rss_max_vs_budget": round(over, 3),
    })
    assert "held" not in evicted
    assert len(evicted) >= CYCLES - 4  # nearly every load had to make room
    assert rss_max <= budget * 1.10, (
        f"RSS reached {rss_max / MIB:.1f} MiB; the budget is {budget / MIB:.0f} MiB for the whole process")
