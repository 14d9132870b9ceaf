"""Where the daemons are: a fixed list, or a DNS name re-resolved on a timer
(a Kubernetes headless Service answers with one address per ready pod)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import structlog

log = structlog.get_logger("modeld.gateway")


async def resolve(name_port: str) -> set[str] | None:
    """Every address NAME resolves to, as HOST:PORT; None when the lookup
    fails (a Service with no ready pods has no records, which is a normal
    state: the gateway answers UNAVAILABLE until pods come)."""
    host, _, port = name_port.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        log.warning("dns_resolve_failed", name=host, reason=str(exc))
        return None
    found = set()
    for family, _, _, _, address in infos:
        ip = address[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return found


async def watch_dns(name_port: str, interval_s: float, apply: Callable[[set[str]], None]) -> None:
    previous: set[str] | None = None
    while True:
        found = await resolve(name_port)
        if found is None:
            # a failed lookup keeps the nodes we know: a DNS blip must not
            # empty the ring; the health watches still see real departures
            found = previous if previous is not None else set()
        if found != previous:
            log.info("dns_nodes", name=name_port, nodes=sorted(found))
            apply(found)
            previous = found
        await asyncio.sleep(interval_s)
