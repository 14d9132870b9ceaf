"""A chat or completion request's fields, read into the engine's terms:
the sampling parameters, the messages or prompt, the logprobs and the
number of choices asked for, and the constraint the output must match.

The extensions beyond OpenAI's fields are in `_SAMPLING_EXTENSIONS` (vLLM
spells them the same way). A constraint comes from exactly one of
OpenAI's `response_format`, vLLM's `structured_outputs` object or its
older `guided_*` fields, or llama-server's `grammar` / `json_schema`
(`_CONSTRAINT_FIELDS`); two at once are refused rather than one ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from modeld.backends.digits import ascii_digits
from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import (
    MAX_CHOICES, MAX_N, ChatMessage, Constraint, ConstraintKind, SamplingParams, SpeculativeMode,
    check_template_kwargs,
)
from modeld.server.http.common import json_type_name
from modeld.server.http.openai_fields import (
    IGNORED, FieldError, check_fields, get_bool, get_field, get_int, get_number,
)
from modeld.server.http.openai_tools import chat_messages

_SAMPLING_EXTENSIONS = {"top_k", "min_p", "ignore_eos", "priority", "speculative", "num_speculative_tokens",
                        "repetition_penalty", "min_tokens", "stop_token_ids", "skip_special_tokens",
                        "include_stop_str_in_output", "prompt_logprobs", "cache_prompt"}
# where a constraint may come from: OpenAI, vLLM (current and older), llama-server
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "grammar", "json_schema")
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
           "logprobs", "frequency_penalty", "presence_penalty", "logit_bias", *_CONSTRAINT_FIELDS} \
    | IGNORED | _SAMPLING_EXTENSIONS
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "parallel_tool_calls", "chat_template_kwargs"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
_STRUCTURED_KEYS = {"json": "a JSON schema (object or JSON text)", "regex": "a regular expression",
                    "choice": "an array of strings", "grammar": "a Lark or GBNF grammar",
                    "json_object": "true"}
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
    n: int = 1  # choices answered
    best_of: int = 1  # sequences generated, the n with the highest cumulative logprob answered
    echo: bool = False  # completions: the prompt's text leads each choice's text
    constraint_field: str | None = None  # the field the constraint came from, for errors
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()  # chat: extra template variables


def generation_fields(body: dict, chat: bool, backend: str = "") -> GenerationFields:
    """`backend` (the serving backend's name, where known) is named in the
    refusal of what no backend here can do."""
    check_fields(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS,
                 "/v1/chat/completions" if chat else "/v1/completions")
    stream = get_bool(body, "stream")
    include_usage = _stream_options(body, stream)
    template_kwargs = ()
    if chat:
        messages, prompt, token_ids = chat_messages(body), "", ()
        with_logprobs, top = _chat_logprobs(body)
        template_kwargs = chat_template_kwargs(body)
    else:
        messages = ()
        prompt, token_ids = _prompt(body)
        with_logprobs, top = _completion_logprobs(body)
    n, best_of = _choices(body, stream)
    echo = _echo(body, with_logprobs, backend)
    if body.get("prompt_logprobs") is not None:
        # the step computes logits at each sequence's last position only
        # (backends/generation/loop.py), so no backend here has the prompt's
        raise FieldError("prompt_logprobs", f"prompt_logprobs is not supported by the {backend or 'serving'} backend: "
                                            "it computes logits for the last prompt position only, so the prompt's "
                                            "own logprobs are not known; leave prompt_logprobs out")
    constraint, constraint_field = _constraint(body)
    # the engine reports the chosen token's logprob only alongside at
    # least one alternative; the extra one is dropped when encoding.
    # best_of ranks its sequences by cumulative logprob, so it asks too.
    logprobs = max(top, 1) if with_logprobs or best_of > n else 0
    params = _sampling(body, logprobs, constraint)
    return GenerationFields(stream, include_usage, messages, prompt, token_ids, with_logprobs, top, params,
                            n, best_of, echo, constraint_field, template_kwargs)


def chat_template_kwargs(body: dict) -> tuple[tuple[str, object], ...]:
    """vLLM's chat_template_kwargs: an object of extra chat template
    variables (add_generation_prompt, enable_thinking, ...)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise FieldError("chat_template_kwargs", "chat_template_kwargs must be an object of template variables, got "
                                                 f"{json_type_name(value)}")
    kwargs = tuple(value.items())
    try:
        check_template_kwargs(kwargs)
    except InvalidArgument as exc:
        raise FieldError("chat_template_kwargs", str(exc)) from None
    return kwargs


def _choices(body: dict, stream: bool) -> tuple[int, int]:
    n = get_int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise FieldError("n", f"n must be in [1, {MAX_N}] (choices per request), got {n}")
    best_of = get_int(body, "best_of")
    if best_of is None:
        return n, n
    if not n <= best_of <= MAX_N:
        raise FieldError("best_of", f"best_of must be in [n={n}, {MAX_N}], got {best_of}")
    if best_of > n and stream:
        raise FieldError("best_of", "best_of > n cannot stream: the best sequences are known only once all "
                                    "have finished; send stream: false")
    return n, best_of


def _echo(body: dict, with_logprobs: bool, backend: str) -> bool:
    echo = get_bool(body, "echo")
    if echo and with_logprobs:
        raise FieldError("echo", f"echo with logprobs needs the prompt's logprobs, which the {backend or 'serving'} "
                                 "backend does not compute; send echo without logprobs")
    return echo


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


def _sampling(body: dict, logprobs: int, constraint: Constraint | None) -> SamplingParams:
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
        "presence_penalty": get_number(body, "presence_penalty"),
        "frequency_penalty": get_number(body, "frequency_penalty"),
        "repetition_penalty": get_number(body, "repetition_penalty"),
        "min_tokens": get_int(body, "min_tokens"),
        "skip_special_tokens": get_field(body, "skip_special_tokens", (bool,), "true or false"),
        "include_stop_str_in_output": get_field(body, "include_stop_str_in_output", (bool,), "true or false"),
        "cache_prompt": get_field(body, "cache_prompt", (bool,), "true or false"),
    }
    # OpenAI's defaults where they differ from ours: temperature 1 and,
    # absent max_tokens, the engine's default length (SamplingParams)
    values["temperature"] = 1.0 if values["temperature"] is None else values["temperature"]
    params = SamplingParams(**{k: v for k, v in values.items() if v is not None}, stop=_stop(body),
                            stop_token_ids=_token_ids(body, "stop_token_ids"), logit_bias=_logit_bias(body),
                            logprobs=logprobs, speculative=mode, constraint=constraint)
    try:
        params.validate()
    except InvalidArgument as exc:  # name the field as the client spelled it
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field == "max_tokens" and max_tokens is None and max_completion_tokens is not None:
            field, message = "max_completion_tokens", "max_completion_tokens" + message[len(field):]
        raise FieldError(field if field in body else None, message) from None
    return params


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


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise FieldError(name, f"{name} must be an array of token ids (integers)")
    return tuple(ids)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias} map, as (id, bias) pairs in id order."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise FieldError("logit_bias", f"logit_bias must be an object of token id -> bias, got {json_type_name(bias)}")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and ascii_digits(key)):
            raise FieldError("logit_bias", f"logit_bias keys must be token ids written as decimal strings, got {key!r}"[:120])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise FieldError("logit_bias", f"logit_bias[{key!r}] must be a number in [-100, 100], got "
                                           f"{json.dumps(value)[:40]}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _constraint(body: dict) -> tuple[Constraint | None, str | None]:
    """The one constraint the request asks for, and the field it came from."""
    given = [name for name in _CONSTRAINT_FIELDS if body.get(name) is not None
             and not (name == "response_format" and body[name] == {"type": "text"})]
    if not given:
        if body.get("response_format") is not None:
            _response_format(body["response_format"])  # checks {"type": "text"}'s shape
        return None, None
    if len(given) > 1:
        raise FieldError(given[1], f"{given[1]} and {given[0]} both constrain the output; send one of them")
    name = given[0]
    value = body[name]
    if name == "response_format":
        constraint = _response_format(value)
    elif name == "structured_outputs":
        constraint = _structured_outputs(value)
    elif name in ("guided_json", "json_schema"):
        constraint = _json_schema(name, value)
    elif name == "guided_regex":
        constraint = Constraint(ConstraintKind.REGEX, _string(name, value, "a regular expression"))
    elif name == "guided_choice":
        constraint = _choice(name, value)
    elif name == "guided_grammar":
        constraint = _grammar(name, _string(name, value, "a Lark or GBNF grammar"))
    else:  # llama-server's grammar is GBNF
        constraint = Constraint(ConstraintKind.GBNF, _string(name, value, "a GBNF grammar"))
    try:
        constraint.validate()
    except InvalidArgument as exc:
        raise FieldError(name, f"{name}: {exc}") from None
    return constraint, name


def _response_format(fmt: object) -> Constraint | None:
    if not isinstance(fmt, dict):
        raise FieldError("response_format", f"response_format must be an object, got {json_type_name(fmt)}")
    kind = fmt.get("type")
    extra = sorted(set(fmt) - {"type", "json_schema", "schema"})
    if extra:
        raise FieldError("response_format", f"response_format.{extra[0]} is not supported; send type and, for "
                                            "json_schema, json_schema")
    if kind == "text":
        if len(fmt) > 1:
            raise FieldError("response_format", "response_format {'type': 'text'} takes no other keys")
        return None
    if kind == "json_object":
        # llama-server takes a schema beside json_object
        if fmt.get("schema") is not None:
            return _json_schema("response_format.schema", fmt["schema"])
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise FieldError("response_format", "response_format.json_schema must be an object "
                                                "{name, schema, strict, description}")
        extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if extra:
            raise FieldError("response_format", f"response_format.json_schema.{extra[0]} is not supported; send "
                                                "name, schema, strict or description")
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 64):
            raise FieldError("response_format", "response_format.json_schema.name must be a string of 1 to 64 "
                                                "characters")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise FieldError("response_format", "response_format.json_schema.strict must be true or false")
        if spec.get("schema") is None:
            raise FieldError("response_format", "response_format.json_schema.schema is required: the JSON schema "
                                                "the output must match")
        return _json_schema("response_format", spec["schema"])
    raise FieldError("response_format", "response_format.type must be text, json_object or json_schema, got "
                                        f"{json.dumps(kind)[:40]}")


def _structured_outputs(value: object) -> Constraint:
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise FieldError(name, f"{name} must be an object holding one of {', '.join(_STRUCTURED_KEYS)}")
    extra = sorted(set(value) - set(_STRUCTURED_KEYS))
    if extra:
        raise FieldError(name, f"{name}.{extra[0]} is not supported; {name} takes one of "
                               f"{', '.join(_STRUCTURED_KEYS)}")
    given = [k for k in _STRUCTURED_KEYS if value.get(k) is not None]
    if len(given) != 1:
        raise FieldError(name, f"{name} must hold exactly one of {', '.join(_STRUCTURED_KEYS)}, got "
                               f"{', '.join(given) or 'none'}")
    key = given[0]
    where = f"{name}.{key}"
    if key == "json":
        return _json_schema(where, value[key])
    if key == "regex":
        return Constraint(ConstraintKind.REGEX, _string(where, value[key], _STRUCTURED_KEYS[key]))
    if key == "choice":
        return _choice(where, value[key])
    if key == "grammar":
        return _grammar(where, _string(where, value[key], _STRUCTURED_KEYS[key]))
    if value[key] is not True:
        raise FieldError(name, f"{where} must be true")
    return Constraint(ConstraintKind.JSON_OBJECT)


def _field_of(where: str) -> str:
    return where.split(".", 1)[0]


def _string(where: str, value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(_field_of(where), f"{where} must be {what} as a non-empty string, got "
                                           f"{json_type_name(value)}")
    return value


def _json_schema(where: str, schema: object) -> Constraint:
    """A schema as an object, or as JSON text (vLLM takes both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise FieldError(_field_of(where), f"{where} is not valid JSON: {exc}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise FieldError(_field_of(where), f"{where} must be a JSON schema object, got {json_type_name(schema)}")
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))


def _choice(where: str, value: object) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise FieldError(_field_of(where), f"{where} must be a non-empty array of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise FieldError(_field_of(where), f"{where} takes at most {MAX_CHOICES} strings, got {len(value)}")
    return Constraint(ConstraintKind.CHOICE, json.dumps(value))


def _grammar(where: str, grammar: str) -> Constraint:
    # vLLM's grammar field takes either notation; GBNF's rules are written
    # `name ::= ...`, Lark's `name: ...`
    return Constraint(ConstraintKind.GBNF if "::=" in grammar else ConstraintKind.LARK, grammar)
