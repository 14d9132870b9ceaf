"""Tool calling, whatever front the request came in by (OpenAI HTTP, gRPC
Generate): what `tool_choice` means for the answer, and reading the answer
back into calls.

`required` and a named function are enforced by a grammar: a Lark grammar
(llguidance's, each function's JSON schema inline) whose every sentence is
a call in the model's own format, compiled and applied by the engine like
any constraint, so the call is always valid JSON matching its schema.
`auto` lets the model choose and the answer is parsed by the family's
parser (server/http/tool_parsers.py, plain text in and out, no HTTP in it);
`none` leaves the functions out of the prompt, as vLLM does.

Each front reads its own wire shape into `ToolSpec`s and a `ToolChoice`
and names its own fields in errors: a failure here is a `ToolError`
carrying the path of the bad value as OpenAI spells it (`tools[0].function.
parameters`), which each front maps to its field names.
"""

from __future__ import annotations

import json
import uuid
from enum import Enum

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import Constraint, ConstraintKind, ToolSpec
from modeld.backends.model_config import ReasoningParser, ToolParser
from modeld.server.http.reasoning_parsers import new_reasoning_parser
from modeld.server.http.tool_parsers import CallArguments, CallStart, Content, new_tool_parser


class ToolChoice(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # one named function must be called


class ToolError(InvalidArgument):
    """Bad tool input at `where`, a path in OpenAI's spelling."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


def check_parameters(where: str, schema: object) -> str:
    """A function's parameters schema as JSON text; a schema that is not one
    is refused whatever tool_choice says, so a bad definition never reaches
    a template."""
    if not isinstance(schema, dict):
        raise ToolError(where, f"{where} must be a JSON schema object, got {type(schema).__name__}")
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as exc:
        at = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise ToolError(where, f"{where}{at} is not a valid JSON schema: {exc.message[:200]}") from None
    if schema.get("type", "object") != "object":
        raise ToolError(where, f"{where} must describe an object (type: object), got type {schema['type']!r}")
    return json.dumps(schema, ensure_ascii=False)


def call_constraint(parser: ToolParser, tools: tuple[ToolSpec, ...], choice: ToolChoice, named: str,
                    parallel: bool) -> Constraint | None:
    """The constraint `choice` puts on the answer: for required or named, the
    grammar of a call to one of the (chosen) functions; otherwise none."""
    if choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
        return None
    chosen = tuple(t for t in tools if t.name == named) if choice is ToolChoice.NAMED else tools
    if not chosen:
        raise ToolError("tool_choice", f"tool_choice names the function {named[:64]!r}, which tools does not define")
    for tool in chosen:
        _check_enforceable(tools.index(tool), tool, choice)
    return Constraint(ConstraintKind.LARK, call_grammar(parser, chosen, parallel))


def _check_enforceable(index: int, tool: ToolSpec, choice: ToolChoice) -> None:
    """A schema the grammar engine cannot enforce (a look-around pattern, a
    remote $ref) is refused naming its function, not as the whole grammar."""
    if not tool.parameters_json:
        return
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("json_schema", tool.parameters_json))
    if problem:
        where = f"tools[{index}].function.parameters"
        raise ToolError(where, f"{where} cannot be enforced for tool_choice {choice.value}: "
                               f"{problem.strip().splitlines()[-1][:200]}")


def call_grammar(parser: ToolParser, tools: tuple[ToolSpec, ...], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with `%json` schemas inline) whose
    every sentence is one call, or with `parallel` one or more, in the
    format `parser` reads, each function's arguments valid for its schema.
    Keys come in the trained order, name first, so the call streams."""
    key = "parameters" if parser is ToolParser.LLAMA3 else "arguments"
    any_object = '{"type": "object"}'
    rules = [f'fn_{i}: "{t.name}\\", \\"{key}\\": " %json {t.parameters_json or any_object}'
             for i, t in enumerate(tools)]
    body = '"{\\"name\\": \\"" (' + " | ".join(f"fn_{i}" for i in range(len(tools))) + ') "}"'
    if parser is ToolParser.LLAMA3:
        call, joiner = f"call: {body}", '"; "'
    else:
        call, joiner = f'call: "<tool_call>\\n" {body} "\\n</tool_call>"', '"\\n"'
    start = f"start: call ({joiner} call)*" if parallel else "start: call"
    return "\n".join([start, call, *rules]) + "\n"


# -- the answer --------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class AnswerReader:
    """One choice's text, read into OpenAI's message fields as it streams:
    `reasoning_content`, `content` and `tool_calls`."""

    def __init__(self, tool_parser: ToolParser | None, reasoning_parser: ReasoningParser | None) -> None:
        self.tools = new_tool_parser(tool_parser) if tool_parser is not None else None
        self.reasoning = new_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        self.call_ids: list[str] = []
        # the whole answer, for JSON
        self.content: list[str] = []
        self.reasoning_text: list[str] = []
        self.calls: list[dict] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.call_ids)

    def feed(self, text: str) -> list[dict]:
        """The deltas this piece of text makes sure of."""
        if self.reasoning is None:
            if self.tools is None:  # a plain answer, once a token: what _answer would make, directly
                if not text:
                    return []
                self.content.append(text)
                return [{"content": text}]
            return self._answer("", text, final=False)
        reasoning, content = self.reasoning.feed(text)
        return self._answer(reasoning, content, final=False)

    def finish(self) -> list[dict]:
        if self.reasoning is None:
            return self._answer("", "", final=True)
        reasoning, content = self.reasoning.finish()
        return self._answer(reasoning, content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> list[dict]:
        deltas = []
        if reasoning:
            self.reasoning_text.append(reasoning)
            deltas.append({"reasoning_content": reasoning})
        if self.tools is None:
            events = [Content(content)] if content else []
        else:
            events = self.tools.feed(content) if content else []
            if final:
                events += self.tools.finish()
        for event in events:
            deltas.append(self._delta(event))
        return deltas

    def _delta(self, event) -> dict:
        if isinstance(event, Content):
            self.content.append(event.text)
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.call_ids.append(new_call_id())
            self.calls.append({"id": self.call_ids[-1], "type": "function",
                               "function": {"name": event.name, "arguments": ""}})
            return {"tool_calls": [{"index": event.index, "id": self.call_ids[-1], "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        assert isinstance(event, CallArguments)
        self.calls[event.index]["function"]["arguments"] += event.text
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def message(self) -> dict:
        """The JSON answer's message, once `feed` and `finish` saw it all."""
        content = "".join(self.content)
        message = {"role": "assistant", "content": content if content or not self.calls else None,
                   "refusal": None}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(self.reasoning_text) or None
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def finish_reason(self, reason: str) -> str:
        """OpenAI says tool_calls for an answer that ended with calls."""
        return "tool_calls" if self.calls and reason == "stop" else reason
