"""Language models over the KServe protocol: BYTES `text_input` in,
`text_output` out, sampling options as request parameters under the same
names as modeld.v1.Generation (vLLM's, for the sampling extensions and
the `guided_*` constraints), usage figures as response parameters.

Logprobs travel as a response parameter `logprobs`: a JSON list with one
object per generated token in that response, `{"token_id", "logprob",
"top": [[token_id, logprob], ...]}`, most likely alternative first."""

from __future__ import annotations

import json

import numpy as np

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import (
    MAX_CHOICES, MAX_LOGIT_BIAS, Constraint, ConstraintKind, FinalEvent, GenerateRequest, SamplingParams,
    SpeculativeMode, TokenEvent, Usage,
)
from modeld.gen import inference_pb2 as pb
from modeld.server.dataplane import MODEL_VERSION, DataPlane
from modeld.server.services.convert import decode_tensor, encode_bytes, parameter_value, priority_of, timeout_of
from modeld.server.services.limits import sooner

_NUMERIC = {"max_tokens": int, "top_k": int, "seed": int, "logprobs": int, "num_speculative_tokens": int,
            "min_tokens": int, "temperature": float, "top_p": float, "min_p": float, "presence_penalty": float,
            "frequency_penalty": float, "repetition_penalty": float}
_BOOLEAN = ("ignore_eos", "cache_prompt", "skip_special_tokens", "include_stop_str_in_output")
# string parameters holding a constraint, by vLLM's names; guided_grammar
# is GBNF where its rules read `name ::= ...`, Lark otherwise
_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object")
_LISTS = ("stop", "stop_token_ids", "logit_bias")
# read by the service itself (priority_of, timeout_of, the stream's final flag)
_TRITON_RESERVED = ("triton_enable_empty_final_response", "priority", "timeout")


def text_request(msg: pb.ModelInferRequest, request_id: str) -> tuple[GenerateRequest, float | None]:
    """The generation a KServe text request asks for, and its timeout in seconds."""
    texts = [decode_tensor(t, msg.raw_input_contents[i] if msg.raw_input_contents else None)
             for i, t in enumerate(msg.inputs) if t.name == "text_input"]
    if not texts or texts[0].size != 1:
        raise InvalidArgument("a language model takes one BYTES input 'text_input' holding one prompt (shape [1])")
    prompt = texts[0].reshape(-1)[0]
    try:
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"text_input is not valid UTF-8: {exc}") from None
    params = {k: parameter_value(v) for k, v in msg.parameters.items()}
    request = GenerateRequest(msg.model_name, prompt=prompt, params=sampling_from_parameters(params),
                              request_id=request_id, priority=priority_of(params), model_version=msg.model_version)
    return request, timeout_of(params)


def sampling_from_parameters(params: dict) -> SamplingParams:
    values = {}
    constraints = [key for key in _CONSTRAINTS if key in params]
    if len(constraints) > 1:
        raise InvalidArgument(f"parameters {constraints[0]} and {constraints[1]} both constrain the output; send one")
    for key, value in params.items():
        if key in _NUMERIC:
            if isinstance(value, (bool, str)) or value is None:
                raise InvalidArgument(f"parameter {key} must be a number, got {value!r}")
            values[key] = _NUMERIC[key](value)
        elif key in _BOOLEAN:
            if not isinstance(value, bool):
                raise InvalidArgument(f"parameter {key} must be a bool_param, got {value!r}")
            values[key] = value
        elif key == "stop":
            values["stop"] = _string_list(key, value)
        elif key == "stop_token_ids":
            values["stop_token_ids"] = tuple(_json_param(key, value, list, "a JSON list of token ids", int))
        elif key == "logit_bias":
            bias = _json_param(key, value, dict, 'a JSON object {"<token id>": bias}')
            if len(bias) > MAX_LOGIT_BIAS:
                raise InvalidArgument(f"parameter logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
            try:
                values["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
            except (TypeError, ValueError):
                raise InvalidArgument('parameter logit_bias must map token ids to numbers, e.g. {"42": -100}') from None
        elif key in _CONSTRAINTS:
            values["constraint"] = _constraint(key, value)
        elif key == "speculative":
            try:
                values["speculative"] = SpeculativeMode(str(value))
            except ValueError:
                raise InvalidArgument(f"parameter speculative must be none, ngram or draft, got {value!r}") from None
        elif key not in _TRITON_RESERVED:
            raise InvalidArgument(f"unknown generation parameter {key!r}; known: "
                                  f"{', '.join(sorted([*_NUMERIC, *_BOOLEAN, *_LISTS, *_CONSTRAINTS, 'speculative']))}")
    return SamplingParams(**values)


def _json_param(key: str, value, kind: type, what: str, item: type | None = None):
    if not isinstance(value, str):
        raise InvalidArgument(f"parameter {key} must be a string_param holding {what}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"parameter {key} is not valid JSON ({what}): {exc}") from None
    if not isinstance(parsed, kind) or (item is not None and not all(
            isinstance(i, item) and not isinstance(i, bool) for i in parsed)):
        raise InvalidArgument(f"parameter {key} must be {what}")
    return parsed


def _constraint(key: str, value) -> Constraint:
    if key == "guided_json_object":
        if value is not True:
            raise InvalidArgument("parameter guided_json_object must be a bool_param true")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"parameter {key} must be a non-empty string_param")
    if key == "guided_json":
        schema = _json_param(key, value, dict, "a JSON schema object")
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))
    if key == "guided_regex":
        return Constraint(ConstraintKind.REGEX, value)
    if key == "guided_choice":
        choices = _json_param(key, value, list, "a JSON list of strings", str)
        if not choices or len(choices) > MAX_CHOICES or not all(choices):
            raise InvalidArgument(f"parameter guided_choice takes 1 to {MAX_CHOICES} non-empty strings")
        return Constraint(ConstraintKind.CHOICE, json.dumps(choices))
    return Constraint(ConstraintKind.GBNF if "::=" in value else ConstraintKind.LARK, value)


def _string_list(key: str, value) -> tuple[str, ...]:
    """A stop parameter is one string, or a JSON list of strings."""
    if not isinstance(value, str):
        raise InvalidArgument(f"parameter {key} must be a string or a JSON list of strings")
    if value.startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"parameter {key} is not a valid JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise InvalidArgument(f"parameter {key} must be a JSON list of strings")
        return tuple(items)
    return (value,)


def text_response(msg: pb.ModelInferRequest, text: str | None, final: FinalEvent | None = None,
                  tokens: list[TokenEvent] = (), version: str = MODEL_VERSION) -> pb.ModelInferResponse:
    """One response: a text chunk (or none), the logprobs of the tokens in
    it when asked, and usage when it is the last; `version` is the one that
    generated it."""
    response = pb.ModelInferResponse(model_name=msg.model_name, model_version=version, id=msg.id)
    if text is not None:
        response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        response.raw_output_contents.append(encode_bytes(np.array([text.encode("utf-8")], dtype=object)))
    logprobs = logprobs_json(tokens)
    if logprobs is not None:
        response.parameters["logprobs"].string_param = logprobs
    if final is not None:
        add_usage(response, final.usage)
        response.parameters["finish_reason"].string_param = final.finish_reason.value
    return response


def logprobs_json(events) -> str | None:
    """The chosen tokens' logprobs and their alternatives, as a JSON list."""
    entries = []
    for event in events:
        tops = event.top_logprobs or ((),) * len(event.logprobs)
        for chosen, top in zip(event.logprobs, tops):
            entries.append({"token_id": chosen.token_id, "logprob": chosen.logprob,
                            "top": [[c.token_id, c.logprob] for c in top]})
    return json.dumps(entries) if entries else None


def add_usage(response: pb.ModelInferResponse, usage: Usage) -> None:
    for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "drafted_tokens", "accepted_tokens"):
        response.parameters[name].int64_param = getattr(usage, name)
    response.parameters["time_to_first_token_s"].double_param = usage.time_to_first_token_s


async def complete_text(plane: DataPlane, msg: pb.ModelInferRequest, request_id: str,
                        call_timeout_s: float | None = None) -> pb.ModelInferResponse:
    """The whole completion in one response (ModelInfer on gRPC and REST); a
    generation that fails raises its own error from the engine. The call's
    own deadline (gRPC) bounds it where that is sooner."""
    chunks, tokens, final = [], [], None
    generation, timeout_s = text_request(msg, request_id)
    version = plane.served_version(msg.model_name, msg.model_version)
    async for event in plane.generate(generation, sooner(timeout_s, call_timeout_s)):
        if isinstance(event, FinalEvent):
            final = event
        else:
            chunks.append(event.text)
            tokens.append(event)
    return text_response(msg, "".join(chunks), final, tokens, version)
