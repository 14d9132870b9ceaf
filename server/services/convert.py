"""Protobuf <-> numpy for the KServe v2 messages.

Raw contents are the fast path in both directions; typed `contents` are
accepted on input. Every size is checked against the declared shape before
numpy sees the bytes, so a malformed tensor is INVALID_ARGUMENT, never a
crash.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from modeld.backends.base import Capability
from modeld.backends.dtypes import NUMPY_BY_DATATYPE, datatype_of
from modeld.backends.errors import InvalidArgument, Unimplemented
from modeld.gen import inference_pb2 as pb
from modeld.server.rerank import PARAMETERS as RERANK_PARAMETERS
from modeld.server.requests import InferRequest, InferResult

_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}

# Request parameters that name a Triton feature modeld does not serve.
_PARAMETER_CAPABILITIES = {
    "sequence_id": Capability.SEQUENCE_BATCHING,
    "sequence_start": Capability.SEQUENCE_BATCHING,
    "sequence_end": Capability.SEQUENCE_BATCHING,
    "shared_memory_region": Capability.SHARED_MEMORY,
}
# Request parameters a tensor model understands; anything else would be
# silently ignored, so it is refused instead. A rerank model also takes
# RERANK_PARAMETERS, which the engine refuses for every other model.
TENSOR_PARAMETERS = ("priority", "timeout", "triton_enable_empty_final_response")
# numpy's own bound on an array's bytes, for the widest element (8 bytes)
_MAX_ELEMENTS = np.iinfo(np.intp).max // 8


def parameter_value(param) -> object:
    kind = param.WhichOneof("parameter_choice")
    return getattr(param, kind) if kind else None


def request_from_proto(msg: pb.ModelInferRequest) -> InferRequest:
    # Tensors in a shared-memory region carry no contents here: the request
    # is refused as UNIMPLEMENTED by the engine, never misread as empty input.
    in_shared_memory = any("shared_memory_region" in t.parameters for t in msg.inputs)
    if msg.raw_input_contents and len(msg.raw_input_contents) != len(msg.inputs) and not in_shared_memory:
        raise InvalidArgument(
            f"got {len(msg.raw_input_contents)} raw_input_contents for {len(msg.inputs)} inputs; "
            "send one raw entry per input, in the order of 'inputs'"
        )
    required = {Capability.TENSOR_INFERENCE}
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(msg.inputs):
        if tensor.name in inputs:
            raise InvalidArgument(f"input {tensor.name!r} appears twice")
        required |= {cap for key, cap in _PARAMETER_CAPABILITIES.items() if key in tensor.parameters}
        if in_shared_memory:
            continue
        raw = msg.raw_input_contents[index] if msg.raw_input_contents else None
        inputs[tensor.name] = decode_tensor(tensor, raw)
    parameters = {key: parameter_value(value) for key, value in msg.parameters.items()}
    required |= {cap for key, cap in _PARAMETER_CAPABILITIES.items() if key in parameters}
    unknown = sorted(set(parameters) - set(TENSOR_PARAMETERS) - set(RERANK_PARAMETERS) - set(_PARAMETER_CAPABILITIES))
    if unknown:
        raise InvalidArgument(f"unknown request parameter {unknown[0]!r} for a tensor model; "
                              f"it understands {', '.join(TENSOR_PARAMETERS)} (a rerank model also "
                              f"{', '.join(RERANK_PARAMETERS)})")
    outputs = []
    for out in msg.outputs:
        if "classification" in out.parameters:
            raise Unimplemented("the classification extension is not supported; request the raw output and rank it yourself")
        required |= {cap for key, cap in _PARAMETER_CAPABILITIES.items() if key in out.parameters}
        outputs.append(out.name)
    return InferRequest(
        model_name=msg.model_name, model_version=msg.model_version, id=msg.id, inputs=inputs,
        output_names=tuple(outputs), parameters=parameters, required=frozenset(required),
        priority=priority_of(parameters), timeout_s=timeout_of(parameters),
    )


def priority_of(parameters: dict) -> int:
    """Triton's `priority` parameter: level 1 runs first, larger levels
    later, 0 (or absent) is the default level, after every explicit one."""
    value = parameters.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"parameter priority must be a non-negative integer (1 is the most urgent), got {value!r}")
    return value


def timeout_of(parameters: dict) -> float | None:
    """Triton's `timeout` parameter, in microseconds; 0 or absent: none."""
    value = parameters.get("timeout", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"parameter timeout must be a non-negative integer of microseconds, got {value!r}")
    return value / 1e6 if value else None


def decode_tensor(tensor, raw: bytes | None) -> np.ndarray:
    datatype = tensor.datatype
    if datatype not in NUMPY_BY_DATATYPE:
        raise InvalidArgument(
            f"input {tensor.name!r} has unsupported datatype {datatype!r}; use one of {', '.join(NUMPY_BY_DATATYPE)}"
        )
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input {tensor.name!r} has a negative dimension in shape {list(shape)}")
    # a zero dimension makes the element count 0 whatever the others say, so
    # the size checks below pass, and numpy then refuses the shape itself
    if math.prod(d for d in shape if d) > _MAX_ELEMENTS:
        raise InvalidArgument(f"input {tensor.name!r} has shape {list(shape)}, larger than any tensor can be")
    count = math.prod(shape)
    if raw is not None:
        return _decode_raw(tensor.name, datatype, shape, count, raw)
    return _decode_contents(tensor, datatype, shape, count)


def _decode_raw(name: str, datatype: str, shape: tuple[int, ...], count: int, raw: bytes) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(_split_bytes(name, raw, count), dtype=object).reshape(shape)
    dtype = NUMPY_BY_DATATYPE[datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidArgument(
            f"input {name!r}: shape {list(shape)} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"raw contents have {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _split_bytes(name: str, raw: bytes, count: int) -> list[bytes]:
    """Elements are a 4-byte little-endian length followed by that many bytes."""
    items, offset, view = [], 0, memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidArgument(f"input {name!r}: BYTES contents end inside a length prefix")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidArgument(f"input {name!r}: BYTES element of length {length} runs past the end of the contents")
        items.append(bytes(view[offset:offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidArgument(f"input {name!r}: shape holds {count} BYTES elements, raw contents hold {len(items)}")
    return items


def _decode_contents(tensor, datatype: str, shape: tuple[int, ...], count: int) -> np.ndarray:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(f"input {tensor.name!r}: {datatype} data must be sent as raw_input_contents")
    values = list(getattr(tensor.contents, field))
    if len(values) != count:
        raise InvalidArgument(
            f"input {tensor.name!r}: shape {list(shape)} needs {count} values, contents.{field} has {len(values)}"
        )
    if datatype == "BYTES":
        return np.array(values, dtype=object).reshape(shape)
    dtype = NUMPY_BY_DATATYPE[datatype]
    try:
        return np.array(values, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError) as exc:
        info = np.iinfo(dtype) if dtype.kind in "iu" else None
        limits = f" (range {info.min}..{info.max})" if info is not None else ""
        raise InvalidArgument(f"input {tensor.name!r}: a value does not fit {datatype}{limits}: {exc}") from None


def encode_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def response_to_proto(result: InferResult) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=result.model_name, model_version=result.model_version, id=result.id)
    for name, array in result.outputs.items():
        datatype = datatype_of(array)
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if datatype == "BYTES":
            response.raw_output_contents.append(encode_bytes(array))
        else:
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response
