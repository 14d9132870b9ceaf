"""Engine behaviour with scripted backends: selection, shared loads,
run-time fallback, and in-flight protection from eviction."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from modeld.backends import registry as registry_module
from modeld.backends.base import Backend, Capability, LoadedModel, Verdict
from modeld.backends.errors import BackendFailure, InvalidArgument, LoadFailed, ResourceExhausted
from modeld.backends.model_config import TensorSpec
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import InferRequest, ModelState
from polling import wait_until_async

SPEC = (TensorSpec("x", "FP32", (-1, 2)),)


class ScriptedModel(LoadedModel):
    def __init__(self, owner: "ScriptedBackend", name: str) -> None:
        self.owner, self.name = owner, name
        self.nbytes, self.inputs, self.outputs = owner.nbytes, SPEC, (TensorSpec("y", "FP32", (-1, 2)),)

    def execute(self, inputs, output_names):
        if self.name in self.owner.held:
            assert self.owner.gate.wait(5), "test gate never opened"
        self.owner.runs += 1
        if self.owner.fail_runs:
            raise BackendFailure(f"{self.owner.name} crashed")
        return {"y": inputs["x"] + self.owner.offset}

    def unload(self):
        self.owner.unloads += 1


class ScriptedBackend(Backend):
    capabilities = frozenset({Capability.TENSOR_INFERENCE, Capability.DYNAMIC_BATCHING})

    def __init__(self, name: str, priority: int, offset: float) -> None:
        self.name, self.priority, self.offset = name, priority, offset
        self.nbytes, self.loads, self.unloads, self.runs = 100, 0, 0, 0
        self.fail_load = self.fail_runs = False
        # runs of the models named in `held` block until `gate` opens
        self.held: set[str] = set()
        self.gate = threading.Event()

    def can_serve(self, config, model_dir) -> Verdict:
        return Verdict.yes()

    def estimate_bytes(self, config, model_dir) -> int:
        return self.nbytes

    def load(self, config, model_dir) -> LoadedModel:
        self.loads += 1
        if self.fail_load:
            raise LoadFailed(f"{self.name} refuses")
        return ScriptedModel(self, config.name)


@pytest.fixture
def backends(monkeypatch):
    fast, slow = ScriptedBackend("fast", 10, 1.0), ScriptedBackend("slow", 1, 1.0)
    module = types.ModuleType("scripted_backends")
    module.Fast, module.Slow = (lambda: fast), (lambda: slow)
    monkeypatch.setitem(sys.modules, "scripted_backends", module)
    monkeypatch.setattr(registry_module, "BACKENDS", {"fast": "scripted_backends:Fast", "slow": "scripted_backends:Slow"})
    return fast, slow


def _engine(tmp_path: Path, budget: int = 1000) -> Engine:
    root = tmp_path / "repo"
    for name in ("m", "n", "o"):
        (root / name).mkdir(parents=True)
        (root / name / "model.toml").write_text("[batching]\nmax_batch_size = 8\n")
    return Engine(ModelRepository(root, tmp_path / "inline"), BackendRegistry(), MemoryManager(budget), Metrics())


async def _until(predicate) -> None:
    await wait_until_async(predicate, interval=0.001)


def _request(model="m", value=0.0):
    return InferRequest(model, {"x": np.full((1, 2), value, np.float32)})


async def test_highest_priority_backend_serves_and_load_failure_falls_back(backends, tmp_path):
    fast, slow = backends
    engine = _engine(tmp_path)
    assert (await engine.load("m")).backend is fast
    fast.fail_load = True
    assert (await engine.load("n")).backend is slow
    assert engine.metrics.fallbacks.labels("n", "fast", "load")._value.get() == 1


async def test_concurrent_loads_of_one_model_share_one_load(backends, tmp_path):
    fast, _ = backends
    engine = _engine(tmp_path)
    served = await asyncio.gather(*(engine.load("m") for _ in range(5)))
    assert fast.loads == 1 and all(s is served[0] for s in served)


async def test_run_time_failure_moves_the_model_to_the_next_backend(backends, tmp_path):
    fast, slow = backends
    engine = _engine(tmp_path)
    await engine.load("m")
    fast.fail_runs = True
    result = await engine.infer(_request(value=2.0))
    np.testing.assert_array_equal(result.outputs["y"], [[3.0, 3.0]])
    assert result.backend == "slow" and engine.served("m").backend is slow
    assert engine.metrics.fallbacks.labels("m", "fast", "run")._value.get() == 1
    await _until(lambda: fast.unloads)  # released in the background
    assert fast.unloads == 1  # the failed instance is released


async def test_model_with_requests_in_flight_is_not_evicted(backends, tmp_path):
    fast, _ = backends
    engine = _engine(tmp_path, budget=200)  # two models fit
    m, n = await engine.load("m"), await engine.load("n")
    fast.held.add("m")  # m's run blocks inside the backend
    busy = asyncio.create_task(engine.infer(_request("m")))
    try:
        await _until(lambda: engine.memory.entry(m.key).num_in_flight == 1)
        # A request to n after m's makes m the least recently used model, so
        # plain LRU order would pick m: only the in-flight guard can spare it.
        await engine.infer(_request("n"))
        assert engine.memory.keys_lru_first() == [m.key, n.key]
        await engine.load("o")
        assert engine.state_of("m") is ModelState.READY and engine.state_of("n") is ModelState.UNAVAILABLE
        assert fast.unloads == 1 and not busy.done()
    finally:
        fast.gate.set()
    np.testing.assert_array_equal((await busy).outputs["y"], [[1.0, 1.0]])


async def test_invalid_input_is_rejected_before_batching(backends, tmp_path):
    fast, _ = backends
    engine = _engine(tmp_path)
    with pytest.raises(InvalidArgument, match="must have shape"):
        await engine.infer(InferRequest("m", {"x": np.zeros((1, 3), np.float32)}))
    assert fast.runs == 0


async def test_the_daemon_s_own_memory_is_in_the_books_and_its_growth_evicts_idle_models(backends, tmp_path,
                                                                                        monkeypatch):
    """The budget holds for the whole process: the daemon's resident bytes
    outside its in-process models count, at start and as they grow."""
    from modeld.server.engine import accounting

    fast, _ = backends
    base = [400]  # the daemon's own resident bytes; each loaded model adds its 100
    monkeypatch.setattr(accounting, "own_rss", lambda: base[0] + fast.nbytes * (fast.loads - fast.unloads))
    engine = _engine(tmp_path, budget=700)
    engine.count_daemon_memory(interval_s=0.01)
    try:
        assert engine.memory.daemon_bytes == 400 and engine.memory.used == 400
        m = await engine.load("m")
        await engine.load("n")
        engine.refresh_daemon_bytes()
        assert engine.memory.daemon_bytes == 400 and engine.memory.used == 600
        assert engine.metrics.daemon_bytes._value.get() == 400
        with pytest.raises(ResourceExhausted, match="the daemon itself holds 400"):
            engine.memory.plan(400)  # evicting both models leaves 300: the daemon's share is never freed
        # the daemon grows by 150 outside any model (a runtime imported, say):
        # the books pass the budget, so the idle least recently used model goes
        base[0] = 550
        await _until(lambda: m.key not in engine.memory)
        assert engine.state_of("n") is ModelState.READY and fast.unloads == 1
        assert engine.memory.daemon_bytes == 550 and engine.memory.used == 650 <= engine.memory.budget
        assert m.key not in engine.memory
    finally:
        await engine.stop()
