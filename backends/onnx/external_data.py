"""The files an ONNX model's tensors keep their data in, checked before any
runtime opens them.

A tensor stored outside the graph (`data_location = EXTERNAL`) names its
file in `external_data["location"]`, relative to the graph's folder. An
older onnxruntime (the `>=1.18` floor) or IREE's importer would read any
file the daemon can and hand it back through an Identity output, so every
location of every tensor (initializers, sparse initializers, Constant and
other tensor attributes, in subgraphs and functions too) is resolved here
with artifact_paths and refused when it leaves the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from modeld.backends.artifact_paths import ArtifactPathError, resolve_inside
from modeld.backends.errors import LoadFailed

_EXTERNAL = 1  # TensorProto.EXTERNAL


def check_model_file(model: str, folder: Path, path: Path) -> list[Path]:
    """Read the graph at `path` (without its external data) and return the
    external data files it names, each inside `folder`; raises
    ArtifactPathError for one outside (the model's fault, whatever backend
    tries it), LoadFailed for a file that is not an ONNX model (so the
    engine tries the next backend, as the runtime's own refusal would)."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise LoadFailed(f"cannot read {path.name!r} as an ONNX model ({type(exc).__name__})") from None
    return external_files(model, folder, proto)


def external_files(model: str, folder: Path, proto) -> list[Path]:
    """The external data files a ModelProto names, resolved inside `folder`."""
    files: dict[Path, None] = {}
    for tensor in tensors(proto):
        if tensor.data_location != _EXTERNAL and not len(tensor.external_data):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        field = f"tensor {tensor.name!r} external data location"
        if location is None:
            raise ArtifactPathError(f"model {model!r}: tensor {tensor.name!r} keeps its data outside the graph "
                                    "but names no location")
        files[resolve_inside(model, folder, location, field)] = None
    return list(files)


def tensors(proto) -> Iterator:
    """Every TensorProto of a ModelProto that can hold data."""
    yield from _graph_tensors(proto.graph)
    for function in proto.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph) -> Iterator:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node) -> Iterator:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        for sparse in attr.sparse_tensors:
            yield sparse.values
            yield sparse.indices
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for sub in attr.graphs:
            yield from _graph_tensors(sub)


__all__ = ["ArtifactPathError", "check_model_file", "external_files", "tensors"]
