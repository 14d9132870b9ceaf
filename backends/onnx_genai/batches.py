"""Which onnxruntime-genai batch a request joins, and when.

onnxruntime-genai 0.18's Engine batches continuously (sequences join and
leave every step, prefix caching) only for models built with PagedAttention,
which its model builder makes for CUDA or WebGPU in fp16/bf16 alone. A CPU
model runs on its static batch scheduler instead: the requests queued when a
batch starts run together, at most 4 of them (a constant in og's
StaticBatchScheduler), and a request that arrives later waits until every
sequence of that batch has finished, because the batch holds one contiguous
KV cache whose rows cannot be released one by one.

So the backend keeps several og Engines over one og Model (the weights are
shared) and steps each busy one once per step. A request that arrives while
batches are running starts a batch of its own at the next step instead of
waiting for them to drain; requests that arrive together share a batch.
Beyond max_running sequences, requests wait here in priority order.

Pure bookkeeping: no onnxruntime-genai, no numpy. A sequence's `slot` is
the index of its batch (its og Engine).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from modeld.backends.errors import InvalidArgument, ResourceExhausted
from modeld.backends.generation.params import queue_rank
from modeld.backends.generation.sequence import Sequence, SeqStatus

#: og's StaticBatchScheduler starts at most this many requests as one batch
OG_STATIC_BATCH_SIZE = 4


@dataclass(frozen=True)
class BatchConfig:
    max_running: int  # sequences in all batches at once; also the most batches
    context_length: int  # prompt + max_tokens of one request
    max_waiting: int = 256
    batch_size: int = OG_STATIC_BATCH_SIZE


@dataclass(eq=False)
class Batch:
    index: int
    sequences: list[Sequence] = field(default_factory=list)
    # set once the batch's engine has run: og admits no one else until it drains
    is_sealed: bool = False

    @property
    def is_idle(self) -> bool:
        return not self.sequences


def _queue_key(seq: Sequence) -> tuple[int, int]:
    return queue_rank(seq.priority), seq.seq_id  # within a level, first come first served


class BatchScheduler:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self.waiting: list[Sequence] = []  # in (priority rank, arrival) order
        self.running: list[Sequence] = []  # placed in a batch, their og turn not yet over
        self.batches: list[Batch] = []

    @property
    def kv_capacity(self) -> int:
        return self.config.max_running * self.config.context_length

    @property
    def num_used_cells(self) -> int:
        """Positions the running sequences hold (og sizes a batch's cache by its longest)."""
        return sum(len(seq.token_ids) for seq in self.running)

    def add(self, seq: Sequence) -> None:
        total = seq.num_prompt + seq.params.max_tokens
        if total > self.config.context_length:
            raise InvalidArgument(
                f"prompt of {seq.num_prompt} tokens plus max_tokens {seq.params.max_tokens} is {total}, "
                f"beyond the context window of {self.config.context_length} tokens; shorten the prompt or "
                "lower max_tokens")
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(
                f"{len(self.waiting)} requests are already waiting (max_waiting); retry later or on another node")
        bisect.insort(self.waiting, seq, key=_queue_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drop_cancelled_waiting(self) -> list[Sequence]:
        """Requests whose callers left before they reached a batch."""
        gone = [seq for seq in self.waiting if seq.is_cancelled]
        if gone:
            self.waiting = [seq for seq in self.waiting if not seq.is_cancelled]
        return gone

    def admit(self) -> list[Sequence]:
        """Place waiting requests, most urgent first: into a batch that has not
        run yet while it has room, else into an idle batch (a new one while
        there are fewer than max_running)."""
        placed = []
        while self.waiting and len(self.running) < self.config.max_running:
            batch = self._open_batch()
            if batch is None:
                break
            seq = self.waiting.pop(0)
            seq.slot, seq.status = batch.index, SeqStatus.RUNNING
            batch.sequences.append(seq)
            self.running.append(seq)
            placed.append(seq)
        return placed

    def _open_batch(self) -> Batch | None:
        filling = [b for b in self.batches if b.sequences and not b.is_sealed]
        for batch in filling:
            if len(batch.sequences) < self.config.batch_size:
                return batch
        idle = next((b for b in self.batches if b.is_idle), None)
        if idle is not None:
            idle.is_sealed = False
            return idle
        if len(self.batches) < self.config.max_running:
            self.batches.append(Batch(len(self.batches)))
            return self.batches[-1]
        return None

    def busy_batches(self) -> list[int]:
        return [b.index for b in self.batches if b.sequences]

    def seal(self, indices: list[int]) -> None:
        """These batches' engines ran: og lets no one else in until they drain."""
        for index in indices:
            self.batches[index].is_sealed = True

    def leave(self, seq: Sequence) -> None:
        """og ended seq's turn (finished, cancelled or failed): its row is done."""
        if seq.status is not SeqStatus.RUNNING:
            return
        seq.status = SeqStatus.FINISHED
        self.running.remove(seq)
        self.batches[seq.slot].sequences.remove(seq)
