"""The event loop the daemon, the gateway and each worker process run on.

uvloop (libuv) where it is installed costs less CPU per wake-up, callback
and socket write than asyncio's pure-Python selector loop, and every
generated token crosses a loop a few times: the daemon, the gateway and
the workers run on it by default. (The daemon starts its workers with
subprocess.Popen, not the loop's subprocess_exec, whose libuv spawn left
a worker dead of SIGSEGV about one start in twenty: workers/stand_in.py.)
MODELD_EVENT_LOOP=uvloop or =asyncio overrides the default for every
process that reads it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine


def loop_name(default: str = "uvloop") -> str:
    """"uvloop" or "asyncio": what `run` would start."""
    if os.environ.get("MODELD_EVENT_LOOP", default).strip().lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, Any], default: str = "uvloop") -> Any:
    """asyncio.run(main) on the loop loop_name(default) names."""
    if loop_name(default) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
