"""Request dispatch: a tensor call or a generation, from a loaded (or lazily
loaded) model to its batcher or generation loop, with the request's deadline,
its capability check, its statistics and its failover."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import numpy as np
import structlog

from modeld.backends.base import Capability
from modeld.backends.errors import (
    BackendFailure, ErrorKind, ModeldError, NotFound, ResourceExhausted, Unavailable, Unimplemented,
    error_for,
)
from modeld.backends.generation.params import FinalEvent, GenerateRequest, SpeculativeMode, TokenEvent
from modeld.backends.model_config import validate_model_name
from modeld.server.metrics import Metrics
from modeld.server.request_context import current_protocol
from modeld.server.requests import InferRequest, InferResult
from modeld.server.rerank import plan_rerank
from modeld.server.validation import validate_inputs
from modeld.server.versions import (
    DEFAULT_VERSION, SEPARATOR, VersionIndex, model_of, no_version_message, parse_version, version_key, version_of,
)

from .deadlines import next_event, within
from .failover import Failover
from .loading import ModelLifecycle
from .served import MODEL_VERSION, ServedModel

log = structlog.get_logger("modeld.engine")

_CAPABILITY_HINTS = {
    Capability.SEQUENCE_BATCHING: "stateful sequences (sequence_id) are not supported; send each request on its own",
    Capability.SHARED_MEMORY: "shared-memory tensors are not supported; send tensor data in raw_input_contents",
    Capability.GENERATION: "use a language model for generation",
    Capability.CONSTRAINED_DECODING: "serve the model with the llamacpp or torch backend, or a remote engine, "
                                     "for structured output",
}

Event = TokenEvent | FinalEvent


class Dispatcher:
    def __init__(self, lifecycle: ModelLifecycle, failover: Failover, metrics: Metrics, lazy_load: bool,
                 max_streams: int) -> None:
        self.lifecycle = lifecycle
        self.models = lifecycle.models
        self.memory = lifecycle.accounting.memory
        self.failover = failover
        self.metrics = metrics
        self.lazy_load = lazy_load
        self.versions = VersionIndex(lifecycle.repository.resolve)  # each model's served versions
        # generations in progress at once, daemon-wide: past it a new one is
        # refused at once rather than queued behind work the node cannot take
        self.max_streams = max_streams
        self.num_streams = 0

    def model_name(self, name: str) -> str:
        """The model a name means: itself, or the model whose served_names holds it."""
        if name in self.models.aliases:
            return model_of(self.models.aliases[name])  # an alias registered by a version names its model
        if self.models.is_active(name):
            return name
        try:
            return self.lifecycle.repository.canonical(name)
        except ModeldError:  # a malformed name names nothing
            return name

    def canonical(self, name: str) -> str:
        """The engine entry a name means: its model's default version's key
        (the name itself where it names no version that serves)."""
        try:
            return self.key_for(name)
        except ModeldError:
            return name

    def key_for(self, name: str, version: str = "") -> str:
        """The engine's key for `version` of the model `name` means
        (server/versions.py); no version: the highest its policy serves.
        NOT_FOUND for a version the model does not serve."""
        if SEPARATOR in name:  # keys are the engine's own: a client's ':' is a malformed name
            validate_model_name(name)
        model = self.model_name(name)
        versions = self.versions.of(model)
        if versions is None:  # not an entry: the lookup of the name itself says why
            if version not in ("", MODEL_VERSION):
                self.lifecycle.repository.resolve(model)  # NOT_FOUND (unknown) or INVALID_ARGUMENT (malformed)
                raise NotFound(no_version_message(model, version, (DEFAULT_VERSION,)))
            return model
        if not version:
            if not versions:
                raise NotFound(no_version_message(model, version, versions, self.versions.source(model)))
            return version_key(model, versions[-1])
        number = parse_version(version)
        if number not in versions:
            raise NotFound(no_version_message(model, version, versions, self.versions.source(model)))
        return version_key(model, number)

    def version_keys(self, name: str) -> list[str]:
        """The keys of every version the model `name` means serves, ascending."""
        model = self.model_name(name)
        versions = self.versions.of(model)
        return [model] if versions is None else [version_key(model, v) for v in versions]

    def loaded_keys(self, name: str) -> list[str]:
        """The keys of the model's versions served or loading now."""
        model = self.model_name(name)
        return sorted((k for k in self.models.names() if model_of(k) == model), key=_by_version)

    def all_keys(self) -> list[str]:
        """Every version of every model known: each entry's served versions and whatever is loaded."""
        keys = set(self.models.names())
        for name in self.lifecycle.repository.names():
            keys.update(self.version_keys(name))
        return sorted(keys, key=lambda k: (model_of(k), _by_version(k)))

    def is_known(self, name: str) -> bool:
        """A model (or a version's key) served, loading, or in the repository."""
        if self.models.is_active(name):
            return True
        if SEPARATOR in name:  # a key not loaded, or a client's made-up name: neither may grow a metric
            return False
        model = self.model_name(name)
        return (self.models.is_active(model) or model in self.lifecycle.repository.names()
                or bool(self.loaded_keys(model)))

    async def ensure_loaded(self, name: str, version: str = "") -> ServedModel:
        return await self.ensure_key_loaded(self.key_for(name, version))

    async def ensure_key_loaded(self, key: str) -> ServedModel:
        served = self.models.get(key)
        if served is not None and key not in self.models.unloading:
            return served
        source = self.lifecycle.repository.resolve(key)
        key = source.config.name  # an alias's model
        served = self.models.get(key)
        if served is not None and key not in self.models.unloading:
            return served
        lazy = source.config.lazy_load if source.config.lazy_load is not None else self.lazy_load
        if not lazy and key not in self.models.loading:
            raise Unavailable(f"model {model_of(key)!r} version {version_of(key)} is not loaded and lazy loading is "
                              "off; load it first (RepositoryModelLoad)")
        return await self.lifecycle.load(key)

    @contextlib.contextmanager
    def counting_call(self, key: str):
        """In flight from entry (a lazy load's wait included) until the call
        leaves, however it leaves, and a failure counted by its kind, once
        per call, on the model version `key` names. A name nobody knows is
        not counted: ensure_loaded refuses it, and made-up names must not
        grow the statistics."""
        stats = self.begin_counting(key)
        try:
            yield
        except BaseException as exc:
            self.end_counting(stats, exc)
            raise
        self.end_counting(stats, None)

    def begin_counting(self, key: str):
        """counting_call's entry, for a call that outlives a `with` block (a
        generation's stream); None for a name nobody knows."""
        if not self.is_known(model_of(key)):  # key_for made it: its version serves
            return None
        stats = self.models.stats(key)
        stats.begin_call()
        return stats

    @staticmethod
    def end_counting(stats, exc: BaseException | None) -> None:
        """counting_call's exit: a failure by its kind (a cancelled call is none)."""
        if stats is None:
            return
        if isinstance(exc, ModeldError):
            stats.count_failure(exc.kind)
        elif isinstance(exc, Exception):  # a bug: the service answers INTERNAL
            stats.count_failure(ErrorKind.INTERNAL)
        stats.end_call()

    def count_success(self, served: ServedModel, elapsed_ns: int) -> None:
        served.stats.record_success(elapsed_ns)
        labels = (served.config.name, served.backend.name, current_protocol())
        self.metrics.requests.labels(*labels).inc()
        self.metrics.request_latency.labels(*labels).observe(elapsed_ns / 1e9)

    # -- tensor calls -------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResult:
        key = self.key_for(request.model_name, request.model_version)
        with self.counting_call(key):
            served = await self.ensure_key_loaded(key)
            started = time.perf_counter_ns()
            try:
                async with within(request.timeout_s):
                    served, outputs = await self._infer_on(served, request)
            except ModeldError:
                served.stats.record_failure(time.perf_counter_ns() - started)
                raise
            self.count_success(served, time.perf_counter_ns() - started)
            return InferResult(request.model_name, version_of(served.config.name), request.id, outputs,
                               served.backend.name)

    async def _infer_on(self, served: ServedModel, request: InferRequest) -> tuple[ServedModel, dict[str, np.ndarray]]:
        """Run on `served`, or on the backend it falls back to; says which."""
        missing = served.backend.missing(request.required)
        if missing:
            raise Unimplemented(capability_message(served, missing))
        rerank = plan_rerank(request, served.config)  # a rerank model's documents as rows of pairs
        if rerank is None:
            validate_inputs(request, served.loaded.inputs, served.loaded.outputs, served.config)
        self.memory.acquire(served.key)
        try:
            if rerank is not None:
                return served, await rerank.run(served.batcher.submit)
            return served, await served.batcher.submit(request.inputs, request.output_names, request.priority,
                                                       deadline=request.deadline)
        except BackendFailure as exc:
            fallback = await self.failover.fall_back(served, exc)
            return await self._infer_on(fallback, request)
        finally:
            self.memory.release(served.key)

    # -- generation ------------------------------------------------------------

    async def generative(self, name: str, required: frozenset[Capability] = frozenset(),
                         fail_over: bool = False, version: str = "") -> ServedModel:
        served = await self.failover.route_around_unhealthy(await self.ensure_loaded(name, version), fail_over)
        missing = served.backend.missing(required | {Capability.GENERATION})
        if missing or not served.is_generative:
            raise Unimplemented(capability_message(served, missing or frozenset({Capability.GENERATION})))
        return served

    def generate(self, request: GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[Event]:
        """Stream a language model's tokens; leaving early (aclose) cancels the sequence.

        A generation that fails inside the model ends with a FinalEvent that
        carries the error, then raises it with its own kind, so callers that
        stream can still send what came before. Nothing runs before the
        first event is asked for.
        """
        return _GenerationStream(self, request, timeout_s)


class _GenerationStream:
    """Dispatcher.generate's events: the stream limit, the call's figures,
    the model's memory hold, the deadline and a remote engine's fail-over
    around the backend's own stream, in one object rather than a stack of
    async generators, whose every layer is resumed again for each token
    (six pass-through layers cost about 10 us of the daemon's CPU a token
    at 8 streams here, bench_token_cpu)."""

    __slots__ = ("_dispatch", "_request", "_timeout_s", "_state", "_stats", "_served", "_events",
                 "_started", "_deadline", "_counted", "_failure", "_loop")

    _NEW, _STREAMING, _DONE = 0, 1, 2

    def __init__(self, dispatch: Dispatcher, request: GenerateRequest, timeout_s: float | None) -> None:
        self._dispatch, self._request, self._timeout_s = dispatch, request, timeout_s
        self._state = self._NEW  # STREAMING from taking a stream slot until _finish gives it back
        self._stats = None  # the call's figures (Dispatcher.begin_counting)
        self._served: ServedModel | None = None  # the model this attempt holds memory on
        self._events = None  # that model's stream
        self._started = 0
        self._deadline: float | None = None
        self._counted = False  # its success counted
        self._failure: FinalEvent | None = None  # a failure's final event, raised at the next call
        self._loop: asyncio.AbstractEventLoop | None = None

    def __del__(self) -> None:
        # Dropped unfinished (a front that returns at the final event, or
        # whose task was cancelled between two events): let go on the loop,
        # as asyncio finalizes an async generator left suspended.
        if self._state == self._STREAMING and self._loop is not None and not self._loop.is_closed():
            loop = self._loop
            try:
                loop.call_soon_threadsafe(lambda: loop.create_task(self._finish(None)))
            except RuntimeError:  # the loop closed meanwhile
                pass

    def __aiter__(self) -> _GenerationStream:
        return self

    async def __anext__(self) -> Event:
        if self._state != self._STREAMING:
            if self._state == self._NEW:
                return await self._start()
            raise StopAsyncIteration
        if self._failure is not None:
            final, request = self._failure, self._request
            log.warning("generation_failed", model=request.model_name, request_id=request.request_id,
                        reason=final.error)
            exc = error_for(final.error_kind, final.error)
            await self._finish(exc)
            raise exc
        # as _first's read, inline rather than shared: a coroutine call less for every token
        try:
            if self._deadline is None:
                event = await self._events.__anext__()
            else:
                event = await next_event(self._events, self._deadline, self._timeout_s)
        except StopAsyncIteration:
            self._count_success()
            await self._finish(None)
            raise
        except BaseException as exc:
            await self._finish(exc)
            raise
        return self._seen(event)

    async def aclose(self) -> None:
        """The consumer left: the sequence is cancelled and everything held let go."""
        await self._finish(None)

    async def _start(self) -> Event:
        dispatch, request = self._dispatch, self._request
        if dispatch.num_streams >= dispatch.max_streams:
            self._state = self._DONE
            raise ResourceExhausted(f"daemon stream limit {dispatch.max_streams} reached "
                                    f"(max_streams={dispatch.max_streams}); retry later or on another node")
        dispatch.num_streams += 1
        self._loop = asyncio.get_running_loop()
        self._state = self._STREAMING  # from here on _finish lets everything go
        try:
            key = dispatch.key_for(request.model_name, request.model_version)
            self._stats = dispatch.begin_counting(key)
            # A remote engine that fails before its first event hands the
            # request to its standby, once: nothing reached the caller, so
            # nothing is replayed (a stream that broke mid-way ends with its error).
            current = dispatch.models.get(key)
            via_remote = current is not None and current.remote is not None and current.remote.is_healthy
            try:
                return await self._first(fail_over=False)
            except Unavailable as exc:
                if not (via_remote and dispatch.failover.can_fail_over(current)):
                    raise
                log.warning("remote_request_failed_over", model=request.model_name, backend=current.backend.name,
                            request_id=request.request_id, reason=str(exc))
                return await self._first(fail_over=True)
        except StopAsyncIteration:  # a stream with no events
            await self._finish(None)
            raise
        except BaseException as exc:
            await self._finish(exc)
            raise

    async def _first(self, fail_over: bool) -> Event:
        """One attempt's model, its memory hold and its first event; a
        failure lets that attempt go (not the call: it may fail over)."""
        dispatch, request = self._dispatch, self._request
        served = await dispatch.generative(request.model_name, _generation_capabilities(request), fail_over,
                                           request.model_version)
        dispatch.memory.acquire(served.key)
        self._served, self._counted = served, False
        self._started = time.perf_counter_ns()
        self._deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        self._events = served.generative.generate(request)
        try:
            event = await next_event(self._events, self._deadline, self._timeout_s)
        except StopAsyncIteration:
            self._count_success()
            await self._let_go(None)
            raise
        except BaseException as exc:
            await self._let_go(exc)
            raise
        return self._seen(event)

    def _seen(self, event: Event) -> Event:
        if isinstance(event, FinalEvent):
            if event.error:
                self._failure = event
            else:
                # counted before the caller sees it: a front that stops
                # reading at the final event (ModelStreamInfer) closes the
                # stream there, and the call would go uncounted
                self._count_success()
        return event

    def _count_success(self) -> None:
        if not self._counted and self._served is not None:
            self._counted = True
            self._dispatch.count_success(self._served, time.perf_counter_ns() - self._started)

    async def _let_go(self, exc: BaseException | None) -> None:
        """The attempt's end: its failure on the model's figures, its
        stream closed (a consumer that left cancels its sequence now), its
        memory released."""
        served, events = self._served, self._events
        self._served = self._events = None
        if served is None:
            return
        try:
            if isinstance(exc, ModeldError):
                served.stats.record_failure(time.perf_counter_ns() - self._started)
            if events is not None:
                await events.aclose()
        finally:
            self._dispatch.memory.release(served.key)

    async def _finish(self, exc: BaseException | None) -> None:
        """The call's end, once, however it ends."""
        if self._state != self._STREAMING:  # never started, or finished already
            self._state = self._DONE
            return
        self._state = self._DONE
        try:
            await self._let_go(exc)
        finally:
            self._dispatch.end_counting(self._stats, exc)
            self._dispatch.num_streams -= 1


def check_version(name: str, version: str) -> None:
    """NOT_FOUND for a version no model can have (not a positive number);
    whether `name` serves it is Dispatcher.key_for's to say."""
    if version and parse_version(version) is None:
        raise NotFound(f"model {name!r} has no version {version!r}; versions are positive whole numbers")


def _by_version(key: str) -> int:
    return int(version_of(key))


def _generation_capabilities(request: GenerateRequest) -> frozenset[Capability]:
    needed = {Capability.GENERATION, Capability.STREAMING}
    if request.params.speculative is not SpeculativeMode.NONE:
        needed.add(Capability.SPECULATIVE_DECODING)
    if request.params.logprobs:
        needed.add(Capability.LOGPROBS)
    if request.params.constraint is not None:
        needed.add(Capability.CONSTRAINED_DECODING)
    return frozenset(needed)


def capability_message(served: ServedModel, missing: frozenset[Capability]) -> str:
    names = ", ".join(sorted(c.value for c in missing))
    hints = "; ".join(_CAPABILITY_HINTS[c] for c in missing if c in _CAPABILITY_HINTS)
    return (f"model {served.config.name!r} is served by backend {served.backend.name!r}, which lacks {names}"
            + (f": {hints}" if hints else ""))
