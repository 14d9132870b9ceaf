"""The daemons behind the gateway: one channel, breaker, health score, health
watch and stats poller per node, and the fleet that puts them on the ring."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections import Counter
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeld.gen import node_pb2, node_pb2_grpc
from modeld.server.auth import FLEET_CHALLENGE_HEADER, FLEET_PROOF_HEADER
from modeld.server.gateway.breaker import BreakerState, CircuitBreaker, is_server_failure
from modeld.server.gateway.config import GatewaySettings, NodeCredentials
from modeld.server.gateway.kv_index import KvEventError, NodeKvIndex
from modeld.server.gateway.metrics import BREAKER_VALUE, GatewayMetrics
from modeld.server.gateway.ring import HashRing
from modeld.server.gateway.score import NodeHealth

log = structlog.get_logger("modeld.gateway")

_SERVING = health_pb2.HealthCheckResponse.SERVING
SCORE_TTL_S = 0.05
KV_WATCH_INTERVAL_MS = 50
KV_RETRY_MAX_S = 2.0
KV_UNSUPPORTED_RETRY_S = 30.0  # a daemon without WatchKvEvents (an older release)


class Node:
    """One daemon as the gateway sees it.

    `name` is its place on the ring: the address for a static list, the
    daemon's own host name for DNS discovery, because a Kubernetes pod keeps
    its name across restarts but not its IP, and the ring must not move when
    a pod comes back.
    """

    def __init__(self, address: str, settings: GatewaySettings, metrics: GatewayMetrics,
                 on_change: Callable[[Node], None], credentials: NodeCredentials | None = None) -> None:
        self.address = address
        self.name = address
        self.settings = settings
        self.metrics = metrics
        self._on_change = on_change
        credentials = credentials if credentials is not None else NodeCredentials()
        # the gateway's own calls (health Watch, Stats) carry its token;
        # forwarded calls carry the client's metadata only (call_options.CallOptions)
        self._probe_metadata = credentials.probe_metadata
        self._credentials = credentials
        # admitted: it proved it holds the fleet token, or no proof is asked
        # (its TLS certificate is the proof, or the gateway has no token)
        self.admitted = not settings.fleet_proof_required
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # a restarted node must be dialled again at once, not after
            # grpc's default reconnect backoff of up to two minutes
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.min_reconnect_backoff_ms", 100),
            *credentials.options,
        ]
        if credentials.channel_credentials is not None:
            self.channel = grpc.aio.secure_channel(address, credentials.channel_credentials, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        self.last_error = ""        # why the health watch last failed: UNAVAILABLE's answer names it
        # a refused handshake reads only "Socket closed": name the likely cause
        # while the node has never answered (set up wrongly rather than down)
        if not credentials.tls:
            self._connect_hint = "if the daemon serves TLS, give the gateway --node-tls-ca"
        elif not settings.node_tls_cert:
            self._connect_hint = "if the daemon requires client certificates, give --node-tls-cert/--node-tls-key"
        else:
            self._connect_hint = ""
        self._stats_refused = False  # Stats answered UNAUTHENTICATED or PERMISSION_DENIED (logged once)
        self.breaker = CircuitBreaker(settings.breaker, on_transition=self._on_transition)
        self.health = NodeHealth(settings.weights)
        self.serving = False        # the health Watch's latest word
        self.ever_served = False    # on the ring from its first SERVING on
        self.responsive = True      # its last Stats poll answered in time
        self.stats: node_pb2.NodeStats | None = None
        self.stats_at = 0.0
        self.in_flight = 0          # calls this gateway has open on the node
        self._score, self._score_at = 1.0, -1.0
        self._ready_models: frozenset[str] = frozenset()
        self.bases: dict[str, str] = {}  # LoRA adapter -> its base model, as the node's repository lists it
        self.pulling: dict[str, tuple[int, int]] = {}  # model -> (bytes done, total) while the node pulls it
        self._pull_waits: frozenset[str] = frozenset()  # of those, models whose calls wait for it (while_pulling)
        self.kv = NodeKvIndex()  # its prefix caches, from its WatchKvEvents stream
        self._kv_models_gauge = metrics.kv_models.labels(self.address)
        self._kv_blocks_gauge = metrics.kv_blocks.labels(self.address)
        self.kv_active_blocks = 0  # prompt blocks of the KV-routed generations this gateway has open here
        self.calls: set[asyncio.Task] = set()   # tasks awaiting a unary call here
        # tasks awaiting a fan-out (a load or unload sent to every replica):
        # they have no other node to move to, so a late Stats answer alone
        # (a node busy loading a model) must not cancel them; only an open
        # breaker or the node leaving the fleet does
        self.fanouts: set[asyncio.Task] = set()
        self._abandoned: set[asyncio.Task] = set()
        self._methods: dict[tuple[str, str], object] = {}
        self._tasks: list[asyncio.Task] = []
        metrics.breaker_state.labels(address).set(0)

    # -- what routing reads ----------------------------------------------------

    @property
    def routable(self) -> bool:
        return self.responsive and self.usable

    @property
    def usable(self) -> bool:
        """Routable but for a late Stats answer: when every node is slow to
        answer (a busy machine), calls still go to one of these rather than fail."""
        return self.serving and not (self.stats is not None and self.stats.draining) and self.breaker.would_allow()

    def load(self) -> float:
        """Calls in flight there: this gateway's own count, which is exact
        and current, or the node's, which also holds other gateways' calls
        but is up to one poll old; the larger. (Adding them would count this
        gateway's calls twice.)"""
        reported = self.stats.in_flight if self.stats is not None else 0
        return max(self.in_flight, reported)

    def has_model(self, model: str) -> bool:
        return model in self._ready_models

    def is_pulling(self, model: str) -> bool:
        """The node is fetching the model from the store (issue 31's
        PULLING): it will serve it, but not yet."""
        return model in self.pulling

    def resident_for(self, model: str) -> bool:
        """What placement counts as holding the model: ready, or pulling it
        with calls waiting there (while_pulling = "wait")."""
        return model in self._ready_models or model in self._pull_waits

    def routes_around_pull(self, model: str) -> bool:
        """Pulling a model whose calls go elsewhere while a replica has it
        ready (its while_pulling = "route", the default)."""
        return model in self.pulling and model not in self._pull_waits

    def score(self) -> float:
        """The health score, recomputed at most every SCORE_TTL_S: it moves
        over seconds, and routing asks for it several times per call."""
        now = time.monotonic()
        if now - self._score_at > SCORE_TTL_S:
            self._score, self._score_at = self.health.score(), now
        return self._score

    # -- calls -----------------------------------------------------------------

    def unary(self, method: str):
        key = ("uu", method)
        if key not in self._methods:
            self._methods[key] = self.channel.unary_unary(method)  # bytes in, bytes out
        return self._methods[key]

    def unary_stream(self, method: str):
        key = ("us", method)
        if key not in self._methods:
            self._methods[key] = self.channel.unary_stream(method)
        return self._methods[key]

    def stream_stream(self, method: str):
        key = ("ss", method)
        if key not in self._methods:
            self._methods[key] = self.channel.stream_stream(method)
        return self._methods[key]

    async def prompt_blocks(self, request: node_pb2.PromptBlocksRequest, timeout: float) -> node_pb2.PromptBlocksResponse:
        """Node/PromptBlocks, the gateway's own call (with its token, not the client's)."""
        return await node_pb2_grpc.NodeStub(self.channel).PromptBlocks(request, timeout=timeout,
                                                                       metadata=self._probe_metadata)

    def _abandon_calls(self, fanouts: bool = False) -> None:
        """Calls waiting on a node that stopped answering would wait as long
        as it stays frozen: cancel them, so each fails over to another node
        as if the node had refused it (see `claim_abandoned`)."""
        for task in [*self.calls, *(self.fanouts if fanouts else ())]:
            self._abandoned.add(task)
            task.cancel()

    def claim_abandoned(self, task: asyncio.Task) -> bool:
        """True when `task` was cancelled by `_abandon_calls`, not by its client."""
        if task in self._abandoned:
            self._abandoned.discard(task)
            task.uncancel()
            return True
        return False

    def record(self, code: grpc.StatusCode | None, latency_s: float | None) -> None:
        """A finished call's verdict for the breaker and the score; client
        errors (bad input, unknown model) say nothing about the node."""
        if code == grpc.StatusCode.OK:
            self.breaker.record_success()
            self.health.record(True, latency_s)
        elif is_server_failure(code):
            self.breaker.record_failure()
            self.health.record(False)
        else:
            self.breaker.release()

    # -- watching --------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.admitted:
            self._tasks = [loop.create_task(self._watch_health()), loop.create_task(self._poll_stats()),
                           loop.create_task(self._watch_kv())]
            self.metrics.admitted.labels(self.address).set(1)
        else:
            self.metrics.admitted.labels(self.address).set(0)
            self._tasks = [loop.create_task(self._admit())]

    async def _admit(self) -> None:
        """Until the node proves it holds the fleet token, it gets no call and
        not even the gateway's own token: the challenge rides on an open
        health Check, and the node answers with an HMAC of it keyed by the
        token's digest (server/auth.py fleet_proof). Then the watches start."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        backoff, logged = 0.1, ""
        while True:
            challenge = secrets.token_urlsafe(24)
            why = ""
            try:
                call = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(1.0, self.settings.stats_timeout_s),
                                  metadata=((FLEET_CHALLENGE_HEADER, challenge),))
                await call
                proof = next((v for k, v in (await call.trailing_metadata() or ()) if k == FLEET_PROOF_HEADER), None)
                expected = self._credentials.expected_proof(challenge)
                if proof is None:
                    why = ("it gave no fleet proof: mark the gateway's token fleet=yes in the daemon's token file "
                           "(or use TLS toward the nodes)")
                elif expected is None or not hmac.compare_digest(str(proof), expected):
                    why = "its fleet proof is wrong: it does not hold the gateway's token (--node-token-file)"
            except grpc.aio.AioRpcError as exc:
                why = f"fleet challenge: {exc.code().name}: {exc.details()}"
                if self._connect_hint and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    why += f" ({self._connect_hint})"
            if not why:
                self.admitted = True
                self.last_error = ""
                self.metrics.admitted.labels(self.address).set(1)
                log.info("node_admitted", node=self.name, address=self.address)
                loop = asyncio.get_running_loop()
                self._tasks += [loop.create_task(self._watch_health()), loop.create_task(self._poll_stats()),
                                loop.create_task(self._watch_kv())]
                return
            self.last_error = f"not admitted to the ring: {why}"
            if why != logged:
                log.warning("node_not_admitted", node=self.name, address=self.address, reason=why)
                logged = why
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.channel.close()

    def _set_serving(self, serving: bool, why: str) -> None:
        if serving == self.serving:
            return
        self.serving = serving
        self.ever_served |= serving
        self.metrics.serving.labels(self.address).set(int(serving))
        log.info("node_serving" if serving else "node_not_serving", node=self.name, address=self.address, reason=why)
        if not serving:
            self.breaker.trip()  # stop sending at once; the stats probes close it again
        else:
            self.breaker.probe_now()  # back: probe it now, not after a period grown while it was down
        self._on_change(self)

    async def _watch_health(self) -> None:
        """The standard health Watch on service "": NOT_SERVING, a drain or a
        broken stream takes the node out of routing at once."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        backoff = 0.1
        while True:
            try:
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""),
                                              metadata=self._probe_metadata):
                    backoff = 0.1
                    self.last_error = ""
                    self._set_serving(reply.status == _SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(
                        reply.status))
                self._set_serving(False, "health watch ended")
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"health watch: {exc.code().name}: {exc.details()}"
                if not self.ever_served and self._connect_hint and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.last_error += f" ({self._connect_hint})"
                self._set_serving(False, self.last_error)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _watch_kv(self) -> None:
        """The node's prefix-cache events into `kv`. The index is dropped
        whenever the stream ends or fails (a restarted node's cache is
        empty; a drained one takes no prompts) and whenever a message is
        garbage; a new stream's snapshot rebuilds it."""
        stub = node_pb2_grpc.NodeStub(self.channel)
        backoff = 0.1
        while True:
            why = "stream ended"
            call = stub.WatchKvEvents(node_pb2.WatchKvEventsRequest(interval_ms=KV_WATCH_INTERVAL_MS),
                                      metadata=self._probe_metadata)
            try:
                async for events in call:
                    self.kv.apply(events)
                    self._count_kv()
                    backoff = 0.1
            except KvEventError as exc:
                why = f"garbage on its KV event stream: {exc}"
                log.warning("node_kv_events_dropped", node=self.name, address=self.address, reason=str(exc))
                call.cancel()
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    backoff = KV_UNSUPPORTED_RETRY_S
                elif exc.code() == grpc.StatusCode.INTERNAL:  # e.g. a message that does not parse
                    log.warning("node_kv_events_dropped", node=self.name, address=self.address, reason=why)
            finally:
                if self.kv.models:
                    log.info("node_kv_index_dropped", node=self.name, address=self.address, reason=why,
                             num_blocks=self.kv.num_hashes)
                self.kv.clear()
                self._count_kv()
            await asyncio.sleep(backoff)
            backoff = min(max(backoff * 2, 0.1), max(backoff, KV_RETRY_MAX_S))

    def _count_kv(self) -> None:
        self._kv_models_gauge.set(len(self.kv.models))
        self._kv_blocks_gauge.set(self.kv.num_hashes)

    async def _poll_stats(self) -> None:
        """Stats on a short deadline: the load figures routing reads, and the
        probe that notices a frozen node (a SIGSTOPped process keeps its
        connections open, so only a deadline tells) and closes a breaker again."""
        stub = node_pb2_grpc.NodeStub(self.channel)
        s = self.settings
        while True:
            started = time.monotonic()
            state = self.breaker.state
            probing = state is BreakerState.HALF_OPEN and self.breaker.allow()
            try:
                stats = await stub.Stats(node_pb2.NodeStatsRequest(), timeout=s.stats_timeout_s,
                                         metadata=self._probe_metadata)
            except grpc.aio.AioRpcError as exc:
                self._note_refusal(exc)
                if not is_server_failure(exc.code()):
                    if probing:
                        self.breaker.release()
                else:
                    if state is BreakerState.CLOSED or probing:
                        self.breaker.record_failure()
                    self.health.record(False)
                    # no new calls until it answers again: the breaker needs
                    # several failures, and every call sent meanwhile would
                    # hang on a frozen node
                    if self.responsive:
                        self.responsive = False
                        log.warning("node_unresponsive", node=self.name, address=self.address,
                                    reason=f"{exc.code().name}: {exc.details()}", timeout_s=s.stats_timeout_s,
                                    calls_moved=len(self.calls))
                        self._abandon_calls()
            except asyncio.CancelledError:
                if probing:
                    self.breaker.release()
                raise
            else:
                self._stats_refused = False
                if probing:
                    self.breaker.record_success()
                self.health.record(True)
                if not self.responsive:
                    self.responsive = True
                    log.info("node_responsive", node=self.name, address=self.address)
                self._take_stats(stats)
            self.metrics.score.labels(self.address).set(self.score())
            self.metrics.in_flight.labels(self.address).set(self.in_flight)
            await asyncio.sleep(max(0.0, s.stats_interval_s - (time.monotonic() - started)))

    def _note_refusal(self, exc: grpc.aio.AioRpcError) -> None:
        """A node with tokens refuses Stats without the gateway's own token:
        routing then lacks its load and models (and under DNS its name), so
        say so once, and how to fix it."""
        if exc.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return
        if not self._stats_refused:
            self._stats_refused = True
            log.warning("node_stats_refused", node=self.name, address=self.address, code=exc.code().name,
                        reason=exc.details(), hint="give the gateway a token with the infer role: --node-token-file")

    def _take_stats(self, stats: node_pb2.NodeStats) -> None:
        if stats.gpu_memory_total_bytes:
            self.health.set_memory(stats.gpu_memory_used_bytes, stats.gpu_memory_total_bytes)
        else:
            self.health.set_memory(stats.memory_used_bytes, stats.memory_budget_bytes)
        self.health.set_in_flight(max(self.in_flight, stats.in_flight))
        first = self.stats_at == 0.0
        self.stats, self.stats_at = stats, time.monotonic()
        bases = {m.name: m.base for m in stats.models if m.base}
        ready = {m.name for m in stats.models if m.state == "READY"}
        # an adapter of a READY base counts as resident: it loads onto the
        # base in milliseconds (a few MiB), where another node would load the base first
        self._ready_models = frozenset(ready | {a for a, b in bases.items() if b in ready})
        bases_changed, self.bases = bases != self.bases, bases
        pulling = {m.name: (m.pull_bytes_done, m.pull_bytes_total) for m in stats.models if m.state == "PULLING"}
        started = pulling.keys() - self.pulling.keys()
        self.pulling = pulling
        self._pull_waits = frozenset(m.name for m in stats.models if m.state == "PULLING" and m.wait_for_pull)
        for model in sorted(started):  # once per pull: an operator sees where calls for the model go meanwhile
            log.info("node_pulling", node=self.name, address=self.address, model=model,
                     calls="wait" if model in self._pull_waits else "route",
                     bytes_done=pulling[model][0], bytes_total=pulling[model][1])
        if self.settings.dns and (first or stats.node_id and stats.node_id != self.name):
            self.name = stats.node_id or self.address
            self._on_change(self)
        elif bases_changed:
            self._on_change(self)  # the fleet's adapter -> base map (Fleet.ring_key)

    def _on_transition(self, old: BreakerState, new: BreakerState) -> None:
        self.metrics.breaker_state.labels(self.address).set(BREAKER_VALUE[new.value])
        self.metrics.breaker_transitions.labels(self.address, old.value, new.value).inc()
        log.info("breaker_transition", node=self.name, address=self.address, from_state=old.value, to_state=new.value)
        if new is BreakerState.OPEN and self.fanouts:
            self._abandon_calls(fanouts=True)  # frozen, not merely slow: fan-outs stop waiting on it


class Fleet:
    """Every known node, and the ring of the ones that may take calls.

    A node joins the ring once its health first says SERVING and leaves it
    only when discovery no longer lists it. A node that is down, frozen or
    draining stays on the ring, so its models do not move (and load
    elsewhere) while it recovers; routing steps past it to the next replica.
    """

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics,
                 credentials: NodeCredentials | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.credentials = credentials if credentials is not None else NodeCredentials.load(settings)
        self.ring = HashRing(settings.vnodes)
        self.by_address: dict[str, Node] = {}
        self.by_name: dict[str, Node] = {}
        self._bases: dict[str, str] = {}  # adapter -> base, over the nodes' repositories
        self.listeners: list[Callable[[], None]] = []
        self._closing: set[asyncio.Task] = set()

    def set_addresses(self, addresses: set[str]) -> None:
        for address in addresses - self.by_address.keys():
            node = Node(address, self.settings, self.metrics, self._changed, self.credentials)
            self.by_address[address] = node
            node.start()
            log.info("node_added", address=address)
        for address in self.by_address.keys() - addresses:
            node = self.by_address.pop(address)
            node._abandon_calls(fanouts=True)  # its waiting calls move to other nodes now
            closing = asyncio.get_running_loop().create_task(node.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            log.info("node_removed", node=node.name, address=address)
        self.metrics.nodes.set(len(self.by_address))
        self._rebuild()

    def _changed(self, _node: Node) -> None:
        self._rebuild()

    def _rebuild(self) -> None:
        # under DNS a node joins once its Stats named it, so it enters the
        # ring under its stable name rather than its address and then moves
        wanted = {n.name: n for n in self.by_address.values()
                  if n.ever_served and (not self.settings.dns or n.stats is not None)}
        for name in self.ring.nodes - wanted.keys():
            self.ring.remove(name)
        for name in wanted.keys() - self.ring.nodes:
            self.ring.add(name)
        self.by_name = wanted
        self._bases = _fleet_bases(self.by_address.values())
        for listener in self.listeners:
            listener()

    def ring_key(self, model: str) -> str:
        """What the ring hashes for `model`: a LoRA adapter's base, so the
        adapter's calls go to the nodes its base lives on (an adapter runs
        on its base's weights: another node would load the base as well);
        any other model's own name."""
        return self._bases.get(model, model)

    def replicas(self, model: str, k: int) -> list[str]:
        """The model's k homes on the ring (its base's, for an adapter)."""
        return self.ring.replicas(self.ring_key(model), k)

    def node(self, name: str) -> Node:
        return self.by_name[name]

    def nodes(self) -> list[Node]:
        return list(self.by_name.values())

    def routable(self) -> list[Node]:
        return [n for n in self.by_name.values() if n.routable]

    def mean_load(self) -> float:
        nodes = self.routable()
        return sum(n.load() for n in nodes) / len(nodes) if nodes else 0.0

    async def close(self) -> None:
        await asyncio.gather(*(n.close() for n in self.by_address.values()))


def _fleet_bases(nodes) -> dict[str, str]:
    """adapter -> base over every node's Stats. Each node lists its whole
    repository (models not loaded included), so an adapter no node has
    loaded yet is known from the first Stats on, and its first call already
    goes to its base's homes. Nodes whose repositories disagree: the base
    most of them name, the first in name order among equals, so every
    gateway picks the same."""
    votes: dict[str, Counter] = {}
    for node in nodes:
        for adapter, base in node.bases.items():
            votes.setdefault(adapter, Counter())[base] += 1
    return {adapter: min(count, key=lambda b: (-count[b], b)) for adapter, count in votes.items()}
