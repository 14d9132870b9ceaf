"""The gateway's HTTP surface: the daemon's OpenAI (/v1) and KServe v2 REST
(/v2) routes, each forwarded to a node over HTTP (forward.py).

A route reads only what placement needs: the model from the path, or from
the body's top-level `model` (body.py; for a generation its prompt too, for
prefix affinity). The body goes on as the client sent it. Requests get an
id (the client's `x-request-id` when usable), echoed on every answer and
sent to the node; tokens are checked by the daemon's own HTTP middleware
(server/auth.py) and judged again by the node, which gets the client's
`authorization`. Errors the gateway answers itself come in the route's
shape: OpenAI's `{"error": {"message", "type", "param", "code"}}` under
/v1, KServe's `{"error": message}` under /v2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import structlog
from starlette.routing import Route, Router

from modeld.server.http_listen import embedded_server, listen
from modeld.server import tenants
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.http.body import (
    BodyError, BodyTooLarge, ClientGone, Fields, chat_turns, inflate, model_of, prompt_key, prompt_text, read_body,
    routing_fields, with_model,
)
from modeld.server.gateway.http.forward import (
    STATUS_BY_CODE, Answer, Call, ClientLeft, Forwarder, Stream, code_of, to_client,
)
from modeld.server.gateway.http.options import HeaderError, HttpCallOptions
from modeld.server.gateway.http.pools import NodePools
from modeld.server.gateway.split import target_model, target_parts
from modeld.server.gateway.http.usage import StreamTokens, charge_answer
from modeld.server.request_context import REQUEST_ID_HEADER, begin_call, current_request_id, internal_message

log = structlog.get_logger("modeld.gateway")

_JSON = [(b"content-type", b"application/json")]
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
_STATE_RANK = {"READY": 3, "LOADING": 2, "UNLOADING": 1}
_MODEL = frozenset({"model"})
_GENERATION = frozenset({"model", "messages", "prompt"})


def _is_openai(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def error_answer(path: str, status: int, message: str, code: str = "", param: str | None = None) -> Answer:
    """The gateway's own refusal, in the route's error shape."""
    if _is_openai(path):
        body = {"error": {"message": message, "type": _TYPE_BY_STATUS.get(status, "server_error"),
                          "param": param, "code": code or code_of(status).name.lower()}}
    else:
        body = {"error": message}
    return Answer(status, list(_JSON), json.dumps(body).encode())


def failure_answer(path: str, failure: CallFailed) -> Answer:
    return error_answer(path, STATUS_BY_CODE.get(failure.code, 500), failure.details, failure.code.name.lower())


def _method(scope) -> str:
    """HEAD goes on as GET: an answer to HEAD has a length but no body, which
    the node pool's parser cannot tell from a body still to come; uvicorn
    sends the client the head only."""
    return "GET" if scope["method"] == "HEAD" else scope["method"]


def _target(scope) -> str:
    """The path and query the node gets: the client's own bytes."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (path + b"?" + query if query else path).decode("latin-1")


class RequestIds:
    """Pure ASGI, outermost: each request's id bound for the logs and echoed
    on every answer, the token check's refusals included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = (REQUEST_ID_HEADER.encode(), begin_call(scope.get("headers"), "http").encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _Exchange:
    """One request's answer as it goes out, and whether its client left."""

    __slots__ = ("send", "started", "finished", "gone")

    def __init__(self, send) -> None:
        self.send = send
        self.started = self.finished = self.gone = False

    async def start(self, status: int, headers: list) -> None:
        self.started = True
        await to_client(self.send, {"type": "http.response.start", "status": status, "headers": headers})

    async def answer(self, answer: Answer) -> None:
        await self.start(answer.status, [*answer.headers, (b"content-length", str(len(answer.body)).encode())])
        self.finished = True  # before the send: the disconnect watch wakes on the answer's end
        await to_client(self.send, {"type": "http.response.body", "body": answer.body})

    async def body(self, message: dict) -> None:
        if not message.get("more_body", False):
            self.finished = True
        await self.send(message)


class _Endpoint:
    """A route's handler as an ASGI app (Starlette hands it the scope)."""

    __slots__ = ("front", "name", "handler", "reads_body", "metered")

    def __init__(self, front: HttpFront, name: str, handler, reads_body: bool = False, metered: bool = False) -> None:
        self.front, self.name, self.handler, self.reads_body, self.metered = front, name, handler, reads_body, metered

    async def __call__(self, scope, receive, send) -> None:
        await self.front.serve(self, scope, receive, send)


class HttpFront:
    """The HTTP app and its server, over the gateway's fleet and router."""

    def __init__(self, fleet, router, settings, metrics, authenticator=None, tls=None) -> None:
        self.fleet, self.router, self.settings, self.metrics = fleet, router, settings, metrics
        self.tls = tls
        self.pools = NodePools(fleet, settings)
        self.forwarder = Forwarder(fleet, router, settings, metrics, self.pools)
        app = Router(routes=self._routes(), default=self._not_found, redirect_slashes=False)
        if authenticator is not None:
            from modeld.server.auth import HttpAuthMiddleware

            app = HttpAuthMiddleware(app, authenticator=authenticator, max_body_bytes=settings.http_max_body_bytes)
        self.app = RequestIds(app)
        self.port = 0
        self._server = None
        self._task: asyncio.Task | None = None

    # -- the table -------------------------------------------------------------

    def _routes(self) -> list[Route]:
        e = _Endpoint
        model = "/v2/models/{name}"
        versioned = "/v2/models/{name}/versions/{version}"
        infer = e(self, "ModelInfer", self._by_path(hedgeable=True, split=True), True)
        stats = e(self, "ModelStatistics", self._by_path())
        ready = e(self, "ModelReady", self._model_ready)
        metadata = e(self, "ModelMetadata", self._by_path())
        return [
            Route("/v1/chat/completions", e(self, "ChatCompletions", self._generation, True, True), methods=["POST"]),
            Route("/v1/completions", e(self, "Completions", self._generation, True, True), methods=["POST"]),
            Route("/v1/embeddings", e(self, "Embeddings", self._by_body(hedgeable=True), True), methods=["POST"]),
            Route("/v1/rerank", e(self, "Rerank", self._by_body(hedgeable=True), True), methods=["POST"]),
            Route("/v1/models", e(self, "Models", self._list_models), methods=["GET"]),
            Route("/v1/models/{name:path}", e(self, "Model", self._by_path()), methods=["GET"]),
            Route("/tokenize", e(self, "HttpTokenize", self._by_body(), True), methods=["POST"]),
            Route("/detokenize", e(self, "HttpDetokenize", self._by_body(), True), methods=["POST"]),
            Route("/v2/health/live", e(self, "ServerLive", self._live), methods=["GET"]),
            Route("/v2/health/ready", e(self, "ServerReady", self._ready), methods=["GET"]),
            Route("/v2", e(self, "ServerMetadata", self._any), methods=["GET"]),
            Route("/v2/models/stats", e(self, "ModelStatistics", self._any), methods=["GET"]),
            Route(model + "/stats", stats, methods=["GET"]),
            Route(versioned + "/stats", stats, methods=["GET"]),
            Route(model + "/ready", ready, methods=["GET"]),
            Route(versioned + "/ready", ready, methods=["GET"]),
            Route(model + "/infer", infer, methods=["POST"]),
            Route(versioned + "/infer", infer, methods=["POST"]),
            Route(model, metadata, methods=["GET"]),
            Route(versioned, metadata, methods=["GET"]),
            Route("/v2/repository/index", e(self, "RepositoryIndex", self._repository_index, True), methods=["POST"]),
            Route("/v2/repository/models/{name}/load", e(self, "RepositoryModelLoad", self._to_replicas, True),
                  methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", e(self, "RepositoryModelUnload", self._to_replicas, True),
                  methods=["POST"]),
            # the node answers an endpoint it lacks in its own words
            Route("/v2/{path:path}", e(self, "KServe", self._any, True), methods=["GET", "POST", "PUT", "DELETE"]),
        ]

    async def _not_found(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        answer = error_answer(path, 404, f"no endpoint {scope.get('method')} {path} on this gateway; it serves the "
                                         "OpenAI API under /v1 and KServe v2 under /v2")
        await _Exchange(send).answer(answer)

    # -- one request -------------------------------------------------------------

    async def serve(self, endpoint: _Endpoint, scope, receive, send) -> None:
        started = time.perf_counter()
        path, status, exchange = scope["path"], 499, _Exchange(send)
        task = asyncio.current_task()
        watch = None
        tenant = tenants.current() if endpoint.metered else None
        metered = False
        try:
            try:
                opts = HttpCallOptions(scope["headers"], current_request_id())
                body = b""
                if endpoint.reads_body:
                    body = await read_body(receive, _header(scope, b"content-length"),
                                           self.settings.http_max_body_bytes)
                watch = asyncio.ensure_future(self._watch(receive, task, exchange))
                if tenant is not None and tenant.limited:
                    tenant.start_stream()
                    metered = True
                result = await endpoint.handler(scope, body, opts)
            except CallFailed as failure:
                result = failure_answer(path, failure)
            except BodyError as exc:
                result = error_answer(path, 400, str(exc), param="model" if "model" in str(exc) else None)
            except HeaderError as exc:
                result = error_answer(path, 400, str(exc))
            except BodyTooLarge as exc:
                limit = self.settings.http_max_body_bytes
                result = error_answer(path, 413, f"request body of {exc.args[0]} bytes or more is larger than the "
                                                 f"gateway's http_max_body_bytes ({limit} bytes); send less per "
                                                 "request", "request_too_large")
            except PermissionError as exc:
                result = error_answer(path, 403, str(exc))
            except tenants.QuotaExceeded as exc:
                result = error_answer(path, 429, exc.message)
            if isinstance(result, Stream):
                status = 200
                await exchange.start(200, [(k, v) for k, v in result.response.headers
                                           if k in (b"content-type", b"cache-control", b"x-accel-buffering")])
                meter = StreamTokens(tenant.charge_tokens) if metered else None
                await self.forwarder.relay(result, exchange.body, meter.feed if meter is not None else None)
            else:
                status = result.status
                if metered and status == 200:
                    charge_answer(result.body, tenant.charge_tokens)
                await exchange.answer(result)
        except (ClientGone, ClientLeft):
            status = 499
        except asyncio.CancelledError:
            if not exchange.gone:
                raise
            task.uncancel()  # ours: the client left, and every call on its behalf is cancelled
            status = 499
        except Exception:
            log.exception("gateway_http_failed", path=path)
            status = 500
            if not exchange.started:
                with contextlib.suppress(ClientLeft):
                    await exchange.answer(error_answer(path, 500, internal_message()))
        finally:
            if watch is not None:
                watch.cancel()
            if metered:
                tenant.end_stream()
            name = f"http:{endpoint.name}"
            self.metrics.calls.labels(name, code_of(status).name).inc()
            self.metrics.latency.labels(name).observe(time.perf_counter() - started)

    async def _watch(self, receive, task: asyncio.Task, exchange: _Exchange) -> None:
        """A client that disconnects cancels its request at once: every call
        made for it (the node's stream, a hedge) is cancelled with it."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not exchange.finished:
            exchange.gone = True
            task.cancel()

    # -- routing reads -------------------------------------------------------------

    async def _fields(self, body: bytes, opts: HttpCallOptions, wanted: frozenset[str]) -> Fields:
        s = self.settings
        if opts.encoding not in ("", "identity"):
            body = inflate(body, opts.encoding, s.http_max_body_bytes)
        if len(body) > s.parse_in_thread_bytes:  # a large body is walked off the event loop
            return await asyncio.to_thread(routing_fields, body, wanted, s.max_request_fields)
        return routing_fields(body, wanted, s.max_request_fields)

    def _split(self, model: str, opts: HttpCallOptions) -> str:
        target = self.settings.splits.choose(model, opts.session) if self.settings.splits else model
        if target != model:
            self.metrics.split_calls.labels(model, target).inc()
        return target

    def _retargeted(self, body: bytes, fields: Fields, opts: HttpCallOptions, model: str) -> tuple[bytes, str]:
        """A split model's call sent to its target, the body's model
        overridden by appending one (body.with_model)."""
        # OpenAI's routes name no version: a `name:version` target goes to its model
        target = target_model(self._split(model, opts))
        if target == model:
            return body, model
        if opts.encoding not in ("", "identity"):
            body = inflate(body, opts.encoding, self.settings.http_max_body_bytes)
            opts.headers = [(k, v) for k, v in opts.headers if k != b"content-encoding"]
            opts.encoding = "identity"
        return with_model(body, fields.num_keys, target), target

    # -- handlers ------------------------------------------------------------------

    async def _generation(self, scope, body: bytes, opts: HttpCallOptions) -> Answer | Stream:
        fields = await self._fields(body, opts, _GENERATION)
        model = model_of(fields)
        body, model = self._retargeted(body, fields, opts, model)
        call = Call(self._name(scope), "POST", _target(scope), body, opts, model, prompt_key(fields))
        # the prompt's KV blocks as the nodes hash them, where some node publishes the model's cache
        turns = chat_turns(fields)
        kv = await self.router.kv_blocks_for(model, messages=turns) if turns is not None else \
            await self.router.kv_blocks_for(model, prompt=prompt_text(fields)) if prompt_text(fields) else None
        return await self.forwarder.stream(call, kv)

    def _by_body(self, hedgeable: bool = False):
        async def handler(scope, body: bytes, opts: HttpCallOptions) -> Answer:
            fields = await self._fields(body, opts, _MODEL)
            model = model_of(fields)
            body, model = self._retargeted(body, fields, opts, model)
            call = Call(self._name(scope), _method(scope), _target(scope), body, opts, model)
            return await self.forwarder.unary(call, self._hedges(hedgeable, model, opts))
        return handler

    def _by_path(self, hedgeable: bool = False, split: bool = False):
        async def handler(scope, body: bytes, opts: HttpCallOptions) -> Answer:
            model = scope["path_params"]["name"]
            target = _target(scope)
            if split and (chosen := self._split(model, opts)) != model:
                from urllib.parse import quote

                name, version = target_parts(chosen)
                prefix = "/v2/models/"
                rest = target[len(prefix):].split("/", 1)
                tail = rest[1] if len(rest) > 1 else ""
                if version and not tail.startswith("versions/"):  # the client's own version wins
                    tail = f"versions/{version}/{tail}"
                target = prefix + quote(name, safe="") + ("/" + tail if tail else "")
                model = name
            call = Call(self._name(scope), _method(scope), target, body, opts, model)
            return await self.forwarder.unary(call, self._hedges(hedgeable, model, opts))
        return handler

    async def _any(self, scope, body: bytes, opts: HttpCallOptions) -> Answer:
        """A call about no model: any node that can take it."""
        return await self.forwarder.unary(Call(self._name(scope), _method(scope), _target(scope), body, opts))

    def _hedges(self, hedgeable: bool, model: str, opts: HttpCallOptions) -> bool:
        return hedgeable and not opts.update and (opts.urgent or model in self.settings.hedge_models)

    @staticmethod
    def _name(scope) -> str:
        return scope["endpoint"].name if "endpoint" in scope else scope["path"]

    async def _live(self, scope, body: bytes, opts) -> Answer:
        return Answer(200, list(_JSON), b'{"live":true}')

    async def _ready(self, scope, body: bytes, opts) -> Answer:
        ready = bool(self.fleet.routable())
        return Answer(200 if ready else 503, list(_JSON), json.dumps({"ready": ready}).encode())

    async def _list_models(self, scope, body: bytes, opts: HttpCallOptions) -> Answer:
        """Every node's models merged: one row per id, ready where any is."""
        nodes = self.fleet.routable()
        if not nodes:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, self.router.why_unavailable(""))
        answers = await self.forwarder.fan_out(nodes, Call("Models", "GET", _target(scope), b"", opts))
        rows: dict[str, dict] = {}
        for answer in answers:
            for row in _json_rows(answer, "data"):
                best = rows.get(row.get("id"))
                if best is None or row.get("ready") and not best.get("ready"):
                    rows[row.get("id")] = row
        if not rows:
            return _first_telling(answers, scope["path"])
        listing = {"object": "list", "data": [rows[k] for k in sorted(rows, key=str)]}
        return Answer(200, list(_JSON), json.dumps(listing).encode())

    async def _repository_index(self, scope, body: bytes, opts: HttpCallOptions) -> Answer:
        nodes = self.fleet.routable()
        if not nodes:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, self.router.why_unavailable(""))
        answers = await self.forwarder.fan_out(nodes, Call("RepositoryIndex", "POST", _target(scope), body, opts))
        rows: dict[str, dict] = {}
        for answer in answers:
            for row in _json_rows(answer, None):
                best = rows.get(row.get("name"))
                if best is None or _STATE_RANK.get(row.get("state"), 0) > _STATE_RANK.get(best.get("state"), 0):
                    rows[row.get("name")] = row
        if not rows and not any(isinstance(a, Answer) and a.status == 200 for a in answers):
            return _first_telling(answers, scope["path"])
        return Answer(200, list(_JSON), json.dumps([rows[k] for k in sorted(rows, key=str)]).encode())

    def _replicas(self, model: str, usable: bool = False) -> list:
        by_name = self.fleet.by_name
        names = self.fleet.replicas(model, self.settings.replicas)
        return [by_name[n] for n in names if (by_name[n].usable if usable else by_name[n].routable)]

    async def _model_ready(self, scope, body: bytes, opts: HttpCallOptions) -> Answer:
        """Ready when any home of the model that can take calls has it ready."""
        model = scope["path_params"]["name"]
        targets = self._replicas(model)
        if not targets:
            node, _ = self.router.place(model, update=opts.update)  # a spill target, or UNAVAILABLE
            node.breaker.release()  # placed only to find a target: the fan-out gives no verdict
            targets = [node]
        answers = await self.forwarder.fan_out(targets, Call("ModelReady", "GET", _target(scope), b"", opts, model))
        for answer in answers:
            if isinstance(answer, Answer) and answer.status == 200:
                return answer
        return _first_telling(answers, scope["path"])

    async def _to_replicas(self, scope, body: bytes, opts: HttpCallOptions) -> Answer:
        """Loads and unloads go to every replica the ring gives the model."""
        model = scope["path_params"]["name"]
        targets = self._replicas(model, usable=True)
        if not targets:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, self.router.why_unavailable(model))
        call = Call(self._name(scope), "POST", _target(scope), body, opts, model)
        answers = await self.forwarder.fan_out(targets, call)
        for node, answer in zip(targets, answers):
            if not isinstance(answer, Answer) or answer.status >= 300:
                log.warning("replica_failed", method=call.name, model=model, node=node.name, request_id=opts.request_id,
                            reason=answer.details if isinstance(answer, CallFailed) else answer.status)
        for answer in answers:
            if isinstance(answer, Answer) and answer.status < 300:
                return answer
        return _first_telling(answers, scope["path"])

    # -- the server ----------------------------------------------------------------

    async def start(self, host: str, port: int, grace_s: float) -> int:
        import uvicorn

        sock = listen(host, port)
        config = uvicorn.Config(self.app, log_config=None, lifespan="off", access_log=False, server_header=False,
                                timeout_graceful_shutdown=grace_s, timeout_keep_alive=75)
        if self.tls is not None:
            # set after load(): uvicorn would build its own context from file
            # names, which could not switch certificates on SIGHUP (server/tls.py)
            config.load()
            config.ssl = self.tls.http_context()
        self._server = embedded_server(config)
        self.port = sock.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the gateway's HTTP server on {host}:{self.port} stopped during start-up")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Close the port; requests in flight finish within the grace period."""
        if self._task is not None:
            self._server.should_exit = True
            try:
                await self._task
            except (Exception, SystemExit):  # noqa: BLE001 - the gateway stops either way; say why
                log.exception("gateway_http_stop_failed")
        await self.pools.close()


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return None


def _json_rows(answer, key: str | None) -> list[dict]:
    """The rows of a node's JSON list answer (under `key`, or the whole
    body); none from a failure or an answer that is not one."""
    if not isinstance(answer, Answer) or answer.status != 200:
        return []
    try:
        value = json.loads(answer.body)
    except ValueError:
        return []
    rows = value.get(key) if key is not None and isinstance(value, dict) else value
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


def _first_telling(answers: list, path: str) -> Answer:
    """Of answers that all failed, the one that tells the client most: a
    node's own answer (bad input, unknown model) over transport trouble."""
    for answer in answers:
        if isinstance(answer, Answer) and answer.status != 503:
            return answer
    for answer in answers:
        if isinstance(answer, Answer):
            return answer
    return failure_answer(path, answers[0])


