"""ModelStreamInfer: many KServe requests on one bidirectional stream.

Requests on one stream run concurrently; each gets its own answers. A
failed request becomes an error_message on the stream, which stays open,
as tritonclient expects; the message starts with the status the same
failure gets from ModelInfer, and is counted the same way. So does a
message that is no valid ModelInferRequest (the stream reads its messages
as bytes and parses each itself). Language models answer with one response
per token chunk. The stream's request id and the call's deadline cover
every request on it.

The stream is a window, not a queue: at most `stream_infer_window`
requests are in flight, and at most as many answers wait unread (a request
whose answer finds the queue full stays in flight). With the window full
the reader stops taking messages off the stream, so HTTP/2 flow control
holds the client's next ones on its side: a client that never reads holds
two windows' worth of work and answers in the daemon, not one task and an
ever longer queue per message it sends.
"""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator

import structlog

from modeld.backends.errors import ErrorKind, ModeldError
from modeld.backends.generation.params import FinalEvent
from modeld.gen import inference_pb2 as pb
from modeld.server.dataplane import DRAINING_MESSAGE, DataPlane
from modeld.server.request_context import internal_message
from modeld.server.services.convert import request_from_proto, response_to_proto
from modeld.server.services.kserve_text import text_request, text_response
from modeld.server.services.limits import call_timeout_s, sooner, with_call_timeout
from modeld.server.services.parsing import UndecodableRequest, decode_off_loop, parse_request

log = structlog.get_logger("modeld.rpc")


class InferStream:
    """One ModelStreamInfer call: a reader starts a task per request while
    the window has room, and every task puts its answers on one bounded
    queue the call yields from."""

    def __init__(self, plane: DataPlane, context, request_id: str) -> None:
        self.plane, self.context, self.request_id = plane, context, request_id
        self.window = plane.limits.stream_infer_window
        # a task blocked on a full queue keeps its window slot, so unread answers stop the reader too
        self.responses: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(maxsize=self.window)
        self.slots = asyncio.Semaphore(self.window)
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None  # what ended the client's messages early

    async def answers(self, request_iterator) -> AsyncIterator[pb.ModelStreamInferResponse]:
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator))
        try:
            while (item := await self.responses.get()) is not None:
                yield item
            if self.failure is not None:
                # raised here, in the call's own task: a refusal the reader met
                # (a tenant's context.abort on a message) ends the call with its
                # status instead of leaving the call waiting for answers
                raise self.failure
        finally:
            reader.cancel()
            for task in list(self.tasks):
                task.cancel()

    async def _read(self, request_iterator) -> None:
        try:
            await self._read_messages(request_iterator)
        except Exception as exc:  # the client's stream failed or a message was refused: the call ends with it
            self.failure = exc
            await self.responses.put(None)

    async def _read_messages(self, request_iterator) -> None:
        messages = request_iterator.__aiter__()
        while True:
            await self.slots.acquire()  # before reading: a full window leaves the next message unread
            try:
                data = await messages.__anext__()
            except StopAsyncIteration:
                self.slots.release()
                break
            msg = await self._parsed(data)
            if msg is None:
                self.slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run_one(msg, len(data)))
            self.tasks.add(task)
            task.add_done_callback(self._finished)
        while self.tasks:
            await asyncio.gather(*list(self.tasks))
        await self.responses.put(None)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.slots.release()

    async def _parsed(self, data: bytes) -> pb.ModelInferRequest | None:
        """The message, or None once its failure is on the stream."""
        try:
            msg = await decode_off_loop(functools.partial(parse_request, pb.ModelInferRequest.FromString), data,
                                        len(data))
        except UndecodableRequest as exc:
            log.info("stream_request_failed", status=exc.kind.value, reason=str(exc))
            await self._fail(pb.ModelInferRequest(), exc.kind, str(exc))
            return None
        if self.plane.is_draining:
            await self._fail(msg, ErrorKind.UNAVAILABLE, DRAINING_MESSAGE)
            return None
        return msg

    async def _run_one(self, msg: pb.ModelInferRequest, nbytes: int) -> None:
        structlog.contextvars.bind_contextvars(request_id=self.request_id, client_request_id=msg.id)
        try:
            await self._answer(msg, nbytes)
        except ModeldError as exc:
            log.info("stream_request_failed", model=msg.model_name, status=exc.kind.value, reason=str(exc))
            await self._fail(msg, exc.kind, str(exc))
        except Exception:  # a bug: keep the stream and the daemon alive
            log.exception("stream_request_bug", model=msg.model_name)
            await self._fail(msg, ErrorKind.INTERNAL, internal_message(self.request_id))

    async def _answer(self, msg: pb.ModelInferRequest, nbytes: int) -> None:
        timeout_s = call_timeout_s(self.context)
        self.plane.check_request_size(msg.model_name, nbytes)
        if await self.plane.is_language_model(msg.model_name, msg.model_version):
            await self._stream_text(msg, timeout_s)
            return
        request = await decode_off_loop(request_from_proto, msg, nbytes)
        result = await self.plane.infer(with_call_timeout(request, timeout_s))
        if wants_empty_final(msg):
            await self._put(flagged(response_to_proto(result), False))
            await self._put(flagged(pb.ModelInferResponse(model_name=msg.model_name, id=msg.id), True))
            return
        # A tensor model answers each request once: that answer is the last.
        await self._put(flagged(response_to_proto(result), True))

    async def _stream_text(self, msg: pb.ModelInferRequest, call_timeout: float | None) -> None:
        """One response per token chunk; the last carries triton_final_response.

        Each chunk is held back one event so the last text chunk can carry
        the final flag; with triton_enable_empty_final_response the chunks
        all go out as they come and an empty response closes the request.
        """
        empty_final = wants_empty_final(msg)
        pending = None
        generation, timeout_s = text_request(msg, self.request_id)
        version = self.plane.served_version(msg.model_name, msg.model_version)
        async for event in self.plane.generate(generation, sooner(timeout_s, call_timeout)):
            if isinstance(event, FinalEvent):
                if empty_final or pending is None:
                    await self._put(flagged(text_response(msg, None, event, version=version), True))
                else:
                    await self._put(flagged(text_response(msg, pending.text, event, [pending], version), True))
                return
            if empty_final:
                await self._put(flagged(text_response(msg, event.text, tokens=[event], version=version), False))
                continue
            if pending is not None:
                await self._put(flagged(text_response(msg, pending.text, tokens=[pending], version=version), False))
            pending = event

    async def _put(self, response: pb.ModelInferResponse) -> None:
        await self.responses.put(pb.ModelStreamInferResponse(infer_response=response))

    async def _fail(self, msg: pb.ModelInferRequest, kind: ErrorKind, message: str) -> None:
        self.plane.count_failure(msg.model_name, kind)
        await self.responses.put(pb.ModelStreamInferResponse(
            error_message=f"{kind.value}: {message}",
            infer_response=pb.ModelInferResponse(model_name=msg.model_name, id=msg.id)))


def wants_empty_final(request: pb.ModelInferRequest) -> bool:
    flag = "triton_enable_empty_final_response"
    return flag in request.parameters and request.parameters[flag].bool_param


def flagged(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response
