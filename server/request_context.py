"""What every call carries through the engine, whatever front it came in
by: its request id and its protocol ("grpc" or "http"). Context variables,
so the engine and its log lines see them without threading them through
every signature; each front sets them once per call."""

from __future__ import annotations

import contextvars
import re
import uuid

import structlog

REQUEST_ID_HEADER = "x-request-id"
# what a proxy or client typically sends (UUIDs, trace ids); anything else
# could forge log lines, so a fresh id replaces it
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_protocol: contextvars.ContextVar[str] = contextvars.ContextVar("protocol", default="grpc")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def usable_client_id(value: object) -> str | None:
    return value if isinstance(value, str) and _CLIENT_ID.fullmatch(value) else None


def begin_call(client_id: object, protocol: str) -> str:
    """Take the client's id when usable, else make one; bind it to the logs."""
    request_id = usable_client_id(client_id) or new_request_id()
    _request_id.set(request_id)
    _protocol.set(protocol)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    return request_id


def current_request_id() -> str:
    return _request_id.get() or new_request_id()


def current_protocol() -> str:
    return _protocol.get()
