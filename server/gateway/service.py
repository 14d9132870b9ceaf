"""The gateway's gRPC surface: the daemon's own services, forwarded.

Requests travel as the bytes the client sent: a handler reads only what
routing needs (ModelInfer's model name straight off the wire, a Generate
request's prompt for prefix affinity) and passes the rest on, so tensor
payloads are never decoded or re-encoded here. Where a call goes and what
each attempt does to a node's standing is the router's (router.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from modeld.gen import generation_pb2, inference_pb2
from modeld.server import tenants
from modeld.server.gateway import wire
from modeld.server.gateway.call_options import CallOptions
from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet, Node
from modeld.server.gateway.router import Router
from modeld.server.gateway.split import retarget, target_model

log = structlog.get_logger("modeld.gateway")

INFERENCE = "inference.GRPCInferenceService"
GENERATION = "modeld.v1.Generation"
_STATE_RANK = {"READY": 3, "LOADING": 2, "UNLOADING": 1}
_OK = grpc.StatusCode.OK
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def prompt_key(request: generation_pb2.GenerateRequest) -> str:
    """The request's input as one string whose prefixes mirror the model's
    prompt prefixes, for the prefix index. Chat turns are separated by
    control characters no message text holds."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "messages":
        return "".join(f"{m.role}\x1f{m.content}\x1e" for m in request.messages.messages)
    if kind == "token_ids":
        return "".join(f"{i}," for i in request.token_ids.ids)
    return ""


def _continued_key(request: generation_pb2.GenerateRequest, key: str, completion: str) -> str:
    """The key of the conversation's next turn, which repeats this reply."""
    if request.WhichOneof("input") == "messages":
        return f"{key}assistant\x1f{completion}\x1e"
    return key + completion if request.WhichOneof("input") == "prompt" else key


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _aborting(handler: Callable) -> Callable:
    """A unary handler whose CallFailed reaches the client as its status."""
    @functools.wraps(handler)
    async def answered(*args):
        try:
            return await handler(*args)
        except CallFailed as exc:
            await exc.abort(args[-1])
    return answered


def _merge_indexes(replies: list[bytes | CallFailed]) -> list[inference_pb2.RepositoryIndexResponse.ModelIndex]:
    """One row per model over every node's index, with its best state."""
    rows: dict[str, inference_pb2.RepositoryIndexResponse.ModelIndex] = {}
    for reply in replies:
        if isinstance(reply, CallFailed):
            continue
        for row in inference_pb2.RepositoryIndexResponse.FromString(reply).models:
            best = rows.get(row.name)
            if best is None or _STATE_RANK.get(row.state, 0) > _STATE_RANK.get(best.state, 0):
                rows[row.name] = row
    return [rows[name] for name in sorted(rows)]


class GatewayService:
    """Handlers for every forwarded method, as raw-bytes generic handlers."""

    def __init__(self, fleet: Fleet, router: Router, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.fleet, self.router, self.settings, self.metrics = fleet, router, settings, metrics

    # -- plumbing --------------------------------------------------------------

    async def _routing(self, data: bytes, field: int, parameters: int = 0) -> tuple[str, int | None]:
        """The request's routing field (and its KServe `timeout` parameter
        when `parameters` names the map), read off the wire: in a thread for
        a large request, so the event loop never walks one; bounded by
        max_request_fields."""
        s = self.settings
        try:
            if len(data) > s.parse_in_thread_bytes:
                return await asyncio.to_thread(wire.routing_fields, data, field, parameters, s.max_request_fields)
            return wire.routing_fields(data, field, parameters, s.max_request_fields)
        except wire.TooManyFields as exc:
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except wire.WireError as exc:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None

    async def _model(self, data: bytes, field: int) -> str:
        return (await self._routing(data, field))[0]

    def _split(self, data: bytes, field: int, model: str, opts: CallOptions,
               version_field: int = 0) -> tuple[bytes, str]:
        """The request retargeted when its model is split among others
        ([gateway.splits]), and the model it is placed by; as it came
        otherwise. `version_field`: a KServe request's, which a `name:version`
        target sets (split.retarget)."""
        target = self.settings.splits.choose(model, opts.session)
        if target == model:
            return data, model
        self.metrics.split_calls.labels(model, target).inc()
        return retarget(data, field, target, version_field), target_model(target)

    async def _call(self, node: Node, method: str, data: bytes, opts: CallOptions, model: str = "",
                    context=None, admitted: bool = True) -> bytes:
        """One unary call on `node`; `model` and `admitted` as NodeVisit takes them."""
        timeout = opts.timeout
        # the client's own budget, its KServe `timeout` included: a node that
        # answers DEADLINE_EXCEEDED once it is spent did nothing wrong
        budget = _sooner(timeout, opts.kserve_timeout_s)
        with self.router.visit(node, "call", model=model, admitted=admitted, timeout=budget):
            call = node.unary(method)(data, metadata=opts.metadata, timeout=timeout)
            reply = await call
            if context is not None:
                context.set_trailing_metadata(await call.trailing_metadata())
            return reply

    async def _fan_out(self, nodes: list[Node], method: str, data: bytes,
                       opts: CallOptions) -> list[bytes | CallFailed]:
        """The call on every node at once, each reply or failure in the
        nodes' order; none took its breaker's admission."""
        replies = await asyncio.gather(*(self._call(n, method, data, opts, admitted=False) for n in nodes),
                                       return_exceptions=True)
        return [CallFailed.of(r) if isinstance(r, BaseException) else r for r in replies]

    async def _routed_unary(self, method: str, data: bytes, opts: CallOptions, model: str,
                            hedge: bool = False, data_plane: bool = False, context=None) -> bytes:
        # a language model's KServe text call (ModelInfer with text_input)
        # goes where its prompt's blocks are, when some node publishes them
        kv = await self.router.prompt_blocks(model, model_infer=data) \
            if data_plane and model in self.router.kv_models() else None
        route = self.router.route(method, model, opts, kv=kv)
        sample = model if data_plane else ""
        try:
            if hedge:
                return await self._hedged(method, data, opts, model, route.node, context)
            return await self._call(route.node, method, data, opts, sample, context)
        except CallFailed as exc:
            return await self._call(route.retry(exc), method, data, opts, sample, context)
        finally:
            route.finish()

    async def _hedged(self, method: str, data: bytes, opts: CallOptions, model: str, primary: Node,
                      context=None) -> bytes:
        """After the model's p95 on the primary, a copy to another replica;
        the first answer wins and the other call is cancelled."""
        p95 = self.router.latency.quantile((primary.name, model), 0.95)
        if p95 is None:
            return await self._call(primary, method, data, opts, model, context)
        first = asyncio.ensure_future(self._call(primary, method, data, opts, model, context))
        second = None
        try:
            done, _ = await asyncio.wait({first}, timeout=max(p95, self.settings.hedge_min_delay_s))
            if done:
                return first.result()
            second_node = self.router.hedge_target(model, primary)
            if second_node is None or not self.router.hedge_budget.try_take() or not second_node.breaker.allow():
                return await first
            self.metrics.hedges_fired.labels(model).inc()
            self.metrics.picks.labels(second_node.address, "hedge").inc()
            log.info("hedge", model=model, node=second_node.name, primary=primary.name, after_s=round(p95, 4),
                     request_id=opts.request_id)
            second = asyncio.ensure_future(self._call(second_node, method, data, opts, model, context))
            return await self._first_answer(first, second, model)
        finally:
            # a client that left (or a deadline) while we waited must not
            # leave either call running upstream
            for task in (first, second):
                if task is not None and not task.done():
                    task.cancel()

    async def _first_answer(self, first: asyncio.Future, second: asyncio.Future, model: str) -> bytes:
        """The first of the two to answer; when both fail, the primary's failure."""
        pending = {first, second}
        failure: BaseException | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    if task is second:
                        self.metrics.hedges_won.labels(model).inc()
                    return task.result()
                if failure is None or task is first:
                    failure = task.exception()
        raise failure

    async def _relay(self, node: Node, call, pump, name: str, context,
                     seen: list | None = None) -> AsyncIterator[bytes]:
        """A stream's replies, passed on. Until its first reply the stream
        counts among the node's waiting calls, so a node found frozen moves
        it (CallFailed UNAVAILABLE, which Generate retries elsewhere); after
        that it stays where its state is."""
        visit = self.router.visit(node, "stream", timeout=call.time_remaining())
        writer = asyncio.ensure_future(pump()) if pump is not None else None
        try:
            with visit:
                async for reply in call:
                    visit.answered()
                    if seen is not None:
                        seen.append(reply)
                    yield reply
                context.set_trailing_metadata(await call.trailing_metadata())
        finally:
            if visit.code != _OK:
                call.cancel()  # the client left or the stream failed: end it upstream too
            if writer is not None:
                if not writer.done():
                    writer.cancel()
                elif not writer.cancelled() and (failure := writer.exception()) is not None:
                    log.warning("stream_forward_failed", method=name, node=node.name, reason=str(failure))
            self.metrics.calls.labels(name, visit.code.name).inc()
            self.metrics.latency.labels(name).observe(time.perf_counter() - visit.started)

    # -- inference.GRPCInferenceService ----------------------------------------

    async def server_live(self, data: bytes, context) -> bytes:
        return inference_pb2.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, data: bytes, context) -> bytes:
        return inference_pb2.ServerReadyResponse(ready=bool(self.fleet.routable())).SerializeToString()

    def unary_by_field(self, service: str, name: str, field: int, hedgeable: bool = False, split: bool = True):
        """A unary method routed by the string field `field` (the model name);
        `split`: a split model's calls go to one of its targets."""
        method = f"/{service}/{name}"

        async def handler(data: bytes, context) -> bytes:
            started = time.perf_counter()
            code = "OK"
            try:
                opts = CallOptions(context)
                if field:
                    model, kserve_timeout = await self._routing(data, field, parameters=4 if hedgeable else 0)
                    if kserve_timeout:
                        opts.kserve_timeout_s = kserve_timeout / 1e6
                    if split and self.settings.splits:
                        data, model = self._split(data, field, model, opts, field + 1 if service == INFERENCE else 0)
                else:
                    model = ""
                hedge = hedgeable and not opts.update and (opts.urgent or model in self.settings.hedge_models)
                if hedge:
                    self.router.hedge_budget.on_request()
                return await self._routed_unary(method, data, opts, model, hedge, data_plane=hedgeable,
                                                context=context)
            except CallFailed as exc:
                code = exc.code.name
                await exc.abort(context)
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception:
                code = "UNKNOWN"
                log.exception("gateway_call_failed", method=name)
                raise
            finally:
                self.metrics.calls.labels(name, code).inc()
                self.metrics.latency.labels(name).observe(time.perf_counter() - started)
        return handler

    @_aborting
    async def repository_index(self, data: bytes, context) -> bytes:
        """Every node's index merged: one row per model, its best state."""
        opts = CallOptions(context)
        nodes = self.fleet.routable()
        if not nodes:
            raise CallFailed(_UNAVAILABLE, self.router.why_unavailable(""))
        replies = await self._fan_out(nodes, f"/{INFERENCE}/RepositoryIndex", data, opts)
        rows = _merge_indexes(replies)
        if not rows and all(isinstance(r, CallFailed) for r in replies):
            raise replies[0]
        return inference_pb2.RepositoryIndexResponse(models=rows).SerializeToString()

    @_aborting
    async def model_ready(self, data: bytes, context) -> bytes:
        """Ready when any home of the model that can take calls has it ready:
        that is where its calls go (one home may still be loading it, or
        hold it not at all yet)."""
        opts = CallOptions(context)
        model = await self._model(data, 1)
        targets = [self.fleet.by_name[n] for n in self.fleet.replicas(model, self.settings.replicas)
                   if self.fleet.by_name[n].routable]
        if not targets:
            node, _ = self.router.place(model, update=opts.update)  # a spill target, or UNAVAILABLE
            targets = [node]
            node.breaker.release()  # placed only to find a target: the fan-out below gives no verdict
        replies = await self._fan_out(targets, f"/{INFERENCE}/ModelReady", data, opts)
        answers = [reply for reply in replies if not isinstance(reply, CallFailed)]
        if not answers:
            raise replies[0]
        ready = any(inference_pb2.ModelReadyResponse.FromString(a).ready for a in answers)
        return inference_pb2.ModelReadyResponse(ready=ready).SerializeToString()

    def to_replicas(self, name: str):
        """Load and unload go to every replica the ring gives the model, so
        the nodes that will serve it are the ones that hold it."""
        method = f"/{INFERENCE}/{name}"

        @_aborting
        async def handler(data: bytes, context) -> bytes:
            opts = CallOptions(context)
            model = await self._model(data, 2)
            if not model:
                raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "model_name is empty")
            # `usable`, not `routable`: a replica that is only late with its
            # Stats (busy, say loading another model) still gets its copy
            targets = [self.fleet.by_name[n] for n in self.fleet.replicas(model, self.settings.replicas)
                       if self.fleet.by_name[n].usable]
            if not targets:
                raise CallFailed(_UNAVAILABLE, self.router.why_unavailable(model))
            replies = await self._fan_out(targets, method, data, opts)
            for node, reply in zip(targets, replies):
                if isinstance(reply, CallFailed):
                    log.warning("replica_failed", method=name, model=model, node=node.name, reason=str(reply),
                                request_id=opts.request_id)
            ok = [r for r in replies if not isinstance(r, CallFailed)]
            if ok:
                return ok[0]
            # all failed: the most telling answer (bad input, unknown model) over transport trouble
            raise sorted(replies, key=lambda f: f.code == _UNAVAILABLE)[0]
        return handler

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:
        """A bidirectional stream goes to the node of its first request's
        model, whole (later requests may name other models; that node
        serves them too). Streams are never hedged or replayed."""
        try:
            opts = CallOptions(context)
            first = await anext(aiter(requests), None)
            if first is None:
                return
            model = await self._model(first, 1)
            chosen = self.settings.splits.choose(model, opts.session) if self.settings.splits else model
            if chosen != model:
                # one target for the whole stream: its later requests for the
                # split name follow the first one's draw
                self.metrics.split_calls.labels(model, chosen).inc()
                first = retarget(first, 1, chosen, 2)
                requests = self._retargeted(requests, model, chosen)
                model = target_model(chosen)
            node, _ = self.router.place(model, update=opts.update)
        except CallFailed as exc:
            await exc.abort(context)
        tenant = tenants.current()
        metered = tenant is not None and tenant.limited
        if metered:
            try:
                tenant.start_stream()
            except tenants.QuotaExceeded as exc:
                node.breaker.release()  # placed, never sent: no verdict
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message)
        try:
            async for reply in self._stream_to(node, first, requests, opts, context):
                yield reply
        finally:
            if metered:
                tenant.end_stream()

    async def _retargeted(self, requests: AsyncIterator[bytes], model: str, target: str) -> AsyncIterator[bytes]:
        async for request in requests:
            if await self._model(request, 1) == model:
                request = retarget(request, 1, target, 2)
            yield request

    async def _stream_to(self, node: Node, first: bytes, requests, opts: CallOptions, context):
        call = node.stream_stream(f"/{INFERENCE}/ModelStreamInfer")(metadata=opts.metadata, timeout=opts.timeout)

        async def pump() -> None:
            await call.write(first)
            async for request in requests:
                await call.write(request)
            await call.done_writing()

        async for reply in self._relay(node, call, pump, "ModelStreamInfer", context):
            yield reply

    async def _stream_infer_guarded(self, requests, context):
        try:
            async for reply in self.model_stream_infer(requests, context):
                yield reply
        except CallFailed as exc:
            await exc.abort(context)

    # -- modeld.v1.Generation --------------------------------------------------

    async def generate(self, data: bytes, context) -> AsyncIterator[bytes]:
        """Prefix affinity: the replica whose earlier prompts share the
        longest prefix with this one holds that prefix in its KV cache. A
        stream that failed before its first token is tried once more
        elsewhere; one that has sent tokens is never replayed."""
        method = f"/{GENERATION}/Generate"
        tenant = tenants.current()
        metered = tenant is not None and tenant.limited
        streaming = False
        routed = None
        try:
            try:
                if len(data) > self.settings.parse_in_thread_bytes:  # a long prompt: parsed off the event loop
                    request = await asyncio.to_thread(generation_pb2.GenerateRequest.FromString, data)
                else:
                    request = generation_pb2.GenerateRequest.FromString(data)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
                raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None
            opts = CallOptions(context)
            if self.settings.splits:
                data, request.model = self._split(data, 1, request.model, opts)
            if metered:
                try:
                    tenant.start_stream()
                except tenants.QuotaExceeded as exc:
                    raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message) from None
                streaming = True
            key = prompt_key(request)
            # the client's bytes as they are, unless a split retargeted them
            kv = await self.router.prompt_blocks(request.model, generate=data) \
                if request.model in self.router.kv_models() else None
            route = routed = self.router.route(method, request.model, opts, key, kv)
            while True:
                node, seen = route.node, []
                call = node.unary_stream(method)(data, metadata=opts.metadata, timeout=opts.timeout)
                try:
                    async for reply in self._relay(node, call, None, "Generate", context, seen):
                        if metered:  # the tenant's generated tokens, charged as they stream
                            tenant.charge_tokens(len(generation_pb2.GenerateResponse.FromString(reply).token_ids))
                        yield reply
                    break
                except CallFailed as exc:
                    route.retry(exc, replied=bool(seen))
            if key:
                text = "".join(generation_pb2.GenerateResponse.FromString(r).text for r in seen)
                self.router.remember_prompt(node.name, _continued_key(request, key, text))
        except CallFailed as exc:
            await exc.abort(context)
        finally:
            if routed is not None:
                routed.finish()
            if streaming:
                tenant.end_stream()

    # -- the table -------------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        uu = grpc.unary_unary_rpc_method_handler
        inference = {
            "ServerLive": uu(self.server_live),
            "ServerReady": uu(self.server_ready),
            "ServerMetadata": uu(self.unary_by_field(INFERENCE, "ServerMetadata", 0)),
            "ModelReady": uu(self.model_ready),
            "ModelMetadata": uu(self.unary_by_field(INFERENCE, "ModelMetadata", 1)),
            "ModelInfer": uu(self.unary_by_field(INFERENCE, "ModelInfer", 1, hedgeable=True)),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self._stream_infer_guarded),
            # statistics stay under each target's own name, never a draw
            "ModelStatistics": uu(self.unary_by_field(INFERENCE, "ModelStatistics", 1, split=False)),
            "RepositoryIndex": uu(self.repository_index),
            "RepositoryModelLoad": uu(self.to_replicas("RepositoryModelLoad")),
            "RepositoryModelUnload": uu(self.to_replicas("RepositoryModelUnload")),
        }
        generation = {
            "Generate": grpc.unary_stream_rpc_method_handler(self.generate),
            "Tokenize": uu(self.unary_by_field(GENERATION, "Tokenize", 1)),
            "Detokenize": uu(self.unary_by_field(GENERATION, "Detokenize", 1)),
        }
        return [grpc.method_handlers_generic_handler(INFERENCE, inference),
                grpc.method_handlers_generic_handler(GENERATION, generation)]
