"""Per-call limits of a gRPC call: its deadline, joined with KServe's
`timeout` parameter. (The per-model request size cap is the data plane's.)"""

from __future__ import annotations

import dataclasses

from modeld.backends.errors import DeadlineExceeded
from modeld.server.requests import InferRequest


def call_timeout_s(context) -> float | None:
    """Seconds left of the call's gRPC deadline, None without one.

    A deadline already passed fails here, before anything runs: the caller
    has stopped waiting, so the work would be thrown away.
    """
    remaining = context.time_remaining()
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before the request started; send it with a later deadline")
    return remaining


def sooner(a: float | None, b: float | None) -> float | None:
    """The shorter of two timeouts, either of which may be None (none)."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def with_call_timeout(request: InferRequest, call_timeout_s: float | None) -> InferRequest:
    """The request with the call's deadline as its timeout where that is sooner."""
    timeout_s = sooner(request.timeout_s, call_timeout_s)
    if timeout_s == request.timeout_s:
        return request
    return dataclasses.replace(request, timeout_s=timeout_s, deadline=None)
