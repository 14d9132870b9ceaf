"""Map the engine's errors to gRPC status codes, and give each call its id.

Every servicer method is wrapped by `grpc_errors`: a ModeldError becomes its
status with the message as written; anything else is a bug, logged with the
request id and returned as INTERNAL. Each failure is counted in
`modeld_request_failures_total` by model and status (through the data
plane). The request id comes from the client's `x-request-id` metadata when
it sends a usable one (request_context.py reads it, for HTTP too), else it
is made there; it is bound to every log line of the call, readable by the
service through `current_request_id()`, and returned in the trailing metadata.
"""

from __future__ import annotations

import functools
import inspect

import grpc
import structlog

from modeld.backends.errors import ErrorKind, ModeldError
from modeld.server.dataplane import DRAINING_MESSAGE, DataPlane
from modeld.server.request_context import (
    REQUEST_ID_HEADER, begin_call, current_request_id, internal_message, release_frames,
)

__all__ = ["STATUS_BY_KIND", "begin_grpc_call", "count_failure", "current_request_id", "grpc_errors"]

log = structlog.get_logger("modeld.rpc")

STATUS_BY_KIND = {kind: getattr(grpc.StatusCode, kind.value) for kind in ErrorKind}


def begin_grpc_call(context) -> str:
    """The call's request id (the client's x-request-id when usable), bound to its logs."""
    return begin_call(context.invocation_metadata(), "grpc")


def model_of(request) -> str:
    """The model a request names, for the failure counter ("" if none)."""
    for field in ("model_name", "model", "name"):
        value = getattr(request, field, None)
        if isinstance(value, str):
            return value
    return ""


def count_failure(servicer, model: str, kind: ErrorKind) -> None:
    plane: DataPlane | None = getattr(servicer, "plane", None)
    if plane is not None:
        plane.count_failure(model, kind)


async def refuse_if_draining(servicer, context) -> None:
    plane: DataPlane | None = getattr(servicer, "plane", None)
    if plane is not None and plane.is_draining:
        await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)


def grpc_errors(method):
    """Decorate a unary or streaming grpc.aio servicer method."""
    name = method.__name__

    def fail(servicer, context, request, exc: BaseException, request_id: str) -> None:
        trailer = ((REQUEST_ID_HEADER, request_id),)
        if isinstance(exc, ModeldError):
            log.info("rpc_failed", rpc=name, status=exc.kind.value, reason=str(exc))
            count_failure(servicer, model_of(request), exc.kind)
            code, details = STATUS_BY_KIND[exc.kind], str(exc)
        else:
            log.exception("rpc_bug", rpc=name)
            count_failure(servicer, model_of(request), ErrorKind.INTERNAL)
            code, details = grpc.StatusCode.INTERNAL, internal_message(request_id)
        release_frames(exc)
        # the status is set, not raised with context.abort: grpc's AbortError would
        # form a cycle with the frames of this call, which hold its request (an
        # inline upload's files) until the cycle collector runs
        context.set_code(code)
        context.set_details(details)
        context.set_trailing_metadata(trailer)

    def begin(context) -> str:
        request_id = begin_grpc_call(context)
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        return request_id

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            request_id = begin(context)
            await refuse_if_draining(self, context)
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise  # the method set its status itself (context.abort)
            except Exception as exc:  # noqa: BLE001 - mapped to a status above
                fail(self, context, request, exc, request_id)
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        request_id = begin(context)
        await refuse_if_draining(self, context)
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method set its status itself (context.abort)
        except Exception as exc:  # noqa: BLE001 - mapped to a status above
            fail(self, context, request, exc, request_id)
            return None  # grpc sends no message with a status other than OK
    return unary_wrapper
