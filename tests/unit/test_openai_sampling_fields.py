"""The OpenAI front's reading of a request into SamplingParams and a
Constraint: every source of a constraint (OpenAI, vLLM, llama-server), the
new sampling fields, and each limit refused with the field named; and the
same on the gRPC and KServe fronts."""

from __future__ import annotations

import json

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import MAX_N, Constraint, ConstraintKind
from modeld.gen import generation_pb2 as pb
from modeld.server.http.openai_fields import FieldError
from modeld.server.http.openai_sampling import generation_fields
from modeld.server.services.generation import request_from_proto
from modeld.server.services.kserve_text import sampling_from_parameters

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _constraint(**fields) -> Constraint | None:
    return generation_fields({**CHAT, **fields}, chat=True).params.constraint


@pytest.mark.parametrize("fields, kind, spec", [
    ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT, ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     ConstraintKind.JSON_SCHEMA, SCHEMA),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, ConstraintKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, ConstraintKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ConstraintKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, ""),
    ({"structured_outputs": {"regex": "a+"}}, ConstraintKind.REGEX, "a+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, ConstraintKind.CHOICE, ["x", "y"]),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ConstraintKind.GBNF, 'root ::= "a"'),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, ConstraintKind.LARK, 'start: "a"'),
    ({"guided_json": SCHEMA}, ConstraintKind.JSON_SCHEMA, SCHEMA),
    ({"guided_regex": "[0-9]"}, ConstraintKind.REGEX, "[0-9]"),
    ({"guided_choice": ["a"]}, ConstraintKind.CHOICE, ["a"]),
    ({"guided_grammar": 'start: "a"'}, ConstraintKind.LARK, 'start: "a"'),
    ({"grammar": 'root ::= "a"'}, ConstraintKind.GBNF, 'root ::= "a"'),
    ({"json_schema": SCHEMA}, ConstraintKind.JSON_SCHEMA, SCHEMA),
])
def test_each_source_gives_one_constraint(fields, kind, spec):
    constraint = _constraint(**fields)
    assert constraint.kind is kind
    assert (json.loads(constraint.spec) if isinstance(spec, (dict, list)) else constraint.spec) == spec


def test_text_and_absent_mean_no_constraint():
    assert _constraint() is None and _constraint(response_format={"type": "text"}) is None


BAD = {
    "two sources": ({"guided_regex": "a", "grammar": "x"}, "grammar"),
    "unknown type": ({"response_format": {"type": "xml"}}, "response_format"),
    "json_schema without schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                   "response_format"),
    "json_schema with an unknown key": ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": SCHEMA, "extra": 1}}}, "response_format"),
    "schema as a number": ({"guided_json": 3}, "guided_json"),
    "schema as bad JSON text": ({"structured_outputs": {"json": "{x"}}, "structured_outputs"),
    "structured_outputs with two keys": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    "structured_outputs unknown key": ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
    "empty choice": ({"guided_choice": []}, "guided_choice"),
    "too many choices": ({"guided_choice": [str(i) for i in range(257)]}, "guided_choice"),
    "constraint over the size limit": ({"guided_regex": "a" * (64 * 1024 + 1)}, "guided_regex"),
    "n zero": ({"n": 0}, "n"),
    "n over the limit": ({"n": MAX_N + 1}, "n"),
    "logit_bias over the limit": ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    "logit_bias out of range": ({"logit_bias": {"1": 101}}, "logit_bias"),
    "logit_bias key": ({"logit_bias": {"-1": 1}}, "logit_bias"),
    "presence_penalty out of range": ({"presence_penalty": 3}, "presence_penalty"),
    "repetition_penalty zero": ({"repetition_penalty": 0}, "repetition_penalty"),
    "stop_token_ids not ints": ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    "stop_token_ids over the limit": ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    "too many stops": ({"stop": [str(i) for i in range(17)]}, "stop"),
    "min_tokens over max_tokens": ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    "skip_special_tokens not a bool": ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    "cache_prompt not a bool": ({"cache_prompt": 0}, "cache_prompt"),
    "prompt_logprobs": ({"prompt_logprobs": 2}, "prompt_logprobs"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_fields_name_the_field(case):
    fields, param = BAD[case]
    with pytest.raises(FieldError) as err:
        generation_fields({**CHAT, **fields}, chat=True)
    assert err.value.param == param and param in str(err.value), str(err.value)


def test_cache_prompt_as_llama_server_spells_it():
    assert generation_fields(CHAT, chat=True).params.cache_prompt
    assert not generation_fields({**CHAT, "cache_prompt": False}, chat=True).params.cache_prompt
    assert not generation_fields({"model": "m", "prompt": "x", "cache_prompt": False}, chat=False).params.cache_prompt


def test_sampling_fields_and_choices():
    fields = generation_fields({"model": "m", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,
                                "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 2,
                                "stop_token_ids": [9], "skip_special_tokens": False,
                                "include_stop_str_in_output": True, "n": 2, "best_of": 4, "echo": True}, chat=False)
    p = fields.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens,
            p.stop_token_ids, p.skip_special_tokens, p.include_stop_str_in_output) == (
        0.5, -1.0, 1.2, ((3, 2.5), (7, -100.0)), 2, (9,), False, True)
    assert (fields.n, fields.best_of, fields.echo) == (2, 4, True)
    assert p.logprobs == 1  # best_of ranks by cumulative logprob, so the engine reports them
    for bad, param in (({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
                       ({"echo": True, "logprobs": 1}, "echo")):
        with pytest.raises(FieldError) as err:
            generation_fields({"model": "m", "prompt": "x", **bad}, chat=False)
        assert err.value.param == param


def test_grpc_maps_the_same_fields():
    sampling = pb.SamplingParams(presence_penalty=0.5, repetition_penalty=1.5, logit_bias={4: -1.0, 2: 1.0},
                                 min_tokens=3, skip_special_tokens=False,
                                 constraint=pb.Constraint(choice=pb.ChoiceList(choices=["a", "b"])))
    p = request_from_proto(pb.GenerateRequest(model="m", prompt="x", sampling=sampling, n=2)).params
    assert (p.presence_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens, p.skip_special_tokens) == (
        0.5, 1.5, ((2, 1.0), (4, -1.0)), 3, False)
    assert p.constraint == Constraint(ConstraintKind.CHOICE, json.dumps(["a", "b"]))
    for kind, value in (("json_schema", "{}"), ("regex", "a"), ("lark", 'start: "a"'), ("gbnf", 'root ::= "a"')):
        constraint = request_from_proto(pb.GenerateRequest(model="m", prompt="x", sampling=pb.SamplingParams(
            constraint=pb.Constraint(**{kind: value})))).params.constraint
        assert constraint == Constraint(ConstraintKind(kind), value)
    with pytest.raises(InvalidArgument, match="logit_bias takes at most 300"):
        request_from_proto(pb.GenerateRequest(model="m", prompt="x", sampling=pb.SamplingParams(
            logit_bias={i: 1.0 for i in range(301)})))
    with pytest.raises(InvalidArgument, match="holds none"):
        request_from_proto(pb.GenerateRequest(model="m", prompt="x", sampling=pb.SamplingParams(
            constraint=pb.Constraint())))


def test_kserve_parameters_by_vllms_names():
    p = sampling_from_parameters({"guided_json": json.dumps(SCHEMA), "frequency_penalty": 1.0, "min_tokens": 2,
                                  "stop_token_ids": "[5, 6]", "logit_bias": '{"3": -2}',
                                  "include_stop_str_in_output": True})
    assert p.constraint.kind is ConstraintKind.JSON_SCHEMA and json.loads(p.constraint.spec) == SCHEMA
    assert (p.frequency_penalty, p.min_tokens, p.stop_token_ids, p.logit_bias, p.include_stop_str_in_output) == (
        1.0, 2, (5, 6), ((3, -2.0),), True)
    assert sampling_from_parameters({"guided_json_object": True}).constraint.kind is ConstraintKind.JSON_OBJECT
    assert sampling_from_parameters({"guided_grammar": 'root ::= "a"'}).constraint.kind is ConstraintKind.GBNF
    for bad, fragment in (({"guided_regex": "a", "guided_choice": '["a"]'}, "both constrain"),
                          ({"guided_choice": "[1]"}, "guided_choice"), ({"stop_token_ids": "[true]"}, "stop_token_ids"),
                          ({"logit_bias": json.dumps({str(i): 1 for i in range(301)})}, "at most 300")):
        with pytest.raises(InvalidArgument, match=fragment):
            sampling_from_parameters(bad)


def test_chat_template_kwargs_are_read_and_limited():
    fields = generation_fields({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, chat=True)
    assert fields.chat_template_kwargs == (("enable_thinking", False),)
    for bad in ([1], {"messages": []}, {f"k{i}": i for i in range(33)}, {"x": "y" * 9000}):
        with pytest.raises(FieldError) as failure:
            generation_fields({**CHAT, "chat_template_kwargs": bad}, chat=True)
        assert failure.value.param == "chat_template_kwargs"
    with pytest.raises(FieldError) as failure:  # completions have no template
        generation_fields({"model": "m", "prompt": "x", "chat_template_kwargs": {}}, chat=False)
    assert failure.value.param == "chat_template_kwargs"
    proto = request_from_proto(pb.GenerateRequest(model="m", messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="hi")]), chat_template_kwargs='{"enable_thinking": true}'))
    assert proto.chat_template_kwargs == (("enable_thinking", True),)
    with pytest.raises(InvalidArgument, match="chat_template_kwargs"):
        request_from_proto(pb.GenerateRequest(model="m", prompt="x", chat_template_kwargs="nope"))
