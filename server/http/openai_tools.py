"""Tool calling on /v1/chat/completions, in OpenAI's shape.

Request side: `messages` with assistant `tool_calls` and `tool` results,
`tools` (function definitions whose `parameters` are JSON schemas),
`tool_choice` (`none`, `auto`, `required` or one named function) and
`parallel_tool_calls`, each bad value refused naming its field. The
functions reach the model through its own chat template
(backends/generation/chat_template.py); what the choice means for the
answer (the grammar of a required call) and reading the answer back into
`reasoning_content`, `content` and `tool_calls` (`AnswerReader`) are
shared with gRPC Generate in server/tool_calls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from modeld.backends.generation.params import MAX_TOOL_CALLS, MAX_TOOLS, ChatMessage, Constraint, ToolCall, ToolSpec
from modeld.backends.model_config import ToolParser
from modeld.server.http.common import json_type_name
from modeld.server.http.openai_fields import FieldError
# what every front shares, re-exported for this module's readers
from modeld.server.tool_calls import (  # noqa: F401
    AnswerReader, ToolChoice, ToolError, call_constraint, call_grammar, check_parameters, new_call_id,
)

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
MAX_CALL_ID_CHARS = 256


@dataclass(frozen=True)
class ToolFields:
    """A chat request's tool fields, checked."""

    tools: tuple[ToolSpec, ...] = ()  # what the template renders ("none": nothing)
    choice: ToolChoice = ToolChoice.NONE
    parallel: bool = True
    constraint: Constraint | None = None  # required / named: the grammar of the call

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is parsed for calls."""
        return bool(self.tools)


# -- messages ------------------------------------------------------------------


def chat_messages(body: dict) -> tuple[ChatMessage, ...]:
    """`messages`, tool calls and results included; a tool result must answer
    a call an earlier assistant message made."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty array of {role, content} objects")
    out: list[ChatMessage] = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        parsed = _message(i, message)
        if parsed.role == "tool" and parsed.tool_call_id not in call_ids:
            raise FieldError(f"messages[{i}].tool_call_id",
                             f"messages[{i}].tool_call_id {parsed.tool_call_id[:64]!r} answers no tool call of an "
                             "earlier assistant message; give the id of the call this result answers")
        call_ids.update(c.id for c in parsed.tool_calls)
        out.append(parsed)
    return tuple(out)


def _message(i: int, message: object) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise FieldError(where, f"{where} must be an object, got {json_type_name(message)}")
    extra = sorted(set(message) - _MESSAGE_KEYS)
    if extra:
        raise FieldError(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported; a message has "
                                                f"{', '.join(sorted(_MESSAGE_KEYS))}")
    role = message.get("role")
    if role not in _ROLES:
        raise FieldError(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}, "
                                          f"got {json.dumps(role)[:40]}")
    name = _optional_string(message, "name", where)
    calls = _tool_calls(where, message.get("tool_calls")) if role == "assistant" else ()
    if role != "assistant" and message.get("tool_calls") is not None:
        raise FieldError(f"{where}.tool_calls", f"{where}.tool_calls belongs to assistant messages")
    content = message.get("content")
    text = "" if content is None and calls else _content(f"{where}.content", content)
    call_id = ""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise FieldError(f"{where}.tool_call_id", f"{where} has role tool and needs tool_call_id, the id of "
                                                      "the call it answers")
    elif message.get("tool_call_id") is not None:
        raise FieldError(f"{where}.tool_call_id", f"{where}.tool_call_id belongs to tool messages")
    return ChatMessage(_ROLES[role], text, tool_calls=calls, tool_call_id=call_id, name=name)


def _optional_string(message: dict, key: str, where: str) -> str:
    value = message.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(f"{where}.{key}", f"{where}.{key} must be a string, got {json_type_name(value)}")
    return value


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise FieldError(f"{where}[{j}]", f"{where}[{j}] is a {kind or json_type_name(part)} part; this "
                                                  "server takes text only ({'type': 'text', 'text': ...})")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise FieldError(f"{where}[{j}]", f"{where}[{j}] must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "".join(texts)
    raise FieldError(where, f"{where} must be a string or an array of text parts, got {json_type_name(content)}")


def _tool_calls(where: str, calls: object) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise FieldError(f"{where}.tool_calls", f"{where}.tool_calls must be an array, got {json_type_name(calls)}")
    if len(calls) > MAX_TOOL_CALLS:
        raise FieldError(f"{where}.tool_calls", f"{where}.tool_calls holds {len(calls)} calls, over the limit of "
                                                f"{MAX_TOOL_CALLS}")
    return tuple(_tool_call(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(calls))


def _tool_call(where: str, call: object) -> ToolCall:
    shape = f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': <JSON text>}}}}"
    if not isinstance(call, dict) or call.get("type", "function") != "function" or set(call) - {"id", "type",
                                                                                                "function"}:
        raise FieldError(where, shape)
    call_id, function = call.get("id"), call.get("function")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
        raise FieldError(f"{where}.id", f"{where}.id must be a string of 1 to {MAX_CALL_ID_CHARS} characters")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or set(function) - {"name", "arguments"}:
        raise FieldError(f"{where}.function", shape)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise FieldError(f"{where}.function.arguments", f"{where}.function.arguments must be JSON text (a string), "
                                                        f"got {json_type_name(arguments)}")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise FieldError(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object's text")
    return ToolCall(call_id, function["name"], arguments)


# -- tools and tool_choice -------------------------------------------------------


def tool_fields(body: dict, parser: ToolParser) -> ToolFields:
    tools = _tools(body.get("tools"))
    choice, named = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if choice is ToolChoice.NONE:
        return ToolFields()
    try:
        constraint = call_constraint(parser, tools, choice, named, parallel)
    except ToolError as exc:
        raise FieldError(exc.where, str(exc)) from None
    return ToolFields(tools, choice, parallel, constraint)


def _tools(value: object) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise FieldError("tools", f"tools must be an array of function definitions, got {json_type_name(value)}")
    if len(value) > MAX_TOOLS:
        raise FieldError("tools", f"tools takes at most {MAX_TOOLS} functions, got {len(value)}")
    out = [_tool(f"tools[{i}]", tool) for i, tool in enumerate(value)]
    seen: set[str] = set()
    for i, tool in enumerate(out):
        if tool.name in seen:
            raise FieldError(f"tools[{i}].function.name", f"tools[{i}].function.name {tool.name!r} is given twice; "
                                                          "function names must be distinct")
        seen.add(tool.name)
    return tuple(out)


def _tool(where: str, tool: object) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise FieldError(where, f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                "<JSON schema>}}}}")
    function = tool["function"]
    extra = sorted(set(function) - _FUNCTION_KEYS)
    if extra or set(tool) - {"type", "function"}:
        key = f"function.{extra[0]}" if extra else sorted(set(tool) - {"type", "function"})[0]
        raise FieldError(f"{where}.{key}", f"{where}.{key} is not supported; a function has "
                                           f"{', '.join(sorted(_FUNCTION_KEYS))}")
    name, description = function.get("name"), function.get("description", "")
    if not isinstance(name, str):
        raise FieldError(f"{where}.function.name", f"{where}.function.name must be a string")
    if not isinstance(description, str):
        raise FieldError(f"{where}.function.description", f"{where}.function.description must be a string")
    spec = ToolSpec(name, description, _parameters(f"{where}.function.parameters", function.get("parameters")))
    try:
        spec.validate(f"{where}.function")
    except Exception as exc:  # noqa: BLE001 - InvalidArgument, re-raised naming the field
        raise FieldError(f"{where}.function", str(exc)) from None
    return spec


def _parameters(where: str, schema: object) -> str:
    """The schema as JSON text (server/tool_calls.py checks it)."""
    if schema is None:
        return ""
    if not isinstance(schema, dict):
        raise FieldError(where, f"{where} must be a JSON schema object, got {json_type_name(schema)}")
    try:
        return check_parameters(where, schema)
    except ToolError as exc:
        raise FieldError(exc.where, str(exc)) from None


def _tool_choice(value: object, tools: tuple[ToolSpec, ...]) -> tuple[ToolChoice, str]:
    if value is None:
        return (ToolChoice.AUTO if tools else ToolChoice.NONE), ""
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
        if choice is not ToolChoice.NONE and not tools:
            raise FieldError("tool_choice", f"tool_choice {value!r} needs tools: define at least one function")
        return choice, ""
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        name = value["function"]["name"]
        if name not in {t.name for t in tools}:
            raise FieldError("tool_choice", f"tool_choice names the function {name[:64]!r}, which tools does not "
                                            "define")
        return ToolChoice.NAMED, name
    raise FieldError("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', 'function': "
                                    f"{{'name': ...}}}}, got {json.dumps(value)[:80]}")
