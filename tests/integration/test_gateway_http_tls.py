"""The gateway's HTTP front with TLS on both sides: clients reach it over
TLS, it dials a daemon with mutual TLS (--node-tls-*, the server name
override) over HTTP, and each client's own token reaches the node, which
judges it. Certificates are made here with trustme; the model is a tiny
ONNX graph (y = x + 1)."""

from __future__ import annotations

import secrets
import ssl

import httpx
import pytest

import onnx_fixtures
from daemon import metric_sum, start_daemon, start_gateway
from polling import wait_until

trustme = pytest.importorskip("trustme")

CLIENT_TOKEN = "client-" + secrets.token_urlsafe(24)
GATEWAY_TOKEN = "gateway-" + secrets.token_urlsafe(24)
SERVER_NAME = "modeld.internal"  # the node's certificate names only this; dialled by IP, the gateway overrides
INFER = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    server_ca, client_ca = trustme.CA(), trustme.CA()
    server_ca.cert_pem.write_to_path(str(folder / "server_ca.pem"))
    for name, ca, leaf_name in (("server", server_ca, SERVER_NAME), ("gateway", client_ca, "gateway@example.com"),
                                ("front", server_ca, "127.0.0.1")):
        leaf = ca.issue_cert(leaf_name)
        with open(folder / f"{name}.crt", "wb") as f:
            for pem in leaf.cert_chain_pems:
                f.write(pem.bytes())
        leaf.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    client_ca.cert_pem.write_to_path(str(folder / "client_ca.pem"))
    (folder / "tokens.txt").write_text(f"{CLIENT_TOKEN} infer\n{GATEWAY_TOKEN} infer\n")
    (folder / "gateway-token").write_text(f"{GATEWAY_TOKEN}\n")
    repo = tmp_path_factory.mktemp("repo")
    (repo / "plus").mkdir()
    (repo / "plus" / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (repo / "plus" / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
    node = start_daemon("--no-preload", "--tls-cert", str(folder / "server.crt"), "--tls-key",
                        str(folder / "server.key"), "--tls-client-ca", str(folder / "client_ca.pem"),
                        "--auth-token-file", str(folder / "tokens.txt"), repository=repo)
    gateway = start_gateway(node.address, args=(
        "--http-port", "0", "--node-http", f"{node.address}=127.0.0.1:{node.http_port}",
        "--node-tls-ca", str(folder / "server_ca.pem"), "--node-tls-cert", str(folder / "gateway.crt"),
        "--node-tls-key", str(folder / "gateway.key"), "--node-tls-server-name", SERVER_NAME,
        "--node-token-file", str(folder / "gateway-token"),
        "--tls-cert", str(folder / "front.crt"), "--tls-key", str(folder / "front.key")))
    try:
        wait_until(lambda: metric_sum(gateway, "modeld_gateway_node_serving") == 1, what="the TLS node serving")
    except BaseException:
        gateway.proc.kill()
        node.proc.kill()
        raise
    client = httpx.Client(base_url=f"https://127.0.0.1:{gateway.http_port}", timeout=60,
                          verify=ssl.create_default_context(cafile=str(folder / "server_ca.pem")))
    yield {"client": client}
    client.close()
    gateway.stop()
    node.stop()


def test_a_call_crosses_tls_on_both_sides_with_the_clients_token(setup):
    answer = setup["client"].post("/v2/models/plus/infer", json=INFER,
                                  headers={"authorization": f"Bearer {CLIENT_TOKEN}"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]


def test_the_node_judges_the_clients_token(setup):
    refused = setup["client"].post("/v2/models/plus/infer", json=INFER,
                                   headers={"authorization": "Bearer not-a-token"})
    assert refused.status_code == 401
    assert setup["client"].post("/v2/models/plus/infer", json=INFER).status_code == 401
