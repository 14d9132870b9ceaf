"""The daemon: engine, gRPC server, HTTP server, health, reflection, metrics, shutdown."""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from modeld.server.health_watch import DrainingHealthServicer
from modeld.server.http_listen import embedded_server, listen
from modeld.backends.errors import ErrorKind, ModeldError
from modeld.backends.registry import BackendRegistry
from modeld.backends.sizes import format_size
from modeld.gen import generation_pb2, generation_pb2_grpc, inference_pb2, inference_pb2_grpc, node_pb2, node_pb2_grpc
from modeld.server.config import Settings
from modeld.server.dataplane import DataPlane
from modeld.server.engine import Engine
from modeld.server.lifecycle import Lifecycle
from modeld.server.memory import MemoryManager
from modeld.server.metrics import Metrics
from modeld.server.reflection import reflection_pool
from modeld.server.repository import ModelRepository
from modeld.server.store import ModelStore
from modeld.server.requests import ModelState
from modeld.server.services.generation import GenerationService
from modeld.server.services.inference import InferenceService
from modeld.server.services.node import NodeService
from modeld.server.services.parsing import ParsingServer
from modeld.server.tls import ServerTls, TlsFiles, add_port, reload_credentials
from modeld.server.os_memory import own_rss

log = structlog.get_logger("modeld.daemon")

# room above max_concurrent_rpcs for the calls it does not count (health
# checks, reflection): gRPC's own cap, the backstop, counts every call
PROBE_HEADROOM = 256

_HEALTH_BY_STATE = {ModelState.READY: health_pb2.HealthCheckResponse.SERVING}


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.metrics = Metrics()
        self._inline_dir = tempfile.TemporaryDirectory(prefix="modeld-inline-")
        self.registry = BackendRegistry()
        store = ModelStore(settings.store_settings(), self.metrics.registry)
        # torch.compile's caches under the store's cache folder, before any load or worker
        # start (workers inherit the environment); the operator's own settings are kept
        store.place_compile_caches()
        self.engine = Engine(
            ModelRepository(settings.model_repository, Path(self._inline_dir.name), store),
            self.registry, MemoryManager(settings.memory_budget), self.metrics, settings.lazy_load,
            settings.health_policy(), max_streams=settings.max_streams,
        )
        self.engine.use_workers(settings.worker_policy())
        self.engine.use_load_policy(settings.load_policy())
        # what every front (gRPC and HTTP) asks of the engine
        self.plane = DataPlane(self.engine, self.lifecycle,
                               max_request_bytes=settings.max_request_bytes or settings.max_message_bytes,
                               limits=settings.request_limits())
        self.health = DrainingHealthServicer()
        self.engine.add_listener(self._on_model_state)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.http_port = 0  # the bound port; 0 while HTTP is off
        self.metrics_port = 0
        self._http = None
        self._http_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self.tls = (ServerTls(TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca))
                    if settings.tls_cert is not None else None)
        self.auth = None
        if settings.auth_token_file is not None:
            from modeld.server.auth import Authenticator

            self.auth = Authenticator(settings.auth_token_file, registry=self.metrics.registry)

    def _on_model_state(self, name: str, state: ModelState) -> None:
        status = _HEALTH_BY_STATE.get(state, health_pb2.HealthCheckResponse.NOT_SERVING)
        asyncio.get_running_loop().create_task(self.health.set(name, status))

    async def start(self) -> int:
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        if s.max_streams_per_connection:
            options.append(("grpc.max_concurrent_streams", s.max_streams_per_connection))
        interceptors = []
        if self.auth is not None:
            from modeld.server.auth import AuthInterceptor

            interceptors.append(AuthInterceptor(self.auth))  # first: a refused call takes no slot
        backstop = None
        if s.max_concurrent_rpcs:
            from modeld.server.services.limits import ConcurrencyInterceptor

            interceptors.append(ConcurrencyInterceptor(s.max_concurrent_rpcs))
            # gRPC's own cap counts probes too and names no setting: only past ours, for calls it never lets in
            backstop = s.max_concurrent_rpcs + PROBE_HEADROOM
        self.server = grpc.aio.server(options=options, interceptors=interceptors or None,
                                      maximum_concurrent_rpcs=backstop)
        # every handler registered through it parses its own request: bytes
        # that are no valid message are INVALID_ARGUMENT, not grpc's UNKNOWN
        parsing = ParsingServer(self.server, lambda: self.plane.count_failure("", ErrorKind.INVALID_ARGUMENT))
        inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(self.plane), parsing)
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(self.plane), parsing)
        self.node_service = NodeService(self.plane)
        node_pb2_grpc.add_NodeServicer_to_server(self.node_service, parsing)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, parsing)
        reflection.enable_server_reflection(
            [inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
             generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
             node_pb2.DESCRIPTOR.services_by_name["Node"].full_name,
             health.SERVICE_NAME, reflection.SERVICE_NAME],
            parsing, pool=reflection_pool())
        self.port = add_port(self.server, f"{s.host}:{s.grpc_port}", self.tls)
        if self.port == 0:
            raise OSError(f"cannot listen on {s.host}:{s.grpc_port}")
        await self.server.start()
        await self._start_http()
        self.node_service.http_port = self.http_port  # NodeStats tells gateways where its HTTP front is
        self._start_metrics()
        for name in self.engine.repository.names():
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.engine.count_daemon_memory()  # before any model: the budget holds for the whole process
        loop = asyncio.get_running_loop()
        self.metrics.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
        log.info("daemon_started", host=s.host, grpc_port=self.port, http_port=self.http_port,
                 metrics_port=self.metrics_port,
                 tls="mutual" if self.tls is not None and self.tls.mutual else "on" if self.tls is not None else "off",
                 auth=f"{len(self.auth.table)} tokens" if self.auth is not None else "off",
                 memory_budget=format_size(s.memory_budget), memory_budget_bytes=s.memory_budget,
                 daemon_rss_bytes=own_rss(), daemon_bytes=self.engine.memory.daemon_bytes,  # README, "Worker processes"
                 backends={e.name: (e.availability.reason or "available") for e in self.registry.entries()})
        self._warn_if_exposed()
        if s.preload:
            await self._preload()
        return self.port

    def _warn_if_exposed(self) -> None:
        """load_settings refuses a non-loopback host without tokens unless
        insecure is set; said loudly in the log whenever it is so."""
        from modeld.server.limits import is_loopback

        s = self.settings
        if is_loopback(s.host):
            return
        if self.auth is None:
            log.warning("serving_without_tokens", host=s.host,
                        reason="insecure is set: anyone who reaches these ports may run, load and unload models; "
                               "set auth_token_file (`modeld token` makes one)")
        if self.tls is None:
            log.warning("serving_without_tls", host=s.host,
                        reason="tokens and requests cross the network in plain text; set tls_cert and tls_key")

    async def _start_http(self) -> None:
        """KServe v2 REST and the OpenAI API on uvicorn, in this event loop:
        one process, one engine, so one copy of every model."""
        s = self.settings
        if s.http_port < 0:
            return
        import uvicorn

        from modeld.server.http.app import build_app

        sock = listen(s.host, s.http_port)
        config = uvicorn.Config(
            # bodies up to gRPC's message cap; inference bodies also their
            # model's request size cap (http/common.py, read_body)
            build_app(self.plane, s.max_message_bytes, authenticator=self.auth,
                      max_concurrency=s.http_max_concurrency),
            log_config=None, lifespan="off", access_log=False, server_header=False,
            # the backstop (probes and idle keep-alive connections count): past it
            # uvicorn answers 503 before the app runs, while ours names its limit
            limit_concurrency=s.http_max_concurrency + PROBE_HEADROOM if s.http_max_concurrency else None,
            timeout_graceful_shutdown=s.shutdown_grace_s,
            # longer than clients and balancers keep idle connections (aiohttp
            # 15 s, cloud balancers 60 s): a server that closes first races
            # their next request on the same connection, which then fails
            timeout_keep_alive=75,
        )
        if self.tls is not None:
            # set after load(): uvicorn builds its own context from file names,
            # which could not switch certificates on SIGHUP
            config.load()
            config.ssl = self.tls.http_context()
        self._http = embedded_server(config)
        self.http_port = sock.getsockname()[1]
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # startup failed: raise why
                raise OSError(f"the HTTP server on {s.host}:{self.http_port} stopped during start-up")
            await asyncio.sleep(0.01)

    async def _stop_http(self) -> None:
        """Close the port and idle keep-alive connections, let requests in
        flight finish within the grace period (uvicorn cancels the rest)."""
        if self._http_task is None:
            return
        self._http.should_exit = True
        try:
            await self._http_task
        except (Exception, SystemExit):  # noqa: BLE001 - the daemon exits either way; say why
            log.exception("http_stop_failed")

    def _start_metrics(self) -> None:
        if self.settings.metrics_port < 0:
            return
        server, _thread = start_http_server(self.settings.metrics_port, addr=self.settings.host,
                                            registry=self.metrics.registry)
        self.metrics_port = server.server_port
        self._metrics_server = server

    async def _preload(self) -> None:
        for name in self.engine.repository.names():
            try:
                # a versioned entry: every version its policy serves, not only version 1
                for key in self.engine.dispatch.version_keys(name):
                    await self.engine.load(key)
            except ModeldError as exc:
                log.warning("preload_skipped", model=name, reason=str(exc))

    async def stop(self) -> None:
        """Health NOT_SERVING first, refuse new calls, let calls in flight finish."""
        if self.lifecycle.is_draining:
            await self._stopped.wait()
            return
        self.lifecycle.is_draining = True
        log.info("daemon_draining", grace_s=self.settings.shutdown_grace_s)
        await self.health.enter_graceful_shutdown()
        await asyncio.sleep(self.settings.drain_delay_s)
        stopping = [self._stop_http()]
        if self.server is not None:
            stopping.append(self.server.stop(self.settings.shutdown_grace_s))
        await asyncio.gather(*stopping)
        await self.engine.stop()
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()
        self._inline_dir.cleanup()
        log.info("daemon_stopped")
        self._stopped.set()

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
