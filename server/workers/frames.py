"""Length-prefixed pickle frames over a stream socket.

A frame is `<u32 pickle length><u32 buffer count>`, one `<u64 length>` per
out-of-band buffer, the pickle, then the buffers. A dict of arrays in a
message (a batch's inputs or outputs) travels as dtype, shape and raw memory:
written from the arrays' own memory (no copy into the pickle, one write for
the frame) and, on arrival, sliced once out of the receive buffer into the
bytearray the array is built on; numpy's own pickling (protocol 5, used for
any other array) spends ~10 us a frame on its dtype alone.
Both ends are modeld's own processes, so pickle is safe here: the
socket is a private socketpair, never a listening address.

The daemon's end is an asyncio protocol (`FrameProtocol`); the worker's end
is `ThreadChannel`, whose reader thread answers tensor batches itself.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import Callable, Iterator

import numpy as np

from modeld.backends.generation.params import TokenEvent

HEADER = struct.Struct("<II")
BUFFER_LENGTH = struct.Struct("<Q")
# a frame larger than this is a bug or a corrupted stream, not a request:
# gRPC's own limit (max_message_bytes) is below 2 GiB
MAX_PICKLE_BYTES = 1 << 31


class FrameError(Exception):
    """The peer sent bytes that are not a frame: the channel is unusable."""


# numbers, bool, fixed-width strings (their memory is a buffer), and objects;
# datetimes, records and the rest take numpy's own pickling
_PLAIN_KINDS = frozenset("biufcSUO")


def _plain_tensors(value: object) -> bool:
    """A dict of plain ndarrays (a batch's inputs or outputs): sent as dtype,
    shape and raw bytes, without numpy's own pickling, whose dtype round trip
    costs ~10 us a frame on each side."""
    if type(value) is not dict or not value:
        return False
    for array in value.values():
        if type(array) is not np.ndarray or array.dtype.kind not in _PLAIN_KINDS:
            return False
    return True


def _describe(tensors: dict, views: list) -> tuple:
    """(name, dtype, shape, items) per array: the memory of a non-object
    array goes in `views` (out of band, items None); an object array's
    items (BYTES: bytes objects) go in the pickle."""
    specs = []
    for name, array in tensors.items():
        if array.dtype.hasobject:
            specs.append((name, "O", array.shape, array.ravel().tolist()))
            continue
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        views.append(pickle.PickleBuffer(array).raw())
        specs.append((name, array.dtype.str, array.shape, None))
    return tuple(specs)


def _rebuild(specs: tuple, buffers: Iterator) -> dict:
    tensors = {}
    for name, dtype, shape, items in specs:
        if items is None:
            tensors[name] = np.frombuffer(next(buffers), dtype=dtype).reshape(shape)
        else:
            array = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):  # one by one: an item that is a sequence stays one item
                array[i] = item
            tensors[name] = array.reshape(shape)
    return tensors


def encode(message: object) -> list[bytes | memoryview]:
    """The frame's parts, ready for `writelines` (buffers are not copied).

    The pickle holds `(message, tensors)`: `tensors` is None, or names the
    fields of a tuple message that were dicts of arrays, taken out and
    described (see `_describe`); their memory follows pickle's own buffers."""
    tensors = None
    views: list = []
    if type(message) is tuple:
        for index, value in enumerate(message):
            if _plain_tensors(value):
                if tensors is None:
                    tensors, message = [], list(message)
                tensors.append((index, _describe(value, views)))
                message[index] = None
        if tensors is not None:
            message = tuple(message)
    own: list[pickle.PickleBuffer] = []
    body = pickle.dumps((message, tensors), protocol=5, buffer_callback=own.append)
    if own:  # arrays elsewhere in the message: numpy's own out-of-band pickling
        views = [b.raw() for b in own] + views
    head = HEADER.pack(len(body), len(views)) + b"".join([BUFFER_LENGTH.pack(v.nbytes) for v in views])
    return [head, body, *views]


def _loads(body, buffers: list) -> object:
    """The message of a frame, from its pickle and buffers (see `encode`)."""
    rest = iter(buffers)
    message, tensors = pickle.loads(body, buffers=rest)
    if tensors is None:
        return message
    message = list(message)
    for index, specs in tensors:
        message[index] = _rebuild(specs, rest)
    return tuple(message)


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
    return _loads(body, buffers), offset


# A token event without logprobs, the message of nearly every frame a
# generation sends: ("token", rid, token_ids, text) instead of ("event",
# rid, TokenEvent). A dataclass instance pickles by its class's name and
# its __dict__ (its class looked up again on every load): 5.4 us to load
# a step's frame against 0.9 us for plain tuples here, and 4.2 against 1.1
# to dump. The reader makes the TokenEvent again (token_event).
TOKEN = "token"


def token_message(rid: int, event) -> tuple:
    """The channel message of one of a generation's events."""
    if type(event) is TokenEvent and not event.logprobs and not event.top_logprobs:
        return (TOKEN, rid, event.token_ids, event.text)
    return ("event", rid, event)


def token_event(message: tuple) -> TokenEvent:
    """The TokenEvent a TOKEN message carries."""
    return TokenEvent(message[2], message[3])


_INCOMPLETE = object()
# A frame holding several messages: ("batch", (message, ...)), sent by a
# ThreadChannel flush that has more than one queued (a generation step's
# token events for every stream and its observer reports). One pickle and
# one frame header for the step instead of one per message; a reader hands
# the messages on one by one, so nothing above the channel sees batches.
BATCH = "batch"


def _unbatched(message: object):
    if type(message) is tuple and len(message) == 2 and message[0] == BATCH:
        return message[1]
    return (message,)


def next_frame(buf: bytearray) -> object:
    """Take the first whole frame off `buf` and return its message, or
    _INCOMPLETE if `buf` does not hold one yet; FrameError if it is not a frame."""
    if len(buf) < HEADER.size:
        return _INCOMPLETE
    body_len, num_buffers = HEADER.unpack_from(buf, 0)
    if body_len > MAX_PICKLE_BYTES or num_buffers > 1 << 16:
        raise FrameError(f"frame header claims {body_len} bytes and {num_buffers} buffers")
    offset = HEADER.size + BUFFER_LENGTH.size * num_buffers
    if len(buf) < offset:
        return _INCOMPLETE
    lengths = [BUFFER_LENGTH.unpack_from(buf, HEADER.size + i * BUFFER_LENGTH.size)[0] for i in range(num_buffers)]
    end = offset + body_len + sum(lengths)
    if len(buf) < end:
        return _INCOMPLETE
    body = bytes(buf[offset:offset + body_len])
    offset += body_len
    buffers = []
    for n in lengths:
        # its own bytearray: arrays built on it are writable, as a backend's outputs are
        buffers.append(buf[offset:offset + n])
        offset += n
    del buf[:end]
    try:
        return _loads(body, buffers)
    except Exception as exc:  # noqa: BLE001 - the stream is corrupt: nothing after it can be trusted
        raise FrameError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc


def _take_pending(channel) -> list:
    """What a channel's flush writes: what was queued since the last one
    (frame parts, or a ThreadChannel's messages), or nothing once the
    channel closed (they are dropped)."""
    channel._scheduled = False
    parts, channel._pending = channel._pending, []
    return [] if channel.closed else parts


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
        while True:
            try:
                message = next_frame(buf)
            except FrameError as exc:
                self._fail(exc)
                return
            if message is _INCOMPLETE:
                return
            for one in _unbatched(message):
                self._on_message(one)

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
        parts = _take_pending(self)
        if parts:
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


class ThreadChannel:
    """The worker's end of the channel: a thread blocks in recv and answers
    what `inline` takes (a tensor batch) on that thread, with no event-loop
    wake-up on either side of it (measured: ~30 us less a round trip than
    an asyncio reader); every other message goes to `on_message` on the loop.

    Writes from both threads go out whole under one lock, with a blocking
    sendall: the daemon reads its end all the time, so a write waits at most
    for it to catch up. `send` (loop thread) coalesces one turn's frames."""

    def __init__(self, sock, loop: asyncio.AbstractEventLoop, inline: Callable[[object], bool],
                 on_message: Callable[[object], None], on_lost: Callable[[BaseException | None], None]) -> None:
        sock.setblocking(True)
        self._sock, self._loop = sock, loop
        self._inline, self._on_message, self._on_lost = inline, on_message, on_lost
        self._write_lock = threading.Lock()
        self._pending: list[bytes | memoryview] = []
        self._scheduled = False
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="modeld-worker-channel", daemon=True)

    def start(self) -> None:
        self._reader.start()

    # -- reading (its own thread) -------------------------------------------------------

    def _read(self) -> None:
        buf = bytearray()
        reason: BaseException | None = None
        try:
            while True:
                data = self._sock.recv(1 << 20)
                if not data:
                    break
                buf += data
                while True:
                    message = next_frame(buf)
                    if message is _INCOMPLETE:
                        break
                    for one in _unbatched(message):
                        if not self._inline(one):
                            self._loop.call_soon_threadsafe(self._on_message, one)
        except FrameError as exc:
            reason = exc
        except OSError as exc:
            reason = None if self.closed else exc
        except Exception as exc:  # noqa: BLE001 - a bug on this thread: report it, as a lost channel
            reason = exc
        self.closed = True
        try:
            self._loop.call_soon_threadsafe(self._on_lost, reason)
        except RuntimeError:
            pass  # the loop is gone: the process is ending

    # -- writing ----------------------------------------------------------------------

    def _write(self, parts: list) -> None:
        data = b"".join(parts)
        try:
            with self._write_lock:
                self._sock.sendall(data)
        except OSError as exc:
            if not self.closed:
                self.closed = True
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # the reader sees it and reports the loss
                except OSError:
                    pass
            raise ConnectionResetError(f"the channel is closed: {exc}") from exc

    def send(self, message: object) -> None:
        """Queue a message (on the loop thread); one turn's messages go out
        as one frame (a batch when there are several) in one write."""
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        self._pending.append(message)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def send_now(self, message: object) -> None:
        """Write at once, from either thread."""
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        self._write(encode(message))

    def flush(self) -> None:
        messages = _take_pending(self)
        if not messages:
            return
        try:
            self._write(encode(messages[0] if len(messages) == 1 else (BATCH, tuple(messages))))
        except ConnectionResetError:
            pass  # the reader reports the loss

    async def close(self) -> None:
        """Send what is queued, then close the socket."""
        self.flush()
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
