"""Map the engine's errors to gRPC status codes, in one place.

Every servicer method is wrapped by `grpc_errors`: a ModeldError becomes its
status with the message as written; anything else is a bug, logged with the
request id and returned as INTERNAL.
"""

from __future__ import annotations

import functools
import inspect
import uuid

import grpc
import structlog

from modeld.backends.errors import ErrorKind, ModeldError

log = structlog.get_logger("modeld.rpc")

STATUS_BY_KIND = {kind: getattr(grpc.StatusCode, kind.value) for kind in ErrorKind}


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


async def refuse_if_draining(servicer, context) -> None:
    lifecycle = getattr(servicer, "lifecycle", None)
    if lifecycle is not None and lifecycle.is_draining:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down; retry on another node")


def grpc_errors(method):
    """Decorate a unary or server-streaming grpc.aio servicer method."""
    name = method.__name__

    async def fail(context, exc: BaseException, request_id: str):
        if isinstance(exc, ModeldError):
            log.info("rpc_failed", rpc=name, request_id=request_id, status=exc.kind.value, reason=str(exc))
            await context.abort(STATUS_BY_KIND[exc.kind], str(exc))
        log.exception("rpc_bug", rpc=name, request_id=request_id)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id}); see the daemon log")

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            request_id = new_request_id()
            structlog.contextvars.bind_contextvars(request_id=request_id)
            await refuse_if_draining(self, context)
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - mapped to a status above
                await fail(context, exc, request_id)
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        request_id = new_request_id()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        await refuse_if_draining(self, context)
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status above
            await fail(context, exc, request_id)
    return unary_wrapper
