"""Where a call goes, and what its stay there does to the node's standing.

Router places a call (the ring, breakers, scores, loads, prefixes). Every
call kind goes through the same two helpers: Route, a call's node and the
one more try an UNAVAILABLE earns it (unary calls and generations; a
bidirectional stream is never replayed), and NodeVisit, the bookkeeping of
one attempt on one node (unary calls, streams and generations alike).
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import structlog

from modeld.gen import generation_pb2, node_pb2
from modeld.server.gateway.balance import KvRequest, Pick, place, place_update
from modeld.server.gateway.breaker import BreakerState
from modeld.server.gateway.call_options import CallOptions
from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.hedge import LatencyTracker, TokenBucket
from modeld.server.gateway.kv_index import OVERLAP_WEIGHT, PromptBlocks, overlaps
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet, Node
from modeld.server.gateway.prefix import PrefixIndex

log = structlog.get_logger("modeld.gateway")

FLEET_LOAD_TTL_S = 0.005
# A prompt's block hashes come from a node that serves the model (Node/
# PromptBlocks: its own tokenizer, chat template, block size and hash): one
# loopback hop, well under a millisecond, before a call whose first token
# takes tens. Past this the call is routed on the text guess instead.
KV_LOOKUP_TIMEOUT_S = 0.25
_OK = grpc.StatusCode.OK
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_CANCELLED = grpc.StatusCode.CANCELLED



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

    # -- KV-aware routing ------------------------------------------------------

    def kv_models(self) -> set[str]:
        """Models some node publishes prefix-cache blocks for, but those the
        settings route on the guess (prefix_guess_models)."""
        return {m for n in self.fleet.by_name.values() for m in n.kv.models} - set(self.settings.prefix_guess_models)

    async def prompt_blocks(self, model: str, *, generate: bytes = b"", model_infer: bytes = b"") -> PromptBlocks | None:
        """The prompt's block hashes as the model's caches key them, from a
        node that publishes the model's blocks (the least loaded); None when
        none does or it cannot say in time: the caller routes on its guess."""
        holders = [n for n in self.fleet.routable() if model in n.kv.models]
        if not holders:
            return None
        node = min(holders, key=lambda n: n.load())
        request = node_pb2.PromptBlocksRequest(generate=generate) if generate else \
            node_pb2.PromptBlocksRequest(model_infer=model_infer)
        try:
            reply = await node.prompt_blocks(request, KV_LOOKUP_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("kv_lookup_failed", model=model, node=node.name, reason=f"{exc.code().name}: {exc.details()}")
            return None
        return PromptBlocks(reply.model or model, reply.block_size, tuple(reply.hashes))

    async def kv_blocks_for(self, model: str, *, prompt: str | None = None,
                            messages: list[tuple[str, str]] | None = None,
                            token_ids: list[int] | None = None) -> PromptBlocks | None:
        """prompt_blocks for a caller that holds no GenerateRequest (the
        HTTP front: an OpenAI completion's prompt or a chat's (role,
        content) messages). None: route with `key` alone (the guess)."""
        if model not in self.kv_models():
            return None
        request = generation_pb2.GenerateRequest(model=model)
        if messages is not None:
            request.messages.messages.extend(generation_pb2.ChatMessage(role=r, content=c) for r, c in messages)
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        else:
            request.prompt = prompt or ""
        return await self.prompt_blocks(model, generate=request.SerializeToString())

    def _kv_request(self, prompt: PromptBlocks | None) -> KvRequest | None:
        if prompt is None or not prompt.hashes:
            return None
        indexes = {name: node.kv for name, node in self.fleet.by_name.items() if node.kv.live}
        if not indexes:
            return None  # no stream is live: the guess knows more than an empty index
        return KvRequest(overlaps(indexes, indexes, prompt), prompt.num_blocks,
                         lambda name: self.fleet.by_name[name].kv_active_blocks, OVERLAP_WEIGHT,
                         held_blocks=lambda name: self.fleet.by_name[name].kv.num_blocks(prompt.model))

    def place(self, model: str, *, update: bool = False, key: str = "",
              exclude: frozenset[str] = frozenset(), kv: PromptBlocks | None = None) -> tuple[Node, str]:
        """A node for the call and why, with its breaker's admission taken;
        UNAVAILABLE with the reason when no node can take it. `kv`: the
        prompt's blocks (prompt_blocks), for KV-aware routing; `key`: its
        text, for the guess when `kv` is None."""
        strict = True
        kv_request = self._kv_request(kv) if not update else None
        for _ in range(2 * max(1, len(self.fleet.by_name))):
            pick = self._pick(model, update, key, exclude, strict, kv_request)
            if pick is None:
                if not strict:
                    break
                strict = False  # every node missed its last Stats deadline: take a slow one over none
                continue
            node = self.fleet.by_name[pick.node]
            if node.breaker.allow():  # takes the half-open probe, if that is what it is
                return node, self._count_pick(node, pick)
            exclude = exclude | {pick.node}
        raise CallFailed(_UNAVAILABLE, self.why_unavailable(model))

    def _pick(self, model: str, update: bool, key: str, exclude: frozenset[str], strict: bool,
              kv: KvRequest | None = None) -> Pick | None:
        admitted = self._admitted(exclude, strict)
        if update or not model:
            pick = place_update(self.fleet.by_name, admitted=admitted, load=self._load, score=self._score,
                                rng=self.rng, min_score=self.settings.min_score)
            return Pick(pick.node, "any") if pick is not None and not update else pick
        prefix = (self.prefixes.match(key) or None) if key and kv is None else None
        return place(self.fleet.ring_key(model), self.fleet.ring, self.settings.replicas, admitted=admitted,
                     load=self._load,
                     score=self._score, rng=self.rng, min_score=self.settings.min_score,
                     bound=self.settings.load_bound,
                     loaded=lambda name: self.fleet.by_name[name].resident_for(model), prefix=prefix,
                     fleet_load=None if exclude or not strict else self._fleet_load(), kv=kv,
                     pulling=lambda name: self.fleet.by_name[name].routes_around_pull(model))

    def _count_pick(self, node: Node, pick: Pick) -> str:
        reason = getattr(pick.reason, "value", pick.reason)
        counter = self._pick_counters.get((node.address, reason))
        if counter is None:  # labels() costs more than the rest of the pick's bookkeeping
            counter = self._pick_counters[node.address, reason] = self.metrics.picks.labels(node.address, reason)
        counter.inc()
        return reason

    def route(self, method: str, model: str, opts: CallOptions, key: str = "",
              kv: PromptBlocks | None = None) -> Route:
        """The call placed, with its one retry to come."""
        return Route(self, method, model, opts, key, kv)

    def visit(self, node: Node, what: str, *, model: str = "", admitted: bool = True,
              timeout: float | None = None) -> NodeVisit:
        """The bookkeeping of one attempt on `node` (see NodeVisit)."""
        return NodeVisit(node, self.latency, what, model=model, admitted=admitted, timeout=timeout)

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
        for name in self.fleet.replicas(model, self.settings.replicas):
            node = self.fleet.by_name.get(name)
            if node is None or node is primary or not node.routable:
                continue
            if node.breaker.state is BreakerState.CLOSED and node.score() > self.settings.min_score:
                return node
        return None




class Route:
    """A call's node, and the one more try it may earn: a call that failed
    UNAVAILABLE before anything reached the client goes once more, to
    another node. A prompt `key` makes each node chosen remember it, for
    prefix affinity."""

    __slots__ = ("router", "method", "model", "opts", "key", "kv", "node", "reason", "_retried", "_charged")

    def __init__(self, router: Router, method: str, model: str, opts: CallOptions, key: str = "",
                 kv: PromptBlocks | None = None) -> None:
        self.router, self.method, self.model, self.opts, self.key, self.kv = router, method, model, opts, key, kv
        self._retried = False
        self._charged: Node | None = None
        self.node = self._place(frozenset())

    def _place(self, exclude: frozenset[str]) -> Node:
        node, reason = self.router.place(self.model, update=self.opts.update, key=self.key, exclude=exclude,
                                         kv=self.kv)
        self.reason = reason
        self._charge(node)
        if self.key:
            self.router.remember_prompt(node.name, self.key)
        log.debug("routed", method=self.method, model=self.model, node=node.name, reason=reason,
                  request_id=self.opts.request_id)
        return node

    def retry(self, failure: CallFailed, replied: bool = False) -> Node:
        """The node for the one more try `failure` earns, or `failure`
        raised when it earns none: not UNAVAILABLE, replies already sent
        (a stream is never replayed), the retry already spent, or no other
        node to take it (then the node's own answer tells the client more
        than the fleet's state would)."""
        if replied or failure.code != _UNAVAILABLE or self._retried:
            raise failure
        self._retried = True
        failed = self.node
        try:
            self.node = self._place(frozenset({failed.name}))
        except CallFailed:
            raise failure from None
        self.router.metrics.retries.labels(self.method.rsplit("/", 1)[-1]).inc()
        log.info("retry", method=self.method, model=self.model, failed_node=failed.name, node=self.node.name,
                 reason=failure.details, request_id=self.opts.request_id)
        return self.node

    def _charge(self, node: Node) -> None:
        """The prompt's blocks count as active on the node the call is on
        (kv_index.cost's second term) until `finish`, and as held there
        (kv_index: expect) before its events can say so."""
        self.finish()
        if self.kv is not None:
            node.kv_active_blocks += self.kv.num_blocks
            node.kv.expect(self.kv)
            self._charged = node

    def finish(self) -> None:
        """The call ended: its blocks are no longer active where it ran."""
        if self._charged is not None and self.kv is not None:
            self._charged.kv_active_blocks -= self.kv.num_blocks
            self._charged.kv.settle(self.kv)
            self._charged = None


class NodeVisit:
    """One attempt's stay on a node, as a context manager.

    While it lasts the attempt counts in the node's load. Until its first
    reply (`answered`) it is among the node's waiting calls, so a node
    found frozen can cancel it; that cancel, or the node leaving the fleet,
    leaves as CallFailed UNAVAILABLE, which a Route may retry elsewhere. A
    gRPC error leaves as CallFailed with the node's status. On the way out
    the outcome is recorded: for the node's breaker and score unless the
    attempt is a fan-out that took no admission (`admitted` False: its
    outcome must not act as the breaker's probe), and, for a data-plane
    call (`model` set; a load or a metadata call would skew both), its
    latency for the score and the hedging delay. `timeout` is the client's
    time left when the attempt began, to tell its deadline from the node's
    slowness.
    """

    __slots__ = ("node", "latency", "what", "model", "admitted", "timeout", "task", "waiting", "started", "code")

    def __init__(self, node: Node, latency: LatencyTracker, what: str, *, model: str = "", admitted: bool = True,
                 timeout: float | None = None) -> None:
        self.node, self.latency, self.what, self.model = node, latency, what, model
        self.admitted, self.timeout = admitted, timeout
        self.code = _OK

    def __enter__(self) -> NodeVisit:
        self.node.in_flight += 1
        self.task = asyncio.current_task()
        self.waiting = self.node.calls if self.admitted else self.node.fanouts
        self.waiting.add(self.task)
        self.started = time.perf_counter()
        return self

    def answered(self) -> None:
        """The first reply came: from here on the call stays where its state is."""
        self.waiting.discard(self.task)

    def __exit__(self, kind, exc, traceback) -> bool:
        failure = None
        if exc is not None:
            self.code, failure = self._verdict(exc)
        self._record()
        if failure is not None:
            raise failure from None
        return False

    def _verdict(self, exc: BaseException) -> tuple[grpc.StatusCode, CallFailed | None]:
        """The attempt's status code for the books, and the failure the
        caller sees instead of `exc` (None: `exc` goes on as it is)."""
        node = self.node
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.timeout is not None \
                    and time.perf_counter() - self.started >= self.timeout * 0.95:
                return _CANCELLED, CallFailed.from_rpc(exc)  # the client's own deadline ran out: no verdict on the node
            return exc.code(), CallFailed.from_rpc(exc)
        if isinstance(exc, asyncio.CancelledError):
            if node.claim_abandoned(self.task):
                return _UNAVAILABLE, CallFailed(_UNAVAILABLE, f"node {node.name} stopped answering its health "
                                                              f"probes before the {self.what}'s first reply")
            if self.task.cancelling() == 0:  # not our cancel: the node's channel closed (it left the fleet)
                return _UNAVAILABLE, CallFailed(_UNAVAILABLE, f"node {node.name} left the fleet during the {self.what}")
            return _CANCELLED, None
        if isinstance(exc, Exception):  # e.g. a channel closed under us: the node, not the client
            return _UNAVAILABLE, CallFailed(_UNAVAILABLE, f"node {node.name}: {type(exc).__name__}: {exc}")
        return _CANCELLED, None  # GeneratorExit: the client left a stream

    def _record(self) -> None:
        node, ok = self.node, self.code == _OK
        self.waiting.discard(self.task)
        node.in_flight -= 1
        elapsed = time.perf_counter() - self.started
        if self.admitted:
            node.record(self.code, elapsed if ok and self.model else None)
        if ok and self.model:
            self.latency.record((node.name, self.model), elapsed)
