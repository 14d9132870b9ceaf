"""Which node has seen which prompt prefixes, approximately, so that a
generation call can go where its prefix is likely still in the KV cache.

A prompt is cut into blocks of `block_chars` characters and each block gets a
chain hash, h_i = xxh64(block_i, seed=h_{i-1}), so one hash stands for the
whole prefix up to and including block i (as in nano-vllm's block manager,
with characters in place of tokens: the gateway does not tokenize). The index
maps each chain hash to the nodes that were sent that prefix, with an LRU over
the hashes. It is a guess at the nodes' caches, not a mirror of them: a node
may have evicted what the index remembers, which costs one cache miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import xxhash


def chain_hashes(text: str, block_chars: int) -> Iterator[int]:
    """One hash per whole block of `text`, lazily (a match usually stops
    early); a trailing partial block has none."""
    h = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = xxhash.xxh64_intdigest(text[start : start + block_chars].encode("utf-8"), seed=h)
        yield h


class PrefixIndex:
    """Chain hash -> nodes holding that prefix, at most `capacity` hashes.

    Invariant: a node listed under h_i is listed under h_0 .. h_{i-1} too,
    since inserting a text touches all its blocks and eviction takes a block's
    entry for every node at once. Inserting touches a text's blocks from the
    last to the first, so a prefix is always more recent than its extensions
    and the LRU evicts the tails of old prompts before their shared heads
    (which would strand the tails, unreachable, in the index).
    """

    def __init__(self, block_chars: int = 64, capacity: int = 200_000) -> None:
        if block_chars < 1 or capacity < 1:
            raise ValueError(f"block_chars and capacity must be at least 1, got {block_chars}, {capacity}")
        self._block_chars = block_chars
        self._capacity = capacity
        self._nodes_by_hash: OrderedDict[int, set[str]] = OrderedDict()  # least recently used first

    @property
    def block_chars(self) -> int:
        return self._block_chars

    def __len__(self) -> int:
        """The number of blocks (chain hashes) held."""
        return len(self._nodes_by_hash)

    def insert(self, node: str, text: str) -> None:
        entries = self._nodes_by_hash
        for h in reversed(list(chain_hashes(text, self._block_chars))):
            holders = entries.get(h)
            if holders is None:
                entries[h] = {node}
            else:
                holders.add(node)
                entries.move_to_end(h)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def match(self, text: str) -> dict[str, int]:
        """node -> characters of the longest prefix of `text` sent to it (a
        multiple of block_chars); nodes with no match are absent. Matching is
        a read: it does not refresh the LRU, only sending the prompt does."""
        matched: dict[str, int] = {}
        for i, h in enumerate(chain_hashes(text, self._block_chars)):
            holders = self._nodes_by_hash.get(h)
            if not holders:
                break
            length = (i + 1) * self._block_chars
            for node in holders:
                matched[node] = length
        return matched

    def remove_node(self, node: str) -> None:
        """Forget a node (it left, or restarted with an empty cache): a scan
        over the whole index, which happens when the fleet changes, not per call."""
        emptied = []
        for h, holders in self._nodes_by_hash.items():
            holders.discard(node)
            if not holders:
                emptied.append(h)
        for h in emptied:
            del self._nodes_by_hash[h]
