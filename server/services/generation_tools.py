"""Tool calling on modeld.v1.Generation/Generate: the request's tools,
tool_choice, history with calls and chat_template_kwargs read into the
engine's terms, and each choice's answer read back into tool calls on its
last message. What the choice means (the grammar of a required call) and
the reading of the answer are the OpenAI route's own (server/tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import (
    MAX_TEMPLATE_KWARGS_BYTES, MAX_TOOL_CALLS, MAX_TOOLS, ChatMessage, Constraint, ToolCall, ToolSpec,
)
from modeld.backends.model_config import ReasoningParser, ToolParser
from modeld.gen import generation_pb2 as pb
from modeld.server.tool_calls import AnswerReader, ToolChoice, ToolError, call_constraint, check_parameters

MAX_CALL_ID_CHARS = 256
_ROLES = ("system", "user", "assistant", "tool")
_CHOICES = {
    pb.TOOL_CHOICE_NONE: ToolChoice.NONE,
    pb.TOOL_CHOICE_AUTO: ToolChoice.AUTO,
    pb.TOOL_CHOICE_REQUIRED: ToolChoice.REQUIRED,
    pb.TOOL_CHOICE_FUNCTION: ToolChoice.NAMED,
}


@dataclass(frozen=True)
class ToolRequest:
    """A Generate request's tool fields, checked."""

    tools: tuple[ToolSpec, ...] = ()  # rendered by the chat template (tool_choice none: nothing)
    choice: ToolChoice = ToolChoice.NONE
    constraint: Constraint | None = None  # required / function: the grammar of the call
    chat_template_kwargs: tuple[tuple[str, object], ...] = field(default=())

    @property
    def reads_calls(self) -> bool:
        return bool(self.tools)


def _grpc_where(where: str) -> str:
    """OpenAI's path of a field (tools[0].function.parameters) in the proto's spelling."""
    return where.replace(".function.", ".")


def messages_from_proto(messages) -> tuple[ChatMessage, ...]:
    return tuple(_message(i, m) for i, m in enumerate(messages))


def _message(i: int, msg: pb.ChatMessage) -> ChatMessage:
    where = f"messages[{i}]"
    if msg.role not in _ROLES:
        raise InvalidArgument(f"{where}.role must be one of {', '.join(_ROLES)}, got {msg.role[:40]!r}")
    if msg.tool_calls and msg.role != "assistant":
        raise InvalidArgument(f"{where}.tool_calls belongs to assistant messages")
    if len(msg.tool_calls) > MAX_TOOL_CALLS:
        raise InvalidArgument(f"{where}.tool_calls holds {len(msg.tool_calls)} calls, over the limit of "
                              f"{MAX_TOOL_CALLS}")
    if msg.role == "tool" and not msg.tool_call_id:
        raise InvalidArgument(f"{where} has role tool and needs tool_call_id, the id of the call it answers")
    if msg.role != "tool" and msg.tool_call_id:
        raise InvalidArgument(f"{where}.tool_call_id belongs to tool messages")
    calls = tuple(_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(msg.tool_calls))
    return ChatMessage(msg.role, msg.content, tool_calls=calls, tool_call_id=msg.tool_call_id, name=msg.name)


def _call(where: str, call: pb.ToolCall) -> ToolCall:
    if not 0 < len(call.id) <= MAX_CALL_ID_CHARS:
        raise InvalidArgument(f"{where}.id must be a string of 1 to {MAX_CALL_ID_CHARS} characters")
    if not call.name:
        raise InvalidArgument(f"{where}.name must name the function called")
    arguments = call.arguments or "{}"
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{where}.arguments must be a JSON object's text")
    return ToolCall(call.id, call.name, arguments)


def tool_request(msg: pb.GenerateRequest, parser: ToolParser) -> ToolRequest:
    """tools, tool_choice, parallel_tool_calls and chat_template_kwargs; with
    tool_choice required or function, the constraint of the call."""
    kwargs = _template_kwargs(msg.chat_template_kwargs)
    if len(msg.tools) > MAX_TOOLS:  # before reading any schema
        raise InvalidArgument(f"tools takes at most {MAX_TOOLS} functions, got {len(msg.tools)}")
    tools = tuple(_tool(i, t) for i, t in enumerate(msg.tools))
    choice, named = _choice(msg, tools)
    if choice is ToolChoice.NONE:
        return ToolRequest(chat_template_kwargs=kwargs)
    if msg.WhichOneof("input") != "messages":
        raise InvalidArgument("tools need messages input: the model's chat template renders them")
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True
    try:
        constraint = call_constraint(parser, tools, choice, named, parallel)
    except ToolError as exc:
        raise InvalidArgument(_grpc_where(str(exc))) from None
    return ToolRequest(tools, choice, constraint, kwargs)


def _tool(index: int, tool: pb.Tool) -> ToolSpec:
    where = f"tools[{index}]"
    ToolSpec(tool.name, tool.description, tool.parameters).validate(where)  # sizes, before any parsing
    parameters = ""
    if tool.parameters:
        try:
            schema = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{where}.parameters is not valid JSON: {exc}") from None
        try:
            parameters = check_parameters(f"{where}.parameters", schema)
        except ToolError as exc:
            raise InvalidArgument(str(exc)) from None
    return ToolSpec(tool.name, tool.description, parameters)


def _choice(msg: pb.GenerateRequest, tools: tuple[ToolSpec, ...]) -> tuple[ToolChoice, str]:
    mode = msg.tool_choice.mode
    if mode == pb.TOOL_CHOICE_UNSPECIFIED:
        choice = ToolChoice.AUTO if tools else ToolChoice.NONE
    elif mode in _CHOICES:
        choice = _CHOICES[mode]
    else:  # an enum value from a newer client: refuse rather than guess
        raise InvalidArgument(f"unknown tool_choice mode {mode}; use one of "
                              + ", ".join(pb.ToolChoiceMode.Name(v) for v in (0, *_CHOICES)))
    named = msg.tool_choice.function
    if named and choice is not ToolChoice.NAMED:
        raise InvalidArgument("tool_choice.function is for mode TOOL_CHOICE_FUNCTION; set that mode or leave the "
                              "function out")
    if choice is ToolChoice.NAMED and not named:
        raise InvalidArgument("tool_choice mode TOOL_CHOICE_FUNCTION needs tool_choice.function, the name of the "
                              "function to call")
    if choice is not ToolChoice.NONE and not tools:
        raise InvalidArgument(f"tool_choice {pb.ToolChoiceMode.Name(mode)} needs tools: define at least one function")
    return choice, named


def _template_kwargs(text: str) -> tuple[tuple[str, object], ...]:
    """chat_template_kwargs' JSON text as (name, value) pairs; the engine
    checks the names and counts (params.check_template_kwargs)."""
    if not text:
        return ()
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidArgument(f"chat_template_kwargs is over the limit of {MAX_TEMPLATE_KWARGS_BYTES} bytes")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"chat_template_kwargs is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("chat_template_kwargs must be a JSON object of template variables")
    return tuple(value.items())


class ChoiceAnswers:
    """The answer of each choice read as it streams, so its last message can
    carry the calls it made."""

    def __init__(self, tool_parser: ToolParser, reasoning_parser: ReasoningParser | None) -> None:
        self._parsers = (tool_parser, reasoning_parser)
        self._readers: dict[int, AnswerReader] = {}

    def feed(self, index: int, text: str) -> None:
        if text:
            self._reader(index).feed(text)

    def finish(self, index: int, response: pb.GenerateResponse) -> None:
        """Set the answer's calls and content on the choice's last message;
        an answer that ended (stop) with calls finishes with TOOL_CALLS."""
        reader = self._reader(index)
        reader.finish()
        message = reader.message()
        response.content = message["content"] or ""
        for call in message.get("tool_calls", ()):
            response.tool_calls.add(id=call["id"], name=call["function"]["name"],
                                    arguments=call["function"]["arguments"])
        if response.tool_calls and response.finish_reason == pb.FINISH_REASON_STOP:
            response.finish_reason = pb.FINISH_REASON_TOOL_CALLS

    def _reader(self, index: int) -> AnswerReader:
        if index not in self._readers:
            self._readers[index] = AnswerReader(*self._parsers)
        return self._readers[index]
