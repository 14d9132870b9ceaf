"""One error hierarchy for the engine and its backends.

Each class names the gRPC status the service layer maps it to, by name only:
nothing below `server/services` imports grpc. Messages are written for the
user who sent the request and say what to change.
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INTERNAL = "INTERNAL"


class ModeldError(Exception):
    kind = ErrorKind.INTERNAL


class InvalidArgument(ModeldError):
    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(ModeldError):
    kind = ErrorKind.NOT_FOUND


class Unavailable(ModeldError):
    kind = ErrorKind.UNAVAILABLE


class ResourceExhausted(ModeldError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class Unimplemented(ModeldError):
    kind = ErrorKind.UNIMPLEMENTED


class Cancelled(ModeldError):
    kind = ErrorKind.CANCELLED


class DeadlineExceeded(ModeldError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class FailedPrecondition(ModeldError):
    """The daemon is not in a state to serve the call, and the caller cannot
    change that: an operator must (a remote engine refusing modeld's key)."""

    kind = ErrorKind.FAILED_PRECONDITION


class PermissionDenied(ModeldError):
    """The caller's credentials do not cover what it asked for (a tenant's
    token and a model outside its list)."""

    kind = ErrorKind.PERMISSION_DENIED


class LoadFailed(ModeldError):
    """A backend could not load a model; the engine may try the next one."""

    kind = ErrorKind.INVALID_ARGUMENT


class BackendFailure(ModeldError):
    """A transient failure inside a backend's run, not the request's fault.

    The engine retries the request on the next eligible backend and counts
    the fallback.
    """

    kind = ErrorKind.INTERNAL


_BY_KIND = {cls.kind: cls for cls in (ModeldError, InvalidArgument, NotFound, Unavailable, ResourceExhausted,
                                      Unimplemented, Cancelled, DeadlineExceeded, FailedPrecondition,
                                      PermissionDenied)}
assert set(_BY_KIND) == set(ErrorKind), "every ErrorKind needs its class"


def error_for(kind: ErrorKind | None, message: str) -> ModeldError:
    """The error of a kind reported as data (a generation's final event, a
    worker's reply), so it reaches the client with its own status."""
    return _BY_KIND.get(kind, ModeldError)(message)
