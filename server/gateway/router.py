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

from modeld.server.gateway.balance import Pick, place, place_update
from modeld.server.gateway.breaker import BreakerState
from modeld.server.gateway.call_options import CallOptions
from modeld.server.gateway.config import GatewaySettings
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.hedge import LatencyTracker, TokenBucket
from modeld.server.gateway.metrics import GatewayMetrics
from modeld.server.gateway.nodes import Fleet, Node
from modeld.server.gateway.prefix import PrefixIndex

log = structlog.get_logger("modeld.gateway")

FLEET_LOAD_TTL_S = 0.005
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

    def place(self, model: str, *, update: bool = False, key: str = "",
              exclude: frozenset[str] = frozenset()) -> tuple[Node, str]:
        """A node for the call and why, with its breaker's admission taken;
        UNAVAILABLE with the reason when no node can take it."""
        strict = True
        for _ in range(2 * max(1, len(self.fleet.by_name))):
            pick = self._pick(model, update, key, exclude, strict)
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

    def _pick(self, model: str, update: bool, key: str, exclude: frozenset[str], strict: bool) -> Pick | None:
        admitted = self._admitted(exclude, strict)
        if update or not model:
            pick = place_update(self.fleet.by_name, admitted=admitted, load=self._load, score=self._score,
                                rng=self.rng, min_score=self.settings.min_score)
            return Pick(pick.node, "any") if pick is not None and not update else pick
        prefix = (self.prefixes.match(key) or None) if key else None
        return place(model, self.fleet.ring, self.settings.replicas, admitted=admitted, load=self._load,
                     score=self._score, rng=self.rng, min_score=self.settings.min_score,
                     bound=self.settings.load_bound,
                     loaded=lambda name: self.fleet.by_name[name].has_model(model), prefix=prefix,
                     fleet_load=None if exclude or not strict else self._fleet_load())

    def _count_pick(self, node: Node, pick: Pick) -> str:
        reason = getattr(pick.reason, "value", pick.reason)
        counter = self._pick_counters.get((node.address, reason))
        if counter is None:  # labels() costs more than the rest of the pick's bookkeeping
            counter = self._pick_counters[node.address, reason] = self.metrics.picks.labels(node.address, reason)
        counter.inc()
        return reason

    def route(self, method: str, model: str, opts: CallOptions, key: str = "") -> Route:
        """The call placed, with its one retry to come."""
        return Route(self, method, model, opts, key)

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
        for name in self.fleet.ring.replicas(model, self.settings.replicas):
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

    __slots__ = ("router", "method", "model", "opts", "key", "node", "_retried")

    def __init__(self, router: Router, method: str, model: str, opts: CallOptions, key: str = "") -> None:
        self.router, self.method, self.model, self.opts, self.key = router, method, model, opts, key
        self._retried = False
        self.node = self._place(frozenset())

    def _place(self, exclude: frozenset[str]) -> Node:
        node, reason = self.router.place(self.model, update=self.opts.update, key=self.key, exclude=exclude)
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
