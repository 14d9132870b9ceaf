"""Waiting in tests for something to become true, never for a length of time.

A test that sleeps and then asserts races the machine: on a loaded one
the thing has not happened yet. These poll the condition instead, and the
bound only says when to give up on a daemon that is broken; it is generous
because a working daemon on a busy machine must never reach it, and a
passing test never waits for it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


def wait_until(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, what: str = "the condition",
               interval: float = 0.05) -> T:
    """predicate()'s first truthy value; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float = DEFAULT_TIMEOUT_S,
                           what: str = "the condition", interval: float = 0.01) -> T:
    """wait_until for a test on the event loop: sleeps without blocking it,
    so the tasks that make the condition true keep running meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(interval)
