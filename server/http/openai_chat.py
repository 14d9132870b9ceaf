"""/v1/chat/completions and /v1/completions: one generation (n choices of
it), answered as one JSON object or as server-sent events, in OpenAI's
shapes."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from modeld.backends.errors import Cancelled, InvalidArgument, NotFound, Unavailable
from modeld.backends.generation.params import FinalEvent, FinishReason, GenerateRequest, TokenEvent
from modeld.backends.model_config import ToolParser
from modeld.server.dataplane import DataPlane
from modeld.server.http.common import BODY_SEND, unless_client_leaves
from modeld.server.http.jsonenc import dumps, sse_event
from modeld.server.http.openai_fields import FieldError, error_response, model_name, priority
from modeld.server.http.openai_sampling import GenerationFields, generation_fields
from modeld.server.http.openai_tools import AnswerReader, ToolFields, tool_fields
from modeld.server.request_context import current_request_id

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


async def answer_generation(plane: DataPlane, http: Request, body: dict, chat: bool) -> Response:
    return await _Generation(plane, http, body, chat).respond()


def _backend_name(plane: DataPlane, model: str, body: dict) -> str:
    """The serving backend, for refusals of what it cannot do (only looked up then)."""
    if body.get("prompt_logprobs") is None and not body.get("echo"):
        return ""
    status = plane.find_status(model)
    return status.backend if status is not None else ""


def _error_event(exc: BaseException, plane: DataPlane, model: str) -> bytes:
    """A failure after the stream began: the status line went out already,
    so the error travels as an event (the openai SDK raises it)."""
    response = error_response(exc, plane, model)
    return b"data: " + response.body + b"\n\n"


class _Logprobs:
    """Turns the engine's token ids into OpenAI's token strings, one
    detokenize per distinct id in the request."""

    def __init__(self, plane: DataPlane, model: str, top: int) -> None:
        self.plane, self.model, self.top = plane, model, top
        self._text: dict[int, str] = {}

    async def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = await self.plane.detokenize(self.model, [token_id])
        return self._text[token_id]

    async def entry(self, token_id: int, logprob: float) -> dict:
        text = await self.text(token_id)
        # a token holding part of a UTF-8 character decodes to U+FFFD; its
        # true bytes are not exposed by the engine, so say "unknown" (null)
        return {"token": text, "logprob": logprob, "bytes": None if "\ufffd" in text else list(text.encode())}

    async def chat(self, event: TokenEvent) -> list[dict]:
        out = []
        for i, chosen in enumerate(event.logprobs):
            entry = await self.entry(chosen.token_id, chosen.logprob)
            tops = event.top_logprobs[i] if i < len(event.top_logprobs) else ()
            entry["top_logprobs"] = [await self.entry(c.token_id, c.logprob) for c in tops[:self.top]]
            out.append(entry)
        return out

    async def completion(self, event: TokenEvent, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, chosen in enumerate(event.logprobs):
            text = await self.text(chosen.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(chosen.logprob)
            tops = event.top_logprobs[i] if i < len(event.top_logprobs) else ()
            out["top_logprobs"].append({await self.text(c.token_id): c.logprob for c in tops[:self.top]})
            out["text_offset"].append(offset)
            offset += len(text)
        return out


def _usage(finals: list[FinalEvent]) -> dict:
    """The prompt once (the choices share it), the completions of every
    sequence generated (best_of's discarded ones too, as OpenAI counts)."""
    first = finals[0].usage
    completion = sum(f.usage.completion_tokens for f in finals)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens}}


def _finish_reason(final: FinalEvent) -> str:
    reason = _FINISH.get(final.finish_reason)
    if reason is None:  # the engine raises for failures; anything else ended early
        raise Cancelled(f"the generation ended without finishing ({final.finish_reason.value})")
    return reason


def _open(plane: DataPlane, request: GenerateRequest, n: int):
    """(events, tagged): one choice's events as the engine streams them, or
    n choices' merged and tagged with their index. One choice, nearly every
    request, skips the tagging layer, which would be resumed for every token."""
    if n == 1:
        return plane.generate(request), False
    return plane.generate_choices(request, n), True


def _field_error(exc: InvalidArgument, constraint_field: str | None) -> InvalidArgument:
    """A constraint the engine cannot compile, before any token: named by
    the field the client sent it in."""
    if constraint_field is None or " constraint " not in f" {exc} ":
        return exc
    return FieldError(constraint_field, f"{constraint_field}: {exc}")


async def _first(events, tagged: bool, constraint_field: str | None) -> tuple[int, TokenEvent | FinalEvent]:
    """The first event to send, tagged with its choice (a failure's final
    event is skipped: the engine raises that failure right after it)."""
    try:
        while True:
            item = await anext(events)
            index, event = item if tagged else (0, item)
            if not (isinstance(event, FinalEvent) and event.error):
                return index, event
    except InvalidArgument as exc:
        raise _field_error(exc, constraint_field) from None


async def _events(events, tagged: bool,
                  constraint_field: str | None) -> AsyncIterator[tuple[int, TokenEvent | FinalEvent]]:
    """Every event of a JSON answer, tagged, as _first takes the first."""
    try:
        while True:
            try:
                yield await _first(events, tagged, constraint_field)
            except StopAsyncIteration:
                return
            constraint_field = None  # named only before the first token
    finally:
        # whoever stops early (a client that left, an error) frees the sequences now
        await events.aclose()


class _Choice:
    """One choice's answer as it accumulates (JSON answers only)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list = []
        self.cumulative_logprob = 0.0
        self.final: FinalEvent | None = None


class _EventStream(StreamingResponse):
    """Server-sent events written by a producer, `produce(send)`, that
    sends each body chunk itself rather than yielding it to starlette's
    loop: an async generator between the events and the socket is one more
    layer resumed for every token. `close` runs however the response ends
    (a client that left: starlette cancels the producer; a response never
    started), so the generation never outlives it.

    The response's start goes through every middleware (they add headers);
    its body chunks go straight to the server's own send where app.py's
    application left it in the scope (BODY_SEND): no middleware here
    changes a body, and each wrapper (four of them: starlette's error and
    exception handlers, the route's, the request id's) is another coroutine
    for every token."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Send], Awaitable[None]], close: Callable[[], Awaitable[None]],
                 headers: Mapping[str, str] | None = None) -> None:
        # StreamingResponse's own __init__ wants a body iterator; this has none
        self._produce, self._close = produce, close
        self._body_send = None
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        self._body_send = scope.get(BODY_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send or send
        await self._produce(body_send)
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})


def _body(chunk: bytes) -> dict:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


def _sse(payload: dict | str) -> bytes:
    return sse_event(payload)  # orjson: a chunk in about 3 us instead of 18


# where a chunk's delta or text goes, in _Generation._plain_event's frames
_MARK = "modeld-chunk-value-3f9c1e"
_MARK_JSON = dumps(_MARK)


class _Generation:
    """One chat or completion request, as JSON or as an event stream."""

    def __init__(self, plane: DataPlane, http: Request, body: dict, chat: bool) -> None:
        self.plane, self.http, self.chat = plane, http, chat
        self.model = model_name(body)
        fields = generation_fields(body, chat, _backend_name(plane, self.model, body))
        self.stream, self.include_usage, self.with_logprobs = fields.stream, fields.include_usage, fields.with_logprobs
        self.n, self.best_of, self.echo = fields.n, fields.best_of, fields.echo
        self.prompt_text = fields.prompt
        self.constraint_field = fields.constraint_field
        self.request_id = current_request_id()
        self.tools, self.tool_parser, self.reasoning_parser = ToolFields(), None, None
        params = self._read_tools(plane, body, fields) if chat else fields.params
        self.request = GenerateRequest(self.model, prompt=fields.prompt, token_ids=fields.token_ids,
                                       messages=fields.messages, params=params, request_id=self.request_id,
                                       priority=priority(body), tools=self.tools.tools,
                                       chat_template_kwargs=fields.chat_template_kwargs)
        self.logprobs = _Logprobs(plane, self.model, fields.top_logprobs)
        self.id = ("chatcmpl-" if chat else "cmpl-") + self.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._frames: dict[int, tuple[bytes, ...]] = {}  # per choice: _plain_event's

    def _read_tools(self, plane: DataPlane, body: dict, fields: GenerationFields):
        """The tool fields, and the sampling parameters with the grammar of a
        required call; the model's config says how its answers are read."""
        try:
            config = plane.model_config(self.model)
            tool_parser, self.reasoning_parser = config.tool_parser, config.reasoning_parser
        except NotFound:  # the generation says so in its own words (a name the engine resolves otherwise, say)
            tool_parser, self.reasoning_parser = ToolParser.HERMES, None
        self.tools = tool_fields(body, tool_parser)
        self.tool_parser = tool_parser if self.tools.reads_calls else None
        if self.tools.constraint is None:
            return fields.params
        if fields.params.constraint is not None:
            raise FieldError("tool_choice", f"tool_choice {self.tools.choice.value} constrains the answer to a call "
                                            f"and {fields.constraint_field} constrains it too; send one of them")
        self.constraint_field = "tool_choice"  # a grammar the engine refuses names the field it came from
        return replace(fields.params, constraint=self.tools.constraint)

    def _reader(self) -> AnswerReader:
        return AnswerReader(self.tool_parser, self.reasoning_parser)

    async def respond(self) -> Response:
        if self.echo and not self.prompt_text:  # a prompt of token ids echoes as its text
            self.prompt_text = await self.plane.detokenize(self.model, list(self.request.token_ids))
        events, tagged = _open(self.plane, self.request, self.best_of)
        if not self.stream:
            whole = _events(events, tagged, self.constraint_field)
            try:
                return JSONResponse(await unless_client_leaves(self.http, self._whole(whole)))
            finally:
                await whole.aclose()
        # errors before the first token (unknown model, prompt too long)
        # still get their HTTP status: the stream starts after it
        try:
            first = await unless_client_leaves(self.http, _first(events, tagged, self.constraint_field))
        except BaseException:
            await events.aclose()
            raise
        return _EventStream(lambda send: self._send_chunks(send, first, events, tagged), events.aclose,
                            headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    # -- one JSON answer

    async def _whole(self, events) -> dict:
        choices = [_Choice() for _ in range(self.best_of)]
        offsets = [len(self.prompt_text) if self.echo else 0] * self.best_of
        async for index, event in events:
            choice = choices[index]
            if isinstance(event, FinalEvent):
                choice.final = event
                continue
            choice.cumulative_logprob += sum(lp.logprob for lp in event.logprobs)
            if self.with_logprobs:
                choice.logprobs.append(await (self.logprobs.chat(event) if self.chat else
                                              self.logprobs.completion(event, offsets[index])))
            choice.text.append(event.text)
            offsets[index] += len(event.text)
        if any(c.final is None for c in choices):
            raise Unavailable("a choice's generation ended without a final event; retry")
        finals = [c.final for c in choices]
        answered = choices
        if self.best_of > self.n:  # OpenAI's best_of: the n most likely sequences, best first
            answered = sorted(choices, key=lambda c: -c.cumulative_logprob)[:self.n]
        out = []
        for index, choice in enumerate(answered):
            text = (self.prompt_text if self.echo else "") + "".join(choice.text)
            reason = _finish_reason(choice.final)
            if self.chat:
                reader = self._reader()
                reader.feed(text)
                reader.finish()
                entry = {"index": index, "message": reader.message(),
                         "logprobs": {"content": [e for part in choice.logprobs for e in part], "refusal": None}
                         if self.with_logprobs else None}
                reason = reader.finish_reason(reason)
            else:
                entry = {"index": index, "text": text,
                         "logprobs": _merge(choice.logprobs) if self.with_logprobs else None}
            entry["finish_reason"] = reason
            out.append(entry)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": _usage(finals), "system_fingerprint": None}

    # -- server-sent events

    def _chunk(self, delta: dict | None, text: str, logprobs, finish_reason: str | None, index: int = 0) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice], "system_fingerprint": None}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _plain_event(self, index: int, value: dict | str) -> bytes:
        """_sse(self._chunk(...)) of a chunk with no logprobs and no finish
        reason, whose delta (chat) or text (completions) is `value`: nearly
        every chunk of a stream. Everything around that value is the same
        for the whole stream, so it is encoded once (0.6 against 2.9 us a
        chunk here); only the value is encoded per token."""
        frame = self._frames.get(index)
        if frame is None:
            parts = _sse(self._chunk(_MARK, _MARK, None, None, index)).split(_MARK_JSON)
            # a model name or id that holds the mark itself: no frame, the whole chunk each time
            frame = self._frames[index] = tuple(parts) if len(parts) == 2 else ()
        if not frame:
            return _sse(self._chunk(value, "", None, None, index) if self.chat else
                        self._chunk(None, value, None, None, index))
        return frame[0] + dumps(value) + frame[1]

    async def _send_chunks(self, send: Send, first, events, tagged: bool) -> None:
        """The stream's chunks, each sent as it is made; events read here
        directly (not through _events), a generator layer less for every token."""
        offsets = [0] * self.n
        finals: dict[int, FinalEvent] = {}
        readers = [self._reader() for _ in range(self.n)] if self.chat else []
        try:
            for index in range(self.n):
                if self.chat:
                    await send(_body(_sse(self._chunk({"role": "assistant", "content": ""}, "", None, None, index))))
                elif self.echo:
                    await send(_body(_sse(self._chunk(None, self.prompt_text, None, None, index))))
                    offsets[index] = len(self.prompt_text)
            index, event = first
            while True:
                if isinstance(event, FinalEvent):
                    finals[index] = event
                    reason = _finish_reason(event)
                    if self.chat:
                        for delta in readers[index].finish():
                            await send(_body(_sse(self._chunk(delta, "", None, None, index))))
                        reason = readers[index].finish_reason(reason)
                    await send(_body(_sse(self._chunk({}, "", None, reason, index))))
                    if len(finals) == self.n:
                        if self.include_usage:
                            usage = {**self._chunk(None, "", None, None), "choices": [],
                                     "usage": _usage([finals[i] for i in range(self.n)])}
                            await send(_body(_sse(usage)))
                        await send(_body(_sse("[DONE]")))
                        return
                elif event.text or self.with_logprobs:  # else text held back (part of a character or a stop string)
                    logprobs = None
                    if self.with_logprobs:
                        logprobs = ({"content": await self.logprobs.chat(event), "refusal": None} if self.chat
                                    else await self.logprobs.completion(event, offsets[index]))
                    if self.chat:
                        # the answer's parts (reasoning, content, calls); text a
                        # parser holds back still carries its logprobs
                        deltas = readers[index].feed(event.text) or ([{}] if logprobs else [])
                        for i, delta in enumerate(deltas):
                            if logprobs is None or i:
                                await send(_body(self._plain_event(index, delta)))
                            else:
                                await send(_body(_sse(self._chunk(delta, "", logprobs, None, index))))
                    elif logprobs is None:
                        await send(_body(self._plain_event(index, event.text)))
                    else:
                        await send(_body(_sse(self._chunk(None, event.text, logprobs, None, index))))
                    offsets[index] += len(event.text)
                while True:  # a failure's final event is skipped: the engine raises the failure next
                    item = await events.__anext__()
                    index, event = item if tagged else (0, item)
                    if not (isinstance(event, FinalEvent) and event.error):
                        break
        except StopAsyncIteration:
            ended = Unavailable("the generation ended without a final event; retry")
            await send(_body(_error_event(ended, self.plane, self.model)))
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
            await send(_body(_error_event(exc, self.plane, self.model)))
        finally:
            await events.aclose()


def _merge(parts: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged
