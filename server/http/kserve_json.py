"""KServe v2 REST bodies <-> the gRPC service's messages.

An infer request becomes a `ModelInferRequest` with every tensor as raw
contents, so it goes through the same decoding and checks as gRPC's, and
both fronts accept and refuse the same things in the same words. What is
HTTP's own is here: JSON `data` arrays, and Triton's binary tensor
extension (`Inference-Header-Content-Length`: the JSON header first, then
the tensors' bytes in order; `binary_data_size` on inputs, `binary_data`
on outputs, `binary_data_output` for all of them; BYTES elements carry the
4-byte little-endian length prefix, as in gRPC).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct

import numpy as np
from starlette.responses import Response

from modeld.backends.dtypes import NUMPY_BY_DATATYPE
from modeld.backends.errors import InvalidArgument
from modeld.gen import inference_pb2 as pb
from modeld.server.http.common import json_object
from modeld.server.services.convert import encode_bytes, parameter_value

HEADER_LENGTH = "inference-header-content-length"
_INT64 = (-2**63, 2**63 - 1)


def dumps(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def spec_json(spec) -> dict:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def parameters_of(obj: dict, what: str) -> dict:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument(f"'parameters' of the {what} must be a JSON object")
    return params


def file_contents(key: str, value) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(f"load parameter {key!r} must be a string of the file's contents in base64")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"load parameter {key!r} is not valid base64 ({exc}); "
                              "send the file's contents base64-encoded") from None


def _set_parameter(target, key: str, value, where: str) -> None:
    """A JSON parameter as the gRPC InferParameter of the same type."""
    param = target[key]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
        param.int64_param = value
    elif isinstance(value, int) and 0 <= value < 2**64:
        param.uint64_param = value
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        del target[key]
        raise InvalidArgument(f"{where} parameter {key!r} must be a boolean, a 64-bit integer, a number or a "
                              f"string, got {json.dumps(value)[:80]}")


def infer_request(name: str, version: str, body: bytes,
                  header_length: str | None) -> tuple[pb.ModelInferRequest, BinaryOutputs]:
    """The HTTP infer request as the gRPC service's message, every input as
    raw contents, plus which outputs go back as binary."""
    request, binary = _split_body(body, header_length)
    msg = pb.ModelInferRequest(model_name=name, model_version=version)
    request_id = request.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"the request 'id' must be a string, got {json.dumps(request_id)[:80]}")
    msg.id = request_id
    params = dict(parameters_of(request, "inference request"))
    binary_default = params.pop("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidArgument(f"parameter 'binary_data_output' must be true or false, got {binary_default!r}")
    for key, value in params.items():
        _set_parameter(msg.parameters, key, value, "request")
    _add_inputs(msg, request.get("inputs", []), binary)
    return msg, _requested_outputs(msg, request.get("outputs", []), binary_default)


def _split_body(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    """The JSON header, and the binary tensors' bytes after it."""
    if header_length is None:
        return json_object(body, "inference request (a body with binary tensors after the JSON needs the "
                                 "Inference-Header-Content-Length header)"), memoryview(b"")
    try:
        split = int(header_length)
    except ValueError:
        split = -1
    if not 0 <= split <= len(body):
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length!r} must be the size in bytes of "
                              f"the JSON header that starts the body ({len(body)} bytes)")
    return json_object(body[:split], "inference request"), memoryview(body)[split:]


def _add_inputs(msg: pb.ModelInferRequest, inputs, binary: memoryview) -> None:
    if not isinstance(inputs, list):
        raise InvalidArgument("'inputs' must be a JSON list of tensors")
    offset = 0
    for index, tensor in enumerate(inputs):
        raw, used = _input(msg, index, tensor, binary[offset:])
        offset += used
        msg.raw_input_contents.append(raw)
    if offset != len(binary):
        raise InvalidArgument(f"the body holds {len(binary) - offset} bytes of binary data after the inputs' "
                              f"binary_data_size total of {offset}; send exactly the bytes the inputs declare")


def _requested_outputs(msg: pb.ModelInferRequest, outputs, binary_default: bool) -> BinaryOutputs:
    if not isinstance(outputs, list):
        raise InvalidArgument("'outputs' must be a JSON list of requested outputs")
    wants = BinaryOutputs(binary_default)
    for out in outputs:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise InvalidArgument("each requested output must be a JSON object with a string 'name'")
        target = msg.outputs.add(name=out["name"])
        out_params = dict(parameters_of(out, f"output {out['name']!r}"))
        flag = out_params.pop("binary_data", binary_default)
        if not isinstance(flag, bool):
            raise InvalidArgument(f"output {out['name']!r}: parameter 'binary_data' must be true or false")
        wants.by_name[out["name"]] = flag
        for key, value in out_params.items():
            _set_parameter(target.parameters, key, value, f"output {out['name']!r}")
    return wants


def _input(msg: pb.ModelInferRequest, index: int, tensor, binary: memoryview) -> tuple[bytes, int]:
    """Add one input's description to `msg`; its raw contents, and how many
    bytes of the binary section it took."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise InvalidArgument(f"input {index} must be a JSON object with a string 'name'")
    name = tensor["name"]
    datatype, shape = tensor.get("datatype"), tensor.get("shape")
    if not isinstance(datatype, str):
        raise InvalidArgument(f"input {name!r} needs a string 'datatype' (FP32, INT64, BYTES, ...)")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidArgument(f"input {name!r} needs a 'shape': a JSON list of integers")
    if any(not _INT64[0] <= d <= _INT64[1] for d in shape):
        raise InvalidArgument(f"input {name!r}: shape {shape} has a dimension beyond 64 bits")
    target = msg.inputs.add(name=name, datatype=datatype, shape=shape)
    params = dict(parameters_of(tensor, f"input {name!r}"))
    size = params.pop("binary_data_size", None)
    for key, value in params.items():
        _set_parameter(target.parameters, key, value, f"input {name!r}")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
        if "data" in tensor:
            raise InvalidArgument(f"input {name!r} has both 'data' and binary_data_size; send one or the other")
        if size > len(binary):
            raise InvalidArgument(f"input {name!r}: binary_data_size {size} runs past the end of the body's binary "
                                  f"data ({len(binary)} bytes left); with binary tensors the JSON header's size "
                                  "goes in Inference-Header-Content-Length")
        return bytes(binary[:size]), size
    if "data" not in tensor:
        raise InvalidArgument(f"input {name!r} has no data: send a 'data' list, or binary data with the "
                              "binary_data_size parameter")
    return _json_data(name, datatype, shape, tensor["data"]), 0


def _flatten(data, out: list) -> None:
    """Triton takes data flat or nested in row-major order."""
    if isinstance(data, list):
        for item in data:
            _flatten(item, out)
    else:
        out.append(data)


def _json_data(name: str, datatype: str, shape: list[int], data) -> bytes:
    """JSON `data` as raw contents, so decode_tensor checks it like gRPC's."""
    dtype = NUMPY_BY_DATATYPE.get(datatype)
    if dtype is None or any(d < 0 for d in shape):
        # decode_tensor refuses it, in the words gRPC clients get
        return b""
    values: list = []
    _flatten(data, values)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidArgument(f"input {name!r}: shape {shape} needs {count} values, 'data' has {len(values)}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InvalidArgument(f"input {name!r}: BYTES 'data' must hold strings; send other bytes as binary data")
        return encode_bytes(np.array(values, dtype=object))
    if datatype == "BOOL":
        ok, kind = all(isinstance(v, bool) for v in values), "true or false"
    elif dtype.kind in "iu":
        ok, kind = all(isinstance(v, int) and not isinstance(v, bool) for v in values), "integers"
    else:
        ok, kind = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values), "numbers"
    if not ok:
        raise InvalidArgument(f"input {name!r}: {datatype} 'data' must hold {kind}")
    if dtype.kind in "iu" and values:
        info = np.iinfo(dtype)
        if min(values) < info.min or max(values) > info.max:
            raise InvalidArgument(f"input {name!r}: a value does not fit {datatype} (range {info.min}..{info.max})")
    return np.array(values, dtype=dtype).tobytes()


# -- response encoding ---------------------------------------------------------


class BinaryOutputs:
    """Which outputs answer as binary: each requested output's `binary_data`,
    else the request's `binary_data_output` (tritonclient sets it when it
    names no outputs)."""

    def __init__(self, default: bool) -> None:
        self.default = default
        self.by_name: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        return self.by_name.get(name, self.default)


def infer_response(response: pb.ModelInferResponse, binary: BinaryOutputs) -> Response:
    body: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        body["id"] = response.id
    if response.parameters:
        body["parameters"] = {k: parameter_value(v) for k, v in response.parameters.items()}
    outputs, chunks = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if binary(tensor.name):
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_values(tensor.name, tensor.datatype, raw)
        outputs.append(entry)
    body["outputs"] = outputs
    header = dumps(body)
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(b"".join([header, *chunks]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})


def _json_values(name: str, datatype: str, raw: bytes) -> list:
    if datatype != "BYTES":
        return np.frombuffer(raw, dtype=NUMPY_BY_DATATYPE[datatype]).tolist()
    values, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        item = raw[offset + 4:offset + 4 + length]
        offset += 4 + length
        try:
            values.append(item.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument(f"output {name!r} holds bytes that are not UTF-8 text, which JSON cannot carry; "
                                  "ask for it with binary_data") from None
    return values
