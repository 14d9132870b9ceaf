"""The daemon's side of a worker's generation stream (stand_in._WorkerStream),
against a recording channel: what goes to the worker and when, what the
caller reads, and that every way of leaving cancels the sequence there."""

from __future__ import annotations

import asyncio
import gc
import itertools

import pytest

from modeld.backends.errors import InvalidArgument, Unavailable
from modeld.backends.generation.params import FinalEvent, FinishReason, GenerateRequest, TokenEvent, Usage
from modeld.server.workers.main import error_reply
from modeld.server.workers.stand_in import WorkerProcess
from polling import wait_until_async


class _Channel:
    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.closed = False

    def send(self, message: tuple) -> None:
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        self.sent.append(message)


def _worker() -> WorkerProcess:
    worker = WorkerProcess.__new__(WorkerProcess)  # its stream side alone, no process
    worker._out, worker._ids, worker._streams, worker.death = _Channel(), itertools.count(1), {}, None
    worker._ended_task = None
    return worker


REQUEST = GenerateRequest("m", prompt="hi")
FINAL = FinalEvent(FinishReason.LENGTH, Usage(completion_tokens=2))


def _ops(worker: WorkerProcess) -> list[tuple]:
    return [(m[0], m[1]) for m in worker._out.sent]


async def _reading(worker: WorkerProcess, adapter: str = ""):
    """A new stream and its first read in flight, once the worker was asked."""
    stream = worker.stream(REQUEST, adapter=adapter)
    reading = asyncio.ensure_future(anext(stream))
    await wait_until_async(lambda: worker._streams)
    return stream, reading


async def test_a_whole_stream_sends_nothing_before_its_first_read_and_ends_at_the_final_event():
    worker = _worker()
    stream = worker.stream(REQUEST)
    assert worker._out.sent == [] and worker._streams == {}
    reading = asyncio.ensure_future(anext(stream))
    await wait_until_async(lambda: worker._streams)
    assert worker._out.sent == [("generate", 1, REQUEST)]
    worker._dispatch(("token", 1, (5,), "a"))
    worker._dispatch(("token", 1, (6,), "b"))  # arrives while nobody waits: kept in order
    worker._dispatch(("event", 1, FINAL))
    assert await reading == TokenEvent((5,), "a")
    assert [e async for e in stream] == [TokenEvent((6,), "b"), FINAL]
    assert worker._streams == {} and _ops(worker) == [("generate", 1)]  # finished: nothing cancelled
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_an_adapters_stream_names_the_adapter():
    worker = _worker()
    _, reading = await _reading(worker, adapter="tone")
    assert worker._out.sent == [("generate", 1, REQUEST, "tone")]
    worker._dispatch(("event", 1, FINAL))
    assert await reading == FINAL


async def test_leaving_midway_cancels_the_sequence_in_the_worker_once():
    worker = _worker()
    stream, reading = await _reading(worker)
    worker._dispatch(("token", 1, (5,), "a"))
    assert await reading == TokenEvent((5,), "a")
    await stream.aclose()
    await stream.aclose()
    assert _ops(worker) == [("generate", 1), ("cancel", 1)] and worker._streams == {}
    worker._dispatch(("token", 1, (6,), "b"))  # a late token of the cancelled sequence: dropped
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_a_consumer_cancelled_while_waiting_cancels_the_sequence():
    worker = _worker()
    stream, reading = await _reading(worker)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert _ops(worker) == [("generate", 1), ("cancel", 1)] and worker._streams == {}


async def test_a_stream_dropped_unfinished_is_cancelled_from_the_loop():
    worker = _worker()
    stream, reading = await _reading(worker)
    worker._dispatch(("token", 1, (5,), "a"))
    await reading
    del stream, reading
    gc.collect()
    await wait_until_async(lambda: ("cancel", 1) in _ops(worker))
    assert worker._streams == {}


async def test_a_closed_before_reading_stream_sends_nothing():
    worker = _worker()
    stream = worker.stream(REQUEST)
    await stream.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert worker._out.sent == []


async def test_a_remote_error_and_the_workers_death_end_the_stream_with_their_reason():
    worker = _worker()
    _, reading = await _reading(worker)
    worker._dispatch(error_reply(1, InvalidArgument("the prompt is too long")))  # as the worker sends it
    with pytest.raises(InvalidArgument, match="the prompt is too long"):
        await reading
    assert worker._streams == {} and _ops(worker) == [("generate", 1)]

    _, reading = await _reading(worker)
    death = Unavailable("worker died")
    worker.death = death
    for inbox in worker._streams.values():  # as _ended hands it to every stream
        inbox.put_nowait(death)
    with pytest.raises(Unavailable, match="worker died"):
        await reading
    assert worker._streams == {} and _ops(worker) == [("generate", 1), ("generate", 2)]
