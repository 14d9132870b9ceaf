"""The daemon's HTTP application: the KServe v2 REST front (/v2) and the
OpenAI front (/v1) over the engine the gRPC services use.

Shared by both fronts: `http_status_of` (the one table from an error kind
to an HTTP status, the REST twin of the gRPC status table),
`status_of_error` (the same for any exception, 413 for an oversize body),
`read_body` (max_message_bytes, as gRPC enforces it) and
`RequestIdMiddleware` (each request's id and protocol, set in the task that
runs the endpoint so streaming bodies see them too).
"""

from __future__ import annotations

import asyncio
import zlib

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError, ResourceExhausted
from modeld.server.request_context import REQUEST_ID_HEADER, begin_call

log = structlog.get_logger("modeld.http")

# The gRPC status table in grpc-gateway's HTTP mapping, which REST clients
# of gRPC services already know. 499 is nginx's "client closed request";
# RESOURCE_EXHAUSTED is 429 because a full queue or budget is worth retrying
# later, unlike an oversize body (413, decided by the front).
_STATUS_BY_KIND = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.FAILED_PRECONDITION: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
}
assert set(_STATUS_BY_KIND) == set(ErrorKind), "every ErrorKind needs an HTTP status"

DRAINING_MESSAGE = "the daemon is shutting down; retry on another node"


def http_status_of(kind: ErrorKind) -> int:
    """The HTTP status for an engine error kind (the gRPC table's twin)."""
    return _STATUS_BY_KIND.get(kind, 500)


def internal_message(request_id: str) -> str:
    return f"internal error (request id {request_id}); see the daemon log"


class BodyTooLarge(ResourceExhausted):
    """RESOURCE_EXHAUSTED, as gRPC reports an oversize message, but 413:
    retrying the same body can never succeed, unlike a full queue (429)."""


def status_of_error(exc: BaseException) -> int:
    """The HTTP status for any exception an endpoint lets out."""
    if isinstance(exc, BodyTooLarge):
        return 413
    if isinstance(exc, ModeldError):
        return http_status_of(exc.kind)
    return 500


def _too_large(size: int | str, limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body of {size} bytes is larger than the daemon's max_message_bytes "
                        f"({limit} bytes); send less per request or raise max_message_bytes")


async def read_body(request: Request) -> bytes:
    """The request body, decompressed (gzip or deflate, as tritonclient can
    send it), refused as soon as it passes max_message_bytes."""
    limit = getattr(request.app.state, "max_message_bytes", None)
    declared = request.headers.get("content-length", "")
    if limit and declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)  # before reading a byte of it
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit and size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidArgument(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or identity")
    # bounded: a small compressed body must not inflate past the limit
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        data = inflater.decompress(body, limit + 1 if limit else 0)
    except zlib.error as exc:
        raise InvalidArgument(f"the request body is not valid {encoding} data: {exc}") from None
    if limit and (len(data) > limit or inflater.unconsumed_tail):
        raise _too_large(f"more than {limit} (decompressed)", limit)
    return data


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def unless_client_leaves(request: Request, awaitable):
    """Await `awaitable`; if the client disconnects first, cancel it (a queued
    request leaves its queue, a sequence the batch: nobody will read the
    answer, as grpc.aio cancels a call whose client went away) and raise
    ClientGone. The body must have been read: the next message can then only
    be the disconnect."""
    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        watch.cancel()
        await asyncio.wait({work})  # its cleanup must finish before the caller closes what it used
        raise
    watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait({work})  # its cleanup releases the sequence before we answer
    raise ClientGone()


class RequestIdMiddleware:
    """Pure ASGI, not BaseHTTPMiddleware: the endpoint then runs in this
    task, so the request id context variables reach it, its log lines and
    any streaming body it produces.

    The client's `x-request-id` is used when usable, else one is made; it is
    echoed on every response, errors included. While the daemon drains, new
    requests are refused with 503 as gRPC refuses them with UNAVAILABLE.
    """

    def __init__(self, app: ASGIApp, lifecycle=None) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = None
        for key, value in scope.get("headers") or ():
            if key == b"x-request-id":
                client_id = value.decode("latin-1")
                break
        request_id = begin_call(client_id, "http")
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        if self.lifecycle is not None and self.lifecycle.is_draining:
            response = JSONResponse({"error": DRAINING_MESSAGE}, status_code=503)
            await response(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def build_app(engine, lifecycle, max_message_bytes: int | None = None, authenticator=None) -> Starlette:
    """Both fronts' routes behind the request-id middleware (and the token
    check when the daemon has a token file)."""
    from modeld.server.http import kserve, openai, rerank

    routes = [*kserve.routes(engine, lifecycle), *openai.routes(engine, lifecycle), *rerank.routes(engine)]
    app = Starlette(routes=routes)
    app.state.engine = engine
    app.state.lifecycle = lifecycle
    app.state.max_message_bytes = max_message_bytes
    if authenticator is not None:
        from modeld.server.auth import HttpAuthMiddleware

        # added first so it runs inside the request-id one: refusals carry an id too
        app.add_middleware(HttpAuthMiddleware, authenticator=authenticator)
    app.add_middleware(RequestIdMiddleware, lifecycle=lifecycle)
    return app
