"""vLLM's OpenAI-compatible server: the openai backend plus what vLLM adds.

- Sampling: top_k, min_p, seed, ignore_eos, stop_token_ids, logprobs, the
  presence, frequency and repetition penalties, logit_bias, min_tokens,
  skip_special_tokens and include_stop_str_in_output, always sent with
  modeld's values (top_k -1 for off, the spelling every vLLM version
  takes): vLLM otherwise applies the defaults in the model's
  generation_config.json, which would change what a request means.
- Constraints as `structured_outputs` ({json | json_object | regex | choice
  | grammar}), vLLM's field since it retired the `guided_*` ones.
- Token ids: `return_tokens_as_token_ids` makes every logprob entry name
  its token as "token_id:<id>", so each request asks for logprobs (0
  alternatives when the caller wants none) to learn the ids it streams.
- /tokenize and /detokenize for Tokenize and Detokenize.
- /health for health, /metrics for load: running and waiting requests, KV
  cache usage (vllm:kv_cache_usage_perc; gpu_cache_usage_perc before v1)
  times its capacity from vllm:cache_config_info, prefix-cache hits over
  queries.
- LoRA adapters (docs/remote.md): an adapter runs as `model = <its name>`,
  the name vLLM serves it under (--lora-modules NAME=PATH, listed in
  /v1/models with the base as its parent), or loaded at run time through
  POST /v1/load_lora_adapter {lora_name, lora_path} and removed through
  /v1/unload_lora_adapter {lora_name} (routes vLLM adds only with
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
"""

from __future__ import annotations

import copy
from typing import Any

from modeld.backends.base import Capability
from modeld.backends.errors import ErrorKind, FailedPrecondition, InvalidArgument
from modeld.backends.generation.params import (
    FinishReason, GenerateRequest, SamplingParams, TokenEvent, TokenLogprob,
)
from modeld.backends.remote.http import error_for_status, remote_message
from modeld.backends.remote.model import RemoteBackend
from modeld.backends.remote.openai_compat import CHAT, OpenAIProtocol
from modeld.backends.remote.protocol import RemoteFinish, RemoteLoad, Sample, metric_sum, ratio

_TOKEN_PREFIX = "token_id:"


class VllmProtocol(OpenAIProtocol):
    engine = "vllm"
    health_path = "/health"
    metrics_path = "/metrics"
    probe_when_busy = True  # /health and /metrics never touch vLLM's engine loop

    async def inspect(self) -> None:
        await self.check_listed()
        # vLLM's API is known: no need to read its schema
        self.schema_fields = None
        self.tokenize_route = ("/tokenize", "prompt", "tokens")
        self.detokenize_route = ("/detokenize", "tokens", "prompt")
        await self.find_metrics()

    def takes(self, path: str, field: str) -> bool:
        return True

    def streams_usage(self, path: str) -> bool:
        return True

    def server_capabilities(self) -> dict[str, str]:
        return {**super(OpenAIProtocol, self).server_capabilities(),
                "tokenize": "yes: /tokenize", "detokenize": "yes: /detokenize",
                "usage": "reported by the server (stream_options.include_usage)"}

    def refusal(self, request: GenerateRequest) -> str | None:
        # logprobs are fine here; only the base class's refusals apply
        return super(OpenAIProtocol, self).refusal(request)

    def extras(self, path: str, p: SamplingParams) -> dict[str, Any]:
        extras: dict[str, Any] = {
            "top_k": p.top_k or -1, "min_p": p.min_p, "ignore_eos": p.ignore_eos,
            "repetition_penalty": p.repetition_penalty, "frequency_penalty": p.frequency_penalty,
            "presence_penalty": p.presence_penalty, "min_tokens": p.min_tokens,
            "skip_special_tokens": p.skip_special_tokens, "include_stop_str_in_output": p.include_stop_str_in_output,
            "return_tokens_as_token_ids": True,
        }
        if p.stop_token_ids:
            extras["stop_token_ids"] = list(p.stop_token_ids)
        if p.logit_bias:
            extras["logit_bias"] = {str(t): b for t, b in p.logit_bias}
        if p.constraint is not None:
            extras.update(self.constraint_fields(path, p.constraint))
        if path == CHAT:
            extras.update(logprobs=True, top_logprobs=p.logprobs)
        else:
            extras["logprobs"] = p.logprobs
        return extras

    def token_event(self, choice: dict, chat: bool, request: GenerateRequest) -> TokenEvent | RemoteFinish | None:
        text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
        entries = _logprob_entries(choice.get("logprobs"), chat)
        ids = [_token_id(token) for token, _, _ in entries]
        if None in ids:
            if request.params.logprobs:
                return RemoteFinish(FinishReason.ERROR, error_kind=ErrorKind.UNIMPLEMENTED, error=(
                    f"{self.where} did not name its tokens by id (return_tokens_as_token_ids), so their logprobs "
                    "cannot be reported"))
            ids = []  # text only: an older vLLM
        if not text and not ids:
            return None
        n = request.params.logprobs
        if not n or not ids:
            return TokenEvent(tuple(ids), text)
        chosen = tuple(TokenLogprob(i, lp) for i, (_, lp, _) in zip(ids, entries))
        tops = tuple(_top(alternatives, n) for _, _, alternatives in entries)
        return TokenEvent(tuple(ids), text, chosen, tops)

    # -- LoRA adapters ------------------------------------------------------------------

    lora_refusal = ""

    def for_adapter(self, name: str) -> VllmProtocol:
        adapter = copy.copy(self)
        adapter.model = name  # vLLM picks the adapter by the request's model
        return adapter

    async def adapter_served(self, name: str) -> str:
        listing = await self.http.get_json("/v1/models")
        cards = {m.get("id"): m for m in (listing.get("data") or []) if isinstance(m, dict)} \
            if isinstance(listing, dict) else {}
        card = cards.get(name)
        if card is None:
            adapters = [i for i, c in cards.items() if c.get("parent")]
            return (f"{self.where} serves no adapter {name!r} (its /v1/models lists "
                    f"{', '.join(map(repr, adapters)) or 'no adapters'}): start it with --enable-lora "
                    f"--lora-modules {name}=PATH, or set remote_path in the adapter's model.toml for modeld to "
                    "load it there")
        parent = card.get("parent")
        if not parent:
            return f"{self.where} serves {name!r} as a base model, not as an adapter"
        if parent != self.model:
            return f"{self.where} serves {name!r} as an adapter of {parent!r}, not of {self.model!r}"
        return ""

    async def load_adapter(self, name: str, path: str) -> bool:
        route = "/v1/load_lora_adapter"
        answer = await self.http.answer("POST", route, {"lora_name": name, "lora_path": path})
        if answer.status_code < 400:
            return True
        message = remote_message(answer.text, answer.status_code)
        if answer.status_code == 404 and _route_missing(answer):
            raise FailedPrecondition(
                f"{self.where} takes no adapters at run time (no {route}): start it with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora, or serve the adapter with "
                f"--lora-modules {name}=PATH and leave remote_path out")
        if answer.status_code == 400 and "already been loaded" in message and not await self.adapter_served(name):
            return False  # left by an earlier run of the daemon: served, and not ours to unload
        # the engine's own trouble; vLLM answers 500 for an adapter it cannot apply, which is the adapter's
        if answer.status_code in (502, 503, 504):
            raise error_for_status(f"{self.where} (POST {route})", answer.status_code, answer.text)
        raise InvalidArgument(f"{self.where} did not load the adapter from config key remote_path "
                              f"(HTTP {answer.status_code}): {message}")

    async def unload_adapter(self, name: str) -> None:
        route = "/v1/unload_lora_adapter"
        answer = await self.http.answer("POST", route, {"lora_name": name})
        if answer.status_code < 400 or answer.status_code == 404 and not _route_missing(answer):
            return  # gone, or already gone (a restarted engine)
        raise error_for_status(f"{self.where} (POST {route})", answer.status_code, answer.text)

    def read_load(self, samples: list[Sample]) -> RemoteLoad | None:
        running = metric_sum(samples, ("vllm:num_requests_running",), self.model)
        if running is None:
            return None
        usage = metric_sum(samples, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), self.model)
        capacity = _kv_capacity(samples)
        hits = metric_sum(samples, ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"), self.model)
        queries = metric_sum(samples, ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
                             self.model)
        hit_ratio = ratio(hits, queries)
        if hit_ratio is None:
            hit_ratio = metric_sum(samples, ("vllm:gpu_prefix_cache_hit_rate",), self.model)
        return RemoteLoad(
            num_running=int(running),
            num_waiting=int(metric_sum(samples, ("vllm:num_requests_waiting",), self.model) or 0),
            kv_used=round((usage or 0.0) * capacity), kv_capacity=capacity,
            kv_cache_usage=usage, prefix_cache_hit_ratio=hit_ratio,
        )


def _logprob_entries(logprobs: Any, chat: bool) -> list[tuple[str, float, dict[str, float]]]:
    """(token, logprob, alternatives) per token, from either API's shape."""
    if not isinstance(logprobs, dict):
        return []
    if chat:
        return [(e.get("token", ""), float(e.get("logprob", 0.0)),
                 {a.get("token", ""): float(a.get("logprob", 0.0)) for a in e.get("top_logprobs") or ()})
                for e in logprobs.get("content") or () if isinstance(e, dict)]
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    return [(token, float(values[i] if i < len(values) and values[i] is not None else 0.0),
             dict(tops[i]) if i < len(tops) and isinstance(tops[i], dict) else {})
            for i, token in enumerate(tokens)]


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith(_TOKEN_PREFIX):
        try:
            return int(token[len(_TOKEN_PREFIX):])
        except ValueError:
            return None
    return None


def _top(alternatives: dict[str, float], n: int) -> tuple[TokenLogprob, ...]:
    """The n most likely, best first (vLLM also lists the chosen token when
    it is not among them; modeld's alternatives are the top n only)."""
    ranked = sorted(((lp, _token_id(t)) for t, lp in alternatives.items()), key=lambda x: -x[0])
    return tuple(TokenLogprob(i, lp) for lp, i in ranked if i is not None)[:n]


def _route_missing(answer) -> bool:
    """A 404 of the web framework (no such route: {"detail": "Not Found"}),
    not one of vLLM's own errors (an adapter it cannot find)."""
    try:
        body = answer.json()
    except ValueError:
        return True
    return not (isinstance(body, dict) and ("object" in body or "error" in body or "type" in body))


def _kv_capacity(samples: list[Sample]) -> int:
    """KV cache tokens: blocks x block size, from vllm:cache_config_info."""
    for s in samples:
        if s.name == "vllm:cache_config_info":
            try:
                return int(s.labels.get("num_gpu_blocks", "")) * int(s.labels.get("block_size", ""))
            except ValueError:
                return 0
    return 0


class VllmBackend(RemoteBackend):
    name = "vllm"
    engines = ("vllm",)
    protocol = VllmProtocol
    capabilities = frozenset({
        Capability.GENERATION, Capability.STREAMING, Capability.LOGPROBS,
        # vLLM's own scheduler batches continuously and caches prefixes (on by default since v1)
        Capability.CONTINUOUS_BATCHING, Capability.PREFIX_CACHE,
        Capability.CONSTRAINED_DECODING,
        # adapters by name: --lora-modules, or loaded through its run-time LoRA routes
        Capability.LORA,
    })
