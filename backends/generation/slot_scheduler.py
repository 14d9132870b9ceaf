"""The llama.cpp runtime's scheduler: BaseScheduler's token-budget loop
(scheduler.py) over KV kept in llama.cpp's slots, one per sequence, with a
prefix cache over them (slots.py)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Mapping

from modeld.backends.generation.interface import SlotWork, StepPlan
from modeld.backends.generation.scheduler import Admission, BaseScheduler
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.slots import KvOp, KvOpKind, SlotPool


@dataclass(frozen=True)
class SlotConfig:
    num_slots: int  # sequences in the KV cache at once, cached ones included
    kv_capacity: int  # KV cells shared by every slot
    context_length: int  # most tokens one sequence may hold
    max_step_tokens: int = 512
    max_waiting: int = 256
    # llama.cpp copies a slot's KV stream whole (n_ctx / n_slots cells) to
    # share a prefix between slots. Measured here (2 cores, SmolLM2-135M,
    # 2,048-cell streams): a copy costs about what prefilling a few prompt
    # tokens does, so shorter shared prefixes are recomputed instead.
    min_copy_tokens: int = 16
    admission: Admission | None = None  # None: continuous
    # Prompt tokens one step takes, across every prompt in it (decodes are
    # not counted); None: max_step_tokens. On a CPU a prompt token costs
    # about the same in a batch of 256 or in chunks of 32 (one llama_decode
    # or eight: 1.0-1.3 s either way), but every step has a cost of its own
    # (a graph, its barriers, sampling and sending each running stream's
    # token), so under steady arrivals whole prompts in fewer steps serve
    # more tok/s. Smaller chunks let prompts that arrive together get their
    # first tokens one after another, and keep running sequences decoding
    # between the chunks of a long prompt.
    max_prefill_tokens: int | None = None


class SlotScheduler(BaseScheduler):
    """KV in llama.cpp slots (one per sequence), with a prefix cache over them."""

    def __init__(self, config: SlotConfig) -> None:
        super().__init__(config)
        self.slots = SlotPool(config.num_slots, config.min_copy_tokens)
        self.min_shared_prefix = config.min_copy_tokens  # a shorter prefix is recomputed, not copied
        self._pending_ops: list[KvOp] = []

    @property
    def num_reserved_cells(self) -> int:
        return sum(s.num_reserved for s in self.running)

    @property
    def num_used_cells(self) -> int:
        return sum(s.num_computed for s in self.running) + self.slots.num_cached_cells

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._pending_ops)

    def schedule(self, drafts: Mapping[int, list[int]] | None = None) -> StepPlan[SlotWork]:
        drafts = drafts or {}
        budget = self.config.max_step_tokens
        work: list[SlotWork] = []
        live = [s for s in self.running if not s.is_cancelled]
        for seq in [s for s in live if not s.is_prefilling]:
            proposed = drafts.get(seq.seq_id, ())
            tokens = seq.token_ids[seq.num_computed:]
            if len(tokens) + len(proposed) > budget:
                proposed = ()
            if len(tokens) > budget:
                break
            tokens = (*tokens, *proposed)
            work.append(SlotWork(seq.seq_id, seq.num_computed, tokens, len(tokens), len(proposed), seq.slot))
            budget -= len(tokens)
        prefill = min(budget, self.config.max_prefill_tokens or budget)
        for seq in [s for s in live if s.is_prefilling]:
            if prefill <= 0:
                break
            work.append(self._chunk(seq, prefill))
            prefill -= len(work[-1].token_ids)
        quota = self._admission_quota()
        round_wants = self._filling_round(quota)
        while quota > 0 and prefill > 0 and (seq := self._next_waiting()) is not None and self._admit(seq, round_wants):
            work.append(self._chunk(seq, prefill))
            prefill -= len(work[-1].token_ids)
            quota -= 1
        ops, self._pending_ops = tuple(self._pending_ops), []
        return StepPlan(ops, tuple(work))

    def _chunk(self, seq: Sequence, budget: int) -> SlotWork:
        remaining = seq.token_ids[seq.num_computed:]
        chunk = tuple(remaining[:budget])
        wants_logits = len(chunk) == len(remaining)
        return SlotWork(seq.seq_id, seq.num_computed, chunk, 1 if wants_logits else 0, 0, seq.slot)

    def _filling_round(self, quota: int) -> dict[int, int] | None:
        """When the waiting sequences this step may start take every empty
        slot (a burst of concurrent requests), the cached slots their
        prompts reuse (SlotPool.wanted_by); else None. A round the prompt
        budget cuts short leaves the block split until the next step's
        admissions close it."""
        empty = len(self.slots.free) + len(self.slots.cached)
        if not empty:
            return None
        # only as many as could start: the queue behind them may be hundreds long
        starting = list(islice((s for s in self.waiting if not s.is_cancelled and not self._waits_for_prefix(s)),
                               min(quota, empty)))
        if len(starting) < empty:
            return None
        return self.slots.wanted_by(s.prompt_ids for s in starting if s.params.cache_prompt)

    def _admit(self, seq: Sequence, round_wants: dict[int, int] | None = None) -> bool:
        free = self.config.kv_capacity - self.num_reserved_cells - self.slots.num_cached_cells
        while free < seq.num_reserved and self.slots.cached:
            self._pending_ops.extend(self.slots.evict_lru())
            free = self.config.kv_capacity - self.num_reserved_cells - self.slots.num_cached_cells
        if free < seq.num_reserved or not self.slots.can_grant():
            return False
        grant = self.slots.grant(seq.prompt_ids, seq, seq.params.cache_prompt, round_wants)
        self._pending_ops.extend(grant.ops)
        seq.slot, seq.num_computed, seq.num_cached_prompt = grant.slot, grant.num_reused, grant.num_reused
        self._start(seq)
        return True

    def _trim(self, seq: Sequence, pos: int) -> None:
        self._pending_ops.append(KvOp(KvOpKind.TRIM, seq.slot, pos=pos))

    def _release(self, seq: Sequence) -> None:
        self._pending_ops.extend(self.slots.release(seq.slot, seq.num_computed, seq.params.cache_prompt))
