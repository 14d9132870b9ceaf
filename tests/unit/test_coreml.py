"""The coreml backend where Core ML cannot run: its availability, selection
with macOS faked, conversion of models built in code (spec checked, never
run: predictions need macOS), and the compile cache's bookkeeping."""

from __future__ import annotations

import platform
import types
from pathlib import Path

import pytest

import onnx_fixtures
from modeld.backends.coreml import backend as coreml_backend
from modeld.backends.coreml.backend import NOT_MACOS, CoreMLBackend
from modeld.backends.coreml.convert import (
    COMPILED, SIGNATURE, compile_cached, read_signature, signature, source_package,
)
from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.model_config import TensorSpec, config_from_dict
from modeld.backends.registry import BackendRegistry

IS_MACOS = platform.system() == "Darwin"
TORCH_CONFIG = {
    "format": "coreml", "artifact": "model.pt2",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
}


@pytest.mark.skipif(IS_MACOS, reason="checks the answer where Core ML cannot run")
def test_off_macos_it_is_registered_but_unavailable_with_the_reason():
    registry = BackendRegistry(["coreml", "reference"])
    [entry] = [e for e in registry.entries() if e.name == "coreml"]
    assert entry.backend is None and entry.availability.reason == NOT_MACOS == "Core ML runs only on macOS"
    with pytest.raises(InvalidArgument, match="backend 'coreml' is not available here: Core ML runs only on macOS"):
        registry.get("coreml")
    assert [b.name for b in registry.load_order((), lambda name: True)] == ["reference"]
    assert registry.candidates(("coreml",)) == []  # a model that names it gets "no backend", never a crash


@pytest.fixture
def macos(monkeypatch):
    """platform.system() answers "Darwin" inside the coreml backend only:
    faking it process-wide would mislead every other library that asks."""
    monkeypatch.setattr(coreml_backend, "platform", types.SimpleNamespace(system=lambda: "Darwin"))


def _model_dir(tmp_path: Path, name: str, toml: str, files: dict[str, bytes]) -> tuple:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.toml").write_text(toml)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    import tomllib

    return config_from_dict(name, tomllib.loads(toml)), folder


def _chosen(registry: BackendRegistry, config, folder: Path) -> str:
    """The engine's selection: the first backend in load order that can serve the model."""
    for backend in registry.load_order(config.backends, lambda name: True):
        if backend.can_serve(config, folder).ok:
            return backend.name
    return ""


def test_with_macos_faked_the_registry_chooses_coreml_for_the_models_it_can_serve(macos, tmp_path):
    registry = BackendRegistry(["onnx", "reference", "coreml"])
    assert [b.name for b in registry.available()] == ["onnx", "coreml", "reference"]
    package = {"model.mlpackage/Manifest.json": b"{}"}
    coreml_config, coreml_dir = _model_dir(tmp_path, "tiny", 'format = "coreml"\n', package)
    onnx_config, onnx_dir = _model_dir(tmp_path, "double", 'format = "onnx"\n',
                                       {"model.onnx": onnx_fixtures.double_int64()})
    assert _chosen(registry, coreml_config, coreml_dir) == "coreml"
    assert _chosen(registry, onnx_config, onnx_dir) == "onnx"
    coreml = registry.get("coreml")
    assert coreml.can_serve(onnx_config, onnx_dir).reason == "coreml serves coreml models, not onnx"
    # with coreml unhealthy it is still the only one that can serve its model
    assert [b.name for b in registry.load_order((), lambda name: name != "coreml")][-1] == "coreml"


@pytest.mark.parametrize("toml, files, reason", [
    ('format = "coreml"\n', {}, "model file 'model.mlpackage' is missing"),
    ('format = "coreml"\nartifact = "model.onnx"\n', {"model.onnx": b"x"},
     "coreml serves .mlpackage, .mlmodel and torch.export .pt2 artifacts, not 'model.onnx'"),
    ('format = "coreml"\n[text]\ntokenizer = "t.json"\n', {"model.mlpackage/Manifest.json": b"{}"},
     "coreml has no [text] front end"),
    ('format = "coreml"\nartifact = "model.pt2"\ninputs = [{name = "ids", datatype = "INT64", shape = [-1, 8]}]\n',
     {"model.pt2": b"x"}, "input 'ids' is INT64; a converted Core ML program takes and gives FP32, FP16, INT32"),
    ('format = "coreml"\nartifact = "model.pt2"\noutputs = [{name = "p", datatype = "FP64", shape = [-1]}]\n',
     {"model.pt2": b"x"}, "output 'p' is FP64"),
])
def test_can_serve_refuses_with_a_reason_a_user_can_act_on(tmp_path, toml, files, reason):
    config, folder = _model_dir(tmp_path, "m", toml, files)
    verdict = CoreMLBackend().can_serve(config, folder)
    assert not verdict.ok and verdict.reason.startswith(reason)


def test_the_estimate_of_a_package_counts_every_file_in_it(tmp_path):
    files = {"model.mlpackage/Manifest.json": b"{}", "model.mlpackage/Data/weights.bin": b"w" * 1000}
    config, folder = _model_dir(tmp_path, "m", 'format = "coreml"\n', files)
    assert CoreMLBackend().estimate_bytes(config, folder) == 1002


# -- conversion: coremltools and torch are imported from here on (tens of seconds) --


def _ops(spec) -> list[str]:
    return [op.type for function in spec.mlProgram.functions.values()
            for block in function.block_specializations.values() for op in block.operations]


def test_a_mil_program_built_in_code_converts_to_a_package_the_backend_reads(tmp_path):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def double_relu(x):
        return mb.relu(x=mb.mul(x=x, y=2.0), name="y")

    package = tmp_path / "model.mlpackage"
    ct.convert(double_relu, convert_to="mlprogram", skip_model_load=True).save(str(package))
    spec = ct.utils.load_spec(str(package))
    assert signature(spec) == ((TensorSpec("x", "FP32", (2, 3)),), (TensorSpec("y", "FP32", (2, 3)),))
    assert read_signature(package) == signature(spec)
    assert {"mul", "relu"} <= set(_ops(spec))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A small torch module exported with a variable batch of 1..64 rows."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("coremltools")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    path = tmp_path_factory.mktemp("exported") / "model.pt2"
    torch.export.save(program, str(path))
    return path


def _converted_spec(config, exported: Path, work: Path):
    import coremltools as ct

    package = source_package(config, exported, work)
    assert package.suffix == ".mlpackage" and package.parent == work
    return ct.utils.load_spec(str(package))


def test_an_exported_torch_program_converts_with_the_declared_names_and_types(exported, tmp_path):
    spec = _converted_spec(config_from_dict("linear", TORCH_CONFIG), exported, tmp_path)
    inputs, outputs = signature(spec)
    assert inputs == (TensorSpec("x", "FP32", (-1, 4)),)  # the batch dimension stays variable
    assert [(t.name, t.datatype) for t in outputs] == [("y", "FP32")]
    assert [(r.lowerBound, r.upperBound) for r in spec.description.input[0].type.multiArrayType.shapeRange.sizeRanges] \
        == [(1, 64), (4, 4)]  # the export's bounds
    ops = _ops(spec)
    assert "linear" in ops and "relu" in ops
    assert "cast" not in ops  # FP32 compute: the conversion does not round through FP16


def test_without_declared_tensors_the_exports_own_names_stand(exported, tmp_path):
    spec = _converted_spec(config_from_dict("linear", {"format": "coreml", "artifact": "model.pt2"}), exported, tmp_path)
    inputs, outputs = signature(spec)
    assert [t.datatype for t in (*inputs, *outputs)] == ["FP32", "FP32"]
    assert inputs[0].shape == (-1, 4) and inputs[0].name and outputs[0].name


def test_a_file_that_is_no_exported_program_fails_the_load_with_the_reason(tmp_path):
    pytest.importorskip("coremltools")
    (tmp_path / "model.pt2").write_bytes(b"not a torch.export archive")
    config = config_from_dict("broken", TORCH_CONFIG)
    with pytest.raises(LoadFailed, match="coremltools cannot convert 'model.pt2'"):
        source_package(config, tmp_path / "model.pt2", tmp_path)


class StandInCompiler:
    """Stands in for Apple's compiler (macOS only) to test the cache's
    bookkeeping: it writes a folder where the .mlmodelc would be."""

    def __init__(self) -> None:
        self.sources: list[Path] = []

    def __call__(self, source: Path, destination: Path) -> None:
        self.sources.append(source)
        destination.mkdir()
        (destination / "model.mil").write_text(source.name)


def test_the_compile_cache_converts_once_per_distinct_bytes_and_declaration(exported, tmp_path):
    cache, compiler = tmp_path / "cache", StandInCompiler()
    config = config_from_dict("linear", TORCH_CONFIG)
    first = compile_cached(config, exported, cache, compiler)
    again = compile_cached(config_from_dict("renamed", TORCH_CONFIG), exported, cache, compiler)
    assert (first.is_cached, again.is_cached) == (False, True)
    assert again.path == first.path and first.path.name == COMPILED and first.path.is_dir()
    assert len(compiler.sources) == 1 and compiler.sources[0].name == "converted.mlpackage"
    assert first.inputs == again.inputs == (TensorSpec("x", "FP32", (-1, 4)),)
    assert sorted(p.name for p in first.path.parent.iterdir()) == [COMPILED, SIGNATURE]  # the conversion is not kept
    # other declared names convert again: they are part of the result
    renamed = dict(TORCH_CONFIG, outputs=[{"name": "scores", "datatype": "FP32", "shape": [-1, 3]}])
    other = compile_cached(config_from_dict("linear", renamed), exported, cache, compiler)
    assert other.path != first.path and [t.name for t in other.outputs] == ["scores"]
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.path.parent.name, other.path.parent.name])


@pytest.mark.skipif(IS_MACOS, reason="Core ML compiles on macOS")
def test_off_macos_the_real_compile_fails_cleanly_and_leaves_no_cache_entry(exported, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(LoadFailed, match="Core ML cannot compile 'model.pt2'"):
        compile_cached(config_from_dict("linear", TORCH_CONFIG), exported, cache)
    assert list(cache.iterdir()) == []
