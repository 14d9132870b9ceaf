"""Simulate the gateway's model ring: how evenly it spreads models over nodes,
and how many models move when a node joins.

Models "model-0" .. are placed on nodes "node-0" .. by the real HashRing
(xxh64, `vnodes` points per node). Figures:

- max_over_mean: the busiest node's primary count over the mean (goal <= 1.1);
  also with every model counted on its k=2 replicas, and with the bounded-load
  placement the gateway does at run time (each model in turn to its first
  replica with room under capacity(), bound 1.1), which meets the goal by
  construction: it is the ring's spread that the bound corrects;
  max_over_mean_uniform is the noise floor for comparison: the same models
  thrown on the nodes uniformly at random (seeded), as a perfect hash would;
  with 100 models per node its spread alone is near 1.25;
- moved_fraction: the share of models whose primary changed when one node
  joins (goal <= 1/(n+1) + 5%); all of them should move to the new node;
- left_moved_fraction: the same when a node leaves (only its own models move).

Deterministic: the hash has no seed. Prints one summary line on stderr and the
JSON record on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import random
import time
from collections import Counter
from statistics import pstdev

from modeld.server.gateway.balance import capacity
from modeld.server.gateway.ring import HashRing

GOAL_MAX_OVER_MEAN = 1.1
GOAL_MOVED_SLACK = 0.05
BOUNDED_LOAD_BOUND = 1.1


def _ring(nodes: list[str], vnodes: int) -> HashRing:
    ring = HashRing(vnodes)
    for node in nodes:
        ring.add(node)
    return ring


def _spread(counts: Counter[str], nodes: list[str]) -> dict[str, float]:
    values = [counts.get(n, 0) for n in nodes]
    mean = sum(values) / len(values)
    return {
        "max_over_mean": max(values) / mean,
        "min_over_mean": min(values) / mean,
        "stdev_over_mean": pstdev(values) / mean,
    }


def _bounded_primaries(ring: HashRing, models: list[str], bound: float) -> Counter[str]:
    """Each model in turn to the first node along its walk with room, as
    place() does with load = models already placed."""
    counts: Counter[str] = Counter()
    for i, model in enumerate(models):
        room = capacity(i, len(ring), bound)
        node = next(n for n in ring.walk(model) if counts[n] + 1 <= room)
        counts[node] += 1
    return counts


def _uniform_primaries(nodes: list[str], num_models: int, seed: int = 0) -> Counter[str]:
    rng = random.Random(seed)
    return Counter(rng.choice(nodes) for _ in range(num_models))


def ring_simulation(nodes: int = 100, models: int = 10_000, vnodes: int = 150) -> dict:
    started = time.perf_counter()
    node_names = [f"node-{i}" for i in range(nodes)]
    model_names = [f"model-{j}" for j in range(models)]
    ring = _ring(node_names, vnodes)

    primaries = {m: ring.replicas(m, 1)[0] for m in model_names}
    primary_spread = _spread(Counter(primaries.values()), node_names)
    replica_spread = _spread(Counter(n for m in model_names for n in ring.replicas(m, 2)), node_names)
    bounded_spread = _spread(_bounded_primaries(ring, model_names, BOUNDED_LOAD_BOUND), node_names)
    uniform_spread = _spread(_uniform_primaries(node_names, models), node_names)

    newcomer = f"node-{nodes}"
    ring.add(newcomer)
    joined = {m: ring.replicas(m, 1)[0] for m in model_names}
    moved = [m for m in model_names if joined[m] != primaries[m]]
    ring.remove(newcomer)

    leaver = node_names[0]
    ring.remove(leaver)
    left = {m: ring.replicas(m, 1)[0] for m in model_names}
    left_moved = [m for m in model_names if left[m] != primaries[m]]

    moved_fraction = len(moved) / models
    bound = 1 / (nodes + 1) + GOAL_MOVED_SLACK
    return {
        "nodes": nodes,
        "models": models,
        "vnodes": vnodes,
        "max_over_mean": primary_spread["max_over_mean"],
        "min_over_mean": primary_spread["min_over_mean"],
        "stdev_over_mean": primary_spread["stdev_over_mean"],
        "max_over_mean_k2": replica_spread["max_over_mean"],
        "max_over_mean_bounded": bounded_spread["max_over_mean"],
        "bounded_load_bound": BOUNDED_LOAD_BOUND,
        "max_over_mean_uniform": uniform_spread["max_over_mean"],
        "moved_fraction": moved_fraction,
        "bound": bound,
        "moved_only_to_new_node": all(joined[m] == newcomer for m in moved),
        "left_moved_fraction": len(left_moved) / models,
        "left_moved_only_its_own": all(primaries[m] == leaver for m in left_moved),
        "spread_goal_met": primary_spread["max_over_mean"] <= GOAL_MAX_OVER_MEAN,
        "spread_goal_met_k2": replica_spread["max_over_mean"] <= GOAL_MAX_OVER_MEAN,
        "moved_goal_met": moved_fraction <= bound,
        "seconds": time.perf_counter() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--vnodes", type=int, default=150)
    args = parser.parse_args()
    result = ring_simulation(args.nodes, args.models, args.vnodes)
    print(
        f"ring {args.nodes} nodes x {args.models} models x {args.vnodes} vnodes: "
        f"max/mean {result['max_over_mean']:.3f} (k=2 {result['max_over_mean_k2']:.3f}, "
        f"bounded {result['max_over_mean_bounded']:.3f}, uniform random {result['max_over_mean_uniform']:.3f}), "
        f"join moved {result['moved_fraction']:.4f} (bound {result['bound']:.4f}), {result['seconds']:.2f} s",
        file=sys.stderr,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
