"""From a coreml model's artifact to a compiled Core ML model, cached.

Core ML runs compiled models (`.mlmodelc`). Compiling, and converting an
exported PyTorch program first, takes seconds, so the result is kept in a cache
folder under a digest of the artifact's bytes and of what the conversion
reads: the next load of the same bytes, under any model name and after a
restart, skips both. Everything here but the compile step also runs on Linux,
which is how the conversion is tested there.

Cache layout: `<cache>/<digest>/model.mlmodelc` and `signature.json` (the
model's inputs and outputs, read from its spec before compiling; a compiled
model has no spec to read). An entry appears by one rename of a finished
folder, so a load that crashed half-way leaves no entry, only a `.tmp` folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable

from modeld.backends.dtypes import NUMPY_BY_DATATYPE
from modeld.backends.errors import LoadFailed
from modeld.backends.model_config import ModelConfig, TensorSpec

SIGNATURE = "signature.json"
COMPILED = "model.mlmodelc"
CACHE_ENV = "MODELD_COREML_CACHE"


class ArtifactKind(Enum):
    PACKAGE = ".mlpackage"  # a folder: an ML program (or neural network) and its weights
    SPEC = ".mlmodel"  # one file: a neural network, pipeline or classic model spec
    # torch.export.save of an ExportedProgram: converted at load. Not
    # TorchScript: torch 2.13 deprecates torch.jit.trace and torch.jit.load.
    EXPORTED_PROGRAM = ".pt2"


# Core ML's multi-array element types (ArrayFeatureType.ArrayDataType names)
DATATYPE_BY_COREML = {"FLOAT32": "FP32", "FLOAT16": "FP16", "DOUBLE": "FP64", "INT32": "INT32"}
# What a converted ML program may take and give: Core ML has no 64-bit
# integers or doubles there (torch's int64 becomes int32 inside the program).
CONVERTIBLE_DATATYPES = ("FP32", "FP16", "INT32")


@dataclass(frozen=True)
class CompiledModel:
    path: Path  # the .mlmodelc folder
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    is_cached: bool  # an earlier load had compiled these bytes already


def artifact_kind(artifact: str | Path) -> ArtifactKind | None:
    suffix = Path(artifact).suffix.lower()
    return next((kind for kind in ArtifactKind if kind.value == suffix), None)


def default_cache_dir() -> Path:
    # the macOS place for caches a program can rebuild
    return Path(os.environ.get(CACHE_ENV) or Path.home() / "Library" / "Caches" / "modeld" / "coreml")


def conversion_problem(config: ModelConfig) -> str:
    """Why an exported program cannot be converted with this config ("" if it can)."""
    for kind, specs in (("input", config.inputs), ("output", config.outputs)):
        for spec in specs:
            if spec.datatype not in CONVERTIBLE_DATATYPES:
                return (f"{kind} {spec.name!r} is {spec.datatype}; a converted Core ML program takes and gives "
                        f"{', '.join(CONVERTIBLE_DATATYPES)} tensors")
    return ""


def convert_exported(path: Path, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> Any:
    """A torch.export file as an unloaded Core ML ML program (coremltools' MLModel).

    Shapes, variable dimensions and their bounds come from the program (its
    `torch.export.Dim`s). The config's `inputs` and `outputs`, where given,
    name and type the program's tensors in order; otherwise the names are
    the export's (forward's arguments, the last op of each output).
    FP32 compute precision: the ML program default, FP16, would change the
    model's answers (the design's rule: nothing silently changes meaning).
    A model that wants FP16 declares FP16 tensors, which needs macOS 13.
    """
    import coremltools as ct
    import torch

    # coremltools converts the ATen dialect; torch.export saves the training one
    program = torch.export.load(str(path)).run_decompositions({})
    wants_fp16 = any(spec.datatype == "FP16" for spec in (*inputs, *outputs))
    return ct.convert(
        program,
        inputs=[ct.TensorType(name=s.name, dtype=_numpy_type(s)) for s in inputs] or None,
        outputs=[ct.TensorType(name=s.name, dtype=_numpy_type(s)) for s in outputs] or None,
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT32,
        minimum_deployment_target=ct.target.macOS13 if wants_fp16 else None,
        # the daemon compiles and loads the model itself (and on Linux it cannot be loaded)
        skip_model_load=True,
    )


def _numpy_type(spec: TensorSpec) -> type:
    return NUMPY_BY_DATATYPE[spec.datatype].type


def signature(spec: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of a Core ML model spec (Model_pb2.Model)."""
    return (tuple(_tensor_spec(f, "input") for f in spec.description.input),
            tuple(_tensor_spec(f, "output") for f in spec.description.output))


def _tensor_spec(feature: Any, kind: str) -> TensorSpec:
    from coremltools.proto import FeatureTypes_pb2

    which = feature.type.WhichOneof("Type")
    if which != "multiArrayType":
        raise LoadFailed(f"{kind} {feature.name!r} is a Core ML {which}; the coreml backend serves "
                         "multi-array (tensor) inputs and outputs only")
    array = feature.type.multiArrayType
    element = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(array.dataType)
    if element not in DATATYPE_BY_COREML:
        raise LoadFailed(f"{kind} {feature.name!r} holds {element}, which has no KServe datatype here")
    return TensorSpec(feature.name, DATATYPE_BY_COREML[element], _dims(array))


def _dims(array: Any) -> tuple[int, ...]:
    """The declared shape, -1 where the model accepts a range or a choice of sizes."""
    flexibility = array.WhichOneof("ShapeFlexibility")
    if flexibility == "shapeRange":
        return tuple(r.lowerBound if r.lowerBound == r.upperBound else -1 for r in array.shapeRange.sizeRanges)
    if flexibility == "enumeratedShapes":
        shapes = [tuple(s.shape) for s in array.enumeratedShapes.shapes]
        if len({len(s) for s in shapes}) > 1:
            return ()  # ranks differ: leave the shape to Core ML's own check
        return tuple(sizes[0] if len(set(sizes)) == 1 else -1 for sizes in zip(*shapes))
    return tuple(array.shape)


def cache_key(config: ModelConfig, artifact: Path) -> str:
    """The artifact's bytes, plus what else decides the compiled result: the
    coremltools version and, for a conversion, the declared names and types."""
    import importlib.metadata

    digest = hashlib.sha256()
    digest.update(importlib.metadata.version("coremltools").encode())
    if artifact_kind(artifact) is ArtifactKind.EXPORTED_PROGRAM:  # the names and types it is converted with
        digest.update(json.dumps([[s.name, s.datatype] for s in (*config.inputs, *config.outputs)]).encode())
    for path in _files(artifact):
        digest.update(str(path.relative_to(artifact)).encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def _files(artifact: Path) -> list[Path]:
    # an .mlpackage is a folder; its file names are part of what it means
    return sorted(p for p in artifact.rglob("*") if p.is_file()) if artifact.is_dir() else [artifact]


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def source_package(config: ModelConfig, artifact: Path, work: Path) -> Path:
    """What Core ML compiles: the artifact itself, or its conversion saved under `work`."""
    if artifact_kind(artifact) is not ArtifactKind.EXPORTED_PROGRAM:
        return artifact
    try:
        converted = convert_exported(artifact, config.inputs, config.outputs)
        package = work / "converted.mlpackage"
        converted.save(str(package))
    except Exception as exc:  # torch and coremltools raise anything from RuntimeError to ValueError
        raise LoadFailed(f"coremltools cannot convert {artifact.name!r}: {_first_line(exc)}") from exc
    return package


def read_signature(source: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    import coremltools as ct

    try:
        spec = ct.utils.load_spec(str(source))
    except Exception as exc:
        raise LoadFailed(f"not a readable Core ML model {source.name!r}: {_first_line(exc)}") from exc
    return signature(spec)


def _compile(source: Path, destination: Path) -> None:
    from coremltools.models.utils import compile_model

    compile_model(str(source), str(destination))


Compiler = Callable[[Path, Path], None]


def compile_cached(config: ModelConfig, artifact: Path, cache_dir: Path,
                   compile_model: Compiler = _compile) -> CompiledModel:
    """The compiled model for these bytes: from the cache, or built into it."""
    entry = cache_dir / cache_key(config, artifact)
    is_cached = (entry / SIGNATURE).is_file()
    if not is_cached:
        _build(config, artifact, entry, compile_model)
    inputs, outputs = _load_signature(entry / SIGNATURE)
    return CompiledModel(entry / COMPILED, inputs, outputs, is_cached)


def _build(config: ModelConfig, artifact: Path, entry: Path, compile_model: Compiler) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{entry.name}.", suffix=".tmp", dir=entry.parent))
    try:
        source = source_package(config, artifact, work)
        inputs, outputs = read_signature(source)
        try:
            compile_model(source, work / COMPILED)
        except Exception as exc:
            raise LoadFailed(f"Core ML cannot compile {artifact.name!r}: {_first_line(exc)}") from exc
        if source != artifact:
            shutil.rmtree(source)  # the compiled model is all a load needs
        _save_signature(work / SIGNATURE, inputs, outputs)
        _publish(work, entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(work: Path, entry: Path) -> None:
    if entry.exists() and not (entry / SIGNATURE).is_file():
        shutil.rmtree(entry)  # not ours to keep: an entry always has its signature
    try:
        work.rename(entry)
    except OSError:
        if not (entry / SIGNATURE).is_file():
            raise
        # another load of the same bytes published first; theirs is as good


def _spec_json(spec: TensorSpec) -> dict:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def _save_signature(path: Path, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> None:
    path.write_text(json.dumps({"inputs": [_spec_json(s) for s in inputs],
                                "outputs": [_spec_json(s) for s in outputs]}), encoding="utf-8")


def _load_signature(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    return tuple(tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in raw[side])
                 for side in ("inputs", "outputs"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
