"""The event loop the daemon, the gateway and each worker process run on.

uvloop (libuv) where it is installed: every generated token crosses the
event loop a few times (the worker's channel, the daemon's stream, the
HTTP or gRPC write), and uvloop's wake-ups, callbacks and socket writes
cost less CPU than asyncio's pure-Python selector loop. grpc.aio, uvicorn
and asyncio subprocesses run on it unchanged. MODELD_EVENT_LOOP=asyncio
picks the standard loop (to compare, or to rule uvloop out of a fault).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine


def loop_name() -> str:
    """"uvloop" or "asyncio": what `run` would start."""
    if os.environ.get("MODELD_EVENT_LOOP", "uvloop").strip().lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run(main) on the loop loop_name() names."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
