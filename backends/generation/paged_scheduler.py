"""Continuous batching over a paged KV cache (the torch runtime's scheduler).

Same interface as SlotScheduler (schedule / update, see interface.py), same
token-budget loop: caught-up sequences first (one token plus drafts), then
prompt chunks. Blocks come from a BlockManager; a new prompt starts after
its cached prefix. When blocks run out, the most recently admitted sequence
is preempted by recompute: its blocks are released (hashed ones stay
cached) and it waits to be prefilled again. Each plan item carries the
sequence's block table, so the executor never reads the BlockManager. No
torch, no numpy.

LoRA adapters: each sequence runs under an adapter id (0: the base), carried
in its plan items; at most max_loras_per_batch distinct adapters run at
once, and a waiting sequence of another adapter waits until one of them
has no sequence left. A prompt computed under one adapter has other KV than
under another, so each adapter's blocks are hashed in a namespace of its
own (the block manager's salt): the prefix cache never shares blocks across
adapters, nor between an adapter and the base.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Mapping

from modeld.backends.generation.block_manager import BlockManager
from modeld.backends.generation.interface import PagedWork, StepPlan
from modeld.backends.generation.scheduler import Admission, BaseScheduler
from modeld.backends.generation.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class PagedConfig:
    num_blocks: int
    block_size: int
    context_length: int
    max_running: int = 16
    max_step_tokens: int = 512
    max_waiting: int = 256
    admission: Admission | None = None  # None: continuous
    max_loras_per_batch: int = 4  # distinct LoRA adapters running at once (the base is not one)

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks * self.block_size


# The adapter a sequence being added runs under (0: the base). An adapter
# model sets it around its base loop's generate(), which calls add()
# synchronously in the requester's own task: the value is that request's.
REQUEST_ADAPTER: ContextVar[int] = ContextVar("modeld_request_adapter", default=0)


def adapter_salt(adapter: int) -> bytes:
    """The prefix-cache namespace of an adapter's sequences (b"" for the
    base, 0), as PromptBlocks hashes a prompt for that adapter."""
    return adapter.to_bytes(8, "little") if adapter else b""


class PagedScheduler(BaseScheduler):
    def __init__(self, config: PagedConfig) -> None:
        super().__init__(config)
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.min_shared_prefix = config.block_size  # the cache shares whole blocks
        self.num_preemptions = 0
        self.adapter_of: dict[int, int] = {}  # seq id -> adapter id, for sequences not of the base

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        adapter = REQUEST_ADAPTER.get()
        if adapter:
            self.adapter_of[seq.seq_id] = adapter

    def num_sequences_of(self, adapter: int) -> int:
        """Sequences waiting or running under an adapter."""
        return sum(1 for a in self.adapter_of.values() if a == adapter)

    def _next_waiting(self) -> Sequence | None:
        running = {self.adapter_of.get(s.seq_id, 0) for s in self.running} - {0}
        full = len(running) >= self.config.max_loras_per_batch
        for seq in self.waiting:
            if seq.is_cancelled or self._waits_for_prefix(seq):
                continue
            adapter = self.adapter_of.get(seq.seq_id, 0)
            if full and adapter and adapter not in running:
                continue  # the step mixes max_loras_per_batch adapters already
            return seq
        return None

    def _shares_cache(self, a: Sequence, b: Sequence) -> bool:
        return self.adapter_of.get(a.seq_id, 0) == self.adapter_of.get(b.seq_id, 0)

    def _salt(self, seq: Sequence) -> bytes:
        """seq's prefix-cache namespace: b"" for the base, the adapter's id
        otherwise (an id names one adapter's weights, so an unloaded
        adapter's blocks are never another's)."""
        return adapter_salt(self.adapter_of.get(seq.seq_id, 0))

    def _finish(self, seq: Sequence, reason) -> None:
        super()._finish(seq, reason)
        self.adapter_of.pop(seq.seq_id, None)

    @property
    def num_used_cells(self) -> int:
        return self.blocks.num_used * self.config.block_size

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, drafts: Mapping[int, list[int]] | None = None) -> StepPlan[PagedWork]:
        drafts = drafts or {}
        budget = self.config.max_step_tokens
        # by seq id, so a sequence preempted later in this call loses the item it already got
        work: dict[int, PagedWork] = {}
        live = [s for s in self.running if not s.is_cancelled]
        for seq in [s for s in live if not s.is_prefilling]:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below to make room
            proposed = drafts.get(seq.seq_id, [])
            tokens = seq.token_ids[seq.num_computed:] + proposed
            if len(tokens) > budget or not self._grow(seq, seq.num_computed + len(tokens), work):
                proposed, tokens = [], tokens[:1]
                if len(tokens) > budget or not self._grow(seq, seq.num_computed + 1, work):
                    continue
            work[seq.seq_id] = self._work(seq, tokens, len(tokens), len(proposed))
            budget -= len(tokens)
        for seq in [s for s in live if s.is_prefilling]:
            if budget <= 0 or seq.status is not SeqStatus.RUNNING:
                continue
            item = self._chunk(seq, budget)
            if item is not None:
                work[seq.seq_id] = item
                budget -= len(item.token_ids)
        quota = self._admission_quota()
        while quota > 0 and budget > 0 and len(self.running) < self.config.max_running:
            quota -= 1
            seq = self._next_waiting()
            item = None if seq is None else self._admit(seq, budget)
            if item is None:
                break
            work[seq.seq_id] = item
            budget -= len(item.token_ids)
        return StepPlan((), tuple(work.values()))

    def _work(self, seq: Sequence, tokens: list[int], num_logits: int, num_drafts: int) -> PagedWork:
        return PagedWork(seq.seq_id, seq.num_computed, tuple(tokens), num_logits, num_drafts,
                         tuple(self.blocks.tables[seq.seq_id]), self.adapter_of.get(seq.seq_id, 0))

    def _chunk(self, seq: Sequence, budget: int) -> PagedWork | None:
        remaining = seq.token_ids[seq.num_computed:]
        chunk = remaining[:budget]
        if not self.blocks.grow(seq.seq_id, seq.num_computed + len(chunk)):
            return None
        return self._work(seq, chunk, 1 if len(chunk) == len(remaining) else 0, 0)

    def _admit(self, seq: Sequence, budget: int) -> PagedWork | None:
        if seq.params.cache_prompt:
            cached = self.blocks.match_prefix(seq.seq_id, seq.token_ids, self._salt(seq))
        else:
            cached = 0
            self.blocks.start_sequence(seq.seq_id, self._salt(seq))
        seq.num_computed = cached
        item = self._chunk(seq, budget)
        if item is None:
            self.blocks.free_sequence(seq.seq_id)
            seq.num_computed = 0
            return None
        if seq.num_output == 0:
            seq.num_cached_prompt = cached
        self._start(seq)
        return item

    def _grow(self, seq: Sequence, num_tokens: int, work: dict[int, PagedWork]) -> bool:
        """Blocks for num_tokens, preempting later-admitted sequences if needed."""
        while not self.blocks.grow(seq.seq_id, num_tokens):
            victims = [s for s in self.running if s is not seq]
            if not victims:
                return False
            # a cancelled sequence's blocks go first: update() drops it from the queue anyway
            victim = next((s for s in victims if s.is_cancelled), victims[-1])
            self._preempt(victim)
            work.pop(victim.seq_id, None)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq.seq_id)
        seq.num_computed = 0
        self._enqueue(seq)
        self.num_preemptions += 1

    def _computed(self, seq: Sequence) -> None:
        if seq.params.cache_prompt:
            self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)

    def _trim(self, seq: Sequence, pos: int) -> None:
        self.blocks.shrink(seq.seq_id, pos)

    def _release(self, seq: Sequence) -> None:
        self._computed(seq)
        self.blocks.free_sequence(seq.seq_id)
