"""Every row of DESIGN.md's error table through the real daemon.

Each bad request gets its status and a message naming what to change; the
daemon keeps serving and already loaded models are undisturbed.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

import onnx_fixtures
from daemon import start_daemon
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc


@pytest.fixture
def stub(daemon):
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 2**31 - 1)]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _fp32_request(model="softcap_demo", shape=(1, 4), raw=None, name="x", datatype="FP32", version=""):
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    request.inputs.add(name=name, datatype=datatype, shape=list(shape))
    request.raw_input_contents.append(raw if raw is not None else np.zeros(shape, np.float32).tobytes())
    return request


@pytest.fixture(autouse=True)
def still_serving(triton):
    """After every bad request, the loaded models still answer correctly."""
    for name in ("minilm", "softcap_demo"):
        triton.load_model(name)  # a no-op when it is loaded already
    yield
    text = tc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"still here"], dtype=object))
    assert triton.infer("minilm", [text]).as_numpy("embedding").shape == (1, 384)
    assert triton.is_model_ready("softcap_demo")


CASES = {
    "wrong shape": (lambda: _fp32_request(shape=(1, 5)), grpc.StatusCode.INVALID_ARGUMENT, "must have shape [-1, 4]"),
    "wrong dtype": (lambda: _fp32_request(raw=np.zeros((1, 4), np.float64).tobytes(), datatype="FP64"),
                    grpc.StatusCode.INVALID_ARGUMENT, "must be FP32, got FP64"),
    "raw size mismatch": (lambda: _fp32_request(raw=b"\x00" * 10), grpc.StatusCode.INVALID_ARGUMENT,
                          "needs 16 bytes, raw contents have 10"),
    "missing input": (lambda: pb.ModelInferRequest(model_name="softcap_demo"), grpc.StatusCode.INVALID_ARGUMENT,
                      "needs input 'x'"),
    "unknown input": (lambda: _fp32_request(name="z"), grpc.StatusCode.INVALID_ARGUMENT, "has no input 'z'"),
    "unknown model": (lambda: _fp32_request(model="no_such_model"), grpc.StatusCode.NOT_FOUND,
                      "unknown model 'no_such_model'"),
    "unknown version": (lambda: _fp32_request(version="7"), grpc.StatusCode.NOT_FOUND, "has no version '7'"),
    "model name escapes": (lambda: _fp32_request(model="../minilm"), grpc.StatusCode.INVALID_ARGUMENT,
                           "invalid model name"),
    "absolute model name": (lambda: _fp32_request(model="/etc/passwd"), grpc.StatusCode.INVALID_ARGUMENT,
                            "invalid model name"),
    "NUL in model name": (lambda: _fp32_request(model="mini\x00lm"), grpc.StatusCode.INVALID_ARGUMENT,
                          "invalid model name"),
    "batch too large": (lambda: _fp32_request(shape=(9, 4)), grpc.StatusCode.INVALID_ARGUMENT,
                        "outside 1..8"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_infer_request(stub, case):
    build, code, fragment = CASES[case]
    got_code, details = _status(lambda: stub.ModelInfer(build(), timeout=30))
    assert got_code == code, details
    assert fragment in details


def test_bad_bytes_tensor(stub):
    request = pb.ModelInferRequest(model_name="minilm")
    request.inputs.add(name="text", datatype="BYTES", shape=[2])
    request.raw_input_contents.append(b"\x05\x00\x00\x00hello\xff\x00\x00\x00x")
    code, details = _status(lambda: stub.ModelInfer(request, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "runs past the end" in details


def test_capability_the_backend_lacks_is_unimplemented(triton):
    x = tc.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as err:
        triton.infer("softcap_demo", [x], sequence_id=42, sequence_start=True)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "reference" in err.value.message() and "sequence_batching" in err.value.message()


def _load(triton, name, config, files=None):
    with pytest.raises(InferenceServerException) as err:
        triton.load_model(name, config=config, files=files)
    return err.value


def test_malformed_inline_config(triton):
    err = _load(triton, "broken", "{not json", {"file:1/model.onnx": onnx_fixtures.double_int64()})
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "not valid JSON" in err.message()
    err = _load(triton, "broken", json.dumps({"max_batch_size": "many"}), {"file:1/model.onnx": b"x"})
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "max_batch_size" in err.message()


def test_corrupt_and_non_onnx_files(triton):
    config = json.dumps(onnx_fixtures.triton_config("corrupt", [("x", "INT64", [3])], [("y", "INT64", [3])]))
    for name, data in (("corrupt", onnx_fixtures.double_int64()[:40]), ("notonnx", b"GGUF this is not a graph")):
        err = _load(triton, name, config.replace('"corrupt"', f'"{name}"'), {"file:1/model.onnx": data})
        assert err.status() == "StatusCode.INVALID_ARGUMENT", err.message()
        assert "no backend could load" in err.message() and "onnx:" in err.message() and "reference:" in err.message()
        assert not triton.is_model_ready(name)


def test_a_graph_with_names_that_are_not_utf8_loads_on_the_next_backend(triton):
    """onnxruntime loads it, then cannot describe its inputs and outputs as
    str: the onnx backend refuses it (LoadFailed, not an INTERNAL bug: a
    fuzzed upload found that), and the next backend in the model's list
    (IREE, or the pure-Python reference one, which read the name as bytes)
    serves it."""
    config = json.dumps(onnx_fixtures.triton_config("notutf8", [("x", "INT64", [3])], [("y", "INT64", [3])]))
    triton.load_model("notutf8", config=config, files={"file:1/model.onnx": onnx_fixtures.non_utf8_dimension()})
    x = tc.InferInput("x", [1, 3], "INT64")
    x.set_data_from_numpy(np.array([[1, 2, 3]], np.int64))
    np.testing.assert_array_equal(triton.infer("notutf8", [x]).as_numpy("y"), [[2, 4, 6]])
    assert triton.get_model_metadata("notutf8").platform != "modeld_onnx"  # iree or reference, by priority
    triton.unload_model("notutf8")


@pytest.mark.parametrize("path", ["file:../escape.onnx", "file:/etc/model.onnx", "file:1/../../x", "file:a\x00b"])
def test_inline_file_paths_cannot_escape(triton, path):
    config = json.dumps(onnx_fixtures.triton_config("escape", [("x", "INT64", [3])], [("y", "INT64", [3])]))
    err = _load(triton, "escape", config, {path: onnx_fixtures.double_int64()})
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "must be relative" in err.message()


@pytest.mark.parametrize("name", ["../minilm", "/abs", "a/b", "nul\x00name"])
def test_load_names_cannot_escape(triton, name):
    err = _load(triton, name, None)
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "invalid model name" in err.message()


def test_oversize_message_is_resource_exhausted():
    daemon = start_daemon("--no-preload", env={"MODELD_MAX_MESSAGE_BYTES": "64KiB"})
    try:
        with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 2**31 - 1)]) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            big = _fp32_request(shape=(8, 4), raw=b"\x00" * 100_000)
            code, details = _status(lambda: stub.ModelInfer(big, timeout=30))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            ok = stub.ModelInfer(_fp32_request(), timeout=30)
            assert ok.model_name == "softcap_demo"
    finally:
        assert daemon.stop() == 0
