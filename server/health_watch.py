"""grpc.health.v1 for a server that drains: grpc's own servicer, except
that a Watch stream ends (OK) once the drain has begun and the watcher has
been told NOT_SERVING.

grpc's Watch waits for the next change for ever, and after
enter_graceful_shutdown there is none; `server.stop(grace)` then waits out
the whole grace period for the watchers (a gateway watches every node), so a
drained daemon whose last call ended in seconds stayed up for the full grace.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

# how long a watcher of a service grpc never knew (SERVICE_UNKNOWN, which
# the drain does not change) keeps its stream once the drain has begun
_UNKNOWN_SERVICE_LINGER_S = 1.0


class _Told:
    """The stream's context, noting when NOT_SERVING has gone out on it."""

    def __init__(self, context) -> None:
        self._context = context
        self.not_serving = asyncio.Event()

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        await self._context.write(message)
        if message.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            self.not_serving.set()

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class DrainingHealthServicer(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._draining = asyncio.Event()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._draining.set()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        told = _Told(context)
        watch = asyncio.ensure_future(super().Watch(request, told))
        draining = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({watch, draining}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                return watch.result()
            try:
                await asyncio.wait_for(told.not_serving.wait(), _UNKNOWN_SERVICE_LINGER_S)
            except TimeoutError:
                pass
        finally:
            watch.cancel()
            draining.cancel()
