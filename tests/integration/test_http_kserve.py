"""KServe v2 REST on the daemon's HTTP port: the stock tritonclient.http
against a real daemon, the same answers as gRPC, and every refusal as
Triton's `{"error": ...}` with the status of the gRPC table."""

from __future__ import annotations

import gzip
import json
import signal
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from daemon import start_daemon
from modeld.clients import Client
from polling import wait_until

SENTENCES = ["The cat sits on the mat.", "modeld serves many models from one process.", "Ünïcödé text works too ✓"]
X = np.array([[0.0, 1.0, -1.0, 3.0], [0.5, -2.0, 4.0, 0.25]], dtype=np.float32)
W = np.arange(16, dtype=np.float32).reshape(4, 4) / 8.0
B = np.array([0.5, -0.5, 1.0, -1.0], dtype=np.float32)
SOFTCAP_Y = 2.0 * np.tanh((X @ W + B) / 2.0)


@pytest.fixture
def http(daemon):
    assert daemon.http_port > 0, "the test daemon must log its bound http_port"
    client = th.InferenceServerClient(f"127.0.0.1:{daemon.http_port}")
    yield client
    client.close()


@pytest.fixture
def raw(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=120) as client:
        yield client


def _input(name, array, datatype, binary=True):
    tensor = th.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _softcap_json(**overrides) -> dict:
    request = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": X.tolist()}]}
    request.update(overrides)
    return request


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]
    assert response.headers["x-request-id"]
    return body["error"]


def _samples(daemon, metric: str) -> list:
    text = httpx.get(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == metric]


# -- health and metadata ---------------------------------------------------------------------


def test_health_and_model_readiness(http):
    assert http.is_server_live() and http.is_server_ready()
    assert http.is_model_ready("softcap_demo") and http.is_model_ready("softcap_demo", "1")
    assert not http.is_model_ready("softcap_demo", "2")
    assert not http.is_model_ready("no-such-model")


def test_readiness_answers_with_the_status_a_probe_reads(raw):
    assert raw.get("/v2/health/live").json() == {"live": True}
    assert raw.get("/v2/health/ready").json() == {"ready": True}
    assert raw.get("/v2/models/softcap_demo/versions/1/ready").json() == {"name": "softcap_demo", "ready": True}
    assert "no-such-model" in _error(raw.get("/v2/models/no-such-model/ready"), 404)
    assert "version '2'" in _error(raw.get("/v2/models/softcap_demo/versions/2/ready"), 404)


def test_server_and_model_metadata_match_grpc(http, triton):
    meta = triton.get_server_metadata()
    assert http.get_server_metadata() == {"name": meta.name, "version": meta.version,
                                          "extensions": list(meta.extensions)}
    for model in ("minilm", "softcap_demo"):
        over_grpc = triton.get_model_metadata(model, as_json=True)
        over_http = http.get_model_metadata(model)
        assert over_http["name"] == over_grpc["name"] == model
        assert over_http["versions"] == over_grpc["versions"] == ["1"]
        assert over_http["platform"] == over_grpc["platform"]
        for key in ("inputs", "outputs"):
            assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in over_grpc[key]] == \
                [(t["name"], t["datatype"], t["shape"]) for t in over_http[key]]
    assert http.get_model_metadata("minilm", "1")["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


# -- inference -------------------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_fp32_infer_with_and_without_the_binary_extension(http, binary_in, binary_out):
    outputs = None if binary_out is None else [th.InferRequestedOutput("y", binary_data=binary_out)]
    result = http.infer("softcap_demo", [_input("x", X, "FP32", binary_in)], outputs=outputs, request_id="fp32-1")
    y = result.as_numpy("y")
    assert y.dtype == np.float32 and y.shape == (2, 4)
    np.testing.assert_allclose(y, SOFTCAP_Y, rtol=1e-6)
    response = result.get_response()
    assert response["id"] == "fp32-1" and response["model_name"] == "softcap_demo"
    # no outputs named: tritonclient asks for all of them as binary
    binary_expected = binary_out is not False
    assert ("binary_data_size" in response["outputs"][0].get("parameters", {})) is binary_expected
    assert ("data" in response["outputs"][0]) is not binary_expected


def test_fp32_over_http_equals_grpc_bit_for_bit(http, triton):
    over_http = http.infer("softcap_demo", [_input("x", X, "FP32")]).as_numpy("y")
    grpc_input = tg.InferInput("x", list(X.shape), "FP32")
    grpc_input.set_data_from_numpy(X)
    over_grpc = triton.infer("softcap_demo", [grpc_input]).as_numpy("y")
    assert over_http.tobytes() == over_grpc.tobytes()


def test_binary_response_layout_is_tritons(raw):
    """JSON header, then each binary output's bytes, the header's size in
    Inference-Header-Content-Length."""
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                     "parameters": {"binary_data_size": X.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    response = raw.post("/v2/models/softcap_demo/infer", content=header + X.tobytes(),
                        headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200, response.text
    split = int(response.headers["inference-header-content-length"])
    meta = json.loads(response.content[:split])
    assert meta["outputs"][0]["parameters"] == {"binary_data_size": 32}
    y = np.frombuffer(response.content[split:], dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(y, SOFTCAP_Y, rtol=1e-6)


def test_json_data_may_be_nested_or_flat_and_gzip_compressed(raw):
    flat = raw.post("/v2/models/softcap_demo/infer", json=_softcap_json(
        inputs=[{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": X.ravel().tolist()}]))
    nested = raw.post("/v2/models/softcap_demo/infer", content=gzip.compress(json.dumps(_softcap_json()).encode()),
                      headers={"Content-Encoding": "gzip"})
    for response in (flat, nested):
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()["outputs"][0]["data"]).reshape(2, 4), SOFTCAP_Y, rtol=1e-6)


def test_inline_int64_model_load_infer_index_unload(http):
    config = onnx_fixtures.triton_config("double_http", [("x", "INT64", [3])], [("y", "INT64", [3])])
    http.load_model("double_http", config=json.dumps(config), files={"file:1/model.onnx": onnx_fixtures.double_int64()})
    try:
        assert http.is_model_ready("double_http")
        x = np.array([[1, -2, 3], [40, 50, 2**40]], dtype=np.int64)
        for binary in (True, False):
            result = http.infer("double_http", [_input("x", x, "INT64", binary)],
                                outputs=[th.InferRequestedOutput("y", binary_data=binary)])
            y = result.as_numpy("y")
            assert y.dtype == np.int64
            np.testing.assert_array_equal(y, x * 2)
        index = {m["name"]: m["state"] for m in http.get_model_repository_index()}
        assert index["double_http"] == "READY"
    finally:
        http.unload_model("double_http")
    assert not http.is_model_ready("double_http")
    with pytest.raises(InferenceServerException) as err:
        http.infer("double_http", [_input("x", np.array([[1, 2, 3]], dtype=np.int64), "INT64")])
    assert err.value.status() == "404" and "double_http" in err.value.message()


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_embeddings_match_grpc(http, triton, binary):
    texts = np.array([s.encode() for s in SENTENCES], dtype=object)
    got = http.infer("minilm", [_input("text", texts, "BYTES", binary)],
                     outputs=[th.InferRequestedOutput("embedding", binary_data=binary)]).as_numpy("embedding")
    grpc_input = tg.InferInput("text", [len(texts)], "BYTES")
    grpc_input.set_data_from_numpy(texts)
    expected = triton.infer("minilm", [grpc_input]).as_numpy("embedding")
    assert got.shape == (3, 384) and got.dtype == np.float32
    cosine = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.999, cosine


def test_repository_index_and_statistics_match_grpc(http, triton, raw):
    over_grpc = {(m.name, m.state) for m in triton.get_model_repository_index().models}
    assert {(m["name"], m["state"]) for m in http.get_model_repository_index()} == over_grpc
    ready = raw.post("/v2/repository/index", json={"ready": True}).json()
    assert ready and all(m["state"] == "READY" for m in ready)
    before = http.get_inference_statistics("softcap_demo")["model_stats"][0]["inference_stats"]["success"]["count"]
    for _ in range(3):
        http.infer("softcap_demo", [_input("x", X, "FP32")])
    stats = http.get_inference_statistics("softcap_demo")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == before + 3
    assert stats["name"] == "softcap_demo" and stats["memory_usage"][0]["byte_size"] > 0
    assert stats["inference_stats"]["success"]["count"] == int(
        triton.get_inference_statistics("softcap_demo", as_json=True)["model_stats"][0]["inference_stats"]
        ["success"]["count"])
    names = {s["name"] for s in http.get_inference_statistics()["model_stats"]}
    assert {"minilm", "softcap_demo"} <= names
    assert "no-such-model" in _error(raw.get("/v2/models/no-such-model/stats"), 404)


def test_language_model_text_over_v2_infer_equals_grpc(raw, http, daemon):
    prompt = "The capital of France is"
    response = raw.post("/v2/models/smollm2/infer", json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}],
        "parameters": {"max_tokens": 8}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["parameters"]["completion_tokens"] == 8 and body["parameters"]["finish_reason"]
    text = body["outputs"][0]["data"][0]
    assert body["outputs"][0]["name"] == "text_output" and text
    grpc_client = tg.InferenceServerClient(daemon.address)
    grpc_input = tg.InferInput("text_input", [1], "BYTES")
    grpc_input.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    over_grpc = grpc_client.infer("smollm2", [grpc_input], parameters={"max_tokens": 8})
    assert text == over_grpc.as_numpy("text_output")[0].decode()
    # tritonclient.http, binary: the same text, length-prefixed
    binary = http.infer("smollm2", [_input("text_input", np.array([prompt.encode()], dtype=object), "BYTES")],
                        parameters={"max_tokens": 8})
    assert binary.as_numpy("text_output")[0].decode() == text
    assert "temperature" in _error(raw.post("/v2/models/smollm2/infer", json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}],
        "parameters": {"temperature": "hot"}}), 400)


# -- errors ----------------------------------------------------------------------------------


def _fp32_binary(header_extra: dict | None = None, size: int = 32, payload: bytes = X.tobytes(),
                 header_length: int | None = None):
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                     "parameters": {"binary_data_size": size}}], **(header_extra or {})}).encode()
    length = len(header) if header_length is None else header_length
    return {"content": header + payload, "headers": {"Inference-Header-Content-Length": str(length)}}


BAD_REQUESTS = {
    "body is not JSON": ("softcap_demo", {"content": b"{not json"}, 400, "not valid JSON"),
    "body is a JSON list": ("softcap_demo", {"json": [1, 2]}, 400, "must be a JSON object"),
    "unknown model": ("no-such-model", {"json": _softcap_json()}, 404, "no-such-model"),
    "wrong datatype": ("softcap_demo", {"json": {"inputs": [
        {"name": "x", "datatype": "INT64", "shape": [2, 4], "data": [1] * 8}]}}, 400, "INT64"),
    "wrong shape": ("softcap_demo", {"json": {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [2, 5], "data": [1.0] * 10}]}}, 400, "shape"),
    "data does not fill the shape": ("softcap_demo", {"json": {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [1.0] * 7}]}}, 400, "needs 8 values"),
    "strings in FP32 data": ("softcap_demo", {"json": {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": ["a", "b", "c", "d"]}]}}, 400, "must hold numbers"),
    "unknown datatype": ("softcap_demo", {"json": {"inputs": [
        {"name": "x", "datatype": "FP128", "shape": [1, 4], "data": [1.0] * 4}]}}, 400, "unsupported datatype"),
    "input without data": ("softcap_demo", {"json": {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4]}]}}, 400, "has no data"),
    "unsupported request parameter": ("softcap_demo", {"json": _softcap_json(parameters={"custom": 1})},
                                      400, "'custom'"),
    "parameter of a JSON type parameters cannot have": (
        "softcap_demo", {"json": _softcap_json(parameters={"priority": [1]})}, 400, "'priority'"),
    "negative priority": ("softcap_demo", {"json": _softcap_json(parameters={"priority": -1})}, 400, "priority"),
    "classification output": ("softcap_demo", {"json": _softcap_json(
        outputs=[{"name": "y", "parameters": {"classification": 2}}])}, 501, "classification"),
    "sequence batching": ("softcap_demo", {"json": _softcap_json(parameters={"sequence_id": 7})}, 501, "sequence"),
    "binary data shorter than declared": ("softcap_demo", _fp32_binary(size=64), 400, "runs past the end"),
    "binary data left over": ("softcap_demo", _fp32_binary(payload=X.tobytes() + b"xx"), 400, "2 bytes"),
    "header length past the body": ("softcap_demo", _fp32_binary(header_length=10**6), 400,
                                    "Inference-Header-Content-Length"),
    "binary tensors without the header length": ("softcap_demo", {"content": _fp32_binary()["content"]}, 400,
                                                 "Inference-Header-Content-Length"),
    "unsupported content encoding": ("softcap_demo", {"json": _softcap_json(), "headers": {"Content-Encoding": "br"}},
                                     400, "Content-Encoding"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_infer_requests_get_tritons_error_body_and_the_grpc_tables_status(raw, case):
    model, kwargs, status, fragment = BAD_REQUESTS[case]
    message = _error(raw.post(f"/v2/models/{model}/infer", **kwargs), status)
    assert fragment in message, message


def test_unknown_version_unknown_endpoint_and_bad_load(raw):
    assert "version '7'" in _error(raw.post("/v2/models/softcap_demo/versions/7/infer", json=_softcap_json()), 404)
    assert "no KServe v2 endpoint" in _error(raw.get("/v2/models/softcap_demo/config"), 404)
    assert "base64" in _error(raw.post("/v2/repository/models/x/load", json={
        "parameters": {"config": "{}", "file:1/model.onnx": "***not base64***"}}), 400)
    assert "'config'" in _error(raw.post("/v2/repository/models/x/load", json={
        "parameters": {"file:1/model.onnx": "AAAA"}}), 400)
    assert "no-such-model" in _error(raw.post("/v2/repository/models/no-such-model/load"), 404)


def test_failures_are_counted_by_model_status_and_protocol(raw, daemon):
    def failures() -> float:
        return sum(s.value for s in _samples(daemon, "modeld_request_failures_total")
                   if s.labels == {"model": "softcap_demo", "status": "INVALID_ARGUMENT", "protocol": "http"})

    def successes() -> float:
        return sum(s.value for s in _samples(daemon, "modeld_requests_total")
                   if s.labels.get("model") == "softcap_demo" and s.labels.get("protocol") == "http")

    failed, succeeded = failures(), successes()
    _error(raw.post("/v2/models/softcap_demo/infer", json=_softcap_json(parameters={"custom": 1})), 400)
    assert raw.post("/v2/models/softcap_demo/infer", json=_softcap_json()).status_code == 200
    assert failures() == failed + 1
    assert successes() == succeeded + 1


def test_request_id_round_trip(raw, daemon):
    ok = raw.post("/v2/models/softcap_demo/infer", json=_softcap_json(), headers={"x-request-id": "trace-42.a:b"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42.a:b"
    failed = raw.post("/v2/models/softcap_demo/infer", json=_softcap_json(parameters={"custom": 1}),
                      headers={"x-request-id": "trace-43"})
    assert failed.status_code == 400 and failed.headers["x-request-id"] == "trace-43"
    wait_until(lambda: any(e.get("request_id") == "trace-43" for e in daemon.events("http_failed")),
               what="the failure's log line with its request id")
    # an id that could forge log lines is replaced by a fresh one
    forged = raw.get("/v2/health/live", headers={"x-request-id": "bad id\" level=error"})
    assert forged.headers["x-request-id"] != "bad id\" level=error"
    assert len(forged.headers["x-request-id"]) == 16
    assert raw.get("/v2/health/live").headers["x-request-id"] != raw.get("/v2/health/live").headers["x-request-id"]


# -- limits and shutdown (a daemon of their own) -------------------------------------------------


LONG_TEXT = " ".join(["a long sentence keeps the model busy for a while"] * 30)


@pytest.fixture(scope="module")
def small_daemon():
    # a drain delay long enough for the SIGTERM test to see it on a busy machine
    daemon = start_daemon("--no-preload", env={"MODELD_MAX_MESSAGE_BYTES": "64KiB", "MODELD_DRAIN_DELAY_S": "5.0",
                                               "MODELD_SHUTDOWN_GRACE_S": "30"})
    yield daemon
    daemon.stop()


def test_oversize_body_is_413_and_small_ones_still_pass(small_daemon):
    with httpx.Client(base_url=small_daemon.http_url, timeout=60) as client:
        big = _softcap_json(inputs=[{"name": "x", "datatype": "FP32", "shape": [8000, 4], "data": [0.5] * 32000}])
        assert "max_message_bytes" in _error(client.post("/v2/models/softcap_demo/infer", json=big), 413)
        # no Content-Length to check first: refused while reading
        chunks = iter([b"{" + b" " * 40_000, b" " * 40_000 + b"}"])
        assert "max_message_bytes" in _error(client.post("/v2/models/softcap_demo/infer", content=chunks), 413)
        # small on the wire, past the limit once inflated
        bomb = gzip.compress(json.dumps(big).encode())
        assert len(bomb) < 64 * 1024
        assert "decompressed" in _error(client.post("/v2/models/softcap_demo/infer", content=bomb,
                                                    headers={"Content-Encoding": "gzip"}), 413)
        assert client.post("/v2/models/softcap_demo/infer", json=_softcap_json()).status_code == 200
    exhausted = [s for s in _samples(small_daemon, "modeld_request_failures_total")
                 if s.labels["status"] == "RESOURCE_EXHAUSTED" and s.labels["protocol"] == "http"]
    assert sum(s.value for s in exhausted) == 3


def test_sigterm_refuses_new_http_requests_and_finishes_those_in_flight(small_daemon):
    """Runs last on small_daemon: it ends it."""
    url = small_daemon.http_url
    # 8 calls of 16 rows of 256 tokens: two merged batches of 64 rows, each
    # far longer than it takes to see them all arrive even on a quiet machine
    texts = [LONG_TEXT] * 16
    request = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [16], "data": texts}]}
    with httpx.Client(base_url=url, timeout=120) as client:
        assert client.post("/v2/repository/models/minilm/load").status_code == 200

    ready_to_send = threading.Barrier(9)

    def embed():
        with httpx.Client(base_url=url, timeout=120) as own:
            own.get("/v2/health/live")  # connected before the clock starts: only the request itself is left
            ready_to_send.wait(30)
            response = own.post("/v2/models/minilm/infer", json=request)
            return response, time.monotonic()

    with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=url, timeout=30) as late, \
            Client(small_daemon.address, timeout=30) as stats:
        assert late.get("/v2/health/ready").status_code == 200  # a kept-alive connection, reused below
        entered = _calls_entered(stats)
        futures = [pool.submit(embed) for _ in range(8)]
        ready_to_send.wait(30)
        # all eight reached the engine, so none can arrive after the signal
        wait_until(lambda: _calls_entered(stats) >= entered + 8, what="the eight calls in flight")
        signalled = time.monotonic()
        small_daemon.proc.send_signal(signal.SIGTERM)
        # inside the drain delay
        wait_until(lambda: late.get("/v2/health/ready").status_code == 503, what="the drain to begin")
        assert "shutting down" in _error(late.get("/v2/health/ready"), 503)
        assert "shutting down" in _error(late.post("/v2/models/minilm/infer", json=request), 503)
        finished = [f.result(timeout=120) for f in futures]
    results = [response for response, _ in finished]
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results if r.status_code != 200]
    assert all(done > signalled for _, done in finished), "a call ended before SIGTERM: nothing was in flight"
    assert all(r.json()["outputs"][0]["shape"] == [16, 384] for r in results)
    assert small_daemon.proc.wait(60) == 0
    assert small_daemon.events("daemon_stopped")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/v2/health/live", timeout=5)


def _calls_entered(client: Client, model: str = "minilm") -> int:
    """Calls that have reached `model` in the engine, however they ended."""
    return next((m.request_count for m in client.node_stats().models if m.name == model), 0)


def test_http_port_minus_one_serves_no_http():
    daemon = start_daemon("--no-preload", "--http-port", "-1", repository=None)
    try:
        assert daemon.http_port == 0 and daemon.events("daemon_started")[0]["http_port"] == 0
    finally:
        assert daemon.stop() == 0


def test_binary_bytes_elements_are_length_prefixed(raw):
    texts = [s.encode() for s in SENTENCES]
    payload = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    header = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3],
                                     "parameters": {"binary_data_size": len(payload)}}]}).encode()
    response = raw.post("/v2/models/minilm/infer", content=header + payload,
                        headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [3, 384]
    # a length prefix that overruns its element is refused, not read past
    broken = struct.pack("<I", 1000) + b"short"
    header = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(broken)}}]}).encode()
    message = _error(raw.post("/v2/models/minilm/infer", content=header + broken,
                              headers={"Inference-Header-Content-Length": str(len(header))}), 400)
    assert "runs past the end" in message


def test_a_client_that_leaves_cancels_its_generation(daemon):
    payload = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Count to a thousand:"]}],
               "parameters": {"max_tokens": 1500, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.http_url + "/v2/models/smollm2/infer", json=payload, headers={"x-request-id": "leaver-1"},
                   timeout=httpx.Timeout(60, read=2))
    wait_until(lambda: any(e.get("request_id") == "leaver-1" for e in daemon.events("http_client_disconnected")),
               what="the daemon to notice the client leave")
    # the sequence left the batch: nothing runs for smollm2 any more
    wait_until(lambda: not any(s.value for s in _samples(daemon, "modeld_running_sequences")
                               if s.labels["model"] == "smollm2"),
               what="the generation to stop after its client left")
