"""Per-tenant quotas on a real daemon, over both fronts: a tenant over its
rate gets 429 with Retry-After (HTTP) or RESOURCE_EXHAUSTED with a
retry-after trailer (gRPC) while another tenant is unaffected; generated
tokens per minute are charged as a generation streams; a model outside a
tenant's list is 403 / PERMISSION_DENIED; a priority above the default
from a tenant without the right is clamped; per-tenant metrics count it all.

Rates are set so low (one call per thousand seconds after a small burst)
that the refill during a test is nothing: the test never races the clock.
"""

from __future__ import annotations

import secrets

import grpc
import httpx
import numpy as np
import pytest

import onnx_fixtures
from daemon import add_small_smollm2, start_daemon
from daemon import metric_sum as _metric
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc

SLOW = "slow-" + secrets.token_urlsafe(24)      # tenant alpha: a burst of 3 calls, then one per 1000 s
SLOW_GRPC = "grpc-" + secrets.token_urlsafe(24)  # tenant delta: the same over gRPC
OTHER = "other-" + secrets.token_urlsafe(24)    # tenant beta: 1000 calls per second
METERED = "meter-" + secrets.token_urlsafe(24)  # tenant gamma: smollm2 only, 1 generated token per minute
PLAIN = "plain-" + secrets.token_urlsafe(24)    # no tenant: no limits, as before tenants
NARROW = "narrow-" + secrets.token_urlsafe(24)  # tenant epsilon: model plus only, no quotas
MODEL = "plus"




@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "tokens.txt").write_text(
        f"{SLOW} infer tenant=alpha rps=0.001 burst=3\n"
        f"{SLOW_GRPC} infer tenant=delta rps=0.001 burst=2\n"
        f"{OTHER} infer tenant=beta rps=1000 burst=1000\n"
        f"{METERED} infer tenant=gamma models=smollm2,{MODEL} tokens_per_minute=1\n"
        f"{NARROW} infer tenant=epsilon models={MODEL}\n"
        f"{PLAIN} admin\n")
    repo = tmp_path_factory.mktemp("repo")
    (repo / MODEL).mkdir()
    (repo / MODEL / "model.onnx").write_bytes(onnx_fixtures.add_fp32())
    (repo / MODEL / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
    add_small_smollm2(repo, n_ctx=1024, n_slots=2, context_length=512)
    process = start_daemon("--auth-token-file", str(folder / "tokens.txt"), repository=repo)
    yield process
    process.stop()


def _bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


def _grpc_md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_another_is_unaffected(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=30) as http:
        for _ in range(3):
            assert http.get("/v1/models", headers=_bearer(SLOW)).status_code == 200
        refused = http.get("/v1/models", headers=_bearer(SLOW))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert "alpha" in refused.json()["error"]["message"] and "calls per second" in refused.json()["error"]["message"]
        # KServe's shape on /v2
        refused = http.get(f"/v2/models/{MODEL}", headers=_bearer(SLOW))
        assert refused.status_code == 429 and "retry-after" in refused.headers and "error" in refused.json()
        for _ in range(20):
            assert http.get("/v1/models", headers=_bearer(OTHER)).status_code == 200
            assert http.get("/v1/models", headers=_bearer(PLAIN)).status_code == 200
    assert _metric(daemon, "modeld_tenant_refusals_total", tenant="alpha", reason="rate") == 2
    assert _metric(daemon, "modeld_tenant_requests_total", tenant="alpha") == 3
    assert _metric(daemon, "modeld_tenant_refusals_total", tenant="beta") == 0


def test_a_grpc_tenant_over_its_rate_gets_resource_exhausted_with_a_retry_after_trailer(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(2):
            stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=_grpc_md(SLOW_GRPC), timeout=30)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=_grpc_md(SLOW_GRPC), timeout=30)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(caught.value.trailing_metadata())
        assert int(trailers["retry-after"]) >= 1 and "delta" in caught.value.details()
        request = pb.ModelInferRequest(model_name=MODEL, inputs=[pb.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=[1, 4])], raw_input_contents=[np.ones((1, 4), np.float32).tobytes()])
        for _ in range(10):  # the other tenant's calls still pass
            reply = stub.ModelInfer(request, metadata=_grpc_md(OTHER), timeout=60)
            assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [2.0] * 4


def test_a_model_outside_the_tenant_s_list_is_refused_on_both_fronts(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=30) as http:
        refused = http.post("/v1/embeddings", headers=_bearer(METERED), json={"model": "minilm", "input": "hi"})
        assert refused.status_code == 403 and "may not use model 'minilm'" in refused.json()["error"]["message"]
        assert http.get("/v2/models/minilm", headers=_bearer(METERED)).status_code == 403
        assert http.get(f"/v2/models/{MODEL}", headers=_bearer(METERED)).status_code == 200
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelMetadata(pb.ModelMetadataRequest(name="minilm"), metadata=_grpc_md(METERED), timeout=30)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as caught:
            gg.GenerationStub(channel).Tokenize(g.TokenizeRequest(model="minilm", text="x"),
                                                metadata=_grpc_md(METERED), timeout=30)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _metric(daemon, "modeld_tenant_refusals_total", tenant="gamma", reason="model") == 4


def test_priority_above_the_default_is_clamped_for_a_tenant_without_the_right(daemon):
    request = pb.ModelInferRequest(model_name=MODEL, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[1, 4])], raw_input_contents=[np.ones((1, 4), np.float32).tobytes()])
    request.parameters["priority"].uint64_param = 1
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(request, metadata=_grpc_md(METERED), timeout=60)  # served, at the default level
        assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
        stub.ModelInfer(request, metadata=_grpc_md(PLAIN), timeout=60)  # no tenant: its level stands
    assert _metric(daemon, "modeld_tenant_refusals_total", tenant="gamma", reason="priority_clamped") == 1


def test_generated_tokens_per_minute_are_charged_as_they_stream(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        stub = gg.GenerationStub(channel)
        request = g.GenerateRequest(model="smollm2", prompt="The capital of France is",
                                    sampling=g.SamplingParams(max_tokens=4, temperature=0.0))
        replies = list(stub.Generate(request, metadata=_grpc_md(METERED), timeout=120))
        generated = sum(len(r.token_ids) for r in replies)
        assert generated >= 1
        # the bucket of 1 token per minute is now overdrawn: the next call waits for it
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, metadata=_grpc_md(METERED), timeout=120))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(caught.value.trailing_metadata())["retry-after"]) >= 60 * (generated - 1)
        assert "tokens per minute" in caught.value.details()
        # another tenant generates as before
        assert list(stub.Generate(request, metadata=_grpc_md(PLAIN), timeout=120))[-1].finish_reason
    with httpx.Client(base_url=daemon.http_url, timeout=30) as http:
        refused = http.post("/v1/completions", headers=_bearer(METERED),
                            json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert _metric(daemon, "modeld_tenant_generated_tokens_total", tenant="gamma") == generated
    assert _metric(daemon, "modeld_tenant_refusals_total", tenant="gamma", reason="tokens_per_minute") == 2


def test_each_message_of_a_stream_is_checked_against_the_tenant_s_models(daemon):
    def requests(names):
        for name in names:
            yield pb.ModelInferRequest(model_name=name, inputs=[pb.ModelInferRequest.InferInputTensor(
                name="x", datatype="FP32", shape=[1, 4])], raw_input_contents=[np.ones((1, 4), np.float32).tobytes()])

    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        replies = list(stub.ModelStreamInfer(requests([MODEL, MODEL]), metadata=_grpc_md(NARROW), timeout=60))
        assert [r.error_message for r in replies] == ["", ""]
        assert [np.frombuffer(r.infer_response.raw_output_contents[0], np.float32).tolist() for r in replies] == \
            [[2.0] * 4] * 2
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ModelStreamInfer(requests([MODEL, "minilm"]), metadata=_grpc_md(NARROW), timeout=60))
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
