"""Where the daemons are: a fixed list, a DNS name re-resolved on a timer
(a Kubernetes headless Service answers with one address per ready pod), or
a file of addresses re-read on a timer (a mounted ConfigMap, or whatever
else an operator's tooling writes)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from modeld.backends.digits import ascii_digits

log = structlog.get_logger("modeld.gateway")

MAX_FILE_NODES = 4096
MAX_FILE_BYTES = 1024 * 1024


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


async def read_nodes_file(path: Path) -> set[str] | None:
    """The HOST:PORT addresses in `path`, one a line (blank lines and `#`
    comments skipped); None when it cannot be read or says something that
    is not a list of addresses (the nodes known stay, as for a failed DNS
    lookup: a half-written file must not empty the ring)."""
    try:
        text = await asyncio.to_thread(_read_small, path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.warning("nodes_file_unreadable", path=str(path), reason=str(exc))
        return None
    found = set()
    for number, line in enumerate(text.splitlines(), 1):
        address = line.split("#", 1)[0].strip()
        if not address:
            continue
        if not is_address(address):
            log.warning("nodes_file_invalid", path=str(path), line=number, reason=f"{address[:80]!r} is not HOST:PORT")
            return None
        found.add(address)
    if len(found) > MAX_FILE_NODES:
        log.warning("nodes_file_invalid", path=str(path), reason=f"more than {MAX_FILE_NODES} addresses")
        return None
    return found


def _read_small(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


def is_address(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and ascii_digits(port) and 0 < int(port) < 65536)


async def watch_dns(name_port: str, interval_s: float, apply: Callable[[set[str]], None]) -> None:
    await _watch(lambda: resolve(name_port), interval_s, apply, name_port)


async def watch_file(path: Path, interval_s: float, apply: Callable[[set[str]], None]) -> None:
    await _watch(lambda: read_nodes_file(path), interval_s, apply, str(path))


async def _watch(source: Callable[[], Awaitable[set[str] | None]], interval_s: float,
                 apply: Callable[[set[str]], None], name: str) -> None:
    previous: set[str] | None = None
    while True:
        found = await source()
        if found is None:
            # a failed lookup keeps the nodes we know: a DNS blip must not
            # empty the ring; the health watches still see real departures
            found = previous if previous is not None else set()
        if found != previous:
            log.info("discovered_nodes", source=name, nodes=sorted(found))
            apply(found)
            previous = found
        await asyncio.sleep(interval_s)
