"""Per-call limits the services apply before the engine sees a request:
the call's gRPC deadline (joined with KServe's `timeout` parameter) and
the per-model request size cap."""

from __future__ import annotations

from modeld.backends.errors import DeadlineExceeded, ResourceExhausted
from modeld.backends.sizes import format_size


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


def check_request_size(engine, model: str, nbytes: int, default_cap: int | None) -> None:
    """RESOURCE_EXHAUSTED for a request larger than its model's cap:
    `[limits] max_request_bytes` in its config, else the daemon's
    `max_request_bytes`. A model not loaded yet is judged by its config
    in the repository, so an oversized request never triggers a load."""
    if not nbytes:
        return
    served = engine.served(model)
    config = served.config if served is not None else engine.repository.resolve(model).config
    cap = getattr(config, "max_request_bytes", None)
    if cap is not None:
        if nbytes > cap:
            raise ResourceExhausted(
                f"request of {nbytes} bytes exceeds model {model!r}'s request size limit {cap} "
                f"({format_size(cap)}, limits.max_request_bytes in its config); send a smaller request or batch")
        return
    if default_cap is not None and nbytes > default_cap:
        raise ResourceExhausted(
            f"request of {nbytes} bytes exceeds the daemon's request size limit {default_cap} "
            f"({format_size(default_cap)}, max_request_bytes); send a smaller request, or raise the limit for "
            f"this model with limits.max_request_bytes in its config")

