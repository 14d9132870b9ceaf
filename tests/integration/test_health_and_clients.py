"""grpc.health.v1 through the standard stub, reflection, the Python client,
the Node.js client and the `modeld` command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import onnx_fixtures
from daemon import ROOT
from modeld.clients import AsyncClient, Client

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_check_daemon_and_models(daemon):
    with Client(daemon.address) as client:
        client.load("minilm")  # a no-op when it is loaded already
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="minilm"), timeout=10).status == SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no_such_model"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_follows_a_model_through_load_and_unload(daemon):
    seen: list[int] = []
    ended: list[grpc.StatusCode] = []
    changed = threading.Condition()
    with grpc.insecure_channel(daemon.address) as channel, Client(daemon.address) as client:
        health = health_pb2_grpc.HealthStub(channel)
        stream = health.Watch(health_pb2.HealthCheckRequest(service="watched"), timeout=60)

        def follow():
            try:
                for message in stream:
                    with changed:
                        seen.append(message.status)
                        changed.notify_all()
            except grpc.RpcError as exc:
                ended.append(exc.code())

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()

        def wait_for(status):
            with changed:
                assert changed.wait_for(lambda: status in seen, timeout=30), seen

        wait_for(health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        config = onnx_fixtures.triton_config("watched", [("x", "INT64", [3])], [("y", "INT64", [3])])
        client.load("watched", config=config, files={"1/model.onnx": onnx_fixtures.double_int64()})
        wait_for(SERVING)
        client.unload("watched")
        wait_for(NOT_SERVING)
        stream.cancel()
        thread.join(30)
    # the watch ran until this test cancelled it, not until an error ended it
    assert ended == [grpc.StatusCode.CANCELLED]
    last_not_serving = max(i for i, status in enumerate(seen) if status == NOT_SERVING)
    assert seen.index(SERVING) < last_not_serving


def test_reflection_lists_the_services(daemon):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(daemon.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_python_client_blocking(daemon):
    with Client(daemon.address) as client:
        vectors = client.embed(["first sentence", "second one"])
        assert vectors.shape == (2, 384)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
        assert client.health() == "SERVING" and client.health("minilm") == "SERVING"
        states = {m.name: m.state for m in client.models()}
        assert states["minilm"] == "READY"


async def test_python_client_asyncio(daemon):
    async with AsyncClient(daemon.address) as client:
        vectors = await client.embed(["async sentence"])
        assert vectors.shape == (1, 384)
        x = np.array([[1, 2, 3]], dtype=np.int64)
        config = onnx_fixtures.triton_config("double_async", [("x", "INT64", [3])], [("y", "INT64", [3])])
        await client.load("double_async", config=config, files={"1/model.onnx": onnx_fixtures.double_int64()})
        np.testing.assert_array_equal((await client.infer("double_async", {"x": x}))["y"], x * 2)
        await client.unload("double_async")
        assert await client.health("double_async") == "NOT_SERVING"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_node_client_checks_health_and_embeds(daemon):
    if not (ROOT / "clients/node/node_modules/@grpc/grpc-js").is_dir():
        pytest.fail("run `make node` (npm install in clients/node) first")
    out = subprocess.run(["node", str(ROOT / "clients/node/example.js"), daemon.address, "hello from node"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["health"] == "SERVING" and result["dim"] == 384
    assert abs(result["norm"] - 1.0) < 1e-4
    with Client(daemon.address) as client:
        expected = client.embed(["hello from node"])[0]
    np.testing.assert_allclose(result["head"], expected[:4], rtol=1e-5)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "modeld.server.cli", *args], capture_output=True, text=True, timeout=60)


def test_command_line_client(daemon):
    assert _cli("load", "minilm", "--address", daemon.address).returncode == 0
    listing = _cli("models", "--address", daemon.address)
    assert listing.returncode == 0 and "minilm\t1\tREADY" in listing.stdout
    health = _cli("health", "--address", daemon.address)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    infer = _cli("infer", "minilm", "--text", "a sentence", "--address", daemon.address)
    assert infer.returncode == 0 and len(json.loads(infer.stdout)["embedding"][0]) == 384
    completion = _cli("infer", "smollm2", "--prompt", "The capital of France is", "--max-tokens", "4",
                      "--address", daemon.address)
    assert completion.returncode == 0 and completion.stdout.startswith(" Paris")
    missing = _cli("infer", "nope", "--text", "x", "--address", daemon.address)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_invalid_settings_fail_at_start_with_a_clear_message(tmp_path):
    bad = _cli("serve", "--memory-budget", "lots", "--model-repository", str(tmp_path))
    assert bad.returncode == 2 and "invalid memory_budget 'lots' from --memory-budget" in bad.stderr
    bad_env = subprocess.run([sys.executable, "-m", "modeld.server.cli", "serve"], capture_output=True, text=True,
                             timeout=60, env={"MODELD_GRPC_PORT": "99999", "PATH": "/usr/bin"})
    assert bad_env.returncode == 2 and "grpc_port 99999" in bad_env.stderr
