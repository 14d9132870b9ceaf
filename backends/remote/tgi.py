"""Hugging Face Text Generation Inference: POST /generate_stream, GET /info.

Written to TGI's published API documentation (its server needs CUDA, so the
suite tests this adapter against a small server speaking the same wire
format, tests/remote_fakes.py). What the documentation says and this
adapter relies on:

- `{"inputs": text, "parameters": {...}}`; greedy is `do_sample: false`,
  and TGI refuses temperature <= 0 and top_p outside (0, 1), so those are
  sent only when they sample;
- one event per token: `{"index", "token": {"id", "text", "logprob",
  "special"}, "top_tokens": [...], "generated_text", "details"}`; the last
  carries `generated_text` and `details` (`finish_reason` length |
  eos_token | stop_sequence, `generated_tokens`, `input_length`); no
  [DONE];
- TGI keeps a matched stop sequence in the generated text: modeld trims it
  here (IncrementalText, as the local backends do), so a stop string never
  reaches the client, whatever the engine;
- /tokenize exists (probed at load); there is no detokenize endpoint;
- /metrics: tgi_batch_current_size (running), tgi_queue_size (waiting).

- penalties: `repetition_penalty` and `frequency_penalty`; constraints as
  `grammar` {"type": "json", "value": schema} or {"type": "regex",
  "value": ...} (json_object as the schema of any object, a choice as the
  regex of its alternatives).

Not in TGI's /generate parameters, so refused: min_p, ignore_eos,
stop_token_ids, presence_penalty, logit_bias, min_tokens, special tokens
kept in the text, a stop string kept in the output, Lark and GBNF
grammars, token-id prompts, chat messages (TGI's chat API is its OpenAI
one: use the openai backend for that).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from modeld.backends.base import Capability
from modeld.backends.errors import ErrorKind, LoadFailed, ModeldError, Unimplemented
from modeld.backends.generation.detokenize import IncrementalText
from modeld.backends.generation.params import (
    ConstraintKind, FinishReason, GenerateRequest, TokenEvent, TokenLogprob,
)
from modeld.backends.remote.health import FailureKind
from modeld.backends.remote.http import RemoteFailure
from modeld.backends.remote.model import RemoteBackend
from modeld.backends.remote.protocol import (
    ANY_OBJECT, PROBE_TIMEOUT_S, RemoteFinish, RemoteLoad, RemoteProtocol, Sample, choice_regex, constraint_spec,
    metric_sum, served_names,
)

_FINISH = {"length": FinishReason.LENGTH, "eos_token": FinishReason.STOP, "stop_sequence": FinishReason.STOP}
_KIND_BY_ERROR_TYPE = {"validation": ErrorKind.INVALID_ARGUMENT, "overloaded": ErrorKind.RESOURCE_EXHAUSTED}


class TgiProtocol(RemoteProtocol):
    engine = "tgi"

    def __init__(self, http, model: str) -> None:
        super().__init__(http, model)
        self.no_tokenize = ""  # "" or why /tokenize is not there

    async def inspect(self) -> None:
        info = await self.http.get_json("/info")
        model_id = str(info.get("model_id", "")) if isinstance(info, dict) else ""
        if self.model not in served_names(model_id):
            raise LoadFailed(f"{self.where} serves {model_id or 'no model'!r}, not {self.model!r} (its /info); "
                             "set [remote] model to its model_id")
        try:
            await self.tokenize_now("probe")
        except ModeldError as exc:
            self.no_tokenize = f"{self.where} has no working /tokenize ({exc})"
        await self.find_metrics()

    def server_capabilities(self) -> dict[str, str]:
        return {**super().server_capabilities(),
                "tokenize": "yes: /tokenize" if not self.no_tokenize else f"no: {self.no_tokenize}",
                "detokenize": "no: TGI's API has no detokenize endpoint",
                "usage": "reported by the server (details.input_length, generated_tokens); no prefix-cache figure"}

    def refusal(self, request: GenerateRequest) -> str | None:
        reason = super().refusal(request)
        if reason:
            return reason
        p = request.params
        lacking = [name for name, asked in (
            ("min_p", p.min_p != 0.0), ("ignore_eos", p.ignore_eos), ("stop_token_ids", bool(p.stop_token_ids)),
            ("presence_penalty", p.presence_penalty != 0.0), ("logit_bias", bool(p.logit_bias)),
            ("min_tokens", p.min_tokens != 0), ("skip_special_tokens: false", not p.skip_special_tokens),
            ("include_stop_str_in_output", p.include_stop_str_in_output),
            (f"{p.constraint.kind.value if p.constraint else ''} grammar (its grammar takes json or regex)",
             p.constraint is not None and p.constraint.kind in (ConstraintKind.LARK, ConstraintKind.GBNF)),
            ("a prompt of token ids", bool(request.token_ids)),
            ("chat messages (TGI's chat API is its OpenAI one: backends = [\"openai\"])", bool(request.messages)),
        ) if asked]
        if lacking:
            return f"TGI's /generate_stream takes no {lacking[0]}"
        return None

    def body(self, request: GenerateRequest) -> dict[str, Any]:
        p = request.params
        parameters: dict[str, Any] = {"max_new_tokens": p.max_tokens, "details": True, "return_full_text": False,
                                      "do_sample": not p.is_greedy, "repetition_penalty": p.repetition_penalty}
        if p.frequency_penalty:
            parameters["frequency_penalty"] = p.frequency_penalty
        c = p.constraint
        if c is not None and c.kind is ConstraintKind.JSON_SCHEMA:
            parameters["grammar"] = {"type": "json", "value": constraint_spec(c)}
        elif c is not None and c.kind is ConstraintKind.JSON_OBJECT:
            parameters["grammar"] = {"type": "json", "value": ANY_OBJECT}
        elif c is not None and c.kind is ConstraintKind.REGEX:
            parameters["grammar"] = {"type": "regex", "value": c.spec}
        elif c is not None and c.kind is ConstraintKind.CHOICE:
            parameters["grammar"] = {"type": "regex", "value": choice_regex(c)}
        if not p.is_greedy:
            parameters["temperature"] = p.temperature
            if p.top_p < 1.0:
                parameters["top_p"] = p.top_p
            if p.top_k:
                parameters["top_k"] = p.top_k
        if p.seed is not None:
            parameters["seed"] = p.seed
        if p.stop:
            parameters["stop"] = list(p.stop)
        if p.logprobs:
            parameters["top_n_tokens"] = p.logprobs
        return {"inputs": request.prompt, "parameters": parameters}

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | RemoteFinish]:
        text = IncrementalText(request.params.stop)
        num_tokens = 0
        async for event in self.http.events("/generate_stream", self.body(request)):
            if not isinstance(event, dict):
                raise RemoteFailure(f"{self.where} sent an event that is not a JSON object", FailureKind.BROKEN_STREAM)
            if event.get("error"):
                yield _error_finish(self.where, event, num_tokens)
                return
            details = event.get("details")
            token = self.token_event(event, text, request.params.logprobs, final=bool(details))
            if token is not None:
                num_tokens += len(token.token_ids)
                yield token
            if details:
                yield self.finish(details, num_tokens)
                return

    def token_event(self, event: dict, text: IncrementalText, num_top: int, final: bool) -> TokenEvent | None:
        token = event.get("token")
        if not isinstance(token, dict) or "id" not in token:
            raise RemoteFailure(f"{self.where} sent a stream event without a token: {event!r}"[:300],
                                FailureKind.BROKEN_STREAM)
        piece = "" if token.get("special") else str(token.get("text") or "")
        delta = text.push(piece.encode("utf-8"))
        if final or text.stopped:
            delta += text.flush()
        chosen = TokenLogprob(int(token["id"]), float(token.get("logprob") or 0.0))
        if not num_top:
            return TokenEvent((chosen.token_id,), delta)
        tops = sorted((t for t in event.get("top_tokens") or () if isinstance(t, dict)),
                      key=lambda t: -float(t.get("logprob") or 0.0))
        top = tuple(TokenLogprob(int(t["id"]), float(t.get("logprob") or 0.0)) for t in tops[:num_top])
        return TokenEvent((chosen.token_id,), delta, (chosen,), (top,))

    def finish(self, details: dict, num_tokens: int) -> RemoteFinish:
        figures = dict(prompt_tokens=int(details.get("input_length") or 0),
                       completion_tokens=int(details.get("generated_tokens") or num_tokens))
        reason = _FINISH.get(details.get("finish_reason"))
        if reason is None:
            return RemoteFinish(FinishReason.ERROR, error=f"{self.where} ended the sequence with finish_reason "
                                f"{details.get('finish_reason')!r}", error_kind=ErrorKind.UNAVAILABLE, **figures)
        return RemoteFinish(reason, **figures)

    async def tokenize(self, text: str) -> list[int]:
        if self.no_tokenize:
            raise Unimplemented(self.no_tokenize)
        return await self.tokenize_now(text)

    async def tokenize_now(self, text: str) -> list[int]:
        reply = await self.http.post_json("/tokenize", {"inputs": text}, PROBE_TIMEOUT_S)
        if not isinstance(reply, list) or not all(isinstance(t, dict) and isinstance(t.get("id"), int) for t in reply):
            raise RemoteFailure(f"{self.where} answered /tokenize without tokens: {reply!r}"[:300],
                                FailureKind.BROKEN_STREAM)
        return [t["id"] for t in reply]

    async def detokenize(self, token_ids: list[int]) -> str:
        raise Unimplemented(f"TGI's API has no detokenize endpoint ({self.where})")

    def read_load(self, samples: list[Sample]) -> RemoteLoad | None:
        running = metric_sum(samples, ("tgi_batch_current_size",))
        if running is None:
            return None
        return RemoteLoad(num_running=int(running), num_waiting=int(metric_sum(samples, ("tgi_queue_size",)) or 0))


def _error_finish(where: str, event: dict, num_tokens: int) -> RemoteFinish:
    kind = _KIND_BY_ERROR_TYPE.get(str(event.get("error_type")), ErrorKind.UNAVAILABLE)
    return RemoteFinish(FinishReason.ERROR, completion_tokens=num_tokens,
                        error=f"{where} failed the sequence: {event['error']}", error_kind=kind)


class TgiBackend(RemoteBackend):
    name = "tgi"
    engines = ("tgi",)
    protocol = TgiProtocol
    capabilities = frozenset({
        Capability.GENERATION, Capability.STREAMING, Capability.LOGPROBS,
        Capability.CONTINUOUS_BATCHING, Capability.PREFIX_CACHE,  # its router batches; v3 caches prefixes
        Capability.CONSTRAINED_DECODING,
    })
