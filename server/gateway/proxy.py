"""The gateway's gRPC surface: the daemon's own services, forwarded.

Requests travel as the bytes the client sent: a handler reads only what
routing needs (ModelInfer's model name straight off the wire, a Generate
request's prompt for prefix affinity) and passes the rest on, so tensor
payloads are never decoded or re-encoded here.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from modeld.gen import generation_pb2, inference_pb2
from modeld.server.gateway import wire
from modeld.server.gateway.balance import Pick, place, place_update
from modeld.server.gateway.breaker import BreakerState
from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.hedge import LatencyTracker, TokenBucket
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet, Node
from modeld.server.gateway.prefix import PrefixIndex
from modeld.server.request_context import REQUEST_ID_HEADER, new_request_id, usable_client_id

log = structlog.get_logger("modeld.gateway")

INFERENCE = "inference.GRPCInferenceService"
GENERATION = "modeld.v1.Generation"
REQUEST_TYPE_HEADER = "x-modeld-request-type"
URGENCY_HEADER = "x-modeld-urgency"
_REQUEST_TYPES = ("inference", "update")
_URGENCIES = ("low", "normal", "high", "critical")
# hop-by-hop and transport headers grpc sets itself on the next hop
_DROPPED = frozenset({"user-agent", "te", "content-type", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout"})
_STATE_RANK = {"READY": 3, "LOADING": 2, "UNLOADING": 1}
FLEET_LOAD_TTL_S = 0.005


class CallFailed(Exception):
    """A node's answer that must reach the client as a status (with the
    node's trailing metadata, its request id among them)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers=()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, tuple(trailers or ())

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError) -> CallFailed:
        return cls(exc.code(), exc.details() or exc.code().name, exc.trailing_metadata())


class CallOptions:
    """What the client's metadata asks of this call, and the metadata the
    node gets: the client's own, `authorization` included, so the node
    judges the client's token (the gateway's own token, --node-token-file,
    rides only on its health and Stats probes, never on a forwarded call)."""

    __slots__ = ("metadata", "request_id", "update", "urgent", "_context")

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        metadata, request_id, self.update, self.urgent = [], None, False, False
        for key, value in context.invocation_metadata() or ():
            if key.startswith(":") or key in _DROPPED:
                continue
            if key == REQUEST_TYPE_HEADER:
                if value not in _REQUEST_TYPES:
                    raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"{REQUEST_TYPE_HEADER} must be one of {', '.join(_REQUEST_TYPES)}, not {value!r}")
                self.update = value == "update"
            elif key == URGENCY_HEADER:
                if value not in _URGENCIES:
                    raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"{URGENCY_HEADER} must be one of {', '.join(_URGENCIES)}, not {value!r}")
                self.urgent = value in ("high", "critical")
            elif key == REQUEST_ID_HEADER:
                request_id = usable_client_id(value)
                continue
            metadata.append((key, value))
        # the node's logs and ours carry one id for the call
        self.request_id = request_id or new_request_id()
        metadata.append((REQUEST_ID_HEADER, self.request_id))
        self.metadata = tuple(metadata)

    @property
    def timeout(self) -> float | None:
        """The client's time left, read per attempt: a retry or a hedge
        must not get the whole of the original deadline again."""
        return self._context.time_remaining()


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


class Router:
    """Chooses a node for a call: the ring, breakers, scores, loads, prefixes."""

    def __init__(self, fleet: Fleet, settings: GatewaySettings, metrics: GatewayMetrics,
                 rng: random.Random | None = None) -> None:
        self.fleet, self.settings, self.metrics = fleet, settings, metrics
        self.rng = rng or random.Random()
        self.prefixes = PrefixIndex()
        self.latency = LatencyTracker()
        self.hedge_budget = TokenBucket(settings.hedge_ratio)
        self._warm_nodes: set[str] = set()
        self._fleet_load_value, self._fleet_load_at = (0.0, 0), -1.0
        self._pick_counters: dict[tuple[str, str], object] = {}
        fleet.listeners.append(self._forget_cold_caches)

    def remember_prompt(self, node: str, key: str) -> None:
        self.prefixes.insert(node, key)
        self._warm_nodes.add(node)

    def _forget_cold_caches(self) -> None:
        """A node that stopped serving (restarted, left) lost its KV cache:
        its prefixes must not draw conversations back to it."""
        for name in list(self._warm_nodes):
            node = self.fleet.by_name.get(name)
            if node is None or not node.serving:
                self.prefixes.remove_node(name)
                self._warm_nodes.discard(name)

    def _fleet_load(self) -> tuple[float, int]:
        """Total load and count of the nodes that may take calls, for the
        load bound; surveyed at most every FLEET_LOAD_TTL_S, because with a
        hundred nodes the survey would cost more than the hop."""
        now = time.monotonic()
        if now - self._fleet_load_at > FLEET_LOAD_TTL_S:
            routable = self.fleet.routable()
            self._fleet_load_value = (sum(n.load() for n in routable), len(routable))
            self._fleet_load_at = now
        return self._fleet_load_value

    def _admitted(self, exclude: frozenset[str], strict: bool = True):
        by_name = self.fleet.by_name

        def admitted(name: str) -> bool:
            node = by_name.get(name)
            return node is not None and name not in exclude and (node.routable if strict else node.usable)
        return admitted

    def _load(self, name: str) -> float:
        return self.fleet.by_name[name].load()

    def _score(self, name: str) -> float:
        return self.fleet.by_name[name].score()

    def place(self, model: str, *, update: bool = False, key: str = "",
              exclude: frozenset[str] = frozenset()) -> tuple[Node, str]:
        """A node for the call and why, with its breaker's admission taken;
        UNAVAILABLE with the reason when no node can take it."""
        strict = True
        for _ in range(2 * max(1, len(self.fleet.by_name))):
            admitted = self._admitted(exclude, strict)
            if update or not model:
                pick = place_update(self.fleet.by_name, admitted=admitted, load=self._load, score=self._score,
                                    rng=self.rng, min_score=self.settings.min_score)
                if pick is not None and not update:
                    pick = Pick(pick.node, "any")
            else:
                prefix = None
                if key:
                    prefix = self.prefixes.match(key) or None
                pick = place(model, self.fleet.ring, self.settings.replicas, admitted=admitted, load=self._load,
                             score=self._score, rng=self.rng, min_score=self.settings.min_score,
                             bound=self.settings.load_bound,
                             loaded=lambda name: self.fleet.by_name[name].has_model(model), prefix=prefix,
                             fleet_load=None if exclude or not strict else self._fleet_load())
            if pick is None:
                if not strict:
                    break
                strict = False  # every node missed its last Stats deadline: take a slow one over none
                continue
            node = self.fleet.by_name[pick.node]
            if node.breaker.allow():  # takes the half-open probe, if that is what it is
                reason = getattr(pick.reason, "value", pick.reason)
                counter = self._pick_counters.get((node.address, reason))
                if counter is None:  # labels() costs more than the rest of the pick's bookkeeping
                    counter = self._pick_counters[node.address, reason] = self.metrics.picks.labels(
                        node.address, reason)
                counter.inc()
                return node, reason
            exclude = exclude | {pick.node}
        raise CallFailed(grpc.StatusCode.UNAVAILABLE, self.why_unavailable(model))

    def why_unavailable(self, model: str) -> str:
        nodes = list(self.fleet.by_address.values())
        if not nodes:
            source = f"DNS name {self.settings.dns} resolves to no address" if self.settings.dns else "no nodes"
            return f"no daemon to route to: {source}"
        states = ", ".join(
            f"{n.name} ({'serving' if n.serving else 'not serving'}, "
            f"{'answering' if n.responsive else 'not answering its Stats probes'}, breaker {n.breaker.state.value}, "
            f"score {n.score():.2f}{'; ' + n.last_error if n.last_error and not n.serving else ''})"
            for n in nodes)
        what = f"model {model!r}" if model else "this call"
        return f"no healthy node can take {what}: {states}"

    def hedge_target(self, model: str, primary: Node) -> Node | None:
        """A different replica for a hedged copy, only while the fleet is
        calm: both breakers closed and mean load under the threshold."""
        if primary.breaker.state is not BreakerState.CLOSED:
            return None
        if self.fleet.mean_load() > self.settings.hedge_max_fleet_load:
            return None
        for name in self.fleet.ring.replicas(model, self.settings.replicas):
            node = self.fleet.by_name.get(name)
            if node is None or node is primary or not node.routable:
                continue
            if node.breaker.state is BreakerState.CLOSED and node.score() > self.settings.min_score:
                return node
        return None


class GatewayService:
    """Handlers for every forwarded method, as raw-bytes generic handlers."""

    def __init__(self, fleet: Fleet, router: Router, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.fleet, self.router, self.settings, self.metrics = fleet, router, settings, metrics

    # -- plumbing --------------------------------------------------------------

    async def _call(self, node: Node, method: str, data: bytes, opts: CallOptions, model: str = "",
                    context=None, admitted: bool = True) -> bytes:
        """One unary call on `node`. `model` names a data-plane call whose
        latency feeds the node's score and the hedging delay (a model load
        or a metadata call would skew both); `admitted` is False for a
        fan-out that did not take the breaker's admission, whose outcome
        then must not act as the breaker's probe."""
        node.in_flight += 1
        task = asyncio.current_task()
        waiting = node.calls if admitted else node.fanouts
        waiting.add(task)
        started = time.perf_counter()
        timeout = opts.timeout
        code = grpc.StatusCode.OK
        try:
            call = node.unary(method)(data, metadata=opts.metadata, timeout=timeout)
            reply = await call
            if context is not None:
                context.set_trailing_metadata(await call.trailing_metadata())
            return reply
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None \
                    and time.perf_counter() - started >= timeout * 0.95:
                code = grpc.StatusCode.CANCELLED  # the client's own deadline ran out: no verdict on the node
            raise CallFailed.from_rpc(exc) from None
        except asyncio.CancelledError:
            if node.claim_abandoned(task):
                code = grpc.StatusCode.UNAVAILABLE
                raise CallFailed(code, f"node {node.name} stopped answering its health probes while the call "
                                       "waited there") from None
            if task.cancelling() == 0:  # not our cancel: the node's channel closed (it left the fleet)
                code = grpc.StatusCode.UNAVAILABLE
                raise CallFailed(code, f"node {node.name} left the fleet during the call") from None
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a channel closed under us: the node, not the client
            code = grpc.StatusCode.UNAVAILABLE
            raise CallFailed(code, f"node {node.name}: {type(exc).__name__}: {exc}") from None
        finally:
            waiting.discard(task)
            node.in_flight -= 1
            elapsed = time.perf_counter() - started
            if admitted:
                node.record(code, elapsed if code == grpc.StatusCode.OK and model else None)
            if code == grpc.StatusCode.OK and model:
                self.router.latency.record((node.name, model), elapsed)

    async def _routed_unary(self, method: str, data: bytes, opts: CallOptions, model: str,
                            hedge: bool = False, data_plane: bool = False, context=None) -> bytes:
        node, reason = self.router.place(model, update=opts.update)
        log.debug("routed", method=method, model=model, node=node.name, reason=reason, request_id=opts.request_id)
        sample = model if data_plane else ""
        try:
            if hedge:
                return await self._hedged(method, data, opts, model, node, context)
            return await self._call(node, method, data, opts, sample, context)
        except CallFailed as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            # nothing reached the client yet: one more try on another node
            try:
                retry, _ = self.router.place(model, update=opts.update, exclude=frozenset({node.name}))
            except CallFailed:
                raise exc from None
            self.metrics.retries.labels(method.rsplit("/", 1)[-1]).inc()
            log.info("retry", method=method, model=model, failed_node=node.name, node=retry.name,
                     reason=exc.details, request_id=opts.request_id)
            return await self._call(retry, method, data, opts, sample, context)

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
        finally:
            # a client that left (or a deadline) while we waited must not
            # leave either call running upstream
            for task in (first, second):
                if task is not None and not task.done():
                    task.cancel()

    @staticmethod
    async def _abort(context, exc: CallFailed):
        await context.abort(exc.code, exc.details, exc.trailers)

    # -- inference.GRPCInferenceService ----------------------------------------

    async def server_live(self, data: bytes, context) -> bytes:
        return inference_pb2.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, data: bytes, context) -> bytes:
        return inference_pb2.ServerReadyResponse(ready=bool(self.fleet.routable())).SerializeToString()

    def unary_by_field(self, service: str, name: str, field: int, hedgeable: bool = False):
        """A unary method routed by the string field `field` (the model name)."""
        method = f"/{service}/{name}"

        async def handler(data: bytes, context) -> bytes:
            started = time.perf_counter()
            code = "OK"
            try:
                try:
                    model = wire.string_field(data, field) if field else ""
                except wire.WireError as exc:
                    raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None
                opts = CallOptions(context)
                hedge = hedgeable and not opts.update and (opts.urgent or model in self.settings.hedge_models)
                if hedge:
                    self.router.hedge_budget.on_request()
                return await self._routed_unary(method, data, opts, model, hedge, data_plane=hedgeable,
                                                context=context)
            except CallFailed as exc:
                code = exc.code.name
                await self._abort(context, exc)
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

    async def repository_index(self, data: bytes, context) -> bytes:
        """Every node's index merged: one row per model, its best state."""
        try:
            opts = CallOptions(context)
            nodes = self.fleet.routable()
            if not nodes:
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, self.router.why_unavailable(""))
            method = f"/{INFERENCE}/RepositoryIndex"
            replies = await asyncio.gather(*(self._call(n, method, data, opts, admitted=False) for n in nodes),
                                           return_exceptions=True)
        except CallFailed as exc:
            await self._abort(context, exc)
        rows: dict[str, inference_pb2.RepositoryIndexResponse.ModelIndex] = {}
        failures = []
        for reply in replies:
            if isinstance(reply, BaseException):
                failures.append(reply)
                continue
            for row in inference_pb2.RepositoryIndexResponse.FromString(reply).models:
                best = rows.get(row.name)
                if best is None or _STATE_RANK.get(row.state, 0) > _STATE_RANK.get(best.state, 0):
                    rows[row.name] = row
        if failures and not rows and len(failures) == len(replies):
            exc = failures[0]
            await self._abort(context, exc if isinstance(exc, CallFailed) else
                              CallFailed(grpc.StatusCode.UNAVAILABLE, str(exc)))
        merged = inference_pb2.RepositoryIndexResponse(models=[rows[k] for k in sorted(rows)])
        return merged.SerializeToString()

    async def model_ready(self, data: bytes, context) -> bytes:
        """Ready when any home of the model that can take calls has it ready:
        that is where its calls go (one home may still be loading it, or
        hold it not at all yet)."""
        method = f"/{INFERENCE}/ModelReady"
        try:
            try:
                model = wire.string_field(data, 1)
            except wire.WireError as exc:
                raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None
            opts = CallOptions(context)
            targets = [self.fleet.by_name[n] for n in self.fleet.ring.replicas(model, self.settings.replicas)
                       if self.fleet.by_name[n].routable]
            if not targets:
                node, _ = self.router.place(model, update=opts.update)  # a spill target, or UNAVAILABLE
                targets = [node]
                node.breaker.release()  # placed only to find a target: the fan-out below gives no verdict
            replies = await asyncio.gather(*(self._call(n, method, data, opts, admitted=False) for n in targets),
                                           return_exceptions=True)
            answers = [pb_reply for pb_reply in replies if not isinstance(pb_reply, BaseException)]
            if not answers:
                raise replies[0] if isinstance(replies[0], CallFailed) else CallFailed(
                    grpc.StatusCode.UNAVAILABLE, str(replies[0]))
            ready = any(inference_pb2.ModelReadyResponse.FromString(a).ready for a in answers)
            return inference_pb2.ModelReadyResponse(ready=ready).SerializeToString()
        except CallFailed as exc:
            await self._abort(context, exc)

    def to_replicas(self, name: str):
        """Load and unload go to every replica the ring gives the model, so
        the nodes that will serve it are the ones that hold it."""
        method = f"/{INFERENCE}/{name}"

        async def handler(data: bytes, context) -> bytes:
            try:
                try:
                    model = wire.string_field(data, 2)
                except wire.WireError as exc:
                    raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None
                if not model:
                    raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "model_name is empty")
                opts = CallOptions(context)
                # `usable`, not `routable`: a replica that is only late with its
                # Stats (busy, say loading another model) still gets its copy
                targets = [self.fleet.by_name[n] for n in self.fleet.ring.replicas(model, self.settings.replicas)
                           if self.fleet.by_name[n].usable]
                if not targets:
                    raise CallFailed(grpc.StatusCode.UNAVAILABLE, self.router.why_unavailable(model))
                replies = await asyncio.gather(*(self._call(n, method, data, opts, admitted=False) for n in targets),
                                               return_exceptions=True)
                for node, reply in zip(targets, replies):
                    if isinstance(reply, BaseException):
                        log.warning("replica_failed", method=name, model=model, node=node.name, reason=str(reply),
                                    request_id=opts.request_id)
                ok = [r for r in replies if not isinstance(r, BaseException)]
                if ok:
                    return ok[0]
                # all failed: the most telling answer (bad input, unknown model) over transport trouble
                failures = [r if isinstance(r, CallFailed) else CallFailed(grpc.StatusCode.UNAVAILABLE, str(r))
                            for r in replies]
                failures.sort(key=lambda f: f.code == grpc.StatusCode.UNAVAILABLE)
                raise failures[0]
            except CallFailed as exc:
                await self._abort(context, exc)
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
            try:
                model = wire.string_field(first, 1)
            except wire.WireError as exc:
                raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None
            node, _ = self.router.place(model, update=opts.update)
        except CallFailed as exc:
            await self._abort(context, exc)
        call = node.stream_stream(f"/{INFERENCE}/ModelStreamInfer")(metadata=opts.metadata, timeout=opts.timeout)

        async def pump() -> None:
            await call.write(first)
            async for request in requests:
                await call.write(request)
            await call.done_writing()

        async for reply in self._relay(node, call, pump, "ModelStreamInfer", context):
            yield reply

    async def _relay(self, node: Node, call, pump, name: str, context,
                     seen: list | None = None) -> AsyncIterator[bytes]:
        """A stream's replies, passed on. Until its first reply the stream
        counts among the node's waiting calls, so a node found frozen moves
        it (CallFailed UNAVAILABLE, which Generate retries elsewhere); after
        that it stays where its state is."""
        node.in_flight += 1
        task = asyncio.current_task()
        node.calls.add(task)
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        writer = asyncio.ensure_future(pump()) if pump is not None else None
        try:
            async for reply in call:
                node.calls.discard(task)
                if seen is not None:
                    seen.append(reply)
                yield reply
            context.set_trailing_metadata(await call.trailing_metadata())
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            raise CallFailed.from_rpc(exc) from None
        except asyncio.CancelledError:
            if node.claim_abandoned(task):
                code = grpc.StatusCode.UNAVAILABLE
                raise CallFailed(code, f"node {node.name} stopped answering its health probes before the "
                                       "stream's first reply") from None
            if task.cancelling() == 0:
                code = grpc.StatusCode.UNAVAILABLE
                raise CallFailed(code, f"node {node.name} left the fleet during the stream") from None
            code = grpc.StatusCode.CANCELLED
            raise
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            node.calls.discard(task)
            if code != grpc.StatusCode.OK:
                call.cancel()  # the client left or the stream failed: end it upstream too
            if writer is not None:
                if not writer.done():
                    writer.cancel()
                elif not writer.cancelled() and (failure := writer.exception()) is not None:
                    log.warning("stream_forward_failed", method=name, node=node.name, reason=str(failure))
            node.in_flight -= 1
            node.record(code, None)
            self.metrics.calls.labels(name, code.name).inc()
            self.metrics.latency.labels(name).observe(time.perf_counter() - started)

    async def _stream_infer_guarded(self, requests, context):
        try:
            async for reply in self.model_stream_infer(requests, context):
                yield reply
        except CallFailed as exc:
            await self._abort(context, exc)

    # -- modeld.v1.Generation --------------------------------------------------

    async def generate(self, data: bytes, context) -> AsyncIterator[bytes]:
        """Prefix affinity: the replica whose earlier prompts share the
        longest prefix with this one holds that prefix in its KV cache. A
        stream that failed before its first token is tried once more
        elsewhere; one that has sent tokens is never replayed."""
        method = f"/{GENERATION}/Generate"
        try:
            try:
                request = generation_pb2.GenerateRequest.FromString(data)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
                raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {exc}") from None
            opts = CallOptions(context)
            key = prompt_key(request)
            tried: frozenset[str] = frozenset()
            for attempt in range(2):
                node, reason = self.router.place(request.model, update=opts.update, key=key, exclude=tried)
                if key:
                    self.router.remember_prompt(node.name, key)
                log.debug("routed", method=method, model=request.model, node=node.name, reason=reason,
                          request_id=opts.request_id)
                seen: list[bytes] = []
                call = node.unary_stream(method)(data, metadata=opts.metadata, timeout=opts.timeout)
                try:
                    async for reply in self._relay(node, call, None, "Generate", context, seen):
                        yield reply
                except CallFailed as exc:
                    if seen or exc.code != grpc.StatusCode.UNAVAILABLE or attempt:
                        raise
                    tried = tried | {node.name}
                    self.metrics.retries.labels("Generate").inc()
                    log.info("retry", method=method, model=request.model, failed_node=node.name, reason=exc.details,
                             request_id=opts.request_id)
                    continue
                if key:
                    text = "".join(generation_pb2.GenerateResponse.FromString(r).text for r in seen)
                    self.router.remember_prompt(node.name, _continued_key(request, key, text))
                return
        except CallFailed as exc:
            await self._abort(context, exc)

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
            "ModelStatistics": uu(self.unary_by_field(INFERENCE, "ModelStatistics", 1)),
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
