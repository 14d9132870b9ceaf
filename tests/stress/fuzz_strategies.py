"""Hypothesis strategies over the daemon's request messages.

Field-level strategies build messages that parse but say anything: names
that exist and names that do not, shapes and datatypes that disagree with
the contents, parameters of every type under known and unknown keys,
sampling parameters out of range, junk model configs. Byte-level ones
mutate valid serialized requests (flip, cut, insert, splice) or send
random bytes, which mostly do not parse at all.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from hypothesis import strategies as st

import onnx_fixtures
from modeld.gen import generation_pb2 as g
from modeld.gen import inference_pb2 as pb

# the fuzz daemon's models (tests/stress/test_fuzz.py), plus names nobody serves
MODEL_NAMES = ["add", "minilm", "smollm2", "absent", "", "../add", "add/../add", "a" * 300, "nul\x00name", "ADD"]
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BYTES", "BF16", "", "fp32", "FP8", "STRING"]
INPUT_NAMES = ["x", "text", "text_input", "query", "documents", "", "y", "x\x00"]
PARAMETER_KEYS = ["priority", "timeout", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                  "ignore_eos", "cache_prompt", "speculative", "num_speculative_tokens", "logprobs", "sort", "top_n",
                  "sequence_id", "sequence_start", "shared_memory_region", "classification",
                  "triton_enable_empty_final_response", "config", "file:model.onnx", "junk"]
# the sizes a generation may run for, including refused ones: never the 128 default
MAX_TOKENS = st.sampled_from([1, 2, 0, -1, -(2**31), 2**31 - 1, 10**6])

names = st.one_of(st.sampled_from(MODEL_NAMES), st.text(max_size=24))
small_text = st.text(max_size=40)
dims = st.one_of(st.integers(-2, 6), st.sampled_from([0, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63)]))
shapes = st.lists(dims, max_size=5)


@st.composite
def parameter_values(draw, message_type=pb.InferParameter):
    param = message_type()
    fields = {f.name.removesuffix("_param") for f in message_type.DESCRIPTOR.fields}
    kind = draw(st.sampled_from(sorted(fields) + ["none"]))
    if kind == "bool":
        param.bool_param = draw(st.booleans())
    elif kind == "int64":
        param.int64_param = draw(st.one_of(st.integers(-5, 300), st.integers(-(2**63), 2**63 - 1)))
    elif kind == "string":
        param.string_param = draw(st.one_of(small_text, st.sampled_from(["none", "ngram", "draft", '["a", "b"]',
                                                                         "[1, 2]", "[", "true"])))
    elif kind == "double":
        param.double_param = draw(st.floats(allow_nan=True, allow_infinity=True))
    elif kind == "uint64":
        param.uint64_param = draw(st.integers(0, 2**64 - 1))
    elif kind == "bytes":
        param.bytes_param = draw(st.binary(max_size=64))
    return param


def _fill_parameters(draw, target, keys=st.one_of(st.sampled_from(PARAMETER_KEYS), small_text)) -> None:
    for key in draw(st.lists(keys, max_size=4, unique=True)):
        target[key].CopyFrom(draw(parameter_values()))


def _bytes_elements(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


@st.composite
def raw_contents(draw, datatype: str, shape: list[int]):
    """Contents that fit the shape, are one element off, or are junk."""
    count = math.prod(max(d, 0) for d in shape)
    count = min(count, 64)
    choice = draw(st.sampled_from(["fit", "off", "junk"]))
    if choice == "junk":
        return draw(st.binary(max_size=128))
    if choice == "off":
        count = max(count + draw(st.sampled_from([-1, 1])), 0)
    if datatype == "BYTES":
        return _bytes_elements([draw(st.binary(max_size=16)) for _ in range(count)])
    width = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2, "UINT32": 4,
             "INT32": 4, "FP32": 4}.get(datatype, 8)
    return draw(st.binary(min_size=count * width, max_size=count * width))


@st.composite
def infer_requests(draw):
    """A ModelInferRequest anywhere between valid and nonsense."""
    request = pb.ModelInferRequest(model_name=draw(names), model_version=draw(st.sampled_from(["", "1", "2", "x"])),
                                   id=draw(st.text(max_size=8)))
    use_raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(shapes)
        tensor = request.inputs.add(name=draw(st.one_of(st.sampled_from(INPUT_NAMES), small_text)),
                                    datatype=datatype, shape=shape)
        if draw(st.integers(0, 9)) == 0:
            _fill_parameters(draw, tensor.parameters)
        if use_raw:
            request.raw_input_contents.append(draw(raw_contents(datatype, shape)))
        else:
            field = draw(st.sampled_from(["fp32_contents", "int_contents", "int64_contents", "bytes_contents",
                                          "bool_contents", "uint_contents", "uint64_contents", "fp64_contents"]))
            values = {"fp32_contents": st.floats(width=32), "fp64_contents": st.floats(),
                      "int_contents": st.integers(-(2**31), 2**31 - 1),
                      "int64_contents": st.integers(-(2**63), 2**63 - 1),
                      "uint_contents": st.integers(0, 2**32 - 1), "uint64_contents": st.integers(0, 2**64 - 1),
                      "bytes_contents": st.binary(max_size=16), "bool_contents": st.booleans()}[field]
            getattr(tensor.contents, field).extend(draw(st.lists(values, max_size=12)))
    if use_raw and draw(st.integers(0, 5)) == 0:
        request.raw_input_contents.append(draw(st.binary(max_size=16)))  # one more than inputs
    for _ in range(draw(st.integers(0, 2))):
        output = request.outputs.add(name=draw(st.one_of(st.sampled_from(["y", "embedding", "text_output"]),
                                                         small_text)))
        if draw(st.integers(0, 5)) == 0:
            _fill_parameters(draw, output.parameters)
    _fill_parameters(draw, request.parameters)
    if request.model_name == "smollm2":
        request.parameters["max_tokens"].int64_param = draw(MAX_TOKENS)  # never the long default
    return request


def valid_infer_requests() -> list[pb.ModelInferRequest]:
    """One good request per model, the seeds of byte-level mutation."""
    add = pb.ModelInferRequest(model_name="add")
    add.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    add.raw_input_contents.append(np.arange(8, dtype=np.float32).tobytes())
    minilm = pb.ModelInferRequest(model_name="minilm")
    minilm.inputs.add(name="text", datatype="BYTES", shape=[2])
    minilm.raw_input_contents.append(_bytes_elements([b"a short sentence", b"another one"]))
    text = pb.ModelInferRequest(model_name="smollm2", id="t")
    text.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.raw_input_contents.append(_bytes_elements([b"Hello"]))
    text.parameters["max_tokens"].int64_param = 1
    return [add, minilm, text]


@st.composite
def sampling_params(draw):
    params = g.SamplingParams(max_tokens=draw(st.sampled_from([1, 2, 0, 2**32 - 1, 10**6])))
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    uint32 = st.one_of(st.integers(0, 70), st.integers(0, 2**32 - 1))
    for name, values in (("temperature", floats), ("top_p", floats), ("min_p", floats), ("top_k", uint32),
                         ("seed", st.integers(0, 2**64 - 1)), ("logprobs", uint32), ("cache_prompt", st.booleans()),
                         ("ignore_eos", st.booleans()), ("num_speculative_tokens", uint32)):
        if draw(st.integers(0, 3)) == 0:
            setattr(params, name, draw(values))
    params.stop.extend(draw(st.lists(small_text, max_size=3)))
    params.stop_token_ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3)))
    params.speculative = draw(st.integers(0, 5))  # 3..5: values from a newer client
    return params


@st.composite
def generate_requests(draw):
    request = g.GenerateRequest(model=draw(names), sampling=draw(sampling_params()),
                                priority=draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["prompt", "token_ids", "messages", "none"]))
    if kind == "prompt":
        request.prompt = draw(st.text(max_size=120))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=16)))
    elif kind == "messages":
        for _ in range(draw(st.integers(0, 3))):
            request.messages.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "", "tool"])),
                                          content=draw(st.text(max_size=60)))
    return request


def valid_generate_requests() -> list[g.GenerateRequest]:
    return [g.GenerateRequest(model="smollm2", prompt="Hello", sampling=g.SamplingParams(max_tokens=2)),
            g.GenerateRequest(model="smollm2", token_ids=g.TokenIds(ids=[1, 2, 3]),
                              sampling=g.SamplingParams(max_tokens=1, temperature=0.7, seed=3))]


# keys of the config's nested tables, so junk reaches the code that reads them
NESTED_KEYS = ["max_batch_size", "max_queue_delay_us", "max_queue_size", "preferred_batch_sizes",
               "max_queue_delay_microseconds", "preferred_batch_size", "name", "data_type", "dims", "datatype",
               "shape", "tokenizer", "input", "max_length", "embedding_model", "url", "engine", "n_ctx", "n_slots",
               "context_length", "draft_model", "intra_op_threads", "max_request_bytes", "num_blocks", "dtype",
               "device", "max_running", "reshape", "format"]
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
              st.text(max_size=16), st.sampled_from(["onnx", "gguf", "remote", "TYPE_FP32", "onnxruntime_onnx",
                                                      "model.onnx", "1/model.onnx", "http://127.0.0.1:1", "x",
                                                      "TYPE_STRING", "cpu", "openai"])),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(NESTED_KEYS), st.text(max_size=12)), children, max_size=4)),
    max_leaves=12)
CONFIG_KEYS = ["format", "backends", "artifact", "batching", "memory_estimate", "warmup", "pinned", "lazy_load",
               "inputs", "outputs", "text", "name", "kind", "rerank", "limits", "onnx", "llamacpp", "torch",
               "remote", "max_batch_size", "dynamic_batching", "input", "output", "platform", "backend", "junk"]
# names the fuzz daemon does not serve: a junk config never replaces a model the good-request checks use
LOAD_NAMES = st.one_of(st.from_regex(r"fz[a-z0-9_.-]{0,12}", fullmatch=True),
                       st.sampled_from(["", "../fz", "fz/x", "/fz", "fz\x00", "f" * 200]))


@st.composite
def load_requests(draw):
    request = pb.RepositoryModelLoadRequest(model_name=draw(LOAD_NAMES))
    config = draw(st.one_of(
        st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, max_size=6).map(json.dumps),
        st.text(max_size=60), st.just('{"format": "onnx", "backends": ["onnx"]}'), st.none()))
    if config is not None:
        if draw(st.integers(0, 6)) == 0:
            request.parameters["config"].CopyFrom(draw(parameter_values(pb.ModelRepositoryParameter)))
        else:
            request.parameters["config"].string_param = config
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.one_of(st.sampled_from(["file:model.onnx", "file:1/model.onnx", "file:../x", "file:", "file:/x",
                                              "file:a//b", "model.onnx"]), small_text.map(lambda t: "file:" + t)))
        data = draw(st.one_of(st.binary(max_size=256), st.just(onnx_fixtures.add_fp32())))
        if draw(st.integers(0, 6)) == 0:
            request.parameters[key].CopyFrom(draw(parameter_values(pb.ModelRepositoryParameter)))
        else:
            request.parameters[key].bytes_param = data
    return request


@st.composite
def unload_requests(draw):
    request = pb.RepositoryModelUnloadRequest(model_name=draw(LOAD_NAMES))
    if draw(st.booleans()):
        request.parameters["unload_dependents"].CopyFrom(draw(parameter_values(pb.ModelRepositoryParameter)))
    return request


@st.composite
def mutated(draw, seeds: list[bytes]):
    """A valid message's bytes, bent: bytes flipped, cut, inserted, spliced."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "truncate", "splice", "varint"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "cut" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del data[at:]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            data[at:] = other[draw(st.integers(0, len(other))):]
        elif op == "varint":  # a length or tag that runs on, or claims far more than follows
            data[at:at] = draw(st.sampled_from([b"\xff" * 10, b"\x80" * 5 + b"\x01", b"\x0a\xff\xff\xff\x0f",
                                                b"\x00", b"\x07", b"\xfa\xff\xff\xff\x0f"]))
    return bytes(data)


# -- HTTP bodies: the OpenAI and KServe REST fronts ------------------------------------

# max_tokens a body may ask, refused ones included; small or far out of range
# (never one the context would cut short), as an HTTP answer is read whole
HTTP_MAX_TOKENS = st.sampled_from([0, 1, 2, -1, 2**63, 2**64, "2", 1.5, [], None])
# JSON of any shape, for fields that should have been something else
ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=False),
              st.text(max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=8)
OPENAI_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "logprobs", "top_logprobs",
                 "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "stream",
                 "stream_options", "priority", "user", "tools", "tool_choice", "echo", "suffix", "best_of",
                 "ignore_eos", "min_tokens", "encoding_format", "dimensions", "junk"]
FIELD_VALUES = st.one_of(ANY_JSON, st.sampled_from([0, 1, -1, 0.5, 2.0, True, "", "x", [], {}, ["a", "b"],
                                                    {"type": "json_object"}, {"1": 5}, {"include_usage": True}]))


def _without_long_generations(body: dict) -> dict:
    """A body the daemon accepts must still end within a step or two: an
    absent max_tokens (the default is long) is 1, an n it would take is 2."""
    if body.get("max_tokens") is None:
        body["max_tokens"] = 1
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 2 < n < 2**20:
        body["n"] = 2
    return body


@st.composite
def openai_bodies(draw, endpoint: str):
    """A JSON body for one /v1 endpoint, anywhere between valid and nonsense."""
    body: dict = {}
    if draw(st.integers(0, 9)):
        body["model"] = draw(st.one_of(names, ANY_JSON))
    if endpoint == "/v1/chat/completions":
        if draw(st.integers(0, 9)):
            body["messages"] = draw(st.one_of(
                st.lists(st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "assistant", "tool", "", "x"])},
                    optional={"content": st.one_of(st.text(max_size=40), ANY_JSON),
                              "name": small_text, "tool_call_id": small_text}), max_size=3),
                ANY_JSON))
    elif endpoint == "/v1/completions":
        if draw(st.integers(0, 9)):
            body["prompt"] = draw(st.one_of(st.text(max_size=60), st.lists(st.text(max_size=20), max_size=3),
                                            st.lists(st.integers(-5, 50000), max_size=6), ANY_JSON))
    elif endpoint == "/v1/embeddings":
        body["model"] = draw(st.sampled_from(["minilm", "add", "smollm2", "absent"]))
        body["input"] = draw(st.one_of(st.text(max_size=40), st.lists(st.text(max_size=20), max_size=4),
                                       st.lists(st.integers(0, 100), max_size=4), ANY_JSON))
    elif endpoint == "/v1/rerank":
        body["model"] = draw(st.sampled_from(["minilm", "add", "absent"]))
        body["query"] = draw(st.one_of(st.text(max_size=30), ANY_JSON))
        body["documents"] = draw(st.one_of(st.lists(st.text(max_size=20), max_size=4), ANY_JSON))
        if draw(st.booleans()):
            body["top_n"] = draw(st.one_of(st.integers(-2, 6), ANY_JSON))
    if endpoint in ("/v1/chat/completions", "/v1/completions"):
        body["max_tokens"] = draw(HTTP_MAX_TOKENS)
    for key in draw(st.lists(st.sampled_from(OPENAI_FIELDS), max_size=4, unique=True)):
        body[key] = draw(FIELD_VALUES)
    if endpoint in ("/v1/chat/completions", "/v1/completions"):
        body = _without_long_generations(body)
    return body


@st.composite
def kserve_infer_bodies(draw):
    """A KServe v2 REST infer body: tensors whose datatype, shape and data disagree."""
    body: dict = {}
    inputs = []
    for _ in range(draw(st.integers(0, 3))):
        tensor = {}
        for key, values in (("name", st.one_of(st.sampled_from(INPUT_NAMES), ANY_JSON)),
                            ("datatype", st.one_of(st.sampled_from(DATATYPES), ANY_JSON)),
                            ("shape", st.one_of(st.lists(st.one_of(dims, ANY_JSON), max_size=4), ANY_JSON)),
                            ("data", st.one_of(st.lists(st.one_of(st.floats(allow_nan=False), st.integers(-(2**70), 2**70),
                                                                  st.text(max_size=8), st.booleans()), max_size=12),
                                               ANY_JSON)),
                            ("parameters", st.dictionaries(st.sampled_from(PARAMETER_KEYS + ["binary_data_size"]),
                                                           ANY_JSON, max_size=2))):
            if draw(st.integers(0, 7)):
                tensor[key] = draw(values)
        inputs.append(tensor)
    if draw(st.integers(0, 9)):
        body["inputs"] = inputs
    else:
        body["inputs"] = draw(ANY_JSON)
    if draw(st.booleans()):
        body["outputs"] = draw(st.one_of(st.lists(st.fixed_dictionaries({"name": st.one_of(small_text, ANY_JSON)}),
                                                  max_size=2), ANY_JSON))
    if draw(st.booleans()):
        params = draw(st.dictionaries(st.sampled_from(PARAMETER_KEYS), ANY_JSON, max_size=3))
        if "max_tokens" in params:
            params["max_tokens"] = draw(st.sampled_from([0, 1, -1, "x"]))
        body["parameters"] = params
    for key in draw(st.lists(st.sampled_from(["id", "junk"]), max_size=2, unique=True)):
        body[key] = draw(ANY_JSON)
    return body


def valid_http_bodies() -> dict[str, list[bytes]]:
    """Good bodies per HTTP route, the seeds of byte-level mutation."""
    add = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    return {path: [json.dumps(b).encode() for b in bodies] for path, bodies in {
        "/v1/chat/completions": [{"model": "smollm2", "max_tokens": 1,
                                  "messages": [{"role": "user", "content": "Hi"}]}],
        "/v1/completions": [{"model": "smollm2", "prompt": "Hello", "max_tokens": 1}],
        "/v1/embeddings": [{"model": "minilm", "input": ["a sentence", "another"]}],
        "/v1/rerank": [{"model": "minilm", "query": "cats", "documents": ["a cat", "a dog"]}],
        "/v2/models/add/infer": [add],
        "/v2/models/smollm2/infer": [{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                                  "data": ["Hi"]}], "parameters": {"max_tokens": 1}}],
        "/v2/repository/index": [{"ready": True}],
    }.items()}
