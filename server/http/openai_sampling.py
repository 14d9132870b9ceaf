"""A chat or completion request's fields, read into the engine's terms:
the sampling parameters, the messages or prompt, and the logprobs asked for.

The extensions beyond OpenAI's fields are in `_SAMPLING_EXTENSIONS` (vLLM
spells them the same way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import ChatMessage, SamplingParams, SpeculativeMode
from modeld.server.http.common import json_type_name
from modeld.server.http.openai_fields import (
    IGNORED, FieldError, check_fields, get_bool, get_field, get_int, get_number,
)

_SAMPLING_EXTENSIONS = {"top_k", "min_p", "ignore_eos", "priority", "speculative", "num_speculative_tokens"}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
           "logprobs"} | IGNORED | _SAMPLING_EXTENSIONS
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                          "frequency_penalty", "presence_penalty", "logit_bias", "tools", "tool_choice"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "frequency_penalty", "presence_penalty", "logit_bias", "best_of", "echo",
                                "suffix"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MAX_TOP_LOGPROBS = 20  # SamplingParams' bound


@dataclass(frozen=True)
class GenerationFields:
    """What a chat or completion request asks for, checked."""

    stream: bool
    include_usage: bool  # the stream ends with a usage chunk
    messages: tuple[ChatMessage, ...]  # chat
    prompt: str  # completions: text, or
    token_ids: tuple[int, ...]  # token ids
    with_logprobs: bool
    top_logprobs: int
    params: SamplingParams


def generation_fields(body: dict, chat: bool) -> GenerationFields:
    check_fields(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS,
                 "/v1/chat/completions" if chat else "/v1/completions")
    stream = get_bool(body, "stream")
    include_usage = _stream_options(body, stream)
    if chat:
        _response_format(body)
        messages, prompt, token_ids = _messages(body), "", ()
        with_logprobs, top = _chat_logprobs(body)
    else:
        messages = ()
        prompt, token_ids = _prompt(body)
        with_logprobs, top = _completion_logprobs(body)
    # the engine reports the chosen token's logprob only alongside at
    # least one alternative; the extra one is dropped when encoding
    params = _sampling(body, max(top, 1) if with_logprobs else 0)
    return GenerationFields(stream, include_usage, messages, prompt, token_ids, with_logprobs, top, params)


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
        raise FieldError("stream_options", f"stream_options must be an object, got {json_type_name(options)}")
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
    if get_field(body, "n", (int,), "an integer", 1) != 1:
        raise FieldError("n", f"n must be 1: this server returns one choice per request, got {body['n']}; "
                              "send several requests for several choices")
    max_tokens = get_int(body, "max_tokens")
    max_completion_tokens = get_int(body, "max_completion_tokens")
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise FieldError("max_completion_tokens", f"max_tokens ({max_tokens}) and max_completion_tokens "
                                                  f"({max_completion_tokens}) disagree; send one of them")
    speculative = get_field(body, "speculative", (str,), "one of none, ngram, draft", "none")
    try:
        mode = SpeculativeMode(speculative)
    except ValueError:
        raise FieldError("speculative", f"speculative must be one of none, ngram, draft, got {speculative!r}") from None
    values = {
        "max_tokens": max_completion_tokens if max_tokens is None else max_tokens,
        "temperature": get_number(body, "temperature"),
        "top_p": get_number(body, "top_p"),
        "top_k": get_int(body, "top_k"),
        "min_p": get_number(body, "min_p"),
        "seed": get_int(body, "seed"),
        "ignore_eos": get_field(body, "ignore_eos", (bool,), "true or false"),
        "num_speculative_tokens": get_int(body, "num_speculative_tokens"),
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


def _content(index: int, content: object) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise FieldError(f"{where}[{j}]", f"{where}[{j}] is a {kind or json_type_name(part)} part; this server "
                                                  "takes text only ({'type': 'text', 'text': ...})")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise FieldError(f"{where}[{j}]", f"{where}[{j}] must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "".join(texts)
    raise FieldError(where, f"{where} must be a string or an array of text parts, got {json_type_name(content)}")


def _messages(body: dict) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty array of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FieldError(f"messages[{i}]", f"messages[{i}] must be an object, got {json_type_name(message)}")
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
    wanted = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs")
    if top is not None and not wanted:
        raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
    if top is not None and not 0 <= top <= _MAX_TOP_LOGPROBS:
        raise FieldError("top_logprobs", f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {top}")
    return wanted, top or 0


def _completion_logprobs(body: dict) -> tuple[bool, int]:
    top = get_int(body, "logprobs")
    if top is not None and not 0 <= top <= _MAX_TOP_LOGPROBS:
        raise FieldError("logprobs", f"logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {top}")
    return top is not None, top or 0


def _response_format(body: dict) -> None:
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise FieldError("response_format", "response_format is not supported (no JSON mode or schemas); only "
                                            f"{{'type': 'text'}} is accepted, got {json.dumps(fmt)[:80]}")
