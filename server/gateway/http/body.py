"""A request body as the HTTP gateway reads it: whole but bounded, and
walked only as far as routing needs.

The gateway forwards the bytes the client sent. To route a /v1 call it needs
the body's top-level `model` (and, for prefix affinity, the prompt), so
`routing_fields` walks the top-level object and decodes only the values it
was asked for; every other value is skipped by regular expressions that run
in C (strings and brackets), never built into Python objects. The walk is
bounded by the number of top-level keys.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass

from modeld.backends.digits import ascii_digits


class BodyError(ValueError):
    """The body cannot be routed (400): not a JSON object, or no usable model."""


class BodyTooLarge(Exception):
    """The body passes the gateway's http_max_body_bytes (413)."""


class ClientGone(Exception):
    """The client disconnected before its body was read."""


# a JSON string (escapes included), or a bracket: what skipping a value steps over
# (the unrolled form: one C loop per run of plain characters, not one step per character)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NESTED = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_SCALAR = re.compile(r"[^,}\]\s]+")
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class Fields:
    """The top-level values routing asked for (absent: not in `values`), and
    how many top-level keys the object has."""

    values: dict
    num_keys: int


async def read_body(receive, declared: str | None, limit: int) -> bytes:
    """The whole body, refused (BodyTooLarge) as soon as it passes `limit`:
    by its Content-Length before a byte is read, else while it streams in."""
    if declared is not None and ascii_digits(declared) and int(declared) > limit:
        raise BodyTooLarge(int(declared))
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip or deflate body decompressed, bounded by `limit` (a small body
    must not inflate past it)."""
    if encoding not in ("gzip", "deflate"):
        raise BodyError(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or identity")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BodyError(f"the request body is not valid {encoding} data: {exc}") from None
    if len(data) > limit or inflater.unconsumed_tail:
        raise BodyTooLarge(len(data))
    return data


def routing_fields(body: bytes, wanted: frozenset[str], max_keys: int) -> Fields:
    """The values of the top-level keys in `wanted` (the last one of a key
    that repeats, as json.loads reads it), decoded; the rest skipped."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the request body is not UTF-8 JSON: {exc}") from None
    return _Walk(text, wanted, max_keys).run()


class _Walk:
    __slots__ = ("text", "wanted", "max_keys", "pos")

    def __init__(self, text: str, wanted: frozenset[str], max_keys: int) -> None:
        self.text, self.wanted, self.max_keys, self.pos = text, wanted, max_keys, 0

    def run(self) -> Fields:
        values: dict = {}
        self._space()
        if not self._take("{"):
            raise BodyError("the request body must be a JSON object")
        num_keys = 0
        self._space()
        if self._take("}"):
            return self._end(values, num_keys)
        while True:
            num_keys += 1
            if num_keys > self.max_keys:
                raise BodyError(f"the request body has more than {self.max_keys} top-level keys, the gateway's "
                                "max_request_fields")
            key = self._string()
            self._space()
            if not self._take(":"):
                self._fail("':' after a key")
            self._space()
            if key in self.wanted:
                values[key] = self._value()
            else:
                self._skip()
            self._space()
            if self._take("}"):
                return self._end(values, num_keys)
            if not self._take(","):
                self._fail("',' or '}'")
            self._space()

    def _end(self, values: dict, num_keys: int) -> Fields:
        self._space()
        if self.pos != len(self.text):
            self._fail("the end of the body after its object")
        return Fields(values, num_keys)

    def _space(self) -> None:
        self.pos = _SPACE.match(self.text, self.pos).end()

    def _take(self, char: str) -> bool:
        if self.text.startswith(char, self.pos):
            self.pos += 1
            return True
        return False

    def _fail(self, expected: str):
        raise BodyError(f"the request body is not valid JSON: expected {expected} at character {self.pos}")

    def _string(self) -> str:
        match = _STRING.match(self.text, self.pos)
        if match is None:
            self._fail("a string key")
        self.pos = match.end()
        return json.loads(match.group())

    def _value(self):
        start = self.pos
        self._skip()
        try:
            return json.loads(self.text[start:self.pos])
        except (ValueError, RecursionError) as exc:
            raise BodyError(f"the request body is not valid JSON: {exc}") from None

    def _skip(self) -> None:
        text, pos = self.text, self.pos
        char = text[pos:pos + 1]
        if char == '"':
            match = _STRING.match(text, pos)
            if match is None:
                self._fail("the end of a string")
            self.pos = match.end()
        elif char in ("{", "["):
            self.pos = self._skip_nested(pos)
        else:
            match = _SCALAR.match(text, pos)
            if match is None:
                self._fail("a value")
            self.pos = match.end()

    def _skip_nested(self, pos: int) -> int:
        """Past the object or array at `pos`: brackets counted, strings (which
        may hold brackets) stepped over whole; its content is the node's to check."""
        depth = 0
        for match in _NESTED.finditer(self.text, pos):
            token = match.group()
            if token in ("{", "["):
                depth += 1
            elif token in ("}", "]"):
                depth -= 1
                if depth == 0:
                    return match.end()
        self._fail("the end of a nested value")


def model_of(fields: Fields) -> str:
    """The body's model, or BodyError in the words the daemon uses."""
    if "model" not in fields.values or fields.values["model"] is None:
        raise BodyError("model is required: name a model (GET /v1/models lists them)")
    model = fields.values["model"]
    if not isinstance(model, str):
        raise BodyError(f"model must be a string naming a model (GET /v1/models lists them), "
                        f"got {type(model).__name__}")
    if not model:
        raise BodyError("model is required: name a model (GET /v1/models lists them)")
    return model


def chat_turns(fields: Fields) -> list[tuple[str, str]] | None:
    """A chat's (role, text) turns, for the prefix index and the nodes' KV
    block lookup; None for a body that is not a readable chat."""
    messages = fields.values.get("messages")
    if not isinstance(messages, list):
        return None
    turns = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role, content = message.get("role", ""), message.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                              and isinstance(p.get("text", ""), str))
        turns.append((role if isinstance(role, str) else "", content if isinstance(content, str) else ""))
    return turns


def prompt_text(fields: Fields) -> str | None:
    prompt = fields.values.get("prompt")
    return prompt if isinstance(prompt, str) else None


def prompt_key(fields: Fields) -> str:
    """The prompt as the prefix index keys it (the gRPC front's shape:
    chat turns separated by control characters no message text holds)."""
    turns = chat_turns(fields)
    if turns is not None:
        return "".join(f"{role}\x1f{content}\x1e" for role, content in turns)
    return prompt_text(fields) or ""


def with_model(body: bytes, num_keys: int, model: str) -> bytes:
    """The body with its model replaced by appending `"model": model` to the
    object: json.loads keeps the last value of a repeated key, so the body
    is never decoded and encoded again (a traffic split's target)."""
    end = body.rstrip().rfind(b"}")
    extra = (b"," if num_keys else b"") + b'"model":' + json.dumps(model).encode()
    return body[:end] + extra + body[end:]
