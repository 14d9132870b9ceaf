"""What every /v1 endpoint shares: reading its JSON fields, and OpenAI's
error shape.

Requests fail closed: a field this server does not implement is refused
with 400 naming it, rather than ignored, so a client never gets an answer
that silently means something else than it asked. The few fields accepted
without effect are in `IGNORED` and `_NEUTRAL` (the latter only at the
value that changes nothing).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError
from modeld.server.dataplane import DataPlane
from modeld.server.http.common import CLIENT_GONE_STATUS, ClientGone, check_body_size, json_object, json_type_name, \
    read_body, status_of_error
from modeld.server.request_context import internal_message, release_frames

log = structlog.get_logger("modeld.http.openai")

# Accepted and without effect here: `user` names the end user for OpenAI's
# abuse monitoring, which a self-hosted daemon does not do.
IGNORED = {"user"}
# Accepted only at the value that changes nothing; any other value is refused.
_NEUTRAL = {"suffix": None}
# OpenAI's error `type` by our kind; clients branch on the HTTP status, the
# type is for people reading the body.
_ERROR_TYPE = {
    ErrorKind.INVALID_ARGUMENT: "invalid_request_error",
    ErrorKind.NOT_FOUND: "invalid_request_error",
    ErrorKind.UNIMPLEMENTED: "invalid_request_error",
    ErrorKind.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorKind.FAILED_PRECONDITION: "invalid_request_error",
    ErrorKind.PERMISSION_DENIED: "permission_error",
}


class FieldError(InvalidArgument):
    """Bad input in one request field, named in the error's `param`."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_response(exc: BaseException, plane: DataPlane, model: str) -> JSONResponse:
    """OpenAI's error shape with our status; counts the failure."""
    if isinstance(exc, ModeldError):
        kind, message = exc.kind, str(exc)
        log.info("http_failed", api="openai", status=kind.value, reason=message)
    else:
        kind, message = ErrorKind.INTERNAL, internal_message()
        log.error("http_bug", api="openai", exc_info=exc)
    plane.count_failure(model, kind)
    release_frames(exc)  # logged: nothing reads its frames again (see release_frames)
    body = {"message": message, "type": _ERROR_TYPE.get(kind, "server_error"),
            "param": getattr(exc, "param", None), "code": kind.value.lower()}
    return JSONResponse({"error": body}, status_code=status_of_error(exc))


def takes_json_body(method):
    """A POST /v1 endpoint, called with its JSON object body: every failure
    answers in OpenAI's shape, counted under the model the body names; a
    client that left before the answer gets 499 and counts as CANCELLED."""

    @functools.wraps(method)
    async def wrapper(self, request: Request) -> Response:
        model = ""
        try:
            raw = await read_body(request)  # max_message_bytes, as gRPC's limit
            body = json_object(raw)
            model = body.get("model") if isinstance(body.get("model"), str) else ""
            check_body_size(self.plane, model, len(raw))  # and the model's request size cap, as gRPC's
            return await method(self, request, body)
        except ClientGone:
            self.plane.count_failure(model, ErrorKind.CANCELLED)
            return Response(status_code=CLIENT_GONE_STATUS)
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            return error_response(exc, self.plane, model)
    return wrapper


def check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise FieldError(unknown[0], f"{endpoint} does not support the field {unknown[0]!r}"
                         + (f" (nor {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else "")
                         + "; remove it (this server refuses fields it would otherwise ignore)")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] is not None and body[name] != neutral:
            raise FieldError(name, f"{name} is not supported; only {json.dumps(neutral)} (no effect) is accepted, "
                                   f"got {json.dumps(body[name])}")


def get_field(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    """A field of the given JSON type; null or absent gives the default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise FieldError(name, f"{name} must be {what}, got {json_type_name(value)} {json.dumps(value)[:50]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(name, f"{name} must be a finite number, got {value}")
    return value


def get_int(body: dict, name: str, default: int | None = None) -> int | None:
    return get_field(body, name, (int,), "an integer", default)


def get_number(body: dict, name: str, default: float | None = None) -> float | None:
    value = get_field(body, name, (int, float), "a number", default)
    return None if value is None else float(value)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    return get_field(body, name, (bool,), "true or false", default)


def model_name(body: dict) -> str:
    model = get_field(body, "model", (str,), "a string naming a model (GET /v1/models lists them)")
    if not model:
        raise FieldError("model", "model is required: name a model (GET /v1/models lists them)")
    return model


def priority(body: dict) -> int:
    value = get_int(body, "priority", 0)
    if value < 0:
        raise FieldError("priority", f"priority must be >= 0 (1 is the most urgent, 0 the default), got {value}")
    return value
