"""The HTTP listening socket and an embedded uvicorn, shared by the daemon
and the gateway (each runs uvicorn inside its own event loop)."""

from __future__ import annotations

import contextlib
import socket


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket: a taken port is an OSError the process
    reports, where uvicorn would sys.exit from inside the loop."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen for HTTP on {host}:{port} ({exc.strerror}); choose another "
                                 "--http-port, 0 for a free one, or -1 to turn HTTP off") from None
    return sock


def embedded_server(config):
    """uvicorn in the caller's loop. It must not take SIGTERM/SIGINT:
    signal.signal would replace the loop's handlers, and the process's own
    stop order (health, refuse, finish, exit) must run instead."""
    import uvicorn

    class EmbeddedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

    return EmbeddedServer(config)
