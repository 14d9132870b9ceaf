"""Continuous batching: which tokens of which sequences run in the next step.

As in vLLM v1 there is no prefill phase and no decode phase: each sequence's
num_computed catches up with its token_ids inside a per-step token budget.
Running sequences that are caught up go first (one token, plus any draft
tokens); then prompt chunks of sequences still prefilling; then newly
admitted ones, in priority order. Sequences join and leave between steps.
No numpy, no torch: `schedule()` returns a StepPlan of plain data and
`update()` applies the step's results (see interface.py).

BaseScheduler holds what both schedulers share (admission, the waiting
order, update and cancellation); SlotScheduler (slot_scheduler.py) keeps
the KV in llama.cpp's slots, PagedScheduler (paged_scheduler.py) in blocks.
"""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

from modeld.backends.errors import InvalidArgument, ResourceExhausted
from modeld.backends.generation.interface import SeqResult, StepPlan
from modeld.backends.generation.params import FinishReason, queue_rank
from modeld.backends.generation.sequence import Sequence, SeqStatus
from modeld.backends.generation.slots import common_prefix


@dataclass(frozen=True)
class Admission:
    """When waiting sequences may start (the batching strategy).

    continuous: at any step, joining the sequences already running.
    dynamic / static: a batch runs to completion before the next one forms;
    it starts once `batch` sequences wait or the oldest has waited
    `window_s`, and takes at most `batch`. Static batching is the same rule
    with a window long enough that, under load, only a full batch starts
    one; a lone request still starts when the window ends rather than never.
    """

    policy: str = "continuous"
    batch: int = 8
    window_s: float = 0.05


CONTINUOUS = Admission()


def admission_from(options) -> Admission:
    """The Admission a backend's options ([llamacpp] / [torch]) ask for."""
    return Admission(options.admission, options.admission_batch, options.admission_window_ms / 1000)


def _queue_key(seq: Sequence) -> tuple[int, int]:
    # seq ids count up as requests arrive, so within a level the queue is
    # FIFO, and a preempted sequence goes back ahead of later arrivals
    return queue_rank(seq.priority), seq.seq_id


class BaseScheduler(ABC):
    """Admission, the waiting order, and the one place progress changes.

    Subclasses set `config` (context_length, kv_capacity, max_waiting,
    max_step_tokens), implement `schedule`, and say how KV is trimmed and
    released.
    """

    def __init__(self, config) -> None:
        self.config = config
        self.waiting: list[Sequence] = []  # in (priority rank, arrival) order
        self.running: list[Sequence] = []
        self._held: dict[int, Sequence] = {}  # seq id -> every sequence waiting or running

    @property
    def kv_capacity(self) -> int:
        return self.config.kv_capacity

    # -- admission ---------------------------------------------------------------

    def check(self, seq: Sequence) -> None:
        """Refuse what could never fit."""
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
        self._enqueue(seq)
        self._held[seq.seq_id] = seq

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_queue_key)

    def _admission_quota(self) -> int:
        """How many waiting sequences this step may start."""
        admission = getattr(self.config, "admission", None) or CONTINUOUS
        if admission.policy == "continuous":
            return len(self.waiting)
        if self.running:
            return 0  # the running batch finishes first
        live = [s for s in self.waiting if not s.is_cancelled]
        if not live:
            return 0
        oldest = min(s.arrival_time for s in live)
        if len(live) >= admission.batch or time.monotonic() - oldest >= admission.window_s:
            return admission.batch
        return 0

    def _next_waiting(self) -> Sequence | None:
        """The next sequence to admit; cancelled ones wait for update() to
        drop them, and one whose prompt a running sequence is computing
        waits for it (see _waits_for_prefix)."""
        return next((s for s in self.waiting if not s.is_cancelled and not self._waits_for_prefix(s)), None)

    # the fewest shared prompt tokens worth waiting for (a subclass knows what
    # its prefix cache can share: a block, or a slot copy's break-even)
    min_shared_prefix = 16

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether seq should wait for a running sequence that is prefilling
        the same prompt prefix: once that one's KV is in, seq takes it from
        the prefix cache, so n requests with one prompt (an n > 1 fan-out,
        or a burst of the same system prompt) compute it once instead of n
        times. It costs seq nothing it would not have spent: prompt work is
        compute-bound, and computing the prompt twice at once takes as long
        as computing it once and then waiting. Continuous batching only: a
        batch policy admits its batch whole."""
        admission = getattr(self.config, "admission", None) or CONTINUOUS
        if admission.policy != "continuous" or not seq.params.cache_prompt or seq.num_output or not seq.prompt_ids:
            return False
        for other in self.running:
            if other.is_cancelled or not other.params.cache_prompt or not other.is_prefilling:
                continue
            if not self._shares_cache(seq, other):
                continue
            if other.prompt_ids[0] != seq.prompt_ids[0]:
                continue
            shared = min(common_prefix(other.prompt_ids, seq.prompt_ids), seq.num_prompt - 1)
            if shared >= self.min_shared_prefix and other.num_computed < shared:
                return True
        return False

    def _shares_cache(self, a: Sequence, b: Sequence) -> bool:
        """Whether a and b may share cached KV (not under different LoRA adapters)."""
        return True

    def _start(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    # -- results -----------------------------------------------------------------

    def update(self, plan: StepPlan, results: Mapping[int, SeqResult]) -> list[Sequence]:
        finished: list[Sequence] = []
        for work in plan.work:
            seq = self._held.get(work.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING or seq.is_cancelled:
                continue  # finished or cancelled meanwhile; cancelled ones are dropped below
            result = results.get(work.seq_id)
            if result is None:
                if work.num_logits == 0:  # a prompt chunk: its KV is in, no token yet
                    seq.num_computed += len(work.token_ids)
                    self._computed(seq)
                continue
            if result.new_token_ids:
                seq.token_ids.extend(result.new_token_ids)
                num_fed = len(work.token_ids) - work.num_drafts + result.num_accepted
                # a stop inside the accepted drafts leaves KV past the last token; it is not part of the text
                seq.num_computed = min(seq.num_computed + num_fed, len(seq.token_ids) - 1)
                if work.num_drafts:
                    seq.num_drafted += work.num_drafts
                    seq.num_accepted += result.num_accepted
            if result.finish_reason is not None:
                self._finish(seq, result.finish_reason)
                finished.append(seq)
                continue
            if result.num_accepted < work.num_drafts:
                self._trim(seq, seq.num_computed)
            self._computed(seq)
        for seq_id, result in results.items():  # failures of sequences the plan did not carry
            seq = self._held.get(seq_id)
            if seq is not None and result.finish_reason is not None:
                self._finish(seq, result.finish_reason)
                finished.append(seq)
        for seq in [s for s in self.running + self.waiting if s.is_cancelled]:
            self._finish(seq, FinishReason.CANCELLED)
            finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        del self._held[seq.seq_id]
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def _computed(self, seq: Sequence) -> None:
        """seq.num_computed grew."""

    @abstractmethod
    def _trim(self, seq: Sequence, pos: int) -> None:
        """Forget seq's KV from `pos` on (rejected draft tokens), before the next step."""

    @abstractmethod
    def _release(self, seq: Sequence) -> None:
        """A running sequence ended: free its KV (its first num_computed tokens may stay cached)."""
