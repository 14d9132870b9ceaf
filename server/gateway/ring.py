"""The model ring: consistent hashing of model ids onto nodes.

Each node owns `vnodes` points on a 64-bit ring (xxh64 of f"{node}#{i}"); a
key belongs to the owner of the first point at or after its own hash, going
clockwise and wrapping around. The next distinct owners along the ring are its
further replicas, so adding or removing one node only moves the keys whose
walk passes through that node's points (about 1/n of them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import chain, islice

import xxhash


def ring_hash(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8"))


class HashRing:
    """Sorted ring points with their owners, searched by bisection.

    Invariant: the points (`_hashes[i]`, `_owners[i]`) are sorted by (hash,
    node). Ties are broken by node name, so the ring depends only on its set
    of nodes, not on the order they joined in. Every change builds new lists,
    so a walk in progress keeps the ring it started on.
    """

    def __init__(self, vnodes: int = 150) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        self._vnodes = vnodes
        self._nodes: frozenset[str] = frozenset()
        self._hashes: list[int] = []
        self._owners: list[str] = []

    @property
    def vnodes(self) -> int:
        return self._vnodes

    @property
    def nodes(self) -> frozenset[str]:
        return self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        if node in self._nodes:
            return
        new_points = sorted((ring_hash(f"{node}#{i}"), node) for i in range(self._vnodes))
        self._hashes, self._owners = _merge(self._hashes, self._owners, new_points)
        self._nodes = self._nodes | {node}

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            return
        kept = [(h, owner) for h, owner in zip(self._hashes, self._owners) if owner != node]
        self._hashes = [h for h, _ in kept]
        self._owners = [owner for _, owner in kept]
        self._nodes = self._nodes - {node}

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, in ring order clockwise from the key's position."""
        hashes, owners, num_nodes = self._hashes, self._owners, len(self._nodes)
        if not num_nodes:
            return
        start = bisect_left(hashes, ring_hash(key))
        seen: set[str] = set()
        for i in chain(range(start, len(owners)), range(start)):
            owner = owners[i]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == num_nodes:
                    return

    def replicas(self, key: str, k: int) -> list[str]:
        """The first k nodes of `walk(key)`; fewer when the ring has fewer."""
        return list(islice(self.walk(key), max(k, 0)))


def _merge(hashes: list[int], owners: list[str], new_points: list[tuple[int, str]]) -> tuple[list[int], list[str]]:
    """The ring's columns with the sorted `new_points` merged in: a bisection
    per new point and slice copies between them, so adding a node costs
    O(vnodes log n) comparisons and a memory copy, not a sort of the ring."""
    merged_hashes: list[int] = []
    merged_owners: list[str] = []
    start = 0
    for h, node in new_points:
        at = bisect_left(hashes, h, start)
        while at < len(hashes) and hashes[at] == h and owners[at] < node:
            at += 1
        merged_hashes += hashes[start:at]
        merged_owners += owners[start:at]
        merged_hashes.append(h)
        merged_owners.append(node)
        start = at
    merged_hashes += hashes[start:]
    merged_owners += owners[start:]
    return merged_hashes, merged_owners
