"""A gateway traffic split between two versions of one model
([gateway.splits.scorer] "scorer:1" = 1, "scorer:2" = 1), against a real
daemon serving both versions (numbered folders, version_policy "all", each
version a different ONNX graph: y = x * version) and a real `modeld
gateway`, with the stock tritonclient over gRPC (ModelInfer and
ModelStreamInfer) and HTTP (KServe REST through the gateway's HTTP front).

Every answer says which version computed it, so the test sees the split:
both versions serve calls for "scorer", a session id keeps its version, a
client that names a version itself gets that one, and a plain-name canary
split in the same table still works beside it."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th

from daemon import metric_sum, start_daemon, start_gateway
from polling import wait_until
from test_model_versions import versioned_entry

X = np.ones((1, 4), dtype=np.float32)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("version-split")
    repo = root / "repo"
    versioned_entry(repo, "scorer", [1, 2], '"all"')
    config = root / "gateway.toml"
    config.write_text('[gateway.splits.scorer]\n"scorer:1" = 1\n"scorer:2" = 1\n')
    daemon = start_daemon("--no-preload", repository=repo)
    gateway = start_gateway(daemon.address, args=("--config", str(config)))
    client = tc.InferenceServerClient(gateway.address)
    wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") >= 1, what="the gateway to see its node")
    yield client, gateway, daemon
    client.close()
    gateway.stop()
    daemon.stop()


def grpc_call(client, session: str, version: str = "") -> tuple[float, str]:
    inp = tc.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    result = client.infer("scorer", [inp], model_version=version, headers={"x-session-id": session})
    return float(result.as_numpy("y")[0, 0]), result.get_response().model_version


def test_calls_are_split_between_the_versions_and_a_session_keeps_its_version(fleet):
    client, gateway, _ = fleet
    first = {f"conversation-{i}": grpc_call(client, f"conversation-{i}") for i in range(24)}
    # the value computed and the version the answer names agree, and both versions serve
    assert all(value == float(version) for value, version in first.values()), first
    assert {version for _, version in first.values()} == {"1", "2"}, first
    assert all(grpc_call(client, session) == answer for session, answer in list(first.items())[:8])
    assert metric_sum(gateway, "modeld_gateway_split_calls_total") >= 32


def test_a_version_the_client_names_is_kept(fleet):
    client, _, _ = fleet
    for i in range(12):
        assert grpc_call(client, f"pinned-{i}", version="1") == (1.0, "1")


def test_a_stream_keeps_the_version_its_first_request_drew(fleet):
    _, gateway, _ = fleet
    versions = set()
    for session in [f"stream-{i}" for i in range(8)]:
        answers: queue.Queue = queue.Queue()
        with tc.InferenceServerClient(gateway.address) as stream:
            stream.start_stream(callback=lambda result, error: answers.put((result, error)),
                                headers={"x-session-id": session})
            inp = tc.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(X)
            for n in range(3):
                stream.async_stream_infer("scorer", [inp], request_id=str(n))
            got = [answers.get(timeout=60) for _ in range(3)]
            stream.stop_stream()
        assert all(error is None for _, error in got), got
        drawn = {(float(r.as_numpy("y")[0, 0]), r.get_response().model_version) for r, _ in got}
        assert len(drawn) == 1 and next(iter(drawn))[0] == float(next(iter(drawn))[1]), drawn
        versions |= {v for _, v in drawn}
    assert versions == {"1", "2"}


def test_kserve_rest_through_the_gateway_is_split_by_version(fleet):
    _, gateway, _ = fleet
    http = th.InferenceServerClient(f"127.0.0.1:{gateway.http_port}")
    try:
        seen = {}
        for i in range(16):
            inp = th.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(X)
            result = http.infer("scorer", [inp], headers={"x-session-id": f"rest-{i}"})
            seen[i] = (float(result.as_numpy("y")[0, 0]), result.get_response()["model_version"])
        assert all(value == float(version) for value, version in seen.values()), seen
        assert {version for _, version in seen.values()} == {"1", "2"}, seen
        inp = th.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(X)
        pinned = http.infer("scorer", [inp], model_version="2", headers={"x-session-id": "rest-0"})
        assert pinned.get_response()["model_version"] == "2"
    finally:
        http.close()
