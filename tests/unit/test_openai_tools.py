"""The tool fields of a chat request, read into the engine's terms: messages
with calls and results, function definitions, tool_choice and the grammar
it implies; each bad input names its field."""

from __future__ import annotations

import json

import pytest

from modeld.backends.generation.params import ChatMessage, ConstraintKind, GenerateRequest, ToolCall
from modeld.backends.model_config import ToolParser
from modeld.server.http.openai_fields import FieldError
from modeld.server.http.openai_tools import ToolChoice, chat_messages, tool_fields

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
]


def test_messages_carry_calls_and_results():
    messages = chat_messages({"messages": HISTORY})
    assert messages == (
        ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"))
    GenerateRequest("m", messages=messages).validate()  # the engine's own check agrees


def test_tool_choice_decides_what_is_rendered_and_enforced():
    auto = tool_fields({"tools": [TOOL, CLOCK]}, ToolParser.HERMES)
    assert auto.choice is ToolChoice.AUTO and [t.name for t in auto.tools] == ["get_weather", "get_time"]
    assert json.loads(auto.tools[0].parameters_json) == SCHEMA and auto.constraint is None
    none = tool_fields({"tools": [TOOL], "tool_choice": "none"}, ToolParser.HERMES)
    assert none.tools == () and not none.reads_calls
    required = tool_fields({"tools": [TOOL, CLOCK], "tool_choice": "required"}, ToolParser.HERMES)
    assert required.constraint.kind is ConstraintKind.LARK and "fn_1" in required.constraint.spec
    named = tool_fields({"tools": [TOOL, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                         "parallel_tool_calls": False}, ToolParser.LLAMA3)
    assert named.tools == required.tools  # every function is still rendered
    assert '"get_time\\", \\"parameters\\": "' in named.constraint.spec and "get_weather" not in named.constraint.spec
    assert named.constraint.spec.startswith("start: call\n")


BAD = [
    ({"messages": HISTORY[:2] + [HISTORY[3]]}, "messages[2].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "", "type": "function",
                                                         "function": {"name": "f"}}]}]}, "messages[0].tool_calls[0].id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}] * 129}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_messages_name_the_field(body, param):
    with pytest.raises(FieldError) as caught:
        chat_messages(body)
    assert caught.value.param == param


BAD_TOOLS = [
    ({"tools": TOOL}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools[0].function.returns"),
    ({"tools": [{"type": "function", "function": {"name": "a" * 65}}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "object", "description": "x" * 17000}}}]},
     "tools[0].function"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
]


@pytest.mark.parametrize(("body", "param"), BAD_TOOLS, ids=[f"{i}:{p}" for i, (_, p) in enumerate(BAD_TOOLS)])
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(FieldError) as caught:
        tool_fields(body, ToolParser.HERMES)
    assert caught.value.param == param
