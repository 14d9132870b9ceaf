"""KServe v2 REST (/v2): the HTTP half of the protocol the gRPC
`inference.GRPCInferenceService` speaks, as Triton serves it, so the stock
`tritonclient.http` works unmodified.

An infer request is turned into the gRPC service's `ModelInferRequest`
(every tensor as raw contents) and goes through the same decoding, checks
and engine calls as gRPC, so both fronts accept and refuse the same things
in the same words. What is HTTP's own: JSON `data` arrays, and Triton's
binary tensor extension (`Inference-Header-Content-Length`: the JSON header
first, then the tensors' bytes in order; `binary_data_size` on inputs,
`binary_data` on outputs, `binary_data_output` for all of them; BYTES
elements carry the 4-byte little-endian length prefix, as in gRPC).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import struct

import numpy as np
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.backends.dtypes import NUMPY_BY_DATATYPE
from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError, NotFound
from modeld.gen import inference_pb2 as pb
from modeld.server.engine import MODEL_VERSION
from modeld.server.http.app import ClientGone, internal_message, read_body, status_of_error, unless_client_leaves
from modeld.server.request_context import current_request_id
from modeld.server.requests import ModelState
from modeld.server.services.convert import encode_bytes, parameter_value, request_from_proto, response_to_proto
from modeld.server.services.inference import EXTENSIONS, SERVER_NAME, SERVER_VERSION
from modeld.server.services.kserve_text import complete_text

log = structlog.get_logger("modeld.http")

HEADER_LENGTH = "inference-header-content-length"
_INT64 = (-2**63, 2**63 - 1)


def routes(engine, lifecycle) -> list[Route]:
    api = _KServe(engine, lifecycle)
    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    return [
        Route("/v2/health/live", api.live, methods=["GET"]),
        Route("/v2/health/ready", api.ready, methods=["GET"]),
        Route("/v2", api.server_metadata, methods=["GET"]),
        # before /v2/models/{name}, which would take "stats" for a model name
        Route("/v2/models/stats", api.statistics, methods=["GET"]),
        Route(model + "/stats", api.statistics, methods=["GET"]),
        Route(versioned + "/stats", api.statistics, methods=["GET"]),
        Route(model + "/ready", api.model_ready, methods=["GET"]),
        Route(versioned + "/ready", api.model_ready, methods=["GET"]),
        Route(model + "/infer", api.infer, methods=["POST"]),
        Route(versioned + "/infer", api.infer, methods=["POST"]),
        Route(model, api.model_metadata, methods=["GET"]),
        Route(versioned, api.model_metadata, methods=["GET"]),
        Route("/v2/repository/index", api.repository_index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", api.load, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", api.unload, methods=["POST"]),
        Route("/v2/{path:path}", api.unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]


def _endpoint(method):
    """Errors as Triton's REST errors, `{"error": message}`, with the status
    the gRPC table gives them, counted as gRPC counts them."""

    @functools.wraps(method)
    async def wrapper(self, request: Request) -> Response:
        try:
            return await method(self, request)
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            model = request.path_params.get("name", "")
            if isinstance(exc, ModeldError):
                log.info("http_failed", path=request.url.path, status=exc.kind.value, reason=str(exc))
                self.engine.count_failure(model, exc.kind)
                return JSONResponse({"error": str(exc)}, status_code=status_of_error(exc))
            log.exception("http_bug", path=request.url.path)
            self.engine.count_failure(model, ErrorKind.INTERNAL)
            return JSONResponse({"error": internal_message(current_request_id())}, status_code=500)
    return wrapper


def _json(value, status_code: int = 200) -> Response:
    return Response(_dumps(value), status_code=status_code, media_type="application/json")


def _dumps(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class _KServe:
    def __init__(self, engine, lifecycle) -> None:
        self.engine = engine
        self.lifecycle = lifecycle

    # -- health and metadata -------------------------------------------------

    @_endpoint
    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    @_endpoint
    async def ready(self, request: Request) -> Response:
        # while draining the middleware answers 503 before this runs
        return _json({"ready": not self.lifecycle.is_draining})

    @_endpoint
    async def model_ready(self, request: Request) -> Response:
        name, version = _model_of(request)
        self.engine.check_version(name, version)
        state = self.engine.state_of(name)
        if state is ModelState.READY:
            return _json({"name": name, "ready": True})
        if state is ModelState.UNAVAILABLE and name not in self.engine.repository.names():
            self.engine.repository.resolve(name)  # raises NOT_FOUND for a name nobody knows
        # a probe's answer, not a failed call: not counted
        return _json({"error": f"model {name!r} is not ready: it is {state.value}"}, status_code=503)

    @_endpoint
    async def server_metadata(self, request: Request) -> Response:
        return _json({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    @_endpoint
    async def model_metadata(self, request: Request) -> Response:
        name, version = _model_of(request)
        served = await self.engine.ensure_loaded(name, version)
        return _json({
            "name": name, "versions": [MODEL_VERSION], "platform": f"modeld_{served.backend.name}",
            "inputs": [_spec(s) for s in served.loaded.inputs],
            "outputs": [_spec(s) for s in served.loaded.outputs],
        })

    @_endpoint
    async def statistics(self, request: Request) -> Response:
        name, version = _model_of(request)
        if name:
            self.engine.check_version(name, version)
            if name not in self.engine.repository.names() and not self.engine.served(name):
                self.engine.repository.resolve(name)  # raises NOT_FOUND
        names = [name] if name else [s.name for s in self.engine.statuses()]
        return _json({"model_stats": [self._model_stats(n) for n in names]})

    def _model_stats(self, name: str) -> dict:
        stats = self.engine.stats(name)
        zero = {"count": 0, "ns": 0}  # Triton's fields modeld does not measure apart

        def duration(value) -> dict:
            return {"count": value.count, "ns": value.ns}

        entry = {
            "name": name, "version": MODEL_VERSION, "last_inference": stats.last_inference_ms,
            "inference_count": stats.inference_count, "execution_count": stats.execution_count,
            "inference_stats": {
                "success": duration(stats.success), "fail": duration(stats.fail), "queue": duration(stats.queue),
                "compute_input": zero, "compute_infer": duration(stats.compute_infer), "compute_output": zero,
                "cache_hit": zero, "cache_miss": zero,
            },
            "batch_stats": [{"batch_size": size, "compute_input": zero, "compute_infer": duration(d),
                             "compute_output": zero} for size, d in sorted(stats.batches.items())],
            "memory_usage": [],
        }
        served = self.engine.served(name)
        if served is not None:
            entry["memory_usage"].append({"type": "CPU", "id": 0, "byte_size": served.loaded.nbytes})
        return entry

    # -- repository ----------------------------------------------------------

    @_endpoint
    async def repository_index(self, request: Request) -> Response:
        body = await _json_body(request)
        ready_only = body.get("ready", False)
        if not isinstance(ready_only, bool):
            raise InvalidArgument(f"'ready' must be true or false, got {ready_only!r}")
        return _json([
            {"name": s.name, "version": s.version, "state": s.state.value, "reason": s.reason}
            for s in self.engine.statuses() if not ready_only or s.state is ModelState.READY
        ])

    @_endpoint
    async def load(self, request: Request) -> Response:
        """Triton's load: by name from the repository, or inline with a
        `config` parameter (JSON text) and `file:<path>` parameters holding
        base64 file contents, as tritonclient.http sends them."""
        name = request.path_params["name"]
        params = _parameters_of(await _json_body(request), "load request")
        files = {}
        for key, value in params.items():
            if key.startswith("file:"):
                files[key] = _base64(key, value)
        config = params.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidArgument("load parameter 'config' must be a string holding the model configuration as JSON")
        if files and config is None:
            raise InvalidArgument("model files in a load request need a 'config' parameter as well")
        source = self.engine.repository.add_inline(name, config, files) if config is not None else None
        await self.engine.load(name, source)
        return Response(status_code=200)

    @_endpoint
    async def unload(self, request: Request) -> Response:
        # `unload_dependents` needs no handling: a model here has no dependents
        _parameters_of(await _json_body(request), "unload request")
        await self.engine.unload(request.path_params["name"])
        return Response(status_code=200)

    @_endpoint
    async def unknown(self, request: Request) -> Response:
        raise NotFound(f"no KServe v2 endpoint {request.method} {request.url.path}; this daemon serves health, "
                       "metadata, infer, stats and the model repository (see the README)")

    # -- inference -----------------------------------------------------------

    @_endpoint
    async def infer(self, request: Request) -> Response:
        name, version = _model_of(request)
        body = await read_body(request)
        msg, binary = _infer_request(name, version, body, request.headers.get(HEADER_LENGTH))
        try:
            response = await unless_client_leaves(request, self._run(msg))
        except ClientGone:
            log.info("http_client_disconnected", path=request.url.path)
            return Response(status_code=499)  # nobody is left to read it
        return _infer_response(response, binary)

    async def _run(self, msg: pb.ModelInferRequest) -> pb.ModelInferResponse:
        served = await self.engine.ensure_loaded(msg.model_name, msg.model_version)
        if served.is_generative:
            return await complete_text(self.engine, msg, current_request_id())
        return response_to_proto(await self.engine.infer(request_from_proto(msg, current_request_id())))


# -- request decoding ----------------------------------------------------------


def _model_of(request: Request) -> tuple[str, str]:
    return request.path_params.get("name", ""), request.path_params.get("version", "")


def _spec(spec) -> dict:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


async def _json_body(request: Request) -> dict:
    """An optional JSON object body (repository calls may send none)."""
    body = await read_body(request)
    if not body.strip():
        return {}
    return _parse_object(body, "request body")


def _parse_object(data: bytes, what: str) -> dict:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"the {what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the {what} must be a JSON object, got {type(value).__name__}")
    return value


def _parameters_of(obj: dict, what: str) -> dict:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument(f"'parameters' of the {what} must be a JSON object")
    return params


def _base64(key: str, value) -> bytes:
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


def _infer_request(name: str, version: str, body: bytes,
                   header_length: str | None) -> tuple[pb.ModelInferRequest, _BinaryOutputs]:
    """The HTTP infer request as the gRPC service's message, every input as
    raw contents, plus which outputs go back as binary."""
    if header_length is not None:
        try:
            split = int(header_length)
        except ValueError:
            split = -1
        if not 0 <= split <= len(body):
            raise InvalidArgument(f"Inference-Header-Content-Length {header_length!r} must be the size in bytes of "
                                  f"the JSON header that starts the body ({len(body)} bytes)")
        header, binary = body[:split], memoryview(body)[split:]
    else:
        header, binary = body, memoryview(b"")
    request = _parse_object(header, "inference request" + (
        "" if header_length is not None else
        " (a body with binary tensors after the JSON needs the Inference-Header-Content-Length header)"))
    msg = pb.ModelInferRequest(model_name=name, model_version=version)
    request_id = request.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"the request 'id' must be a string, got {json.dumps(request_id)[:80]}")
    msg.id = request_id
    params = dict(_parameters_of(request, "inference request"))
    binary_default = params.pop("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidArgument(f"parameter 'binary_data_output' must be true or false, got {binary_default!r}")
    for key, value in params.items():
        _set_parameter(msg.parameters, key, value, "request")

    inputs = request.get("inputs", [])
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

    outputs = request.get("outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument("'outputs' must be a JSON list of requested outputs")
    wants = _BinaryOutputs(binary_default)
    for out in outputs:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise InvalidArgument("each requested output must be a JSON object with a string 'name'")
        target = msg.outputs.add(name=out["name"])
        out_params = dict(_parameters_of(out, f"output {out['name']!r}"))
        flag = out_params.pop("binary_data", binary_default)
        if not isinstance(flag, bool):
            raise InvalidArgument(f"output {out['name']!r}: parameter 'binary_data' must be true or false")
        wants.by_name[out["name"]] = flag
        for key, value in out_params.items():
            _set_parameter(target.parameters, key, value, f"output {out['name']!r}")
    return msg, wants


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
    params = dict(_parameters_of(tensor, f"input {name!r}"))
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


class _BinaryOutputs:
    """Which outputs answer as binary: each requested output's `binary_data`,
    else the request's `binary_data_output` (tritonclient sets it when it
    names no outputs)."""

    def __init__(self, default: bool) -> None:
        self.default = default
        self.by_name: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        return self.by_name.get(name, self.default)


def _infer_response(response: pb.ModelInferResponse, binary: _BinaryOutputs) -> Response:
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
    header = _dumps(body)
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
