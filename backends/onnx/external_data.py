"""The files an ONNX model's tensors keep their data in, checked before any
runtime opens them.

A tensor stored outside the graph (`data_location = EXTERNAL`) names its
file in `external_data["location"]`, relative to the graph's folder. An
older onnxruntime (the `>=1.18` floor) or IREE's importer would read any
file the daemon can and hand it back through an Identity output, so every
location of every tensor (initializers, sparse initializers, Constant and
other tensor attributes, in subgraphs, functions and training graphs too) is resolved here
with artifact_paths and refused when it leaves the folder.
"""

from __future__ import annotations

from pathlib import Path

from modeld.backends.artifact_paths import ArtifactPathError, resolve_inside
from modeld.backends.errors import LoadFailed

_EXTERNAL = 1  # TensorProto.EXTERNAL


def check_model_file(model: str, folder: Path, path: Path) -> list[Path]:
    """The external data files the graph at `path` names, each inside
    `folder`; raises ArtifactPathError for one outside (the model's fault,
    whatever backend tries it), LoadFailed for a file that is not an ONNX
    model (so the engine tries the next backend, as the runtime's own
    refusal would).

    The file is scanned, not parsed: every tensor's bytes are skipped by
    seeking, so this costs a few reads per tensor whatever the weights
    weigh (parsing minilm's 90 MB with onnx took 0.2-1.1 s a load)."""
    try:
        with path.open("rb") as file, _mapped(file) as data:
            found = _scan(data, 0, len(data), _MODEL, 0)
    except (OSError, ValueError) as exc:
        raise LoadFailed(f"cannot read {path.name!r} as an ONNX model ({exc})") from None
    first_user = {}  # location -> the first tensor naming it: most tensors share one file
    for name, location in found:
        first_user.setdefault(location, name)
    return list(dict.fromkeys(_resolve(model, folder, name, location) for location, name in first_user.items()))


def _resolve(model: str, folder: Path, name: str, location: str | None) -> Path:
    if location is None:
        raise ArtifactPathError(f"model {model!r}: tensor {name!r} keeps its data outside the graph "
                                "but names no location")
    return resolve_inside(model, folder, location, f"tensor {name!r} external data location")


# The messages that can hold a TensorProto, as field number -> the message
# it holds (onnx.proto3). TENSOR is read for its name, external_data and
# data_location; every other field of every message is skipped.
_MODEL, _GRAPH, _NODE, _ATTRIBUTE, _SPARSE, _FUNCTION, _TRAINING, _TENSOR = range(8)
_CHILDREN = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNCTION},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _FUNCTION: {7: _NODE, 11: _ATTRIBUTE},
    _NODE: {5: _ATTRIBUTE},
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
}
_MAX_NESTING = 64  # graphs inside attributes inside nodes: deeper is no real model
_MAX_SMALL = 1 << 16  # a tensor's name or an external_data entry; larger ones are not read


def _mapped(file):
    import mmap

    size = file.seek(0, 2)
    # an empty file cannot be mapped; its few bytes (none) are as good
    return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else memoryview(b"")


def _scan(data, start: int, end: int, kind: int, depth: int) -> list[tuple[str, str | None]]:
    """(tensor name, location) of every tensor with external data in the
    message of `kind` filling data[start:end]."""
    if depth > _MAX_NESTING:
        raise ValueError(f"messages nested deeper than {_MAX_NESTING}")
    if kind == _TENSOR:
        return _scan_tensor(data, start, end)
    found = []
    children = _CHILDREN[kind]
    at = start
    while at < end:
        number, length, _, at = _field(data, at, end)
        child = children.get(number)
        if length is not None:
            if child is not None:
                found.extend(_scan(data, at, at + length, child, depth + 1))
            at += length
    return found


def _scan_tensor(data, start: int, end: int) -> list[tuple[str, str | None]]:
    # every location entry is checked: which one a runtime takes when a
    # tensor names several is its business
    name, locations, is_external = "", [], False
    at = start
    while at < end:
        number, length, varint, at = _field(data, at, end)
        if number == 14 and length is None:  # data_location
            is_external = is_external or varint == _EXTERNAL
        elif number == 8 and length is not None and length <= _MAX_SMALL:
            name = bytes(data[at:at + length]).decode("utf-8", "replace")
        elif number == 13 and length is not None:  # external_data: StringStringEntryProto
            is_external = True
            key, value = _entry(bytes(data[at:at + min(length, _MAX_SMALL)]))
            if key == "location":
                locations.append(value)
        at += length or 0
    if not is_external:
        return []
    return [(name, location) for location in locations] or [(name, None)]


def _entry(data: bytes) -> tuple[str, str]:
    key = value = ""
    at = 0
    while at < len(data):
        number, length, _, at = _field(data, at, len(data))
        if length is None:
            continue
        text = data[at:at + length].decode("utf-8", "replace")
        at += length
        key, value = (text, value) if number == 1 else (key, text) if number == 2 else (key, value)
    return key, value


def _field(data, at: int, end: int) -> tuple[int, int | None, int, int]:
    """The field at data[at]: its number, its length if length-delimited,
    a varint's value (else 0), and where its payload starts (or, for any
    other wire type, where the next field starts)."""
    tag, at = _varint(data, at)
    number, wire = divmod(tag, 8)
    if wire == 0:
        value, at = _varint(data, at)
        return number, None, value, at
    if wire in (1, 5):
        return number, None, 0, at + (8 if wire == 1 else 4)
    if wire == 2:
        length, at = _varint(data, at)
        if at + length > end:
            raise ValueError("a field runs past its message")
        return number, length, 0, at
    raise ValueError(f"wire type {wire}: not an ONNX model")


def _varint(data, at: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if at >= len(data):
            raise ValueError("the file ends inside a number")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
    raise ValueError("a number longer than 64 bits")
