"""A language model served by a remote engine, and the backend base class the
four engine backends share.

The model holds no local memory (nbytes 0, so the LRU never evicts it for
room). Beyond GenerativeModel it offers what the engine reads to route and
report (duck-typed on purpose: a local model has none of it):

- `is_healthy` and `set_health_listener(fn)`: the HealthTracker's verdict;
  the engine turns the model's health NOT_SERVING and sends requests to the
  next backend in the model's list while it is False.
- `num_running`, `num_waiting`, `kv_cache_usage`, `load`: the engine's own
  figures from its /metrics where it has them, for the node stats; they also
  reach the observer's `on_step`, as a local loop's do.
- `server_capabilities`: what this server turned out to do at load.

A LoRA adapter over a remote base (`load_adapter`) is a RemoteAdapterModel:
its requests go to the same engine, on the base's connections, naming the
adapter as the engine serves it; the base's health tracker counts them.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import time
from pathlib import Path
from typing import AsyncIterator, Callable, ClassVar

import structlog

from modeld.backends.base import Backend, Capability, GenerativeModel, Verdict
from modeld.backends.errors import (
    ErrorKind, FailedPrecondition, LoadFailed, ModeldError, ResourceExhausted, Unavailable, Unimplemented, error_for,
)
from modeld.backends.generation.params import FinalEvent, FinishReason, GenerateRequest, TokenEvent, Usage
from modeld.backends.model_config import ModelConfig, TensorSpec
from modeld.backends.options import RemoteOptions
from modeld.backends.remote.egress import check_api_key_env, check_destination, check_key_transport, redact_url
from modeld.backends.remote.health import FailureKind, HealthTracker
from modeld.backends.remote.http import Endpoint, RemoteFailure, RemoteHttp
from modeld.backends.remote.protocol import RemoteFinish, RemoteLoad, RemoteProtocol

log = structlog.get_logger("modeld.remote")

TEXT_SIGNATURE = (TensorSpec("text_input", "BYTES", (1,)),), (TensorSpec("text_output", "BYTES", (1,)),)


class RemoteBackend(Backend):
    """A backend whose models run on an engine server ([remote] in model.toml)."""

    #: [remote] engine values this backend can talk to
    engines: ClassVar[tuple[str, ...]]
    protocol: ClassVar[type[RemoteProtocol]]
    # above every local backend: a model that names a remote engine and no
    # `backends` list wants the engine first, its local file as the fallback
    priority = 200
    # constraints go to the engine in its own request fields, refused per kind where it lacks one
    capabilities = frozenset({Capability.GENERATION, Capability.STREAMING, Capability.CONSTRAINED_DECODING})

    def availability(self) -> Verdict:
        for module in ("httpx", "httpx_sse"):
            if importlib.util.find_spec(module) is None:
                return Verdict.no(f"{module} is not installed (pip install {module.replace('_', '-')})")
        return Verdict.yes()

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        if not config.is_remote:
            return Verdict.no(f"{self.name} serves only format = \"remote\" models, not {config.format.value} files")
        engine = config.backend_options.remote.engine
        if engine not in self.engines:
            return Verdict.no(f"{self.name} talks to {' or '.join(self.engines)} engines, not [remote] engine = "
                              f"{engine!r}")
        return Verdict.yes()

    def estimate_bytes(self, config: ModelConfig, model_dir: Path) -> int:
        return 0

    def load(self, config: ModelConfig, model_dir: Path) -> RemoteModel:
        """Blocking (the engine calls it from a worker thread): check the
        engine answers and serves the model, in a private event loop whose
        client closes with it; the model opens its own in start()."""
        options = config.backend_options.remote
        # the operator's settings first: nothing is read or sent for a config they refuse
        check_api_key_env(config.name, options.api_key_env, config.policy)
        destination = check_destination(config.name, options.url, config.policy)
        api_key = _api_key(options)
        if api_key:
            check_key_transport(config.name, destination)
        endpoint = Endpoint(options.engine, options.url.rstrip("/"), api_key, options.timeout_s)
        protocol = self.protocol(RemoteHttp(endpoint), options.model or config.name)
        asyncio.run(_inspect(protocol))
        model = RemoteModel(protocol, options, config.name)
        log.info("remote_model_inspected", model=config.name, backend=self.name, url=redact_url(endpoint.url),
                 remote_model=protocol.model, **{k.replace(" ", "_"): v for k, v in model.server_capabilities.items()})
        return model


def _api_key(options: RemoteOptions) -> str:
    if not options.api_key_env:
        return ""
    key = os.environ.get(options.api_key_env)
    if not key:
        raise LoadFailed(f"[remote] api_key_env names {options.api_key_env}, which is not set (or empty) in the "
                         "daemon's environment")
    return key


async def _inspect(protocol: RemoteProtocol) -> None:
    protocol.http.open()
    try:
        await protocol.inspect()
    except LoadFailed:
        raise
    except ModeldError as exc:
        raise LoadFailed(str(exc)) from None
    finally:
        await protocol.http.close()


HealthCallback = Callable[[bool], None]


class _RemoteCalls(GenerativeModel):
    """Requests to a remote engine: limits, relaying, timing, the final
    event. Needs protocol, options, name, health, observer, _idle and
    _num_in_flight, and `_engine_calls()`."""

    protocol: RemoteProtocol
    options: RemoteOptions
    name: str
    health: HealthTracker
    observer: object
    _idle: asyncio.Event | None
    _num_in_flight: int

    def _engine_calls(self) -> int:
        """Requests in flight on this engine through this model and its kin
        (a base and its adapters share [remote] max_in_flight)."""
        raise NotImplementedError


    # -- requests ----------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        if self._idle is None:
            raise Unavailable(f"model {self.name!r} is not started (or already stopped)")
        request.validate()
        reason = self.protocol.refusal(request)
        if reason:
            raise Unimplemented(f"model {self.name!r}: {reason}")
        if self._engine_calls() >= self.options.max_in_flight:
            raise ResourceExhausted(f"model {self.name!r}: {self._engine_calls()} requests are in flight on "
                                    f"{self.protocol.where}, its [remote] max_in_flight; retry later")
        self._num_in_flight += 1
        self._idle.clear()
        try:
            async for event in self._relay(request):
                yield event
        finally:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._idle.set()

    async def _relay(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        timing = _Timing(time.monotonic())
        stream = self.protocol.stream(request)
        try:
            async for item in stream:
                if isinstance(item, RemoteFinish):
                    yield self._finished(item, timing)
                    return
                self._tell("on_tokens", len(item.token_ids), *timing.token(time.monotonic(), len(item.token_ids)))
                timing.num_ids += len(item.token_ids)
                yield item
        except RemoteFailure as exc:
            self._failed(exc)
            if not timing.num_events:
                raise  # nothing was sent yet: the call fails with the cause
            # tokens already went out: end the stream, never replay the sequence
            yield self._final(RemoteFinish(FinishReason.ERROR, error=f"{exc}; the sequence was not replayed",
                                           error_kind=exc.kind), timing)
            return
        finally:
            await stream.aclose()  # our caller left: the engine's connection closes now
        failure = RemoteFailure(f"{self.protocol.where} ended its stream before saying how the sequence finished",
                                FailureKind.BROKEN_STREAM)
        self._failed(failure)
        yield self._final(RemoteFinish(FinishReason.ERROR, error=str(failure), error_kind=failure.kind), timing)

    def _finished(self, finish: RemoteFinish, timing: _Timing) -> FinalEvent:
        if finish.error_kind is ErrorKind.UNAVAILABLE:  # the engine failed the sequence itself
            self._failed(RemoteFailure(finish.error, FailureKind.SERVER_ERROR))
        else:
            self.health.record_success()  # it answered, even if only to refuse
        if not timing.num_ids and finish.completion_tokens:
            # an engine that streams text without token ids: count its tokens once, from its usage
            self._tell("on_tokens", finish.completion_tokens, None, None)
        return self._final(finish, timing)

    def _final(self, finish: RemoteFinish, timing: _Timing) -> FinalEvent:
        usage = Usage(prompt_tokens=finish.prompt_tokens, cached_prompt_tokens=finish.cached_prompt_tokens,
                      completion_tokens=finish.completion_tokens,
                      time_to_first_token_s=timing.first_token_s)
        self._tell("on_finish", usage, finish.reason)
        return FinalEvent(finish.reason, usage, finish.error, finish.error_kind)

    def _failed(self, failure: RemoteFailure) -> None:
        self._tell("on_remote_failure", failure.failure.value)
        self.health.record_failure(failure.failure, str(failure))

    async def tokenize(self, text: str) -> list[int]:
        return await self._counted(self.protocol.tokenize(text))

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._counted(self.protocol.detokenize(token_ids))

    def prompt_ids(self, request) -> list[int]:
        raise Unimplemented(f"model {self.name!r} runs on a remote engine, which renders chat "
                            "messages with its own template: send them to that engine's /tokenize, or tokenize a "
                            "prompt here")

    async def _counted(self, call):
        try:
            return await call
        except RemoteFailure as exc:
            self._failed(exc)
            raise
        except Unimplemented as exc:
            raise Unimplemented(f"model {self.name!r}: {exc}") from None

    def _tell(self, method: str, *args) -> None:
        """The observer's method, where it has it (the remote ones are optional)."""
        handler = getattr(self.observer, method, None)
        if handler is not None:
            handler(*args)


class RemoteModel(_RemoteCalls):
    def __init__(self, protocol: RemoteProtocol, options: RemoteOptions, name: str) -> None:
        self.protocol = protocol
        self.options = options
        self.name = name
        self.nbytes = 0
        self.inputs, self.outputs = TEXT_SIGNATURE
        self.loop = self.runner = None  # no local generation loop or runner
        self.observer = None
        self.load: RemoteLoad | None = None  # the engine's latest figures
        self.health = HealthTracker(options.unhealthy_after, options.probe_interval_s, options.max_probe_interval_s,
                                    self._health_changed)
        self._health_listener: HealthCallback | None = None
        self._num_in_flight = 0
        self._idle: asyncio.Event | None = None
        self._watch_task: asyncio.Task | None = None
        self.adapters: set[RemoteAdapterModel] = set()  # started adapters of this base

    def _engine_calls(self) -> int:
        return self._num_in_flight + sum(a._num_in_flight for a in self.adapters)

    # -- what the engine reads ---------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.health.is_healthy

    def set_health_listener(self, listener: HealthCallback) -> None:
        self._health_listener = listener

    @property
    def num_running(self) -> int:
        return self.load.num_running if self.load else 0

    @property
    def num_waiting(self) -> int:
        return self.load.num_waiting if self.load else 0

    @property
    def kv_cache_usage(self) -> float | None:
        return self.load.kv_cache_usage if self.load else None

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def server_capabilities(self) -> dict[str, str]:
        return self.protocol.server_capabilities()

    # -- lifecycle -------------------------------------------------------------------

    def set_observer(self, observer) -> None:
        self.observer = observer
        self._tell("on_remote_health", self.health.is_healthy)

    async def start(self) -> None:
        self.protocol.http.open()
        self._idle = asyncio.Event()
        self._idle.set()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        """Let requests in flight finish, then stop probing and close the client."""
        if self._idle is not None:
            await self._idle.wait()
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except asyncio.CancelledError:
                pass
            self._watch_task = None
        self._idle = None
        await self.protocol.http.close()

    def unload(self) -> None:
        """Nothing local to free: stop() closed the connections."""

    # -- LoRA adapters -------------------------------------------------------------------

    def load_adapter(self, config: ModelConfig, model_dir: Path) -> RemoteAdapterModel:
        """Blocking (the engine calls it from a worker thread): make the
        engine serve the adapter under its remote name, loading it from
        remote_path where the config gives one, else checking the engine
        already serves it (vLLM's --lora-modules, SGLang's --lora-paths).
        The adapter's own files, if any, stay here: the engine reads its
        own copy."""
        if self.protocol.lora_refusal:
            raise FailedPrecondition(f"adapter {config.name!r}: its base {self.name!r} runs on "
                                     f"{self.protocol.where}, and {self.protocol.lora_refusal}")
        remote_name = config.remote_name or config.name
        loaded = asyncio.run(_on_private_client(self.protocol, lambda p: _bring_adapter(p, config, remote_name)))
        model = RemoteAdapterModel(self, self.protocol.for_adapter(remote_name), config.name, remote_name, loaded)
        log.info("remote_adapter_ready", model=config.name, base=self.name, remote_name=remote_name,
                 loaded_by_modeld=loaded)
        return model

    # -- health ------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Probe while healthy (every probe_interval_s, with the engine's load
        figures) and while not (backing off), until stopped."""
        while True:
            await asyncio.sleep(self.health.next_probe_in())
            if self._num_in_flight and not self.protocol.probe_when_busy:
                continue
            try:
                load = await self.protocol.probe()
            except RemoteFailure as exc:
                self._failed(exc)
                continue
            except ModeldError as exc:  # /health answered 4xx: alive but not serving
                self._failed(RemoteFailure(str(exc), FailureKind.SERVER_ERROR))
                continue
            except Exception as exc:  # noqa: BLE001 - a probe must never end the watch
                log.exception("remote_probe_failed", model=self.name)
                self._failed(RemoteFailure(f"probing {self.protocol.where} failed: {exc}", FailureKind.SERVER_ERROR))
                continue
            self.health.record_success()
            if load is not None:
                self.load = load
                self._tell("on_step", load.num_running, load.num_waiting, load.kv_used, load.kv_capacity)
                self._tell("on_remote_load", load.kv_cache_usage, load.prefix_cache_hit_ratio)

    def _health_changed(self, is_healthy: bool, reason: str) -> None:
        if is_healthy:
            log.info("remote_healthy", model=self.name, url=redact_url(self.protocol.http.endpoint.url))
        else:
            log.warning("remote_unhealthy", model=self.name, url=redact_url(self.protocol.http.endpoint.url),
                        reason=reason)
        self._tell("on_remote_health", is_healthy)
        if self._health_listener is not None:
            self._health_listener(is_healthy)


class RemoteAdapterModel(_RemoteCalls):
    """A LoRA adapter that a remote engine applies: requests name it as the
    engine serves it, on the base's connections. The base's health tracker
    counts its outcomes (one engine), and the base's figures are the engine's,
    so the adapter reports none of its own; it has no standby of its own
    either (an adapter runs where its base does)."""

    def __init__(self, base: RemoteModel, protocol: RemoteProtocol, name: str, remote_name: str,
                 loaded_by_modeld: bool) -> None:
        self.base = base
        self.protocol = protocol
        self.options = base.options
        self.name = name
        self.remote_name = remote_name  # the engine's name for it
        self.loaded_by_modeld = loaded_by_modeld  # unloaded from the engine with the adapter
        self.nbytes = 0
        self.inputs, self.outputs = TEXT_SIGNATURE
        self.loop = self.runner = None
        self.observer = None
        self.health = base.health
        self._num_in_flight = 0
        self._idle: asyncio.Event | None = None

    def _engine_calls(self) -> int:
        return self.base._engine_calls()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def set_observer(self, observer) -> None:
        self.observer = observer

    async def start(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        self.base.adapters.add(self)

    async def stop(self) -> None:
        """Let this adapter's requests finish."""
        if self._idle is not None:
            await self._idle.wait()
        self._idle = None
        self.base.adapters.discard(self)

    def unload(self) -> None:
        """Blocking: unload the adapter from the engine where modeld loaded
        it there. An engine that cannot be reached keeps it (it goes with the
        engine's restart); the adapter is gone from modeld either way."""
        if not self.loaded_by_modeld:
            return
        try:
            asyncio.run(_on_private_client(self.protocol, lambda p: p.unload_adapter(self.remote_name)))
        except ModeldError as exc:
            log.warning("remote_adapter_unload_failed", model=self.name, remote_name=self.remote_name,
                        reason=str(exc))


async def _on_private_client(protocol: RemoteProtocol, call):
    """`call(protocol)` over a client of its own, in the calling thread's
    event loop: the model's own client belongs to the daemon's loop."""
    private = copy.copy(protocol)
    private.http = RemoteHttp(protocol.http.endpoint, protocol.http.transport)
    private.http.open()
    try:
        return await call(private)
    finally:
        await private.http.close()


async def _bring_adapter(protocol: RemoteProtocol, config: ModelConfig, remote_name: str) -> bool:
    """Whether modeld loaded the adapter on the engine (False: it served it already)."""
    name = config.name
    try:
        if config.remote_path:
            return await protocol.load_adapter(remote_name, config.remote_path)
        reason = await protocol.adapter_served(remote_name)
    except RemoteFailure as exc:
        raise Unavailable(f"adapter {name!r}: {exc}") from None
    except ModeldError as exc:
        raise error_for(exc.kind, f"adapter {name!r}: {exc}") from None
    if reason:
        raise FailedPrecondition(f"adapter {name!r}: {reason}")
    return False


class _Timing:
    """Arrival, first and last token of one request."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.num_events = 0
        self.num_ids = 0  # token ids the engine reported

    def token(self, now: float, count: int) -> tuple[float | None, float | None]:
        """(time to first token, time per token since the last event)."""
        first = None if self.first is not None else now - self.arrival
        inter = None if self.last is None else (now - self.last) / max(count, 1)
        self.first = self.first or now
        self.last = now
        self.num_events += 1
        return first, inter

    @property
    def first_token_s(self) -> float:
        return self.first - self.arrival if self.first is not None else 0.0
