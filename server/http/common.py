"""What every HTTP front shares: the one table from an error kind to an HTTP
status (the REST twin of the gRPC status table), `status_of_error` (the same
for any exception, 413 for an oversize body), `read_body`
(max_message_bytes, as gRPC enforces it), a JSON object body, and
`unless_client_leaves` (a call cancelled when its client disconnects).

The route modules and app.py import it; it imports none of them.
"""

from __future__ import annotations

import asyncio
import json
import zlib

from starlette.requests import Request

from modeld.backends.digits import ascii_digits
from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError, ResourceExhausted

# The gRPC status table in grpc-gateway's HTTP mapping, which REST clients
# of gRPC services already know. 499 is nginx's "client closed request";
# RESOURCE_EXHAUSTED is 429 because a full queue or budget is worth retrying
# later, unlike an oversize body (413, decided by the front).
_STATUS_BY_KIND = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.FAILED_PRECONDITION: 400,
    ErrorKind.PERMISSION_DENIED: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
}
assert set(_STATUS_BY_KIND) == set(ErrorKind), "every ErrorKind needs an HTTP status"

CLIENT_GONE_STATUS = 499  # nobody is left to read the answer; for the access log


def http_status_of(kind: ErrorKind) -> int:
    """The HTTP status for an engine error kind (the gRPC table's twin)."""
    return _STATUS_BY_KIND.get(kind, 500)


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


def check_body_size(plane, model: str, nbytes: int) -> None:
    """413 for a body over the model's request size cap (its `[limits]
    max_request_bytes`, else the daemon's `max_request_bytes`): the same
    cap and message as a gRPC request gets, with the status REST clients
    read as "too large"."""
    if plane is None or not model or not isinstance(model, str):
        return
    try:
        plane.check_request_size(model, nbytes)
    except ResourceExhausted as exc:
        raise BodyTooLarge(str(exc)) from None
    except ModeldError:
        return  # an unknown or misspelt model: the endpoint refuses it in its own words


def _infer_model(request: Request) -> str:
    """The model an inference route names in its path; "" elsewhere (loads
    carry model files, bound by max_message_bytes only, as over gRPC)."""
    return request.path_params.get("name", "") if request.url.path.endswith("/infer") else ""


async def read_body(request: Request) -> bytes:
    """The request body, decompressed (gzip or deflate, as tritonclient can
    send it), refused as soon as it passes max_message_bytes, and on an
    inference route as soon as it passes its model's request size cap."""
    limit = getattr(request.app.state, "max_message_bytes", None)
    plane, model = getattr(request.app.state, "plane", None), _infer_model(request)
    declared = request.headers.get("content-length", "")
    digits = ascii_digits(declared)
    if limit and digits and int(declared) > limit:
        raise _too_large(declared, limit)  # before reading a byte of it
    if digits:
        check_body_size(plane, model, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit and size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        check_body_size(plane, model, len(body))
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
    check_body_size(plane, model, len(data))
    return data


def json_type_name(value: object) -> str:
    """A value's type as JSON names it (a list is an array)."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def json_object(data: bytes, what: str = "request body") -> dict:
    """`data` parsed as one JSON object, INVALID_ARGUMENT naming `what` otherwise."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"the {what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the {what} must be a JSON object, got {json_type_name(value)}")
    return value


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


# The scope key under which app.py's application leaves the server's own
# send, outside every middleware: an event stream's body chunks go there
# (openai_chat._EventStream), its start through the middlewares.
BODY_SEND = "modeld.body_send"


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


# Routes a caller may always reach: Kubernetes probes must be answered while
# every slot is taken.
_UNCOUNTED_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})


class ConcurrencyLimit:
    """At most `limit` HTTP requests in progress, daemon-wide (a streaming
    answer counts until it ends); past it 429 naming http_max_concurrency,
    in the route's error shape. Health routes are not counted. Pure ASGI,
    as the other middleware, so streaming bodies are untouched."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            from starlette.responses import JSONResponse

            message = (f"the daemon has {self.active} HTTP requests in progress, its http_max_concurrency limit "
                       f"({self.limit}); retry shortly, or on another node")
            if scope.get("path", "").startswith("/v1/"):  # the OpenAI SDK reads error.message
                body = {"error": {"message": message, "type": "rate_limit_exceeded", "param": None,
                                  "code": "resource_exhausted"}}
            else:
                body = {"error": message}
            await JSONResponse(body, status_code=429)(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
