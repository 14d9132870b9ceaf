"""KServe v2 protobuf <-> numpy conversion."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from modeld.backends.base import Capability
from modeld.backends.errors import InvalidArgument, Unimplemented
from modeld.gen import inference_pb2 as pb
from modeld.server.requests import InferResult
from modeld.server.services.convert import (
    decode_tensor, encode_bytes, parameter_value, request_from_proto, response_to_proto,
)


def length_prefixed(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def raw_request(*tensors: tuple[str, str, list[int], bytes], **kwargs) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="m", **kwargs)
    for name, datatype, shape, raw in tensors:
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(raw)
    return msg


def decode_response_output(response: pb.ModelInferResponse, index: int) -> np.ndarray:
    out = response.outputs[index]
    raw = response.raw_output_contents[index]
    shape = tuple(out.shape)
    if out.datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            (n,) = struct.unpack_from("<I", raw, offset)
            items.append(raw[offset + 4:offset + 4 + n])
            offset += 4 + n
        return np.array(items, dtype=object).reshape(shape)
    dtype = {"FP32": np.float32, "INT64": np.int64, "FP64": np.float64, "BOOL": np.bool_, "INT32": np.int32,
             "UINT8": np.uint8, "FP16": np.float16}[out.datatype]
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


# -- raw contents -----------------------------------------------------------------


def test_raw_fp32_is_decoded_with_its_shape():
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    request = request_from_proto(raw_request(("x", "FP32", [2, 3], data.tobytes())))
    assert request.model_name == "m"
    assert request.inputs["x"].dtype == np.float32
    np.testing.assert_array_equal(request.inputs["x"], data)
    assert request.required == frozenset({Capability.TENSOR_INFERENCE})
    assert request.output_names == ()


def test_raw_fp32_of_wrong_byte_size_names_expected_and_actual_bytes():
    with pytest.raises(InvalidArgument) as info:
        request_from_proto(raw_request(("x", "FP32", [2, 3], b"\x00" * 20)))
    message = str(info.value)
    assert "'x'" in message
    assert "needs 24 bytes" in message
    assert "have 20" in message


def test_raw_int64_too_long_is_refused():
    with pytest.raises(InvalidArgument, match="needs 8 bytes.*have 16"):
        request_from_proto(raw_request(("ids", "INT64", [1], b"\x00" * 16)))


def test_raw_inputs_keep_the_clients_order_and_each_gets_its_own_buffer():
    a = np.array([1, 2, 3], dtype=np.int32)
    b = np.array([[1.5], [2.5]], dtype=np.float64)
    request = request_from_proto(raw_request(("b", "FP64", [2, 1], b.tobytes()), ("a", "INT32", [3], a.tobytes())))
    assert list(request.inputs) == ["b", "a"]
    np.testing.assert_array_equal(request.inputs["a"], a)
    np.testing.assert_array_equal(request.inputs["b"], b)


def test_raw_bytes_are_split_on_little_endian_length_prefixes():
    raw = length_prefixed(b"hello", b"", b"w\x00rld" * 100)
    request = request_from_proto(raw_request(("text", "BYTES", [3], raw)))
    array = request.inputs["text"]
    assert array.dtype == object
    assert array.shape == (3,)
    assert list(array) == [b"hello", b"", b"w\x00rld" * 100]


def test_raw_bytes_reshape_to_the_declared_shape():
    raw = length_prefixed(b"a", b"bb", b"ccc", b"dddd")
    array = request_from_proto(raw_request(("t", "BYTES", [2, 2], raw))).inputs["t"]
    assert array.shape == (2, 2)
    assert array[1, 0] == b"ccc"


def test_raw_bytes_length_prefix_is_little_endian():
    # a big-endian prefix for 5 reads as 83886080 little-endian: it must overrun, not parse
    raw = struct.pack(">I", 5) + b"hello"
    with pytest.raises(InvalidArgument, match="runs past the end"):
        request_from_proto(raw_request(("t", "BYTES", [1], raw)))


def test_raw_bytes_truncated_length_prefix():
    raw = length_prefixed(b"ok") + b"\x01\x00"
    with pytest.raises(InvalidArgument, match="end inside a length prefix"):
        request_from_proto(raw_request(("t", "BYTES", [2], raw)))


def test_raw_bytes_element_overrun():
    raw = struct.pack("<I", 10) + b"short"
    with pytest.raises(InvalidArgument) as info:
        request_from_proto(raw_request(("t", "BYTES", [1], raw)))
    assert "length 10 runs past the end" in str(info.value)
    assert "'t'" in str(info.value)


@pytest.mark.parametrize(("shape", "n_items"), [([3], 2), ([1], 2), ([2, 2], 3)])
def test_raw_bytes_count_mismatch(shape, n_items):
    raw = length_prefixed(*[b"x"] * n_items)
    with pytest.raises(InvalidArgument) as info:
        request_from_proto(raw_request(("t", "BYTES", shape, raw)))
    assert f"holds {int(np.prod(shape))} BYTES elements, raw contents hold {n_items}" in str(info.value)


def test_raw_input_contents_count_must_match_inputs():
    msg = raw_request(("a", "FP32", [1], np.float32(1).tobytes()))
    msg.inputs.add(name="b", datatype="FP32", shape=[1])
    with pytest.raises(InvalidArgument, match="got 1 raw_input_contents for 2 inputs"):
        request_from_proto(msg)
    msg = raw_request(("a", "FP32", [1], np.float32(1).tobytes()))
    msg.raw_input_contents.append(b"extra")
    with pytest.raises(InvalidArgument, match="got 2 raw_input_contents for 1 inputs"):
        request_from_proto(msg)


@pytest.mark.parametrize("datatype", ["FLOAT32", "fp32", "STRING", "BF16", ""])
def test_unknown_datatype_is_refused_with_the_supported_list(datatype):
    with pytest.raises(InvalidArgument) as info:
        request_from_proto(raw_request(("x", datatype, [1], b"\x00" * 4)))
    assert f"unsupported datatype {datatype!r}" in str(info.value)
    assert "FP32" in str(info.value) and "BYTES" in str(info.value)


def test_negative_dimension_is_refused():
    with pytest.raises(InvalidArgument, match="negative dimension"):
        request_from_proto(raw_request(("x", "FP32", [-1, 2], b"")))


def test_duplicate_input_name_is_refused():
    one = np.float32(1).tobytes()
    with pytest.raises(InvalidArgument, match="'x' appears twice"):
        request_from_proto(raw_request(("x", "FP32", [1], one), ("x", "FP32", [1], one)))


# -- typed contents -------------------------------------------------------------------


def test_typed_fp32_int64_and_bytes_contents_are_accepted():
    msg = pb.ModelInferRequest(model_name="m")
    f = msg.inputs.add(name="f", datatype="FP32", shape=[2, 2])
    f.contents.fp32_contents.extend([1.0, 2.5, -3.0, 4.0])
    i = msg.inputs.add(name="i", datatype="INT64", shape=[3])
    i.contents.int64_contents.extend([1, -2, 2**40])
    b = msg.inputs.add(name="b", datatype="BYTES", shape=[2])
    b.contents.bytes_contents.extend([b"one", b"two"])
    request = request_from_proto(msg)
    assert request.inputs["f"].dtype == np.float32
    np.testing.assert_array_equal(request.inputs["f"], [[1.0, 2.5], [-3.0, 4.0]])
    assert request.inputs["i"].dtype == np.int64
    np.testing.assert_array_equal(request.inputs["i"], [1, -2, 2**40])
    assert request.inputs["b"].dtype == object
    assert list(request.inputs["b"]) == [b"one", b"two"]


@pytest.mark.parametrize(("datatype", "field", "values", "dtype"), [
    ("BOOL", "bool_contents", [True, False], np.bool_),
    ("INT8", "int_contents", [-128, 127], np.int8),
    ("INT32", "int_contents", [-5, 7], np.int32),
    ("UINT8", "uint_contents", [0, 255], np.uint8),
    ("UINT64", "uint64_contents", [0, 2**63], np.uint64),
    ("FP64", "fp64_contents", [0.1, -1e300], np.float64),
])
def test_typed_contents_use_the_declared_dtype(datatype, field, values, dtype):
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype=datatype, shape=[2])
    getattr(t.contents, field).extend(values)
    array = request_from_proto(msg).inputs["x"]
    assert array.dtype == dtype
    np.testing.assert_array_equal(array, np.array(values, dtype=dtype))


def test_typed_contents_count_mismatch():
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    t.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    with pytest.raises(InvalidArgument, match=r"shape \[2, 2\] needs 4 values, contents.fp32_contents has 3"):
        request_from_proto(msg)


def test_typed_contents_in_the_wrong_field_count_as_missing():
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype="FP32", shape=[1])
    t.contents.fp64_contents.append(1.0)
    with pytest.raises(InvalidArgument, match="needs 1 values, contents.fp32_contents has 0"):
        request_from_proto(msg)


def test_fp16_must_be_sent_raw():
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="h", datatype="FP16", shape=[1])
    with pytest.raises(InvalidArgument, match="FP16 data must be sent as raw_input_contents"):
        request_from_proto(msg)
    array = request_from_proto(raw_request(("h", "FP16", [2], np.array([1, 2], np.float16).tobytes()))).inputs["h"]
    assert array.dtype == np.float16


@pytest.mark.parametrize(("datatype", "field", "value"), [("INT8", "int_contents", 300),
                                                         ("UINT8", "uint_contents", 256)])
def test_out_of_range_typed_contents_are_invalid_argument(datatype, field, value):
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype=datatype, shape=[1])
    getattr(t.contents, field).append(value)
    with pytest.raises(InvalidArgument):
        request_from_proto(msg)


# -- parameters and outputs ----------------------------------------------------------


def test_sequence_id_parameter_requires_sequence_batching():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()))
    msg.parameters["sequence_id"].int64_param = 42
    msg.parameters["priority"].int64_param = 1
    request = request_from_proto(msg)
    assert Capability.SEQUENCE_BATCHING in request.required
    assert Capability.TENSOR_INFERENCE in request.required
    assert request.parameters == {"sequence_id": 42, "priority": 1}


def test_shared_memory_on_an_input_requires_shared_memory():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()))
    msg.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    request = request_from_proto(msg)
    assert request.required == frozenset({Capability.TENSOR_INFERENCE, Capability.SHARED_MEMORY})


def test_an_input_in_shared_memory_has_no_contents_and_is_not_misread_as_empty():
    # as tritonclient's InferInput.set_shared_memory sends it: the data is in the region
    msg = pb.ModelInferRequest(model_name="m")
    tensor = msg.inputs.add(name="x", datatype="INT64", shape=[1, 3])
    tensor.parameters["shared_memory_region"].string_param = "region0"
    tensor.parameters["shared_memory_byte_size"].int64_param = 24
    request = request_from_proto(msg)
    assert Capability.SHARED_MEMORY in request.required and request.inputs == {}


def test_sequence_start_on_an_output_requires_sequence_batching():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()))
    msg.outputs.add(name="y").parameters["sequence_start"].bool_param = True
    request = request_from_proto(msg)
    assert Capability.SEQUENCE_BATCHING in request.required
    assert request.output_names == ("y",)


def test_requested_outputs_keep_their_order():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()))
    msg.outputs.add(name="b")
    msg.outputs.add(name="a")
    assert request_from_proto(msg).output_names == ("b", "a")


def test_classification_extension_is_unimplemented():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()))
    msg.outputs.add(name="y").parameters["classification"].int64_param = 3
    with pytest.raises(Unimplemented, match="classification"):
        request_from_proto(msg)


@pytest.mark.parametrize(("field", "value"), [("bool_param", True), ("int64_param", -7), ("string_param", "s"),
                                              ("double_param", 0.5), ("uint64_param", 2**64 - 1)])
def test_parameter_value_reads_the_set_choice(field, value):
    param = pb.InferParameter(**{field: value})
    assert parameter_value(param) == value


def test_parameter_value_of_an_empty_parameter_is_none():
    assert parameter_value(pb.InferParameter()) is None


def test_request_identity_fields_are_copied():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()), model_version="1", id="client-7")
    request = request_from_proto(msg)
    assert (request.model_version, request.id) == ("1", "client-7")


# -- responses ---------------------------------------------------------------------------


def test_response_round_trips_fp32_int64_and_bytes():
    outputs = {
        "emb": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "ids": np.array([[1, -2**40]], dtype=np.int64),
        "text": np.array([b"alpha", "b\u00e9ta", b""], dtype=object),
    }
    response = response_to_proto(InferResult("m", "1", "req-9", outputs, "onnx"))
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "req-9")
    assert [o.name for o in response.outputs] == ["emb", "ids", "text"]
    assert [o.datatype for o in response.outputs] == ["FP32", "INT64", "BYTES"]
    assert [list(o.shape) for o in response.outputs] == [[2, 3], [1, 2], [3]]
    assert len(response.raw_output_contents) == 3
    np.testing.assert_array_equal(decode_response_output(response, 0), outputs["emb"])
    np.testing.assert_array_equal(decode_response_output(response, 1), outputs["ids"])
    assert list(decode_response_output(response, 2)) == [b"alpha", "b\u00e9ta".encode(), b""]


def test_response_of_a_non_contiguous_array_is_in_logical_order():
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T  # Fortran order view
    response = response_to_proto(InferResult("m", "1", "", {"y": array}, "onnx"))
    assert list(response.outputs[0].shape) == [4, 3]
    np.testing.assert_array_equal(decode_response_output(response, 0), array)


def test_response_bytes_round_trip_through_request_decoding():
    text = np.array([[b"a", b"bc"], [b"", b"def"]], dtype=object)
    response = response_to_proto(InferResult("m", "1", "", {"t": text}, "onnx"))
    back = decode_tensor(pb.ModelInferRequest.InferInputTensor(name="t", datatype="BYTES", shape=[2, 2]),
                         response.raw_output_contents[0])
    np.testing.assert_array_equal(back, text)


def test_encode_bytes_uses_little_endian_prefixes():
    assert encode_bytes(np.array([b"ab", "\u00e9"], dtype=object)) == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xc3\xa9"


def test_full_request_response_round_trip_of_numeric_tensors():
    data = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    request = request_from_proto(raw_request(("x", "FP32", [2, 4], data.tobytes())))
    response = response_to_proto(InferResult("m", "1", "", {"x": request.inputs["x"]}, "reference"))
    assert response.raw_output_contents[0] == data.tobytes()


def test_a_parameter_a_tensor_model_does_not_understand_is_refused_by_name():
    msg = raw_request(("x", "FP32", [1], np.float32(1).tobytes()))
    msg.parameters["temperature"].double_param = 0.5
    with pytest.raises(InvalidArgument, match="'temperature'"):
        request_from_proto(msg)
    msg.parameters.clear()
    msg.parameters["priority"].uint64_param = 2
    msg.parameters["timeout"].int64_param = 1_500_000
    request = request_from_proto(msg)
    assert request.priority == 2 and request.timeout_s == 1.5
