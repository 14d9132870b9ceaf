"""Each remote engine's adapter maps the sampling extensions and the output
constraints to that engine's own request fields, and refuses, naming the
engine, only what its API cannot take. No sockets: httpx answers from
functions, with the shapes the engines' API documentation gives."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from modeld.backends.generation.params import (
    ChatMessage, Constraint, ConstraintKind, GenerateRequest, SamplingParams, ToolCall, ToolSpec,
)
from modeld.backends.remote.http import Endpoint, RemoteHttp
from modeld.backends.remote.openai_compat import OpenAIProtocol
from modeld.backends.remote.protocol import choice_regex
from modeld.backends.remote.sglang import SglangProtocol
from modeld.backends.remote.tgi import TgiProtocol
from modeld.backends.remote.vllm import VllmProtocol

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CONSTRAINTS = {
    "json_schema": Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    "json_object": Constraint(ConstraintKind.JSON_OBJECT),
    "regex": Constraint(ConstraintKind.REGEX, "[0-9]{3}"),
    "choice": Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no (maybe)"])),
    "lark": Constraint(ConstraintKind.LARK, 'start: "a"+'),
    "gbnf": Constraint(ConstraintKind.GBNF, 'root ::= "a"+'),
}
PENALISED = dict(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias=((7, -100.0),),
                 min_tokens=3, skip_special_tokens=False, include_stop_str_in_output=True)


def _protocol(cls, handler=None):
    http = RemoteHttp(Endpoint(cls.engine, "http://engine:1"),
                      transport=httpx.MockTransport(handler or (lambda r: httpx.Response(404))))
    http.open()
    return cls(http, "m")


def _request(chat: bool = False, **params) -> GenerateRequest:
    if chat:
        return GenerateRequest("m", messages=(ChatMessage("user", "x"),), params=SamplingParams(**params))
    return GenerateRequest("m", prompt="Hi", params=SamplingParams(**params))


# llama-cpp-python's /openapi.json, cut to what matters: penalties under
# its own names, grammar on both paths, response_format on chat only
LLAMA_CPP_PYTHON = {
    "paths": {
        "/v1/completions": {"post": {"requestBody": {"content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Completion"}}}}}},
        "/v1/chat/completions": {"post": {"requestBody": {"content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Chat"}}}}}},
    },
    "components": {"schemas": {
        "Completion": {"properties": {k: {} for k in (
            "prompt", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias",
            "repeat_penalty", "min_tokens", "grammar")}},
        "Chat": {"properties": {**{k: {} for k in ("messages", "presence_penalty", "repeat_penalty", "grammar")},
                                "response_format": {"$ref": "#/components/schemas/Format"}}},
        "Format": {"properties": {"type": {"enum": ["text", "json_object"]}, "schema": {}}},
    }},
}


async def _llama_cpp_python():
    def answer(request):
        if request.url.path == "/openapi.json":
            return httpx.Response(200, json=LLAMA_CPP_PYTHON)
        return httpx.Response(200, json={"data": [{"id": "m"}]})
    server = _protocol(OpenAIProtocol, answer)
    await server.inspect()
    return server


def test_vllm_takes_every_field_and_constraint_as_structured_outputs():
    vllm = _protocol(VllmProtocol)
    body = vllm.body(_request(**PENALISED))
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"], body["logit_bias"],
            body["min_tokens"], body["skip_special_tokens"], body["include_stop_str_in_output"]) == (
        0.5, -0.25, 1.2, {"7": -100.0}, 3, False, True)
    expected = {"json_schema": {"json": SCHEMA}, "json_object": {"json_object": True}, "regex": {"regex": "[0-9]{3}"},
                "choice": {"choice": ["yes", "no (maybe)"]}, "lark": {"grammar": 'start: "a"+'},
                "gbnf": {"grammar": 'root ::= "a"+'}}
    for name, constraint in CONSTRAINTS.items():
        request = _request(constraint=constraint)
        assert vllm.refusal(request) is None
        assert vllm.body(request)["structured_outputs"] == expected[name], name


async def test_llama_cpp_python_gets_its_own_spellings():
    server = await _llama_cpp_python()
    body = server.body(_request(presence_penalty=0.5, repetition_penalty=1.3, logit_bias=((5, 2.0),), min_tokens=2))
    assert (body["presence_penalty"], body["repeat_penalty"], body["logit_bias"], body["min_tokens"]) == (
        0.5, 1.3, {"5": 2.0}, 2)
    assert "repetition_penalty" not in body
    gbnf = _request(constraint=CONSTRAINTS["gbnf"])
    assert server.refusal(gbnf) is None and server.body(gbnf)["grammar"] == 'root ::= "a"+'
    # its response_format knows json_object with a schema, not OpenAI's json_schema type
    chat = _request(chat=True, constraint=CONSTRAINTS["json_schema"])
    assert server.refusal(chat) is None
    assert server.body(chat)["response_format"] == {"type": "json_object", "schema": SCHEMA}
    assert server.body(_request(chat=True, constraint=CONSTRAINTS["json_object"]))["response_format"] == {
        "type": "json_object"}
    for name in ("regex", "choice", "lark"):
        reason = server.refusal(_request(constraint=CONSTRAINTS[name]))
        assert reason and "http://engine:1" in reason and name in reason, reason
    # completions take no response_format there
    assert "json_schema" in server.refusal(_request(constraint=CONSTRAINTS["json_schema"]))
    assert "does not take skip_special_tokens" in server.refusal(_request(skip_special_tokens=False))


async def test_a_server_without_a_schema_gets_openais_own_fields_only():
    server = _protocol(OpenAIProtocol, lambda r: httpx.Response(200, json={"data": [{"id": "m"}]})
                       if r.url.path == "/v1/models" else httpx.Response(404))
    await server.inspect()
    body = server.body(_request(presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((1, 1.0),)))
    assert (body["presence_penalty"], body["frequency_penalty"], body["logit_bias"]) == (0.5, 0.5, {"1": 1.0})
    chat = _request(chat=True, constraint=CONSTRAINTS["json_schema"])
    assert server.body(chat)["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA, "strict": True}}
    assert "cannot tell whether it honours repetition_penalty" in server.refusal(_request(repetition_penalty=1.1))
    assert "cannot constrain output to a regex" in server.refusal(_request(constraint=CONSTRAINTS["regex"]))


def test_sglang_maps_to_its_sampling_params():
    sglang = _protocol(SglangProtocol)
    sampling = sglang.body(_request(**PENALISED))["sampling_params"]
    assert (sampling["presence_penalty"], sampling["frequency_penalty"], sampling["repetition_penalty"],
            sampling["logit_bias"], sampling["min_new_tokens"], sampling["skip_special_tokens"],
            sampling["no_stop_trim"]) == (0.5, -0.25, 1.2, {"7": -100.0}, 3, False, True)
    def sent(name):
        return {k: v for k, v in sglang.body(_request(constraint=CONSTRAINTS[name]))["sampling_params"].items()
                if k in ("json_schema", "regex", "ebnf")}
    assert json.loads(sent("json_schema")["json_schema"]) == SCHEMA
    assert json.loads(sent("json_object")["json_schema"]) == {"type": "object"}
    assert sent("regex") == {"regex": "[0-9]{3}"} and sent("gbnf") == {"ebnf": 'root ::= "a"+'}
    assert sent("choice") == {"regex": r"(yes|no \(maybe\))"}
    assert "SGLang" in sglang.refusal(_request(constraint=CONSTRAINTS["lark"]))


def test_tgi_maps_to_its_grammar_and_refuses_the_rest_by_name():
    tgi = _protocol(TgiProtocol)
    parameters = tgi.body(_request(repetition_penalty=1.2, frequency_penalty=0.5,
                                   constraint=CONSTRAINTS["json_schema"]))["parameters"]
    assert parameters["repetition_penalty"] == 1.2 and parameters["frequency_penalty"] == 0.5
    assert parameters["grammar"] == {"type": "json", "value": SCHEMA}
    assert tgi.body(_request(constraint=CONSTRAINTS["choice"]))["parameters"]["grammar"] == {
        "type": "regex", "value": r"(yes|no \(maybe\))"}
    assert tgi.refusal(_request(constraint=CONSTRAINTS["regex"])) is None
    for params, word in ((dict(presence_penalty=0.5), "presence_penalty"), (dict(logit_bias=((1, 1.0),)), "logit_bias"),
                         (dict(min_tokens=2), "min_tokens"), (dict(constraint=CONSTRAINTS["lark"]), "lark grammar"),
                         (dict(constraint=CONSTRAINTS["gbnf"]), "gbnf grammar")):
        reason = tgi.refusal(_request(**params))
        assert reason and "TGI" in reason and word in reason, reason


@pytest.mark.parametrize("choices", [["a", "b"], ["1.5", "x+y", "[z]", "a|b", "c\\d"], ["with space", "tab\tx"]])
def test_a_choice_regex_matches_exactly_its_strings(choices):
    pattern = choice_regex(Constraint(ConstraintKind.CHOICE, json.dumps(choices)))
    for choice in choices:
        assert re.fullmatch(pattern, choice)
    assert not re.fullmatch(pattern, choices[0] + "x")


@pytest.mark.parametrize("cls", [VllmProtocol, OpenAIProtocol, SglangProtocol, TgiProtocol])
def test_tools_are_refused_naming_the_engine_rather_than_dropped(cls):
    server = _protocol(cls)
    tools = GenerateRequest("m", messages=(ChatMessage("user", "x"),), tools=(ToolSpec("lookup"),))
    history = GenerateRequest("m", messages=(
        ChatMessage("user", "x"), ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "lookup"),)),
        ChatMessage("tool", "42", tool_call_id="c1")))
    for request in (tools, history):
        reason = server.refusal(request)
        assert reason and "tool calling" in reason and server.where in reason, reason
    if cls in (VllmProtocol, OpenAIProtocol):  # the engines that take chat at all
        assert server.refusal(_request(chat=True)) is None
