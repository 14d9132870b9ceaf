"""The seam between a remote model and one engine's wire format.

A RemoteProtocol knows one engine's endpoints and JSON; RemoteModel
(model.py) does everything engines share: health, limits, timing, metrics,
final events. The contract:

- `inspect()` runs once at load, in a private event loop: it raises
  LoadFailed unless the server answers and serves `self.model`, and learns
  what this particular server can do (a tokenize endpoint, which sampling
  fields it takes). Nothing here may assume what it did not check.
- `refusal(request)` names what the engine or this server cannot do for a
  request (UNIMPLEMENTED), before anything is sent; nothing is dropped
  silently.
- `stream(request)` yields TokenEvents (text deltas; token ids and logprobs
  where the engine reports them) and ends with exactly one RemoteFinish, or
  raises. Closing it early closes the HTTP stream, which cancels the
  sequence on the engine.
- `probe()` raises unless the engine is healthy, and returns its load
  figures where it publishes them.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, AsyncIterator, ClassVar, Iterable, NamedTuple

from modeld.backends.errors import ErrorKind, FailedPrecondition, ModeldError, Unimplemented
from modeld.backends.generation.params import (
    Constraint, ConstraintKind, FinishReason, GenerateRequest, SpeculativeMode, TokenEvent,
)
from modeld.backends.remote.http import RemoteHttp

PROBE_TIMEOUT_S = 5.0  # a health probe slower than this is a failed one


@dataclass(frozen=True)
class RemoteFinish:
    """How a remote stream ended, with the engine's usage figures."""

    reason: FinishReason
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    error_kind: ErrorKind | None = None


@dataclass(frozen=True)
class RemoteLoad:
    """An engine's load, from its Prometheus /metrics (None: not published)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used: int = 0  # KV cache tokens in use: usage x capacity, where the engine gives both
    kv_capacity: int = 0
    kv_cache_usage: float | None = None  # 0-1
    prefix_cache_hit_ratio: float | None = None  # 0-1, since the engine started


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


class RemoteProtocol(ABC):
    engine: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str] = "/metrics"
    # False where a probe would disturb running requests (llama-cpp-python
    # interrupts a generation for any request that needs its model, its model
    # list included): probes then wait for an idle moment, and the requests'
    # own outcomes are the health signal meanwhile
    probe_when_busy: ClassVar[bool] = True

    def __init__(self, http: RemoteHttp, model: str) -> None:
        self.http = http
        self.model = model  # the engine's own name for it
        self.has_metrics = False  # set by inspect() where /metrics answered

    @property
    def where(self) -> str:
        return self.http.endpoint.where

    # -- load --------------------------------------------------------------------

    @abstractmethod
    async def inspect(self) -> None:
        """The server answers and serves self.model; learn what it can do."""

    async def find_metrics(self) -> None:
        """Whether the engine publishes load figures at metrics_path."""
        try:
            samples = parse_metrics((await self.http.get(self.metrics_path, PROBE_TIMEOUT_S)).text)
        except (ModeldError, ValueError):
            return
        self.has_metrics = self.read_load(samples) is not None

    def server_capabilities(self) -> dict[str, str]:
        """What this server does beyond the class's capabilities, for logs
        and the conformance table: feature -> "yes: how" or "no: why"."""
        return {"load figures": f"yes: {self.metrics_path}" if self.has_metrics else
                f"no: {self.where} publishes none at {self.metrics_path}"}

    # -- requests ------------------------------------------------------------------

    def refusal(self, request: GenerateRequest) -> str | None:
        """Why this engine cannot serve the request as asked; None if it can."""
        if request.params.speculative is not SpeculativeMode.NONE:
            return (f"speculative decoding is a setting of {self.where} when it starts, "
                    "not something a request can ask for")
        # the engine answers a tool call as structured deltas, which the token
        # stream modeld relays cannot carry: sending the tools would let the
        # engine call one and the client never see it
        if request.tools or any(m.tool_calls or m.role == "tool" for m in request.messages):
            return (f"tool calling is not relayed to {self.where}: its tool calls do not fit the token stream "
                    "modeld relays; call tools on a local model, or on the engine's own API")
        return None

    @abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | RemoteFinish]:
        """TokenEvents, then one RemoteFinish (see the module docstring)."""

    async def tokenize(self, text: str) -> list[int]:
        raise Unimplemented(f"{self.where} offers no tokenize endpoint")

    async def detokenize(self, token_ids: list[int]) -> str:
        raise Unimplemented(f"{self.where} offers no detokenize endpoint")

    # -- health --------------------------------------------------------------------

    async def probe(self) -> RemoteLoad | None:
        await self.http.get(self.health_path, PROBE_TIMEOUT_S)
        if not self.has_metrics:
            return None
        response = await self.http.get(self.metrics_path, PROBE_TIMEOUT_S)
        try:
            return self.read_load(parse_metrics(response.text))
        except ValueError:
            return None  # a garbled scrape costs the figures, not the health

    def read_load(self, samples: list[Sample]) -> RemoteLoad | None:
        """The load figures in a /metrics scrape, None if it has none."""
        return None

    # -- LoRA adapters (docs/remote.md, "LoRA adapters") -------------------------------
    # An adapter over a base on this engine is served by the engine itself,
    # under a name: modeld passes that name through, and, where the adapter's
    # model.toml gives remote_path, loads and unloads it there.

    #: "" where the engine serves adapters by name; else why it cannot
    lora_refusal: ClassVar[str] = "modeld does not pass LoRA adapters through to this engine"

    def for_adapter(self, name: str) -> RemoteProtocol:
        """A protocol whose requests run adapter `name` on this engine (the
        same client and what inspect() learned)."""
        raise FailedPrecondition(self.lora_refusal)

    async def adapter_served(self, name: str) -> str:
        """"" if the engine serves adapter `name` over this base now, else why not."""
        raise FailedPrecondition(self.lora_refusal)

    async def load_adapter(self, name: str, path: str) -> bool:
        """Have the engine load the adapter at `path` (its own file system)
        as `name`: True if it did, False if it already served that name."""
        raise FailedPrecondition(self.lora_refusal)

    async def unload_adapter(self, name: str) -> None:
        raise FailedPrecondition(self.lora_refusal)


def constraint_spec(constraint: Constraint) -> Any:
    """A constraint's spec as JSON values: a schema or a choice list as
    objects, anything else as its text."""
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        return json.loads(constraint.spec)
    if constraint.kind is ConstraintKind.CHOICE:
        return json.loads(constraint.spec)
    return constraint.spec


def choice_regex(constraint: Constraint) -> str:
    """A choice as the regex matching exactly one of its strings, for
    engines that take a regex but no choice list."""
    # only the metacharacters every regex dialect shares: Python's re.escape
    # also escapes spaces and '-', which some engines' dialects refuse
    return "(" + "|".join(re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", c) for c in json.loads(constraint.spec)) + ")"


ANY_OBJECT = {"type": "object"}  # json_object, for engines that take only a schema


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def metric_sum(samples: Iterable[Sample], names: tuple[str, ...], model: str = "") -> float | None:
    """The sum over labels of the first name present; samples labelled with
    another model_name than `model` are left out (one engine, several models)."""
    for name in names:
        found = [s for s in samples if s.name == name]
        if found:
            if model and any(s.labels.get("model_name") == model for s in found):
                found = [s for s in found if s.labels.get("model_name") == model]
            return sum(s.value for s in found)
    return None


def ratio(hits: float | None, total: float | None) -> float | None:
    if hits is None or not total:
        return None
    return hits / total


def served_names(model_path: str) -> set[str]:
    """Names a client may use for a model an engine loaded from a path or a
    hub id: the whole of it and its last component."""
    return {model_path, model_path.rstrip("/").rsplit("/", 1)[-1]}
