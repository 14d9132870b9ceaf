"""One HTTP call forwarded to a node: its attempts, the one retry an
UNAVAILABLE earns before anything reached the client, hedged copies of
unary inference calls, event streams relayed as they come, and fan-outs.

Placement and each attempt's bookkeeping are the router's (router.py), the
same for HTTP as for gRPC: an attempt is a NodeVisit, so breakers, health
scores, latency samples and the frozen-node cancel all see it. A node's HTTP
status is recorded as the gRPC code of the same meaning (the daemon's own
table, server/http/common.py, read backwards).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.hedge import race
from modeld.server.gateway.http.client import NodePool, NodeResponse
from modeld.server.gateway.http.options import HttpCallOptions
from modeld.server.gateway.http.pools import NodePools
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet, Node
from modeld.server.gateway.router import Router

log = structlog.get_logger("modeld.gateway")

_S = grpc.StatusCode
CODE_BY_STATUS = {400: _S.INVALID_ARGUMENT, 401: _S.UNAUTHENTICATED, 403: _S.PERMISSION_DENIED, 404: _S.NOT_FOUND,
                  409: _S.ALREADY_EXISTS, 413: _S.RESOURCE_EXHAUSTED, 429: _S.RESOURCE_EXHAUSTED, 499: _S.CANCELLED,
                  500: _S.INTERNAL, 501: _S.UNIMPLEMENTED, 502: _S.UNAVAILABLE, 503: _S.UNAVAILABLE,
                  504: _S.DEADLINE_EXCEEDED}
STATUS_BY_CODE = {_S.INVALID_ARGUMENT: 400, _S.FAILED_PRECONDITION: 400, _S.OUT_OF_RANGE: 400,
                  _S.UNAUTHENTICATED: 401, _S.PERMISSION_DENIED: 403, _S.NOT_FOUND: 404, _S.ALREADY_EXISTS: 409,
                  _S.RESOURCE_EXHAUSTED: 429, _S.CANCELLED: 499, _S.UNIMPLEMENTED: 501, _S.UNAVAILABLE: 503,
                  _S.DEADLINE_EXCEEDED: 504}
# hop-by-hop headers, and those the gateway's own server sets for its answer
_RESPONSE_DROPPED = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date",
                               b"server", b"x-request-id", b"trailer", b"upgrade"})


def code_of(status: int) -> grpc.StatusCode:
    if status < 400:
        return _S.OK
    return CODE_BY_STATUS.get(status, _S.INTERNAL if status >= 500 else _S.FAILED_PRECONDITION)


@dataclass(frozen=True)
class Call:
    """What goes to a node: the route's name (for metrics), the HTTP
    method, path and query, the body as the client sent it, its options,
    the model it is placed by, and its prompt for prefix affinity."""

    name: str
    method: str
    path: str
    body: bytes
    opts: HttpCallOptions
    model: str = ""
    key: str = ""

    @property
    def router_method(self) -> str:
        return f"/http:{self.name}"  # the retries metric labels by the part after the last "/"


@dataclass(frozen=True)
class Answer:
    """A whole answer: a node's, or the gateway's own."""

    status: int
    headers: list
    body: bytes


class ClientLeft(BaseException):
    """The client's connection closed under a send. A BaseException, as a
    cancel is: the attempt's visit then gives the node no verdict."""


async def to_client(send, message: dict) -> None:
    try:
        await send(message)
    except Exception as exc:  # noqa: BLE001 - uvicorn's ClientDisconnected, a reset socket
        raise ClientLeft() from exc


class NodeAnswered(CallFailed):
    """A node's 503: UNAVAILABLE, so a Route may retry it elsewhere; when it
    may not, the client gets the node's own answer."""

    def __init__(self, answer: Answer, node: Node) -> None:
        super().__init__(_S.UNAVAILABLE, f"node {node.name} answered {answer.status}")
        self.answer = answer


@dataclass
class Stream:
    """An event stream a node began: its first bytes are read, the rest
    are read by `relay`. The visit stays open until the stream ends."""

    node: Node
    visit: object
    response: NodeResponse
    first: bytes
    route: object = None  # the Route, finished when the stream ends (its KV blocks stop counting as active)


def _response_headers(response: NodeResponse) -> list:
    return [(k, v) for k, v in response.headers if k not in _RESPONSE_DROPPED]


def _is_event_stream(response: NodeResponse) -> bool:
    return response.status == 200 and response.header(b"content-type").startswith(b"text/event-stream")


class Forwarder:
    def __init__(self, fleet: Fleet, router: Router, settings: GatewaySettings, metrics: GatewayMetrics,
                 pools: NodePools) -> None:
        self.fleet, self.router, self.settings, self.metrics, self.pools = fleet, router, settings, metrics, pools

    # -- one attempt -----------------------------------------------------------

    def _client(self, node: Node, admitted: bool) -> NodePool:
        try:
            return self.pools.client(node)
        except CallFailed:
            if admitted:
                node.breaker.release()  # placed, never sent: no verdict on the node
            raise

    async def _send(self, client: NodePool, call: Call) -> NodeResponse:
        return await client.request(call.method, call.path, call.opts.headers, call.body)

    async def attempt(self, node: Node, call: Call, *, sample: bool = True, admitted: bool = True) -> Answer:
        """One unary attempt on `node`: its whole answer, read raw (bytes as
        the node sent them, its Content-Encoding kept). NodeAnswered for a 503."""
        client = self._client(node, admitted)
        with self.router.visit(node, "call", model=call.model if sample else "", admitted=admitted) as visit:
            response = await self._send(client, call)
            try:
                body = await response.read()
            finally:
                response.close()
            visit.code = code_of(response.status)
        answer = Answer(response.status, _response_headers(response), body)
        if response.status == 503:
            raise NodeAnswered(answer, node)
        return answer

    async def open_stream(self, node: Node, call: Call) -> Answer | Stream:
        """A call that may answer with an event stream: its whole answer
        when it does not; its first bytes when it does. Until they came it
        may fail over (the client has seen nothing)."""
        client = self._client(node, True)
        visit = self.router.visit(node, "stream")
        visit.__enter__()
        response = None
        try:
            response = await self._send(client, call)
            if not _is_event_stream(response):
                try:
                    body = await response.read()
                finally:
                    response.close()
                visit.code = code_of(response.status)
                open_visit, visit = visit, None
                open_visit.__exit__(None, None, None)
                answer = Answer(response.status, _response_headers(response), body)
                if response.status == 503:
                    raise NodeAnswered(answer, node)
                return answer
            first = await response.next_chunk()
            visit.answered()
            return Stream(node, visit, response, first)
        except BaseException as exc:
            if visit is None:
                raise
            if response is not None:
                response.close()
            if not visit.__exit__(type(exc), exc, exc.__traceback__):
                raise

    # -- routed calls ------------------------------------------------------------

    async def unary(self, call: Call, hedge: bool = False) -> Answer:
        """The call on the node routing picks, hedged when asked; once more
        elsewhere after an UNAVAILABLE (nothing has reached the client yet)."""
        route = self.router.route(call.router_method, call.model, call.opts, call.key)
        try:
            try:
                if hedge:
                    return await self._hedged(route.node, call)
                return await self.attempt(route.node, call)
            except CallFailed as exc:
                return await self.attempt(route.retry(exc), call)
        except NodeAnswered as exc:
            return exc.answer

    async def _hedged(self, primary: Node, call: Call) -> Answer:
        """After the model's p95 on the primary, a copy to another replica
        (router.hedge_target: calm fleet, closed breakers, within budget)."""
        self.router.hedge_budget.on_request()
        p95 = self.router.latency.quantile((primary.name, call.model), 0.95)
        if p95 is None:
            return await self.attempt(primary, call)
        fired: list[Node] = []

        def second():
            node = self.router.hedge_target(call.model, primary)
            if node is None or not self.router.hedge_budget.try_take() or not node.breaker.allow():
                return None
            fired.append(node)
            self.metrics.hedges_fired.labels(call.model).inc()
            self.metrics.picks.labels(node.address, "hedge").inc()
            log.info("hedge", model=call.model, node=node.name, primary=primary.name, after_s=round(p95, 4),
                     request_id=call.opts.request_id, protocol="http")
            return self.attempt(node, call)

        answer, won = await race(self.attempt(primary, call), second,
                                 max(p95, self.settings.hedge_min_delay_s))
        if won:
            self.metrics.hedges_won.labels(call.model).inc()
        return answer

    async def stream(self, call: Call, kv=None) -> Answer | Stream:
        """A generation: its answer or its begun stream, on the node routing
        picks (by `kv`, the prompt's KV blocks, when known), once more
        elsewhere when it failed before its first byte."""
        route = self.router.route(call.router_method, call.model, call.opts, call.key, kv)
        result = None
        try:
            try:
                result = await self.open_stream(route.node, call)
            except CallFailed as exc:
                result = await self.open_stream(route.retry(exc), call)
        except NodeAnswered as exc:
            result = exc.answer
        finally:
            if isinstance(result, Stream):
                result.route = route
            else:
                route.finish()
        return result

    async def relay(self, stream: Stream, send, on_events: Callable[[bytes], None] | None = None) -> None:
        """The stream's bytes to the client as they come, cut only at event
        boundaries (a blank line), so that if the node dies mid-stream the
        client never holds half an event: it gets an error event in
        OpenAI's shape instead, and the end of the stream. `on_events` sees
        each run of whole events before the client does (a tenant's meter)."""
        visit, response = stream.visit, stream.response
        tail = b""
        try:
            try:
                chunk = stream.first
                while chunk:
                    data = tail + chunk if tail else chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut >= 2:
                        if on_events is not None:
                            on_events(data[:cut])
                        await to_client(send, {"type": "http.response.body", "body": data[:cut], "more_body": True})
                        tail = data[cut:]
                    else:
                        tail = data
                    chunk = await response.next_chunk()
            except BaseException as exc:
                if not visit.__exit__(type(exc), exc, exc.__traceback__):
                    raise
            else:
                visit.__exit__(None, None, None)
        except CallFailed as failure:
            log.warning("stream_broken", node=stream.node.name, reason=failure.details, protocol="http")
            await to_client(send, {"type": "http.response.body", "body": error_event(failure), "more_body": True})
            tail = b""
        finally:
            response.close()
            if stream.route is not None:
                stream.route.finish()
        await to_client(send, {"type": "http.response.body", "body": tail})

    # -- fan-outs ----------------------------------------------------------------

    async def fan_out(self, nodes: list[Node], call: Call) -> list[Answer | CallFailed]:
        """The call on every node at once, each answer (a 503 included) or
        transport failure in the nodes' order; none took a breaker's admission."""
        async def one(node: Node) -> Answer | CallFailed:
            try:
                return await self.attempt(node, call, sample=False, admitted=False)
            except NodeAnswered as exc:
                return exc.answer
            except CallFailed as exc:
                return exc
        return list(await asyncio.gather(*(one(n) for n in nodes)))


def error_event(failure: CallFailed) -> bytes:
    """A stream's end in OpenAI's error shape, which the openai SDK raises."""
    import json

    body = {"error": {"message": f"the stream broke off: {failure.details}; the answer is incomplete, retry",
                      "type": "server_error", "param": None, "code": failure.code.name.lower()}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
