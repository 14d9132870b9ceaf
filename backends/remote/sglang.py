"""SGLang's native API: POST /generate `{text | input_ids, sampling_params,
stream}`, model checks through /get_model_info.

Written to SGLang's published API documentation (its server needs CUDA,
so the suite tests this adapter against a small server speaking the same
wire format, tests/remote_fakes.py). What the documentation says and this
adapter relies on:

- each streamed event holds the whole text so far, so deltas are computed
  here (a server started with incremental output is refused as malformed
  rather than garbled); `output_ids` and `meta_info.output_token_logprobs`
  ([logprob, token_id, text] per token) are cumulative likewise;
- `meta_info` carries `prompt_tokens`, `completion_tokens`, `cached_tokens`
  and, on the last event, `finish_reason` ({"type": "stop" | "length" |
  "abort", ...}); the stream ends with `data: [DONE]`;
- stop strings are trimmed from the text by SGLang itself;
- /tokenize and /detokenize exist in recent versions: probed at load;
- /metrics (with --enable-metrics): sglang:num_running_reqs,
  sglang:num_queue_reqs, sglang:token_usage, sglang:cache_hit_rate.

Sampling extensions map to its `sampling_params` names: the three
penalties, `min_new_tokens`, `skip_special_tokens`, `no_stop_trim` (a stop
string kept in the output), `logit_bias`; constraints to `json_schema`
(json_object as the schema of any object), `regex` (a choice as the regex
of its alternatives) and `ebnf` (a GBNF grammar).

LoRA adapters: a request runs adapter NAME with `lora_path: NAME` (the
name SGLang serves it under: --lora-paths NAME=PATH, or loaded at run time
through POST /load_lora_adapter {lora_name, lora_path}, removed through
/unload_lora_adapter {lora_name}; both answer {success, error_message}).
An adapter said to be served already is checked by a one-token /generate
under its name, which SGLang refuses for an adapter it has not loaded.

Not in the native API, so refused: chat messages (its chat template runs
in its OpenAI API: use the openai backend for that), a per-request seed,
Lark grammars (its `ebnf` is GBNF's notation).
"""

from __future__ import annotations

import copy
from typing import Any, AsyncIterator

from modeld.backends.base import Capability
from modeld.backends.errors import (
    ErrorKind, FailedPrecondition, InvalidArgument, LoadFailed, ModeldError, Unimplemented,
)
import json

from modeld.backends.generation.params import (
    Constraint, ConstraintKind, FinishReason, GenerateRequest, TokenEvent, TokenLogprob,
)
from modeld.backends.remote.health import FailureKind
from modeld.backends.remote.http import RemoteFailure, error_for_status, kind_for_status, remote_message
from modeld.backends.remote.model import RemoteBackend
from modeld.backends.remote.protocol import (
    ANY_OBJECT, PROBE_TIMEOUT_S, RemoteFinish, RemoteLoad, RemoteProtocol, Sample, choice_regex, metric_sum,
    served_names,
)

class SglangProtocol(RemoteProtocol):
    engine = "sglang"

    def __init__(self, http, model: str) -> None:
        super().__init__(http, model)
        self.token_routes = ""  # "" or why /tokenize is not there
        self.lora = ""  # the adapter requests run under ("" the base)

    async def inspect(self) -> None:
        info = await self.http.get_json("/get_model_info")
        if not isinstance(info, dict):
            raise LoadFailed(f"{self.where} answered /get_model_info with {info!r}"[:300])
        if info.get("is_generation") is False:
            raise LoadFailed(f"{self.where} serves {info.get('model_path')!r}, which is not a generative model")
        names = served_names(str(info.get("model_path", ""))) | {str(info.get("served_model_name", ""))}
        if self.model not in names:
            raise LoadFailed(f"{self.where} serves {info.get('model_path')!r}, not {self.model!r} (its "
                             "/get_model_info); set [remote] model to the served name")
        await self._find_token_routes()
        await self.find_metrics()

    async def _find_token_routes(self) -> None:
        try:
            await self.tokenize_now("probe")
        except ModeldError as exc:
            self.token_routes = f"{self.where} has no working /tokenize ({exc})"

    def server_capabilities(self) -> dict[str, str]:
        tokens = "yes: /tokenize, /detokenize" if not self.token_routes else f"no: {self.token_routes}"
        return {**super().server_capabilities(), "tokenize": tokens, "detokenize": tokens,
                "usage": "reported by the server (meta_info)"}

    def refusal(self, request: GenerateRequest) -> str | None:
        reason = super().refusal(request)
        if reason:
            return reason
        if request.messages:
            return ("SGLang's native /generate takes text or token ids; chat messages need its OpenAI API "
                    "(engine = \"sglang\" with backends = [\"openai\"])")
        if request.params.seed is not None:
            return "SGLang's documented /generate sampling_params take no per-request seed"
        c = request.params.constraint
        if c is not None and c.kind is ConstraintKind.LARK:
            return "SGLang's /generate takes grammars as ebnf (GBNF notation), not Lark; send the grammar as GBNF"
        return None

    def body(self, request: GenerateRequest) -> dict[str, Any]:
        p = request.params
        sampling = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                    "top_k": p.top_k or -1, "min_p": p.min_p, "ignore_eos": p.ignore_eos,
                    # always sent, so the server's defaults never change a request's meaning
                    "repetition_penalty": p.repetition_penalty, "frequency_penalty": p.frequency_penalty,
                    "presence_penalty": p.presence_penalty, "min_new_tokens": p.min_tokens,
                    "skip_special_tokens": p.skip_special_tokens, "no_stop_trim": p.include_stop_str_in_output}
        if p.logit_bias:
            sampling["logit_bias"] = {str(t): b for t, b in p.logit_bias}
        if p.constraint is not None:
            sampling.update(_constraint(p.constraint))
        if p.stop:
            sampling["stop"] = list(p.stop)
        if p.stop_token_ids:
            sampling["stop_token_ids"] = list(p.stop_token_ids)
        body: dict[str, Any] = {"sampling_params": sampling, "stream": True,
                                # logprobs also name each token's id
                                "return_logprob": True, "top_logprobs_num": p.logprobs}
        if request.token_ids:
            body["input_ids"] = list(request.token_ids)
        else:
            body["text"] = request.prompt
        if self.lora:
            body["lora_path"] = self.lora
        return body

    # -- LoRA adapters ------------------------------------------------------------------

    lora_refusal = ""

    def for_adapter(self, name: str) -> SglangProtocol:
        adapter = copy.copy(self)
        adapter.lora = name
        return adapter

    async def adapter_served(self, name: str) -> str:
        body = {"text": "a", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "lora_path": name,
                "stream": False}
        answer = await self.http.answer("POST", "/generate", body, PROBE_TIMEOUT_S * 6)
        if answer.status_code >= 500:
            raise error_for_status(f"{self.where} (POST /generate)", answer.status_code, answer.text)
        if answer.status_code >= 400:
            return (f"{self.where} runs no adapter {name!r} ({remote_message(answer.text, answer.status_code)}); "
                    f"start it with --enable-lora --lora-paths {name}=PATH, or set remote_path in the adapter's "
                    "model.toml for modeld to load it there")
        return ""

    async def load_adapter(self, name: str, path: str) -> bool:
        ok, message = await self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if ok:
            return True
        if "already" in message and not await self.adapter_served(name):
            return False  # left by an earlier run of the daemon: served, and not ours to unload
        raise InvalidArgument(f"{self.where} did not load the adapter from config key remote_path: {message}")

    async def unload_adapter(self, name: str) -> None:
        await self._lora_call("/unload_lora_adapter", {"lora_name": name})

    async def _lora_call(self, route: str, body: dict) -> tuple[bool, str]:
        answer = await self.http.answer("POST", route, body)
        if answer.status_code == 404:
            raise FailedPrecondition(f"{self.where} has no {route} (an SGLang before run-time LoRA loading): "
                                     f"serve the adapter with --lora-paths {body['lora_name']}=PATH and leave "
                                     "remote_path out")
        if answer.status_code >= 500:
            raise error_for_status(f"{self.where} (POST {route})", answer.status_code, answer.text)
        try:
            reply = answer.json()
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise RemoteFailure(f"{self.where} answered {route} with something that is not a JSON object",
                                FailureKind.BROKEN_STREAM)
        message = remote_message(json.dumps({"error": reply.get("error_message") or ""}), answer.status_code)
        return bool(reply.get("success")) and answer.status_code < 400, message

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | RemoteFinish]:
        seen = _Seen()
        async for event in self.http.events("/generate", self.body(request)):
            if not isinstance(event, dict):
                raise RemoteFailure(f"{self.where} sent an event that is not a JSON object"[:300],
                                    FailureKind.BROKEN_STREAM)
            if event.get("error"):
                yield _error_finish(self.where, event["error"], seen)
                return
            token = self.token_event(event, seen, request.params.logprobs)
            if token is not None:
                yield token
            meta = event.get("meta_info") or {}
            if meta.get("finish_reason"):
                yield self.finish(meta, seen)
                return

    def token_event(self, event: dict, seen: _Seen, num_top: int) -> TokenEvent | None:
        text = event.get("text") or ""
        if not text.startswith(seen.text):
            raise RemoteFailure(f"{self.where} sent text that does not extend the text before it; modeld reads "
                                "SGLang's cumulative stream (start it without incremental streaming output)",
                                FailureKind.BROKEN_STREAM)
        delta, seen.text = text[len(seen.text):], text
        meta = event.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        new_entries = entries[seen.num_tokens:]
        ids = [int(e[1]) for e in new_entries if isinstance(e, (list, tuple)) and len(e) >= 2]
        if not ids and isinstance(event.get("output_ids"), list):
            ids = [int(i) for i in event["output_ids"][seen.num_tokens:]]
        if not delta and not ids:
            return None
        tops_all = meta.get("output_top_logprobs") or []
        new_tops = tops_all[seen.num_tokens:seen.num_tokens + len(ids)]
        seen.num_tokens += len(ids)
        if not num_top or len(new_entries) != len(ids):
            return TokenEvent(tuple(ids), delta)
        chosen = tuple(TokenLogprob(int(e[1]), float(e[0])) for e in new_entries)
        tops = tuple(_top(t, num_top) for t in new_tops) + ((),) * (len(ids) - len(new_tops))
        return TokenEvent(tuple(ids), delta, chosen, tops)

    def finish(self, meta: dict, seen: _Seen) -> RemoteFinish:
        reason = meta["finish_reason"]
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        figures = dict(prompt_tokens=int(meta.get("prompt_tokens") or 0),
                       cached_prompt_tokens=int(meta.get("cached_tokens") or 0),
                       completion_tokens=int(meta.get("completion_tokens") or seen.num_tokens))
        if kind == "stop":
            return RemoteFinish(FinishReason.STOP, **figures)
        if kind == "length":
            return RemoteFinish(FinishReason.LENGTH, **figures)
        message = reason.get("message", "") if isinstance(reason, dict) else ""
        status = reason.get("status_code") if isinstance(reason, dict) else None
        return RemoteFinish(FinishReason.ERROR, error=f"{self.where} ended the sequence ({kind}): {message}".rstrip(": "),
                            error_kind=kind_for_status(status), **figures)

    # -- tokens --------------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        if self.token_routes:
            raise Unimplemented(self.token_routes)
        return await self.tokenize_now(text)

    async def tokenize_now(self, text: str) -> list[int]:
        reply = await self.http.post_json("/tokenize", {"model": self.model, "prompt": text}, PROBE_TIMEOUT_S)
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RemoteFailure(f"{self.where} answered /tokenize without token ids: {reply!r}"[:300],
                                FailureKind.BROKEN_STREAM)
        return tokens

    async def detokenize(self, token_ids: list[int]) -> str:
        if self.token_routes:
            raise Unimplemented(self.token_routes)
        reply = await self.http.post_json("/detokenize", {"model": self.model, "tokens": list(token_ids)})
        text = reply.get("text", reply.get("prompt")) if isinstance(reply, dict) else None
        if not isinstance(text, str):
            raise RemoteFailure(f"{self.where} answered /detokenize without text: {reply!r}"[:300],
                                FailureKind.BROKEN_STREAM)
        return text

    # -- load ------------------------------------------------------------------------------

    def read_load(self, samples: list[Sample]) -> RemoteLoad | None:
        running = metric_sum(samples, ("sglang:num_running_reqs",), self.model)
        if running is None:
            return None
        return RemoteLoad(
            num_running=int(running),
            num_waiting=int(metric_sum(samples, ("sglang:num_queue_reqs",), self.model) or 0),
            kv_cache_usage=metric_sum(samples, ("sglang:token_usage",), self.model),
            prefix_cache_hit_ratio=metric_sum(samples, ("sglang:cache_hit_rate",), self.model),
        )


def _constraint(c: Constraint) -> dict[str, str]:
    if c.kind is ConstraintKind.JSON_SCHEMA:
        return {"json_schema": c.spec}
    if c.kind is ConstraintKind.JSON_OBJECT:
        return {"json_schema": json.dumps(ANY_OBJECT)}
    if c.kind is ConstraintKind.REGEX:
        return {"regex": c.spec}
    if c.kind is ConstraintKind.CHOICE:
        return {"regex": choice_regex(c)}
    return {"ebnf": c.spec}  # GBNF; Lark is refused before this


class _Seen:
    """How much of SGLang's cumulative stream has gone out already."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0


def _top(entries: Any, n: int) -> tuple[TokenLogprob, ...]:
    if not isinstance(entries, list):
        return ()
    ranked = sorted((e for e in entries if isinstance(e, (list, tuple)) and len(e) >= 2), key=lambda e: -float(e[0]))
    return tuple(TokenLogprob(int(e[1]), float(e[0])) for e in ranked[:n])


def _error_finish(where: str, error: Any, seen: _Seen) -> RemoteFinish:
    message = error.get("message", error) if isinstance(error, dict) else error
    return RemoteFinish(FinishReason.ERROR, completion_tokens=seen.num_tokens,
                        error=f"{where} failed the sequence: {message}", error_kind=ErrorKind.UNAVAILABLE)


class SglangBackend(RemoteBackend):
    name = "sglang"
    engines = ("sglang",)
    protocol = SglangProtocol
    capabilities = frozenset({
        Capability.GENERATION, Capability.STREAMING, Capability.LOGPROBS,
        Capability.CONTINUOUS_BATCHING, Capability.PREFIX_CACHE,  # its scheduler and RadixAttention
        Capability.CONSTRAINED_DECODING,
        Capability.LORA,  # adapters by name (lora_path), --lora-paths or /load_lora_adapter
    })
