"""The KServe v2 protocol through the stock tritonclient against a real daemon."""

from __future__ import annotations

import json
import queue
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc

SENTENCES = ["The cat sits on the mat.", "modeld serves many models from one process.", "Ünïcödé text works too ✓"]


def _bytes_input(name, values):
    tensor = tc.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=object))
    return tensor


def _array_input(name, array, datatype):
    tensor = tc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_server_live_ready_and_metadata(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()
    meta = triton.get_server_metadata()
    assert meta.name == "modeld"
    assert "model_repository" in meta.extensions and "statistics" in meta.extensions


def test_model_metadata_describes_the_text_signature(triton):
    triton.load_model("minilm")  # a no-op when it is loaded already
    meta = triton.get_model_metadata("minilm")
    assert meta.versions == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("text", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("embedding", "FP32", [-1, 384])]
    assert triton.is_model_ready("minilm") and triton.is_model_ready("minilm", "1")


def test_bytes_in_fp32_out_matches_sentence_transformers(triton):
    from sentence_transformers import SentenceTransformer

    from modeld.server.prepare import minilm_source_dir

    result = triton.infer("minilm", [_bytes_input("text", SENTENCES)], request_id="req-7")
    got = result.as_numpy("embedding")
    assert got.shape == (3, 384) and got.dtype == np.float32
    assert result.get_response().id == "req-7"
    expected = SentenceTransformer(str(minilm_source_dir()), device="cpu").encode(SENTENCES)
    cosine = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.999, cosine


def test_inline_triton_config_int64_model_load_infer_unload(triton):
    config = onnx_fixtures.triton_config("double", [("x", "INT64", [3])], [("y", "INT64", [3])])
    triton.load_model("double", config=json.dumps(config), files={"file:1/model.onnx": onnx_fixtures.double_int64()})
    assert triton.is_model_ready("double")
    x = np.array([[1, -2, 3], [40, 50, 2**40]], dtype=np.int64)
    result = triton.infer("double", [_array_input("x", x, "INT64")])
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    index = {m.name: m.state for m in triton.get_model_repository_index().models}
    assert index["double"] == "READY"
    triton.unload_model("double")
    assert not triton.is_model_ready("double")
    with pytest.raises(InferenceServerException) as err:
        triton.infer("double", [_array_input("x", x, "INT64")])
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_fp32_model_onnxruntime_refuses_is_served_by_reference(triton, daemon):
    x = np.array([[0.0, 1.0, -1.0, 3.0]], dtype=np.float32)
    y = triton.infer("softcap_demo", [_array_input("x", x, "FP32")]).as_numpy("y")
    w = np.arange(16, dtype=np.float32).reshape(4, 4) / 8.0
    b = np.array([0.5, -0.5, 1.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(y, 2.0 * np.tanh((x @ w + b) / 2.0), rtol=1e-6)
    assert triton.get_model_metadata("softcap_demo").platform == "modeld_reference"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    assert 'modeld_backend_fallbacks_total{from_backend="onnx",model="softcap_demo",stage="load"} 1.0' in metrics


def test_typed_contents_and_the_parameters_a_tensor_model_understands_are_accepted(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="softcap_demo", id="typed")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend([0.0, 0.0, 0.0, 0.0])
        request.parameters["priority"].uint64_param = 2
        request.parameters["timeout"].int64_param = 30_000_000
        response = stub.ModelInfer(request, timeout=30)
        # anything else would be ignored silently, so it is refused
        for kind, value in (("bool_param", True), ("int64_param", -3), ("string_param", "x"),
                            ("double_param", 0.5), ("uint64_param", 2**63)):
            request.parameters.clear()
            setattr(request.parameters["custom"], kind, value)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(request, timeout=30)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "custom" in err.value.details()
    assert response.id == "typed"
    y = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    np.testing.assert_allclose(y, 2.0 * np.tanh(np.array([0.5, -0.5, 1.0, -1.0]) / 2.0), rtol=1e-6)


def test_tritonclient_priority_and_timeout_are_honoured_and_unknown_parameters_refused(triton):
    result = triton.infer("minilm", [_bytes_input("text", ["hi"])], priority=3, timeout=30_000_000)
    assert result.as_numpy("embedding").shape == (1, 384)
    with pytest.raises(InferenceServerException) as err:
        triton.infer("minilm", [_bytes_input("text", ["hi"])], parameters={"s": "v"})
    assert "INVALID_ARGUMENT" in str(err.value.status()) and "'s'" in err.value.message()


def test_stream_infer_answers_each_request_and_isolates_errors(triton):
    answers: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        triton.async_stream_infer("minilm", [_bytes_input("text", ["one"])], request_id="a")
        triton.async_stream_infer("minilm", [_bytes_input("wrong_name", ["two"])], request_id="bad")
        triton.async_stream_infer("minilm", [_bytes_input("text", ["three", "four"])], request_id="b")
        got = [answers.get(timeout=30) for _ in range(3)]
    finally:
        triton.stop_stream()
    ok = {r.get_response().id: r.as_numpy("embedding").shape for r, e in got if e is None}
    errors = [e for r, e in got if e is not None]
    assert ok == {"a": (1, 384), "b": (2, 384)}
    assert len(errors) == 1 and "wrong_name" in str(errors[0]) and "INVALID_ARGUMENT" in str(errors[0])


def test_statistics_count_inferences_and_batches(triton):
    before = triton.get_inference_statistics("minilm").model_stats[0]
    for _ in range(3):
        triton.infer("minilm", [_bytes_input("text", ["a", "b"])])
    after = triton.get_inference_statistics("minilm").model_stats[0]
    assert after.name == "minilm" and after.version == "1"
    assert after.inference_count - before.inference_count == 6
    assert after.execution_count - before.execution_count == 3
    assert after.inference_stats.success.count - before.inference_stats.success.count == 3
    assert any(b.batch_size == 2 for b in after.batch_stats)
    assert after.last_inference > 0
    everything = triton.get_inference_statistics()
    assert {"minilm", "softcap_demo"} <= {s.name for s in everything.model_stats}
