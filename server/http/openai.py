"""The OpenAI-compatible API (/v1): chat completions, completions,
embeddings and the model list, over the same engine as gRPC.

Requests fail closed: a field this server does not implement is refused
with 400 naming it, rather than ignored, so a client never gets an answer
that silently means something else than it asked. The few fields accepted
without effect are in `_IGNORED` and `_NEUTRAL` (the latter only at the
value that changes nothing); the extensions beyond OpenAI's fields are in
`_SAMPLING_EXTENSIONS` (vLLM spells them the same way).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from typing import Any, AsyncIterator

import numpy as np
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from modeld.backends.errors import Cancelled, ErrorKind, InvalidArgument, ModeldError, NotFound, Unavailable
from modeld.backends.generation.params import (
    ChatMessage, FinalEvent, FinishReason, GenerateRequest, SamplingParams, SpeculativeMode, TokenEvent,
)
from modeld.server.http.app import ClientGone, internal_message, read_body, status_of_error, unless_client_leaves
from modeld.server.request_context import current_request_id
from modeld.server.requests import InferRequest

log = structlog.get_logger("modeld.http.openai")

# Accepted and without effect here: `user` names the end user for OpenAI's
# abuse monitoring, which a self-hosted daemon does not do.
_IGNORED = {"user"}
# Accepted only at the value that changes nothing; any other value is refused.
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "best_of": 1, "echo": False,
            "suffix": None, "tools": [], "tool_choice": "none"}
_SAMPLING_EXTENSIONS = {"top_k", "min_p", "ignore_eos", "priority", "speculative", "num_speculative_tokens"}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
           "logprobs"} | _IGNORED | _SAMPLING_EXTENSIONS
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                          "frequency_penalty", "presence_penalty", "logit_bias", "tools", "tool_choice"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "frequency_penalty", "presence_penalty", "logit_bias", "best_of", "echo",
                                "suffix"}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "priority"} | _IGNORED

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# OpenAI's error `type` by our kind; clients branch on the HTTP status, the
# type is for people reading the body.
_ERROR_TYPE = {
    ErrorKind.INVALID_ARGUMENT: "invalid_request_error",
    ErrorKind.NOT_FOUND: "invalid_request_error",
    ErrorKind.UNIMPLEMENTED: "invalid_request_error",
    ErrorKind.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorKind.FAILED_PRECONDITION: "invalid_request_error",
}
_MAX_TOP_LOGPROBS = 20  # SamplingParams' bound


class FieldError(InvalidArgument):
    """Bad input in one request field, named in the error's `param`."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_response(exc: BaseException, engine, model: str) -> JSONResponse:
    """OpenAI's error shape with our status; counts the failure."""
    if isinstance(exc, ModeldError):
        kind, message = exc.kind, str(exc)
        log.info("http_failed", api="openai", status=kind.value, reason=message)
    else:
        kind = ErrorKind.INTERNAL
        message = internal_message(current_request_id())
        log.error("http_bug", api="openai", exc_info=exc)
    engine.count_failure(model, kind)
    body = {"message": message, "type": _ERROR_TYPE.get(kind, "server_error"),
            "param": getattr(exc, "param", None), "code": kind.value.lower()}
    return JSONResponse({"error": body}, status_code=status_of_error(exc))


def _error_event(exc: BaseException, engine, model: str) -> bytes:
    """A failure after the stream began: the status line went out already,
    so the error travels as an event (the openai SDK raises it)."""
    response = error_response(exc, engine, model)
    return b"data: " + response.body + b"\n\n"


# -- reading the request -------------------------------------------------------------


async def _json_body(request: Request) -> dict:
    raw = await read_body(request)  # max_message_bytes, as gRPC's limit
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise FieldError(unknown[0], f"{endpoint} does not support the field {unknown[0]!r}"
                         + (f" (nor {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else "")
                         + "; remove it (this server refuses fields it would otherwise ignore)")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] is not None and body[name] != neutral:
            raise FieldError(name, f"{name} is not supported; only {json.dumps(neutral)} (no effect) is accepted, "
                                   f"got {json.dumps(body[name])}")


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    """A field of the given JSON type; null or absent gives the default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise FieldError(name, f"{name} must be {what}, got {_type_name(value)} {json.dumps(value)[:50]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(name, f"{name} must be a finite number, got {value}")
    return value


def _int(body: dict, name: str, default: int | None = None) -> int | None:
    return _get(body, name, (int,), "an integer", default)


def _number(body: dict, name: str, default: float | None = None) -> float | None:
    value = _get(body, name, (int, float), "a number", default)
    return None if value is None else float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    return _get(body, name, (bool,), "true or false", default)


def _model_name(body: dict) -> str:
    model = _get(body, "model", (str,), "a string naming a model (GET /v1/models lists them)")
    if not model:
        raise FieldError("model", "model is required: name a model (GET /v1/models lists them)")
    return model


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise FieldError("stop", f"stop must be a string or an array of strings, got {json.dumps(stop)[:50]}")
    if not all(stop):
        raise FieldError("stop", "stop strings must not be empty")
    return tuple(stop)


def _stream_options(body: dict, stream: bool) -> bool:
    """Whether the stream ends with a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise FieldError("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict):
        raise FieldError("stream_options", f"stream_options must be an object, got {_type_name(options)}")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise FieldError(f"stream_options.{unknown[0]}", f"stream_options.{unknown[0]} is not supported; "
                                                         "only include_usage is")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise FieldError("stream_options.include_usage", "stream_options.include_usage must be true or false, "
                                                         f"got {json.dumps(include)[:50]}")
    return bool(include)


def _sampling(body: dict, logprobs: int) -> SamplingParams:
    if _get(body, "n", (int,), "an integer", 1) != 1:
        raise FieldError("n", f"n must be 1: this server returns one choice per request, got {body['n']}; "
                              "send several requests for several choices")
    max_tokens = _int(body, "max_tokens")
    max_completion_tokens = _int(body, "max_completion_tokens")
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise FieldError("max_completion_tokens", f"max_tokens ({max_tokens}) and max_completion_tokens "
                                                  f"({max_completion_tokens}) disagree; send one of them")
    speculative = _get(body, "speculative", (str,), "one of none, ngram, draft", "none")
    try:
        mode = SpeculativeMode(speculative)
    except ValueError:
        raise FieldError("speculative", f"speculative must be one of none, ngram, draft, got {speculative!r}") from None
    values = {
        "max_tokens": max_completion_tokens if max_tokens is None else max_tokens,
        "temperature": _number(body, "temperature"),
        "top_p": _number(body, "top_p"),
        "top_k": _int(body, "top_k"),
        "min_p": _number(body, "min_p"),
        "seed": _int(body, "seed"),
        "ignore_eos": _get(body, "ignore_eos", (bool,), "true or false"),
        "num_speculative_tokens": _int(body, "num_speculative_tokens"),
    }
    # OpenAI's defaults where they differ from ours: temperature 1 and,
    # absent max_tokens, the engine's default length (SamplingParams)
    values["temperature"] = 1.0 if values["temperature"] is None else values["temperature"]
    params = SamplingParams(**{k: v for k, v in values.items() if v is not None}, stop=_stop(body),
                            logprobs=logprobs, speculative=mode)
    try:
        params.validate()
    except InvalidArgument as exc:  # name the field as the client spelled it
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field == "max_tokens" and max_tokens is None and max_completion_tokens is not None:
            field, message = "max_completion_tokens", "max_completion_tokens" + message[len(field):]
        raise FieldError(field if field in body else None, message) from None
    return params


def _priority(body: dict) -> int:
    priority = _int(body, "priority", 0)
    if priority < 0:
        raise FieldError("priority", f"priority must be >= 0 (1 is the most urgent, 0 the default), got {priority}")
    return priority


def _content(index: int, content: object) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise FieldError(f"{where}[{j}]", f"{where}[{j}] is a {kind or _type_name(part)} part; this server "
                                                  "takes text only ({'type': 'text', 'text': ...})")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise FieldError(f"{where}[{j}]", f"{where}[{j}] must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "".join(texts)
    raise FieldError(where, f"{where} must be a string or an array of text parts, got {_type_name(content)}")


def _messages(body: dict) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty array of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FieldError(f"messages[{i}]", f"messages[{i}] must be an object, got {_type_name(message)}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise FieldError(f"messages[{i}].{extra[0]}", f"messages[{i}].{extra[0]} is not supported (no tool "
                                                          "calls or names); send role and content only")
        role = message.get("role")
        if role not in _ROLES:
            raise FieldError(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(_ROLES)}, "
                                                    f"got {json.dumps(role)[:40]}")
        out.append(ChatMessage(_ROLES[role], _content(i, message.get("content"))))
    return tuple(out)


def _prompt(body: dict) -> tuple[str, tuple[int, ...]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt, ()
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "", tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise FieldError("prompt", f"prompt holds {len(prompt)} prompts; send one per request")
    raise FieldError("prompt", "prompt must be a non-empty string or an array of token ids")


def _chat_logprobs(body: dict) -> tuple[bool, int]:
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs")
    if top is not None and not wanted:
        raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
    if top is not None and not 0 <= top <= _MAX_TOP_LOGPROBS:
        raise FieldError("top_logprobs", f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {top}")
    return wanted, top or 0


def _completion_logprobs(body: dict) -> tuple[bool, int]:
    top = _int(body, "logprobs")
    if top is not None and not 0 <= top <= _MAX_TOP_LOGPROBS:
        raise FieldError("logprobs", f"logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {top}")
    return top is not None, top or 0


def _response_format(body: dict) -> None:
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise FieldError("response_format", "response_format is not supported (no JSON mode or schemas); only "
                                            f"{{'type': 'text'}} is accepted, got {json.dumps(fmt)[:80]}")


# -- generation ------------------------------------------------------------------------


class _Logprobs:
    """Turns the engine's token ids into OpenAI's token strings, one
    detokenize per distinct id in the request."""

    def __init__(self, engine, model: str, top: int) -> None:
        self.engine, self.model, self.top = engine, model, top
        self._text: dict[int, str] = {}

    async def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = await self.engine.detokenize(self.model, [token_id])
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


async def _events(engine, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
    """The engine's events, without the final event of a failure (the
    engine raises that failure right after it)."""
    events = engine.generate(request)
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

    def __init__(self, engine, http: Request, body: dict, chat: bool) -> None:
        self.engine, self.http, self.chat = engine, http, chat
        self.model = _model_name(body)
        _check_fields(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS,
                      "/v1/chat/completions" if chat else "/v1/completions")
        self.stream = _bool(body, "stream")
        self.include_usage = _stream_options(body, self.stream)
        if chat:
            _response_format(body)
            messages, prompt, token_ids = _messages(body), "", ()
            self.with_logprobs, top = _chat_logprobs(body)
        else:
            messages = ()
            prompt, token_ids = _prompt(body)
            self.with_logprobs, top = _completion_logprobs(body)
        # the engine reports the chosen token's logprob only alongside at
        # least one alternative; the extra one is dropped in _Logprobs
        params = _sampling(body, max(top, 1) if self.with_logprobs else 0)
        self.request_id = current_request_id()
        self.request = GenerateRequest(self.model, prompt=prompt, token_ids=token_ids, messages=messages,
                                       params=params, request_id=self.request_id, priority=_priority(body))
        self.logprobs = _Logprobs(engine, self.model, top)
        self.id = ("chatcmpl-" if chat else "cmpl-") + self.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def respond(self) -> Response:
        events = _events(self.engine, self.request)
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
            yield _error_event(Unavailable("the generation ended without a final event; retry"), self.engine,
                               self.model)
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
            yield _error_event(exc, self.engine, self.model)
        finally:
            await events.aclose()


def _merge(parts: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged


# -- embeddings --------------------------------------------------------------------------


def _texts(body: dict) -> list[str]:
    value = body.get("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise FieldError("input", "input must be a string or a non-empty array of strings")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise FieldError("input", f"input[{i}] must be a string, got {_type_name(text)} (token arrays are not "
                                      "accepted: this server tokenizes text itself)")
        if not text:
            raise FieldError("input", f"input[{i}] is empty; embeddings need text")
    return value


def _embedder(served) -> tuple[Any, Any]:
    """The text input and the vector output of a one-BYTES-input text
    embedder; anything else is refused with what it is instead."""
    name = served.config.name
    if served.is_generative:
        raise InvalidArgument(f"model {name!r} is a language model, not an embedding model; use "
                              "/v1/chat/completions or /v1/completions")
    inputs, outputs = served.loaded.inputs, served.loaded.outputs
    if len(inputs) != 1 or inputs[0].datatype != "BYTES" or len(inputs[0].shape) != 1:
        found = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in inputs)
        raise InvalidArgument(f"model {name!r} is not a text embedding model: /v1/embeddings needs one BYTES input "
                              f"[batch] of text, it takes {found}; use the KServe API (ModelInfer) instead")
    vectors = [t for t in outputs if t.datatype == "FP32" and len(t.shape) == 2]
    if len(vectors) != 1:
        found = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in outputs)
        raise InvalidArgument(f"model {name!r} is not a text embedding model: /v1/embeddings needs exactly one FP32 "
                              f"output [batch, dimensions], it has {found}; use the KServe API (ModelInfer) instead")
    return inputs[0], vectors[0]


async def _embed(engine, served, texts: list[str], priority: int) -> np.ndarray:
    text_input, vector_output = _embedder(served)
    # One infer call per HTTP request carries all its strings, split only
    # where the model's max_batch_size would refuse them; the dynamic
    # batcher merges these with concurrent gRPC calls all the same
    # (bench/bench_http.py measures this against one call per string).
    step = served.config.max_batch_size or len(texts)
    chunks = [texts[i:i + step] for i in range(0, len(texts), step)]
    request_id = current_request_id()
    results = await asyncio.gather(*(
        engine.infer(InferRequest(served.config.name, {text_input.name: np.array([t.encode() for t in chunk],
                                                                                  dtype=object)},
                                  output_names=(vector_output.name,), request_id=request_id, priority=priority))
        for chunk in chunks))
    return np.concatenate([r.outputs[vector_output.name] for r in results]).astype(np.float32, copy=False)


def _encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


# -- routes -------------------------------------------------------------------------------


def routes(engine, lifecycle) -> list[BaseRoute]:
    # lifecycle: app.py's middleware refuses new requests while draining
    started = int(time.time())  # what `created` says of every model: when this daemon began serving it

    async def generation(request: Request, chat: bool) -> Response:
        model = ""
        try:
            body = await _json_body(request)
            model = body.get("model") if isinstance(body.get("model"), str) else ""
            return await _Generation(engine, request, body, chat).respond()
        except ClientGone:
            engine.count_failure(model, ErrorKind.CANCELLED)
            return Response(status_code=499)  # nobody reads it; for the access log
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            return error_response(exc, engine, model)

    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    async def embeddings(request: Request) -> Response:
        model = ""
        try:
            body = await _json_body(request)
            model = _model_name(body)
            _check_fields(body, _EMBEDDING_FIELDS, "/v1/embeddings")
            texts = _texts(body)
            encoding = _get(body, "encoding_format", (str,), "float or base64", "float")
            if encoding not in ("float", "base64"):
                raise FieldError("encoding_format", f"encoding_format must be float or base64, got {encoding!r}")
            dimensions = _int(body, "dimensions")
            priority = _priority(body)
            served = await engine.ensure_loaded(model)
            vectors = await _embed(engine, served, texts, priority)
            if dimensions is not None and dimensions != vectors.shape[1]:
                raise FieldError("dimensions", f"model {model!r} gives {vectors.shape[1]} dimensions and cannot "
                                               f"shorten them; leave dimensions out or send {vectors.shape[1]}")
        except Exception as exc:  # noqa: BLE001
            return error_response(exc, engine, model)
        return JSONResponse({
            "object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)}
                     for i, v in enumerate(vectors)],
            # the tokenizer runs inside the backend, which reports no token
            # counts; 0 says "not counted" rather than a guess
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        })

    def describe(status) -> dict:
        return {"id": status.name, "object": "model", "created": started, "owned_by": "modeld",
                "ready": status.state.value == "READY", "state": status.state.value,
                **({"reason": status.reason} if status.reason else {})}

    async def list_models(request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": [describe(s) for s in engine.statuses()]})
        except Exception as exc:  # noqa: BLE001
            return error_response(exc, engine, "")

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        try:
            for status in engine.statuses():
                if status.name == name:
                    return JSONResponse(describe(status))
            raise NotFound(f"model {name!r} is not in the repository; GET /v1/models lists the models")
        except Exception as exc:  # noqa: BLE001
            return error_response(exc, engine, name)

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    ]
