"""The data plane's answers, with a scripted backend: which model, is it
known, inline loads, the request size cap, statistics and load figures."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from modeld.backends import registry as registry_module
from modeld.backends.base import Backend, Capability, LoadedModel, Verdict
from modeld.backends.errors import InvalidArgument, NotFound, ResourceExhausted
from modeld.backends.model_config import ModelKind, TensorSpec
from modeld.backends.registry import BackendRegistry
from modeld.server.dataplane import DataPlane, ModelMetadata
from modeld.server.engine import Engine
from modeld.server.lifecycle import Lifecycle
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import InferRequest, ModelState

SPEC = (TensorSpec("x", "FP32", (-1, 2)),)


class Doubling(LoadedModel):
    nbytes, inputs, outputs = 100, SPEC, (TensorSpec("y", "FP32", (-1, 2)),)

    def execute(self, inputs, output_names):
        return {"y": inputs["x"] * 2}

    def unload(self):
        pass


class Scripted(Backend):
    name, priority = "scripted", 10
    capabilities = frozenset({Capability.TENSOR_INFERENCE, Capability.DYNAMIC_BATCHING})

    def __init__(self) -> None:
        self.loads = 0

    def can_serve(self, config, model_dir) -> Verdict:
        return Verdict.yes()

    def estimate_bytes(self, config, model_dir) -> int:
        return 100

    def load(self, config, model_dir) -> LoadedModel:
        self.loads += 1
        return Doubling()


@pytest.fixture
def backend(monkeypatch) -> Scripted:
    scripted = Scripted()
    module = types.ModuleType("dataplane_backends")
    module.Scripted = lambda: scripted
    monkeypatch.setitem(sys.modules, "dataplane_backends", module)
    monkeypatch.setattr(registry_module, "BACKENDS", {"scripted": "dataplane_backends:Scripted"})
    return scripted


@pytest.fixture
def plane(backend, tmp_path: Path) -> DataPlane:
    root = tmp_path / "repo"
    for name, limits in (("m", ""), ("capped", "[limits]\nmax_request_bytes = 10\n")):
        (root / name).mkdir(parents=True)
        (root / name / "model.toml").write_text("[batching]\nmax_batch_size = 8\n" + limits)
    engine = Engine(ModelRepository(root, tmp_path / "inline"), BackendRegistry(), MemoryManager(1000), Metrics())
    return DataPlane(engine, Lifecycle(), max_request_bytes=50)


def test_a_name_nobody_knows_and_a_version_not_served_are_not_found(plane):
    plane.check_known("m")
    plane.check_known("m", "1")
    with pytest.raises(NotFound, match="unknown model 'nope'"):
        plane.check_known("nope")
    with pytest.raises(NotFound, match="no version '2'"):
        plane.check_known("m", "2")
    with pytest.raises(NotFound):
        plane.model_state("nope")
    assert plane.model_state("m") is ModelState.UNAVAILABLE
    assert not plane.is_model_ready("nope")  # a probe of gRPC's ModelReady answers, it does not refuse
    assert plane.find_status("nope") is None and plane.find_status("m").name == "m"


async def test_metadata_loads_the_model_and_is_a_frozen_view(plane, backend):
    model = await plane.model("m")
    assert model == ModelMetadata("m", "scripted", ModelKind.TENSOR, False, SPEC, Doubling.outputs, 8)
    assert model.platform == "modeld_scripted" and model.version == "1"
    assert plane.is_model_ready("m") and not await plane.is_language_model("m")
    with pytest.raises(AttributeError):
        model.name = "other"  # frozen: a front cannot change what the engine serves
    assert backend.loads == 1


async def test_statistics_of_one_model_or_of_every_known_one(plane):
    assert [s.name for s in plane.statistics()] == ["capped", "m"]
    assert plane.statistics("m")[0].nbytes is None  # not served yet
    await plane.infer(InferRequest("m", {"x": np.ones((1, 2), np.float32)}))
    (stats,) = plane.statistics("m", "1")
    assert stats.nbytes == 100 and stats.stats.inference_count == 1
    with pytest.raises(NotFound):
        plane.statistics("nope")


@pytest.mark.parametrize("config, files, message", [
    (7, {}, "must be a string"),
    (None, {"file:1/model.onnx": b"x"}, "need a 'config' parameter"),
])
async def test_an_inline_load_needs_its_config_as_a_string(plane, config, files, message):
    with pytest.raises(InvalidArgument, match=message):
        await plane.load("x", config, files)


async def test_a_load_by_name_serves_the_repository_model(plane, backend):
    await plane.load("m")
    assert plane.is_model_ready("m") and backend.loads == 1
    await plane.unload("m")
    assert not plane.is_model_ready("m")


def test_the_request_size_cap_is_the_model_s_else_the_daemon_s_and_loads_nothing(plane, backend):
    plane.check_request_size("m", 50)
    with pytest.raises(ResourceExhausted, match="daemon's request size limit 50"):
        plane.check_request_size("m", 51)
    with pytest.raises(ResourceExhausted, match="'capped''s request size limit 10"):
        plane.check_request_size("capped", 11)
    plane.check_request_size("m", 0)  # size unknown: nothing to judge
    assert backend.loads == 0


async def test_load_figures_and_memory_come_from_the_engine_s_books(plane):
    await plane.model("m")
    loads = {load.status.name: load for load in plane.model_loads()}
    assert loads["m"].memory_bytes == 100 and loads["m"].queue_depth == 0
    assert loads["capped"].memory_bytes == 0 and loads["capped"].status.state is ModelState.UNAVAILABLE
    memory = plane.memory()
    assert memory.budget_bytes == 1000 and memory.used_bytes == memory.daemon_bytes + 100
    assert plane.unhealthy_backends() == []


def test_a_draining_daemon_is_not_ready(plane):
    assert plane.is_ready()
    plane.lifecycle.is_draining = True
    assert plane.is_draining and not plane.is_ready()
