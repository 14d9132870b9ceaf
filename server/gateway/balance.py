"""Placement: which node gets a call. Pure functions of the ring and of what
the gateway knows about each node, passed in as callbacks.

For a model call (`place`), the model id's k ring replicas are the home of the
model; among those the breaker admits and whose health score is above
`min_score`, the call goes

1. to a replica that already has the model loaded, if any (residency);
2. with the daemons' KV events at hand (`kv`), to the one of least KV cost:
   the prompt's blocks it would compute against the blocks active there
   (kv_index.cost, NVIDIA Dynamo's), or, for a prompt no replica holds half
   of, to the one whose cache holds the fewest blocks (sglang's router);
   otherwise to the one whose forwarded prompts share the longest prefix
   with this one, if any (a guess);
3. to the only one left, or by power of two choices among several;

always among replicas within the load bound of consistent hashing with
bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): no node takes more than
ceil(bound * (total load + 1) / nodes) calls. When every good replica is full
the call spills to the next node along the ring that has room; when no replica
is good, to the next good node along the ring.

Update traffic (`place_update`) has no home: power of two choices over all nodes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import islice

from .ring import HashRing

NodePredicate = Callable[[str], bool]
NodeMeasure = Callable[[str], float]


RESIDENT_SLACK = 2.0  # how far past the bound a replica holding the model still takes calls
# A prompt no replica holds this share of goes to the emptiest cache (_least_kv_cost)
CACHE_THRESHOLD = 0.5


class PickReason(str, Enum):
    RING = "ring"  # the only good replica within the bound
    P2C = "p2c"  # power of two choices among good replicas
    SPILL = "spill"  # off the replicas, further along the ring
    PREFIX = "prefix"  # the replica with the longest matching prompt prefix (the text guess)
    KV = "kv"  # the replica of least KV cost, from the daemons' own cache events
    UPDATE = "update"  # update traffic, over all nodes


@dataclass(frozen=True)
class Pick:
    node: str
    reason: PickReason


@dataclass(frozen=True)
class KvRequest:
    """A prompt's standing in the daemons' caches: leading blocks each node
    holds (nodes with none absent), the prompt's blocks in all, and the
    blocks active on a node."""

    overlap: Mapping[str, int]
    num_blocks: int
    active_blocks: NodeMeasure
    overlap_weight: float = 1.0
    held_blocks: NodeMeasure | None = None  # blocks of the model a node holds in all (or will: kv_index.expect)

    def cost(self, node: str) -> float:
        return self.overlap_weight * (self.num_blocks - self.overlap.get(node, 0)) + self.active_blocks(node)


def capacity(total_load: float, num_nodes: int, bound: float = 1.25) -> float:
    """The most calls one node may hold: ceil(bound * (total_load + 1) / num_nodes).
    The +1 counts the call being placed, so an idle fleet still has room."""
    if num_nodes < 1:
        raise ValueError(f"capacity needs at least one node, got {num_nodes}")
    if bound < 1:
        raise ValueError(f"bound must be at least 1 (below it no node ever has room), got {bound}")
    # 1e-9: 1.1 * 10 / 11 is 1.0000000000000002 in floating point, not 1
    return float(math.ceil(bound * (total_load + 1) / num_nodes - 1e-9))


def p2c(candidates: Sequence[str], load: NodeMeasure, score: NodeMeasure, rng: random.Random) -> str:
    """Power of two choices, weighted by health: sample two distinct candidates
    with probability proportional to their score, keep the one with the lower
    (load + 1) / score, or at equal loads one of the two in proportion to score. Sampling by score keeps weak nodes out of most duels,
    and dividing by it makes a weak node win only when it is much less loaded."""
    if not candidates:
        raise ValueError("p2c needs at least one candidate")
    if len(candidates) == 1:
        return candidates[0]
    scores = [max(0.0, score(c)) for c in candidates]
    first = _weighted_index(scores, rng)
    scores[first] = 0.0
    second = _weighted_index(scores, rng, exclude=first)
    a, b = candidates[first], candidates[second]
    if load(a) == load(b):
        # equal loads (an idle fleet, sequential callers): split by score, so
        # a node's share follows its score; comparing (load + 1) / score here
        # would send everything to the higher score and starve a node that is
        # recovering (its score climbs back only through the calls it gets)
        return a if _weighted_index([max(0.0, score(a)), max(0.0, score(b))], rng) == 0 else b
    return a if _cost(a, load, score) <= _cost(b, load, score) else b


def place(
    key: str,
    ring: HashRing,
    k: int,
    *,
    admitted: NodePredicate,
    load: NodeMeasure,
    score: NodeMeasure,
    rng: random.Random,
    min_score: float = 0.2,
    bound: float = 1.25,
    loaded: NodePredicate | None = None,
    prefix: Mapping[str, int] | None = None,
    fleet_load: tuple[float, int] | None = None,
    kv: KvRequest | None = None,
    pulling: NodePredicate | None = None,
) -> Pick | None:
    """Where a call for `key` (a model id) goes; None when no node is admitted.

    Each callback is called at most once per node per placement, and
    `admitted` only as a check (breaker.would_allow): the caller takes the
    breaker's probe with allow() on the node it then calls. `fleet_load`,
    (total load, admitted nodes), spares the survey of every node that the
    capacity needs; a caller placing many calls may pass a figure a few
    milliseconds old.
    """
    view = _FleetView(admitted, load, score, min_score)
    total_load, num_admitted = fleet_load if fleet_load is not None else view.survey(ring.nodes)
    if not num_admitted:
        return None
    view.capacity = capacity(total_load, num_admitted, bound)
    replicas = ring.replicas(key, k)
    eligible = [r for r in replicas if view.is_eligible(r)]
    if eligible:
        return _place_on_replicas(key, ring, replicas, eligible, view, rng, loaded, prefix, kv, pulling)
    return Pick(_spill_without_replicas(key, ring, len(replicas), view), PickReason.SPILL)


def place_update(
    nodes: Iterable[str],
    *,
    admitted: NodePredicate,
    load: NodeMeasure,
    score: NodeMeasure,
    rng: random.Random,
    min_score: float = 0.2,
) -> Pick | None:
    """Update traffic: p2c over every admitted node above min_score, or over
    every admitted node when none is; None when no node is admitted."""
    view = _FleetView(admitted, load, score, min_score)
    # sorted: a set's order changes with the interpreter's hash seed, which
    # would make a seeded rng pick differently from run to run
    pool = [n for n in sorted(set(nodes)) if view.is_admitted(n)]
    good = [n for n in pool if view.is_eligible(n)]
    if not pool:
        return None
    return Pick(p2c(good or pool, view.load, view.score, rng), PickReason.UPDATE)


class _FleetView:
    """The callbacks, each called at most once per node: placement asks the
    same question about a node several times, and a breaker or a load table
    should not see a placement as several requests."""

    def __init__(self, admitted: NodePredicate, load: NodeMeasure, score: NodeMeasure, min_score: float) -> None:
        self._admitted, self._load, self._score = admitted, load, score
        self._min_score = min_score
        self._is_admitted: dict[str, bool] = {}
        self._loads: dict[str, float] = {}
        self._scores: dict[str, float] = {}
        self.capacity = math.inf  # set by place() once the admitted nodes' total load is known

    def survey(self, nodes: Iterable[str]) -> tuple[float, int]:
        """(total load, count) of the admitted nodes; asks every node at once,
        which is most of a placement's cost with a hundred nodes."""
        self._is_admitted = {n: bool(self._admitted(n)) for n in nodes}
        self._loads = {n: float(self._load(n)) for n, ok in self._is_admitted.items() if ok}
        return sum(self._loads.values()), len(self._loads)

    def is_admitted(self, node: str) -> bool:
        if node not in self._is_admitted:
            self._is_admitted[node] = bool(self._admitted(node))
        return self._is_admitted[node]

    def load(self, node: str) -> float:
        if node not in self._loads:
            self._loads[node] = float(self._load(node))
        return self._loads[node]

    def score(self, node: str) -> float:
        if node not in self._scores:
            self._scores[node] = float(self._score(node))
        return self._scores[node]

    def is_eligible(self, node: str) -> bool:
        """Admitted and healthy enough to be chosen on purpose."""
        return self.is_admitted(node) and self.score(node) > self._min_score

    def fits(self, node: str, slack: float = 1.0) -> bool:
        """Within the load bound (times `slack`), counting the call being placed."""
        return self.load(node) + 1 <= self.capacity * slack


def _place_on_replicas(
    key: str,
    ring: HashRing,
    replicas: list[str],
    eligible: list[str],
    view: _FleetView,
    rng: random.Random,
    loaded: NodePredicate | None,
    prefix: Mapping[str, int] | None,
    kv: KvRequest | None = None,
    pulling: NodePredicate | None = None,
) -> Pick:
    resident = [r for r in eligible if loaded(r)] if loaded is not None else []
    if resident and pulling is not None:
        # a replica still pulling the model from the store would hold the
        # call until its download and load finish: while another has the
        # model ready, it is no candidate (with none ready it is the one
        # that will serve first, so the call waits there). A model set to
        # while_pulling = "wait" comes in `loaded` instead, not here.
        eligible = [r for r in eligible if not pulling(r)]
    # A replica that must load the model first pays seconds for that call
    # and may evict another model, which the next call of that one pays for
    # again: where memory holds fewer models than the ring asks of a node,
    # sending calls to a second home whenever the first is at the bound makes
    # both homes load and evict by turns. So a resident replica takes calls
    # up to RESIDENT_SLACK times the bound before one without the model does.
    pool = [r for r in resident if view.fits(r, RESIDENT_SLACK)] or [r for r in eligible if view.fits(r)]
    if pool:
        if kv is not None:
            return _least_kv_cost(pool, view, rng, kv)
        return _choose_within(pool, view, rng, prefix)
    spill = next((n for n in _past_replicas(key, ring, len(replicas)) if view.is_eligible(n) and view.fits(n)), None)
    if spill is not None:
        return Pick(spill, PickReason.SPILL)
    # the whole fleet is at the bound: stay home, on the less loaded replica
    return Pick(p2c(resident or eligible, view.load, view.score, rng), PickReason.P2C)


def _choose_within(pool: list[str], view: _FleetView, rng: random.Random, prefix: Mapping[str, int] | None) -> Pick:
    if prefix:
        longest = max(prefix.get(n, 0) for n in pool)
        if longest > 0:
            # several replicas share the prefix (a common system prompt):
            # spread over them rather than always sending it to the first
            warm = [n for n in pool if prefix.get(n, 0) == longest]
            return Pick(p2c(warm, view.load, view.score, rng), PickReason.PREFIX)
    if len(pool) == 1:
        return Pick(pool[0], PickReason.RING)
    return Pick(p2c(pool, view.load, view.score, rng), PickReason.P2C)


def _least_kv_cost(pool: list[str], view: _FleetView, rng: random.Random, kv: KvRequest) -> Pick:
    """Where a prompt goes on the daemons' KV events.

    A prompt that no replica holds at least CACHE_THRESHOLD of (a new
    system prompt, a one-off) goes to the replica whose cache holds the
    fewest blocks of the model, as sglang's router sends a prompt whose best
    match is under its cache_threshold (0.5) to the worker with the
    smallest tree: what a prompt shares with everything (a chat template's
    header, a common preamble) says nothing about where it belongs, and on
    least cost that block or two sent every new prefix to the node already
    holding one, whose cache then held the conversations of two or three
    system prompts while another node's stayed empty (bench_kv_routing: 56,
    40 and 0 calls of 96; 0.82 of the ideal). The conversations on that
    prefix follow it there by their overlap.

    Otherwise the replica of least KV cost (kv_index.cost, Dynamo's); among
    equals the one holding the fewest blocks, then power of two choices."""
    held = {n: kv.held_blocks(n) for n in pool} if kv.held_blocks is not None else None
    if held is not None and max(kv.overlap.get(n, 0) for n in pool) < CACHE_THRESHOLD * kv.num_blocks:
        fewest = min(held.values())
        tied = [n for n in pool if held[n] == fewest]
        costs = {n: kv.cost(n) for n in tied}
        least = min(costs.values())
        tied = [n for n in tied if costs[n] == least]
    else:
        costs = {n: kv.cost(n) for n in pool}
        least = min(costs.values())
        tied = [n for n in pool if costs[n] == least]
        if len(tied) > 1 and held is not None:
            fewest = min(held[n] for n in tied)
            tied = [n for n in tied if held[n] == fewest]
    return Pick(tied[0] if len(tied) == 1 else p2c(tied, view.load, view.score, rng), PickReason.KV)


def _spill_without_replicas(key: str, ring: HashRing, num_replicas: int, view: _FleetView) -> str:
    """No replica is good: the next good node with room along the ring, else
    the next good node, else the first admitted node at all (place() has
    checked that there is one)."""
    further = list(_past_replicas(key, ring, num_replicas))
    for is_wanted in (lambda n: view.is_eligible(n) and view.fits(n), view.is_eligible):
        found = next((n for n in further if is_wanted(n)), None)
        if found is not None:
            return found
    return next(n for n in ring.walk(key) if view.is_admitted(n))


def _past_replicas(key: str, ring: HashRing, num_replicas: int) -> Iterable[str]:
    return islice(ring.walk(key), num_replicas, None)


def _weighted_index(weights: list[float], rng: random.Random, exclude: int | None = None) -> int:
    """An index drawn with probability proportional to its weight; uniformly
    (never `exclude`) when all weights are zero."""
    total = sum(weights)
    if total <= 0:
        choices = [i for i in range(len(weights)) if i != exclude]
        return choices[rng.randrange(len(choices))]
    target = rng.random() * total
    for i, weight in enumerate(weights):
        target -= weight
        if target < 0 and weight > 0:
            return i
    return max(i for i, weight in enumerate(weights) if weight > 0)  # rounding left target at ~0


def _cost(node: str, load: NodeMeasure, score: NodeMeasure) -> float:
    node_score = score(node)
    return (load(node) + 1) / node_score if node_score > 0 else math.inf
