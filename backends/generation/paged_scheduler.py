"""Continuous batching over a paged KV cache (the torch runtime's scheduler).

Same contract as Scheduler (schedule / finish / trim), same token-budget
loop: caught-up sequences first (one token plus drafts), then prompt chunks.
Blocks come from a BlockManager; a new prompt starts after its cached
prefix. When blocks run out, the most recently admitted sequence is
preempted by recompute: its blocks are released (hashed ones stay cached)
and it waits to be prefilled again. No torch, no numpy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from modeld.backends.generation.block_manager import BlockManager
from modeld.backends.generation.scheduler import Admission, SeqWork, StepPlan
from modeld.backends.generation.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class PagedConfig:
    num_blocks: int
    block_size: int
    context_length: int
    max_running: int = 16
    max_step_tokens: int = 512
    max_waiting: int = 256

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks * self.block_size


class PagedScheduler(Admission):
    def __init__(self, config: PagedConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_used_cells(self) -> int:
        return self.blocks.num_used * self.config.block_size

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> StepPlan:
        self._drop_cancelled()
        for seq in self.running:
            if seq.params.cache_prompt:
                self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        budget = self.config.max_step_tokens
        work: list[SeqWork] = []
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq not in self.running:
                continue  # preempted below to make room
            tokens = seq.token_ids[seq.num_computed:] + seq.draft_ids
            if len(tokens) > budget or not self._grow(seq, seq.num_computed + len(tokens)):
                seq.draft_ids = []
                tokens = tokens[:1]
                if len(tokens) > budget or not self._grow(seq, seq.num_computed + 1):
                    continue
            work.append(SeqWork(seq, -1, seq.num_computed, tuple(tokens), len(tokens)))
            budget -= len(tokens)
        for seq in [s for s in self.running if s.is_prefilling]:
            if budget <= 0 or seq not in self.running:
                continue
            item = self._chunk(seq, budget)
            if item is not None:
                work.append(item)
                budget -= len(item.token_ids)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            item = self._admit(budget)
            if item is None:
                break
            work.append(item)
            budget -= len(item.token_ids)
        return StepPlan((), tuple(w for w in work if w.seq in self.running))

    def _chunk(self, seq: Sequence, budget: int) -> SeqWork | None:
        remaining = seq.token_ids[seq.num_computed:]
        chunk = remaining[:budget]
        if not self.blocks.grow(seq.seq_id, seq.num_computed + len(chunk)):
            return None
        return SeqWork(seq, -1, seq.num_computed, tuple(chunk), 1 if len(chunk) == len(remaining) else 0)

    def _admit(self, budget: int) -> SeqWork | None:
        seq = self.waiting[0]
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
        self.waiting.popleft()
        if seq.num_output == 0:
            seq.num_cached_prompt = cached
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return item

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for num_tokens, preempting later-admitted sequences if needed."""
        while not self.blocks.grow(seq.seq_id, num_tokens):
            victims = [s for s in self.running if s is not seq]
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq.seq_id)
        seq.num_computed = 0
        seq.draft_ids = []
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.is_cancelled]:
            self.finish(seq)
        for seq in [s for s in self.running if s.is_cancelled]:
            self.finish(seq)

    def trim(self, seq: Sequence, pos: int) -> None:
        self.blocks.shrink(seq.seq_id, pos)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            if seq.params.cache_prompt:
                self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            self.blocks.free_sequence(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.blocks.free_sequence(seq.seq_id)
        seq.status = SeqStatus.FINISHED
