"""/v1/chat/completions and /v1/completions: one generation, answered as
one JSON object or as server-sent events, in OpenAI's shapes."""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from modeld.backends.errors import Cancelled, Unavailable
from modeld.backends.generation.params import FinalEvent, FinishReason, GenerateRequest, TokenEvent
from modeld.server.dataplane import DataPlane
from modeld.server.http.common import unless_client_leaves
from modeld.server.http.openai_fields import error_response, model_name, priority
from modeld.server.http.openai_sampling import generation_fields
from modeld.server.request_context import current_request_id

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


async def answer_generation(plane: DataPlane, http: Request, body: dict, chat: bool) -> Response:
    return await _Generation(plane, http, body, chat).respond()


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


def _usage(final: FinalEvent) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def _finish_reason(final: FinalEvent) -> str:
    reason = _FINISH.get(final.finish_reason)
    if reason is None:  # the engine raises for failures; anything else ended early
        raise Cancelled(f"the generation ended without finishing ({final.finish_reason.value})")
    return reason


async def _events(plane: DataPlane, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
    """The engine's events, without the final event of a failure (the
    engine raises that failure right after it)."""
    events = plane.generate(request)
    try:
        async for event in events:
            if isinstance(event, FinalEvent) and event.error:
                continue
            yield event
    finally:
        # whoever stops early (a client that left, an error) frees the sequence now
        await events.aclose()


class _EventStream(StreamingResponse):
    """Server-sent events whose producer is closed however the response
    ends: on a client disconnect starlette either cancels the producer or
    (ASGI 2.4 servers) just stops iterating it, which alone would leave the
    generation running."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Generation:
    """One chat or completion request, as JSON or as an event stream."""

    def __init__(self, plane: DataPlane, http: Request, body: dict, chat: bool) -> None:
        self.plane, self.http, self.chat = plane, http, chat
        self.model = model_name(body)
        fields = generation_fields(body, chat)
        self.stream, self.include_usage, self.with_logprobs = fields.stream, fields.include_usage, fields.with_logprobs
        self.request_id = current_request_id()
        self.request = GenerateRequest(self.model, prompt=fields.prompt, token_ids=fields.token_ids,
                                       messages=fields.messages, params=fields.params, request_id=self.request_id,
                                       priority=priority(body))
        self.logprobs = _Logprobs(plane, self.model, fields.top_logprobs)
        self.id = ("chatcmpl-" if chat else "cmpl-") + self.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def respond(self) -> Response:
        events = _events(self.plane, self.request)
        if not self.stream:
            try:
                return JSONResponse(await unless_client_leaves(self.http, self._whole(events)))
            finally:
                await events.aclose()
        # errors before the first token (unknown model, prompt too long)
        # still get their HTTP status: the stream starts after it
        try:
            first = await unless_client_leaves(self.http, anext(events))
        except BaseException:
            await events.aclose()
            raise
        return _EventStream(self._chunks(first, events), headers={"cache-control": "no-cache",
                                                                  "x-accel-buffering": "no"})

    # -- one JSON answer

    async def _whole(self, events) -> dict:
        text, logprobs, final = [], [], None
        offset = 0
        async for event in events:
            if isinstance(event, FinalEvent):
                final = event
                continue
            if self.with_logprobs:
                logprobs.append(await (self.logprobs.chat(event) if self.chat else
                                       self.logprobs.completion(event, offset)))
            text.append(event.text)
            offset += len(event.text)
        text = "".join(text)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": {"content": [e for part in logprobs for e in part], "refusal": None}
                      if self.with_logprobs else None}
        else:
            choice = {"index": 0, "text": text, "logprobs": _merge(logprobs) if self.with_logprobs else None}
        choice["finish_reason"] = _finish_reason(final)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": _usage(final), "system_fingerprint": None}

    # -- server-sent events

    def _chunk(self, delta: dict | None, text: str, logprobs, finish_reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice], "system_fingerprint": None}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    async def _chunks(self, first, events) -> AsyncIterator[bytes]:
        offset = 0
        try:
            if self.chat:
                yield _sse(self._chunk({"role": "assistant", "content": ""}, "", None, None))
            event = first
            while True:
                if isinstance(event, FinalEvent):
                    reason = _finish_reason(event)
                    yield _sse(self._chunk({}, "", None, reason))
                    if self.include_usage:
                        yield _sse({**self._chunk(None, "", None, None), "choices": [], "usage": _usage(event)})
                    yield _sse("[DONE]")
                    return
                logprobs = None
                if not event.text and not self.with_logprobs:
                    event = await anext(events)  # text held back (part of a character or of a stop string)
                    continue
                if self.with_logprobs:
                    logprobs = ({"content": await self.logprobs.chat(event), "refusal": None} if self.chat
                                else await self.logprobs.completion(event, offset))
                yield _sse(self._chunk({"content": event.text}, event.text, logprobs, None))
                offset += len(event.text)
                event = await anext(events)
        except StopAsyncIteration:
            yield _error_event(Unavailable("the generation ended without a final event; retry"), self.plane,
                               self.model)
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
            yield _error_event(exc, self.plane, self.model)
        finally:
            await events.aclose()


def _merge(parts: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged
