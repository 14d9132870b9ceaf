"""Which node holds which KV blocks, from the daemons' own prefix-cache
events (modeld.v1.Node/WatchKvEvents), and the cost that routes on it.

Each node's index (model -> block size and set of chain hashes) is rebuilt
from the snapshot its stream opens with and kept by the deltas after it; it
is dropped whenever the stream ends, fails or says something that cannot be
true (a delta before any snapshot, a sequence number out of order, a block
size of 0, more hashes than a node can hold): routing then falls back to
the prompt-text guess (prefix.py) for that node until a new stream's
snapshot arrives.

The cost is NVIDIA Dynamo's KV router's (with a larger weight, see OVERLAP_WEIGHT):

    cost(node) = overlap_weight * (prompt blocks - blocks the node holds)
                 + blocks active there

the blocks the node must compute for this prompt against the blocks its
running sequences hold (here: the prompt blocks of the generations this
gateway has in flight there); the lowest cost wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from modeld.gen import node_pb2

MAX_BLOCK_SIZE = 4096
MAX_HASHES_PER_NODE = 4_000_000  # far past any cache's blocks: more is a broken stream
MAX_MODELS_PER_NODE = 4096
# Dynamo's default weight is 1. Here that sent a prompt away from the node
# holding its blocks as soon as that node had one more call in flight than a
# cold one (its N prompt blocks against one call's N active blocks): on the
# 24-conversation bench (bench/bench_kv_routing.py, 3 calls at a time) it
# served 0.45 of the ideal cached tokens, below round robin's 0.86, with 3x
# the TTFT. A prefill block costs its 16 positions' compute once; an active
# block slows each step a little: the overlap weighs 4 times as much.
OVERLAP_WEIGHT = 4.0


class KvEventError(ValueError):
    """A KV event stream said something no cache can mean."""


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt's chain hashes, as the model's caches key them."""

    model: str
    block_size: int
    hashes: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class ModelBlocks:
    __slots__ = ("block_size", "hashes")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.hashes: set[int] = set()


class NodeKvIndex:
    """One node's prefix caches as its event stream tells them."""

    def __init__(self) -> None:
        self.models: dict[str, ModelBlocks] = {}
        self.next_sequence = 0
        self.live = False  # a snapshot came on the current stream

    @property
    def num_hashes(self) -> int:
        return sum(len(m.hashes) for m in self.models.values())

    def num_blocks(self, model: str) -> int:
        """Blocks of `model` its cache holds."""
        blocks = self.models.get(model)
        return len(blocks.hashes) if blocks is not None else 0

    def clear(self) -> None:
        self.models.clear()
        self.next_sequence = 0
        self.live = False

    def apply(self, events: node_pb2.KvEvents) -> None:
        """Take one message of the stream; KvEventError (the index cleared)
        when it cannot be a true account of a cache."""
        try:
            self._apply(events)
        except KvEventError:
            self.clear()
            raise

    def _apply(self, events: node_pb2.KvEvents) -> None:
        if events.snapshot:
            self.models.clear()
            self.live = True
        elif not self.live:
            raise KvEventError("a change arrived before the stream's snapshot")
        elif events.sequence != self.next_sequence:
            raise KvEventError(f"message {events.sequence} arrived where {self.next_sequence} was due")
        self.next_sequence = events.sequence + 1
        for change in events.models:
            self._apply_model(change)
        if len(self.models) > MAX_MODELS_PER_NODE or self.num_hashes > MAX_HASHES_PER_NODE:
            raise KvEventError(f"the node claims more than {MAX_MODELS_PER_NODE} models or "
                               f"{MAX_HASHES_PER_NODE} blocks")

    def _apply_model(self, change: node_pb2.ModelKvEvents) -> None:
        if not change.model or len(change.model) > 256:
            raise KvEventError("a model's events name no model (or a name longer than 256 characters)")
        if not 0 < change.block_size <= MAX_BLOCK_SIZE:
            raise KvEventError(f"model {change.model!r}: block size {change.block_size} is not in "
                               f"[1, {MAX_BLOCK_SIZE}]")
        blocks = self.models.get(change.model)
        if change.cleared and not change.stored:
            self.models.pop(change.model, None)
            return
        if blocks is None or change.cleared:
            blocks = self.models[change.model] = ModelBlocks(change.block_size)
        elif blocks.block_size != change.block_size:
            raise KvEventError(f"model {change.model!r}: block size changed from {blocks.block_size} to "
                               f"{change.block_size} without clearing")
        blocks.hashes.difference_update(change.removed)
        blocks.hashes.update(change.stored)

    def overlap(self, prompt: PromptBlocks) -> int:
        """Leading blocks of the prompt this node holds (a cache serves a
        prefix: a later block without the ones before it is of no use)."""
        blocks = self.models.get(prompt.model)
        if blocks is None or blocks.block_size != prompt.block_size:
            return 0
        held = blocks.hashes
        count = 0
        for h in prompt.hashes:
            if h not in held:
                break
            count += 1
        return count


def overlaps(indexes: Mapping[str, NodeKvIndex], nodes: Iterable[str], prompt: PromptBlocks) -> dict[str, int]:
    """node -> leading prompt blocks it holds, for the nodes with any."""
    found = {}
    for node in nodes:
        index = indexes.get(node)
        if index is not None and (count := index.overlap(prompt)):
            found[node] = count
    return found


def cost(prompt_blocks: int, overlap: int, active_blocks: float, weight: float = OVERLAP_WEIGHT) -> float:
    """Dynamo's routing cost (module docstring): lower is better."""
    return weight * (prompt_blocks - overlap) + active_blocks
