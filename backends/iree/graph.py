"""What the backend reads from an ONNX model before compiling it: the
operator domains it declares (cheaply, for can_serve), then at load its
signature, the operators IREE could never import, and the files that make it."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from modeld.backends.dtypes import DATATYPE_BY_ONNX_ELEM, shape_from_dims
from modeld.backends.model_config import TensorSpec

# IREE lowers the standard operator set only; anything else (com.microsoft's
# fused kernels, ai.onnx.ml, modeld's own ai.modeld) fails in the importer.
STANDARD_DOMAINS = frozenset({"", "ai.onnx"})

_OPSET_IMPORT = 8  # ModelProto.opset_import
_MAX_ENTRY = 1 << 20  # an opset entry is a few bytes; anything this big is not one


def declared_domains(path: Path) -> set[str]:
    """The operator domains a model file declares (ModelProto.opset_import),
    read without parsing the graph: every other top-level field, the graph
    with its weights included, is skipped by seeking, so this costs a few
    small reads whatever the file's size (parsing minilm's 90 MB takes ~0.5 s,
    too long for can_serve, which runs on the event loop; so does importing
    onnx). Raises ValueError for bytes that are not a protobuf message."""
    with path.open("rb") as stream:
        size = stream.seek(0, 2)
        stream.seek(0)
        entries = _fields(stream, size, _OPSET_IMPORT)
    return {_domain(entry) for entry in entries}


def _domain(entry: bytes) -> str:
    # OperatorSetIdProto: the domain is field 1, a string, "" when left out
    values = _fields(io.BytesIO(entry), len(entry), 1)
    return values[-1].decode() if values else ""


def _fields(stream, size: int, wanted: int) -> list[bytes]:
    """The length-delimited values of field `wanted` in the message that
    fills `stream` up to `size`; every other field is skipped."""
    found = []
    while stream.tell() < size:
        field, wire = divmod(_varint(stream), 8)
        if wire == 0:
            _varint(stream)
        elif wire in (1, 5):
            stream.seek(8 if wire == 1 else 4, 1)
        elif wire == 2:
            length = _varint(stream)
            if field == wanted and length <= _MAX_ENTRY:
                found.append(stream.read(length))
            else:
                stream.seek(length, 1)
        else:
            raise ValueError(f"wire type {wire} at byte {stream.tell()}: not an ONNX model")
        if stream.tell() > size:
            raise ValueError("the file ends inside a field: not an ONNX model")
    return found


def _varint(stream) -> int:
    value = 0
    for shift in range(0, 64, 7):
        byte = stream.read(1)
        if not byte:
            raise ValueError("the file ends inside a number: not an ONNX model")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
    raise ValueError("a number longer than 64 bits: not an ONNX model")


@dataclass(frozen=True)
class GraphInfo:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # symbolic dimension -> the (input, axis) pairs that share it
    symbols: dict[str, tuple[tuple[str, int], ...]]
    foreign_ops: tuple[str, ...]  # "domain.Op" outside the standard set
    files: tuple[Path, ...]  # the graph, then its external data files


def read_graph(path: Path, model: str = "") -> GraphInfo:
    """Raises whatever onnx raises for a file that is not a graph, and
    ArtifactPathError for external data outside the graph's folder: IREE's
    importer would read it wherever it is."""
    import onnx

    from modeld.backends.onnx.external_data import check_model_file

    proto = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [v for v in proto.graph.input if v.name not in initializers]
    return GraphInfo(
        inputs=tuple(_spec(v) for v in inputs),
        outputs=tuple(_spec(v) for v in proto.graph.output),
        symbols=_symbols(inputs),
        foreign_ops=tuple(sorted({f"{n.domain}.{n.op_type}" for n in _nodes(proto.graph)
                                  if n.domain not in STANDARD_DOMAINS})),
        files=(path, *[f for f in check_model_file(model, path.parent, path) if f.is_file()]),
    )


def _spec(value) -> TensorSpec:
    tensor = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
    return TensorSpec(value.name, DATATYPE_BY_ONNX_ELEM.get(tensor.elem_type, "FP32"), shape_from_dims(dims))


def _symbols(inputs) -> dict[str, tuple[tuple[str, int], ...]]:
    found: dict[str, list[tuple[str, int]]] = {}
    for value in inputs:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param"):
                found.setdefault(dim.dim_param, []).append((value.name, axis))
    return {name: tuple(uses) for name, uses in found.items() if len(uses) > 1}


def _nodes(graph):
    """Every node, inside If/Loop/Scan bodies too."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in (attr.g,) if attr.HasField("g") else attr.graphs:
                yield from _nodes(sub)
