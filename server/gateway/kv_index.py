"""Which node holds which KV blocks, from the daemons' own prefix-cache
events (modeld.v1.Node/WatchKvEvents), and the cost that routes on it.

Each node's index (model -> block size and set of chain hashes) is rebuilt
from the snapshot its stream opens with and kept by the deltas after it; it
is dropped whenever the stream ends, fails or says something that cannot be
true (a delta before any snapshot, a sequence number out of order, a block
size of 0, more hashes than a node can hold): routing then falls back to
the prompt-text guess (prefix.py) for that node until a new stream's
snapshot arrives.

Beside what the events say, each index holds the blocks of the prompts this
gateway has just sent the node (`expect`, `settle`), as Dynamo's router
counts a request's blocks on the worker it chose before the worker reports
them: a prompt's blocks reach the events only once the node has computed
them (a long prompt's prefill takes seconds on a CPU), and until then a
second prompt with the same new prefix (another conversation on the same
system prompt) would see no node holding it and start it on another node,
which then holds the prefix too and splits its conversations over two
caches. They count while the call runs and PENDING_GRACE_S after it ends,
by which time the node's events say whether its cache kept them.

The cost is NVIDIA Dynamo's KV router's (with a larger weight, see OVERLAP_WEIGHT):

    cost(node) = overlap_weight * (prompt blocks - blocks the node holds)
                 + blocks active there

the blocks the node must compute for this prompt against the blocks its
running sequences hold (here: the prompt blocks of the generations this
gateway has in flight there); the lowest cost wins.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
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
# A sent prompt's blocks count on its node this long after its call ended:
# the node gathers its cache's changes every 50 ms (nodes.KV_WATCH_INTERVAL_MS)
# and the ended call's blocks are in the next message; a claim past what the
# cache kept costs at most one miss within this time.
PENDING_GRACE_S = 1.0


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


class PendingBlocks:
    """Blocks of one model's prompts sent to a node that its events may not
    show yet: hash -> calls running with it, and hash -> until when it still
    counts after its last call ended (in order of that time)."""

    __slots__ = ("block_size", "running", "ending")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.running: Counter[int] = Counter()
        self.ending: dict[int, float] = {}

    def holds(self, h: int, now: float) -> bool:
        return h in self.running or self.ending.get(h, -1.0) > now

    def prune(self, now: float) -> None:
        ending = self.ending
        while ending:
            h = next(iter(ending))
            if ending[h] > now:
                break
            del ending[h]


class NodeKvIndex:
    """One node's prefix caches as its event stream tells them, and the
    blocks of the prompts just sent there (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.models: dict[str, ModelBlocks] = {}
        self.pending: dict[str, PendingBlocks] = {}
        self.next_sequence = 0
        self.live = False  # a snapshot came on the current stream
        self._clock = clock

    @property
    def num_hashes(self) -> int:
        return sum(len(m.hashes) for m in self.models.values())

    def num_blocks(self, model: str) -> int:
        """Blocks of `model` its cache holds, or will once the prompts sent
        there are computed."""
        blocks = self.models.get(model)
        held = blocks.hashes if blocks is not None else set()
        pending = self.pending.get(model)
        if pending is None:
            return len(held)
        now = self._clock()
        extra = {h for h in (*pending.running, *pending.ending) if h not in held and pending.holds(h, now)}
        return len(held) + len(extra)

    def clear(self) -> None:
        self.models.clear()
        self.pending.clear()  # the stream ended: the node restarted or left, its cache is gone
        self.next_sequence = 0
        self.live = False

    def expect(self, prompt: PromptBlocks) -> None:
        """A call with this prompt was sent here: its blocks count as held."""
        if not prompt.hashes:
            return
        pending = self.pending.get(prompt.model)
        if pending is None or pending.block_size != prompt.block_size:
            pending = self.pending[prompt.model] = PendingBlocks(prompt.block_size)
        pending.running.update(prompt.hashes)

    def settle(self, prompt: PromptBlocks) -> None:
        """That call ended: its blocks count for PENDING_GRACE_S more, then
        only as the node's events tell."""
        pending = self.pending.get(prompt.model)
        if pending is None or pending.block_size != prompt.block_size:
            return  # cleared meanwhile (the stream ended)
        now = self._clock()
        pending.prune(now)
        until = now + PENDING_GRACE_S
        for h in prompt.hashes:
            left = pending.running.get(h, 0) - 1
            if left > 0:
                pending.running[h] = left
                continue
            pending.running.pop(h, None)
            pending.ending.pop(h, None)  # re-inserted at the end: the dict stays in order of time
            pending.ending[h] = until
        if not pending.running and not pending.ending:
            del self.pending[prompt.model]

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
        prefix: a later block without the ones before it is of no use),
        counting those of the prompts just sent here."""
        blocks = self.models.get(prompt.model)
        held = blocks.hashes if blocks is not None and blocks.block_size == prompt.block_size else ()
        pending = self.pending.get(prompt.model)
        if pending is not None and pending.block_size != prompt.block_size:
            pending = None
        now = self._clock() if pending is not None else 0.0
        count = 0
        for h in prompt.hashes:
            if h not in held and (pending is None or not pending.holds(h, now)):
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
