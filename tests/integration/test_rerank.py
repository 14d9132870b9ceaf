"""Reranking on a real daemon: the embedded `rerank` (cosine of minilm
embeddings) checked against minilm's own vectors from the same daemon, a
cross-encoder loaded inline checked against its graph run directly, over
KServe gRPC (tritonclient), KServe REST and /v1/rerank, with concurrent
calls sharing batches and bad input refused with the reason."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca

import onnx_fixtures
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc

QUERY = "What is the capital of France?"
DOCUMENTS = ["The cat sits on the mat.", "Paris is the capital and largest city of France.",
             "Berlin is the capital of Germany.", "France is a country in Europe.",
             "Ünïcödé text works too ✓", "The Seine flows through Paris."]


def _bytes_input(name: str, texts: list[str]) -> tc.InferInput:
    tensor = tc.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def _rerank(client, model: str, query: str, documents: list[str], **parameters):
    result = client.infer(model, [_bytes_input("query", [query]), _bytes_input("documents", documents)],
                          parameters=parameters or None)
    return result.as_numpy("scores"), result.as_numpy("indices")


@pytest.fixture(scope="module")
def cosines(daemon):
    """What the default rerank must answer: minilm's own vectors, from the same daemon, compared in numpy."""
    client = tc.InferenceServerClient(daemon.address)
    vectors = client.infer("minilm", [_bytes_input("text", [QUERY, *DOCUMENTS])]).as_numpy("embedding")
    client.close()
    q, d = vectors[0].astype(np.float64), vectors[1:].astype(np.float64)
    return d @ q / (np.linalg.norm(d, axis=1) * np.linalg.norm(q))


@pytest.fixture
def raw(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=120) as client:
        yield client


def test_default_rerank_is_minilm_cosine_in_document_order_or_highest_first(triton, cosines):
    scores, indices = _rerank(triton, "rerank", QUERY, DOCUMENTS)
    assert scores.dtype == np.float32 and indices.dtype == np.int64
    np.testing.assert_allclose(scores, cosines, atol=1e-5)
    np.testing.assert_array_equal(indices, np.arange(len(DOCUMENTS)))
    scores, indices = _rerank(triton, "rerank", QUERY, DOCUMENTS, sort=True)
    np.testing.assert_array_equal(indices, np.argsort(-cosines, kind="stable"))
    np.testing.assert_allclose(scores, cosines[indices], atol=1e-5)
    assert DOCUMENTS[indices[0]].startswith("Paris is the capital")
    scores, indices = _rerank(triton, "rerank", QUERY, DOCUMENTS, top_n=2)
    np.testing.assert_array_equal(indices, np.argsort(-cosines, kind="stable")[:2])


def test_metadata_shows_the_rerank_signature(triton):
    meta = triton.get_model_metadata("rerank", as_json=True)
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("query", "BYTES", ["1"]), ("documents", "BYTES", ["-1"])]
    assert [(t["name"], t["datatype"]) for t in meta["outputs"]] == [("scores", "FP32"), ("indices", "INT64")]


def test_kserve_rest_takes_sort_and_top_n_as_parameters(raw, cosines):
    body = {"parameters": {"sort": True, "top_n": 3}, "inputs": [
        {"name": "query", "datatype": "BYTES", "shape": [1], "data": [QUERY]},
        {"name": "documents", "datatype": "BYTES", "shape": [len(DOCUMENTS)], "data": DOCUMENTS}]}
    response = raw.post("/v2/models/rerank/infer", json=body)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    expected = np.argsort(-cosines, kind="stable")[:3]
    assert outputs["indices"]["data"] == expected.tolist() and outputs["indices"]["datatype"] == "INT64"
    np.testing.assert_allclose(outputs["scores"]["data"], cosines[expected], atol=1e-5)


def test_v1_rerank_answers_as_cohere_jina_and_infinity_do(raw, cosines):
    response = raw.post("/v1/rerank", json={"model": "rerank", "query": QUERY, "documents": DOCUMENTS,
                                            "top_n": 3, "return_documents": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "rerank" and body["model"] == "rerank" and body["id"].startswith("rerank-")
    expected = np.argsort(-cosines, kind="stable")[:3]
    assert [r["index"] for r in body["results"]] == expected.tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], cosines[expected], atol=1e-5)
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[i]} for i in expected]
    # documents as objects (Cohere v1, Jina); every document, and no text back, by default
    response = raw.post("/v1/rerank", json={"model": "rerank", "query": QUERY,
                                            "documents": [{"text": d} for d in DOCUMENTS]})
    results = response.json()["results"]
    assert [r["index"] for r in results] == np.argsort(-cosines, kind="stable").tolist()
    assert all("document" not in r for r in results)


@pytest.mark.parametrize("body, status, param, reason", [
    ({"model": "rerank", "documents": DOCUMENTS}, 400, "query", "query must be a non-empty string"),
    ({"model": "rerank", "query": QUERY, "documents": []}, 400, "documents", "non-empty array"),
    ({"model": "rerank", "query": QUERY, "documents": [1]}, 400, "documents[0]", "must be a string"),
    ({"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 0}, 400, "top_n", "top_n must be >= 1"),
    ({"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "rank_fields": ["text"]}, 400, "rank_fields",
     "does not support the field 'rank_fields'"),
    ({"model": "minilm", "query": QUERY, "documents": DOCUMENTS}, 400, "model", "is not a rerank model"),
    ({"model": "nope", "query": QUERY, "documents": DOCUMENTS}, 404, None, "unknown model 'nope'"),
])
def test_v1_rerank_refuses_bad_requests_naming_the_field(raw, body, status, param, reason):
    response = raw.post("/v1/rerank", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"]


def _request(model="rerank", query=(QUERY,), documents=tuple(DOCUMENTS), datatype="BYTES", **parameters):
    request = pb.ModelInferRequest(model_name=model)
    for name, values in (("query", query), ("documents", documents)):
        if values is None:
            continue
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[len(values)])
        if datatype == "BYTES":
            tensor.contents.bytes_contents.extend(v.encode() for v in values)
        else:
            tensor.contents.fp32_contents.extend(float(i) for i, _ in enumerate(values))
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        else:
            request.parameters[key].int64_param = value
    return request


@pytest.mark.parametrize("request_, reason", [
    (_request(query=None), "needs input 'query'"),
    (_request(documents=()), "'documents' of model 'rerank' is empty"),
    (_request(query=(QUERY, QUERY)), "must have shape [1]"),
    (_request(datatype="FP32"), "must be BYTES, got FP32"),
    (_request(top_n=0), "top_n must be an integer >= 1"),
    (_request(model="minilm", sort=True), "'sort' is for rerank models; model 'minilm' is not one"),
])
def test_bad_input_is_invalid_argument_with_the_reason(daemon, request_, reason):
    with grpc.insecure_channel(daemon.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request_, timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()


def test_a_request_longer_than_max_batch_size_is_cut_and_put_back_together(triton, cosines):
    documents = DOCUMENTS * 12  # 72 documents; the model's max_batch_size is 64
    scores, indices = _rerank(triton, "rerank", QUERY, documents)
    np.testing.assert_allclose(scores, np.tile(cosines, 12), atol=1e-5)
    np.testing.assert_array_equal(indices, np.arange(len(documents)))


async def _concurrent(address: str, model: str, queries: list[str], documents: list[str]) -> list[np.ndarray]:
    client = tca.InferenceServerClient(address)
    try:
        results = await asyncio.gather(*(
            client.infer(model, [_bytes_input("query", [q]), _bytes_input("documents", documents)])
            for q in queries))
    finally:
        await client.close()
    return [r.as_numpy("scores") for r in results]


def _executions(client, model: str) -> int:
    return int(client.get_inference_statistics(model, as_json=True)["model_stats"][0].get("execution_count", 0))


async def test_32_concurrent_rerank_calls_share_batches(daemon, triton):
    before = _executions(triton, "rerank")
    queries = [f"{w} question number {i}" for i, w in enumerate(["capital", "cat", "river", "Europe"] * 8)]
    scores = await _concurrent(daemon.address, "rerank", queries, DOCUMENTS[:4])
    assert all(s.shape == (4,) for s in scores)
    assert _executions(triton, "rerank") - before < len(queries), "each call ran alone"


async def test_a_cross_encoder_loaded_inline_ranks_as_its_graph_does(daemon, triton):
    config = {"kind": "rerank", "backends": ["onnx"], "text": {"tokenizer": "tokenizer.json", "max_length": 64},
              "batching": {"max_batch_size": 64, "max_queue_delay_us": 20_000}}
    files = {"file:model.onnx": onnx_fixtures.cross_encoder(),
             "file:tokenizer.json": onnx_fixtures.cross_encoder_tokenizer().encode()}
    triton.load_model("rerank-ce", config=json.dumps(config), files=files)
    try:
        query, documents = "where is the cat", ["the dog runs in the park", "the cat sits on the mat",
                                                "paris is the capital of france", "a cat sleeps on a rug"]
        expected = onnx_fixtures.cross_encoder_scores(query, documents)
        scores, indices = _rerank(triton, "rerank-ce", query, documents, sort=True)
        np.testing.assert_array_equal(indices, np.argsort(-expected, kind="stable"))
        np.testing.assert_allclose(scores, expected[indices], rtol=1e-5, atol=1e-5)
        queries = [f"where is the {w}" for w in ("cat", "dog", "river", "city") * 8]
        many = await _concurrent(daemon.address, "rerank-ce", queries, documents)
        for q, s in zip(queries, many):
            np.testing.assert_allclose(s, onnx_fixtures.cross_encoder_scores(q, documents), rtol=1e-5, atol=1e-5)
        stats = triton.get_inference_statistics("rerank-ce", as_json=True)["model_stats"][0]
        assert max(int(b["batch_size"]) for b in stats["batch_stats"]) > len(documents)
    finally:
        triton.unload_model("rerank-ce")

