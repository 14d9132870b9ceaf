"""The daemon's HTTP application: the KServe v2 REST front (/v2), the
OpenAI front (/v1) and rerank, over the data plane the gRPC services use.

`RequestIdMiddleware` gives each request its id and protocol, set in the
task that runs the endpoint so streaming bodies see them too. What the
fronts share otherwise is in common.py.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modeld.server.dataplane import DRAINING_MESSAGE, DataPlane
from modeld.server.http import kserve, openai_api, rerank_api
from modeld.server.http.common import BODY_SEND, ConcurrencyLimit
from modeld.server.request_context import REQUEST_ID_HEADER, begin_call


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
        request_id = begin_call(scope.get("headers"), "http")
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


class _App(Starlette):
    """Starlette, leaving the server's send in the scope (common.BODY_SEND)
    for event streams' body chunks. Middlewares added here may rewrite a
    response's start, never its body: an event stream's chunks pass them by."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = send
        await super().__call__(scope, receive, send)


def build_app(plane: DataPlane, max_message_bytes: int | None = None, authenticator=None,
              max_concurrency: int = 0) -> Starlette:
    """Every front's routes behind the request-id middleware (and the token
    check when the daemon has a token file, and the cap on requests in
    progress when `max_concurrency` is set)."""
    routes = [*kserve.routes(plane), *openai_api.routes(plane), *rerank_api.routes(plane)]
    app = _App(routes=routes)
    app.state.max_message_bytes = max_message_bytes
    app.state.plane = plane  # read_body applies its models' request size caps
    if max_concurrency:
        # innermost: a call the token check refuses takes no slot
        app.add_middleware(ConcurrencyLimit, limit=max_concurrency)
    if authenticator is not None:
        from modeld.server.auth import HttpAuthMiddleware

        # added first so it runs inside the request-id one: refusals carry an id too
        app.add_middleware(HttpAuthMiddleware, authenticator=authenticator, max_body_bytes=max_message_bytes)
    app.add_middleware(RequestIdMiddleware, lifecycle=plane.lifecycle)
    return app
