"""BackendRegistry: lazy imports, availability, priority and preference order."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from modeld.backends import registry as registry_module
from modeld.backends.base import Backend, Capability, Verdict
from modeld.backends.errors import InvalidArgument
from modeld.backends.registry import BackendRegistry

FAKE_MODULE = "modeld_unit_fake_backends"


class _FakeBase(Backend):
    capabilities = frozenset({Capability.TENSOR_INFERENCE})

    def can_serve(self, config, model_dir: Path) -> Verdict:
        return Verdict.yes()

    def load(self, config, model_dir: Path):
        raise NotImplementedError


class MissingGpuBackend(_FakeBase):
    name = "fakegpu"
    priority = 500

    def availability(self) -> Verdict:
        return Verdict.no("no CUDA device found; install a GPU build")


class MiddleBackend(_FakeBase):
    name = "middle"
    priority = 50


class TopBackend(_FakeBase):
    name = "top"
    priority = 1000


@pytest.fixture
def fake_backends(monkeypatch):
    module = types.ModuleType(FAKE_MODULE)
    module.MissingGpuBackend = MissingGpuBackend
    module.MiddleBackend = MiddleBackend
    module.TopBackend = TopBackend
    monkeypatch.setitem(sys.modules, FAKE_MODULE, module)
    monkeypatch.setitem(registry_module.BACKENDS, "fakegpu", f"{FAKE_MODULE}:MissingGpuBackend")
    monkeypatch.setitem(registry_module.BACKENDS, "middle", f"{FAKE_MODULE}:MiddleBackend")
    monkeypatch.setitem(registry_module.BACKENDS, "top", f"{FAKE_MODULE}:TopBackend")
    monkeypatch.setitem(registry_module.BACKENDS, "broken", "modeld_unit_no_such_module:Nothing")
    return module


@pytest.fixture(scope="module")
def real_registry() -> BackendRegistry:
    return BackendRegistry()


def test_default_registry_has_onnx_and_reference(real_registry):
    assert [e.name for e in real_registry.entries()] == [
        "onnx", "reference", "iree", "llamacpp", "torch", "onnx-genai", "coreml", "openai", "vllm", "sglang", "tgi"]
    unavailable = {e.name: e.availability.reason for e in real_registry.entries() if not e.availability.ok}
    # Core ML is registered everywhere and says why it cannot run off macOS
    assert unavailable == {"coreml": "Core ML runs only on macOS"}


def test_available_is_sorted_by_priority_onnx_first(real_registry):
    names = [b.name for b in real_registry.available()]
    # remote engines first: they serve only format = "remote" models, whose local file is the fallback
    assert names == ["vllm", "sglang", "tgi", "openai", "onnx", "iree", "llamacpp", "torch", "onnx-genai", "reference"]
    priorities = [b.priority for b in real_registry.available()]
    assert priorities == sorted(priorities, reverse=True)


def test_available_sorts_even_when_registered_in_reverse():
    registry = BackendRegistry(["reference", "onnx"])
    assert [e.name for e in registry.entries()] == ["reference", "onnx"]
    assert [b.name for b in registry.available()] == ["onnx", "reference"]


def test_candidates_without_preference_follow_priority(real_registry):
    assert [b.name for b in real_registry.candidates(())] == [
        "vllm", "sglang", "tgi", "openai", "onnx", "iree", "llamacpp", "torch", "onnx-genai", "reference"]


def test_candidates_honour_the_models_preference_order(real_registry):
    assert [b.name for b in real_registry.candidates(("reference", "onnx"))] == ["reference", "onnx"]
    assert [b.name for b in real_registry.candidates(("reference",))] == ["reference"]
    assert [b.name for b in real_registry.candidates(("onnx",))] == ["onnx"]


def test_get_returns_the_named_backend(real_registry):
    assert real_registry.get("onnx").name == "onnx"
    assert real_registry.get("reference").name == "reference"
    assert real_registry.get("onnx") is real_registry.get("onnx")  # one instance per registry


def test_unknown_backend_lists_known_backends(real_registry):
    with pytest.raises(InvalidArgument) as info:
        real_registry.get("tensorrt")
    assert "unknown backend 'tensorrt'" in str(info.value)
    assert "known backends: coreml, iree, llamacpp, onnx, onnx-genai, openai, reference, sglang, tgi, torch, vllm" in str(info.value)


def test_unknown_preferred_backend_lists_known_backends(real_registry):
    with pytest.raises(InvalidArgument) as info:
        real_registry.candidates(("onnx", "tensorrt"))
    assert "unknown backend 'tensorrt'" in str(info.value)
    assert "known backends: coreml, iree, llamacpp, onnx, onnx-genai, openai, reference, sglang, tgi, torch, vllm" in str(info.value)


def test_unknown_name_at_construction_is_refused():
    with pytest.raises(InvalidArgument, match="unknown backend 'nope'.*known backends: coreml, iree, llamacpp, onnx, onnx-genai, "
                                              "openai, reference, sglang, tgi, torch, vllm"):
        BackendRegistry(["onnx", "nope"])


def test_unavailable_backend_is_kept_with_its_reason(fake_backends):
    registry = BackendRegistry(["fakegpu", "reference"])
    entries = {e.name: e for e in registry.entries()}
    assert entries["fakegpu"].backend is None
    assert entries["fakegpu"].availability == Verdict.no("no CUDA device found; install a GPU build")
    with pytest.raises(InvalidArgument) as info:
        registry.get("fakegpu")
    assert "backend 'fakegpu' is not available here" in str(info.value)
    assert "no CUDA device found; install a GPU build" in str(info.value)
    # despite its top priority it is never offered
    assert [b.name for b in registry.available()] == ["reference"]
    assert [b.name for b in registry.candidates(("fakegpu", "reference"))] == ["reference"]
    assert registry.candidates(("fakegpu",)) == []


def test_a_backend_that_cannot_be_imported_is_unavailable_with_the_import_error(fake_backends):
    registry = BackendRegistry(["broken", "reference"])
    entry = next(e for e in registry.entries() if e.name == "broken")
    assert entry.backend is None
    assert "cannot import modeld_unit_no_such_module" in entry.availability.reason
    with pytest.raises(InvalidArgument, match="'broken' is not available here: cannot import"):
        registry.get("broken")


def test_fake_backends_sort_by_priority_and_preference(fake_backends):
    registry = BackendRegistry(["middle", "reference", "top", "onnx"])
    assert [b.name for b in registry.available()] == ["top", "onnx", "middle", "reference"]
    assert [b.name for b in registry.candidates(("middle", "top"))] == ["middle", "top"]
    assert isinstance(registry.get("top"), TopBackend)


def test_known_backend_list_follows_the_backends_table(fake_backends):
    registry = BackendRegistry(["reference"])
    with pytest.raises(InvalidArgument) as info:
        registry.get("nope")
    assert ("known backends: broken, coreml, fakegpu, iree, llamacpp, middle, onnx, onnx-genai, openai, reference, "
            "sglang, tgi, top, torch, vllm") in str(info.value)


def test_preferred_backend_known_but_not_in_this_registry_is_skipped(fake_backends):
    registry = BackendRegistry(["reference"])
    assert [b.name for b in registry.candidates(("onnx", "reference"))] == ["reference"]


def test_registry_backends_missing_capabilities(real_registry):
    onnx = real_registry.get("onnx")
    assert onnx.missing(frozenset({Capability.TENSOR_INFERENCE})) == frozenset()
    assert onnx.missing(frozenset({Capability.TENSOR_INFERENCE, Capability.SEQUENCE_BATCHING})) == frozenset(
        {Capability.SEQUENCE_BATCHING})
