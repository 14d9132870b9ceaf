"""Backend health from fallbacks: the tracker on a fake clock, the registry's
load order, and the engine with scripted load and run failures."""

from __future__ import annotations

import asyncio
import time
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from modeld.backends import registry as registry_module
from modeld.backends.base import Backend, Capability, LoadedModel, Verdict
from modeld.backends.errors import BackendFailure, InvalidArgument, LoadFailed
from modeld.backends.model_config import TensorSpec
from modeld.backends.registry import BackendRegistry
from modeld.server.backend_health import BackendHealthTracker, HealthPolicy, UnhealthyBackend
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import InferRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tracker(unhealthy_after=3, window_s=10.0, cooldown_s=30.0):
    clock, changes = FakeClock(), []
    tracker = BackendHealthTracker(HealthPolicy(unhealthy_after, window_s, cooldown_s), clock)
    tracker.add_listener(lambda change: changes.append((change.backend, change.is_healthy)))
    return tracker, clock, changes


# -- the tracker ---------------------------------------------------------------


def test_the_threshold_within_the_window_marks_a_backend_unhealthy():
    tracker, clock, changes = _tracker()
    for _ in range(2):
        tracker.record_fallback("onnx", "model 'a' (load): refused")
        clock.now += 1
    assert tracker.is_healthy("onnx") and changes == []
    tracker.record_fallback("onnx", "model 'b' (run): crashed")
    assert not tracker.is_healthy("onnx")
    assert tracker.is_healthy("reference")  # per backend
    assert changes == [("onnx", False)]
    [record] = tracker.unhealthy()
    assert record == UnhealthyBackend("onnx", "3 fallbacks within 10s; last: model 'b' (run): crashed", 30.0)


def test_fallbacks_spread_wider_than_the_window_never_add_up():
    tracker, clock, changes = _tracker()
    for _ in range(10):
        tracker.record_fallback("onnx", "refused")
        clock.now += 5.0  # two fit in a 10 s window, never three
    assert tracker.is_healthy("onnx") and changes == []


def test_it_recovers_when_the_cool_down_ends_and_needs_the_full_count_again():
    tracker, clock, changes = _tracker()
    for _ in range(3):
        tracker.record_fallback("onnx", "refused")
    clock.now += 29.9
    assert not tracker.is_healthy("onnx")
    assert tracker.unhealthy()[0].retry_in_s == pytest.approx(0.1)
    assert tracker.next_recovery_in() == pytest.approx(0.1)
    clock.now += 0.1
    tracker.refresh()
    assert changes == [("onnx", False), ("onnx", True)]
    assert tracker.is_healthy("onnx") and tracker.unhealthy() == [] and tracker.next_recovery_in() is None
    for _ in range(2):
        tracker.record_fallback("onnx", "refused")
    assert tracker.is_healthy("onnx")  # the history before the cool-down is gone
    tracker.record_fallback("onnx", "refused")
    assert changes[-1] == ("onnx", False)


def test_failures_during_the_cool_down_neither_count_nor_extend_it():
    tracker, clock, changes = _tracker(cooldown_s=30.0)
    for _ in range(3):
        tracker.record_fallback("onnx", "refused")
    for _ in range(5):  # tried as a last resort, failing again
        clock.now += 5
        tracker.record_fallback("onnx", "refused again")
    clock.now += 5
    assert tracker.is_healthy("onnx")
    assert changes == [("onnx", False), ("onnx", True)]


def test_a_recovery_is_heard_by_whoever_asks_first():
    tracker, clock, changes = _tracker(unhealthy_after=1, cooldown_s=1.0)
    tracker.record_fallback("onnx", "refused")
    tracker.record_fallback("torch", "refused")
    clock.now += 2
    assert tracker.unhealthy() == []
    assert changes == [("onnx", False), ("torch", False), ("onnx", True), ("torch", True)]


@pytest.mark.parametrize("kwargs", [{"unhealthy_after": 0}, {"unhealthy_after": True}, {"window_s": 0},
                                    {"cooldown_s": -1.0}])
def test_a_policy_out_of_range_is_refused(kwargs):
    with pytest.raises(ValueError):
        HealthPolicy(**kwargs)


# -- scripted backends through the registry and the engine --------------------------


class ScriptedModel(LoadedModel):
    def __init__(self, owner: ScriptedBackend) -> None:
        self.owner, self.nbytes = owner, 10
        self.inputs = (TensorSpec("x", "FP32", (-1, 2)),)
        self.outputs = (TensorSpec("y", "FP32", (-1, 2)),)

    def execute(self, inputs, output_names):
        if self.owner.fail_runs:
            raise BackendFailure(f"{self.owner.name} crashed")
        return {"y": inputs["x"] + self.owner.offset}

    def unload(self) -> None:
        pass


class ScriptedBackend(Backend):
    capabilities = frozenset({Capability.TENSOR_INFERENCE})

    def __init__(self, name: str, priority: int, offset: float) -> None:
        self.name, self.priority, self.offset = name, priority, offset
        self.num_loads = 0
        self.fail_loads = self.fail_runs = False

    def can_serve(self, config, model_dir) -> Verdict:
        return Verdict.yes()

    def estimate_bytes(self, config, model_dir) -> int:
        return 10

    def load(self, config, model_dir) -> LoadedModel:
        self.num_loads += 1
        if self.fail_loads:
            raise LoadFailed(f"{self.name} refuses the file")
        return ScriptedModel(self)


@pytest.fixture
def backends(monkeypatch):
    fast, slow = ScriptedBackend("fast", 10, 1.0), ScriptedBackend("slow", 1, 2.0)
    module = types.ModuleType("health_scripted_backends")
    module.Fast, module.Slow = (lambda: fast), (lambda: slow)
    monkeypatch.setitem(sys.modules, "health_scripted_backends", module)
    monkeypatch.setattr(registry_module, "BACKENDS", {"fast": "health_scripted_backends:Fast",
                                                      "slow": "health_scripted_backends:Slow"})
    return fast, slow


def test_the_load_order_puts_unhealthy_backends_last(backends):
    registry = BackendRegistry()
    names = lambda backends: [b.name for b in backends]  # noqa: E731
    assert names(registry.load_order((), lambda name: True)) == ["fast", "slow"]
    assert names(registry.load_order((), lambda name: name != "fast")) == ["slow", "fast"]
    assert names(registry.load_order(("slow", "fast"), lambda name: name != "slow")) == ["fast", "slow"]
    # after a failure on `fast`: only what ranks below it, healthy or not
    fast = registry.get("fast")
    assert names(registry.load_order((), lambda name: name != "fast", after=fast)) == ["slow"]
    assert names(registry.load_order((), lambda name: False, after=fast)) == ["slow"]
    assert registry.load_order(("fast",), lambda name: True, after=fast) == []


def _engine(tmp_path: Path, **policy) -> Engine:
    root = tmp_path / "repo"
    for name, toml in (("m", ""), ("n", ""), ("only_fast", 'backends = ["fast"]\n')):
        (root / name).mkdir(parents=True)
        (root / name / "model.toml").write_text(toml)
    return Engine(ModelRepository(root, tmp_path / "inline"), BackendRegistry(), MemoryManager(10_000), Metrics(),
                  health_policy=HealthPolicy(**policy))


def _sample(engine: Engine, name: str, **labels) -> float | None:
    return engine.metrics.registry.get_sample_value(name, labels)


async def _reload(engine: Engine, name: str) -> str:
    served = await engine.load(name)
    await engine.unload(name)
    return served.backend.name


async def test_scripted_load_failures_mark_a_backend_unhealthy_until_the_cool_down_ends(backends, tmp_path):
    fast, slow = backends
    # a cool-down long enough to outlast the checks below on a loaded machine
    # (2 s did not, at a load average of 7)
    engine = _engine(tmp_path, unhealthy_after=3, window_s=60.0, cooldown_s=6.0)
    assert _sample(engine, "modeld_backend_healthy", backend="fast") == 1
    fast.fail_loads = True
    with capture_logs() as logs:
        for _ in range(3):
            assert await _reload(engine, "m") == "slow"
        assert fast.num_loads == 3
        assert _sample(engine, "modeld_backend_fallbacks_total", model="m", from_backend="fast", stage="load") == 3
        assert _sample(engine, "modeld_backend_healthy", backend="fast") == 0
        [marked] = [e for e in logs if e["event"] == "backend_unhealthy"]
        assert marked["backend"] == "fast" and "3 fallbacks within 60s" in marked["reason"]
        assert "fast refuses the file" in marked["reason"]
        [unhealthy] = engine.unhealthy_backends()
        assert unhealthy.name == "fast" and 0 < unhealthy.retry_in_s <= 6.0

        # during the cool-down new loads skip it: no attempt, no new fallback
        assert await _reload(engine, "n") == "slow"
        assert fast.num_loads == 3
        # unless nothing else may serve the model: then it is still tried, last
        with pytest.raises(InvalidArgument, match="fast refuses the file"):
            await engine.load("only_fast")
        assert fast.num_loads == 4
        assert not [e for e in logs if e["event"] == "backend_recovered"]

        fast.fail_loads = False
        deadline = time.monotonic() + 20
        while _sample(engine, "modeld_backend_healthy", backend="fast") == 0:  # the engine's timer, no load asking
            assert time.monotonic() < deadline, "the cool-down never ended"
            await asyncio.sleep(0.05)
    assert [e["backend"] for e in logs if e["event"] == "backend_recovered"] == ["fast"]
    assert engine.unhealthy_backends() == []
    assert await _reload(engine, "n") == "fast"
    await engine.stop()


async def test_a_model_on_an_unhealthy_backend_still_falls_back_when_its_run_fails(backends, tmp_path):
    fast, slow = backends
    engine = _engine(tmp_path, unhealthy_after=1, window_s=60.0, cooldown_s=30.0)
    await engine.load("m")  # on fast, while healthy
    fast.fail_loads = True
    assert (await engine.load("n")).backend.name == "slow"
    assert not engine.backend_health.is_healthy("fast")
    fast.fail_runs = True
    result = await engine.infer(InferRequest("m", {"x": np.zeros((1, 2), np.float32)}))
    np.testing.assert_array_equal(result.outputs["y"], np.full((1, 2), 2.0, np.float32))  # slow's answer
    assert engine.served("m").backend.name == "slow"
    assert _sample(engine, "modeld_backend_fallbacks_total", model="m", from_backend="fast", stage="run") == 1
    await engine.stop()
