"""modeld.v1.Node: this daemon's load, as a gateway reads it to route calls.

Every figure is read from the data plane (which reads where the engine
keeps it) at the moment of the call; nothing here counts anything. Stats
and WatchStats answer while the daemon drains (with `draining` set): that
is the news a gateway needs, so unlike the other services they do not
refuse calls then.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import grpc
import structlog

from modeld.backends.errors import ModeldError
from modeld.gen import node_pb2 as pb
from modeld.gen import node_pb2_grpc as pb_grpc
from modeld.server.dataplane import DataPlane, ModelLoad
from modeld.server.request_context import internal_message
from modeld.server.services import kv_events
from modeld.server.services.status import STATUS_BY_KIND, begin_grpc_call

log = structlog.get_logger("modeld.node")

DEFAULT_INTERVAL_S = 1.0
MIN_INTERVAL_S = 0.05
# How soon a watch notices the daemon started draining, whatever its interval.
_DRAIN_POLL_S = 0.1
KV_DEFAULT_INTERVAL_S = 0.1
KV_MIN_INTERVAL_S = 0.02


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.node_id = socket.gethostname()
        self.http_port = 0  # the daemon's bound HTTP port, set by the app once it listens (0: no HTTP)
        self._started = time.monotonic()

    async def Stats(self, request, context):
        begin_grpc_call(context)  # the id a bug's message names is on its log line
        try:
            return self.snapshot()
        except Exception:  # a bug: say so and keep serving
            log.exception("node_stats_bug")
            await context.abort(grpc.StatusCode.INTERNAL, internal_message())

    async def WatchStats(self, request, context):
        """A snapshot now, then one per interval; a last one with `draining`
        set when the daemon starts to drain, then the stream ends (OK), so
        it never holds up the shutdown."""
        begin_grpc_call(context)
        interval_s = watch_interval_s(request.interval_ms)
        try:
            while True:
                yield self.snapshot()
                if self.plane.is_draining:
                    return
                await self._sleep_unless_draining(interval_s)
        except Exception:  # a bug: say so and keep serving (cancellation is BaseException, not caught)
            log.exception("node_watch_bug")
            await context.abort(grpc.StatusCode.INTERNAL, internal_message())

    async def WatchKvEvents(self, request, context):
        """A snapshot of the prefix caches now, then their changes each
        interval (none sent while nothing changed); the stream ends (OK)
        when the daemon drains: a draining node takes no new prompts."""
        begin_grpc_call(context)
        interval_s = KV_DEFAULT_INTERVAL_S if request.interval_ms == 0 else max(
            request.interval_ms / 1000, KV_MIN_INTERVAL_S)
        watch = kv_events.KvWatch()
        try:
            while not self.plane.is_draining:
                message = watch.message(kv_events.cache_views(self.plane))
                if message is not None:
                    yield message
                await self._sleep_unless_draining(interval_s)
        except Exception:  # a bug: say so and keep serving
            log.exception("node_kv_watch_bug")
            await context.abort(grpc.StatusCode.INTERNAL, internal_message())

    async def PromptBlocks(self, request, context):
        """The block hashes a gateway looks up for a prompt (kv_events.prompt_blocks)."""
        begin_grpc_call(context)
        try:
            return await kv_events.prompt_blocks(self.plane, request)
        except ModeldError as exc:
            await context.abort(STATUS_BY_KIND[exc.kind], str(exc))
        except Exception:  # a bug: say so and keep serving
            log.exception("node_prompt_blocks_bug")
            await context.abort(grpc.StatusCode.INTERNAL, internal_message())

    async def _sleep_unless_draining(self, interval_s: float) -> None:
        wake_at = time.monotonic() + interval_s
        while not self.plane.is_draining:
            left = wake_at - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, _DRAIN_POLL_S))

    def snapshot(self) -> pb.NodeStats:
        plane = self.plane
        models = [_model_load(load) for load in plane.model_loads()]
        memory = plane.memory()
        gpu_used, gpu_total = gpu_memory()
        return pb.NodeStats(
            node_id=self.node_id,
            models=models,
            memory_used_bytes=memory.used_bytes,
            memory_budget_bytes=memory.budget_bytes,
            daemon_memory_bytes=memory.daemon_bytes,
            http_port=self.http_port,
            in_flight=sum(m.in_flight for m in models),
            queue_depth=sum(m.queue_depth for m in models),
            kv_cells_used=sum(m.kv_cells_used for m in models),
            kv_cells_capacity=sum(m.kv_cells_capacity for m in models),
            uptime_s=time.monotonic() - self._started,
            gpu_memory_used_bytes=gpu_used,
            gpu_memory_total_bytes=gpu_total,
            draining=plane.is_draining,
            unhealthy_backends=[pb.UnhealthyBackend(name=b.name, reason=b.reason, retry_in_s=b.retry_in_s)
                                for b in plane.unhealthy_backends()],
        )


def _model_load(load: ModelLoad) -> pb.ModelLoad:
    status, stats = load.status, load.stats
    return pb.ModelLoad(
        name=status.name,
        backend=status.backend,
        state=status.state.value,
        memory_bytes=load.memory_bytes,
        in_flight=stats.num_in_flight,
        p99_latency_s=stats.recent_latency.quantile(0.99),
        p95_latency_s=stats.recent_latency.quantile(0.95),
        request_count=stats.num_requests,
        failure_count=stats.num_server_failures,
        queue_depth=load.queue_depth,
        kv_cells_used=load.kv_cells_used,
        kv_cells_capacity=load.kv_cells_capacity,
        pull_bytes_done=status.pull_done,
        pull_bytes_total=status.pull_total,
        base=status.base,
        wait_for_pull=status.waits_for_pull,
    )


def watch_interval_s(interval_ms: int) -> float:
    """The proto's rule: 0 means one second, and never faster than 50 ms."""
    if interval_ms == 0:
        return DEFAULT_INTERVAL_S
    return max(interval_ms / 1000, MIN_INTERVAL_S)


def gpu_memory() -> tuple[int, int]:
    """(used, total) bytes over the GPUs this process already uses; (0, 0) elsewhere.

    Only where a backend has imported torch and initialised CUDA: importing
    torch costs seconds and hundreds of MB, and querying a GPU nothing uses
    would create a CUDA context on it (several hundred MB of its memory).
    Used is the device's, every process's allocations included.
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return 0, 0
    used = total = 0
    try:
        for index in range(cuda.device_count()):
            if cuda.memory_reserved(index) == 0:
                continue  # no allocation of ours there, maybe no context: do not make one
            free, size = cuda.mem_get_info(index)
            used, total = used + size - free, total + size
    except RuntimeError:  # a driver fault must not take the load report with it
        log.warning("gpu_memory_unreadable", exc_info=True)
        return 0, 0
    return used, total
