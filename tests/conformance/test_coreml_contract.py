"""The coreml backend's row of the conformance table.

Off macOS the backend is registered but unavailable, and the table says why.
On macOS a torch module exported in code is converted, compiled, loaded and
run through the engine, and its answers are checked against torch's own.
"""

from __future__ import annotations

import asyncio
import json
import platform

import numpy as np
import pytest
from capability_table import record

from modeld.backends.base import Capability
from modeld.backends.coreml.backend import CoreMLBackend
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import InferRequest

IS_MACOS = platform.system() == "Darwin"


def test_coreml_is_registered_and_says_why_it_cannot_run_here():
    [entry] = [e for e in BackendRegistry(["coreml"]).entries()]
    record("coreml", "available", "yes" if entry.backend else f"no: {entry.availability.reason}")
    if IS_MACOS:
        return
    assert entry.backend is None and entry.availability.reason == "Core ML runs only on macOS"
    for capability in Capability:
        declared = capability in CoreMLBackend.capabilities
        record("coreml", capability.value, "declared; not run: Core ML runs only on macOS (the conversion is "
                                           "tested in tests/unit/test_coreml.py)" if declared else "no")


def _exported_linear(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    return module, path.read_bytes()


@pytest.mark.skipif(not IS_MACOS, reason="Core ML runs only on macOS")
async def test_a_converted_torch_program_runs_through_the_engine_and_matches_torch(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("MODELD_COREML_CACHE", str(tmp_path / "cache"))
    module, data = _exported_linear(tmp_path)
    engine = Engine(ModelRepository(None, tmp_path / "inline"), BackendRegistry(["coreml"]), MemoryManager(2**31),
                    Metrics())
    config = {"format": "coreml", "artifact": "model.pt2", "backends": ["coreml"],
              "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
              "batching": {"max_batch_size": 16, "max_queue_delay_us": 2000}}
    served = await engine.load("linear", engine.repository.add_inline("linear", json.dumps(config),
                                                                      {"file:model.pt2": data}))
    assert served.backend.name == "coreml" and served.loaded.nbytes > 0
    rows = [np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32) for i in range(12)]
    results = await asyncio.gather(*(engine.infer(InferRequest("linear", {"x": r})) for r in rows))
    with torch.no_grad():
        for row, result in zip(rows, results):
            np.testing.assert_allclose(result.outputs["y"], module(torch.from_numpy(row)).numpy(), rtol=1e-3, atol=1e-4)
    runs = engine.stats("linear").execution_count
    record("coreml", "tensor_inference", "yes: matches torch within 1e-3")
    record("coreml", "dynamic_batching", f"declared=True, merged {len(rows)} requests into {runs} runs")
    assert runs < len(rows)
    await engine.unload("linear")
    assert engine.memory.used == 0
    await engine.stop()
