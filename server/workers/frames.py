"""Length-prefixed pickle frames over a stream socket.

A frame is `<u32 pickle length><u32 buffer count>`, one `<u64 length>` per
out-of-band buffer, the pickle, then the buffers. Pickle protocol 5 hands
numpy arrays' data out of band, so a tensor is written from its own memory
(no copy into the pickle, one writev for the frame) and, on arrival, sliced
once out of the receive buffer into the bytearray the array is built on.
Both ends are modeld's own processes, so pickle is safe here: the
socket is a private socketpair, never a listening address.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Callable

HEADER = struct.Struct("<II")
BUFFER_LENGTH = struct.Struct("<Q")
# a frame larger than this is a bug or a corrupted stream, not a request:
# gRPC's own limit (max_message_bytes) is below 2 GiB
MAX_PICKLE_BYTES = 1 << 31


class FrameError(Exception):
    """The peer sent bytes that are not a frame: the channel is unusable."""


def encode(message: object) -> list[bytes | memoryview]:
    """The frame's parts, ready for `writelines` (buffers are not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    head = HEADER.pack(len(body), len(views)) + b"".join(BUFFER_LENGTH.pack(v.nbytes) for v in views)
    return [head, body, *views]


def encode_bytes(message: object) -> bytes:
    return b"".join(bytes(part) for part in encode(message))


def decode_bytes(data: bytes) -> tuple[object, int]:
    """(message, bytes used) from the front of `data`; for tests and tools."""
    body_len, num_buffers = HEADER.unpack_from(data, 0)
    offset = HEADER.size
    lengths = [BUFFER_LENGTH.unpack_from(data, offset + i * BUFFER_LENGTH.size)[0] for i in range(num_buffers)]
    offset += BUFFER_LENGTH.size * num_buffers
    body = data[offset:offset + body_len]
    offset += body_len
    buffers = []
    for n in lengths:
        buffers.append(bytearray(data[offset:offset + n]))
        offset += n
    if offset > len(data):
        raise FrameError("truncated frame")
    return pickle.loads(body, buffers=buffers), offset


class FrameProtocol(asyncio.Protocol):
    """Both ends of the channel: parses frames as bytes arrive and hands each
    message to `on_message` at once, on the event loop's own callback (no
    task to wake: a reply settles its caller's future in the same turn)."""

    def __init__(self, on_message: Callable[[object], None], on_lost: Callable[[BaseException | None], None]) -> None:
        self._on_message, self._on_lost = on_message, on_lost
        self._buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self._pending: list[bytes | memoryview] = []
        self._scheduled = False
        self.closed = False
        self.lost = asyncio.get_running_loop().create_future()

    # -- reading ---------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= HEADER.size:
            body_len, num_buffers = HEADER.unpack_from(buf, 0)
            if body_len > MAX_PICKLE_BYTES or num_buffers > 1 << 16:
                self._fail(FrameError(f"frame header claims {body_len} bytes and {num_buffers} buffers"))
                return
            offset = HEADER.size + BUFFER_LENGTH.size * num_buffers
            if len(buf) < offset:
                return
            lengths = [BUFFER_LENGTH.unpack_from(buf, HEADER.size + i * BUFFER_LENGTH.size)[0]
                       for i in range(num_buffers)]
            end = offset + body_len + sum(lengths)
            if len(buf) < end:
                return
            body = bytes(buf[offset:offset + body_len])
            offset += body_len
            buffers = []
            for n in lengths:
                # its own bytearray: arrays built on it are writable, as a backend's outputs are
                buffers.append(buf[offset:offset + n])
                offset += n
            del buf[:end]
            try:
                message = pickle.loads(body, buffers=buffers)
            except Exception as exc:  # noqa: BLE001 - the stream is corrupt: nothing after it can be trusted
                self._fail(FrameError(f"undecodable frame: {type(exc).__name__}: {exc}"))
                return
            self._on_message(message)

    def _fail(self, exc: BaseException) -> None:
        self.closed = True
        self.transport.abort()  # connection_lost follows, with no error; report this one
        self._on_lost(exc)
        self._on_lost = lambda _exc: None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        self._on_lost(exc)

    # -- writing ---------------------------------------------------------------------

    def send(self, message: object) -> None:
        """Queue a frame; the frames of one event-loop turn go out in one write.

        A generation step yields a token event per stream and an observer
        report: coalescing them saves a system call (and a wake-up of the
        reader) per frame."""
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        self._pending.extend(encode(message))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def send_now(self, message: object) -> None:
        """Write at once (a lone request on the latency path: no extra turn)."""
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        self._pending.extend(encode(message))
        self.flush()

    def flush(self) -> None:
        self._scheduled = False
        if not self._pending or self.closed:
            self._pending = []
            return
        parts, self._pending = self._pending, []
        self.transport.writelines(parts)

    async def close(self) -> None:
        """Send what is queued, then close; returns once the socket is closed."""
        self.flush()
        self.closed = True
        self.transport.close()
        await self.lost


async def connect(protocol: FrameProtocol, sock) -> FrameProtocol:
    """Run `protocol` on a connected Unix socket (one end of a socketpair).

    The protocol is built first so its owner holds it before the first
    message can arrive."""
    await asyncio.get_running_loop().create_unix_connection(lambda: protocol, sock=sock)
    return protocol
