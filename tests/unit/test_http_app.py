"""The HTTP fronts' shared pieces: the error-kind → HTTP status table, the
request-id middleware, and build_app mounting both fronts."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from modeld.backends.errors import ErrorKind, InvalidArgument, ResourceExhausted, error_for
from modeld.server.dataplane import DataPlane
from modeld.server.http import app as http_app
from modeld.server.http import kserve, openai_api
from modeld.server.http.app import RequestIdMiddleware
from modeld.server.http.common import BodyTooLarge, http_status_of, status_of_error
from modeld.server.lifecycle import Lifecycle
from modeld.server.request_context import current_protocol, current_request_id

# The README's error table, over HTTP (Triton's REST front, grpc-gateway).
EXPECTED = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.FAILED_PRECONDITION: 400,
    ErrorKind.PERMISSION_DENIED: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
}


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_error_kind_has_the_status_of_the_table(kind):
    assert http_status_of(kind) == EXPECTED[kind]
    assert status_of_error(error_for(kind, "x")) == EXPECTED[kind]


def test_an_oversize_body_is_413_other_exhaustion_429_and_bugs_500():
    assert status_of_error(BodyTooLarge("too big")) == 413
    assert BodyTooLarge("too big").kind is ErrorKind.RESOURCE_EXHAUSTED  # counted as gRPC counts it
    assert status_of_error(ResourceExhausted("queue full")) == 429
    assert status_of_error(InvalidArgument("bad")) == 400
    assert status_of_error(ZeroDivisionError()) == 500


def _context_app(lifecycle: Lifecycle) -> Starlette:
    async def plain(request):
        return PlainTextResponse(f"{current_request_id()} {current_protocol()}")

    async def streamed(request):
        async def chunks():
            for _ in range(3):
                await asyncio.sleep(0)
                yield current_request_id() + "\n"
        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/plain", plain), Route("/stream", streamed)])
    app.add_middleware(RequestIdMiddleware, lifecycle=lifecycle)
    return app


def test_the_request_id_reaches_the_endpoint_its_stream_and_the_response_header():
    with TestClient(_context_app(Lifecycle())) as client:
        response = client.get("/plain", headers={"x-request-id": "abc-1"})
        assert response.headers["x-request-id"] == "abc-1"
        assert response.text == "abc-1 http"
        streamed = client.get("/stream", headers={"x-request-id": "abc-2"})
        assert streamed.headers["x-request-id"] == "abc-2"
        assert streamed.text.splitlines() == ["abc-2"] * 3
        made = client.get("/plain")
        assert made.text.split()[0] == made.headers["x-request-id"] and len(made.headers["x-request-id"]) == 16
        forged = client.get("/plain", headers={"x-request-id": "x\ny"})
        assert forged.headers["x-request-id"] != "x\ny"


def test_a_draining_daemon_refuses_new_requests_with_503_and_the_request_id():
    lifecycle = Lifecycle()
    with TestClient(_context_app(lifecycle)) as client:
        assert client.get("/plain").status_code == 200
        lifecycle.is_draining = True
        refused = client.get("/plain", headers={"x-request-id": "late-1"})
    assert refused.status_code == 503
    assert refused.json() == {"error": "the daemon is shutting down; retry on another node"}
    assert refused.headers["x-request-id"] == "late-1"


def test_build_app_mounts_both_fronts(monkeypatch):
    async def ping(request):
        return PlainTextResponse("pong")

    monkeypatch.setattr(openai_api, "routes", lambda plane: [Route("/v1/ping", ping)])
    plane = DataPlane(engine=None, lifecycle=Lifecycle())
    app = http_app.build_app(plane, max_message_bytes=1024)
    paths = {getattr(r, "path", None) for r in app.routes}
    assert "/v1/ping" in paths
    assert {r.path for r in kserve.routes(plane)} <= paths
    with TestClient(app) as client:
        assert client.get("/v1/ping").text == "pong"
        assert client.get("/v2/health/live").json() == {"live": True}


def test_an_event_streams_start_passes_the_middlewares_and_its_chunks_go_to_the_servers_send(monkeypatch):
    from modeld.server.http.openai_chat import _EventStream

    closed = []

    async def produce(send):
        for i in range(3):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})

    async def close():
        closed.append(True)

    async def events(request):
        return _EventStream(produce, close)

    monkeypatch.setattr(openai_api, "routes", lambda plane: [Route("/v1/events", events)])
    app = http_app.build_app(DataPlane(engine=None, lifecycle=Lifecycle()), max_message_bytes=1024)
    seen = []

    class Recorder:  # a middleware inside the request-id one, as the token check and the cap are
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def recorded(message):
                seen.append(message["type"])
                await send(message)
            await self.app(scope, receive, recorded)

    app.add_middleware(Recorder)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(3600)  # the client stays until the stream ends

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/v1/events", "raw_path": b"/v1/events",
             "query_string": b"", "root_path": "", "headers": [(b"x-request-id", b"ev-1")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and (b"x-request-id", b"ev-1") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
    assert seen == ["http.response.start"] and closed == [True]
