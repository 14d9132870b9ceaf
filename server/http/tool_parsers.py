"""Reading tool calls back out of a model's text, as it streams.

A parser is fed the answer's text piece by piece (however the tokens cut
it) and returns what it can say for sure so far: `Content` (text for the
user), `CallStart` (a call's index and function name) and `CallArguments`
(the next fragment of that call's arguments JSON). Text that may still turn
out to be part of a call (the start of a `<tool_call>` tag, say) is held
back until it is known. A whole answer is the same parser fed once, so the
streamed and the one-piece answers always agree.

Arguments are the model's own JSON text for the arguments value, streamed
as it arrives when the call is written `{"name": ..., "arguments": ...}` in
that order (what the models are trained on, and what the grammar for
`tool_choice: required` produces); otherwise it comes whole when the call
ends. A call that never parses as a JSON object is given back as content.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from modeld.backends.model_config import ToolParser


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


ParseEvent = Content | CallStart | CallArguments

# {"name": "f", "arguments": — the head of a call in the trained order
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _Call:
    """One call's JSON object as it arrives. After the head, the arguments
    value is scanned structurally (strings and nesting), so every character
    given out belongs to it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.name: str | None = None
        self.args_start = self.args_end = self.scanned = self.sent = 0
        self.depth, self.in_string, self.escaped = 0, False, False
        self.is_complete = False  # the arguments value ended

    def feed(self, text: str) -> list[ParseEvent]:
        self.text += text
        events: list[ParseEvent] = []
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is None or self.text[head.end():head.end() + 1] not in ("{", "["):
                return events  # not yet, or not an object/array value: read whole at the end
            self.name = json.loads(f'"{head.group(1)}"')
            self.args_start = self.scanned = self.sent = head.end()
            events.append(CallStart(self.index, self.name))
        self._scan()
        end = self.args_end if self.is_complete else self.scanned
        if end > self.sent:
            events.append(CallArguments(self.index, self.text[self.sent:end]))
            self.sent = end
        return events

    def _scan(self) -> None:
        text, i = self.text, self.scanned
        while i < len(text) and not self.is_complete:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.is_complete, self.args_end = True, i + 1
            i += 1
        self.scanned = i

    def finish(self) -> list[ParseEvent] | None:
        """The rest of the call once its text is all there; None when it
        is no call at all (nothing was given out for it yet)."""
        if self.name is not None:
            return []  # streamed: what arrived is the call (cut short, it stays so)
        try:
            call = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return [CallStart(self.index, call["name"]), CallArguments(self.index, text)]

    @property
    def is_closed(self) -> bool:
        """The object's closing brace arrived after the arguments."""
        return self.is_complete and self.text[self.args_end:].strip().startswith("}")


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser(ABC):
    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[ParseEvent]: ...

    @abstractmethod
    def finish(self) -> list[ParseEvent]:
        """Everything held back, at the end of the answer."""


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
    of them, with text around (Hermes 2/3, Qwen 2.5 and 3, and modeld's own
    prompt for templates that do not render tools)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.call: _Call | None = None
        self.call_text = ""  # the raw text since the open tag, given back if it is no call

    def feed(self, text: str) -> list[ParseEvent]:
        self.buffer += text
        events: list[ParseEvent] = []
        while True:
            if self.call is None:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    keep = _held_back(self.buffer, self.OPEN)
                    _content(events, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return events
                _content(events, self.buffer[:at])
                self.buffer = self.buffer[at + len(self.OPEN):]
                self.call, self.call_text = _Call(self.num_calls), self.OPEN
                continue
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                keep = _held_back(self.buffer, self.CLOSE)
                events += self._into_call(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return events
            events += self._into_call(self.buffer[:at])
            self.call_text += self.CLOSE
            self.buffer = self.buffer[at + len(self.CLOSE):]
            events += self._end_call()

    def _into_call(self, text: str) -> list[ParseEvent]:
        self.call_text += text
        return self.call.feed(text)

    def _end_call(self) -> list[ParseEvent]:
        rest = self.call.finish()
        self.call = None
        if rest is None:
            return [Content(self.call_text)]
        self.num_calls += 1
        return rest

    def finish(self) -> list[ParseEvent]:
        if self.call is None:
            events: list[ParseEvent] = []
            _content(events, self.buffer)
            self.buffer = ""
            return events
        events = self._into_call(self.buffer)  # an answer cut short inside a call (max_tokens, a stop)
        self.buffer = ""
        return events + self._end_call()


class Llama3Parser(ToolCallParser):
    """Llama 3.1-3.3's JSON calls: the whole answer is
    `{"name": ..., "parameters": {...}}` (several joined by `;`), perhaps
    after `<|python_tag|>`; an answer that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.is_content: bool | None = None  # None: not known yet
        self.call: _Call | None = None

    def feed(self, text: str) -> list[ParseEvent]:
        if self.is_content:
            return [Content(text)] if text else []
        self.buffer += text
        events: list[ParseEvent] = []
        while True:
            if self.call is None:
                head = self.buffer.lstrip()
                if head.startswith(self.TAG):
                    head = head[len(self.TAG):].lstrip()
                if self.num_calls and head.startswith(";"):
                    head = head[1:].lstrip()
                if not head or (self.TAG.startswith(head) and self.is_content is None):
                    return events  # not known yet
                if not head.startswith("{"):
                    self.is_content = True
                    events.append(Content(self.buffer))
                    self.buffer = ""
                    return events
                self.is_content = False
                self.call, self.buffer = _Call(self.num_calls), head
                self.call_text = ""
            events += self.call.feed(self.buffer)
            self.call_text += self.buffer
            self.buffer = ""
            end = _object_end(self.call_text)
            if end is None:
                return events
            self.buffer = self.call_text[end:]
            self.call.text = self.call_text[:end]
            events += self._end_call()

    def _end_call(self) -> list[ParseEvent]:
        rest = self.call.finish()
        text, self.call = self.call_text, None
        if rest is None:
            self.is_content = True
            return [Content(text)]
        self.num_calls += 1
        return rest

    def finish(self) -> list[ParseEvent]:
        if self.call is not None:
            return self._end_call()
        if self.buffer and not self.num_calls and not self.is_content:
            text, self.buffer = self.buffer, ""
            return [Content(text)]
        return []


def _object_end(text: str) -> int | None:
    """The index after the JSON object `text` opens with, once it closed."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _content(events: list[ParseEvent], text: str) -> None:
    if text:
        events.append(Content(text))


_PARSERS = {ToolParser.HERMES: HermesParser, ToolParser.LLAMA3: Llama3Parser}


def new_tool_parser(kind: ToolParser) -> ToolCallParser:
    return _PARSERS[kind]()


@dataclass(frozen=True)
class ParsedAnswer:
    content: str
    calls: tuple[tuple[str, str], ...]  # (name, arguments JSON text) per call


def parse_answer(kind: ToolParser, text: str) -> ParsedAnswer:
    """A whole answer: its content and its calls."""
    parser = new_tool_parser(kind)
    return collect(parser.feed(text) + parser.finish())


def collect(events: list[ParseEvent]) -> ParsedAnswer:
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names[event.index] = event.name
            arguments.setdefault(event.index, [])
        else:
            arguments[event.index].append(event.text)
    calls = tuple((names[i], "".join(arguments[i]) or "{}") for i in sorted(names))
    return ParsedAnswer("".join(content), calls)
