"""Any OpenAI-compatible server: /v1/completions and /v1/chat/completions,
streamed as server-sent events ending in `data: [DONE]`.

OpenAI's API is the floor every such server shares (llama.cpp's server,
llama-cpp-python's, vLLM, SGLang, LM Studio); beyond it each server differs,
so what one server can do is learnt from its own /openapi.json at load
(FastAPI servers publish one: llama-cpp-python, vLLM):

- sampling fields beyond OpenAI's (top_k, min_p, ignore_eos,
  stop_token_ids, min_tokens, repetition_penalty or repeat_penalty,
  skip_special_tokens, include_stop_str_in_output) are sent only to a
  server whose schema takes them, always with modeld's value (0 = off), so
  the server's own defaults (top_k 40, min_p 0.05 and repeat_penalty 1.1 on
  llama-cpp-python; vLLM's from the model's generation_config.json) never
  change what a request means; a request that needs one the server does
  not take is refused, naming the field. OpenAI's own presence_penalty,
  frequency_penalty and logit_bias go to a server without a schema too;
- a constraint goes as the server's schema says it takes one: vLLM's
  `structured_outputs`, its older `guided_*` fields, OpenAI's
  `response_format` (json_object and json_schema; llama-cpp-python's
  json_object-with-schema where its schema knows no json_schema type), or
  a GBNF `grammar` (llama.cpp's servers); any other is refused, naming the
  server;
- Tokenize/Detokenize use the server's endpoints where its schema lists
  them (/extras/tokenize on llama-cpp-python, /tokenize on vLLM and SGLang);
- usage comes from `stream_options.include_usage` where the server takes
  it; otherwise modeld counts: one completion token per streamed chunk
  (these servers send one per token) and the prompt's tokens from the
  server's tokenize endpoint (0 without one).

The OpenAI format names streamed tokens by their text, not their id, so
this backend reports no token ids and no logprobs (the `vllm` backend asks
vLLM for ids).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from modeld.backends.base import Capability
from modeld.backends.errors import ErrorKind, LoadFailed, ModeldError, Unimplemented
from modeld.backends.generation.params import (
    Constraint, ConstraintKind, FinishReason, GenerateRequest, SamplingParams, TokenEvent,
)
from modeld.backends.remote.health import FailureKind
from modeld.backends.remote.http import RemoteFailure, kind_for_status, remote_message
from modeld.backends.remote.model import RemoteBackend
from modeld.backends.remote.protocol import (
    ANY_OBJECT, PROBE_TIMEOUT_S, RemoteFinish, RemoteProtocol, choice_regex, constraint_spec,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# (wire name, modeld's value for it, the value that means "off", in
# OpenAI's own API); sent where the server's schema takes the field, and
# OpenAI's own where there is no schema and the value is not off
_EXTRAS = (
    ("top_k", lambda p: p.top_k, 0, False),
    ("min_p", lambda p: p.min_p, 0.0, False),
    ("ignore_eos", lambda p: p.ignore_eos, False, False),
    ("stop_token_ids", lambda p: list(p.stop_token_ids), [], False),
    ("min_tokens", lambda p: p.min_tokens, 0, False),
    ("skip_special_tokens", lambda p: p.skip_special_tokens, True, False),
    ("include_stop_str_in_output", lambda p: p.include_stop_str_in_output, False, False),
    ("presence_penalty", lambda p: p.presence_penalty, 0.0, True),
    ("frequency_penalty", lambda p: p.frequency_penalty, 0.0, True),
    ("logit_bias", lambda p: {str(t): b for t, b in p.logit_bias}, {}, True),
)
# the repetition penalty by vLLM's spelling and by llama-cpp-python's
_REPETITION = ("repetition_penalty", "repeat_penalty")
# vLLM's guided_* fields (before structured_outputs) by constraint kind
_GUIDED = {ConstraintKind.JSON_SCHEMA: "guided_json", ConstraintKind.JSON_OBJECT: "guided_json",
           ConstraintKind.REGEX: "guided_regex", ConstraintKind.CHOICE: "guided_choice",
           ConstraintKind.LARK: "guided_grammar", ConstraintKind.GBNF: "guided_grammar"}
_STRUCTURED = {ConstraintKind.JSON_SCHEMA: "json", ConstraintKind.JSON_OBJECT: "json_object",
               ConstraintKind.REGEX: "regex", ConstraintKind.CHOICE: "choice", ConstraintKind.LARK: "grammar",
               ConstraintKind.GBNF: "grammar"}

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}

# token endpoints and their JSON: (path, text field, ids field of the answer)
_TOKENIZE_ROUTES = (("/extras/tokenize", "input", "tokens"), ("/tokenize", "prompt", "tokens"))
_DETOKENIZE_ROUTES = (("/extras/detokenize", "tokens", "text"), ("/detokenize", "tokens", "prompt"))


class OpenAIProtocol(RemoteProtocol):
    engine = "openai"
    health_path = "/v1/models"  # the one endpoint every OpenAI-compatible server has
    metrics_path = ""
    probe_when_busy = False

    def __init__(self, http, model: str) -> None:
        super().__init__(http, model)
        self.schema_fields: dict[str, frozenset[str]] | None = None  # path -> body fields; None: no schema
        self.tokenize_route: tuple[str, str, str] | None = None
        self.detokenize_route: tuple[str, str, str] | None = None
        self.prompt_takes_ids = True  # OpenAI's API takes token ids; a schema may say otherwise
        self.knows_json_schema: set[str] = {CHAT}  # paths whose response_format takes OpenAI's json_schema type

    # -- load --------------------------------------------------------------------------

    async def inspect(self) -> None:
        await self.check_listed()
        await self.read_schema()

    async def check_listed(self) -> None:
        listing = await self.http.get_json("/v1/models")
        served = [m.get("id") for m in (listing.get("data") or []) if isinstance(m, dict)] \
            if isinstance(listing, dict) else []
        if self.model not in served:
            raise LoadFailed(f"{self.where} does not serve {self.model!r} (its /v1/models lists "
                             f"{', '.join(map(repr, served)) or 'nothing'}); set [remote] model to one of them")

    async def read_schema(self) -> None:
        try:
            spec = await self.http.get_json("/openapi.json", PROBE_TIMEOUT_S)
        except ModeldError:
            return  # no schema: OpenAI's own fields only
        if not isinstance(spec, dict) or not isinstance(spec.get("paths"), dict):
            return
        self.schema_fields = {path: _body_fields(spec, path) for path in (COMPLETIONS, CHAT)}
        self.prompt_takes_ids = _takes_int_array(spec, _body_property(spec, COMPLETIONS, "prompt"), depth=0)
        self.knows_json_schema = {path for path in (COMPLETIONS, CHAT)
                                  if _mentions(spec, _body_property(spec, path, "response_format"), "json_schema", 0)}
        self.tokenize_route = next((r for r in _TOKENIZE_ROUTES if r[0] in spec["paths"]), None)
        self.detokenize_route = next((r for r in _DETOKENIZE_ROUTES if r[0] in spec["paths"]), None)

    def takes(self, path: str, field: str) -> bool:
        """Whether the server's schema lists `field` in the body of `path`."""
        return self.schema_fields is not None and field in self.schema_fields.get(path, frozenset())

    def server_capabilities(self) -> dict[str, str]:
        schema = "its /openapi.json" if self.schema_fields is not None else "no /openapi.json"
        extras = [name for name, _, _, _ in _EXTRAS if self.takes(COMPLETIONS, name)]
        return {
            "sampling extras": f"{', '.join(extras) or 'none'} (from {schema})",
            "tokenize": f"yes: {self.tokenize_route[0]}" if self.tokenize_route else f"no: {self._no_route('tokenize')}",
            "detokenize": (f"yes: {self.detokenize_route[0]}" if self.detokenize_route
                           else f"no: {self._no_route('detokenize')}"),
            "usage": ("reported by the server (stream_options.include_usage)" if self.streams_usage(COMPLETIONS)
                      else "counted by modeld: a token per streamed chunk, the prompt through tokenize"),
        }

    # -- requests ------------------------------------------------------------------------

    def refusal(self, request: GenerateRequest) -> str | None:
        reason = super().refusal(request)
        if reason:
            return reason
        if request.params.logprobs:
            return (f"{self.where} streams tokens as text without their ids, so it cannot report logprobs "
                    "(modeld's carry token ids); use engine = \"vllm\" for a vLLM server")
        path = self.path(request)
        p = request.params
        for name, value_of, off, openai_own in _EXTRAS:
            if value_of(p) != off and not self.takes(path, name) and not (openai_own and self.schema_fields is None):
                return self.missing_field(path, name)
        if p.repetition_penalty != 1.0 and not any(self.takes(path, name) for name in _REPETITION):
            return self.missing_field(path, "repetition_penalty")
        if p.constraint is not None:
            fields = self.constraint_fields(path, p.constraint)
            if isinstance(fields, str):
                return fields
        if request.params.seed is not None and self.schema_fields is not None and not self.takes(path, "seed"):
            return self.missing_field(path, "seed")
        if request.token_ids and not self.prompt_takes_ids:
            return f"{self.where} does not take a prompt of token ids (its /openapi.json types prompt as text)"
        return None

    def missing_field(self, path: str, name: str) -> str:
        if self.schema_fields is None:
            return (f"{self.where} publishes no /openapi.json, so modeld cannot tell whether it honours {name}; "
                    "send the request without it (or use the backend for the server's engine, e.g. vllm)")
        return f"{self.where} does not take {name} (its /openapi.json lists no such field for {path})"

    def path(self, request: GenerateRequest) -> str:
        return CHAT if request.messages else COMPLETIONS

    def body(self, request: GenerateRequest) -> dict[str, Any]:
        path = self.path(request)
        p = request.params
        body: dict[str, Any] = {"model": self.model, "stream": True, "max_tokens": p.max_tokens,
                                "temperature": p.temperature, "top_p": p.top_p}
        if request.messages:
            body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        else:
            body["prompt"] = list(request.token_ids) if request.token_ids else request.prompt
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if self.streams_usage(path):
            body["stream_options"] = {"include_usage": True}
        body.update(self.extras(path, p))
        return body

    def extras(self, path: str, p: SamplingParams) -> dict[str, Any]:
        sent = {name: value_of(p) for name, value_of, off, openai_own in _EXTRAS
                if self.takes(path, name) or (openai_own and self.schema_fields is None and value_of(p) != off)}
        sent.update({name: p.repetition_penalty for name in _REPETITION if self.takes(path, name)})
        if p.constraint is not None:
            sent.update(self.constraint_fields(path, p.constraint))
        return sent

    def constraint_fields(self, path: str, c: Constraint) -> dict[str, Any] | str:
        """The body fields asking the server for the constraint, or why it
        takes none such."""
        spec = constraint_spec(c)
        if self.takes(path, "structured_outputs"):
            return {"structured_outputs": {_STRUCTURED[c.kind]: True if c.kind is ConstraintKind.JSON_OBJECT else spec}}
        if self.takes(path, _GUIDED[c.kind]):
            return {_GUIDED[c.kind]: ANY_OBJECT if c.kind is ConstraintKind.JSON_OBJECT else spec}
        takes_format = self.takes(path, "response_format") or (self.schema_fields is None and path == CHAT)
        if takes_format and c.kind is ConstraintKind.JSON_OBJECT:
            return {"response_format": {"type": "json_object"}}
        if takes_format and c.kind is ConstraintKind.JSON_SCHEMA:
            if path in self.knows_json_schema:
                return {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "output", "schema": spec, "strict": True}}}
            return {"response_format": {"type": "json_object", "schema": spec}}  # llama-cpp-python's shape
        if c.kind is ConstraintKind.GBNF and self.takes(path, "grammar"):
            return {"grammar": c.spec}
        if c.kind is ConstraintKind.CHOICE and self.takes(path, "guided_regex"):
            return {"guided_regex": choice_regex(c)}
        source = "its /openapi.json lists" if self.schema_fields is not None else "OpenAI's API has"
        return (f"{self.where} cannot constrain output to a {c.kind.value}: {source} none of structured_outputs, "
                f"{_GUIDED[c.kind]}, response_format or grammar for {path} that takes it")

    def streams_usage(self, path: str) -> bool:
        # OpenAI's own option: assumed where there is no schema to ask
        return self.schema_fields is None or self.takes(path, "stream_options")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | RemoteFinish]:
        path = self.path(request)
        chat = path == CHAT
        state = _StreamState()
        try:
            async for chunk in self.http.events(path, self.body(request)):
                if not isinstance(chunk, dict):
                    raise RemoteFailure(f"{self.where} sent an event that is not a JSON object: {chunk!r}"[:300],
                                        FailureKind.BROKEN_STREAM)
                if chunk.get("error") or chunk.get("object") == "error":  # vLLM's ErrorResponse has no "error" key
                    yield self.error_finish(chunk, state)
                    return
                if chunk.get("usage"):
                    state.usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    event = self.token_event(choice, chat, request)
                    if isinstance(event, RemoteFinish):
                        yield event
                        return
                    if event is not None:
                        state.count(event)
                        yield event
                    if choice.get("finish_reason"):
                        state.finish_reason = choice["finish_reason"]
        except RemoteFailure:
            if state.finish_reason is None:
                raise
            # the answer was complete; only the trailer (usage, [DONE]) went missing
        if state.finish_reason is not None:
            yield await self.finish(state, request)

    def token_event(self, choice: dict, chat: bool, request: GenerateRequest) -> TokenEvent | RemoteFinish | None:
        text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
        return TokenEvent((), text) if text else None

    async def finish(self, state: _StreamState, request: GenerateRequest) -> RemoteFinish:
        reason = _FINISH.get(state.finish_reason)
        usage = state.usage or await self.counted_usage(state, request)
        details = usage.get("prompt_tokens_details") or {}
        figures = dict(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                       cached_prompt_tokens=int(details.get("cached_tokens") or 0),
                       completion_tokens=int(usage.get("completion_tokens") or 0))
        if reason is None:
            return RemoteFinish(FinishReason.ERROR, error=f"{self.where} ended the sequence with finish_reason "
                                f"{state.finish_reason!r}", error_kind=ErrorKind.UNAVAILABLE, **figures)
        return RemoteFinish(reason, **figures)

    async def counted_usage(self, state: _StreamState, request: GenerateRequest) -> dict[str, int]:
        """Usage for a server that streams none (see the module docstring)."""
        prompt_tokens = len(request.token_ids)
        if request.prompt and self.tokenize_route is not None:
            try:
                prompt_tokens = len(await self.tokenize(request.prompt))
            except ModeldError:
                prompt_tokens = 0  # the figure is lost, not the completion
        return {"prompt_tokens": prompt_tokens, "completion_tokens": state.num_tokens}

    def error_finish(self, chunk: dict, state: _StreamState) -> RemoteFinish:
        """An error event: its code, where it has one, says whose fault it was."""
        inner = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
        return RemoteFinish(FinishReason.ERROR, completion_tokens=state.num_tokens,
                            error=f"{self.where} failed the sequence: {remote_message_of(chunk)}",
                            error_kind=kind_for_status(inner.get("code")))

    # -- tokens --------------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        if self.tokenize_route is None:
            raise Unimplemented(self._no_route("tokenize"))
        path, field, answer = self.tokenize_route
        body = {field: text, "model": self.model}
        return _int_list(self.where, path, (await self.http.post_json(path, body)).get(answer))

    async def detokenize(self, token_ids: list[int]) -> str:
        if self.detokenize_route is None:
            raise Unimplemented(self._no_route("detokenize"))
        path, field, answer = self.detokenize_route
        reply = await self.http.post_json(path, {field: list(token_ids), "model": self.model})
        text = reply.get(answer, reply.get("text")) if isinstance(reply, dict) else None
        if not isinstance(text, str):
            raise RemoteFailure(f"{self.where} answered {path} without text: {reply!r}"[:300], FailureKind.BROKEN_STREAM)
        return text

    def _no_route(self, what: str) -> str:
        if self.schema_fields is None:
            return (f"the OpenAI API has no {what} endpoint, and {self.where} publishes no /openapi.json naming "
                    "one of its own")
        return (f"the OpenAI API has no {what} endpoint, and the /openapi.json of {self.where} lists none of "
                f"{', '.join(r[0] for r in (_TOKENIZE_ROUTES if what == 'tokenize' else _DETOKENIZE_ROUTES))}")


class _StreamState:
    def __init__(self) -> None:
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.num_tokens = 0

    def count(self, event: TokenEvent) -> None:
        self.num_tokens += len(event.token_ids) or 1


def _body_fields(spec: dict, path: str) -> frozenset[str]:
    """The top-level fields of a POST body in an OpenAPI document."""
    try:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    except (KeyError, TypeError):
        return frozenset()
    return frozenset(_properties(spec, schema, depth=0))


def _body_property(spec: dict, path: str, name: str) -> Any:
    try:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    except (KeyError, TypeError):
        return None
    schema = _resolve(spec, schema)
    return (schema.get("properties") or {}).get(name) if isinstance(schema, dict) else None


def _resolve(spec: dict, schema: Any) -> Any:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    target: Any = spec
    for part in ref[2:].split("/"):
        target = target.get(part, {}) if isinstance(target, dict) else {}
    return target


def _takes_int_array(spec: dict, schema: Any, depth: int) -> bool:
    """Whether a property's schema admits a list of integers (token ids)."""
    schema = _resolve(spec, schema)
    if not isinstance(schema, dict) or depth > 8:
        return schema is None  # no schema for it: nothing says it cannot
    if schema.get("type") == "array":
        items = _resolve(spec, schema.get("items"))
        return isinstance(items, dict) and (items.get("type") == "integer" or _takes_int_array(spec, items, depth + 1)
                                            and items.get("type") == "array")
    options = [option for key in ("anyOf", "oneOf") for option in schema.get(key) or ()]
    if options:
        return any(_takes_int_array(spec, option, depth + 1) for option in options)
    return "type" not in schema  # unconstrained


def _properties(spec: dict, schema: Any, depth: int) -> set[str]:
    if not isinstance(schema, dict) or depth > 8:
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = spec
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return _properties(spec, target, depth + 1)
    names = set(schema.get("properties") or {})
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or ():
            names |= _properties(spec, option, depth + 1)
    return names


def _mentions(spec: dict, schema: Any, word: str, depth: int) -> bool:
    """Whether a property's schema, its references followed, names `word`
    (an enum value, a const, a property)."""
    schema = _resolve(spec, schema)
    if depth > 8:
        return False
    if isinstance(schema, dict):
        return any(key == word or _mentions(spec, value, word, depth + 1) for key, value in schema.items())
    if isinstance(schema, list):
        return any(_mentions(spec, value, word, depth + 1) for value in schema)
    return schema == word


def _int_list(where: str, path: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RemoteFailure(f"{where} answered {path} without a list of token ids: {value!r}"[:300], FailureKind.BROKEN_STREAM)
    return value


def remote_message_of(chunk: dict) -> str:
    return remote_message(json.dumps(chunk))


class OpenAIBackend(RemoteBackend):
    name = "openai"
    # vLLM and SGLang speak OpenAI's API too; their own backends know more
    engines = ("openai", "vllm", "sglang")
    protocol = OpenAIProtocol
    priority = 190  # after the engine-specific backends, when a model names no order
    capabilities = frozenset({Capability.GENERATION, Capability.STREAMING, Capability.CONSTRAINED_DECODING})
