"""Language models over KServe: request parameters to a GenerateRequest,
and events back to responses (text, usage, logprobs)."""

from __future__ import annotations

import json
import struct

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, SpeculativeMode, TokenEvent, TokenLogprob, Usage,
)
from modeld.gen import inference_pb2 as pb
from modeld.server.services.kserve_text import logprobs_json, text_request, text_response


def prompt_request(prompt: bytes = b"Hello", **parameters) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="llm", id="r1")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    msg.raw_input_contents.append(struct.pack("<I", len(prompt)) + prompt)
    for key, value in parameters.items():
        param = msg.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value
    return msg


def test_parameters_become_sampling_params_priority_and_timeout():
    request, timeout_s = text_request(prompt_request(
        max_tokens=7, temperature=0.5, top_k=3, seed=11, logprobs=2, ignore_eos=True, stop='["a", "b"]',
        speculative="ngram", priority=2, timeout=1_500_000), "rid")
    assert request.prompt == "Hello" and request.model_name == "llm" and request.request_id == "rid"
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.logprobs, p.ignore_eos) == (7, 0.5, 3, 11, 2, True)
    assert p.stop == ("a", "b") and p.speculative is SpeculativeMode.NGRAM
    assert request.priority == 2 and timeout_s == 1.5  # Triton's timeout is in microseconds


def test_no_timeout_and_default_priority_when_absent():
    request, timeout_s = text_request(prompt_request(), "rid")
    assert timeout_s is None and request.priority == 0


@pytest.mark.parametrize("parameters, named", [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"speculative": "eagle"}, "speculative"),
    ({"stop": "[1, 2]"}, "stop"),
    ({"temperatur": 0.5}, "temperatur"),
    ({"priority": -1}, "priority"),
    ({"timeout": "soon"}, "timeout"),
])
def test_bad_or_unknown_parameters_are_refused_by_name(parameters, named):
    with pytest.raises(InvalidArgument, match=named):
        text_request(prompt_request(**parameters), "rid")


def test_text_input_must_hold_one_utf8_prompt():
    with pytest.raises(InvalidArgument, match="UTF-8"):
        text_request(prompt_request(b"\xff\xfe"), "rid")
    msg = pb.ModelInferRequest(model_name="llm")
    msg.inputs.add(name="prompt", datatype="BYTES", shape=[1])
    msg.raw_input_contents.append(struct.pack("<I", 2) + b"hi")
    with pytest.raises(InvalidArgument, match="text_input"):
        text_request(msg, "rid")


def test_final_response_carries_text_usage_finish_reason_and_logprobs():
    tokens = [TokenEvent((5, 6), "ab", (TokenLogprob(5, -0.1), TokenLogprob(6, -0.7)),
                         ((TokenLogprob(5, -0.1), TokenLogprob(9, -2.0)), (TokenLogprob(6, -0.7),)))]
    final = FinalEvent(FinishReason.LENGTH, Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1))
    response = text_response(prompt_request(), "ab", final, tokens)
    assert response.id == "r1" and response.outputs[0].name == "text_output"
    assert response.raw_output_contents[0] == struct.pack("<I", 2) + b"ab"
    assert response.parameters["finish_reason"].string_param == "length"
    assert response.parameters["prompt_tokens"].int64_param == 3
    assert response.parameters["cached_prompt_tokens"].int64_param == 1
    assert json.loads(response.parameters["logprobs"].string_param) == [
        {"token_id": 5, "logprob": -0.1, "top": [[5, -0.1], [9, -2.0]]},
        {"token_id": 6, "logprob": -0.7, "top": [[6, -0.7]]},
    ]


def test_no_logprobs_parameter_unless_the_tokens_carry_them():
    assert logprobs_json([TokenEvent((1,), "x")]) is None
    response = text_response(prompt_request(), "x", tokens=[TokenEvent((1,), "x")])
    assert "logprobs" not in response.parameters and "finish_reason" not in response.parameters
