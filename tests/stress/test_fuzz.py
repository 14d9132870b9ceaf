"""Fuzz every RPC of a real daemon with bad input.

Field-level messages (hypothesis strategies over the protobuf fields),
valid requests mutated byte by byte and sent as raw bytes, and random
bytes. Whatever comes in, the answer is a status that blames the request
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, ...) or a
normal answer: never UNKNOWN or INTERNAL, never a bug in the log, and the
daemon stays up and answers a good request after every batch of calls.

The HTTP fronts get the same: OpenAI and KServe REST bodies from
hypothesis, valid bodies mutated byte by byte, and random bytes, on every
POST route. No answer is a 500 other than the opaque internal error (which
names only a request id), and the daemon answers after every 100 calls.

`make test` sends 300 messages per RPC and kind and 25 bodies per HTTP
route and kind; `make stress` 20 times as many (MODELD_STRESS_SCALE=20).
"""

from __future__ import annotations

import collections
import json
import re

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnx_fixtures
from daemon import MODELS, add_small_smollm2, start_daemon
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.gen import node_pb2
from stress import fuzz_strategies as fs
from stress.stress_config import record, scaled

pytestmark = pytest.mark.stress

MESSAGES = scaled(300)  # field-level messages per RPC and kind
# raw bytes per RPC and kind (mutated valid requests, random bytes): 2,500 of
# each at `make stress` scale, 5,000 per RPC, on every RPC the daemon serves
RAW_MESSAGES = scaled(125)
CHECK_EVERY = 100  # calls between checks that the daemon still serves
CALL_TIMEOUT_S = 30
STREAM_READS = 4  # responses read from a streaming call before leaving it (watches: 1)
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

FUZZ = settings(max_examples=MESSAGES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
RAW_FUZZ = settings(FUZZ, max_examples=RAW_MESSAGES)
HTTP_FUZZ = settings(FUZZ, max_examples=scaled(25))  # bodies per HTTP route and kind
# what a 500 may say: where to look, nothing of the bug (server/request_context.py)
OPAQUE_INTERNAL = re.compile(r"^internal error \(request id [^)]*\); see the daemon log$")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    (root / "add").mkdir()
    (root / "add" / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (root / "add" / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n[batching]\nmax_batch_size = 8\n')
    (root / "minilm").symlink_to(MODELS / "minilm", target_is_directory=True)
    add_small_smollm2(root, n_ctx=2048, n_slots=2, context_length=1024)
    proc = start_daemon(repository=root, env={"MODELD_DRAIN_DELAY_S": "0"})
    yield proc
    assert proc.stop() == 0


class Tally:
    """Every status the fuzzed calls got, and the periodic good-request check."""

    def __init__(self, daemon, channel) -> None:
        self.daemon, self.channel = daemon, channel
        self.codes: collections.Counter = collections.Counter()
        self.raw_by_method: collections.Counter = collections.Counter()
        self.calls = 0

    def saw(self, what: str, code: grpc.StatusCode, details: str = "") -> None:
        assert code not in NEVER, f"{what}: {code.name} for bad input: {details}"
        self.codes[code.name] += 1
        self.calls += 1
        if self.calls % CHECK_EVERY == 0:
            self.check_serving()

    def check_serving(self) -> None:
        assert self.daemon.proc.poll() is None, "the daemon died"
        request = pb.ModelInferRequest(model_name="add")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.zeros((1, 4), np.float32).tobytes())
        response = pb_grpc.GRPCInferenceServiceStub(self.channel).ModelInfer(request, timeout=CALL_TIMEOUT_S)
        assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [1.0] * 4
        done = list(gg.GenerationStub(self.channel).Generate(
            g.GenerateRequest(model="smollm2", prompt="Hi", sampling=g.SamplingParams(max_tokens=1)),
            timeout=CALL_TIMEOUT_S))
        assert done[-1].usage.completion_tokens == 1
        ready = httpx.get(f"{self.daemon.http_url}/v2/health/ready", timeout=CALL_TIMEOUT_S)
        assert ready.status_code == 200
        bugs = self.daemon.events("rpc_bug") + self.daemon.events("stream_request_bug")
        assert not bugs, f"the daemon logged bugs: {bugs[:3]}"

    def saw_http(self, what: str, response: httpx.Response) -> None:
        """An HTTP answer: a 500 only as the opaque internal error, and no
        such error inside a server-sent event stream either."""
        status = response.status_code
        if status == 500:
            message = _error_message(response)
            assert OPAQUE_INTERNAL.match(message or ""), f"{what}: a 500 that is not opaque: {response.text[:300]}"
            self.codes["HTTP 500 (opaque)"] += 1
        else:
            self.codes[f"HTTP {status}"] += 1
        if status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in response.text.splitlines():
                if line.startswith("data: {") and '"error"' in line:
                    error = json.loads(line[len("data: "):]).get("error") or {}
                    message = error.get("message", "") if isinstance(error, dict) else str(error)
                    if error.get("code") in ("internal", 500) or "internal error" in message:
                        assert OPAQUE_INTERNAL.match(message), f"{what}: a stream error that is not opaque: {line}"
        self.calls += 1
        if self.calls % CHECK_EVERY == 0:
            self.check_serving()


def _error_message(response: httpx.Response) -> str | None:
    """The message of either front's error shape: KServe's {"error": text},
    OpenAI's {"error": {"message": text}}."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("message") if isinstance(error, dict) else error


@pytest.fixture(scope="module")
def channel(daemon):
    options = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
    with grpc.insecure_channel(daemon.address, options=options) as channel:
        yield channel


@pytest.fixture(scope="module")
def tally(daemon, channel):
    tally = Tally(daemon, channel)
    yield tally
    tally.check_serving()
    record("fuzz", {"messages_per_rpc_and_kind": MESSAGES, "raw_messages_per_rpc_and_kind": RAW_MESSAGES,
                    "calls": tally.calls, "statuses": dict(tally.codes),
                    "raw_calls_by_method": dict(sorted(tally.raw_by_method.items()))})


def _unary(tally: Tally, what: str, call) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        tally.saw(what, exc.code(), exc.details())
        return
    tally.saw(what, grpc.StatusCode.OK)


def _streaming(tally: Tally, what: str, responses, reads: int = STREAM_READS) -> list:
    """Read a few responses, then leave the call (which cancels it)."""
    got = []
    try:
        for response in responses:
            got.append(response)
            if len(got) >= reads:
                responses.cancel()
                tally.saw(what, grpc.StatusCode.OK)
                return got
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED or len(got) < reads:
            tally.saw(what, exc.code(), exc.details())
        return got
    tally.saw(what, grpc.StatusCode.OK)
    return got


# -- field-level messages ------------------------------------------------------


def test_infer_requests(channel, tally):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    @FUZZ
    @given(fs.infer_requests())
    def run(request):
        _unary(tally, f"ModelInfer {request!r:.300}", lambda: stub.ModelInfer(request, timeout=CALL_TIMEOUT_S))

    run()


def test_generate_requests(channel, tally):
    stub = gg.GenerationStub(channel)

    @FUZZ
    @given(fs.generate_requests())
    def run(request):
        _streaming(tally, f"Generate {request!r:.300}", stub.Generate(request, timeout=CALL_TIMEOUT_S))

    run()


def test_load_and_unload_requests(channel, tally):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    @FUZZ
    @given(fs.load_requests(), fs.unload_requests())
    def run(load, unload):
        try:
            stub.RepositoryModelLoad(load, timeout=120)
        except grpc.RpcError as exc:
            tally.saw(f"RepositoryModelLoad {load!r:.300}", exc.code(), exc.details())
        else:
            tally.saw("RepositoryModelLoad", grpc.StatusCode.OK)
            # a junk config that loads anyway must not pile up
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=load.model_name), timeout=60)
        _unary(tally, f"RepositoryModelUnload {unload!r:.300}",
               lambda: stub.RepositoryModelUnload(unload, timeout=60))

    run()


def _stream_message(draw_from):
    return st.one_of(fs.infer_requests().map(lambda r: r.SerializeToString()), draw_from,
                     st.binary(max_size=256))


def test_stream_infer_with_bad_messages(channel, tally):
    """Each bad message on a stream is an error message on it; the stream goes on."""
    call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    seeds = [r.SerializeToString() for r in fs.valid_infer_requests()]

    @FUZZ
    @given(st.lists(_stream_message(fs.mutated(seeds)), min_size=1, max_size=4))
    def run(messages):
        try:
            responses = [pb.ModelStreamInferResponse.FromString(r)
                         for r in call(iter(messages), timeout=CALL_TIMEOUT_S)]
        except grpc.RpcError as exc:
            tally.saw("ModelStreamInfer", exc.code(), exc.details())
            return
        for response in responses:
            status = response.error_message.split(":", 1)[0]
            assert status not in ("UNKNOWN", "INTERNAL"), f"ModelStreamInfer answered {response.error_message}"
        tally.saw("ModelStreamInfer", grpc.StatusCode.OK)

    run()


# -- raw bytes: valid requests mutated, and random bytes ---------------------------


def _load_seed(with_file: bool) -> pb.RepositoryModelLoadRequest:
    request = pb.RepositoryModelLoadRequest(model_name="fzseed")
    config = onnx_fixtures.triton_config("fzseed", [("x", "FP32", [4])], [("y", "FP32", [4])])
    request.parameters["config"].string_param = json.dumps(config)
    if with_file:
        request.parameters["file:1/model.onnx"].bytes_param = onnx_fixtures.add_fp32()
    return request


RAW_METHODS = {
    # method: (response streaming, valid requests to mutate)
    "/inference.GRPCInferenceService/ModelInfer": (False, fs.valid_infer_requests()),
    "/inference.GRPCInferenceService/ServerLive": (False, [pb.ServerLiveRequest()]),
    "/inference.GRPCInferenceService/ServerReady": (False, [pb.ServerReadyRequest()]),
    "/inference.GRPCInferenceService/ServerMetadata": (False, [pb.ServerMetadataRequest()]),
    "/inference.GRPCInferenceService/ModelReady": (False, [pb.ModelReadyRequest(name="add", version="1")]),
    "/inference.GRPCInferenceService/ModelMetadata": (False, [pb.ModelMetadataRequest(name="add")]),
    "/inference.GRPCInferenceService/ModelStatistics": (False, [pb.ModelStatisticsRequest(name="add")]),
    "/inference.GRPCInferenceService/RepositoryIndex": (False, [pb.RepositoryIndexRequest(ready=True)]),
    "/inference.GRPCInferenceService/RepositoryModelLoad": (False, [_load_seed(True), _load_seed(False)]),
    "/inference.GRPCInferenceService/RepositoryModelUnload": (False, [pb.RepositoryModelUnloadRequest(
        model_name="fzseed")]),
    "/modeld.v1.Generation/Generate": (True, fs.valid_generate_requests()),
    "/modeld.v1.Generation/Tokenize": (False, [g.TokenizeRequest(model="smollm2", text="Hello there")]),
    "/modeld.v1.Generation/Detokenize": (False, [g.DetokenizeRequest(model="smollm2", token_ids=[1, 2, 3])]),
    "/modeld.v1.Node/Stats": (False, [node_pb2.NodeStatsRequest()]),
    "/modeld.v1.Node/WatchStats": (True, [node_pb2.WatchStatsRequest(interval_ms=50)]),
    "/grpc.health.v1.Health/Check": (False, [health_pb2.HealthCheckRequest(service="add")]),
    "/grpc.health.v1.Health/Watch": (True, [health_pb2.HealthCheckRequest(service="")]),
}


def _seeds(method: str) -> tuple[bool, list[bytes]]:
    streaming, messages = RAW_METHODS[method]
    return streaming, [m.SerializeToString() for m in messages]


def _send_raw(channel, tally: Tally, method: str, streaming: bool, data: bytes) -> None:
    what = f"{method} {data[:80]!r}"
    tally.raw_by_method[method] += 1
    if streaming:
        # a watch answers once, then only on a change: one response is all it owes
        reads = 1 if method.endswith("Watch") or method.endswith("WatchStats") else STREAM_READS
        _streaming(tally, what, channel.unary_stream(method)(data, timeout=CALL_TIMEOUT_S), reads)
    else:
        _unary(tally, what, lambda: channel.unary_unary(method)(data, timeout=CALL_TIMEOUT_S))


@pytest.mark.parametrize("method", list(RAW_METHODS))
def test_mutated_requests(channel, tally, method):
    streaming, seeds = _seeds(method)

    @RAW_FUZZ
    @given(fs.mutated(seeds))
    def run(data):
        _send_raw(channel, tally, method, streaming, data)

    run()


@pytest.mark.parametrize("method", list(RAW_METHODS))
def test_random_bytes(channel, tally, method):
    streaming, _ = _seeds(method)

    @RAW_FUZZ
    @given(st.binary(max_size=512))
    def run(data):
        _send_raw(channel, tally, method, streaming, data)

    run()


def test_undecodable_bytes_are_invalid_argument_naming_the_message(channel):
    """Not UNKNOWN, as grpc answers by itself when it cannot deserialize."""
    for method, message in (("/inference.GRPCInferenceService/ModelInfer", "inference.ModelInferRequest"),
                            ("/modeld.v1.Generation/Tokenize", "modeld.v1.TokenizeRequest"),
                            ("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest")):
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(method)(b"\x0a\xff\xff\xff\x0f", timeout=CALL_TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"request is not a valid {message}: ")
    with pytest.raises(grpc.RpcError) as err:
        list(channel.unary_stream("/modeld.v1.Generation/Generate")(b"\xff", timeout=CALL_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    good = fs.valid_infer_requests()[0].SerializeToString()
    responses = [pb.ModelStreamInferResponse.FromString(r) for r in channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer")(iter([b"\xff", good]), timeout=CALL_TIMEOUT_S)]
    assert responses[0].error_message.startswith("INVALID_ARGUMENT: request is not a valid inference.ModelInferRequest")
    assert not responses[1].error_message and responses[1].infer_response.model_name == "add"


# -- the HTTP fronts: OpenAI and KServe REST bodies, mutated bodies, random bytes ------------

OPENAI_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank"]
KSERVE_MODELS = ["add", "minilm", "smollm2", "absent", "ADD"]
HTTP_SEEDS = fs.valid_http_bodies()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=CALL_TIMEOUT_S) as client:
        yield client


def _post(tally: Tally, http, path: str, content: bytes, headers: dict | None = None) -> None:
    what = f"POST {path} {content[:200]!r}"
    tally.raw_by_method[f"POST {path}"] += 1
    response = http.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})
    tally.saw_http(what, response)


def _json_bytes(body) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity too, which Python's json reads


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_openai_bodies(http, tally, route):
    @HTTP_FUZZ
    @given(fs.openai_bodies(route))
    def run(body):
        _post(tally, http, route, _json_bytes(body))

    run()


def test_kserve_infer_bodies(http, tally):
    @HTTP_FUZZ
    @given(st.sampled_from(KSERVE_MODELS), fs.kserve_infer_bodies())
    def run(model, body):
        _post(tally, http, f"/v2/models/{model}/infer", _json_bytes(body))

    run()


@pytest.mark.parametrize("route", list(HTTP_SEEDS))
def test_mutated_http_bodies(http, tally, route):
    @HTTP_FUZZ
    @given(fs.mutated(HTTP_SEEDS[route]))
    def run(data):
        _post(tally, http, route, data)

    run()


@pytest.mark.parametrize("route", list(HTTP_SEEDS))
def test_random_http_bytes(http, tally, route):
    """Random bytes, sometimes claiming to be compressed."""
    @HTTP_FUZZ
    @given(st.binary(max_size=512), st.sampled_from([None, "gzip", "deflate", "br", "identity"]))
    def run(data, encoding):
        _post(tally, http, route, data, {"content-encoding": encoding} if encoding else None)

    run()
