"""What every call carries through the engine, whatever front it came in
by: its request id and its protocol ("grpc" or "http"). Context variables,
so the engine and its log lines see them without threading them through
every signature; each front sets them once per call."""

from __future__ import annotations

import contextvars
import re
import traceback
import uuid
from typing import Iterable

import structlog

REQUEST_ID_HEADER = "x-request-id"
_HEADER_BYTES = REQUEST_ID_HEADER.encode()
# what a proxy or client typically sends (UUIDs, trace ids); anything else
# could forge log lines, so a fresh id replaces it
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_protocol: contextvars.ContextVar[str] = contextvars.ContextVar("protocol", default="grpc")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def usable_client_id(value: object) -> str | None:
    return value if isinstance(value, str) and _CLIENT_ID.fullmatch(value) else None


def client_request_id(metadata: Iterable[tuple[str | bytes, str | bytes]] | None) -> str | None:
    """The client's x-request-id among a call's metadata: gRPC's invocation
    metadata (str pairs) or an ASGI scope's headers (bytes pairs, lower-case)."""
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER or key == _HEADER_BYTES:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def begin_call(metadata: Iterable[tuple[str | bytes, str | bytes]] | None, protocol: str) -> str:
    """Take the client's id from the call's metadata when usable, else make
    one; bind it to the logs."""
    request_id = usable_client_id(client_request_id(metadata)) or new_request_id()
    _request_id.set(request_id)
    _protocol.set(protocol)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    return request_id


def current_request_id() -> str:
    return _request_id.get() or new_request_id()


def current_protocol() -> str:
    return _protocol.get()


def internal_message(request_id: str | None = None) -> str:
    """What a client is told of a bug: where to look, and nothing of the bug."""
    return f"internal error (request id {request_id or current_request_id()}); see the daemon log"


def release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in `exc`'s tracebacks (its
    causes and contexts too), once a front has turned it into a status.

    A failed call's traceback holds every frame it unwound through, and one
    of them often holds the exception again (a frame awaiting a task keeps
    the task, which keeps its exception): a reference cycle, which only the
    cycle collector frees, and a busy daemon runs it rarely. Meanwhile the
    frames keep what the call held: an inline load refused for room kept its
    uploaded files, so three clients retrying 40 MiB uploads grew the daemon
    by over 2 GB in 40 s. Frames still running (the front's own) are left."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
