"""A request's own timeout (KServe's `timeout` parameter, or the call's gRPC
deadline if sooner): work not done by then is cancelled, queued requests
leave the queue, and running sequences leave the batch at the next step."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from modeld.backends.errors import DeadlineExceeded


@contextlib.asynccontextmanager
async def within(timeout_s: float | None):
    if timeout_s is None:
        yield
        return
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise timed_out(timeout_s) from None


async def next_event(events: AsyncIterator, deadline: float | None, timeout_s: float | None):
    # The timeout covers only the wait for the model, never the caller's own
    # work between events: a stream is consumed across many awaits.
    # asyncio.timeout_at rather than wait_for: wait_for wraps every event's
    # wait in a task of its own, a cost paid per token (the loop's clock is
    # time.monotonic, the deadline's too)
    if deadline is None:
        return await events.__anext__()
    try:
        async with asyncio.timeout_at(deadline):
            return await events.__anext__()
    except TimeoutError:
        raise timed_out(timeout_s) from None


def timed_out(timeout_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"the request's timeout of {timeout_s:g} s passed before it finished")
