"""Continuous batching over a paged KV cache (the torch runtime's scheduler).

Same interface as SlotScheduler (schedule / update, see interface.py), same
token-budget loop: caught-up sequences first (one token plus drafts), then
prompt chunks. Blocks come from a BlockManager; a new prompt starts after
its cached prefix. When blocks run out, the most recently admitted sequence
is preempted by recompute: its blocks are released (hashed ones stay
cached) and it waits to be prefilled again. Each plan item carries the
sequence's block table, so the executor never reads the BlockManager. No
torch, no numpy.
"""

from __future__ import annotations

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

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks * self.block_size


class PagedScheduler(BaseScheduler):
    def __init__(self, config: PagedConfig) -> None:
        super().__init__(config)
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.min_shared_prefix = config.block_size  # the cache shares whole blocks
        self.num_preemptions = 0

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
                         tuple(self.blocks.tables[seq.seq_id]))

    def _chunk(self, seq: Sequence, budget: int) -> PagedWork | None:
        remaining = seq.token_ids[seq.num_computed:]
        chunk = remaining[:budget]
        if not self.blocks.grow(seq.seq_id, seq.num_computed + len(chunk)):
            return None
        return self._work(seq, chunk, 1 if len(chunk) == len(remaining) else 0, 0)

    def _admit(self, seq: Sequence, budget: int) -> PagedWork | None:
        if seq.params.cache_prompt:
            cached = self.blocks.match_prefix(seq.seq_id, seq.token_ids)
        else:
            cached = 0
            self.blocks.start_sequence(seq.seq_id)
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
