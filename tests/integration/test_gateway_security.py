"""`modeld gateway` in front of a daemon with mutual TLS and tokens: the
gateway dials it with --node-tls-*, probes it with its own token
(--node-token-file), and forwards each client's own token untouched; a
gateway set up wrongly never routes to the node and says why.

Certificates are made here with trustme; the model is a tiny ONNX graph
(y = x + 1), loaded on first use, so the module runs in seconds.
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from daemon import start_daemon, start_gateway
from daemon import metric_sum as _metric

trustme = pytest.importorskip("trustme")

CLIENT_TOKEN = "client-" + secrets.token_urlsafe(24)
GATEWAY_TOKEN = "gateway-" + secrets.token_urlsafe(24)
SERVER_NAME = "modeld.internal"  # the node's certificate names only this: dialled by IP, the gateway overrides
MODEL = "plus"




def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def _x() -> tc.InferInput:
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32))
    return x


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    server_ca, client_ca = trustme.CA(), trustme.CA()
    server_ca.cert_pem.write_to_path(str(folder / "server_ca.pem"))
    client_ca.cert_pem.write_to_path(str(folder / "client_ca.pem"))
    for name, leaf in (("server", server_ca.issue_cert(SERVER_NAME)),
                       ("gateway", client_ca.issue_cert("gateway@example.com"))):
        with open(folder / f"{name}.crt", "wb") as f:
            for pem in leaf.cert_chain_pems:
                f.write(pem.bytes())
        leaf.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    (folder / "tokens.txt").write_text(f"{CLIENT_TOKEN} infer\n{GATEWAY_TOKEN} infer  # the gateway's probes\n")
    (folder / "gateway-token").write_text(f"# the gateway's own\n{GATEWAY_TOKEN}\n")
    repo = tmp_path_factory.mktemp("repo")
    (repo / MODEL).mkdir()
    (repo / MODEL / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (repo / MODEL / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')

    node = start_daemon("--no-preload", "--http-port", "-1",
                        "--tls-cert", str(folder / "server.crt"), "--tls-key", str(folder / "server.key"),
                        "--tls-client-ca", str(folder / "client_ca.pem"),
                        "--auth-token-file", str(folder / "tokens.txt"), repository=repo)
    tls = ("--node-tls-ca", str(folder / "server_ca.pem"), "--node-tls-cert", str(folder / "gateway.crt"),
           "--node-tls-key", str(folder / "gateway.key"))
    token = ("--node-token-file", str(folder / "gateway-token"))
    name = ("--node-tls-server-name", SERVER_NAME)
    variants = {
        "right": (*tls, *name, *token),
        "plaintext": token,                     # no --node-tls-ca: the TLS node refuses the handshake
        "no client certificate": (tls[0], tls[1], *name, *token),  # mutual TLS refuses it
        "no server name": (*tls, *token),       # the node's certificate does not name 127.0.0.1
        "no token": (*tls, *name),              # TLS is right, Stats is refused
    }
    with ThreadPoolExecutor(len(variants)) as pool:
        gateways = dict(zip(variants, pool.map(lambda args: start_gateway(node.address, args=args),
                                               variants.values())))
    yield {"node": node, "gateways": gateways}
    for process in (*gateways.values(), node):
        process.stop()


def _serving(gateway, node) -> float:
    return _metric(gateway, "modeld_gateway_node_serving", node=node.address)


def test_tritonclient_through_the_gateway_to_a_mutual_tls_node_with_the_clients_token(setup):
    node, gateway = setup["node"], setup["gateways"]["right"]
    _wait(lambda: _serving(gateway, node) == 1, 20, "the node serving (health Watch over mutual TLS)")
    client = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    try:
        result = client.infer(MODEL, [_x()], headers={"authorization": f"Bearer {CLIENT_TOKEN}"})
        np.testing.assert_allclose(result.as_numpy("y"), [[2.0, 3.0, 4.0, 5.0]])
        # the gateway's own Stats got through with its token: it knows the
        # model is loaded there, and its health says so per model
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def model_serving() -> bool:
                try:  # NOT_FOUND until a Stats answer lists the model
                    reply = health.Check(health_pb2.HealthCheckRequest(service=MODEL), timeout=5)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            _wait(model_serving, 10, "the model SERVING in the gateway's health")
        # no client token: the gateway does not lend its own, the node refuses
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, [_x()])
        assert "UNAUTHENTICATED" in caught.value.status()
    finally:
        client.close()
    assert not gateway.events("node_stats_refused")
    text = "".join(gateway._lines) + "".join(node._lines)
    assert GATEWAY_TOKEN not in text and CLIENT_TOKEN not in text


@pytest.mark.parametrize("variant", ["plaintext", "no client certificate", "no server name"])
def test_a_gateway_that_cannot_reach_the_tls_node_never_routes_to_it_and_says_why(setup, variant):
    node, gateway = setup["node"], setup["gateways"][variant]
    _wait(lambda: _serving(setup["gateways"]["right"], node) == 1, 20, "the right gateway seeing the node")
    time.sleep(0.5)  # the wrong gateways started as early: they had as long to fail
    assert _serving(gateway, node) == 0
    client = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, [_x()], headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, client_timeout=10)
    finally:
        client.close()
    assert "UNAVAILABLE" in caught.value.status()
    message = caught.value.message()
    # without TLS toward the nodes the gateway first asks the node for its fleet proof
    probe = "fleet challenge: UNAVAILABLE" if variant == "plaintext" else "health watch: UNAVAILABLE"
    assert node.address in message and "not serving" in message and probe in message, message
    hint = {"plaintext": "--node-tls-ca", "no client certificate": "--node-tls-cert",
            "no server name": "Hostname Verification"}[variant]
    assert hint in message, message


def test_a_gateway_without_its_token_routes_but_warns_that_stats_are_refused(setup):
    node, gateway = setup["node"], setup["gateways"]["no token"]
    _wait(lambda: _serving(gateway, node) == 1, 20, "the node serving (health is open)")
    _wait(lambda: gateway.events("node_stats_refused"), 10, "node_stats_refused logged")
    event = gateway.events("node_stats_refused")[0]
    assert event["code"] == "UNAUTHENTICATED" and "--node-token-file" in event["hint"]
    client = tc.InferenceServerClient(f"127.0.0.1:{gateway.port}")
    try:
        result = client.infer(MODEL, [_x()], headers={"authorization": f"Bearer {CLIENT_TOKEN}"})
        np.testing.assert_allclose(result.as_numpy("y"), [[2.0, 3.0, 4.0, 5.0]])
    finally:
        client.close()
    assert len(gateway.events("node_stats_refused")) == 1  # once, not every 250 ms
