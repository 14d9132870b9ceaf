"""gRPC Generate's tool fields read into the engine's terms (the same
ToolSpecs, history and call grammar as the OpenAI route), and a choice's
answer read back onto its last message."""

from __future__ import annotations

import json

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import ChatMessage, ConstraintKind, ToolCall
from modeld.backends.model_config import ToolParser
from modeld.gen import generation_pb2 as pb
from modeld.server.http.openai_tools import tool_fields
from modeld.server.services.generation import request_from_proto
from modeld.server.services.generation_tools import ChoiceAnswers

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = pb.Tool(name="get_weather", description="Weather", parameters=json.dumps(SCHEMA))
CLOCK = pb.Tool(name="get_time")
ASK = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")])


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(model="m", messages=ASK, tools=[WEATHER, CLOCK], **fields)


def test_tools_and_choices_mean_what_they_mean_over_http():
    openai_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                      "parameters": SCHEMA}},
                    {"type": "function", "function": {"name": "get_time"}}]
    for mode, http_choice in ((pb.TOOL_CHOICE_UNSPECIFIED, None), (pb.TOOL_CHOICE_AUTO, "auto"),
                              (pb.TOOL_CHOICE_REQUIRED, "required"), (pb.TOOL_CHOICE_NONE, "none")):
        ours = request_from_proto(_request(tool_choice=pb.ToolChoice(mode=mode), parallel_tool_calls=False))
        http = tool_fields({"tools": openai_tools, "tool_choice": http_choice, "parallel_tool_calls": False},
                           ToolParser.HERMES)
        assert ours.tools == http.tools
        assert ours.params.constraint == http.constraint
    named = request_from_proto(_request(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_FUNCTION, function="get_time")))
    assert named.params.constraint.kind is ConstraintKind.LARK and "get_weather" not in named.params.constraint.spec
    llama3 = request_from_proto(_request(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED)), ToolParser.LLAMA3)
    assert '\\"parameters\\"' in llama3.params.constraint.spec  # the model's own format


def test_history_with_calls_and_results():
    messages = pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="hi"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_time", arguments='{"a": 1}')]),
        pb.ChatMessage(role="tool", tool_call_id="c1", name="get_time", content="noon")])
    request = request_from_proto(pb.GenerateRequest(model="m", messages=messages))
    assert request.messages[1:] == (ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_time", '{"a": 1}'),)),
                                    ChatMessage("tool", "noon", tool_call_id="c1", name="get_time"))
    request.validate()


@pytest.mark.parametrize("fields, named", [
    (dict(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_FUNCTION, function="nope")), "'nope'"),
    (dict(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_AUTO, function="get_time")), "TOOL_CHOICE_FUNCTION"),
    (dict(tool_choice=pb.ToolChoice(mode=7)), "unknown tool_choice mode 7"),
    (dict(tools=[pb.Tool(name="f", parameters='{"type": "object", "properties": 3}')]), "tools[0].parameters"),
    (dict(tools=[pb.Tool(name="f" * 65)]), "tools[0].name"),
    (dict(tools=[pb.Tool(name="f", parameters="x" * 17000)]), "tools[0].parameters is 17000 bytes"),
    (dict(tools=[pb.Tool(name=f"f{i}") for i in range(129)]), "at most 128"),
    (dict(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
          sampling=pb.SamplingParams(constraint=pb.Constraint(regex="a"))), "send one of them"),
])
def test_bad_tool_fields_are_refused_naming_the_field(fields, named):
    request = _request()
    for key, value in fields.items():
        request.ClearField(key)
        if key == "tools":
            request.tools.extend(value)
        else:
            getattr(request, key).CopyFrom(value)
    with pytest.raises(InvalidArgument) as failure:
        request_from_proto(request).validate()
    assert named in str(failure.value)


def test_bad_history_is_refused_naming_the_message():
    for message, named in ((pb.ChatMessage(role="tool", content="x"), "needs tool_call_id"),
                           (pb.ChatMessage(role="user", tool_call_id="c"), "belongs to tool messages"),
                           (pb.ChatMessage(role="robot"), "messages[0].role"),
                           (pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f",
                                                                                     arguments="[1]")]),
                            "messages[0].tool_calls[0].arguments")):
        with pytest.raises(InvalidArgument, match=named.replace("[", r"\[")):
            request_from_proto(pb.GenerateRequest(model="m", messages=pb.ChatMessages(messages=[message])))


def test_a_choices_answer_is_read_onto_its_last_message():
    answers = ChoiceAnswers(ToolParser.HERMES, None)
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for i in range(0, len(text), 7):
        answers.feed(1, text[i:i + 7])
    last = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, index=1)
    answers.finish(1, last)
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS and last.content == "Sure."
    [call] = last.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.id
    plain = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, index=0)
    answers.feed(0, "no call here")
    answers.finish(0, plain)
    assert plain.finish_reason == pb.FINISH_REASON_LENGTH and not plain.tool_calls and plain.content == "no call here"
