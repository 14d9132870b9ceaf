"""SIGTERM: health flips to NOT_SERVING first, new calls get UNAVAILABLE,
calls in flight finish, and the process exits 0."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon import start_daemon
from modeld.clients import Client
from polling import wait_until

LONG_TEXT = " ".join(["a long sentence keeps the model busy for a while"] * 30)


def test_graceful_shutdown_with_calls_in_flight():
    daemon = start_daemon("--no-preload", env={"MODELD_DRAIN_DELAY_S": "1.0", "MODELD_SHUTDOWN_GRACE_S": "30"})
    with Client(daemon.address, timeout=60) as client, grpc.insecure_channel(daemon.address) as channel:
        client.load("minilm")
        follower, statuses, ended = _follow_health(channel)
        entered = _calls_entered(client)
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(client.embed, [LONG_TEXT] * 4) for _ in range(8)]
            # every call reached the engine: none can be refused as too late
            wait_until(lambda: _calls_entered(client) >= entered + 8, what="the eight calls in flight")
            daemon.proc.send_signal(15)
            # inside the drain delay: health is NOT_SERVING (the port stays open
            # for a while, and once it closes a new call is UNAVAILABLE too)
            wait_until(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in statuses, what="the drain to begin")
            try:
                client.embed(["too late"])
                refused = None
            except grpc.RpcError as exc:
                refused = exc.code()
            results = [f.result(timeout=120) for f in futures]
    assert all(r.shape == (4, 384) for r in results)
    np.testing.assert_allclose(np.linalg.norm(results[-1], axis=1), 1.0, rtol=1e-5)
    assert refused == grpc.StatusCode.UNAVAILABLE
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    assert statuses.index(health_pb2.HealthCheckResponse.SERVING) < statuses.index(health_pb2.HealthCheckResponse.NOT_SERVING)
    assert daemon.proc.wait(60) == 0
    follower.join(30)
    # the daemon ended the watch (OK) once it had said NOT_SERVING, so the
    # watcher does not hold the shutdown for the grace period
    assert ended == ["ok"]
    assert daemon.events("daemon_draining") and daemon.events("daemon_stopped")


def _calls_entered(client: Client, model: str = "minilm") -> int:
    """Calls that have reached `model` in the engine, however they ended."""
    return next(m.request_count for m in client.node_stats().models if m.name == model)


def test_a_health_watcher_does_not_hold_the_drain_for_the_grace_period():
    """A gateway keeps a health Watch open on every node. grpc's own servicer
    never ends one, so server.stop(grace) waited out the whole grace for it:
    here the grace is 600 s and the daemon, with no call in flight, must exit
    long before, the watch told NOT_SERVING and then ended OK."""
    daemon = start_daemon("--no-preload", env={"MODELD_DRAIN_DELAY_S": "0.5", "MODELD_SHUTDOWN_GRACE_S": "600"})
    with grpc.insecure_channel(daemon.address) as channel:
        follower, statuses, ended = _follow_health(channel)
        wait_until(lambda: health_pb2.HealthCheckResponse.SERVING in statuses, what="the watch to report SERVING")
        daemon.proc.send_signal(15)
        # far below the grace: only a watch that ends lets the daemon exit this soon
        assert daemon.proc.wait(120) == 0
        follower.join(30)
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert ended == ["ok"]


def _follow_health(channel) -> tuple[threading.Thread, list[int], list[object]]:
    """A health Watch on "" read on a thread: the statuses it reports, and
    how it ended ("ok" when the daemon ended it, else the status code)."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=600)
    statuses: list[int] = []
    ended: list[object] = []

    def follow():
        try:
            for message in watch:
                statuses.append(message.status)
            ended.append("ok")
        except grpc.RpcError as exc:
            ended.append(exc.code())

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    return follower, statuses, ended
