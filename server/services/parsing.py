"""Every RPC parses its own request, so undecodable bytes are INVALID_ARGUMENT.

grpc.aio deserializes a request before the servicer runs and answers
UNKNOWN ("Unexpected <class 'DecodeError'>") when that fails: to a client
that reads as a server fault, and it is not counted or logged as a client's
mistake. `ParsingServer` stands in for the grpc.aio server while the
generated `add_*_to_server` functions (and health, reflection) register
their handlers: each handler is registered with no request deserializer,
so the servicer's wrapper receives the bytes and parses them with the
message's own FromString, answering INVALID_ARGUMENT with a reason on a
DecodeError. The bytes' size is kept for the call (`request_nbytes()`),
which is what the per-model request size cap reads, at no extra cost.

A streaming-request RPC parses each message as it is read. A servicer
method marked `@raw_request_stream` gets the bytes instead and parses them
itself (ModelStreamInfer does, to answer a bad message with an error on
the stream and keep reading, as it does for any failed request on it);
for any other one a bad message ends the call with INVALID_ARGUMENT.

A large message is parsed, and a large request's tensors decoded
(`decode_off_loop`), in a worker thread: splitting a BYTES tensor runs a
Python loop per element, and on the event loop it would stall every other
call, health probes included, for as long as that takes. The thread still
takes the GIL in turns (sys.getswitchinterval, 5 ms), so the loop answers
between them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from typing import Any, Callable

import grpc
import structlog
from google.protobuf.message import DecodeError

from modeld.backends.errors import ErrorKind, InvalidArgument
from modeld.server.request_context import REQUEST_ID_HEADER
from modeld.server.services.status import begin_grpc_call

log = structlog.get_logger("modeld.rpc")

_request_nbytes: contextvars.ContextVar[int] = contextvars.ContextVar("request_nbytes", default=0)

RAW_STREAM_ATTR = "_modeld_raw_request_stream"

# Below this a message parses (and its tensors decode) in well under a
# millisecond, less than a thread hand-off costs.
OFF_LOOP_BYTES = 256 * 1024


def request_nbytes() -> int:
    """The serialized size of this call's request (unary requests), 0 if unknown."""
    return _request_nbytes.get()


def raw_request_stream(method):
    """Mark a streaming-request servicer method that parses each message itself."""
    setattr(method, RAW_STREAM_ATTR, True)
    return method


class UndecodableRequest(InvalidArgument):
    pass


def parse_request(deserializer: Callable[[bytes], Any], data: bytes) -> Any:
    """deserializer(data), a DecodeError turned into INVALID_ARGUMENT naming the message type."""
    if data is None:  # a unary call whose client closed before sending its message
        raise UndecodableRequest(f"the call carried no {_type_name(deserializer)}")
    try:
        return deserializer(data)
    except DecodeError as exc:
        raise UndecodableRequest(f"request is not a valid {_type_name(deserializer)}: {exc}") from None


async def decode_off_loop(decode: Callable[[Any], Any], value: Any, nbytes: int) -> Any:
    """decode(value), in a worker thread when the message is `nbytes` >= OFF_LOOP_BYTES."""
    if nbytes < OFF_LOOP_BYTES:
        return decode(value)
    return await asyncio.to_thread(decode, value)


def _type_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)  # Message.FromString is a classmethod
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return descriptor.full_name if descriptor is not None else "request message"


OnInvalid = Callable[[], None]


class ParsingServer(grpc.aio.Server):
    """Registers the handlers it is given on `server`, parsing requests in the call.

    A grpc.aio.Server itself, so registration helpers that check for an
    asyncio server (reflection's) pick their asyncio servicer.
    """

    def __init__(self, server: grpc.aio.Server, on_invalid: OnInvalid | None = None) -> None:
        self._server = server
        self._on_invalid = on_invalid or (lambda: None)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service_name, {name: self._wrap(h) for name, h in method_handlers.items()})

    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GenericParsing(h, self._wrap) for h in generic_rpc_handlers))

    def _wrap(self, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        if handler is None or handler.request_deserializer is None:
            return handler
        deserializer, on_invalid = handler.request_deserializer, self._on_invalid
        if not handler.request_streaming:
            behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary
            if inspect.isasyncgenfunction(behaviour):
                wrapped = _unary_stream(behaviour, deserializer, on_invalid)
            elif inspect.iscoroutinefunction(behaviour):
                wrapped = _unary_unary(behaviour, deserializer, on_invalid)
            else:
                return handler  # a synchronous servicer: grpc parses as before
            field = "unary_stream" if handler.response_streaming else "unary_unary"
            return handler._replace(request_deserializer=None, **{field: wrapped})
        behaviour = handler.stream_stream if handler.response_streaming else handler.stream_unary
        if getattr(behaviour, RAW_STREAM_ATTR, False):
            return handler._replace(request_deserializer=None)
        if inspect.isasyncgenfunction(behaviour):
            wrapped = _stream_stream(behaviour, deserializer, on_invalid)
        elif inspect.iscoroutinefunction(behaviour):
            wrapped = _stream_unary(behaviour, deserializer, on_invalid)
        else:
            return handler
        field = "stream_stream" if handler.response_streaming else "stream_unary"
        return handler._replace(request_deserializer=None, **{field: wrapped})

    # the rest is the real server's
    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials) -> int:
        return self._server.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace) -> None:
        await self._server.stop(grace)

    async def wait_for_termination(self, timeout=None) -> bool:
        return await self._server.wait_for_termination(timeout)


class _GenericParsing(grpc.GenericRpcHandler):
    """A generic handler whose method handlers parse in the call; wrapped once per method."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap) -> None:
        self._inner, self._wrap, self._cache = inner, wrap, {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        wrapped = self._cache.get(method)
        if wrapped is None:
            wrapped = self._wrap(self._inner.service(handler_call_details))
            if wrapped is not None:  # only served methods: clients choose the names of the rest
                self._cache[method] = wrapped
        return wrapped


async def _refuse(context, exc: UndecodableRequest, on_invalid: OnInvalid) -> None:
    # the call never reached a servicer: give it an id and a count here
    request_id = begin_grpc_call(context)
    log.info("rpc_failed", status=ErrorKind.INVALID_ARGUMENT.value, reason=str(exc))
    on_invalid()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                        trailing_metadata=((REQUEST_ID_HEADER, request_id),))


async def _parse_or_refuse(data: bytes, context, deserializer, on_invalid: OnInvalid):
    """The request in `data`, or the call aborted with INVALID_ARGUMENT."""
    nbytes = len(data) if data is not None else 0
    try:
        request = await decode_off_loop(functools.partial(parse_request, deserializer), data, nbytes)
    except UndecodableRequest as exc:
        await _refuse(context, exc, on_invalid)
    _request_nbytes.set(nbytes)
    return request


def _unary_unary(behaviour, deserializer, on_invalid):
    @functools.wraps(behaviour)
    async def handler(data, context):
        return await behaviour(await _parse_or_refuse(data, context, deserializer, on_invalid), context)
    return handler


def _unary_stream(behaviour, deserializer, on_invalid):
    @functools.wraps(behaviour)
    async def handler(data, context):
        async for response in behaviour(await _parse_or_refuse(data, context, deserializer, on_invalid), context):
            yield response
    return handler


async def _parsed(raw_iterator, deserializer):
    async for data in raw_iterator:
        yield parse_request(deserializer, data)


def _stream_unary(behaviour, deserializer, on_invalid):
    @functools.wraps(behaviour)
    async def handler(raw_iterator, context):
        try:
            return await behaviour(_parsed(raw_iterator, deserializer), context)
        except UndecodableRequest as exc:
            await _refuse(context, exc, on_invalid)
    return handler


def _stream_stream(behaviour, deserializer, on_invalid):
    @functools.wraps(behaviour)
    async def handler(raw_iterator, context):
        try:
            async for response in behaviour(_parsed(raw_iterator, deserializer), context):
                yield response
        except UndecodableRequest as exc:
            await _refuse(context, exc, on_invalid)
    return handler
