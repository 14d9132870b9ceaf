"""Request dispatch: a tensor call or a generation, from a loaded (or lazily
loaded) model to its batcher or generation loop, with the request's deadline,
its capability check, its statistics and its failover."""

from __future__ import annotations

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
        if not self.is_known(model_of(key)):  # key_for made it: its version serves
            yield
            return
        stats = self.models.stats(key)
        stats.begin_call()
        try:
            yield
        except ModeldError as exc:
            stats.count_failure(exc.kind)
            raise
        except Exception:  # a bug: the service answers INTERNAL
            stats.count_failure(ErrorKind.INTERNAL)
            raise
        finally:
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

    async def generate(self, request: GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[Event]:
        """Stream a language model's tokens; leaving early cancels the sequence.

        A generation that fails inside the model ends with a FinalEvent that
        carries the error, then raises it with its own kind, so callers that
        stream can still send what came before.
        """
        if self.num_streams >= self.max_streams:
            raise ResourceExhausted(f"daemon stream limit {self.max_streams} reached (max_streams={self.max_streams}); "
                                    "retry later or on another node")
        self.num_streams += 1
        try:
            with self.counting_call(self.key_for(request.model_name, request.model_version)):
                # aclosing: a consumer that leaves early closes the inner stream
                # now (its sequence and memory freed), not whenever it is collected
                async with contextlib.aclosing(self._generate_or_fail_over(request, timeout_s)) as events:
                    async for event in events:
                        yield event
        finally:
            self.num_streams -= 1

    async def _generate_or_fail_over(self, request: GenerateRequest, timeout_s: float | None) -> AsyncIterator[Event]:
        """_generate; a remote engine that fails before its first event hands
        the request to its standby, once: nothing reached the caller, so
        nothing is replayed (a stream that broke mid-way ends with its error)."""
        current = self.models.get(self.key_for(request.model_name, request.model_version))
        via_remote = current is not None and current.remote is not None and current.remote.is_healthy
        attempt = self._generate(request, timeout_s)
        try:
            first = await attempt.__anext__()
        except StopAsyncIteration:
            return
        except Unavailable as exc:
            await attempt.aclose()
            if not (via_remote and self.failover.can_fail_over(current)):
                raise
            log.warning("remote_request_failed_over", model=request.model_name, backend=current.backend.name,
                        request_id=request.request_id, reason=str(exc))
            attempt = self._generate(request, timeout_s, fail_over=True)
            first = await attempt.__anext__()
        async with contextlib.aclosing(attempt):
            yield first
            async for event in attempt:
                yield event

    async def _generate(self, request: GenerateRequest, timeout_s: float | None,
                        fail_over: bool = False) -> AsyncIterator[Event]:
        served = await self.generative(request.model_name, _generation_capabilities(request), fail_over,
                                       request.model_version)
        self.memory.acquire(served.key)
        started = time.perf_counter_ns()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        events = served.generative.generate(request)
        counted = False
        try:
            while True:
                try:
                    event = await next_event(events, deadline, timeout_s)
                except StopAsyncIteration:
                    break
                if isinstance(event, FinalEvent) and not event.error:
                    # counted before the caller sees it: a front that stops
                    # reading at the final event (ModelStreamInfer) closes this
                    # generator there, and the call would go uncounted
                    counted = True
                    self.count_success(served, time.perf_counter_ns() - started)
                yield event
                if isinstance(event, FinalEvent) and event.error:
                    log.warning("generation_failed", model=request.model_name, request_id=request.request_id,
                                reason=event.error)
                    raise error_for(event.error_kind, event.error)
            if not counted:
                self.count_success(served, time.perf_counter_ns() - started)
        except ModeldError:
            served.stats.record_failure(time.perf_counter_ns() - started)
            raise
        finally:
            await events.aclose()  # a consumer that left cancels its sequence now
            self.memory.release(served.key)


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
