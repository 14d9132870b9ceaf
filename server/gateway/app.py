"""`modeld gateway`: the process that serves the daemon's gRPC surface in
front of many daemons."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from modeld.server.gateway.config import GatewaySettings, NodeCredentials
from modeld.server.gateway.discovery import watch_dns, watch_file
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet
from modeld.server.gateway.router import Router
from modeld.server.gateway.service import GENERATION, INFERENCE, GatewayService
from modeld.server.health_watch import DrainingHealthServicer
from modeld.server.reflection import reflection_pool
from modeld.server.tls import ServerTls, add_port, reload_credentials

log = structlog.get_logger("modeld.gateway")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        # the client port's credentials: the daemon's own modules and file formats
        self.tls = ServerTls(settings.client_tls_files()) if settings.tls_cert else None
        self.auth = None
        if settings.auth_token_file:
            from modeld.server.auth import Authenticator

            self.auth = Authenticator(Path(settings.auth_token_file), registry=self.metrics.registry)
        self.fleet = Fleet(settings, self.metrics, NodeCredentials.load(settings))
        self.router = Router(self.fleet, settings, self.metrics)
        self.service = GatewayService(self.fleet, self.router, settings, self.metrics)
        self.health = DrainingHealthServicer()
        self._health_view: dict[str, int] = {}
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.http = None  # the HTTP front (server/gateway/http/), made in start() unless --http-port -1
        self.http_port = 0
        self.metrics_port = 0
        self._tasks: list[asyncio.Task] = []
        self._draining = False

    async def start(self) -> int:
        s = self.settings
        interceptors = []
        if self.auth is not None:
            from modeld.server.auth import AuthInterceptor

            interceptors.append(AuthInterceptor(self.auth))
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ], interceptors=interceptors or None)
        self.server.add_generic_rpc_handlers(self.service.handlers())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [INFERENCE, GENERATION, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server,
            pool=reflection_pool())
        self.port = add_port(self.server, f"{s.host}:{s.grpc_port}", self.tls)
        if self.port == 0:
            raise OSError(f"cannot listen on {s.host}:{s.grpc_port}")
        await self.server.start()
        if s.http_port >= 0:
            from modeld.server.gateway.http.front import HttpFront

            self.http = HttpFront(self.fleet, self.router, s, self.metrics, authenticator=self.auth, tls=self.tls)
            self.http_port = await self.http.start(s.host, s.http_port, grace_s=10.0)
        if s.metrics_port >= 0:
            self._metrics_server, _ = start_http_server(s.metrics_port, addr=s.host, registry=self.metrics.registry)
            self.metrics_port = self._metrics_server.server_port
        await self.health.set("", _NOT_SERVING)
        loop = asyncio.get_running_loop()
        if s.dns:
            self._tasks.append(loop.create_task(watch_dns(s.dns, s.dns_interval_s, self.fleet.set_addresses)))
        elif s.nodes_file:
            self._tasks.append(loop.create_task(watch_file(Path(s.nodes_file), s.dns_interval_s,
                                                           self.fleet.set_addresses)))
        else:
            self.fleet.set_addresses(set(s.nodes))
        self._tasks.append(loop.create_task(self._follow_health()))
        log.info("gateway_started", host=s.host, grpc_port=self.port, http_port=self.http_port or None,
                 metrics_port=self.metrics_port,
                 nodes=list(s.nodes), dns=s.dns, replicas=s.replicas, node_tls=self.fleet.credentials.tls,
                 node_mutual_tls=bool(s.node_tls_cert), node_token=self.fleet.credentials.has_token,
                 fleet_proof=s.fleet_proof_required,
                 tls="mutual" if self.tls is not None and self.tls.mutual else "on" if self.tls is not None else "off",
                 auth=f"{len(self.auth.table)} tokens" if self.auth is not None else "off")
        if s.host not in ("127.0.0.1", "localhost", "::1") and (self.tls is None or self.auth is None):
            log.warning("gateway_client_port_open", host=s.host, tls=self.tls is not None, auth=self.auth is not None,
                        hint="give --tls-cert/--tls-key and --auth-token-file: any caller that reaches the port "
                             "can use every node through it")
        return self.port

    async def _follow_health(self) -> None:
        """The gateway's own health: "" is SERVING while some node can take
        calls; a model is SERVING while a node that can take calls has it
        ready (as a daemon reports a model it has not loaded yet)."""
        while True:
            if not self._draining:
                view: dict[str, int] = {}
                routable = self.fleet.routable()
                view[""] = _SERVING if routable else _NOT_SERVING
                for node in self.fleet.by_address.values():
                    for model in (node.stats.models if node.stats is not None else ()):
                        ready = node in routable and model.state == "READY"
                        if ready or model.name not in view:
                            view[model.name] = _SERVING if ready else _NOT_SERVING
                for name in self._health_view.keys() - view.keys():
                    view[name] = _NOT_SERVING  # no node lists it any more
                for name, status in view.items():
                    if self._health_view.get(name) != status:
                        await self.health.set(name, status)
                self._health_view = view
            await asyncio.sleep(min(0.25, self.settings.stats_interval_s))

    async def stop(self, grace_s: float = 10.0) -> None:
        self._draining = True
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        # both ports close at once; calls in flight on either finish within the grace period
        await asyncio.gather(*(stop for stop in (self.server.stop(grace_s) if self.server is not None else None,
                                                 self.http.stop() if self.http is not None else None) if stop))
        await self.fleet.close()
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()
        log.info("gateway_stopped")

    def reload_credentials(self) -> None:
        """SIGHUP: reread certificates and tokens (server/tls.py)."""
        reload_credentials(self.tls, self.auth)

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_credentials)
        await self.start()
        await stop_requested.wait()
        await self.stop()
