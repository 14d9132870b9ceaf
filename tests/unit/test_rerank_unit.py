"""Rerank models without sockets: the config, a request as rows of pairs and
its answer in order, and both scorers through the engine and its dynamic
batcher, checked against the same graphs run directly with onnxruntime."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import onnx_fixtures
from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import ModelKind, config_from_dict, config_from_json
from modeld.backends.registry import BackendRegistry
from modeld.server.engine import Engine
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.repository import ModelRepository
from modeld.server.requests import InferRequest
from modeld.server.rerank import RerankCall, plan_rerank

QUERY = "where is the cat"
DOCUMENTS = ["the dog runs in the park", "the cat sits on the mat", "paris is the capital of france",
             "a cat sleeps on a rug", "the fish eats", "where is the cat"]


def _bytes(*texts: str) -> np.ndarray:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return array


def _request(model: str = "ce", query=(QUERY,), documents=tuple(DOCUMENTS), **parameters) -> InferRequest:
    inputs = {}
    if query is not None:
        inputs["query"] = _bytes(*query)
    if documents is not None:
        inputs["documents"] = _bytes(*documents)
    return InferRequest(model, inputs, parameters=parameters)


# -- config ------------------------------------------------------------------------------


def test_a_rerank_model_is_a_kind_with_its_own_table():
    bi = config_from_dict("r", {"kind": "rerank", "rerank": {"embedding_model": "minilm"}})
    assert bi.kind is ModelKind.RERANK and bi.rerank.is_bi_encoder and bi.rerank.embedding_model == "minilm"
    cross = config_from_dict("c", {"kind": "rerank", "text": {"tokenizer": "tokenizer.json"}})
    assert cross.kind is ModelKind.RERANK and not cross.rerank.is_bi_encoder
    assert config_from_dict("t", {}).kind is ModelKind.TENSOR
    inline = config_from_json("j", json.dumps({"platform": "onnxruntime_onnx", "max_batch_size": 8, "kind": "rerank",
                                               "text": {"tokenizer": "tokenizer.json"}}))
    assert inline.kind is ModelKind.RERANK and inline.max_batch_size == 8


@pytest.mark.parametrize("raw, reason", [
    ({"kind": "ranker"}, "kind must be one of tensor, rerank"),
    ({"rerank": {"embedding_model": "minilm"}}, 'belongs to kind = "rerank"'),
    ({"kind": "rerank"}, "needs a [text] table"),
    ({"kind": "rerank", "rerank": {"embedding_model": "minilm", "pooling": "mean"}}, "unknown config key rerank.pooling"),
    ({"kind": "rerank", "rerank": {"embedding_model": "r"}}, "must name another model"),
    ({"kind": "rerank", "rerank": {"embedding_model": "../x"}}, "must name another model"),
    ({"kind": "rerank", "rerank": {"embedding_model": "minilm"}, "text": {"tokenizer": "t.json"}}, "remove 'text'"),
    ({"kind": "rerank", "rerank": {"embedding_model": "minilm"}, "artifact": "m.onnx"}, "remove 'artifact'"),
    ({"kind": "rerank", "format": "gguf", "text": {"tokenizer": "t.json"}}, "is an ONNX graph"),
])
def test_bad_rerank_configs_are_refused_naming_the_key(raw, reason):
    with pytest.raises(InvalidArgument) as caught:
        config_from_dict("r", raw)
    assert reason in str(caught.value)


# -- a request as rows, its answer in order ------------------------------------------------


def _config(max_batch_size: int = 4, max_queue_size: int = 1024):
    return config_from_dict("ce", {"kind": "rerank", "text": {"tokenizer": "tokenizer.json"},
                                   "batching": {"max_batch_size": max_batch_size, "max_queue_size": max_queue_size}})


def test_documents_become_rows_of_pairs_cut_at_max_batch_size():
    call = plan_rerank(_request(), _config(max_batch_size=4))
    assert [piece["documents"].tolist() for piece in call.pieces] == [
        [d.encode() for d in DOCUMENTS[:4]], [d.encode() for d in DOCUMENTS[4:]]]
    for piece in call.pieces:
        assert piece["query"].tolist() == [QUERY.encode()] * piece["documents"].shape[0]
        assert list(piece) == ["query", "documents"]  # one merge key for every rerank request


async def test_pieces_run_side_by_side_and_answer_in_document_order():
    call = plan_rerank(_request(), _config(max_batch_size=4))
    seen = []

    async def submit(rows, output_names, priority):
        seen.append((len(rows["documents"]), output_names))
        await asyncio.sleep(0.01 if len(seen) == 1 else 0)  # the first piece finishes last
        return {"scores": np.array([float(len(d)) for d in rows["documents"]], dtype=np.float32)}

    outputs = await call.run(submit)
    assert seen == [(4, ("scores",)), (2, ("scores",))]
    np.testing.assert_array_equal(outputs["scores"], [len(d) for d in DOCUMENTS])
    np.testing.assert_array_equal(outputs["indices"], np.arange(len(DOCUMENTS)))


def test_sort_puts_the_highest_first_and_top_n_keeps_the_best():
    scores = np.array([0.1, 0.9, -0.5, 0.9, 0.3], dtype=np.float32)
    plain = RerankCall((), (), is_sorted=False, top_n=None).answer(scores)
    np.testing.assert_array_equal(plain["scores"], scores)
    ranked = RerankCall((), (), is_sorted=True, top_n=None).answer(scores)
    np.testing.assert_array_equal(ranked["indices"], [1, 3, 4, 0, 2])  # ties keep the documents' order
    np.testing.assert_array_equal(ranked["scores"], scores[[1, 3, 4, 0, 2]])
    best = RerankCall((), ("indices",), is_sorted=True, top_n=2).answer(scores)
    assert list(best) == ["indices"] and best["indices"].dtype == np.int64
    np.testing.assert_array_equal(best["indices"], [1, 3])


def test_sort_and_top_n_parameters():
    assert plan_rerank(_request(), _config()).is_sorted is False
    call = plan_rerank(_request(sort=True), _config())
    assert call.is_sorted and call.top_n is None
    call = plan_rerank(_request(top_n=2), _config())
    assert call.is_sorted and call.top_n == 2
    assert plan_rerank(_request(top_n=100), _config()).top_n == len(DOCUMENTS)


@pytest.mark.parametrize("request_, reason", [
    (_request(query=None), "needs input 'query'"),
    (_request(documents=None), "needs input 'documents'"),
    (_request(documents=()), "'documents' of model 'ce' is empty"),
    (_request(query=(QUERY, QUERY)), "must have shape [1]"),
    (_request(query=("",)), "empty string"),
    (InferRequest("ce", {"query": _bytes(QUERY), "documents": np.array([1.0], dtype=np.float32)}),
     "'documents' of model 'ce' must be BYTES, got FP32"),
    (InferRequest("ce", {"query": _bytes(QUERY), "documents": _bytes("a", "b").reshape(1, 2)}),
     "must have shape [n], got [1, 2]"),
    (InferRequest("ce", {"query": _bytes(QUERY), "documents": _bytes("a"), "text": _bytes("a")}),
     "has no input 'text'"),
    (InferRequest("ce", {"query": _bytes(QUERY), "documents": np.array([b"\xff\xfe"], dtype=object)}),
     "documents[0] is not valid UTF-8"),
    (InferRequest("ce", {"query": _bytes(QUERY), "documents": _bytes("a")}, output_names=("score",)),
     "has no output 'score'"),
    (_request(sort="yes"), "sort must be true or false"),
    (_request(top_n=0), "top_n must be an integer >= 1"),
    (_request(top_n=True), "top_n must be an integer >= 1"),
    (_request(top_n=2, sort=False), "not false"),
])
def test_bad_requests_are_invalid_argument_with_the_reason(request_, reason):
    with pytest.raises(InvalidArgument) as caught:
        plan_rerank(request_, _config())
    assert reason in str(caught.value)


def test_more_pieces_than_the_queue_holds_is_refused_up_front():
    with pytest.raises(InvalidArgument, match="send fewer documents"):
        plan_rerank(_request(), _config(max_batch_size=1, max_queue_size=3))


def test_other_models_refuse_the_rerank_parameters():
    plain = config_from_dict("m", {})
    assert plan_rerank(InferRequest("m", {"x": np.zeros(1)}), plain) is None
    with pytest.raises(InvalidArgument, match="'sort' is for rerank models; model 'm' is not one"):
        plan_rerank(InferRequest("m", {"x": np.zeros(1)}, parameters={"sort": True}), plain)


# -- through the engine: both scorers against the graphs run directly ----------------------


def _engine(tmp_path: Path, root: Path | None = None) -> Engine:
    registry = BackendRegistry(["onnx", "reference"])
    return Engine(ModelRepository(root, tmp_path / "inline"), registry, MemoryManager(2**31), Metrics())


def _cross_encoder(engine: Engine, backend: str = "onnx", delay_us: int = 0):
    body = {"kind": "rerank", "backends": [backend], "text": {"tokenizer": "tokenizer.json", "max_length": 64},
            "batching": {"max_batch_size": 64, "max_queue_delay_us": delay_us}}
    files = {"file:model.onnx": onnx_fixtures.cross_encoder(),
             "file:tokenizer.json": onnx_fixtures.cross_encoder_tokenizer().encode()}
    return engine.repository.add_inline("ce", json.dumps(body), files)


@pytest.mark.parametrize("backend", ["onnx", "reference"])
async def test_cross_encoder_order_matches_the_graph_run_directly(backend, tmp_path):
    engine = _engine(tmp_path)
    served = await engine.load("ce", _cross_encoder(engine, backend))
    assert [t.name for t in served.loaded.inputs] == ["query", "documents"]
    assert [(t.name, t.datatype) for t in served.loaded.outputs] == [("scores", "FP32"), ("indices", "INT64")]
    expected = onnx_fixtures.cross_encoder_scores(QUERY, DOCUMENTS)
    result = await engine.infer(_request(sort=True))
    np.testing.assert_array_equal(result.outputs["indices"], np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(result.outputs["scores"], np.sort(expected)[::-1], rtol=1e-5, atol=1e-5)
    top = await engine.infer(_request(top_n=2))
    np.testing.assert_array_equal(top.outputs["indices"], np.argsort(-expected, kind="stable")[:2])
    await engine.stop()


async def test_concurrent_rerank_calls_share_batches(tmp_path):
    engine = _engine(tmp_path)
    await engine.load("ce", _cross_encoder(engine, delay_us=20_000))
    queries = [f"where is the {w}" for w in ("cat", "dog", "fish", "city") * 8]  # 32 callers, 4 documents each
    results = await asyncio.gather(*(engine.infer(_request(query=(q,), documents=DOCUMENTS[:4])) for q in queries))
    for query, result in zip(queries, results):
        np.testing.assert_allclose(result.outputs["scores"], onnx_fixtures.cross_encoder_scores(query, DOCUMENTS[:4]),
                                   rtol=1e-5, atol=1e-5)
    stats = engine.stats("ce")
    assert max(stats.batches) > 4, f"every request ran alone: batch sizes {sorted(stats.batches)}"
    assert stats.execution_count < len(queries)
    await engine.stop()


def _embedding_repository(root: Path) -> None:
    (root / "words").mkdir(parents=True)
    (root / "words" / "model.onnx").write_bytes(onnx_fixtures.word_embedder())
    (root / "words" / "tokenizer.json").write_text(onnx_fixtures.cross_encoder_tokenizer())
    (root / "words" / "model.toml").write_text('[text]\ntokenizer = "tokenizer.json"\n[batching]\nmax_batch_size = 8\n')
    (root / "r").mkdir()
    (root / "r" / "model.toml").write_text('kind = "rerank"\n[rerank]\nembedding_model = "words"\n'
                                           '[batching]\nmax_batch_size = 4\n')


async def test_bi_encoder_scores_are_cosines_of_the_embedding_models_vectors(tmp_path):
    root = tmp_path / "repo"
    _embedding_repository(root)
    engine = _engine(tmp_path, root)
    served = await engine.load("r")
    assert served.backend.name == "onnx"
    vectors = (await engine.infer(InferRequest("words", {"text": _bytes(QUERY, *DOCUMENTS)}))).outputs["embedding"]
    q, d = vectors[0], vectors[1:]
    expected = d @ q / (np.linalg.norm(d, axis=1) * np.linalg.norm(q))  # the word embedder is not normalised
    result = await engine.infer(InferRequest("r", {"query": _bytes(QUERY), "documents": _bytes(*DOCUMENTS)},
                                             parameters={"sort": True}))
    np.testing.assert_array_equal(result.outputs["indices"], np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(result.outputs["scores"], np.sort(expected)[::-1], rtol=1e-5, atol=1e-6)
    assert result.outputs["scores"][0] == pytest.approx(1.0, abs=1e-5)  # the document equal to the query
    await engine.stop()


@pytest.mark.parametrize("embedding_model, reason", [
    ("nowhere", "'nowhere' is not in the repository"),
    ("plain", "must be a text embedding model"),
])
async def test_a_bi_encoder_needs_a_text_embedding_model(embedding_model, reason, tmp_path):
    root = tmp_path / "repo"
    _embedding_repository(root)
    (root / "plain").mkdir()
    (root / "plain" / "model.onnx").write_bytes(onnx_fixtures.double_int64())
    (root / "plain" / "model.toml").write_text("")
    (root / "bad").mkdir()
    (root / "bad" / "model.toml").write_text(f'kind = "rerank"\n[rerank]\nembedding_model = "{embedding_model}"\n')
    engine = _engine(tmp_path, root)
    with pytest.raises(InvalidArgument) as caught:
        await engine.load("bad")
    assert reason in str(caught.value)
