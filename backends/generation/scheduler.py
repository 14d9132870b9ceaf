"""Continuous batching: which tokens of which sequences run in the next step.

As in vLLM v1 there is no prefill phase and no decode phase: each sequence's
num_computed catches up with its token_ids inside a per-step token budget.
Running sequences that are caught up go first (one token, plus any draft
tokens); then prompt chunks of sequences still prefilling; then newly
admitted ones. Sequences join and leave between steps. No numpy, no torch:
`schedule()` returns plain data and `finish()` / `advance()` apply results.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from modeld.backends.errors import InvalidArgument, ResourceExhausted
from modeld.backends.generation.sequence import Sequence, SeqStatus
from modeld.backends.generation.slots import KvOp, KvOpKind, SlotPool


@dataclass(frozen=True)
class SeqWork:
    seq: Sequence
    slot: int
    start_pos: int
    token_ids: tuple[int, ...]  # uncomputed tokens, then this step's drafts
    num_logits: int  # logits wanted for the last num_logits tokens (0: prefill chunk)


@dataclass(frozen=True)
class StepPlan:
    kv_ops: tuple[KvOp, ...]
    work: tuple[SeqWork, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)


@dataclass(frozen=True)
class SchedulerConfig:
    num_slots: int  # sequences in the KV cache at once, cached ones included
    kv_capacity: int  # KV cells shared by every slot
    context_length: int  # most tokens one sequence may hold
    max_step_tokens: int = 512
    max_waiting: int = 256


class Admission:
    """What both schedulers do when a request arrives: refuse what could
    never fit, bound the waiting queue. Needs `config` (context_length,
    kv_capacity, max_waiting) and `waiting`."""

    def check(self, seq: Sequence) -> None:
        total = seq.num_prompt + seq.params.max_tokens
        limit = min(self.config.context_length, self.config.kv_capacity - seq.params.num_speculative_tokens)
        if total > limit:
            raise InvalidArgument(
                f"prompt of {seq.num_prompt} tokens plus max_tokens {seq.params.max_tokens} is {total}, "
                f"beyond the context window of {limit} tokens; shorten the prompt or lower max_tokens"
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(
                f"{len(self.waiting)} requests are already waiting (max_waiting); retry later or on another node"
            )
        self.waiting.append(seq)


class Scheduler(Admission):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.slots = SlotPool(config.num_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending_ops: list[KvOp] = []

    @property
    def num_reserved_cells(self) -> int:
        return sum(s.num_reserved for s in self.running)

    @property
    def num_used_cells(self) -> int:
        return sum(s.num_computed for s in self.running) + self.slots.num_cached_cells

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._pending_ops)

    def schedule(self) -> StepPlan:
        self._drop_cancelled()
        budget = self.config.max_step_tokens
        work: list[SeqWork] = []
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        for seq in decoding:
            tokens = seq.token_ids[seq.num_computed:] + seq.draft_ids
            if len(tokens) > budget:
                seq.draft_ids = []
                tokens = tokens[:1]
            if len(tokens) > budget:
                break
            work.append(SeqWork(seq, seq.slot, seq.num_computed, tuple(tokens), len(tokens)))
            budget -= len(tokens)
        for seq in prefilling:
            if budget <= 0:
                break
            work.append(self._chunk(seq, budget))
            budget -= len(work[-1].token_ids)
        while self.waiting and budget > 0 and self._admit():
            seq = self.running[-1]
            work.append(self._chunk(seq, budget))
            budget -= len(work[-1].token_ids)
        ops, self._pending_ops = tuple(self._pending_ops), []
        return StepPlan(ops, tuple(work))

    def _chunk(self, seq: Sequence, budget: int) -> SeqWork:
        remaining = seq.token_ids[seq.num_computed:]
        chunk = remaining[:budget]
        wants_logits = len(chunk) == len(remaining)
        return SeqWork(seq, seq.slot, seq.num_computed, tuple(chunk), 1 if wants_logits else 0)

    def _admit(self) -> bool:
        seq = self.waiting[0]
        free = self.config.kv_capacity - self.num_reserved_cells - self.slots.num_cached_cells
        while free < seq.num_reserved and self.slots.cached:
            self._pending_ops.extend(self.slots.evict_lru())
            free = self.config.kv_capacity - self.num_reserved_cells - self.slots.num_cached_cells
        if free < seq.num_reserved or not self.slots.can_grant():
            return False
        self.waiting.popleft()
        grant = self.slots.grant(seq.prompt_ids, seq, seq.params.cache_prompt)
        self._pending_ops.extend(grant.ops)
        seq.slot, seq.num_computed, seq.num_cached_prompt = grant.slot, grant.num_reused, grant.num_reused
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _drop_cancelled(self) -> None:
        self.waiting = deque(s for s in self.waiting if not s.is_cancelled)
        for seq in [s for s in self.running if s.is_cancelled]:
            self.finish(seq)

    def trim(self, seq: Sequence, pos: int) -> None:
        """Forget KV from `pos` on (rejected draft tokens), before the next step."""
        self._pending_ops.append(KvOp(KvOpKind.TRIM, seq.slot, pos=pos))

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            keep = seq.params.cache_prompt
            self._pending_ops.extend(self.slots.release(seq.slot, seq.num_computed, keep))
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
