"""modeld.v1.Generation: token streaming over gRPC. Converts and delegates."""

from __future__ import annotations

import dataclasses
import json

from modeld.backends.generation.params import (
    Constraint, ConstraintKind, FinalEvent, FinishReason, GenerateRequest, SamplingParams,
    SpeculativeMode, TokenEvent,
)
from modeld.gen import generation_pb2 as pb
from modeld.gen import generation_pb2_grpc as pb_grpc
from modeld.backends.errors import InvalidArgument, NotFound
from modeld.backends.model_config import ReasoningParser, ToolParser
from modeld.backends.generation.params import MAX_CHOICES, MAX_LOGIT_BIAS
from modeld.server.dataplane import DataPlane
from modeld.server.services.generation_tools import ChoiceAnswers, messages_from_proto, tool_request
from modeld.server.services.limits import call_timeout_s
from modeld.server.services.parsing import request_nbytes
from modeld.server.services.status import current_request_id, grpc_errors

_SPECULATIVE = {
    pb.SPECULATIVE_NONE: SpeculativeMode.NONE,
    pb.SPECULATIVE_NGRAM: SpeculativeMode.NGRAM,
    pb.SPECULATIVE_DRAFT: SpeculativeMode.DRAFT,
}
_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_DEFAULT_PARSERS = (ToolParser.HERMES, None)  # a model the repository does not know: the generation says so itself


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    values = {}
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "cache_prompt",
                 "ignore_eos", "num_speculative_tokens", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "skip_special_tokens", "include_stop_str_in_output"):
        if msg.HasField(name):
            values[name] = getattr(msg, name)
    values["stop"] = tuple(msg.stop)
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.speculative not in _SPECULATIVE:
        # an enum value from a newer client: refuse rather than run without it
        raise InvalidArgument(f"unknown speculative mode {msg.speculative}; use one of "
                              + ", ".join(f"{pb.SpeculativeMode.Name(v)} ({v})" for v in _SPECULATIVE))
    values["speculative"] = _SPECULATIVE[msg.speculative]
    if len(msg.logit_bias) > MAX_LOGIT_BIAS:  # before copying a map of any size
        raise InvalidArgument(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(msg.logit_bias)}")
    values["logit_bias"] = tuple(sorted(msg.logit_bias.items()))
    if msg.HasField("constraint"):
        values["constraint"] = constraint_from_proto(msg.constraint)
    return SamplingParams(**values)


def constraint_from_proto(msg: pb.Constraint) -> Constraint:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("constraint is set but holds none of json_object, json_schema, regex, choice, lark, "
                              "gbnf; leave it unset for unconstrained output")
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidArgument("constraint.json_object must be true (unset the constraint for none)")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        choices = list(msg.choice.choices)
        if not choices or not all(choices):
            raise InvalidArgument("constraint.choice needs at least one non-empty string")
        if len(choices) > MAX_CHOICES:
            raise InvalidArgument(f"constraint.choice takes at most {MAX_CHOICES} strings, got {len(choices)}")
        return Constraint(ConstraintKind.CHOICE, json.dumps(choices))
    return Constraint(ConstraintKind(kind), getattr(msg, kind))


def request_from_proto(msg: pb.GenerateRequest, parser: ToolParser = ToolParser.HERMES) -> GenerateRequest:
    """The engine's request; with tools, `parser` (the model's tool_parser)
    decides the format a required call is written in."""
    kind = msg.WhichOneof("input")
    params = sampling_from_proto(msg.sampling)
    tools = tool_request(msg, parser)
    if tools.constraint is not None:
        if params.constraint is not None:
            raise InvalidArgument("tool_choice required or function constrains the answer to a call and "
                                  "sampling.constraint constrains it too; send one of them")
        params = dataclasses.replace(params, constraint=tools.constraint)
    return GenerateRequest(
        model_name=msg.model,
        prompt=msg.prompt if kind == "prompt" else "",
        token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else (),
        messages=messages_from_proto(msg.messages.messages) if kind == "messages" else (),
        params=params,
        request_id=current_request_id(),
        priority=msg.priority,
        tools=tools.tools,
        chat_template_kwargs=tools.chat_template_kwargs,
    )


def event_to_proto(event: TokenEvent | FinalEvent, index: int = 0) -> pb.GenerateResponse:
    if isinstance(event, FinalEvent):
        u = event.usage
        return pb.GenerateResponse(
            finish_reason=_FINISH[event.finish_reason], error=event.error, index=index,
            usage=pb.Usage(prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens,
                           completion_tokens=u.completion_tokens, drafted_tokens=u.drafted_tokens,
                           accepted_tokens=u.accepted_tokens, time_to_first_token_s=u.time_to_first_token_s),
        )
    response = pb.GenerateResponse(token_ids=list(event.token_ids), text=event.text, index=index)
    for lp in event.logprobs:
        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
    for top in event.top_logprobs:
        response.top_logprobs.add().candidates.extend(pb.TokenLogprob(token_id=c.token_id, logprob=c.logprob) for c in top)
    return response


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    @grpc_errors
    async def Generate(self, request, context):
        # When the client cancels or disconnects, grpc cancels this generator;
        # leaving the engine's iterator then drops the sequence and frees its
        # KV at the loop's next step. The call's deadline is the generation's
        # timeout, so a sequence past it leaves the batch the same way.
        timeout_s = call_timeout_s(context)
        self.plane.check_request_size(request.model, request_nbytes())
        tool_parser, reasoning_parser = self._parsers(request)
        generate = request_from_proto(request, tool_parser)
        answers = ChoiceAnswers(tool_parser, reasoning_parser) if generate.tools else None
        events = self.plane.generate_choices(generate, request.n or 1, timeout_s)
        try:
            async for index, event in events:
                response = event_to_proto(event, index)
                if answers is not None:
                    if isinstance(event, FinalEvent):
                        answers.finish(index, response)
                    else:
                        answers.feed(index, event.text)
                yield response
        finally:
            await events.aclose()

    def _parsers(self, request) -> tuple[ToolParser, ReasoningParser | None]:
        """How the model writes its calls and reasoning (model.toml); only
        asked when the request has tools."""
        if not request.tools:
            return _DEFAULT_PARSERS
        try:
            config = self.plane.model_config(request.model)
        except NotFound:
            return _DEFAULT_PARSERS
        return config.tool_parser, config.reasoning_parser

    @grpc_errors
    async def Tokenize(self, request, context):
        self.plane.check_request_size(request.model, request_nbytes())
        return pb.TokenizeResponse(token_ids=await self.plane.tokenize(request.model, request.text))

    @grpc_errors
    async def Detokenize(self, request, context):
        self.plane.check_request_size(request.model, request_nbytes())
        return pb.DetokenizeResponse(text=await self.plane.detokenize(request.model, list(request.token_ids)))
