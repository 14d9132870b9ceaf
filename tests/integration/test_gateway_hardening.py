"""The gateway's own security (issue 29): TLS and tokens on its client port,
tenants' quotas and rights enforced there, client-caused statuses (a KServe
`timeout` the client set, quota refusals) never held against a node,
bounded routing reads, and nodes admitted to the ring only once they prove
they hold the fleet token.

One node holds the fleet token (fleet=yes in its token file); a second,
stranger node answers on its port with the same client tokens but not the
fleet token, and must never join the ring.
"""

from __future__ import annotations

import secrets
import time

import grpc
import numpy as np
import pytest

import onnx_fixtures
from daemon import start_daemon, start_gateway
from daemon import metric_sum as _metric
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from polling import wait_until

trustme = pytest.importorskip("trustme")

FLOOD = "flood-" + secrets.token_urlsafe(24)      # tenant flood: no rate, no priority, no update
LIMITED = "limit-" + secrets.token_urlsafe(24)    # tenant limited: 2 calls, then one per 1000 s
OPS = "ops-" + secrets.token_urlsafe(24)          # tenant ops: may send update traffic and urgency
NARROW = "narrow-" + secrets.token_urlsafe(24)    # tenant narrow: model plus only
GATEWAY = "gateway-" + secrets.token_urlsafe(24)  # the gateway's own token: the fleet token
MODEL = "plus"
CLIENT_LINES = (f"{FLOOD} infer tenant=flood\n"
                f"{LIMITED} infer tenant=limited rps=0.001 burst=2\n"
                f"{OPS} infer tenant=ops update=yes priority=yes\n"
                f"{NARROW} infer tenant=narrow models={MODEL}\n")




@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    with open(folder / "gateway.crt", "wb") as f:
        for pem in leaf.cert_chain_pems:
            f.write(pem.bytes())
    leaf.private_key_pem.write_to_path(str(folder / "gateway.key"))
    (folder / "clients.txt").write_text(CLIENT_LINES)
    (folder / "node-tokens.txt").write_text(CLIENT_LINES + f"{GATEWAY} infer fleet=yes\n")
    (folder / "stranger-tokens.txt").write_text(CLIENT_LINES + f"{GATEWAY} infer\n")
    (folder / "gateway-token").write_text(f"{GATEWAY}\n")
    (folder / "gateway.toml").write_text("[gateway]\nmax_request_fields = 50\nparse_in_thread_bytes = 4096\n")
    repo = tmp_path_factory.mktemp("repo")
    (repo / MODEL).mkdir()
    (repo / MODEL / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (repo / MODEL / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
    node = start_daemon("--http-port", "-1", "--auth-token-file", str(folder / "node-tokens.txt"), repository=repo)
    stranger = start_daemon("--http-port", "-1", "--auth-token-file", str(folder / "stranger-tokens.txt"),
                            repository=repo)
    gateway = start_gateway(node.address, stranger.address, args=(
        "--node-token-file", str(folder / "gateway-token"), "--auth-token-file", str(folder / "clients.txt"),
        "--tls-cert", str(folder / "gateway.crt"), "--tls-key", str(folder / "gateway.key"),
        "--config", str(folder / "gateway.toml")))
    channel = grpc.secure_channel(f"localhost:{gateway.port}",
                                  grpc.ssl_channel_credentials(root_certificates=(folder / "ca.pem").read_bytes()))
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    wait_until(lambda: _metric(gateway, "modeld_gateway_node_serving", node=node.address) == 1, 60,
               "the fleet node serving through the gateway")
    yield {"node": node, "stranger": stranger, "gateway": gateway, "stub": stub, "channel": channel,
           "folder": folder}
    channel.close()
    for process in (gateway, node, stranger):
        process.stop()


def _md(token: str, *extra: tuple[str, str]) -> tuple:
    return (("authorization", f"Bearer {token}"), *extra)


def _request(timeout_us: int = 0, pad: int = 0) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[1, 4])], raw_input_contents=[np.ones((1, 4), np.float32).tobytes()])
    if timeout_us:
        request.parameters["timeout"].int64_param = timeout_us
    if pad:
        request.id = "x" * pad
    return request


def _sums(reply) -> list[float]:
    return np.frombuffer(reply.raw_output_contents[0], np.float32).tolist()


def test_the_gateway_refuses_a_call_without_a_token_or_with_a_wrong_one(fleet):
    stub = fleet["stub"]
    for metadata in ((), _md("wrong-" + secrets.token_urlsafe(24))):
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(_request(), metadata=metadata, timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # probes stay open, as on a daemon
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live
    assert _sums(stub.ModelInfer(_request(), metadata=_md(FLOOD), timeout=60)) == [2.0] * 4


def test_the_client_port_serves_tls_only(fleet):
    with grpc.insecure_channel(f"127.0.0.1:{fleet['gateway'].port}") as plain:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_flood_of_expired_kserve_timeouts_leaves_the_node_s_breaker_closed(fleet):
    stub, gateway, node = fleet["stub"], fleet["gateway"], fleet["node"]
    before = _metric(gateway, "modeld_gateway_breaker_transitions_total", node=node.address)
    codes = []
    for _ in range(200):
        try:
            stub.ModelInfer(_request(timeout_us=1), metadata=_md(FLOOD), timeout=60)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK}, set(codes)
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= 150  # 1 µs is spent before any batch runs
    # the client's other mistakes say nothing about the node either
    unknown, misshapen = _request(), _request()
    unknown.model_name = "no-such-model"
    misshapen.inputs[0].shape[:] = [1, 5]
    for request, code in ((unknown, grpc.StatusCode.NOT_FOUND), (misshapen, grpc.StatusCode.INVALID_ARGUMENT)):
        for _ in range(30):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request, metadata=_md(FLOOD), timeout=60)
            assert caught.value.code() == code
    assert _metric(gateway, "modeld_gateway_breaker_transitions_total", node=node.address) == before
    assert _metric(gateway, "modeld_gateway_breaker_state", node=node.address) == 0
    assert _sums(stub.ModelInfer(_request(), metadata=_md(FLOOD), timeout=60)) == [2.0] * 4


def test_a_tenant_over_its_rate_is_refused_at_the_gateway_and_no_breaker_moves(fleet):
    stub, gateway, node = fleet["stub"], fleet["gateway"], fleet["node"]
    for _ in range(2):
        assert _sums(stub.ModelInfer(_request(), metadata=_md(LIMITED), timeout=60)) == [2.0] * 4
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_request(), metadata=_md(LIMITED), timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(caught.value.trailing_metadata())["retry-after"]) >= 1
    assert _metric(gateway, "modeld_tenant_refusals_total", tenant="limited", reason="rate") == 1
    assert _metric(gateway, "modeld_gateway_breaker_state", node=node.address) == 0
    assert _sums(stub.ModelInfer(_request(), metadata=_md(FLOOD), timeout=60)) == [2.0] * 4  # others unaffected


def test_a_model_outside_the_tenant_s_list_is_refused_at_the_gateway(fleet):
    stub = fleet["stub"]
    request = _request()
    request.model_name = "not-" + MODEL
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, metadata=_md(NARROW), timeout=60)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use model" in caught.value.details()
    assert _sums(stub.ModelInfer(_request(), metadata=_md(NARROW), timeout=60)) == [2.0] * 4


def test_update_traffic_is_honoured_only_for_a_tenant_allowed_it(fleet):
    stub = fleet["stub"]
    update = ("x-modeld-request-type", "update")
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_request(), metadata=_md(FLOOD, update), timeout=60)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED and "update" in caught.value.details()
    assert _sums(stub.ModelInfer(_request(), metadata=_md(OPS, update), timeout=60)) == [2.0] * 4
    # urgency from a tenant without priority is served, at the default urgency (no hedge)
    urgent = ("x-modeld-urgency", "critical")
    assert _sums(stub.ModelInfer(_request(), metadata=_md(FLOOD, urgent), timeout=60)) == [2.0] * 4
    assert _metric(fleet["gateway"], "modeld_tenant_refusals_total", tenant="flood",
                   reason="priority_clamped") >= 1


def test_routing_reads_are_bounded_and_large_requests_are_read_off_the_loop(fleet):
    stub = fleet["stub"]
    # above parse_in_thread_bytes (4096): routed from a thread, answered as any other
    assert _sums(stub.ModelInfer(_request(pad=64 * 1024), metadata=_md(FLOOD), timeout=60)) == [2.0] * 4
    request = _request()
    request.raw_input_contents.extend([b"\0" * 16] * 60)  # more top-level fields than max_request_fields (50)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, metadata=_md(FLOOD), timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_request_fields" in caught.value.details()
    assert _metric(fleet["gateway"], "modeld_gateway_breaker_state", node=fleet["node"].address) == 0


def test_a_node_without_the_fleet_token_is_never_admitted(fleet):
    gateway, node, stranger = fleet["gateway"], fleet["node"], fleet["stranger"]
    wait_until(lambda: any(e.get("address") == stranger.address for e in gateway.events("node_not_admitted")),
               30, "the gateway to refuse the stranger")
    assert _metric(gateway, "modeld_gateway_node_admitted", node=node.address) == 1
    assert _metric(gateway, "modeld_gateway_node_admitted", node=stranger.address) == 0
    assert _metric(gateway, "modeld_gateway_node_serving", node=stranger.address) == 0
    reason = next(e for e in gateway.events("node_not_admitted") if e.get("address") == stranger.address)["reason"]
    assert "fleet=yes" in reason and GATEWAY not in reason
    # the stranger never saw the gateway's token: it got no call that carries one
    time.sleep(0)  # its log is read as it stands
    assert not stranger.events("call_refused") or all(
        e.get("method", "").startswith("/grpc.health") for e in stranger.events("call_refused"))
    assert _metric(gateway, "modeld_gateway_picks_total", node=stranger.address) == 0


def test_the_gateway_rereads_its_client_tokens_on_sighup(fleet):
    import signal

    stub, folder, gateway = fleet["stub"], fleet["folder"], fleet["gateway"]
    late = "late-" + secrets.token_urlsafe(24)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=_md(late), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (folder / "clients.txt").write_text(CLIENT_LINES + f"{late} infer tenant=late\n")
    gateway.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: gateway.events("auth_tokens_reloaded"), 30, "the gateway to reread its tokens")
    # the node has no such token: the gateway lets the call through, and the node judges it
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_request(), metadata=_md(late), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not valid on this daemon" in caught.value.details()
    assert _metric(gateway, "modeld_tenant_requests_total", tenant="late") == 1
