"""How long a health probe waits while one large request is decoded or
refused: the figure behind "a probe answers within 100 ms under any single
request" (issue 29), measured, not asserted to the millisecond (a shared CI
machine would make that a coin toss).

Three loads, each run `scaled(1)` times: a 1,000,000-element BYTES tensor
(200,000 in `make test`) over gRPC (split in a worker thread), the same
count of strings in a KServe REST JSON body (parsed in a worker thread), and
200,000 /v1/embeddings inputs (refused before any is read). gRPC health checks run back to back
meanwhile; their latencies go to bench/results/stress.json under
`probe_latency` at `make stress`.
"""

from __future__ import annotations

import json
import struct
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import onnx_fixtures
from daemon import start_daemon
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from polling import wait_until
from stress.stress_config import SCALE, record, scaled

pytestmark = pytest.mark.stress

RUNS = scaled(1)
COUNT = 1_000_000 if SCALE > 1 else 200_000  # `make test`: a short run of the same loads
GENEROUS_S = 5.0  # a daemon that blocks its loop for the whole decode takes longer than this on CI


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    (root / "add").mkdir()
    (root / "add" / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (root / "add" / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
    proc = start_daemon(repository=root, env={"MODELD_DRAIN_DELAY_S": "0"})
    yield proc
    assert proc.stop() == 0


def _probing(address: str, load) -> list[float]:
    """Health-check latencies (seconds) of the checks that overlapped `load()`."""
    latencies: list[tuple[float, float]] = []
    stop = threading.Event()

    def probe():
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                start = time.perf_counter()
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                latencies.append((start, time.perf_counter()))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    wait_until(lambda: latencies, what="a first health answer")
    began = time.perf_counter()
    load()
    ended = time.perf_counter()
    wait_until(lambda: latencies[-1][0] > ended, what="a health answer after the load")
    stop.set()
    thread.join(60)
    return [done - start for start, done in latencies if done >= began and start <= ended]


def _bytes_tensor_over_grpc(daemon) -> None:
    request = pb.ModelInferRequest(model_name="add")
    request.inputs.add(name="x", datatype="BYTES", shape=[COUNT])
    request.raw_input_contents.append((struct.pack("<I", 1) + b"a") * COUNT)
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 2**31 - 1)]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=300)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # decoded, then refused: add takes FP32


def _bytes_tensor_over_rest(daemon) -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [COUNT], "data": ["a"] * COUNT}]})
    response = httpx.post(f"{daemon.http_url}/v2/models/add/infer", content=body.encode(), timeout=300)
    assert response.status_code == 400


def _embedding_inputs(daemon) -> None:
    body = json.dumps({"model": "add", "input": ["a"] * 200_000}).encode()
    response = httpx.post(f"{daemon.http_url}/v1/embeddings", content=body, timeout=300)
    assert response.status_code == 429 and "max_embedding_inputs" in response.json()["error"]["message"]


LOADS = {"bytes_tensor_grpc": _bytes_tensor_over_grpc, "bytes_tensor_rest": _bytes_tensor_over_rest,
         "embedding_inputs_200k": _embedding_inputs}


def test_health_answers_beside_one_large_request(daemon):
    figures = {}
    for name, load in LOADS.items():
        latencies = []
        for _ in range(RUNS):
            latencies += _probing(daemon.address, lambda: load(daemon))
        assert latencies, f"{name}: no probe overlapped the request"
        ms = np.array(latencies) * 1000
        figures[name] = {"probes": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
                         "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(float(ms.max()), 2),
                         "within_100ms": round(float((ms <= 100).mean()), 4)}
        print(f"{name}: {figures[name]}")
        assert ms.max() < GENEROUS_S * 1000, f"{name}: a probe waited {ms.max():.0f} ms"
    record("probe_latency", figures)
