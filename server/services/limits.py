"""Per-call limits of a gRPC call: its deadline, joined with KServe's
`timeout` parameter, and the daemon-wide cap on calls in progress
(`ConcurrencyInterceptor`). (The per-model request size cap is the data
plane's.)"""

from __future__ import annotations

import dataclasses
import inspect

import grpc

from modeld.backends.errors import DeadlineExceeded
from modeld.server.requests import InferRequest


def call_timeout_s(context) -> float | None:
    """Seconds left of the call's gRPC deadline, None without one.

    A deadline already passed fails here, before anything runs: the caller
    has stopped waiting, so the work would be thrown away.
    """
    remaining = context.time_remaining()
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before the request started; send it with a later deadline")
    return remaining


def sooner(a: float | None, b: float | None) -> float | None:
    """The shorter of two timeouts, either of which may be None (none)."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def with_call_timeout(request: InferRequest, call_timeout_s: float | None) -> InferRequest:
    """The request with the call's deadline as its timeout where that is sooner."""
    timeout_s = sooner(request.timeout_s, call_timeout_s)
    if timeout_s == request.timeout_s:
        return request
    return dataclasses.replace(request, timeout_s=timeout_s, deadline=None)


# gRPC services a caller may always reach: Kubernetes probes and grpcurl must
# be answered even while every slot is taken
_ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                "/grpc.reflection.v1.ServerReflection/")


class ConcurrencyInterceptor(grpc.aio.ServerInterceptor):
    """At most `limit` gRPC calls in progress, daemon-wide (a streaming call
    counts until it ends); past that RESOURCE_EXHAUSTED naming
    max_concurrent_rpcs. Health and reflection are not counted, so probes
    answer under a flood. grpc's own maximum_concurrent_rpcs stays above it
    as a backstop that counts everything."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_ALWAYS_OPEN):
            return handler
        kind = ("stream_stream" if handler.request_streaming else "unary_stream") if handler.response_streaming \
            else ("stream_unary" if handler.request_streaming else "unary_unary")
        behaviour = getattr(handler, kind)
        if handler.response_streaming and inspect.isasyncgenfunction(behaviour):
            return handler._replace(**{kind: self._counted_stream(behaviour)})
        if not handler.response_streaming and inspect.iscoroutinefunction(behaviour):
            return handler._replace(**{kind: self._counted(behaviour)})
        return handler  # a synchronous handler: not one of ours

    async def _enter(self, context) -> None:
        if self.active >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"the daemon has {self.active} calls in progress, its max_concurrent_rpcs limit ({self.limit}); "
                "retry shortly, or on another node"))
        self.active += 1

    def _counted(self, behaviour):
        async def handler(request, context):
            await self._enter(context)
            try:
                return await behaviour(request, context)
            finally:
                self.active -= 1
        return handler

    def _counted_stream(self, behaviour):
        async def handler(request, context):
            await self._enter(context)
            try:
                async for response in behaviour(request, context):
                    yield response
            finally:
                self.active -= 1
        return handler
