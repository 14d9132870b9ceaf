"""HTTP/1.1 toward one node: a keep-alive pool of asyncio connections whose
answers httptools (uvicorn's C parser, already a dependency) reads.

Why not httpx: forwarding one small call through httpx cost 1.4-1.8 ms of
CPU here (h11 in pure Python, anyio and its models; aiohttp 0.6-0.8 ms),
more than the whole hop may add (the goal is 1 ms). This client does the
little a proxy needs: it writes the request bytes, and hands back the status,
the headers and the body as it arrives (chunked framing undone, the bytes
otherwise as the node sent them). A connection whose answer was not read to
its end is aborted, never reused, so the node sees the client leave.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time

import httptools

_MAX_BUFFERED = 1 << 20  # past this much unread body, stop reading the socket until the reader catches up


class NodeConnectionError(ConnectionError):
    """The connection to the node failed or closed before its answer ended."""


class _Connection(asyncio.Protocol):
    """One connection; one request at a time on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.head: asyncio.Future | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.wake: asyncio.Future | None = None
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: BaseException | None = None

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(NodeConnectionError(f"the node's answer is not HTTP/1.1: {exc}"))
            self.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.complete:
            self._fail(NodeConnectionError("the node closed the connection before its answer ended"
                                           + (f" ({exc})" if exc else "")))

    # -- httptools callbacks ---------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = []
            return
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.status < 200:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _MAX_BUFFERED and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.complete = True
        self._wake()

    # -- the exchange ----------------------------------------------------------

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        if self.wake is not None and not self.wake.done():
            self.wake.set_exception(exc)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def send(self, data: bytes) -> asyncio.Future:
        self._reset()
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.head

    async def next_chunk(self) -> bytes:
        """The next piece of the body; b"" at its end."""
        while not self.chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.buffered <= _MAX_BUFFERED // 2 and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        return chunk


class NodeResponse:
    """A node's answer: status and headers now, the body as it comes."""

    __slots__ = ("status", "headers", "_connection", "_pool", "_done")

    def __init__(self, connection: _Connection, pool: NodePool) -> None:
        self.status, self.headers = connection.status, connection.headers
        self._connection, self._pool, self._done = connection, pool, False

    def header(self, name: bytes) -> bytes:
        for key, value in self.headers:
            if key == name:
                return value
        return b""

    async def next_chunk(self) -> bytes:
        chunk = await self._connection.next_chunk()
        if not chunk:
            self.close()
        return chunk

    async def read(self) -> bytes:
        chunks = []
        while chunk := await self.next_chunk():
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        """Back to the pool when the answer was read whole and the node keeps
        the connection; aborted otherwise (the node then stops its work)."""
        if self._done:
            return
        self._done = True
        connection = self._connection
        if connection.complete and connection.keep_alive and not connection.closed:
            self._pool.release(connection)
        else:
            connection.abort()


class NodePool:
    """Keep-alive connections to one node's HTTP address."""

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 max_idle: int = 64, idle_s: float = 30.0, connect_timeout_s: float = 5.0) -> None:
        self.host, self.port, self.tls = host.strip("[]"), port, tls
        self.server_hostname = server_hostname if tls is not None else None
        self.max_idle, self.idle_s, self.connect_timeout_s = max_idle, idle_s, connect_timeout_s
        self._host_header = f"{host}:{port}".encode()
        self._idle: list[_Connection] = []

    def _head(self, method: str, target: str, headers, body: bytes) -> bytes:
        lines = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self._host_header, b"\r\n"]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            lines += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        lines.append(b"\r\n")
        lines.append(body)
        return b"".join(lines)

    async def request(self, method: str, target: str, headers, body: bytes = b"") -> NodeResponse:
        """The node's status and headers; its body through the response.
        A reused connection the node had closed meanwhile (nothing came
        back) is replaced by a new one, once."""
        data = self._head(method, target, headers, body)
        for reused in (True, False):
            connection = self._take() if reused else await self._connect()
            if connection is None:
                continue
            try:
                await connection.send(data)
            except NodeConnectionError:
                connection.abort()
                if reused and not connection.received:
                    continue  # the node closed it while idle: it never read this request
                raise
            except BaseException:
                connection.abort()  # cancelled (the client left): the node must see it go
                raise
            return NodeResponse(connection, self)
        raise AssertionError("unreachable")

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < self.idle_s:
                return connection
            connection.abort()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(loop.create_connection(
                _Connection, self.host, self.port, ssl=self.tls, server_hostname=self.server_hostname),
                self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            raise NodeConnectionError(f"cannot connect to {self.host}:{self.port}: "
                                      f"{exc.strerror if isinstance(exc, OSError) and exc.strerror else exc!r}") \
                from None
        return connection

    def release(self, connection: _Connection) -> None:
        if len(self._idle) >= self.max_idle:
            connection.abort()
            return
        connection.idle_since = time.monotonic()
        self._idle.append(connection)

    def close(self) -> None:
        """Idle connections closed; those in use end with their answers."""
        for connection in self._idle:
            connection.abort()
        self._idle.clear()
