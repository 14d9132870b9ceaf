"""The HTTP layer every remote backend shares: one httpx client per model,
the engine's errors mapped to modeld's kinds by meaning, and server-sent
event streams read with httpx-sse.

Every failure leaves here as a ModeldError. One the health tracker must
count (unreachable, timeout, 5xx, a broken stream) is a RemoteFailure, an
Unavailable that says which FailureKind it was; an answer that refuses the
request on its merits (4xx) maps by meaning through one table,
kind_for_status.

A remote's error body reaches the caller summarised, never quoted raw: the
status, its reason phrase and, where the body is an engine's JSON error,
the first line of its message, cut short, with URLs' userinfo and absolute
paths taken out. A body can be anything the host at the URL sends (a proxy's
page, an internal service's answer), and the caller chose the URL; the
operator finds the body itself in the daemon's log (remote_error_body).
"""

from __future__ import annotations

import http
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
import structlog
from httpx_sse import SSEError, aconnect_sse

from modeld.backends.artifact_paths import scrub_paths
from modeld.backends.errors import ErrorKind, ModeldError, Unavailable, error_for
from modeld.backends.remote.egress import redact_text, redact_url
from modeld.backends.remote.health import FailureKind

log = structlog.get_logger("modeld.remote")

_MAX_MESSAGE = 160  # characters of an engine's own error message shown to a client
_MAX_LOGGED = 2000  # characters of a remote's error body kept in the daemon's log
_CONNECT_TIMEOUT_S = 10.0


class RemoteFailure(Unavailable):
    """A call the remote failed (not refused): UNAVAILABLE, counted for health."""

    def __init__(self, message: str, failure: FailureKind) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(frozen=True)
class Endpoint:
    """Where one remote engine listens and how to talk to it."""

    engine: str  # openai, vllm, sglang, tgi: for messages
    url: str  # http(s)://host:port, no trailing slash
    api_key: str = field(default="", repr=False)  # never in a log line or a traceback's repr
    timeout_s: float = 600.0

    @property
    def where(self) -> str:
        return f"the {self.engine} engine at {redact_url(self.url)}"


class RemoteHttp:
    """One httpx.AsyncClient, opened in the event loop that uses it."""

    def __init__(self, endpoint: Endpoint, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.endpoint = endpoint
        self.transport = transport  # tests answer from a function instead of a socket
        self._client: httpx.AsyncClient | None = None

    def open(self) -> None:
        e = self.endpoint
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=e.url, headers=headers, follow_redirects=False, transport=self.transport,
            # the read timeout bounds the wait for each next byte, so a long
            # stream never times out while tokens keep coming
            timeout=httpx.Timeout(e.timeout_s, connect=min(_CONNECT_TIMEOUT_S, e.timeout_s)),
            # a sequence per connection: max_in_flight bounds them, not the pool
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise Unavailable(f"{self.endpoint.where}: the model is not started (or already stopped)")
        return self._client

    async def get(self, path: str, timeout_s: float | None = None) -> httpx.Response:
        return await self._call("GET", path, None, timeout_s)

    async def post(self, path: str, body: Any, timeout_s: float | None = None) -> httpx.Response:
        return await self._call("POST", path, body, timeout_s)

    async def get_json(self, path: str, timeout_s: float | None = None) -> Any:
        return self._json(path, await self.get(path, timeout_s))

    async def post_json(self, path: str, body: Any, timeout_s: float | None = None) -> Any:
        return self._json(path, await self.post(path, body, timeout_s))

    async def answer(self, method: str, path: str, body: Any, timeout_s: float | None = None) -> httpx.Response:
        """The engine's answer whatever its status (the caller reads an error
        answer itself); only a transport failure raises."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            return await self.client.request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise self.transport_failure(exc, path) from None

    async def _call(self, method: str, path: str, body: Any, timeout_s: float | None) -> httpx.Response:
        response = await self.answer(method, path, body, timeout_s)
        if response.status_code >= 400:
            raise error_for_status(f"{self.endpoint.where} ({method} {path})", response.status_code, response.text)
        return response

    def _json(self, path: str, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            _log_body(self.endpoint.where, response.status_code, response.text)
            raise RemoteFailure(f"{self.endpoint.where} answered {path} with something that is not JSON",
                                FailureKind.BROKEN_STREAM) from None

    async def events(self, path: str, body: Any) -> AsyncIterator[Any]:
        """POST `body` and yield the JSON of each server-sent event, until the
        stream ends or sends `data: [DONE]`.

        Closing this iterator (the caller left) closes the connection, which
        is how the engine learns to stop generating."""
        where = f"{self.endpoint.where} ({path})"
        received = 0
        try:
            async with aconnect_sse(self.client, "POST", path, json=body) as source:
                response = source.response
                if response.status_code >= 400:
                    await response.aread()
                    raise error_for_status(where, response.status_code, response.text)
                async for event in source.aiter_sse():
                    if event.data == "[DONE]":
                        return
                    if not event.data.strip():
                        continue  # a keep-alive without data
                    received += 1
                    yield _event_json(where, event.data)
        except SSEError as exc:  # not an event stream at all
            raise RemoteFailure(f"{where} did not answer with an event stream: {exc}",
                                FailureKind.BROKEN_STREAM) from None
        except httpx.HTTPError as exc:
            raise self.transport_failure(exc, path, mid_stream=received > 0) from None

    def transport_failure(self, exc: httpx.HTTPError, path: str, mid_stream: bool = False) -> RemoteFailure:
        where = f"{self.endpoint.where} ({path})"
        detail = f"{type(exc).__name__}: {_clean(str(exc))}" if str(exc) else type(exc).__name__
        if isinstance(exc, httpx.ConnectError):
            return RemoteFailure(f"{where} is unreachable ({detail})", FailureKind.UNREACHABLE)
        if isinstance(exc, httpx.TimeoutException):
            return RemoteFailure(f"{where} did not answer within its timeout ({detail}); [remote] timeout_s is "
                                 f"{self.endpoint.timeout_s:g}", FailureKind.TIMEOUT)
        if mid_stream:
            return RemoteFailure(f"{where} broke off its answer mid-stream ({detail})", FailureKind.BROKEN_STREAM)
        return RemoteFailure(f"{where} failed ({detail})", FailureKind.BROKEN_STREAM)


def _event_json(where: str, data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        _log_body(where, 200, data)
        raise RemoteFailure(f"{where} sent a malformed event (not JSON)", FailureKind.BROKEN_STREAM) from None


# One table for every remote protocol, whether the status comes as the HTTP
# answer or inside a stream's error event (OpenAI's `code`, SGLang's abort
# `status_code`). 401/403 refuse *modeld's* credentials for the remote
# ([remote] api_key_env), which the caller can neither see nor fix: they are
# FAILED_PRECONDITION (an operator must fix the daemon), never a verdict on
# the caller's own credentials, and not UNAVAILABLE either, since retrying
# elsewhere or later cannot help until the key is fixed.
_KIND_BY_STATUS = {
    401: ErrorKind.FAILED_PRECONDITION, 403: ErrorKind.FAILED_PRECONDITION, 404: ErrorKind.NOT_FOUND,
    408: ErrorKind.UNAVAILABLE, 413: ErrorKind.RESOURCE_EXHAUSTED, 429: ErrorKind.RESOURCE_EXHAUSTED,
    424: ErrorKind.UNAVAILABLE,  # TGI: a failed generation in its shards
}


def kind_for_status(status: int | None) -> ErrorKind:
    """The kind a remote's HTTP status means; a missing or non-error status
    (a stream that just failed) is the remote's failure: UNAVAILABLE."""
    if not isinstance(status, int) or not 400 <= status < 500:
        return ErrorKind.UNAVAILABLE
    return _KIND_BY_STATUS.get(status, ErrorKind.INVALID_ARGUMENT)


def error_for_status(where: str, status: int, body: str) -> ModeldError:
    """An HTTP error answer as the error a client of modeld should see."""
    _log_body(where, status, body)
    text = f"{where} answered HTTP {status}: {remote_message(body, status)}"
    kind = kind_for_status(status)
    if kind is ErrorKind.UNAVAILABLE:
        return RemoteFailure(text, FailureKind.TIMEOUT if status == 408 else FailureKind.SERVER_ERROR)
    if kind is ErrorKind.FAILED_PRECONDITION:
        text += "; the daemon's key for it is missing or wrong (check [remote] api_key_env)"
    return error_for(kind, text)


def remote_message(body: str, status: int | None = None) -> str:
    """A summary of an error body: the first line of the message an engine's
    JSON error carries (OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, TGI's {"error"}, vLLM's {"message"}), cut short and cleaned;
    for any other body only the status's reason phrase."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    message = _message_of(data) if isinstance(data, (dict, list)) else ""
    line = " ".join(message.strip().splitlines()[0].split()) if message.strip() else ""
    if not line:
        return _phrase(status)
    line = _clean(line)
    return line if len(line) <= _MAX_MESSAGE else line[:_MAX_MESSAGE] + "..."


def _message_of(data: Any) -> str:
    if isinstance(data, dict):
        for key in ("error", "detail", "message", "msg"):
            if key in data and data[key]:
                return _message_of(data[key])
        return ""  # some other JSON: not an error message to show
    if isinstance(data, list):
        return "; ".join(m for m in (_message_of(item) for item in data[:8]) if m)
    return str(data)


def _phrase(status: int | None) -> str:
    try:
        return f"{http.HTTPStatus(status).phrase} (no message)" if status else "(no message)"
    except ValueError:
        return "(no message)"


def _clean(text: str) -> str:
    return scrub_paths(redact_text(text))


def _log_body(where: str, status: int, body: str) -> None:
    log.warning("remote_error_body", where=where, status=status, body=redact_text(body[:_MAX_LOGGED]))
