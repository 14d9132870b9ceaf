"""modeld's Python client: blocking (`Client`) and asyncio (`AsyncClient`).

Thin helpers over the generated stubs for what users do most: embed texts,
run a tensor model, load and unload, list models, check health, read the
node's load. Errors are grpc.RpcError with the daemon's status and message.

Against a daemon with TLS pass `ca_file` (or `tls=True` to trust the system's
CAs), with mutual TLS also `cert_file` and `key_file`; with a token file,
`token`, which goes out as `authorization: Bearer <token>` on every call,
calls made through `.stub` and `.channel` included.
"""

from __future__ import annotations

import collections
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.gen import node_pb2, node_pb2_grpc

_DATATYPE = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.int8): "INT8", np.dtype(np.int16): "INT16", np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64", np.dtype(np.uint8): "UINT8", np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64", np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
}
_NUMPY = {name: dtype for dtype, name in _DATATYPE.items()}
_MAX_MESSAGE = 2**31 - 1
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE)]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    state: str
    reason: str


def _encode_tensor(request: pb.ModelInferRequest, name: str, array) -> None:
    array = np.asarray(array)
    if array.dtype.kind in ("O", "S", "U"):
        items = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in array.reshape(-1)]
        raw, datatype = b"".join(struct.pack("<I", len(x)) + x for x in items), "BYTES"
    else:
        raw, datatype = np.ascontiguousarray(array).tobytes(), _DATATYPE[array.dtype]
    request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
    request.raw_input_contents.append(raw)


def _decode_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    outputs = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.datatype == "BYTES":
            items, offset = [], 0
            while offset < len(raw):
                (length,) = struct.unpack_from("<I", raw, offset)
                items.append(raw[offset + 4:offset + 4 + length])
                offset += 4 + length
            outputs[tensor.name] = np.array(items, dtype=object).reshape(tuple(tensor.shape))
        else:
            outputs[tensor.name] = np.frombuffer(raw, dtype=_NUMPY[tensor.datatype]).reshape(tuple(tensor.shape))
    return outputs


def build_infer_request(model: str, inputs: dict, outputs: tuple[str, ...] = ()) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    for name, array in inputs.items():
        _encode_tensor(request, name, array)
    for name in outputs:
        request.outputs.add(name=name)
    return request


def build_load_request(model: str, config: dict | None, files: dict[str, bytes] | None) -> pb.RepositoryModelLoadRequest:
    request = pb.RepositoryModelLoadRequest(model_name=model)
    if config is not None:
        request.parameters["config"].string_param = json.dumps(config)
    for path, data in (files or {}).items():
        request.parameters[f"file:{path}"].bytes_param = data
    return request


def _models(response: pb.RepositoryIndexResponse) -> list[ModelInfo]:
    return [ModelInfo(m.name, m.version, m.state, m.reason) for m in response.models]


def _health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def _read_pem(path, what: str) -> bytes | None:
    if path is None:
        return None
    data = Path(path).read_bytes()
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    return data


def channel_credentials(tls: bool = False, ca_file=None, cert_file=None,
                        key_file=None) -> grpc.ChannelCredentials | None:
    """SSL credentials when any TLS option is given, else None (plaintext).
    Without `ca_file` the system's (gRPC's bundled) roots are trusted."""
    if not (tls or ca_file or cert_file or key_file):
        return None
    if (cert_file is None) != (key_file is None):
        raise ValueError("mutual TLS needs both cert_file and key_file")
    return grpc.ssl_channel_credentials(root_certificates=_read_pem(ca_file, "CA file"),
                                        private_key=_read_pem(key_file, "key file"),
                                        certificate_chain=_read_pem(cert_file, "certificate file"))


def _channel_options(server_name: str | None) -> list:
    # server_name: the name the daemon's certificate carries, when the
    # address is not it (an IP, or a tunnel)
    return CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])


def _with_token(metadata, token: str) -> tuple:
    return (*(metadata or ()), ("authorization", f"Bearer {token}"))


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, _with_token(d.metadata, self._token), d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def _aio_details(d, token: str):
    return grpc.aio.ClientCallDetails(d.method, d.timeout, _with_token(d.metadata, token), d.credentials,
                                      d.wait_for_ready)


class _AioTokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._token), request)


class _AioTokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._token), request)


class _AioTokenStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details, self._token), request_iterator)


class _AioTokenStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details, self._token), request_iterator)


def _aio_token_interceptors(token: str | None) -> list | None:
    # grpc.aio picks interceptors by base class, one per call shape
    if not token:
        return None
    return [cls(token) for cls in (_AioTokenUnary, _AioTokenUnaryStream, _AioTokenStreamUnary, _AioTokenStreamStream)]


def _load_timeout(timeout: float | None) -> float | None:
    # a load can take minutes (a torch model compiles at load, the first time on a machine)
    return None if timeout is None else max(timeout, 600.0)


class Client:
    """Blocking client. `Client("127.0.0.1:8001")`; use as a context manager."""

    def __init__(self, address: str = "127.0.0.1:8001", timeout: float | None = 30.0, *,
                 token: str | None = None, tls: bool = False, ca_file=None, cert_file=None, key_file=None,
                 server_name: str | None = None) -> None:
        credentials = channel_credentials(tls, ca_file, cert_file, key_file)
        options = _channel_options(server_name)
        channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
                   else grpc.insecure_channel(address, options=options))
        self.channel = grpc.intercept_channel(channel, _TokenInterceptor(token)) if token else channel
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.node_stub = node_pb2_grpc.NodeStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def infer(self, model: str, inputs: dict, outputs: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        return _decode_outputs(self.stub.ModelInfer(build_infer_request(model, inputs, outputs), timeout=self.timeout))

    def embed(self, texts: list[str], model: str = "minilm") -> np.ndarray:
        """Sentence embeddings, [len(texts), dim] float32."""
        return self.infer(model, {"text": np.array(texts, dtype=object)})["embedding"]

    def complete(self, model: str, prompt: str, max_tokens: int = 64) -> str:
        """A language model's whole completion of `prompt` (greedy by default)."""
        request = build_infer_request(model, {"text_input": np.array([prompt], dtype=object)})
        request.parameters["max_tokens"].int64_param = max_tokens
        response = self.stub.ModelInfer(request, timeout=self.timeout)
        return _decode_outputs(response)["text_output"].reshape(-1)[0].decode("utf-8")

    def models(self) -> list[ModelInfo]:
        return _models(self.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=self.timeout))

    def load(self, model: str, config: dict | None = None, files: dict[str, bytes] | None = None) -> None:
        self.stub.RepositoryModelLoad(build_load_request(model, config, files), timeout=_load_timeout(self.timeout))

    def unload(self, model: str) -> None:
        self.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=model), timeout=self.timeout)

    def health(self, service: str = "") -> str:
        """'SERVING' or 'NOT_SERVING'; service '' is the daemon, a model name is that model."""
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return _health_name(response.status)

    def node_stats(self) -> node_pb2.NodeStats:
        """The daemon's load now (modeld.v1.Node/Stats): memory, per-model calls in flight, queues, latency."""
        return self.node_stub.Stats(node_pb2.NodeStatsRequest(), timeout=self.timeout)


class AsyncClient:
    """asyncio client with the same helpers and options; `async with AsyncClient(addr) as c:`."""

    def __init__(self, address: str = "127.0.0.1:8001", timeout: float | None = 30.0, *,
                 token: str | None = None, tls: bool = False, ca_file=None, cert_file=None, key_file=None,
                 server_name: str | None = None) -> None:
        credentials = channel_credentials(tls, ca_file, cert_file, key_file)
        options, interceptors = _channel_options(server_name), _aio_token_interceptors(token)
        self.channel = (grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
                        if credentials is not None
                        else grpc.aio.insecure_channel(address, options=options, interceptors=interceptors))
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.node_stub = node_pb2_grpc.NodeStub(self.channel)
        self.timeout = timeout

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def infer(self, model: str, inputs: dict, outputs: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        response = await self.stub.ModelInfer(build_infer_request(model, inputs, outputs), timeout=self.timeout)
        return _decode_outputs(response)

    async def embed(self, texts: list[str], model: str = "minilm") -> np.ndarray:
        return (await self.infer(model, {"text": np.array(texts, dtype=object)}))["embedding"]

    async def models(self) -> list[ModelInfo]:
        return _models(await self.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=self.timeout))

    async def load(self, model: str, config: dict | None = None, files: dict[str, bytes] | None = None) -> None:
        await self.stub.RepositoryModelLoad(build_load_request(model, config, files), timeout=_load_timeout(self.timeout))

    async def unload(self, model: str) -> None:
        await self.stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=model), timeout=self.timeout)

    async def health(self, service: str = "") -> str:
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return _health_name(response.status)

    async def node_stats(self) -> node_pb2.NodeStats:
        return await self.node_stub.Stats(node_pb2.NodeStatsRequest(), timeout=self.timeout)
